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
    return pdecode.load("code-target")


@pytest.fixture(scope="module")
def draft():
    return pdecode.load("code-draft")


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


def test_generates_python(target):
    out = pdecode.generate(target, ["def fibonacci(n):\n", "class Stack:\n    def __init__(self):\n"],
                           max_new_tokens=40)
    assert all(len(t) > 0 for t in out.texts)
    assert any(kw in out.texts[0] + out.texts[1] for kw in ("return", "self", "if ", "=")), out.texts
