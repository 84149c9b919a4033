"""Draft-and-verify: greedy identical to AR for every drafter, lossless sampling (statistical), verification
against brute force, drafter-specific behaviour, errors."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats as sstats

import pdecode
from pdecode import sampling
from pdecode.decode import tree as tree_lib
from pdecode.decode.lookup import find_matches
from pdecode.decode.verify import Rule, verify
from tests.helpers import make_hf_model

PROMPTS = [[5, 6, 7, 8, 9, 5, 6, 7], [11, 12, 13], list(range(20, 57)), [3, 4],
           [40, 41, 42, 43, 44, 40, 41, 42, 43, 44, 40], [60, 61], [70, 71, 72, 73, 74, 75], [80]]

METHODS = [
    ("sd", "self", dict(gamma=4)),
    ("sd", "small", dict(gamma=3)),
    ("sd", "small", dict(gamma=2, adaptive=True, gamma_max=6)),
    ("tree", "self", dict(tree="dynamic", tree_top_k=3, depth=4, total_tokens=12)),
    ("tree", "small", dict(tree="binary-14")),
    ("tree", "small", dict(tree=[[0], [1], [2], [0, 0], [0, 1], [1, 0], [0, 0, 0]])),
    ("lookup", None, dict(gamma=4)),
    ("lookup", None, dict(gamma=3, branches=3, ngram_max=2)),
]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """A tiny target, and a 1-layer draft trained on nothing (different random weights, same vocabulary)."""
    d1 = tmp_path_factory.mktemp("t")
    d2 = tmp_path_factory.mktemp("d")
    make_hf_model("llama", d1, seed=0)
    make_hf_model("llama", d2, seed=1, num_hidden_layers=1)
    t = pdecode.load(d1)
    return {"target": t, "self": t, "small": pdecode.load(d2), None: None}


@pytest.mark.parametrize("method,draft,opts", METHODS, ids=[f"{m}-{d}-{i}" for i, (m, d, _) in enumerate(METHODS)])
def test_greedy_identical_to_ar(models, method, draft, opts):
    t = models["target"]
    ref = pdecode.generate(t, PROMPTS, max_new_tokens=24, stop_at_eos=False)
    out = pdecode.generate(t, PROMPTS, method=method, draft=models[draft], max_new_tokens=24, stop_at_eos=False,
                           **opts)
    assert out.tokens == ref.tokens
    s = out.stats
    assert s["tokens_per_forward"] >= 1.0 and s["target_forwards"] <= 24
    if draft == "self" or method == "lookup":
        assert s["tokens_per_forward"] > 1.2  # drafts really get accepted
    if draft is not None:
        assert s["draft_forwards"] > 0
    assert len(s["acceptance_per_depth"]) == len(s["accepted_histogram"]) - 1


@pytest.mark.parametrize("method,draft,opts", [METHODS[0], METHODS[3], METHODS[7]], ids=["sd", "tree", "lookup"])
def test_greedy_with_eos_rows_stop_independently(models, method, draft, opts):
    t = models["target"]
    free = pdecode.generate(t, PROMPTS[:4], max_new_tokens=20, stop_at_eos=False).tokens
    eos = free[1][5]
    te = pdecode.Model(cfg=t.cfg.replace(eos_token_ids=(eos,)), params=t.params)
    ar = pdecode.generate(te, PROMPTS[:4], max_new_tokens=20)
    out = pdecode.generate(te, PROMPTS[:4], method=method, draft=models[draft], max_new_tokens=20, **opts)
    assert out.tokens == ar.tokens
    assert out.tokens[1][-1] == eos and len(out.tokens[1]) <= 6


@pytest.mark.parametrize("method,draft,opts", [METHODS[0], METHODS[3], METHODS[7]], ids=["sd", "tree", "lookup"])
def test_greedy_identical_to_ar_across_cache_phases(models, method, draft, opts):
    """The target cache grows between loop phases while rows accept different numbers of tokens per step: output
    equals AR over the full cache (one phase) and the engine run in one phase."""
    from pdecode.decode import common

    t = models["target"]
    ref = pdecode.generate(t, PROMPTS, max_new_tokens=90, stop_at_eos=False, cache_phases=1)
    one, four = (pdecode.generate(t, PROMPTS, method=method, draft=models[draft], max_new_tokens=90,
                                  stop_at_eos=False, cache_phases=ph, **opts) for ph in (1, 4))
    assert len(common.phase_lengths(64, four.stats["cache_len"], 4)) >= 3  # PROMPTS bucket to 64 tokens
    assert four.tokens == ref.tokens and one.tokens == ref.tokens
    assert four.stats["target_forwards"] == one.stats["target_forwards"]


@pytest.mark.parametrize("method,draft,opts", [METHODS[0], METHODS[3], METHODS[6]], ids=["sd", "tree", "lookup"])
def test_greedy_identical_to_ar_in_mixed_precision(models, method, draft, opts):
    """bfloat16 weights with float32 activations (the fast CPU setting): still token for token equal to AR."""
    from pdecode.model.transformer import cast_params

    def mixed(m):
        return None if m is None else pdecode.Model(cfg=m.cfg.with_run(activation_dtype="float32"),
                                                    params=cast_params(m.params, jnp.bfloat16))

    t = mixed(models["target"])
    ref = pdecode.generate(t, PROMPTS, max_new_tokens=24, stop_at_eos=False)
    out = pdecode.generate(t, PROMPTS, method=method, draft=t if draft == "self" else mixed(models[draft]),
                           max_new_tokens=24, stop_at_eos=False, **opts)
    assert out.tokens == ref.tokens
    assert out.stats["tokens_per_forward"] > 1.2


# ------------------------------------------------------------------------------------------------ verification
def _brute_greedy(logits, tokens, parents, valid):
    """Walk the tree sequentially: follow the first child whose token is the argmax."""
    node, path = 0, [0]
    while True:
        best = int(np.argmax(logits[node]))
        kids = [c for c in range(len(parents)) if parents[c] == node and valid[c]]
        nxt = next((c for c in kids if tokens[c] == best), None)
        if nxt is None:
            return path, best
        node = nxt
        path.append(nxt)


def test_greedy_verify_matches_brute_force():
    rng = np.random.default_rng(0)
    v, b = 5, 64
    tr = tree_lib.resolve("binary-14")
    n = tr.size
    logits = rng.normal(size=(b, n, v)).astype(np.float32)
    tokens = rng.integers(0, v, size=(b, n))
    # make acceptance likely: often copy the argmax of the parent
    for r in range(b):
        for c in range(1, n):
            if rng.random() < 0.6:
                tokens[r, c] = int(np.argmax(logits[r, tr.parents[c]]))
    valid = rng.random((b, n)) < 0.9
    valid[:, 0] = True
    ver = verify(jnp.asarray(logits), jnp.asarray(tokens, jnp.int32), tr.parents, jnp.asarray(valid), jax.random.PRNGKey(0),
                 sampling.Sampling(), sampling.Warp.of(0.0), rule=Rule.GREEDY, max_depth=tr.max_depth,
                 max_children=tr.max_children)
    for r in range(b):
        path, bonus = _brute_greedy(logits[r], tokens[r], tr.parents, valid[r])
        na = int(ver.n_accepted[r])
        assert np.asarray(ver.path[r, : na + 1]).tolist() == path
        assert int(ver.bonus[r]) == bonus
        assert np.asarray(ver.tokens[r, : na + 1]).tolist() == [int(tokens[r, c]) for c in path[1:]] + [bonus]


def _first_two(tokens, n_acc):
    tokens = np.asarray(tokens)
    n_acc = np.asarray(n_acc)
    return tokens[:, 0], np.where(n_acc >= 1, tokens[:, 1], -1)


def _sampled_children(rng, q_rows, k, replace=False):
    """Per row, k children drawn from q without replacement (the order they are tried in)."""
    out = np.zeros((len(q_rows), k), np.int64)
    for i, q in enumerate(q_rows):
        out[i] = rng.choice(len(q), size=k, replace=replace, p=q)
    return out


@pytest.mark.parametrize("mode", ["chain", "tree-sampled", "tree-deterministic"])
def test_sampled_verify_is_lossless(mode):
    """Output token 1 ~ p(root); token 2 given token 1 = child c ~ p(c): exactly the target's distributions."""
    rng = np.random.default_rng(1)
    v, n_rows = 6, 40000
    if mode == "chain":
        tr = tree_lib.chain(2)
    else:
        tr = tree_lib.from_choices([[0], [1], [2], [0, 0], [1, 0]])
    n = tr.size
    p_logits = rng.normal(size=(n, v)) * 1.5
    q_logits = rng.normal(size=(n, v)) * 1.5
    p = np.exp(p_logits) / np.exp(p_logits).sum(-1, keepdims=True)
    q = np.exp(q_logits) / np.exp(q_logits).sum(-1, keepdims=True)
    tokens = np.zeros((n_rows, n), np.int64)
    for parent in range(n):
        kids = [c for c in range(n) if tr.parents[c] == parent]
        if not kids:
            continue
        if mode == "tree-deterministic":
            tokens[:, kids] = np.argsort(-q[parent])[: len(kids)]
        else:
            tokens[:, kids] = _sampled_children(rng, [q[parent]] * n_rows, len(kids))
    draft_q = None if mode == "tree-deterministic" else jnp.asarray(np.broadcast_to(q, (n_rows, n, v)), jnp.float32)
    rule = {"chain": Rule.CHAIN_SAMPLING, "tree-sampled": Rule.TREE_MULTI,
            "tree-deterministic": Rule.TREE_DETERMINISTIC}[mode]
    logits = jnp.asarray(np.broadcast_to(p_logits, (n_rows, n, v)), jnp.float32)
    samp = sampling.Sampling(greedy=False)
    ver = verify(logits, jnp.asarray(tokens, jnp.int32), tr.parents, jnp.ones((n_rows, n), bool),
                 jax.random.PRNGKey(7), samp, sampling.Warp.of(1.0), rule=rule, max_depth=tr.max_depth,
                 max_children=tr.max_children, draft_q_BNV=draft_q)
    first, second = _first_two(ver.tokens, ver.n_accepted)
    counts = np.bincount(first, minlength=v)
    assert sstats.chisquare(counts, p[0] * n_rows).pvalue > 1e-3
    # second token, for rows whose first token was accepted from child c (token fixed per c in the deterministic
    # case; in sampled modes group by the accepted node)
    path1 = np.asarray(ver.path[:, 1])
    n_acc = np.asarray(ver.n_accepted)
    for c in range(1, n):
        if tr.parents[c] != 0:
            continue
        rows = (n_acc >= 1) & (path1 == c)
        if rows.sum() < 2000:
            continue
        cnt = np.bincount(second[rows], minlength=v)
        assert sstats.chisquare(cnt, p[c] * rows.sum()).pvalue > 1e-3


def test_wrong_acceptance_rule_is_detected():
    """Sampled children verified against the wrong q (uniform instead of the q they came from) are biased; the
    same test must catch it. (The q = 1 rule with one sampled child would be lossless, so it is no wrong rule.)"""
    rng = np.random.default_rng(2)
    v, n_rows = 6, 40000
    tr = tree_lib.chain(1)
    p_logits = rng.normal(size=(2, v)) * 1.5
    q_logits = rng.normal(size=(2, v)) * 1.5
    p = np.exp(p_logits) / np.exp(p_logits).sum(-1, keepdims=True)
    q = np.exp(q_logits) / np.exp(q_logits).sum(-1, keepdims=True)
    tokens = np.zeros((n_rows, 2), np.int64)
    tokens[:, 1] = rng.choice(v, size=n_rows, p=q[0])
    logits = jnp.asarray(np.broadcast_to(p_logits, (n_rows, 2, v)), jnp.float32)
    ver = verify(logits, jnp.asarray(tokens, jnp.int32), tr.parents, jnp.ones((n_rows, 2), bool),
                 jax.random.PRNGKey(3), sampling.Sampling(greedy=False), sampling.Warp.of(1.0),
                 rule=Rule.CHAIN_SAMPLING, max_depth=1, max_children=1, draft_q_BNV=jnp.full((n_rows, 2, v), 1.0 / v))
    counts = np.bincount(np.asarray(ver.tokens[:, 0]), minlength=v)
    assert sstats.chisquare(counts, p[0] * n_rows).pvalue < 1e-6


@pytest.mark.parametrize("rule,greedy,with_q,children,match", [
    (Rule.GREEDY, False, False, 1, "does not fit sampled"),
    (Rule.TREE_DETERMINISTIC, True, False, 2, "does not fit greedy"),
    (Rule.CHAIN_SAMPLING, False, False, 1, "needs the draft distribution"),
    (Rule.TREE_MULTI, False, False, 2, "needs the draft distribution"),
    (Rule.TREE_DETERMINISTIC, False, True, 2, "takes no draft distribution"),
    (Rule.CHAIN_SAMPLING, False, True, 2, "use 'tree_multi'"),
    (Rule.TYPICAL, False, False, 2, "needs its thresholds"),
    ("nope", False, False, 1, "not a valid Rule"),
])
def test_verify_rule_must_fit_the_proposal(rule, greedy, with_q, children, match):
    """The rule is explicit: one that does not fit the sampling mode or what the drafter supplied is an error
    at trace time, never a silent switch to another acceptance test."""
    v, n = 4, 3
    tr = tree_lib.from_choices([[0], [1]] if children == 2 else [[0, 0]])
    q = jnp.full((1, n, v), 1.0 / v) if with_q else None
    with pytest.raises(ValueError, match=match):
        verify(jnp.zeros((1, n, v)), jnp.zeros((1, n), jnp.int32), tr.parents, jnp.ones((1, n), bool),
               jax.random.PRNGKey(0), sampling.Sampling(greedy=greedy), sampling.Warp.of(1.0), rule=rule,
               max_depth=tr.max_depth, max_children=tr.max_children, draft_q_BNV=q)


def test_drafters_set_their_rule(models):
    """Each drafter names the rule its proposal is verified by: greedy under greedy sampling; else speculative
    sampling (with the q it drew from) for the draft chain and the q = 1 rule for lookup's deterministic drafts."""
    from pdecode.decode.draft_model import DraftChain
    from pdecode.decode.lookup import LookupDrafter
    from pdecode.decode.speculative import Context

    draft = models["small"]
    chain = DraftChain(draft.cfg, 2, 2)
    dp = chain.prepare(draft.params, None)
    prompt = jnp.asarray([[1, 2, 3, 1]], jnp.int32)
    state = chain.init(dp, None, prompt, jnp.asarray([4]), None, 16)
    seq = jnp.zeros((1, 16), jnp.int32).at[:, :5].set(jnp.asarray([1, 2, 3, 1, 2]))
    ctx = Context(seq, jnp.asarray([5]), None, None, jnp.ones((1,), bool))
    key = jax.random.PRNGKey(0)
    for samp, lookup_rule, chain_rule in ((sampling.Sampling(), Rule.GREEDY, Rule.GREEDY),
                                          (sampling.Sampling(greedy=False), Rule.TREE_DETERMINISTIC,
                                           Rule.CHAIN_SAMPLING)):
        lk = LookupDrafter(gamma=2)
        prop, _ = lk.propose(None, lk.init(None, None, ctx.seq, ctx.seq_len, None, 8), ctx, key, samp,
                             sampling.Warp.of(1.0))
        assert prop.rule is lookup_rule and prop.q is None
        prop, _ = chain.propose(dp, state, ctx, key, samp, sampling.Warp.of(1.0))
        assert prop.rule is chain_rule and (prop.q is None) == samp.greedy


# ------------------------------------------------------------------------------------------------ end to end
@pytest.fixture(scope="module")
def small_vocab(tmp_path_factory):
    """Target and draft with 16 tokens and decisive (but not one-hot) distributions, for statistics."""
    dt, dd = tmp_path_factory.mktemp("sv_t"), tmp_path_factory.mktemp("sv_d")
    kw = dict(vocab_size=16, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=2,
              num_key_value_heads=1, bos_token_id=None, eos_token_id=None, pad_token_id=0)
    make_hf_model("llama", dt, seed=10, **kw)
    make_hf_model("llama", dd, seed=11, **{**kw, "num_hidden_layers": 1})
    return pdecode.load(dt), pdecode.load(dd)


def _exact_marginals(m, prompt, n_tok):
    """Exact marginals of the first n_tok sampled tokens (T = 1) by enumerating prefixes."""
    v = m.cfg.vocab_size
    prefixes, probs = [[]], np.array([1.0])
    margs = []
    for _ in range(n_tok):
        lg = np.asarray(pdecode.forward_logits(m, [prompt + pre for pre in prefixes]))[:, -1].astype(np.float64)
        cond = np.exp(lg - lg.max(-1, keepdims=True))
        cond /= cond.sum(-1, keepdims=True)
        joint = probs[:, None] * cond
        margs.append(joint.sum(0))
        prefixes = [pre + [t] for pre in prefixes for t in range(v)]
        probs = joint.reshape(-1)
    return margs


@dataclasses.dataclass(frozen=True)
class _LyingChain:
    """Wraps a chain drafter but reports a uniform q instead of the distribution it sampled from (a drafter of
    deterministic top-k children, whose proposal has no q, is verified as if it had sampled them from it)."""

    inner: object

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def init(self, *a, **k):
        return self.inner.init(*a, **k)

    def update(self, *a):
        return self.inner.update(*a)

    def propose(self, *a):
        prop, st = self.inner.propose(*a)
        if prop.q is None:
            v = self.inner.cfg.vocab_size
            return prop._replace(q=jnp.full(prop.tokens.shape + (v,), 1.0 / v), rule=Rule.CHAIN_SAMPLING), st
        return prop._replace(q=jnp.full_like(prop.q, 1.0 / prop.q.shape[-1])), st


def liar_tokens(m, drafter, dparams, prompt, n: int, new: int = 3) -> np.ndarray:
    """[n, new] tokens of speculative sampling (temperature 1) with ``drafter`` wrapped in `_LyingChain`: a wrong
    rule the lossless tests must reject."""
    from pdecode.api import compiled
    from pdecode.decode import speculative

    prompt_a = jnp.asarray([prompt + [0] * 27] * n, jnp.int32)
    args = ((m.params, dparams), prompt_a, jnp.full((n,), len(prompt), jnp.int32), jax.random.PRNGKey(1),
            sampling.Warp.of(1.0))
    exe, _ = compiled(speculative.generate, dict(cfg=m.cfg, drafter=_LyingChain(drafter), max_new=new, max_len=64,
                                                 eos_ids=(), samp=sampling.Sampling(greedy=False), mesh=None), *args)
    return np.asarray(exe(*args)[0].tokens)


def marginal_pvalues(m, prompt, toks: np.ndarray) -> list[float]:
    """Chi-square p-values of each column of sampled ``toks`` [n, k] against the exact AR marginals."""
    n, k = toks.shape
    v = m.cfg.vocab_size
    margs = _exact_marginals(m, prompt, k)
    return [sstats.chisquare(np.bincount(toks[:, i], minlength=v), margs[i] / margs[i].sum() * n).pvalue
            for i in range(k)]


@pytest.mark.parametrize("method,opts,vocab", [("sd", dict(gamma=3), None), ("tree", dict(tree="binary-14"), None),
                                               ("tree", dict(tree="dynamic", tree_top_k=3, depth=3, total_tokens=8),
                                                None),
                                               ("lookup", dict(gamma=3), None),
                                               ("sd", dict(gamma=3), range(0, 16, 2))])
def test_sampling_matches_ar_distribution(small_vocab, method, opts, vocab):
    """The first sampled tokens follow AR's exact marginals (chi-square), also when the draft draws from a reduced
    vocabulary (half of it: q is zero outside)."""
    target, draft = small_vocab
    if vocab is not None:
        draft = _with_vocab(draft, vocab)
    prompt = [3, 7, 3, 7, 3]
    n = 12000
    out = pdecode.generate(target, [prompt] * n, method=method, draft=draft if method != "lookup" else None,
                           max_new_tokens=3, temperature=1.0, seed=1, stop_at_eos=False, **opts)
    toks = np.array(out.tokens)
    margs = _exact_marginals(target, prompt, 3)
    for i in range(3):
        counts = np.bincount(toks[:, i], minlength=16)
        assert sstats.chisquare(counts, margs[i] / margs[i].sum() * n).pvalue > 1e-4, f"token {i + 1}"
    assert out.stats["tokens_per_forward"] > 1.0


def test_lying_drafter_fails_the_distribution_test(small_vocab):
    """The same statistical test rejects a drafter whose acceptance ratios use the wrong q."""
    from pdecode.api import compiled
    from pdecode.decode import speculative
    from pdecode.decode.draft_model import DraftChain

    target, draft = small_vocab
    prompt = [3, 7, 3, 7, 3]
    n = 12000
    drafter = _LyingChain(DraftChain(draft.cfg, 3, 3))
    samp = sampling.Sampling(greedy=False)
    prompt_a = jnp.asarray([prompt + [0] * 27] * n, jnp.int32)
    plen = jnp.full((n,), len(prompt), jnp.int32)
    args = ((target.params, draft.params), prompt_a, plen, jax.random.PRNGKey(1), sampling.Warp.of(1.0))
    exe, _ = compiled(speculative.generate, dict(cfg=target.cfg, drafter=drafter, max_new=3, max_len=64, eos_ids=(),
                                                 samp=samp, mesh=None), *args)
    out, _ = exe(*args)
    toks = np.asarray(out.tokens)
    margs = _exact_marginals(target, prompt, 3)
    pvals = [sstats.chisquare(np.bincount(toks[:, i], minlength=16), margs[i] / margs[i].sum() * n).pvalue
             for i in range(3)]
    assert min(pvals) < 1e-6


# ------------------------------------------------------------------------------------------------ pieces
def test_lookup_ranks_matches_by_context_then_continuation():
    # the row ends in [1, 2, 3]: at 0 and at 4 three tokens of context precede a continuation (starts 3 and 7)
    seq = jnp.asarray([[1, 2, 3, 9, 1, 2, 3, 8, 5, 1, 2, 3, 0, 0]], jnp.int32)
    starts, found = find_matches(seq, jnp.asarray([12]), 3, 1, 3, gamma=4)
    # equal context and both have 4+ tokens after them: the latest first; then the 2-token context ending at 2
    assert starts[0, :2].tolist() == [7, 3] and found[0].tolist() == [True, True, False]
    # gamma 8: the occurrence at 0 has 12 tokens after it, the one at 4 only 5: more continuation wins
    starts, _ = find_matches(seq, jnp.asarray([12]), 3, 1, 2, gamma=8)
    assert starts[0].tolist() == [3, 7]
    # a longer context beats more continuation: the row ends in [7, 1, 2, 3]; all four precede 15 (5 tokens after
    # it), three precede 4 (16 after it)
    seq2 = jnp.asarray([[4, 1, 2, 3, 8, 9, 9, 9, 9, 9, 9, 7, 1, 2, 3, 5, 7, 1, 2, 3, 0]], jnp.int32)
    starts, _ = find_matches(seq2, jnp.asarray([20]), 4, 1, 1, gamma=8)
    assert starts[0].tolist() == [15]
    starts, _ = find_matches(seq2, jnp.asarray([20]), 3, 1, 1, gamma=8)  # contexts capped at 3: a tie, then room
    assert starts[0].tolist() == [4]
    # ngram_min: a one-token context is no match
    seq3 = jnp.asarray([[5, 6, 7, 8, 5, 0]], jnp.int32)
    _, found = find_matches(seq3, jnp.asarray([5]), 3, 1, 1, gamma=2)
    assert bool(found[0, 0])
    _, found = find_matches(seq3, jnp.asarray([5]), 3, 2, 1, gamma=2)
    assert not bool(found[0, 0])
    # a repeated token overlapping the row's end is a match
    seq4 = jnp.asarray([[4, 4, 4, 0]], jnp.int32)
    starts, found = find_matches(seq4, jnp.asarray([3]), 3, 1, 1, gamma=2)
    assert bool(found[0, 0]) and starts[0].tolist() == [2]  # context 2 at 2 (one token of it is the end itself)


def test_lookup_takes_plain_steps_where_drafting_does_not_pay(models, monkeypatch):
    """A step drafts when some live row's end matches and the rows' expected tokens (1 + the decayed mean accepted
    from matches of that context length) reach the verify's cost; otherwise it is a plain step (one token's
    forward, nothing drafted). The acceptance histogram (drafted steps) then counts fewer steps than the loop ran;
    the output is AR's either way."""
    from pdecode.decode.lookup import LookupDrafter
    from pdecode.decode.speculative import Context

    d = LookupDrafter()
    seq = jnp.asarray([[5, 6, 7, 8, 0], [5, 6, 5, 6, 0]], jnp.int32)
    st = d.init(None, None, seq, jnp.asarray([4, 4]), None, 8)
    both = Context(seq, jnp.asarray([4, 4]), None, None, jnp.asarray([True, True]))
    assert bool(d.worth_drafting(None, st, both))  # row 1 ends in 6, seen at 1
    assert not bool(d.worth_drafting(None, st, both._replace(active=jnp.asarray([True, False]))))  # row 0: no match
    # a drafted step costing 2 plain ones pays when every row furthest from its end (the most tokens left, within
    # gamma) is expected to take 2 or more: 1 + what drafts from its context length accepted (until measured: the
    # context's length). A row left behind with nothing to draft sets the batch's end whatever the others take.
    dear = LookupDrafter(cost=2.0)
    assert st.accepted.tolist()[:4] == [0, 1, 2, 3]
    assert not bool(dear.worth_drafting(None, st, both))  # row 0 (no match) as far from its end as row 1
    ahead = both._replace(remaining=jnp.asarray([5, 30]))  # row 0 within 5 of its end: row 1 alone sets the end
    assert bool(dear.worth_drafting(None, st, ahead))  # 1 + 2 >= 2
    assert not bool(dear.worth_drafting(None, st, both._replace(remaining=jnp.asarray([25, 30]))))  # within gamma
    poor = st.replace(accepted=st.accepted.at[2].set(0.5))
    assert not bool(dear.worth_drafting(None, poor, ahead))  # 1 + 0.5 < 2
    t = models["target"]
    prompt = [list(range(30, 40))]  # no token repeats: the first steps have nothing to draft
    ar = pdecode.generate(t, prompt, max_new_tokens=24, stop_at_eos=False)
    out = pdecode.generate(t, prompt, method="lookup", max_new_tokens=24, stop_at_eos=False)
    assert out.tokens == ar.tokens
    drafted = sum(out.stats["accepted_histogram"])
    assert 0 < drafted < out.stats["target_forwards"] - 1
    # a verify priced at 50 tokens never pays: every step is plain, as ar
    monkeypatch.setenv("PDECODE_VERIFY_COST", "2:50")
    out = pdecode.generate(t, PROMPTS[:3], method="lookup", max_new_tokens=24, stop_at_eos=False)
    assert out.tokens == pdecode.generate(t, PROMPTS[:3], max_new_tokens=24, stop_at_eos=False).tokens
    assert out.stats["verify_cost"] == 50 and out.stats["tokens_per_forward"] == 1.0
    # given outright (no measuring): the same; 0 drafts whenever a row has a match
    monkeypatch.delenv("PDECODE_VERIFY_COST")
    out = pdecode.generate(t, PROMPTS[:3], method="lookup", draft_cost=50, max_new_tokens=24, stop_at_eos=False)
    assert out.stats["verify_cost"] == 50 and out.stats["tokens_per_forward"] == 1.0
    with pytest.raises(pdecode.PdecodeError, match="draft_cost must be a number >= 0 or 'auto'"):
        pdecode.generate(t, PROMPTS[:1], method="lookup", draft_cost="dear")
    # 'auto': lookup's whole step timed against ar's on a prompt that repeats (so it drafts), at the generation's
    # batch, always drafting while timed; the engine, which times its own step calls, measures nothing
    from pdecode.decode import cost
    from pdecode.engine import Engine

    calls = []
    monkeypatch.setattr(cost, "_MEMO", {})
    monkeypatch.setattr(cost, "_cache_dir", lambda: None)
    monkeypatch.setattr(cost, "measure_steps", lambda m, b, meth, o, c, repeat=False: calls.append((b, meth, o, repeat))
                        or 50.0)
    out = pdecode.generate(t, PROMPTS[:3], method="lookup", max_new_tokens=24, stop_at_eos=False)
    assert out.stats["verify_cost"] == 50 and out.stats["tokens_per_forward"] == 1.0
    assert [(b, meth, o["draft_cost"], o["gamma"], r) for b, meth, o, r in calls] == [(3, "lookup", 0.0, 10, True)]
    Engine(t, method="lookup", slots=2, max_len=64, chunk=32)
    assert len(calls) == 1


def test_static_tree_from_choices():
    tr = tree_lib.from_choices([[0, 1], [1]])  # prefix [0] is added
    assert tr.parents == (-1, 0, 0, 1) and tr.ranks == (0, 0, 1, 1)
    assert tr.max_depth == 2 and tr.max_children == 2
    assert tree_lib.resolve("medusa-63").size == 64
    with pytest.raises(pdecode.ConfigError, match="unknown tree preset"):
        tree_lib.resolve("nope")
    with pytest.raises(pdecode.ConfigError, match="invalid tree path"):
        tree_lib.from_choices([[0, -1]])


def test_dynamic_tree_keeps_ancestors():
    """Every kept node's parent is kept and precedes it, for many rows."""
    from pdecode.decode.draft_model import grow_dynamic_tree
    from pdecode.decode.speculative import Context

    b, k, depth, total = 3, 3, 4, 15
    rng = np.random.default_rng(0)
    seq = jnp.zeros((b, 8), jnp.int32)
    ctx = Context(seq, jnp.full((b,), 4), None, None, jnp.ones((b,), bool))

    class FakeCache:
        max_len = 64

    def expand(cache, tok, pos, write_at, mask, state):
        return jnp.asarray(rng.normal(size=(b, k, 10)), jnp.float32), cache, state

    prop, _ = grow_dynamic_tree(ctx, FakeCache(), jax.nn.log_softmax(jnp.asarray(rng.normal(size=(b, 10)))), k, depth,
                                total, expand, base_B=ctx.seq_len, pos1_B=ctx.seq_len, rule=Rule.TREE_DETERMINISTIC)
    par = np.asarray(prop.parents)
    assert par.shape == (b, total + 1) and (par[:, 0] == -1).all()
    assert (par[:, 1:] < np.arange(1, total + 1)[None]).all() and np.asarray(prop.valid).all()


@pytest.mark.parametrize("kwargs,match", [
    (dict(method="sd", gamma=0), "gamma must be an integer >= 1"),
    (dict(method="tree", tree="bogus"), "unknown tree preset"),
    (dict(method="tree", tree_top_k=2, depth=2, total_tokens=50), "exceeds"),
    (dict(method="lookup", ngram_min=4, ngram_max=2), "ngram_min"),
])
def test_bad_options(models, kwargs, match):
    with pytest.raises(pdecode.ConfigError, match=match):
        pdecode.generate(models["target"], [[1, 2, 3]], draft=models["small"], **kwargs)


def test_vocab_mismatch_and_missing_draft(models, tmp_path):
    make_hf_model("llama", tmp_path, seed=2, vocab_size=50)
    other = pdecode.load(tmp_path)
    with pytest.raises(pdecode.ConfigError, match="vocabulary"):
        pdecode.generate(models["target"], [[1, 2]], method="sd", draft=other)
    with pytest.raises(pdecode.InputError, match="needs a draft model"):
        pdecode.generate(models["target"], [[1, 2]], method="sd")


# ------------------------------------------------------------------------------------------------ draft vocabulary
def _with_vocab(draft, ids):
    return dataclasses.replace(draft, extras={**draft.extras, "draft_vocab": np.asarray(ids, np.int32)}, _sharded={})


@pytest.mark.parametrize("method,opts", [("sd", dict(gamma=4)),
                                         ("tree", dict(tree="dynamic", tree_top_k=3, depth=4, total_tokens=12))])
def test_reduced_draft_vocabulary(models, method, opts):
    """A draft that ships a reduced vocabulary proposes only its tokens; greedy output stays AR's. The target as its
    own draft with every token AR emits in its vocabulary keeps its acceptance; one without them is never accepted."""
    t = models["target"]
    ref = pdecode.generate(t, PROMPTS, max_new_tokens=24, stop_at_eos=False)
    emitted = sorted({x for row in ref.tokens for x in row})
    v = t.cfg.vocab_size
    keep = _with_vocab(t, sorted(set(emitted) | set(range(0, v, 7))))
    drop = _with_vocab(t, [x for x in range(v) if x not in set(emitted)])
    run = dict(method=method, max_new_tokens=24, stop_at_eos=False, **opts)
    off = pdecode.generate(t, PROMPTS, draft=drop, draft_vocab=False, **run)  # the vocabulary switched off
    assert off.tokens == ref.tokens and off.stats["tokens_per_forward"] > 1.2
    out = pdecode.generate(t, PROMPTS, draft=keep, **run)
    assert out.tokens == ref.tokens
    assert out.stats["tokens_per_forward"] == pytest.approx(off.stats["tokens_per_forward"], abs=1e-6)
    out = pdecode.generate(t, PROMPTS, draft=drop, **run)
    assert out.tokens == ref.tokens
    assert out.stats["tokens_per_forward"] == 1.0 and out.stats["draft_forwards"] > 0


def test_draft_vocabulary_errors_and_round_trip(models, tmp_path):
    t, small = models["target"], models["small"]
    with pytest.raises(pdecode.ConfigError, match="ships no reduced vocabulary"):
        pdecode.generate(t, [[1, 2, 3]], method="sd", draft=small, draft_vocab=True)
    with pytest.raises(pdecode.InputError, match="draft_vocab"):
        pdecode.generate(t, [[1, 2, 3]], method="sd", draft=small, draft_vocab="all")
    d = _with_vocab(small, [1, 5, 9])
    pdecode.save_hf(d, tmp_path / "d")
    assert pdecode.load(tmp_path / "d").extras["draft_vocab"].tolist() == [1, 5, 9]
    import json

    cfg = json.loads((tmp_path / "d" / "config.json").read_text())
    cfg["pdecode_draft_vocab"] = [5, 1]
    (tmp_path / "d" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(pdecode.CheckpointError, match="distinct sorted token ids"):
        pdecode.load(tmp_path / "d")
