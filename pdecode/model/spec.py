"""Parameter specs: the shape, logical axes and initialiser of every weight (a leaf module).

A spec tree (`pdecode.model.transformer.param_specs`) mirrors a params tree; it drives init, sharding
(`pdecode.sharding`, which maps the logical axes onto a mesh) and checkpoint restore alike. This module imports
nothing of pdecode, so the model, sharding and checkpoint layers can all read specs without importing each other.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class ParamSpec:
    shape: tuple[int, ...]
    axes: tuple[str | None, ...]  # logical axis names, one per dim
    init: str = "normal"  # normal | ones | zeros | index (int32 zeros) | flag (bool False): buffers, not weights


def is_spec(x) -> bool:
    return isinstance(x, ParamSpec)


def drop_layers(spec: ParamSpec) -> ParamSpec:
    """A stacked spec of one layer ([1, ...] on ``layers``) as that layer's own."""
    return dataclasses.replace(spec, shape=spec.shape[1:], axes=spec.axes[1:])


def stack(spec: ParamSpec, n: int, axis: str = "layers") -> ParamSpec:
    """``spec`` repeated ``n`` times on a new leading ``axis`` (a stack of identical layers)."""
    return dataclasses.replace(spec, shape=(n,) + tuple(spec.shape), axes=(axis,) + tuple(spec.axes))
