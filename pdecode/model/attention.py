"""One attention for every mask kind, and the mask builders.

A mask is boolean ``[B, T, S]``: query t of row b may read key slot s. Every decoding method builds its mask from
the same few pieces: committed cache slots (``s < lengths[b]``), the fresh tokens of this pass with an
``intra`` mask among themselves (causal for chains and prefill, ancestor-of for trees, all-ones for
bidirectional blocks), and padding.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

_NEG = -1e30


class CausalSelfMask(NamedTuple):
    """A self-attention mask ``[B, T, T]`` (keys = the T queries' own tokens, no cache) that hides every key after
    its query. `attend` then splits the queries into ``blocks`` and lets each block read only the keys up to its
    last query: (n + 1) / 2n of the score entries for n blocks (5/8 at 4), the same result. Training passes use it
    (`train.objectives.causal_hidden`)."""

    mask: jax.Array
    blocks: int = 4


def attend(q_BTHD: jax.Array, k_BKDS: jax.Array, v_BKSD: jax.Array, mask_BTS) -> jax.Array:
    """Grouped-query attention. q: [B,T,H,hd]; k: [B,KV,hd,S] (transposed, the cache layout); v: [B,KV,S,hd];
    mask: [B,T,S] (True = visible), or a `CausalSelfMask`. Returns [B,T,H,hd].

    Scores and softmax run in float32 whatever the input dtypes. A query with no visible key gets the mean of all
    values (masks always give a real query at least one key).
    """
    if isinstance(mask_BTS, CausalSelfMask):
        t, n = q_BTHD.shape[1], mask_BTS.blocks
        if n <= 1 or t % n or t // n < 16:
            return attend(q_BTHD, k_BKDS, v_BKSD, mask_BTS.mask)
        bs, m = t // n, mask_BTS.mask
        return jnp.concatenate([attend(q_BTHD[:, i * bs:(i + 1) * bs], k_BKDS[..., :(i + 1) * bs],
                                       v_BKSD[:, :, :(i + 1) * bs], m[:, i * bs:(i + 1) * bs, :(i + 1) * bs])
                                for i in range(n)], axis=1)
    b, t, h, d = q_BTHD.shape
    kv = k_BKDS.shape[1]
    # the matmuls run in the cache's dtype (a bf16 cache: bf16 operands, float32 accumulation)
    q = q_BTHD.reshape(b, t, kv, h // kv, d).transpose(0, 2, 3, 1, 4).astype(k_BKDS.dtype)  # [B, KV, G, T, hd]
    scores = jnp.einsum("bkgtd,bkds->bkgts", q, k_BKDS, preferred_element_type=jnp.float32)
    scores = jnp.where(mask_BTS[:, None, None, :, :], scores * (1.0 / jnp.sqrt(jnp.float32(d))), _NEG)
    # softmax, normalised after the value matmul (one division over hd instead of over S). The max only keeps exp
    # in range; softmax does not depend on it, so it carries no gradient (saves the backward passes over [T, S]).
    e = jnp.exp(scores - jax.lax.stop_gradient(jnp.max(scores, axis=-1, keepdims=True)))
    out = jnp.einsum("bkgts,bksd->bkgtd", e.astype(v_BKSD.dtype), v_BKSD, preferred_element_type=jnp.float32)
    out = out / jnp.sum(e, axis=-1, keepdims=True)
    return out.transpose(0, 3, 1, 2, 4).reshape(b, t, h, d).astype(q_BTHD.dtype)


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
