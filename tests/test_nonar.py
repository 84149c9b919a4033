"""Non-autoregressive generation beyond the diffusion samplers: one-shot and Mask-Predict never leave a mask, stay
within their forward budget (T x beams + the length pass), pick lengths from the EOS distribution, keep the best
beam; the length distribution against a brute-force reference."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pdecode
from pdecode.config import ModelConfig
from pdecode.decode import mask_predict as mp
from pdecode.model.transformer import init_params

V, MASK, EOS = 24, 2, 0
PROMPTS = [[5, 6, 7, 8], [9, 10], [11, 12, 13, 14, 15, 16, 17], [3]]


@pytest.fixture(scope="module")
def dllm():
    cfg = ModelConfig(vocab_size=V, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=2, num_kv_heads=1,
                      head_dim=16, max_position_embeddings=512, causal=False, mask_token_id=MASK,
                      eos_token_ids=(EOS,), pad_token_id=1, diffusion_shift=True)
    return pdecode.Model(cfg=cfg, params=init_params(cfg, jax.random.PRNGKey(0), std=0.3), name="tiny-dllm")


def test_length_distribution_matches_brute_force():
    rng = np.random.default_rng(0)
    p = rng.uniform(0.05, 0.6, size=(3, 6))
    dist = np.asarray(mp.length_distribution(jnp.asarray(p)))
    for b in range(3):
        want = [p[b, j] * np.prod(1 - p[b, :j]) for j in range(6)] + [np.prod(1 - p[b])]
        np.testing.assert_allclose(dist[b], want, rtol=1e-5)
        assert abs(dist[b].sum() - 1) < 1e-5


CASES = [("oneshot", dict()), ("oneshot", dict(beams=1)), ("oneshot", dict(length="full", beams=1)),
         ("mask_predict", dict(iterations=4, beams=2)), ("mask_predict", dict(iterations=6, beams=1))]


@pytest.mark.parametrize("method,opts", CASES, ids=[f"{m}-{i}" for i, (m, _) in enumerate(CASES)])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_no_mask_left_and_forward_budget(dllm, method, opts, temperature):
    g = 16
    out = pdecode.generate(dllm, PROMPTS, method=method, max_new_tokens=g, temperature=temperature, seed=1, **opts)
    t = opts.get("iterations", 1) * opts.get("beams", 3) + (0 if opts.get("length") == "full" else 1)
    assert out.stats["target_forwards"] == t  # T x beams + the length pass
    for toks, n in zip(out.tokens, out.stats["length"]):
        assert MASK not in toks and 1 <= len(toks) <= g
        assert (toks[-1] == EOS and EOS not in toks[:-1]) or (len(toks) == g and EOS not in toks)
        assert len(toks) <= n + 1


def test_beams_take_the_most_likely_lengths_and_keep_the_best(dllm):
    """The lengths decoded are the top `beams` of the length pass's distribution (the first is the one a single beam
    decodes), distinct, and the kept one is the beam with the highest mean log-probability."""
    out = pdecode.generate(dllm, PROMPTS, method="mask_predict", iterations=3, beams=3, max_new_tokens=12)
    one = pdecode.generate(dllm, PROMPTS, method="mask_predict", iterations=3, beams=1, max_new_tokens=12)
    scores, lengths = np.asarray(out.stats["beam_scores"]), np.asarray(out.stats["beam_lengths"])
    for r in range(len(PROMPTS)):
        assert len(set(lengths[r])) == 3 and lengths[r][0] == one.stats["length"][r]
        assert out.stats["length"][r] == lengths[r][np.argmax(scores[r])]
        assert out.stats["length_probability"][r] <= one.stats["length_probability"][r] + 1e-6


def test_mask_predict_refines(dllm):
    """More iterations re-predict the least confident tokens: the kept beam's mean log-probability does not fall."""
    a = pdecode.generate(dllm, PROMPTS, method="mask_predict", iterations=1, beams=1, length="full",
                         max_new_tokens=12)
    b = pdecode.generate(dllm, PROMPTS, method="mask_predict", iterations=8, beams=1, length="full",
                         max_new_tokens=12)
    assert np.mean(b.stats["beam_scores"]) >= np.mean(a.stats["beam_scores"]) - 1e-3
    assert a.tokens != b.tokens


def test_errors(dllm, tiny):
    from pdecode.errors import ConfigError, InputError

    with pytest.raises(InputError, match="masked-diffusion"):
        pdecode.generate(tiny, PROMPTS[:1], method="oneshot", max_new_tokens=8)
    with pytest.raises(ConfigError, match="beams must be 1"):
        pdecode.generate(dllm, PROMPTS[:1], method="oneshot", length="full", beams=2, max_new_tokens=8)


def test_glancing_objective_trains_one_pass_prediction():
    """The GLAT option: a model trained with glancing predicts counting sequences in one pass from all masks better
    than before, and the loss it reports is the cross-entropy on the positions it was not shown."""
    from train.loop import TrainConfig, train
    from train.objectives import masked_diffusion_loss

    cfg = ModelConfig(vocab_size=16, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=2,
                      num_kv_heads=1, head_dim=16, causal=False, mask_token_id=2)

    def batch(i):
        r = np.random.default_rng(i)
        start = r.integers(3, 8, size=(8, 1))
        toks = ((start + np.arange(12)[None]) % 13 + 3).astype(np.int32)
        maskable = np.ones_like(toks, bool)
        maskable[:, :2] = False  # the first two tokens are the prompt
        return toks, maskable, np.full((8,), 12, np.int32)

    def one_pass_accuracy(params):
        toks, maskable, _ = batch(999)
        x = np.where(maskable, 2, toks)
        lg = pdecode.forward_logits(pdecode.Model(cfg=cfg, params=params), x)
        return float(np.mean((np.argmax(np.asarray(lg), -1) == toks)[maskable]))

    loss = masked_diffusion_loss(cfg, 2, glancing=0.5)
    p0 = init_params(cfg, jax.random.PRNGKey(0))
    p1, _ = train(loss, p0, None, batch, TrainConfig(steps=80, lr=1e-2, warmup=5, eval_every=1000, ckpt_every=1000,
                                                    log_every=40))
    assert one_pass_accuracy(p1) > one_pass_accuracy(p0) + 0.3


@pytest.mark.parametrize("method,opts,mode", [("diffusion", dict(rule="threshold", threshold=0.5), "cap"),
                                              ("diffusion", dict(rule="eb", block_length=8), "rescale"),
                                              ("dico", dict(block_length=8), "conf")], ids=["threshold", "eb", "dico"])
def test_remasking_corrects_and_ends(dllm, method, opts, mode):
    """ReMDM remasking: tokens really get re-masked (and decoded again: more forwards), each position at most once,
    the output holds no mask, and eta 0 is the sampler without remasking."""
    g = 16
    base = pdecode.generate(dllm, PROMPTS, method=method, max_new_tokens=g, **opts)
    out = pdecode.generate(dllm, PROMPTS, method=method, max_new_tokens=g, remask=mode, remask_eta=1.0, seed=3,
                           **opts)
    assert 0 < out.stats["remasked_tokens"] <= g * len(PROMPTS)
    assert out.stats["nfe"] > base.stats["nfe"]
    assert all(MASK not in t for t in out.tokens)
    zero = pdecode.generate(dllm, PROMPTS, method=method, max_new_tokens=g, remask=mode, remask_eta=0.0, **opts)
    assert zero.tokens == base.tokens and zero.stats["remasked_tokens"] == 0


def test_remask_sigma():
    """sigma_max = min(1, masks left / tokens decoded before): nothing is re-masked once the region is full."""
    from pdecode.decode import canvas as cvs

    x = jnp.asarray([[5, 6, MASK, MASK], [5, 6, 7, 8]])
    masked = x == MASK
    commit = jnp.zeros_like(masked)
    region = jnp.ones_like(masked)
    conf = jnp.zeros(x.shape)
    hits = []
    for seed in range(200):
        _, _, _, hit = cvs.remask(x, masked, commit, region, conf, jnp.zeros_like(masked), jnp.zeros((2,), bool),
                                  MASK, "rescale", 1.0, jax.random.PRNGKey(seed))
        hits.append(np.asarray(hit))
    hits = np.asarray(hits)
    assert hits[:, 1].sum() == 0  # the full row: sigma 0
    assert abs(hits[:, 0, :2].mean() - 1.0) < 1e-9  # 2 left / 2 decoded: sigma 1
    with pytest.raises(Exception, match="adaptive rule"):
        from pdecode.decode.diffusion import DiffusionOptions

        DiffusionOptions(remask="cap")
