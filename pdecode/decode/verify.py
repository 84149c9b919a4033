"""The verification core shared by every drafter.

    verify(target_logits [B,N,V], tree, draft_q, key, sampling) -> (accepted path [B, D+1], n_accepted [B], bonus [B])

Node 0 of the tree is the last committed token; the target's logits at node i give the distribution of i's
children. The outcome at each node is computed for all nodes at once (it depends only on that node's target
distribution, its children and their coins); the accepted path then follows accepted-child pointers from the root.

Rules
* greedy: a child is accepted when its token is the target's argmax; the bonus is the argmax at the last
  accepted node. Output equals greedy AR.
* sampled children (``draft_q`` given, chain SD and trees drawn without replacement from q): children are tried
  in order; child x is accepted with prob ``min(1, r(x) / q(x))`` where r starts as the target distribution p;
  on rejection ``r <- norm(max(0, r - q))`` and ``q <- norm(q without x)``. If no child is accepted the bonus
  is drawn from r. This is lossless speculative sampling (Leviathan/Chen for one child; SpecInfer-style
  multi-branch for several).
* deterministic children (``draft_q=None`` while sampling: top-k trees, n-gram lookup): the q = 1 case:
  accept x with prob r(x); on rejection zero r at x and renormalise. Also lossless.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from pdecode import sampling
from pdecode.decode import tree as tree_lib


class Verified(NamedTuple):
    path: jax.Array  # [B, D+1] node indices from the root, valid up to n_accepted
    n_accepted: jax.Array  # [B] accepted draft tokens (the bonus not counted)
    bonus: jax.Array  # [B] one token from the target at the end of the accepted path
    tokens: jax.Array  # [B, D+1] accepted draft tokens followed by the bonus (n_accepted + 1 valid)


def _normalize(x, axis=-1):
    s = jnp.sum(x, axis=axis, keepdims=True)
    return jnp.where(s > 0, x / jnp.maximum(s, 1e-30), x)


def node_outcomes(p_BNV, tokens_BN, children_BNK, q_BNV, coins_BN, key, deterministic: bool):
    """For every node: the accepted child (-1 if none) and a draw from its final residual (the bonus if the
    walk ends there). Vectorised over rows and nodes; the loop is over sibling rank (K, static)."""
    b, n, v = p_BNV.shape
    k_max = children_BNK.shape[-1]
    r = p_BNV
    q = q_BNV
    accepted = jnp.full((b, n), -1, jnp.int32)
    rows = jnp.arange(b)[:, None]
    for j in range(k_max):
        c = children_BNK[:, :, j]  # [B, N]
        has = c >= 0
        cc = jnp.maximum(c, 0)
        x = jnp.take_along_axis(tokens_BN, cc, axis=1)  # child's token
        u = jnp.take_along_axis(coins_BN, cc, axis=1)
        rx = jnp.take_along_axis(r, x[..., None], axis=-1)[..., 0]
        searching = has & (accepted < 0)
        if deterministic:
            acc_p = rx
        else:
            qx = jnp.take_along_axis(q, x[..., None], axis=-1)[..., 0]
            acc_p = jnp.where(qx > 0, jnp.minimum(1.0, rx / jnp.maximum(qx, 1e-30)), 1.0)
        ok = searching & (u < acc_p)
        accepted = jnp.where(ok, c, accepted)
        reject = (searching & ~ok)[..., None]
        onehot_x = jax.nn.one_hot(x, v, dtype=r.dtype)
        if deterministic:
            r_new = _normalize(r * (1.0 - onehot_x))
        else:
            r_new = _normalize(jnp.maximum(r - q, 0.0))
            q = jnp.where(reject, _normalize(q * (1.0 - onehot_x)), q)
        # guard: a residual with no mass left (p == q up to rounding) keeps the previous distribution
        r = jnp.where(reject & (jnp.sum(r_new, -1, keepdims=True) > 0), r_new, r)
    del rows
    residual = sampling.sample_from_probs(key, r)
    return accepted, residual


def walk(accepted_BN: jax.Array, max_depth: int) -> tuple[jax.Array, jax.Array]:
    """Follow accepted-child pointers from the root: (path [B, D+1], n_accepted [B])."""
    b = accepted_BN.shape[0]
    node = jnp.zeros((b,), jnp.int32)
    path = [node]
    n_acc = jnp.zeros((b,), jnp.int32)
    for _ in range(max_depth):
        nxt = jnp.take_along_axis(accepted_BN, node[:, None], axis=1)[:, 0]
        go = nxt >= 0
        node = jnp.where(go, nxt, node)
        n_acc = n_acc + go.astype(jnp.int32)
        path.append(node)
    return jnp.stack(path, axis=1), n_acc


def verify(logits_BNV: jax.Array, tokens_BN: jax.Array, parents, valid_BN: jax.Array, key: jax.Array,
           samp: sampling.Sampling, temperature, top_p, *, max_depth: int, max_children: int,
           draft_q_BNV: jax.Array | None = None, typical: tuple[float, float] | None = None) -> Verified:
    """Accept the longest valid path of a drafted tree and draw one bonus token (see module docstring).

    ``parents``: [N] (static tree, shared) or [B, N]; ``valid``: [B, N] (False for nodes not proposed this step;
    node 0 must be valid). ``draft_q``: the draft distribution each node's children were drawn from (sampled
    mode); ``None`` means the children were chosen deterministically. ``typical = (epsilon, delta)`` switches the
    sampled mode to Medusa's typical acceptance (LOSSY: the output no longer follows the target distribution):
    the first child x with p(x) > min(epsilon, delta * exp(-H(p))) is accepted.
    """
    b, n, _ = logits_BNV.shape
    parents_BN = jnp.broadcast_to(jnp.asarray(parents, jnp.int32), (b, n))
    children = tree_lib.children_table(parents_BN, valid_BN, max_children)
    if samp.greedy:
        best = sampling.argmax(logits_BNV)  # [B, N]
        accepted = jnp.full((b, n), -1, jnp.int32)
        for j in range(max_children - 1, -1, -1):  # the first matching child (in order) wins
            c = children[:, :, j]
            tok = jnp.take_along_axis(tokens_BN, jnp.maximum(c, 0), axis=1)
            accepted = jnp.where((c >= 0) & (tok == best), c, accepted)
        path, n_acc = walk(accepted, max_depth)
        bonus = jnp.take_along_axis(best, path[jnp.arange(b), n_acc][:, None], axis=1)[:, 0]
    elif typical is not None:
        eps, delta = typical
        p = sampling.probs(logits_BNV, samp, temperature, top_p)
        ent = -jnp.sum(jnp.where(p > 0, p * jnp.log(jnp.maximum(p, 1e-30)), 0.0), axis=-1)  # [B, N]
        thresh = jnp.minimum(eps, delta * jnp.exp(-ent))
        accepted = jnp.full((b, n), -1, jnp.int32)
        for j in range(max_children - 1, -1, -1):
            c = children[:, :, j]
            tok = jnp.take_along_axis(tokens_BN, jnp.maximum(c, 0), axis=1)
            px = jnp.take_along_axis(p, tok[..., None], axis=-1)[..., 0]
            accepted = jnp.where((c >= 0) & (px > thresh), c, accepted)
        path, n_acc = walk(accepted, max_depth)
        final = path[jnp.arange(b), n_acc]
        p_final = jnp.take_along_axis(p, final[:, None, None], axis=1)[:, 0]
        bonus = sampling.sample_from_probs(key, p_final)
    else:
        k_coin, k_res = jax.random.split(key)
        p = sampling.probs(logits_BNV, samp, temperature, top_p)
        q = None if draft_q_BNV is None else draft_q_BNV.astype(jnp.float32)
        coins = jax.random.uniform(k_coin, (b, n))
        accepted, residual = node_outcomes(p, tokens_BN, children, q, coins, k_res, deterministic=q is None)
        path, n_acc = walk(accepted, max_depth)
        bonus = jnp.take_along_axis(residual, path[jnp.arange(b), n_acc][:, None], axis=1)[:, 0]
    drafted = jnp.take_along_axis(tokens_BN, path[:, 1:], axis=1)  # [B, D]
    out = jnp.concatenate([drafted, jnp.zeros((b, 1), jnp.int32)], axis=1)
    out = out.at[jnp.arange(b), n_acc].set(bonus)
    return Verified(path=path, n_accepted=n_acc, bonus=bonus, tokens=out)
