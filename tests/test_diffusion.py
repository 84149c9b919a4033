"""Masked-diffusion samplers and DiCo: LLaDA reference equality, rule behaviour on hand-made inputs, invariants,
batching, caching, EOS, and the masked-diffusion objective."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pdecode
from pdecode.config import ModelConfig
from pdecode.decode import diffusion as D
from pdecode.decode import dico as DC
from pdecode.model.transformer import init_params

V, MASK, EOS = 24, 2, 0


@pytest.fixture(scope="module")
def dllm():
    cfg = ModelConfig(vocab_size=V, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=2, num_kv_heads=1,
                      head_dim=16, max_position_embeddings=512, causal=False, mask_token_id=MASK,
                      eos_token_ids=(EOS,), pad_token_id=1)
    params = init_params(cfg, jax.random.PRNGKey(0), std=0.3)
    return pdecode.Model(cfg=cfg, params=params, name="tiny-dllm")


PROMPTS = [[5, 6, 7, 8], [9, 10], [11, 12, 13, 14, 15, 16, 17], [3]]


def llada_reference(m, prompt, gen, block, steps):
    """LLaDA's published sampler (greedy, low-confidence remasking), in NumPy on our model's logits."""
    x = np.array(prompt + [MASK] * gen)
    p = len(prompt)
    nb = gen // block
    spb = steps // nb
    for b in range(nb):
        lo, hi = p + b * block, p + (b + 1) * block
        n = int(np.sum(x[lo:hi] == MASK))
        counts = [n // spb + (1 if i < n % spb else 0) for i in range(spb)]
        for i in range(spb):
            logits = np.array(pdecode.forward_logits(m, x[None]))[0]
            logits[:, MASK] = -np.inf  # the mask token is never predicted
            x0 = logits.argmax(-1)
            prob = np.exp(logits - logits.max(-1, keepdims=True))
            prob /= prob.sum(-1, keepdims=True)
            conf = prob[np.arange(len(x)), x0]
            conf[hi:] = -np.inf
            conf[:lo] = -np.inf
            conf[x != MASK] = -np.inf
            k = counts[i]
            if k:
                pick = np.argsort(-conf, kind="stable")[:k]
                x[pick] = x0[pick]
    return x[p:].tolist()


@pytest.mark.parametrize("gen,block,steps", [(16, 16, 16), (16, 8, 8), (24, 8, 12)])
def test_low_confidence_equals_llada_reference(dllm, gen, block, steps):
    out = pdecode.generate(dllm, PROMPTS, method="diffusion", max_new_tokens=gen, block_length=block, steps=steps,
                           stop_at_eos=False)
    for prompt, toks in zip(PROMPTS, out.tokens):
        assert toks == llada_reference(dllm, prompt, gen, block, steps)
    assert out.stats["nfe"] == steps


@pytest.mark.parametrize("opts", [dict(rule="threshold", threshold=0.3, block_length=8),
                                  dict(rule="factor", factor=1.0, block_length=8),
                                  dict(rule="eb", eb_gamma=0.5, block_length=16),
                                  dict(alg="margin", block_length=8, steps=8),
                                  dict(alg="entropy", alg_temp=0.5, block_length=8, steps=16),
                                  dict(alg="random", block_length=16),
                                  dict(rule="threshold", threshold=0.3, block_length=8, cache="dual"),
                                  dict(rule="threshold", threshold=0.3, block_length=8, cache="prefix"),
                                  dict(cfg_scale=1.0)])
def test_batch_equals_single_rows_and_fills_every_mask(dllm, opts):
    batch = pdecode.generate(dllm, PROMPTS, method="diffusion", max_new_tokens=16, stop_at_eos=False, **opts)
    deterministic = opts.get("alg") != "random" and not opts.get("alg_temp")  # else noise depends on batch shape
    for prompt, toks in zip(PROMPTS, batch.tokens):
        if deterministic:
            single = pdecode.generate(dllm, [prompt], method="diffusion", max_new_tokens=16, stop_at_eos=False,
                                      **opts)
            assert single.tokens[0] == toks
        assert len(toks) == 16 and MASK not in toks
    steps = np.array(batch.stats["commit_step"])
    assert (steps >= 0).all()  # every canvas position was committed exactly at some step
    assert batch.stats["nfe"] >= 1


def test_schedule_commits_one_token_per_step(dllm):
    out = pdecode.generate(dllm, PROMPTS, method="diffusion", max_new_tokens=16, stop_at_eos=False)
    for row in out.stats["commit_step"]:
        assert sorted(row) == list(range(16))  # committed tokens never change: each position once, one per step


def test_rules_on_hand_made_confidences():
    opts = D.DiffusionOptions(gen_length=8, block_length=8, steps=8)
    conf = jnp.asarray([[0.95, 0.2, 0.91, 0.5, 0.99, 0.1, 0.3, 0.92]])
    elig = jnp.asarray([[True, True, True, True, False, True, True, True]])
    key = jax.random.PRNGKey(0)
    thr = D.select("threshold", opts, conf, conf, elig, jnp.asarray([2]), key)
    assert np.asarray(thr)[0].tolist() == [True, False, True, False, False, False, False, True]
    low = jnp.asarray([[0.5, 0.2, 0.4, 0.3, 0.99, 0.1, 0.3, 0.2]])
    thr1 = D.select("threshold", opts, low, low, elig, jnp.asarray([2]), key)
    assert np.asarray(thr1)[0].tolist() == [True] + [False] * 7  # always the best one
    sched = D.select("schedule", opts, conf, conf, elig, jnp.asarray([2]), key)
    assert np.asarray(sched)[0].tolist() == [True, False, False, False, False, False, False, True]
    # factor f=1: sorted eligible c = .95 .92 .91 .5 ...; k=1: 2*.05=.1<=1, k=2: 3*.08=.24, k=3: 4*.09=.36,
    # k=4: 5*.5=2.5 > 1 -> three committed
    fac = D.select("factor", opts, conf, conf, elig, jnp.asarray([0]), key)
    assert np.asarray(fac)[0].tolist() == [True, False, True, False, False, False, False, True]
    ent = jnp.asarray([[0.05, 2.0, 0.1, 0.3, 0.0, 1.0, 0.02, 0.5]])
    eb = D.select("eb", D.DiffusionOptions(gen_length=8, block_length=8, eb_gamma=0.2), conf, ent, elig,
                  jnp.asarray([0]), key)
    # ascending entropy among eligible: .02 .05 .1 .3 .5 ...; sums minus max: 0, .02, .07, .17, .47 -> 4 committed
    assert np.asarray(eb)[0].tolist() == [True, False, True, True, False, False, True, False]
    assert D.schedule_counts(jnp.asarray([10]), 4, jnp.arange(4)).tolist() == [3, 3, 2, 2]


def test_eos_stops_a_row_and_trims(dllm):
    free = pdecode.generate(dllm, PROMPTS, method="diffusion", max_new_tokens=16, block_length=4, steps=16,
                            stop_at_eos=False).tokens
    eos = free[0][2]
    m = pdecode.Model(cfg=dllm.cfg.replace(eos_token_ids=(eos,)), params=dllm.params)
    out = pdecode.generate(m, PROMPTS, method="diffusion", max_new_tokens=16, block_length=4, steps=16)
    # semi-AR blocks decode left to right, so the first answer EOS appears where the free run had it
    assert out.tokens[0] == free[0][:3]
    assert out.stats["nfe"] <= 16


@pytest.mark.parametrize("growth,divide,block", [(1, "seeds", 0), (4, "factor", 0), (4, "factor", 8)])
def test_dico_invariants(dllm, growth, divide, block):
    kw = dict(num_seeds=3, seed_low=0.0, seed_high=1.0, stability=1.0, conquer_growth=growth, divide_commit=divide,
              block_length=block)
    out = pdecode.generate(dllm, PROMPTS, method="dico", max_new_tokens=32, stop_at_eos=False, **kw)
    steps = np.array(out.stats["commit_step"])
    assert (steps >= 0).all() and all(len(t) == 32 and MASK not in t for t in out.tokens)
    assert out.stats["nfe"] <= 32  # every step commits at least one token
    ph = out.stats["phase_steps"]
    assert sum(ph) >= out.stats["nfe"] and ph[0] >= 1  # Divide ran
    if block:  # semi-AR blocks: a row finishes block k before it commits anything in block k + 1
        per_block = steps.reshape(len(PROMPTS), 32 // block, block)
        assert (per_block[:, :-1].max(axis=2) < per_block[:, 1:].min(axis=2)).all()
    for prompt, toks in zip(PROMPTS, out.tokens):  # batch == per row
        one = pdecode.generate(dllm, [prompt], method="dico", max_new_tokens=32, stop_at_eos=False, **kw)
        assert one.tokens[0] == toks


def test_before_answer_end():
    x = jnp.asarray([[7, 7, MASK, EOS, MASK, EOS, 7], [7, MASK, MASK, MASK, MASK, MASK, MASK]])
    masked = x == MASK
    canvas = jnp.asarray([[False, True, True, True, True, True, True]] * 2)
    got = np.asarray(D.before_answer_end(x, masked, canvas, (EOS,)))
    assert got[0].tolist() == [False, True, True, False, False, False, False]  # up to the first committed EOS
    assert got[1].tolist() == canvas[1].tolist()  # no EOS committed yet: the whole canvas


@pytest.mark.parametrize("method,opts", [("diffusion", dict(rule="threshold", threshold=0.5, block_length=16)),
                                         ("dico", dict(num_seeds=3, seed_low=0.0, seed_high=1.0, stability=1.0))])
def test_nothing_after_a_committed_eos_is_decoded(dllm, method, opts):
    free = pdecode.generate(dllm, PROMPTS, method=method, max_new_tokens=16, stop_at_eos=False, **opts).tokens
    eos = max(set(free[0]), key=free[0].count)  # the most frequent token of a free run plays EOS
    m = pdecode.Model(cfg=dllm.cfg.replace(eos_token_ids=(eos,)), params=dllm.params)
    out = pdecode.generate(m, PROMPTS, method=method, max_new_tokens=16, **opts)
    steps = np.array(out.stats["commit_step"])
    ended = 0
    for r, toks in enumerate(out.tokens):
        n = len(toks)
        assert MASK not in toks
        if toks and toks[-1] == eos and n < 16:  # the answer ended at an EOS: nothing after it was committed later
            ended += 1
            assert (steps[r, n:] <= steps[r, n - 1]).all()
    assert ended >= 2  # the check above ran on real rows


def test_dual_cache_refreshed_every_step_equals_no_cache(dllm):
    kw = dict(method="diffusion", max_new_tokens=16, stop_at_eos=False, rule="threshold", threshold=0.3,
              block_length=8)
    plain = pdecode.generate(dllm, PROMPTS, **kw)
    fresh = pdecode.generate(dllm, PROMPTS, cache="dual", refresh_every=1, **kw)
    assert fresh.tokens == plain.tokens
    assert fresh.stats["commit_step"] == plain.stats["commit_step"]
    stale = pdecode.generate(dllm, PROMPTS, cache="dual", **kw)  # the plain dual cache does differ here
    assert (stale.tokens, stale.stats["commit_step"]) != (plain.tokens, plain.stats["commit_step"])
    with pytest.raises(pdecode.ConfigError, match="refresh_every applies to a KV cache"):
        pdecode.generate(dllm, PROMPTS, refresh_every=2, **kw)


@pytest.mark.parametrize("cache", ["dual", "prefix"])
def test_guidance_works_with_a_kv_cache(dllm, cache):
    """Classifier-free guidance with a cache: refreshed every step, the cached guided run equals the uncached guided
    one (the unconditional pass keeps a cache of its own) and differs from the unguided run; both passes are
    counted. (It was silently dropped with a cache while the forwards counter still doubled.)"""
    kw = dict(method="diffusion", max_new_tokens=16, stop_at_eos=False, rule="threshold", threshold=0.3,
              block_length=8)
    guided = pdecode.generate(dllm, PROMPTS, cfg_scale=2.0, **kw)
    cached = pdecode.generate(dllm, PROMPTS, cfg_scale=2.0, cache=cache, refresh_every=1, **kw)
    plain = pdecode.generate(dllm, PROMPTS, cache=cache, refresh_every=1, **kw)
    assert cached.tokens == guided.tokens and cached.tokens != plain.tokens
    assert cached.stats["target_forwards"] == 2 * cached.stats["steps"]
    assert plain.stats["target_forwards"] == plain.stats["steps"]
    stale = pdecode.generate(dllm, PROMPTS, cfg_scale=2.0, cache=cache, **kw)  # refreshed only at block starts
    assert all(len(t) == 16 and MASK not in t for t in stale.tokens)


@pytest.mark.parametrize("method,opts", [("diffusion", dict(rule="threshold", threshold=0.5, block_length=8)),
                                         ("diffusion", dict(block_length=8, steps=16, cache="dual")),
                                         ("dico", dict(num_seeds=3, seed_low=0.0, seed_high=1.0, stability=1.0))])
def test_top_k_and_top_p_are_honoured(dllm, method, opts):
    """top_k=1 (or a tiny top_p) leaves one token to draw: temperature 1 then decodes exactly as greedy, while
    plain temperature-1 sampling does not. (Both were accepted and ignored.)"""
    kw = dict(method=method, max_new_tokens=16, stop_at_eos=False, **opts)
    greedy = pdecode.generate(dllm, PROMPTS, **kw).tokens
    assert pdecode.generate(dllm, PROMPTS, temperature=1.0, top_k=1, seed=3, **kw).tokens == greedy
    assert pdecode.generate(dllm, PROMPTS, temperature=1.0, top_p=1e-6, seed=3, **kw).tokens == greedy
    assert pdecode.generate(dllm, PROMPTS, temperature=1.0, seed=3, **kw).tokens != greedy
    # top-k 3: every committed token is among the model's 3 most likely at the step it was committed; checked on
    # the first step's commits, whose logits are those of the all-mask canvas
    out = pdecode.generate(dllm, PROMPTS, temperature=5.0, top_k=3, seed=1, **kw)
    for prompt, toks, steps in zip(PROMPTS, out.tokens, out.stats["commit_step"]):
        lg = np.array(pdecode.forward_logits(dllm, [prompt + [MASK] * 16]))[0, len(prompt):]
        lg[:, MASK] = -np.inf
        top3 = np.argsort(-lg, axis=-1)[:, :3]
        first = [j for j, st in enumerate(steps) if st == 0]
        assert first and all(toks[j] in top3[j] for j in first)


@pytest.mark.parametrize("opts", [dict(rule="threshold", threshold=0.5, block_length=4),
                                  dict(rule="threshold", threshold=0.5, block_length=4, cache="dual")])
def test_rows_advance_through_blocks_on_their_own(dllm, opts):
    """Per-row semi-AR blocks: a batch takes as many steps as its slowest row alone (rows in lockstep would wait
    for the slowest row in every block), each row finishes block k before it commits in block k + 1, and the
    batch decodes every row as it would alone."""
    kw = dict(method="diffusion", max_new_tokens=16, stop_at_eos=False, **opts)
    batch = pdecode.generate(dllm, PROMPTS, **kw)
    singles = [pdecode.generate(dllm, [p], **kw) for p in PROMPTS]
    assert batch.tokens == [s.tokens[0] for s in singles]
    assert batch.stats["steps"] == max(s.stats["steps"] for s in singles)
    assert batch.stats["nfe"] == pytest.approx(np.mean([s.stats["nfe"] for s in singles]))
    steps = np.array(batch.stats["commit_step"]).reshape(len(PROMPTS), 4, 4)
    assert (steps[:, :-1].max(axis=2) < steps[:, 1:].min(axis=2)).all()


def test_shifted_model_cache_equals_no_cache(dllm):
    """With the AR shift (position i predicted from the hidden state at i - 1, as code-dllm is trained) a dual or
    prefix cache refreshed every step decodes exactly as the uncached sampler, and the shift changes the output."""
    shifted = pdecode.Model(cfg=dllm.cfg.replace(diffusion_shift=True), params=dllm.params)
    kw = dict(method="diffusion", max_new_tokens=16, stop_at_eos=False, rule="threshold", threshold=0.3,
              block_length=8)
    plain = pdecode.generate(shifted, PROMPTS, **kw)
    for cache in ("dual", "prefix"):
        assert pdecode.generate(shifted, PROMPTS, cache=cache, refresh_every=1, **kw).tokens == plain.tokens
    assert plain.tokens != pdecode.generate(dllm, PROMPTS, **kw).tokens


def test_prob_stats_match_softmax():
    lg = jnp.asarray([[[2.0, 1.0, 0.5, -1.0], [3.0, 3.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0]]])
    x0 = jnp.asarray([[0, 1, 2]])
    c, first, second = D.prob_stats(lg, x0)
    p = np.asarray(jax.nn.softmax(lg, axis=-1))[0]
    assert np.allclose(np.asarray(c)[0], p[[0, 1, 2], [0, 1, 2]], atol=1e-6)
    top = np.sort(p, axis=-1)[:, ::-1]
    assert np.allclose(np.asarray(first)[0], top[:, 0], atol=1e-6)
    assert np.allclose(np.asarray(second)[0], top[:, 1], atol=1e-6)  # ties: the second equals the first


def test_dico_pieces():
    member = jnp.asarray([[False, True, True, False, True, False, False, True, True, True]])
    assert np.asarray(DC.runs_id(member))[0].tolist() == [-1, 0, 0, -1, 1, -1, -1, 2, 2, 2]
    # two seeds whose growth touches merge into one run (one cluster)
    masked = jnp.ones((1, 10), bool)
    conf = jnp.full((1, 10), 0.9)
    seeds = jnp.zeros((1, 10), bool).at[0, 2].set(True).at[0, 6].set(True)
    grown = DC.grow(seeds, masked, conf, 0.5, 2)
    assert np.asarray(grown)[0].tolist() == [True] * 9 + [False]
    assert int(np.asarray(DC.runs_id(grown)).max()) == 0
    # soft-NMS spreads seeds: with a peaked score the second pick is not the neighbour
    score = jnp.asarray([[0.1, 0.5, 0.9, 0.89, 0.88, 0.2, 0.3, 0.4, 0.6, 0.1]])
    picks = np.nonzero(np.asarray(DC.pick_seeds(score, jnp.ones((1, 10), bool), 2, 3.0))[0])[0].tolist()
    assert 2 in picks and 3 not in picks
    # factor rule inside clusters: each cluster decides on its own
    c = jnp.asarray([[0.99, 0.6, 0.0, 0.95, 0.9, 0.85]])
    cid = jnp.asarray([[0, 0, -1, 1, 1, 1]])
    got = DC.factor_in_clusters(c, cid >= 0, cid)
    # cluster 0: .99 (2*.01 < 1) yes, .6 (3*.4 = 1.2) no; cluster 1: .95 .9 .85 -> 2*.05, 3*.1, 4*.15=.6 all < 1
    assert np.asarray(got)[0].tolist() == [True, False, False, True, True, True]


def test_errors(dllm, tiny):
    with pytest.raises(pdecode.InputError, match="autoregressive"):
        pdecode.generate(tiny, [[1, 2]], method="diffusion")
    with pytest.raises(pdecode.ConfigError, match="multiple of block_length"):
        pdecode.generate(dllm, [[1, 2]], method="diffusion", max_new_tokens=10, block_length=4)
    with pytest.raises(pdecode.InputError, match="rule.*must be one of schedule, threshold, factor, eb"):
        pdecode.generate(dllm, [[1, 2]], method="diffusion", max_new_tokens=8, rule="nope")


def test_masked_diffusion_objective_decreases():
    from train.loop import TrainConfig, train
    from train.objectives import masked_diffusion_loss

    cfg = ModelConfig(vocab_size=16, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=2,
                      num_kv_heads=1, head_dim=16, causal=False, mask_token_id=2)
    def batch(i):
        r = np.random.default_rng(i)
        start = r.integers(3, 8, size=(8, 1))
        toks = ((start + np.arange(20)[None]) % 13 + 3).astype(np.int32)  # counting sequences
        return toks, np.ones_like(toks, bool), np.full((8,), 20, np.int32)

    loss = masked_diffusion_loss(cfg, 2)
    p0 = init_params(cfg, jax.random.PRNGKey(0))
    probe = jax.tree.map(jnp.asarray, batch(999))
    before = float(loss(p0, None, probe, jax.random.PRNGKey(1))[0])
    p1, _ = train(loss, p0, None, batch, TrainConfig(steps=60, lr=1e-2, warmup=5, eval_every=1000,
                                                    ckpt_every=1000, log_every=30))
    after = float(loss(p1, None, probe, jax.random.PRNGKey(1))[0])
    # heavily masked sequences stay uncertain, so the loss cannot vanish; it must fall clearly
    assert after < 0.8 * before
