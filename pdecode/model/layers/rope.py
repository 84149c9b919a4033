"""Rotary position embeddings: the frequencies of every rope variant pdecode reads (plain, linear, llama3, YaRN,
longrope; a local base for sliding layers; partial rotation), the cos/sin tables and the rotation itself, and the
config.json fields they come from (`rope_from_hf`)."""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp

from pdecode.config import ModelConfig
from pdecode.errors import ConfigError

ROPE_TYPES = ("default", "linear", "llama3", "yarn", "longrope")


def rope_from_hf(model_type: str, hf: dict[str, Any], params: dict | None = None):
    """(rope_theta, rope_scaling as the config's sorted tuple or None) from a config.json: transformers >= 5 nests
    them in ``rope_parameters`` (``params`` when a family passes one of several), older files use
    ``rope_theta`` / ``rope_scaling``. An unsupported scaling type is a ConfigError naming the family and value."""
    rope = dict(params if params is not None else (hf.get("rope_parameters") or {}))
    if rope and all(isinstance(v, dict) for v in rope.values()):  # per layer kind (Gemma 3): the global layers'
        rope = dict(rope.get("full_attention") or {})
    theta = rope.pop("rope_theta", None) or hf.get("rope_theta") or 10000.0
    scaling = (hf.get("rope_scaling") if params is None else None) or (rope if rope else None)
    if scaling:
        scaling = {k: v for k, v in scaling.items() if k != "rope_theta"}
        rtype = scaling.get("rope_type", scaling.get("type", "default"))
        if rtype == "default":
            scaling = None
        elif rtype not in ROPE_TYPES:
            raise ConfigError(f"{model_type}: rope_parameters.rope_type {rtype!r} is not supported (pdecode supports "
                              f"{', '.join(ROPE_TYPES)})")
        else:
            scaling = {**{k: tuple(v) if isinstance(v, list) else v for k, v in scaling.items()
                          if k not in ("type", "partial_rotary_factor")}, "rope_type": rtype}
            if rtype == "longrope":
                _longrope_from_hf(model_type, hf, scaling)
    partial = float(rope.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0)) or 1.0)
    if partial != 1.0:
        raise ConfigError(f"{model_type}: partial_rotary_factor {partial} is not supported (pdecode rotates the "
                          "whole head)")
    return float(theta), (tuple(sorted(scaling.items())) if scaling else None)


def _longrope_from_hf(model_type: str, hf: dict[str, Any], scaling: dict[str, Any]) -> None:
    """Complete a longrope ``scaling`` dict in place: its factor lists as float tuples and the original context
    resolved as transformers resolves it (a top-level ``original_max_position_embeddings`` wins over the rope
    dict's, then max_position_embeddings)."""
    for key in ("short_factor", "long_factor"):
        if not scaling.get(key):
            raise ConfigError(f"{model_type}: rope_parameters.rope_type 'longrope' needs {key} (a list with one "
                              "entry per rotated pair of the head)")
        scaling[key] = tuple(float(x) for x in scaling[key])
    orig = hf.get("original_max_position_embeddings") or scaling.get("original_max_position_embeddings") or \
        hf.get("max_position_embeddings", 2048)
    scaling["original_max_position_embeddings"] = int(orig)


def with_rope_context(cfg: ModelConfig, context: int) -> ModelConfig:
    """``cfg`` for a generation that holds up to ``context`` positions (prompt + new tokens): a longrope model rotates
    every forward of it with the factors that length calls for (`rope_long`), whatever cache span or phase a call
    attends over; other models unchanged."""
    sc = cfg.rope_scaling_dict
    if not sc or sc["rope_type"] != "longrope":
        return cfg
    return cfg.with_run(rope_long_factors=int(context) > int(sc["original_max_position_embeddings"]))


def rope_long(cfg: ModelConfig, context: int) -> bool:
    """Whether a call holding ``context`` positions (its attention's key length: a plain forward's T, a decode's
    KV-cache length) rotates with longrope's long factors: when it exceeds ``original_max_position_embeddings``
    (transformers picks by the length a forward reaches, `pdecode.model.families.phi3`). False for other ropes."""
    sc = cfg.rope_scaling_dict
    if not sc or sc["rope_type"] != "longrope":
        return False
    if cfg.run.rope_long_factors is not None:  # decided by the generation's context, not this call's
        return cfg.run.rope_long_factors
    return context > int(sc["original_max_position_embeddings"])


def rope_inv_freq(cfg: ModelConfig, theta: float | None = None, scaled: bool = True, long: bool = False):
    """Inverse RoPE frequencies [head_dim // 2] as numpy float64, with llama3/linear/yarn/longrope scaling applied
    (``scaled``); ``theta``: another base (the sliding layers' `local_rope_theta`); ``long``: longrope's long
    factors (else its short ones; `rope_long`)."""
    import numpy as np

    # the full-attention layers' rope (``scaled``): their head size, maybe part of it rotating
    dim = cfg.arch.full_head_dim(cfg) if scaled else cfg.head_dim
    dim = cfg.rotary_dims or dim
    rot = int((cfg.arch.rope_fraction if scaled else 1.0) * dim // 2)
    inv = 1.0 / ((theta or cfg.rope_theta) ** (np.arange(0, 2 * rot, 2, dtype=np.float64) / dim))
    inv = np.concatenate([inv, np.zeros(dim // 2 - rot)])  # frequency 0: those pairs pass through
    sc = cfg.rope_scaling_dict if scaled else None
    if not sc:
        return inv
    if sc["rope_type"] == "linear":
        return inv / float(sc["factor"])
    if sc["rope_type"] == "yarn":
        return _yarn_inv_freq(cfg, inv, sc)
    if sc["rope_type"] == "longrope":  # each frequency divided by its own factor, the short or the long set
        return inv / np.asarray(sc["long_factor" if long else "short_factor"], np.float64)
    # llama3: long wavelengths scaled by `factor`, short ones kept, a smooth blend between.
    factor = float(sc["factor"])
    low, high = float(sc.get("low_freq_factor", 1.0)), float(sc.get("high_freq_factor", 4.0))
    orig = float(sc.get("original_max_position_embeddings", 8192))
    low_wavelen, high_wavelen = orig / low, orig / high
    wavelen = 2 * math.pi / inv
    scaled = np.where(wavelen > low_wavelen, inv / factor, inv)
    smooth = (orig / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    mid = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return np.where(mid, blended, scaled)


def _yarn_inv_freq(cfg: ModelConfig, inv, sc: dict):
    """YaRN (Peng et al. 2023): frequencies below the correction range interpolated by ``factor``, those above
    kept, a linear ramp between (``beta_fast`` / ``beta_slow`` rotations over the original context)."""
    import numpy as np

    dim, base = 2 * len(inv), cfg.rope_theta
    factor = float(sc.get("factor") or cfg.max_position_embeddings / float(sc["original_max_position_embeddings"]))
    orig = float(sc["original_max_position_embeddings"])
    fast, slow = float(sc.get("beta_fast") or 32), float(sc.get("beta_slow") or 1)

    def corr(rot):
        return dim * math.log(orig / (rot * 2 * math.pi)) / (2 * math.log(base))

    low, high = corr(fast), corr(slow)
    if sc.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - low) / (high - low), 0, 1).astype(np.float64)
    extrapolate = 1 - ramp
    return (inv / factor) * (1 - extrapolate) + inv * extrapolate


def rope_attention_factor(cfg: ModelConfig) -> float:
    """The factor cos and sin are multiplied by (YaRN's attention temperature, longrope's scaling; 1 otherwise)."""
    sc = cfg.rope_scaling_dict
    if sc and sc["rope_type"] == "longrope":  # the same for the short and the long factors
        if sc.get("attention_factor") is not None:
            return float(sc["attention_factor"])
        orig = float(sc["original_max_position_embeddings"])
        factor = float(sc["factor"]) if sc.get("factor") is not None else cfg.max_position_embeddings / orig
        return 1.0 if factor <= 1.0 else math.sqrt(1.0 + math.log(factor) / math.log(orig))
    if not sc or sc["rope_type"] != "yarn":
        return 1.0
    if sc.get("attention_factor") is not None:
        return float(sc["attention_factor"])
    factor = float(sc.get("factor") or cfg.max_position_embeddings / float(sc["original_max_position_embeddings"]))

    def mscale(scale, m=1.0):
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    if sc.get("mscale") and sc.get("mscale_all_dim"):
        return mscale(factor, float(sc["mscale"])) / mscale(factor, float(sc["mscale_all_dim"]))
    return mscale(factor)


def rope_tables(cfg: ModelConfig, positions_BT: jax.Array, table=None, local: bool = False, long: bool = False
                ) -> tuple[jax.Array, jax.Array]:
    """cos, sin [B, T, 1, hd/2] for the given positions (once per forward, shared by all layers of a kind; ``local``:
    the sliding layers' rope, `ModelConfig.local_rope_theta`, unscaled; ``long``: longrope's long factors,
    `config.rope_long`). With ``table`` (`rope_table`, built once per call by `decode_layout`) they are gathered
    instead of computed: inside a decode loop XLA would otherwise recompute cos/sin in every layer's rotation, for
    every element."""
    if table is not None:
        pos = jnp.clip(positions_BT, 0, table[0].shape[0] - 1)  # padding/invalid slots may run past the end
        return table[0][pos][:, :, None, :], table[1][pos][:, :, None, :]
    inv = rope_inv_freq(cfg, cfg.local_rope_theta, scaled=False) if local else rope_inv_freq(cfg, long=long)
    ang = positions_BT.astype(jnp.float32)[..., None] * jnp.asarray(inv, jnp.float32)
    cos, sin = jnp.cos(ang)[:, :, None, :], jnp.sin(ang)[:, :, None, :]
    f = 1.0 if local else rope_attention_factor(cfg)
    return (cos, sin) if f == 1.0 else (cos * f, sin * f)


ROPE_TABLE_MAX = 1 << 20  # entries (positions x hd/2): larger contexts compute cos/sin per forward instead


def rope_table_fits(cfg: ModelConfig) -> bool:
    """Whether the context is short enough for a table of every position's cos/sin (`rope_table`)."""
    return cfg.max_position_embeddings * cfg.head_dim // 2 <= ROPE_TABLE_MAX


def rope_table(cfg: ModelConfig, local: bool = False, long: bool = False) -> tuple[jax.Array, jax.Array] | None:
    """cos, sin [max_position_embeddings, hd/2] (`rope_tables` at every position), or None when the context is too
    long for a table to be worth its memory."""
    if not rope_table_fits(cfg):
        return None
    cos, sin = rope_tables(cfg, jnp.arange(cfg.max_position_embeddings, dtype=jnp.int32)[None], local=local,
                           long=long)
    return cos[0, :, 0], sin[0, :, 0]


def has_local_rope(cfg: ModelConfig) -> bool:
    """Whether the sliding layers rotate with a rope of their own (Gemma 3)."""
    return cfg.local_rope_theta is not None and "sliding" in cfg.layer_kinds()


def apply_rope(x_BTHD: jax.Array, rope: tuple[jax.Array, jax.Array]) -> jax.Array:
    """Rotary embedding, half-split layout (as Llama/Qwen checkpoints in HF format expect)."""
    cos, sin = rope
    xf = x_BTHD.astype(jnp.float32)
    x1, x2 = jnp.split(xf, 2, axis=-1)
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x_BTHD.dtype)


def rotate(cfg: ModelConfig, x_BTHD: jax.Array, rope) -> jax.Array:
    """`apply_rope` over the whole head, or only its first ``cfg.rotary_dims`` (GLM's partial rotary; the rest
    passes through)."""
    r = cfg.rotary_dims
    if not r or r == x_BTHD.shape[-1]:
        return apply_rope(x_BTHD, rope)
    return jnp.concatenate([apply_rope(x_BTHD[..., :r], rope), x_BTHD[..., r:]], axis=-1)
