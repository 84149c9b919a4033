"""PEARL (parallel speculative decoding): the draft keeps drafting while the target verifies, so the two halves of
a step are independent work, and the draft length adapts by itself.

Each step verifies the window the draft wrote during the previous step and, at the same time (no data dependency
between the two), the draft writes the next ``gamma + 1`` tokens past that window, assuming all of it will be
accepted. After verification:

* the whole window was accepted and the target's next token equals the draft's first token past the window: the
  draft's remaining ``gamma`` tokens are the next window (*post-verify*: the target verifies a window while the draft
  goes on);
* otherwise the draft's work past the window is dropped and the next step verifies no draft token: the target
  takes one token (the correction) while the draft writes a fresh window from it (*pre-verify*: the target checks
  the draft's first token while the draft writes the rest).

So a step after a rejection costs one target token, and a run of accepted windows keeps both models busy every step;
the window never waits for the draft. Verification is the shared lossless verifier (greedy equality; speculative
sampling with the draft's distributions under sampling): a drafted token is kept only as a proposal, never without
the target's test. The draft keeps its own KV cache of committed tokens (the catch-up design of `draft_model`).
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
from pdecode.decode.draft_model import _draft_init, _DraftModelDrafter, draft_logits, upto_mask
from pdecode.decode.speculative import Context, Proposal
from pdecode.decode.verify import Rule, Verified, rule_for
from pdecode.model import attention
from pdecode.model import cache as kvc
from pdecode.model.transformer import forward


@struct.dataclass
class PearlState:
    cache: kvc.KVCache  # the draft's KV cache (committed tokens; speculative slots past them are overwritten)
    window: jax.Array  # [B, gamma] drafted tokens the next step verifies (the first n_window valid)
    window_q: jax.Array  # [B, gamma, V] q each window token was drawn from (sampled decoding; zeros when greedy)
    n_window: jax.Array  # [B] int32: 0 = pre-verify


@dataclasses.dataclass(frozen=True)
class PearlDrafter(_DraftModelDrafter):
    """Nodes of a step: the root, the stored window (``gamma`` tokens, or none in pre-verify) and ``first``, the
    draft's next token past them (its one forward before the target starts); the draft's other ``gamma + 1`` tokens
    are written while the target verifies."""

    dcfg: ModelConfig
    gamma: int = 4

    @property
    def tree_size(self) -> int:
        return self.gamma + 2

    @property
    def max_depth(self) -> int:
        return self.gamma + 1

    max_children = 1

    def init(self, dparams, tparams, prompt_BP, plen_B, prefill_out, max_len, cache_dtype=jnp.float32,
             shared_prefix: int = 0, feed: bool = True):
        b, g = prompt_BP.shape[0], self.gamma
        v = self.dcfg.vocab_size
        return PearlState(cache=_draft_init(dparams, self.dcfg, prompt_BP, plen_B, max_len, cache_dtype, shared_prefix,
                                            feed),
                          window=jnp.zeros((b, g), jnp.int32), window_q=jnp.zeros((b, g, v), jnp.float32),
                          n_window=jnp.zeros((b,), jnp.int32))

    def _catch_up(self, dparams, st: PearlState, ctx: Context, key, samp, warp):
        """The draft's serial part: feed the committed tokens it has not seen and the window, and draw ``first``,
        the token past the window. Returns (cache, first [B], its q [B, V] or None, the sequence end after first)."""
        g = self.gamma
        width = 2 * g + 1  # unseen committed tokens (accepted + bonus: <= g + 2, of which the root) and the window
        start = st.cache.lengths
        pos = start[:, None] + jnp.arange(width, dtype=jnp.int32)[None, :]
        rel = pos - ctx.seq_len[:, None]
        from_seq = jnp.take_along_axis(ctx.seq, jnp.minimum(pos, ctx.seq.shape[1] - 1), axis=1)
        from_win = jnp.take_along_axis(st.window, jnp.clip(rel, 0, g - 1), axis=1)
        tok = jnp.where(rel < 0, from_seq, from_win)
        end = ctx.seq_len + st.n_window  # the draft's sequence length after the window
        valid = pos < end[:, None]
        mask = common.step_mask(self.dcfg, st.cache, attention.causal_intra(width), pos, valid)
        fo = forward(dparams, self.dcfg, tok, pos, mask, cache=st.cache)
        lg = draft_logits(dparams, self.dcfg, common.gather_rows(fo.hidden, jnp.clip(end - 1 - start, 0, width - 1)))
        first = sampling.sample(key, lg, samp, warp)
        q = None if samp.greedy else sampling.probs(lg, samp, warp)
        return kvc.set_lengths(fo.cache, ctx.seq_len), first, q, end

    def _write_ahead(self, dparams, cache, first, end, key, samp, warp):
        """The draft's parallel part: ``gamma + 1`` tokens after ``first`` (at position ``end``) and their draft
        distributions (zeros when greedy)."""
        b, g = first.shape[0], self.gamma
        max_len = cache.max_len

        def body(i, c):
            cch, prev, toks, q = c
            p_i = end + i  # position and slot of the token fed now (first, then ahead[i - 1])
            m = upto_mask(self.dcfg, p_i + 1, max_len, p_i)
            o = forward(dparams, self.dcfg, prev[:, None], p_i[:, None], m, cache=cch, write_at_B=p_i)
            lg = draft_logits(dparams, self.dcfg, o.hidden[:, 0])
            nxt = sampling.sample(sampling.fold_in(key, i), lg, samp, warp)
            toks = jax.lax.dynamic_update_slice_in_dim(toks, nxt[:, None], i, axis=1)
            if not samp.greedy:
                q = jax.lax.dynamic_update_slice_in_dim(q, sampling.probs(lg, samp, warp)[:, None], i,
                                                        axis=1)
            return o.cache.replace(lengths=cch.lengths), nxt, toks, q

        q0 = jnp.zeros((b, g + 1, self.dcfg.vocab_size), jnp.float32)
        _, _, ahead, aq = jax.lax.fori_loop(0, g + 1, body, (cache, first, jnp.zeros((b, g + 1), jnp.int32), q0))
        return ahead, aq

    def propose(self, dparams, st: PearlState, ctx: Context, key, samp, warp):
        b, g = ctx.seq.shape[0], self.gamma
        k1, k2 = sampling.split(key)
        cache, first, q_first, end = self._catch_up(dparams, st, ctx, k1, samp, warp)

        def side():  # while the target verifies [root, window, first], the draft writes gamma + 1 tokens past first
            # (its cache writes are scratch: the next catch-up rewrites every slot past the committed tokens)
            return self._write_ahead(dparams, cache, first, end, k2, samp, warp)

        root = jnp.take_along_axis(ctx.seq, (ctx.seq_len - 1)[:, None], axis=1)
        idx = jnp.arange(g + 1)[None, :]
        nw = st.n_window[:, None]
        body = jnp.where(idx < nw, jnp.pad(st.window, ((0, 0), (0, 1))), jnp.where(idx == nw, first[:, None], 0))
        tokens = jnp.concatenate([root, body], axis=1)
        valid = jnp.arange(g + 2)[None, :] <= nw + 1
        q = None
        if not samp.greedy:
            wq = jnp.pad(st.window_q, ((0, 0), (0, 2), (0, 0)))  # node j's child = window[j] (j < n_window)
            q = jnp.where((jnp.arange(g + 2) == nw)[:, :, None], q_first[:, None, :], wq)
        prop = Proposal(tokens=tokens, parents=tree_lib.chain(g + 1), valid=valid, q=q,
                        draft_forwards=jnp.int32(g + 2), rule=rule_for(samp, Rule.CHAIN_SAMPLING), side=side)
        return prop, st.replace(cache=cache)

    def update(self, dparams, st: PearlState, ctx: Context, ver: Verified, hidden, layers):
        g = self.gamma
        ahead, ahead_q = ctx.side  # the draft's gamma + 1 tokens past `first`, written during the verify forward
        # post-verify continues when the window and `first` all passed and the target's next token is the draft's
        # first token past them; else pre-verify (no window)
        keep = (ver.n_accepted == st.n_window + 1) & (ver.bonus == ahead[:, 0]) & ctx.active
        window = jnp.where(keep[:, None], ahead[:, 1:], st.window)
        window_q = jnp.where(keep[:, None, None], ahead_q[:, 1:], st.window_q)
        n_window = jnp.where(keep, g, 0)
        return st.replace(window=window, window_q=window_q, n_window=jnp.where(ctx.active, n_window, st.n_window))
