"""The attention sublayer every family shares: what the layers of one forward attend with (`Attention`: each layer
kind's rope and mask, built once per forward by `attention_for`; sliding windows derived here, never by the decode
loops) and `self_attention` (q/k/v with the config's biases and q/k norms, the layer's rope, the KV cache write and
read, the config's score scale and softcap, the output projection)."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from pdecode.config import ModelConfig
from pdecode.model import cache as kvc
from pdecode.model.attention import CausalSelfMask, attend
from pdecode.model.family import family_of
from pdecode.model.groups import LayerRef, layer_index
from pdecode.model.layers.linear import linear
from pdecode.model.layers.norms import rms_norm
from pdecode.model.layers.rope import has_local_rope, rope_long, rope_tables, rotate

Params = dict


def key_length(mask) -> int:
    """The number of key slots a mask covers (static): a plain pass's T, a cached pass's cache length."""
    return (mask.mask if isinstance(mask, CausalSelfMask) else mask).shape[-1]


def window_mask(mask, positions_BT: jax.Array, window: int):
    """``mask`` with the keys a sliding window of ``window`` hides removed: key slot s (= its position, in a cache
    and in a cache-less pass) is visible to a query at position p when s > p - window (transformers' rule). A
    `CausalSelfMask` stays one."""
    if isinstance(mask, CausalSelfMask):
        return CausalSelfMask(window_mask(mask.mask, positions_BT, window), mask.blocks)
    s = jnp.arange(mask.shape[-1])
    return mask & (s[None, None, :] > positions_BT[:, :, None] - window)


class Attention(NamedTuple):
    """What the layers of one forward attend with, built once per forward (`attention_for`): the rope and mask of
    each layer kind and which kind each layer is (static). Families read it through `for_layer`."""

    rope: tuple[jax.Array, jax.Array]
    mask: Any
    rope_local: tuple[jax.Array, jax.Array] | None
    mask_local: Any
    sliding: tuple[bool, ...]
    # a family's per-forward data, read-only (`Family.layer_inputs`, e.g. Gemma 4's per-layer inputs; a Gemma 4
    # assistant's target keys and values, "given"); None for most families
    extra: Any = None

    def for_layer(self, i):
        """(rope, mask) of layer ``i`` (a static int, a traced one under `lax.scan`, or a `LayerRef`: its static
        representative has the same kind)."""
        if isinstance(i, LayerRef):
            i = i.rep
        if self.mask_local is None:
            return self.rope, self.mask
        rope_l = self.rope if self.rope_local is None else self.rope_local
        if isinstance(i, (int, np.integer)):
            return (rope_l, self.mask_local) if self.sliding[i] else (self.rope, self.mask)
        if all(self.sliding):
            return rope_l, self.mask_local
        sel = jnp.asarray(self.sliding)[i]
        pick = lambda a, b: jnp.where(sel, a, b)  # noqa: E731
        mask = jax.tree.map(pick, self.mask_local, self.mask)
        if isinstance(self.mask, CausalSelfMask):
            mask = CausalSelfMask(mask.mask, self.mask.blocks)
        return jax.tree.map(pick, rope_l, self.rope), mask


def attention_for(cfg: ModelConfig, positions_BT: jax.Array, mask_BTS, tables=None, layer_ids=None,
                  layer_inputs=None) -> Attention:
    """The `Attention` of a forward: ``mask`` is the full-attention mask the caller built; the sliding layers' mask
    and rope are derived here (windows never come from the caller). ``tables``: the decode layout's rope tables
    (`decode_layout`; a dict with "global" and maybe "local" / "global_long"), else computed. A longrope model
    rotates with its long factors when the mask's key length (the positions the call holds) exceeds the original
    context (`config.rope_long`): one static choice per compiled call, the same in every forward of a decode."""
    tables = tables or {}
    if isinstance(tables, tuple):  # a bare table (the global one)
        tables = {"global": tables}
    kinds = tuple(k == "sliding" for k in cfg.layer_kinds())
    ids = range(len(kinds)) if layer_ids is None else layer_ids
    any_sliding = any(kinds[i] for i in ids)
    long = rope_long(cfg, key_length(mask_BTS))
    rope = rope_tables(cfg, positions_BT, tables.get("global_long" if long else "global"), long=long)
    rope_l = rope_tables(cfg, positions_BT, tables.get("local"), local=True) \
        if any_sliding and has_local_rope(cfg) else None
    mask_l = window_mask(mask_BTS, positions_BT, cfg.sliding_window) if any_sliding else None
    extra = None if layer_inputs is None else {"inputs": layer_inputs}
    return Attention(rope, mask_BTS, rope_l, mask_l, kinds, extra)


def _qkv(cfg: ModelConfig, lp: Params, h: jax.Array, rope, fused: bool, norm=None):
    """q [B,T,H,hd], k, v [B,T,KV,hd] with q/k norms (``norm``, the family's; default RMSNorm) and RoPE applied;
    ``fused``: lp holds wqkv."""
    b, t, _ = h.shape
    H, KV, hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    if fused:  # decode layout: one matmul for q, k and v
        qkv = linear(h, lp["wqkv"])
        if cfg.attention_bias:
            qkv = qkv + lp["bqkv"]
        v = qkv[..., (H + KV) * hd:].reshape(b, t, KV, hd)
        qk = qkv[..., : (H + KV) * hd].reshape(b, t, H + KV, hd)
        if not cfg.qk_norm:  # rotate q and k heads in one pass
            qk = rotate(cfg, qk, rope)
            return qk[:, :, :H], qk[:, :, H:], v
        q, k = qk[:, :, :H], qk[:, :, H:]
    else:
        q = linear(h, lp["wq"], "btd,dhk->bthk")
        k = linear(h, lp["wk"], "btd,dhk->bthk")
        v = linear(h, lp["wv"], "btd,dhk->bthk")
        if cfg.attention_bias:
            q, k, v = q + lp["bq"], k + lp["bk"], v + lp["bv"]
    if cfg.qk_norm:
        norm = norm or (lambda x, w: rms_norm(x, w, cfg.rms_norm_eps))
        q, k = norm(q, lp["q_norm"]), norm(k, lp["k_norm"])
    return rotate(cfg, q, rope), rotate(cfg, k, rope), v


def self_attention(cfg: ModelConfig, lp: Params, h: jax.Array, att: Attention, cache: kvc.KVCache | None, layer_idx,
                   write_at: jax.Array | None, fused: bool = False, norm=None):
    """The attention sublayer every family shares, on the normed input ``h``: q/k/v (biases and q/k norms as lp
    holds), this layer's rope and mask from ``att``, the cache write and read, the config's score scale and softcap,
    the output projection. Returns (out [B,T,D], cache)."""
    b, t, _ = h.shape
    rope, mask = att.for_layer(layer_idx)
    q, k, v = _qkv(cfg, lp, h, rope, fused, norm)
    k, v = jnp.swapaxes(k, 1, 2), jnp.swapaxes(v, 1, 2)  # [B, KV, T, hd]
    if cache is not None:
        cache = kvc.write_layer(cache, layer_index(layer_idx), k, v, write_at)
        k, v = cache.layer(layer_index(layer_idx))  # [B, KV, hd, S], [B, KV, S, hd]
    else:
        k = jnp.swapaxes(k, 2, 3)  # [B, KV, hd, T]
    fam = family_of(cfg)
    a = attend(q, k, v, mask, impl=cfg.run.attention_impl, scale=cfg.attn_scale, softcap=cfg.attn_softcap,
               sinks=lp["sinks"] if fam.attention_sinks else None)
    if fused:  # decode layout: wo [H*hd, D]
        out = linear(a.reshape(b, t, -1), lp["wo"])
    else:
        out = linear(a, lp["wo"], "bthk,hkd->btd")
    if fam.output_bias:
        out = out + lp["bo"]
    return out, cache
