"""Prompt lookup / n-gram drafting: no extra model.

The row's last tokens are searched for in its own history (prompt + generated): the occurrence that shares the
longest context with the row's end (up to ``ngram_max`` tokens, at least ``ngram_min``) wins, and the ``gamma``
tokens that followed it are proposed (`find_matches`). With ``branches > 1`` the most recent
matches with distinct next tokens become sibling chains of one tree (multi-candidate lookup). Proposals are a
deterministic function of the history, so sampled verification uses the q = 1 rule (``TREE_DETERMINISTIC``,
lossless).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import struct

from pdecode.decode import tree as tree_lib
from pdecode.decode.speculative import Context, Drafter, Proposal, StaticTreeShape
from pdecode.decode.verify import Rule, rule_for


def broom(branches: int, length: int) -> tree_lib.StaticTree:
    """``branches`` chains of ``length`` nodes hanging from the root."""
    return tree_lib.from_choices([[b] + [0] * (length - 1) for b in range(branches)])


NGRAM_MAX_LIMIT = 64  # the ranking's int32 score holds contexts up to this
AVAIL_RANKED = 63  # continuations longer than this rank alike


def find_matches(seq: jax.Array, seq_len: jax.Array, ngram_max: int, ngram_min: int, n_best: int,
                 gamma: int = 1, with_context: bool = False):
    """Start of the continuation after the best ``n_best`` matches per row.

    A candidate start s (1 <= s < seq_len: at least one known token follows) matches with context l when the l
    tokens before s equal the row's last l tokens (l up to ``ngram_max``; candidates with l < ``ngram_min`` are
    not matches). Candidates rank by the longest context, then by the continuation available (up to ``gamma``
    tokens: a match near the end has few tokens after it to propose), then by the latest position. The occurrence
    may overlap the suffix itself (a repeated token or phrase). Measured on SmolLM2's greedy outputs (48 prompts,
    HumanEval and ShareGPT, 256 tokens), this rule proposes 3.03 and 2.54 tokens per forward at gamma 10 where the
    latest match of the longest n-gram up to 3 gave 2.62 and 2.43, and transformers' first match of a 2-gram 2.78
    and 2.29 (docs/methods.md#prompt-lookup).

    Returns (starts [B, n_best], found [B, n_best]), and ``with_context`` the matches' context lengths [B, n_best]
    (0 where not found).
    """
    b, s_max = seq.shape
    pos = jnp.arange(s_max)[None, :]
    run = jnp.ones((b, s_max), bool)
    context = jnp.zeros((b, s_max), jnp.int32)
    for j in range(ngram_max):
        # the token j before s against the row's token j before its end
        want = jnp.take_along_axis(seq, jnp.clip(seq_len - 1 - j, 0, s_max - 1)[:, None], axis=1)
        before = jnp.roll(seq, j + 1, axis=1)  # before[s] = seq[s - 1 - j]
        run = run & (before == want) & (pos - 1 - j >= 0) & (seq_len[:, None] - 1 - j >= 0)
        context = context + run.astype(jnp.int32)
    ok = (context >= ngram_min) & (pos >= 1) & (pos < seq_len[:, None])
    cap = min(gamma, AVAIL_RANKED)
    avail = jnp.clip(seq_len[:, None] - pos, 0, cap)
    score = (context * (cap + 1) + avail) * s_max + pos  # < 2**31 while ngram_max <= NGRAM_MAX_LIMIT
    top, start = jax.lax.top_k(jnp.where(ok, score, -1), n_best)
    found = top >= 0
    if with_context:
        return jnp.where(found, start, 0), found, jnp.where(found, top // s_max // (cap + 1), 0)
    return jnp.where(found, start, 0), found


@struct.dataclass
class LookupState:
    accepted: jax.Array  # [ngram_max + 1] float32: decayed mean tokens accepted per drafted row, by match context
    context: jax.Array  # [B] int32: the context of the match each row drafted from this step (0: none)


EMA = 0.2  # weight of a step's acceptance in the decayed means


@dataclasses.dataclass(frozen=True)
class LookupDrafter(StaticTreeShape, Drafter):
    """``cost``: what a drafted step (finding the match, verifying 1 + gamma x branches tokens, committing) costs
    against a plain step on the device at the generation's batch (`pdecode.decode.cost`, measured when the method
    is prepared). A step drafts when every row that sets the batch's end (the most tokens left, within gamma)
    expects from it at least ``cost`` tokens: 1 + the decayed mean of what drafts from a match of the row's context
    length accepted (until measured: the context's length, at most gamma); otherwise it is a plain step (one
    token's forward, one token: `Drafter.worth_drafting`). No match in any live row: always plain. ``cost`` 1:
    every step with a match drafts."""

    gamma: int = 10
    ngram_max: int = 8
    ngram_min: int = 1
    branches: int = 1
    cost: float = 1.0

    @property
    def tree(self) -> tree_lib.StaticTree:
        return broom(self.branches, self.gamma)

    follows = True  # its state (acceptance means) stays right across a plain step: nothing was drafted

    def init(self, dparams, tparams, prompt_BP, plen_B, prefill_out, max_len: int, cache_dtype=None,
             shared_prefix: int = 0):
        # the prior, until a context length is seen, a match with l tokens of context accepts about l tokens (SmolLM2's
        # outputs: about 1 after 1, 2 after 2, 8 after 8; docs/methods.md), at most gamma
        prior = jnp.minimum(jnp.arange(self.ngram_max + 1), self.gamma).astype(jnp.float32)
        return LookupState(accepted=prior,
                           context=jnp.zeros(prompt_BP.shape[:1], jnp.int32))

    def follow(self, dparams, dstate, ctx: Context):
        return dstate

    def worth_drafting(self, dparams, dstate: LookupState, ctx: Context):
        # on SmolLM2's outputs a third of the steps have no match at all (a token new to the row), and a match of one
        # token of context accepts about one token: a (1 + gamma)-token forward is worth it where it costs about one.
        # A batch ends with its last row, so a step pays when it moves the rows furthest from their end (those within
        # gamma tokens of the most remaining): the least any of them is expected to take must reach the step's cost
        # (a row ahead that drafts well only finishes earlier and waits)
        _, found, context = find_matches(ctx.seq, ctx.seq_len, self.ngram_max, self.ngram_min, 1, self.gamma,
                                         with_context=True)
        live = found[:, 0] & ctx.active
        expected = 1.0 + jnp.where(live, dstate.accepted[context[:, 0]], 0.0)
        behind = ctx.active
        if ctx.remaining is not None:
            most = jnp.max(jnp.where(ctx.active, ctx.remaining, jnp.iinfo(jnp.int32).min))
            behind = behind & (ctx.remaining >= most - self.gamma)
        least = jnp.min(jnp.where(behind, expected, jnp.inf))
        return jnp.any(live) & (least >= self.cost)

    def update(self, dparams, dstate: LookupState, ctx: Context, ver, hidden_BND, layers_nBND):
        n = self.ngram_max + 1
        drafted = ctx.active & (dstate.context > 0)
        got = jax.ops.segment_sum(jnp.where(drafted, ver.n_accepted, 0).astype(jnp.float32), dstate.context, n)
        rows = jax.ops.segment_sum(drafted.astype(jnp.float32), dstate.context, n)
        seen = rows > 0
        mean = got / jnp.maximum(rows, 1.0)
        accepted = jnp.where(seen, (1 - EMA) * dstate.accepted + EMA * mean, dstate.accepted).at[0].set(0.0)
        return dstate.replace(accepted=accepted)

    def propose(self, dparams, dstate, ctx: Context, key, samp, warp):
        b, s_max = ctx.seq.shape
        g = self.gamma
        # more candidates than branches, so branches can skip matches that repeat an earlier first token
        n_cand = min(s_max, 4 * self.branches)
        starts, found, context = find_matches(ctx.seq, ctx.seq_len, self.ngram_max, self.ngram_min, n_cand, g,
                                              with_context=True)
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
        used = jnp.where(jnp.any(tok_ok[:, :, 0], axis=1), context[:, 0], 0)  # (the best match leads the branches)
        return Proposal(tokens=tokens, parents=self.tree, valid=valid, q=None, draft_forwards=jnp.int32(0),
                        rule=rule_for(samp, Rule.TREE_DETERMINISTIC)), dstate.replace(context=used)
