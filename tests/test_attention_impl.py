"""Attention implementations (`attention.attend(..., impl=)`) against the XLA reference, on the CPU: the
`jax.nn.dot_product_attention` path (its XLA implementation) and the Pallas splash kernel in interpret mode, for
every mask kind pdecode builds, GQA, float32 and bfloat16 caches; "auto" and the refusals of explicit impls. On a
GPU the cuDNN path joins them, on a TPU the compiled splash kernel (scripts/device_check.sh runs this file there);
a case the impl cannot serve (`attention._why_not`: cuDNN takes no float32) is skipped with its reason."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pdecode.config import ModelConfig
from pdecode.errors import ConfigError
from pdecode.model import attention

B, H, KV, HD = 2, 4, 2, 16  # GQA: two query heads per kv head
T_STEP, S_CACHE = 8, 128  # a pass of 8 fresh tokens over a 128-slot cache (the splash kernel tiles keys by 128)
T_PREFILL = 128
IMPLS = ("dot_product", "pallas_interpret") + {"gpu": ("cudnn",), "tpu": ("pallas",)}.get(jax.default_backend(), ())
DTYPES = ("float32", "bfloat16")
TOL = {"float32": dict(atol=2e-5, rtol=2e-5), "bfloat16": dict(atol=3e-2, rtol=3e-2)}
CASES = ("chain", "tree", "block", "empty_query")


def _qkv(t, s, dtype, seed):
    rng = np.random.default_rng(seed)
    q = jnp.asarray(rng.normal(size=(len(CASES) * B, t, H, HD)), jnp.float32)  # activations stay float32
    k = jnp.asarray(rng.normal(size=(len(CASES) * B, KV, HD, s)), dtype)  # [B, KV, hd, S]: the cache layout
    v = jnp.asarray(rng.normal(size=(len(CASES) * B, KV, s, HD)), dtype)
    return q, k, v


def _cache_masks():
    """[4 * B, T_STEP, S_CACHE]: two rows per case, cases stacked along the batch (one compile for all of them)."""
    prev = jnp.array([5, 40])
    chain = attention.cache_mask(prev, attention.causal_intra(T_STEP), S_CACHE)
    parents = jnp.array([-1, 0, 0, 1, 1, 2, 3, 5])
    tree = attention.cache_mask(prev, attention.tree_intra(parents), S_CACHE)
    block = attention.cache_mask(prev, jnp.ones((T_STEP, T_STEP), bool), S_CACHE,
                                 fresh_valid_BM=jnp.arange(T_STEP)[None, :] < jnp.array([[8], [6]]))
    empty = chain.at[:, -1, :].set(False)  # the last query of each row sees no key (a padding query)
    return jnp.concatenate([chain, tree, block, empty])


def _rows(case):
    i = CASES.index(case)
    return slice(i * B, (i + 1) * B)


def _skip_unservable(impl, q, k, v):
    why = attention._why_not(impl, q.shape, k.shape, k.dtype, v.dtype, jax.default_backend()) \
        if impl not in ("xla", "dot_product", "pallas_interpret") else None
    if why is not None:
        pytest.skip(f"{impl}: {why}")


@functools.lru_cache(maxsize=None)
def _cache_pass(impl, dtype):
    q, k, v = _qkv(T_STEP, S_CACHE, jnp.dtype(dtype), seed=0)
    out = jax.jit(functools.partial(attention.attend, impl=impl))(q, k, v, _cache_masks())
    return np.asarray(out.astype(jnp.float32)), (q, k, v)


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("impl", IMPLS)
def test_cache_pass_matches_xla(impl, dtype, case):
    _skip_unservable(impl, *_qkv(T_STEP, S_CACHE, jnp.dtype(dtype), seed=0))
    got, (_, _, v) = _cache_pass(impl, dtype)
    ref, _ = _cache_pass("xla", dtype)
    assert np.isfinite(got).all()
    rows = _rows(case)
    if case == "empty_query":
        # the padding query: xla and dot_product give the mean of all values, the kernels key slot 0's value
        n = T_STEP - 1
        want = np.asarray(v[rows].astype(jnp.float32))  # [B, KV, S, hd]
        want = want.mean(axis=2) if impl == "dot_product" else want[:, :, 0]
        np.testing.assert_allclose(got[rows, n], np.repeat(want, H // KV, axis=1), **TOL[dtype])
        np.testing.assert_allclose(got[rows, :n], ref[rows, :n], **TOL[dtype])
    else:
        np.testing.assert_allclose(got[rows], ref[rows], **TOL[dtype])


def test_xla_reference_gives_an_empty_query_the_mean_of_values():
    ref, (_, _, v) = _cache_pass("xla", "float32")
    rows = _rows("empty_query")
    want = np.repeat(np.asarray(v[rows]).mean(axis=2), H // KV, axis=1)
    np.testing.assert_allclose(ref[rows, -1], want, atol=1e-5)


def _prefill(dtype, causal_self):
    rng = np.random.default_rng(1)
    q = jnp.asarray(rng.normal(size=(B, T_PREFILL, H, HD)), jnp.float32)
    k = jnp.asarray(rng.normal(size=(B, KV, HD, T_PREFILL)), dtype)
    v = jnp.asarray(rng.normal(size=(B, KV, T_PREFILL, HD)), dtype)
    mask = attention.padded_self_mask(jnp.array([T_PREFILL, 77]), T_PREFILL)  # right padding in row 1
    return q, k, v, (attention.CausalSelfMask(mask) if causal_self else mask)


@functools.partial(jax.jit, static_argnames=("impl", "causal_self"))
def _attend_prefill(q, k, v, mask, impl, causal_self):
    # a CausalSelfMask is built inside jit, as the training passes do (its block count stays a Python int)
    return attention.attend(q, k, v, attention.CausalSelfMask(mask) if causal_self else mask, impl=impl)


@pytest.mark.parametrize("impl, dtype, causal_self", [
    (impl, dtype, False) for impl in IMPLS for dtype in DTYPES] + [(impl, "float32", True) for impl in IMPLS])
def test_causal_prefill_with_right_padding_matches_xla(impl, dtype, causal_self):
    """A prefill over right-padded rows (no cache), as a plain mask and as the training passes' CausalSelfMask."""
    q, k, v, mask = _prefill(jnp.dtype(dtype), causal_self=False)
    _skip_unservable(impl, q, k, v)
    got = np.asarray(_attend_prefill(q, k, v, mask, impl, causal_self).astype(jnp.float32))
    ref = np.asarray(_attend_prefill(q, k, v, mask, "xla", causal_self).astype(jnp.float32))
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got, ref, **TOL[dtype])


@pytest.mark.parametrize("impl", IMPLS)
def test_gradients_of_a_training_pass_match_xla(impl):
    """A training pass (CausalSelfMask, no cache) differentiates through each impl as through the reference."""
    q, k, v, mask = _prefill(jnp.float32, causal_self=True)
    _skip_unservable(impl, q, k, v)
    w = jnp.asarray(np.random.default_rng(2).normal(size=q.shape), jnp.float32)

    def loss(impl_, q, k, v):
        return jnp.sum(attention.attend(q, k, v, mask, impl=impl_) * w)

    got = jax.jit(jax.grad(functools.partial(loss, impl), argnums=(0, 1, 2)))(q, k, v)
    ref = jax.jit(jax.grad(functools.partial(loss, "xla"), argnums=(0, 1, 2)))(q, k, v)
    for g, r in zip(got, ref):
        np.testing.assert_allclose(np.asarray(g), np.asarray(r), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("t, s, d, dtype, train", [(8, 128, 16, "float32", False), (16, 256, 16, "bfloat16", False),
                                                   (128, 128, 128, "bfloat16", True)])
def test_pallas_path_lowers_for_tpu(t, s, d, dtype, train):
    """The compiled (not interpreted) kernel, with the tiles `attend` picks, lowers to Mosaic TPU custom calls
    (`jax.export` for "tpu" on this CPU; compiling them needs a TPU, which this test does not have)."""
    from jax import export

    def fwd(q, k, v, m):
        mask = attention.CausalSelfMask(m) if train else m
        return attention._attend_splash(q, k, v, mask, interpret=False)

    def step(q, k, v, m):
        return jax.grad(lambda *a: jnp.sum(fwd(*a, m).astype(jnp.float32)), argnums=(0, 1, 2))(q, k, v)

    sds = jax.ShapeDtypeStruct
    args = (sds((B, t, H, d), jnp.float32), sds((B, KV, d, s), jnp.dtype(dtype)), sds((B, KV, s, d), jnp.dtype(dtype)),
            sds((B, t, s), jnp.bool_))
    module = export.export(jax.jit(step if train else fwd), platforms=["tpu"])(*args).mlir_module()
    assert module.count("tpu_custom_call") == (2 if train else 1)  # forward (+ the fused backward) kernel


# ------------------------------------------------------------------------------------------------ choice
def test_auto_on_cpu_is_xla():
    assert jax.default_backend() == "cpu"
    for t, s, d, dt in [(1, 64, 16, jnp.float32), (512, 1024, 128, jnp.bfloat16), (256, 256, 64, jnp.float16)]:
        assert attention.resolve_impl("auto", (B, t, H, d), (B, KV, d, s), dt) == "xla"
    q, k, v = _qkv(T_STEP, S_CACHE, jnp.float32, seed=0)
    mask = _cache_masks()
    np.testing.assert_array_equal(np.asarray(attention.attend(q, k, v, mask, impl="auto")),
                                  np.asarray(attention.attend(q, k, v, mask)))


def test_auto_rules_per_backend():
    """The static rules "auto" applies on other backends (no device needed to decide)."""
    long_bf16 = ((B, 512, H, 128), (B, KV, 128, 1024), jnp.bfloat16)
    assert attention.resolve_impl("auto", *long_bf16, backend="tpu") == "pallas"
    assert attention.resolve_impl("auto", (B, 1, H, 128), (B, KV, 128, 1024), jnp.bfloat16, backend="tpu") == "xla"
    assert attention.resolve_impl("auto", (B, 512, H, 64), (B, KV, 64, 1024), jnp.bfloat16, backend="tpu") == "xla"
    assert attention.resolve_impl("auto", (B, 512, H, 128), (B, KV, 128, 1000), jnp.bfloat16, backend="tpu") == "xla"
    assert attention.resolve_impl("auto", (B, 512, H, 128), (B, KV, 128, 1024), jnp.float16, backend="tpu") == "xla"
    # this machine has no CUDA GPU, so cuDNN cannot serve and "auto" on "gpu" falls back
    assert attention.resolve_impl("auto", *long_bf16, backend="gpu") == "xla"


@pytest.mark.parametrize("impl, q_shape, k_shape, dtype, words", [
    ("cudnn", (B, 8, H, 16), (B, KV, 16, 128), jnp.bfloat16, "CUDA GPU"),
    ("pallas", (B, 8, H, 16), (B, KV, 16, 128), jnp.float32, "TPU only"),
    ("pallas_interpret", (B, 8, H, 16), (B, KV, 16, 100), jnp.float32, "S=100"),
    ("pallas_interpret", (B, 12, H, 16), (B, KV, 16, 128), jnp.float32, "T=12"),
    ("pallas_interpret", (B, 8, H, 16), (B, KV, 16, 128), jnp.float16, "float16"),
    ("flash", (B, 8, H, 16), (B, KV, 16, 128), jnp.float32, "unknown attention impl"),
])
def test_explicit_impl_that_cannot_serve_raises(impl, q_shape, k_shape, dtype, words):
    with pytest.raises(ConfigError, match=words) as e:
        attention.resolve_impl(impl, q_shape, k_shape, dtype)
    assert "\n" not in str(e.value)


def test_attend_refuses_before_tracing_anything():
    q, k, v = _qkv(T_STEP, S_CACHE, jnp.float32, seed=0)
    with pytest.raises(ConfigError, match="use impl='xla'"):
        attention.attend(q, k[..., :100], v[:, :, :100], _cache_masks()[..., :100], impl="pallas_interpret")


def test_model_config_validates_attention_impl():
    base = dict(vocab_size=11, hidden_size=8, intermediate_size=8, num_layers=1, num_heads=2, num_kv_heads=1,
                head_dim=4)
    assert ModelConfig(**base).run.attention_impl == "auto"
    assert ModelConfig(**base).with_run(attention_impl="dot_product").run.attention_impl == "dot_product"
    with pytest.raises(ConfigError, match="attention_impl"):
        ModelConfig(**base).with_run(attention_impl="flash")
