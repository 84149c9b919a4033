"""Feature-level drafters: EAGLE (1/2/3) and MTP modules, drafting EAGLE-2 dynamic trees.

Both are a small block with its own KV cache over pairs (token_{i+1}, feature_i): the drafter at position i reads
the embedding of the next token and the target's feature at i, and predicts the feature / token of i+1. Deeper
drafts feed the drafter's own predicted feature back (EAGLE's autoregression over features; for MTP, module 1
reused). After each verification the target features of the accepted positions (from the verify forward itself)
become the drafter's *pending* pairs, processed by one catch-up pass at the start of the next step, whose last
output (the root pair) gives the depth-1 distribution.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import struct

from pdecode.config import ModelConfig
from pdecode.decode.draft_model import grow_dynamic_tree
from pdecode.decode.speculative import Context, Drafter, DynamicTreeShape
from pdecode.decode.verify import Rule, rule_for
from pdecode.model import attention
from pdecode.model import cache as kvc
from pdecode.model.heads import EagleConfig, MTPConfig, eagle_feature, eagle_step, mtp_module
from pdecode.model.transformer import unrolled, unstack_layers


@struct.dataclass
class FeatureState:
    """State of a feature drafter: its own KV cache over committed pairs, and the pairs still to feed it."""

    cache: kvc.KVCache
    pend: jax.Array  # [B, depth + 1, D] target features of the pending pairs (root first, then accepted nodes)
    pend_n: jax.Array  # [B] int32: how many of them are valid


class FeatureDrafter(DynamicTreeShape, Drafter):
    """Base: subclasses give ``step`` (one drafter pass) and ``target_feature``; trees are grown EAGLE-2 style."""

    modules = False  # its params are a list of modules under "modules" (MTP), else one drafter's (EAGLE)

    cfg: ModelConfig

    def block_cfg(self) -> ModelConfig:
        return self.cfg.with_layers(1)

    def step(self, dparams, target, tokens, feats, pos, mask, cache, write_at):
        """One drafter pass: (logits [B,T,V], output features [B,T,D], cache)."""
        raise NotImplementedError

    def target_feature(self, dparams, hidden_BND, layers_nBND):
        raise NotImplementedError

    def prepare(self, dparams, mesh):
        def unstack(mod):
            return {**mod, "layers": unstack_layers(mod["layers"], self.block_cfg(), mesh is None)}

        return {**dparams, "modules": [unstack(m) for m in dparams["modules"]]} if self.modules \
            else unstack(dparams)

    def init(self, dparams, tparams, prompt_BP, plen_B, pre, max_len, cache_dtype=jnp.float32, shared_prefix: int = 0):
        b, p = prompt_BP.shape
        feats = self.target_feature(dparams, pre.hidden, pre.layer_hidden)  # [B, P, D]
        mods = dparams["modules"] if self.modules else [dparams]
        # (the cache's layout follows the layers'; the prompt's pairs attend over their own slots, grown after)
        size = min(p, max_len)
        cache = kvc.init_cache(self.block_cfg(), b, size, cache_dtype, per_layer=unrolled(mods[0]))
        if p > 1:  # pairs (x_{i+1}, f_i) for i = 0 .. plen-2
            pos = jnp.broadcast_to(jnp.arange(p - 1, dtype=jnp.int32), (b, p - 1))
            valid = pos + 1 < plen_B[:, None]
            mask = attention.cache_mask(jnp.zeros((b,), jnp.int32), attention.causal_intra(p - 1), size, valid)
            _, _, cache = self.step(dparams, tparams, prompt_BP[:, 1:], feats[:, :-1], pos, mask, cache,
                                    jnp.zeros((b,), jnp.int32))
        cache = kvc.set_lengths(kvc.grow(cache, max_len), plen_B - 1)
        width = self.depth + 1
        last = jnp.take_along_axis(feats, (plen_B - 1)[:, None, None], axis=1)  # [B, 1, D]
        pend = jnp.zeros((b, width) + feats.shape[2:], feats.dtype).at[:, :1].set(last)
        return FeatureState(cache=cache, pend=pend, pend_n=jnp.ones((b,), jnp.int32))

    def propose(self, dparams, dstate, ctx: Context, key, samp, warp):
        cache, pend, pend_n = dstate.cache, dstate.pend, dstate.pend_n
        b, width = pend.shape[:2]
        start = cache.lengths
        pos = start[:, None] + jnp.arange(width, dtype=jnp.int32)[None, :]
        tok = jnp.take_along_axis(ctx.seq, jnp.minimum(pos + 1, ctx.seq.shape[1] - 1), axis=1)
        valid = jnp.arange(width)[None, :] < pend_n[:, None]
        mask = attention.cache_mask(start, attention.causal_intra(width), cache.max_len, valid)
        logits, out, cache = self.step(dparams, ctx.target, tok, pend, pos, mask, cache, start)
        last = (pend_n - 1)[:, None, None]
        logits0 = jnp.take_along_axis(logits, last, axis=1)[:, 0]
        f_root = jnp.take_along_axis(out, last, axis=1)[:, 0]
        cache = kvc.set_lengths(cache, start + pend_n)  # = seq_len - 1: the root pair is committed
        base = cache.lengths

        def expand(c, tokens, positions, write_at, m, state):
            lg, o, c = self.step(dparams, ctx.target, tokens, state, positions, m, c, write_at)
            return lg, c, o

        prop, cache = grow_dynamic_tree(ctx, cache, jax.nn.log_softmax(logits0), self.tree_top_k, self.depth,
                                        self.total_tokens, expand, base_B=base, pos1_B=base, state0=f_root,
                                        rule=rule_for(samp, Rule.TREE_DETERMINISTIC),
                                        grammar_tables=warp.grammar if samp.grammar else None)
        return prop, dstate.replace(cache=cache)

    def update(self, dparams, dstate, ctx, ver, hidden_BND, layers_nBND):
        feats = self.target_feature(dparams, hidden_BND, layers_nBND)  # [B, N, D]
        width = dstate.pend.shape[1]
        on_path = jnp.take_along_axis(feats, ver.path[:, :width, None], axis=1)  # root, accepted nodes
        pend = jnp.where(ctx.active[:, None, None], on_path, dstate.pend)
        pend_n = jnp.where(ctx.active, ver.n_accepted + 1, dstate.pend_n)
        return dstate.replace(pend=pend, pend_n=pend_n)


@dataclasses.dataclass(frozen=True)
class EagleDrafter(FeatureDrafter):
    cfg: ModelConfig
    ecfg: EagleConfig
    tree_top_k: int
    depth: int
    total_tokens: int

    @property
    def hidden_layers(self) -> tuple[int, ...]:
        return self.ecfg.fuse_layers

    def step(self, dparams, target, tokens, feats, pos, mask, cache, write_at):
        return eagle_step(dparams, self.ecfg, self.cfg, target, tokens, feats, pos, mask, cache, write_at)

    def target_feature(self, dparams, hidden_BND, layers_nBND):
        return eagle_feature(dparams, self.ecfg, hidden_BND, layers_nBND)


@dataclasses.dataclass(frozen=True)
class MTPDrafter(FeatureDrafter):
    """Drafts with the first sequential MTP module; depth > 1 reuses it on its own output (EAGLE-style)."""

    modules = True

    cfg: ModelConfig
    mcfg: MTPConfig
    tree_top_k: int
    depth: int
    total_tokens: int

    @property
    def hidden_layers(self) -> tuple[int, ...]:
        return (self.cfg.num_layers - 1,)  # h^0: the last layer's output before the final norm

    def step(self, dparams, target, tokens, feats, pos, mask, cache, write_at):
        return mtp_module(dparams["modules"][0], self.mcfg, self.cfg, target, feats, tokens, pos, mask, cache,
                          write_at)

    def target_feature(self, dparams, hidden_BND, layers_nBND):
        return layers_nBND[0]
