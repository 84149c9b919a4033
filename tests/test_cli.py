"""The `pdecode` command: generate/convert/zoo, and one-line errors for bad input."""

import json
import os
import subprocess
import sys

import pytest

from infer.cli import main


@pytest.fixture(autouse=True)
def _jax_cache_dir_restored():
    """In-process `pdecode generate` (`enable_disk_cache`) sets JAX's global cache directory: put it back after each
    test so that no test sees another's."""
    import jax

    before = jax.config.jax_compilation_cache_dir
    yield
    jax.config.update("jax_compilation_cache_dir", before)


def test_text_prompt_without_tokenizer_is_a_clear_error(hf_dirs, capsys):
    d = str(hf_dirs["llama"][0])  # the tiny random checkpoint ships no tokenizer.json
    rc = main(["generate", "--model", d, "--prompt", "hello", "--max-new-tokens", "4"])
    err = capsys.readouterr().err
    assert rc == 2 and err.startswith("error: ") and "tokenizer" in err and len(err.strip().splitlines()) == 1


def test_option_values_parse_as_json_or_python_literals():
    from infer.cli import parse_options

    got = parse_options(["adaptive=False", "gamma_max=None", "tree='dynamic'", "tree2=[[0], [1]]", "t=0.9",
                         "a=true", "rule=threshold"])
    assert got == {"adaptive": False, "gamma_max": None, "tree": "dynamic", "tree2": [[0], [1]], "t": 0.9,
                   "a": True, "rule": "threshold"}


@pytest.mark.parametrize("args,match", [
    (["--model", "/no/such/dir"], "no model '/no/such/dir'"),
    (["--method", "warp-drive"], "unknown method 'warp-drive'"),
    (["--temperature", "-0.5"], "temperature must be a number >= 0"),
    (["--top-p", "0"], "top_p must be in (0, 1]"),
    (["--max-new-tokens", "5000"], "exceeds the model's context"),
    (["--method", "sd"], "needs a draft model: add --draft"),
    (["--mesh", "3x5"], "--mesh 3x5 needs 15 devices, "),
    (["--mesh", "abc"], "--mesh takes DATAxMODEL"),
    (["--mesh", "2x0"], "--mesh takes DATAxMODEL"),
    (["-o", "gamma"], "-o/--option takes key=value, got 'gamma'"),
    (["-o", "max_new_token=3"], "unknown option 'max_new_token' for method 'ar': did you mean max_new_tokens?"),
    (["-o", "zzz=1"], "unknown option 'zzz' for method 'ar'; it takes: "),
    (["-o", "temperature=0.5"], "temperature is not a method option: use --temperature"),
    (["--prompt-file", "/no/such/prompt.txt"], "--prompt-file /no/such/prompt.txt: no such file"),
    (["--prompts-jsonl", "/no/such/prompts.jsonl"], "--prompts-jsonl /no/such/prompts.jsonl: no such file"),
    (["--compare", "warp-drive"], "unknown method 'warp-drive'"),
    (["--compare", "sd"], "--compare sd: method 'sd' needs a draft model: add --draft"),
    (["--compare", "lookup:gamma=2.5"], "option 'gamma' of method 'lookup' takes int"),
    (["--compare", "ar:dtype=bfloat16"], "drop dtype keys"),
    (["--mesh", "1x\u00b2"], "--mesh takes DATAxMODEL"),
    (["--method", "eagel"], "unknown method 'eagel'; did you mean eagle?"),
    (["--model", "code-targt"], "did you mean code-target?"),
    (["--method", "eagle"], "(--model code-target-eagle: it loads its base model too)"),
    (["--model", "code-dllm"], "'code-dllm' is a masked-diffusion (bidirectional) model: use a masked method"),
    (["--method", "sd", "--draft", "code-dllm"], "needs an autoregressive draft model such as code-draft"),
    (["--method", "diffusion_draft", "--draft", "code-draft"], "needs a masked-diffusion draft model"),
    (["--plot", "x.png"], "method 'ar' has neither: drop --plot"),
    (["--method", "oneshot", "--model", "code-dllm", "--plot", "x.png"], "method 'oneshot' has neither"),
])

def test_bad_input_one_line_error(zoo_model_name, capsys, args, match):
    argv = ["generate", "--model", zoo_model_name, "--prompt", "def f():", "--max-new-tokens", "8"] + args
    rc = main(argv)
    err = capsys.readouterr().err.strip()
    assert rc == 2
    assert len(err.splitlines()) == 1 and err.startswith("error: ") and match in err


@pytest.mark.parametrize("argv,want", [
    (["generate", "--prompt", "x", "--temprature", "0.5"], "unknown flag --temprature: did you mean --temperature?"),
    (["bench", "--methds", "ar"], "unknown flag --methds: did you mean --methods?"),
    (["serve", "--slotz", "4"], "unknown flag --slotz: did you mean --slots?"),
    (["plan", "--config", "x", "--devices", "1", "--metod", "sd"], "unknown flag --metod: did you mean --method?"),
    (["convert", "--src", "a", "--dst", "b", "--to", "hf", "--dtpye", "float32"], "did you mean --dtype?"),
    (["train", "heads", "--bse", "x"], "unknown flag --bse: did you mean --base?"),
    (["train", "draft", "--stesp", "3"], "unknown flag --stesp: did you mean --steps?"),
    (["generate", "--prompt", "x", "stray"], "unexpected argument 'stray'"),
])
def test_flag_typos_suggest_the_closest_flag(capsys, argv, want):
    """Every subcommand (and each trainer) answers an unknown flag with the closest one it knows, in one line."""
    with pytest.raises(SystemExit) as e:
        main(argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and want in err[-1], err


def test_compare_checked_before_loading(monkeypatch, capsys):
    """A wrong --compare method, option or heads model is named before any model loads."""
    import pdecode

    def no_load(*a, **k):
        raise AssertionError("a model was loaded before --compare was checked")

    monkeypatch.setattr(pdecode, "load", no_load)
    for spec, want in [("eagle@code-target-eagl", "did you mean code-target-eagle?"), ("sdd", "did you mean sd?"),
                       ("lookup:ngram_mx=3", "unknown option 'ngram_mx'")]:
        assert main(["generate", "--prompt", "x", "--compare", spec]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and want in err, err


def test_no_prompt_and_bad_jsonl_one_line_error(zoo_model_name, tmp_path, capsys):
    bad = tmp_path / "p.jsonl"
    bad.write_text('"ok"\n{"text": "no prompt key"}\n')
    for extra, match in [([], "give at least one --prompt, --prompt-file or --prompts-jsonl"),
                         (["--prompts-jsonl", str(bad)], f"{bad}:2 is not a JSON string")]:
        rc = main(["generate", "--model", zoo_model_name, "--max-new-tokens", "4"] + extra)
        err = capsys.readouterr().err.strip()
        assert rc == 2 and len(err.splitlines()) == 1 and err.startswith("error: ") and match in err, err


def test_misspelt_generate_keyword_names_the_keyword(zoo_model_name):
    import pdecode

    m = pdecode.load(zoo_model_name, dtype="float32")
    with pytest.raises(pdecode.InputError, match=r"unknown option 'max_new_token' for method 'ar': did you mean "
                                                 r"max_new_tokens\?"):
        pdecode.generate(m, ["x"], max_new_token=8)
    with pytest.raises(pdecode.InputError, match=r"did you mean gamma\?"):  # the method's own options count too
        pdecode.generate(m, ["x"], method="sd", draft=m, gama=3)
    with pytest.raises(pdecode.InputError, match=r"unknown option 'qqq' for method 'ar'; it takes: .*cache_phases"):
        pdecode.generate(m, ["x"], qqq=1)


def test_draft_with_another_tokenizer_of_the_same_size_is_refused(zoo_model_name, tmp_path):
    import shutil

    import pdecode

    d = tmp_path / "draft"
    shutil.copytree(pdecode.zoo_dir() / "code-draft", d)
    tok = json.loads((d / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    vocab["a"], vocab["b"] = vocab["b"], vocab["a"]  # same size, two ids swapped
    (d / "tokenizer.json").write_text(json.dumps(tok))
    target, draft = pdecode.load(zoo_model_name, dtype="float32"), pdecode.load(d)
    assert draft.tokenizer.vocab_size == target.tokenizer.vocab_size and draft.cfg.vocab_size == target.cfg.vocab_size
    with pytest.raises(pdecode.ConfigError, match="has another tokenizer than the target.*2 tokens differ"):
        pdecode.generate(target, ["def f():"], method="sd", draft=draft, max_new_tokens=4)
    ok = pdecode.load("code-draft", dtype="float32")  # the shipped draft shares the target's tokenizer
    assert len(pdecode.generate(target, ["def f():"], method="sd", draft=ok, max_new_tokens=4).tokens[0]) >= 1


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


def test_compare_runs_the_same_prompts_through_each_method(zoo_model_name, capsys):
    """The main job's shape: AR, then sd and lookup on the same prompts; at greedy both must give AR's tokens."""
    rc = main(["generate", "--model", zoo_model_name, "--draft", "code-draft", "--prompt", "import os\n",
               "--prompt", "def f(x):", "--max-new-tokens", "16", "--compare", "sd:gamma=3", "lookup"])
    out = capsys.readouterr().out
    assert rc == 0
    table = out[out.index("method "):].splitlines()
    assert table[1].split()[0] == "ar" and table[1].endswith("(shown above)")
    assert table[2].split()[0] == "sd:gamma=3" and table[2].endswith("identical to ar")
    assert table[3].split()[0] == "lookup" and table[3].endswith("identical to ar")
    assert float(table[2].split()[1]) > 1.0  # tokens per forward of speculative decoding
    rc = main(["generate", "--model", zoo_model_name, "--prompt", "import os\n", "--max-new-tokens", "8",
               "--compare", "lookup", "--json"])
    rows = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["compare"]
    assert [r["method"] for r in rows] == ["ar", "lookup"] and rows[1]["same_tokens"] is True


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
    a, b = pdecode.load(zoo_model_name, dtype="float32"), pdecode.load(tmp_path / "hf")
    np.testing.assert_array_equal(np.asarray(a.params["embed"]), np.asarray(b.params["embed"]))
    assert b.tokenizer is not None


def test_convert_writes_the_heads(tmp_path, capsys):
    """A model with heads attached converts with its heads: loading the destination gives the same heads."""
    import jax
    import numpy as np

    import pdecode

    assert main(["convert", "--src", "code-target-eagle", "--dst", str(tmp_path / "hf"), "--to", "hf"]) == 0
    assert "with its eagle heads" in capsys.readouterr().err
    a, b = pdecode.load("code-target-eagle", dtype="float32"), pdecode.load(tmp_path / "hf")
    assert b.extras["eagle"][0] == a.extras["eagle"][0]
    for x, y in zip(jax.tree.leaves(a.extras["eagle"][1]), jax.tree.leaves(b.extras["eagle"][1])):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    np.testing.assert_array_equal(np.asarray(a.params["embed"]), np.asarray(b.params["embed"]))


def test_convert_refuses_a_non_empty_destination_without_force(zoo_model_name, tmp_path, capsys):
    dst = tmp_path / "out"
    dst.mkdir()
    (dst / "notes.txt").write_text("keep me")
    rc = main(["convert", "--src", zoo_model_name, "--dst", str(dst), "--to", "hf"])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and len(err.splitlines()) == 1 and err.startswith("error: ") and "add --force" in err
    assert sorted(p.name for p in dst.iterdir()) == ["notes.txt"]
    assert main(["convert", "--src", zoo_model_name, "--dst", str(dst), "--to", "hf", "--force"]) == 0
    assert (dst / "config.json").exists() and (dst / "notes.txt").read_text() == "keep me"


def test_commit_order_plot_explains_grey_and_has_integer_rows(tmp_path):
    import matplotlib.pyplot as plt

    from infer.plots import NOT_DECODED, commit_order_figure, commit_order_plot

    steps = [[0, 2, 1, 3, -1, -1], [1, 0, 2, -1, -1, -1], [0, 1, 1, 2, 3, 4]]
    fig = commit_order_figure(steps, title="t")
    try:
        fig.canvas.draw()
        ax = fig.axes[0]
        assert [t.get_text() for t in ax.get_yticklabels()] == ["0", "1", "2"]
        assert all(float(v).is_integer() for v in ax.get_yticks())
        texts = [t.get_text() for leg in fig.legends for t in leg.get_texts()]
        assert texts == [NOT_DECODED] and "never decoded" in NOT_DECODED
        assert fig.axes[1].get_ylabel() == "decoding step"  # the colorbar
    finally:
        plt.close(fig)
    out = commit_order_plot(steps, tmp_path / "sub" / "co.png")
    assert out.exists() and out.read_bytes()[:4] == b"\x89PNG"


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
    env.pop("JAX_COMPILATION_CACHE_DIR", None)  # (the test run's own shared cache, scripts/test.sh)
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
    """Independent of test order: it starts with JAX's cache directory unset (`_jax_cache_dir_restored` puts back
    what was there)."""
    import jax

    import pdecode

    jax.config.update("jax_compilation_cache_dir", None)  # whatever an earlier test or the environment set
    monkeypatch.setenv("PDECODE_COMPILE_CACHE_DIR", "off")
    assert pdecode.enable_disk_cache() is None
    assert not jax.config.jax_compilation_cache_dir


def test_truncated_checkpoint_is_one_line_naming_the_file(tmp_path, capsys):
    import shutil

    import pdecode
    from pdecode.errors import CheckpointError

    d = tmp_path / "cut"
    shutil.copytree(pdecode.zoo_dir() / "code-draft", d)
    f = d / "model.safetensors"
    os.truncate(f, f.stat().st_size // 2)
    with pytest.raises(CheckpointError, match=f"{f} is truncated: tensor .* ends at byte"):
        pdecode.load(d)
    rc = main(["generate", "--model", str(d), "--prompt", "x", "--max-new-tokens", "2"])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and len(err.splitlines()) == 1 and str(f) in err and "copy or download it again" in err


def test_serve_speculates_by_cost_by_default():
    """`pdecode serve` runs draft-and-verify methods with speculation auto unless told: on one process, or on several
    with a cost ratio given (every process then decides alike); on several without one, always; auto asked for on
    several without --spec-cost is refused."""
    from infer.serve import speculation_mode
    from pdecode.errors import InputError

    assert speculation_mode(None, False, None) == "auto" and speculation_mode(None, True, 3.0) == "auto"
    assert speculation_mode(None, True, None) == "always" and speculation_mode("always", False, None) == "always"
    assert speculation_mode("auto", True, 2.5) == "auto"
    with pytest.raises(InputError, match="needs --spec-cost"):
        speculation_mode("auto", True, None)


def test_cli_errors_speak_in_flags(capsys):
    """The library's advice in Python terms (draft=pdecode.load(...)) becomes flags on the command line."""
    rc = main(["serve", "--model", "code-target", "--method", "sd"])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and "add --draft" in err and "pdecode.load" not in err
    rc = main(["serve", "--model", "code-target", "--method", "lookup", "--spec-cost", "0"])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and len(err.splitlines()) == 1 and "--spec-cost must be a number > 0" in err
    rc = main(["generate", "--model", "code-target", "--prompt", "x", "--max-new-tokens", "2", "--compare", "eagle"])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and err.startswith("error: --compare eagle: ") and "eagle@code-target-eagle" in err
    assert "pdecode.load" not in err


def test_plot_draws_the_acceptance_of_a_draft_and_verify_method(tmp_path, capsys):
    png = tmp_path / "acc.png"
    rc = main(["generate", "--model", "code-target", "--method", "lookup", "--prompt", "import os\nimport os\n",
               "--max-new-tokens", "12", "--plot", str(png)])
    assert rc == 0 and png.read_bytes()[:4] == b"\x89PNG" and f"wrote {png}" in capsys.readouterr().err


def test_acceptance_plot_axes(tmp_path):
    import matplotlib.image as mpimg

    from infer.plots import acceptance_plot

    out = acceptance_plot([4, 2, 3, 1, 2], [0.67, 0.75, 0.5, None], tmp_path / "a.png", title="t")
    assert mpimg.imread(out).shape[0] > 100


def test_zoo_says_what_each_model_serves(capsys):
    """`pdecode zoo` has a line per shipped model saying which methods it serves; every method it names exists and
    docs/zoo.md's table says the same."""
    import re
    from pathlib import Path

    import pdecode
    from infer.cli import ZOO_SERVES, zoo_table

    assert main(["zoo"]) == 0
    out = capsys.readouterr().out
    rows = zoo_table()
    assert [r[0] for r in rows] == pdecode.zoo_names() and set(ZOO_SERVES) == set(pdecode.zoo_names())
    methods = set(pdecode.methods())
    for name, _, _, serves in rows:
        line = next(x for x in out.splitlines() if x.startswith(name + " "))
        assert line.endswith(serves)
        named = {w for w in re.findall(r"[a-z_]+", serves.split("(")[0]) if w in methods}
        assert named, f"{name}: names no method"
    doc = (Path(__file__).resolve().parent.parent / "docs" / "zoo.md").read_text()
    for name, _, _, serves in rows:
        assert f"| `{name}` | {serves} |" in doc


def test_edit_output_is_shown_as_a_diff_of_the_input(capsys):
    prompt = "def add(a, b):\n    retrun a + + b\n"
    rc = main(["generate", "--model", "code-edit", "--method", "edit", "-o", "context=8", "--prompt", prompt])
    out = capsys.readouterr().out
    assert rc == 0 and not out.startswith(prompt + prompt[:3])  # not the prompt with the result glued on
    if out.startswith("(no edits)"):
        assert out.startswith("(no edits)\n" + prompt)
    else:
        assert out.startswith("--- input\n+++ edited\n@@ ")
        edited = out.split("=" * 20 + " edited text " + "=" * 20 + "\n")[1].split("\n" + "-" * 60)[0]
        assert edited != prompt and edited.startswith("def add(a, b):")  # context=8 keeps the first 8 tokens


def test_compare_verdicts():
    from infer.cli import _verdict

    assert _verdict({"same_tokens": None}, "ar") == "(shown above)"
    assert _verdict({"same_tokens": True}, "ar") == "identical to ar"
    assert _verdict({"same_tokens": False}, "sd") == "differs from sd"  # not against greedy AR: no tie check
    assert _verdict({"same_tokens": False, "all_ties": True}, "ar") == "identical to ar up to a near-tie"
    assert _verdict({"same_tokens": False, "all_ties": False}, "ar") == "DIFFERS from ar at a non-tie"


def test_compare_names_each_divergence_and_whether_it_is_a_tie(capsys):
    """The issue's case: code-target-layerskip in its stored bfloat16 leaves AR at a float32 near-tie; --compare says
    where, with the margin, instead of a bare "differs"."""
    rc = main(["generate", "--model", "code-target-layerskip", "--compare", "layerskip", "--prompt", "def fib(n):",
               "--max-new-tokens", "32"])
    out = capsys.readouterr().out
    assert rc == 0
    row = next(x for x in out.splitlines() if x.startswith("layerskip "))
    if row.endswith("identical to ar"):
        pytest.skip("no divergence on this machine's rounding")
    assert row.endswith("identical to ar up to a near-tie")
    assert "layerskip differs from ar at row 0, new token " in out and ": a near-tie (the two tokens' float32" in out
