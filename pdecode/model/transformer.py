"""The decoder: pure functions over a params pytree.

Params are a nested dict; per-layer weights are stacked on a leading ``layers`` axis and the layers run under
``lax.scan`` (fully unrolled for shallow models, where it is faster and compiles quickly). One spec tree
(`param_specs`) gives every weight's shape and logical axis names; it drives init, sharding and checkpoint
restore alike.

    params = init_params(cfg, key)
    out = forward(params, cfg, tokens_BT, positions_BT, mask_BTS, cache=cache, write_at_B=cache.lengths)
    logits_BTV = unembed(params, cfg, out.hidden)
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from pdecode.config import ModelConfig, rope_inv_freq
from pdecode.model import cache as kvc
from pdecode.model.attention import attend

Params = dict[str, Any]


@dataclasses.dataclass(frozen=True)
class ParamSpec:
    shape: tuple[int, ...]
    axes: tuple[str | None, ...]  # logical axis names, one per dim
    init: str = "normal"  # normal | ones | zeros


def layer_specs(cfg: ModelConfig, num_layers: int) -> dict[str, ParamSpec]:
    """Specs of a stack of ``num_layers`` decoder blocks (also used by drafters built from the same block)."""
    L, D, F = num_layers, cfg.hidden_size, cfg.intermediate_size
    H, KV, hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    s = {
        "attn_norm": ParamSpec((L, D), ("layers", None), "ones"),
        "wq": ParamSpec((L, D, H, hd), ("layers", "embed", "heads", None)),
        "wk": ParamSpec((L, D, KV, hd), ("layers", "embed", "kv_heads", None)),
        "wv": ParamSpec((L, D, KV, hd), ("layers", "embed", "kv_heads", None)),
        "wo": ParamSpec((L, H, hd, D), ("layers", "heads", None, "embed")),
        "mlp_norm": ParamSpec((L, D), ("layers", None), "ones"),
        "w_gate": ParamSpec((L, D, F), ("layers", "embed", "mlp")),
        "w_up": ParamSpec((L, D, F), ("layers", "embed", "mlp")),
        "w_down": ParamSpec((L, F, D), ("layers", "mlp", "embed")),
    }
    if cfg.attention_bias:
        s["bq"] = ParamSpec((L, H, hd), ("layers", "heads", None), "zeros")
        s["bk"] = ParamSpec((L, KV, hd), ("layers", "kv_heads", None), "zeros")
        s["bv"] = ParamSpec((L, KV, hd), ("layers", "kv_heads", None), "zeros")
    if cfg.qk_norm:
        s["q_norm"] = ParamSpec((L, hd), ("layers", None), "ones")
        s["k_norm"] = ParamSpec((L, hd), ("layers", None), "ones")
    return s


def param_specs(cfg: ModelConfig) -> dict[str, Any]:
    specs: dict[str, Any] = {
        "embed": ParamSpec((cfg.vocab_size, cfg.hidden_size), ("vocab", "embed")),
        "layers": layer_specs(cfg, cfg.num_layers),
        "final_norm": ParamSpec((cfg.hidden_size,), (None,), "ones"),
    }
    if not cfg.tie_word_embeddings:
        specs["lm_head"] = ParamSpec((cfg.hidden_size, cfg.vocab_size), ("embed", "vocab"))
    return specs


def is_spec(x) -> bool:
    return isinstance(x, ParamSpec)


def init_from_specs(specs, key: jax.Array, dtype=jnp.float32, std: float = 0.02):
    leaves, treedef = jax.tree_util.tree_flatten(specs, is_leaf=is_spec)
    keys = jax.random.split(key, len(leaves))
    out = []
    for spec, k in zip(leaves, keys):
        if spec.init == "ones":
            out.append(jnp.ones(spec.shape, dtype))
        elif spec.init == "zeros":
            out.append(jnp.zeros(spec.shape, dtype))
        else:
            out.append((std * jax.random.normal(k, spec.shape, jnp.float32)).astype(dtype))
    return jax.tree_util.tree_unflatten(treedef, out)


def init_params(cfg: ModelConfig, key: jax.Array, dtype=jnp.float32, std: float = 0.02) -> Params:
    return init_from_specs(param_specs(cfg), key, dtype, std)


def abstract_params(cfg: ModelConfig, dtype=jnp.float32) -> Params:
    return jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, dtype), param_specs(cfg), is_leaf=is_spec)


# ------------------------------------------------------------------------------------------------ pieces
def rms_norm(x: jax.Array, w: jax.Array, eps: float) -> jax.Array:
    xf = x.astype(jnp.float32)
    xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return w * xf.astype(x.dtype)


def apply_rope(x_BTHD: jax.Array, positions_BT: jax.Array, inv_freq: jax.Array) -> jax.Array:
    """Rotary embedding, half-split layout (as Llama/Qwen checkpoints in HF format expect)."""
    ang = positions_BT.astype(jnp.float32)[..., None] * inv_freq  # [B, T, hd/2]
    cos, sin = jnp.cos(ang)[:, :, None, :], jnp.sin(ang)[:, :, None, :]
    xf = x_BTHD.astype(jnp.float32)
    x1, x2 = jnp.split(xf, 2, axis=-1)
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x_BTHD.dtype)


def embed(params: Params, tokens_BT: jax.Array) -> jax.Array:
    return jnp.take(params["embed"], tokens_BT, axis=0)


def unembed(params: Params, cfg: ModelConfig, h_BTD: jax.Array) -> jax.Array:
    """Final hidden states (already normed) -> float32 logits."""
    if cfg.tie_word_embeddings:
        return jnp.einsum("...d,vd->...v", h_BTD, params["embed"], preferred_element_type=jnp.float32)
    return jnp.einsum("...d,dv->...v", h_BTD, params["lm_head"], preferred_element_type=jnp.float32)


class ForwardOut(NamedTuple):
    hidden: jax.Array  # [B, T, D] final hidden states after the final norm (feed `unembed`)
    cache: kvc.KVCache | None  # updated cache (fresh tokens written; lengths unchanged)
    layer_hidden: jax.Array | None  # [n, B, T, D] outputs of the requested layers (before the final norm)


def _block(cfg: ModelConfig, lp: Params, x: jax.Array, positions: jax.Array, mask: jax.Array,
           inv_freq: jax.Array, cache: kvc.KVCache | None, layer_idx, write_at: jax.Array | None):
    h = rms_norm(x, lp["attn_norm"], cfg.rms_norm_eps)
    q = jnp.einsum("btd,dhk->bthk", h, lp["wq"])
    k = jnp.einsum("btd,dhk->bthk", h, lp["wk"])
    v = jnp.einsum("btd,dhk->bthk", h, lp["wv"])
    if "bq" in lp:
        q, k, v = q + lp["bq"], k + lp["bk"], v + lp["bv"]
    if "q_norm" in lp:
        q = rms_norm(q, lp["q_norm"], cfg.rms_norm_eps)
        k = rms_norm(k, lp["k_norm"], cfg.rms_norm_eps)
    q = apply_rope(q, positions, inv_freq)
    k = apply_rope(k, positions, inv_freq)
    if cache is not None:
        cache = kvc.write_layer(cache, layer_idx, k, v, write_at)
        keys, vals = cache.k[layer_idx], cache.v[layer_idx]
    else:
        keys, vals = k, v
    a = attend(q, keys.astype(q.dtype), vals.astype(q.dtype), mask)
    x = x + jnp.einsum("bthk,hkd->btd", a, lp["wo"])
    h = rms_norm(x, lp["mlp_norm"], cfg.rms_norm_eps)
    g = jnp.einsum("btd,df->btf", h, lp["w_gate"])
    u = jnp.einsum("btd,df->btf", h, lp["w_up"])
    x = x + jnp.einsum("btf,fd->btd", jax.nn.silu(g) * u, lp["w_down"])
    return x, cache


def run_layers(cfg: ModelConfig, layers: Params, x_BTD: jax.Array, positions_BT: jax.Array, mask_BTS: jax.Array,
               cache: kvc.KVCache | None = None, write_at_B: jax.Array | None = None,
               hidden_layers: tuple[int, ...] = ()) -> tuple[jax.Array, kvc.KVCache | None, jax.Array | None]:
    """Run a stack of blocks (stacked params) over embeddings. Returns (x, cache, layer_hidden)."""
    num_layers = jax.tree.leaves(layers)[0].shape[0]
    inv_freq = jnp.asarray(rope_inv_freq(cfg), jnp.float32)
    n_hid = len(hidden_layers)
    slot_of = np.full((num_layers,), n_hid, np.int32)
    for i, layer in enumerate(hidden_layers):
        slot_of[layer % num_layers] = i
    slot_of = jnp.asarray(slot_of)
    hid0 = jnp.zeros((n_hid,) + x_BTD.shape, x_BTD.dtype) if n_hid else None

    def body(carry, xs):
        x, c, hid = carry
        lp, i = xs
        x, c = _block(cfg, lp, x, positions_BT, mask_BTS, inv_freq, c, i, write_at_B)
        if hid is not None:
            hid = hid.at[slot_of[i]].set(x, mode="drop")
        return (x, c, hid), None

    (x, cache, hid), _ = jax.lax.scan(body, (x_BTD, cache, hid0), (layers, jnp.arange(num_layers)),
                                      unroll=num_layers if num_layers <= 8 else 1)
    return x, cache, hid


def forward(params: Params, cfg: ModelConfig, tokens_BT: jax.Array, positions_BT: jax.Array, mask_BTS: jax.Array,
            cache: kvc.KVCache | None = None, write_at_B: jax.Array | None = None,
            hidden_layers: tuple[int, ...] = ()) -> ForwardOut:
    """Transformer pass over T tokens per row.

    Without a cache, keys are the T tokens themselves and ``mask`` is [B, T, T]. With a cache, the fresh keys and
    values are written at slots ``write_at[b] + t`` first and queries read all ``max_len`` slots, so ``mask`` is
    [B, T, max_len] (build it with `attention.cache_mask`). ``cache.lengths`` is not changed: the caller decides
    what to keep (`cache.advance` / `cache.commit`).
    """
    x = embed(params, tokens_BT)
    if cache is not None and write_at_B is None:
        write_at_B = cache.lengths
    x, cache, hid = run_layers(cfg, params["layers"], x, positions_BT, mask_BTS, cache, write_at_B, hidden_layers)
    h = rms_norm(x, params["final_norm"], cfg.rms_norm_eps)
    return ForwardOut(hidden=h, cache=cache, layer_hidden=hid)


def cast_params(params: Params, dtype) -> Params:
    return jax.tree.map(lambda a: a.astype(dtype) if jnp.issubdtype(a.dtype, jnp.floating) else a, params)
