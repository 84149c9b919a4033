"""KV cache: a preallocated pytree with per-row lengths.

Layout ``k, v: [layers, batch, max_len, kv_heads, head_dim]`` and ``lengths: [batch]`` (committed tokens per row;
slot ``s`` of a row holds position ``s``). Every operation is by index with static shapes, so it runs inside jit and
``lax.while_loop``:

* ``write_layer``: scatter k fresh tokens of one layer at per-row offsets (used inside the forward pass);
* ``commit``: after a verify pass wrote N fresh tokens at ``lengths..lengths+N-1``, move the accepted ones
  (a gather by node index, e.g. an accepted tree path) to ``lengths..lengths+n-1`` and advance ``lengths``;
* ``rollback``: forget the last n tokens of each row (only ``lengths`` moves; stale slots are masked out).
"""

from __future__ import annotations

import jax
from flax import struct
import jax.numpy as jnp

from pdecode.config import ModelConfig


@struct.dataclass
class KVCache:
    k: jax.Array  # [L, B, S, KV, hd]
    v: jax.Array  # [L, B, S, KV, hd]
    lengths: jax.Array  # [B] int32, committed tokens per row

    @property
    def max_len(self) -> int:
        return self.k.shape[2]

    @property
    def batch(self) -> int:
        return self.k.shape[1]


def init_cache(cfg: ModelConfig, batch: int, max_len: int, dtype=jnp.float32, num_layers: int | None = None) -> KVCache:
    shape = (num_layers or cfg.num_layers, batch, max_len, cfg.num_kv_heads, cfg.head_dim)
    return KVCache(k=jnp.zeros(shape, dtype), v=jnp.zeros(shape, dtype), lengths=jnp.zeros((batch,), jnp.int32))


def _row_slots(offsets_B: jax.Array, t: int) -> jax.Array:
    return offsets_B[:, None] + jnp.arange(t, dtype=jnp.int32)[None, :]  # [B, T]


def write_layer(cache: KVCache, layer, k_BTKH: jax.Array, v_BTKH: jax.Array, offsets_B: jax.Array) -> KVCache:
    """Write fresh keys/values of one layer at slots ``offsets[b] + t``; slots past max_len are dropped."""
    b, t = k_BTKH.shape[:2]
    rows = jnp.arange(b)[:, None]
    slots = _row_slots(offsets_B, t)
    k = cache.k.at[layer, rows, slots].set(k_BTKH.astype(cache.k.dtype), mode="drop")
    v = cache.v.at[layer, rows, slots].set(v_BTKH.astype(cache.v.dtype), mode="drop")
    return cache.replace(k=k, v=v)


def advance(cache: KVCache, n_B: jax.Array) -> KVCache:
    """Accept the first n fresh tokens of each row as they are (chains: no data moves)."""
    return cache.replace(lengths=jnp.minimum(cache.lengths + n_B.astype(jnp.int32), cache.max_len))


def commit(cache: KVCache, node_idx_BA: jax.Array, n_B: jax.Array) -> KVCache:
    """Keep fresh tokens ``node_idx[b, :n[b]]`` (indices relative to ``lengths[b]``) as the next n committed slots.

    The fresh region was written by a verify pass at ``lengths .. lengths + N - 1``; an accepted tree path is a
    list of node indices in depth order. Entries past ``n[b]`` are ignored (they may hold anything).
    """
    b, a = node_idx_BA.shape
    rows = jnp.arange(b)[:, None]
    start = cache.lengths[:, None]
    src = jnp.clip(start + node_idx_BA, 0, cache.max_len - 1)
    dst = start + jnp.arange(a, dtype=jnp.int32)[None, :]
    keep = jnp.arange(a)[None, :] < n_B[:, None]
    # Rows/slots not kept scatter out of range and are dropped.
    dst = jnp.where(keep, dst, cache.max_len)
    k_src = cache.k[:, rows, src]  # [L, B, A, KV, hd]
    v_src = cache.v[:, rows, src]
    k = cache.k.at[:, rows, dst].set(k_src, mode="drop")
    v = cache.v.at[:, rows, dst].set(v_src, mode="drop")
    return KVCache(k=k, v=v, lengths=jnp.minimum(cache.lengths + n_B.astype(jnp.int32), cache.max_len))


def rollback(cache: KVCache, n_B: jax.Array) -> KVCache:
    """Forget the last n committed tokens of each row."""
    return cache.replace(lengths=jnp.maximum(cache.lengths - n_B.astype(jnp.int32), 0))


def set_lengths(cache: KVCache, lengths_B: jax.Array) -> KVCache:
    return cache.replace(lengths=lengths_B.astype(jnp.int32))
