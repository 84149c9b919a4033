"""Self-drafting heads: Medusa, EAGLE (1/2/3), MTP — decoding equals AR (greedy) and is lossless (sampling),
objectives train, shapes at scale, checkpoint interop and the DeepSeek concatenation order."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats as sstats

import pdecode
from pdecode.checkpoint import heads_io
from pdecode.config import ModelConfig
from pdecode.model import heads as H
from pdecode.model.transformer import init_from_specs, init_params, is_spec
from tests.helpers import make_hf_model

PROMPTS = [[5, 6, 7, 8, 9, 5, 6, 7], [11, 12, 13], list(range(20, 50)), [3, 4], [40, 41, 42, 40, 41, 42, 40]]


def _with_heads(m, kind, hcfg, seed=0, scale=0.05):
    params = init_from_specs(hcfg.specs(m.cfg), jax.random.PRNGKey(seed), std=scale)
    return pdecode.Model(cfg=m.cfg, params=m.params, tokenizer=m.tokenizer, extras={kind: (hcfg, params)})


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    d = tmp_path_factory.mktemp("t")
    make_hf_model("llama", d, seed=0, num_hidden_layers=4)
    return pdecode.load(d)


HEAD_CASES = [
    ("medusa", H.MedusaConfig(num_heads=3), {}),
    ("medusa", H.MedusaConfig(num_heads=4, own_head=True), {"tree": [[0], [1], [0, 0], [0, 0, 0], [0, 0, 0, 0]]}),
    ("eagle", H.EagleConfig(), {"tree_top_k": 3, "depth": 4, "total_tokens": 10}),
    ("eagle", H.EagleConfig(fuse_layers=(0, 2, 3)), {"tree_top_k": 2, "depth": 3, "total_tokens": 5}),
    ("eagle", H.EagleConfig(fc_bias=True), {"tree_top_k": 1, "depth": 3, "total_tokens": 3}),
    # EAGLE-3 with a reduced draft vocabulary (the first 8 ids): drafts only those, verified over the whole vocabulary
    ("eagle", H.EagleConfig(fuse_layers=(0, 1), draft_vocab=8), {"tree_top_k": 3, "depth": 3, "total_tokens": 6}),
    ("mtp", H.MTPConfig(num_modules=1), {}),
    ("mtp", H.MTPConfig(num_modules=2, emb_first=True), {"tree_top_k": 3, "depth": 2, "total_tokens": 6}),
    ("mtp", H.MTPConfig(num_modules=1), {"depth": 3}),  # a chain of 3: total_tokens follows depth
]


@pytest.mark.parametrize("kind,hcfg,opts", HEAD_CASES, ids=[f"{k}-{i}" for i, (k, _, _) in enumerate(HEAD_CASES)])
def test_greedy_identical_to_ar(target, kind, hcfg, opts):
    m = _with_heads(target, kind, hcfg)
    ref = pdecode.generate(target, PROMPTS, max_new_tokens=20, stop_at_eos=False)
    out = pdecode.generate(m, PROMPTS, method=kind, max_new_tokens=20, stop_at_eos=False, **opts)
    assert out.tokens == ref.tokens
    assert out.stats["tokens_per_forward"] >= 1.0
    if kind == "mtp" and opts == {"depth": 3}:
        assert len(out.stats["accepted_histogram"]) == 4  # 0..3 drafted tokens accepted: three were drafted


def test_heads_that_copy_the_target_are_accepted(target):
    """An EAGLE drafter whose fc passes the feature through and whose block is a no-op predicts the target's own
    next token from the feature of the previous position... is not the case; instead Medusa head 0 with zero W
    predicts what the LM head predicts from the same hidden state: on a repetitive prompt it is often right."""
    mcfg = H.MedusaConfig(num_heads=2)
    params = init_from_specs(mcfg.specs(target.cfg), jax.random.PRNGKey(0))
    params = H.medusa_init_zero(params)
    m = pdecode.Model(cfg=target.cfg, params=target.params, extras={"medusa": (mcfg, params)})
    prompt = [7, 8] * 15
    out = pdecode.generate(m, [prompt], method="medusa", max_new_tokens=24, stop_at_eos=False,
                           tree=[[0], [1], [0, 0]])
    assert out.tokens == pdecode.generate(target, [prompt], max_new_tokens=24, stop_at_eos=False).tokens


@pytest.mark.parametrize("kind,hcfg,opts", [HEAD_CASES[0], HEAD_CASES[2], HEAD_CASES[5], HEAD_CASES[7]],
                         ids=["medusa", "eagle", "eagle3-vocab", "mtp"])
def test_sampling_is_lossless(tmp_path, kind, hcfg, opts):
    from tests.test_speculative import _exact_marginals

    make_hf_model("llama", tmp_path, seed=10, vocab_size=16, hidden_size=32, intermediate_size=48,
                  num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, bos_token_id=None,
                  eos_token_id=None, pad_token_id=0)
    t = pdecode.load(tmp_path)
    m = _with_heads(t, kind, hcfg, seed=3, scale=0.3)
    prompt = [3, 7, 3, 7, 3]
    n = 12000
    out = pdecode.generate(m, [prompt] * n, method=kind, max_new_tokens=3, temperature=1.0, seed=2,
                           stop_at_eos=False, **opts)
    toks = np.array(out.tokens)
    margs = _exact_marginals(t, prompt, 3)
    for i in range(3):
        counts = np.bincount(toks[:, i], minlength=16)
        assert sstats.chisquare(counts, margs[i] / margs[i].sum() * n).pvalue > 1e-4, f"token {i + 1}"


def _exit_adapter(m, exit_layer, seed=0, scale=0.3):
    """``m`` with a random early-exit adapter attached (W2 random too: the adapter changes the draft)."""
    xcfg = H.ExitConfig(exit_layer=exit_layer)
    xp = init_from_specs(xcfg.specs(m.cfg), jax.random.PRNGKey(seed), std=scale)
    xp["w2"] = scale * jax.random.normal(jax.random.PRNGKey(seed + 1), xp["w2"].shape)
    return pdecode.Model(cfg=m.cfg, params=m.params, tokenizer=m.tokenizer, extras={"layerskip": (xcfg, xp)})


def test_exit_adapter_drafts_for_layerskip(target, tmp_path):
    """An early-exit adapter (layerskip heads): untrained it is the plain early exit; attached, layerskip drafts
    through it, greedy output equal to ar; it round-trips through a heads directory; options that contradict it are
    refused."""
    from pdecode.model.transformer import final_norm, init_from_specs as init, unembed
    from train.objectives import causal_hidden

    xcfg = H.ExitConfig(exit_layer=2)
    xp = init(xcfg.specs(target.cfg), jax.random.PRNGKey(0))
    xp["norm"] = target.params["final_norm"]
    tok = jnp.asarray([PROMPTS[2]])
    _, lh = causal_hidden(target.params, target.cfg, tok, (1,))
    plain = unembed(target.params, target.cfg, final_norm(target.params, target.cfg, lh[0]))
    np.testing.assert_allclose(H.exit_logits(xp, target.cfg, target.params, lh[0]), plain, atol=1e-5)

    m = _exit_adapter(target, 2)
    ref = pdecode.generate(target, PROMPTS, max_new_tokens=20, stop_at_eos=False)
    out = pdecode.generate(m, PROMPTS, method="layerskip", gamma=3, max_new_tokens=20, stop_at_eos=False)
    plain = pdecode.generate(target, PROMPTS, method="layerskip", exit_layer=2, gamma=3, max_new_tokens=20,
                             stop_at_eos=False)
    assert out.tokens == ref.tokens == plain.tokens
    assert out.stats["accepted_histogram"] != plain.stats["accepted_histogram"]  # the adapter drafted, not the exit
    heads_io.save_heads(tmp_path / "x", "layerskip", H.ExitConfig(exit_layer=2), m.extras["layerskip"][1],
                        base_model=str(target.path))
    back = pdecode.load(tmp_path / "x")
    again = pdecode.generate(back, PROMPTS, method="layerskip", gamma=3, max_new_tokens=20, stop_at_eos=False)
    assert again.tokens == ref.tokens and again.stats["accepted_histogram"] == out.stats["accepted_histogram"]
    for bad in ({"exit_layer": 3}, {"skip": [0]}):
        with pytest.raises(pdecode.ConfigError, match="exit adapter after layer 2"):
            pdecode.generate(m, PROMPTS, method="layerskip", max_new_tokens=4, **bad)
    with pytest.raises(pdecode.ConfigError, match="exit_layer < 4"):
        H.ExitConfig(exit_layer=4).specs(target.cfg)


def test_exit_adapter_sampling_is_lossless(tmp_path):
    from tests.test_speculative import _exact_marginals

    make_hf_model("llama", tmp_path, seed=10, vocab_size=16, hidden_size=32, intermediate_size=48,
                  num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, bos_token_id=None,
                  eos_token_id=None, pad_token_id=0)
    t = pdecode.load(tmp_path)
    m = _exit_adapter(t, 1, seed=3)
    prompt, n = [3, 7, 3, 7, 3], 12000
    out = pdecode.generate(m, [prompt] * n, method="layerskip", gamma=2, max_new_tokens=3, temperature=1.0, seed=2,
                           stop_at_eos=False)
    toks, margs = np.array(out.tokens), _exact_marginals(t, prompt, 3)
    for i in range(3):
        counts = np.bincount(toks[:, i], minlength=16)
        assert sstats.chisquare(counts, margs[i] / margs[i].sum() * n).pvalue > 1e-4, f"token {i + 1}"
def test_typical_acceptance_is_opt_in_and_runs(target):
    m = _with_heads(target, "medusa", H.MedusaConfig(num_heads=3))
    out = pdecode.generate(m, PROMPTS, method="medusa", max_new_tokens=12, temperature=0.7, typical=True,
                           stop_at_eos=False)
    assert all(len(t) == 12 for t in out.tokens)


def test_missing_heads_error(target):
    with pytest.raises(pdecode.InputError, match="needs eagle heads"):
        pdecode.generate(target, [[1, 2]], method="eagle")
    m = _with_heads(target, "medusa", H.MedusaConfig(num_heads=2))
    with pytest.raises(pdecode.ConfigError, match="2 heads"):
        pdecode.generate(m, [[1, 2]], method="medusa", tree="medusa-18")


# ------------------------------------------------------------------------------------------------ training
CFG = ModelConfig(vocab_size=32, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=2, num_kv_heads=1,
                  head_dim=16, max_position_embeddings=64, tie_word_embeddings=True)


def _pattern_batches():
    from train.data import TokenBatches

    rng = np.random.default_rng(0)
    base = np.tile(np.arange(8), 800)
    stream = np.where(rng.random(len(base)) < 0.05, rng.integers(0, 32, len(base)), base).astype(np.int32)
    return TokenBatches(stream, 16, 8)


@pytest.fixture(scope="module")
def trained_base():
    from train.loop import TrainConfig, train
    from train.objectives import lm_loss

    params, _ = train(lm_loss(CFG), init_params(CFG, jax.random.PRNGKey(0)), None, _pattern_batches().batch,
                      TrainConfig(steps=60, lr=1e-2, warmup=5, eval_every=1000, ckpt_every=1000, log_every=30))
    return params


@pytest.mark.parametrize("name", ["medusa1", "medusa2", "eagle1", "eagle3", "eagle3-vocab", "mtp-posthoc",
                                  "mtp-parallel", "mtp-native", "exit-adapter"])
def test_objective_decreases(trained_base, name):
    from train.loop import TrainConfig, train
    from train.objectives import eagle_loss, exit_loss, medusa_loss, mtp_loss

    key = jax.random.PRNGKey(1)
    if name == "exit-adapter":  # LayerSkip's early-exit loss on an adapter after the first block (base frozen)
        xcfg = H.ExitConfig(exit_layer=1)
        obj, trainable, frozen = exit_loss(CFG, xcfg), init_from_specs(xcfg.specs(CFG), key), trained_base
    elif name.startswith("medusa"):
        mcfg = H.MedusaConfig(num_heads=2)
        heads = init_from_specs(mcfg.specs(CFG), key)
        if name == "medusa1":
            obj, trainable, frozen = medusa_loss(CFG, mcfg), heads, trained_base
        else:
            obj, trainable, frozen = medusa_loss(CFG, mcfg, joint=True), {"base": trained_base, "heads": heads}, None
    elif name == "eagle3-vocab":  # a draft vocabulary of the 12 tokens the pattern uses most (maps frozen)
        ecfg = H.EagleConfig(fuse_layers=(0, 1), draft_vocab=12)
        obj = eagle_loss(CFG, ecfg, ttt_steps=3)
        ids, cover = H.most_frequent_tokens(_pattern_batches().stream, 12, CFG.vocab_size)
        assert set(range(8)) <= set(ids.tolist()) and cover > 0.9
        ep = init_from_specs(ecfg.specs(CFG), key)
        trainable = {k: v for k, v in ep.items() if k not in H.VOCAB_MAPS}
        frozen = (trained_base, {k: jnp.asarray(v) for k, v in H.draft_vocab_maps(ids, CFG.vocab_size).items()})
    elif name.startswith("eagle"):
        ecfg = H.EagleConfig(fuse_layers=(0, 1)) if name == "eagle3" else H.EagleConfig()
        obj = eagle_loss(CFG, ecfg, ttt_steps=3 if name == "eagle3" else 1)
        trainable, frozen = init_from_specs(ecfg.specs(CFG), key), trained_base
    else:
        mcfg = H.MTPConfig(num_modules=2, kind="parallel" if name == "mtp-parallel" else "sequential")
        mp = init_from_specs(mcfg.specs(CFG), key)
        if name == "mtp-native":
            obj = mtp_loss(CFG, mcfg, native=True)
            trainable, frozen = {"base": init_params(CFG, key), "mtp": mp}, None
        else:
            obj, trainable, frozen = mtp_loss(CFG, mcfg), mp, trained_base
    batches = _pattern_batches()
    probe = jnp.asarray(batches.batch(10_000))
    before = float(obj(trainable, frozen, probe, None)[0])
    trained, _ = train(obj, trainable, frozen, batches.batch,
                       TrainConfig(steps=40, lr=1e-2, warmup=4, eval_every=1000, ckpt_every=1000, log_every=20))
    after = float(obj(trained, frozen, probe, None)[0])
    assert after < 0.7 * before, (before, after)


def test_draft_vocabulary_maps_and_logits(trained_base):
    """EAGLE-3's reduced vocabulary: d2t offsets and the t2d mask as released checkpoints carry them; the head reads
    only the draft rows and its logits come back over the target's ids, -inf outside the draft vocabulary."""
    ids = np.array([30, 2, 7, 5])
    maps = H.draft_vocab_maps(ids, CFG.vocab_size)
    np.testing.assert_array_equal(np.arange(4) + maps["d2t"], [2, 5, 7, 30])  # sorted, target id = draft id + d2t
    assert maps["t2d"].dtype == bool and maps["t2d"].sum() == 4 and maps["t2d"][[2, 5, 7, 30]].all()
    with pytest.raises(pdecode.ConfigError, match="distinct"):
        H.draft_vocab_maps([3, 3], CFG.vocab_size)
    top, cover = H.most_frequent_tokens(np.array([5, 5, 5, 1, 1, 9, 2, 2]), 2, CFG.vocab_size)
    assert top.tolist() == [1, 5] and cover == pytest.approx(5 / 8)
    ecfg = H.EagleConfig(fuse_layers=(0, 1), draft_vocab=4)
    with pytest.raises(pdecode.ConfigError, match="draft_vocab must be in 1..32"):
        H.EagleConfig(draft_vocab=33).specs(CFG)
    ep = {**init_from_specs(ecfg.specs(CFG), jax.random.PRNGKey(3)), **maps}
    assert ep["lm_head"].shape == (CFG.hidden_size, 4)
    b, t = 2, 5
    args = (jnp.zeros((b, t), jnp.int32), jax.random.normal(jax.random.PRNGKey(4), (b, t, CFG.hidden_size)),
            jnp.broadcast_to(jnp.arange(t), (b, t)), jnp.tril(jnp.ones((t, t), bool))[None].repeat(b, 0))
    full, _, _ = H.eagle_step(ep, ecfg, CFG, trained_base, *args)
    small, _, _ = H.eagle_step(ep, ecfg, CFG, trained_base, *args, draft_space=True)
    assert full.shape == (b, t, CFG.vocab_size) and small.shape == (b, t, 4)
    np.testing.assert_array_equal(np.asarray(full[..., [2, 5, 7, 30]]), np.asarray(small))
    assert np.isneginf(np.delete(np.asarray(full), [2, 5, 7, 30], axis=-1)).all()


def test_head_shapes_at_scale():
    big = ModelConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_layers=32, num_heads=32,
                      num_kv_heads=8, head_dim=128, max_position_embeddings=8192)
    for hcfg in (H.MedusaConfig(num_heads=5), H.EagleConfig(), H.EagleConfig(fuse_layers=(2, 16, 29)),
                 H.MTPConfig(num_modules=2)):
        shapes = jax.eval_shape(lambda: init_from_specs(hcfg.specs(big), jax.random.PRNGKey(0)))
        n = sum(int(np.prod(s.shape)) for s in jax.tree.leaves(shapes))
        assert n > 0
    ecfg = H.EagleConfig(fuse_layers=(2, 16, 29))
    ep = jax.eval_shape(lambda: init_from_specs(ecfg.specs(big), jax.random.PRNGKey(0)))
    assert ep["fuse"].shape == (3 * 4096, 4096) and ep["fc"].shape == (8192, 4096)
    tp = jax.eval_shape(lambda: init_params(big, jax.random.PRNGKey(0)))
    b, t = 2, 7
    out = jax.eval_shape(lambda ep, tp: H.eagle_step(
        ep, ecfg, big, tp, jnp.zeros((b, t), jnp.int32), jnp.zeros((b, t, 4096)),
        jnp.zeros((b, t), jnp.int32), jnp.ones((b, t, t), bool)), ep, tp)
    assert out[0].shape == (b, t, 128256) and out[1].shape == (b, t, 4096)
    mcfg = H.MedusaConfig(num_heads=5)
    mp = jax.eval_shape(lambda: init_from_specs(mcfg.specs(big), jax.random.PRNGKey(0)))
    lg = jax.eval_shape(lambda mp, tp: H.medusa_logits(mp, mcfg, tp, big, jnp.zeros((b, 4096))), mp, tp)
    assert lg.shape == (5, b, 128256)


# ------------------------------------------------------------------------------------------------ checkpoints
def test_pdecode_heads_round_trip(target, tmp_path):
    hcfg = H.EagleConfig(fuse_layers=(0, 3))
    m = _with_heads(target, "eagle", hcfg)
    heads_io.save_heads(tmp_path / "h", "eagle", hcfg, m.extras["eagle"][1], base_model=str(target.path))
    m2 = pdecode.load(tmp_path / "h")
    assert m2.extras["eagle"][0] == hcfg
    for a, b in zip(jax.tree.leaves(m.extras["eagle"][1]), jax.tree.leaves(m2.extras["eagle"][1])):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    a = pdecode.generate(m, PROMPTS[:2], method="eagle", max_new_tokens=8)
    b = pdecode.generate(m2, PROMPTS[:2], method="eagle", max_new_tokens=8)
    assert a.tokens == b.tokens and a.stats["tokens_per_forward"] == b.stats["tokens_per_forward"]


def test_calibrated_paths_are_the_best_tree():
    """Medusa's tree construction against brute force: the n best paths by product of per-depth accuracies."""
    import itertools

    from pdecode.decode.tree import calibrated_paths

    acc = np.random.default_rng(0).uniform(0.01, 0.9, (3, 4))
    for n in (1, 5, 10, 30):
        paths, expected = calibrated_paths(acc, n)
        assert len(paths) == n and len({tuple(p) for p in paths}) == n
        assert all(p[:-1] in paths for p in paths if len(p) > 1)  # prefix-closed: a valid tree
        score = {p: np.prod([acc[i, r] for i, r in enumerate(p)])
                 for d in (1, 2, 3) for p in itertools.product(range(4), repeat=d)}
        best = sorted(score.values(), reverse=True)[:n]
        np.testing.assert_allclose(sorted(score[tuple(p)] for p in paths), sorted(best))
        np.testing.assert_allclose(expected, 1 + sum(best))
    with pytest.raises(pdecode.ConfigError):
        calibrated_paths(acc + 1, 3)


def test_medusa_uses_the_tree_calibrated_in_heads_json(target, tmp_path):
    hcfg = H.MedusaConfig(num_heads=3)
    m = _with_heads(target, "medusa", hcfg)
    acc = [[0.6, 0.2], [0.5, 0.1], [0.4, 0.1]]
    heads_io.save_heads(tmp_path / "h", "medusa", hcfg, m.extras["medusa"][1], base_model=str(target.path),
                        extra={"tree": [[0], [0, 0]], "tree_calibration": {"accuracy": acc}})
    m2 = pdecode.load(tmp_path / "h")
    ref = pdecode.generate(target, PROMPTS, max_new_tokens=16, stop_at_eos=False)
    shipped = pdecode.generate(m2, PROMPTS, method="medusa", max_new_tokens=16, stop_at_eos=False)
    rebuilt = pdecode.generate(m2, PROMPTS, method="medusa", max_new_tokens=16, stop_at_eos=False,
                               tree="calibrated:6")  # [0] .6, [0,0] .3, [1] .2, [0,0,0] .12, [0,1] .06, [1,0] .1
    default = pdecode.generate(m, PROMPTS, method="medusa", max_new_tokens=16, stop_at_eos=False)
    assert shipped.tokens == rebuilt.tokens == default.tokens == ref.tokens
    assert len(shipped.stats["accepted_histogram"]) == 3  # the shipped 2-deep tree, not the 3-deep default
    assert len(rebuilt.stats["accepted_histogram"]) == 4 == len(default.stats["accepted_histogram"])
    with pytest.raises(pdecode.ConfigError, match="calibrate-tree"):
        pdecode.generate(m, PROMPTS, method="medusa", max_new_tokens=4, tree="calibrated")


def test_medusa_rank_accuracy_matches_a_sort(target):
    """The calibration's accuracy table (the target token's rank in each head's order, counted without sorting)
    equals ranks read off a full sort of each head's logits."""
    from pdecode.model.transformer import unembed
    from train.heads import medusa_rank_accuracy
    from train.objectives import causal_hidden

    hcfg = H.MedusaConfig(num_heads=3)
    hp = _with_heads(target, "medusa", hcfg, scale=0.3).extras["medusa"][1]
    w = np.asarray(jax.random.randint(jax.random.PRNGKey(4), (8, 25), 0, target.cfg.vocab_size), np.int32)
    got = medusa_rank_accuracy(hp, hcfg, target.cfg, target.params, w, max_rank=4, start=3)
    h, _ = causal_hidden(target.params, target.cfg, jnp.asarray(w[:, :-1]))
    t_next = np.asarray(jnp.argmax(unembed(target.params, target.cfg, h), -1))
    logits = np.asarray(H.medusa_logits(hp, hcfg, target.params, target.cfg, h))
    order = np.argsort(-logits, axis=-1, kind="stable")  # larger first, ties to the lower id (top_k's order)
    for k in range(3):
        n = 24 - k - 1
        want = t_next[:, 3 + k + 1:]
        rank = np.argmax(order[k, :, 3:n] == want[..., None], axis=-1)
        np.testing.assert_allclose(got[k], [(rank == r).mean() for r in range(4)], atol=1e-6)


def test_medusa_tree_sized_by_the_measured_cost(target, tmp_path, monkeypatch):
    """tree="auto": calibrated trees of 1, 2, 4, ... nodes, each's expected tokens per step from the accuracy table
    (1.6, 1.9, 2.22, ...), weighed against each step's cost (here set by verify tokens): the best rate wins; none
    above ar's runs ar."""
    hcfg = H.MedusaConfig(num_heads=3)
    m = _with_heads(target, "medusa", hcfg)
    heads_io.save_heads(tmp_path / "h", "medusa", hcfg, m.extras["medusa"][1], base_model=str(target.path),
                        extra={"tree_calibration": {"accuracy": [[0.6, 0.2], [0.5, 0.1], [0.4, 0.1]]}})
    m2 = pdecode.load(tmp_path / "h")
    ref = pdecode.generate(target, PROMPTS, max_new_tokens=16, stop_at_eos=False)
    monkeypatch.setenv("PDECODE_VERIFY_COST", "2:1.0,3:1.05,5:1.5,9:3")  # rates 1.6, 1.81, 1.48, ...
    out = pdecode.generate(m2, PROMPTS, method="medusa", tree="auto", max_new_tokens=16, stop_at_eos=False)
    assert out.tokens == ref.tokens and out.stats["tree"] == 2 and "1.90 expected tokens" in out.stats["tree_note"]
    assert len(out.stats["accepted_histogram"]) == 3  # [0], [0, 0]: two deep
    monkeypatch.setenv("PDECODE_VERIFY_COST", "2:5")
    out = pdecode.generate(m2, PROMPTS, method="medusa", tree="auto", max_new_tokens=16, stop_at_eos=False)
    assert out.tokens == ref.tokens and out.stats["tree"] == 0 and "ran as ar" in out.stats["tree_note"]
    with pytest.raises(pdecode.ConfigError, match="calibrate-only"):
        pdecode.generate(m, PROMPTS, method="medusa", max_new_tokens=4, tree="auto")


def test_eagle_tree_sized_by_the_measured_cost(target, tmp_path, monkeypatch):
    """total_tokens="auto": the heads' calibrated trees (tokens per forward) weighed against each step's cost on
    the device (here set with PDECODE_VERIFY_COST, by verify tokens): the best rate wins, none above ar's runs ar."""
    hcfg = H.EagleConfig()
    m = _with_heads(target, "eagle", hcfg)
    trees = [{"tree_top_k": 1, "depth": 1, "total_tokens": 1, "tokens_per_forward": 1.2},
             {"tree_top_k": 2, "depth": 2, "total_tokens": 3, "tokens_per_forward": 1.6},
             {"tree_top_k": 3, "depth": 3, "total_tokens": 8, "tokens_per_forward": 2.0}]
    heads_io.save_heads(tmp_path / "h", "eagle", hcfg, m.extras["eagle"][1], base_model=str(target.path),
                        extra={"tree_sizes": {"trees": trees}})
    m2 = pdecode.load(tmp_path / "h")
    ref = pdecode.generate(target, PROMPTS, max_new_tokens=16, stop_at_eos=False)

    def run(**kw):
        out = pdecode.generate(m2, PROMPTS, method="eagle", max_new_tokens=16, stop_at_eos=False, **kw)
        assert out.tokens == ref.tokens
        return out

    # rates 1.2 / 1.1, 1.6 / 1.2 and 2.0 / 2.5: the 3-node tree (its verify holds 4 tokens)
    monkeypatch.setenv("PDECODE_VERIFY_COST", "2:1.1,4:1.2,9:2.5")
    out = run(total_tokens="auto")
    assert out.stats["tree"] == {"tree_top_k": 2, "depth": 2, "total_tokens": 3}
    assert "tree 3:" in out.stats["tree_note"] and len(out.stats["accepted_histogram"]) == 3
    monkeypatch.setenv("PDECODE_VERIFY_COST", "2:1.0,9:1.05")  # an accelerator's flat cost: the biggest tree
    assert run(total_tokens="auto").stats["tree"]["total_tokens"] == 8
    for costs in ("2:1.5,4:2,9:3",  # no tree beats ar: ar runs, and says why
                  "2:1.15,4:1.6,9:2"):  # the best (1 node, 1.04x) beats ar by less than the margin: ar too
        monkeypatch.setenv("PDECODE_VERIFY_COST", costs)
        out = run(total_tokens="auto")
        assert out.stats["tree"] == 0 and "ran as ar" in out.stats["tree_note"] and "1.10x margin" in out.stats[
            "tree_note"]
        assert out.stats["tokens_per_forward"] == 1.0
    with pytest.raises(pdecode.ConfigError, match="calibrate-only"):  # heads without the calibration
        pdecode.generate(m, PROMPTS, method="eagle", max_new_tokens=4, total_tokens="auto")
    with pytest.raises(pdecode.ConfigError, match="'auto'"):
        pdecode.generate(m2, PROMPTS, method="eagle", max_new_tokens=4, total_tokens="many")


def test_import_public_medusa_layout(target):
    rng = np.random.default_rng(0)
    d, v, k, n = target.cfg.hidden_size, target.cfg.vocab_size, 3, 1
    tensors = {}
    for h in range(k):
        tensors[f"{h}.0.linear.weight"] = rng.normal(size=(d, d)).astype(np.float32) * 0.05
        tensors[f"{h}.0.linear.bias"] = rng.normal(size=(d,)).astype(np.float32) * 0.05
        tensors[f"{h}.1.weight"] = rng.normal(size=(v, d)).astype(np.float32) * 0.05
    mcfg, params = heads_io.import_medusa(tensors, k, n)
    x = rng.normal(size=(2, d)).astype(np.float32)
    ours = np.asarray(H.medusa_logits(jax.tree.map(jnp.asarray, params), mcfg, target.params, target.cfg, x))
    for h in range(k):  # reference: x + SiLU(x W^T + b), then the head's Linear(D, V)
        z = x @ tensors[f"{h}.0.linear.weight"].T + tensors[f"{h}.0.linear.bias"]
        y = x + z / (1 + np.exp(-z))
        np.testing.assert_allclose(ours[h], y @ tensors[f"{h}.1.weight"].T, rtol=1e-4, atol=1e-5)


def test_import_public_eagle_layout_matches_a_manual_forward(target):
    """An EAGLE-1 file: fc (+bias) over [emb; feature], one Llama layer without input_layernorm."""
    import torch
    import transformers as tf

    cfg = target.cfg
    torch.manual_seed(0)
    layer_cfg = tf.LlamaConfig(vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size,
                               intermediate_size=cfg.intermediate_size, num_hidden_layers=1,
                               num_attention_heads=cfg.num_heads, num_key_value_heads=cfg.num_kv_heads,
                               max_position_embeddings=256)
    ref = tf.LlamaForCausalLM(layer_cfg).eval()
    with torch.no_grad():
        for p in ref.parameters():
            p.add_(torch.randn_like(p) * 0.05)
        ref.model.layers[0].input_layernorm.weight.fill_(1.0)  # EAGLE-1's layer 0 has no input norm
    fc = torch.nn.Linear(2 * cfg.hidden_size, cfg.hidden_size, bias=True)
    tensors = {f"layers.0.{k}": v.detach().numpy() for k, v in ref.model.layers[0].state_dict().items()
               if "input_layernorm" not in k}
    tensors["fc.weight"], tensors["fc.bias"] = fc.weight.detach().numpy(), fc.bias.detach().numpy()
    ecfg, params = heads_io.import_eagle(tensors, cfg)
    assert ecfg.fc_bias
    toks = np.array([[3, 9, 27, 4, 5]])
    feats = np.random.default_rng(1).normal(size=(1, 5, cfg.hidden_size)).astype(np.float32)
    with torch.no_grad():
        emb = torch.tensor(np.asarray(target.params["embed"]))[torch.tensor(toks)]
        x = fc(torch.cat([emb, torch.tensor(feats)], -1))
        pos = torch.arange(5)[None]
        rot = ref.model.rotary_emb(x, pos)
        mask = torch.full((5, 5), float("-inf")).triu(1)[None, None]
        expect = ref.model.layers[0](x, attention_mask=mask, position_ids=pos, position_embeddings=rot)
        expect = (expect[0] if isinstance(expect, tuple) else expect).numpy()
    _, out, _ = H.eagle_step(jax.tree.map(jnp.asarray, params), ecfg, cfg, target.params, jnp.asarray(toks),
                             jnp.asarray(feats), jnp.arange(5)[None], jnp.tril(jnp.ones((1, 5, 5), bool)))
    np.testing.assert_allclose(np.asarray(out), expect, atol=1e-4)


def test_import_eagle_reads_the_base_family_block(tmp_path):
    """A released EAGLE head for a Qwen2 base carries q/k/v biases: they are read by the base family's block names
    (not a fixed Llama list), and the imported layer equals transformers' Qwen2 layer."""
    import torch
    import transformers as tf

    make_hf_model("qwen2", tmp_path / "q", num_hidden_layers=1)
    base = pdecode.load(tmp_path / "q")
    cfg = base.cfg
    assert cfg.attention_bias
    torch.manual_seed(1)
    ref = tf.Qwen2ForCausalLM(tf.Qwen2Config(vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size,
                                             intermediate_size=cfg.intermediate_size, num_hidden_layers=1,
                                             num_attention_heads=cfg.num_heads,
                                             num_key_value_heads=cfg.num_kv_heads, max_position_embeddings=256)).eval()
    with torch.no_grad():
        for p in ref.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    fc = torch.nn.Linear(2 * cfg.hidden_size, cfg.hidden_size, bias=False)
    tensors = {f"layers.0.{k}": v.detach().numpy() for k, v in ref.model.layers[0].state_dict().items()}
    tensors["fc.weight"] = fc.weight.detach().numpy()
    assert "layers.0.self_attn.q_proj.bias" in tensors
    ecfg, params = heads_io.import_eagle(tensors, cfg)
    assert np.array_equal(np.asarray(params["layers"]["bq"][0]).reshape(-1),
                          tensors["layers.0.self_attn.q_proj.bias"])
    toks = np.array([[3, 9, 27, 4]])
    feats = np.random.default_rng(2).normal(size=(1, 4, cfg.hidden_size)).astype(np.float32)
    with torch.no_grad():
        x = fc(torch.cat([torch.tensor(np.asarray(base.params["embed"]))[torch.tensor(toks)], torch.tensor(feats)],
                         -1))
        pos = torch.arange(4)[None]
        mask = torch.full((4, 4), float("-inf")).triu(1)[None, None]
        expect = ref.model.layers[0](x, attention_mask=mask, position_ids=pos,
                                     position_embeddings=ref.model.rotary_emb(x, pos))
        expect = (expect[0] if isinstance(expect, tuple) else expect).numpy()
    _, out, _ = H.eagle_step(jax.tree.map(jnp.asarray, params), ecfg, cfg, base.params, jnp.asarray(toks),
                             jnp.asarray(feats), jnp.arange(4)[None], jnp.tril(jnp.ones((1, 4, 4), bool)))
    np.testing.assert_allclose(np.asarray(out), expect, atol=1e-4)


def test_deepseek_mtp_layout_and_concat_order(target):
    rng = np.random.default_rng(0)
    cfg = target.cfg
    d = cfg.hidden_size
    mcfg = H.MTPConfig(num_modules=1, emb_first=True)
    ours = jax.tree.map(np.asarray, init_from_specs(mcfg.specs(cfg), jax.random.PRNGKey(0)))
    tensors = heads_io.export_deepseek_mtp(mcfg, ours, cfg)
    L = cfg.num_layers
    assert {f"model.layers.{L}.{n}.weight" for n in ("enorm", "hnorm", "eh_proj", "shared_head.norm")} <= set(tensors)
    assert tensors[f"model.layers.{L}.eh_proj.weight"].shape == (d, 2 * d)
    back_cfg, back = heads_io.import_deepseek_mtp(tensors, cfg)
    assert back_cfg.emb_first
    for a, b in zip(jax.tree.leaves(ours), jax.tree.leaves(back)):
        np.testing.assert_array_equal(a, b)
    # Pin the order: a projection that reads only the first half of its input sees the embedding when
    # emb_first (the released checkpoints' order) and the hidden state otherwise (the paper's equation).
    mod = dict(back["modules"][0])
    proj = np.zeros((2 * d, d), np.float32)
    proj[:d] = np.eye(d)
    mod["proj"] = proj
    mod["layers"] = jax.tree.map(np.zeros_like, mod["layers"])  # the block adds nothing: out = proj input
    mod["layers"]["attn_norm"] = np.ones_like(mod["layers"]["attn_norm"])
    mod["layers"]["mlp_norm"] = np.ones_like(mod["layers"]["mlp_norm"])
    h = jnp.asarray(rng.normal(size=(1, 3, d)), jnp.float32)
    toks = jnp.asarray([[4, 5, 6]])
    pos = jnp.arange(3)[None]
    mask = jnp.tril(jnp.ones((1, 3, 3), bool))
    for emb_first in (True, False):
        c = H.MTPConfig(num_modules=1, emb_first=emb_first)
        _, out, _ = H.mtp_module(jax.tree.map(jnp.asarray, mod), c, cfg, target.params, h, toks, pos, mask)
        from pdecode.model.transformer import rms_norm

        e = rms_norm(jnp.take(target.params["embed"], toks, axis=0), jnp.asarray(mod["enorm"]), cfg.rms_norm_eps)
        hn = rms_norm(h, jnp.asarray(mod["hnorm"]), cfg.rms_norm_eps)
        np.testing.assert_allclose(np.asarray(out), np.asarray(e if emb_first else hn), atol=1e-5)
