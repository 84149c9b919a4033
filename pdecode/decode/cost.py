"""What a step that verifies k tokens costs against an AR step, measured on the device at hand; windows from it.

Methods that draft for free (jacobi, lookahead) gain nothing when their guesses miss: a step then yields one token,
as an AR step does, but pays for a forward over the whole window and the step's drafting and verifying. Whatever
their acceptance, a step yields at least one token, so a window whose step costs at most 1 / `FLOOR` of an AR step
keeps the method at ``FLOOR`` x AR or better; every accepted guess is a gain on top. ``block="auto"`` (jacobi) and
``window="auto"`` (lookahead) take the largest such window of their candidates, timed here as whole steps of the
method against ar's (`measure_steps`); when even the smallest costs more, the method steps aside and runs AR's loop
(its stats say so: ``window`` 0 and ``window_note``). Lookup's drafted step is priced the same way, as a whole step
against ar's, timed on a prompt that repeats so every step drafts (``draft_cost="auto"``). A bare forward's ratio
(`measure`, `verify_cost`) is there for callers who price a verify alone; the benchmarks time the same forwards
(`forwards`, `timing_cache`).

Where a forward is bound by reading the weights (an accelerator at small batch), a few dozen tokens cost about
what one does and the paper's windows are kept. On a 2-core CPU a 2-token forward of SmolLM2-135M at batch 1 already
costs 1.25x a 1-token one (docs/results.md), so there jacobi and lookahead run as AR.

Each ratio is timed once per (device, model shape, dtype, batch, tokens, context, method and options) and kept in
memory and in a file next to JAX's persistent compilation cache (or, without one, under ``~/.cache/pdecode``), so
later processes read it back.
``PDECODE_VERIFY_COST`` = ``"2:1.25,9:1.6"`` (tokens:ratio) sets ratios instead (reproducible runs, tests).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import sys
import time
from pathlib import Path
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

FLOOR = 0.95  # a free-draft method sized by cost never runs below this fraction of AR's speed (one token a step)
CONTEXT = 512  # the cache length the ratio is timed at (rounded up to the generation's own, in CONTEXT steps)
_MEMO: dict[tuple, float] = {}


@dataclasses.dataclass(frozen=True)
class Sizing:
    """A window chosen by cost: ``size`` (0: none pays; the method runs as AR), the ``tokens`` its verify holds,
    their ``cost`` ratio against one token, and a ``note`` saying why."""

    size: int
    tokens: int
    cost: float | None
    note: str


def _env_costs() -> dict[int, float]:
    raw = os.environ.get("PDECODE_VERIFY_COST", "").strip()
    if not raw:
        return {}
    try:
        return {int(k): float(v) for k, v in (p.split(":") for p in raw.split(","))}
    except ValueError:
        from pdecode.errors import ConfigError

        raise ConfigError(f"PDECODE_VERIFY_COST must look like '2:1.25,9:1.6' (tokens:ratio, ...), got {raw!r}")


def _key(model, batch: int, tokens: int, context: int) -> tuple:
    shapes = [(tuple(x.shape), str(x.dtype)) for x in jax.tree.leaves(model.params)]
    dev = [(d.platform, d.device_kind) for d in jax.devices()]
    return (repr(model.cfg), repr(shapes), repr(dev), os.cpu_count(), os.environ.get("XLA_FLAGS", ""), jax.__version__,
            batch, tokens, context, "cost.measure: forwards + head, 8 a call, median of 5")


def _cache_dir():
    """JAX's persistent compilation cache directory when one is set, else pdecode's own under the user's cache
    (``$XDG_CACHE_HOME/pdecode`` or ``~/.cache/pdecode``): a ratio is timed once per machine, not once per process."""
    d = jax.config.jax_compilation_cache_dir
    if d:
        return d
    return os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "pdecode")


def _file(key: tuple) -> Path | None:
    d = _cache_dir()
    if not d or "://" in str(d):
        return None
    return Path(d) / "pdecode-costs" / ("verify-" + hashlib.sha256(repr(key).encode()).hexdigest()[:32] + ".json")


def forwards(cfg, inner: int):
    """A jit-able ``many(params, tokens_BK, cache) -> scalar``: ``inner`` target forwards over the K fresh tokens (a
    chain mask, the LM head at every position) on ``cache``, in one program so timing it leaves dispatch out."""
    from pdecode.decode import common
    from pdecode.model import attention
    from pdecode.model.transformer import decode_layout, forward, unembed

    def many(params, tokens, cache):
        params = decode_layout(params, cfg)
        k = tokens.shape[1]
        pos = cache.lengths[:, None] + jnp.arange(k)[None, :]
        mask = common.step_mask(cfg, cache, attention.causal_intra(k), pos)

        def body(i, carry):
            c, acc = carry
            fo = forward(params, cfg, tokens + (acc > 1e30).astype(tokens.dtype), pos, mask, cache=c)
            return fo.cache, acc + jnp.sum(unembed(params, cfg, fo.hidden))

        return jax.lax.fori_loop(0, inner, body, (cache, jnp.float32(0.0)))[1]

    return many


def timing_cache(cfg, batch: int, context: int, room: int, dtype=jnp.float32):
    """A cache holding ``context`` tokens per row with ``room`` free slots after them, laid out as decoding's."""
    from pdecode.model import cache as kvc
    from pdecode.model.transformer import UNROLL_MAX_LAYERS

    per_layer = cfg.num_layers <= UNROLL_MAX_LAYERS
    return kvc.set_lengths(kvc.init_cache(cfg, batch, context + room, dtype, per_layer=per_layer),
                           jnp.full((batch,), context, jnp.int32))


def measure(model, batch: int, tokens: int, context: int = CONTEXT, reps: int = 5, inner: int = 8) -> float:
    """The time of one target forward (and LM head) over ``tokens`` new tokens per row against one token, at
    ``batch`` rows over a cache holding ``context`` tokens: medians of ``reps`` interleaved timings of ``inner``
    forwards each."""
    params = model.params
    cache = timing_cache(model.cfg, batch, context, tokens, jax.tree.leaves(params)[0].dtype)
    fn = jax.jit(forwards(model.cfg, inner))
    args = {t: jnp.ones((batch, t), jnp.int32) for t in (1, tokens)}
    for t in args:
        jax.block_until_ready(fn(params, args[t], cache))  # compile and warm
    times: dict[int, list[float]] = {t: [] for t in args}
    for _ in range(reps):
        for t in args:
            t0 = time.perf_counter()
            jax.block_until_ready(fn(params, args[t], cache))
            times[t].append(time.perf_counter() - t0)
    return float(np.median(times[tokens]) / np.median(times[1]))


def _kept(key: tuple, measure_now: Callable[[], float], meta: dict) -> float:
    """A ratio memoised under ``key``, else read from its file next to JAX's compilation cache, else measured now
    (and written there)."""
    if key in _MEMO:
        return _MEMO[key]
    path = _file(key)
    try:
        got = float(json.loads(path.read_text())["ratio"]) if path else None
    except (OSError, ValueError, TypeError, KeyError):
        got = None
    if got is None or not got > 0:
        where = f"; kept in {path.parent}" if path is not None else ""
        what = (f"{meta['method']}'s step ({meta['tokens']} tokens) against ar's" if "method" in meta
                else f"a {meta['tokens']}-token forward against a 1-token one")
        print(f"pdecode: timing {what} at batch {meta['batch']} on {jax.devices()[0].device_kind} (once per device, "
              f"model and shape{where}) ...", file=sys.stderr, flush=True)
        got = measure_now()
        if path is not None:
            try:
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_text(json.dumps({"ratio": got, **meta}))
            except OSError:
                pass
    _MEMO[key] = got
    return got


def _env_cost(tokens: int) -> float | None:
    """``PDECODE_VERIFY_COST``'s price of a ``tokens``-token verify (None: not set)."""
    env = _env_costs()
    if not env:
        return None
    if tokens in env:
        return env[tokens]
    below = [k for k in env if k <= tokens]  # a longer verify costs at least what a shorter one does
    return max(env[k] for k in below) if below else 1.0


def _context(context: int) -> int:
    return max(CONTEXT, -(-context // CONTEXT) * CONTEXT)


def verify_cost(model, batch: int, tokens: int, context: int = CONTEXT,
                measure_fn: Callable[..., float] | None = None) -> float:
    """The cost ratio of a ``tokens``-token verify forward against one token on this device (memoised; kept on
    disk next to JAX's compilation cache; ``PDECODE_VERIFY_COST`` overrides)."""
    if tokens <= 1:
        return 1.0
    env = _env_cost(tokens)
    if env is not None:
        return env
    context = _context(context)
    return _kept(_key(model, batch, tokens, context), lambda: (measure_fn or measure)(model, batch, tokens, context),
                 {"tokens": tokens, "batch": batch, "context": context})


PERIOD = 12  # a ``repeat`` prompt's period: every suffix of it has a match, so lookup drafts every step


def measure_steps(model, batch: int, method: str, opts: dict, context: int = CONTEXT, new: int = 16,
                  reps: int = 3, repeat: bool = False) -> float:
    """A step of ``method`` (with ``opts``) against a step of ar, each timed as a whole generation's wall time per
    target forward (drafting, verifying, committing: everything a step does), at ``batch`` rows of a fixed prompt
    of up to 256 tokens (``repeat``: a phrase of `PERIOD` tokens over and over, so a lookup drafter always finds a
    match), greedy. The prefill is taken out: ar's step is the difference between its generations of ``new`` and 4 x
    ``new`` tokens over the difference in their forwards, what else the longer one spent is the prefill's (and fixed)
    time, and the method's step is its 4 x ``new``-token generation less that, over its forwards (a method that
    accepts much takes few: differencing two of its own lengths would be noisy). Rounds interleaved, medians of
    ``reps``."""
    import pdecode

    v = model.cfg.vocab_size
    long = 4 * new
    plen = max(1, min(max(context // 2, 16), 256, model.cfg.max_position_embeddings - long - 8))
    prompt = [[(31 * i + 17 * (j % PERIOD if repeat else j)) % max(v - 2, 1) + 1 for j in range(plen)]
              for i in range(batch)]

    def run(meth, o, n):
        out = pdecode.generate(model, prompt, method=meth, max_new_tokens=n, stop_at_eos=False, temperature=0.0,
                               **o)
        return out.stats["wall_s"], out.stats["target_forwards"]

    def ar_round():
        (w1, f1), (w2, f2) = run("ar", {}, new), run("ar", {}, long)
        step = max(w2 - w1, 1e-9) / max(f2 - f1, 1)
        return step, max(w2 - f2 * step, 0.0)  # (the prefill and fixed costs: what the long run spends besides steps)

    def method_step(fixed):
        w, f = run(method, opts, long)
        return max(w - fixed, 1e-9) / max(f, 1)

    ar_round()  # compile them all
    run(method, opts, long)
    ar, it = [], []
    for _ in range(reps):
        step, fixed = ar_round()
        ar.append(step)
        it.append(method_step(fixed))
    return float(np.median(it) / np.median(ar))


def step_cost(model, batch: int, method: str, opts: dict, tokens: int, context: int = CONTEXT,
              repeat: bool = False) -> float:
    """The cost ratio of one step of ``method`` (``opts``; its verify holds ``tokens`` tokens) against one ar step on
    this device (`measure_steps`, ``repeat`` its prompt; memoised, kept on disk; ``PDECODE_VERIFY_COST`` prices it by
    ``tokens``)."""
    env = _env_cost(tokens)
    if env is not None:
        return env
    context = _context(context)
    key = _key(model, batch, tokens, context) + (method, repr(sorted(opts.items())), "measure_steps", repeat)
    return _kept(key, lambda: measure_steps(model, batch, method, opts, context, repeat=repeat),
                 {"tokens": tokens, "batch": batch, "context": context, "method": method})


def choose(model, batch: int, candidates: Sequence[tuple[int, int]], context: int, what: str, method: str,
           opts_of: Callable[[int], dict]) -> Sizing:
    """The largest candidate ``(size, tokens)`` whose step, ``method``'s whole step at ``opts_of(size)`` against
    ar's (`step_cost`; its verify holds ``tokens`` tokens), costs at most 1 / `FLOOR` of one AR step. Candidates are
    tried from the smallest verify up, so a device where even the smallest does not pay measures one. Size 0 when
    none pays."""
    best, cost_seen = None, None
    for size, tokens in sorted(candidates, key=lambda c: c[1]):
        c = step_cost(model, batch, method, opts_of(size), tokens, context)
        cost_seen = (tokens, c)
        if c > 1 / FLOOR:
            break
        best = Sizing(size, tokens, c, f"{what} {size}: a step verifying {tokens} tokens costs {c:.2f}x an ar step at "
                                       f"batch {batch} on {jax.devices()[0].device_kind}")
    if best is not None:
        return best
    tokens, c = cost_seen
    return Sizing(0, 1, c, f"{what} 0 (ran as ar): a step verifying {tokens} tokens costs {c:.2f}x an ar step at batch "
                           f"{batch} on {jax.devices()[0].device_kind}, more than 1/{FLOOR} (an unlucky step would be "
                           "slower than ar's)")


# a calibrated tree runs only when its expected rate beats ar's by this much: the calibration's prompts come from
# the drafter's training stream, and held-out prompts accept less (SmolLM2's EAGLE-3 heads: a 2-node tree expected
# at 1.01x ar ran at 0.91-0.99x on held-out chat and code, docs/results.md)
PAY_MARGIN = 1.1


def choose_rate(model, batch: int, candidates: Sequence[tuple[dict, int, float]], context: int, what: str,
                method: str) -> tuple[dict | None, Sizing]:
    """The candidate ``(opts, tokens, tokens_per_step)`` that makes the most tokens per unit of time: its expected
    tokens per step (measured on the drafter's calibration data) over the cost of its whole step against an ar step
    (`step_cost`; its verify holds ``tokens`` tokens). Every candidate is timed (a bigger tree accepts more and costs
    more: the rate need not rise or fall with the size). (None, size 0) when even the best rate is below
    `PAY_MARGIN` x ar's (one token per ar step): the method then runs as ar."""
    dev = jax.devices()[0].device_kind
    rated = []
    for opts, tokens, tpf in candidates:
        c = step_cost(model, batch, method, opts, tokens, context)
        rated.append((tpf / c, opts, tokens, tpf, c))
    rate, opts, tokens, tpf, c = max(rated, key=lambda r: r[0])
    table = ", ".join(f"{t - 1}: {p:.2f}/{k:.2f}" for _, _, t, p, k in rated)
    if rate < PAY_MARGIN:
        return None, Sizing(0, 1, c, f"{what} 0 (ran as ar): no tree's expected tokens per step pays for its step's "
                                     f"cost with a {PAY_MARGIN:.2f}x margin at batch {batch} on {dev} (best "
                                     f"{tokens - 1} nodes: {tpf:.2f} tokens per step at {c:.2f}x an ar step; nodes: "
                                     f"tokens/cost {table})")
    note = (f"{what} {tokens - 1}: {tpf:.2f} expected tokens per step at {c:.2f}x an ar step ({rate:.2f}x ar) at "
            f"batch {batch} on {dev}; nodes: tokens/cost {table}")
    return opts, Sizing(tokens - 1, tokens, c, note)
