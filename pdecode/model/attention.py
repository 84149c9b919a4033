"""One attention for every mask kind, and the mask builders.

A mask is boolean ``[B, T, S]``: query t of row b may read key slot s. Every decoding method builds its mask from
the same few pieces: committed cache slots (``s < lengths[b]``), the fresh tokens of this pass with an
``intra`` mask among themselves (causal for chains and prefill, ancestor-of for trees, all-ones for
bidirectional blocks), and padding.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from pdecode.config import ATTENTION_IMPLS
from pdecode.errors import ConfigError

_NEG = -1e30


class CausalSelfMask(NamedTuple):
    """A self-attention mask ``[B, T, T]`` (keys = the T queries' own tokens, no cache) that hides every key after
    its query. `attend` then splits the queries into ``blocks`` and lets each block read only the keys up to its
    last query: (n + 1) / 2n of the score entries for n blocks (5/8 at 4), the same result. Training passes use it
    (`train.objectives.causal_hidden`)."""

    mask: jax.Array
    blocks: int = 4


def attend(q_BTHD: jax.Array, k_BKDS: jax.Array, v_BKSD: jax.Array, mask_BTS, impl: str = "xla",
           scale: float | None = None, softcap: float | None = None, sinks: jax.Array | None = None) -> jax.Array:
    """Grouped-query attention. q: [B,T,H,hd]; k: [B,KV,hd,S] (transposed, the cache layout); v: [B,KV,S,hd];
    mask: [B,T,S] (True = visible), or a `CausalSelfMask`. Returns [B,T,H,hd]. ``scale``: the score scale (default
    1/sqrt(hd)); ``softcap``: scores -> softcap * tanh(scores / softcap) (Gemma 2); ``sinks`` [H]: a per-head logit
    that joins every softmax's denominator and reads no value (gpt-oss). Softcaps and sinks run on the "xla"
    implementation only ("auto" picks it; an explicit other one raises).

    Scores and softmax run in float32 whatever the input dtypes; the matmul operands are in the cache's dtype. A query
    with no visible key gets the mean of all values (masks always give a real query at least one key).

    ``impl`` picks the implementation (static; `resolve_impl`, docs/performance.md): "xla" (the einsums below, the
    reference), "dot_product" (`jax.nn.dot_product_attention`, its XLA implementation), "cudnn" (the same function's
    cuDNN flash attention; CUDA GPUs), "pallas" (the Pallas splash-attention kernel; TPU), "pallas_interpret" (that
    kernel in Pallas interpret mode on any backend: slow, for tests), or "auto" (one of them by
    `jax.default_backend()` and the shapes, else "xla"). An explicit impl that cannot serve the shapes, dtypes or
    backend raises `ConfigError`; only "auto" falls back. "cudnn" and "pallas*" give a query with no visible key the
    value at key slot 0 instead of the mean (finite either way; masks give real queries a key).
    """
    d_ = q_BTHD.shape[-1]
    if scale is not None and softcap is None and impl != "xla":  # the kernels scale by 1/sqrt(hd): pre-scale q
        q_BTHD = (q_BTHD.astype(jnp.float32) * (scale * d_ ** 0.5)).astype(q_BTHD.dtype)
        scale = None
    if (softcap is not None or sinks is not None) and impl != "xla":
        if impl != "auto":
            raise ConfigError(f"attention impl {impl!r} cannot apply a score softcap or attention sinks; use "
                              "impl='xla' (or 'auto')")
        impl = "xla"
    impl = resolve_impl(impl, q_BTHD.shape, k_BKDS.shape, k_BKDS.dtype, v_BKSD.dtype)
    if impl in ("dot_product", "cudnn"):
        return _attend_dot_product(q_BTHD, k_BKDS, v_BKSD, mask_BTS, "cudnn" if impl == "cudnn" else "xla")
    if impl in ("pallas", "pallas_interpret"):
        return _attend_splash(q_BTHD, k_BKDS, v_BKSD, mask_BTS, interpret=impl == "pallas_interpret")
    if isinstance(mask_BTS, CausalSelfMask):
        t, n = q_BTHD.shape[1], mask_BTS.blocks
        if n <= 1 or t % n or t // n < 16:
            return attend(q_BTHD, k_BKDS, v_BKSD, mask_BTS.mask, scale=scale, softcap=softcap, sinks=sinks)
        bs, m = t // n, mask_BTS.mask
        return jnp.concatenate([attend(q_BTHD[:, i * bs:(i + 1) * bs], k_BKDS[..., :(i + 1) * bs],
                                       v_BKSD[:, :, :(i + 1) * bs], m[:, i * bs:(i + 1) * bs, :(i + 1) * bs],
                                       scale=scale, softcap=softcap, sinks=sinks)
                                for i in range(n)], axis=1)
    b, t, h, d = q_BTHD.shape
    kv = k_BKDS.shape[1]
    # the matmuls run in the cache's dtype (a bf16 cache: bf16 operands, float32 accumulation)
    q = q_BTHD.reshape(b, t, kv, h // kv, d).transpose(0, 2, 3, 1, 4).astype(k_BKDS.dtype)  # [B, KV, G, T, hd]
    scores = jnp.einsum("bkgtd,bkds->bkgts", q, k_BKDS, preferred_element_type=jnp.float32)
    scores = scores * (jnp.float32(scale) if scale is not None else 1.0 / jnp.sqrt(jnp.float32(d)))
    if softcap is not None:
        scores = softcap * jnp.tanh(scores / softcap)
    scores = jnp.where(mask_BTS[:, None, None, :, :], scores, _NEG)
    # softmax, normalised after the value matmul (one division over hd instead of over S). The max only keeps exp
    # in range; softmax does not depend on it, so it carries no gradient (saves the backward passes over [T, S]).
    top = jnp.max(scores, axis=-1, keepdims=True)
    if sinks is not None:
        sink = sinks.astype(jnp.float32).reshape(1, kv, h // kv, 1, 1)
        top = jnp.maximum(top, sink)
    top = jax.lax.stop_gradient(top)
    e = jnp.exp(scores - top)
    out = jnp.einsum("bkgts,bksd->bkgtd", e.astype(v_BKSD.dtype), v_BKSD, preferred_element_type=jnp.float32)
    denom = jnp.sum(e, axis=-1, keepdims=True)
    if sinks is not None:
        denom = denom + jnp.exp(sink - top)
    out = out / denom
    return out.transpose(0, 3, 1, 2, 4).reshape(b, t, h, d).astype(q_BTHD.dtype)


# ------------------------------------------------------------------------------------------------ implementations
# "auto" runs an accelerator kernel only for passes of at least this many queries (prefill, training, diffusion
# passes over a whole sequence). Shorter passes (decode steps, verifies) keep the XLA reference: on GPU the kernel
# path copies the K cache into the [B, S, KV, hd] layout cuDNN takes, once per layer and step, and the TPU kernel
# tiles queries in blocks of 128. A rule from the shapes, not a measurement: none was made on an accelerator.
AUTO_MIN_QUERIES = 128
_BLOCKS = (512, 256, 128)  # splash-attention tile sizes tried, largest first


def resolve_impl(impl: str, q_shape, k_shape, dtype, v_dtype=None, backend: str | None = None) -> str:
    """The implementation `attend` runs for ``impl``, from static facts only: q's shape [B,T,H,hd], k's [B,KV,hd,S],
    the cache's dtype (k's), v's dtype (default: k's) and the backend (default `jax.default_backend()`).

    "auto" picks "cudnn" on "gpu" when cuDNN can serve the call, T >= AUTO_MIN_QUERIES, and T and S are even (cuDNN
    refuses a masked pass of odd length under differentiation, and attend cannot tell whether it is differentiated);
    "pallas" on "tpu" when the kernel can serve the call, T >= AUTO_MIN_QUERIES and head_dim is a multiple of 128;
    "xla" otherwise, and always on "cpu". Any other impl is returned unchanged when it can serve the call, or raises
    `ConfigError` saying why not and what to use instead.
    """
    if impl not in ATTENTION_IMPLS:
        raise ConfigError(f"unknown attention impl {impl!r}; expected one of {', '.join(ATTENTION_IMPLS)}")
    backend = backend or jax.default_backend()
    dtype = jnp.dtype(dtype)
    v_dtype = dtype if v_dtype is None else jnp.dtype(v_dtype)
    if impl == "auto":
        t, s, d = q_shape[1], k_shape[-1], q_shape[-1]
        if t < AUTO_MIN_QUERIES:
            return "xla"
        if backend == "gpu" and t % 2 == 0 and s % 2 == 0 and \
                _why_not("cudnn", q_shape, k_shape, dtype, v_dtype, backend) is None:
            return "cudnn"
        if backend == "tpu" and d % 128 == 0 and _why_not("pallas", q_shape, k_shape, dtype, v_dtype, backend) is None:
            return "pallas"
        return "xla"
    why = _why_not(impl, q_shape, k_shape, dtype, v_dtype, backend)
    if why is not None:
        raise ConfigError(f"attention impl {impl!r} cannot serve this call: {why}; use impl='xla' (or 'auto')")
    return impl


def _why_not(impl: str, q_shape, k_shape, dtype, v_dtype, backend: str) -> str | None:
    """Why ``impl`` cannot serve a call of these shapes and dtypes on ``backend`` (None: it can)."""
    t, d, s = q_shape[1], q_shape[-1], k_shape[-1]
    if impl in ("xla", "dot_product"):
        return None
    if v_dtype != dtype:
        return f"k and v have different dtypes ({dtype}, {v_dtype})"
    if impl == "cudnn":
        if backend != "gpu":
            return f"cuDNN runs on a CUDA GPU and the backend is {backend!r}"
        d_max = _cudnn_head_dim_max()
        if d_max is None:
            return "the GPU backend is not CUDA (no cuDNN)"
        if dtype not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
            return f"cuDNN flash attention takes a bfloat16 or float16 cache, not {dtype}"
        if d % 8 or d > d_max:
            return f"cuDNN flash attention needs head_dim a multiple of 8 and at most {d_max} (got {d})"
        return None
    # "pallas" / "pallas_interpret": the splash-attention kernel
    if impl == "pallas" and backend != "tpu":
        return (f"the Pallas splash kernel compiles for TPU only and the backend is {backend!r} "
                "('pallas_interpret' runs it on any backend, slowly)")
    if _splash() is None:
        return "this JAX has no jax.experimental.pallas.ops.tpu.splash_attention"
    if dtype not in (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16)):
        return f"the splash kernel takes a float32 or bfloat16 cache, not {dtype}"
    if _tile(s, small=False) is None:
        return f"the splash kernel tiles keys in blocks of a multiple of 128 and S={s} is not one (grow the cache)"
    if _tile(t, small=True) is None:
        return f"the splash kernel tiles queries in blocks of 128, or one block of a multiple of 8 below 128 (T={t})"
    return None


@functools.lru_cache(maxsize=None)
def _cudnn_head_dim_max() -> int | None:
    """The largest head_dim cuDNN flash attention takes on the first GPU (256 from compute capability 9.0, 128
    before), or None without a CUDA GPU."""
    try:
        dev = jax.devices("gpu")[0]
    except RuntimeError:  # no GPU backend
        return None
    if "cuda" not in str(dev.client.platform_version).lower():
        return None
    cc = tuple(int(x) for x in str(getattr(dev, "compute_capability", "0.0")).split("."))
    return 256 if cc >= (9, 0) else 128


@functools.lru_cache(maxsize=None)
def _splash():
    """The splash-attention kernel module (jax.experimental.pallas.ops.tpu), or None where this JAX lacks it."""
    try:
        from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel
    except ImportError:
        return None
    return splash_attention_kernel


def _tile(n: int, small: bool) -> int | None:
    """The splash tile for a sequence of n: the largest of 512/256/128 dividing n, else (``small``) n itself when it
    is a multiple of 8 below 128; None when neither."""
    for b in _BLOCKS:
        if n % b == 0:
            return b
    return n if small and n < 128 and n % 8 == 0 else None


def _some_key(mask_BTS: jax.Array) -> jax.Array:
    """The mask with key slot 0 made visible to every query that sees no key (the kernels' softmax over an empty
    row is 0/0; the reference's is the mean of the values)."""
    s = jnp.arange(mask_BTS.shape[-1])
    return mask_BTS | (~jnp.any(mask_BTS, axis=-1, keepdims=True) & (s == 0))


def _attend_dot_product(q_BTHD, k_BKDS, v_BKSD, mask_BTS, implementation: str) -> jax.Array:
    """`jax.nn.dot_product_attention` ("xla" or "cudnn") in its [B, S, N, hd] layouts; GQA by fewer kv heads. A
    `CausalSelfMask` also sets ``is_causal`` (its mask hides every later key anyway), so cuDNN skips those tiles."""
    b, t, _, _ = q_BTHD.shape
    causal = isinstance(mask_BTS, CausalSelfMask)
    m = jnp.broadcast_to(mask_BTS.mask if causal else mask_BTS, (b, t, k_BKDS.shape[-1]))
    if implementation == "cudnn":
        m = _some_key(m)
    out = jax.nn.dot_product_attention(q_BTHD.astype(k_BKDS.dtype), jnp.transpose(k_BKDS, (0, 3, 1, 2)),
                                       jnp.swapaxes(v_BKSD, 1, 2), mask=m[:, None], is_causal=causal,
                                       implementation=implementation)
    return out.astype(q_BTHD.dtype)


def _attend_splash(q_BTHD, k_BKDS, v_BKSD, mask_BTS, interpret: bool) -> jax.Array:
    """The Pallas splash-attention kernel, one call per row (vmapped), the row's [T, S] mask given as a dynamic
    block mask: exact for any boolean mask, and tiles with no visible key are skipped. k stays in the cache's
    [KV, hd, S] layout (the kernel's SEQ_MINOR k layout); GQA by fewer kv heads."""
    sk = _splash()
    b, t, _, d = q_BTHD.shape
    s = k_BKDS.shape[-1]
    m = jnp.broadcast_to(mask_BTS.mask if isinstance(mask_BTS, CausalSelfMask) else mask_BTS, (b, t, s))
    m = _some_key(m)
    bq, bkv = _tile(t, small=True), _tile(s, small=False)
    sizes = sk.BlockSizes(block_q=bq, block_kv=bkv, block_kv_compute=bkv, block_q_dkv=bq, block_kv_dkv=bkv,
                          block_kv_dkv_compute=bkv, use_fused_bwd_kernel=True, k_layout=sk.QKVLayout.SEQ_MINOR)
    # the kernel takes no scale: q is scaled in float32, then cast to the cache's dtype (the matmul operands')
    q = (q_BTHD.astype(jnp.float32) * (1.0 / d ** 0.5)).astype(k_BKDS.dtype).transpose(0, 2, 1, 3)  # [B, H, T, hd]

    def dynamic(info):
        # Built under jit, MaskInfo.is_dynamic_mask is a traced bool that the kernel's __call__ tests in Python
        # (JAX 0.10); it only names a profiler scope.
        return None if info is None else info._replace(is_dynamic_mask=True)

    def row(m_TS, q_HTD, k_KDS, v_KSD):
        kernel = sk.make_splash_mha_single_device(m_TS[None], block_sizes=sizes, interpret=interpret)
        kernel = sk.SplashAttentionKernel(dynamic(kernel.fwd_mask_info), dynamic(kernel.dq_mask_info),
                                          dynamic(kernel.dkv_mask_info), **kernel.kwargs)
        return kernel(q_HTD, jnp.swapaxes(k_KDS, -1, -2), v_KSD)  # k's logical [KV, S, hd]; SEQ_MINOR swaps back

    out = jax.vmap(row)(m, q, k_BKDS, v_BKSD)  # [B, H, T, hd]
    return out.transpose(0, 2, 1, 3).astype(q_BTHD.dtype)


# ------------------------------------------------------------------------------------------------ masks
def causal_intra(t: int) -> jax.Array:
    """[T, T] lower-triangular (a chain of fresh tokens, or a prefill)."""
    return jnp.tril(jnp.ones((t, t), bool))


def padded_self_mask(lengths_B: jax.Array, t: int, causal: bool = True, window: int | None = None) -> jax.Array:
    """Mask for a pass with no cache over right-padded rows: keys s < lengths[b] (and s <= t when causal;
    s > t - window with a sliding window).
    """
    s = jnp.arange(t)
    q = jnp.arange(t)[None, :, None]
    valid = s[None, None, :] < lengths_B[:, None, None]
    if causal:
        valid = valid & (s[None, None, :] <= q)
    if window is not None:
        valid = valid & (s[None, None, :] > q - window)
    # A query that sees nothing (padding) gets key 0, so its ignored output stays finite.
    return valid | (~jnp.any(valid, axis=-1, keepdims=True) & (s[None, None, :] == 0))


def cache_mask(prev_lengths_B: jax.Array, intra_BTM: jax.Array, max_len: int,
               fresh_valid_BM: jax.Array | None = None, window: int | None = None,
               query_pos_BT: jax.Array | None = None) -> jax.Array:
    """Mask [B, T, max_len] over all cache slots for T queries, given M fresh slots at ``prev_lengths[b] + j``.

    Key slot s is visible to query t when s is committed (``s < prev_lengths[b]``), or s is fresh slot j
    (``s = prev_lengths[b] + j``) with ``intra[b, t, j]`` and ``fresh_valid[b, j]``. ``intra`` may be [T, M]
    (shared) or [B, T, M]; usually T = M (the queries are the fresh tokens), but a drafter expanding part of a tree
    asks with T < M. ``window`` (sliding-window attention) hides slots ``<= query_pos - window``.
    """
    if intra_BTM.ndim == 2:
        intra_BTM = intra_BTM[None]
    b = prev_lengths_B.shape[0]
    t, m = intra_BTM.shape[-2:]
    s = jnp.arange(max_len)[None, :]  # [1, S]
    rel = s - prev_lengths_B[:, None]  # [B, S]: index among the fresh slots
    is_fresh = (rel >= 0) & (rel < m)
    rel_c = jnp.clip(rel, 0, m - 1)
    intra = jnp.broadcast_to(intra_BTM, (b, t, m))
    fresh_vis = jnp.take_along_axis(intra, jnp.broadcast_to(rel_c[:, None, :], (b, t, max_len)), axis=2)
    if fresh_valid_BM is not None:
        fresh_vis = fresh_vis & jnp.take_along_axis(fresh_valid_BM, rel_c, axis=1)[:, None, :]
    vis = (rel < 0)[:, None, :] | (is_fresh[:, None, :] & fresh_vis)
    if window is not None and query_pos_BT is not None:
        # Slot index = position for committed and chain tokens; for tree nodes it is exact while window > depth.
        vis = vis & (s[:, None, :] > query_pos_BT[:, :, None] - window)
    return vis


def tree_intra(parents_N: jax.Array) -> jax.Array:
    """Ancestor-or-self mask [..., N, N] of trees given by ``parents [..., N]`` (root's parent = -1).

    Computed by pointer doubling (log2 N steps), no Python loop over nodes.
    """
    n = parents_N.shape[-1]
    par = jnp.where(parents_N < 0, jnp.arange(n), parents_N)  # root points to itself
    anc = jax.nn.one_hot(par, n, dtype=jnp.int32) | jnp.eye(n, dtype=jnp.int32)
    for _ in range(max(1, int(n - 1).bit_length())):
        # anc[i, j] |= exists k: anc[i, k] & anc[k, j]   (reachability doubles each step)
        anc = (jnp.matmul(anc, anc) > 0).astype(jnp.int32)
    return anc.astype(bool)
