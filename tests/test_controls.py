"""Generation controls: repetition penalty and min-p (speculative methods lossless with respect to the processed
distribution, and a penalty that ignores the drafted path rejected by the same test), per-row sampling values and
keys, logprobs, stop strings and stop ids, generation_config.json defaults."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats as sstats

import pdecode
from pdecode import generation, sampling
from pdecode.decode import speculative
from pdecode.errors import InputError
from tests.helpers import make_hf_model
from tests.test_speculative import PROMPTS, models, small_vocab  # noqa: F401 (fixtures)

PROMPT = [3, 7, 3, 7, 3]
N = 12000
PEN, MIN_P = 0.4, 0.05  # a penalty below 1 favours seen tokens: a strong, easily seen effect
PRES, FREQ, BIAS = -2.0, -1.5, {1: 2.0, 5: -3.0}  # negative penalties favour repeats: a strong effect too


@pytest.fixture(scope="module")
def sharp(small_vocab):  # noqa: F811
    """small_vocab's target with its logits scaled up 6x (the final norm's weight), so that a multiplicative
    penalty moves the distribution a lot; the draft as it is."""
    t, d = small_vocab
    return pdecode.Model(cfg=t.cfg, params={**t.params, "final_norm": t.params["final_norm"] * 6}), d


def _processed_marginals(m, prompt, n_tok, penalty=1.0, min_p=0.0, presence=0.0, frequency=0.0,
                         bias=None):
    """Exact marginals of the first n_tok tokens sampled at T = 1 from the processed (bias added, repetition,
    presence and frequency penalties), min-p filtered distribution (every prefix enumerated; `transformers`' and
    OpenAI's rules written out in numpy)."""
    v = m.cfg.vocab_size
    prefixes, probs = [[]], np.array([1.0])
    margs = []
    for _ in range(n_tok):
        lg = np.asarray(pdecode.forward_logits(m, [prompt + pre for pre in prefixes]))[:, -1].astype(np.float64)
        for i, pre in enumerate(prefixes):
            for t, b in (bias or {}).items():
                lg[i, t] += b
            seen = sorted(set(prompt + pre))
            x = lg[i, seen]
            lg[i, seen] = np.where(x > 0, x / penalty, x * penalty)
            count = np.bincount(np.asarray(pre, np.int64), minlength=v)[:v]
            lg[i] -= frequency * count + presence * (count > 0)
        cond = np.exp(lg - lg.max(-1, keepdims=True))
        cond /= cond.sum(-1, keepdims=True)
        if min_p:
            cond = np.where(cond < min_p * cond.max(-1, keepdims=True), 0.0, cond)
            cond /= cond.sum(-1, keepdims=True)
        joint = probs[:, None] * cond
        margs.append(joint.sum(0))
        prefixes = [pre + [t] for pre in prefixes for t in range(v)]
        probs = joint.reshape(-1)
    return margs


def _min_pvalue(toks, margs):
    out = []
    for i, m in enumerate(margs):
        keep = m > 1e-12
        counts = np.bincount(toks[:, i], minlength=len(m))
        if counts[~keep].sum():
            return 0.0  # a token the distribution cannot produce
        out.append(sstats.chisquare(counts[keep], m[keep] / m[keep].sum() * len(toks)).pvalue)
    return min(out)


CASES = [("ar", {}), ("sd", dict(gamma=3)), ("tree", dict(tree=[[0], [1], [0, 0], [0, 1], [0, 0, 0]])),
         ("lookup", dict(gamma=3))]


@pytest.mark.parametrize("method,opts", CASES, ids=[c[0] for c in CASES])
def test_penalty_and_min_p_sampling_is_lossless(sharp, method, opts):
    """Every method samples the processed distribution: the logit bias, the repetition penalty and OpenAI's presence /
    frequency penalties apply to each drafted node with the tokens on its path (counted), so the marginals of the
    first tokens equal AR sampling's from the processed, min-p filtered distribution."""
    target, draft = sharp
    out = pdecode.generate(target, [PROMPT] * N, method=method, draft=draft if method in ("sd", "tree") else None,
                           max_new_tokens=3, temperature=1.0, repetition_penalty=PEN, min_p=MIN_P, seed=3,
                           presence_penalty=PRES, frequency_penalty=FREQ, logit_bias=BIAS, stop_at_eos=False, **opts)
    toks = np.array(out.tokens)
    full = dict(presence=PRES, frequency=FREQ, bias=BIAS)
    assert _min_pvalue(toks, _processed_marginals(target, PROMPT, 3, PEN, MIN_P, **full)) > 1e-4
    # the test tells each stage apart
    assert _min_pvalue(toks, _processed_marginals(target, PROMPT, 3, 1.0, MIN_P, **full)) < 1e-6
    assert _min_pvalue(toks, _processed_marginals(target, PROMPT, 3, PEN, MIN_P, bias=BIAS)) < 1e-6


def test_a_penalty_blind_to_the_drafted_path_fails_the_test(sharp, monkeypatch):
    """The wrong rule: penalise each drafted node by the committed history only (not the drafted tokens above it).
    The same test rejects it."""
    target, draft = sharp

    def committed_only(logits, seen, tokens, parents, max_depth, samp, warp, *a, **kw):
        return sampling.penalize(logits, seen[:, None, :], samp, warp)

    monkeypatch.setattr(speculative, "penalize_nodes", committed_only)
    pdecode.clear_compile_cache()
    try:
        out = pdecode.generate(target, [PROMPT] * N, method="sd", draft=draft, gamma=3, max_new_tokens=3,
                               temperature=1.0, repetition_penalty=PEN, seed=3, stop_at_eos=False)
    finally:
        pdecode.clear_compile_cache()
    assert _min_pvalue(np.array(out.tokens), _processed_marginals(target, PROMPT, 3, PEN)) < 1e-6


def test_counts_blind_to_the_drafted_path_fail_the_test(sharp, monkeypatch):
    """The wrong rule: presence / frequency from the committed output only (not the drafted tokens above a node).
    The same test rejects it."""
    target, draft = sharp

    def committed_only(logits, seen, tokens, parents, max_depth, samp, warp, counts=None, *a, **kw):
        return sampling.penalize(logits, None, samp, warp, counts[:, None, :])

    monkeypatch.setattr(speculative, "penalize_nodes", committed_only)
    pdecode.clear_compile_cache()
    try:
        out = pdecode.generate(target, [PROMPT] * N, method="sd", draft=draft, gamma=3, max_new_tokens=3,
                               temperature=1.0, presence_penalty=PRES, frequency_penalty=FREQ, seed=5,
                               stop_at_eos=False)
    finally:
        pdecode.clear_compile_cache()
    assert _min_pvalue(np.array(out.tokens), _processed_marginals(target, PROMPT, 3, presence=PRES,
                                                                  frequency=FREQ)) < 1e-6


def test_greedy_with_penalties_bias_and_min_tokens_equals_ar(models):  # noqa: F811
    """Greedy speculative decoding with presence / frequency penalties, a logit bias and min_tokens gives AR's
    tokens under the same controls; min_tokens holds a stop id back, a bias of +100 takes over."""
    t = models["target"]
    free = pdecode.generate(t, PROMPTS, max_new_tokens=16, stop_at_eos=False)
    sid = free.tokens[0][1]  # row 0 would stop at its second token
    kw = dict(max_new_tokens=16, stop_at_eos=False, presence_penalty=0.8, frequency_penalty=0.6,
              logit_bias={int(free.tokens[1][3]): -5.0, 7: 1.5}, min_tokens=6, stop_token_ids=[sid])
    ref = pdecode.generate(t, PROMPTS, **kw)
    assert ref.tokens != free.tokens
    assert all(len(x) >= 6 and sid not in x[:5] for x in ref.tokens)  # no stop before the 6th token
    for method, opts in (("sd", dict(gamma=3)), ("tree", dict(tree="binary-14"))):
        out = pdecode.generate(t, PROMPTS, method=method, draft=models["small"], **kw, **opts)
        assert out.tokens == ref.tokens, method
    forced = pdecode.generate(t, PROMPTS[:2], max_new_tokens=5, stop_at_eos=False, logit_bias={"9": 100})
    assert forced.tokens == [[9] * 5] * 2


@pytest.mark.parametrize("method,opts", [("sd", dict(gamma=3)), ("lookup", {}), ("tree", dict(tree="binary-14"))])
def test_greedy_with_penalty_equals_ar(models, method, opts):  # noqa: F811
    t = models["target"]
    kw = dict(max_new_tokens=24, stop_at_eos=False, repetition_penalty=1.3)
    ref = pdecode.generate(t, PROMPTS, **kw)
    assert ref.tokens != pdecode.generate(t, PROMPTS, max_new_tokens=24, stop_at_eos=False).tokens
    out = pdecode.generate(t, PROMPTS, method=method, draft=models["small"], **kw, **opts)
    assert out.tokens == ref.tokens


def _top_p_reference(x, top_p):
    """Sort, cut the cumulative mass before each token at top_p, keep values at or above the last kept one."""
    x = np.asarray(x, np.float64)
    out = x.copy()
    for idx in np.ndindex(x.shape[:-1]):
        tp = top_p[idx[0]]
        if tp >= 1:
            continue
        srt = np.sort(x[idx])[::-1]
        p = np.exp(srt - srt.max())
        p /= p.sum()
        out[idx] = np.where(x[idx] < srt[np.cumsum(p) - p < tp].min(), sampling.NEG_INF, x[idx])
    return out


def test_top_p_by_bisection_equals_the_sorted_rule():
    """`sampling._top_p` (a bisection over the values, no sort) keeps exactly the tokens the sort-and-cut rule keeps:
    random logits at several scales, ties (with -0.0 against 0.0), filtered entries at -1e30, per-row top_p with
    rows at 1.0; and `warp` skips a filter no row asks for and applies it to the rows that do."""
    rng = np.random.default_rng(0)
    for t in range(120):
        x = (rng.normal(size=(3, 2, 50)) * rng.uniform(0.3, 5)).astype(np.float32)
        if t % 3 == 0:
            x = np.round(x)  # ties, and -0.0 next to 0.0
        if t % 4 == 0:
            x[..., :10] = sampling.NEG_INF
        tp = rng.uniform(0.05, 1.0, size=3).astype(np.float32)
        if t % 5 == 0:
            tp[0] = 1.0
        got = np.asarray(sampling._top_p(jnp.asarray(x), tp.reshape(3, 1, 1))) <= sampling.NEG_INF / 2
        want = _top_p_reference(x, tp) <= sampling.NEG_INF / 2
        assert (got == want).all(), t
    x = jnp.asarray(rng.normal(size=(4, 64)).astype(np.float32) * 3)
    samp = sampling.Sampling(greedy=False, top_k=8, use_top_p=True, use_min_p=True)
    off = sampling.Warp.of(np.ones(4, np.float32), np.ones(4, np.float32), np.zeros(4, np.int32), np.zeros(4))
    assert (np.asarray(jax.jit(sampling.warp, static_argnums=1)(x, samp, off)) == np.asarray(x)).all()
    on = sampling.Warp.of(np.ones(4, np.float32), np.asarray([1, .5, 1, 1], np.float32), np.asarray([0, 0, 3, 0]),
                          np.asarray([0, 0, 0, .2], np.float32))
    kept = np.asarray(jax.jit(sampling.warp, static_argnums=1)(x, samp, on)) > sampling.NEG_INF / 2
    assert kept[0].all() and kept[2].sum() == 3
    assert (kept[1] == (_top_p_reference(np.asarray(x)[1:2], [.5])[0] > sampling.NEG_INF / 2)).all()
    q = np.exp(np.asarray(x)[3] - np.asarray(x)[3].max())
    assert (kept[3] == (q >= .2 * q.max())).all()


def test_per_row_values_and_keys(sharp):
    """One batch, per-row sampling values and keys (the serving engine's layout): rows at temperature 0 are exactly
    greedy AR inside a sampled batch, rows at temperature 1 follow the processed distribution, and a row's draws
    depend only on its own key."""
    from pdecode.api import compiled

    target, draft = sharp
    b = N
    t = np.where(np.arange(b) % 4 == 0, 0.0, 1.0).astype(np.float32)
    warp = sampling.Warp.of(t, np.ones(b), np.zeros(b, np.int32), np.full(b, MIN_P), np.full(b, PEN))
    samp = sampling.Sampling(greedy=False, top_k=4, use_top_p=True, use_min_p=True, penalty=True)
    prompt = jnp.asarray([PROMPT + [0] * 27] * b, jnp.int32)
    plen = jnp.full((b,), len(PROMPT), jnp.int32)
    keys = sampling.row_keys(np.arange(b))
    from pdecode.decode.draft_model import DraftChain

    static = dict(cfg=target.cfg, drafter=DraftChain(draft.cfg, 3, 3), max_new=3, max_len=64, eos_ids=(),
                  samp=samp, mesh=None)
    args = ((target.params, draft.params), prompt, plen, keys, warp)
    exe, _ = compiled(speculative.generate, static, *args)
    toks = np.asarray(exe(*args)[0].tokens)
    greedy = pdecode.generate(target, [PROMPT], max_new_tokens=3, repetition_penalty=PEN, stop_at_eos=False).tokens[0]
    assert (toks[t == 0] == np.asarray(greedy)).all()
    assert _min_pvalue(toks[t > 0], _processed_marginals(target, PROMPT, 3, PEN, MIN_P)) > 1e-4
    # row r's draws depend on its key alone: the same keys in another batch composition give the same rows
    sub = slice(0, 64)
    args2 = ((target.params, draft.params), prompt[sub], plen[sub], keys[sub],
             jax.tree.map(lambda a: a[sub] if a.ndim else a, warp))
    exe2, _ = compiled(speculative.generate, static, *args2)
    assert (np.asarray(exe2(*args2)[0].tokens) == toks[sub]).all()


def test_logprobs(models):  # noqa: F811
    t = models["target"]
    out = pdecode.generate(t, PROMPTS[:3], max_new_tokens=10, stop_at_eos=False, logprobs=True)
    for p, toks, lps in zip(PROMPTS, out.tokens, out.logprobs):
        lg = np.asarray(pdecode.forward_logits(t, [p + toks]))[0].astype(np.float64)
        lsm = lg - np.log(np.exp(lg - lg.max(-1, keepdims=True)).sum(-1, keepdims=True)) - lg.max(-1, keepdims=True)
        want = [lsm[len(p) - 1 + i, tok] for i, tok in enumerate(toks)]
        np.testing.assert_allclose(lps, want, atol=2e-4)
    sd = pdecode.generate(t, PROMPTS[:3], method="sd", draft=models["small"], max_new_tokens=10, stop_at_eos=False,
                          logprobs=True)
    np.testing.assert_allclose(np.asarray(sd.logprobs), np.asarray(out.logprobs), atol=2e-4)
    with pytest.raises(InputError, match="does not take logprobs"):
        pdecode.generate(pdecode.load("code-dllm"), ["x = "], method="diffusion", logprobs=True, max_new_tokens=8)


def test_stop_ids_and_stop_strings():
    m = pdecode.load("code-target", dtype="float32")
    prompt = "def fib(n):"
    free = pdecode.generate(m, [prompt], max_new_tokens=40, stop_at_eos=False)
    text, toks = free.texts[0], free.tokens[0]
    assert free.finish_reasons == ["length"]
    stop = text[len(text) // 3: len(text) // 3 + 4]
    at = text.find(stop)
    for method in ("ar", "lookup"):
        out = pdecode.generate(m, [prompt, prompt], method=method, max_new_tokens=40, stop=[stop, "@@never@@"],
                               stop_at_eos=False)
        assert out.texts == [text[:at]] * 2 and out.finish_reasons == ["stop", "stop"]
        n = len(out.tokens[0])
        assert out.tokens[0] == toks[:n] and stop in m.tokenizer.decode(toks[:n])
        assert stop not in m.tokenizer.decode(toks[: n - 1])
    sid = toks[5]
    out = pdecode.generate(m, [prompt], max_new_tokens=40, stop_token_ids=[sid], stop_at_eos=False)
    assert out.tokens[0] == toks[: toks.index(sid) + 1] and out.finish_reasons == ["stop"]
    with pytest.raises(InputError, match="stop must be"):
        pdecode.generate(m, [prompt], stop=[""])


def test_generation_config_defaults(tmp_path):
    make_hf_model("llama", tmp_path, seed=0)
    f = tmp_path / "generation_config.json"
    gen = json.loads(f.read_text()) if f.exists() else {}
    gen.update(do_sample=True, temperature=0.9, top_k=7, max_new_tokens=9, repetition_penalty=1.1)
    (tmp_path / "generation_config.json").write_text(json.dumps(gen))
    m = pdecode.load(tmp_path)
    assert m.generation_config["top_k"] == 7
    c = generation.resolve(m.generation_config, m.cfg.vocab_size, {})
    assert (c.temperature, c.top_k, c.max_new_tokens, c.repetition_penalty) == (0.9, 7, 9, 1.1)
    c = generation.resolve(m.generation_config, m.cfg.vocab_size, {"temperature": 0.0, "top_k": 3})
    assert (c.temperature, c.top_k) == (0.0, 3)
    a = pdecode.generate(m, [[5, 6, 7]], seed=1, stop_at_eos=False)
    b = pdecode.generate(m, [[5, 6, 7]], seed=2, stop_at_eos=False)
    assert len(a.tokens[0]) == 9 and a.tokens != b.tokens  # the file's defaults: 9 tokens, sampled
    g1 = pdecode.generate(m, [[5, 6, 7]], temperature=0.0, seed=1, stop_at_eos=False)
    g2 = pdecode.generate(m, [[5, 6, 7]], temperature=0.0, seed=2, stop_at_eos=False)
    assert g1.tokens == g2.tokens
    # no do_sample: greedy, whatever temperature the file holds
    assert generation.resolve({"temperature": 0.6}, 100, {}).temperature == 0.0
    assert generation.config_eos_ids({"eos_token_id": [3, 4]}) == (3, 4)


def test_bad_controls(models):  # noqa: F811
    t = models["target"]
    for kw, msg in [(dict(min_p=1.5), "min_p"), (dict(repetition_penalty=0.0), "repetition_penalty"),
                    (dict(temperature=float("nan")), "temperature"), (dict(stop_token_ids=[10**9]), "stop_token_ids"),
                    (dict(stop=3), "stop must be"), (dict(presence_penalty=2.5), "presence_penalty"),
                    (dict(frequency_penalty="1"), "frequency_penalty"), (dict(logit_bias={10**9: 1}), "logit_bias"),
                    (dict(logit_bias={3: 101}), "logit_bias"), (dict(logit_bias=[3]), "logit_bias"),
                    (dict(min_tokens=5), "min_tokens"), (dict(min_tokens=-1), "min_tokens")]:
        with pytest.raises(InputError, match=msg):
            pdecode.generate(t, PROMPTS[:1], max_new_tokens=4, **kw)


def test_stop_string_helpers():
    assert generation.find_stop("abc\ndef", ["\nd", "c"]) == 2
    assert generation.held_back("hello wor", ["world"]) == 3
    assert generation.held_back("hello", ["xyz"]) == 0
    dec = lambda t: "".join(chr(97 + x) for x in t)  # noqa: E731
    assert generation.cut_at_stop([0, 1, 2, 3, 4], dec, ["cd"]) == ([0, 1, 2, 3], "ab", True)
    assert generation.cut_at_stop([0, 1], dec, ["zz"]) == ([0, 1], "ab", False)
    # min_tokens: a stop string inside the first min_tokens - 1 tokens does not count; one ending later does
    assert generation.cut_at_stop([0, 1, 2, 3, 1, 2, 4], dec, ["bc"], min_tokens=4) == ([0, 1, 2, 3, 1, 2], "abcd",
                                                                                      True)
    assert generation.cut_at_stop([0, 1, 2], dec, ["bc"], min_tokens=4) == ([0, 1, 2], "abc", False)
    assert generation.cut_at_stop([0, 1, 2], dec, ["bc"], min_tokens=3) == ([0, 1, 2], "a", True)
