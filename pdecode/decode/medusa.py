"""Medusa: K heads on the target's last hidden state propose the tokens 2..K+1 steps ahead; a static tree of their
top-k candidates is verified in one target forward (Cai et al. 2024).

Verification is the shared lossless core (the ``GREEDY`` rule, or ``TREE_DETERMINISTIC``, the q = 1 rule for
deterministic top-k candidates, when sampling). Medusa's *typical acceptance* (the ``TYPICAL`` rule) is available
only as an explicit, lossy opt-in (``typical=True``).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from pdecode.config import ModelConfig
from pdecode.decode import tree as tree_lib
from pdecode.decode.speculative import Context, Drafter, Proposal, StaticTreeShape
from pdecode.decode.verify import Rule, rule_for
from pdecode.model.heads import MedusaConfig, medusa_logits


@dataclasses.dataclass(frozen=True)
class MedusaDrafter(StaticTreeShape, Drafter):
    cfg: ModelConfig
    mcfg: MedusaConfig
    tree: tree_lib.StaticTree
    typical: tuple[float, float] | None = None

    follows = True  # no state of its own: it reads the sequence (and the target's root hidden state) afresh

    def follow(self, dparams, dstate, ctx: Context):
        return dstate

    def propose(self, dparams, dstate, ctx: Context, key, samp, warp):
        mp, tparams = dparams, ctx.target
        b = ctx.seq.shape[0]
        r = self.tree.max_rank + 1
        logits = medusa_logits(mp, self.mcfg, tparams, self.cfg, ctx.root_hidden)  # [K, B, V]
        cand = jax.lax.top_k(logits, r)[1].astype(jnp.int32)  # [K, B, r]
        depth = self.tree.depths
        head = np.maximum(depth - 1, 0)
        rank = np.asarray(self.tree.ranks)
        toks = cand[head, :, rank].T  # [B, N]: node i takes rank r_i of head depth_i - 1
        root = jnp.take_along_axis(ctx.seq, (ctx.seq_len - 1)[:, None], axis=1)[:, 0]
        toks = toks.at[:, 0].set(root)
        rule = rule_for(samp, Rule.TYPICAL if self.typical is not None else Rule.TREE_DETERMINISTIC)
        return Proposal(tokens=toks, parents=self.tree, valid=jnp.ones((b, self.tree.size), bool), q=None,
                        draft_forwards=jnp.int32(0), rule=rule), dstate


def check_tree(tree: tree_lib.StaticTree, mcfg: MedusaConfig) -> None:
    from pdecode.errors import ConfigError

    if tree.max_depth > mcfg.num_heads:
        raise ConfigError(f"the tree is {tree.max_depth} deep but the Medusa checkpoint has {mcfg.num_heads} heads; "
                          f"use a tree of depth <= {mcfg.num_heads}")
