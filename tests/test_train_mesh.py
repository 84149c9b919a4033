"""Training at size, on 8 forced CPU devices: data-parallel and FSDP steps equal the single-device step; gradient
accumulation equals the full batch; bf16 compute keeps float32 master weights."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pdecode.config import ModelConfig
from pdecode.model import heads as H
from pdecode.model.transformer import init_from_specs, init_params, param_specs
from pdecode.sharding import make_mesh
from train.loop import MeshPlan, TrainConfig, loss_and_grads, train
from train.objectives import eagle_loss, lm_loss

pytestmark = pytest.mark.skipif(jax.device_count() < 8, reason="needs XLA_FLAGS=--xla_force_host_platform_device_count=8")

CFG = ModelConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2,
                  head_dim=16, family="llama", tie_word_embeddings=False)


def _batch(n=8, t=33, seed=0):
    return np.random.default_rng(seed).integers(0, CFG.vocab_size, (n, t), dtype=np.int32)


def _close(a, b, rtol=2e-5, atol=2e-6):
    for (kp, x), y in zip(jax.tree_util.tree_flatten_with_path(a)[0], jax.tree.leaves(b)):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=rtol, atol=atol,
                                   err_msg=jax.tree_util.keystr(kp))


@pytest.mark.parametrize("shape,fsdp", [((8, 1), False), ((4, 2), True), ((2, 4), False)])
def test_sharded_loss_and_grads_equal_single_device(shape, fsdp):
    params = init_params(CFG, jax.random.PRNGKey(0))
    batch, rng = _batch(), jax.random.PRNGKey(1)
    f = jax.jit(lambda p, b: loss_and_grads(lm_loss(CFG), p, None, b, rng))
    loss1, _, g1 = f(params, jnp.asarray(batch))
    plan = MeshPlan(make_mesh(*shape), param_specs(CFG), fsdp=fsdp)
    p_sh, _ = plan.place(params, None)
    if fsdp:  # weights really are split over data (embed axis) and model
        spec = p_sh["layers"]["w_gate"].sharding.spec
        assert tuple(spec) == (None, "data", "model"), spec
    loss8, _, g8 = f(p_sh, plan.place_batch(batch))
    np.testing.assert_allclose(float(loss8), float(loss1), rtol=1e-6)
    _close(g8, g1)


def test_train_on_mesh_equals_single_device_and_resumes(tmp_path):
    params = init_params(CFG, jax.random.PRNGKey(0))
    tc = TrainConfig(steps=3, lr=1e-2, warmup=1, log_every=1, eval_every=100, ckpt_every=2)
    batch_fn = lambda i: _batch(seed=i)  # noqa: E731
    p1, h1 = train(lm_loss(CFG), params, None, batch_fn, tc, desc="single")
    plan = MeshPlan(make_mesh(4, 2), param_specs(CFG), fsdp=True)
    p8, h8 = train(lm_loss(CFG), params, None, batch_fn, tc, desc="fsdp", mesh_plan=plan, ckpt_dir=tmp_path / "c")
    np.testing.assert_allclose(h8["loss"], h1["loss"], rtol=1e-5)
    _close(p8, p1, rtol=1e-4, atol=1e-5)
    assert p8["layers"]["w_up"].sharding.spec == plan.param_shardings()["layers"]["w_up"].spec
    # resume from the step-2 checkpoint in the same sharded layout, finish the same
    p8b, h8b = train(lm_loss(CFG), params, None, batch_fn, dataclasses.replace(tc, steps=4), desc="fsdp",
                     mesh_plan=plan, ckpt_dir=tmp_path / "c")
    assert h8b["step"] == [4]


def test_grad_accumulation_equals_full_batch():
    params = init_params(CFG, jax.random.PRNGKey(0))
    batch, rng = jnp.asarray(_batch()), jax.random.PRNGKey(1)
    loss1, _, g1 = jax.jit(lambda p: loss_and_grads(lm_loss(CFG), p, None, batch, rng))(params)
    loss4, _, g4 = jax.jit(lambda p: loss_and_grads(lm_loss(CFG), p, None, batch, rng, accum=4))(params)
    np.testing.assert_allclose(float(loss4), float(loss1), rtol=1e-5)
    _close(g4, g1, rtol=1e-4, atol=1e-6)
    with pytest.raises(ValueError, match="accum=3 must be >= 1 and divide the batch size"):
        train(lm_loss(CFG), params, None, lambda i: _batch(), TrainConfig(steps=1, accum=3))


def test_bf16_compute_keeps_fp32_master_weights():
    params = init_params(CFG, jax.random.PRNGKey(0))
    batch, rng = jnp.asarray(_batch()), jax.random.PRNGKey(1)
    loss32, _, _ = loss_and_grads(lm_loss(CFG), params, None, batch, rng)
    loss16, _, g16 = loss_and_grads(lm_loss(CFG), params, None, batch, rng, compute_dtype=jnp.bfloat16)
    assert all(g.dtype == jnp.float32 for g in jax.tree.leaves(g16))
    assert abs(float(loss16) - float(loss32)) < 2e-2 * float(loss32)
    tc = TrainConfig(steps=2, lr=1e-2, warmup=1, log_every=1, compute_dtype="bfloat16")
    p_bf = jax.tree.map(lambda a: a.astype(jnp.bfloat16), params)  # bf16 params in -> fp32 master weights out
    out, hist = train(lm_loss(CFG), p_bf, None, lambda i: _batch(seed=i), tc, desc="bf16")
    assert all(a.dtype == jnp.float32 for a in jax.tree.leaves(out))
    assert all(np.isfinite(hist["loss"])) and not np.allclose(np.asarray(out["embed"]), np.asarray(params["embed"]))


def test_heads_training_step_sharded_with_frozen_base():
    """EAGLE heads on a frozen base, both sharded (base tensor-parallel by its specs, heads FSDP): same step."""
    ecfg = H.EagleConfig()
    base = init_params(CFG, jax.random.PRNGKey(0))
    hp = init_from_specs(ecfg.specs(CFG), jax.random.PRNGKey(2))
    batch, rng = _batch(), jax.random.PRNGKey(1)
    f = jax.jit(lambda p, fr, b: loss_and_grads(eagle_loss(CFG, ecfg), p, fr, b, rng))
    l1, _, g1 = f(hp, base, jnp.asarray(batch))
    plan = MeshPlan(make_mesh(4, 2), ecfg.specs(CFG), frozen_specs=param_specs(CFG), fsdp=True)
    hp8, base8 = plan.place(hp, base)
    assert "model" in str(base8["layers"]["wq"].sharding.spec)
    l8, _, g8 = f(hp8, base8, plan.place_batch(batch))
    np.testing.assert_allclose(float(l8), float(l1), rtol=1e-5)
    _close(g8, g1, rtol=1e-4, atol=1e-6)
