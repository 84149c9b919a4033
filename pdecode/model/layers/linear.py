"""The matmul every weight goes through (`linear`): the one place a weight's storage meets the activations."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def linear(x: jax.Array, w: jax.Array, spec: str | None = None) -> jax.Array:
    """``x @ w`` (or ``einsum(spec, x, w)``) in the activations' dtype. Weights narrower than the activations
    (bfloat16 weights, float32 activations) run as a matmul of the weights' dtype accumulating in the activations'
    dtype, so the loop never upcasts a weight matrix (half the bytes read per decode step)."""
    pet = None
    if w.dtype != x.dtype:
        x, pet = x.astype(w.dtype), jnp.result_type(x)
    return jnp.matmul(x, w, preferred_element_type=pet) if spec is None else \
        jnp.einsum(spec, x, w, preferred_element_type=pet)
