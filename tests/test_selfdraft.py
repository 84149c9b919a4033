"""Self-drafting without extra weights: Jacobi and lookahead decoding. Greedy identical to AR, lossless sampling
against exact AR marginals (and a wrong rule the same test rejects), the lookahead window mask, n-gram pool and
candidate trie against brute-force references."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats as sstats

import pdecode
from pdecode import sampling
from pdecode.decode import lookahead as la
from pdecode.decode.speculative import Context
from pdecode.decode.verify import Rule
from tests.test_speculative import PROMPTS, _exact_marginals, models, small_vocab  # noqa: F401 (fixtures)

METHODS = [("jacobi", dict(block=4)), ("jacobi", dict(block=1)), ("lookahead", dict()),
           ("lookahead", dict(window=3, ngram=3, guesses=2)), ("lookahead", dict(window=4, ngram=4, seed_prompt=False))]


@pytest.mark.parametrize("method,opts", METHODS, ids=[f"{m}-{i}" for i, (m, _) in enumerate(METHODS)])
def test_greedy_identical_to_ar(models, method, opts):  # noqa: F811
    t = models["target"]
    ref = pdecode.generate(t, PROMPTS, max_new_tokens=40, stop_at_eos=False)
    out = pdecode.generate(t, PROMPTS, method=method, max_new_tokens=40, stop_at_eos=False, **opts)
    assert out.tokens == ref.tokens
    assert out.stats["target_forwards"] <= 40 and out.stats["draft_forwards"] == 0


def test_lookahead_accepts_on_repetitive_code():
    """On the zoo's code model the pool's candidates really get accepted (far fewer forwards than tokens)."""
    m = pdecode.load("code-target", dtype="float32")
    prompt = "def f(x):\n    return x + 1\n\n\ndef g(x):\n    return x + 2\n\n\ndef h(x):\n"
    ref = pdecode.generate(m, [prompt], max_new_tokens=48, stop_at_eos=False)
    out = pdecode.generate(m, [prompt], method="lookahead", max_new_tokens=48, stop_at_eos=False)
    assert out.tokens == ref.tokens and out.stats["tokens_per_forward"] > 1.5


# ------------------------------------------------------------------------------------------------ sampling
LA_SMALL = dict(window=3, ngram=3, guesses=3)
PROMPT = [3, 7, 3, 7, 3]
N_SAMPLES = 12000


def _pvalues(target, toks, n_tok):
    """Chi-square p-values of each of the first n_tok sampled tokens against the exact AR marginals."""
    margs = _exact_marginals(target, PROMPT, n_tok)
    return [sstats.chisquare(np.bincount(toks[:, i], minlength=16), margs[i] / margs[i].sum() * len(toks)).pvalue
            for i in range(n_tok)]


SAMPLED = [("jacobi", dict(block=3)), ("lookahead", LA_SMALL), ("layerskip", dict(exit_layer=1, threshold=0.0)),
           ("layerskip", dict(exit_layer=1, threshold=0.1)), ("pearl", dict(gamma=2)),
           ("pearl", dict(gamma=2, placement="split"))]


@pytest.mark.parametrize("method,opts", SAMPLED, ids=["jacobi", "lookahead", "layerskip", "layerskip-thr", "pearl",
                                                      "pearl-split"])
def test_sampling_matches_ar_distribution(small_vocab, method, opts):  # noqa: F811
    target, draft = small_vocab
    n_tok = 4 if method == "pearl" else 3  # pearl: past its first window
    out = pdecode.generate(target, [PROMPT] * N_SAMPLES, method=method, draft=draft if method == "pearl" else None,
                           max_new_tokens=n_tok, temperature=1.0, seed=2, stop_at_eos=False, **opts)
    assert min(_pvalues(target, np.array(out.tokens), n_tok)) > 1e-4
    assert out.stats["tokens_per_forward"] > 1.0


@dataclasses.dataclass(frozen=True)
class _OverAccepting:
    """Wraps a deterministic drafter but verifies it as if its candidates were drawn from a uniform q: accepting
    x with min(1, p(x) / q(x)) over-accepts every candidate (a wrong rule); ``rule``: the verifier rule it claims."""

    inner: object
    rule: Rule = Rule.TREE_MULTI

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def init(self, *a, **k):
        return self.inner.init(*a, **k)

    def update(self, *a):
        return self.inner.update(*a)

    def propose(self, dparams, st, ctx, key, samp, warp):
        prop, st = self.inner.propose(dparams, st, ctx, key, samp, warp)
        b, n = prop.tokens.shape
        return prop._replace(rule=self.rule, q=jnp.full((b, n, 16), 1.0 / 16)), st


def wrong_rule_pvalue(target, drafter, dparams) -> float:
    """The smallest p-value of the first 3 tokens sampled by `speculative.generate` with ``drafter`` (a drafter
    verified by a wrong rule) against the target's exact AR marginals, N_SAMPLES rows of PROMPT."""
    from pdecode.api import compiled
    from pdecode.decode import speculative

    prompt_a = jnp.asarray([PROMPT + [0] * 27] * N_SAMPLES, jnp.int32)
    plen = jnp.full((N_SAMPLES,), len(PROMPT), jnp.int32)
    args = ((target.params, dparams), prompt_a, plen, jax.random.PRNGKey(2), sampling.Warp.of(1.0))
    exe, _ = compiled(speculative.generate, dict(cfg=target.cfg, drafter=drafter, max_new=3, max_len=64, eos_ids=(),
                                                 samp=sampling.Sampling(greedy=False), mesh=None), *args)
    return min(_pvalues(target, np.asarray(exe(*args)[0].tokens), 3))


@pytest.mark.parametrize("kind", ["lookahead", "layerskip", "pearl"])
def test_a_wrong_rule_fails_the_distribution_test(small_vocab, kind):  # noqa: F811
    """The same test rejects each drafter verified by a wrong rule: lookahead's deterministic candidates as if
    sampled from a uniform q, layer skip's and PEARL's sampled drafts against a uniform q instead of their own."""
    from pdecode.decode.layerskip import LayerSkipDrafter
    from pdecode.decode.pearl import PearlDrafter
    from tests.test_speculative import _LyingChain

    target, draft = small_vocab
    drafter, dparams = {
        "lookahead": (_OverAccepting(la.LookaheadDrafter(**LA_SMALL, vocab_size=16)), None),
        "layerskip": (_LyingChain(LayerSkipDrafter(target.cfg, (0,), gamma=3, threshold=0.0)), None),
        "pearl": (_LyingChain(PearlDrafter(draft.cfg, gamma=2)), draft.params)}[kind]
    assert wrong_rule_pvalue(target, drafter, dparams) < 1e-6


EOS_CASES = [("jacobi", dict(block=4), None), ("lookahead", dict(window=3, ngram=3, guesses=2), None),
             ("layerskip", dict(exit_layer=1), None), ("pearl", dict(gamma=3), "small")]


@pytest.mark.parametrize("method,opts,draft", EOS_CASES, ids=[c[0] for c in EOS_CASES])
def test_greedy_with_eos_rows_stop_independently(models, method, opts, draft):  # noqa: F811
    t = models["target"]
    free = pdecode.generate(t, PROMPTS[:4], max_new_tokens=20, stop_at_eos=False).tokens
    eos = free[1][5]
    te = pdecode.Model(cfg=t.cfg.replace(eos_token_ids=(eos,)), params=t.params)
    ar = pdecode.generate(te, PROMPTS[:4], max_new_tokens=20)
    out = pdecode.generate(te, PROMPTS[:4], method=method, draft=models[draft], max_new_tokens=20, **opts)
    assert out.tokens == ar.tokens and out.tokens[1][-1] == eos


# ------------------------------------------------------------------------------------------------ pieces
@pytest.mark.parametrize("n,w", [(2, 1), (3, 4), (5, 7)])
def test_window_layout_gives_every_node_a_contiguous_context(n, w):
    pos, intra = la.window_layout(n, w)
    for l in range(n - 1):
        for c in range(w):
            i = l * w + c
            seen = sorted(pos[j] for j in np.flatnonzero(intra[i]))
            assert pos[i] == l + c + 1 and seen == list(range(1, pos[i] + 1))  # the root (0) is added by propose
            # its own column's lower levels, and level 0's earlier columns: nothing else
            want = {l2 * w + c for l2 in range(l + 1)} | set(range(c))
            assert set(np.flatnonzero(intra[i]).tolist()) == want


def _reference_pool(inserts, g):
    """Per key: an LRU list of (continuation, age) with capacity g (a brute-force reference of `insert`)."""
    pool = {}
    for key, cont, age in inserts:
        slots = pool.setdefault(key, [])
        hit = [s for s in slots if s[0] == cont]
        if hit:
            slots[slots.index(hit[0])] = (cont, age)
        elif len(slots) < g:
            slots.append((cont, age))
        else:
            slots[min(range(g), key=lambda j: slots[j][1])] = (cont, age)
    return pool


def test_pool_insert_is_an_lru_per_key():
    rng = np.random.default_rng(0)
    b, v, g, m = 3, 6, 3, 2
    pool = jnp.full((b, v, g, m + 1), -1, jnp.int32)
    age = jnp.full((b, v, g), la.EMPTY, jnp.int32)
    log = [[] for _ in range(b)]
    for t in range(200):
        key = rng.integers(0, 3, b)
        cont = rng.integers(0, 2, (b, m))  # few distinct n-grams: many refreshes and evictions
        ok = rng.random(b) < 0.8
        pool, age = la.insert(pool, age, jnp.asarray(key), jnp.asarray(cont), jnp.asarray(ok), t)
        for r in range(b):
            if ok[r]:
                log[r].append((int(key[r]), tuple(cont[r].tolist()), t))
    pool, age = np.asarray(pool), np.asarray(age)
    for r in range(b):
        ref = _reference_pool(log[r], g)
        for key in range(v):
            got = {(tuple(pool[r, key, j, 1:].tolist()), int(age[r, key, j])) for j in range(g)
                   if age[r, key, j] > la.EMPTY}
            assert got == set(ref.get(key, [])), (r, key)
            assert all(pool[r, key, j, 0] == key for j in range(g) if age[r, key, j] > la.EMPTY)


def test_candidates_merge_into_a_trie():
    """Verification nodes: one per distinct candidate prefix, each with its parent prefix's node as parent, seen
    by exactly its ancestors; the window does not see them and they do not see the window."""
    d = la.LookaheadDrafter(window=2, ngram=4, guesses=4, vocab_size=10)
    m, g = 3, 4
    cands = [(1, 2, 3), (1, 2, 4), (5, 6, 7)]  # the first two share a two-token prefix
    pool = np.full((1, 10, g, m + 1), -1, np.int32)
    age = np.full((1, 10, g), la.EMPTY, np.int32)
    for j, c in enumerate(cands):
        pool[0, 9, j] = (9,) + c
        age[0, 9, j] = 10 - j  # most recent first: the order above
    st = la.LookaheadState(levels=jnp.zeros((1, m, 2), jnp.int32), filled=jnp.int32(3), pool=jnp.asarray(pool),
                           age=jnp.asarray(age), clock=jnp.int32(10))
    seq = jnp.asarray([[9] + [0] * 15], jnp.int32)
    ctx = Context(seq, jnp.asarray([1]), None, None, jnp.ones((1,), bool))
    prop, _ = d.propose(None, st, ctx, jax.random.PRNGKey(0), sampling.Sampling(), sampling.Warp.of(1.0))
    tok, par, val = (np.asarray(x[0]) for x in (prop.tokens, prop.parents, prop.valid))
    vis, intra = np.asarray(prop.visible[0]), np.asarray(prop.intra[0])
    n_ver = 1 + g * m

    def path(i):
        out = []
        while i > 0:
            out.append(int(tok[i]))
            i = int(par[i])
        return tuple(reversed(out))

    valid_paths = sorted(path(i) for i in range(1, n_ver) if val[i])
    want = sorted({c[:k] for c in cands for k in range(1, m + 1)})
    assert valid_paths == want  # every distinct prefix once
    assert not val[n_ver:].any() and vis[n_ver:].all() and (vis[:n_ver] == val[:n_ver]).all()
    for i in range(1, n_ver):
        if val[i]:
            anc = {0}
            j = i
            while j > 0:
                anc.add(j)
                j = int(par[j])
            assert set(np.flatnonzero(intra[i]).tolist()) == anc
    assert not intra[n_ver:, 1:n_ver].any() and not intra[1:n_ver, n_ver:].any() and intra[:, 0].all()
    pos = np.asarray(prop.positions)
    assert all(pos[i] == len(path(i)) for i in range(1, n_ver) if val[i])


def test_bad_options(models):  # noqa: F811
    t = models["target"]
    with pytest.raises(pdecode.PdecodeError, match="ngram must be >= 2"):
        pdecode.generate(t, PROMPTS[:1], method="lookahead", ngram=1)
    with pytest.raises(pdecode.PdecodeError, match="block must be an integer >= 1"):
        pdecode.generate(t, PROMPTS[:1], method="jacobi", block=0)
    with pytest.raises(pdecode.PdecodeError, match="window must be an integer >= 1 or 'auto'"):
        pdecode.generate(t, PROMPTS[:1], method="lookahead", window="big")


# ------------------------------------------------------------------------------------------------ sizing by cost
def test_windows_sized_by_verify_cost(models, monkeypatch):  # noqa: F811
    """block / window "auto": the largest window whose verify costs <= 1/0.95 of one token; none: ar's loop (same
    tokens, one per forward), the stats saying why; explicit sizes are kept whatever the cost."""
    t = models["target"]
    ar = pdecode.generate(t, PROMPTS[:2], max_new_tokens=12)
    # the CPU of docs/results.md: a 2-token verify already costs 1.25x one token
    monkeypatch.setenv("PDECODE_VERIFY_COST", "2:1.25,3:1.32,5:1.32,9:1.64")
    for method in ("jacobi", "lookahead"):
        out = pdecode.generate(t, PROMPTS[:2], method=method, max_new_tokens=12)
        assert out.stats["window"] == 0 and "ran as ar" in out.stats["window_note"]
        assert out.stats["tokens_per_forward"] == 1.0 and out.tokens == ar.tokens
    out = pdecode.generate(t, PROMPTS[:2], method="jacobi", block=4, max_new_tokens=12)
    assert out.stats["window"] == 4 and out.tokens == ar.tokens
    # verifies up to 5 tokens cost about one (an accelerator at batch 1): block 4 (5 tokens), lookahead W = G = 2
    # (1 + 2 (5 - 1) + ... = 17 tokens would cost 1.3: too much; with ngram 3, 1 + 2 * 2 + 2 * 2 = 9 > 5 too)
    monkeypatch.setenv("PDECODE_VERIFY_COST", "2:1.0,5:1.04,6:1.2")
    out = pdecode.generate(t, PROMPTS[:2], method="jacobi", max_new_tokens=12)
    assert out.stats["window"] == 4 and out.tokens == ar.tokens
    out = pdecode.generate(t, PROMPTS[:2], method="lookahead", ngram=2, max_new_tokens=12)
    assert out.stats["window"] == {"window": 2, "guesses": 2} and out.tokens == ar.tokens  # 1 + 2 + 2 tokens


def test_verify_cost_measured_and_kept(models, monkeypatch, tmp_path):  # noqa: F811
    """Without the override the ratio is timed on the device once, then read back (memory, then the file next to
    JAX's compilation cache)."""
    from pdecode.decode import cost

    monkeypatch.delenv("PDECODE_VERIFY_COST")
    monkeypatch.setattr(cost, "_MEMO", {})
    monkeypatch.setattr(cost, "_cache_dir", lambda: str(tmp_path))
    t = models["target"]
    r = cost.verify_cost(t, 2, 9, context=64)
    assert 0.3 < r < 30  # a timing: a longer forward, not a constant
    calls = []
    assert cost.verify_cost(t, 2, 9, context=64, measure_fn=lambda *a: calls.append(a) or 99.0) == r
    monkeypatch.setattr(cost, "_MEMO", {})  # a later process: the file
    assert cost.verify_cost(t, 2, 9, context=64, measure_fn=lambda *a: calls.append(a) or 99.0) == r
    assert not calls and list((tmp_path / "pdecode-costs").glob("verify-*.json"))
    assert cost.verify_cost(t, 3, 9, context=64, measure_fn=lambda *a: calls.append(a) or 2.5) == 2.5  # other batch
    assert len(calls) == 1
    # a method's whole step against ar's (what block / window "auto" use): timed, then kept
    r = cost.step_cost(t, 2, "jacobi", {"block": 1}, 2, context=64)
    assert 0.3 < r < 30
    monkeypatch.setattr(cost, "measure_steps", lambda *a, **k: calls.append(a) or 99.0)
    monkeypatch.setattr(cost, "_MEMO", {})
    assert cost.step_cost(t, 2, "jacobi", {"block": 1}, 2, context=64) == r and len(calls) == 1


# ------------------------------------------------------------------------------------------------ layer skip
LS = [dict(exit_layer=1, threshold=0.0), dict(exit_layer=2, gamma=3), dict(exit_layer=3, skip=[1], threshold=0.0),
      dict(exit_layer=2, threshold=0.3, adaptive=False)]


@pytest.mark.parametrize("opts", LS, ids=[f"ls-{i}" for i in range(len(LS))])
def test_layerskip_greedy_identical_to_ar(models, opts):  # noqa: F811
    t = models["target"]
    ref = pdecode.generate(t, PROMPTS, max_new_tokens=40, stop_at_eos=False)
    out = pdecode.generate(t, PROMPTS, method="layerskip", max_new_tokens=40, stop_at_eos=False, **opts)
    assert out.tokens == ref.tokens
    assert out.stats["target_forwards"] <= 40 and out.stats["draft_forwards"] > 0


@pytest.mark.parametrize("layers", [(0,), (0, 1), (0, 2)], ids=["exit1", "exit2", "skip1"])
def test_layerskip_reused_kv_equals_a_full_recompute(models, layers):  # noqa: F811
    """One draft + verify step by hand: the KV cache after the verify pass (the draft's blocks below r kept, the
    rest written by the verify) and the verify logits equal a plain forward over prompt + drafted tokens."""
    from pdecode.decode import common
    from pdecode.decode.layerskip import LayerSkipDrafter
    from pdecode.model import attention
    from pdecode.model import cache as kvc
    from pdecode.model.transformer import decode_layout, forward_layers, unembed, unrolled

    t = models["target"]
    cfg = t.cfg
    tp = decode_layout(t.params, cfg)
    prompt = PROMPTS[2][:20]
    p = len(prompt)
    cache = kvc.init_cache(cfg, 1, 64, jnp.float32, per_layer=unrolled(tp))
    cache, logits, _ = common.prefill(tp, cfg, jnp.asarray([prompt]), jnp.asarray([p]), cache)
    first = int(jnp.argmax(logits[0]))
    seq = jnp.zeros((1, 64), jnp.int32).at[0, :p].set(jnp.asarray(prompt)).at[0, p].set(first)
    d = LayerSkipDrafter(cfg, layers, gamma=4, threshold=0.0)
    ctx = Context(seq, jnp.asarray([p + 1]), None, None, jnp.ones((1,), bool), tp, cache=cache)
    prop, _ = d.propose(None, d.init(None, tp, jnp.asarray([prompt]), jnp.asarray([p]), None, 64), ctx, jax.random.PRNGKey(0),
                        sampling.Sampling(), sampling.Warp.of(1.0))
    assert prop.from_layer == d.reuse == (1 if layers == (0, 2) else len(layers))
    n = 5
    positions = cache.lengths[:, None] + jnp.arange(n)[None]
    mask = common.step_mask(cfg, cache, attention.causal_intra(n), positions, prop.valid)
    fo, _ = forward_layers(tp, cfg, positions, mask, prop.cache, cache.lengths,
                           tuple(range(prop.from_layer, cfg.num_layers)), x_in_BTD=prop.hidden_in)
    full = prompt + np.asarray(prop.tokens[0]).tolist()
    ref_cache = kvc.init_cache(cfg, 1, 64, jnp.float32, per_layer=unrolled(tp))
    ref_cache, _, ref_out = common.prefill(tp, cfg, jnp.asarray([full]), jnp.asarray([len(full)]), ref_cache)
    for i in range(cfg.num_layers):
        (k, v), (rk, rv) = fo.cache.layer(i), ref_cache.layer(i)
        np.testing.assert_allclose(np.asarray(k[..., p:p + n]), np.asarray(rk[..., p:p + n]), atol=2e-5, rtol=1e-5)
        np.testing.assert_allclose(np.asarray(v[:, :, p:p + n]), np.asarray(rv[:, :, p:p + n]), atol=2e-5, rtol=1e-5)
    np.testing.assert_allclose(np.asarray(unembed(tp, cfg, fo.hidden)),
                               np.asarray(unembed(tp, cfg, ref_out.hidden[:, p:p + n])), atol=1e-4, rtol=1e-4)


def test_layerskip_bad_options(models):  # noqa: F811
    t = models["target"]
    with pytest.raises(pdecode.PdecodeError, match="exit_layer must be an integer in 1..3"):
        pdecode.generate(t, PROMPTS[:1], method="layerskip", exit_layer=4)
    with pytest.raises(pdecode.PdecodeError, match="some but not all"):
        pdecode.generate(t, PROMPTS[:1], method="layerskip", exit_layer=3)
    with pytest.raises(pdecode.PdecodeError, match="skip must list"):
        pdecode.generate(t, PROMPTS[:1], method="layerskip", skip=[7])


def test_skip_search_picks_the_least_harmful_layer(models):  # noqa: F811
    from pdecode.decode import layerskip

    t = models["target"]
    texts = [p for p in PROMPTS if len(p) > 2]
    skip, hist = layerskip.search_skip(t, texts, 1)
    assert len(skip) == 1 and len(hist) == 1
    ids = [list(p) for p in texts]
    tt = max(map(len, ids))
    tok = jnp.asarray([x + [0] * (tt - len(x)) for x in ids], jnp.int32)
    lens = jnp.asarray([len(x) for x in ids], jnp.int32)

    def agree(layers):
        return layerskip.agreement(t, tok, lens, layers)

    assert agree((0, 1, 2)) == 1.0
    brute = {c: agree(tuple(i for i in range(3) if i != c)) for c in range(3)}
    assert hist[0] == max(brute.values()) and brute[skip[0]] == hist[0]
    two, hist2 = layerskip.search_skip(t, texts, 2)
    assert len(two) == 2 and hist2[0] == hist[0] and skip[0] in two
    out = pdecode.generate(t, PROMPTS, method="layerskip", exit_layer=3, skip=list(skip), max_new_tokens=16,
                           stop_at_eos=False)
    assert out.tokens == pdecode.generate(t, PROMPTS, max_new_tokens=16, stop_at_eos=False).tokens


# ------------------------------------------------------------------------------------------------ PEARL
@pytest.mark.parametrize("draft,opts", [("small", dict(gamma=3)), ("self", dict(gamma=4)), ("small", dict(gamma=1)),
                                        ("small", dict(gamma=3, placement="split"))],
                         ids=["small-3", "self-4", "small-1", "small-3-split"])
def test_pearl_greedy_identical_to_ar(models, draft, opts):  # noqa: F811
    t = models["target"]
    ref = pdecode.generate(t, PROMPTS, max_new_tokens=40, stop_at_eos=False)
    out = pdecode.generate(t, PROMPTS, method="pearl", draft=models[draft], max_new_tokens=40, stop_at_eos=False,
                           **opts)
    assert out.tokens == ref.tokens
    if draft == "self":  # the target drafting for itself: every window passes, post-verify all the way
        assert out.stats["tokens_per_forward"] > 3.0


def test_pearl_split_placement_equals_the_same_device_run(models):  # noqa: F811
    """Target on device 0, draft on device 1, the halves of each step at once: the same tokens and counts as the
    one-device run under sampling (the exchange between the devices loses nothing), batch 8, mixed lengths."""
    t, d = models["target"], models["small"]
    kw = dict(method="pearl", draft=d, max_new_tokens=24, temperature=1.0, seed=5, gamma=3)
    same = pdecode.generate(t, PROMPTS, **kw)
    split = pdecode.generate(t, PROMPTS, placement="split", **kw)
    assert split.tokens == same.tokens
    assert split.stats["target_forwards"] == same.stats["target_forwards"]
    assert split.stats["draft_forwards"] == same.stats["draft_forwards"]


def test_pearl_split_placement_errors(models, monkeypatch):  # noqa: F811
    from pdecode.errors import InputError
    from pdecode.sharding import make_mesh

    t, d = models["target"], models["small"]
    with pytest.raises(InputError, match="drop mesh="):
        pdecode.generate(t, PROMPTS[:2], method="pearl", draft=d, placement="split", mesh=make_mesh(data=2, model=1),
                         max_new_tokens=4)
    with pytest.raises(InputError, match="must be one of same, split"):
        pdecode.generate(t, PROMPTS[:2], method="pearl", draft=d, placement="other", max_new_tokens=4)
    monkeypatch.setattr(jax, "devices", lambda *a: [jax.local_devices()[0]])
    with pytest.raises(InputError, match="needs 2 devices"):
        pdecode.generate(t, PROMPTS[:2], method="pearl", draft=d, placement="split", max_new_tokens=4)
