"""The KV cache every decode loop uses: a preallocated pytree of keys, values and per-row lengths, and the operations
on it.

`KVCache` holds ``k``, ``v`` and ``lengths [batch]``, the committed tokens per row; slot ``s`` of a row holds
position ``s``, and slots at or past ``lengths`` are stale or free (masks hide them). Keys are stored transposed so
both attention matmuls get their operands in the layout CPU/GPU matmul kernels want:

* stacked (the default): ``k [layers, batch, kv_heads, head_dim, max_len]``, ``v [layers, batch, kv_heads, max_len,
  head_dim]``;
* per layer (``per_layer=True``, used with the unrolled decode layout of shallow models): ``k`` and ``v`` are tuples
  of one ``[batch, kv_heads, head_dim, max_len]`` / ``[batch, kv_heads, max_len, head_dim]`` buffer per layer, so a
  layer reads its own buffer with no slice copied per step. Layers of different shapes (Gemma 4's full-attention
  layers: other head size and kv heads) have buffers of their own shapes, and a kv-shared layer none (``None``: it
  reads the buffer of `ModelConfig.kv_source`, its arch section's answer); such configs always use this layout.
* latent attention (DeepSeek-V3's MLA): ``k`` holds the one rotated key per token (``kv_heads`` 1, ``head_dim`` the
  rope size) and ``v`` the latent (``[.., 1, max_len, kv_lora_rank]``): the compressed cache, nothing per head.

Every operation works by index on static shapes, so it runs inside jit and ``lax.while_loop``:

* `init_cache`: an empty cache of either layout;
* `write_layer`: scatter T fresh tokens of one layer at per-row offsets (called inside the forward pass; lengths do
  not move);
* `advance`: keep the first n fresh tokens of each row where they are (a chain);
* `commit`: after a verify pass wrote N fresh tokens at ``lengths .. lengths + N - 1``, move the accepted ones (a
  gather by node index, e.g. an accepted tree path) to ``lengths .. lengths + n - 1`` and advance ``lengths``;
* `rollback`: forget the last n committed tokens of each row (only ``lengths`` moves);
* `grow`: more slots at the end (a decode loop that runs in phases attends over a cache no longer than it needs);
* `head`, `put_head`: the first n slots as a cache of their own, and back (the serving engine's steps attend over the
  span its live rows need);
* `set_lengths`, `where_rows`: set the lengths; pick each row from one of two caches.

`PagedKVCache` is the same cache with its positions in fixed-size pages of a pool that rows share (the serving
engine's slots, `pdecode.Engine(kv_pages=...)`): ``pages [B, n]`` maps row b's slots ``j*page .. (j+1)*page - 1`` to
a pool page (the pool's size, an index past the pool, where the row owns none: writes there are dropped, reads give
zeros). Each layer's keys and values are gathered into the contiguous ``[B, KV, hd, n*page]`` view attention reads
(`PagedKVCache.layer`, one layer at a time: the view of all layers never exists at once); `write_layer`, `advance`,
`commit`, `rollback`, `head` / `put_head` and `set_lengths` take either kind, so every decode loop runs on it
unchanged. `init_paged` makes an empty one; `put_rows` writes contiguous rows (a prefill) into their pages. The
serving engine's row operations take either kind too: `put_slots` (prefilled rows over some rows), `rows_head` /
`put_rows_head` (the first rows alone, and back).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
from flax import struct
import jax.numpy as jnp

from pdecode.config import ModelConfig
from pdecode.model.groups import LayerRef, layer_index


@dataclasses.dataclass(frozen=True)
class CacheGroups:
    """Where each layer's keys and values sit in a grouped cache (layers of several shapes scanned by group,
    `pdecode.model.groups`): ``where[i]`` is (buffer, entry) of layer i's own, None for a kv-shared layer; buffer b
    stacks the layers ``period[b]`` apart of one position of a group."""

    where: tuple
    period: tuple

    def locate(self, i):
        """(buffer, entry) of layer ``i``: a static int, or a `LayerRef` (its entry traced)."""
        if isinstance(i, LayerRef):
            b, r0 = self.where[i.rep]
            return b, r0 + (i.index - i.rep) // self.period[b]
        return self.where[int(i)]


class _Rows:
    """What both cache kinds answer alike (their fields ``k``, ``v``, ``lengths``, ``groups``)."""

    @property
    def per_layer(self) -> bool:
        """One buffer per layer, no layer axis (the unrolled decode layout)."""
        return isinstance(self.k, tuple) and self.groups is None

    @property
    def grouped(self) -> bool:
        """One stacked buffer per position of each group of layers (`CacheGroups`)."""
        return self.groups is not None

    @property
    def dtype(self):
        """The dtype keys and values are stored in."""
        return jax.tree.leaves(self.k)[0].dtype

    @property
    def batch(self) -> int:
        return self.lengths.shape[0]


@struct.dataclass
class KVCache(_Rows):
    k: Any  # [L, B, KV, hd, S], a tuple of L arrays [B, KV, hd, S], or (grouped) a tuple of [n, B, KV, hd, S]
    v: Any  # [L, B, KV, S, hd], a tuple of L arrays [B, KV, S, hd], or (grouped) a tuple of [n, B, KV, S, hd]
    lengths: jax.Array  # [B] int32, committed tokens per row
    groups: Any = struct.field(pytree_node=False, default=None)  # CacheGroups of a grouped cache, else None

    @property
    def max_len(self) -> int:
        return jax.tree.leaves(self.v)[0].shape[-2]

    def layer(self, i) -> tuple[jax.Array, jax.Array]:
        """Keys [B, KV, hd, S] and values [B, KV, S, hd] of layer i (an int, traced or not, or a `LayerRef`)."""
        if self.grouped:
            b, r = self.groups.locate(i)
            return self.k[b][r], self.v[b][r]
        i = layer_index(i)
        return self.k[i], self.v[i]


@struct.dataclass
class PagedKVCache(_Rows):
    k: Any  # pool [L, P, KV, hd, page], or a tuple of L arrays [P, KV, hd, page] (None: a kv-shared layer)
    v: Any  # pool [L, P, KV, page, hd], or a tuple of L arrays [P, KV, page, hd]
    lengths: jax.Array  # [B] int32, committed tokens per row
    pages: jax.Array  # [B, n] int32: the pool page holding row b's slots j*page.. (P, past the pool: none)
    groups: Any = struct.field(pytree_node=False, default=None)  # CacheGroups of a grouped cache, else None

    @property
    def page_size(self) -> int:
        return jax.tree.leaves(self.v)[0].shape[-2]

    @property
    def num_pages(self) -> int:
        """Pages in the pool."""
        a = jax.tree.leaves(self.v)[0]
        return a.shape[a.ndim - 4]

    @property
    def max_len(self) -> int:
        return self.pages.shape[1] * self.page_size

    def layer(self, i) -> tuple[jax.Array, jax.Array]:
        """Keys [B, KV, hd, S] and values [B, KV, S, hd] of layer i, gathered from each row's pages (S = n*page)."""
        if self.grouped:
            b, r = self.groups.locate(i)
            k, v = self.k[b][r], self.v[b][r]
        else:
            k, v = self.k[layer_index(i)], self.v[layer_index(i)]
        return _gather_pages(k, self.pages, True), _gather_pages(v, self.pages, False)


def is_cache(x) -> bool:
    """Whether ``x`` is a KV cache of any kind (contiguous, per layer, grouped or paged): a leaf to stop at when
    mapping over a state that holds caches."""
    return isinstance(x, _Rows)


def _gather_pages(pool: jax.Array, pages_Bn: jax.Array, keys: bool) -> jax.Array:
    """Rows' pages of one pool (keys [.., P, KV, hd, page], values [.., P, KV, page, hd]; ``..``: a layer axis or
    none) as the contiguous layout (keys [.., B, KV, hd, n*page], values [.., B, KV, n*page, hd]); a page index past
    the pool reads zeros."""
    lead = pool.ndim - 4
    x = jnp.take(pool, pages_Bn, axis=lead, mode="fill", fill_value=0)  # [.., B, n, KV, a, b]
    b, n = pages_Bn.shape
    kv_, a, c = x.shape[lead + 2:]
    pre, at = tuple(range(lead)), x.shape[:lead]
    if keys:  # [.., B, KV, hd, n, page]
        return x.transpose(pre + (lead, lead + 2, lead + 3, lead + 1, lead + 4)).reshape(at + (b, kv_, a, n * c))
    return x.transpose(pre + (lead, lead + 2, lead + 1, lead + 3, lead + 4)).reshape(at + (b, kv_, n * a, c))


def init_paged(cfg: ModelConfig, batch: int, max_len: int, num_pages: int, page_size: int, dtype=jnp.float32,
               num_layers: int | None = None, per_layer: bool = False) -> PagedKVCache:
    """An empty paged cache: a pool of ``num_pages`` pages of ``page_size`` positions; ``batch`` rows of ``max_len``
    slots (a multiple of ``page_size``) owning no page yet."""
    if max_len % page_size:
        raise ValueError(f"init_paged: max_len {max_len} is not a multiple of the page size {page_size}")
    like = jax.eval_shape(lambda: init_cache(cfg, 1, page_size, dtype, num_layers, per_layer))  # one page's shapes

    def pool(a):  # one row of one page -> num_pages pages (the row axis: after a layer axis, if any)
        lead = _row_axis(a)
        return None if a is None else jnp.zeros(a.shape[:lead] + (num_pages,) + a.shape[lead + 1:], dtype)

    k, v = jax.tree.map(pool, like.k), jax.tree.map(pool, like.v)
    return PagedKVCache(k=k, v=v, lengths=jnp.zeros((batch,), jnp.int32),
                        pages=jnp.full((batch, max_len // page_size), num_pages, jnp.int32), groups=like.groups)


def _contiguous(cache, op: str):
    if isinstance(cache, PagedKVCache):
        raise TypeError(f"{op} takes a contiguous KVCache (a paged cache's rows share a pool)")


def _page_of(cache: PagedKVCache, slots_BT: jax.Array):
    """Row slots [B, T] -> (pool page, offset in it); a slot past the view or in no page -> page P (dropped)."""
    page, n = cache.page_size, cache.pages.shape[1]
    j = slots_BT // page
    pg = jnp.take_along_axis(cache.pages, jnp.clip(j, 0, n - 1), axis=1)
    return jnp.where((j < n) & (slots_BT >= 0), pg, cache.num_pages), slots_BT % page


def put_rows(cache: PagedKVCache, rows: KVCache, slot_A: jax.Array, pages_Bn: jax.Array) -> PagedKVCache:
    """``cache`` with the page table ``pages_Bn`` and contiguous ``rows`` (A rows of a whole number of pages up to the
    view's: a prefill) written into the first pages of slots ``slot_A``, their lengths set."""
    page = cache.page_size
    n = rows.max_len // page
    if rows.max_len % page or n > pages_Bn.shape[1]:
        raise ValueError(f"put_rows: rows of {rows.max_len} slots into a view of {pages_Bn.shape[1]} pages of "
                         f"{page}")
    dst = pages_Bn[slot_A, :n]  # [A, n]: the rows' first pages (a short prefill fills a few)

    def put(pool, x, s_axis):  # x [.., A, KV, hd, S] (keys, s_axis -1) or [.., A, KV, S, hd] (values, -2)
        lead = x.ndim - 4
        shape = list(x.shape)
        shape[s_axis:s_axis + 1 if s_axis != -1 else None] = [n, page]
        y = x.reshape(shape)  # keys [.., A, KV, hd, n, page]; values [.., A, KV, n, page, hd]
        y = jnp.moveaxis(y, -2 if s_axis == -1 else -3, lead + 1).astype(pool.dtype)  # [.., A, n, KV, ...]
        idx = (slice(None),) * lead + (dst,)
        return pool.at[idx].set(y, mode="drop")

    k = jax.tree.map(lambda p, x: put(p, x, -1), cache.k, rows.k)
    v = jax.tree.map(lambda p, x: put(p, x, -2), cache.v, rows.v)
    return cache.replace(k=k, v=v, lengths=cache.lengths.at[slot_A].set(rows.lengths), pages=pages_Bn.astype(jnp.int32))


def put_slots(cache, rows: KVCache, slot_A: jax.Array, pages_Bn: jax.Array | None = None):
    """``cache`` (either kind) with contiguous ``rows`` (A prefilled rows: a contiguous cache's of its own length, a
    paged one's a whole number of pages) written over its rows ``slot_A``; a paged cache takes the page table
    ``pages_Bn`` with them (`put_rows`)."""
    if isinstance(cache, PagedKVCache):
        return put_rows(cache, rows, slot_A, pages_Bn)
    for i in range(rows.batch):
        def put(big, small, ax, i=i):
            row = jax.lax.slice_in_dim(small, i, i + 1, axis=ax)
            return jax.lax.dynamic_update_slice_in_dim(big, row.astype(big.dtype), slot_A[i], axis=ax)

        cache = cache.replace(k=jax.tree.map(lambda a, b: put(a, b, _row_axis(a)), cache.k, rows.k),
                              v=jax.tree.map(lambda a, b: put(a, b, _row_axis(a)), cache.v, rows.v),
                              lengths=put(cache.lengths, rows.lengths, 0))
    return cache


def rows_head(cache, rows: int):
    """The cache's first ``rows`` rows (a copy; a paged cache's table and lengths cut, its pool shared)."""
    if isinstance(cache, PagedKVCache):
        return cache.replace(lengths=cache.lengths[:rows], pages=cache.pages[:rows])
    cut = lambda a: jax.lax.slice_in_dim(a, 0, rows, axis=_row_axis(a))  # noqa: E731
    return cache.replace(k=jax.tree.map(cut, cache.k), v=jax.tree.map(cut, cache.v), lengths=cache.lengths[:rows])


def put_rows_head(cache, part):
    """``cache`` with its first rows replaced by ``part``'s (a `rows_head` after steps ran on it; a paged cache's pool
    was written in place, its table unchanged)."""
    lengths = cache.lengths.at[: part.batch].set(part.lengths)
    if isinstance(cache, PagedKVCache):
        return cache.replace(k=part.k, v=part.v, lengths=lengths)
    put = lambda a, b: jax.lax.dynamic_update_slice_in_dim(a, b.astype(a.dtype), 0, _row_axis(a))  # noqa: E731
    return cache.replace(k=jax.tree.map(put, cache.k, part.k), v=jax.tree.map(put, cache.v, part.v), lengths=lengths)


def _row_axis(a) -> int:
    """The row (batch, or a pool's page) axis of one key or value buffer: after its layer axis, if it has one."""
    return a.ndim - 4


def value_dim(cfg: ModelConfig, i: int) -> int:
    """The size of what layer ``i``'s cache holds per token as its "values": the head size, or with latent
    attention the latent (``kv_lora_rank``; its "keys" are then the one rotated key of ``head_dim``)."""
    la = cfg.arch.latent
    return la.kv_lora_rank if la is not None else cfg.layer_attention(i)[1]


def uniform_layers(cfg: ModelConfig) -> bool:
    """Whether every layer has a cache of its own of one shape (else the cache is per layer or grouped)."""
    return not (cfg.arch.kv_shared_layers or len({cfg.layer_attention(i) for i in range(cfg.num_layers)}) > 1)


def init_cache(cfg: ModelConfig, batch: int, max_len: int, dtype=jnp.float32, num_layers: int | None = None,
               per_layer: bool = False) -> KVCache:
    n = num_layers or cfg.num_layers
    kv, hd = cfg.layer_attention(0)  # every layer's, when uniform
    k_shape = (batch, kv, hd, max_len)
    v_shape = (batch, kv, max_len, value_dim(cfg, 0))
    uniform = uniform_layers(cfg)
    if not uniform and not per_layer:  # one stacked buffer per position of each group of layers
        return _init_grouped(cfg, n, batch, max_len, dtype)
    if not uniform:
        shapes = [cfg.layer_attention(i) if cfg.kv_source(i) == i else None for i in range(n)]
        k = tuple(None if s is None else jnp.zeros((batch, s[0], s[1], max_len), dtype) for s in shapes)
        v = tuple(None if s is None else jnp.zeros((batch, s[0], max_len, value_dim(cfg, i)), dtype)
                  for i, s in enumerate(shapes))
    elif per_layer:
        k = tuple(jnp.zeros(k_shape, dtype) for _ in range(n))
        v = tuple(jnp.zeros(v_shape, dtype) for _ in range(n))
    else:
        k, v = jnp.zeros((n,) + k_shape, dtype), jnp.zeros((n,) + v_shape, dtype)
    return KVCache(k=k, v=v, lengths=jnp.zeros((batch,), jnp.int32))


def _init_grouped(cfg: ModelConfig, n: int, batch: int, max_len: int, dtype) -> KVCache:
    from pdecode.model.family import family_of

    where, period, ks, vs = [None] * n, [], [], []
    for g in family_of(cfg).layer_plan(cfg, n):
        for u in range(g.period):
            i0 = g.first + u
            if cfg.kv_source(i0) != i0:  # kv-shared (every repeat alike: the plan groups them so)
                continue
            kv, hd = cfg.layer_attention(i0)
            for r in range(g.count):
                where[g.layer(r, u)] = (len(ks), r)
            period.append(g.period)
            ks.append(jnp.zeros((g.count, batch, kv, hd, max_len), dtype))
            vs.append(jnp.zeros((g.count, batch, kv, max_len, value_dim(cfg, i0)), dtype))
    return KVCache(k=tuple(ks), v=tuple(vs), lengths=jnp.zeros((batch,), jnp.int32),
                   groups=CacheGroups(tuple(where), tuple(period)))


def _row_slots(offsets_B: jax.Array, t: int) -> jax.Array:
    return offsets_B[:, None] + jnp.arange(t, dtype=jnp.int32)[None, :]  # [B, T]


def write_layer(cache: KVCache, layer, k_BKTH: jax.Array, v_BKTH: jax.Array, offsets_B: jax.Array) -> KVCache:
    """Write fresh keys/values [B, KV, T, hd] of one layer at slots ``offsets[b] + t``; slots past max_len are
    dropped."""
    return _write_slots(cache, layer, k_BKTH, v_BKTH, _row_slots(offsets_B, k_BKTH.shape[2]))


def _write_slots(cache: KVCache, layer, k_BKTH: jax.Array, v_BKTH: jax.Array, slots_BT: jax.Array) -> KVCache:
    """`write_layer` at any slots [B, T] per row (past max_len: dropped)."""
    rows, slots = _slot_index(cache, slots_BT)
    # advanced indices (rows, slots) around slices: the indexed shape is [B, T, KV, hd] for both layouts
    k_new, v_new = jnp.swapaxes(k_BKTH, 1, 2), jnp.swapaxes(v_BKTH, 1, 2)
    if cache.grouped:
        b, r = cache.groups.locate(layer)
        k, v = list(cache.k), list(cache.v)
        k[b] = k[b].at[r, rows, :, :, slots].set(k_new.astype(k[b].dtype), mode="drop")
        v[b] = v[b].at[r, rows, :, slots].set(v_new.astype(v[b].dtype), mode="drop")
        return cache.replace(k=tuple(k), v=tuple(v))
    layer = layer_index(layer)
    if cache.per_layer:
        k, v = list(cache.k), list(cache.v)
        k[layer] = k[layer].at[rows, :, :, slots].set(k_new.astype(k[layer].dtype), mode="drop")
        v[layer] = v[layer].at[rows, :, slots].set(v_new.astype(v[layer].dtype), mode="drop")
        return cache.replace(k=tuple(k), v=tuple(v))
    k = cache.k.at[layer, rows, :, :, slots].set(k_new.astype(cache.k.dtype), mode="drop")
    v = cache.v.at[layer, rows, :, slots].set(v_new.astype(cache.v.dtype), mode="drop")
    return cache.replace(k=k, v=v)


def _slot_index(cache, slots_BT: jax.Array):
    """The (row, slot) indices [B, T] of each row's slots ``slots_BT`` in the buffers: a paged cache's (pool page,
    offset in it)."""
    if isinstance(cache, PagedKVCache):
        return _page_of(cache, slots_BT)
    return jnp.arange(slots_BT.shape[0])[:, None], slots_BT


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
    if isinstance(cache, PagedKVCache):  # the same moves between (page, offset) pairs
        sp, so = _page_of(cache, src)
        dp, do = _page_of(cache, dst)
        get = lambda x, i: x.at[i].get(mode="fill", fill_value=0)  # noqa: E731

        def move_k(x):  # [.., P, KV, hd, page]
            lead = (slice(None),) * _row_axis(x)
            return x.at[lead + (dp, slice(None), slice(None), do)].set(
                get(x, lead + (sp, slice(None), slice(None), so)), mode="drop")

        def move_v(x):  # [.., P, KV, page, hd]
            lead = (slice(None),) * _row_axis(x)
            return x.at[lead + (dp, slice(None), do)].set(get(x, lead + (sp, slice(None), so)), mode="drop")

        return cache.replace(k=jax.tree.map(move_k, cache.k), v=jax.tree.map(move_v, cache.v),
                             lengths=jnp.minimum(cache.lengths + n_B.astype(jnp.int32), cache.max_len))

    def commit_k(x):  # [.., B, KV, hd, S]
        lead = (slice(None),) * _row_axis(x)
        return x.at[lead + (rows, slice(None), slice(None), dst)].set(x[lead + (rows, slice(None), slice(None), src)],
                                                                       mode="drop")

    def commit_v(x):  # [.., B, KV, S, hd]
        lead = (slice(None),) * _row_axis(x)
        return x.at[lead + (rows, slice(None), dst)].set(x[lead + (rows, slice(None), src)], mode="drop")

    return cache.replace(k=jax.tree.map(commit_k, cache.k), v=jax.tree.map(commit_v, cache.v),
                         lengths=jnp.minimum(cache.lengths + n_B.astype(jnp.int32), cache.max_len))


def rollback(cache: KVCache, n_B: jax.Array) -> KVCache:
    """Forget the last n committed tokens of each row."""
    return cache.replace(lengths=jnp.maximum(cache.lengths - n_B.astype(jnp.int32), 0))


def grow(cache: KVCache, max_len: int) -> KVCache:
    """The same cache with ``max_len`` slots (new slots zero, at the end); lengths unchanged."""
    _contiguous(cache, "grow")
    extra = max_len - cache.max_len
    if extra < 0:
        raise ValueError(f"grow: the cache has {cache.max_len} slots, more than the {max_len} asked for")
    if extra == 0:
        return cache

    def pad(a, axis):
        widths = [(0, 0)] * a.ndim
        widths[axis] = (0, extra)
        return jnp.pad(a, widths)

    # keys [.., hd, S] grow on the last axis, values [.., S, hd] on the one before
    return cache.replace(k=jax.tree.map(lambda a: pad(a, -1), cache.k), v=jax.tree.map(lambda a: pad(a, -2), cache.v))


def head(cache: KVCache, n: int, gather: bool = True) -> KVCache:
    """The cache's first ``n`` slots as a contiguous cache of their own (a copy; lengths unchanged): a loop whose rows
    all fit ``n`` slots attends over those alone. A paged cache's rows are gathered from their pages once here, so
    the steps after read contiguous buffers instead of gathering every layer at every step (``gather=False``: a
    paged cache of the first ``n // page`` columns of the table, nothing copied; its steps gather each layer)."""
    if isinstance(cache, PagedKVCache):
        if n % cache.page_size or n > cache.max_len:
            raise ValueError(f"head: {n} slots is not a whole number of pages of {cache.page_size} within the view "
                             f"of {cache.max_len}")
        pages = cache.pages[:, : n // cache.page_size]
        if not gather:
            return cache.replace(pages=pages)
        return KVCache(k=jax.tree.map(lambda a: _gather_pages(a, pages, True), cache.k),
                       v=jax.tree.map(lambda a: _gather_pages(a, pages, False), cache.v), lengths=cache.lengths,
                       groups=cache.groups)
    if n >= cache.max_len:
        return cache
    return cache.replace(k=jax.tree.map(lambda a: a[..., :n], cache.k),
                         v=jax.tree.map(lambda a: a[..., :n, :], cache.v))


def put_head(cache: KVCache, part: KVCache, window: int | None = None) -> KVCache:
    """``cache`` with its first slots replaced by ``part``'s (a `head` after steps ran on it) and part's lengths.

    ``window``: only each row's slots ``cache.lengths[b] .. + window - 1`` are written back (steps that commit at most
    ``window`` tokens per row and never rewrite a committed slot: the rest of the head is what ``cache`` holds); a
    slot past the head or the row's pages is dropped. None: the whole head (a paged cache: every slot of a page
    the row owns)."""
    if isinstance(part, PagedKVCache):  # a table's head: the pool was written in place, the whole table kept
        return cache.replace(k=part.k, v=part.v, lengths=part.lengths)
    if not isinstance(cache, PagedKVCache) and part.max_len == cache.max_len:  # the whole cache: nothing to put
        return part
    if isinstance(cache, PagedKVCache) and window is None:
        window = part.max_len
        start = jnp.zeros_like(cache.lengths)
    else:
        start = cache.lengths
    if window is None:
        put = lambda a, b, axis: jax.lax.dynamic_update_slice_in_dim(a, b.astype(a.dtype), 0, axis)  # noqa: E731
        return cache.replace(k=jax.tree.map(lambda a, b: put(a, b, a.ndim - 1), cache.k, part.k),
                             v=jax.tree.map(lambda a, b: put(a, b, a.ndim - 2), cache.v, part.v),
                             lengths=part.lengths)
    n = part.max_len
    pos = _row_slots(start, window)  # [B, W]
    src = jnp.clip(pos, 0, n - 1)
    dst = jnp.where(pos < n, pos, cache.max_len)  # a window reaching past the head: dropped
    rows, slots = _slot_index(cache, dst)

    def put_k(c, p):  # c [.., R, KV, hd, S], p [.., B, KV, hd, n]: each buffer's window in one gather and one scatter
        lead = _row_axis(p)
        w = jnp.take_along_axis(p, src.reshape((1,) * lead + (src.shape[0], 1, 1, -1)), axis=-1)  # [.., B, KV, hd, W]
        # advanced indices (rows, slots) around slices index [B, W, .., KV, hd]
        w = jnp.moveaxis(w, (lead, lead + 3), (0, 1))
        return c.at[(slice(None),) * lead + (rows, slice(None), slice(None), slots)].set(w.astype(c.dtype),
                                                                                          mode="drop")

    def put_v(c, p):  # c [.., R, KV, S, hd], p [.., B, KV, n, hd]
        lead = _row_axis(p)
        w = jnp.take_along_axis(p, src.reshape((1,) * lead + (src.shape[0], 1, -1, 1)), axis=-2)  # [.., B, KV, W, hd]
        w = jnp.moveaxis(w, (lead, lead + 2), (0, 1))
        return c.at[(slice(None),) * lead + (rows, slice(None), slots)].set(w.astype(c.dtype), mode="drop")

    return cache.replace(k=jax.tree.map(put_k, cache.k, part.k), v=jax.tree.map(put_v, cache.v, part.v),
                         lengths=part.lengths)


def set_lengths(cache: KVCache, lengths_B: jax.Array) -> KVCache:
    return cache.replace(lengths=lengths_B.astype(jnp.int32))


def where_rows(sel_B: jax.Array, a: KVCache, b: KVCache) -> KVCache:
    """Row by row, cache ``a`` where ``sel[b]`` and cache ``b`` elsewhere (both of the same layout)."""
    _contiguous(a, "where_rows")
    _contiguous(b, "where_rows")

    def pick(x, y, axis):
        shape = [1] * x.ndim
        shape[axis] = sel_B.shape[0]
        return jnp.where(sel_B.reshape(shape), x, y)

    k = jax.tree.map(lambda x, y: pick(x, y, _row_axis(x)), a.k, b.k)
    v = jax.tree.map(lambda x, y: pick(x, y, _row_axis(x)), a.v, b.v)
    return a.replace(k=k, v=v, lengths=jnp.where(sel_B, a.lengths, b.lengths))


def broadcast_rows(cache: KVCache, batch: int) -> KVCache:
    """A one-row cache repeated to ``batch`` rows (a shared prefix prefilled once, then given to every row)."""
    _contiguous(cache, "broadcast_rows")
    rep = lambda a: jnp.repeat(a, batch, axis=_row_axis(a))  # noqa: E731
    return cache.replace(k=jax.tree.map(rep, cache.k), v=jax.tree.map(rep, cache.v),
                         lengths=jnp.broadcast_to(cache.lengths[:1], (batch,)))
