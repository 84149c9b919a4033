"""The serving engine: continuous batching gives each request exactly what `pdecode.generate` gives it (greedy; ar,
sd, lookup, eagle; more requests than slots, mixed prompt lengths and budgets, a prompt prefilled in chunks), with
no compilation after warm-up; per-slot sampling values and seeds; stop strings; cancellation frees the slot."""

import jax
import numpy as np
import pytest

import pdecode
from pdecode import engine as engine_mod
from pdecode.engine import LONE_STEPS, Engine, default_row_buckets
from pdecode.errors import InputError
from pdecode.model import heads as H
from tests.test_heads import _with_heads
from tests.test_speculative import PROMPTS, models  # noqa: F401 (fixtures)

BUDGETS = [12, 5, 20, 9, 16, 3, 11, 14]


class CompileCounter:
    """Counts XLA backend compiles in this process while active."""

    def __init__(self):
        self.n, self.on = 0, False
        jax.monitoring.register_event_duration_secs_listener(self._event)

    def _event(self, name, secs, **kw):
        if self.on and name == "/jax/core/compile/backend_compile_duration":
            self.n += 1


COUNTER = CompileCounter()


def _serve_greedy(eng, prompts, budgets, each_round=None):
    """Submit greedy requests and run the engine until idle (``each_round()`` after every round); asserts that
    nothing compiled meanwhile. Returns the requests."""
    COUNTER.n, COUNTER.on = 0, True
    try:
        reqs = [eng.submit(p, eng.check(p, max_tokens=b, temperature=0.0)) for p, b in zip(prompts, budgets)]
        while not eng.idle:
            eng.run_once()
            if each_round is not None:
                each_round()
    finally:
        COUNTER.on = False
    assert COUNTER.n == 0 and eng.compiles == eng.warm_compiles  # requests came and went: nothing compiled
    return reqs


def _engine_case(models, method):  # noqa: F811
    t = models["target"]
    if method == "eagle":
        t = _with_heads(t, "eagle", H.EagleConfig(), seed=1)
        return t, {"tree_top_k": 2, "depth": 3, "total_tokens": 5}
    if method == "sd":
        return t, {"draft": models["small"], "gamma": 3}
    if method == "lookup":
        return t, {"gamma": 3}
    if method == "pearl":
        return t, {"draft": models["small"], "gamma": 2}
    if method == "lookahead":
        return t, {"window": 3, "ngram": 3, "guesses": 2}
    if method == "layerskip":
        return t, {"exit_layer": 1, "gamma": 3}
    return t, {}


# (layerskip, also served by the engine, is left out of this run for CI time; its decoding is tested in test_selfdraft)
@pytest.mark.parametrize("method", ["ar", "sd", "lookup", "eagle", "pearl", "lookahead"])
def test_engine_equals_generate_with_no_compile_after_warmup(models, method):  # noqa: F811
    t, opts = _engine_case(models, method)
    eng = Engine(t, method=method, slots=3, max_len=128, chunk=32, steps_per_call=3, **opts)
    eng.warmup()
    reqs = _serve_greedy(eng, PROMPTS, BUDGETS)
    assert eng.stats["prefill_chunks"] == 2  # the 37-token prompt went in two chunks
    assert eng.stats["admit_calls"] < len(PROMPTS)  # short prompts admitted together
    ref = pdecode.generate(t, PROMPTS, method=method, max_new_tokens=BUDGETS, **opts)  # one budget per row
    for i, (r, p) in enumerate(zip(reqs, PROMPTS)):
        assert r.tokens == ref.tokens[i], (method, p)
        assert r.finish_reason == ref.finish_reasons[i]
    # each request's target forwards (its prefill's one included) add up to generate's
    assert all(1 <= r.forwards <= len(r.tokens) for r in reqs)
    assert sum(r.forwards for r in reqs) == ref.stats["row_forwards"], method
    assert not eng.running and not eng.queue
    for r in reqs:  # per request, its verify steps by drafted tokens accepted: they account for its tokens
        if eng.drafter is None:
            assert r.accepted is None
            continue
        h, d = r.accepted, len(r.accepted) - 1
        made = 1 + sum((k + 1) * n for k, n in enumerate(h))  # the prefill's token, then each step's accepted + 1
        assert sum(h) == r.forwards - 1 and made - d <= len(r.tokens) <= made, (method, h, len(r.tokens))


def test_per_slot_sampling_and_seeds(models):  # noqa: F811
    """Greedy slots decode exactly as AR while sampled slots share the batch; a seeded request gives the same
    tokens whichever slot it lands in and whatever else runs."""
    t = models["target"]
    eng = Engine(t, method="sd", draft=models["small"], slots=4, max_len=96, chunk=32, gamma=3)
    reqs = []
    for i, p in enumerate(PROMPTS):
        kw = dict(temperature=0.0) if i % 2 == 0 else dict(temperature=1.0, top_k=5, repetition_penalty=1.2)
        reqs.append(eng.submit(p, eng.check(p, max_tokens=10, **kw), seed=100 + i))
    while not eng.idle:
        eng.run_once()
    for i, (r, p) in enumerate(zip(reqs, PROMPTS)):
        if i % 2 == 0:
            assert r.tokens == pdecode.generate(t, [p], max_new_tokens=10).tokens[0]
    # the sampled ones again, alone, in other slots
    again = [eng.submit(PROMPTS[i], eng.check(PROMPTS[i], max_tokens=10, temperature=1.0, top_k=5,
                                              repetition_penalty=1.2), seed=100 + i) for i in (5, 1)]
    while not eng.idle:
        eng.run_once()
    assert again[0].tokens == reqs[5].tokens and again[1].tokens == reqs[1].tokens
    assert reqs[1].tokens != reqs[3].tokens


@pytest.fixture(scope="module")
def code_engine():
    m = pdecode.load("code-target", dtype="float32")
    return m, Engine(m, method="ar", slots=2, max_len=160, chunk=64, steps_per_call=4)


def test_stop_strings_logprobs_and_streaming_text(code_engine):
    m, eng = code_engine
    prompt = m.tokenizer.encode("def fib(n):")
    free = pdecode.generate(m, [prompt], max_new_tokens=40, stop_at_eos=False, logprobs=True)
    text = free.texts[0]
    stop = text[len(text) // 2: len(text) // 2 + 3]
    events = []
    r = eng.submit(prompt, eng.check(prompt, max_tokens=40, temperature=0.0, stop=[stop], logprobs=True),
                   callback=events.append)
    while not eng.idle:
        eng.run_once()
    want = text[: text.find(stop)]
    assert r.finish_reason == "stop" and r.text == want
    assert "".join(e.text for e in events) == want  # the streamed pieces add up, stop string held back
    assert len(events) > 2 and events[-1].finish_reason == "stop"
    n = len(r.tokens)
    assert r.tokens == free.tokens[0][:n]
    np.testing.assert_allclose(r.logprobs, free.logprobs[0][:n], atol=1e-4)


def test_ignore_eos_runs_a_request_to_its_budget():
    """EOS is each row's own stop id in the engine: a request with ignore_eos runs past it to max_tokens (what load
    testers ask for), its neighbour in the same batch stops there."""
    import dataclasses

    m = pdecode.load("code-target", dtype="float32")
    prompt = m.tokenizer.encode("def fib(n):")
    free = pdecode.generate(m, [prompt], max_new_tokens=12, stop_at_eos=False).tokens[0]
    eos = free[3]
    k = free.index(eos)
    eng = Engine(dataclasses.replace(m, cfg=m.cfg.replace(eos_token_ids=(eos,))), slots=2, max_len=64, chunk=32)
    a = eng.submit(prompt, eng.check(prompt, max_tokens=12, temperature=0.0))
    b = eng.submit(prompt, eng.check(prompt, max_tokens=12, temperature=0.0, ignore_eos=True))
    while not eng.idle:
        eng.run_once()
    assert a.tokens == free[: k + 1] and a.finish_reason == "stop"
    assert b.tokens == free and b.finish_reason == "length"


def test_cancel_frees_the_slot(code_engine):
    m, eng = code_engine
    ps = [m.tokenizer.encode(s) for s in ("import os\n", "class A:\n", "x = 1\n")]
    reqs = [eng.submit(p, eng.check(p, max_tokens=60, temperature=0.0)) for p in ps]
    eng.run_once()
    assert len(eng.running) == 2 and len(eng.queue) == 1
    eng.cancel(reqs[0])
    eng.run_once()
    assert reqs[0].finish_reason == "cancelled" and reqs[2].slot == reqs[0].slot
    while not eng.idle:
        eng.run_once()
    assert reqs[1].tokens == pdecode.generate(m, [ps[1]], max_new_tokens=60).tokens[0]
    assert reqs[2].tokens == pdecode.generate(m, [ps[2]], max_new_tokens=60).tokens[0]


def test_bad_requests_and_options(code_engine, models):  # noqa: F811
    m, eng = code_engine
    p = m.tokenizer.encode("x")
    for kw, msg in [(dict(max_tokens=500), "ask for at most"), (dict(top_k=100), "top_k must be at most"),
                    (dict(temperature=-1.0), "temperature"), (dict(stop_token_ids=list(range(9))), "stop token ids")]:
        with pytest.raises(InputError, match=msg):
            eng.check(p, **kw)
    with pytest.raises(InputError, match="shorten the prompt"):
        eng.check(p * 200)
    with pytest.raises(InputError, match="empty"):
        eng.check([])
    with pytest.raises(InputError, match="token ids must lie"):
        eng.check([10**7])
    with pytest.raises(InputError, match="does not run in the serving engine"):
        Engine(models["target"], method="diffusion")
    with pytest.raises(InputError, match="chunk must be one of"):
        Engine(models["target"], chunk=100)


@pytest.mark.skipif(engine_mod._maps_in_use() is None or engine_mod._maps_limit() is None, reason="Linux's /proc")
def test_warmup_stops_short_of_the_memory_maps(models, monkeypatch):  # noqa: F811
    """On XLA:CPU each compiled program holds hundreds of memory maps, and a process past Linux's
    ``vm.max_map_count`` dies of a segmentation fault inside LLVM: warm-up judges the rest by what its first programs
    took and refuses, in one line, what would not fit; with room, a second warm-up compiles the rest."""
    eng = Engine(models["target"], slots=2, max_len=256, chunk=32, steps_per_call=2)
    core, rest = eng._programs()
    # room for the empty state and the core programs alone: the check after them refuses the rest, whole
    monkeypatch.setattr(engine_mod, "_maps_limit", lambda: 10**9 if eng.compiles <= len(core) else
                        engine_mod._maps_in_use() + 100)
    with pytest.raises(InputError, match=r"memory maps on XLA:CPU .*vm.max_map_count") as e:
        eng.warmup()
    todo = sum(name not in eng._exe for name, _ in rest)
    assert str(e.value).startswith(f"{todo} more programs") and todo > 1 and "\n" not in str(e.value)
    assert eng.compiles == len(core) + 1
    # ... and at each compile: with room for less than the most one program took, the next one is refused
    eng2 = Engine(models["target"], slots=2, max_len=256, chunk=32, steps_per_call=2)
    monkeypatch.setattr(engine_mod, "_maps_limit", lambda: engine_mod._maps_in_use() + 100)
    with pytest.raises(InputError, match=r"^1 more programs"):
        eng2.warmup()
    assert eng2.compiles == 2  # the empty state and a first program (its maps counted), nothing after
    before = eng.compiles
    monkeypatch.setattr(engine_mod, "_maps_limit", lambda: 10**9)
    eng.warmup()
    assert eng.compiles > before and all(("step", g, False, s, r) in eng._exe for g in (True, False)
                                       for s in eng.spans for r in eng.row_buckets)
    reqs = [eng.submit(p, eng.check(p, max_tokens=8, temperature=0.0)) for p in PROMPTS[:2]]
    while not eng.idle:
        eng.run_once()
    assert [r.tokens for r in reqs] == pdecode.generate(models["target"], PROMPTS[:2], max_new_tokens=8).tokens


def test_stream(code_engine):
    """`pdecode.stream`: the pieces of each prompt add up to generate's text, arrive over several events, and a
    consumer that stops early leaves the engine idle."""
    m, _ = code_engine
    prompts = ["def fib(n):", "import os\n", "class A:\n"]
    ref = pdecode.generate(m, prompts, max_new_tokens=30)
    texts, counts = ["", "", ""], [0, 0, 0]
    for i, ev in pdecode.stream(m, prompts, max_new_tokens=30):
        texts[i] += ev.text
        counts[i] += 1
    assert texts == ref.texts and min(counts) > 2
    gen = pdecode.stream(m, prompts, max_new_tokens=30)
    next(gen)
    gen.close()
    eng = next(iter(pdecode.engine._ENGINES.values()))
    assert eng.idle


@pytest.mark.parametrize("method", ["ar", "eagle"])
def test_prefix_cache_reuses_a_shared_prompt(models, method):  # noqa: F811
    """Prompts sharing a 70-token head (a system prompt), longer than a chunk: the first is prefilled in chunks and
    its head kept; the others take the kept prefill state (EAGLE's hidden states at the prompt positions included)
    and feed only their own tail; each request's tokens = `pdecode.generate`'s, nothing compiles after warm-up."""
    t, opts = _engine_case(models, method)
    eng = Engine(t, method=method, slots=2, max_len=160, chunk=32, steps_per_call=2, prefix_cache=2, **opts)
    eng.warmup()
    rng = np.random.default_rng(0)
    head = rng.integers(3, 90, 70).tolist()
    prompts = [head + rng.integers(3, 90, n).tolist() for n in (9, 1, 25, 40)] + [rng.integers(3, 90, 50).tolist()]
    budgets = [8, 6, 10, 5, 7]
    COUNTER.n, COUNTER.on = 0, True
    try:
        first = eng.submit(prompts[0], eng.check(prompts[0], max_tokens=budgets[0], temperature=0.0))
        while not eng.idle:
            eng.run_once()
        reqs = [first] + [eng.submit(p, eng.check(p, max_tokens=b, temperature=0.0))
                          for p, b in zip(prompts[1:], budgets[1:])]
        while not eng.idle:
            eng.run_once()
    finally:
        COUNTER.on = False
    assert COUNTER.n == 0 and eng.compiles == eng.warm_compiles
    assert eng.stats["prefix_hits"] == 3 and eng.stats["prefix_tokens_reused"] >= 3 * 64
    want = pdecode.generate(t, prompts, method=method, max_new_tokens=budgets, **opts)
    assert [r.tokens for r in reqs] == want.tokens


@pytest.mark.parametrize("pages", [None, 6])
def test_prompt_chunks_longer_than_max_len(models, pages):  # noqa: F811
    """An admission prefills over its chunk's slots, never more than max_len: chunk 64 on a 48-slot engine (paged:
    3 pages of 16 a slot) warms up and serves generate's tokens."""
    t = models["target"]
    eng = Engine(t, slots=2, max_len=48, chunk=64, kv_pages=pages)
    eng.warmup()
    reqs = _serve_greedy(eng, PROMPTS[:3], [12, 5, 9])
    assert [r.tokens for r in reqs] == pdecode.generate(t, PROMPTS[:3], max_new_tokens=[12, 5, 9]).tokens


def test_a_slot_freed_by_the_call_in_flight_is_refilled_in_the_next_round(models):  # noqa: F811
    """One slot, 4 steps a call, three requests of 4 tokens (the first from the admission, three from its call): each
    request's call ends it by its budget, so the round after reads that call's results before it admits and
    dispatches; three step calls in all, where a round that dispatched before reading would spend a call on the
    finished row each time (and leave the waiting request out for it)."""
    t = models["target"]
    eng = Engine(t, slots=1, max_len=64, chunk=32, steps_per_call=4)
    eng.warmup()
    reqs = _serve_greedy(eng, PROMPTS[:3], [4, 4, 4])
    assert [r.tokens for r in reqs] == pdecode.generate(t, PROMPTS[:3], max_new_tokens=4).tokens
    assert eng.stats["steps"] == 3, dict(eng.stats)


def test_a_row_alone_runs_longer_calls(models):  # noqa: F811
    """3 slots, 2 steps a call, a one-row bucket: a request alone in slot 0 runs calls of `LONE_STEPS` * 2 = 8 steps
    (a budget of 17: its first token from the admission, 16 from two such calls), two requests at once calls of 2
    steps; tokens = `pdecode.generate`'s."""
    t = models["target"]
    eng = Engine(t, slots=3, max_len=128, chunk=32, steps_per_call=2, row_buckets=[1])
    assert LONE_STEPS == 4 and eng.steps_for(1) == 8 and eng.steps_for(3) == 2
    eng.warmup()
    alone = _serve_greedy(eng, PROMPTS[:1], [17])
    assert eng.stats["steps_rows_1"] == eng.stats["steps"] == 2, dict(eng.stats)
    both = _serve_greedy(eng, PROMPTS[1:3], [9, 9])  # slots 0 and 1: 8 tokens each from 4 calls of 2 steps
    assert eng.stats["steps_rows_3"] == 4, dict(eng.stats)
    want = pdecode.generate(t, PROMPTS[:3], max_new_tokens=[17, 9, 9])
    assert [r.tokens for r in alone + both] == want.tokens
    assert Engine(t, slots=1, max_len=64, chunk=32, steps_per_call=2).steps_for(1) == 2  # one slot: no lone calls


@pytest.mark.parametrize("method", ["ar", "sd"])
def test_steps_attend_over_the_span_live_rows_need(models, method):  # noqa: F811
    """Step programs for spans of 32, 64 and 128 slots: calls with short live rows attend over 32 or 64 slots (the
    cache's head, written back after), longer ones over more; tokens = `pdecode.generate`'s, nothing compiles after
    warm-up; a bad span is refused."""
    t, opts = _engine_case(models, method)
    eng = Engine(t, method=method, slots=3, max_len=128, chunk=32, steps_per_call=2, spans=[32, 64],
                 row_buckets=[1], **opts)
    assert eng.spans == [32, 64, 128] and eng.row_buckets == [1, 3]
    eng.warmup()
    budgets = [40, 5, 60, 9, 16, 3, 11, 70]
    reqs = _serve_greedy(eng, PROMPTS, budgets)
    assert eng.stats["steps_span_32"] and eng.stats["steps_span_64"] and eng.stats["steps_span_128"]
    assert eng.stats["steps_rows_1"] and eng.stats["steps_rows_3"]  # slot 0 alone live: a one-row step
    want = pdecode.generate(t, PROMPTS, method=method, max_new_tokens=budgets, **opts)
    assert [r.tokens for r in reqs] == want.tokens
    with pytest.raises(InputError, match="spans must lie"):
        Engine(t, slots=1, max_len=128, chunk=32, spans=[0])
    assert default_row_buckets(16) == [1, 4, 16] and default_row_buckets(4) == [4]
    with pytest.raises(InputError, match="row_buckets must lie"):
        Engine(t, slots=2, max_len=128, chunk=32, row_buckets=[3])


# (paging is the target's cache: plain steps, and a drafter with a state of its own beside it; sd's draft-model cache
# is exercised with the paged target in tests/test_adaptive.py)
@pytest.mark.parametrize("method", ["ar", "eagle"])
def test_paged_kv_cache_shares_pages_among_slots(models, method):  # noqa: F811
    """A paged target cache of 9 pages of 16 positions for 4 slots of 128 (32 pages' worth): requests hold the pages
    their prompt and budget need and wait while too few are free; freed pages go to later requests (other slots,
    another order: any page kept stale or shared would change tokens); every request's tokens = `pdecode.generate`'s,
    nothing compiles after warm-up, all pages free at the end; a request needing more pages than the pool is refused."""
    t, opts = _engine_case(models, method)
    eng = Engine(t, method=method, slots=4, max_len=128, chunk=32, steps_per_call=2, spans=[64], kv_pages=9,
                 page_size=16, row_buckets=[2], **opts)
    eng.warmup()
    budgets = [12, 5, 40, 9, 16, 3, 11, 30]
    held = []  # per round: (pages the running requests hold, pages free)
    reqs = _serve_greedy(eng, PROMPTS, budgets, lambda: held.append(
        (sum(len(r.pages) for r in eng.running.values()), eng.pages_free)))
    assert eng.stats["page_waits"] > 0 and all(a + b == 9 for a, b in held)  # no page lost or held twice
    assert eng.stats["steps_rows_2"] and eng.stats["steps_rows_4"]  # calls with live slots 0-1 alone decode 2 rows
    want = pdecode.generate(t, PROMPTS, method=method, max_new_tokens=budgets, **opts)
    assert [r.tokens for r in reqs] == want.tokens
    assert sorted(eng._free_pages) == list(range(9)) and (eng._table == 9).all()
    small = Engine(t, method=method, slots=1, max_len=128, chunk=32, kv_pages=4, **opts)
    with pytest.raises(InputError, match="needs 5 KV pages"):
        small.check(PROMPTS[0], max_tokens=4 * 16 + 1 - len(PROMPTS[0]) - small.extra - 1)
    with pytest.raises(InputError, match="kv_pages must be"):
        Engine(t, slots=1, max_len=128, chunk=32, kv_pages=0)
    with pytest.raises(InputError, match="multiple of page_size"):
        Engine(t, slots=1, max_len=128, chunk=32, kv_pages=8, page_size=48)


def test_row_buckets_keep_the_batch_shared_state(models):  # noqa: F811
    """Lookahead's n-gram pool has a fill count and a clock shared by the batch (no row axis): steps in a one-row
    bucket advance them as full-width steps do (a write-back that kept the old values would freeze the pool: tokens
    still right, the pool never fed); tokens = `pdecode.generate`'s."""
    t, opts = _engine_case(models, "lookahead")
    eng = Engine(t, method="lookahead", slots=2, max_len=96, chunk=32, steps_per_call=2, row_buckets=[1], **opts)
    eng.warmup()
    reqs = _serve_greedy(eng, PROMPTS[:2], [20, 20])  # two at once: slots 0 and 1, full-width calls
    reqs += _serve_greedy(eng, PROMPTS[2:3], [24])  # alone in slot 0: one-row calls
    assert eng.stats["steps_rows_1"] > 0
    d = eng.state.loop.dstate
    assert int(d.clock) >= eng.stats["steps"] and int(d.filled) > 0
    want = pdecode.generate(t, PROMPTS[:3], method="lookahead", max_new_tokens=[20, 20, 24], **opts)
    assert [r.tokens for r in reqs] == want.tokens
