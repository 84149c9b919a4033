"""Logical axis names -> mesh axes, and the shardings of params, caches and batches.

Every weight carries logical axis names in its `ParamSpec` (``vocab``, ``embed``, ``heads``, ``kv_heads``, ``mlp``,
``layers``, and ``experts`` / ``expert_mlp`` for a mixture of experts); `RULES` maps them onto a
`jax.sharding.Mesh` with a ``data`` and a ``model`` axis. Experts are sharded over ``model`` (expert parallelism:
each device holds whole experts). Two logical axes of one array mapped to the same mesh axis are an error.

A dimension its mesh axis does not divide is an error that names both (``indivisible="error"``, the default for a
model's own weights), except for the logical axes in `REPLICATE_IF_INDIVISIBLE`: ``kv_heads`` (a GQA model with
fewer kv heads than the model axis keeps its k/v projections and cache whole on every device, the usual practice)
and ``batch`` (a batch smaller than the data axis runs replicated). ``indivisible="replicate"`` replicates any such
dimension instead: `pdecode.generate` places a draft model that way (a draft is small; its few heads rarely divide
the model axis a large target needs).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from pdecode.errors import ConfigError
from pdecode.model.spec import is_spec

RULES: dict[str, str | None] = {
    "batch": "data",
    "vocab": "model",
    "heads": "model",
    "kv_heads": "model",
    "mlp": "model",
    "experts": "model",  # expert parallelism: each device of the model axis holds E / model whole experts
    "expert_mlp": None,  # an expert's own hidden width stays whole on the device that holds the expert
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


# FSDP-style training: every weight is also split over ``data`` along its ``embed`` axis (all-gathered per layer
# for the forward, its gradient reduce-scattered back), so params, grads and optimizer moments take 1/N each
FSDP_RULES: dict[str, str | None] = {**RULES, "embed": "data"}

REPLICATE_IF_INDIVISIBLE = frozenset({"kv_heads", "batch"})


def parse_mesh_shape(spec: str, example: str = "8x1", flag: str = "--mesh") -> tuple[int, int]:
    """``DATAxMODEL`` -> (data, model); an InputError that shows the form otherwise."""
    from pdecode.errors import InputError

    parts = spec.lower().split("x")
    if len(parts) != 2 or not all(x.strip().isascii() and x.strip().isdecimal() and int(x) >= 1 for x in parts):
        raise InputError(f"{flag} takes DATAxMODEL (two integers >= 1, e.g. {example}), got {spec!r}")
    d, mo = (int(x) for x in parts)
    return d, mo


def mesh_from_spec(spec: str, flag: str = "--mesh") -> Mesh:
    """``DATAxMODEL`` -> a mesh over the first DATA*MODEL available devices (an InputError when too few)."""
    from pdecode.errors import InputError

    n = jax.device_count()
    d, mo = parse_mesh_shape(spec, f"{n}x1", flag)
    if d * mo > n:
        raise InputError(f"{flag} {spec} needs {d * mo} devices, {n} available; pick DATAxMODEL with "
                         f"DATA*MODEL <= {n} (e.g. {n}x1)")
    return make_mesh(d, mo)


def spec_for(axes: tuple, shape: tuple, mesh: Mesh, rules: dict | None = None, indivisible: str = "replicate",
             what: str = "") -> P:
    """The PartitionSpec of an array with logical ``axes``; ``indivisible``: "error" or "replicate" (see the
    module's doc); ``what`` names the array in the error."""
    rules = RULES if rules is None else rules
    out, used = [], {}
    for name, dim in zip(axes, shape):
        mesh_axis = rules.get(name) if name else None
        if mesh_axis is not None and mesh_axis in used:
            raise ConfigError(f"sharding rules collide on {what or 'an array'}: its logical axes {used[mesh_axis]!r} "
                              f"and {name!r} both map to the mesh axis {mesh_axis!r}; map one of them elsewhere "
                              "(or to None)")
        if mesh_axis is None or mesh_axis not in mesh.shape:
            out.append(None)
        elif dim % mesh.shape[mesh_axis]:
            if indivisible == "error" and name not in REPLICATE_IF_INDIVISIBLE and mesh.shape[mesh_axis] > 1:
                raise ConfigError(f"{what or 'an array'}: its {name} dimension ({dim}) is not divisible by the mesh's "
                                  f"{mesh_axis} axis ({mesh.shape[mesh_axis]}); use a {mesh_axis} axis that divides "
                                  f"{dim}, or replicate it explicitly (Model.on_mesh(mesh, indivisible='replicate'))")
            out.append(None)
        else:
            out.append(mesh_axis)
        if mesh_axis is not None:
            used[mesh_axis] = name
    return P(*out)


def _name(key_path) -> str:
    return "/".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in key_path)


def param_shardings(specs, mesh: Mesh, rules: dict | None = None, indivisible: str = "error"):
    """NamedShardings of a spec tree; an indivisible sharded dimension is an error unless ``indivisible="replicate"``
    (or its logical axis is in `REPLICATE_IF_INDIVISIBLE`)."""
    if indivisible not in ("error", "replicate"):
        raise ConfigError(f"indivisible must be 'error' or 'replicate', got {indivisible!r}")
    leaves, treedef = jax.tree_util.tree_flatten_with_path(specs, is_leaf=is_spec)
    out = [NamedSharding(mesh, spec_for(s.axes, s.shape, mesh, rules, indivisible, _name(kp)))
           for kp, s in leaves]
    return jax.tree_util.tree_unflatten(treedef, out)


def shard_params(params, specs, mesh: Mesh, rules: dict | None = None, indivisible: str = "error"):
    """``params`` placed by their specs on ``mesh``. On a mesh spanning several processes (multi-host), each process
    puts its own devices' slices of its local copy (every process holds the same params)."""
    shardings = param_shardings(specs, mesh, rules, indivisible)
    if all(sh.is_fully_addressable for sh in jax.tree.leaves(shardings)):
        return jax.device_put(params, shardings)
    return jax.tree.map(place, params, shardings)


def place(a, sh: NamedSharding):
    """``a`` (a host array, a one-process jax array or a global one) as a jax array with sharding ``sh``, also on a
    mesh spanning several processes: there each process puts its own devices' slices of its copy (every process
    holds the same value), and an array already global is only re-laid out."""
    if sh.is_fully_addressable:
        return jax.device_put(a, sh)
    if isinstance(a, jax.Array) and not a.is_fully_addressable:
        return a if a.sharding == sh else jax.device_put(a, sh)
    host = np.asarray(a)
    return jax.make_array_from_callback(host.shape, sh, lambda idx: host[idx])


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


def constrain_vocab(x, mesh: Mesh | None):
    """Pin an array [B, ..., V] over the vocabulary (batch on ``data``, vocabulary on ``model``, as the unembedding
    is): a canvas's logits are B x L x V, too large to hold whole on every device at a 262k vocabulary."""
    if mesh is None:
        return x
    axes = ("batch",) + (None,) * (x.ndim - 2) + ("vocab",)
    return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec_for(axes, x.shape, mesh)))


def kv_repeat(cfg, mesh: Mesh | None) -> int:
    """How many times to repeat each kv head so that the kv heads divide the mesh's ``model`` axis: a GQA model
    with fewer kv heads than the tensor-parallel degree (Llama-3-70B: 8 kv heads on 32 or 64 devices) would
    otherwise keep every kv head — its k/v projections and its whole KV cache — on every device. Repeating head j
    r times in place (j -> j*r .. j*r + r - 1) keeps each query head reading the same keys and values (query head h
    reads kv head h // (H / KV) before, h // (H / (KV r)) after, and the second over r is the first), so outputs
    are unchanged, and each device then holds only the kv head its own query heads read. 1 when not needed or not
    possible (the model axis must be a multiple of the kv heads, and the query heads a multiple of the axis)."""
    if mesh is None or "model" not in mesh.shape or cfg.arch.latent is not None:  # a latent cache serves every head
        return 1
    m, kv, h = mesh.shape["model"], cfg.num_kv_heads, cfg.num_heads
    if kv >= m or m % kv or h % m:
        return 1
    return m // kv


def kv_repeated_cfg(cfg, r: int):
    """``cfg`` with every layer's kv heads repeated ``r`` times (`kv_repeat`; Gemma 4's full layers too)."""
    if r == 1:
        return cfg
    return cfg.replace(num_kv_heads=cfg.num_kv_heads * r, arch=cfg.arch.repeat_kv_heads(r))


def placed_cfg(cfg, mesh: Mesh | None):
    """``cfg`` as placed on ``mesh``: kv heads repeated to the model axis (`kv_repeat`) and, when the model axis
    splits the experts, ``run.experts_sharded`` set (the expert path that keeps each device's experts at home)."""
    cfg = kv_repeated_cfg(cfg, kv_repeat(cfg, mesh))
    m = mesh.shape.get("model", 1) if mesh is not None else 1
    ex = cfg.arch.experts
    return cfg.with_run(experts_sharded=bool(ex is not None and m > 1 and ex.num_experts % m == 0))


def repeat_kv_heads(params, specs, r: int, shardings=None):
    """``params`` with every weight that has a ``kv_heads`` axis (by its spec) repeated ``r`` times along it, in
    place (`kv_repeat`), computed under jit straight into ``shardings`` when given (no gathering on one device)."""
    if r == 1:
        return params

    def rep(a, s):
        return jnp.repeat(a, r, axis=s.axes.index("kv_heads")) if "kv_heads" in s.axes else a

    f = lambda p: jax.tree.map(rep, p, specs)  # noqa: E731
    return jax.jit(f, out_shardings=shardings)(params)


def describe(mesh: Mesh | None) -> str:
    return "single device" if mesh is None else " x ".join(f"{k}={v}" for k, v in mesh.shape.items())

