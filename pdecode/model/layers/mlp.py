"""The gated MLP and its activations."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pdecode.config import ModelConfig
from pdecode.model.layers.linear import linear

Params = dict


def glu_mlp(cfg: ModelConfig, lp: Params, h: jax.Array, fused: bool) -> jax.Array:
    """The gated MLP (gate/up/down, the config's activation); ``fused``: lp holds w_gu [D, 2F]."""
    if fused:
        g, u = jnp.split(linear(h, lp["w_gu"]), 2, axis=-1)
    else:
        g = linear(h, lp["w_gate"], "btd,df->btf")
        u = linear(h, lp["w_up"], "btd,df->btf")
    return linear(activation(cfg, g) * u, lp["w_down"])


def activation(cfg: ModelConfig, x: jax.Array) -> jax.Array:
    if cfg.hidden_act == "gelu_tanh":
        return jax.nn.gelu(x, approximate=True)
    return jax.nn.silu(x)
