"""Continuous batching: a fixed set of decode slots that requests enter and leave while the others keep decoding.

The device side is four compiled functions over one `EngineState` (the decode loop's own state, `ar.ARState` or
`speculative.SpecState`, with ``slots`` rows and a cache of ``max_len`` positions, plus each slot's `sampling.Warp`):

* ``prefill_chunk``: one chunk of a prompt into a request's own one-row cache (`common.prefill_at`); a long prompt
  takes several calls, so decode steps of the other slots run between them;
* ``insert``: the request's loop state from that cache (`ar.start` / `speculative.start`: the first token drawn,
  a drafter's state initialised) written into a free slot, with its sampling values, budget and stop ids;
* ``step``: ``k`` decode steps for every live slot (the loop's own `make_step`), the state donated;
* ``release``: a slot marked finished (a stop string seen on the host, a client gone).

Shapes are fixed when the engine is built: prompt chunks come in a few bucket sizes (`CHUNKS` up to ``chunk``), the
state is always ``slots`` rows, and a step compiles in two variants (every live slot greedy and plain, or the
full sampler: per-row temperature / top-k / top-p / min-p, repetition penalty, logprobs). `warmup` compiles them
all; afterwards requests come and go without compiling (``compiles`` counts every compile).

The host side (`Engine.submit`, `Engine.run_once`) keeps the queue, detokenizes incrementally, holds back text that
may begin a stop string, and reports `Event`s. It is single-threaded: a server drives it from one thread.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import itertools
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from pdecode import generation, sampling
from pdecode.decode import ar, common, registry, speculative
from pdecode.errors import InputError
from pdecode.model import cache as kvc
from pdecode.model.transformer import ForwardOut, decode_layout, unrolled

CHUNKS = (32, 64, 128, 256, 512, 1024, 2048)  # prompt chunk sizes (up to the engine's ``chunk``)
MAX_STOP_IDS = 8  # extra stop ids per request


@struct.dataclass
class EngineState:
    loop: Any  # ar.ARState or speculative.SpecState, ``slots`` rows
    warp: sampling.Warp  # [slots] each


@struct.dataclass
class Prefill:
    """A request's prompt on its way in: its own one-row target cache and the prefill's outputs so far."""

    cache: kvc.KVCache
    hidden: jax.Array  # [1, max_len, D] the target's final hidden states at the prompt positions
    layers: jax.Array | None  # [n, 1, max_len, D] requested layer outputs (EAGLE-3), or None
    logits: jax.Array  # [1, V] at the last token fed


@dataclasses.dataclass
class Request:
    """One generation request (token ids in, the values already checked by `Engine.submit`)."""

    prompt: list[int]
    controls: generation.Controls
    seed: int
    id: int = 0
    callback: Callable[["Event"], None] | None = None
    # host-side progress
    slot: int = -1
    fed: int = 0  # prompt tokens prefilled so far
    pre: Any = None
    tokens: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[float] = dataclasses.field(default_factory=list)
    text_sent: int = 0  # characters of the decoded text already reported
    tok_sent: int = 0  # tokens already reported
    read: int = 0  # tokens read back from the slot
    text: str = ""  # the whole text, once finished
    finish_reason: str | None = None
    cancelled: bool = False
    t_submit: float = 0.0
    t_first: float | None = None


@dataclasses.dataclass
class Event:
    """What `Engine.run_once` reports for a request: new text (and tokens), then a last event with
    ``finish_reason`` ("stop": EOS, a stop id or string; "length": the budget; "cancelled")."""

    request_id: int
    text: str
    tokens: list[int]
    logprobs: list[float] | None
    finish_reason: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0


class Engine:
    """Decode slots over one model (module docstring). ``method``: ar, or a draft-and-verify method (sd, lookup,
    tree, eagle, medusa, mtp, lookahead, jacobi, layerskip, with their ``method_options``); ``draft``: its draft
    model; ``slots``: rows decoded together; ``max_len``: cache positions per slot (prompt + output + the method's
    draft slots); ``chunk``: the largest prefill chunk; ``steps_per_call``: decode steps per compiled call (more:
    less host overhead, coarser streaming); ``top_k_max``: the largest top_k a request may ask for."""

    def __init__(self, model, method: str = "ar", draft=None, slots: int = 8, max_len: int = 1024, chunk: int = 256,
                 steps_per_call: int = 4, cache_dtype: str | None = None, top_k_max: int = 64, **method_options):
        from pdecode import api

        if not isinstance(slots, int) or slots < 1:
            raise InputError(f"slots must be an integer >= 1, got {slots!r}")
        if chunk not in CHUNKS:
            raise InputError(f"chunk must be one of {', '.join(map(str, CHUNKS))}, got {chunk!r}")
        if not isinstance(steps_per_call, int) or steps_per_call < 1:
            raise InputError(f"steps_per_call must be an integer >= 1, got {steps_per_call!r}")
        meth = registry.get(method)
        not_here = InputError(f"method {method!r} does not run in the serving engine: it takes ar and the "
                              f"draft-and-verify methods (sd, lookup, tree, eagle, medusa, mtp, ...)")
        if meth.wants_max_new:  # a masked-diffusion canvas, not a token loop
            raise not_here
        opts = registry.resolve_options(meth, method_options)
        if meth.needs_draft and draft is None:
            raise InputError(f"method {method!r} needs a draft model: pass draft=pdecode.load(...)")
        if draft is not None:
            api._check_same_tokenizer(model, draft)
        self.model, self.method, self.slots, self.chunk, self.k = model, method, slots, chunk, steps_per_call
        self.vocab = model.cfg.vocab_size
        self.top_k_max = min(int(top_k_max), self.vocab)
        self.full = sampling.Sampling(greedy=False, top_k=self.top_k_max, use_top_p=True, use_min_p=True,
                                      penalty=True, logprobs=True)
        self.fast = sampling.Sampling(greedy=True, logprobs=True)  # logprobs: same state layout; written when asked
        plan = meth.prepare(model, draft, opts, self.full)
        if plan.fn is ar.generate:
            self.drafter = None
        elif plan.fn is speculative.generate:
            self.drafter = plan.static["drafter"]
        else:
            raise not_here
        self.extra = plan.extra_len
        if max_len > model.cfg.max_position_embeddings:
            raise InputError(f"max_len ({max_len}) exceeds the model's context of "
                             f"{model.cfg.max_position_embeddings} tokens")
        self.max_len = int(max_len)
        if self.max_len < CHUNKS[0] + self.extra + 2:
            raise InputError(f"max_len must be at least {CHUNKS[0] + self.extra + 2} for method {method!r}")
        self.eos = api.eos_ids(model)
        self.kv_dtype = api.resolve_cache_dtype(model, cache_dtype)
        self.params = plan.params  # the target's params, or (target, drafter) params
        self.compiles = 0
        self._exe: dict = {}
        self._hid = self.drafter.hidden_layers if self.drafter is not None else ()
        self._rng = np.random.default_rng()
        self._ids = itertools.count(1)
        self.queue: collections.deque[Request] = collections.deque()
        self.running: dict[int, Request] = {}  # slot -> request
        self.state = None
        self.stats = collections.Counter()

    # ------------------------------------------------------------------------------------------ device functions
    def _tparams(self, params):
        return params if self.drafter is None else params[0]

    def _layout(self, params):
        tp = decode_layout(self._tparams(params), self.model.cfg, fuse=True)
        if self.drafter is None:
            return tp, None
        return tp, self.drafter.prepare(params[1], None)

    def _start(self, params, prompt_BP, plen_B, cache, logits, pre, key, warp, stops, samp):
        tp, dp = self._layout(params)
        if self.drafter is None:
            return ar.start(prompt_BP, plen_B, cache, logits, key, warp, stops, max_new=self.max_len,
                            eos_ids=self.eos, samp=samp)
        return speculative.start(tp, dp, prompt_BP, plen_B, cache, logits, pre, key, warp, stops,
                                 cfg=self.model.cfg, drafter=self.drafter, max_new=self.max_len,
                                 max_len=self.max_len, eos_ids=self.eos, samp=samp, cache_dtype=self.kv_dtype)

    def _row_state(self, params, b: int):
        """The loop state of ``b`` rows (for shapes): from zeros."""
        cfg = self.model.cfg
        per_layer = unrolled(decode_layout(self._tparams(params), cfg, fuse=True))
        cache = kvc.init_cache(cfg, b, self.max_len, self.kv_dtype, per_layer=per_layer)
        prompt = jnp.zeros((b, self.max_len), jnp.int32)
        plen = jnp.ones((b,), jnp.int32)
        hd = self._hidden_dtype()
        hid = jnp.zeros((b, self.max_len, cfg.hidden_size), hd)
        layers = jnp.zeros((len(self._hid), b, self.max_len, cfg.hidden_size), hd) if self._hid else None
        warp = sampling.Warp.of(*(np.zeros(b),) * 4, np.ones(b))
        stops = common.Stops(limit=jnp.ones((b,), jnp.int32), stop_ids=jnp.full((b, MAX_STOP_IDS), -1, jnp.int32))
        key = jnp.zeros((b, 2), jnp.uint32)
        return self._start(params, prompt, plen, cache, jnp.zeros((b, self.vocab), jnp.float32),
                           ForwardOut(hidden=hid, cache=None, layer_hidden=layers), key, warp, stops, self.full)

    def _empty(self, params) -> EngineState:
        shapes = jax.eval_shape(functools.partial(self._row_state, b=self.slots), params)
        loop = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)
        loop = loop.replace(out=loop.out.replace(done=jnp.ones((self.slots,), bool)))
        n = self.slots
        return EngineState(loop=loop, warp=sampling.Warp.of(np.zeros(n), np.ones(n), np.zeros(n, np.int32),
                                                            np.zeros(n), np.ones(n)))

    def _batch_axes(self):
        """Per leaf of the loop state: its row axis (None for counters shared by the batch), from the shapes at two
        batch sizes."""
        a = jax.eval_shape(functools.partial(self._row_state, b=2), self.params)
        b = jax.eval_shape(functools.partial(self._row_state, b=3), self.params)

        def axis(x, y):
            d = [i for i, (p, q) in enumerate(zip(x.shape, y.shape)) if p != q]
            return d[0] if d else None

        return jax.tree.map(axis, a, b)

    def _prefill_fn(self, params, pre: Prefill, tokens_1T, n_1):
        tp = decode_layout(self._tparams(params), self.model.cfg, fuse=True)
        start = pre.cache.lengths
        cache, logits, fo = common.prefill_at(tp, self.model.cfg, tokens_1T, start, n_1, pre.cache, self._hid)
        pos = start[0] + jnp.arange(tokens_1T.shape[1])  # positions past the cache's end are dropped
        hidden = pre.hidden.at[:, pos].set(fo.hidden.astype(pre.hidden.dtype), mode="drop")
        layers = pre.layers
        if layers is not None:
            layers = layers.at[:, :, pos].set(fo.layer_hidden.astype(layers.dtype), mode="drop")
        return Prefill(cache=cache, hidden=hidden, layers=layers, logits=logits)

    def _insert_fn(self, params, st: EngineState, pre: Prefill, prompt_1L, plen_1, slot, seed_1, warp1, limit_1,
                   stop_ids_1S, *, axes):
        key = sampling.row_keys(seed_1)
        stops = common.Stops(limit=limit_1, stop_ids=stop_ids_1S)
        row = self._start(params, prompt_1L, plen_1, pre.cache, pre.logits,
                          ForwardOut(hidden=pre.hidden, cache=None, layer_hidden=pre.layers), key, warp1, stops,
                          self.full)

        def put(big, small, ax):
            if ax is None:
                return big
            return jax.lax.dynamic_update_slice_in_dim(big, small.astype(big.dtype), slot, axis=ax)

        loop = jax.tree.map(put, st.loop, row, axes)
        warp = jax.tree.map(lambda big, small: big.at[slot].set(small[0]), st.warp, warp1)
        return EngineState(loop=loop, warp=warp)

    def _step_fn(self, params, st: EngineState, read_B, *, samp, k: int):
        """``k`` steps; returns (state, (count, done, the tokens and logprobs from ``read`` on: [slots, W]))."""
        tp, dp = self._layout(params)
        cfg = self.model.cfg
        if self.drafter is None:
            one = ar.make_step(tp, st.warp, cfg=cfg, eos_ids=self.eos, samp=samp)
        else:
            one = speculative.make_step(tp, dp, st.warp, cfg=cfg, drafter=self.drafter, max_len=self.max_len,
                                        eos_ids=self.eos, samp=samp)
        def cond(c):
            i, s = c
            return (i < k) & ~jnp.all(s.out.done)

        _, loop = jax.lax.while_loop(cond, lambda c: (c[0] + 1, one(c[1])), (jnp.int32(0), st.loop))
        out = loop.out
        w = k * self._per_step() + 1  # + 1: a slot's first token, drawn when it was inserted
        idx = jnp.minimum(read_B[:, None] + jnp.arange(w)[None, :], out.tokens.shape[1] - 1)
        new = jnp.take_along_axis(out.tokens, idx, axis=1)
        lps = jnp.take_along_axis(out.logprobs, idx, axis=1)
        return EngineState(loop=loop, warp=st.warp), (out.count, out.done, new, lps)

    def _per_step(self) -> int:
        return 1 if self.drafter is None else self.drafter.max_depth + 1

    @staticmethod
    def _release_fn(st: EngineState, slot):
        out = st.loop.out
        return st.replace(loop=st.loop.replace(out=out.replace(done=out.done.at[slot].set(True))))

    # ------------------------------------------------------------------------------------------ compile
    def _compile(self, name, fn, *args, static=None, donate=()):
        static = static or {}
        key = (name, tuple(sorted(static.items(), key=lambda kv: kv[0])))
        if key not in self._exe:
            self.compiles += 1
            self._exe[key] = jax.jit(fn, static_argnames=tuple(static), donate_argnums=donate).lower(
                *args, **static).compile()
        return self._exe[key]

    def _hidden_dtype(self):
        return jnp.dtype(self.model.cfg.activation_dtype or self.model.dtype)

    def _blank_prefill(self) -> Prefill:
        """A request's empty prefill state (numpy zeros: no device op, nothing compiled)."""
        cfg = self.model.cfg
        per_layer = unrolled(decode_layout(self._tparams(self.params), cfg, fuse=True))
        shapes = jax.eval_shape(lambda: kvc.init_cache(cfg, 1, self.max_len, self.kv_dtype, per_layer=per_layer))
        cache = jax.tree.map(lambda a: np.zeros(a.shape, a.dtype), shapes)
        hd = self._hidden_dtype()
        layers = np.zeros((len(self._hid), 1, self.max_len, cfg.hidden_size), hd) if self._hid else None
        return Prefill(cache=cache, hidden=np.zeros((1, self.max_len, cfg.hidden_size), hd), layers=layers,
                       logits=np.zeros((1, self.vocab), np.float32))

    def warmup(self) -> float:
        """Compile every function the engine calls (prefill chunks, insert, both step variants, release); returns
        the seconds it took. Called by the first `run_once` if not before."""
        t0 = time.perf_counter()
        if self.state is None:
            self.state = jax.jit(self._empty)(self.params)
            self.compiles += 1
            self._axes = self._batch_axes()
        pre = self._blank_prefill()
        for c in self._chunk_sizes():
            self._compile(("prefill", c), self._prefill_fn, self.params, pre, np.zeros((1, c), np.int32),
                          np.ones((1,), np.int32))
        self._insert_exe(pre)
        for samp in (self.fast, self.full):
            self._step_exe(samp)
        self._compile("release", self._release_fn, self.state, np.int32(0), donate=(0,))
        self.warm_compiles = self.compiles
        return time.perf_counter() - t0

    def _chunk_sizes(self):
        return [c for c in CHUNKS if c <= self.chunk]

    def _insert_exe(self, pre):
        n = 1
        return self._compile(
            "insert", functools.partial(self._insert_fn, axes=self._axes), self.params, self.state, pre,
            np.zeros((1, self.max_len), np.int32), np.ones((1,), np.int32), np.int32(0), np.zeros((n,), np.uint32),
            sampling.Warp.of(np.zeros(n, np.float32), np.ones(n, np.float32), np.zeros(n, np.int32),
                             np.zeros(n, np.float32), np.ones(n, np.float32)),
            np.ones((1,), np.int32), np.full((1, MAX_STOP_IDS), -1, np.int32), donate=(1,))

    def _step_exe(self, samp):
        return self._compile(("step", samp.greedy), self._step_fn, self.params, self.state,
                             np.zeros((self.slots,), np.int32), static={"samp": samp, "k": self.k}, donate=(1,))

    # ------------------------------------------------------------------------------------------ host API
    def check(self, prompt: list[int], max_tokens: int | None = None, **controls) -> generation.Controls:
        """The request's controls resolved and checked against this engine (one-line InputError otherwise)."""
        if not prompt:
            raise InputError("the prompt is empty: give at least one token")
        if min(prompt) < 0 or max(prompt) >= self.vocab:
            raise InputError(f"prompt token ids must lie in [0, {self.vocab})")
        ctl = generation.resolve(self.model.generation_config, self.vocab, dict(max_new_tokens=max_tokens, **controls))
        room = self.max_len - self.extra - 1 - len(prompt)
        if room < 1:
            raise InputError(f"the prompt has {len(prompt)} tokens; this server's context holds "
                             f"{self.max_len - self.extra - 2} (prompt and output together): shorten the prompt")
        if ctl.max_new_tokens > room:
            raise InputError(f"max_tokens ({ctl.max_new_tokens}) + the prompt ({len(prompt)} tokens) exceed this "
                             f"server's context ({self.max_len - self.extra - 1}): ask for at most {room} tokens")
        if ctl.top_k > self.top_k_max:
            raise InputError(f"top_k must be at most {self.top_k_max} here, got {ctl.top_k}")
        if len(ctl.stop_token_ids) > MAX_STOP_IDS:
            raise InputError(f"at most {MAX_STOP_IDS} stop token ids, got {len(ctl.stop_token_ids)}")
        return ctl

    def submit(self, prompt: list[int], controls: generation.Controls, seed: int | None = None,
               callback: Callable[[Event], None] | None = None) -> Request:
        """Queue a request (``controls`` from `check`); its events go to ``callback`` and are returned by
        `run_once`."""
        if seed is None:
            seed = int(self._rng.integers(0, 2**31 - 1))
        r = Request(prompt=list(prompt), controls=controls, seed=int(seed) % (2**32), id=next(self._ids),
                    callback=callback, t_submit=time.perf_counter())
        self.queue.append(r)
        return r

    def cancel(self, req: Request) -> None:
        """Stop a request (a client gone): its slot is freed at the next `run_once`."""
        req.cancelled = True

    @property
    def idle(self) -> bool:
        return not self.queue and not self.running

    def run_once(self) -> list[Event]:
        """One round: fill free slots from the queue (prefilling one chunk per request), then one compiled call of
        ``steps_per_call`` decode steps for the live slots; returns the events of this round."""
        if self.state is None:
            self.warmup()
        events: list[Event] = []
        self._drop_cancelled(events)
        self._admit(events)
        if any(r.fed >= len(r.prompt) for r in self.running.values()):
            events += self._decode()
        for e in events:
            r = self._by_id.get(e.request_id)
            if r is not None and r.callback is not None:
                r.callback(e)
        for e in events:
            if e.finish_reason is not None:
                self._by_id.pop(e.request_id, None)
        return events

    @property
    def _by_id(self) -> dict:
        if not hasattr(self, "_reqs"):
            self._reqs = {}
        return self._reqs

    def _drop_cancelled(self, events):
        for slot, r in list(self.running.items()):
            if r.cancelled:
                self._free(slot)
                events.append(self._final(r, "cancelled"))
        for r in [r for r in self.queue if r.cancelled]:
            self.queue.remove(r)
            self._by_id[r.id] = r
            events.append(self._final(r, "cancelled"))

    def _admit(self, events):
        free = [s for s in range(self.slots) if s not in self.running]
        while free and self.queue:
            r = self.queue.popleft()
            self._by_id[r.id] = r
            r.slot = free.pop(0)
            r.pre = self._blank_prefill()
            self.running[r.slot] = r
        for r in self.running.values():  # one chunk per request still prefilling
            if r.fed < len(r.prompt):
                self._feed_chunk(r)
                if r.fed >= len(r.prompt):
                    self._insert(r)

    def _feed_chunk(self, r: Request):
        rest = len(r.prompt) - r.fed
        size = next((c for c in self._chunk_sizes() if c >= rest), self.chunk)
        n = min(rest, size)
        toks = np.zeros((1, size), np.int32)
        toks[0, :n] = r.prompt[r.fed: r.fed + n]
        exe = self._exe[(("prefill", size), ())]
        r.pre = exe(self.params, r.pre, toks, np.asarray([n], np.int32))
        r.fed += n
        self.stats["prefill_chunks"] += 1

    def _insert(self, r: Request):
        c = r.controls
        prompt = np.zeros((1, self.max_len), np.int32)
        prompt[0, : len(r.prompt)] = r.prompt
        ids = np.full((1, MAX_STOP_IDS), -1, np.int32)
        ids[0, : len(c.stop_token_ids)] = c.stop_token_ids
        warp = sampling.Warp.of(np.asarray([c.temperature], np.float32), np.asarray([c.top_p], np.float32),
                                np.asarray([c.top_k if c.temperature > 0 else 0], np.int32),
                                np.asarray([c.min_p if c.temperature > 0 else 0.0], np.float32),
                                np.asarray([c.repetition_penalty], np.float32))
        exe = self._exe[("insert", ())]
        self.state = exe(self.params, self.state, r.pre, prompt, np.asarray([len(r.prompt)], np.int32),
                         np.int32(r.slot), np.asarray([r.seed], np.uint32), warp,
                         np.asarray([c.max_new_tokens], np.int32), ids)
        r.pre = None
        r.read = 0  # tokens read back from the slot so far
        self.stats["inserted"] += 1

    def _decode(self) -> list[Event]:
        live = [r for r in self.running.values() if r.fed >= len(r.prompt)]
        plain = all(r.controls.temperature == 0 and r.controls.repetition_penalty == 1.0 and not r.controls.logprobs
                    for r in live)
        exe = self._exe[(("step", plain), (("k", self.k), ("samp", self.fast if plain else self.full)))]
        read = np.zeros((self.slots,), np.int32)
        for r in live:
            read[r.slot] = r.read
        self.state, (count, done, new, lps) = exe(self.params, self.state, read)
        count, done, new, lps = (np.asarray(x) for x in (count, done, new, lps))
        self.stats["steps"] += 1
        events = []
        for r in live:
            s = r.slot
            k = int(count[s] - r.read)
            r.tokens += new[s, :k].tolist()
            if r.controls.logprobs:
                r.logprobs += lps[s, :k].tolist()
            r.read += k
            ev = self._progress(r, bool(done[s]))
            if ev is not None:
                events.append(ev)
        return events

    def _progress(self, r: Request, device_done: bool) -> Event | None:
        """The request's new text since the last event; finished when the device says so or a stop string shows."""
        tok = self.model.tokenizer
        if r.t_first is None and r.tokens:
            r.t_first = time.perf_counter()
        text = tok.decode(r.tokens) if tok is not None else ""
        stops = r.controls.stop
        at = generation.find_stop(text, stops) if stops else -1
        if at >= 0:
            cut, text, _ = generation.cut_at_stop(r.tokens, tok.decode, stops)
            r.tokens = cut
            r.logprobs = r.logprobs[: len(cut)]
            return self._finish(r, text, "stop", release=not device_done)
        if device_done:
            last = r.tokens[-1] if r.tokens else -1
            reason = "stop" if (last in self.eos or last in r.controls.stop_token_ids) else "length"
            return self._finish(r, text, reason, release=False)
        hold = generation.held_back(text, stops) if stops else 0
        if text.endswith("\ufffd"):  # an incomplete UTF-8 sequence: wait for the rest of it
            hold = max(hold, 1)
        return self._delta(r, text[: len(text) - hold])

    def _delta(self, r: Request, text: str, reason: str | None = None) -> Event | None:
        delta = text[r.text_sent:]
        n_before = r.tok_sent
        toks = r.tokens[n_before:]
        r.finish_reason = reason
        if not delta and not toks and reason is None:
            return None
        r.text_sent = max(r.text_sent, len(text))
        r.tok_sent = len(r.tokens)
        return Event(request_id=r.id, text=delta, tokens=toks,
                     logprobs=r.logprobs[n_before:] if r.controls.logprobs else None, finish_reason=reason,
                     prompt_tokens=len(r.prompt), completion_tokens=len(r.tokens))

    def _finish(self, r: Request, text: str, reason: str, release: bool) -> Event:
        self._free(r.slot, release)
        r.text = text
        return self._delta(r, text, reason)

    def _final(self, r: Request, reason: str) -> Event:
        r.finish_reason = reason
        return Event(request_id=r.id, text="", tokens=[], logprobs=None, finish_reason=reason,
                     prompt_tokens=len(r.prompt), completion_tokens=len(r.tokens))

    def _free(self, slot: int, release: bool = True):
        """Forget the slot's request; ``release``: also stop the slot on the device (it was still decoding)."""
        r = self.running.pop(slot, None)
        if release and r is not None and r.pre is None and r.fed >= len(r.prompt):
            self.state = self._exe[("release", ())](self.state, np.int32(slot))

    # ------------------------------------------------------------------------------------------ convenience
    def generate(self, prompts: list[list[int]], **controls) -> list[Event]:
        """Run ``prompts`` to completion through the slots (more prompts than slots queue); returns each request's
        final state as one event (the whole text), in order."""
        reqs = [self.submit(p, self.check(p, **controls)) for p in prompts]
        while not self.idle:
            self.run_once()
        return [Event(request_id=r.id, text=r.text, tokens=r.tokens, logprobs=r.logprobs or None,
                      finish_reason=r.finish_reason, prompt_tokens=len(r.prompt), completion_tokens=len(r.tokens))
                for r in reqs]
