"""Drafting with a Gemma 4 assistant (`pdecode.model.families.gemma4_assistant`): a chain of ``gamma`` tokens per step, or an
EAGLE-2 dynamic tree (``tree_top_k`` > 1).

The assistant keeps no state of its own: each step it reads the target's KV cache (its committed tokens) and the
target's final hidden state at the token before the root, then drafts ``gamma`` tokens one after another, all at the
root's position, each from the previous token's embedding and its own projected hidden state. The chain is verified
like a draft model's (greedy: exact match; sampled: speculative sampling against the drafts' own distributions).

A tree: since drafted tokens write no keys, a node's expansion depends only on its token and its parent's hidden
state, so each level's frontier (``tree_top_k`` nodes per row) runs as one pass of independent queries, the best
children kept as EAGLE-2 keeps them (`draft_model.grow_dynamic_tree`); its children are top-k picks, verified by
the deterministic-draft rule when sampling (lossless).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from pdecode import sampling
from pdecode.config import ModelConfig
from pdecode.decode import common
from pdecode.decode import tree as tree_lib
from pdecode.decode.speculative import Context, Drafter, Proposal
from pdecode.decode.verify import Rule, rule_for
from pdecode.model.families import gemma4_assistant as A


@dataclasses.dataclass(frozen=True)
class AssistantDrafter(Drafter):
    cfg: ModelConfig
    acfg: A.AssistantConfig
    gamma: int
    tree_top_k: int = 1  # > 1: an EAGLE-2 dynamic tree of depth gamma
    total_tokens: int = 0  # the tree's nodes kept (default gamma x tree_top_k)

    @property
    def max_children(self) -> int:
        return self.tree_top_k

    @property
    def tree_size(self) -> int:
        return (self.total_tokens or self.gamma * self.tree_top_k) + 1 if self.tree_top_k > 1 else self.gamma + 1

    @property
    def max_depth(self) -> int:
        return self.gamma

    def propose(self, dparams, dstate, ctx: Context, key, samp, warp):
        if self.tree_top_k > 1:
            return self._tree(dparams, ctx, samp, warp), dstate
        b, g = ctx.seq.shape[0], self.gamma
        root = jnp.take_along_axis(ctx.seq, (ctx.seq_len - 1)[:, None], axis=1)[:, 0]
        n = ctx.cache.lengths  # committed tokens (the root is not among them)
        pos = ctx.seq_len - 1
        tokens = jnp.zeros((b, g + 1), jnp.int32).at[:, 0].set(root)
        v = self.cfg.vocab_size
        qs = None if samp.greedy else jnp.zeros((b, g + 1, v), jnp.float32)
        gmask = common.grammar_masker(ctx.gstate, v, samp, warp)  # drafts drawn among the grammar's tokens

        def body(i, c):
            tok, h, toks, q, gs = c
            lg, h = A.step(dparams, self.acfg, self.cfg, ctx.target, tok, h, pos, ctx.cache, n)
            lg, gs = gmask(lg, gs, jnp.where(i == 0, -1, tok))  # (the first draw: the root's state)
            nxt = sampling.sample(sampling.fold_in(key, i), lg, samp, warp)
            toks = jax.lax.dynamic_update_slice_in_dim(toks, nxt[:, None], i + 1, axis=1)
            if q is not None:
                q = jax.lax.dynamic_update_slice_in_dim(q, sampling.probs(lg, samp, warp)[:, None], i, axis=1)
            return nxt, h.astype(ctx.root_hidden.dtype), toks, q, gs

        _, _, tokens, qs, _ = jax.lax.fori_loop(0, g, body, (root, ctx.root_hidden, tokens, qs, ctx.gstate))
        prop = Proposal(tokens=tokens, parents=tree_lib.chain(g), valid=jnp.ones((b, g + 1), bool), q=qs,
                        draft_forwards=jnp.int32(g), rule=rule_for(samp, Rule.CHAIN_SAMPLING))
        return prop, dstate

    def _tree(self, dparams, ctx: Context, samp, warp):
        from pdecode.decode.draft_model import grow_dynamic_tree

        root = jnp.take_along_axis(ctx.seq, (ctx.seq_len - 1)[:, None], axis=1)[:, 0]
        n = ctx.cache.lengths
        pos = ctx.seq_len - 1  # every draft step sits at the root's position
        lg0, h0 = A.step(dparams, self.acfg, self.cfg, ctx.target, root, ctx.root_hidden, pos, ctx.cache, n)

        def expand(c, tokens, positions, write_at, mask, state):
            del positions, write_at, mask  # no keys of its own: the target cache's committed slots only
            p = jnp.broadcast_to(pos[:, None], tokens.shape)
            lg, h = A.step(dparams, self.acfg, self.cfg, ctx.target, tokens, state, p, ctx.cache, n)
            return lg, c, h.astype(state.dtype)

        total = self.total_tokens or self.gamma * self.tree_top_k
        prop, _ = grow_dynamic_tree(ctx, _NoCache(), jax.nn.log_softmax(lg0), self.tree_top_k, self.gamma, total,
                                    expand, base_B=n, pos1_B=pos, state0=h0.astype(ctx.root_hidden.dtype),
                                    rule=rule_for(samp, Rule.TREE_DETERMINISTIC),
                                    grammar_tables=warp.grammar if samp.grammar else None)
        return prop


class _NoCache:
    """The tree grower's drafter cache, for a drafter that keeps none (its masks go unused)."""

    max_len = 1
