"""The `pdecode` command: generate/convert/zoo, and one-line errors for bad input."""

import json
import os
import subprocess
import sys

import pytest

from infer.cli import main


def test_text_prompt_without_tokenizer_is_a_clear_error(hf_dirs, capsys):
    d = str(hf_dirs["llama"][0])  # the tiny random checkpoint ships no tokenizer.json
    rc = main(["generate", "--model", d, "--prompt", "hello", "--max-new-tokens", "4"])
    err = capsys.readouterr().err
    assert rc == 2 and err.startswith("error: ") and "tokenizer" in err and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("args,match", [
    (["--model", "/no/such/dir"], "no model '/no/such/dir'"),
    (["--method", "warp-drive"], "unknown method 'warp-drive'"),
    (["--temperature", "-0.5"], "temperature must be >= 0"),
    (["--top-p", "0"], "top_p must be in (0, 1]"),
    (["--max-new-tokens", "5000"], "exceeds the model's context"),
    (["--method", "sd"], "needs a draft model: add --draft"),
])
def test_bad_input_one_line_error(zoo_model_name, capsys, args, match):
    argv = ["generate", "--model", zoo_model_name, "--prompt", "def f():", "--max-new-tokens", "8"] + args
    rc = main(argv)
    err = capsys.readouterr().err.strip()
    assert rc == 2
    assert len(err.splitlines()) == 1 and err.startswith("error: ") and match in err


def test_zoo_generate_text_and_json(zoo_model_name, capsys):
    rc = main(["generate", "--model", zoo_model_name, "--prompt", "def add(a, b):", "--prompt", "import os\n",
               "--max-new-tokens", "12", "--json"])
    assert rc == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 2
    objs = [json.loads(x) for x in lines]
    assert objs[0]["prompt"] == "def add(a, b):" and isinstance(objs[0]["text"], str)
    assert 1 <= len(objs[0]["tokens"]) <= 12
    assert {"target_forwards", "new_tokens", "tokens_per_forward", "wall_s", "compile_s"} <= set(objs[0]["stats"])


def test_mixed_precision_flags(zoo_model_name, capsys):
    """--dtype bfloat16 --activation-dtype float32 runs sd with target and draft in mixed precision."""
    rc = main(["generate", "--model", zoo_model_name, "--draft", zoo_model_name, "--method", "sd", "--prompt",
               "def add(a, b):", "--max-new-tokens", "12", "--dtype", "bfloat16", "--activation-dtype", "float32",
               "--json"])
    assert rc == 0
    obj = json.loads(capsys.readouterr().out.strip().splitlines()[0])
    assert 1 <= len(obj["tokens"]) <= 12 and obj["stats"]["tokens_per_forward"] > 1.0


def test_convert_round_trip(zoo_model_name, tmp_path, capsys):
    import numpy as np

    import pdecode

    assert main(["convert", "--src", zoo_model_name, "--dst", str(tmp_path / "ob"), "--to", "orbax"]) == 0
    assert main(["convert", "--src", str(tmp_path / "ob"), "--dst", str(tmp_path / "hf"), "--to", "hf",
                 "--dtype", "bfloat16"]) == 0
    a, b = pdecode.load(zoo_model_name), pdecode.load(tmp_path / "hf")
    np.testing.assert_array_equal(np.asarray(a.params["embed"]), np.asarray(b.params["embed"]))
    assert b.tokenizer is not None


def test_console_script_exit_code(tmp_path):
    r = subprocess.run([sys.executable, "-m", "infer.cli", "generate", "--model", str(tmp_path / "missing"),
                        "--prompt", "x"], capture_output=True, text=True)
    assert r.returncode == 2
    assert r.stderr.strip().startswith("error: no model") and "Traceback" not in r.stderr


def test_generate_keeps_compiled_executables_on_disk(tmp_path):
    """`pdecode generate` keeps its executable on disk: the first run writes it (the cache is on before the compile),
    a second process with the same shapes finds it under the same key (no entry added or rewritten; JAX loads an
    entry it finds instead of compiling), and the tokens are the same."""
    cache = tmp_path / "xla"
    env = dict(os.environ, PDECODE_COMPILE_CACHE_DIR=str(cache))
    cmd = [sys.executable, "-m", "infer.cli", "generate", "--model", "code-target", "--prompt", "def f(x):",
           "--max-new-tokens", "8", "--json"]
    runs = []
    for _ in range(2):
        r = subprocess.run(cmd, capture_output=True, text=True, env=env)
        assert r.returncode == 0, r.stderr
        entries = sorted((p.name, p.stat().st_mtime_ns) for p in cache.iterdir())
        runs.append((json.loads(r.stdout.strip().splitlines()[-1])["tokens"], entries))
    (tokens1, entries1), (tokens2, entries2) = runs
    assert entries1, "the first run wrote no executable"
    assert entries2 == entries1, "the second run wrote a new executable: its cache key changed between processes"
    assert tokens2 == tokens1 and len(tokens1) == 8


def test_disk_cache_off(monkeypatch):
    import jax

    import pdecode

    if jax.config.jax_compilation_cache_dir:
        pytest.skip("JAX was given a compilation cache directory by the environment")
    monkeypatch.setenv("PDECODE_COMPILE_CACHE_DIR", "off")
    assert pdecode.enable_disk_cache() is None
    assert not jax.config.jax_compilation_cache_dir
