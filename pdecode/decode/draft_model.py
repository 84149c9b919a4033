"""Drafting with a separate small model: chains (fixed or adaptive length) and token trees (static or dynamic).

The draft keeps its own KV cache holding only committed tokens. Each step starts with a *catch-up* forward over
the tokens the draft has not seen (the accepted ones and the new root: at most ``max_depth + 1``, one static-width
forward with a validity mask); speculative tokens are then written past the committed length and simply
overwritten by the next catch-up, so nothing ever needs rolling back.
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
from pdecode.decode.speculative import Context, Drafter, DynamicTreeShape, Proposal, StaticTreeShape
from pdecode.decode.verify import Rule, rule_for
from pdecode.model import attention
from pdecode.model import cache as kvc
from pdecode.model.transformer import decode_layout, forward, unembed, unrolled


def with_draft_vocab(dparams: dict, dcfg: ModelConfig, ids) -> dict:
    """The draft's params with a reduced vocabulary (sorted target ids ``ids``, [Vd]): its head keeps only those rows
    (``vocab_head`` [Vd, D], gathered once, outside the decode loop) and `draft_logits` scatters them back over the
    whole vocabulary, -inf elsewhere. The draft then never proposes a token outside ``ids``; verification is
    unchanged, so greedy output and the sampled distribution stay the target's (q is the distribution the draft drew
    from, zero outside ``ids``)."""
    ids = jnp.asarray(ids, jnp.int32)
    head = dparams["embed"][ids] if dcfg.tie_word_embeddings else dparams["lm_head"][:, ids].T
    return {**dparams, "vocab_ids": ids, "vocab_head": head}


def draft_logits(dparams, dcfg: ModelConfig, h: jax.Array) -> jax.Array:
    """The draft's float32 logits over the whole vocabulary; with a reduced one (`with_draft_vocab`) its head reads
    those rows only and the rest are -inf."""
    if "vocab_ids" not in dparams:
        return unembed(dparams, dcfg, h)
    w = dparams["vocab_head"]
    logits = jnp.einsum("...d,vd->...v", h.astype(w.dtype), w, preferred_element_type=jnp.float32)
    if dcfg.final_softcap:
        logits = dcfg.final_softcap * jnp.tanh(logits / dcfg.final_softcap)
    full = jnp.full(logits.shape[:-1] + (dcfg.vocab_size,), -jnp.inf, logits.dtype)
    return full.at[..., dparams["vocab_ids"]].set(logits, unique_indices=True, indices_are_sorted=True)


def catch_up(dparams, dcfg: ModelConfig, dcache: kvc.KVCache, seq: jax.Array, seq_len: jax.Array, width: int):
    """Feed ``seq[dcache.lengths : seq_len]``, at most ``width`` tokens, to the draft.

    Returns (cache committed up to ``min(lengths + width, seq_len)``, draft logits at the root [B, V], draft hidden
    at the root [B, D]; these two mean the root's only when ``width`` covered the whole gap).
    """
    start = dcache.lengths
    pos = start[:, None] + jnp.arange(width, dtype=jnp.int32)[None, :]
    tok = jnp.take_along_axis(seq, jnp.minimum(pos, seq.shape[1] - 1), axis=1)
    valid = pos < seq_len[:, None]
    mask = common.step_mask(dcfg, dcache, attention.causal_intra(width), pos, valid)
    fo = forward(dparams, dcfg, tok, pos, mask, cache=dcache)
    last = jnp.clip(seq_len - 1 - start, 0, width - 1)
    h = common.gather_rows(fo.hidden, last)
    return kvc.set_lengths(fo.cache, jnp.minimum(start + width, seq_len)), draft_logits(dparams, dcfg, h), h


def upto_mask(dcfg: ModelConfig, upto_B: jax.Array, max_len: int, pos_B: jax.Array) -> jax.Array:
    """[B, 1, S] mask for one query that sees slots ``< upto[b]`` (a chain's own history; the model applies its own
    sliding windows at the query's position)."""
    del dcfg, pos_B
    return jnp.arange(max_len)[None, None, :] < upto_B[:, None, None]


@struct.dataclass
class DraftCache:
    """State of a tree drafter: the draft model's KV cache (committed tokens only)."""

    cache: kvc.KVCache


@struct.dataclass
class ChainState:
    """State of `DraftChain`: the draft's KV cache and each row's current chain length."""

    cache: kvc.KVCache
    gamma: jax.Array  # [B] int32


def _draft_init(dparams, dcfg, prompt_BP, plen_B, max_len, cache_dtype, shared_prefix: int = 0, feed: bool = True):
    """The draft's cache of ``max_len`` slots with the prompts prefilled (over the prompts' slots alone, grown
    after: the prefill's attention does not span ``max_len``). ``feed`` False: empty (nothing fed; `follow_late`
    feeds the prompt with the rest, if the row ever drafts)."""
    b, p = prompt_BP.shape
    if not feed:
        return kvc.init_cache(dcfg, b, max_len, cache_dtype, per_layer=unrolled(dparams))
    cache = kvc.init_cache(dcfg, b, min(p, max_len), cache_dtype, per_layer=unrolled(dparams))
    cache, _, _ = common.prefill(dparams, dcfg, prompt_BP, plen_B, cache, shared_prefix=shared_prefix)
    return kvc.grow(cache, max_len)


class _DraftModelDrafter(Drafter):
    dcfg: ModelConfig

    def prepare(self, dparams, mesh):
        return decode_layout(dparams, self.dcfg, fuse=mesh is None)

    def follow(self, dparams, dstate, ctx: Context):
        """A plain step appended one token: the draft takes one committed token too (a one-token forward), so the
        gap its next catch-up covers stays what the last verify step left (at most ``max_depth + 1``)."""
        cache, _, _ = catch_up(dparams, self.dcfg, dstate.cache, ctx.seq, ctx.seq_len, 1)
        return dstate.replace(cache=cache)

    follows_late = True

    def follow_late(self, dparams, dstate, seq_BL, seq_len_B, width: int, slack: int = 0):
        """The committed tokens the draft lacks, all but the last (the next `propose` feeds the root itself), in
        forwards of ``width`` tokens while some row lacks more than ``slack`` of them (each forward feeds every row
        up to ``width``: rows that lag alike are caught up together). The serving engine lets the draft lag through
        its plain calls, unfed, and catches it up whole at the start of the next drafted call, in forwards several
        calls wide (one forward of 32 tokens costs the code draft 1.9x one of 4 on this CPU, for 8x the tokens)."""
        upto = dstate.cache.lengths + self.lag(dstate, seq_len_B)

        def feed(cache):
            return catch_up(dparams, self.dcfg, cache, seq_BL, upto, width)[0]

        cache = jax.lax.while_loop(lambda c: jnp.any(c.lengths < upto - slack), feed, dstate.cache)
        return dstate.replace(cache=cache)

    def lag(self, dstate, seq_len_B):
        return jnp.maximum(seq_len_B - 1 - dstate.cache.lengths, 0)  # (an empty slot: nothing to feed)


@dataclasses.dataclass(frozen=True)
class DraftChain(_DraftModelDrafter):
    """Chain speculative decoding: the draft proposes ``gamma`` tokens (sampled from its warped distribution, or
    argmax when greedy), verified by speculative sampling. ``adaptive``: per-row length, +2 after a fully accepted
    step and -1 otherwise (the heuristic of HF assisted generation), bounded by ``gamma_max``."""

    follows = True

    dcfg: ModelConfig
    gamma: int
    gamma_max: int
    adaptive: bool = False

    @property
    def tree_size(self) -> int:
        return self.gamma_max + 1

    @property
    def max_depth(self) -> int:
        return self.gamma_max

    max_children = 1

    def init(self, dparams, tparams, prompt_BP, plen_B, prefill_out, max_len, cache_dtype=jnp.float32,
             shared_prefix: int = 0, feed: bool = True):
        b = prompt_BP.shape[0]
        return ChainState(cache=_draft_init(dparams, self.dcfg, prompt_BP, plen_B, max_len, cache_dtype,
                                            shared_prefix, feed),
                          gamma=jnp.full((b,), self.gamma, jnp.int32))

    def propose(self, dparams, dstate, ctx: Context, key, samp, warp):
        b = ctx.seq.shape[0]
        g = self.gamma_max
        cache, logits0, _ = catch_up(dparams, self.dcfg, dstate.cache, ctx.seq, ctx.seq_len, g + 1)
        v = logits0.shape[-1]
        k_first, k_rest = sampling.split(key)
        # structured output: the draft samples from its distribution masked by the grammar along the chain (q is
        # what it drew from, so verification stays lossless); it then drafts only tokens the target may accept
        gmask = common.grammar_masker(ctx.gstate, v, samp, warp)
        logits0, gs = gmask(logits0, ctx.gstate, -1)
        root = jnp.take_along_axis(ctx.seq, (ctx.seq_len - 1)[:, None], axis=1)[:, 0]
        tokens = jnp.zeros((b, g + 1), jnp.int32).at[:, 0].set(root)
        tokens = tokens.at[:, 1].set(sampling.sample(k_first, logits0, samp, warp))
        qs = None if samp.greedy else jnp.zeros((b, g + 1, v), jnp.float32).at[:, 0].set(
            sampling.probs(logits0, samp, warp))
        gamma_row = dstate.gamma
        n_steps = jnp.max(jnp.where(ctx.active, gamma_row, 1)) - 1
        max_len = cache.max_len

        def cond(c):
            return c[0] < n_steps

        def body(c):
            i, cch, toks, q, gs = c
            x = jax.lax.dynamic_index_in_dim(toks, i + 1, axis=1, keepdims=True)  # d_{i+1}
            pos = ctx.seq_len + i  # position and slot of d_{i+1}
            mask = upto_mask(self.dcfg, pos + 1, max_len, pos)
            fo = forward(dparams, self.dcfg, x, pos[:, None], mask, cache=cch, write_at_B=pos)
            lg, gs = gmask(draft_logits(dparams, self.dcfg, fo.hidden[:, 0]), gs, x[:, 0])
            nxt = sampling.sample(sampling.fold_in(k_rest, i), lg, samp, warp)
            toks = jax.lax.dynamic_update_slice_in_dim(toks, nxt[:, None], i + 2, axis=1)
            if q is not None:
                q = jax.lax.dynamic_update_slice_in_dim(q, sampling.probs(lg, samp, warp)[:, None],
                                                        i + 1, axis=1)
            return i + 1, fo.cache, toks, q, gs

        _, cache, tokens, qs, _ = jax.lax.while_loop(cond, body, (jnp.int32(0), cache, tokens, qs, gs))
        valid = jnp.arange(g + 1)[None, :] <= gamma_row[:, None]
        prop = Proposal(tokens=tokens, parents=tree_lib.chain(g), valid=valid, q=qs,
                        draft_forwards=(1 + n_steps).astype(jnp.int32), rule=rule_for(samp, Rule.CHAIN_SAMPLING))
        return prop, dstate.replace(cache=cache)

    def update(self, dparams, dstate, ctx, ver, hidden, layers):
        if not self.adaptive:
            return dstate
        g = dstate.gamma
        full = ver.n_accepted >= g
        g_new = jnp.where(full, jnp.minimum(g + 2, self.gamma_max), jnp.maximum(g - 1, 1))
        return dstate.replace(gamma=jnp.where(ctx.active, g_new, g))


@dataclasses.dataclass(frozen=True)
class DraftStaticTree(StaticTreeShape, _DraftModelDrafter):
    """Token tree from a static shape: each node takes the top-``rank`` token of its parent's draft
    distribution (Medusa-style choice paths). One draft forward per depth."""

    follows = True

    dcfg: ModelConfig
    tree: tree_lib.StaticTree

    def init(self, dparams, tparams, prompt_BP, plen_B, prefill_out, max_len, cache_dtype=jnp.float32,
             shared_prefix: int = 0, feed: bool = True):
        return DraftCache(cache=_draft_init(dparams, self.dcfg, prompt_BP, plen_B, max_len, cache_dtype,
                                            shared_prefix, feed))

    def propose(self, dparams, dstate, ctx: Context, key, samp, warp):
        return static_tree_propose(self.tree, ctx, dstate, lambda c: catch_up(
            dparams, self.dcfg, c, ctx.seq, ctx.seq_len, self.max_depth + 1)[:2],
            lambda c, tok, pos, write_at, mask: _expand(dparams, self.dcfg, c, tok, pos, write_at, mask),
            rule=rule_for(samp, Rule.TREE_DETERMINISTIC))


def _expand(dparams, dcfg, cache, tok_BT, pos_BT, write_at_B, mask):
    fo = forward(dparams, dcfg, tok_BT, pos_BT, mask, cache=cache, write_at_B=write_at_B)
    return draft_logits(dparams, dcfg, fo.hidden), fo.cache.replace(lengths=cache.lengths)


def static_tree_propose(tr: tree_lib.StaticTree, ctx: Context, dstate, catch_up_fn, expand_fn, *, rule: Rule):
    """Fill a static tree depth by depth: a node's token is the top-``rank`` candidate of its parent's logits.
    ``dstate`` is a state with a ``cache`` field (the drafter's); ``rule``: the proposal's verification rule."""
    import numpy as np

    b = ctx.seq.shape[0]
    n = tr.size
    depths = tr.depths
    anc = tr.ancestors
    r = tr.max_rank + 1
    cache, logits0 = catch_up_fn(dstate.cache)
    max_len = cache.max_len
    root = jnp.take_along_axis(ctx.seq, (ctx.seq_len - 1)[:, None], axis=1)[:, 0]
    tokens = jnp.zeros((b, n), jnp.int32).at[:, 0].set(root)
    cand = jnp.zeros((b, n, r), jnp.int32).at[:, 0].set(jax.lax.top_k(logits0, r)[1].astype(jnp.int32))
    has_children = np.zeros(n, bool)
    has_children[[p for p in tr.parents[1:]]] = True
    forwards = 1
    for d in range(1, tr.max_depth + 1):
        nodes = np.nonzero(depths == d)[0]
        par = np.asarray(tr.parents)[nodes]
        rank = np.asarray(tr.ranks)[nodes]
        tokens = tokens.at[:, nodes].set(cand[:, par, rank])
        if not has_children[nodes].any():
            continue
        lo = int(nodes[0])
        pos = jnp.broadcast_to((ctx.seq_len - 1 + d)[:, None], (b, len(nodes)))
        write_at = ctx.seq_len - 1 + lo
        mask = attention.cache_mask(ctx.seq_len - 1, jnp.asarray(anc[nodes]), max_len)
        lg, cache = expand_fn(cache, tokens[:, nodes], pos, write_at, mask)
        cand = cand.at[:, nodes].set(jax.lax.top_k(lg, r)[1].astype(jnp.int32))
        forwards += 1
    prop = Proposal(tokens=tokens, parents=tr, valid=jnp.ones((b, n), bool), q=None,
                    draft_forwards=jnp.int32(forwards), rule=rule)
    return prop, dstate.replace(cache=cache)


@dataclasses.dataclass(frozen=True)
class DraftDynamicTree(DynamicTreeShape, _DraftModelDrafter):
    """EAGLE-2-style dynamic tree grown with the draft model: expand the ``tree_top_k`` best frontier nodes per
    depth (each proposing its tree_top_k children), score every node by cumulative draft log-probability, and keep
    the best ``total_tokens`` nodes for verification."""

    follows = True

    dcfg: ModelConfig
    tree_top_k: int
    depth: int
    total_tokens: int

    def init(self, dparams, tparams, prompt_BP, plen_B, prefill_out, max_len, cache_dtype=jnp.float32,
             shared_prefix: int = 0, feed: bool = True):
        return DraftCache(cache=_draft_init(dparams, self.dcfg, prompt_BP, plen_B, max_len, cache_dtype,
                                            shared_prefix, feed))

    def propose(self, dparams, dstate, ctx: Context, key, samp, warp):
        cache, logits0, _ = catch_up(dparams, self.dcfg, dstate.cache, ctx.seq, ctx.seq_len, self.depth + 1)
        prop, cache = grow_dynamic_tree(
            ctx, cache, jax.nn.log_softmax(logits0), self.tree_top_k, self.depth, self.total_tokens,
            lambda c, tok, pos, write_at, mask, st: _expand(dparams, self.dcfg, c, tok, pos, write_at, mask) + (st,),
            base_B=ctx.seq_len, pos1_B=ctx.seq_len, rule=rule_for(samp, Rule.TREE_DETERMINISTIC),
            grammar_tables=warp.grammar if samp.grammar else None)
        return prop, dstate.replace(cache=cache)


def grow_dynamic_tree(ctx: Context, cache, logp0_BV, k: int, depth: int, total: int, expand_fn, base_B, pos1_B,
                      state0=None, *, rule: Rule, grammar_tables=None):
    """EAGLE-2 tree growth, vectorised over rows (shared by the draft-model, EAGLE and MTP drafters).

    ``expand_fn(cache, tokens [B,k], positions [B,k], write_at [B], mask [B,k,S], state [B,k,...])
    -> (logits [B,k,V], cache, out_state [B,k,...])`` runs the drafter on the frontier; ``state`` is what a node
    carries into its own expansion (EAGLE: the feature predicted by its parent) and ``out_state`` what its children
    inherit. Frontier nodes of depth d sit in the drafter cache at slots ``base + (d-1) k + j`` (uncommitted), at
    positions ``pos1 + d - 1``; slots below ``base`` are the drafter's committed history. ``rule``: the proposal's
    verification rule (the children are top-k picks: ``TREE_DETERMINISTIC`` when sampling). ``grammar_tables``:
    structured output's `grammar.Tables` (with ``ctx.gstate``): every node's children are picked among the tokens its
    grammar state allows (each node's state walked from the root's), so the tree holds no token the target must
    reject; None: off.
    Returns (Proposal with per-row parents, cache).
    """
    from pdecode import grammar

    b = ctx.seq.shape[0]
    v = logp0_BV.shape[-1]
    constrained = (grammar_tables is not None and ctx.gstate is not None
                   and v <= grammar_tables.allow.shape[1] * 32)

    def allowed_only(lp, states):
        return jnp.where(grammar.ban(grammar_tables, states, v), -jnp.inf, lp) if constrained else lp

    logp0_BV = allowed_only(logp0_BV, ctx.gstate)
    max_len = cache.max_len
    pool_size = k + (depth - 1) * k * k
    if total > pool_size:
        raise ValueError(f"total_tokens ({total}) exceeds the {pool_size} candidates top_k={k}, depth={depth} grow")
    top_lp, top_tok = jax.lax.top_k(logp0_BV, k)
    pool_tok = jnp.zeros((b, pool_size), jnp.int32).at[:, :k].set(top_tok)
    pool_score = jnp.full((b, pool_size), -jnp.inf).at[:, :k].set(top_lp)
    pool_parent = jnp.full((b, pool_size), -1, jnp.int32)
    pool_depth = jnp.ones((b, pool_size), jnp.int32)
    pool_state = None
    if constrained:  # each pool node's grammar state after its own token
        pool_state = jnp.zeros((b, pool_size), jnp.int32).at[:, :k].set(
            grammar.advance(grammar_tables, ctx.gstate[:, None], top_tok))
    front_idx = jnp.broadcast_to(jnp.arange(k, dtype=jnp.int32), (b, k))  # pool index of frontier nodes
    front_score = top_lp
    n_slots = (depth - 1) * k
    front_anc = jnp.zeros((b, k, max(n_slots, 1)), bool)
    state = None if state0 is None else jnp.broadcast_to(state0[:, None], (b, k) + state0.shape[1:])
    forwards = 1
    for d in range(1, depth):
        slot0 = (d - 1) * k
        front_anc = front_anc.at[:, :, slot0: slot0 + k].set(jnp.eye(k, dtype=bool)[None])
        tok = jnp.take_along_axis(pool_tok, front_idx, axis=1)
        pos = jnp.broadcast_to((pos1_B + d - 1)[:, None], (b, k))
        mask = attention.cache_mask(base_B, front_anc, max_len)
        lg, cache, out_state = expand_fn(cache, tok, pos, base_B + slot0, mask, state)
        forwards += 1
        lp = jax.nn.log_softmax(lg)
        if constrained:
            front_state = jnp.take_along_axis(pool_state, front_idx, axis=1)  # [B, k]
            lp = allowed_only(lp, front_state)
        c_lp, c_tok = jax.lax.top_k(lp, k)  # [B, k, k]
        c_score = front_score[:, :, None] + c_lp
        off = k + (d - 1) * k * k
        pool_tok = pool_tok.at[:, off: off + k * k].set(c_tok.reshape(b, k * k))
        pool_score = pool_score.at[:, off: off + k * k].set(c_score.reshape(b, k * k))
        pool_parent = pool_parent.at[:, off: off + k * k].set(jnp.repeat(front_idx, k, axis=1))
        pool_depth = pool_depth.at[:, off: off + k * k].set(d + 1)
        if constrained:
            kids = grammar.advance(grammar_tables, front_state[:, :, None], c_tok)
            pool_state = pool_state.at[:, off: off + k * k].set(kids.reshape(b, k * k))
        # next frontier: the k best children overall; each inherits its parent's ancestor slots
        best_score, best = jax.lax.top_k(c_score.reshape(b, k * k), k)
        parent_j = best // k
        front_anc = jnp.take_along_axis(front_anc, parent_j[:, :, None], axis=1)
        if out_state is not None:
            state = jnp.take_along_axis(out_state, parent_j.reshape((b, k) + (1,) * (out_state.ndim - 2)), axis=1)
        front_idx = (off + best).astype(jnp.int32)
        front_score = best_score
    # keep the best `total` nodes; ties go to the shallower node so a kept node's parent is always kept
    key_score = pool_score - pool_depth.astype(jnp.float32) * 1e-6
    _, sel = jax.lax.top_k(key_score, total)
    order_key = jnp.take_along_axis(pool_depth, sel, axis=1) * pool_size + sel
    sel = jnp.take_along_axis(sel, jnp.argsort(order_key, axis=1), axis=1)  # parents before children
    tree_of_pool = jnp.full((b, pool_size), -1, jnp.int32).at[jnp.arange(b)[:, None], sel].set(
        jnp.broadcast_to(jnp.arange(1, total + 1, dtype=jnp.int32), (b, total)))
    par_pool = jnp.take_along_axis(pool_parent, sel, axis=1)
    par_tree = jnp.where(par_pool < 0, 0, jnp.take_along_axis(tree_of_pool, jnp.maximum(par_pool, 0), axis=1))
    ok = par_tree >= 0
    root = jnp.take_along_axis(ctx.seq, (ctx.seq_len - 1)[:, None], axis=1)
    tokens = jnp.concatenate([root, jnp.take_along_axis(pool_tok, sel, axis=1)], axis=1)
    parents = jnp.concatenate([jnp.full((b, 1), -1, jnp.int32), jnp.maximum(par_tree, 0)], axis=1)
    valid = jnp.concatenate([jnp.ones((b, 1), bool), ok], axis=1)
    return Proposal(tokens=tokens, parents=parents, valid=valid, q=None,
                    draft_forwards=jnp.int32(forwards), rule=rule), cache
