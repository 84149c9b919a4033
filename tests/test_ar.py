"""Autoregressive generation: cache correctness, batching, EOS, sampling distributions, compile caching, errors."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats as sstats

import pdecode
from pdecode import sampling
from pdecode.decode import ar, common
from tests.helpers import VOCAB

PROMPTS = [[5, 6, 7, 8, 9], [11, 12, 13], list(range(20, 57)), [3], [40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50]]


def naive_greedy(m, prompt, n, bucket=64):
    """Recompute the whole sequence every step (no cache): the reference for cached decoding. The sequence is
    right-padded to a multiple of ``bucket`` so the pass compiles once per bucket, not once per length; in a causal
    model the padding after the last token does not change its logits."""
    seq = list(prompt)
    for _ in range(n):
        width = -(-len(seq) // bucket) * bucket
        logits = np.asarray(pdecode.forward_logits(m, [seq + [0] * (width - len(seq))]))[0, len(seq) - 1]
        seq.append(int(np.argmax(logits)))
    return seq[len(prompt):]


def test_greedy_equals_no_cache_reference_mixed_lengths(tiny):
    out = pdecode.generate(tiny, PROMPTS, max_new_tokens=20, stop_at_eos=False)
    for p, toks in zip(PROMPTS, out.tokens):
        assert toks == naive_greedy(tiny, p, 20)
    assert out.stats["target_forwards"] == 20 and out.stats["tokens_per_forward"] == 1.0
    assert out.stats["new_tokens"] == 20 * len(PROMPTS)


def test_batch_equals_single_rows(tiny):
    batch = pdecode.generate(tiny, PROMPTS, max_new_tokens=16, stop_at_eos=False)
    for p, toks in zip(PROMPTS, batch.tokens):
        assert pdecode.generate(tiny, [p], max_new_tokens=16, stop_at_eos=False).tokens[0] == toks


def test_eos_stops_each_row_independently(tiny):
    free = pdecode.generate(tiny, PROMPTS, max_new_tokens=24, stop_at_eos=False).tokens
    eos = free[0][3]  # a token row 0 emits at step 4
    m = pdecode.Model(cfg=tiny.cfg.replace(eos_token_ids=(eos,)), params=tiny.params)
    out = pdecode.generate(m, PROMPTS, max_new_tokens=24)
    for f, toks in zip(free, out.tokens):
        if eos in f:
            cut = f.index(eos) + 1
            assert toks == f[:cut]  # EOS kept, nothing after it
        else:
            assert toks == f
    assert out.tokens[0][-1] == eos and len(out.tokens[0]) <= 4
    assert out.stats["new_tokens"] == sum(len(t) for t in out.tokens)


def test_max_new_tokens_and_text_output(hf_dirs):
    m = pdecode.load(hf_dirs["qwen2"][0])
    out = pdecode.generate(m, [[1, 2, 3], [4]], max_new_tokens=7, stop_at_eos=False)
    assert [len(t) for t in out.tokens] == [7, 7]
    assert out.texts == ["", ""]  # no tokenizer in this checkpoint: texts are empty, tokens are there


def test_seeded_sampling_is_reproducible(tiny):
    a = pdecode.generate(tiny, PROMPTS, max_new_tokens=12, temperature=1.0, seed=3, stop_at_eos=False).tokens
    b = pdecode.generate(tiny, PROMPTS, max_new_tokens=12, temperature=1.0, seed=3, stop_at_eos=False).tokens
    c = pdecode.generate(tiny, PROMPTS, max_new_tokens=12, temperature=1.0, seed=4, stop_at_eos=False).tokens
    assert a == b and a != c


def _exact_probs(m, prompt, temperature=1.0, top_k=0, top_p=1.0):
    logits = pdecode.forward_logits(m, [prompt])[0, -1]
    s = sampling.validate(temperature, top_k, top_p)
    return np.asarray(sampling.probs(logits, s, sampling.Warp.of(temperature, top_p, top_k)), np.float64)


def _chi2_pvalue(samples, p, n_cats):
    counts = np.bincount(samples, minlength=n_cats).astype(np.float64)
    keep = p > 0
    assert counts[~keep].sum() == 0, "sampled a token with zero probability"
    exp = p[keep] * len(samples)
    # merge rare categories so the chi-square approximation holds
    order = np.argsort(exp)
    obs_k, exp_k = counts[keep][order], exp[order]
    small = np.cumsum(exp_k) < 5 * 5
    o = np.append(obs_k[~small], obs_k[small].sum())
    e = np.append(exp_k[~small], exp_k[small].sum())
    if e[-1] == 0:
        o, e = o[:-1], e[:-1]
    stat = float(((o - e) ** 2 / e).sum())
    return float(sstats.chi2.sf(stat, len(o) - 1))


@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, 0, 1.0), (0.7, 0, 1.0), (1.0, 10, 1.0), (1.0, 0, 0.8)])
def test_first_token_distribution(tiny, temperature, top_k, top_p):
    prompt = [5, 6, 7, 8, 9]
    n = 10000
    out = pdecode.generate(tiny, [prompt] * n, max_new_tokens=1, temperature=temperature, top_k=top_k, top_p=top_p,
                           seed=11, stop_at_eos=False)
    samples = np.array([t[0] for t in out.tokens])
    p = _exact_probs(tiny, prompt, temperature, top_k, top_p)
    if top_k:
        assert (p > 0).sum() == top_k
    assert _chi2_pvalue(samples, p, VOCAB) > 1e-3
    # the test has power: the same samples reject a distribution at another temperature
    wrong = _exact_probs(tiny, prompt, temperature * 2.0, top_k, top_p)
    assert _chi2_pvalue(samples, wrong, VOCAB) < 1e-6


def test_second_token_marginal_through_the_cache(tiny):
    prompt = [5, 6, 7, 8, 9]
    n = 10000
    out = pdecode.generate(tiny, [prompt] * n, max_new_tokens=2, temperature=1.0, seed=5, stop_at_eos=False)
    second = np.array([t[1] for t in out.tokens])
    p1 = _exact_probs(tiny, prompt)
    # exact marginal of the second token: sum_t1 p(t1) p(t2 | prompt, t1), from no-cache forwards
    logits = np.asarray(pdecode.forward_logits(tiny, [prompt + [t] for t in range(VOCAB)]))[:, -1]
    cond = np.asarray(jax.nn.softmax(jnp.asarray(logits), axis=-1), np.float64)
    marg = p1 @ cond
    assert _chi2_pvalue(second, marg / marg.sum(), VOCAB) > 1e-3


def test_compiled_function_is_cached(tiny):
    a = pdecode.generate(tiny, [[1, 2, 3], [4, 5]], max_new_tokens=9)
    b = pdecode.generate(tiny, [[7, 8], [9, 10, 11, 12]], max_new_tokens=9, temperature=0.0)
    c = pdecode.generate(tiny, [[7, 8], [9, 10, 11, 12]], max_new_tokens=9, temperature=0.5)
    d = pdecode.generate(tiny, [[7, 8], [9, 10, 11, 12]], max_new_tokens=9, temperature=0.9, seed=2)
    assert b.stats["compile_s"] == 0.0  # same shapes (prompt lengths fall in one bucket): no recompile
    assert c.stats["compile_s"] > 0  # greedy -> sampling is a different program
    assert d.stats["compile_s"] == 0.0  # temperature and seed are traced values
    assert a.stats["compile_s"] >= 0


def test_compile_cache_is_bounded(tiny, monkeypatch):
    """Executables leave least-recently-used first, so a sweep over many shapes cannot exhaust memory maps."""
    from pdecode import api

    monkeypatch.setattr(api, "COMPILE_CACHE_SIZE", 2)
    pdecode.clear_compile_cache()
    outs = [pdecode.generate(tiny, [[1, 2, 3]], max_new_tokens=n) for n in (3, 4, 5)]
    assert len(api._COMPILED) == 2 and all(o.stats["compile_s"] > 0 for o in outs)
    assert pdecode.generate(tiny, [[4, 5]], max_new_tokens=5).stats["compile_s"] == 0.0  # recent: kept
    assert pdecode.generate(tiny, [[4, 5]], max_new_tokens=3).stats["compile_s"] > 0  # oldest: evicted


@pytest.mark.parametrize("phases", [1, 4])
def test_generation_is_one_while_loop_per_cache_phase(tiny, phases):
    """No host round trip per token: prefill, then one `lax.while_loop` per cache phase, all in one traced call."""
    s = sampling.Sampling()
    prompt = jnp.zeros((2, 16), jnp.int32)
    lengths = common.phase_lengths(16, 128, phases)
    assert (len(lengths) == 1) == (phases == 1) and lengths[-1] == 128
    jaxpr = jax.make_jaxpr(lambda p, x, n, k: ar.generate(p, x, n, k, sampling.Warp.of(0.0), cfg=tiny.cfg, max_new=5,
                                                          max_len=128, eos_ids=(2,), samp=s, phases=phases))(
        tiny.params, prompt, jnp.array([3, 8]), jax.random.PRNGKey(0))
    loops = [e for e in jaxpr.jaxpr.eqns if e.primitive.name == "while"]
    assert len(loops) == len(lengths)
    assert "callback" not in str(jaxpr)


@pytest.mark.parametrize("prompt_len,max_len,phases", [(64, 192, 4), (1, 128, 4), (30, 256, 3), (512, 1024, 6),
                                                       (16, 64, 4), (8, 16, 4), (64, 192, 1)])
def test_phase_lengths(prompt_len, max_len, phases):
    lengths = common.phase_lengths(prompt_len, max_len, phases)
    assert lengths[-1] == max_len and 1 <= len(lengths) <= max(phases, 1)
    assert lengths[0] >= prompt_len and list(lengths) == sorted(set(lengths))
    assert all(n % common.PHASE_ALIGN == 0 for n in lengths[:-1])
    assert all(b - a >= common.PHASE_ALIGN for a, b in zip(lengths, lengths[1:]))
    if phases > 1 and max_len - prompt_len >= 128:
        assert len(lengths) > 1  # long generations do run in phases


def test_cache_phases_give_the_same_tokens(tiny):
    """A loop over a cache grown in phases attends over fewer (masked) slots; tokens equal the single full-cache
    loop and the no-cache reference, greedy and sampled, with mixed prompt lengths, EOS, and rows crossing phase
    boundaries at different steps."""
    n = 90
    assert len(common.phase_lengths(64, 192, 4)) == 4  # PROMPTS bucket to 64; 64 + 90 new tokens -> a 192-slot cache
    one = pdecode.generate(tiny, PROMPTS, max_new_tokens=n, stop_at_eos=False, cache_phases=1)
    four = pdecode.generate(tiny, PROMPTS, max_new_tokens=n, stop_at_eos=False, cache_phases=4)
    assert one.tokens == four.tokens and one.stats["cache_len"] == 192
    assert four.tokens[1] == naive_greedy(tiny, PROMPTS[1], n)
    eos = one.tokens[2][40]
    m = pdecode.Model(cfg=tiny.cfg.replace(eos_token_ids=(eos,)), params=tiny.params)
    kw = dict(max_new_tokens=n, temperature=1.0, top_k=20, seed=3)
    for k in (kw, dict(max_new_tokens=n)):
        a, b = (pdecode.generate(m, PROMPTS, cache_phases=ph, **k) for ph in (1, 4))
        assert a.tokens == b.tokens and a.stats["target_forwards"] == b.stats["target_forwards"]
    with pytest.raises(pdecode.ConfigError, match="cache_phases"):
        pdecode.generate(tiny, PROMPTS, cache_phases=0)


@pytest.mark.parametrize("kwargs,match", [
    (dict(temperature=-1.0), "temperature"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_p=1.5), "top_p"),
    (dict(top_k=-2), "top_k"),
    (dict(top_k=10_000), "top_k"),
    (dict(max_new_tokens=0), "max_new_tokens"),
    (dict(method="nope"), "unknown method"),
    (dict(method="ar", gamma=3), "unknown option 'gamma' for method 'ar'; it takes: "),
    (dict(max_new_tokens=250), "context of 256"),
    (dict(max_len=8), "max_len"),
])
def test_bad_input_gets_a_clear_error(tiny, kwargs, match):
    with pytest.raises(pdecode.InputError, match=match):
        pdecode.generate(tiny, [[1, 2, 3, 4, 5, 6, 7, 8, 9, 10]], **kwargs)


def test_bad_prompts(tiny):
    with pytest.raises(pdecode.InputError, match="token ids must lie"):
        pdecode.generate(tiny, [[1, 2, VOCAB]])
    with pytest.raises(pdecode.InputError, match="no tokenizer"):
        pdecode.generate(tiny, ["text prompt"])
    with pytest.raises(pdecode.InputError, match="zero tokens"):
        pdecode.generate(tiny, [[]])
