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

import os
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from pdecode.config import ModelConfig
from pdecode.errors import ConfigError
from pdecode.model import cache as kvc
from pdecode.model.attention import CausalSelfMask, attend
from pdecode.model.family import family_of
from pdecode.model.groups import LayerGroups, LayerRef
from pdecode.model.layers.attention import (  # noqa: F401  (importable from here too)
    Attention, _qkv, attention_for, key_length, self_attention, window_mask)
# the shared layers, importable from here too (the names the families and the decode loops have always used)
from pdecode.model.layers.linear import linear
from pdecode.model.layers.mlp import activation, glu_mlp
from pdecode.model.layers.norms import rms_norm
from pdecode.model.layers.rope import (apply_rope, has_local_rope, rope_long, rope_table, rope_table_fits, rope_tables,
                                       rotate)
from pdecode.model.spec import ParamSpec, is_spec

Params = dict[str, Any]  # the canonical layout: layers stacked on a leading axis, q/k/v and gate/up apart


class Layout(NamedTuple):
    """How a params tree is arranged (static; `layout_of`). The canonical layout (`Params`, what checkpoints,
    training and sharding rules use) is all False; `decode_layout` makes the decode one, a `DecodeParams`."""

    unrolled: bool = False  # layers are a `DecodeLayers` tuple of per-layer dicts (a plain loop, no slicing)
    fused: bool = False  # per-layer wqkv [D, (H+2KV)hd], wo [H*hd, D], w_gu [D, 2F] (single matmuls)
    unembed_t: bool = False  # the tied embedding pre-transposed once, as "unembed_t" [D, V]


CANONICAL = Layout()


@jax.tree_util.register_pytree_node_class
class DecodeLayers(tuple):
    """The per-layer weight dicts of the decode layout; ``fused``: q/k/v and gate/up fused (unsharded runs)."""

    fused: bool

    def __new__(cls, layers, fused: bool):
        obj = super().__new__(cls, layers)
        obj.fused = bool(fused)
        return obj

    def tree_flatten(self):
        return tuple(self), self.fused

    @classmethod
    def tree_unflatten(cls, fused, children):
        return cls(children, fused)


@jax.tree_util.register_pytree_node_class
class DecodeParams(dict):
    """Params in the decode layout, with their `Layout` stated (``.layout``) rather than read from which keys
    happen to be present. Made by `decode_layout` inside a jitted call, once, before the loop."""

    def __init__(self, items: dict, layout: Layout):
        super().__init__(items)
        self.layout = layout
        if layout.unembed_t != ("unembed_t" in items) or layout.unrolled != isinstance(items["layers"], DecodeLayers):
            raise ValueError(f"DecodeParams: layout {layout} does not match the weights given")

    def tree_flatten(self):
        keys = tuple(sorted(self))
        return tuple(self[k] for k in keys), (keys, self.layout)

    @classmethod
    def tree_unflatten(cls, aux, children):
        keys, layout = aux
        obj = dict.__new__(cls)
        dict.__init__(obj, zip(keys, children))
        obj.layout = layout
        return obj


def rope_tables_of(params, cfg: ModelConfig):
    """The rope tables the decode layout holds (`decode_layout` builds them when the context fits a table), else
    None (computed per forward)."""
    return params["rope_tables"] if isinstance(params, DecodeParams) and rope_table_fits(cfg) else None


def layout_of(params) -> Layout:
    """The `Layout` of a params tree: a `DecodeParams` says it; a plain dict is canonical (its layers may still be
    a `DecodeLayers` tuple, e.g. a training pass that unstacks them)."""
    if isinstance(params, DecodeParams):
        return params.layout
    layers = params["layers"]
    if isinstance(layers, DecodeLayers):
        return Layout(unrolled=True, fused=layers.fused)
    return CANONICAL


def layer_specs(cfg: ModelConfig, num_layers: int) -> dict[str, ParamSpec]:
    """Specs of a stack of ``num_layers`` blocks of the config's family (drafters built from the same block use it
    too)."""
    return family_of(cfg).layer_specs(cfg, num_layers)


def llama_layer_specs(cfg: ModelConfig, num_layers: int) -> dict[str, ParamSpec]:
    """The Llama block's specs: attention (q/k/v biases and q/k norms as the config says) and a SiLU-GLU MLP."""
    L, D, F = num_layers, cfg.hidden_size, cfg.intermediate_size
    s = attention_specs(cfg, num_layers)
    s.update({
        "mlp_norm": ParamSpec((L, D), ("layers", None), "ones"),
        "w_gate": ParamSpec((L, D, F), ("layers", "embed", "mlp")),
        "w_up": ParamSpec((L, D, F), ("layers", "embed", "mlp")),
        "w_down": ParamSpec((L, F, D), ("layers", "mlp", "embed")),
    })
    return s


def attention_specs(cfg: ModelConfig, num_layers: int, norm_init: str = "ones") -> dict[str, ParamSpec]:
    """The pre-attention norm and the attention weights every family's block shares."""
    L, D = num_layers, cfg.hidden_size
    H, KV, hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    s = {
        "attn_norm": ParamSpec((L, D), ("layers", None), norm_init),
        "wq": ParamSpec((L, D, H, hd), ("layers", "embed", "heads", None)),
        "wk": ParamSpec((L, D, KV, hd), ("layers", "embed", "kv_heads", None)),
        "wv": ParamSpec((L, D, KV, hd), ("layers", "embed", "kv_heads", None)),
        "wo": ParamSpec((L, H, hd, D), ("layers", "heads", None, "embed")),
    }
    if cfg.attention_bias:
        s["bq"] = ParamSpec((L, H, hd), ("layers", "heads", None), "zeros")
        s["bk"] = ParamSpec((L, KV, hd), ("layers", "kv_heads", None), "zeros")
        s["bv"] = ParamSpec((L, KV, hd), ("layers", "kv_heads", None), "zeros")
    if cfg.qk_norm:
        s["q_norm"] = ParamSpec((L, hd), ("layers", None), norm_init)
        s["k_norm"] = ParamSpec((L, hd), ("layers", None), norm_init)
    return s


def param_specs(cfg: ModelConfig) -> dict[str, Any]:
    specs: dict[str, Any] = {
        "embed": ParamSpec((cfg.vocab_size, cfg.hidden_size), ("vocab", "embed")),
        "layers": layer_specs(cfg, cfg.num_layers),
        "final_norm": ParamSpec((cfg.hidden_size,), (None,), "ones"),
    }
    if not cfg.tie_word_embeddings:
        specs["lm_head"] = ParamSpec((cfg.hidden_size, cfg.vocab_size), ("embed", "vocab"))
    specs.update(family_of(cfg).extra_specs(cfg))
    return specs


def count_params(cfg: ModelConfig) -> int:
    return int(sum(int(np.prod(s.shape)) for s in jax.tree.leaves(param_specs(cfg), is_leaf=is_spec)))


def init_from_specs(specs, key: jax.Array, dtype=jnp.float32, std: float = 0.02):
    leaves, treedef = jax.tree_util.tree_flatten(specs, is_leaf=is_spec)
    keys = jax.random.split(key, len(leaves))
    out = []
    for spec, k in zip(leaves, keys):
        if spec.init == "ones":
            out.append(jnp.ones(spec.shape, dtype))
        elif spec.init == "zeros":
            out.append(jnp.zeros(spec.shape, dtype))
        elif spec.init == "index":
            out.append(jnp.zeros(spec.shape, jnp.int32))
        elif spec.init == "flag":
            out.append(jnp.zeros(spec.shape, bool))
        else:
            out.append((std * jax.random.normal(k, spec.shape, jnp.float32)).astype(dtype))
    return jax.tree_util.tree_unflatten(treedef, out)


def init_params(cfg: ModelConfig, key: jax.Array, dtype=jnp.float32, std: float = 0.02) -> Params:
    return init_from_specs(param_specs(cfg), key, dtype, std)


def abstract_params(cfg: ModelConfig, dtype=jnp.float32) -> Params:
    return jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, dtype), param_specs(cfg), is_leaf=is_spec)


# ------------------------------------------------------------------------------------------------ pieces
def embed(params: Params, tokens_BT: jax.Array, cfg: ModelConfig | None = None) -> jax.Array:
    x = jnp.take(params["embed"], tokens_BT, axis=0)
    if cfg is not None:
        scale = family_of(cfg).embed_scale(cfg)
        if scale is not None:  # in the weights' dtype, as the reference rounds it
            x = x * jnp.asarray(scale, params["embed"].dtype)
        if cfg.run.activation_dtype is not None:
            x = x.astype(cfg.run.activation_dtype)
    return x


def unembed(params: Params, cfg: ModelConfig, h_BTD: jax.Array) -> jax.Array:
    """Final hidden states (already normed) -> float32 logits."""
    if layout_of(params).unembed_t:  # decode layout: the tied embedding pre-transposed once
        spec, w = "...d,dv->...v", params["unembed_t"]
    elif cfg.tie_word_embeddings:
        spec, w = "...d,vd->...v", params["embed"]
    else:
        spec, w = "...d,dv->...v", params["lm_head"]
    logits = jnp.einsum(spec, h_BTD.astype(w.dtype), w, preferred_element_type=jnp.float32)
    if cfg.final_softcap:
        logits = cfg.final_softcap * jnp.tanh(logits / cfg.final_softcap)
    return logits


def final_norm(params: Params, cfg: ModelConfig, x_BTD: jax.Array) -> jax.Array:
    return family_of(cfg).norm(cfg, x_BTD, params["final_norm"])


class ForwardOut(NamedTuple):
    hidden: jax.Array  # [B, T, D] final hidden states after the final norm (feed `unembed`)
    cache: kvc.KVCache | None  # updated cache (fresh tokens written; lengths unchanged)
    layer_hidden: jax.Array | None  # [n, B, T, D] outputs of the requested layers (before the final norm)


def llama_block(cfg: ModelConfig, lp: Params, x: jax.Array, att: Attention, cache: kvc.KVCache | None, layer_idx,
                write_at: jax.Array | None, fused: bool = False):
    """The pre-norm Llama block: x + attn(norm(x)), then x + mlp(norm(x))."""
    a, cache = self_attention(cfg, lp, rms_norm(x, lp["attn_norm"], cfg.rms_norm_eps), att, cache, layer_idx,
                              write_at, fused)
    x = x + a
    return x + glu_mlp(cfg, lp, rms_norm(x, lp["mlp_norm"], cfg.rms_norm_eps), fused), cache


def _block(cfg: ModelConfig, lp: Params, x: jax.Array, att: Attention, cache: kvc.KVCache | None, layer_idx,
           write_at: jax.Array | None, fused: bool = False):
    return family_of(cfg).block(cfg, lp, x, att, cache, layer_idx, write_at, fused)


def run_layers(cfg: ModelConfig, layers, x_BTD: jax.Array, positions_BT: jax.Array, mask_BTS: jax.Array,
               cache: kvc.KVCache | None = None, write_at_B: jax.Array | None = None,
               hidden_layers: tuple[int, ...] = (), rope_table=None, layer_inputs=None
               ) -> tuple[jax.Array, kvc.KVCache | None, jax.Array | None]:
    """Run a stack of blocks over embeddings. ``layers`` is the stacked dict of the canonical layout (run under
    `lax.scan`) or a `DecodeLayers` tuple of per-layer dicts (a plain loop; fused as it says). Returns
    (x, cache, layer_hidden). ``layer_inputs``: the family's per-forward inputs (`Family.layer_inputs`)."""
    # kv-shared layers read their sources' keys from a cache: this pass's
    if cache is None and cfg.arch.kv_shared_layers:
        c, w, m = pass_cache(cfg, layers, x_BTD, mask_BTS)
        x_BTD, _, hid = run_layers(cfg, layers, x_BTD, positions_BT, m, c, w, hidden_layers, rope_table, layer_inputs)
        return x_BTD, None, hid
    att = attention_for(cfg, positions_BT, mask_BTS, rope_table, layer_inputs=layer_inputs)
    if isinstance(layers, DecodeLayers):
        num_layers = len(layers)
        hid = []
        for i, lp in enumerate(layers):
            x_BTD, cache = _block(cfg, lp, x_BTD, att, cache, i, write_at_B, layers.fused)
            hid.append(x_BTD)
        sel = [hid[layer % num_layers] for layer in hidden_layers]
        return x_BTD, cache, (jnp.stack(sel) if sel else None)
    if isinstance(layers, LayerGroups):
        return _run_groups(cfg, layers, x_BTD, att, cache, write_at_B, hidden_layers)
    num_layers = jax.tree.leaves(layers)[0].shape[0]
    slot_of, hid0 = _hidden_slots(hidden_layers, num_layers, x_BTD)
    slot_of = jnp.asarray(slot_of)

    def body(carry, xs):
        x, c, hid = carry
        lp, i = xs
        x, c = _block(cfg, lp, x, att, c, i, write_at_B)
        if hid is not None:
            hid = hid.at[slot_of[i]].set(x, mode="drop")
        return (x, c, hid), None

    (x, cache, hid), _ = jax.lax.scan(body, (x_BTD, cache, hid0), (layers, jnp.arange(num_layers)),
                                      unroll=_scan_unroll(num_layers))
    return x, cache, hid


def _hidden_slots(hidden_layers: tuple[int, ...], num_layers: int, x_BTD: jax.Array):
    """(slot of each layer's output in the buffer, numpy: ``len(hidden_layers)`` for a layer not asked for; the
    zeroed buffer [n, B, T, D], or None) of a scanned forward that returns the outputs of ``hidden_layers``."""
    n_hid = len(hidden_layers)
    slot_of = np.full((num_layers,), n_hid, np.int32)
    for s, layer in enumerate(hidden_layers):
        slot_of[layer % num_layers] = s
    return slot_of, (jnp.zeros((n_hid,) + x_BTD.shape, x_BTD.dtype) if n_hid else None)


def _run_groups(cfg: ModelConfig, layers: LayerGroups, x_BTD: jax.Array, att: Attention, cache, write_at_B,
                hidden_layers: tuple[int, ...]):
    """`run_layers` over `LayerGroups`: one `lax.scan` per group over its repeats, the period's blocks unrolled in the
    body (each given a `LayerRef`); a group of one repeat runs its blocks with static indices."""
    slot_of, hid = _hidden_slots(hidden_layers, layers.num_layers, x_BTD)
    n_hid = len(hidden_layers)
    for group, plan in zip(layers, layers.plan):
        if plan.count == 1:
            for u, lp in enumerate(group):
                i = plan.first + u
                x_BTD, cache = _block(cfg, jax.tree.map(lambda a: a[0], lp), x_BTD, att, cache, i, write_at_B)
                if hid is not None and slot_of[i] < n_hid:
                    hid = hid.at[int(slot_of[i])].set(x_BTD)
            continue
        slots = jnp.asarray(slot_of)

        def body(carry, xs, plan=plan):
            x, c, h = carry
            unit, r = xs
            for u, lp in enumerate(unit):
                i = plan.first + r * plan.period + u
                x, c = _block(cfg, lp, x, att, c, LayerRef(i, plan.first + u), write_at_B)
                if h is not None:
                    h = h.at[slots[i]].set(x, mode="drop")
            return (x, c, h), None

        (x_BTD, cache, hid), _ = jax.lax.scan(body, (x_BTD, cache, hid), (group, jnp.arange(plan.count)),
                                              unroll=plan.count if _scan_unroll(plan.count * plan.period) > 1 else 1)
    return x_BTD, cache, hid


def pass_cache(cfg: ModelConfig, layers, x_BTD: jax.Array, mask_BTS):
    """(cache, write offsets, mask) for a pass without a KV cache whose kv-shared layers read their sources' keys
    from one: a cache of the pass's own T tokens (slot t holds token t, as the keys of a cache-less pass are laid
    out), in the activations' dtype and the layers' layout; the pass then runs cached and drops it."""
    b, t = x_BTD.shape[:2]
    cache = kvc.init_cache(cfg, b, t, x_BTD.dtype, per_layer=isinstance(layers, DecodeLayers))
    return cache, jnp.zeros((b,), jnp.int32), mask_BTS.mask if isinstance(mask_BTS, CausalSelfMask) else mask_BTS


def forward(params: Params, cfg: ModelConfig, tokens_BT: jax.Array, positions_BT: jax.Array, mask_BTS: jax.Array,
            cache: kvc.KVCache | None = None, write_at_B: jax.Array | None = None,
            hidden_layers: tuple[int, ...] = ()) -> ForwardOut:
    """Transformer pass over T tokens per row; ``params``: canonical (`Params`) or `DecodeParams`.

    Without a cache, keys are the T tokens themselves and ``mask`` is [B, T, T]. With a cache, the fresh keys and
    values are written at slots ``write_at[b] + t`` first and queries read all ``max_len`` slots, so ``mask`` is
    [B, T, max_len] (build it with `attention.cache_mask`); a cache-less causal pass may wrap its mask in
    `attention.CausalSelfMask` (skips the keys after each block of queries). ``cache.lengths`` is not changed: the
    caller decides what to keep (`cache.advance` / `cache.commit`).
    """
    if cache is not None and isinstance(mask_BTS, CausalSelfMask):
        raise ValueError("CausalSelfMask describes a pass without a cache; with a cache use attention.cache_mask")
    x = embed(params, tokens_BT, cfg)
    if cache is not None and write_at_B is None:
        write_at_B = cache.lengths
    x, cache, hid = run_layers(cfg, params["layers"], x, positions_BT, mask_BTS, cache, write_at_B, hidden_layers,
                               rope_tables_of(params, cfg), family_of(cfg).layer_inputs(cfg, params, tokens_BT, x))
    h = final_norm(params, cfg, x)
    return ForwardOut(hidden=h, cache=cache, layer_hidden=hid)


def run_layer_ids(cfg: ModelConfig, layers, x_BTD: jax.Array, positions_BT: jax.Array, mask_BTS: jax.Array,
                  cache: kvc.KVCache | None, write_at_B: jax.Array | None, ids: tuple[int, ...],
                  capture: int | None = None, rope_table=None, layer_inputs=None):
    """Run only the blocks ``ids`` (static, increasing) of a stack, each writing its own layer of ``cache``.
    Returns (x, cache, the hidden state entering block ``capture``, i.e. after the ids below it; None unless asked).
    Self-speculation drafts with a subset of the target's layers and verifies with the rest through this."""
    if cache is None and cfg.arch.kv_shared_layers:  # as `run_layers`: the pass's own cache, each source in the pass
        missing = sorted({cfg.kv_source(i) for i in ids} - set(ids))
        if missing:
            raise ValueError(f"{cfg.family}: layers {[i for i in ids if cfg.kv_source(i) in missing]} attend with the "
                             f"keys and values of layers {missing}; run those in the same pass")
        c, w, m = pass_cache(cfg, layers, x_BTD, mask_BTS)
        x_BTD, _, cap = run_layer_ids(cfg, layers, x_BTD, positions_BT, m, c, w, ids, capture, rope_table,
                                      layer_inputs)
        return x_BTD, None, cap
    att = attention_for(cfg, positions_BT, mask_BTS, rope_table, layer_ids=ids, layer_inputs=layer_inputs)
    groups = [tuple(i for i in ids if capture is None or i < capture)]
    if capture is not None:
        groups.append(tuple(i for i in ids if i >= capture))
    captured = None
    for g, group in enumerate(groups):
        if g == 1:
            captured = x_BTD
        if not group:
            continue
        if isinstance(layers, DecodeLayers):
            for i in group:
                x_BTD, cache = _block(cfg, layers[i], x_BTD, att, cache, i, write_at_B, layers.fused)
            continue
        if isinstance(layers, LayerGroups):  # a subset of blocks of several shapes: each sliced and run on its own
            for i in group:
                x_BTD, cache = _block(cfg, layers.layer(i), x_BTD, att, cache, i, write_at_B)
            continue
        idx = jnp.asarray(group, jnp.int32)
        sub = jax.tree.map(lambda a: a[idx], layers)

        def body(carry, xs):
            x, c = carry
            lp, i = xs
            x, c = _block(cfg, lp, x, att, c, i, write_at_B)
            return (x, c), None

        (x_BTD, cache), _ = jax.lax.scan(body, (x_BTD, cache), (sub, idx), unroll=_scan_unroll(len(group)))
    return x_BTD, cache, captured


def forward_layers(params: Params, cfg: ModelConfig, positions_BT: jax.Array, mask_BTS: jax.Array,
                   cache: kvc.KVCache | None, write_at_B: jax.Array | None, ids: tuple[int, ...],
                   tokens_BT: jax.Array | None = None, x_in_BTD: jax.Array | None = None,
                   capture: int | None = None) -> tuple[ForwardOut, jax.Array | None]:
    """`forward` through the blocks ``ids`` only, from tokens or from hidden states ``x_in`` (the input of the
    first of them), then the final norm. Returns (ForwardOut, the hidden entering block ``capture`` or None).
    A family with per-layer inputs (Gemma 4) needs ``tokens`` also when starting from ``x_in``."""
    need_tokens = x_in_BTD is None or cfg.arch.per_layer_input_size
    x0 = embed(params, tokens_BT, cfg) if tokens_BT is not None and need_tokens else None
    x = x0 if x_in_BTD is None else x_in_BTD
    layer_inputs = None if x0 is None else family_of(cfg).layer_inputs(cfg, params, tokens_BT, x0)
    if layer_inputs is None and cfg.arch.per_layer_input_size:
        raise ValueError("forward_layers: this model's layers take per-layer inputs; pass tokens_BT")
    if cache is not None and write_at_B is None:
        write_at_B = cache.lengths
    x, cache, cap = run_layer_ids(cfg, params["layers"], x, positions_BT, mask_BTS, cache, write_at_B, ids, capture,
                                  rope_tables_of(params, cfg), layer_inputs)
    return ForwardOut(hidden=final_norm(params, cfg, x), cache=cache, layer_hidden=None), cap


UNROLL_DEFAULT = 16


def _unroll_limit() -> int:
    raw = os.environ.get("PDECODE_UNROLL_MAX_LAYERS", str(UNROLL_DEFAULT))
    try:
        n = int(raw)
    except ValueError:
        n = -1
    if n < 0:
        raise ConfigError(f"PDECODE_UNROLL_MAX_LAYERS must be an integer >= 0 (the most layers a decode loop "
                          f"unrolls; 0: always lax.scan), got {raw!r}")
    return n


# A decode loop unrolls (and fuses) the layers of a model this shallow, else keeps them stacked under `lax.scan`
# (PDECODE_UNROLL_MAX_LAYERS; 0 scans every model: half the compile time, a slower loop).
UNROLL_MAX_LAYERS = _unroll_limit()


def _scan_unroll(num_layers: int) -> int:
    """A stacked forward's `lax.scan` runs unrolled up to 8 layers (and never past UNROLL_MAX_LAYERS)."""
    return num_layers if num_layers <= min(8, UNROLL_MAX_LAYERS) else 1


def unrolled(params: Params | DecodeParams) -> bool:
    """Whether params are in the unrolled decode layout (then caches keep one buffer per layer)."""
    return layout_of(params).unrolled


def decode_layout(params: Params | DecodeParams, cfg: ModelConfig, fuse: bool = True) -> DecodeParams:
    """The params rearranged for a decode loop (call inside jit, before the loop, so it runs once per call):
    per-layer weights unstacked (no slicing inside the loop), q/k/v and gate/up fused into single matmuls, the tied
    embedding pre-transposed for the unembedding. Deep models (> UNROLL_MAX_LAYERS) keep the stacked layers and
    their `lax.scan`. With ``fuse=False`` (sharded runs) weights stay unfused so every shard keeps whole heads.
    The result says which of these it did in its ``.layout``."""
    if isinstance(params, DecodeParams):
        return params
    out = dict(params)
    if cfg.tie_word_embeddings:
        out["unembed_t"] = params["embed"].T
    table = rope_table(cfg)
    if table is not None:
        out["rope_tables"] = {"global": table}
        if rope_long(cfg, cfg.max_position_embeddings):  # longrope: the long factors' table beside the short one
            out["rope_tables"]["global_long"] = rope_table(cfg, long=True)
        if has_local_rope(cfg):
            out["rope_tables"]["local"] = rope_table(cfg, local=True)
    out["layers"] = layers = unstack_layers(params["layers"], cfg, fuse)
    unrolled_ = isinstance(layers, DecodeLayers)
    return DecodeParams(out, Layout(unrolled=unrolled_, fused=unrolled_ and layers.fused,
                                    unembed_t=cfg.tie_word_embeddings))


def unstack_layers(layers, cfg: ModelConfig, fuse: bool = True):
    """A stacked layer dict -> a `DecodeLayers` tuple of per-layer dicts (q/k/v and gate/up fused when ``fuse``);
    stacks deeper than UNROLL_MAX_LAYERS are returned as they are (they keep `lax.scan`)."""
    if isinstance(layers, DecodeLayers):
        return layers
    if isinstance(layers, LayerGroups):  # blocks of several shapes: unrolled as they are (unfused), or kept scanned
        return DecodeLayers(layers.per_layer(), False) if layers.num_layers <= UNROLL_MAX_LAYERS else layers
    num_layers = jax.tree.leaves(layers)[0].shape[0]
    if num_layers > UNROLL_MAX_LAYERS:
        return layers
    d = cfg.hidden_size
    per = []
    for i in range(num_layers):
        lp = {k: v[i] for k, v in layers.items()}
        if fuse:
            lp["wqkv"] = jnp.concatenate([lp.pop("wq").reshape(d, -1), lp.pop("wk").reshape(d, -1),
                                          lp.pop("wv").reshape(d, -1)], axis=1)
            if cfg.attention_bias:
                lp["bqkv"] = jnp.concatenate([lp.pop("bq").reshape(-1), lp.pop("bk").reshape(-1),
                                              lp.pop("bv").reshape(-1)])
            lp["wo"] = lp["wo"].reshape(-1, d)
            ex = cfg.arch.experts
            if ex is None or ex.shared_expert_size:  # a dense (or shared-expert) MLP; routed experts
                # stay apart
                lp["w_gu"] = jnp.concatenate([lp.pop("w_gate"), lp.pop("w_up")], axis=1)
        per.append(lp)
    return DecodeLayers(per, fuse)


def cast_params(params: Params, dtype) -> Params:
    return jax.tree.map(lambda a: a.astype(dtype) if jnp.issubdtype(a.dtype, jnp.floating) else a, params)


# ------------------------------------------------------------------------------------------------ sizes
def num_params(cfg: ModelConfig) -> int:
    """Parameters of the network (every expert counted)."""
    return count_params(cfg)


def active_params(cfg: ModelConfig) -> int:
    """Parameters one token runs through (a mixture of experts: k of E experts)."""
    ex = cfg.arch.experts
    if ex is None:
        return num_params(cfg)
    per_expert = 3 * cfg.hidden_size * ex.moe_intermediate_size
    sparse = sum(cfg.moe_layer(i) for i in range(cfg.num_layers))
    return num_params(cfg) - sparse * (ex.num_experts - ex.experts_per_tok) * per_expert


def flops_per_token(cfg: ModelConfig, context: int = 0) -> float:
    """Forward FLOPs for one token attending to ``context`` earlier tokens (2 per multiply-add)."""
    matmul = active_params(cfg) - cfg.vocab_size * cfg.hidden_size * (0 if cfg.tie_word_embeddings else 1)
    attn = cfg.num_layers * cfg.num_heads * attention_width(cfg) * max(context, 1)
    return 2.0 * (matmul + attn)


def attention_width(cfg: ModelConfig) -> int:
    """Multiply-adds per head per cached key of one query: q.k over the key's size, p.v over the value's (latent
    attention in its absorbed form reads the latent for both)."""
    la = cfg.arch.latent
    return (2 * la.kv_lora_rank + cfg.head_dim) if la is not None else 2 * cfg.head_dim


def layer_list(layers) -> list:
    """Every layer's own weights, in order, from any layers layout (stacked dict, `DecodeLayers`, `LayerGroups`)."""
    if isinstance(layers, DecodeLayers):
        return list(layers)
    if isinstance(layers, LayerGroups):
        return layers.per_layer()
    n = jax.tree.leaves(layers)[0].shape[0]
    return [{k: v[i] for k, v in layers.items()} for i in range(n)]
