"""LLaDA- and Dream-layout checkpoints (synthetic files of those layouts) against a NumPy bidirectional reference."""

import json

import numpy as np
import pytest

import pdecode
from pdecode.checkpoint.safetensors_io import write_safetensors

D, H, KV, F, V, L = 32, 4, 2, 48, 40, 2
HD = D // H


def _rms(x, w, eps=1e-5):
    return w * x / np.sqrt((x * x).mean(-1, keepdims=True) + eps)


def _rope(x, theta):  # x [T, heads, hd], half-split layout
    t = x.shape[0]
    inv = 1.0 / theta ** (np.arange(0, HD, 2) / HD)
    ang = np.arange(t)[:, None] * inv[None]
    cos, sin = np.cos(ang)[:, None], np.sin(ang)[:, None]
    a, b = x[..., : HD // 2], x[..., HD // 2:]
    return np.concatenate([a * cos - b * sin, b * cos + a * sin], -1)


def reference_logits(w, tokens, theta, bias=False, eps=1e-5):
    """Bidirectional Llama/Qwen2 forward from HF-style [out, in] matrices (NumPy, float64)."""
    x = w["embed"][tokens].astype(np.float64)
    t = len(tokens)
    for i in range(L):
        h = _rms(x, w[f"attn_norm{i}"], eps)
        q = h @ w[f"q{i}"].T + (w[f"bq{i}"] if bias else 0)
        k = h @ w[f"k{i}"].T + (w[f"bk{i}"] if bias else 0)
        v = h @ w[f"v{i}"].T + (w[f"bv{i}"] if bias else 0)
        q, k, v = q.reshape(t, H, HD), k.reshape(t, KV, HD), v.reshape(t, KV, HD)
        q, k = _rope(q, theta), _rope(k, theta)
        out = np.zeros((t, H, HD))
        for hh in range(H):
            g = hh // (H // KV)
            s = q[:, hh] @ k[:, g].T / np.sqrt(HD)
            p = np.exp(s - s.max(-1, keepdims=True))
            p /= p.sum(-1, keepdims=True)
            out[:, hh] = p @ v[:, g]
        x = x + out.reshape(t, -1) @ w[f"o{i}"].T
        h = _rms(x, w[f"mlp_norm{i}"], eps)
        gate, up = h @ w[f"gate{i}"].T, h @ w[f"up{i}"].T
        x = x + (gate / (1 + np.exp(-gate)) * up) @ w[f"down{i}"].T
    return _rms(x, w["final_norm"], eps) @ w["head"].T


def _weights(rng, bias=False):
    r = lambda *s: (rng.normal(size=s) * 0.2).astype(np.float32)  # noqa: E731
    w = {"embed": r(V, D), "final_norm": 1 + r(D), "head": r(V, D)}
    for i in range(L):
        w.update({f"attn_norm{i}": 1 + r(D), f"q{i}": r(H * HD, D), f"k{i}": r(KV * HD, D), f"v{i}": r(KV * HD, D),
                  f"o{i}": r(D, H * HD), f"mlp_norm{i}": 1 + r(D), f"gate{i}": r(F, D), f"up{i}": r(F, D),
                  f"down{i}": r(D, F)})
        if bias:
            w.update({f"bq{i}": r(H * HD), f"bk{i}": r(KV * HD), f"bv{i}": r(KV * HD)})
    return w


def test_llada_layout(tmp_path):
    w = _weights(np.random.default_rng(0))
    t = {"model.transformer.wte.weight": w["embed"], "model.transformer.ln_f.weight": w["final_norm"],
         "model.transformer.ff_out.weight": w["head"]}
    for i in range(L):
        p = f"model.transformer.blocks.{i}."
        t.update({p + "attn_norm.weight": w[f"attn_norm{i}"], p + "q_proj.weight": w[f"q{i}"],
                  p + "k_proj.weight": w[f"k{i}"], p + "v_proj.weight": w[f"v{i}"], p + "attn_out.weight": w[f"o{i}"],
                  p + "ff_norm.weight": w[f"mlp_norm{i}"], p + "ff_proj.weight": w[f"gate{i}"],
                  p + "up_proj.weight": w[f"up{i}"], p + "ff_out.weight": w[f"down{i}"]})
    write_safetensors(tmp_path / "model.safetensors", t)
    (tmp_path / "config.json").write_text(json.dumps({
        "model_type": "llada", "d_model": D, "n_heads": H, "n_kv_heads": KV, "n_layers": L, "mlp_hidden_size": F,
        "vocab_size": V, "embedding_size": V, "rope_theta": 500000.0, "rms_norm_eps": 1e-5, "weight_tying": False,
        "mask_token_id": 37, "eos_token_id": 1, "max_sequence_length": 128}))
    m = pdecode.load(tmp_path)
    assert not m.cfg.causal and m.cfg.mask_token_id == 37 and not m.cfg.diffusion_shift
    tokens = [3, 17, 37, 37, 5, 37, 9]
    ours = np.asarray(pdecode.forward_logits(m, [tokens]))[0]
    np.testing.assert_allclose(ours, reference_logits(w, np.array(tokens), 500000.0), atol=1e-4)
    out = pdecode.generate(m, [[3, 17, 5]], method="diffusion", max_new_tokens=8, stop_at_eos=False)
    assert len(out.tokens[0]) == 8 and 37 not in out.tokens[0]


def test_dream_layout(tmp_path):
    w = _weights(np.random.default_rng(1), bias=True)
    t = {"model.embed_tokens.weight": w["embed"], "model.norm.weight": w["final_norm"], "lm_head.weight": w["head"]}
    for i in range(L):
        p = f"model.layers.{i}."
        t.update({p + "input_layernorm.weight": w[f"attn_norm{i}"], p + "self_attn.q_proj.weight": w[f"q{i}"],
                  p + "self_attn.k_proj.weight": w[f"k{i}"], p + "self_attn.v_proj.weight": w[f"v{i}"],
                  p + "self_attn.q_proj.bias": w[f"bq{i}"], p + "self_attn.k_proj.bias": w[f"bk{i}"],
                  p + "self_attn.v_proj.bias": w[f"bv{i}"], p + "self_attn.o_proj.weight": w[f"o{i}"],
                  p + "post_attention_layernorm.weight": w[f"mlp_norm{i}"], p + "mlp.gate_proj.weight": w[f"gate{i}"],
                  p + "mlp.up_proj.weight": w[f"up{i}"], p + "mlp.down_proj.weight": w[f"down{i}"]})
    write_safetensors(tmp_path / "model.safetensors", t)
    (tmp_path / "config.json").write_text(json.dumps({
        "model_type": "Dream", "hidden_size": D, "num_attention_heads": H, "num_key_value_heads": KV,
        "num_hidden_layers": L, "intermediate_size": F, "vocab_size": V, "rope_theta": 10000.0, "rms_norm_eps": 1e-5,
        "tie_word_embeddings": False, "mask_token_id": 38, "eos_token_id": 1}))
    m = pdecode.load(tmp_path)
    assert not m.cfg.causal and m.cfg.diffusion_shift and m.cfg.attention_bias
    tokens = [3, 17, 38, 38, 5]
    ours = np.asarray(pdecode.forward_logits(m, [tokens]))[0]
    np.testing.assert_allclose(ours, reference_logits(w, np.array(tokens), 10000.0, bias=True), atol=1e-4)
    # the shift: the first generated position is predicted from the prompt's last hidden state
    out = pdecode.generate(m, [[3, 17, 5]], method="diffusion", max_new_tokens=4, steps=4, stop_at_eos=False)
    full = np.array(pdecode.forward_logits(m, [[3, 17, 5, 38, 38, 38, 38]]))[0]
    full[:, 38] = -np.inf
    first_pos = np.argmax(np.max(np.exp(full - full.max(-1, keepdims=True)) /
                                 np.exp(full - full.max(-1, keepdims=True)).sum(-1, keepdims=True), -1)[2:6])
    assert out.tokens[0][first_pos] == int(np.argmax(full[2 + first_pos]))


def test_save_hf_keeps_diffusion_flags(tmp_path):
    (tmp_path / "a").mkdir()
    test_llada_layout(tmp_path / "a")
    m = pdecode.load(tmp_path / "a")
    out = pdecode.save_hf(m, tmp_path / "b")
    back = pdecode.load(out)
    assert not back.cfg.causal and back.cfg.mask_token_id == 37
    np.testing.assert_array_equal(np.asarray(pdecode.forward_logits(m, [[1, 2, 3]])),
                                  np.asarray(pdecode.forward_logits(back, [[1, 2, 3]])))


@pytest.mark.parametrize("bad", [{"model_type": "llada", "d_model": 8}, {"model_type": "gpt2"}])
def test_bad_configs(tmp_path, bad):
    (tmp_path / "config.json").write_text(json.dumps(bad))
    write_safetensors(tmp_path / "model.safetensors", {"x": np.zeros(1, np.float32)})
    with pytest.raises(pdecode.CheckpointError):
        pdecode.load(tmp_path)


def test_compressed_safetensors_round_trip(tmp_path):
    import lzma

    import ml_dtypes

    from pdecode.checkpoint.safetensors_io import compress_file, read_checkpoint_dir, read_safetensors, write_safetensors

    t = {"a": np.arange(12, dtype=np.float32).reshape(3, 4), "b": np.ones(5, ml_dtypes.bfloat16)}
    plain = write_safetensors(tmp_path / "model.safetensors", t)
    packed = write_safetensors(tmp_path / "model.safetensors", t, compress=True)
    assert packed.name == "model.safetensors.xz" and not plain.exists()  # no stale plain copy left behind
    assert lzma.decompress(packed.read_bytes())[8:9] == b"{"  # an xz stream of a safetensors file
    got = read_safetensors(tmp_path / "model.safetensors")  # found through its .xz form
    assert got.keys() == t.keys() and np.array_equal(got["a"], t["a"]) and got["b"].dtype == ml_dtypes.bfloat16
    assert read_checkpoint_dir(tmp_path).keys() == t.keys()
    write_safetensors(tmp_path / "model.safetensors", t)  # and back: the .xz copy is removed
    assert not packed.exists() and read_checkpoint_dir(tmp_path).keys() == t.keys()
    # a stale .xz beside the plain file (say, after `xz -dk` and a re-save) never wins over it
    old = {"a": np.zeros((3, 4), np.float32), "b": np.zeros(5, ml_dtypes.bfloat16)}
    old_file = write_safetensors(tmp_path / "old.safetensors", old)
    (tmp_path / "model.safetensors.xz").write_bytes(lzma.compress(old_file.read_bytes()))
    old_file.unlink()
    got = read_checkpoint_dir(tmp_path)
    assert np.array_equal(got["a"], t["a"])
    with pytest.raises(pdecode.CheckpointError, match="plain .safetensors"):
        compress_file(tmp_path / "model.safetensors.xz")
    (tmp_path / "bad.safetensors.xz").write_bytes(b"not xz")
    with pytest.raises(pdecode.CheckpointError, match="not a valid xz file"):
        read_safetensors(tmp_path / "bad.safetensors")
