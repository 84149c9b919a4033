"""Drafting with a Gemma 4 assistant (`pdecode.model.assistant`): a chain of ``gamma`` tokens per step.

The assistant keeps no state of its own: each step it reads the target's KV cache (its committed tokens) and the
target's final hidden state at the token before the root, then drafts ``gamma`` tokens one after another, all at the
root's position, each from the previous token's embedding and its own projected hidden state. The chain is verified
like a draft model's (greedy: exact match; sampled: speculative sampling against the drafts' own distributions).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from pdecode import sampling
from pdecode.config import ModelConfig
from pdecode.decode import tree as tree_lib
from pdecode.decode.speculative import Context, Drafter, Proposal
from pdecode.decode.verify import Rule, rule_for
from pdecode.model import assistant as A


@dataclasses.dataclass(frozen=True)
class AssistantDrafter(Drafter):
    cfg: ModelConfig
    acfg: A.AssistantConfig
    gamma: int

    max_children = 1

    @property
    def tree_size(self) -> int:
        return self.gamma + 1

    @property
    def max_depth(self) -> int:
        return self.gamma

    def propose(self, dparams, dstate, ctx: Context, key, samp, warp):
        b, g = ctx.seq.shape[0], self.gamma
        root = jnp.take_along_axis(ctx.seq, (ctx.seq_len - 1)[:, None], axis=1)[:, 0]
        n = ctx.cache.lengths  # committed tokens (the root is not among them)
        pos = ctx.seq_len - 1
        tokens = jnp.zeros((b, g + 1), jnp.int32).at[:, 0].set(root)
        v = self.cfg.vocab_size
        qs = None if samp.greedy else jnp.zeros((b, g + 1, v), jnp.float32)

        def body(i, c):
            tok, h, toks, q = c
            lg, h = A.step(dparams, self.acfg, self.cfg, ctx.target, tok, h, pos, ctx.cache, n)
            nxt = sampling.sample(sampling.fold_in(key, i), lg, samp, warp)
            toks = jax.lax.dynamic_update_slice_in_dim(toks, nxt[:, None], i + 1, axis=1)
            if q is not None:
                q = jax.lax.dynamic_update_slice_in_dim(q, sampling.probs(lg, samp, warp)[:, None], i, axis=1)
            return nxt, h.astype(ctx.root_hidden.dtype), toks, q

        _, _, tokens, qs = jax.lax.fori_loop(0, g, body, (root, ctx.root_hidden, tokens, qs))
        prop = Proposal(tokens=tokens, parents=tree_lib.chain(g), valid=jnp.ones((b, g + 1), bool), q=qs,
                        draft_forwards=jnp.int32(g), rule=rule_for(samp, Rule.CHAIN_SAMPLING))
        return prop, dstate
