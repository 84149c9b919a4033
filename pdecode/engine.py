"""Continuous batching: a fixed set of decode slots that requests enter and leave while the others keep decoding.

The device side is a few compiled functions over one `EngineState` (the decode loop's own state, `ar.ARState` or
`speculative.SpecState`, with ``slots`` rows and a cache of ``max_len`` positions, plus each slot's `sampling.Warp`):

* ``admit``: requests into free slots, up to `ADMIT_ROWS` per call: each prompt prefilled (`common.prefill_at`),
  its loop state started (`ar.start` / `speculative.start`: the first token drawn, a drafter's state initialised)
  and written over the slot's row with its sampling values, budget and stop ids;
* ``prefill``: one middle chunk of a long prompt into the request's own one-row cache; such a prompt takes one
  chunk per round, so the other slots keep decoding, and its last chunk goes in with ``admit``;
* ``step``: ``k`` decode steps for every live slot (the loop's own `make_step`), the state donated; with
  ``speculation="auto"`` a draft-and-verify engine also has a *plain* step (the target alone, one token per row, the
  drafter's state kept by `Drafter.follow`, or left to lag and caught up by the next drafted call,
  `Drafter.follow_late`) and picks one of the two per call by its cost model (below);
* ``catch_up``: (``speculation="auto"`` with a draft model) the draft that plain calls left to lag, fed before the
  next drafted call, per row bucket;
* ``grammar_put``: (structured output) one window of a newly placed grammar's tables written into the device's;
* ``release``: a slot marked finished (a stop string seen on the host, a client gone).

Shapes are fixed when the engine is built: prompts come in a few bucket sizes (`CHUNKS` up to ``chunk``), admissions
one or `ADMIT_ROWS` at a time, the state is always ``slots`` rows, and a step compiles in two variants (every live
slot greedy and plain, or the full sampler: per-row temperature / top-k / top-p / min-p, repetition penalty,
logprobs), each per attention span (``spans``: the cache positions a call attends over) and per row bucket
(``row_buckets``: a call decodes the first rows alone when every live slot is among them). `warmup` compiles them
all; afterwards requests come and go without compiling (``compiles`` counts).

With ``kv_pages`` the target's KV cache is paged (`cache.PagedKVCache`): the slots share a pool of pages, a request
holds the pages it needs from its admission to its end (the host keeps the page table and free list; every admission
call takes the whole table, so a page freed by a finished row is remapped in the same program that hands it on).

Speculation by cost (``speculation="auto"``): a step call costs the same whatever the number of live slots (the
shapes are static), so speculating pays exactly when a drafted step's tokens per row, tau, exceed the ratio of the
two step programs' costs. Warm-up times both for each row bucket, each kind at its own span (``spec_costs``; the
full bucket's is ``spec_cost``: first guesses); while serving, the engine keeps tau from the acceptance of its
recent drafted calls and, per row bucket and span, each kind's row steps per second per live row from the calls
themselves (the steps a call's rows took before they ended, over the time from one step call's results being turned
into events to the next one's, in rounds that admitted nothing, of calls that some row ran to their last step; all
decayed): the ratio of the two rates, each kind's at the span it would get, is the cost ratio as served (rows that end
early in a call, the host's share included), and the engine drafts while tau reaches it times `SPEC_MARGIN` (1.2:
what the rates leave out), or the warm-up's ratio as it is while a kind has no rate there, with a
call of the other kind now and then to keep the figures current (`probe_interval`: every 8 calls when such a probe
costs little and the choice is close, up to every 256 when it costs much or one kind leads far). A ``spec_cost``
given is kept as it is (no timing: every process of a multi-process server must choose alike). Each kind of step is
lossless given the sequence so far, so any mix of them is (greedy output is unchanged; a seeded sampled request may
take a different but equally distributed path when the mix changes).

The host side (`Engine.submit`, `Engine.run_once`) keeps the queue, detokenizes incrementally, holds back text that
may begin a stop string, and reports `Event`s. A round dispatches the next step before it reads the previous one's
results, so host work overlaps device work — unless that call may free a slot (a row reaching its budget in it):
then its results are read first, so the slot is refilled and the next span sized without it. It is
single-threaded: a server drives it from one thread (a background warm-up's thread only compiles programs:
`Engine.warmup`).
"""

from __future__ import annotations

import atexit
import collections
import contextlib
import dataclasses
import functools
import itertools
import math
import os
import threading
import time
import weakref
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
ADMIT_ROWS = 4  # requests admitted together when several wait (their prefill batched: cheaper per request)
SPECULATION = ("always", "auto")
MIN_SPAN = 128  # the shortest attention span a step program is compiled for by default (`default_spans`)
PAGE_SIZE = 16  # positions per page of a paged KV cache (`Engine(kv_pages=...)`)
MIN_PREFIX = 32  # prompt tokens a kept prefix must cover to be used or kept (`Engine(prefix_cache=...)`)
PROBE_EVERY = 8  # speculation="auto": at most one call of the kind not chosen in this many (tau, timings current)
PROBE_SHARE = 0.03  # ... and fewer while a probe costs more: its tokens lost, at most this share of the throughput
PROBE_MAX = 256  # ... but one in this many at least
PROBE_LEAD = 0.1  # ... and fewer while the chosen kind leads by more: PROBE_EVERY calls more per lead of this share
LATE_CALLS = 8  # speculation="auto": a drafted call catches up a draft that lagged through plain calls in forwards
# this many calls' tokens wide
SPEC_MARGIN = 1.2  # speculation="auto": a call drafts while tau reaches the served rates' cost ratio times this
# (the served rates leave out what a kind costs around admissions; at 4 clients on the CPU they put drafting at
# break-even where whole passes of drafted calls gave 0.84x plain ones' tokens/s)
WARM_THREAD = "pdecode-warmup"  # the name of the thread that compiles the rest of warm-up (`Engine.warmup`)
LONE_STEPS = 4  # a step call that decodes one row alone (one client) runs this many times ``steps_per_call`` steps
MAPS_SHARE = 0.95  # warm-up refuses to compile what would take the process past this share of its memory maps (CPU)
TAU_DECAY = 0.8  # weight of older calls in tau and in each kind's seconds per call (per newer call)
GRAMMAR_ROWS = 64  # structured output: a grammar placed in the tables goes up in windows of this many states (32 KiB
GRAMMAR_WIDTH = 1 << 14  # each of allow and base at a 4096 vocabulary) and this many transitions (64 KiB of nexts)
GRAMMAR_WINDOWS = 16  # ... at most this many such calls, else the tables go up whole


@struct.dataclass
class EngineState:
    loop: Any  # ar.ARState or speculative.SpecState, ``slots`` rows
    warp: sampling.Warp  # [slots] each (``grammar_start`` each slot's grammar's start state; ``grammar`` None)
    grammar: Any = None  # the `grammar.Tables` of the grammars requests brought (structured output), or None


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
    pre: Any = None  # a long prompt's `Prefill` between its chunks
    inserted: bool = False  # in its slot, decoding
    tokens: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[float] = dataclasses.field(default_factory=list)
    text_sent: int = 0  # characters of the decoded text already reported
    tok_sent: int = 0  # tokens already reported
    text: str = ""  # the whole text, once finished
    finish_reason: str | None = None
    cancelled: bool = False
    t_submit: float = 0.0
    t_first: float | None = None
    forwards: int = 0  # target forwards while decoding it (its prefill's counts one), as of its last event
    accepted: list[int] | None = None  # draft-and-verify: steps that accepted k drafted tokens, k = 0..depth
    gstart: int = 0  # its grammar's start state in the engine's tables (0: none)
    pages: list[int] = dataclasses.field(default_factory=list)  # the KV pages it holds (a paged engine)


@dataclasses.dataclass
class Event:
    """What `Engine.run_once` reports for a request: new text (and tokens), then a last event with
    ``finish_reason`` ("stop": EOS, a stop id or string; "length": the budget; "cancelled"). ``forwards``: the
    target forwards the request has taken so far (its prefill's one included; ``completion_tokens / forwards`` is
    its tokens per forward). ``accepted`` (draft-and-verify methods): per k = 0..depth, the request's verify steps so
    far that accepted k drafted tokens."""

    request_id: int
    text: str
    tokens: list[int]
    logprobs: list[float] | None
    finish_reason: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    forwards: int = 0
    accepted: list[int] | None = None


def to_host(x):
    """A result as numpy on this process (gathered when it lies on other processes' devices)."""
    from pdecode.api import to_host as gather

    return gather(x)


_ONE_AT_A_TIME = threading.Lock()


class _OneAtATime:
    """A compiled program that returns only once its results are ready, one such program running in the process at
    a time. For a mesh of XLA:CPU devices (the forced host devices of tests, gloo processes): two sharded programs in
    flight there may each hold some of the devices' threads waiting in a collective's rendezvous for the others, a
    stall XLA ends by aborting the process (seen as a worker killed in CI, about 1 run in 6 of a mesh test)."""

    def __init__(self, exe):
        self.exe = exe

    def __call__(self, *args, **kwargs):
        with _ONE_AT_A_TIME:
            return jax.block_until_ready(self.exe(*args, **kwargs))

    def __getattr__(self, name):
        return getattr(self.exe, name)


def _rows_head(tree, axes, rows: int):
    """The first ``rows`` of every leaf of ``tree`` whose row axis ``axes`` names (a leaf with None: shared, kept)."""
    return jax.tree.map(lambda x, ax: x if ax is None else jax.lax.slice_in_dim(x, 0, rows, axis=ax), tree, axes)


def _put_rows_head(whole, part, axes):
    """``whole`` with each leaf's first rows replaced by ``part``'s (`_rows_head`'s cut, after work on it); a leaf with
    no row axis (shared by the batch: a lookahead pool's clock, counters) is the part's, updated."""
    return jax.tree.map(lambda x, y, ax: y if ax is None else jax.lax.dynamic_update_slice_in_dim(
        x, y.astype(x.dtype), 0, ax), whole, part, axes)


class Engine:
    """Decode slots over one model (module docstring). ``method``: ar, or a draft-and-verify method (sd, lookup,
    tree, eagle, medusa, mtp, lookahead, jacobi, layerskip, with their ``method_options``); ``draft``: its draft
    model; ``slots``: rows decoded together; ``max_len``: cache positions per slot (prompt + output + the method's
    draft slots); ``chunk``: the largest prefill chunk; ``steps_per_call``: decode steps per compiled call (more:
    less overhead a call, coarser streaming; a call of one row alone, one client on a server of several slots,
    runs `LONE_STEPS` times as many: `steps_for`); ``top_k_max``: the largest top_k a request may ask for;
    ``admit_rows``: requests admitted by one call when several wait; ``speculation``: "always" (every step drafts)
    or "auto" (drafted or plain steps by the cost model, module docstring; drafters that cannot follow a plain step
    keep drafting, `speculation_note` says why); ``spec_cost``: the cost ratio of a drafted step call to a plain one
    (None: measured at warm-up); ``prefix_cache``: prompts' prefixes kept on the device (0: off) so that a request
    starting with a kept prefix (a shared system prompt) prefills only the rest (`_take_prefix`);
    ``spans``: the attention spans step programs are compiled for (None: `default_spans`; ``[max_len]``: every step
    attends over the whole cache); ``grammar_states`` / ``grammar_transitions``: the structured-output tables' sizes
    (requests' grammars share them; None: `grammar.default_states` / `grammar.DEFAULT_TRANSITIONS`; 0 states:
    structured output off); ``kv_pages``: a paged target KV cache of this many pages of ``page_size`` positions
    that the slots share (a request holds the pages its prompt, budget and draft slots need, from its admission to
    its end; one waits in the queue while the free pages are too few), so more slots fit in the memory of fewer
    ``max_len`` rows (None: each slot reserves ``max_len`` positions); ``row_buckets``: the row counts step programs
    are compiled for besides ``slots`` (None: `default_row_buckets`): a step call decodes the first rows alone when
    every live slot lies among them (requests take the lowest free slot), so a few clients do not pay for every
    slot's compute."""

    def __init__(self, model, method: str = "ar", draft=None, slots: int = 8, max_len: int = 1024, chunk: int = 256,
                 steps_per_call: int = 4, cache_dtype: str | None = None, top_k_max: int = 64,
                 admit_rows: int = ADMIT_ROWS, speculation: str = "always", spec_cost: float | None = None,
                 grammar_states: int | None = None, grammar_transitions: int | None = None, prefix_cache: int = 0,
                 spans=None, kv_pages: int | None = None, page_size: int = PAGE_SIZE, row_buckets=None,
                 **method_options):
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
        model, draft = api.assistant_as_draft(model, draft)
        model, draft = api.as_model(model), api.as_model(draft, "draft", optional=True)
        # a longrope model rotates every request with the factors of the engine's context, whatever a call's span
        model, draft = api._with_rope_context(model, max_len), api._with_rope_context(draft, max_len)
        registry.check_models(meth, model, draft)
        opts = registry.resolve_options(meth, method_options)
        self._opts = sorted(opts.items())
        if meth.needs_draft and draft is None:
            raise InputError(f"method {method!r} needs a draft model: pass draft=pdecode.load(...)",
                             cli=f"method {method!r} needs a draft model: add --draft (a zoo name such as "
                                 "code-draft, or a model directory)")
        if draft is not None:
            api.check_same_tokenizer(model, draft)
        if not isinstance(admit_rows, int) or admit_rows < 1:
            raise InputError(f"admit_rows must be an integer >= 1, got {admit_rows!r}")
        if not isinstance(prefix_cache, int) or isinstance(prefix_cache, bool) or prefix_cache < 0:
            raise InputError(f"prefix_cache must be an integer >= 0 (prefixes kept), got {prefix_cache!r}")
        self.prefix_entries = prefix_cache
        self._prefixes: collections.OrderedDict[int, list[int]] = collections.OrderedDict()  # entry -> its tokens
        self._store = None  # the kept prefixes' `Prefill`s, stacked: [prefix_cache, ...] per leaf
        self.model, self.method, self.slots, self.chunk, self.k = model, method, slots, chunk, steps_per_call
        self.admit_rows = min(admit_rows, slots)
        self.vocab = model.cfg.vocab_size
        self.top_k_max = min(int(top_k_max), self.vocab)
        from pdecode import grammar

        gs = grammar.default_states(self.vocab) if grammar_states is None else grammar_states
        gt = grammar.DEFAULT_TRANSITIONS if grammar_transitions is None else grammar_transitions
        for name, x in (("grammar_states", gs), ("grammar_transitions", gt)):
            if not isinstance(x, int) or isinstance(x, bool) or x < 0:
                raise InputError(f"{name} must be an integer >= 0, got {x!r}")
        self.pool = grammar.Pool(self.vocab, gs, max(gt, 1)) if gs > 1 else None  # state 0 is the free state
        self._pool_version = 0 if self.pool is None else self.pool.version  # (= the blank tables of the empty state)
        self.full = sampling.Sampling(greedy=False, top_k=self.top_k_max, use_top_p=True, use_min_p=True,
                                      penalty=True, logprobs=True, counts=True, bias=True, min_tokens=True,
                                      grammar=self.pool is not None)
        self.fast = sampling.Sampling(greedy=True)  # every live slot greedy, no penalty, no logprobs
        plan = meth.prepare(model, draft, opts, self.full,
                            **({"batch": slots, "context": max_len, "engine": True} if meth.wants_batch else {}))
        if plan.engine is None:
            raise not_here
        self.drafter = plan.static["drafter"] if plan.engine == "draft_verify" else None
        if speculation not in SPECULATION:
            raise InputError(f"speculation must be one of {', '.join(SPECULATION)}, got {speculation!r}")
        if spec_cost is not None and not (isinstance(spec_cost, (int, float)) and spec_cost > 0):
            why = f"must be a number > 0 (a drafted step call's cost over a plain one's), got {spec_cost!r}"
            raise InputError(f"spec_cost {why}", cli=f"--spec-cost {why}")
        self.speculation_note = ""
        self.adaptive = speculation == "auto" and self.drafter is not None
        if self.adaptive and not self.drafter.follows:
            self.adaptive = False
            self.speculation_note = (f"speculation stays on: {type(self.drafter).__name__} ({method}) cannot follow "
                                     f"a plain step")
        self._late = self.adaptive and self.drafter.follows_late  # plain calls leave the draft to lag (`_step_fn`)
        self.spec_cost = None if spec_cost is None else float(spec_cost)
        self.timed = spec_cost is None  # the ratio from the serving loop's own calls (auto)
        self.spec_costs: dict[int, float] = {}  # per row bucket: the warm-up's ratio (auto, timed)
        self.tau = None  # tokens per row per drafted step, decayed over recent drafted calls (auto; span estimates)
        self._tau_sums = [0.0, 0.0]  # decayed (tokens, row steps)
        # per (row bucket, span): decayed row steps per second per live row of step calls, drafted and plain (auto,
        # timed): a call's cost moves with its span as much as with its rows, and the kinds' ratio differs by span
        self.rate: dict[tuple[int, int], dict[bool, float | None]] = {}
        self._calls = 0
        self._ran_each = False  # every program run once (warm-up)
        self._since_probe = 0  # step calls since the last call of the kind not chosen (auto)
        self._last_ready = None  # when the last step call's results were read
        self._round_admits = 0  # admission / prefill calls dispatched in this round
        self._lagging = False  # a plain step call ran since the last drafted one (the draft lags: auto, late drafters)
        self._t_round = 0.0  # when this round began
        self.extra = plan.extra_len
        if max_len > model.cfg.max_position_embeddings:
            raise InputError(f"max_len ({max_len}) exceeds the model's context of "
                             f"{model.cfg.max_position_embeddings} tokens")
        self.max_len = int(max_len)
        self.spans = default_spans(self.max_len) if spans is None else sorted({int(x) for x in spans} | {self.max_len})
        if any(x < 1 or x > self.max_len for x in self.spans):
            raise InputError(f"spans must lie in [1, max_len={self.max_len}], got {spans!r}")
        if self.max_len < CHUNKS[0] + self.extra + 2:
            raise InputError(f"max_len must be at least {CHUNKS[0] + self.extra + 2} for method {method!r}")
        # EOS is each row's first stop ids (not compiled in): a request may ignore it (``ignore_eos``)
        self.eos = api.eos_ids(model)
        self.stop_width = MAX_STOP_IDS + len(self.eos)
        self.kv_dtype = api.resolve_cache_dtype(model, cache_dtype)
        # the decode layout once (fused, unstacked, the embedding transposed), not at every step call
        self.params = jax.jit(self._prepare)(plan.params)  # target params, or (target, drafter) params
        self.compiles = 0
        # compiled programs by name: "release", ("step", greedy, plain, span, rows), ("admit", chunk, rows, pre), ...
        # (a name holds every static argument of its program)
        self._exe: dict = {}
        self._statics: dict = {}  # ... and the static arguments each was compiled with
        # XLA:CPU on Linux: the most memory maps one compiled program took (`_check_maps`; None: not counted)
        self._maps_each: int | None = 0 if jax.default_backend() == "cpu" and _maps_limit() is not None else None
        self._lock = threading.Lock()
        self._spec = None  # the state's shapes and shardings (what programs are compiled for)
        self._rest: list = []  # warm-up with ``background``: the programs the warm-up thread has still to compile
        self._standin = False  # ... and while some are missing, calls take ready programs that cover them
        self.warm_compiles: int | None = None  # programs compiled by warm-up (once every one is)
        self._warm_thread = None
        self.warm_error: BaseException | None = None  # what stopped the warm-up thread, if anything did
        self.warm_all_s: float | None = None  # seconds from warm-up's start to every program compiled
        self._stopping = False  # the process is exiting: the warm-up thread stops after the program in hand
        self._ran: set = set()  # the step programs run at least once (a first run is not timed: `_run_each_once`)
        self._hid = self.drafter.hidden_layers if self.drafter is not None else ()
        self._rng = np.random.default_rng()
        self._ids = itertools.count(1)
        self.queue: collections.deque[Request] = collections.deque()
        self.running: dict[int, Request] = {}  # slot -> request
        self._reqs: dict[int, Request] = {}  # id -> request, until its last event
        self._inflight: collections.deque = collections.deque()  # dispatched calls whose results are not read yet
        self.state = None
        self.mesh = getattr(model, "_placed", None)  # the mesh the model is placed on (None: one device)
        # a mesh of XLA:CPU devices runs one program at a time (`_OneAtATime`)
        self._one_at_a_time = self.mesh is not None and self.mesh.devices.size > 1 and \
            self.mesh.devices.flat[0].platform == "cpu"
        if self._one_at_a_time:
            jax.block_until_ready(self.params)
        if row_buckets is None:  # (on a mesh the slots are split over devices: every step decodes them all)
            self.row_buckets = default_row_buckets(slots) if self.mesh is None else [slots]
        else:
            self.row_buckets = sorted({int(x) for x in row_buckets} | {slots})
            if any(x < 1 or x > slots for x in self.row_buckets):
                raise InputError(f"row_buckets must lie in [1, slots={slots}], got {row_buckets!r}")
            if self.mesh is not None and self.row_buckets != [slots]:
                raise InputError("row_buckets: a model placed on a mesh decodes every slot at each step; drop "
                                 "row_buckets")
        self.kv_pages, self.page_size = kv_pages, page_size
        if kv_pages is not None:
            self._check_pages(spans)
            self._free_pages = list(range(kv_pages))
            self._table = np.full((slots, self.max_len // page_size), kv_pages, np.int32)  # kv_pages: no page
        self._state_sh = None
        self.stats = collections.Counter()

    def _check_pages(self, spans):
        k, page = self.kv_pages, self.page_size
        if not isinstance(k, int) or isinstance(k, bool) or k < 1:
            raise InputError(f"kv_pages must be an integer >= 1 (pages of the shared KV cache), got {k!r}")
        if not isinstance(page, int) or isinstance(page, bool) or page < 1:
            raise InputError(f"page_size must be an integer >= 1, got {page!r}")
        if self.mesh is not None:
            raise InputError("kv_pages: the paged KV cache runs on one device (a model placed on a mesh keeps "
                             "max_len per slot); drop kv_pages")
        if spans is None:  # the default spans, rounded down to whole pages
            self.spans = sorted({x - x % page for x in self.spans if x >= page} | {self.max_len})
        bad = [x for x in self.spans if x % page]
        if bad:
            raise InputError(f"max_len and every span must be a multiple of page_size ({page}); got "
                             f"{', '.join(map(str, bad))}")

    @property
    def pages_free(self) -> int:
        """Pages of a paged engine's KV cache no request holds (0 without paging)."""
        return len(self._free_pages) if self.kv_pages is not None else 0

    def pages_for(self, prompt_len: int, max_tokens: int) -> int:
        """The KV pages a request holds on a paged engine: its prompt, budget and the method's draft slots."""
        need = prompt_len + max_tokens + self.extra + 1
        return min(-(-need // self.page_size), self.max_len // self.page_size)

    # ------------------------------------------------------------------------------------------ device functions
    def _tparams(self, params):
        return params if self.drafter is None else params[0]

    def _prepare(self, params):
        tp = decode_layout(self._tparams(params), self.model.cfg, fuse=True)
        return tp if self.drafter is None else (tp, self.drafter.prepare(params[1], None))

    def _layout(self, params):
        tp = decode_layout(self._tparams(params), self.model.cfg, fuse=True)
        if self.drafter is None:
            return tp, None
        return tp, self.drafter.prepare(params[1], None)

    def _start(self, params, prompt_BP, plen_B, cache, logits, pre, key, warp, stops, samp, feed_draft=True):
        tp, dp = self._layout(params)
        if self.drafter is None:
            return ar.start(prompt_BP, plen_B, cache, logits, key, warp, stops, max_new=self.max_len,
                            eos_ids=(), samp=samp)
        # (a draft that plain calls leave to lag is not fed a prompt of one chunk either: the catch-up before the
        # row's first drafted call feeds it with the rest, and a request that ends before the engine drafts again
        # never pays it; a longer prompt is prefilled at once: the catch-up's forwards are a few calls' tokens wide)
        return speculative.start(tp, dp, prompt_BP, plen_B, cache, logits, pre, key, warp, stops,
                                 cfg=self.model.cfg, drafter=self.drafter, max_new=self.max_len,
                                 max_len=self.max_len, eos_ids=(), samp=samp, cache_dtype=self.kv_dtype,
                                 feed_draft=feed_draft)

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
        warp = self._with_tables(self._warp_of([None] * b), self._blank_tables())
        stops = common.Stops(limit=jnp.ones((b,), jnp.int32), stop_ids=jnp.full((b, self.stop_width), -1, jnp.int32))
        key = jnp.zeros((b, 2), jnp.uint32)
        return self._start(params, prompt, plen, cache, jnp.zeros((b, self.vocab), jnp.float32),
                           ForwardOut(hidden=hid, cache=None, layer_hidden=layers), key, warp, stops, self.full)

    def _empty(self, params) -> EngineState:
        shapes = jax.eval_shape(functools.partial(self._row_state, b=self.slots), params)
        loop = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)
        loop = loop.replace(out=loop.out.replace(done=jnp.ones((self.slots,), bool)))
        if self.kv_pages is not None:
            cfg = self.model.cfg
            per_layer = unrolled(decode_layout(self._tparams(params), cfg, fuse=True))
            loop = loop.replace(cache=kvc.init_paged(cfg, self.slots, self.max_len, self.kv_pages, self.page_size,
                                                     self.kv_dtype, per_layer=per_layer))
        n = self.slots
        return EngineState(loop=loop, warp=jax.tree.map(jnp.asarray, self._warp_of([None] * n)),
                           grammar=self._blank_tables())

    def _blank_tables(self):
        """Structured-output tables holding no grammar (the free state alone), made on the device (no constants in
        the program: the tables' content goes up with `_sync_tables`); None when structured output is off."""
        if self.pool is None:
            return None
        from pdecode import grammar

        p = self.pool
        return grammar.Tables(allow=jnp.zeros(p.allow.shape, jnp.uint32).at[0].set(jnp.uint32(0xFFFFFFFF)),
                              base=jnp.zeros(p.base.shape, jnp.int32), nexts=jnp.zeros(p.nexts.shape, jnp.int32),
                              forced=jnp.full(p.forced.shape, -1, jnp.int32))

    @staticmethod
    def _with_tables(warp, tables):
        return warp if tables is None else warp.replace(grammar=tables)

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
        """One middle chunk of a long prompt into the request's own cache (and hidden-state buffer)."""
        tp = self._tparams(params)
        start = pre.cache.lengths
        cache, logits, fo = common.prefill_at(tp, self.model.cfg, tokens_1T, start, n_1, pre.cache, self._hid)
        pos = start[0] + jnp.arange(tokens_1T.shape[1])  # positions past the cache's end are dropped
        hidden = pre.hidden.at[:, pos].set(fo.hidden.astype(pre.hidden.dtype), mode="drop")
        layers = pre.layers
        if layers is not None:
            layers = layers.at[:, :, pos].set(fo.layer_hidden.astype(layers.dtype), mode="drop")
        return self._replicated(Prefill(cache=cache, hidden=hidden, layers=layers, logits=logits))

    def _admit_fn(self, params, st: EngineState, tokens_AC, n_A, slot_A, seed_A, warp_A, limit_A, stop_ids_AS,
                  table=None, pre=None, prompt_1L=None, plen_1=None, *, axes):
        """Requests into their slots, A at a time (A static; a row repeated to fill A writes its slot twice, alike):
        each prompt's last chunk prefilled (the whole prompt when ``pre`` is None; else, for one request, after the
        chunks in ``pre``, the whole prompt in ``prompt``), the loop state started (first token drawn, drafter state
        initialised) and written over the slot's row, its sampling values set. Returns (state, (first tokens, their
        logprobs, done, target forwards) per row). ``table``: a paged engine's page table (the host's, whole)."""
        cfg = self.model.cfg
        tp = self._tparams(params)
        a = tokens_AC.shape[0]
        if pre is None:  # the prompts attend over their chunk's slots alone (grown to max_len or paged after)
            size = tokens_AC.shape[1]
            if table is not None:
                size = -(-size // self.page_size) * self.page_size
            size = min(size, self.max_len)  # (a chunk longer than max_len: the prompt still fits max_len)
            cache = kvc.init_cache(cfg, a, size, self.kv_dtype, per_layer=unrolled(tp))
            cache, logits, fo = common.prefill_at(tp, cfg, tokens_AC, jnp.zeros((a,), jnp.int32), n_A, cache,
                                                  self._hid)
            if table is None:
                cache = kvc.grow(cache, self.max_len)
            prompt, plen = tokens_AC, n_A
        else:
            p = self._prefill_fn(params, pre, tokens_AC, n_A)
            cache, logits = p.cache, p.logits
            fo = ForwardOut(hidden=p.hidden, cache=None, layer_hidden=p.layers)
            prompt, plen = prompt_1L, plen_1
        stops = common.Stops(limit=limit_A, stop_ids=stop_ids_AS)
        rows = self._start(params, prompt, plen, cache, logits, fo, sampling.row_keys(seed_A),
                           self._with_tables(warp_A, st.grammar), stops, self.full,
                           feed_draft=not self._late or pre is not None)
        # the target's cache (of either kind: its own row operation), then every other leaf with a row axis
        loop, warp = st.loop.replace(cache=None), st.warp
        cache = kvc.put_slots(st.loop.cache, rows.cache, slot_A, table)
        for i in range(a):
            def put(big, small, ax, i=i):
                if ax is None:
                    return big
                row = jax.lax.slice_in_dim(small, i, i + 1, axis=ax)
                return jax.lax.dynamic_update_slice_in_dim(big, row.astype(big.dtype), slot_A[i], axis=ax)

            loop = jax.tree.map(put, loop, rows.replace(cache=None), axes.replace(cache=None))
            warp = jax.tree.map(lambda big, small, i=i: big.at[slot_A[i]].set(small[i]), warp, warp_A)
        loop = loop.replace(cache=cache)
        out = rows.out
        return self._pin(EngineState(loop=loop, warp=warp, grammar=st.grammar)), self._replicated(
            (out.tokens[:, 0], out.logprobs[:, 0], out.done, out.row_forwards))

    def _step_fn(self, params, st: EngineState, *, samp, k: int, plain: bool = False, span: int | None = None,
                 rows: int | None = None):
        """``k`` steps (``plain``: plain steps of a draft-and-verify loop, `speculative.make_step`); returns (state,
        (count before, count after, done, the tokens and logprobs from the count before: [slots, W], each row's
        target forwards since its admission)). ``span``: the steps attend over the target cache's first ``span``
        slots alone (`spans`: the host picks the smallest that holds every live row after the call; a step that
        would write past it is not taken). ``rows``: the steps decode the first ``rows`` slots alone (every live
        slot among them; `row_buckets`), written back after."""
        span = span or self.max_len
        # plain steps (speculation="auto" alone has them) of a drafter that can catch up late: no draft pass a step;
        # the draft is left to lag through plain calls, its state set aside whole (not cut to the rows or the span: a
        # copy that cost a plain call of 4 rows 20% more than an AR call) and not fed; before the next drafted call a
        # program of its own catches it up (`_catch_up_fn`; until it is compiled the calls stay plain). Feeding it
        # through the plain calls cost them 10% on the CPU (the code draft's share of the target's FLOPs): now a
        # request that ends before the engine drafts again never feeds its draft, and one that lives past a drafted
        # call is fed once, in forwards several calls wide.
        lazy = plain and self._late
        dstate = st.loop.dstate if lazy else None
        if lazy:
            st = st.replace(loop=st.loop.replace(dstate=None))
        whole = st
        st = self._first_rows(st, rows)
        # every KV cache of the state (the target's, a draft model's) cut to the span: a contiguous copy of its head
        # (a paged one gathered from its pages) the steps read, and only the slots a call can commit written back;
        # a paged cache whose copy would outgrow its pool stays paged (each layer gathered at each step)
        full = st.loop
        n_rows = rows or self.slots
        gather = self.kv_pages is None or n_rows * span <= self.kv_pages * self.page_size
        is_cache = kvc.is_cache
        cut = lambda tree: jax.tree.map(lambda c: kvc.head(c, span, gather) if is_cache(c) else c, tree,  # noqa: E731
                                        is_leaf=is_cache)
        put = lambda win: lambda c, p: kvc.put_head(c, p, win) if is_cache(c) else p  # noqa: E731
        fresh = 1 if (plain or self.drafter is None) else self.drafter.tree_size
        st = st.replace(loop=cut(full))
        tp, dp = self._layout(params)
        cfg = self.model.cfg
        warp = self._with_tables(st.warp, st.grammar)
        if self.drafter is None:
            one = ar.make_step(tp, warp, cfg=cfg, eos_ids=(), samp=samp)
        else:
            one = speculative.make_step(tp, dp, warp, cfg=cfg, drafter=self.drafter, max_len=self.max_len,
                                        eos_ids=(), samp=samp, plain=plain, follow=not lazy)
        c0 = st.loop.out.count

        def cond(c):
            i, s = c
            room = jnp.max(jnp.where(s.out.done, 0, s.cache.lengths)) + fresh <= span
            return (i < k) & ~jnp.all(s.out.done) & room

        _, loop = jax.lax.while_loop(cond, lambda c: (c[0] + 1, one(c[1])), (jnp.int32(0), st.loop))
        w = k * (1 if plain else self._per_step())  # the most tokens a row commits in this call
        # a draft model's cache may trail the target's by one step's tokens (one that lagged through plain calls was
        # caught up to that before this call, `_catch_up_fn`) (on a mesh the whole head goes back: a slice update
        # the partitioner keeps local to each device's rows)
        window = None if self.mesh is not None else w + self._per_step()
        loop = jax.tree.map(put(window), full.replace(cache=None), loop.replace(cache=None),
                            is_leaf=is_cache).replace(cache=put(window)(full.cache, loop.cache))
        out = loop.out
        idx = jnp.minimum(c0[:, None] + jnp.arange(w)[None, :], out.tokens.shape[1] - 1)
        new = jnp.take_along_axis(out.tokens, idx, axis=1)
        lps = jnp.take_along_axis(out.logprobs, idx, axis=1)
        acc = loop.row_acc if self.drafter is not None else jnp.zeros((out.done.shape[0], 1), jnp.int32)
        st = self._put_first_rows(whole, EngineState(loop=loop, warp=st.warp, grammar=st.grammar))
        if lazy:
            st = st.replace(loop=st.loop.replace(dstate=dstate))
        return self._pin(st), self._replicated((c0, out.count, out.done, new, lps, out.row_forwards, acc))

    def _catch_up_fn(self, params, st: EngineState, *, rows: int):
        """The draft that plain calls left to lag, caught up on the first ``rows`` slots (`Drafter.follow_late`, in
        forwards `_late_width` wide, to what the next proposal feeds itself): dispatched before a drafted call, and
        waited for, so that call's time is its own (`_dispatch_step`). The draft's cache is not cut to a span here
        (one program per row bucket)."""
        _, dp = self._layout(params)
        loop, axes = st.loop, self._axes.dstate
        part = loop.dstate if rows >= self.slots else _rows_head(loop.dstate, axes, rows)
        seq_len = jnp.where(loop.out.done[:rows], 0, loop.seq_len[:rows])  # (a finished row: nothing to feed)
        fed = self.drafter.follow_late(dp, part, loop.seq[:rows], seq_len, self._late_width, self.drafter.max_depth)
        dstate = fed if rows >= self.slots else _put_rows_head(loop.dstate, fed, axes)
        return self._pin(st.replace(loop=loop.replace(dstate=dstate)))

    def _catch_up_exe(self, rows: int):
        return self._compile(("catch_up", rows), self._catch_up_fn, self.params, self._spec, static={"rows": rows},
                             donate=(1,))

    def _first_rows(self, st: EngineState, rows: int | None) -> EngineState:
        """The state of the first ``rows`` slots (a copy; a paged cache keeps its pool and cuts its page table)."""
        if not rows or rows >= self.slots:
            return st
        cache, axes = kvc.rows_head(st.loop.cache, rows), self._loop_axes(st.loop)
        loop = _rows_head(st.loop.replace(cache=None), axes.replace(cache=None), rows).replace(cache=cache)
        return st.replace(loop=loop, warp=jax.tree.map(lambda x: x[:rows], st.warp))

    def _put_first_rows(self, whole: EngineState, part: EngineState) -> EngineState:
        """``whole`` with its first rows replaced by ``part``'s (after steps ran on them)."""
        rows = part.warp.temperature.shape[0]
        if rows >= self.slots:
            return part
        cache, axes = kvc.put_rows_head(whole.loop.cache, part.loop.cache), self._loop_axes(whole.loop)
        loop = _put_rows_head(whole.loop.replace(cache=None), part.loop.replace(cache=None),
                              axes.replace(cache=None)).replace(cache=cache)
        warp = jax.tree.map(lambda x, y: x.at[:rows].set(y), whole.warp, part.warp)
        return whole.replace(loop=loop, warp=warp, grammar=part.grammar)

    def _loop_axes(self, loop):
        """The batch axes of the loop state ``loop`` (a plain call's lacks its drafter state: set aside whole)."""
        return self._axes if getattr(loop, "dstate", ()) is not None else self._axes.replace(dstate=None)

    def _per_step(self) -> int:
        return 1 if self.drafter is None else self.drafter.max_depth + 1

    def steps_for(self, rows: int) -> int:
        """The decode steps of a step call of row bucket ``rows``: ``steps_per_call``, `LONE_STEPS` times that when
        the call decodes one row of several slots. A call's cost has a part that does not grow with its steps (its
        dispatch, the weights' conversion to the activations' dtype, the state's cut and write-back: a one-row sd call
        of the code models on a 2-core CPU takes 4.6 ms for 1 step, 1.7-2 ms more per step); at one row it is a
        fifth of a call of 4 steps. One client's tokens then stream in bursts 4 times longer, and a request that
        arrives meanwhile waits for the call in flight (about 30 ms there) before its admission."""
        return self.k * (LONE_STEPS if rows == 1 < self.slots else 1)

    @property
    def _late_width(self) -> int:
        """The width of the forwards that catch up a draft that lagged through plain calls, at the start of the next
        drafted call (`LATE_CALLS` full calls' tokens; rows that lag alike are caught up together)."""
        return LATE_CALLS * self.k

    @staticmethod
    def _prefix_get_fn(store: Prefill, entry, length) -> Prefill:
        """Kept prefix ``entry`` as a request's prefill state holding its first ``length`` tokens (a causal cache's
        first positions depend on those tokens alone: the rest is masked, then overwritten by the next chunks)."""
        pre = jax.tree.map(lambda x: jax.lax.dynamic_index_in_dim(x, entry, keepdims=False), store)
        return pre.replace(cache=kvc.set_lengths(pre.cache, jnp.reshape(length, (1,)).astype(jnp.int32)))

    @staticmethod
    def _prefix_put_fn(store: Prefill, entry, pre: Prefill) -> Prefill:
        return jax.tree.map(lambda big, x: jax.lax.dynamic_update_index_in_dim(big, x.astype(big.dtype), entry, 0),
                            store, pre)

    def _release_fn(self, st: EngineState, slot):
        out = st.loop.out
        return self._pin(st.replace(loop=st.loop.replace(out=out.replace(done=out.done.at[slot].set(True)))))

    # ------------------------------------------------------------------------------------------ mesh
    # On a mesh (a model placed by `Model.on_mesh`, one process or several) every program's state has one fixed
    # layout — its row axis over ``data`` where the slots divide, the rest replicated — so that a state made by one
    # compiled program is what the next was compiled for; a long prompt's prefill state and the results read back
    # on the host are replicated.
    def _state_shardings(self):
        from jax.sharding import NamedSharding, PartitionSpec as P

        mesh = self.mesh
        data = mesh.shape["data"]

        def sh(x, ax):
            spec = [None] * len(x.shape)
            if ax is not None and x.shape[ax] % data == 0:
                spec[ax] = "data"
            return NamedSharding(mesh, P(*spec))

        shapes = jax.eval_shape(self._empty, self.params)
        loop = jax.tree.map(sh, shapes.loop, self._axes)
        return EngineState(loop=loop, warp=jax.tree.map(lambda x: sh(x, 0), shapes.warp),
                           grammar=jax.tree.map(lambda x: sh(x, None), shapes.grammar))

    def _pin(self, st):
        return st if self.mesh is None else jax.lax.with_sharding_constraint(st, self._state_sh)

    def _replicated_sharding(self):
        from jax.sharding import NamedSharding, PartitionSpec as P

        return NamedSharding(self.mesh, P())

    def _replicated(self, tree):
        if self.mesh is None:
            return tree
        from jax.sharding import NamedSharding, PartitionSpec as P

        return jax.lax.with_sharding_constraint(tree, NamedSharding(self.mesh, P()))

    # ------------------------------------------------------------------------------------------ compile
    def _compile(self, name, fn, *args, static=None, donate=()):
        """The program ``name`` (compiled once; from the warm-up thread too: `warmup` with ``background``). ``name``
        tells it from every other program: a name compiled once is returned for the same ``static`` after, and a
        different ``static`` under that name is an error."""
        static = static or {}
        exe = self._exe.get(name)
        if exe is not None and self._statics.get(name, static) != static:
            raise ValueError(f"program {name!r} was compiled with other static arguments: name it by them")
        if exe is None:
            maps = _maps_in_use() if self._maps_each is not None else None
            self._check_maps(1, maps)
            exe = jax.jit(fn, static_argnames=tuple(static), donate_argnums=donate).lower(*args, **static).compile()
            if self._one_at_a_time:
                exe = _OneAtATime(exe)
            if maps is not None:
                self._maps_each = max(self._maps_each, _maps_in_use() - maps)
            with self._lock:
                if name not in self._exe:
                    self.compiles += 1
                    self._exe[name], self._statics[name] = exe, static
                exe = self._exe[name]
        return exe

    def _hidden_dtype(self):
        return jnp.dtype(self.model.cfg.run.activation_dtype or self.model.dtype)

    def _blank_prefill(self) -> Prefill:
        """A long prompt's empty prefill state (numpy zeros: no device op, nothing compiled)."""
        cfg = self.model.cfg
        per_layer = unrolled(self._tparams(self.params))
        shapes = jax.eval_shape(lambda: kvc.init_cache(cfg, 1, self.max_len, self.kv_dtype, per_layer=per_layer))
        cache = jax.tree.map(lambda a: np.zeros(a.shape, a.dtype), shapes)
        hd = self._hidden_dtype()
        layers = np.zeros((len(self._hid), 1, self.max_len, cfg.hidden_size), hd) if self._hid else None
        return Prefill(cache=cache, hidden=np.zeros((1, self.max_len, cfg.hidden_size), hd), layers=layers,
                       logits=np.zeros((1, self.vocab), np.float32))

    def warmup(self, background: bool = False) -> float:
        """Compile every function the engine calls (admission per prompt bucket and row count, the long-prompt chunk,
        the step programs of each sampler, kind, span and row bucket, release), run each once and time the cost
        model's ratios (speculation="auto"; read back instead where an earlier process of the same engine on the same
        devices saved them next to the persistent compilation cache: `_costs_path`); returns the seconds it took.
        Called by the first `run_once` if not before.

        ``background``: compile only the programs nothing else can stand in for (an admission of the longest chunk,
        the long-prompt programs, release, a step of the full sampler at ``max_len`` over every slot: `_core`), return,
        and compile the rest in a thread while the engine serves; until a program is ready its calls go to a ready
        one that covers them (a longer span or chunk, more rows, the full sampler, the other kind of step: the same
        tokens, `_pick_step`). A restart with the compilation cache warm then serves in seconds; programs run for the
        first time while serving (XLA:CPU pays 40-80 ms more at a program's first run: `_run_each_once`), and the
        cost model's ratios are timed before serving unless saved. `pending_programs` counts what is left,
        `wait_warm` waits for it."""
        t0 = time.perf_counter()
        if self._warm_thread is not None:  # (a background warm-up's thread: let it finish first)
            self._warm_thread.join()
        if self.state is None:
            self._init_state()
        core, rest = self._programs()
        for make in core:
            make()
        self._check_maps(sum(name not in self._exe for name, _ in rest))  # (at each compile too: `_compile`)
        if not background:
            for _, make in rest:
                make()
        if self.adaptive and self.spec_cost is None and not self.spec_costs:
            saved = self._load_costs()
            if saved is None:
                self.spec_costs = self._measure_spec_cost()  # (compiles what it times if not yet compiled)
                self._save_costs()
            else:
                self.spec_costs = saved
            self.spec_cost = self.spec_costs[self.slots]
        self._rest = [make for name, make in rest if name not in self._exe] if background else []
        if not self._rest:
            if not self._ran_each:
                self._run_each_once()
            self._all_ready(t0)
        else:
            # calls take stand-ins from now on; the programs are not run once before serving (the state is in use)
            self._standin, self._ran_each, self.warm_error = True, True, None
            if self._warm_thread is None:
                atexit.register(_stop_warming, weakref.ref(self))  # (a process that exits meanwhile: see there)
            self._warm_thread = threading.Thread(target=self._compile_rest, args=(t0,), name=WARM_THREAD,
                                                 daemon=True)
            self._warm_thread.start()
        return time.perf_counter() - t0

    def _check_maps(self, n: int, maps: int | None = None):
        """Refuse, in one line, to compile ``n`` more programs where XLA:CPU would run out of memory maps on the way:
        each program it compiles holds a few hundred (an sd engine's steps at 16 slots about 700), and past Linux's
        ``vm.max_map_count`` LLVM fails to allocate and the process dies of a segmentation fault. Judged by the most
        one program took so far (``_maps_each``; ``maps``: the maps held now, if read)."""
        limit = _maps_limit() if self._maps_each else None
        now = (_maps_in_use() if maps is None else maps) if limit else None
        if now is None or now + self._maps_each * n <= MAPS_SHARE * limit:
            return
        raise InputError(
            f"{n} more programs would take this process to about {now + self._maps_each * n} memory maps on XLA:CPU "
            f"(up to {self._maps_each} a program), past what it may hold (vm.max_map_count {limit}): raise the limit "
            f"(sysctl -w vm.max_map_count=1048576, as current Linux distributions ship it) or compile fewer programs "
            f"(fewer spans or row_buckets, or speculation always: one kind of step)")

    def _init_state(self) -> None:
        """The empty state (every slot free), its batch axes, shardings and shapes (what programs compile for)."""
        self._axes = self._batch_axes()
        if self.mesh is not None:
            self._state_sh = self._state_shardings()
        pinned = {} if self.mesh is None else {"out_shardings": self._state_sh}
        self._empty_exe = jax.jit(self._empty, **pinned)
        if self._one_at_a_time:
            self._empty_exe = _OneAtATime(self._empty_exe)
        self.state = self._empty_exe(self.params)
        self.compiles += 1
        on = {} if self.mesh is None else {"sharding": True}  # (one device: lowered as its arrays are)
        self._spec = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, **{k: x.sharding for k in on}),
                                  self.state)

    def _programs(self):
        """Warm-up's programs: ``core`` (thunks: the ones the engine cannot serve without) and ``rest`` ((name,
        thunk) pairs in the order a background warm-up compiles them: the steps of the shortest span, the admissions,
        the other steps by span; each span's by row bucket, sampler, kind)."""
        top = self._chunk_sizes()[-1]
        blank = self._blank_prefill
        core = [lambda: self._admit_exe(top, self.admit_rows), lambda: self._admit_exe(top, 1, blank()),
                lambda: self._compile("prefill", self._prefill_fn, self.params, blank(),
                                      np.zeros((1, self.chunk), np.int32), np.ones((1,), np.int32)),
                lambda: self._compile("release", self._release_fn, self._spec, np.int32(0), donate=(0,)),
                lambda: self._step_exe(self.full, self.adaptive)]
        if self.prefix_entries:
            core.append(self._prefix_programs)
        steps, admits = [], []
        for span in self.spans:
            for rows in self.row_buckets:
                for samp in (self.full, self.fast):
                    for plain in (True, False) if self.adaptive else (False,):
                        steps.append((("step", samp.greedy, plain, span, rows),
                                      functools.partial(self._step_exe, samp, plain, span, rows)))
        if self.pool is not None and self.mesh is None:  # (meanwhile new grammars' tables go up whole)
            admits.append(("grammar_put", self._grammar_put_exe))
        # (first of all: until a row bucket's catch-up is ready its calls stay plain, the draft lagging)
        late = [(("catch_up", rows), functools.partial(self._catch_up_exe, rows)) for rows in self.row_buckets] \
            if self._late else []
        for c in self._chunk_sizes():
            for rows in sorted({1, self.admit_rows}):
                admits.append((("admit", c, rows, False), functools.partial(self._admit_exe, c, rows)))
            admits.append((("admit", c, 1, True), lambda c=c: self._admit_exe(c, 1, blank())))
        # the shortest span's steps first (a stand-in at max_len costs the most), then the admissions (fewer calls)
        first = sum(name[3] == self.spans[0] for name, _ in steps)
        return core, late + steps[:first] + admits + steps[first:]

    def _prefix_programs(self):
        if self._store is None:
            blank = self._blank_prefill()
            store = jax.tree.map(lambda a: np.zeros((self.prefix_entries,) + a.shape, a.dtype), blank)
            self._store = jax.device_put(store, None if self.mesh is None else self._replicated_sharding())
        self._compile("prefix_get", self._prefix_get_fn, self._store, np.int32(0), np.int32(1))
        self._compile("prefix_put", self._prefix_put_fn, self._store, np.int32(0), self._blank_prefill(), donate=(0,))

    def _compile_rest(self, t0: float):
        """The warm-up thread: compile what `warmup` left (``background``), in order."""
        try:
            while self._rest and not self._stopping:
                self._rest[0]()
                self._rest.pop(0)
        except BaseException as e:  # noqa: BLE001 (calls keep taking stand-ins among the programs ready)
            self.warm_error = e
            self._rest = []
            return
        if not self._rest:
            self._all_ready(t0)

    def _all_ready(self, t0: float):
        """Every program compiled: calls take their own programs; later compiles count as compiles after warm-up."""
        self.warm_compiles, self._standin = self.compiles, False
        self.warm_all_s = time.perf_counter() - t0

    @property
    def pending_programs(self) -> int:
        """Programs the warm-up thread has still to compile (0: all ready, warm-up not begun, or the thread stopped
        by an error, `warm_error`: calls then keep to stand-ins among the programs ready, and nothing compiles while
        serving)."""
        return len(self._rest)

    def wait_warm(self, timeout: float | None = None) -> bool:
        """Wait for the warm-up thread (``background``); True when every program is ready. Raises what stopped it."""
        if self._warm_thread is not None:
            self._warm_thread.join(timeout)
        if self.warm_error is not None:
            raise self.warm_error
        return not self._rest

    def stop_warmup(self, timeout: float | None = None) -> bool:
        """Stop a background warm-up (a process about to exit): the thread finishes the program in hand, within
        ``timeout`` seconds; True when no warm-up thread is still compiling. An XLA compile cannot be interrupted: a
        process that must leave before it ends exits without waiting (``os._exit``, as `pdecode serve` does at the
        drain deadline) rather than kill the thread inside the compiler."""
        self._stopping = True
        if self._warm_thread is not None:
            self._warm_thread.join(timeout)
            return not self._warm_thread.is_alive()
        return True

    def _measure_spec_cost(self, repeats: int = 3) -> dict[int, float]:
        """The cost model's first ratios, per row bucket: seconds per drafted step call over seconds per plain one,
        each the median of ``repeats`` timed calls with the bucket's rows live (one-token prompts admitted afresh
        before each, greedy), each kind at the shortest span that holds one call (as serving gives it to short
        prompts: a span for all the calls' tokens timed a drafted call of one row at 1024 positions against a plain
        one at 192, a ratio of 3.9 where served calls drafted at 1.4x the plain ones' tokens/s with tau 2.5-3.0);
        the slots are emptied after."""
        budget = self.max_len - self.extra - 3
        ratios = {}
        for bucket in self.row_buckets:
            times = {}
            for plain in (False, True):
                per, fresh = (1, 1) if plain else (self._per_step(), self.drafter.tree_size)
                need = 3 + self.steps_for(bucket) * per + fresh  # room for one call's tokens
                exe = self._step_exe(self.fast, plain, next((x for x in self.spans if x >= need), self.max_len),
                                     bucket)
                ts = []
                for r in range(repeats + 1):
                    self._fill_for_timing(bucket, budget)
                    jax.block_until_ready(self.state)
                    t = time.perf_counter()
                    self.state, outs = exe(self.params, self.state)
                    jax.block_until_ready(outs)
                    if r:  # the first call is a warm-up
                        ts.append(time.perf_counter() - t)
                times[plain] = float(np.median(ts))
            ratios[bucket] = times[False] / times[True]
        self.state = self._empty_exe(self.params)
        return ratios

    def _costs_path(self):
        """Where this engine's warm-up ratios are kept (speculation="auto"): a file next to JAX's persistent
        compilation cache (None when that is off), named by a hash of what the ratios depend on: the pdecode and JAX
        versions, the devices, the model's and drafter's configuration and weights' shapes, the method's options and
        the engine's sizes. They are first guesses that the served calls' own timings replace (a stale one costs a
        few calls' choices, never a token)."""
        import hashlib
        from pathlib import Path

        import pdecode

        d = costs_dir()
        if not d or "://" in str(d):  # (off, or a remote cache JAX writes itself)
            return None
        shapes = jax.tree.map(lambda x: (tuple(x.shape), str(x.dtype)), self.params)
        what = (pdecode.__version__, jax.__version__, [(x.platform, x.device_kind) for x in jax.devices()],
                jax.process_count(), None if self.mesh is None else dict(self.mesh.shape), os.cpu_count(),
                os.environ.get("XLA_FLAGS", ""), repr(self.model.cfg), self.method, repr(self._opts), repr(self.drafter),
                repr(jax.tree.structure(shapes)), repr(jax.tree.leaves(shapes, is_leaf=lambda x: isinstance(x, tuple)
                                                                       and len(x) == 2 and isinstance(x[1], str))),
                self.slots, self.max_len, self.chunk, self.k, self.spans, self.row_buckets, self.admit_rows,
                self.kv_pages, self.page_size, str(self.kv_dtype), self.top_k_max, repr(self.full),
                None if self.pool is None else (self.pool.states, self.pool.transitions), LONE_STEPS, LATE_CALLS,
                "one call's span")  # (how `_measure_spec_cost` times: ratios timed before are not read)
        return Path(d) / "pdecode-costs" / (hashlib.sha256(repr(what).encode()).hexdigest()[:32] + ".json")

    def _load_costs(self) -> dict[int, float] | None:
        import json

        path = self._costs_path()
        try:
            got = {int(k): float(v) for k, v in json.loads(path.read_text()).items()} if path else None
        except (OSError, ValueError, TypeError, AttributeError):
            return None
        return got if got and set(got) == set(self.row_buckets) and all(v > 0 for v in got.values()) else None

    def _save_costs(self):
        import json

        path = self._costs_path()
        if path is None:
            return
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        try:  # (written whole, then renamed: a process reading it meanwhile sees the old file or the new one)
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp.write_text(json.dumps({str(k): v for k, v in self.spec_costs.items()}))
            os.replace(tmp, path)
        except OSError:  # (an optimisation: the next process times them again)
            with contextlib.suppress(OSError):
                tmp.unlink(missing_ok=True)

    def _run_each_once(self):
        """Run every admission, prefill and step program once with a live row, then empty the slots. XLA:CPU pays
        40-80 ms more at a program's first run with work in its loop (a step call on empty slots, which runs no
        step, does not pay it): it would land on the first requests' latency and on the cost model's timings (a
        plain probe's first run timed at 59 ms against 21, which kept the engine drafting at 16 busy slots)."""
        budget = self.max_len - self.extra - 3
        for c in self._chunk_sizes():
            for rows in sorted({1, self.admit_rows}):
                self._fill_for_timing(rows, budget, c)
        pre = self._exe["prefill"](self.params, self._blank_prefill(), np.ones((1, self.chunk), np.int32),
                                         np.ones((1,), np.int32))
        for c in self._chunk_sizes():
            args = list(self._admit_args(np.ones((1, c), np.int32), [None])) + [
                pre, np.ones((1, self.max_len), np.int32), np.ones((1,), np.int32)]
            if self.kv_pages is not None:
                args[9] = self._timing_table()
            self.state, _ = self._exe[("admit", c, 1, True)](*args)
        for name, exe in list(self._exe.items()):
            if name[0] == "step":
                self._fill_for_timing(1, budget)
                self.state, outs = exe(self.params, self.state)
                self._ran.add(exe)
        for name, exe in list(self._exe.items()):  # a draft left to lag by a plain call of its rows, caught up
            if name[0] != "catch_up":
                continue
            plain = [e for n, e in self._exe.items() if n[0] == "step" and n[2] and n[4] == name[1]]
            if plain:  # (plain calls until the row lags more than the catch-up's slack: its loop runs a forward)
                self._fill_for_timing(1, budget)
                for _ in range(self.drafter.max_depth // self.steps_for(name[1]) + 2):
                    self.state, _ = plain[0](self.params, self.state)
                self.state = exe(self.params, self.state)
        put = self._exe.get("grammar_put")
        if put is not None:  # the pool's first window written back as it is (the tables' truth: nothing changes)
            self.state = self.state.replace(grammar=self._put_grammar_window(put, self.state.grammar, 0, 0))
        jax.block_until_ready(self.state)
        self.state = self._empty_exe(self.params)
        self._ran_each = True

    def _timing_table(self):
        """A page table for warm-up rows (pages shared if too few: their contents are not used)."""
        m = self._table.shape[1]
        return (np.arange(self.slots * m, dtype=np.int32) % self.kv_pages).reshape(self.slots, m)

    def _fill_for_timing(self, n: int, budget: int, chunk: int | None = None):
        """The first ``n`` slots admitted with one-token prompts and ``budget`` (the timed calls decode them), by
        admission calls of ``chunk`` positions (the shortest by default)."""
        a, c = self.admit_rows, chunk or self._chunk_sizes()[0]
        whole = n - n % a
        for j, rows in [(j, a) for j in range(0, whole, a)] + [(j, 1) for j in range(whole, n)]:
            args = list(self._admit_args(np.ones((rows, c), np.int32), [None] * rows))
            args[4] = np.arange(j, j + rows, dtype=np.int32)  # their slots
            args[7] = np.full((rows,), budget, np.int32)
            if self.kv_pages is not None:
                args[9] = self._timing_table()
            self.state, _ = self._admit_exe(c, rows)(*args)

    def _chunk_sizes(self):
        return [c for c in CHUNKS if c <= self.chunk]

    def _admit_args(self, tokens, reqs: list):
        """The admission call's arguments for ``reqs`` (their rows of ``tokens``); None entries: warm-up rows."""
        c = [r.controls if r is not None else None for r in reqs]
        f = lambda get, dt: np.asarray([get(x) for x in c], dt)  # noqa: E731
        warp = self._warp_of(c, [r.gstart if r is not None else 0 for r in reqs])
        ids = np.full((len(c), self.stop_width), -1, np.int32)
        for i, x in enumerate(c):
            if x:
                row = (() if x.ignore_eos else tuple(self.eos)) + tuple(x.stop_token_ids)
                ids[i, : len(row)] = row
        n = np.asarray([len(r.prompt) - r.fed if r is not None else 1 for r in reqs], np.int32)
        slots = np.asarray([r.slot if r is not None else 0 for r in reqs], np.int32)
        seeds = np.asarray([r.seed if r is not None else 0 for r in reqs], np.uint32)
        table = None if self.kv_pages is None else self._table.copy()
        return (self.params, self.state, tokens, n, slots, seeds, warp, f(lambda x: x.max_new_tokens if x else 1,
                                                                            np.int32), ids, table)

    def _warp_of(self, c: list, gstart: list | None = None) -> sampling.Warp:
        """The rows' sampling values (numpy), from their controls (None: a blank row) and their grammars' start
        states."""
        f = lambda get, dt: np.asarray([get(x) for x in c], dt)  # noqa: E731
        bias = np.zeros((len(c), self.vocab), np.float32)
        for i, x in enumerate(c):
            if x is not None and x.logit_bias:
                bias[i] = x.bias_vector(self.vocab)
        return sampling.Warp(
            temperature=f(lambda x: x.temperature if x else 0.0, np.float32),
            top_p=f(lambda x: x.top_p if x and x.temperature > 0 else 1.0, np.float32),
            top_k=f(lambda x: x.top_k if x and x.temperature > 0 else 0, np.int32),
            min_p=f(lambda x: x.min_p if x and x.temperature > 0 else 0.0, np.float32),
            penalty=f(lambda x: x.repetition_penalty if x else 1.0, np.float32),
            presence=f(lambda x: x.presence_penalty if x else 0.0, np.float32),
            frequency=f(lambda x: x.frequency_penalty if x else 0.0, np.float32),
            min_tokens=f(lambda x: x.min_tokens if x else 0, np.int32), bias=bias,
            grammar_start=np.asarray(gstart or [0] * len(c), np.int32))

    def _admit_exe(self, size: int, rows: int = 1, pre=None):
        args = self._admit_args(np.zeros((rows, size), np.int32), [None] * rows)
        args = args[:1] + (self._spec,) + args[2:]  # (the state's shapes: the warm-up thread must not read it)
        if pre is not None:
            if self.mesh is not None:  # as the prefill chunks leave it (replicated), not as the compiler would pick
                rep = self._replicated_sharding()
                pre = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=rep), pre)
            args += (pre, np.zeros((1, self.max_len), np.int32), np.ones((1,), np.int32))
        return self._compile(("admit", size, rows, pre is not None),
                             functools.partial(self._admit_fn, axes=self._axes), *args, donate=(1,))

    def _step_exe(self, samp, plain: bool = False, span: int | None = None, rows: int | None = None):
        span, rows = span or self.max_len, rows or self.slots
        return self._compile(("step", samp.greedy, plain, span, rows), self._step_fn, self.params, self._spec,
                             static={"samp": samp, "k": self.steps_for(rows), "plain": plain, "span": span,
                                     "rows": rows},
                             donate=(1,))

    def _pick_step(self, samp, drafted: bool, rows: int, span_of: Callable[[bool], int]):
        """The step program for a call of sampler ``samp``, kind ``drafted`` over row bucket ``rows`` (``span_of``:
        the span a kind needs): (program, drafted, span, rows). While the warm-up thread compiles (`warmup` with
        ``background``), a program not ready yet is stood in for by the cheapest ready one that covers the call:
        the same kind first (a longer span, more rows, the full sampler for the greedy one: each gives the same
        tokens), else the other kind (speculation="auto": either kind is lossless)."""
        if not self._standin:
            span = span_of(drafted)
            return self._step_exe(samp, self.drafter is not None and not drafted, span, rows), drafted, span, rows
        samps = [samp] + ([self.full] if samp is not self.full else [])
        for d in [drafted] + ([not drafted] if self.adaptive else []):
            need, plain = span_of(d), self.drafter is not None and not d
            ready = [(sp * r, i, sp, r) for i, s in enumerate(samps) for sp in self.spans if sp >= need
                     for r in self.row_buckets if r >= rows
                     if ("step", s.greedy, plain, sp, r) in self._exe]
            if ready:
                _, i, sp, r = min(ready)
                self.stats["steps_stood_in"] += (sp, r, samps[i], d) != (need, rows, samp, drafted)
                return self._exe[("step", samps[i].greedy, plain, sp, r)], d, sp, r
        raise RuntimeError("no step program is ready (warm-up compiles the full sampler's at max_len first)")

    def _pick_admit(self, size: int, rows: int, pre: bool):
        """The admission program for ``rows`` prompts of up to ``size`` tokens (``pre``: a long prompt's last chunk):
        (program, rows it takes, chunk). While the warm-up thread compiles, a longer chunk stands in, and for one prompt the
        ``admit_rows`` one (the prompt repeated over its rows, as a part group is)."""
        counts = [rows] + ([self.admit_rows] if rows == 1 and not pre and self._standin else [])
        for n in counts:
            for c in self._chunk_sizes():
                if c >= size and ("admit", c, n, pre) in self._exe:
                    return self._exe[("admit", c, n, pre)], n, c
        raise RuntimeError(f"no admission program is ready for {rows} row(s) of {size} tokens")

    def _span_for(self, live, drafted: bool, rows: int) -> int:
        """The smallest span holding every live row after the next step call (``drafted``: of drafted steps, of row
        bucket ``rows``): its prompt, the tokens reported, each step call in flight's worth and this one's, this
        call's last tree."""
        # a drafted step's tokens per row: tau (measured), with one token of margin, else the whole tree's depth; a
        # plain step's: one. A call whose rows outrun the estimate stops its steps at the span (the loop's room test)
        # and the next call takes a longer span
        draft = self.drafter is not None
        guess = self._per_step() if self.tau is None else min(self._per_step(), math.ceil(self.tau) + 1)
        per = lambda d: guess if d and draft else 1  # noqa: E731
        ahead = self.steps_for(rows) * per(drafted) + sum(self.steps_for(x[6]) * per(x[3]) for x in self._inflight
                                                          if x[0] == "step")
        fresh = self.drafter.tree_size if drafted and draft else 1  # the slots the call's last step writes
        need = max(len(r.prompt) + len(r.tokens) + 1 for r in live) + ahead + fresh + 1
        return next((x for x in self.spans if x >= need), self.max_len)

    # ------------------------------------------------------------------------------------------ host API
    @property
    def context(self) -> int:
        """Tokens of prompt and output together one request may hold (``max_len`` less the drafter's extra slots and
        the one a last step writes)."""
        return self.max_len - self.extra - 1

    def check_ids(self, prompt: list[int]) -> None:
        """A one-line InputError unless ``prompt`` is a non-empty list of this model's token ids."""
        if not prompt:
            raise InputError("the prompt is empty: give at least one token")
        if min(prompt) < 0 or max(prompt) >= self.vocab:
            raise InputError(f"prompt token ids must lie in [0, {self.vocab})")

    def check(self, prompt: list[int], max_tokens: int | None = None, grammar=None, **controls) -> generation.Controls:
        """The request's controls resolved and checked against this engine (one-line InputError otherwise);
        ``grammar``: structured output (`compile_grammar`)."""
        self.check_ids(prompt)
        ctl = generation.resolve(self.model.generation_config, self.vocab, dict(max_new_tokens=max_tokens, **controls))
        context = self.context
        room = context - len(prompt)
        if room < 1:
            raise InputError(f"the prompt has {len(prompt)} tokens; this server's context holds {context} tokens, "
                             f"prompt and output together: shorten the prompt to at most {context - 1}")
        if ctl.max_new_tokens > room:
            raise InputError(f"max_tokens ({ctl.max_new_tokens}) + the prompt ({len(prompt)} tokens) exceed this "
                             f"server's context ({context}): ask for at most {room} tokens")
        if ctl.top_k > self.top_k_max:
            raise InputError(f"top_k must be at most {self.top_k_max} here, got {ctl.top_k}")
        need = 0 if self.kv_pages is None else self.pages_for(len(prompt), ctl.max_new_tokens)
        if need > (self.kv_pages or 0):
            raise InputError(f"this request needs {need} KV pages (prompt, max_tokens and draft slots); the engine "
                             f"holds {self.kv_pages} (kv_pages): ask for fewer tokens")
        if len(ctl.stop_token_ids) > MAX_STOP_IDS:
            raise InputError(f"at most {MAX_STOP_IDS} stop token ids, got {len(ctl.stop_token_ids)}")
        if grammar is not None:
            ctl = dataclasses.replace(ctl, grammar=self.compile_grammar(grammar))
            if ctl.min_tokens:
                raise InputError("min_tokens would ban the EOS a complete structured-output match needs; drop it")
        return ctl

    def compile_grammar(self, spec):
        """A structured-output grammar (`pdecode.generate`'s ``grammar`` forms, or a compiled `grammar.Grammar`)
        compiled for this engine's model and checked against its tables (seconds for a large schema the first time;
        cached after)."""
        from pdecode import api, grammar

        if self.pool is None:
            raise InputError("structured output is off on this engine (grammar_states=0)")
        g = grammar.compile_spec(spec, self.model.tokenizer, self.vocab, api.eos_ids(self.model))
        if not self.pool.fits_ever(g):
            raise InputError(f"this grammar needs {g.num_states} states and {g.num_transitions} transitions; the "
                             f"engine's tables hold {self.pool.states - 1} and {self.pool.transitions} "
                             f"(grammar_states / grammar_transitions)")
        return g

    def submit(self, prompt: list[int], controls: generation.Controls, seed: int | None = None,
               callback: Callable[[Event], None] | None = None) -> Request:
        """Queue a request (``controls`` from `check`); its events go to ``callback`` and are returned by
        `run_once`."""
        if seed is None:
            seed = self.draw_seed()
        r = Request(prompt=list(prompt), controls=controls, seed=int(seed) % (2**32), id=next(self._ids),
                    callback=callback, t_submit=time.perf_counter())
        self.queue.append(r)
        return r

    def draw_seed(self) -> int:
        """A fresh seed for a request that gave none."""
        return int(self._rng.integers(0, 2**31 - 1))

    def cancel(self, req: Request) -> None:
        """Stop a request (a client gone): its slot is freed at the next `run_once`."""
        req.cancelled = True

    @property
    def idle(self) -> bool:
        return not self.queue and not self.running and not self._inflight

    def run_once(self) -> list[Event]:
        """One round: fill free slots from the queue (a long prompt takes one chunk per round), dispatch
        ``steps_per_call`` decode steps for the live slots, and, while the device runs them, turn the previous
        round's results into events (returned, and given to each request's callback). When that call may free a
        slot (`_read_first`), its results are read first, before admitting and dispatching."""
        if self.state is None:
            self.warmup()
        events: list[Event] = []
        self._round_admits = 0
        self._t_round = time.perf_counter()
        if self._read_first():  # the in-flight call may free a slot: learn it before admitting and dispatching
            while self._inflight:
                events += self._collect(self._inflight.popleft())
        self._drop_cancelled(events)
        self._admit()
        live = [r for r in self.running.values() if r.inserted and r.finish_reason is None]
        dispatched = bool(live)
        if dispatched:
            self._dispatch_step(live)
        while len(self._inflight) > (1 if dispatched else 0):
            events += self._collect(self._inflight.popleft())
        for e in events:
            r = self._reqs.get(e.request_id)
            if r is not None and r.callback is not None:
                r.callback(e)
            if e.finish_reason is not None:
                self._reqs.pop(e.request_id, None)
        return events

    def _read_first(self) -> bool:
        """Whether this round reads the in-flight calls' results before it admits and dispatches (the device idles
        meanwhile) rather than after (while the next call runs): when a row of the in-flight step call may reach its
        budget in it, or a waiting request is kept out of a free slot (by pages or grammar tables the in-flight call
        may free). Otherwise a slot freed in that call would idle through the next one too, and the next call's span
        would reserve room for both calls' tokens. (A row that ends on EOS or a stop is not foreseen: reading first
        every round would give up the overlap of host and device work for it.)"""
        if not self._inflight:
            return False
        if self.queue and len(self.running) < self.slots:  # a waiting request kept out by pages or grammar tables
            return True
        # the most tokens a row commits in a call: a plain call's one a step (counted as a drafted call's, every plain
        # call of one client read its results before the next dispatch, the host's work not overlapped)
        most = lambda call: self.steps_for(call[6]) * (self._per_step() if call[3] else 1)  # noqa: E731
        return any(r.finish_reason is None and r.controls.max_new_tokens - len(r.tokens) <= most(x)
                   for x in self._inflight if x[0] == "step" for r in x[1])

    def _drop_cancelled(self, events):
        for slot, r in list(self.running.items()):
            if r.cancelled and r.finish_reason is None:
                self._free(slot, release=r.inserted)
                events.append(self._final(r, "cancelled"))
        for r in [r for r in self.queue if r.cancelled]:
            self.queue.remove(r)
            self._reqs[r.id] = r
            events.append(self._final(r, "cancelled"))

    def _admit(self):
        free = [s for s in range(self.slots) if s not in self.running]
        while free and self.queue:
            r = self.queue[0]
            need = 0 if self.kv_pages is None else self.pages_for(len(r.prompt), r.controls.max_new_tokens)
            if need and need > len(self._free_pages):  # the requests running hold the pages: wait
                self.stats["page_waits"] += 1
                break
            if r.controls.grammar is not None:
                start = self.pool.acquire(r.controls.grammar)
                if start is None:  # the grammars in use fill the tables: wait for some to finish
                    self.stats["grammar_waits"] += 1
                    break
                r.gstart = start
            self.queue.popleft()
            self._reqs[r.id] = r
            r.slot = free.pop(0)
            self.running[r.slot] = r
            if need:  # its pages, in the host's table (the next admission call takes the whole table)
                r.pages, self._free_pages = self._free_pages[:need], self._free_pages[need:]
                self._table[r.slot, :need] = r.pages
        self._sync_tables()
        waiting = [r for r in self.running.values() if not r.inserted]
        short = [r for r in waiting if r.pre is None and len(r.prompt) <= self.chunk]
        for r in waiting:  # long prompts: one chunk per round, the last one admits
            if r not in short:
                self._feed_long(r)
        rows = self.admit_rows
        for i in range(0, len(short), rows):  # short prompts: admitted together, `rows` per call
            group = short[i: i + rows]
            self._admit_group(group if len(group) == 1 else (group + [group[-1]] * rows)[:rows])

    def _sync_tables(self):
        """Upload what changed in the structured-output tables when a grammar was placed since the last upload: the
        ranges it took, in windows of fixed size written into the device's tables (`_grammar_put_fn`), or the
        tables whole (on a mesh, before that program is compiled, or past `GRAMMAR_WINDOWS` windows; the same shapes
        either way: nothing recompiles)."""
        if self.pool is None or self.pool.version == self._pool_version:
            return
        p, put = self.pool, self._exe.get("grammar_put")
        rows, width = self._grammar_window()
        wins = p.windows(p.take_dirty(), rows, width)
        if put is not None and len(wins) <= GRAMMAR_WINDOWS:
            tables = self.state.grammar
            for s0, t0 in wins:
                tables = self._put_grammar_window(put, tables, s0, t0)
            self.state = self.state.replace(grammar=tables)
            self.stats["grammar_windows"] += len(wins)
        else:
            # a copy (device_put may alias host memory the pool writes in place later); device_put: nothing compiles
            tables = jax.tree.map(np.copy, p.tables())
            self.state = self.state.replace(grammar=jax.device_put(
                tables, self._state_sh.grammar if self.mesh is not None else None))
        self._pool_version = p.version
        self.stats["grammar_uploads"] += 1

    def _put_grammar_window(self, put, tables, s0: int, t0: int):
        """``tables`` with the pool's window of states from ``s0`` and of transitions from ``t0`` written by the
        program ``put`` (copies: the pool writes its arrays in place later)."""
        p, (rows, width) = self.pool, self._grammar_window()
        return put(tables, p.allow[s0:s0 + rows].copy(), p.base[s0:s0 + rows].copy(), p.forced[s0:s0 + rows].copy(),
                   np.int32(s0), p.nexts[t0:t0 + width].copy(), np.int32(t0))

    def _grammar_window(self) -> tuple[int, int]:
        return min(GRAMMAR_ROWS, self.pool.states), min(GRAMMAR_WIDTH, self.pool.transitions)

    @staticmethod
    def _grammar_put_fn(tables, allow, base, forced, s0, nexts, t0):
        """``tables`` with one window of states (from ``s0``) and one of transitions (from ``t0``) written."""
        put = jax.lax.dynamic_update_slice_in_dim
        return tables.replace(allow=put(tables.allow, allow, s0, 0), base=put(tables.base, base, s0, 0),
                              forced=put(tables.forced, forced, s0, 0), nexts=put(tables.nexts, nexts, t0, 0))

    def _grammar_put_exe(self):
        rows, width = self._grammar_window()
        p = self.pool
        return self._compile("grammar_put", self._grammar_put_fn, self._spec.grammar,
                             np.zeros((rows,) + p.allow.shape[1:], np.uint32), np.zeros((rows,) + p.base.shape[1:],
                                                                                         np.int32),
                             np.zeros((rows,), np.int32), np.int32(0), np.zeros((width,), np.int32), np.int32(0),
                             donate=(0,))

    def _admit_group(self, reqs: list):
        """One admission call for ``reqs`` (a list of 1 or ``admit_rows``, the last one repeated to fill it)."""
        rest = max(len(r.prompt) for r in reqs)
        exe, n, size = self._pick_admit(rest, len(reqs), False)
        reqs = (reqs * n)[:n]  # (one prompt over the rows of a stand-in program)
        toks = np.zeros((n, size), np.int32)
        for i, r in enumerate(reqs):
            toks[i, : len(r.prompt)] = r.prompt
        self.state, outs = exe(*self._admit_args(toks, reqs))
        uniq = list({id(r): r for r in reqs}.values())
        for r in uniq:
            r.fed, r.inserted = len(r.prompt), True
        self.stats["admit_calls"] += 1
        self._round_admits += 1
        self.stats["inserted"] += len(uniq)
        self._lagging = self._lagging or self._late  # (the draft was not fed these prompts: `_start`)
        self._inflight.append(("admit", uniq, outs))

    def _feed_long(self, r: Request):
        """A long prompt's next chunk: a middle chunk of ``chunk`` tokens, or the admission with the last one."""
        if r.pre is None:
            r.pre = self._take_prefix(r) or self._blank_prefill()
        rest = len(r.prompt) - r.fed
        if rest > self.chunk:
            toks = np.asarray([r.prompt[r.fed: r.fed + self.chunk]], np.int32)
            r.pre = self._exe["prefill"](self.params, r.pre, toks, np.asarray([self.chunk], np.int32))
            r.fed += self.chunk
            self.stats["prefill_chunks"] += 1
            self._round_admits += 1
            return
        exe, _, size = self._pick_admit(rest, 1, True)
        toks = np.zeros((1, size), np.int32)
        toks[0, :rest] = r.prompt[r.fed:]
        prompt = np.zeros((1, self.max_len), np.int32)
        prompt[0, : len(r.prompt)] = r.prompt
        self._keep_prefix(r)
        args = self._admit_args(toks, [r]) + (r.pre, prompt, np.asarray([len(r.prompt)], np.int32))
        self.state, outs = exe(*args)
        r.fed, r.pre, r.inserted = len(r.prompt), None, True
        self.stats["prefill_chunks"] += 1
        self.stats["admit_calls"] += 1
        self._round_admits += 1
        self.stats["inserted"] += 1  # (its draft prefilled with it: `_admit_fn`)
        self._inflight.append(("admit", [r], outs))

    def _take_prefix(self, r: Request):
        """A kept prefix for ``r`` (the entry sharing the most leading tokens with its prompt, at least
        `MIN_PREFIX`, one prompt token at least left to feed): its prefill state, ``r.fed`` set; else None."""
        if not self.prefix_entries:
            return None
        best, best_n = None, 0
        for e, toks in self._prefixes.items():
            n = min(generation.common_prefix([toks, r.prompt]), len(r.prompt) - 1)
            if n > best_n:
                best, best_n = e, n
        if best is None or best_n < MIN_PREFIX:
            self.stats["prefix_misses"] += 1
            return None
        self._prefixes.move_to_end(best)
        r.fed = best_n
        self.stats["prefix_hits"] += 1
        self.stats["prefix_tokens_reused"] += best_n
        return self._exe["prefix_get"](self._store, np.int32(best), np.int32(best_n))

    def _keep_prefix(self, r: Request):
        """Before a long prompt's last chunk: keep what its prefill state holds (``r.fed`` tokens) unless a kept
        prefix already covers it; it takes the place of a kept prefix it extends, else of the least recently used."""
        if not self.prefix_entries or r.fed < MIN_PREFIX:
            return
        head = r.prompt[: r.fed]
        if any(generation.common_prefix([t, head]) == len(head) for t in self._prefixes.values()):
            return
        sub = [e for e, t in self._prefixes.items() if generation.common_prefix([t, head]) == len(t)]
        if sub:
            e = sub[0]
        elif len(self._prefixes) < self.prefix_entries:
            e = len(self._prefixes)
        else:
            e = next(iter(self._prefixes))  # least recently used
        self._prefixes.pop(e, None)
        self._store = self._exe["prefix_put"](self._store, np.int32(e), r.pre)
        self._prefixes[e] = list(head)
        self.stats["prefixes_kept"] += 1

    def _dispatch_step(self, live):
        plain = all(not r.controls.processing and r.controls.temperature == 0 and not r.controls.logprobs
                    for r in live)
        top = max(r.slot for r in live) + 1
        rows = next(x for x in self.row_buckets if x >= top)
        spans = {d: self._span_for(live, d, rows) for d in (False, True)} if self.adaptive else None
        drafted = self._speculate(rows, spans)
        span_of = (lambda d: spans[d]) if spans else (lambda d: self._span_for(live, d, rows))  # noqa: E731
        samp, want = self.fast if plain else self.full, rows
        exe, drafted, span, rows = self._pick_step(samp, drafted, rows, span_of)
        if drafted and self._lagging and ("catch_up", rows) not in self._exe:  # (a background warm-up): plain
            exe, drafted, span, rows = self._pick_step(samp, False, want, span_of)
        first = exe not in self._ran  # (its first run: not timed, `_run_each_once`)
        self._ran.add(exe)
        self.stats[f"steps_span_{span}"] += 1
        self.stats[f"steps_rows_{rows}"] += 1
        if drafted and self._lagging:  # plain calls left the draft to lag: caught up first, apart (`_catch_up_fn`)
            self._catch_up(rows)
        clean = not self._round_admits and not first
        self.state, outs = exe(self.params, self.state)
        self.stats["steps"] += 1
        if self.drafter is not None:
            self.stats["drafted_steps" if drafted else "plain_steps"] += 1
            self._lagging = self._late and not drafted
        self._inflight.append(("step", live, outs, drafted, self._t_round, clean, rows, span))

    def _catch_up(self, rows: int):
        """Before a drafted call of ``rows`` rows after plain ones: the draft they left to lag caught up, waited for
        (the calls in flight with it, whose time is then not timed) and the drafted call's time counted from its
        end. Its own time is in ``stats["catch_up_s"]`` (no rate holds it: it is what drafting again costs after
        plain calls)."""
        t = time.perf_counter()
        self.state = self._exe[("catch_up", rows)](self.params, self.state)
        jax.block_until_ready(self.state)
        self.stats["catch_ups"] += 1
        self._inflight = collections.deque(x if x[0] != "step" else x[:5] + (False,) + x[6:] for x in self._inflight)
        self._t_round = time.perf_counter()
        self.stats["catch_up_s"] += self._t_round - t

    def _speculate(self, rows: int, spans: dict[bool, int] | None = None) -> bool:
        """Whether the next step call (of ``rows`` rows; ``spans``: the span each kind would get) drafts (the cost
        model: tau against the cost ratio — the ratio of the two kinds' timed row-step rates in the row bucket, each
        at its own span, once both were timed there, times `SPEC_MARGIN`, else the warm-up's for the bucket; or the
        given one; the other kind now and then (`probe_interval`): drafted probes keep tau and the drafted rate
        current, plain ones the plain rate)."""
        if not self.adaptive:
            return self.drafter is not None
        self._calls += 1
        if self.tau is None:
            return True
        d, p = ((self.rate.get((rows, spans[k])) or {}).get(k) if spans else None for k in (True, False))
        ratio = p / d if d and p else self.spec_costs.get(rows, self.spec_cost)
        if d and p and rows == self.slots:
            self.spec_cost = ratio  # (the full bucket's, as last judged)
        if self.timed and d and p:  # what the served rates leave out (`SPEC_MARGIN`)
            ratio *= SPEC_MARGIN
        best = self.tau >= ratio
        self._since_probe += 1
        probe = (self.timed or not best) and self._since_probe >= probe_interval(self.tau, ratio)
        if probe:
            self._since_probe = 0
        return best != probe

    def _note_tau(self, tokens: int, row_steps: int):
        if row_steps:
            a, b = self._tau_sums
            self._tau_sums = [TAU_DECAY * a + tokens, TAU_DECAY * b + row_steps]
            self.tau = self._tau_sums[0] / self._tau_sums[1]

    def _note_time(self, drafted: bool, rows: int, span: int, t_round: float, clean: bool, row_steps: int,
                   live: int):
        """A step call's results are read and turned into events: the ``row_steps`` its ``live`` rows took (the
        steps each row decoded before it ended, summed) over its seconds — since the previous step call's results
        were read (or since the start of the round that dispatched it, if later: an idle engine's wait is not
        counted): the loop's period per call, the host's work and the device's — go into its kind's decayed rate for
        its row bucket and span when neither the round that dispatched it nor this one admitted anything. A drafted
        row step gives tau tokens, a plain one 1: the ratio of the two rates (plain / drafted) is the tau at which
        drafting breaks even; tau itself stays current from every drafted call."""
        now = time.perf_counter()
        if self.timed and clean and self._last_ready is not None and live:
            rate = row_steps / max(now - max(self._last_ready, t_round), 1e-9) / live
            c = self.rate.setdefault((rows, span), {True: None, False: None})
            c[drafted] = rate if c[drafted] is None else TAU_DECAY * c[drafted] + (1 - TAU_DECAY) * rate
        self._last_ready = now

    def _collect(self, item) -> list[Event]:
        """Events from one dispatched call's results (waits for them)."""
        kind, reqs, outs = item[:3]
        events = []
        if kind == "admit":
            tok, lp, done, fw = (to_host(x) for x in outs)
            for i, r in enumerate(reqs):
                if r.finish_reason is None:
                    r.forwards = int(fw[i])
                    r.tokens.append(int(tok[i]))
                    if r.controls.logprobs:
                        r.logprobs.append(float(lp[i]))
                    ev = self._progress(r, bool(done[i]))
                    if ev is not None:
                        events.append(ev)
            return events
        c0, c1, done, new, lps, fw, acc = (to_host(x) for x in outs)
        drafted = item[3]
        tau_tok = tau_steps = made = rows_made = longest = 0
        for r in reqs:
            if r.finish_reason is not None:  # finished earlier (its slot's later tokens are not its own)
                continue
            s = r.slot
            k = int(c1[s] - c0[s])
            made, rows_made, ran = made + k, rows_made + 1, k
            r.forwards = int(fw[s])
            if self.drafter is not None:
                if drafted:
                    ran = int(acc[s].sum()) - (sum(r.accepted) if r.accepted else 0)
                    tau_tok, tau_steps = tau_tok + k, tau_steps + ran
                r.accepted = acc[s].tolist()
            longest = max(longest, ran)
            r.tokens += new[s, :k].tolist()
            if r.controls.logprobs:
                r.logprobs += lps[s, :k].tolist()
            ev = self._progress(r, bool(done[s]))
            if ev is not None:
                events.append(ev)
        if drafted and self.drafter is not None:  # (the spans' estimate too, with or without auto)
            self._note_tau(tau_tok, tau_steps)
        if self.adaptive:
            steps = tau_steps if drafted and self.drafter is not None else made  # (a plain step: one token)
            # timed when it ran all its steps: a call that every row left early (a budget reached) paid its fixed
            # part (dispatch, the weights' conversion) for fewer steps, and drafted calls end early more often (one
            # client: most drafted calls are a request's last, and timing them kept the engine from drafting there)
            full = longest >= self.steps_for(item[6])
            self._note_time(drafted, item[6], item[7], item[4], item[5] and full and not self._round_admits, steps,
                            rows_made)
        return events

    def _progress(self, r: Request, device_done: bool) -> Event | None:
        """The request's new text since the last event; finished when the device says so or a stop string shows."""
        tok = self.model.tokenizer
        if r.t_first is None and r.tokens:
            r.t_first = time.perf_counter()
        text = tok.decode(r.tokens) if tok is not None else ""
        stops, mn = r.controls.stop, r.controls.min_tokens
        after = generation.stop_after(r.tokens, tok.decode, mn) if stops and mn else 0
        at = generation.find_stop(text, stops, after) if stops and after >= 0 else -1
        if at >= 0:
            cut, text, _ = generation.cut_at_stop(r.tokens, tok.decode, stops, mn)
            r.tokens = cut
            r.logprobs = r.logprobs[: len(cut)]
            return self._finish(r, text, "stop", release=not device_done)
        if device_done:
            last = r.tokens[-1] if r.tokens else -1
            eos = last in self.eos and not r.controls.ignore_eos
            reason = "stop" if (eos or last in r.controls.stop_token_ids) else "length"
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
                     prompt_tokens=len(r.prompt), completion_tokens=len(r.tokens), forwards=r.forwards,
                     accepted=r.accepted)

    def _finish(self, r: Request, text: str, reason: str, release: bool) -> Event:
        self._free(r.slot, release)
        r.text = text
        return self._delta(r, text, reason)

    def _final(self, r: Request, reason: str) -> Event:
        r.finish_reason = reason
        return Event(request_id=r.id, text="", tokens=[], logprobs=None, finish_reason=reason,
                     prompt_tokens=len(r.prompt), completion_tokens=len(r.tokens), forwards=r.forwards,
                     accepted=r.accepted)

    def _free(self, slot: int, release: bool = True):
        """Forget the slot's request; ``release``: also stop the slot on the device (it was still decoding)."""
        r = self.running.pop(slot, None)
        if r is not None and r.controls.grammar is not None:
            self.pool.release(r.controls.grammar)
        if r is not None and r.pages:  # free for the next admission, whose call also takes this row's table off them
            self._free_pages += r.pages
            self._table[slot] = self.kv_pages
            r.pages = []
        if release and r is not None and r.inserted:
            self.state = self._exe["release"](self.state, np.int32(slot))

    # ------------------------------------------------------------------------------------------ convenience
    def generate(self, prompts: list[list[int]], **controls) -> list[Event]:
        """Run ``prompts`` to completion through the slots (more prompts than slots queue); returns each request's
        final state as one event (the whole text), in order."""
        reqs = [self.submit(p, self.check(p, **controls)) for p in prompts]
        while not self.idle:
            self.run_once()
        return [Event(request_id=r.id, text=r.text, tokens=r.tokens, logprobs=r.logprobs or None,
                      finish_reason=r.finish_reason, prompt_tokens=len(r.prompt), completion_tokens=len(r.tokens),
                      forwards=r.forwards)
                for r in reqs]


def costs_dir():
    """Where engines keep their warm-up's cost ratios: JAX's persistent compilation cache's directory (None: off)."""
    return jax.config.jax_compilation_cache_dir


def _stop_warming(ref):
    """At the process's exit: let an engine's warm-up thread finish the program in hand and stop (a daemon thread
    killed inside XLA's compiler ends the process with a C++ exception)."""
    eng = ref()
    if eng is not None and eng._warm_thread is not None:
        eng._stopping = True
        eng._warm_thread.join(600)


def probe_interval(tau: float, ratio: float) -> int:
    """Step calls per call of the kind the cost model did not choose (speculation="auto"), from tau and the cost
    ratio (a drafted call takes ``ratio`` plain calls' time and gives ``tau`` tokens a row step to a plain one's 1).
    A drafted probe while plain calls win gives ``ratio - tau`` plain calls' tokens fewer than a plain call in its
    time; a plain probe while drafted calls win, ``1 / ratio - 1 / tau`` drafted calls' tokens. The interval keeps
    that loss at `PROBE_SHARE` of the throughput at most, within [`PROBE_EVERY`, `PROBE_MAX`] calls: a probe that
    costs little runs often, one that costs much (a drafted call at a full batch, where it costs several plain ones)
    rarely. A probe is there to notice the choice turning: the further the chosen kind leads (``|tau - ratio|`` over
    the smaller), the less often it runs, `PROBE_EVERY` calls more per `PROBE_LEAD` of lead (one client: tau 3 against
    a ratio near 2, a plain probe once in 30 calls, not 8; on this CPU one in 8 cost that client 6% of its tokens)."""
    lost = ratio - tau if tau < ratio else 1.0 / ratio - 1.0 / tau
    lead = abs(tau - ratio) / min(tau, ratio)
    return int(min(PROBE_MAX, max(PROBE_EVERY, math.ceil(lost / PROBE_SHARE),
                                  math.ceil(PROBE_EVERY * lead / PROBE_LEAD - 1e-9))))


def default_row_buckets(slots: int) -> list[int]:
    """The row counts an engine's step programs are compiled for by default: from 8 slots on one row, a quarter of
    the slots and all of them (fewer slots: all of them). A step call with every live slot among the first rows of a
    bucket decodes those alone (one client: one row)."""
    return sorted({1, slots // 4, slots} if slots >= 8 else {slots})


def _maps_in_use() -> int | None:
    """The memory maps this process holds (Linux's /proc; None elsewhere)."""
    try:
        with open("/proc/self/maps", "rb") as f:
            return sum(1 for _ in f)
    except OSError:
        return None


def _maps_limit() -> int | None:
    """The most memory maps a process may hold (Linux's ``vm.max_map_count``; None elsewhere)."""
    try:
        with open("/proc/sys/vm/max_map_count") as f:
            return int(f.read())
    except (OSError, ValueError):
        return None


def default_spans(max_len: int) -> list[int]:
    """The attention spans an engine's step programs are compiled for by default: `MIN_SPAN`, 1.5 and 2 times it, a
    quarter and a half of ``max_len`` (those at least `MIN_SPAN`) and ``max_len`` itself. A step call attends over the
    smallest that holds its live rows: short requests on a long-context server do not pay for ``max_len`` slots each
    step. (1.5 times `MIN_SPAN`: the serve bench's 16 slots at 1.165x the tokens/s on the CPU, its positions under 192
    no longer attending over 256, `scripts/span_bench.py`. Not every step of 1.5 up to ``max_len``: each span is 6
    programs of an ar engine, 12 of a speculative one with ``speculation="auto"``, and on XLA:CPU such an engine at
    ``max_len`` 1024 with 7 spans ran out of the process's memory maps while compiling, Linux's default 65530.)"""
    return sorted({x for x in (MIN_SPAN, MIN_SPAN * 3 // 2, 2 * MIN_SPAN, max_len // 4, max_len // 2)
                   if MIN_SPAN <= x < max_len} | {max_len})


# ------------------------------------------------------------------------------------------------ streaming
_ENGINES: "collections.OrderedDict[Any, Engine]" = collections.OrderedDict()  # warmed engines, least recent first
ENGINE_CACHE_SIZE = 4


def stream(m, prompts, method: str = "ar", draft=None, max_new_tokens: int | None = None, seed: int = 0,
           slots: int | None = None, steps_per_call: int = 4, **controls_and_options):
    """`pdecode.generate` as a stream: yields ``(index, Event)`` as text arrives, ``index`` the prompt's position;
    each prompt's last event has ``finish_reason`` set. Runs on a `Engine` (kept warm for the next call with the
    same model, method, options and sizes); ``controls_and_options``: generate's sampling controls (temperature,
    top_k, top_p, min_p, repetition_penalty, presence_penalty, frequency_penalty, logit_bias, min_tokens, stop,
    stop_token_ids, logprobs) and the method's options.

        for i, ev in pdecode.stream(m, ["def fib(n):"], max_new_tokens=64):
            print(ev.text, end="", flush=True)
    """
    from pdecode import api

    control_names = ("temperature", "top_k", "top_p", "min_p", "repetition_penalty", "stop", "stop_token_ids",
                     "logprobs", "presence_penalty", "frequency_penalty", "logit_bias", "min_tokens")
    controls = {k: controls_and_options.pop(k) for k in control_names if k in controls_and_options}
    ids = api.encode_prompts(m, prompts)
    budget = max_new_tokens if max_new_tokens is not None else \
        generation.defaults(m.generation_config)["max_new_tokens"]
    n = slots or min(len(ids), 8)
    need = max(len(x) for x in ids) + budget + 64
    max_len = min(-(-need // 64) * 64, m.cfg.max_position_embeddings)
    key = (id(m), id(draft), method, tuple(sorted(controls_and_options.items())), n, max_len, steps_per_call)
    eng = _ENGINES.get(key)
    if eng is None or eng.model is not m:
        chunk = max(c for c in CHUNKS if c <= max(CHUNKS[0], min(256, max_len // 2)))
        eng = Engine(m, method=method, draft=draft, slots=n, max_len=max_len, chunk=chunk,
                     steps_per_call=steps_per_call, **controls_and_options)
        _ENGINES[key] = eng
        while len(_ENGINES) > ENGINE_CACHE_SIZE:
            _ENGINES.popitem(last=False)
    _ENGINES.move_to_end(key)
    index = {}
    for i, p in enumerate(ids):
        r = eng.submit(p, eng.check(p, max_tokens=budget, **controls), seed=seed + i)
        index[r.id] = i
    left = len(ids)
    try:
        while left:
            for ev in eng.run_once():
                i = index.get(ev.request_id)
                if i is None:
                    continue
                if ev.finish_reason is not None:
                    left -= 1
                yield i, ev
    finally:  # a consumer that stops early cancels the rest
        for r in list(eng.queue) + list(eng.running.values()):
            if r.id in index:
                eng.cancel(r)
        while not eng.idle:
            eng.run_once()
