"""Logical axis names -> mesh axes, and the shardings of params, caches and batches.

Every weight carries logical axis names in its `ParamSpec` (``vocab``, ``embed``, ``heads``, ``kv_heads``, ``mlp``,
``layers``); `RULES` maps them onto a `jax.sharding.Mesh` with a ``data`` and a ``model`` axis. A dimension that
the mesh axis does not divide stays replicated, so any model runs on any mesh.
"""

from __future__ import annotations

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from pdecode.errors import ConfigError
from pdecode.model.transformer import is_spec

RULES: dict[str, str | None] = {
    "batch": "data",
    "vocab": "model",
    "heads": "model",
    "kv_heads": "model",
    "mlp": "model",
    "embed": None,
    "layers": None,
    "seq": None,
}


def make_mesh(data: int | None = None, model: int = 1, devices=None) -> Mesh:
    """A (data, model) mesh over the available devices; ``data`` defaults to all devices / model."""
    devices = list(devices if devices is not None else jax.devices())
    if data is None:
        data = len(devices) // model
    if data * model > len(devices) or data < 1 or model < 1:
        raise ConfigError(f"mesh {data}x{model} needs {data * model} devices (data, model >= 1), {len(devices)} "
                          "available")
    return Mesh(np.array(devices[: data * model]).reshape(data, model), ("data", "model"))


def spec_for(axes: tuple, shape: tuple, mesh: Mesh, rules: dict | None = None) -> P:
    rules = RULES if rules is None else rules
    out, used = [], set()
    for name, dim in zip(axes, shape):
        mesh_axis = rules.get(name) if name else None
        if mesh_axis is None or mesh_axis in used or mesh_axis not in mesh.shape or dim % mesh.shape[mesh_axis]:
            out.append(None)
        else:
            out.append(mesh_axis)
            used.add(mesh_axis)
    return P(*out)


def param_shardings(specs, mesh: Mesh, rules: dict | None = None):
    return jax.tree.map(lambda s: NamedSharding(mesh, spec_for(s.axes, s.shape, mesh, rules)), specs, is_leaf=is_spec)


def shard_params(params, specs, mesh: Mesh, rules: dict | None = None):
    return jax.device_put(params, param_shardings(specs, mesh, rules))


def batch_sharding(mesh: Mesh, shape: tuple) -> NamedSharding:
    return NamedSharding(mesh, spec_for(("batch",) + (None,) * (len(shape) - 1), shape, mesh))


def cache_spec(shape: tuple, mesh: Mesh) -> P:
    """Spec of a cache buffer [(L,) B, KV, ...]: batch on ``data``, kv heads on ``model``."""
    axes = ("layers", "batch", "kv_heads", None, None)
    return spec_for(axes[5 - len(shape):], shape, mesh)


def constrain_cache(cache, mesh: Mesh | None):
    """Pin a KVCache's layout inside jit (batch on ``data``, kv heads on ``model``); identity without a mesh."""
    if mesh is None:
        return cache
    pin = lambda a: jax.lax.with_sharding_constraint(a, NamedSharding(mesh, cache_spec(a.shape, mesh)))  # noqa
    ln = NamedSharding(mesh, spec_for(("batch",), cache.lengths.shape, mesh))
    return cache.replace(k=jax.tree.map(pin, cache.k), v=jax.tree.map(pin, cache.v),
                         lengths=jax.lax.with_sharding_constraint(cache.lengths, ln))


def describe(mesh: Mesh | None) -> str:
    return "single device" if mesh is None else " x ".join(f"{k}={v}" for k, v in mesh.shape.items())

