"""Speculation by cost in the serving engine (``speculation="auto"``): the plain step of a draft-and-verify loop
(the target alone, one token, the drafter following) mixed with drafted steps is lossless (sampled: the exact AR
marginals of the processed distribution; greedy: AR token for token), a draft model that followed plain steps still
drafts from the whole sequence, and the engine picks plain steps when drafting does not pay."""

import dataclasses
import itertools

import jax
import numpy as np
import pytest

import pdecode
from pdecode import engine as engine_mod
from pdecode.decode import speculative
from pdecode.engine import LATE_CALLS, PROBE_EVERY, PROBE_MAX, Engine, probe_interval
from pdecode.errors import InputError
from tests.test_controls import MIN_P, PEN, PROMPT, _min_pvalue, _processed_marginals, sharp  # noqa: F401
from tests.test_engine import BUDGETS, COUNTER
from tests.test_speculative import PROMPTS, models, small_vocab  # noqa: F401 (fixtures)

N = 12000


def _mixed_steps(monkeypatch, plain_samp=None):
    """Make every draft-and-verify loop alternate a plain step (first) and a drafted one. ``plain_samp``: a change
    to the plain steps' sampling configuration (a wrong rule)."""
    orig = speculative.make_step

    def mixed(*a, **kw):
        drafted = orig(*a, **kw)
        plain = orig(*a, **{**kw, "plain": True, "samp": (plain_samp or (lambda x: x))(kw["samp"])})
        return lambda s: jax.lax.cond(s.forwards % 2 == 1, plain, drafted, s)

    monkeypatch.setattr(speculative, "make_step", mixed)
    pdecode.clear_compile_cache()


def _sample(target, draft, n=N):
    try:
        out = pdecode.generate(target, [PROMPT] * n, method="sd", draft=draft, gamma=3, max_new_tokens=3,
                               temperature=1.0, repetition_penalty=PEN, min_p=MIN_P, seed=7, stop_at_eos=False)
    finally:
        pdecode.clear_compile_cache()
    return np.array(out.tokens)


def test_mixed_plain_and_drafted_steps_sample_like_ar(sharp, monkeypatch):  # noqa: F811
    """Token 1 from the prefill, token 2 from a plain step (processed with token 1 in its history), token 3 from a
    drafted step whose draft followed the plain one: the marginals are AR's of the processed distribution."""
    target, draft = sharp
    _mixed_steps(monkeypatch)
    toks = _sample(target, draft)
    assert _min_pvalue(toks, _processed_marginals(target, PROMPT, 3, PEN, MIN_P)) > 1e-4


def test_plain_step_without_processing_fails_the_test(sharp, monkeypatch):  # noqa: F811
    """The wrong rule: plain steps that skip a processing stage (min-p). The same test rejects it."""
    target, draft = sharp
    _mixed_steps(monkeypatch, plain_samp=lambda samp: dataclasses.replace(samp, use_min_p=False))
    toks = _sample(target, draft)
    assert _min_pvalue(toks, _processed_marginals(target, PROMPT, 3, PEN, MIN_P)) < 1e-6


def _run(eng, prompts, budgets):
    reqs = [eng.submit(p, eng.check(p, max_tokens=b, temperature=0.0)) for p, b in zip(prompts, budgets)]
    while not eng.idle:
        eng.run_once()
    return reqs


def test_auto_engine_mixes_steps_and_equals_generate(models):  # noqa: F811
    """A cost ratio no drafter can beat: after its first (drafted) call the engine runs plain steps, with a drafted
    probe now and then (at most every PROBE_EVERY calls); greedy output stays generate's token for token, nothing
    compiles after warm-up.
    (sd: the drafter with a state to follow; lookup's and Medusa's `follow` keep nothing.)"""
    t, method = models["target"], "sd"
    opts = dict(draft=models["small"], gamma=3)
    eng = Engine(t, method=method, slots=3, max_len=128, chunk=32, steps_per_call=2, speculation="auto",
                 spec_cost=100.0, **opts)
    eng.warmup()
    warm = eng.compiles
    COUNTER.n, COUNTER.on = 0, True
    try:
        reqs = _run(eng, PROMPTS, BUDGETS)
    finally:
        COUNTER.on = False
    assert COUNTER.n == 0 and eng.compiles == warm
    ref = pdecode.generate(t, PROMPTS, method=method, max_new_tokens=BUDGETS, **opts)
    assert [r.tokens for r in reqs] == ref.tokens
    st = eng.stats
    # the first call or two draft (tau is known once a drafted call's results were read), then plain ones and probes
    calls = st["drafted_steps"] + st["plain_steps"]
    assert calls == st["steps"] and 1 <= st["drafted_steps"] <= 2 + calls // PROBE_EVERY < calls, dict(st)
    assert 0 < eng.tau < 100.0
    assert eng.spec_cost == 100.0 and eng.rate == {}  # a given ratio is kept, not timed
    # per request: drafted verify steps plus plain steps are its forwards after the prefill's
    for r in reqs:
        assert sum(r.accepted) < r.forwards


def test_probes_run_less_often_as_they_cost_more(models):  # noqa: F811
    """The kind not chosen runs once in `probe_interval(tau, ratio)` calls: a probe's tokens lost against the chosen
    kind kept at 3% of the throughput (8 calls at the least, 256 at the most), and 8 calls more per 10% of the chosen
    kind's lead. A drafted probe at tau 3.2 where a drafted call costs 4.8 plain ones loses 1.6 plain calls' tokens:
    one in 54 calls; a plain probe while drafting wins costs little: one in 8 when the choice is close, fewer as
    drafting leads further. The engine's decisions follow it (a given ratio: no plain probes, nothing timed)."""
    assert probe_interval(3.2, 4.8) == 54  # ceil(1.6 / 0.03); the lead, 1.6 / 3.2: 40
    assert probe_interval(1.0, 100.0) == 256 and probe_interval(4.7, 4.8) == PROBE_EVERY
    assert probe_interval(3.2, 3.0) == PROBE_EVERY  # 1 / 3 - 1 / 3.2 = 0.02: 1 call; lead 0.067: 6 calls
    assert probe_interval(3.2, 1.85) == 59  # 1 / 1.85 - 1 / 3.2 = 0.23: 7.6 calls; lead 1.35 / 1.85 = 0.73: 58.4
    assert probe_interval(3.0, 2.0) == 40  # one client on this CPU: lead 0.5
    assert probe_interval(8.0, 1.1) == PROBE_MAX  # 1 / 1.1 - 1 / 8 = 0.784: 27 calls; lead 6.3
    t = models["target"]
    for ratio, tau, want in ((4.8, 3.2, 54), (2.0, 1.6, 20)):  # by the cost; by the lead (0.4 / 0.03: 14)
        eng = Engine(t, method="sd", draft=models["small"], slots=2, max_len=96, chunk=32, speculation="auto",
                     spec_cost=ratio, gamma=3)
        eng.tau = tau
        drafted = [eng._speculate(2) for _ in range(3 * want)]
        assert [i for i, d in enumerate(drafted) if d] == [want - 1, 2 * want - 1, 3 * want - 1]
    eng.tau = 3.0  # drafting wins: a given ratio has no plain probes
    assert all(eng._speculate(2) for _ in range(100))


def test_each_kind_is_judged_at_its_own_span(models):  # noqa: F811
    """The served rates are kept per row bucket and span, and a call compares tau with the ratio of the plain rate at
    the span a plain call would get to the drafted rate at the (longer) span a drafted call would get; without both,
    the warm-up's ratio for the bucket as it is; the served rates' ratio times `SPEC_MARGIN` (1.2), a given one as it
    is."""
    t = models["target"]
    eng = Engine(t, method="sd", draft=models["small"], slots=2, max_len=128, chunk=32, speculation="auto",
                 spans=[32, 64, 128], gamma=3)
    eng.spec_costs, eng.spec_cost, eng.tau = {2: 2.0}, 2.0, 2.5
    eng._since_probe = -10**6  # no probes here
    eng.rate = {(2, 32): {True: 150.0, False: 300.0}, (2, 64): {True: 100.0, False: 200.0}}
    # at either span alone drafting wins (300 / 150 = 200 / 100 = 2, times 1.2 < tau 2.5); a drafted call needing 64
    # where a plain one takes 32 does not (300 / 100 = 3)
    assert eng._speculate(2, {False: 32, True: 32}) and eng._speculate(2, {False: 64, True: 64})
    assert not eng._speculate(2, {False: 32, True: 64})
    assert eng.spec_cost == 3.0
    assert eng._speculate(2, {False: 32, True: 128})  # no drafted rate at 128: the warm-up's 2.0
    eng.tau = 2.3  # above the served ratio, short of it times the margin: plain; above the warm-up's: drafted
    assert not eng._speculate(2, {False: 32, True: 32}) and eng._speculate(2, {False: 32, True: 128})
    eng.spec_costs, eng.tau = {2: 2.5}, 2.4
    assert not eng._speculate(2, {False: 128, True: 128})
    given = Engine(t, method="sd", draft=models["small"], slots=2, max_len=128, chunk=32, speculation="auto",
                   spans=[32, 64, 128], gamma=3, spec_cost=2.0)
    given.tau, given._since_probe = 2.3, -10**6  # a given ratio is the break-even as it is
    assert given._speculate(2, {False: 32, True: 32})


@pytest.mark.parametrize("steps", [1, 3])
def test_followed_draft_keeps_full_acceptance(models, steps):  # noqa: F811
    """The draft is the target itself: every drafted step accepts all gamma tokens, also those after runs of plain
    steps (the draft's cache caught up after each plain call's steps, `Drafter.follow_late`: one pass for 1 or 3
    plain steps). A draft that did not follow would draft from a stale cache. (A ratio just above tau = 4: plain
    calls win by little, so a drafted probe runs once in 8 calls.)"""
    t = models["target"]
    eng = Engine(t, method="sd", draft=t, slots=2, max_len=128, chunk=32, steps_per_call=steps, speculation="auto",
                 spec_cost=4.2, gamma=3)
    reqs = _run(eng, PROMPTS[:2], [60, 60])
    assert eng.stats["plain_steps"] > eng.stats["drafted_steps"] >= 3
    for r in reqs:
        h = r.accepted  # verify steps that accepted 0..3 drafted tokens
        assert h[3] >= 3 and sum(h[:3]) <= 1, h  # at most the last step, cut by the budget, accepts fewer


@pytest.mark.parametrize("layout", ["one device", "mesh", "paged, a row bucket"])
def test_a_draft_left_to_lag_is_caught_up_by_the_next_drafted_call(models, layout):  # noqa: F811
    """Neither an admission (the prompt) nor a plain call feeds the draft: each row's lag grows by every plain call's
    tokens (2 at 2 steps a call), past the width of one catch-up forward (`LATE_CALLS` calls' tokens, 16); before
    the first drafted call, and the next drafted call after plain ones, a
    program of its own catches it up whole (in forwards that wide), waited for, so the drafted call is timed apart
    from it and the plain call in flight with it is not timed. The
    draft is the target itself: every drafted step after 10 plain calls (20 tokens unfed) or 7 accepts all 3 drafted
    tokens, and the tokens are generate's. On a 2x4 mesh too (the caches' heads written back whole there), and on a
    paged cache with the two rows decoded as the first 2 of 4 slots (a row bucket: the state's rows cut and put back).
    On the mesh of 8 host devices every program of the engine returns with its results ready, one at a time (two
    sharded programs in flight there can stall in a collective's rendezvous until XLA ends the process:
    `tests/test_sharding.py::test_programs_on_cpu_devices_run_one_at_a_time`)."""
    t, opts = models["target"], {}
    if layout == "mesh":
        from pdecode.sharding import make_mesh

        t = t.on_mesh(make_mesh(2, 4), indivisible="replicate")
    elif layout != "one device":
        opts = dict(slots=4, row_buckets=[2, 4], kv_pages=32)
    eng = Engine(t, method="sd", draft=t, **{"slots": 2, **opts}, max_len=128, chunk=32, steps_per_call=2,
                 speculation="auto", spec_cost=4.2, gamma=3)
    assert eng._late_width == LATE_CALLS * 2 == 16
    plan = iter([True] + [False] * 10 + [True] * 3 + [False] * 7 + [True] * 100)  # the calls' kinds, in order
    eng._speculate = lambda rows, spans=None: next(plan)
    calls = []
    orig = eng._dispatch_step

    def dispatch(live):  # after each step call: how far each live row's draft lags behind its sequence's last token
        orig(live)
        loop = eng.state.loop
        lag = np.asarray(loop.seq_len) - 1 - np.asarray(loop.dstate.cache.lengths)
        calls.append((eng._inflight[-1][3], eng.stats["catch_ups"], {r.slot: int(lag[r.slot]) for r in live},
                      [x[5] for x in list(eng._inflight)[:-1] if x[0] == "step"]))

    eng._dispatch_step = dispatch
    admitted, admit = [], eng._admit_group

    def admit_group(reqs):  # the draft's committed length in each admitted slot: nothing fed
        admit(reqs)
        admitted.extend(int(np.asarray(eng.state.loop.dstate.cache.lengths)[r.slot]) for r in reqs)

    eng._admit_group = admit_group
    reqs = _run(eng, PROMPTS[:2], [80, 80])
    assert len(admitted) >= 2 and not any(admitted), admitted
    assert (layout == "mesh") == eng._one_at_a_time == all(isinstance(e, engine_mod._OneAtATime)
                                                           for e in eng._exe.values())
    ref = pdecode.generate(t, PROMPTS[:2], method="sd", draft=t, gamma=3, max_new_tokens=[80, 80])
    assert [r.tokens for r in reqs] == ref.tokens
    for r in reqs:  # 8 + 20 + 24 + 14 tokens, then drafted calls to 80: none short of full acceptance but the last
        assert r.accepted[3] >= 10 and sum(r.accepted[:3]) <= 1, r.accepted
    for (d0, n0, lag0, _), (d1, n1, lag1, before) in zip(calls, calls[1:]):
        both = [s for s in lag1 if s in lag0]
        if not d1:  # a plain call leaves the draft its tokens further behind (none fed)
            assert all(lag1[s] == lag0[s] + 2 for s in both), (lag0, lag1)
        else:  # a drafted call leaves it at most one step's tokens behind, whatever it lagged before
            assert max(lag1.values()) <= 3 + 1, lag1
        assert n1 == n0 + (d1 and not d0)  # a catch-up before each drafted call after plain ones, no other
        if d1 and not d0:  # the plain call in flight with it: not timed
            assert before and not any(before), before
    assert max(x for d, _, lag, _ in calls if not d for x in lag.values()) > 16  # beyond one catch-up forward
    assert calls[0][:2] == (True, 1)  # the admissions fed the draft nothing: caught up before the first call
    assert eng.stats["catch_ups"] == 3
    if layout == "one device":  # while the catch-up program is not compiled (a background warm-up): plain calls
        catch_up, n = eng._exe.pop(("catch_up", 2)), len(calls)
        plan = iter([True] * 100)
        again = _run(eng, PROMPTS[:2], [40, 40])
        assert [r.tokens for r in again] == [x[:40] for x in ref.tokens]
        kinds = [d for d, *_ in calls[n:]]
        assert len(kinds) > 5 and not any(kinds), kinds  # (the admissions left the draft unfed)
        eng._exe[("catch_up", 2)] = catch_up
        plan, before = iter([False] * 100), eng.stats["catch_ups"]  # requests that end before a drafted call:
        again = _run(eng, PROMPTS[:2], [40, 40])  # their draft is never fed
        assert [r.tokens for r in again] == [x[:40] for x in ref.tokens] and eng.stats["catch_ups"] == before


def test_a_row_alone_lags_through_longer_plain_calls(models):  # noqa: F811
    """A row alone runs calls of `LONE_STEPS` times the steps (8 at 2 a call), so three plain calls there leave the
    draft 24 tokens behind, more than one catch-up forward's width (16): the catch-up program before the drafted call
    after them feeds it in two, on a row bucket of one (the drafted call then at a span of 128 of 256). The draft is the
    target itself: with a forced cycle of 1 drafted and 3 plain calls, through calls of both rows (4-row bucket) and
    then of the longer request alone, every drafted step accepts all 3 tokens (but a last one cut by the budget),
    tokens = generate's. That request's prompt (37 tokens) is longer than a chunk (32): prefilled over two rounds, and
    its draft prefilled with it at admission (a catch-up's forwards are a few calls' tokens wide), where a prompt of
    one chunk leaves it empty."""
    t = models["target"]
    eng = Engine(t, method="sd", draft=t, slots=4, row_buckets=[1, 4], kv_pages=64, max_len=256, chunk=32,
                 spans=[128], steps_per_call=2, speculation="auto", spec_cost=4.2, gamma=3)
    assert eng.steps_for(1) == 8 and eng._late_width == 16
    plan = itertools.cycle([True, False, False, False])
    eng._speculate = lambda rows, spans=None: next(plan)
    fed, feed_long = {}, eng._feed_long

    def feed(r):  # the draft's committed length in the slot once the long prompt is admitted
        feed_long(r)
        if r.inserted:
            fed[len(r.prompt)] = int(np.asarray(eng.state.loop.dstate.cache.lengths)[r.slot])

    eng._feed_long = feed
    prompts = [PROMPTS[2], PROMPTS[1]]
    reqs = _run(eng, prompts, [64, 12])
    assert fed == {37: 37} and eng.stats["prefill_chunks"] == 2, (fed, dict(eng.stats))
    assert eng.stats["steps_rows_1"] >= 4 and eng.stats["steps_rows_4"] >= 2, dict(eng.stats)
    assert eng.stats["steps_span_128"] == eng.stats["steps"]  # the caches cut to 128 of 256: windows written back
    ref = pdecode.generate(t, prompts, method="sd", draft=t, gamma=3, max_new_tokens=[64, 12])
    assert [r.tokens for r in reqs] == ref.tokens
    for r in reqs:
        assert r.accepted[3] >= 2 and sum(r.accepted[:3]) <= 1, r.accepted


def test_a_lagging_draft_catches_up_whole(models):  # noqa: F811
    """`follow_late` after plain steps feeds every committed token the draft lacks but the last (the root its next
    proposal feeds), in forwards of the given width: two rows lagging 9 and 2 tokens behind (plain calls left them
    unfed) reach seq_len - 1 in forwards of 2, and the draft's next-token logits at the root equal a full forward over
    the sequence. With a slack the rows may lag that much: one forward of 8 feeds both rows (the one lagging 9 keeps 1,
    within a slack of 5), none while no row lags more than the slack."""
    import jax.numpy as jnp

    from pdecode.decode import draft_model

    t, d = models["target"], models["small"]
    eng = Engine(t, method="sd", draft=d, slots=2, max_len=64, chunk=32, speculation="auto", spec_cost=4.0, gamma=4)
    drafter = eng.drafter
    _, dp = eng._layout(eng.params)
    rng = np.random.default_rng(0)
    seq = rng.integers(3, d.cfg.vocab_size, (2, 64)).astype(np.int32)
    plen, seq_len = np.array([5, 9], np.int32), np.array([15, 12], np.int32)  # the draft has the prompts alone
    cache = draft_model._draft_init(dp, drafter.dcfg, jnp.asarray(seq[:, :9]), jnp.asarray(plen), 64, jnp.float32)
    st = drafter.follow_late(dp, draft_model.ChainState(cache=cache, gamma=jnp.full((2,), 4, jnp.int32)),
                             jnp.asarray(seq), jnp.asarray(seq_len), 2)
    assert np.asarray(st.cache.lengths).tolist() == [14, 11]
    state = draft_model.ChainState(cache=cache, gamma=jnp.full((2,), 4, jnp.int32))
    lagging = drafter.follow_late(dp, state, jnp.asarray(seq), jnp.asarray(seq_len), 8, 5)
    assert np.asarray(lagging.cache.lengths).tolist() == [13, 11]
    assert np.asarray(drafter.follow_late(dp, state, jnp.asarray(seq), jnp.asarray(seq_len), 8, 9).cache.lengths
                      ).tolist() == [5, 9]
    whole = drafter.follow_late(dp, lagging, jnp.asarray(seq), jnp.asarray(seq_len), 8)
    assert np.asarray(whole.cache.lengths).tolist() == [14, 11]
    for fed in (st, whole):
        _, logits, _ = draft_model.catch_up(dp, drafter.dcfg, fed.cache, jnp.asarray(seq), jnp.asarray(seq_len), 1)
        for b in range(2):
            ref = np.asarray(pdecode.forward_logits(d, [seq[b, : seq_len[b]].tolist()]))[0, -1]
            np.testing.assert_allclose(np.asarray(logits[b]), ref, atol=2e-4, rtol=1e-4)


def test_a_plain_call_reserves_one_token_a_step(models):  # noqa: F811
    """The span of a step call holds its live rows after the call: a plain call reserves one token a step and one slot
    for its last step, a drafted call tau + 1 tokens a step (the tree's depth before tau is known) and the tree, a
    call of one row alone `LONE_STEPS` times the steps, and a call in flight counts with its own kind's reserve."""
    from pdecode.engine import Request

    t = models["target"]
    eng = Engine(t, method="sd", draft=models["small"], slots=2, max_len=128, chunk=32, steps_per_call=4,
                 speculation="auto", spec_cost=2.0, spans=[32, 64, 128], gamma=4)
    live = [Request(prompt=list(range(20)), controls=None, seed=0)]  # 21 positions after its first token
    assert eng._span_for(live, False, 2) == 32  # 21 + 4 x 1 + 1 + 1 = 27
    assert eng._span_for(live, True, 2) == 64  # 21 + 4 x 5 + 5 + 1 = 47
    assert eng._span_for(live, False, 1) == 64  # a call of one row alone: 21 + 16 x 1 + 1 + 1 = 39
    eng.tau = 1.5
    assert eng._span_for(live, True, 2) == 64  # 21 + 4 x 3 + 5 + 1 = 39
    call = ("step", live, None, False, 0.0, True, 2, 32)
    eng._inflight.append(call)  # a plain call in flight: 4 more
    assert eng._span_for(live, False, 2) == 32  # 27 + 4 = 31
    eng._inflight[0] = call[:3] + (True,) + call[4:]  # a drafted one: 12 more
    assert eng._span_for(live, False, 2) == 64  # 27 + 12 = 39


def test_results_read_first_only_when_a_call_may_end_a_row(models):  # noqa: F811
    """A round reads the in-flight call's results before dispatching (no overlap of host and device work) only when
    a row may reach its budget in that call: a plain call commits one token a step, a drafted call up to gamma + 1
    (a plain call counted as a drafted one read first in every round of one client)."""
    from pdecode.engine import Request

    eng = Engine(models["target"], method="sd", draft=models["small"], slots=2, max_len=96, chunk=32,
                 steps_per_call=4, speculation="auto", gamma=3)
    r = Request(prompt=[1, 2, 3], controls=eng.check([1, 2, 3], max_tokens=20, temperature=0.0), seed=0, slot=0)
    r.tokens = [5] * 10  # 10 to go: more than a plain call of 4 steps makes, fewer than a drafted one's 16
    for drafted, first in ((False, False), (True, True)):
        eng._inflight.clear()
        eng._inflight.append(("step", [r], None, drafted, 0.0, True, 2, 96))
        assert eng._read_first() is first
    eng._inflight[0] = ("step", [r], None, False, 0.0, True, 2, 96)  # a plain call in flight
    r.tokens = [5] * 16  # 4 to go: that call may end it
    assert eng._read_first()
    r.tokens = [5] * 15  # 5 to go
    assert not eng._read_first()


def test_only_calls_that_ran_all_their_steps_are_timed(models):  # noqa: F811
    """The cost model times a step call only when some row ran all its steps: one that every row left early (a
    budget reached) paid the call's fixed part for fewer steps (one client: most drafted calls are a request's last).
    Results of plain and drafted calls of 4 steps over one live row fed to `_collect` (no device work)."""
    import time

    from pdecode.engine import Request

    eng = Engine(models["target"], method="sd", draft=models["small"], slots=2, max_len=96, chunk=32,
                 steps_per_call=4, speculation="auto", gamma=3)
    assert eng.timed and eng.steps_for(2) == 4
    r = Request(prompt=[1, 2, 3], controls=eng.check([1, 2, 3], max_tokens=60, temperature=0.0), seed=0, slot=0)

    def collect(drafted, made, steps):  # one row made ``made`` tokens in ``steps`` steps
        c0 = np.array([len(r.tokens), 0], np.int32)
        acc = np.zeros((2, 4), np.int32)
        acc[0, 0] = (r.accepted[0] if r.accepted else 0) + steps  # (the histogram's total: the row's steps so far)
        outs = (c0, c0 + [made, 0], np.zeros(2, bool), np.ones((2, 96), np.int32), np.zeros((2, 96), np.float32),
                np.zeros(2, np.int32), acc)
        eng._last_ready = time.perf_counter() - 0.01
        eng._collect(("step", [r], outs, drafted, 0.0, True, 2, 96))
        return dict(eng.rate.get((2, 96), {}))

    assert collect(False, 3, 3) == {}  # a plain call left after 3 of its 4 steps
    assert collect(False, 4, 4)[False] > 0 and collect(True, 9, 3)[True] is None  # a drafted call left early
    assert collect(True, 11, 4)[True] > 0


def test_measured_cost_and_options(models, monkeypatch):  # noqa: F811
    """Without spec_cost a ratio is timed at warm-up (its value is this machine's: not asserted), then from the
    serving loop's own calls of both kinds (the other kind runs now and then: here every 3 calls, since how often
    depends on the timed ratio's lead, which is this machine's); bad values are one-line errors; a drafter that cannot
    follow keeps drafting."""
    monkeypatch.setattr(engine_mod, "probe_interval", lambda tau, ratio: 3)
    t = models["target"]
    eng = Engine(t, method="sd", draft=models["small"], slots=2, max_len=96, chunk=32, steps_per_call=1,
                 speculation="auto", gamma=3)
    eng.warmup()
    assert 0 < eng.spec_cost < float("inf") and not eng.running and bool(np.all(np.asarray(eng.state.loop.out.done)))
    reqs = _run(eng, PROMPTS[:2], [40, 40])
    assert [r.tokens for r in reqs] == pdecode.generate(t, PROMPTS[:2], max_new_tokens=40).tokens
    st = eng.stats
    assert st["drafted_steps"] >= 1 and st["plain_steps"] >= 1, dict(st)
    assert eng.spans == [96]  # one row bucket (2 slots), one span: one pair of rates
    c = eng.rate[(2, 96)]  # row steps per second per live row
    assert c[True] > 0 and c[False] > 0
    eng._speculate(2, {True: 96, False: 96})
    assert eng.spec_cost == pytest.approx(c[False] / c[True])  # the break-even tau, as last judged
    with pytest.raises(InputError, match="speculation must be one of"):
        Engine(t, method="lookup", speculation="sometimes")
    with pytest.raises(InputError, match="spec_cost must be a number > 0"):
        Engine(t, method="lookup", speculation="auto", spec_cost=0)
    la = Engine(t, method="lookahead", slots=2, max_len=96, chunk=32, speculation="auto", window=3, ngram=3,
                guesses=2)
    assert not la.adaptive and "cannot follow" in la.speculation_note


def _gated(monkeypatch):
    """Hold `Engine.warmup`'s thread (``background``) until the returned event is set."""
    gate = __import__("threading").Event()
    orig = Engine._compile_rest

    def held(self, t0):
        gate.wait(120)
        orig(self, t0)

    monkeypatch.setattr(Engine, "_compile_rest", held)
    return gate


@pytest.mark.parametrize("layout", ["sd auto", "ar on a mesh"])
def test_background_warmup_serves_from_stand_ins(models, layout, monkeypatch, tmp_path):  # noqa: F811
    """``warmup(background=True)`` returns with the programs nothing can stand in for; until the thread has compiled
    the rest, calls go to ready programs that cover them (the full sampler at a longer span, the admission of several
    rows for one prompt) and give generate's tokens, and keep to them when a compile in the thread fails; a second
    warm-up compiles what is missing; then every program is there and none stands in. sd auto times
    its cost ratios once and keeps them next to the compilation cache: an engine of the same configuration reads
    them instead of timing, one of another does not find them."""
    monkeypatch.setattr(engine_mod, "costs_dir", lambda: tmp_path)
    gate = _gated(monkeypatch)
    t = models["target"]
    if layout == "sd auto":
        opts = dict(method="sd", draft=models["small"], speculation="auto", gamma=3, max_len=256)
    else:
        from pdecode.sharding import make_mesh

        t, opts = t.on_mesh(make_mesh(2, 4), indivisible="replicate"), dict(method="ar", max_len=128)
    eng = Engine(t, slots=2, chunk=32, steps_per_call=2, **opts)
    eng.warmup(background=True)
    assert eng.pending_programs > 0 and eng._warm_thread.is_alive()
    if layout == "sd auto":  # the thread's first programs are the catch-ups: once they are done, calls may draft
        for make in eng._rest[:len(eng.row_buckets)]:
            make()
        assert all(("catch_up", r) in eng._exe for r in eng.row_buckets)
    ready = eng.compiles
    prompts, ref = PROMPTS[:3], pdecode.generate(t, PROMPTS[:3], max_new_tokens=[30, 12, 20]).tokens

    def serve():  # greedy requests, then one with logprobs (the full sampler): their tokens
        greedy = _run(eng, prompts, [30, 12, 20])
        one = eng.submit(PROMPTS[0], eng.check(PROMPTS[0], max_tokens=30, temperature=0.0, logprobs=True))
        while not eng.idle:
            eng.run_once()
        return [r.tokens for r in greedy] + [one.tokens]

    assert serve() == ref + ref[:1]
    assert eng.stats["steps_stood_in"] > 0 and eng.compiles == ready and eng.pending_programs > 0
    assert layout != "sd auto" or eng.stats["drafted_steps"] > 0  # (no step of its own yet: drafted stand-ins)
    # a compile that fails in the thread (say, out of memory): calls keep to stand-ins, nothing compiles while serving
    eng._rest.insert(0, lambda: (_ for _ in ()).throw(RuntimeError("out of memory")))
    gate.set()
    with pytest.raises(RuntimeError, match="out of memory"):
        eng.wait_warm(120)
    stood = eng.stats["steps_stood_in"]
    assert eng.pending_programs == 0 and serve() == ref + ref[:1]
    assert eng.stats["steps_stood_in"] > stood and eng.compiles == ready
    eng.warmup(background=True)  # a second try compiles what is missing
    assert eng.wait_warm(120) and eng.pending_programs == 0 and eng.warm_all_s > 0
    before = eng.stats["steps_stood_in"]
    assert serve() == ref + ref[:1]
    assert eng.stats["steps_stood_in"] == before and eng.compiles == eng.warm_compiles
    steps = len(eng.spans) * len(eng.row_buckets) * 2 * (2 if eng.adaptive else 1)
    assert sum(k[0] == "step" for k in eng._exe) == steps
    if layout == "sd auto":
        assert set(eng.spec_costs) == {2} and len(list(tmp_path.glob("*/*.json"))) == 1
        again = Engine(t, slots=2, chunk=32, steps_per_call=2, **opts)
        assert again._load_costs() == eng.spec_costs
        assert Engine(t, slots=3, chunk=32, steps_per_call=2, **opts)._load_costs() is None
        monkeypatch.setattr(Engine, "_measure_spec_cost", lambda self: pytest.fail("timed again"))
        eng.spec_costs, eng.spec_cost = {}, None
        eng.warmup()  # (its programs are there: the ratios read back)
        assert eng.spec_costs == again._load_costs()
