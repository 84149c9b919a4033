"""Token trees: structure helpers shared by drafters and verification.

A tree of N nodes is ``parents[N]`` (node 0 is the root, ``parents[0] = -1``, ``parents[i] < i``) plus depths.
Node 0 is always the last committed token (not yet in the target's cache); node i > 0 is a drafted token. Static
trees are numpy (known at trace time); dynamic trees are ``[B, N]`` arrays built per step.

Static trees come from Medusa-style *choice paths*: each path lists, per depth, which top-k rank of the parent's
distribution the node takes, e.g. ``[[0], [1], [0, 0], [0, 1], [1, 0]]``.
"""

from __future__ import annotations

import dataclasses
import heapq

import jax
import jax.numpy as jnp
import numpy as np

from pdecode.errors import ConfigError


@dataclasses.dataclass(frozen=True)
class StaticTree:
    """A tree known at trace time (hashable, so it can be a static jit argument)."""

    parents: tuple[int, ...]
    ranks: tuple[int, ...]  # top-k rank of each node among its parent's candidates (root: 0)

    @property
    def size(self) -> int:
        return len(self.parents)

    @property
    def depths(self) -> np.ndarray:
        d = np.zeros(self.size, np.int32)
        for i in range(1, self.size):
            d[i] = d[self.parents[i]] + 1
        return d

    @property
    def ancestors(self) -> np.ndarray:
        """[N, N] ancestor-or-self mask (the tree attention mask among the tree's own tokens)."""
        m = np.eye(self.size, dtype=bool)
        for i in range(1, self.size):
            m[i] |= m[self.parents[i]]
        return m

    @property
    def max_depth(self) -> int:
        return int(self.depths.max())

    @property
    def max_children(self) -> int:
        counts = np.bincount(np.asarray(self.parents[1:], np.int64), minlength=self.size) if self.size > 1 else [0]
        return max(1, int(np.max(counts)))

    @property
    def max_rank(self) -> int:
        return int(max(self.ranks)) if self.size > 1 else 0


def from_choices(paths: list[list[int]] | tuple) -> StaticTree:
    """Build a tree from choice paths (each a list of ranks from the root); prefixes are added when missing."""
    if not paths:
        raise ConfigError("a tree needs at least one choice path, e.g. [[0], [0, 0]]")
    norm = set()
    for p in paths:
        p = tuple(int(x) for x in p)
        if not p or min(p) < 0:
            raise ConfigError(f"invalid tree path {list(p)}: ranks must be non-negative and the path non-empty")
        for k in range(1, len(p) + 1):
            norm.add(p[:k])
    ordered = sorted(norm, key=lambda p: (len(p), p))
    index = {(): 0}
    parents, ranks = [-1], [0]
    for p in ordered:
        index[p] = len(parents)
        parents.append(index[p[:-1]])
        ranks.append(p[-1])
    return StaticTree(tuple(parents), tuple(ranks))


def chain(length: int) -> StaticTree:
    if length < 1:
        raise ConfigError(f"draft length must be >= 1, got {length}")
    return from_choices([[0] * length])


def calibrated_paths(acc_KR, n: int) -> tuple[list[list[int]], float]:
    """Medusa's tree construction: the ``n`` choice paths with the highest expected acceptance, given calibrated
    accuracies ``acc[k][r]`` (how often the rank-r candidate at depth k + 1 is the target's token). A path
    (r_1, ..., r_d) is scored by the product of acc[i][r_i] along it (depths taken as independent); the expected
    tokens per step of the tree is 1 + the sum of its paths' scores, returned alongside.

    Best-first search from the root: a child never scores above its parent, and ties go to the shorter path, so the
    result is prefix-closed (a valid tree) and deterministic.
    """
    acc = np.asarray(acc_KR, np.float64)
    if acc.ndim != 2 or acc.size == 0 or np.any(acc < 0) or np.any(acc > 1):
        raise ConfigError(f"calibrated accuracies must be a [depth, rank] table of values in [0, 1], got shape "
                          f"{acc.shape}")
    if n < 1:
        raise ConfigError(f"a calibrated tree needs n >= 1 nodes, got {n}")
    k_max, r_max = acc.shape
    heap = [(-acc[0, r], 1, (r,)) for r in range(r_max)]
    heapq.heapify(heap)
    out, total = [], 0.0
    while heap and len(out) < n:
        neg, d, path = heapq.heappop(heap)
        out.append(list(path))
        total += -neg
        if d < k_max:
            for r in range(r_max):
                heapq.heappush(heap, (neg * acc[d, r], d + 1, path + (r,)))
    return out, 1.0 + total


# Named static trees; the number is the count of drafted nodes (the root comes on top). "medusa-63" follows the
# shape of Medusa's published 63-node tree for 7B models (wide near the root, deep along the top ranks); the
# others are small, CPU-friendly trees.
PRESETS: dict[str, list[list[int]]] = {
    "chain-4": [[0, 0, 0, 0]],
    "binary-14": [list(p) for p in [[0], [1], [0, 0], [0, 1], [1, 0], [1, 1], [0, 0, 0], [0, 0, 1], [0, 1, 0],
                                     [1, 0, 0], [0, 0, 0, 0], [0, 0, 0, 1], [0, 0, 1, 0], [0, 1, 0, 0]]],
    "wide-25": [[0], [1], [2], [3], [0, 0], [0, 1], [0, 2], [1, 0], [1, 1], [2, 0], [3, 0], [0, 0, 0], [0, 0, 1],
                [0, 1, 0], [1, 0, 0], [0, 0, 0, 0], [0, 0, 0, 1], [0, 0, 1, 0], [0, 1, 0, 0], [1, 0, 0, 0],
                [0, 0, 0, 0, 0], [0, 0, 0, 0, 1], [0, 0, 0, 1, 0], [0, 0, 0, 0, 0, 0], [0, 0, 0, 0, 0, 0, 0]],
    # for 4 heads: wide at depth 1, narrowing with depth
    "medusa-18": [[0], [1], [2], [3], [4], [0, 0], [0, 1], [0, 2], [1, 0], [1, 1], [2, 0], [0, 0, 0], [0, 0, 1],
                  [0, 1, 0], [1, 0, 0], [0, 0, 0, 0], [0, 0, 0, 1], [0, 0, 1, 0]],
    "medusa-63": [[0], [1], [2], [3], [4], [5], [6], [7], [8], [9],
                  [0, 0], [0, 1], [0, 2], [0, 3], [0, 4], [0, 5], [0, 6], [0, 7], [1, 0], [1, 1], [1, 2], [2, 0],
                  [2, 1], [3, 0], [3, 1], [4, 0], [5, 0], [6, 0], [7, 0], [8, 0], [9, 0],
                  [0, 0, 0], [0, 0, 1], [0, 0, 2], [0, 0, 3], [0, 1, 0], [0, 1, 1], [0, 2, 0], [0, 3, 0], [1, 0, 0],
                  [1, 0, 1], [1, 1, 0], [2, 0, 0], [3, 0, 0],
                  [0, 0, 0, 0], [0, 0, 0, 1], [0, 0, 0, 2], [0, 0, 1, 0], [0, 1, 0, 0], [1, 0, 0, 0], [0, 0, 2, 0],
                  [0, 2, 0, 0],
                  [0, 0, 0, 0, 0], [0, 0, 0, 0, 1], [0, 0, 0, 1, 0], [0, 0, 1, 0, 0], [0, 1, 0, 0, 0],
                  [1, 0, 0, 0, 0], [0, 0, 0, 0, 0, 0], [0, 0, 0, 0, 0, 1], [0, 0, 0, 0, 0, 0, 0],
                  [0, 1, 1, 0], [2, 1, 0]],
}


def resolve(spec) -> StaticTree:
    """A StaticTree from a preset name, a list of choice paths, or a StaticTree."""
    if isinstance(spec, StaticTree):
        return spec
    if isinstance(spec, str):
        if spec not in PRESETS:
            raise ConfigError(f"unknown tree preset {spec!r}; presets: {', '.join(PRESETS)} (or give choice paths)")
        return from_choices(PRESETS[spec])
    if isinstance(spec, (list, tuple)) and all(isinstance(p, (list, tuple)) for p in spec):
        return from_choices(spec)
    raise ConfigError(f"invalid tree spec {spec!r}: give a preset name or a list of choice paths like [[0], [0, 0]]")


# ------------------------------------------------------------------------------------------------ in-jit helpers
def depths_of(parents_BN: jax.Array, max_depth: int) -> jax.Array:
    """Depth of every node of per-row trees [B, N] (pointer chasing, ``max_depth`` steps)."""
    par = parents_BN
    depth = jnp.zeros_like(par)
    cur = par
    for _ in range(max_depth):
        has = cur >= 0
        depth = depth + has.astype(depth.dtype)
        cur = jnp.where(has, jnp.take_along_axis(par, jnp.maximum(cur, 0), axis=-1), -1)
    return depth


def children_table(parents_BN: jax.Array, valid_BN: jax.Array, max_children: int) -> jax.Array:
    """[B, N, K] node index of each node's r-th valid child (in node order), -1 where there is none."""
    b, n = parents_BN.shape
    idx = jnp.arange(n)
    same = (parents_BN[:, :, None] == parents_BN[:, None, :]) & valid_BN[:, None, :] & (idx[None, None, :] < idx[None, :, None])
    rank = jnp.sum(same, axis=-1)  # earlier valid siblings
    ok = valid_BN & (parents_BN >= 0) & (rank < max_children)
    row = jnp.arange(b)[:, None]
    par = jnp.where(ok, parents_BN, n)  # out of range -> dropped
    table = jnp.full((b, n, max_children), -1, jnp.int32)
    return table.at[row, par, jnp.where(ok, rank, 0)].set(jnp.broadcast_to(idx, (b, n)).astype(jnp.int32),
                                                           mode="drop")
