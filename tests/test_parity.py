"""Checkpoint loaders against the reference implementation (transformers, CPU torch): logits and greedy output."""

import json

import numpy as np
import pytest
import torch

import pdecode
from pdecode.checkpoint.hf import load_hf
from tests.helpers import VOCAB, assert_logits_close, make_hf_model

FAMILIES = ["llama", "llama3", "qwen2", "qwen3", "mistral"]


def _ids(b, t, seed=0):
    return np.random.default_rng(seed).integers(3, VOCAB, size=(b, t))


@pytest.mark.parametrize("fam", FAMILIES)
def test_logits_match_transformers(hf_dirs, fam):
    d, ref_model = hf_dirs[fam]
    m = pdecode.load(d)
    ids = _ids(2, 40, seed=1)
    with torch.no_grad():
        ref = ref_model(torch.tensor(ids)).logits.numpy()
    ours = np.asarray(pdecode.forward_logits(m, ids))
    assert ours.shape == ref.shape == (2, 40, VOCAB)
    assert_logits_close(ours, ref)


def test_families_switch_the_right_features(hf_dirs):
    cfgs = {f: pdecode.load(hf_dirs[f][0]).cfg for f in FAMILIES}
    assert cfgs["qwen2"].attention_bias and not cfgs["llama"].attention_bias
    assert cfgs["qwen3"].qk_norm and cfgs["qwen3"].head_dim == 32
    assert cfgs["qwen2"].tie_word_embeddings and not cfgs["llama"].tie_word_embeddings
    assert cfgs["llama3"].rope_scaling_dict["rope_type"] == "llama3"
    assert cfgs["mistral"].sliding_window == 24
    assert all(c.num_kv_heads == 2 and c.num_heads == 4 for c in cfgs.values())  # GQA


@pytest.mark.parametrize("fam", FAMILIES)
def test_greedy_generation_matches_transformers(hf_dirs, fam):
    d, ref_model = hf_dirs[fam]
    m = pdecode.load(d)
    prompts = [list(_ids(1, n, seed=n)[0]) for n in (5, 17, 40)]
    out = pdecode.generate(m, prompts, max_new_tokens=32, temperature=0.0, stop_at_eos=False)
    for p, toks in zip(prompts, out.tokens):
        with torch.no_grad():
            ref = ref_model.generate(torch.tensor([p]), max_new_tokens=32, do_sample=False, eos_token_id=None,
                                     pad_token_id=0, attention_mask=torch.ones(1, len(p), dtype=torch.long))
        assert toks == ref[0, len(p):].tolist()


def test_sharded_safetensors_with_index(tmp_path):
    ref = make_hf_model("llama", tmp_path, seed=3)
    d2 = tmp_path / "sharded"
    ref.save_pretrained(d2, max_shard_size="100KB")
    assert (d2 / "model.safetensors.index.json").exists()
    assert len(list(d2.glob("*.safetensors"))) > 1
    m = pdecode.load(d2)
    ids = _ids(1, 12)
    with torch.no_grad():
        expect = ref(torch.tensor(ids)).logits.numpy()
    assert_logits_close(pdecode.forward_logits(m, ids), expect)


@pytest.mark.parametrize("fam", ["llama3", "qwen2", "qwen3"])
def test_save_hf_round_trip_through_transformers(hf_dirs, tmp_path, fam):
    import transformers as tf

    m = pdecode.load(hf_dirs[fam][0])
    out = pdecode.save_hf(m, tmp_path / "export", dtype="float32")
    back = tf.AutoModelForCausalLM.from_pretrained(out).eval()
    ids = _ids(2, 20, seed=7)
    with torch.no_grad():
        theirs = back(torch.tensor(ids)).logits.numpy()
    assert_logits_close(pdecode.forward_logits(m, ids), theirs)
    cfg2, _ = load_hf(out)
    assert cfg2 == m.cfg.replace(dtype="float32")


def test_bf16_inference(hf_dirs, tmp_path):
    d, ref_model = hf_dirs["llama"]
    m16 = pdecode.load(d, dtype="bfloat16")
    assert str(m16.dtype) == "bfloat16"
    ids = _ids(2, 24, seed=5)
    with torch.no_grad():
        ref = ref_model(torch.tensor(ids)).logits.numpy()
    lg = np.asarray(pdecode.forward_logits(m16, ids))
    assert lg.dtype == np.float32
    assert np.abs(lg - ref).max() < 0.1  # bf16 weights: close, not exact
    # bf16 checkpoint on disk loads (upcast) and round-trips
    out = pdecode.save_hf(m16, tmp_path / "bf16")
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "bfloat16"
    m32 = pdecode.load(out)
    np.testing.assert_array_equal(np.asarray(m32.params["embed"]), np.asarray(m16.params["embed"], np.float32))
    out16 = pdecode.generate(m16, [list(ids[0])], max_new_tokens=8)
    assert len(out16.tokens[0]) >= 1


def test_mixed_precision(hf_dirs):
    """bfloat16 weights with float32 activations: closer to the float32 reference than all-bfloat16, and the
    weights stay bfloat16 inside the forward (matmuls take bfloat16 operands; no weight matrix is upcast)."""
    import jax
    import jax.numpy as jnp

    from pdecode.model import attention
    from pdecode.model.transformer import decode_layout, forward

    d, ref_model = hf_dirs["llama"]
    mix = pdecode.load(d, dtype="bfloat16", activation_dtype="float32")
    m16 = pdecode.load(d, dtype="bfloat16")
    assert str(mix.dtype) == "bfloat16" and mix.cfg.run.activation_dtype == "float32"
    ids = _ids(2, 24, seed=5)
    with torch.no_grad():
        ref = ref_model(torch.tensor(ids)).logits.numpy()
    err_mix = np.abs(np.asarray(pdecode.forward_logits(mix, ids)) - ref).max()
    err_16 = np.abs(np.asarray(pdecode.forward_logits(m16, ids)) - ref).max()
    assert err_mix < 0.05 and err_mix < err_16, (err_mix, err_16)

    from tests.helpers import unrolled_layout

    with unrolled_layout():  # the production layout of a shallow model: per-layer weights, fused matmuls
        params = decode_layout(mix.params, mix.cfg)
    weight_shapes = {a.shape for a in jax.tree.leaves(params) if a.ndim == 2}
    tok = jnp.zeros((2, 3), jnp.int32)
    pos = jnp.broadcast_to(jnp.arange(3), (2, 3))
    jaxpr = jax.make_jaxpr(lambda p: forward(p, mix.cfg, tok, pos, attention.causal_intra(3)[None]).hidden)(params)
    eqns = jaxpr.jaxpr.eqns
    upcast = [e for e in eqns if e.primitive.name == "convert_element_type"
              and e.invars[0].aval.dtype == jnp.bfloat16 and e.invars[0].aval.shape in weight_shapes]
    assert not upcast
    dots = [e for e in eqns if e.primitive.name == "dot_general" and e.invars[1].aval.shape in weight_shapes]
    assert len(dots) >= 4 * mix.cfg.num_layers and all(e.invars[0].aval.dtype == jnp.bfloat16 for e in dots)
    assert jaxpr.out_avals[0].dtype == jnp.float32
    with pytest.raises(pdecode.InputError, match="activation_dtype"):
        pdecode.load(d, activation_dtype="int8")
