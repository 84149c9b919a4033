"""`pdecode train heads --base DIR` and `pdecode train draft --base DIR`: heads and drafts for any base model, trained
from the user's text files, and the results decode (greedy speculative output equals AR)."""

import contextlib
import io
import json
import math
import re
import shlex
import warnings
from pathlib import Path
from types import SimpleNamespace

import jax
import numpy as np
import pytest

import pdecode
from infer import cli
from train import heads as train_heads

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
                   "--draft-vocab", "300", "--calibration-prompts", "0", "--work", str(tmp_path / "work")])
    assert rc in (0, None)
    meta = json.loads((out / "heads.json").read_text())
    assert meta["kind"] == "eagle" and meta["config"]["fuse_layers"] == [1, 3, 5]
    assert meta["config"]["draft_vocab"] == 300 and "tree_sizes" not in meta  # (--calibration-prompts 0)
    from pdecode.checkpoint.safetensors_io import read_safetensors

    stored = read_safetensors(out / "heads.safetensors")  # EAGLE-3's released layout of the vocabulary maps
    assert stored["d2t"].dtype == np.int64 and stored["t2d"].dtype == bool and stored["t2d"].sum() == 300
    assert stored["lm_head"].shape == (256, 300)
    ids = np.arange(300) + stored["d2t"]
    assert (np.diff(ids) > 0).all() and stored["t2d"][ids].all()
    assert Path(meta["base_model"]) == base_dir.resolve()
    info = json.loads((out / "train_info.json").read_text())
    assert info["steps"] == 3 and info["train_config"]["accum"] == 2 and "pdecode train heads" in info["command"]
    m = pdecode.load(out)  # the heads directory loads its base and attaches them
    assert "eagle" in m.extras
    got = pdecode.generate(m, PROMPTS, method="eagle", max_new_tokens=12)
    assert got.tokens == _ar(m)
    assert info["draft_vocab"] == 300 and 0.5 < info["draft_vocab_coverage"] <= 1


def test_train_medusa_heads_calibrates_a_tree(base_dir, tmp_path):
    out = tmp_path / "medusa"
    cli.main(["train", "heads", "--base", str(base_dir), "--kind", "medusa", "--data", *DATA, "--out", str(out),
              "--steps", "2", "--seq-len", "96", "--batch-size", "4", "--calibration-prompts", "16",
              "--work", str(tmp_path / "work")])
    meta = json.loads((out / "heads.json").read_text())
    assert meta["tree"] and meta["tree_calibration"]["nodes"] == 64
    m = pdecode.load(out)
    assert pdecode.generate(m, PROMPTS, method="medusa", max_new_tokens=12).tokens == _ar(m)


def test_train_exit_adapter_for_layerskip(base_dir, tmp_path, capsys):
    """--kind layerskip: an early-exit adapter after --exit-layer blocks of the frozen base; `method="layerskip"`
    drafts through it (greedy = ar); an exit layer the base does not have is one line."""
    out = tmp_path / "exit"
    cli.main(["train", "heads", "--base", str(base_dir), "--kind", "layerskip", "--exit-layer", "2", "--data", *DATA,
              "--out", str(out), "--steps", "2", "--seq-len", "64", "--batch-size", "4",
              "--work", str(tmp_path / "work")])
    meta = json.loads((out / "heads.json").read_text())
    assert meta["kind"] == "layerskip" and meta["config"] == {"exit_layer": 2, "hidden": 0}
    info = json.loads((out / "train_info.json").read_text())
    assert "--exit-layer 2" in info["command"] and 0 <= info["final_eval"]["depth1_agreement"] <= 1
    m = pdecode.load(out)
    got = pdecode.generate(m, PROMPTS, method="layerskip", gamma=3, max_new_tokens=12)
    assert got.tokens == _ar(m)
    capsys.readouterr()
    rc = cli.main(["train", "heads", "--base", str(base_dir), "--kind", "layerskip", "--exit-layer", "6", "--data",
                   *DATA, "--out", str(out), "--steps", "1"])
    assert rc == 2 and "--exit-layer must be in 1..5 (the base has 6 blocks), got 6" in capsys.readouterr().err


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
    assert "--seq-len 64 --batch-size 4" in info["command"]
    assert pdecode.generate(base, PROMPTS, method="sd", draft=d, max_new_tokens=12).tokens == _ar(base)


def test_train_draft_from_the_bases_layers(base_dir, tmp_path, capsys):
    out = tmp_path / "draft-from-base"
    cli.main(["train", "draft", "--base", str(base_dir), "--data", *DATA, "--out", str(out), "--steps", "2",
              "--seq-len", "64", "--batch-size", "4", "--from-base-layers", "auto", "--layers", "2",
              "--work", str(tmp_path / "work")])
    d, base = pdecode.load(out), pdecode.load(base_dir)
    assert d.cfg.num_layers == 2 and d.cfg.hidden_size == base.cfg.hidden_size == 256
    info = json.loads((out / "train_info.json").read_text())
    assert info["from_base_layers"] == [0, base.cfg.num_layers - 1] and "--from-base-layers auto" in info["command"]
    # started from the base: after two small steps its last layer is still close to the base's last one
    a = np.asarray(d.params["layers"]["w_up"][1], np.float32)
    b = np.asarray(base.params["layers"]["w_up"][-1], np.float32)
    assert np.abs(a - b).mean() < 0.2 * np.abs(b).mean()
    assert pdecode.generate(base, PROMPTS, method="sd", draft=d, max_new_tokens=12).tokens == _ar(base)
    for flags, msg in ((["--from-base-layers", "3,1"], "distinct increasing indices in 0..5"),
                       (["--from-base-layers", "auto", "--hidden", "64"], "keeps the base's width"),
                       (["--from-base-layers", "0,5", "--layers", "3"], "--layers 3 disagrees")):
        rc = cli.main(["train", "draft", "--base", str(base_dir), "--data", *DATA, "--out", str(tmp_path / "x"),
                       "--steps", "1", *flags])
        assert rc == 2 and msg in capsys.readouterr().err


def test_train_draft_sharing_the_bases_embedding(base_dir, tmp_path, capsys):
    """--share-embedding: the draft trains with the base's embedding frozen, saves none, and reads it from the base
    at load, refusing a base whose embedding is another one."""
    out = tmp_path / "draft-shared"
    cli.main(["train", "draft", "--base", str(base_dir), "--data", *DATA, "--out", str(out), "--steps", "2",
              "--seq-len", "64", "--batch-size", "4", "--from-base-layers", "auto", "--layers", "2",
              "--share-embedding", "--draft-vocab", "48", "--work", str(tmp_path / "work")])
    from pdecode.checkpoint.safetensors_io import read_checkpoint_dir

    stored = read_checkpoint_dir(out, {})
    assert "model.embed_tokens.weight" not in stored and any(".layers.1." in n for n in stored)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["pdecode_shared_tensors"]["from"] == str(Path(base_dir).resolve())
    info = json.loads((out / "train_info.json").read_text())
    assert info["shared_with_base"] == ["embed"] and info["draft_vocab"] == 48
    assert 0.3 < info["draft_vocab_coverage"] <= 1.0
    d, base = pdecode.load(out), pdecode.load(base_dir)
    ids = d.extras["draft_vocab"]  # --draft-vocab: the 48 most frequent ids of the training text, shipped with it
    assert len(ids) == 48 and np.all(np.diff(ids) > 0) and ids[-1] < base.cfg.vocab_size
    emb = np.asarray(d.params["embed"], np.float32)
    assert np.array_equal(emb, np.asarray(jax.numpy.asarray(base.params["embed"], d.params["embed"].dtype), np.float32))
    assert pdecode.generate(base, PROMPTS, method="sd", draft=d, max_new_tokens=12).tokens == _ar(base)
    # the base it names has another embedding (retrained, or another model of the same shape): refused by fingerprint
    other = tmp_path / "other-base"
    p = {**base.params, "embed": base.params["embed"] * 1.01}
    pdecode.save_hf(pdecode.Model(cfg=base.cfg, params=p, tokenizer=base.tokenizer), other)
    for frm, msg in ((str(other), "trained with the model.embed_tokens.weight of another"),
                     ("no-such-base", "which is not here")):
        moved = tmp_path / f"moved-{len(msg)}"
        moved.mkdir()
        for f in out.iterdir():
            (moved / f.name).write_bytes(f.read_bytes())
        cfg["pdecode_shared_tensors"]["from"] = frm
        (moved / "config.json").write_text(json.dumps(cfg))
        with pytest.raises(pdecode.CheckpointError, match=msg):
            pdecode.load(moved)
    rc = cli.main(["train", "draft", "--base", str(base_dir), "--data", *DATA, "--out", str(tmp_path / "x"),
                   "--steps", "1", "--share-embedding"])
    assert rc == 2 and "--share-embedding keeps the base's embedding" in capsys.readouterr().err


def test_train_draft_sharing_an_untied_bases_embedding_and_head(base_dir, tmp_path):
    """An untied base: --share-embedding shares its LM head too (neither is stored) and the draft still decodes."""
    base = pdecode.load(base_dir)
    untied = tmp_path / "untied"
    p = {**base.params, "lm_head": base.params["embed"].T}
    pdecode.save_hf(pdecode.Model(cfg=base.cfg.replace(tie_word_embeddings=False), params=p, tokenizer=base.tokenizer,
                                  path=Path(base_dir)), untied)
    out = tmp_path / "draft-untied"
    cli.main(["train", "draft", "--base", str(untied), "--data", *DATA, "--out", str(out), "--steps", "1",
              "--seq-len", "64", "--batch-size", "4", "--from-base-layers", "auto", "--layers", "2",
              "--share-embedding", "--work", str(tmp_path / "work")])
    from pdecode.checkpoint.safetensors_io import read_checkpoint_dir

    stored = read_checkpoint_dir(out, {})
    assert not {"model.embed_tokens.weight", "lm_head.weight"} & set(stored)
    assert json.loads((out / "train_info.json").read_text())["shared_with_base"] == ["embed", "lm_head"]
    d, b = pdecode.load(out), pdecode.load(untied)
    assert np.array_equal(np.asarray(d.params["lm_head"], np.float32),
                          np.asarray(jax.numpy.asarray(b.params["lm_head"], d.params["lm_head"].dtype), np.float32))
    assert pdecode.generate(b, PROMPTS, method="sd", draft=d, max_new_tokens=12).tokens == _ar(b)


@pytest.mark.parametrize("argv,msg", [
    (["heads", "--base", "code-target", "--data", "x"], "--base needs --out and --kind"),
    (["heads", "--base", "code-target", "--kind", "mtp", "--data", "x", "--out", "o", "--fsdp"], "--fsdp needs --mesh"),
    (["heads", "--base", "code-target", "--kind", "mtp", "--data", "x", "--out", "o", "--accum", "3"],
     "--accum 3 must divide --batch-size 16"),
    (["heads", "--base", "code-target", "--kind", "mtp", "--data", "x", "--out", "o", "--val-fraction", "1.5"],
     "--val-fraction must be between 0 and 1"),
    (["draft", "--data", "x", "--out", "o"], "--base DIR is required"),
    (["heads", "--base", "code-target", "--kind", "eagle3", "--data", "x", "--out", "o", "--draft-vocab", "many"],
     "--draft-vocab takes a number of tokens or auto"),
    (["heads", "--base", "code-target", "--kind", "eagle", "--data", "x", "--out", "o", "--draft-vocab", "100"],
     "--draft-vocab is EAGLE-3's reduced vocabulary: it needs --kind eagle3, not eagle"),
    (["heads", "--base", "code-target", "--kind", "eagle", "--data", "x", "--out", "o", "--exit-layer", "2"],
     "--exit-layer places the layerskip exit adapter: it needs --kind layerskip, not eagle"),
    (["heads", "--base", "code-target", "--kind", "medusa", "--data", "x", "--out", "o", "--calibration-prompts",
      "-1"], "--calibration-prompts must be >= 0"),
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


SMALL_LADDER = ((1, 1, 1), (2, 2, 2), (2, 3, 4))


@pytest.fixture(scope="module")
def small_corpus_run(tmp_path_factory):
    """`pdecode train heads` on ~8 KB of Python: its held-out 5% is fewer windows than one evaluation batch.
    Its argv, exit code, stderr, warnings raised, train_info.json and the corpus directory."""
    d = tmp_path_factory.mktemp("small")
    text = "".join(f.read_text() for f in sorted((ROOT / "pdecode" / "decode").glob("*.py")))
    (d / "corpus" / "pkg").mkdir(parents=True)
    (d / "corpus" / "pkg" / "a.py").write_text(text[:8000])
    argv = ["--base", "code-target", "--kind", "eagle", "--data", str(d / "corpus"), "--out", str(d / "heads"),
            "--steps", "2", "--seq-len", "64", "--batch-size", "4", "--lr", "0.002", "--work", str(d / "work"),
            "--calibration-prompts", "4"]
    err = io.StringIO()
    with warnings.catch_warnings(record=True) as caught, contextlib.redirect_stderr(err), \
            pytest.MonkeyPatch.context() as mp:
        warnings.simplefilter("always")
        mp.setattr(train_heads, "TREE_LADDER", SMALL_LADDER)  # (three small trees: a test compiles each)
        rc = cli.main(["train", "heads", *argv])
    return SimpleNamespace(argv=argv, rc=rc, err=err.getvalue(), warnings=[str(w.message) for w in caught],
                           info=json.loads((d / "heads" / "train_info.json").read_text()), corpus=d / "corpus")


def test_small_held_out_part_is_measured_and_named(small_corpus_run):
    rc, err, info = small_corpus_run.rc, small_corpus_run.err, small_corpus_run.info
    assert rc in (0, None)
    assert "nan" not in err.lower() and not any("empty slice" in w for w in small_corpus_run.warnings)
    values = [e["depth1_agreement"] for e in info["evals"]] + [info["final_eval"]["depth1_agreement"]]
    assert values and all(math.isfinite(v) and 0 <= v <= 1 for v in values)
    # one line before training says how small the held-out part is and what to pass
    warn = [line for line in err.splitlines() if "held-out part" in line]
    assert len(warn) == 1 and err.index(warn[0]) < err.index("eval at step")
    assert re.search(r"is \d+ tokens, [1-7] window\(s\) of 65 tokens", warn[0]), warn[0]
    assert "--seq-len" in warn[0] and "--val-fraction" in warn[0]


def test_eagle_heads_calibrate_their_tree_sizes(small_corpus_run, capsys, monkeypatch):
    """After training, EAGLE heads carry each tree size's measured tokens per forward (what total_tokens="auto"
    weighs); --calibrate-only redoes it for heads already trained, without training."""
    monkeypatch.setattr(train_heads, "TREE_LADDER", SMALL_LADDER)
    heads = Path(small_corpus_run.argv[small_corpus_run.argv.index("--out") + 1])
    cal = json.loads((heads / "heads.json").read_text())["tree_sizes"]
    assert [(t["tree_top_k"], t["depth"], t["total_tokens"]) for t in cal["trees"]] == list(SMALL_LADDER)
    assert all(1.0 <= t["tokens_per_forward"] <= 1 + t["depth"] for t in cal["trees"])
    assert "pdecode train heads" in cal["command"] and "training-stream prompts" in cal["data"]
    assert "tree sizes [3/3]" in small_corpus_run.err
    before = (heads / "heads.safetensors").read_bytes() if (heads / "heads.safetensors").exists() else None
    argv = list(small_corpus_run.argv)
    del argv[argv.index("--steps"): argv.index("--steps") + 2]
    rc = cli.main(["train", "heads", *argv, "--calibrate-only"])
    assert rc in (0, None)
    cal2 = json.loads((heads / "heads.json").read_text())["tree_sizes"]
    assert "--calibrate-only" in cal2["command"] and cal2["trees"] == cal["trees"]  # the same heads, data, prompts
    if before is not None:
        assert (heads / "heads.safetensors").read_bytes() == before  # nothing trained
    m = pdecode.load(heads)
    out = pdecode.generate(m, PROMPTS, method="eagle", total_tokens="auto", max_new_tokens=12)
    assert out.tokens == _ar(m) and out.stats["tree"]  # (the tests' flat verify cost: the biggest tree)
    argv[argv.index("--kind") + 1] = "mtp"
    capsys.readouterr()
    assert cli.main(["train", "heads", *argv, "--calibrate-only"]) == 2
    assert "mtp heads carry no tree calibration" in capsys.readouterr().err


def test_suggested_val_fraction_gives_a_full_evaluation_batch(small_corpus_run):
    from train import data
    from train.heads import EVAL_BATCH, held_out_note

    frac = float(re.search(r"--val-fraction ([0-9.]+)", small_corpus_run.err).group(1))
    tr, va = data.user_streams(pdecode.load("code-target").tokenizer, [small_corpus_run.corpus], 64, frac)
    assert (len(va) - 1) // 65 >= EVAL_BATCH and held_out_note(len(tr), len(va), 64, frac) is None


def test_train_info_records_the_command_as_given(small_corpus_run):
    command = small_corpus_run.info["command"]
    assert command == "pdecode train heads " + shlex.join(small_corpus_run.argv)
    assert "--seq-len 64 --batch-size 4 --lr 0.002" in command
    from train.heads import command_line  # what a run from Python (no argv) records: every option spelled out

    assert command_line("pdecode train heads", data=["a b", "c"], seq_len=128, fsdp=True, mesh=None, seed=0) == \
        "pdecode train heads --data 'a b' c --seq-len 128 --fsdp --seed 0"


def test_train_heads_help_names_the_command_and_shows_defaults(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["train", "heads", "--help"])
    out = capsys.readouterr().out
    assert e.value.code == 0 and out.startswith("usage: pdecode train heads [-h]")
    flat = " ".join(out.split())
    assert "--seq-len SEQ_LEN tokens per training window (default: 256)" in flat
    assert "--batch-size BATCH_SIZE windows per step (default: 16)" in flat
    assert "(default: 500 with --base" in flat
    from train.heads import build_parser

    for a in build_parser()._actions:  # every option with a default shows it
        if a.option_strings and a.default is not None and a.default is not False and a.default != "==SUPPRESS==":
            assert f"(default: {a.default})" in flat, a.option_strings


def test_train_draft_help_shows_defaults(capsys):
    with pytest.raises(SystemExit):
        cli.main(["train", "draft", "--help"])
    flat = " ".join(capsys.readouterr().out.split())
    assert flat.startswith("usage: pdecode train draft")
    for want in ("(default: 256)", "(default: 0.05)", "--steps STEPS training steps (default: 1000)"):
        assert want in flat
