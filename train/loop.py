"""The one training loop: optax AdamW (warmup + cosine, grad clipping), eval, orbax checkpoints with resume,
progress on stderr.

    params, hist = train(objective, params, frozen, batch_fn, TrainConfig(...), ckpt_dir=..., eval_fn=...)

``objective(trainable, frozen, batch, rng) -> (loss, metrics)`` (see `train.objectives`); ``batch_fn(step)`` gives
the batch of a step deterministically, so a resumed run continues exactly where it stopped.
"""

from __future__ import annotations

import dataclasses
import math
import sys
import time
from pathlib import Path
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax


@dataclasses.dataclass
class TrainConfig:
    steps: int
    lr: float = 1e-3
    warmup: int = 100
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.1
    clip: float = 1.0
    b2: float = 0.95
    eval_every: int = 200
    ckpt_every: int = 200
    log_every: int = 10
    seed: int = 0
    time_budget_s: float | None = None  # stop early (and say so) once this much wall time is spent
    accum: int = 1  # gradient accumulation: each batch runs as `accum` micro-batches (a scan), one update
    # mixed precision: the trainable params stay float32 (the master weights AdamW updates) and are cast to this
    # dtype for the forward and backward passes; None: compute in the params' own dtype
    compute_dtype: str | None = None


def make_optimizer(tc: TrainConfig) -> optax.GradientTransformation:
    sched = optax.warmup_cosine_decay_schedule(0.0, tc.lr, max(tc.warmup, 1), max(tc.steps, tc.warmup + 1),
                                               end_value=tc.lr * tc.min_lr_ratio)
    # No weight decay on vectors (norm scales, biases).
    decay_mask = lambda p: jax.tree.map(lambda a: a.ndim >= 2, p)  # noqa: E731
    return optax.chain(optax.clip_by_global_norm(tc.clip),
                       optax.adamw(sched, b1=0.9, b2=tc.b2, weight_decay=tc.weight_decay, mask=decay_mask))


class Progress:
    """One status line per ``every`` steps: step, loss, tokens/s, ETA (a bar when stderr is a terminal)."""

    def __init__(self, total: int, desc: str, every: int, stream=sys.stderr):
        self.total, self.desc, self.every, self.stream = total, desc, max(every, 1), stream
        self.t0 = time.perf_counter()
        self.tty = stream.isatty()

    def update(self, step: int, first_step: int, tokens: int, **metrics):
        if step % self.every and step != self.total:
            return
        el = time.perf_counter() - self.t0
        done = step - first_step
        rate = done / el if el > 0 else 0.0
        eta = (self.total - step) / rate if rate > 0 else float("nan")
        frac = step / self.total
        bar = "#" * int(24 * frac) + "." * (24 - int(24 * frac))
        ms = " ".join(f"{k}={v:.4g}" for k, v in metrics.items())
        line = (f"{self.desc} [{bar}] {step}/{self.total} {ms} {tokens * done / max(el, 1e-9):.0f} tok/s "
                f"elapsed {el / 60:.1f}m eta {eta / 60:.1f}m")
        print(("\r" + line) if self.tty else line, file=self.stream, end="" if self.tty else "\n", flush=True)
        if self.tty and step == self.total:
            print(file=self.stream)


def _ckpt_manager(ckpt_dir: Path, keep: int = 2):
    import orbax.checkpoint as ocp

    return ocp.CheckpointManager(ckpt_dir.resolve(), options=ocp.CheckpointManagerOptions(max_to_keep=keep))


def _cast(tree, dtype):
    return jax.tree.map(lambda a: a.astype(dtype) if jnp.issubdtype(a.dtype, jnp.floating) else a, tree)


def loss_and_grads(objective: Callable, params, frozen, batch, rng, accum: int = 1, compute_dtype=None):
    """(loss, metrics, grads) of ``objective`` on ``batch``: as ``accum`` micro-batches (the batch's leading axis
    split evenly; a `lax.scan` sums their gradients, so memory is one micro-batch's activations), each with its own
    fold of ``rng``; with ``compute_dtype`` the forward and backward run on params cast to it while the gradients
    come back in the params' dtype (the cast's transpose)."""

    def f(p, b, r):
        return objective(_cast(p, compute_dtype) if compute_dtype else p, frozen, b, r)

    grad_f = jax.value_and_grad(f, has_aux=True)
    if accum == 1:
        (loss, metrics), grads = grad_f(params, batch, rng)
        return loss, metrics, grads
    micro = jax.tree.map(lambda x: x.reshape((accum, x.shape[0] // accum) + x.shape[1:]), batch)

    def body(acc, xs):
        i, b = xs
        (loss, metrics), grads = grad_f(params, b, jax.random.fold_in(rng, i))
        return jax.tree.map(jnp.add, acc, (loss, metrics, grads)), None

    (loss0, metrics0), _ = jax.eval_shape(grad_f, params, jax.tree.map(lambda x: x[0], micro), rng)
    zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), (loss0, metrics0, params))
    tot, _ = jax.lax.scan(body, zeros, (jnp.arange(accum), micro))
    return jax.tree.map(lambda a: a / accum, tot)


def _step_fn(objective: Callable, opt: optax.GradientTransformation, accum: int = 1, compute_dtype=None,
             param_shardings=None):
    """The jitted training step. Every array it reads is an argument — the trainable params and the frozen ones
    (a base model, a teacher) alike — so nothing is baked into the compiled program as a constant and a frozen
    8B base costs device memory once, not compile time and program size. With ``param_shardings`` (a mesh run)
    the updated params are pinned to them, so every step keeps the data-parallel or FSDP layout it started with."""

    @jax.jit
    def step_fn(params, frozen, opt_state, batch, rng):
        loss, metrics, grads = loss_and_grads(objective, params, frozen, batch, rng, accum, compute_dtype)
        updates, opt_state = opt.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        if param_shardings is not None:
            params = jax.lax.with_sharding_constraint(params, param_shardings)
        return params, opt_state, loss, dict(metrics, grad_norm=optax.global_norm(grads))

    return step_fn


@dataclasses.dataclass(frozen=True)
class MeshPlan:
    """How a training run lays out on a mesh: the trainable params by their logical ``specs`` (data parallel:
    replicated over ``data``, tensor-parallel over ``model`` by `pdecode.sharding.RULES`; ``fsdp``: also split over
    ``data`` along their ``embed`` axis, `pdecode.sharding.FSDP_RULES`), the frozen params by ``frozen_specs``
    (None: replicated), the batch split over ``data``."""

    mesh: Any
    specs: Any
    frozen_specs: Any = None
    fsdp: bool = False

    def rules(self):
        from pdecode.sharding import FSDP_RULES, RULES

        return FSDP_RULES if self.fsdp else RULES

    def param_shardings(self):
        from pdecode.sharding import param_shardings

        return param_shardings(self.specs, self.mesh, self.rules(), indivisible="replicate")

    def frozen_shardings(self):
        """The frozen params' shardings by ``frozen_specs`` (the same rules), or one replicated sharding."""
        from jax.sharding import NamedSharding, PartitionSpec as P

        from pdecode.sharding import param_shardings

        if self.frozen_specs is None:
            return NamedSharding(self.mesh, P())
        return param_shardings(self.frozen_specs, self.mesh, self.rules(), indivisible="replicate")

    def place(self, params, frozen):
        from jax.sharding import NamedSharding

        from pdecode.sharding import place

        params = jax.tree.map(place, params, self.param_shardings())
        if frozen is not None:
            sh = self.frozen_shardings()  # one sharding for every frozen leaf, or a tree of them
            frozen = jax.tree.map(lambda a: place(a, sh), frozen) if isinstance(sh, NamedSharding) else \
                jax.tree.map(place, frozen, sh)
        return params, frozen

    def place_scalars(self, tree):
        """Leaves on a single device (an optimizer's step count) replicated over the mesh instead."""
        from jax.sharding import NamedSharding, PartitionSpec as P

        from pdecode.sharding import place

        rep = NamedSharding(self.mesh, P())
        return jax.tree.map(lambda a: a if len(a.sharding.device_set) > 1 else place(a, rep), tree)

    def place_batch(self, batch):
        from pdecode.sharding import batch_sharding, place

        return jax.tree.map(lambda x: place(x, batch_sharding(self.mesh, np.shape(x))), batch)

    def local_rows(self, rows: int) -> slice:
        """The rows of a global batch of ``rows`` that this process's devices hold (all of them in a one-process
        run, or when the data axis lies within each process)."""
        from pdecode.sharding import batch_sharding

        idx = batch_sharding(self.mesh, (rows,)).addressable_devices_indices_map((rows,)).values()
        spans = sorted({s[0].indices(rows)[:2] for s in idx})
        lo, hi = spans[0][0], spans[-1][1]
        if sum(b - a for a, b in spans) != hi - lo:
            raise ValueError(f"this process's batch rows {spans} are not one contiguous range")
        return slice(lo, hi)

    def place_local_batch(self, local, rows: int):
        """A global batch of ``rows`` from this process's rows of it (`local_rows`): data sharded by process."""
        from pdecode.sharding import batch_sharding

        return jax.make_array_from_process_local_data(batch_sharding(self.mesh, (rows,) + local.shape[1:]), local,
                                                      (rows,) + local.shape[1:])


def _check_accum(tc: TrainConfig, batch) -> None:
    n = np.shape(jax.tree.leaves(batch)[0])[0]
    if tc.accum < 1 or n % tc.accum:
        raise ValueError(f"accum={tc.accum} must be >= 1 and divide the batch size ({n})")


def time_step(objective: Callable, params: Any, frozen: Any, batch: np.ndarray, tc: TrainConfig,
              repeats: int = 5) -> dict:
    """Seconds per training step (the loop's jitted step: loss, gradients, AdamW update) on one batch: compile
    time and the median of ``repeats`` timed steps after one warm-up."""
    opt = make_optimizer(tc)
    _check_accum(tc, batch)
    step_fn = _step_fn(objective, opt, tc.accum, tc.compute_dtype)
    state, batch, key = opt.init(params), jax.tree.map(jnp.asarray, batch), jax.random.PRNGKey(tc.seed)
    t0 = time.perf_counter()
    params, state, loss, _ = step_fn(params, frozen, state, batch, key)
    jax.block_until_ready(loss)
    compile_s, times = time.perf_counter() - t0, []
    for _ in range(repeats):
        t0 = time.perf_counter()
        params, state, loss, _ = step_fn(params, frozen, state, batch, key)
        jax.block_until_ready(loss)
        times.append(time.perf_counter() - t0)
    return {"step_s": float(np.median(times)), "first_step_s": compile_s, "times": times}


def train(objective: Callable, params: Any, frozen: Any, batch_fn: Callable[[int], np.ndarray], tc: TrainConfig,
          ckpt_dir: str | Path | None = None, eval_fn: Callable[[Any], dict] | None = None, desc: str = "train",
          tokens_per_step: int | None = None, mesh_plan: MeshPlan | None = None,
          local_batch_fn: Callable[[int, slice], np.ndarray] | None = None) -> tuple[Any, dict]:
    """Train ``params`` (see the module's doc); ``mesh_plan`` runs it data-parallel or FSDP on a mesh. On a mesh
    spanning several processes, ``local_batch_fn(step, rows)`` (if given) makes only this process's ``rows`` of
    step ``step``'s global batch (`MeshPlan.local_rows`): each process reads its own share of the data."""
    import orbax.checkpoint as ocp

    opt = make_optimizer(tc)
    first = batch_fn(0)  # a batch's shape: the accumulation check and the tokens per step
    _check_accum(tc, first)
    if tc.compute_dtype is not None:
        params = _cast(params, jnp.float32)  # the master weights
    if mesh_plan is not None:
        params, frozen = mesh_plan.place(params, frozen)
    opt_state = jax.jit(opt.init)(params)  # the moments take their params' shardings
    if mesh_plan is not None:
        opt_state = mesh_plan.place_scalars(opt_state)
    start = 0
    mgr = None
    if ckpt_dir is not None:
        ckpt_dir = Path(ckpt_dir)
        ckpt_dir.mkdir(parents=True, exist_ok=True)
        mgr = _ckpt_manager(ckpt_dir)
        last = mgr.latest_step()
        if last is not None:
            abstract = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=getattr(a, "sharding", None)),
                                    {"params": params, "opt_state": opt_state})
            restored = mgr.restore(last, args=ocp.args.StandardRestore(abstract))
            params = restored["params"]
            opt_state = jax.tree.unflatten(jax.tree.structure(opt_state), jax.tree.leaves(restored["opt_state"]))
            start = last
            print(f"{desc}: resumed from step {last} in {ckpt_dir}", file=sys.stderr)

    step_fn = _step_fn(objective, opt, tc.accum, tc.compute_dtype,
                       mesh_plan.param_shardings() if mesh_plan is not None else None)
    place_batch = mesh_plan.place_batch if mesh_plan is not None else (lambda b: jax.tree.map(jnp.asarray, b))

    hist: dict[str, list] = {"step": [], "loss": [], "eval": []}
    tokens = tokens_per_step or int(np.prod(np.shape(jax.tree.leaves(first)[0])[:2]))
    prog = Progress(tc.steps, desc, tc.log_every)
    t0 = time.perf_counter()
    key = jax.random.PRNGKey(tc.seed)
    stopped_early = False
    step = start
    by_process = local_batch_fn is not None and mesh_plan is not None and jax.process_count() > 1
    rows = int(np.shape(jax.tree.leaves(first)[0])[0])
    mine = mesh_plan.local_rows(rows) if by_process else None
    for step in range(start + 1, tc.steps + 1):
        batch = mesh_plan.place_local_batch(local_batch_fn(step, mine), rows) if by_process else \
            place_batch(batch_fn(step))
        params, opt_state, loss, metrics = step_fn(params, frozen, opt_state, batch, jax.random.fold_in(key, step))
        if step % tc.log_every == 0 or step == tc.steps:
            lv = float(loss)
            if not math.isfinite(lv):
                raise FloatingPointError(f"{desc}: loss became {lv} at step {step}; lower the learning rate")
            hist["step"].append(step)
            hist["loss"].append(lv)
            prog.update(step, start, tokens, loss=lv, gnorm=float(metrics["grad_norm"]))
        if eval_fn is not None and (step % tc.eval_every == 0 or step == tc.steps):
            ev = {k: float(v) for k, v in eval_fn(params).items()}
            hist["eval"].append({"step": step, **ev})
            print(f"{desc}: eval at step {step}: " + " ".join(f"{k}={v:.4f}" for k, v in ev.items()), file=sys.stderr)
        if mgr is not None and (step % tc.ckpt_every == 0 or step == tc.steps):
            mgr.save(step, args=ocp.args.StandardSave({"params": params, "opt_state": opt_state}))
        if tc.time_budget_s is not None and time.perf_counter() - t0 > tc.time_budget_s:
            stopped_early = step < tc.steps
            print(f"{desc}: time budget of {tc.time_budget_s:.0f}s reached at step {step}", file=sys.stderr)
            break
    if mgr is not None:
        mgr.wait_until_finished()
        mgr.close()
    hist["train_s"] = time.perf_counter() - t0
    hist["last_step"] = step
    hist["stopped_early"] = stopped_early
    return params, hist
