"""Structured output (`pdecode.grammar`): the device tables follow outlines-core's automaton; greedy constrained
speculative decoding equals constrained AR token for token and the output parses and validates; sampled speculative
decoding is lossless with respect to the constrained distribution (a statistical test against exact constrained AR
marginals), and a rule that ignores the drafted path is rejected by the same test."""

import json

import jax
import jax.numpy as jnp
import jsonschema
import numpy as np
import pytest

import pdecode
from pdecode import grammar
from pdecode.decode import speculative
from pdecode.errors import InputError
from tests.test_controls import N, PROMPT, _min_pvalue
from tests.test_engine import COUNTER
from tests.test_speculative import small_vocab  # noqa: F401 (fixture)

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 10},
                                           "n": {"type": "integer"}, "ok": {"type": "boolean"}},
          "required": ["name", "n", "ok"]}


@pytest.fixture(scope="module")
def zoo():
    return pdecode.load("code-target"), pdecode.load("code-draft")


def test_tables_follow_the_automaton(zoo):
    """Every state's allowed tokens and every transition of outlines-core's index, read back from the packed device
    tables (next to another grammar and the free state 0)."""
    import outlines_core as oc

    m = zoo[0]
    v, eos = m.cfg.vocab_size, pdecode.api.eos_ids(m)
    regex = r"(yes|no)|[0-9]{2,3}\.[0-9]"
    g = grammar.compile_regex(regex, m.tokenizer, v, eos)
    other = grammar.compile_regex(r"[a-c]+", m.tokenizer, v, eos)
    tables, (s_other, s_g) = grammar.pack([other, g], v)
    index = oc.Index(regex, oc.Vocabulary(eos[0], grammar.vocabulary_map(grammar.token_bytes(m.tokenizer, v), eos)))
    trans = index.get_transitions()
    finals = set(index.get_final_states())
    # number the index's states by walking from the start through the packed tables
    num = {index.get_initial_state(): s_g}
    frontier = [index.get_initial_state()]
    checked = 0
    while frontier:
        s = frontier.pop()
        edges = {t: n for t, n in trans.get(s, {}).items() if t not in eos}
        allowed = np.asarray(grammar.allowed(tables, jnp.asarray([num[s]]), v))[0]
        want = set(edges) | (set(eos) if s in finals or not edges else set())
        assert set(np.flatnonzero(allowed).tolist()) == want
        ts = np.asarray(sorted(edges), np.int32)
        if len(ts):
            got = np.asarray(grammar.advance(tables, jnp.full(ts.shape, num[s]), jnp.asarray(ts)))
            for t, n in zip(ts.tolist(), got.tolist()):
                if edges[t] in num:
                    assert num[edges[t]] == n
                else:
                    num[edges[t]] = n
                    frontier.append(edges[t])
                checked += 1
        forced = int(tables.forced[num[s]])
        assert forced == (next(iter(want)) if len(want) == 1 else -1)
    assert checked > 20 and len(num) > 5
    # a token a state forbids, and the free state, lead to 0; the free state allows everything
    bad = int(np.flatnonzero(~np.asarray(grammar.allowed(tables, jnp.asarray([s_g]), v))[0])[0])
    assert int(grammar.advance(tables, jnp.asarray(s_g), jnp.asarray(bad))) == grammar.FREE
    assert int(grammar.advance(tables, jnp.asarray(0), jnp.asarray(5))) == grammar.FREE
    assert np.asarray(grammar.allowed(tables, jnp.asarray([0]), v)).all()
    assert s_other == 1


PROMPTS = ["def f(x):\n    return", "# one record\nrecord = ", "import os\nimport sys\n\n\ndef main():\n"]
GREEDY = [("ar", {}), ("sd", dict(gamma=4)), ("lookup", {})]


def test_greedy_constrained_speculation_equals_ar_and_validates(zoo):
    """A JSON schema, a choice and an unconstrained row in one batch (one grammar per row): sd (its draft model's
    tokens, forced tokens written in) and lookup give constrained AR's tokens exactly; every constrained row parses
    and validates, the choice row is one of the choices, the unconstrained row is plain AR's."""
    target, draft = zoo
    rows = [{"json_schema": SCHEMA}, {"choice": ["alpha", "beta", "gamma delta"]}, None]
    outs = {}
    for method, opts in GREEDY:
        outs[method] = pdecode.generate(target, PROMPTS, method=method, draft=draft if method == "sd" else None,
                                        max_new_tokens=48, grammar=rows, **opts)
    # an EAGLE-2 dynamic tree: each node's state walked along parents chosen on the device
    outs["eagle"] = pdecode.generate(pdecode.load("code-target-eagle"), PROMPTS, method="eagle", max_new_tokens=48,
                                     grammar=rows)
    ref = outs["ar"]
    for method, o in outs.items():
        assert o.tokens == ref.tokens, method
    assert ref.finish_reasons[:2] == ["stop", "stop"]
    jsonschema.validate(json.loads(ref.texts[0]), SCHEMA)
    assert ref.texts[1] in ("alpha", "beta", "gamma delta")
    plain = pdecode.generate(target, PROMPTS[2:], max_new_tokens=48)
    assert ref.tokens[2] == plain.tokens[0]
    # sampled: every row still parses and validates
    s = pdecode.generate(target, PROMPTS * 2, method="sd", draft=draft, gamma=4, max_new_tokens=64, temperature=1.0,
                         seed=4, json_schema=SCHEMA)
    for text, why in zip(s.texts, s.finish_reasons):
        if why == "stop":
            jsonschema.validate(json.loads(text), SCHEMA)
    assert s.finish_reasons.count("stop") >= 4


# a grammar over small_vocab's 16 tokens whose allowed set depends on the previous token (so a drafted node's state
# depends on its path), with one forced state (after 5 only 6 may come: deterministic drafts get it written in)
def _toy_trans():
    trans = {"start": {t: t for t in range(1, 16)}}
    for k in range(1, 16):
        trans[k] = {6: 6} if k == 5 else {t: t for t in range(1, 16) if t != k and (t + k) % 3 != 0}
    return trans


def _constrained_marginals(m, prompt, n_tok):
    trans = _toy_trans()
    v = m.cfg.vocab_size
    prefixes, states, probs = [[]], ["start"], np.array([1.0])
    margs = []
    for _ in range(n_tok):
        lg = np.asarray(pdecode.forward_logits(m, [prompt + pre for pre in prefixes]))[:, -1].astype(np.float64)
        ok = np.zeros_like(lg, bool)
        for i, s in enumerate(states):
            ok[i, list(trans[s])] = True
        lg = np.where(ok, lg, -np.inf)
        cond = np.exp(lg - lg.max(-1, keepdims=True))
        cond /= cond.sum(-1, keepdims=True)
        joint = probs[:, None] * cond
        margs.append(joint.sum(0))
        keep = [(i, t) for i in range(len(prefixes)) for t in range(v) if joint[i, t] > 0]
        prefixes = [prefixes[i] + [t] for i, t in keep]
        states = [trans[states[i]][t] for i, t in keep]
        probs = np.asarray([joint[i, t] for i, t in keep])
    return margs


SAMPLED = [("sd", dict(gamma=3)), ("tree", dict(tree=[[0], [1], [0, 0], [0, 1], [0, 0, 0]])), ("lookup", dict(gamma=3))]


@pytest.mark.parametrize("method,opts", SAMPLED, ids=[c[0] for c in SAMPLED])
def test_constrained_sampling_is_lossless(small_vocab, method, opts):  # noqa: F811
    """The first three tokens' marginals over 12,000 rows equal exact AR sampling from the constrained distribution
    (a draft model's chain, a sampled multi-child tree, n-gram drafts with the forced state)."""
    target, draft = small_vocab
    g = grammar.from_transitions(_toy_trans(), "start", (), target.cfg.vocab_size, ())
    out = pdecode.generate(target, [PROMPT] * N, method=method, draft=draft if method != "lookup" else None,
                           max_new_tokens=3, temperature=1.0, seed=7, grammar=g, stop_at_eos=False, **opts)
    toks = np.array(out.tokens)
    assert _min_pvalue(toks, _constrained_marginals(target, PROMPT, 3)) > 1e-4
    assert all(b == 6 for a, b in zip(toks[:, 0], toks[:, 1]) if a == 5)


def test_a_grammar_blind_to_the_drafted_path_fails_the_test(small_vocab, monkeypatch):  # noqa: F811
    """The wrong rule: every drafted node masked by the committed state (not the state after the drafted tokens
    above it). The same test rejects it."""
    target, draft = small_vocab
    g = grammar.from_transitions(_toy_trans(), "start", (), target.cfg.vocab_size, ())
    real = grammar.node_states

    def committed_only(t, state_B, tokens_BN, parents_BN, max_depth, force=False):
        tokens, _ = real(t, state_B, tokens_BN, parents_BN, max_depth, force)
        return tokens, jnp.broadcast_to(state_B[:, None], tokens.shape)

    monkeypatch.setattr(speculative.grammar, "node_states", committed_only)
    pdecode.clear_compile_cache()
    try:
        out = pdecode.generate(target, [PROMPT] * N, method="sd", draft=draft, gamma=3, max_new_tokens=3,
                               temperature=1.0, seed=7, grammar=g, stop_at_eos=False)
    finally:
        pdecode.clear_compile_cache()
    assert _min_pvalue(np.array(out.tokens), _constrained_marginals(target, PROMPT, 3)) < 1e-6


def test_bad_grammars(zoo):
    m = zoo[0]
    cases = [
        (dict(grammar="[a-z", method="ar"), "cannot compile"),
        (dict(json_schema="{not json", method="ar"), "not valid JSON"),
        (dict(grammar={"json_schema": SCHEMA, "regex": "a"}, method="ar"), "one key"),
        (dict(grammar="a+", json_schema=SCHEMA, method="ar"), "not both"),
        (dict(grammar="a+", min_tokens=2, method="ar"), "min_tokens"),
        (dict(grammar=["a+"] * 2, method="ar"), "one per prompt"),
        # schemas that break the JSON Schema spec: named where, before anything compiles
        (dict(json_schema={"type": "objekt"}, method="ar"), "spec at type: 'objekt' is not one of"),
        (dict(json_schema={"type": "object", "required": "name"}, method="ar"), "at required: 'name' is not of type"),
        (dict(json_schema={"type": "object", "properties": {"a": {"type": "integer", "minimum": "ten"}}},
              method="ar"), r"at properties\.a\.minimum: 'ten' is not of type 'number'"),
        (dict(grammar={"json_schema": '{"type": "strin"}'}, method="ar"), "spec at type"),
    ]
    for kw, msg in cases:
        with pytest.raises(InputError, match=msg):
            pdecode.generate(m, PROMPTS, max_new_tokens=8, **kw)
    with pytest.raises(InputError, match="does not take a grammar"):  # the canvas methods refuse it
        pdecode.generate(pdecode.load("code-dllm"), PROMPTS, method="diffusion", max_new_tokens=8, grammar="a+")


def test_pool_places_evicts_and_waits():
    """The serving tables: grammars placed in free ranges, kept while used, the least recently used idle one evicted
    for a newcomer, None (wait) when those in use leave no room; a placed grammar reads back as `pack` writes it."""
    v = 64
    trans = lambda k: {s: {t: (s + 1) % k for t in range(s, s + 3)} for s in range(k)}  # noqa: E731
    a, b, c = (grammar.from_transitions(trans(k), 0, {k - 1}, v, (63,)) for k in (5, 6, 4))
    pool = grammar.Pool(v, states=1 + 11, transitions=64)
    sa = pool.acquire(a)
    sb = pool.acquire(b)
    assert (sa, sb) == (1, 6) and pool.acquire(c) is None  # a and b in use: no room for c
    pool.release(a)
    assert pool.acquire(c) == 1 and id(a) not in pool.placed  # a evicted, c in its states
    assert pool.acquire(c) == 1 and pool.placed[id(c)][3] == 2  # a second user
    packed, (pc,) = grammar.pack([c], v)
    tables = pool.tables()
    for s in range(c.num_states):
        np.testing.assert_array_equal(tables.allow[pool.placed[id(c)][1] + s], np.asarray(packed.allow[pc + s]))
        for t in range(v):
            if (int(tables.allow[1 + s, t // 32]) >> (t % 32)) & 1:
                got = int(grammar.advance(jax.tree.map(jnp.asarray, tables), jnp.asarray(1 + s), jnp.asarray(t)))
                want = int(grammar.advance(packed, jnp.asarray(pc + s), jnp.asarray(t)))
                assert got - 1 == want - pc
    assert not pool.fits_ever(grammar.from_transitions(trans(12), 0, {11}, v, (63,)))


def test_engine_serves_grammars_without_compiling(zoo):
    """The serving engine: two schemas and a free row through 2 slots whose tables hold one grammar at a time (the
    second waits for the first to finish); each request's tokens = `pdecode.generate` with its grammar; nothing
    compiles after warm-up."""
    from pdecode.engine import Engine

    target, draft = zoo
    g1 = grammar.compile_spec({"json_schema": SCHEMA}, target.tokenizer, target.cfg.vocab_size,
                              pdecode.api.eos_ids(target))
    g2 = grammar.compile_spec({"choice": ["north", "south", "east by west"]}, target.tokenizer,
                              target.cfg.vocab_size, pdecode.api.eos_ids(target))
    eng = Engine(target, method="sd", draft=draft, gamma=3, slots=2, max_len=128, chunk=32,
                 grammar_states=1 + max(g1.num_states, g2.num_states),
                 grammar_transitions=max(g1.num_transitions, g2.num_transitions))
    eng.warmup()
    ids = [target.tokenizer.encode(p) for p in PROMPTS]
    specs = [{"json_schema": SCHEMA}, {"choice": ["north", "south", "east by west"]}, None]
    checked = [eng.check(p, max_tokens=40, temperature=0, grammar=g) for p, g in zip(ids, specs)]
    COUNTER.n, COUNTER.on = 0, True
    try:
        reqs = [eng.submit(p, c) for p, c in zip(ids, checked)]
        while not eng.idle:
            eng.run_once()
    finally:
        COUNTER.on = False
    assert COUNTER.n == 0  # no XLA compile of any kind (the tables' upload included)
    want = pdecode.generate(target, PROMPTS, method="sd", draft=draft, gamma=3, max_new_tokens=40, grammar=specs)
    assert [r.tokens for r in reqs] == want.tokens
    assert eng.compiles == eng.warm_compiles and eng.stats["grammar_waits"] >= 1
    # each grammar's tables went up in windows (its ranges alone), and the device holds the host's tables
    assert eng.stats["grammar_uploads"] == 2 and eng.stats["grammar_windows"] >= 2
    for name in ("allow", "base", "nexts", "forced"):
        np.testing.assert_array_equal(np.asarray(getattr(eng.state.grammar, name)), getattr(eng.pool, name))
    with pytest.raises(InputError, match="tables hold"):
        Engine(target, slots=1, max_len=128, chunk=32, grammar_states=4).compile_grammar({"json_schema": SCHEMA})


def test_a_placed_grammar_goes_up_in_windows_that_cover_it():
    """`Pool.windows`: fixed-size windows of states and transitions, within the tables, that cover every range a
    placed grammar wrote (a window at the end shifted back to fit)."""
    pool = grammar.Pool(64, 100, 1000)
    dirty = [(1, 70, 0, 500), (90, 5, 990, 10)]
    wins = pool.windows(dirty, 32, 256)
    assert wins == [(1, 0), (33, 256), (65, 256), (68, 744)]
    for s0, n, t0, m in dirty:
        assert all(any(a <= s < a + 32 for a, _ in wins) for s in range(s0, s0 + n))
        assert all(any(b <= t < b + 256 for _, b in wins) for t in range(t0, t0 + m))
    assert all(0 <= a <= 100 - 32 and 0 <= b <= 1000 - 256 for a, b in wins)
