"""The verification core shared by every drafter.

    verify(target_logits [B,N,V], tree, ..., rule=...) -> (accepted path [B, D+1], n_accepted [B], bonus [B])

Node 0 of the tree is the last committed token; the target's logits at node i give the distribution of i's
children. The outcome at each node is computed for all nodes at once (it depends only on that node's target
distribution, its children and their coins); the accepted path then follows accepted-child pointers from the root.

Which acceptance test applies is one explicit, static choice, the `Rule` a drafter puts on its proposal (`rule_for`
picks ``GREEDY`` whenever sampling is greedy); `verify` dispatches on it in one place:

* ``GREEDY``: a child is accepted when its token is the target's argmax; the bonus is the argmax at the last
  accepted node. Output equals greedy AR.
* ``CHAIN_SAMPLING`` (speculative sampling, Leviathan/Chen) and ``TREE_MULTI`` (SpecInfer-style multi-branch):
  the children were sampled from the draft distribution ``q`` (``draft_q``; for several siblings, without
  replacement). Children are tried in order; child x is accepted with prob ``min(1, r(x) / q(x))`` where r starts
  as the target distribution p; on rejection ``r <- norm(max(0, r - q))`` and ``q <- norm(q without x)``. If no
  child is accepted the bonus is drawn from r. Lossless. A chain is the one-child case.
* ``TREE_DETERMINISTIC``: the children were chosen deterministically (top-k trees, n-gram lookup, EAGLE/Medusa
  candidates): the q = 1 case: accept x with prob r(x); on rejection zero r at x and renormalise. Lossless.
* ``TYPICAL``: Medusa's typical acceptance (LOSSY: the output no longer follows the target distribution): the first
  child x with p(x) > min(epsilon, delta * exp(-H(p))) is accepted; the bonus is drawn from p at the last node.
"""

from __future__ import annotations

import enum
from typing import NamedTuple

import jax
import jax.numpy as jnp

from pdecode import sampling
from pdecode.decode import tree as tree_lib


class Rule(str, enum.Enum):
    """How a proposal is verified (a Python value: static under jit)."""

    GREEDY = "greedy"
    CHAIN_SAMPLING = "chain_sampling"
    TREE_MULTI = "tree_multi"
    TREE_DETERMINISTIC = "tree_deterministic"
    TYPICAL = "typical"


def rule_for(samp: sampling.Sampling, sampled: Rule) -> Rule:
    """The rule a drafter's proposal is verified by: ``GREEDY`` under greedy sampling, else ``sampled`` (the rule
    that matches how the drafter chose its children)."""
    return Rule.GREEDY if samp.greedy else Rule(sampled)


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
    walk ends there). ``deterministic``: the q = 1 rule (``q_BNV`` unused), else speculative sampling against
    ``q_BNV``. Vectorised over rows and nodes; the loop is over sibling rank (K, static)."""
    b, n, v = p_BNV.shape
    k_max = children_BNK.shape[-1]
    r = p_BNV
    q = q_BNV
    accepted = jnp.full((b, n), -1, jnp.int32)
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


def _first_child_where(children_BNK, tokens_BN, accept_fn):
    """[B, N] the first child (in order) whose token passes ``accept_fn(tokens [B, N]) -> bool [B, N]``, else -1."""
    b, n, k_max = children_BNK.shape
    accepted = jnp.full((b, n), -1, jnp.int32)
    for j in range(k_max - 1, -1, -1):  # later ranks first, so the earliest passing child is written last
        c = children_BNK[:, :, j]
        tok = jnp.take_along_axis(tokens_BN, jnp.maximum(c, 0), axis=1)
        accepted = jnp.where((c >= 0) & accept_fn(tok), c, accepted)
    return accepted


def _at_end(x_BN, path, n_acc):
    """x at each row's last accepted node: [B] (or [B, ...] for x [B, N, ...])."""
    b = x_BN.shape[0]
    return jnp.take_along_axis(x_BN, path[jnp.arange(b), n_acc].reshape((b, 1) + (1,) * (x_BN.ndim - 2)),
                               axis=1)[:, 0]


def _verify_greedy(logits, tokens, children, key, samp, warp, max_depth, draft_q, typical):
    best = sampling.argmax(logits)  # [B, N]
    accepted = _first_child_where(children, tokens, lambda tok: tok == best)
    path, n_acc = walk(accepted, max_depth)
    return path, n_acc, _at_end(best, path, n_acc)


def _verify_typical(logits, tokens, children, key, samp, warp, max_depth, draft_q, typical):
    eps, delta = typical
    p = sampling.probs(logits, samp, warp)
    ent = -jnp.sum(jnp.where(p > 0, p * jnp.log(jnp.maximum(p, 1e-30)), 0.0), axis=-1)  # [B, N]
    thresh = jnp.minimum(eps, delta * jnp.exp(-ent))
    accepted = _first_child_where(children, tokens,
                                  lambda tok: jnp.take_along_axis(p, tok[..., None], axis=-1)[..., 0] > thresh)
    path, n_acc = walk(accepted, max_depth)
    return path, n_acc, sampling.sample_from_probs(key, _at_end(p, path, n_acc))


def _verify_residual(deterministic: bool):
    """Speculative sampling against the draft's q (``deterministic=False``) or the q = 1 rule (True)."""

    def run(logits, tokens, children, key, samp, warp, max_depth, draft_q, typical):
        b, n, _ = logits.shape
        k_coin, k_res = sampling.split(key)
        p = sampling.probs(logits, samp, warp)
        q = None if deterministic else draft_q.astype(jnp.float32)
        coins = sampling.uniform(k_coin, (b, n))
        accepted, residual = node_outcomes(p, tokens, children, q, coins, k_res, deterministic=deterministic)
        path, n_acc = walk(accepted, max_depth)
        return path, n_acc, _at_end(residual, path, n_acc)

    return run


_RULES = {
    Rule.GREEDY: _verify_greedy,
    Rule.CHAIN_SAMPLING: _verify_residual(deterministic=False),
    Rule.TREE_MULTI: _verify_residual(deterministic=False),
    Rule.TREE_DETERMINISTIC: _verify_residual(deterministic=True),
    Rule.TYPICAL: _verify_typical,
}


def check_rule(rule, samp: sampling.Sampling, draft_q, typical, max_children: int) -> Rule:
    """``rule`` as a `Rule`, after checking it fits the sampling mode and what the drafter supplied (trace time)."""
    rule = Rule(rule)
    if (rule is Rule.GREEDY) != samp.greedy:
        raise ValueError(f"verification rule {rule.value!r} does not fit {'greedy' if samp.greedy else 'sampled'} "
                         f"decoding: use verify.rule_for(samp, ...)")
    needs_q = rule in (Rule.CHAIN_SAMPLING, Rule.TREE_MULTI)
    if needs_q != (draft_q is not None):
        raise ValueError(f"verification rule {rule.value!r} " + (
            "needs the draft distribution draft_q the children were sampled from" if needs_q else
            "takes no draft distribution (draft_q must be None)"))
    if rule is Rule.CHAIN_SAMPLING and max_children != 1:
        raise ValueError(f"rule 'chain_sampling' verifies a chain, but nodes here have up to {max_children} children:"
                         f" use 'tree_multi'")
    if rule is Rule.TYPICAL and typical is None:
        raise ValueError("rule 'typical' needs its thresholds typical=(epsilon, delta)")
    return rule


def verify(logits_BNV: jax.Array, tokens_BN: jax.Array, parents, valid_BN: jax.Array, key: jax.Array,
           samp: sampling.Sampling, warp, *, rule: Rule, max_depth: int, max_children: int,
           draft_q_BNV: jax.Array | None = None, typical: tuple[float, float] | None = None) -> Verified:
    """Accept the longest valid path of a drafted tree by ``rule`` and draw one bonus token (module docstring).

    ``parents``: [N] (static tree, shared) or [B, N]; ``valid``: [B, N] (False for nodes not proposed this step;
    node 0 must be valid). ``draft_q``: the draft distribution each node's children were drawn from (the
    ``CHAIN_SAMPLING`` and ``TREE_MULTI`` rules; None otherwise). ``typical = (epsilon, delta)``: the thresholds of
    the ``TYPICAL`` rule (read by no other rule).
    """
    rule = check_rule(rule, samp, draft_q_BNV, typical, max_children)
    b, n, _ = logits_BNV.shape
    parents_BN = jnp.broadcast_to(jnp.asarray(parents, jnp.int32), (b, n))
    children = tree_lib.children_table(parents_BN, valid_BN, max_children)
    path, n_acc, bonus = _RULES[rule](logits_BNV, tokens_BN, children, key, samp, warp, max_depth,
                                      draft_q_BNV, typical)
    drafted = jnp.take_along_axis(tokens_BN, path[:, 1:], axis=1)  # [B, D]
    out = jnp.concatenate([drafted, jnp.zeros((b, 1), jnp.int32)], axis=1)
    out = out.at[jnp.arange(b), n_acc].set(bonus)
    return Verified(path=path, n_accepted=n_acc, bonus=bonus, tokens=out)
