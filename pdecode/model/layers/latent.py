"""Multi-head latent attention (DeepSeek-V2/V3's MLA): the cache holds a per-token latent and one shared rotated key;
attended absorbed (W_uk folded into the query, W_uv after the weighted sum) or expanded (keys and values decompressed
once), whichever costs fewer FLOPs for the shapes (`mla_expanded`)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from pdecode.errors import ConfigError
from pdecode.model import cache as kvc
from pdecode.model.attention import _NEG, CausalSelfMask
from pdecode.model.groups import layer_index
from pdecode.model.layers.linear import linear
from pdecode.model.layers.norms import rms_norm
from pdecode.model.layers.rope import apply_rope


@dataclasses.dataclass(frozen=True)
class Latent:
    """Latent attention in a family's arch section (`pdecode.config.Arch.latent`): keys and values come from a
    per-token latent of ``kv_lora_rank`` values plus one shared rotated key of the core's ``head_dim`` (the rope part
    of each head: qk_rope_head_dim), which is all the cache holds; each head's query and key have ``qk_nope_dim``
    more unrotated dims, its value ``v_head_dim``; queries through a ``q_lora_rank`` bottleneck (0: one
    projection); ``rope_interleave``: the rotated dims are stored as interleaved pairs."""

    kv_lora_rank: int
    qk_nope_dim: int
    v_head_dim: int
    q_lora_rank: int = 0
    rope_interleave: bool = False

    def problems(self, cfg) -> list[str]:
        if self.kv_lora_rank > 0 and self.qk_nope_dim > 0 and self.v_head_dim > 0 and cfg.num_kv_heads == 1:
            return []
        return [f"latent attention (kv_lora_rank {self.kv_lora_rank}) needs kv_lora_rank, qk_nope_dim and v_head_dim "
                f"> 0 and num_kv_heads 1 (got {self.qk_nope_dim}, {self.v_head_dim}, {cfg.num_kv_heads})"]


def mla_expanded(cfg, t: int, s: int) -> bool:
    """Whether a pass of ``t`` queries over ``s`` keys costs fewer FLOPs with the keys and values decompressed
    (expanded) than absorbed: expanded pays r (dn + dv) per key to decompress and dn + dr + dv per (query, key);
    absorbed pays r (dn + dv) per query to fold W_uk / W_uv and 2r + dr per (query, key)."""
    la = cfg.arch.latent
    r, dn, dv, dr = la.kv_lora_rank, la.qk_nope_dim, la.v_head_dim, cfg.head_dim
    expanded = s * r * (dn + dv) + t * s * (dn + dr + dv)
    absorbed = t * r * (dn + dv) + t * s * (2 * r + dr)
    return expanded < absorbed


def rope_pairs(x: jax.Array, rope, interleave: bool) -> jax.Array:
    """x [..., dr] rotated: half-split pairs (x_i, x_{i + dr/2}), or interleaved pairs (x_2i, x_2i+1) whose result
    is laid out half-split (as the reference does: both q and k come out in that order, so scores agree)."""
    if not interleave:
        return apply_rope(x, rope)
    cos, sin = rope
    xf = x.astype(jnp.float32)
    x1, x2 = xf[..., 0::2], xf[..., 1::2]
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)


def _softmax_over(scores, mask):
    """Masked softmax over the last axis in float32 (the `attention.attend` recipe: max-shifted, no gradient
    through the max)."""
    scores = jnp.where(mask, scores, _NEG)
    top = jax.lax.stop_gradient(jnp.max(scores, axis=-1, keepdims=True))
    e = jnp.exp(scores - top)
    return e / jnp.sum(e, axis=-1, keepdims=True)


def latent_attention(cfg, lp, h, att, cache, i, write_at, form: str | None = None):
    """Latent attention of layer ``i`` on the normed input: (out [B,T,D], cache). ``form``: "absorbed" or
    "expanded" (default: the cheaper for these shapes, `mla_expanded`)."""
    if cfg.run.attention_impl not in ("auto", "xla"):
        raise ConfigError(f"attention impl {cfg.run.attention_impl!r}: latent attention (deepseek_v3) runs its own "
                          "XLA attention; use 'auto' or 'xla'")
    b, t, _ = h.shape
    la = cfg.arch.latent
    r, dn = la.kv_lora_rank, la.qk_nope_dim
    rope, mask = att.for_layer(i)
    if isinstance(mask, CausalSelfMask):
        mask = mask.mask
    if la.q_lora_rank:
        q = linear(rms_norm(linear(h, lp["wq_a"]), lp["q_a_norm"], cfg.rms_norm_eps), lp["wq_b"],
                   "btr,rhk->bthk")
    else:
        q = linear(h, lp["wq"], "btd,dhk->bthk")
    q_nope, q_rope = q[..., :dn], rope_pairs(q[..., dn:], rope, la.rope_interleave)
    ckv = linear(h, lp["wkv_a"])
    c = rms_norm(ckv[..., :r], lp["kv_a_norm"], cfg.rms_norm_eps)  # [B, T, r]
    k_rope = rope_pairs(ckv[..., None, r:], rope, la.rope_interleave)  # [B, T, 1, dr]
    if cache is not None:
        cache = kvc.write_layer(cache, layer_index(i), jnp.swapaxes(k_rope, 1, 2), c[:, None], write_at)
        kr, cs = cache.layer(layer_index(i))  # [B, 1, dr, S], [B, 1, S, r]
        kr, cs = kr[:, 0], cs[:, 0]
    else:
        kr, cs = jnp.swapaxes(k_rope[:, :, 0], 1, 2), c  # [B, dr, T], [B, T, r]
    dt = cs.dtype  # the cache's dtype: the matmul operands'
    s = cs.shape[1]
    w_uk, w_uv = lp["wkv_b"][..., :dn], lp["wkv_b"][..., dn:]  # [r, H, dn], [r, H, dv]
    form = form or ("expanded" if mla_expanded(cfg, t, s) else "absorbed")
    f32 = jnp.float32
    rope_scores = jnp.einsum("bthd,bds->bhts", q_rope.astype(dt), kr.astype(dt), preferred_element_type=f32)
    if form == "absorbed":
        q_lat = jnp.einsum("bthn,rhn->bthr", q_nope, w_uk.astype(q_nope.dtype), preferred_element_type=f32)
        scores = jnp.einsum("bthr,bsr->bhts", q_lat.astype(dt), cs, preferred_element_type=f32) + rope_scores
        p = _softmax_over(scores * f32(cfg.attn_scale), mask[:, None])
        o_lat = jnp.einsum("bhts,bsr->bthr", p.astype(dt), cs, preferred_element_type=f32)
        o = jnp.einsum("bthr,rhv->bthv", o_lat.astype(w_uv.dtype), w_uv, preferred_element_type=f32)
    else:
        k_nope = jnp.einsum("bsr,rhn->bshn", cs, w_uk.astype(dt), preferred_element_type=f32).astype(dt)
        v = jnp.einsum("bsr,rhv->bshv", cs, w_uv.astype(dt), preferred_element_type=f32).astype(dt)
        scores = jnp.einsum("bthn,bshn->bhts", q_nope.astype(dt), k_nope, preferred_element_type=f32) + rope_scores
        p = _softmax_over(scores * f32(cfg.attn_scale), mask[:, None])
        o = jnp.einsum("bhts,bshv->bthv", p.astype(dt), v, preferred_element_type=f32)
    return linear(o.astype(h.dtype), lp["wo"], "bthk,hkd->btd"), cache
