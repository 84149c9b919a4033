"""`pdecode.attach_heads` on released head checkpoint directories (Medusa, EAGLE-1/2, DeepSeek-V3 MTP layouts),
written here from random weights: the heads land under the right kind, hold the file's weights, and decode
losslessly (greedy output identical to the target's AR output)."""

import json

import jax
import numpy as np
import pytest

import pdecode
from pdecode.checkpoint import heads_io
from pdecode.checkpoint.hf import block_rules, params_to_tensors
from pdecode.checkpoint.safetensors_io import write_safetensors
from pdecode.model import heads as H
from pdecode.model.transformer import init_from_specs
from tests.helpers import make_hf_model

PROMPTS = [[5, 6, 7, 8, 9, 5, 6, 7], [11, 12, 13], list(range(20, 40))]


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    d = tmp_path_factory.mktemp("base")
    make_hf_model("llama", d, seed=0, num_hidden_layers=3)
    return pdecode.load(d)


@pytest.fixture(scope="module")
def ar(target):
    return pdecode.generate(target, PROMPTS, max_new_tokens=12, stop_at_eos=False).tokens


def test_released_medusa(target, ar, tmp_path):
    rng = np.random.default_rng(0)
    d, v = target.cfg.hidden_size, target.cfg.vocab_size
    t = {}
    for h in range(3):
        t[f"{h}.0.linear.weight"] = (rng.normal(size=(d, d)) * 0.05).astype(np.float32)
        t[f"{h}.0.linear.bias"] = (rng.normal(size=(d,)) * 0.05).astype(np.float32)
        t[f"{h}.1.weight"] = (rng.normal(size=(v, d)) * 0.05).astype(np.float32)
    write_safetensors(tmp_path / "medusa_lm_head.safetensors", t)
    (tmp_path / "config.json").write_text(json.dumps({"medusa_num_heads": 3, "medusa_num_layers": 1}))
    m = pdecode.attach_heads(target, tmp_path)
    mcfg, params = m.extras["medusa"]
    assert (mcfg.num_heads, mcfg.num_layers, mcfg.own_head) == (3, 1, True)
    np.testing.assert_array_equal(np.asarray(params["lm_head"][2]), t["2.1.weight"].T)
    assert pdecode.generate(m, PROMPTS, method="medusa", max_new_tokens=12, stop_at_eos=False).tokens == ar
    (tmp_path / "config.json").unlink()  # without the config the shape comes from the tensor names
    assert pdecode.attach_heads(target, tmp_path).extras["medusa"][0].num_heads == 3


def test_released_eagle(target, ar, tmp_path):
    ecfg = H.EagleConfig(fc_bias=True)
    p = jax.tree.map(np.asarray, init_from_specs(ecfg.specs(target.cfg), jax.random.PRNGKey(1), std=0.05))
    t = {k: v for k, v in params_to_tensors({"layers": p["layers"]}, block_rules("layers.{i}.")).items()
         if "input_layernorm" not in k}  # EAGLE-1's layer 0 has no input norm
    t["fc.weight"], t["fc.bias"] = p["fc"].T, p["fc_b"]
    write_safetensors(tmp_path / "model.safetensors", t)
    m = pdecode.attach_heads(target, tmp_path)
    got_cfg, got = m.extras["eagle"]
    assert got_cfg.fc_bias
    np.testing.assert_array_equal(np.asarray(got["fc"]), p["fc"])
    out = pdecode.generate(m, PROMPTS, method="eagle", max_new_tokens=12, stop_at_eos=False, tree_top_k=2, depth=3,
                           total_tokens=5)
    assert out.tokens == ar


def test_released_deepseek_mtp_layer(target, ar, tmp_path):
    mcfg = H.MTPConfig(num_modules=1, emb_first=True)
    p = jax.tree.map(np.asarray, init_from_specs(mcfg.specs(target.cfg), jax.random.PRNGKey(2), std=0.05))
    write_safetensors(tmp_path / "model.safetensors", heads_io.export_deepseek_mtp(mcfg, p, target.cfg))
    m = pdecode.attach_heads(target, tmp_path)
    got_cfg, got = m.extras["mtp"]
    assert got_cfg.emb_first and got_cfg.kind == "sequential"
    np.testing.assert_array_equal(np.asarray(got["modules"][0]["proj"]), p["modules"][0]["proj"])
    assert pdecode.generate(m, PROMPTS, method="mtp", max_new_tokens=12, stop_at_eos=False).tokens == ar


def test_not_a_head_checkpoint(target, tmp_path):
    with pytest.raises(pdecode.CheckpointError, match="no heads.json and no safetensors"):
        pdecode.attach_heads(target, tmp_path)
    write_safetensors(tmp_path / "model.safetensors", {"x": np.zeros(3, np.float32)})
    with pytest.raises(pdecode.CheckpointError, match="not a head checkpoint pdecode knows"):
        pdecode.attach_heads(target, tmp_path)


def test_released_heads_for_another_model_are_refused(target, tmp_path):
    rng = np.random.default_rng(0)
    d, v = target.cfg.hidden_size + 8, target.cfg.vocab_size
    t = {"0.0.linear.weight": rng.normal(size=(d, d)).astype(np.float32),
         "0.0.linear.bias": np.zeros(d, np.float32), "0.1.weight": rng.normal(size=(v, d)).astype(np.float32)}
    write_safetensors(tmp_path / "medusa_lm_head.safetensors", t)
    with pytest.raises(pdecode.CheckpointError, match="heads trained for another model"):
        pdecode.attach_heads(target, tmp_path)
    e3 = tmp_path / "e3"
    e3.mkdir()
    write_safetensors(e3 / "model.safetensors", {"fc.weight": np.zeros((4, 12), np.float32),
                                                 "d2t": np.zeros(4, np.int64)})
    with pytest.raises(pdecode.CheckpointError, match="EAGLE-3 release"):
        pdecode.attach_heads(target, e3)
