"""Prompt lookup / n-gram drafting: no extra model.

The last n tokens of a row (n from ``ngram_max`` down to ``ngram_min``) are searched for in the row's own history
(prompt + generated); the tokens that followed a match are proposed. With ``branches > 1`` the most recent
matches with distinct next tokens become sibling chains of one tree (multi-candidate lookup). Proposals are a
deterministic function of the history, so sampled verification uses the q = 1 rule (``TREE_DETERMINISTIC``,
lossless).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from pdecode.decode import tree as tree_lib
from pdecode.decode.speculative import Context, Drafter, Proposal, StaticTreeShape
from pdecode.decode.verify import Rule, rule_for


def broom(branches: int, length: int) -> tree_lib.StaticTree:
    """``branches`` chains of ``length`` nodes hanging from the root."""
    return tree_lib.from_choices([[b] + [0] * (length - 1) for b in range(branches)])


def find_matches(seq: jax.Array, seq_len: jax.Array, ngram_max: int, ngram_min: int, n_best: int):
    """Start of the continuation after the best ``n_best`` matches per row (longest n first, then most recent).

    Returns (starts [B, n_best], found [B, n_best]). A match at s means seq[s:s+n] equals the last n tokens and
    at least one token follows it before the suffix itself.
    """
    b, s_max = seq.shape
    pos = jnp.arange(s_max)[None, :]
    best_score = jnp.full((b, s_max), -1, jnp.int32)
    for n in range(ngram_max, ngram_min - 1, -1):
        suffix_start = seq_len - n
        match = jnp.ones((b, s_max), bool)
        for j in range(n):
            want = jnp.take_along_axis(seq, jnp.clip(suffix_start + j, 0, s_max - 1)[:, None], axis=1)
            shifted = jnp.roll(seq, -j, axis=1)
            match = match & (shifted == want)
        # an earlier occurrence (not the suffix itself); its continuation s + n is then a known token
        ok = match & (pos < suffix_start[:, None]) & (suffix_start[:, None] >= 0)
        score = n * s_max + pos  # prefer longer n, then the latest position
        best_score = jnp.where(ok & (score > best_score), score, best_score)
    # pick the top matches by score; recover the continuation start from the score
    top, _ = jax.lax.top_k(best_score, n_best)
    found = top >= 0
    n_of = top // s_max
    start = top % s_max + n_of
    return jnp.where(found, start, 0), found


@dataclasses.dataclass(frozen=True)
class LookupDrafter(StaticTreeShape, Drafter):
    gamma: int = 4
    ngram_max: int = 3
    ngram_min: int = 1
    branches: int = 1

    @property
    def tree(self) -> tree_lib.StaticTree:
        return broom(self.branches, self.gamma)

    follows = True  # no state of its own: it reads the sequence (and the target's root hidden state) afresh

    def follow(self, dparams, dstate, ctx: Context):
        return dstate

    def propose(self, dparams, dstate, ctx: Context, key, samp, warp):
        b, s_max = ctx.seq.shape
        g = self.gamma
        # more candidates than branches, so branches can skip matches that repeat an earlier first token
        n_cand = min(s_max, 4 * self.branches)
        starts, found = find_matches(ctx.seq, ctx.seq_len, self.ngram_max, self.ngram_min, n_cand)
        idx = starts[:, :, None] + jnp.arange(g)[None, None, :]  # [B, C, g]
        toks = jnp.take_along_axis(ctx.seq, jnp.clip(idx, 0, s_max - 1).reshape(b, -1), axis=1).reshape(b, n_cand, g)
        tok_ok = found[:, :, None] & (idx < ctx.seq_len[:, None, None])
        # distinct first tokens among candidates, then the first `branches` of them
        first = toks[:, :, 0]
        dup = (first[:, :, None] == first[:, None, :]) & found[:, None, :] & \
            (jnp.arange(n_cand)[None, None, :] < jnp.arange(n_cand)[None, :, None])
        keep = found & ~jnp.any(dup, axis=-1)
        order = jnp.argsort(~keep, axis=1, stable=True)[:, : self.branches]
        toks = jnp.take_along_axis(toks, order[:, :, None], axis=1)
        tok_ok = jnp.take_along_axis(tok_ok, order[:, :, None], axis=1) & \
            jnp.take_along_axis(keep, order, axis=1)[:, :, None]
        tok_ok = jnp.cumprod(tok_ok.astype(jnp.int32), axis=2).astype(bool)  # a chain stops at its first gap
        root = jnp.take_along_axis(ctx.seq, (ctx.seq_len - 1)[:, None], axis=1)
        tokens = jnp.concatenate([root, toks.reshape(b, -1)], axis=1)
        valid = jnp.concatenate([jnp.ones((b, 1), bool), tok_ok.reshape(b, -1)], axis=1)
        return Proposal(tokens=tokens, parents=self.tree, valid=valid, q=None, draft_forwards=jnp.int32(0),
                        rule=rule_for(samp, Rule.TREE_DETERMINISTIC)), dstate
