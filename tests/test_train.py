"""The training loop (optax, orbax resume), the LM objective, and the zoo corpus split."""

import jax
import jax.numpy as jnp
import numpy as np

from pdecode.config import ModelConfig
from pdecode.model.transformer import init_params
from train import data
from train.loop import TrainConfig, train
from train.objectives import lm_loss

CFG = ModelConfig(vocab_size=32, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=2, num_kv_heads=1,
                  head_dim=16, max_position_embeddings=64, tie_word_embeddings=True)


def _stream(n=5000, seed=0):
    # a learnable stream: a repeating pattern with noise
    rng = np.random.default_rng(seed)
    base = np.tile(np.arange(8), n // 8 + 1)[:n]
    noise = rng.random(n) < 0.1
    return np.where(noise, rng.integers(0, 32, n), base).astype(np.int32)


def test_lm_loss_decreases():
    batches = data.TokenBatches(_stream(), 16, 8)
    params = init_params(CFG, jax.random.PRNGKey(0))
    loss = lm_loss(CFG)
    before = float(loss(params, None, jnp.asarray(batches.batch(999)), None)[0])
    params, hist = train(loss, params, None, batches.batch, TrainConfig(steps=60, lr=1e-2, warmup=5, log_every=10,
                                                                        eval_every=1000, ckpt_every=1000))
    after = float(loss(params, None, jnp.asarray(batches.batch(999)), None)[0])
    assert after < 0.5 * before
    assert hist["loss"][-1] < hist["loss"][0]


def test_resume_from_orbax_matches_uninterrupted(tmp_path):
    batches = data.TokenBatches(_stream(seed=1), 16, 4)
    loss = lm_loss(CFG)
    p0 = init_params(CFG, jax.random.PRNGKey(1))
    tc = TrainConfig(steps=12, lr=5e-3, warmup=2, ckpt_every=6, eval_every=1000, log_every=6)
    full, _ = train(loss, p0, None, batches.batch, tc)
    # a run that stops at step 6 (its checkpoint), then a new process-like call that resumes to 12
    half_tc = TrainConfig(**{**tc.__dict__, "steps": 12})
    train(loss, p0, None, batches.batch, half_tc, ckpt_dir=tmp_path / "ck", desc="first")
    # remove the final checkpoint so the resume starts from step 6
    import shutil
    shutil.rmtree(tmp_path / "ck" / "12")
    resumed, hist = train(loss, p0, None, batches.batch, tc, ckpt_dir=tmp_path / "ck", desc="resumed")
    assert hist["last_step"] == 12
    for a, b in zip(jax.tree.leaves(full), jax.tree.leaves(resumed)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)


def test_corpus_split_is_deterministic_and_excludes_tests():
    train_files, val_files = data.split_files()
    assert len(val_files) >= 10 and len(train_files) > 20 * len(val_files)
    assert not set(train_files) & set(val_files)
    for p in train_files + val_files:
        parts = p.relative_to(data.stdlib_root()).parts
        assert "test" not in parts[:-1] and "tests" not in parts[:-1] and "site-packages" not in parts
        assert not parts[-1].startswith("test_")
    again = data.split_files()
    assert again == (train_files, val_files)


def test_batches_depend_only_on_step():
    b = data.TokenBatches(_stream(), 16, 4, seed=3)
    np.testing.assert_array_equal(b.batch(7), b.batch(7))
    assert not np.array_equal(b.batch(7), b.batch(8))
    assert b.batch(0).shape == (4, 17)


def test_validation_loss_on_fewer_windows_than_a_batch_is_finite():
    from train.zoo import make_eval

    windows = data.TokenBatches(_stream(200), 16, 1).fixed_eval(3)
    assert [len(b) for b in data.eval_batches(windows, 8)] == [3]  # all of them, not none
    assert [len(b) for b in data.eval_batches(np.zeros((17, 5)), 8)] == [8, 8]  # full batches as before
    assert data.eval_batches(windows[:0], 8) == []
    loss = make_eval(CFG, windows)(init_params(CFG, jax.random.PRNGKey(0)))["val_loss"]
    assert np.isfinite(loss) and loss > 0


def test_self_distillation_stream(tiny):
    stream = np.arange(3, 90, dtype=np.int32).repeat(3)
    out = data.self_distillation_stream(tiny, stream, 150, prompt_len=8, new_tokens=12, batch=4, seed=1)
    assert out.shape == (150,) and out.dtype == np.int32
    # sequences are prompt (a corpus window) + the target's own greedy-or-sampled continuation + EOS
    eos = tiny.cfg.eos_token_ids[0]
    seqs = np.split(out, np.nonzero(out == eos)[0] + 1)
    first = seqs[0]
    assert len(first) == 8 + 12 + 1 and first[-1] == eos
    assert np.all(np.diff(first[:8]) >= 0)  # the prompt is a window of the (sorted) corpus stream


def test_dllm_mixed_batches_layout():
    """code-dllm's batches: task rows keep the prompt visible and make only the response (answer + EOS fill)
    maskable, the fill after the first EOS down-weighted; corpus rows are maskable everywhere; the shapes and the
    task/corpus split follow the stage options."""
    from tokenizers import Tokenizer as HFTokenizer

    from pdecode.api import zoo_dir
    from train import dllm, tasks

    tok = HFTokenizer.from_file(str(zoo_dir() / "code-target" / "tokenizer.json"))
    items = tasks.split()[0][:50]
    stream = np.arange(3, 3003, dtype=np.int32)
    mb = dllm.MixedBatches(tok, stream, items, seed=3, seq=48, batch=8, sft_fraction=0.75, response_lengths=(16,))
    toks, maskable, lengths, weights = mb.batch(5)
    assert toks.shape == maskable.shape == weights.shape == (8, 48) and lengths.shape == (8,)
    again = mb.batch(5)
    assert all(np.array_equal(a, b) for a, b in zip((toks, maskable, lengths, weights), again))
    eos = tok.token_to_id(data.EOT)
    by_prompt = {tuple(tok.encode(it.prompt, add_special_tokens=False).ids): it for it in items}
    for r in range(6):  # task rows
        p = next(k for k in by_prompt if tuple(toks[r, :len(k)]) == k)
        a = tok.encode(by_prompt[p].answer, add_special_tokens=False).ids
        n = len(p) + max(16, len(a) + 1)
        assert not maskable[r, :len(p)].any() and maskable[r, len(p):n].all() and not maskable[r, n:].any()
        assert lengths[r] == n and list(toks[r, len(p):len(p) + len(a)]) == a
        assert (toks[r, len(p) + len(a):] == eos).all()
        assert (weights[r, :len(p) + len(a) + 1] == 1).all() and (weights[r, len(p) + len(a) + 1:] < 1).all()
    for r in (6, 7):  # corpus rows
        assert maskable[r].all() and lengths[r] == 48 and (np.diff(toks[r]) == 1).all()


def test_training_forward_matches_the_plain_forward():
    """The training pass (fused unstacked weights, causal block skipping) computes the plain forward's loss and
    gradients with respect to the stacked params."""
    from pdecode.model.attention import padded_self_mask
    from pdecode.model.transformer import forward, unembed
    from train.objectives import cross_entropy

    cfg = CFG.replace(num_layers=3)
    params = init_params(cfg, jax.random.PRNGKey(1))
    batch = jnp.asarray(data.TokenBatches(_stream(), 64, 4).batch(3))

    def plain(p):
        x, y = batch[:, :-1], batch[:, 1:]
        b, t = x.shape
        pos = jnp.broadcast_to(jnp.arange(t), (b, t))
        h = forward(p, cfg, x, pos, padded_self_mask(jnp.full((b,), t), t)).hidden
        return cross_entropy(unembed(p, cfg, h), y)

    want, g_want = jax.value_and_grad(plain)(params)
    got, g_got = jax.value_and_grad(lambda p: lm_loss(cfg)(p, None, batch, None)[0])(params)
    np.testing.assert_allclose(float(got), float(want), rtol=1e-6)
    assert jax.tree.structure(g_got) == jax.tree.structure(g_want)
    for a, e in zip(jax.tree.leaves(g_got), jax.tree.leaves(g_want)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(e), atol=2e-5, rtol=1e-4)


def test_time_step_runs_the_training_step():
    from train.loop import time_step

    params = init_params(CFG, jax.random.PRNGKey(0))
    batch = data.TokenBatches(_stream(), 16, 4).batch(0)
    res = time_step(lm_loss(CFG), params, None, batch, TrainConfig(steps=10), repeats=3)
    assert len(res["times"]) == 3 and all(t > 0 for t in res["times"])
    assert min(res["times"]) <= res["step_s"] <= max(res["times"])


def test_attention_annealing_runs_from_causal_to_bidirectional():
    """The masked-diffusion loss with attention openness r: r = 0 is the loss of a causal network (each query sees
    only keys at or before it), r = 1 the plain bidirectional loss; in between it lies off both."""
    from pdecode.model.attention import padded_self_mask
    from pdecode.model.transformer import forward, unembed
    from train.objectives import masked_diffusion_loss

    cfg = CFG.replace(causal=False, mask_token_id=2)
    params = init_params(cfg, jax.random.PRNGKey(3), std=0.2)
    toks = jnp.asarray(np.random.default_rng(0).integers(3, 32, (4, 24)), jnp.int32)
    batch = (toks, jnp.ones((4, 24), bool), jnp.full((4,), 24, jnp.int32), jnp.ones((4, 24), jnp.float32))
    loss = masked_diffusion_loss(cfg, 2, shift=True)
    key = jax.random.PRNGKey(5)
    bidir = float(loss(params, None, batch, key)[0])
    opened = float(loss(params, None, batch + (jnp.float32(1.0),), key)[0])
    causal = float(loss(params, None, batch + (jnp.float32(0.0),), key)[0])
    half = float(loss(params, None, batch + (jnp.float32(0.5),), key)[0])
    np.testing.assert_allclose(opened, bidir, rtol=1e-6)
    # the causal network's loss on the same masks (the same rng split as inside the loss)
    k_t, k_m, _ = jax.random.split(key, 3)
    tt = jax.random.uniform(k_t, (4, 1), minval=1e-3, maxval=1.0)
    masked = (jax.random.uniform(k_m, (4, 24)) < tt).at[:, 0].set(False)
    pos = jnp.broadcast_to(jnp.arange(24), (4, 24))
    h = forward(params, cfg.replace(causal=True), jnp.where(masked, 2, toks), pos,
                padded_self_mask(jnp.full((4,), 24), 24, causal=True)).hidden
    lg = unembed(params, cfg, h)
    lg = jnp.concatenate([lg[:, :1], lg[:, :-1]], axis=1)
    import optax

    ce = optax.softmax_cross_entropy_with_integer_labels(lg, toks)
    want = float(jnp.mean(jnp.sum(ce * masked / tt / 24.0, axis=1)))
    np.testing.assert_allclose(causal, want, rtol=1e-5)
    assert len({round(x, 5) for x in (causal, half, bidir)}) == 3


def test_diffusion_nll_bound():
    """The bound is deterministic for a key, log V for a model that predicts uniformly (zero weights), and lower
    for a model trained on the data."""
    from train.objectives import diffusion_nll_bound, masked_diffusion_loss

    cfg = CFG.replace(causal=False, mask_token_id=2)
    nll = jax.jit(diffusion_nll_bound(cfg, 2, shift=True, levels=8))
    toks = jnp.asarray(data.TokenBatches(_stream(), 31, 8).batch(0), jnp.int32)
    zero = jax.tree.map(jnp.zeros_like, init_params(cfg, jax.random.PRNGKey(0)))
    key = jax.random.PRNGKey(1)
    u = float(nll(zero, toks, key))
    assert u == float(nll(zero, toks, key)) and abs(u - np.log(32)) < 0.15 * np.log(32)

    def batch(i):
        b = data.TokenBatches(_stream(), 31, 8).batch(i).astype(np.int32)
        return b, np.ones(b.shape, bool), np.full((8,), 32, np.int32)

    p, _ = train(masked_diffusion_loss(cfg, 2, shift=True), init_params(cfg, jax.random.PRNGKey(0)), None, batch,
                 TrainConfig(steps=60, lr=1e-2, warmup=5, eval_every=1000, ckpt_every=1000, log_every=30))
    assert float(nll(p, toks, key)) < u - 0.3


def test_long_task_kinds():
    """The long kinds: answers of 41-126 tokens on the zoo tokenizer (the token count formula holds), median >= 64
    per kind, >= 300 held-out items in all, exact and per-position scoring, fresh training items never held out."""
    import ast
    import random

    from tokenizers import Tokenizer as HFTokenizer

    from pdecode.api import zoo_dir
    from train import tasks

    tok = HFTokenizer.from_file(str(zoo_dir() / "code-target" / "tokenizer.json"))
    train_items, heldout = tasks.split_long()
    assert len(heldout) >= 300 and not {i.prompt for i in train_items} & {i.prompt for i in heldout}
    for kind in tasks.LONG_KINDS:
        its = [i for i in heldout if i.kind == kind]
        lens = [len(tok.encode(i.answer, add_special_tokens=False).ids) for i in its]
        assert len(its) >= 60 and np.median(lens) >= 64 and 40 <= min(lens) and max(lens) <= tasks.LONG_MAX_TOKENS
        for i in its[:20]:
            xs = ast.literal_eval(i.answer)
            exec(i.prompt + i.answer)  # noqa: S102 (our own generated text): the assert holds
            if kind != "range_long":
                assert len(tok.encode(i.answer, add_special_tokens=False).ids) == tasks.long_answer_tokens(xs)
    it = heldout[0]
    assert tasks.score(it, it.answer + "\nmore") and tasks.position_score(it, it.answer, tok) == 1.0
    wrong = it.answer[:-2] + ("1]" if it.answer[-2] != "1" else "2]")
    assert not tasks.score(it, wrong) and 0.9 < tasks.position_score(it, wrong, tok) < 1.0
    assert tasks.position_score(it, "", tok) == 0.0
    assert not any(i.heldout for i in tasks.long_items(random.Random(0), 200))


def test_training_step_takes_frozen_params_as_arguments():
    """A frozen base (here 1M floats) is a jit argument of the training step, never a constant in its program."""
    import re

    import jax
    import jax.numpy as jnp
    import optax

    from train.loop import _step_fn

    frozen = {"base": jnp.ones((1024, 1024), jnp.float32)}

    def objective(p, fz, batch, rng):
        return jnp.mean((batch @ fz["base"] @ p["w"]) ** 2), {}

    params = {"w": jnp.ones((1024, 4), jnp.float32) * 0.01}
    opt = optax.adamw(1e-3)
    step = _step_fn(objective, opt)
    text = step.lower(params, frozen, opt.init(params), jnp.ones((2, 1024)), jax.random.PRNGKey(0)).as_text()
    sizes = [int(np.prod([int(d) for d in m.split("x")[:-1]] or [1]))
             for m in re.findall(r"stablehlo\.constant dense<[^>]*> : tensor<([0-9x]*[a-z0-9]+)>", text)]
    assert max(sizes, default=0) < 1024, max(sizes)  # scalars and small tables only
    assert "1024x1024" in text.split("func.func public @main(")[1].split("{")[0]  # the base is an argument
    p2, *_ = step(params, frozen, opt.init(params), jnp.ones((2, 1024)), jax.random.PRNGKey(0))
    assert not np.allclose(np.asarray(p2["w"]), np.asarray(params["w"]))


def test_layerskip_objective_trains_the_early_exit():
    """LayerSkip's loss: with no dropout and no exit weight it is the plain LM loss; training with it lowers the
    early exit's loss (the layer-1 hidden state through the shared head), which plain LM training leaves high."""
    from train.objectives import layerskip_loss

    cfg = CFG.replace(num_layers=3)
    batches = data.TokenBatches(_stream(), 16, 8)
    params = init_params(cfg, jax.random.PRNGKey(0))
    batch = jnp.asarray(batches.batch(999))
    plain = float(lm_loss(cfg)(params, None, batch, None)[0])
    same = float(layerskip_loss(cfg, 1, dropout_max=0.0, exit_weight=0.0)(params, None, batch, jax.random.PRNGKey(0))[0])
    assert abs(plain - same) < 1e-4
    obj = layerskip_loss(cfg, 1, dropout_max=0.2)
    tc = TrainConfig(steps=60, lr=1e-2, warmup=5, log_every=10, eval_every=1000, ckpt_every=1000)
    trained, _ = train(obj, params, None, batches.batch, tc)
    lm_trained, _ = train(lm_loss(cfg), params, None, batches.batch, tc)
    exit_ce = lambda p: float(layerskip_loss(cfg, 1, 0.0)(p, None, batch, jax.random.PRNGKey(1))[1]["exit_ce"])  # noqa
    assert exit_ce(trained) < 0.7 * exit_ce(params) and exit_ce(trained) < exit_ce(lm_trained)


def test_block_dllm_canvas_batches_layout():
    """dg-tiny's batches: a task row's prefix is its prompt plus whole canvases of its answer, the canvas the next
    ``L`` tokens of answer + EOS (the fill after the first EOS down-weighted); a corpus row's canvas continues its
    prefix; deterministic in the step."""
    from tokenizers import Tokenizer as HFTokenizer

    from pdecode.api import zoo_dir
    from train import block_dllm, tasks

    tok = HFTokenizer.from_file(str(zoo_dir() / "code-target" / "tokenizer.json"))
    items = tasks.split()[0][:50]
    stream = np.arange(3, 3003, dtype=np.int32)
    cb = block_dllm.CanvasBatches(tok, stream, items, seed=3, prefix=400, canvas=8, batch=8, task_fraction=0.75,
                                  long_fraction=0.5)
    pre, plen, can, w = cb.batch(4)
    assert pre.shape == (8, 400) and can.shape == w.shape == (8, 8) and plen.shape == (8,)
    assert all(np.array_equal(a, b) for a, b in zip((pre, plen, can, w), cb.batch(4)))
    eos = tok.token_to_id(data.EOT)
    fresh = [cb._encode(it) for it in tasks.long_items(__import__("random").Random("3-4"), 3)]
    known = fresh + cb.items
    for r in range(6):  # task rows: 3 long, 3 short
        row = list(pre[r, :plen[r]])
        p, a = next((p, a) for p, a in known if row[:len(p)] == list(p))
        full = list(p) + list(a) + [eos]
        assert (plen[r] - len(p)) % 8 == 0 and row == full[:plen[r]]
        body = full[plen[r]: plen[r] + 8]
        assert list(can[r, :len(body)]) == body and (can[r, len(body):] == eos).all()
        assert (w[r, :len(body)] == 1).all() and (w[r, len(body):] < 1).all()
    for r in (6, 7):  # corpus rows
        assert can[r, 0] == pre[r, plen[r] - 1] + 1 and (np.diff(can[r]) == 1).all()


def test_block_diffusion_objective_trains():
    """The block-diffusion objective trains a tiny DiffusionGemma-layout model on a learnable stream (the canvas
    continues its prefix): the loss falls well below chance, and from a canvas of pure noise (the pad token, greedy
    decoding's noise) one decoder pass after the encoded prefix predicts the continuation."""
    from pdecode.model.families import diffusion_gemma as bd
    from pdecode.model import cache as kvc
    from train.block_dllm import tiny_config
    from train.objectives import block_diffusion_loss

    cfg = tiny_config(canvas=8, window=16, vocab=32, layers=2, hidden=64, eos=None)
    stream = _stream(20000)

    def batch_fn(i):
        r = np.random.default_rng([i, 7])
        n = r.integers(4, 24, 8)
        s = r.integers(0, len(stream) - 40, 8)
        pre = np.zeros((8, 24), np.int32)
        for j in range(8):
            pre[j, :n[j]] = stream[s[j]: s[j] + n[j]]
        can = np.stack([stream[s[j] + n[j]: s[j] + n[j] + 8] for j in range(8)]).astype(np.int32)
        return pre, n.astype(np.int32), can, np.ones((8, 8), np.float32)

    loss = block_diffusion_loss(cfg, pad_rate=0.5)
    params = init_params(cfg, jax.random.PRNGKey(0))
    first = float(jax.jit(loss)(params, None, tuple(map(jnp.asarray, batch_fn(0))), jax.random.PRNGKey(0))[0])
    params, hist = train(loss, params, None, batch_fn, TrainConfig(steps=100, lr=3e-3, warmup=10, log_every=20,
                                                                   eval_every=10**9))
    # the trained loss over 8 held-out batches (one logged batch's loss moved between 0.93 and 1.31 from step 80 to
    # 100 with the packages of 2026-12-06: too noisy a figure to hold against a bound)
    held = np.mean([float(jax.jit(loss)(params, None, tuple(map(jnp.asarray, batch_fn(10_000 + i))),
                                        jax.random.PRNGKey(i))[0]) for i in range(8)])
    assert first > 3.0 and held < 1.3, (first, held, hist["loss"])

    @jax.jit
    def predict(params, prompt):
        cache = kvc.init_cache(cfg, 1, 32, jnp.float32, per_layer=True)
        cache = kvc.set_lengths(bd.encode(params, cfg, prompt, cache), jnp.full((1,), prompt.shape[1]))
        return jnp.argmax(bd.denoise(params, cfg, jnp.full((1, 8), cfg.pad_token_id), cache), -1)

    got = np.asarray(predict(params, jnp.asarray([list(range(8)) * 2], jnp.int32)))[0]
    assert (got == np.arange(8)).sum() >= 6, got
