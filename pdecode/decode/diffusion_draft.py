"""A masked-diffusion model drafting for an AR target (SpecDiff / DiffuSpec): the draft fills a block of masked
positions after the committed text in a few denoising forwards, and the shared verifier decides.

Each step the draft model (bidirectional, e.g. code-dllm) reads the committed text it has not seen yet and a block of
``gamma`` masked positions after it in **one** forward (its KV cache keeps the committed tokens, each computed when it
was fed, so a step never re-reads the whole text); ``steps`` > 1 runs more forwards over the block, each committing
the most confident of the positions still masked (Fast-dLLM-style confidence order), the last one filling the rest.
The block's tokens are the argmax at each position: the draft is deterministic, so it is verified by the q = 1 rule
(`verify.Rule.TREE_DETERMINISTIC`; greedy under greedy decoding) and the output is the target's, token for token or in
distribution.

* **chain** (``tree_top_k`` 1): the block's top-1 tokens, position by position.
* **tree** (DiffuSpec's lattice): the block's per-position top-k candidates form a lattice; the path search keeps the
  ``total_tokens`` nodes whose paths have the highest cumulative draft log-probability (EAGLE-2's selection over the
  lattice, `draft_model.grow_dynamic_tree` with the lattice as its expansion), so the verifier sees the paths the
  draft believes in most, with every prefix of a kept path kept.
* **adaptive** block length: per row, +2 after a fully accepted block, -1 otherwise (between 1 and ``gamma``).
* **refill** (masked refinement after speculative drafting): after a rejection, the next block starts from the
  previous block's tokens past the bonus (they were drafted after a rejected token) instead of masks, and the draft
  model re-fills the whole block from them; masks only where the old block did not reach.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import struct

from pdecode import sampling
from pdecode.config import ModelConfig
from pdecode.decode import common
from pdecode.decode import tree as tree_lib
from pdecode.decode.block_diffusion import DEFAULTS
from pdecode.decode.canvas import NEG
from pdecode.decode.draft_model import grow_dynamic_tree
from pdecode.decode.speculative import Context, Drafter, Proposal
from pdecode.decode.verify import Rule, Verified, rule_for
from pdecode.model import attention
from pdecode.model import cache as kvc
from pdecode.model.transformer import decode_layout, forward, unembed, unrolled


@struct.dataclass
class DiffDraftState:
    cache: kvc.KVCache  # the draft model's KV over committed tokens
    gamma: jax.Array  # [B] int32 block length this row drafts (adaptive)
    prev: jax.Array  # [B, G] the last block's tokens (refill)
    prev_shift: jax.Array  # [B] int32: how far the next block starts past the last one's first position


def commit_most_confident(lg_BGV: jax.Array, masked_BG: jax.Array, per: int) -> tuple[jax.Array, jax.Array]:
    """One denoising step of a block: (the argmax [B, G], which masked positions commit [B, G]: the ``per`` most
    confident of them, ties included)."""
    conf = jnp.max(jax.nn.softmax(lg_BGV, axis=-1), axis=-1)
    score = jnp.where(masked_BG, conf, -1.0)
    return sampling.argmax(lg_BGV), masked_BG & (score >= jax.lax.top_k(score, per)[0][:, -1:])


@dataclasses.dataclass(frozen=True)
class DiffusionDrafter(Drafter):
    dcfg: ModelConfig
    mask_id: int
    shift: bool  # the draft model predicts position i from the hidden state at i - 1 (code-dllm, Dream)
    gamma: int = 8
    steps: int = 1
    tree_top_k: int = 1
    total_tokens: int = 0  # tree mode: nodes kept
    adaptive: bool = False
    refill: bool = False

    @property
    def tree_size(self) -> int:
        return (self.total_tokens if self.tree_top_k > 1 else self.gamma) + 1

    @property
    def max_depth(self) -> int:
        return self.gamma

    @property
    def max_children(self) -> int:
        return self.tree_top_k

    def prepare(self, dparams, mesh):
        return decode_layout(dparams, self.dcfg, fuse=mesh is None)

    def init(self, dparams, tparams, prompt_BP, plen_B, prefill_out, max_len, cache_dtype=jnp.float32,
             shared_prefix: int = 0):
        """The draft model's cache over the prompts (bidirectional over each prompt, as the model was trained)."""
        b, p = prompt_BP.shape
        cache = kvc.init_cache(self.dcfg, b, max_len, cache_dtype, per_layer=unrolled(dparams))
        zeros = jnp.zeros((b,), jnp.int32)
        pos = jnp.broadcast_to(jnp.arange(p, dtype=jnp.int32), (b, p))
        valid = pos < plen_B[:, None]
        mask = attention.cache_mask(zeros, jnp.ones((p, p), bool), max_len, valid)
        fo = forward(dparams, self.dcfg, prompt_BP, pos, mask, cache=cache, write_at_B=zeros)
        g = self.gamma
        return DiffDraftState(cache=kvc.set_lengths(fo.cache, plen_B),
                              gamma=jnp.full((b,), g if not self.adaptive else max(1, g // 2), jnp.int32),
                              prev=jnp.full((b, g), self.mask_id, jnp.int32), prev_shift=jnp.full((b,), g, jnp.int32))

    # ------------------------------------------------------------------------------------------ the block
    def _block_logits(self, dparams, cache, tok_BW, start_B, valid_BW, first_B):
        """One bidirectional forward over ``tok`` fed at ``start`` (committed slots before it in the cache): the
        block's G logits [B, G, V] (mask token removed), the prediction for the block position j taken from the
        hidden state at fed index ``first + j - 1`` (with the AR shift) or ``first + j``; and the cache with the fed
        tokens' keys and values written."""
        b, w = tok_BW.shape
        g = self.gamma
        pos = start_B[:, None] + jnp.arange(w, dtype=jnp.int32)[None, :]
        mask = attention.cache_mask(start_B, jnp.ones((w, w), bool), cache.max_len, valid_BW)
        fo = forward(dparams, self.dcfg, tok_BW, pos, mask, cache=cache, write_at_B=start_B)
        idx = first_B[:, None] + jnp.arange(g)[None, :] - (1 if self.shift else 0)
        h = jnp.take_along_axis(fo.hidden, jnp.clip(idx, 0, w - 1)[:, :, None], axis=1)
        lg = unembed(dparams, self.dcfg, h).astype(jnp.float32)
        return lg.at[..., self.mask_id].set(NEG), fo.cache

    def _block_init(self, st: DiffDraftState):
        """[B, G] the block's input: masks, or (refill) the last block's tokens past where this one starts."""
        g = self.gamma
        if not self.refill:
            return jnp.full(st.prev.shape, self.mask_id, jnp.int32)
        j = jnp.arange(g)[None, :] + st.prev_shift[:, None]
        old = jnp.take_along_axis(st.prev, jnp.clip(j, 0, g - 1), axis=1)
        return jnp.where(j < g, old, self.mask_id)

    def _draft_block(self, dparams, st: DiffDraftState, ctx: Context):
        """(block logits [B, G, V] after the last forward, block tokens [B, G], draft cache, forwards)."""
        g, steps = self.gamma, self.steps
        cache = st.cache
        start = cache.lengths
        width = 2 * g + 1  # unseen committed tokens (accepted + bonus <= g + 1, the root included) and the block
        pos = start[:, None] + jnp.arange(width, dtype=jnp.int32)[None, :]
        rel = pos - ctx.seq_len[:, None]  # >= 0: block position
        blk = self._block_init(st)
        from_seq = jnp.take_along_axis(ctx.seq, jnp.minimum(pos, ctx.seq.shape[1] - 1), axis=1)
        tok = jnp.where(rel < 0, from_seq, jnp.take_along_axis(blk, jnp.clip(rel, 0, g - 1), axis=1))
        valid = rel < g
        lg, cache = self._block_logits(dparams, cache, tok, start, valid, ctx.seq_len - start)
        cache = kvc.set_lengths(cache, ctx.seq_len)  # committed: through the root
        masked = blk == self.mask_id
        x = jnp.where(masked, sampling.argmax(lg), blk)
        if self.refill:
            x = sampling.argmax(lg)  # the draft model re-fills every position of the block
        forwards = 1
        if steps > 1:
            x = blk
            per = -(-g // steps)
            for s in range(steps):
                pred, commit = commit_most_confident(lg, masked, per)
                if s == steps - 1:
                    x = pred if self.refill else jnp.where(masked, pred, x)
                    break
                x = jnp.where(commit, pred, x)
                masked = masked & ~commit
                # the root and the block again: the root's hidden state predicts the block's first position
                root = jnp.take_along_axis(ctx.seq, (ctx.seq_len - 1)[:, None], axis=1)
                feed = jnp.concatenate([root, jnp.where(masked, self.mask_id, x)], axis=1)
                lg, _ = self._block_logits(dparams, cache.replace(lengths=ctx.seq_len - 1), feed, ctx.seq_len - 1,
                                           jnp.ones(feed.shape, bool), jnp.ones_like(ctx.seq_len))
                forwards += 1
        return lg, x, cache, forwards

    # ------------------------------------------------------------------------------------------ drafter API
    def propose(self, dparams, st: DiffDraftState, ctx: Context, key, samp, warp):
        lg, x, cache, forwards = self._draft_block(dparams, st, ctx)
        b, g = x.shape
        rule = rule_for(samp, Rule.TREE_DETERMINISTIC)
        if self.tree_top_k == 1:
            root = jnp.take_along_axis(ctx.seq, (ctx.seq_len - 1)[:, None], axis=1)
            valid = jnp.arange(g + 1)[None, :] <= st.gamma[:, None]
            prop = Proposal(tokens=jnp.concatenate([root, x], axis=1), parents=tree_lib.chain(g), valid=valid,
                            q=None, draft_forwards=jnp.int32(forwards), rule=rule)
            return prop, st.replace(cache=cache, prev=x)
        logp = jax.nn.log_softmax(lg, axis=-1)

        def expand(c, tokens, positions, write_at, m, depth_BK):  # the lattice: depth d's logits, whatever the parent
            lat = jnp.take_along_axis(logp, jnp.minimum(depth_BK, g - 1)[:, :, None], axis=1)
            return lat, c, depth_BK + 1

        prop, _ = grow_dynamic_tree(ctx, cache, logp[:, 0], self.tree_top_k, g, self.total_tokens, expand,
                                    base_B=ctx.seq_len, pos1_B=ctx.seq_len, state0=jnp.ones((b,), jnp.int32),
                                    rule=rule, grammar_tables=warp.grammar if samp.grammar else None)
        depth = tree_lib.depths_of(prop.parents, g)  # the adaptive block length cuts the tree too
        valid = prop.valid & (depth <= st.gamma[:, None])
        return prop._replace(draft_forwards=jnp.int32(forwards), valid=valid), st.replace(cache=cache, prev=x)

    def update(self, dparams, st: DiffDraftState, ctx: Context, ver: Verified, hidden, layers):
        g = self.gamma
        gam = st.gamma
        if self.adaptive:
            full = ver.n_accepted >= gam
            gam = jnp.where(full, jnp.minimum(gam + 2, g), jnp.maximum(gam - 1, 1))
        return st.replace(gamma=jnp.where(ctx.active, gam, st.gamma),
                          prev_shift=jnp.where(ctx.active, ver.n_accepted + 1, st.prev_shift))


@dataclasses.dataclass(frozen=True)
class BlockDiffusionDrafter(DiffusionDrafter):
    """A block-diffusion encoder-decoder (DiffusionGemma) drafting (the block-diffusion drafter idea of DFlash): its
    encoder writes the committed text into its own KV cache as the target commits it (each token once), and its
    decoder denoises a canvas of ``gamma`` positions after it, bidirectionally over the canvas and reading that cache.
    Undecided positions are the noise token ``mask_id`` (the model has no mask token); with ``steps`` > 1 each
    further forward is self-conditioned on the last one's logits (temperature falling from ``t_max`` to ``t_min``)
    and re-reads the positions committed so far. Chains, lattice trees, adaptive lengths and refill as above; the
    draft is the argmax, deterministic, so verification is lossless."""

    t_min: float = DEFAULTS["t_min"]
    t_max: float = DEFAULTS["t_max"]

    def prepare(self, dparams, mesh):
        return decode_layout(dparams, self.dcfg, fuse=False)

    def init(self, dparams, tparams, prompt_BP, plen_B, prefill_out, max_len, cache_dtype=jnp.float32,
             shared_prefix: int = 0):
        from pdecode.model.families import diffusion_gemma as bd

        b = prompt_BP.shape[0]
        cache = kvc.init_cache(self.dcfg, b, max_len, cache_dtype, per_layer=unrolled(dparams))
        cache = kvc.set_lengths(bd.encode(dparams, self.dcfg, prompt_BP, cache, plen_B), plen_B)
        g = self.gamma
        return DiffDraftState(cache=cache, gamma=jnp.full((b,), g if not self.adaptive else max(1, g // 2), jnp.int32),
                              prev=jnp.full((b, g), self.mask_id, jnp.int32), prev_shift=jnp.full((b,), g, jnp.int32))

    def _draft_block(self, dparams, st: DiffDraftState, ctx: Context):
        from pdecode.model.families import diffusion_gemma as bd

        g, steps = self.gamma, self.steps
        cache = st.cache
        start = cache.lengths
        pos = start[:, None] + jnp.arange(g + 1, dtype=jnp.int32)[None, :]  # accepted + bonus <= g + 1 unseen
        tok = jnp.take_along_axis(ctx.seq, jnp.minimum(pos, ctx.seq.shape[1] - 1), axis=1)
        cache = kvc.set_lengths(bd.encode(dparams, self.dcfg, tok, cache, ctx.seq_len - start), ctx.seq_len)
        blk = self._block_init(st)
        masked = blk == self.mask_id
        lg = bd.denoise(dparams, self.dcfg, blk, cache)
        per = -(-g // steps)
        for s in range(1, steps):  # (masked positions hold the noise token: a commit is all that changes)
            pred, commit = commit_most_confident(lg, masked, per)
            blk, masked = jnp.where(commit, pred, blk), masked & ~commit
            t = self.t_min + (self.t_max - self.t_min) * (steps - s) / steps
            lg = bd.denoise(dparams, self.dcfg, blk, cache, lg / t, jnp.ones(start.shape, bool))
        x = sampling.argmax(lg) if self.refill else jnp.where(masked, sampling.argmax(lg), blk)
        return lg, x, cache, steps
