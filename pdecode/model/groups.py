"""Layers of several shapes, stacked by group so a forward scans them: compile time flat in depth.

A network whose blocks differ (DeepSeek-V3's dense layers then sparse ones, Qwen-MoE's dense layers among sparse
ones, Gemma 4's local/global pattern) is still made of runs of identical blocks. `plan_groups` finds them from one
signature per layer: a group is a ``period`` of consecutive layers repeated ``count`` times (DeepSeek-V3: 3 x 1 dense,
then 58 x 1 sparse; a 5-local-1-global pattern: 10 x 6). `LayerGroups` holds the params: per group, one dict per
position in the period, every leaf stacked on a leading ``layers`` axis of ``count``. A forward runs each group as
one `lax.scan` over its repeats, the period's blocks unrolled in the body, so a 61-layer model compiles two bodies.

Inside the scan a block gets a `LayerRef`: its traced index (which cache layer and which per-layer input it reads)
and a static representative (the group's first layer at its position: everything about its structure).
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple, Sequence

import jax


@dataclasses.dataclass(frozen=True)
class Group:
    """Layers ``first + r * period + u`` for r < count, u < period."""

    first: int
    period: int
    count: int

    def layer(self, r: int, u: int) -> int:
        return self.first + r * self.period + u

    @property
    def end(self) -> int:
        return self.first + self.period * self.count


def plan_groups(signatures: Sequence[Any], max_period: int = 16) -> tuple[Group, ...]:
    """Groups covering layers 0..n-1 in order: from each start, the period (up to ``max_period``) whose repeats cover
    the most layers (at least two repeats; ties to the shorter period), else a group of the one layer."""
    sig = list(signatures)
    n, i, out = len(sig), 0, []
    while i < n:
        best = Group(i, 1, 1)
        for p in range(1, min(max_period, n - i) + 1):
            c = 1
            while i + (c + 1) * p <= n and sig[i + c * p: i + (c + 1) * p] == sig[i: i + p]:
                c += 1
            if c >= 2 and c * p > best.period * best.count:
                best = Group(i, p, c)
        out.append(best)
        i = best.end
    return tuple(out)


@jax.tree_util.register_pytree_node_class
class LayerGroups(tuple):
    """Per group (``plan``), a tuple of one dict per position of its period, each leaf stacked ``[count, ...]``."""

    plan: tuple[Group, ...]

    def __new__(cls, groups, plan):
        obj = super().__new__(cls, (tuple(g) for g in groups))
        obj.plan = tuple(plan)
        if len(obj) != len(obj.plan) or any(len(g) != p.period for g, p in zip(obj, obj.plan)):
            raise ValueError(f"LayerGroups: {len(obj)} groups of periods {[len(g) for g in obj]} for plan {plan}")
        return obj

    def tree_flatten(self):
        return tuple(self), self.plan

    @classmethod
    def tree_unflatten(cls, plan, children):
        return cls(children, plan)

    @property
    def num_layers(self) -> int:
        return self.plan[-1].end if self.plan else 0

    def locate(self, i: int) -> tuple[int, int, int]:
        """(group, repeat, position) of layer ``i`` (static)."""
        for g, p in enumerate(self.plan):
            if p.first <= i < p.end:
                r, u = divmod(i - p.first, p.period)
                return g, r, u
        raise IndexError(f"layer {i} of {self.num_layers}")

    def layer(self, i: int) -> dict:
        """Layer ``i``'s own weights (a static slice of its group's stack)."""
        g, r, u = self.locate(i)
        return jax.tree.map(lambda a: a[r], self[g][u])

    def per_layer(self) -> list[dict]:
        return [self.layer(i) for i in range(self.num_layers)]


class LayerRef(NamedTuple):
    """A layer inside a scanned group: ``index`` its (traced) index, ``rep`` the static index of a layer of the very
    same structure (its group's first at its position)."""

    index: Any
    rep: int


def static_layer(layer_idx) -> int:
    """The static index that says a layer's structure: a `LayerRef`'s representative, or the index itself."""
    return layer_idx.rep if isinstance(layer_idx, LayerRef) else int(layer_idx)


def layer_index(layer_idx):
    """The index a layer reads its cache and per-layer inputs at (traced inside a scan)."""
    return layer_idx.index if isinstance(layer_idx, LayerRef) else layer_idx
