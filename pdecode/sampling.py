"""Logits processing and sampling.

The warped distribution is the one every method samples from and verifies against: temperature, then top-k, then
top-p (nucleus), in that order, as `transformers` does. ``temperature == 0`` means greedy (argmax).

`Sampling` is the static part (jit-static: greedy or not, top-k size, whether top-p is on); the temperature and
top-p values are traced scalars so changing them does not recompile.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

from pdecode.errors import InputError

NEG_INF = -1e30


@dataclasses.dataclass(frozen=True)
class Sampling:
    greedy: bool = True
    top_k: int = 0  # 0 = off
    use_top_p: bool = False


def validate(temperature: float, top_k: int, top_p: float, vocab_size: int | None = None) -> Sampling:
    if not isinstance(temperature, (int, float)) or math.isnan(temperature) or temperature < 0:
        raise InputError(f"temperature must be >= 0 (0 = greedy), got {temperature!r}")
    if not isinstance(top_k, int) or top_k < 0:
        raise InputError(f"top_k must be an integer >= 0 (0 = off), got {top_k!r}")
    if vocab_size is not None and top_k > vocab_size:
        raise InputError(f"top_k ({top_k}) is larger than the vocabulary ({vocab_size})")
    if not isinstance(top_p, (int, float)) or not (0.0 < top_p <= 1.0):
        raise InputError(f"top_p must be in (0, 1], got {top_p!r}")
    return Sampling(greedy=temperature == 0, top_k=int(top_k), use_top_p=top_p < 1.0)


def warp(logits: jax.Array, s: Sampling, temperature, top_p) -> jax.Array:
    """Float32 logits of the warped distribution (filtered entries at -1e30). Greedy returns logits unchanged."""
    x = logits.astype(jnp.float32)
    if s.greedy:
        return x
    x = x / jnp.maximum(jnp.asarray(temperature, jnp.float32), 1e-6)
    if s.top_k:
        kth = jax.lax.top_k(x, s.top_k)[0][..., -1:]
        x = jnp.where(x < kth, NEG_INF, x)
    if s.use_top_p:
        x = _top_p(x, top_p)
    return x


def _top_p(x: jax.Array, top_p) -> jax.Array:
    # Keep the smallest set of top tokens whose mass reaches top_p (the top token always stays).
    sorted_x = jnp.sort(x, axis=-1)[..., ::-1]
    probs = jax.nn.softmax(sorted_x, axis=-1)
    mass_before = jnp.cumsum(probs, axis=-1) - probs
    keep_sorted = mass_before < top_p
    # Smallest kept logit is the threshold.
    thresh = jnp.min(jnp.where(keep_sorted, sorted_x, jnp.inf), axis=-1, keepdims=True)
    return jnp.where(x < thresh, NEG_INF, x)


def argmax(x: jax.Array) -> jax.Array:
    """Index of the (first) maximum along the last axis, int32. A max then a min over matching indices: the same
    result as ``jnp.argmax``, kept because on CPU it runs faster than XLA's variadic-reduce argmax
    (docs/performance_code_notes.md)."""
    mx = jnp.max(x, axis=-1, keepdims=True)
    n = x.shape[-1]
    first = jnp.min(jnp.where(x == mx, jnp.arange(n, dtype=jnp.int32), n), axis=-1)
    return jnp.minimum(first, n - 1).astype(jnp.int32)  # (all-NaN rows would otherwise point past the end)


def probs(logits: jax.Array, s: Sampling, temperature, top_p) -> jax.Array:
    """Probabilities of the warped distribution; greedy gives a one-hot of the argmax."""
    if s.greedy:
        return jax.nn.one_hot(argmax(logits), logits.shape[-1], dtype=jnp.float32)
    return jax.nn.softmax(warp(logits, s, temperature, top_p), axis=-1)


def sample(key: jax.Array, logits: jax.Array, s: Sampling, temperature, top_p) -> jax.Array:
    """One token per leading index: argmax when greedy, else a draw from the warped distribution."""
    if s.greedy:
        return argmax(logits)
    return gumbel_argmax(key, warp(logits, s, temperature, top_p))


def gumbel_argmax(key: jax.Array, logits: jax.Array) -> jax.Array:
    """A draw from softmax(logits) along the last axis (the Gumbel-max trick, as `jax.random.categorical`)."""
    return argmax(logits + jax.random.gumbel(key, logits.shape, jnp.float32))


def sample_from_probs(key: jax.Array, p: jax.Array) -> jax.Array:
    """Draw from (unnormalised, non-negative) probabilities along the last axis."""
    logp = jnp.where(p > 0, jnp.log(jnp.maximum(p, 1e-38)), NEG_INF)
    return gumbel_argmax(key, logp)
