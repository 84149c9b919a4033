"""The generated API reference, the registry's option specs, and the CLI's help built from them."""

import subprocess
import sys

import pytest

import pdecode
from infer import api_doc
from pdecode.decode import registry
from pdecode.errors import InputError


def test_api_md_is_current():
    """docs/api.md is what `python -m infer.api_doc` writes from today's code (rerun it after changing an option)."""
    assert api_doc.API_MD.read_text() == api_doc.render(), "docs/api.md is stale: run python -m infer.api_doc"


def test_api_md_lists_every_method_and_option():
    text = api_doc.render()
    for name, m in pdecode.methods().items():
        assert f"### {name}" in text
        for k, o in m.options.items():
            assert f"| `{k}` | {o.type.replace('|', chr(92) + '|')} |" in text
    for arg in ("max_new_tokens", "temperature", "draft", "**method_options"):
        assert f"| `{arg}` |" in text


def test_every_generate_argument_is_documented():
    import inspect

    documented = api_doc.documented_args(pdecode.generate)
    assert set(inspect.signature(pdecode.generate).parameters) == set(documented)
    assert all(documented.values())


def test_undocumented_argument_is_caught():
    def f(a, b=1):
        """Does things.

        Args:
            a: the a.
        """

    with pytest.raises(RuntimeError, match="documents no b"):
        api_doc._signature_table(f)


@pytest.mark.parametrize("method,opts,msg", [
    ("sd", {"gamma": 2.5}, "option 'gamma' of method 'sd' takes int"),
    ("sd", {"adaptive": 1}, "takes bool"),
    ("diffusion", {"rule": "fastest"}, "must be one of schedule, threshold, factor, eb"),
    ("diffusion", {"threshold": "high"}, "takes float"),
    ("dico", {"divide_commit": "all"}, "must be one of factor, seeds"),
])
def test_option_types_are_checked(method, opts, msg):
    with pytest.raises(InputError, match=msg):
        registry.resolve_options(registry.get(method), opts)


def test_numpy_scalars_and_tree_objects_are_accepted():
    import numpy as np

    from pdecode.decode import tree as tree_lib

    got = registry.resolve_options(registry.get("diffusion"), {"threshold": np.float32(0.5), "steps": np.int64(8)})
    assert type(got["threshold"]) is float and type(got["steps"]) is int  # static jit arguments hash alike
    t = tree_lib.resolve("binary-14")
    assert registry.resolve_options(registry.get("tree"), {"tree": t})["tree"] is t
    with pytest.raises(InputError, match="takes bool"):
        registry.resolve_options(registry.get("sd"), {"adaptive": "yes"})


def test_option_values_that_fit_pass():
    got = registry.resolve_options(registry.get("diffusion"), {"threshold": 1, "block_length": None, "cache": "dual"})
    assert got["threshold"] == 1 and got["cache"] == "dual" and got["rule"] is None  # (None: schedule; a block-diffusion model: its own)
    assert registry.resolve_options(registry.get("tree"), {"tree": [[0], [1]]})["tree"] == [[0], [1]]


def test_an_option_needs_a_spec():
    with pytest.raises(TypeError, match="must be a registry.Option"):
        registry.Method("bad", lambda *a: None, options={"k": 3})
    with pytest.raises(TypeError, match="unknown type"):
        registry.Method("bad", lambda *a: None, options={"k": registry.Option(3, "integer", "k")})


def test_generate_help_lists_methods_and_options():
    out = subprocess.run([sys.executable, "-m", "infer.cli", "generate", "--help"], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    for name, m in pdecode.methods().items():
        assert f"  {name} " in out.stdout and m.summary in out.stdout
        for k, o in m.options.items():
            assert f"{k}={api_doc._cli(o.default)}" in out.stdout


def test_train_help_works():
    out = subprocess.run([sys.executable, "-m", "infer.cli", "train", "--help"], capture_output=True, text=True)
    assert out.returncode == 0 and "dllm" in out.stdout and "zoo" in out.stdout
    out = subprocess.run([sys.executable, "-m", "infer.cli", "train"], capture_output=True, text=True)
    assert out.returncode == 2 and "say what to train" in out.stderr


ROOT = api_doc.API_MD.parent.parent


def _blocks(path, lang="python"):
    import re

    return re.findall(rf"```{lang}\n(.*?)```", path.read_text(), re.S)


def test_readme_is_short_and_starts_with_the_two_commands():
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= 165  # short: what was tried and every figure live in docs/
    first = _blocks(ROOT / "README.md", "bash")[0].splitlines()
    assert first[0].startswith("bash scripts/run.sh") and first[1].startswith("bash scripts/test.sh")
    assert text.index("```bash") < 40


def test_readme_zoo_quickstart_runs():
    """The README's first Python block (zoo models only) runs as written."""
    code = _blocks(ROOT / "README.md")[0]
    assert "pdecode.load(\"code-target\")" in code
    env: dict = {}
    exec(compile(code, "README quickstart", "exec"), env)
    assert env["out"].texts and env["out"].stats["new_tokens"] >= 1


def test_doc_links_resolve():
    import re

    files = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    missing = []
    for f in files:
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", f.read_text()):
            if "://" in target:
                continue
            if not (f.parent / target).exists():
                missing.append(f"{f.relative_to(ROOT)} -> {target}")
    assert not missing, missing


def test_extending_model_family_example_runs(tmp_path):
    """docs/extending.md's OLMo 2 family registers, matches transformers' logits and decodes sd = ar (its own
    asserts); unregistered afterwards, olmo2 is unsupported again."""
    from pdecode.errors import ConfigError
    from pdecode.model import family

    code = _blocks(ROOT / "docs" / "extending.md")[1]
    try:
        exec(compile(code, "docs/extending.md", "exec"), {"olmo_dir": tmp_path / "olmo2"})
    finally:
        family.FAMILIES.pop("olmo2", None)
    with pytest.raises(ConfigError, match="unsupported model_type 'olmo2'"):
        family.family_for_model_type("olmo2")


def test_extending_worked_example_runs():
    """docs/extending.md's drafter registers, decodes losslessly (its own assert) and shows in the API reference."""
    code = _blocks(ROOT / "docs" / "extending.md")[0]
    env: dict = {}
    try:
        exec(compile(code, "docs/extending.md", "exec"), env)
        out = env["out"]
        assert out.stats["method"] == "repeat" and out.stats["tokens_per_forward"] >= 1.0
        assert "### repeat" in api_doc.render() and "gamma=3" in api_doc.methods_help()
        with pytest.raises(InputError, match="takes int"):
            pdecode.generate(env["m"], ["x"], method="repeat", gamma=1.5)
    finally:
        registry.METHODS.pop("repeat", None)
    assert "### repeat" not in api_doc.render()
