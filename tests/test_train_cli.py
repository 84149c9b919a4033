"""`pdecode train heads --base DIR` and `pdecode train draft --base DIR`: heads and drafts for any base model, trained
from the user's text files, and the results decode (greedy speculative output equals AR)."""

import json
from pathlib import Path

import jax
import pytest

import pdecode
from infer import cli

ROOT = Path(__file__).resolve().parent.parent
DATA = [str(ROOT / "pdecode" / "decode"), str(ROOT / "pdecode" / "model")]  # Python text the base tokenizes
PROMPTS = ["def fib(n):", "import os\n", "class Stack:\n    def push(self, x):"]


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory):
    """code-target saved as a plain user directory (not found through the zoo)."""
    d = tmp_path_factory.mktemp("base")
    pdecode.save_hf(pdecode.load("code-target"), d)
    return d


def _ar(base, n=12):
    return pdecode.generate(base, PROMPTS, max_new_tokens=n).tokens


@pytest.mark.skipif(jax.device_count() < 4, reason="needs 4 forced CPU devices")
def test_train_heads_for_own_base_on_mesh(base_dir, tmp_path):
    out = tmp_path / "eagle3"
    rc = cli.main(["train", "heads", "--base", str(base_dir), "--kind", "eagle3", "--data", *DATA, "--out", str(out),
                   "--steps", "3", "--seq-len", "64", "--batch-size", "4", "--mesh", "2x2", "--fsdp", "--accum", "2",
                   "--work", str(tmp_path / "work")])
    assert rc in (0, None)
    meta = json.loads((out / "heads.json").read_text())
    assert meta["kind"] == "eagle" and meta["config"]["fuse_layers"] == [1, 3, 5]
    assert Path(meta["base_model"]) == base_dir.resolve()
    info = json.loads((out / "train_info.json").read_text())
    assert info["steps"] == 3 and info["train_config"]["accum"] == 2 and "pdecode train heads" in info["command"]
    m = pdecode.load(out)  # the heads directory loads its base and attaches them
    assert "eagle" in m.extras
    got = pdecode.generate(m, PROMPTS, method="eagle", max_new_tokens=12)
    assert got.tokens == _ar(m)


def test_train_medusa_heads_calibrates_a_tree(base_dir, tmp_path):
    out = tmp_path / "medusa"
    cli.main(["train", "heads", "--base", str(base_dir), "--kind", "medusa", "--data", *DATA, "--out", str(out),
              "--steps", "2", "--seq-len", "96", "--batch-size", "4", "--work", str(tmp_path / "work")])
    meta = json.loads((out / "heads.json").read_text())
    assert meta["tree"] and meta["tree_calibration"]["nodes"] == 64
    m = pdecode.load(out)
    assert pdecode.generate(m, PROMPTS, method="medusa", max_new_tokens=12).tokens == _ar(m)


def test_train_draft_for_own_base(base_dir, tmp_path):
    out = tmp_path / "draft"
    cli.main(["train", "draft", "--base", str(base_dir), "--data", *DATA, "--out", str(out), "--steps", "3",
              "--seq-len", "64", "--batch-size", "4", "--work", str(tmp_path / "work")])
    d = pdecode.load(out)
    base = pdecode.load(base_dir)
    assert d.cfg.num_layers == 2 and d.cfg.hidden_size == 128 and d.cfg.vocab_size == base.cfg.vocab_size
    assert d.tokenizer.fingerprint() == base.tokenizer.fingerprint()
    info = json.loads((out / "train_info.json").read_text())
    assert info["teacher"] == str(base_dir) and info["steps"] == 3
    assert pdecode.generate(base, PROMPTS, method="sd", draft=d, max_new_tokens=12).tokens == _ar(base)


@pytest.mark.parametrize("argv,msg", [
    (["heads", "--base", "code-target", "--data", "x"], "--base needs --out and --kind"),
    (["heads", "--base", "code-target", "--kind", "mtp", "--data", "x", "--out", "o", "--fsdp"], "--fsdp needs --mesh"),
    (["heads", "--base", "code-target", "--kind", "mtp", "--data", "x", "--out", "o", "--accum", "3"],
     "--accum 3 must divide --batch-size 16"),
    (["draft", "--data", "x", "--out", "o"], "--base DIR is required"),
])
def test_train_cli_rejects_bad_flags(argv, msg, capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["train", *argv])
    assert e.value.code == 2 and msg in capsys.readouterr().err


def test_train_heads_missing_data_is_one_line(tmp_path, capsys):
    rc = cli.main(["train", "heads", "--base", "code-target", "--kind", "mtp", "--data", str(tmp_path / "nope"),
                   "--out", str(tmp_path / "o"), "--steps", "1"])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and err == f"error: --data {tmp_path / 'nope'}: no such file or directory"
