"""The two passes of a block-diffusion encoder-decoder (DiffusionGemma, `ModelConfig.canvas_length` > 0).

One set of layer weights runs as

* `encode`: a causal pass over new tokens (the prompt, then each committed canvas at the positions it was decoded
  at) that writes their keys and values into the KV cache at each row's ``lengths`` (the caller advances them);
  sliding layers see the last ``sliding_window`` positions, as in any causal pass;
* `denoise`: a bidirectional pass over a canvas of L tokens at positions ``lengths .. lengths + L - 1`` that attends
  to every cached token (sliding layers: the last ``sliding_window - 1`` of them, what the reference's sliding
  cache keeps) and to the whole canvas, and returns the canvas's soft-capped logits [B, L, V] in float32. Its
  keys and values are written past ``lengths`` as scratch (never committed: the next `encode` of the committed
  canvas overwrites them), so no cache is copied per step.

The decoder's input is the canvas embedding plus a self-conditioning MLP of the previous step's distribution
(``softmax(sc_logits) @ embedding``, x sqrt(D), zero where ``sc_on`` is False), RMS-normalised without weight.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pdecode.config import ModelConfig
from pdecode.model import cache as kvc
from pdecode.model.attention import cache_mask, causal_intra
from pdecode.model.families.gemma4 import gemma4_norm
from pdecode.model.family import family_of
from pdecode.model.transformer import (
    Attention, activation, embed, final_norm, forward, linear, rope_tables, rope_tables_of, unembed)


def check(cfg: ModelConfig) -> None:
    if not cfg.canvas_length:
        raise ValueError("block_diffusion: the config has no canvas_length (not a block-diffusion model)")


def encode(params, cfg: ModelConfig, tokens_BT: jax.Array, cache: kvc.KVCache, valid_B: jax.Array | None = None
           ) -> kvc.KVCache:
    """Write the keys and values of ``tokens`` (at positions ``cache.lengths + t``) into ``cache``; lengths do not
    move. ``valid_B``: how many of the T tokens are real in each row (the rest are padding no query reads)."""
    check(cfg)
    b, t = tokens_BT.shape
    start = cache.lengths
    pos = start[:, None] + jnp.arange(t, dtype=jnp.int32)[None]
    intra = jnp.broadcast_to(causal_intra(t), (b, t, t))
    if valid_B is not None:
        intra = intra & (jnp.arange(t)[None, None, :] < valid_B[:, None, None])
    mask = cache_mask(start, intra, cache.max_len)
    return forward(params, cfg, tokens_BT, pos, mask, cache=cache, write_at_B=start).cache


def canvas_input(params, cfg: ModelConfig, canvas_BL: jax.Array, sc_logits_BLV: jax.Array | None,
                 sc_on_B: jax.Array | None) -> jax.Array:
    """The decoder's input [B, L, D]: norm(embed(canvas) + MLP(pre_norm(softmax(sc) @ E x sqrt(D))))."""
    x = embed(params, canvas_BL, cfg)
    eps = cfg.rms_norm_eps
    if sc_logits_BLV is not None:
        w = params["embed"]
        p = jax.nn.softmax(sc_logits_BLV.astype(jnp.float32), axis=-1).astype(w.dtype)
        s = jnp.einsum("blv,vd->bld", p, w) * jnp.asarray(cfg.hidden_size ** 0.5, w.dtype)
        s = s.astype(x.dtype)
        if sc_on_B is not None:
            s = s * sc_on_B[:, None, None].astype(s.dtype)
        h = gemma4_norm(s, params["sc_pre_norm"], eps)
        x = x + linear(activation(cfg, linear(h, params["sc_gate"])) * linear(h, params["sc_up"]), params["sc_down"])
    return gemma4_norm(x, None, eps)


def denoise(params, cfg: ModelConfig, canvas_BL: jax.Array, cache: kvc.KVCache,
            sc_logits_BLV: jax.Array | None = None, sc_on_B: jax.Array | None = None) -> jax.Array:
    """Logits [B, L, V] (float32, soft-capped) of the canvas decoded after each row's ``cache.lengths`` tokens."""
    check(cfg)
    b, l = canvas_BL.shape
    fam = family_of(cfg)
    start = cache.lengths
    pos = start[:, None] + jnp.arange(l, dtype=jnp.int32)[None]
    s = jnp.arange(cache.max_len, dtype=jnp.int32)[None, None, :]
    lo, hi = start[:, None, None], (start + l)[:, None, None]
    canvas_keys = (s >= lo) & (s < hi)
    full = jnp.broadcast_to((s < lo) | canvas_keys, (b, l, cache.max_len))
    window = cfg.sliding_window or cache.max_len
    local = jnp.broadcast_to(((s < lo) & (s >= lo - (window - 1))) | canvas_keys, (b, l, cache.max_len))
    kinds = tuple(k == "sliding" for k in cfg.layer_kinds())
    tables = rope_tables_of(params, cfg) or {}
    att = Attention(rope_tables(cfg, pos, tables.get("global")), full,
                    rope_tables(cfg, pos, tables.get("local"), local=True) if any(kinds) else None,
                    local if any(kinds) else None, kinds, {"inputs": None, "kv": {}})
    x = canvas_input(params, cfg, canvas_BL, sc_logits_BLV, sc_on_B)
    for i, lp in enumerate(params["layers"]):
        lp = {**lp, "layer_scalar": lp["dec_layer_scalar"]}
        x, cache = fam.block(cfg, lp, x, att, cache, i, start, False)
    return unembed(params, cfg, final_norm(params, cfg, x))
