"""DeepSeek-V3 and GLM-4.5 (issue 29): latent attention's two forms, fp8 block-quantized checkpoints, and the
checkpoint's own MTP layer as the `method="mtp"` drafter (parity with a reference written from the report's
equations on top of transformers' decoder layer, greedy = AR for chains and trees, lossless sampling, the engine).
Their logits, greedy output, save_hf and method matrix against transformers are in test_families."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from pdecode.model.transformer import layer_list
import pdecode
from tests.helpers import add_mtp_layer, make_hf_model

PROMPTS = [[5, 9, 13, 7, 21], list(range(3, 20)), [40, 41, 42, 7, 9, 11, 13, 15, 17, 19, 21]]


def _with_mtp(d, family):
    ref = make_hf_model(family, d, seed=3, num_hidden_layers=2)
    return d, ref, add_mtp_layer(ref, d, seed=4)


@pytest.fixture(scope="module")
def ds(tmp_path_factory):
    return _with_mtp(tmp_path_factory.mktemp("ds"), "deepseek_v3")


@pytest.fixture(scope="module")
def glm(tmp_path_factory):
    return _with_mtp(tmp_path_factory.mktemp("glm"), "glm4_moe")


def _ref_mtp_logits(ref, mtp, ids):
    """DeepSeek-V3's MTP module from the report's equations: h' = W [RMSNorm(emb(t_{i+1})); RMSNorm(h_i)] (h_i the
    main model's last-layer output), one decoder layer (causal, positions 0..), the shared head after its norm."""
    got = {}
    hook = ref.model.layers[-1].register_forward_hook(lambda m, i, o: got.setdefault("h", o[0] if isinstance(o, tuple)
                                                                                      else o))
    with torch.no_grad():
        ref(ids)
        hook.remove()
        h = got["h"]
        t = ids.shape[1] - 1
        x = mtp["eh_proj"](torch.cat([mtp["enorm"](ref.model.embed_tokens(ids[:, 1:])), mtp["hnorm"](h[:, :-1])], -1))
        pos = torch.arange(t)[None]
        mask = torch.full((t, t), float("-inf")).triu(1)[None, None]
        y = mtp["layer"](x, attention_mask=mask, position_embeddings=ref.model.rotary_emb(x, pos), position_ids=pos)
        y = y[0] if isinstance(y, tuple) else y
        return ref.lm_head(mtp["norm"](y)).numpy()


@pytest.mark.parametrize("which", ["ds", "glm"])
def test_mtp_layer_of_the_checkpoint_matches_the_reference(request, which):
    from pdecode.model import attention
    from pdecode.model.heads import mtp_module
    from pdecode.model.transformer import forward

    d, ref, mtp = request.getfixturevalue(which)
    m = pdecode.load(d)
    assert "mtp" in m.extras  # attached from the checkpoint itself, no extra files
    mcfg, mp = m.extras["mtp"]
    ids = np.random.default_rng(1).integers(3, m.cfg.vocab_size, size=(2, 24))
    want = _ref_mtp_logits(ref, mtp, torch.tensor(ids))
    b, t = ids.shape
    pos = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    out = forward(m.params, m.cfg, jnp.asarray(ids), pos, attention.padded_self_mask(jnp.full((b,), t), t),
                  hidden_layers=(m.cfg.num_layers - 1,))
    mask = attention.padded_self_mask(jnp.full((b,), t - 1), t - 1)
    logits, _, _ = mtp_module(mp["modules"][0], mcfg, m.cfg, m.params, out.layer_hidden[0][:, :-1],
                              jnp.asarray(ids[:, 1:]), pos[:, :-1], mask)
    assert np.abs(np.asarray(logits) - want).max() <= 1e-4


@pytest.mark.parametrize("which,opts", [("ds", {}), ("ds", {"tree_top_k": 2, "depth": 3, "total_tokens": 6}),
                                        ("glm", {"depth": 3})])
def test_mtp_decodes_like_ar(request, which, opts):
    d, _, _ = request.getfixturevalue(which)
    m = pdecode.load(d)
    ref = pdecode.generate(m, PROMPTS, max_new_tokens=16, stop_at_eos=False)
    out = pdecode.generate(m, PROMPTS, method="mtp", max_new_tokens=16, stop_at_eos=False, **opts)
    assert out.tokens == ref.tokens
    assert len(out.stats["acceptance_per_depth"]) == opts.get("depth", 1)


def test_latent_attention_forms_agree(ds):
    """The absorbed form (decode steps) and the expanded one (long passes) give the same attention output, with a
    cache and without."""
    from pdecode.model import attention
    from pdecode.model import cache as kvc
    from pdecode.model.families.deepseek import DEEPSEEK_V3
    from pdecode.model.transformer import attention_for

    m = pdecode.load(ds[0])
    cfg, lp = m.cfg, layer_list(m.params["layers"])[1]
    b, t, s = 2, 5, 16
    h = jax.random.normal(jax.random.PRNGKey(0), (b, t, cfg.hidden_size))
    pos = jnp.broadcast_to(jnp.arange(3, 3 + t, dtype=jnp.int32), (b, t))
    cache = kvc.init_cache(cfg, b, s, per_layer=True)
    cache = cache.replace(v=tuple(jax.random.normal(jax.random.PRNGKey(i + 1), a.shape) for i, a in enumerate(cache.v)),
                          k=tuple(jax.random.normal(jax.random.PRNGKey(i + 9), a.shape) for i, a in enumerate(cache.k)),
                          lengths=jnp.array([3, 3], jnp.int32))
    assert cache.v[1].shape == (b, 1, s, cfg.arch.latent.kv_lora_rank) and cache.k[1].shape == (b, 1, cfg.head_dim, s)
    mask = attention.cache_mask(cache.lengths, attention.causal_intra(t), s)
    att = attention_for(cfg, pos, mask)
    outs = [DEEPSEEK_V3.attention(cfg, lp, h, att, cache, 1, cache.lengths, form)[0] for f in (0,)
            for form in ("absorbed", "expanded")]
    assert np.abs(np.asarray(outs[0] - outs[1])).max() <= 1e-5
    att0 = attention_for(cfg, pos, attention.padded_self_mask(jnp.full((b,), t), t))
    outs = [DEEPSEEK_V3.attention(cfg, lp, h, att0, None, 1, None, form)[0] for form in ("absorbed", "expanded")]
    assert np.abs(np.asarray(outs[0] - outs[1])).max() <= 1e-5


def test_fp8_block_quantized_checkpoint_loads_dequantized(ds, tmp_path):
    """A checkpoint quantized as DeepSeek-V3's release is (e4m3 weights, one float32 scale per 128 x 128 block as
    ``weight_scale_inv``, quantization_config fp8): loads with the weights the scales give back, MTP layer included."""
    import json
    import shutil

    import ml_dtypes
    from pdecode.checkpoint.safetensors_io import read_safetensors, write_safetensors

    d = ds[0]
    q = tmp_path / "fp8"
    shutil.copytree(d, q)
    tensors = {k: np.array(v) for k, v in read_safetensors(q / "model.safetensors").items()}
    blk = 16  # the tiny weights are smaller than 128: blocks of 16 exercise partial and whole blocks
    deq = {}
    for k in list(tensors):
        w = tensors[k]
        if w.ndim != 2 or "embed" in k or "layernorm" in k or k.endswith("norm.weight") or ".gate." in k or \
                k == "lm_head.weight" or "shared_head.head" in k:
            continue
        so, si = -(-w.shape[0] // blk), -(-w.shape[1] // blk)
        pad = np.zeros((so * blk, si * blk), np.float32)
        pad[:w.shape[0], :w.shape[1]] = w
        amax = np.abs(pad.reshape(so, blk, si, blk)).max(axis=(1, 3)) + 1e-12
        scale = (amax / 448.0).astype(np.float32)
        big = np.repeat(np.repeat(scale, blk, 0), blk, 1)[:w.shape[0], :w.shape[1]]
        tensors[k] = (w / big).astype(ml_dtypes.float8_e4m3fn)
        tensors[k + "_scale_inv"] = scale
        deq[k] = tensors[k].astype(np.float32) * big
    write_safetensors(q / "model.safetensors", tensors, metadata={"format": "pt"})
    conf = json.loads((q / "config.json").read_text())
    conf["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                   "weight_block_size": [blk, blk]}
    (q / "config.json").write_text(json.dumps(conf))
    mq = pdecode.load(q)
    wkv = np.asarray(layer_list(mq.params["layers"])[1]["wkv_a"])
    np.testing.assert_allclose(wkv, deq["model.layers.1.self_attn.kv_a_proj_with_mqa.weight"].T, rtol=0, atol=1e-6)
    assert "mtp" in mq.extras
    ref = pdecode.load(d)
    ids = np.random.default_rng(2).integers(3, 97, size=(1, 12))
    lq, lr = np.asarray(pdecode.forward_logits(mq, ids)), np.asarray(pdecode.forward_logits(ref, ids))
    assert 0 < np.abs(lq - lr).max() <= 0.1 * np.abs(lr).max()  # fp8's rounding, no more


def test_mtp_sampling_is_lossless(tmp_path):
    """Sampling with the checkpoint's MTP layer drafting 3-token chains: the first 3 tokens' marginals equal the
    exact AR marginals (chi-square over 6000 rows); the same test rejects the chain's deterministic (top-1) drafts
    verified as if sampled from a uniform q."""
    from pdecode.decode.eagle import MTPDrafter
    from tests.test_speculative import liar_tokens, marginal_pvalues

    ref = make_hf_model("deepseek_v3", tmp_path, seed=5, vocab_size=16, num_hidden_layers=2, bos_token_id=None,
                        eos_token_id=None)
    add_mtp_layer(ref, tmp_path, seed=6)
    m = pdecode.load(tmp_path)
    prompt, n = [3, 7, 3, 7, 3], 6000
    out = pdecode.generate(m, [prompt] * n, method="mtp", depth=3, max_new_tokens=3, temperature=1.0, seed=2,
                           stop_at_eos=False)
    assert min(marginal_pvalues(m, prompt, np.array(out.tokens))) > 1e-4
    assert out.stats["tokens_per_forward"] > 1.0
    mcfg, mp = m.extras["mtp"]
    assert min(marginal_pvalues(m, prompt, liar_tokens(m, MTPDrafter(m.cfg, mcfg, 1, 3, 3), mp, prompt, n))) < 1e-6


def test_engine_serves_deepseek_with_its_mtp_layer(ds):
    """Continuous batching with the checkpoint's MTP layer drafting: each request's tokens equal generate's."""
    from pdecode.engine import Engine

    m = pdecode.load(ds[0])
    eng = Engine(m, method="mtp", slots=2, max_len=64, chunk=32, steps_per_call=2, depth=2)
    reqs = [eng.submit(p, eng.check(p, max_tokens=10, temperature=0.0)) for p in PROMPTS]
    while not eng.idle:
        eng.run_once()
    ref = pdecode.generate(m, PROMPTS, max_new_tokens=10, stop_at_eos=False)
    assert [r.tokens for r in reqs] == ref.tokens


def test_mtp_layer_errors_name_tensors_as_stored(ds, tmp_path):
    """A broken MTP layer is reported under the names the checkpoint stores (model.layers.{L}.*, L = num_layers),
    not under the index-0 names the loader reads it by."""
    import shutil

    from pdecode.checkpoint.safetensors_io import read_checkpoint_dir, write_safetensors

    d = tmp_path / "broken"
    shutil.copytree(ds[0], d)
    tensors = {k: np.array(v) for k, v in read_checkpoint_dir(d).items()}
    L = 2  # the model's 2 layers, then its MTP layer
    gone = sorted(k for k in tensors if k.startswith(f"model.layers.{L}.mlp.") and k.endswith("gate_proj.weight"))[0]
    del tensors[gone]
    for f in d.glob("*.safetensors*"):
        f.unlink()
    (d / "model.safetensors.index.json").unlink(missing_ok=True)
    write_safetensors(d / "model.safetensors", tensors, metadata={"format": "pt"})
    with pytest.raises(pdecode.CheckpointError) as e:
        pdecode.load(d)
    assert gone in str(e.value) and "model.layers.0.mlp" not in str(e.value), str(e.value)
