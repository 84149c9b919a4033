"""Jacobi decoding: the target drafts for itself, with no extra weights.

A row keeps a block of ``block`` guessed tokens after its root. Each step feeds the root and the block in one target
forward (a chain); the target's prediction at every position is one Jacobi update of the whole block at once
(y_i = argmax p(. | root, g_1 .. g_i)). The verifier accepts the longest prefix of guesses that already equals
those predictions (the converged part) plus the bonus; the predictions past the accepted prefix become the next
block (the Jacobi iterate, shifted to start after the new root), the last prediction repeated to fill it.
Greedy output equals AR's; under sampling the guesses are a deterministic function of the history, so the q = 1
rule (``TREE_DETERMINISTIC``) keeps the output lossless.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import struct

from pdecode import sampling
from pdecode.decode import tree as tree_lib
from pdecode.decode.speculative import Context, Drafter, Proposal, StaticTreeShape
from pdecode.decode.verify import Rule, Verified, rule_for


@struct.dataclass
class JacobiState:
    guess: jax.Array  # [B, block] the current iterate after the root


@dataclasses.dataclass(frozen=True)
class JacobiDrafter(StaticTreeShape, Drafter):
    block: int = 8

    @property
    def tree(self) -> tree_lib.StaticTree:
        return tree_lib.chain(self.block)

    def init(self, dparams, tparams, prompt_BP, plen_B, prefill_out, max_len: int, cache_dtype=None,
             shared_prefix: int = 0):
        # the first iterate: the prompt's last `block` tokens (any guess converges to the same fixed point)
        idx = jnp.clip(plen_B[:, None] - self.block + jnp.arange(self.block)[None, :], 0, prompt_BP.shape[1] - 1)
        return JacobiState(guess=jnp.take_along_axis(prompt_BP, idx, axis=1))

    def propose(self, dparams, dstate: JacobiState, ctx: Context, key, samp, warp):
        b = ctx.seq.shape[0]
        root = jnp.take_along_axis(ctx.seq, (ctx.seq_len - 1)[:, None], axis=1)
        tokens = jnp.concatenate([root, dstate.guess], axis=1)
        return Proposal(tokens=tokens, parents=self.tree, valid=jnp.ones((b, self.block + 1), bool), q=None,
                        draft_forwards=jnp.int32(0), rule=rule_for(samp, Rule.TREE_DETERMINISTIC)), dstate

    def update(self, dparams, dstate: JacobiState, ctx: Context, ver: Verified, hidden_BND, layers_nBND):
        y = sampling.argmax(ctx.logits)  # [B, block + 1]: the target's prediction after each node
        k = ver.n_accepted
        idx = jnp.minimum(k[:, None] + 1 + jnp.arange(self.block)[None, :], self.block)
        nxt = jnp.take_along_axis(y, idx, axis=1)
        return JacobiState(guess=jnp.where(ctx.active[:, None], nxt, dstate.guess))
