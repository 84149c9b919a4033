"""Masked-diffusion samplers (LLaDA / Dream / Fast-dLLM / EB-sampler), each the whole generation in one
`lax.while_loop` with static shapes and batch > 1.

Layout: row b holds its prompt at ``[0, P_b)``, its generation canvas at ``[P_b, P_b + G)`` (initially all mask
tokens) and padding after; attention is bidirectional over the row's valid positions and RoPE positions are the
natural ones, so rows of different prompt lengths need no left-padding tricks. The canvas is split into
semi-autoregressive blocks of ``block_length``; the batch moves from block to block in lockstep (a row whose block
is finished waits), and each step commits, inside the current block, the masked positions the *rule* picks:

* ``schedule`` (LLaDA): the per-block step budget spreads the block's masks evenly over its steps
  (``masks // steps``, +1 for the first ``masks % steps`` steps); the most confident ones are committed.
* ``threshold`` (Fast-dLLM): every mask whose confidence is >= ``threshold``, and always the most confident one.
* ``factor`` (Fast-dLLM): the top n while ``(k + 1) (1 - c_(k)) <= factor`` holds for k = 1..n (at least one).
* ``eb`` (EB-sampler): sort by entropy; the longest prefix with ``sum H - max H <= eb_gamma`` (at least one).

Confidence (``alg``): ``confidence`` = probability of the predicted token (LLaDA low-confidence remasking, Dream
maskgit_plus), ``margin`` = top1 - top2 (Dream topk_margin), ``entropy`` = -H (Dream entropy), ``random``
(LLaDA random remasking). ``alg_temp > 0`` draws the positions (Gumbel top-k on confidence / alg_temp) instead of
taking the top ones. Tokens are the argmax of ``logits / temperature + Gumbel`` (greedy at temperature 0).
Classifier-free guidance: ``logits = un + (s + 1)(cond - un)`` with the prompt masked in the unconditional pass.

Caching (Fast-dLLM): ``prefix`` keeps the KV of everything before the current block from a full pass at the block
start and recomputes the block and what follows; ``dual`` also keeps the suffix and recomputes only the block.

EOS: a row stops as soon as an EOS is committed with every canvas position before it committed; the answer is
the canvas up to that EOS, and no further steps are spent on the trailing positions.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import struct

from pdecode.config import ModelConfig
from pdecode.decode import common
from pdecode.errors import ConfigError
from pdecode.model import cache as kvc
from pdecode.model.transformer import decode_layout, forward, unembed, unrolled
from pdecode.sampling import argmax

NEG = -1e30


@dataclasses.dataclass(frozen=True)
class DiffusionOptions:
    gen_length: int = 64
    block_length: int = 64
    steps: int = 64  # total step budget for the schedule rule (per block: steps / number of blocks)
    rule: str = "schedule"  # schedule | threshold | factor | eb
    alg: str = "confidence"  # confidence | margin | entropy | random
    threshold: float = 0.9
    factor: float = 1.0
    eb_gamma: float = 0.1
    alg_temp: float = 0.0
    cfg_scale: float = 0.0
    cache: str = "none"  # none | prefix | dual
    refresh_every: int = 0  # cached runs: also refresh the whole cache every this many steps of a block (0: only
    # at a block start, as Fast-dLLM does)
    shift: bool = False  # Dream: position i is predicted from the hidden state at i - 1

    def __post_init__(self):
        problems = []
        if self.gen_length < 1 or self.block_length < 1 or self.gen_length % self.block_length:
            problems.append(f"gen_length ({self.gen_length}) must be a positive multiple of block_length "
                            f"({self.block_length})")
        nb = max(self.gen_length // max(self.block_length, 1), 1)
        if self.rule == "schedule" and (self.steps < nb or self.steps % nb):
            problems.append(f"steps ({self.steps}) must be a multiple of the number of blocks ({nb})")
        for name, allowed in (("rule", ("schedule", "threshold", "factor", "eb")),
                              ("alg", ("confidence", "margin", "entropy", "random")),
                              ("cache", ("none", "prefix", "dual"))):
            if getattr(self, name) not in allowed:
                problems.append(f"{name} must be one of {', '.join(allowed)}, got {getattr(self, name)!r}")
        if not 0.0 < self.threshold <= 1.0:
            problems.append(f"threshold must be in (0, 1], got {self.threshold}")
        if self.refresh_every < 0:
            problems.append(f"refresh_every must be >= 0 (0: refresh only at a block start), got {self.refresh_every}")
        if self.refresh_every > 0 and self.cache == "none":
            problems.append("refresh_every applies to a KV cache: set cache='prefix' or 'dual', or drop refresh_every")
        if self.factor <= 0 or self.eb_gamma < 0 or self.alg_temp < 0 or self.cfg_scale < 0:
            problems.append("factor must be > 0; eb_gamma, alg_temp and cfg_scale >= 0")
        if problems:
            raise ConfigError("invalid diffusion options: " + "; ".join(problems))

    @property
    def num_blocks(self) -> int:
        return self.gen_length // self.block_length

    @property
    def steps_per_block(self) -> int:
        return max(self.steps // self.num_blocks, 1)


@struct.dataclass
class DiffState:
    x: jax.Array  # [B, S] tokens (mask id where not yet decoded)
    masked: jax.Array  # [B, S] canvas positions still masked
    commit_step: jax.Array  # [B, S] step at which each canvas position was committed (-1: prompt / never)
    block: jax.Array  # scalar: current block index
    step_in_block: jax.Array  # scalar
    block_masks: jax.Array  # [B] masks in the current block when it started (schedule rule)
    done: jax.Array  # [B]
    nfe: jax.Array  # scalar: model forwards
    steps: jax.Array  # scalar
    key: jax.Array
    cache: kvc.KVCache | None


# ------------------------------------------------------------------------------------------------ pieces
def full_mask(total_len_B: jax.Array, s: int) -> jax.Array:
    """[B, S, S] bidirectional mask over each row's valid positions (padding queries see position 0)."""
    valid = jnp.arange(s)[None, :] < total_len_B[:, None]
    m = valid[:, None, :] & valid[:, :, None]
    return m | (~valid[:, :, None] & (jnp.arange(s)[None, None, :] == 0))


def prob_stats(logits: jax.Array, x0: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(p(x0), top-1 probability, top-2 probability) per position, from the logits through their logsumexp: the
    [..., V] probabilities are never materialised (a few passes over the logits fewer per step). The second value
    is a masked max, not `lax.top_k`: inside a `while_loop` that lowers to a sort on XLA:CPU, which once cost DiCo
    5x its model forward per step."""
    lg = logits.astype(jnp.float32)
    lse = jax.nn.logsumexp(lg, axis=-1)
    mx = jnp.max(lg, axis=-1)
    arg = argmax(lg)  # not jnp.argmax: XLA:CPU's variadic-reduce argmax over the vocabulary costs ~5x more
    m2 = jnp.max(jnp.where(jnp.arange(lg.shape[-1]) == arg[..., None], -jnp.inf, lg), axis=-1)
    at = jnp.take_along_axis(lg, x0[..., None], axis=-1)[..., 0]
    return jnp.exp(at - lse), jnp.exp(mx - lse), jnp.exp(m2 - lse)


def confidence(logits: jax.Array, x0: jax.Array, alg: str, key) -> jax.Array:
    """Per-position confidence of the prediction x0 under the model's distribution (higher = surer)."""
    if alg == "random":
        return jax.random.uniform(key, x0.shape)
    if alg == "entropy":
        return -entropy(logits)
    c, first, second = prob_stats(logits, x0)
    return c if alg == "confidence" else first - second  # top-1 probability / margin


def entropy(logits: jax.Array) -> jax.Array:
    p = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
    return -jnp.sum(p * jnp.log(jnp.maximum(p, 1e-30)), axis=-1)


def no_mask(logits: jax.Array, mask_id: int) -> jax.Array:
    """The mask token is never a prediction: its logit is removed before any sampler looks at the logits."""
    return logits.at[..., mask_id].set(NEG)


def predict(logits: jax.Array, temperature, key, greedy: bool) -> jax.Array:
    if greedy:
        return argmax(logits)
    g = jax.random.gumbel(key, logits.shape, jnp.float32)
    return argmax(logits.astype(jnp.float32) / jnp.maximum(temperature, 1e-6) + g)


def rank_desc(score_BS: jax.Array, eligible_BS: jax.Array) -> jax.Array:
    """Rank of each position by descending score among eligible ones (0 = best); ineligible get S."""
    s = score_BS.shape[1]
    key = jnp.where(eligible_BS, score_BS, -jnp.inf)
    order = jnp.argsort(-key, axis=1, stable=True)
    rank = jnp.zeros_like(order).at[jnp.arange(score_BS.shape[0])[:, None], order].set(
        jnp.broadcast_to(jnp.arange(s), order.shape))
    return jnp.where(eligible_BS, rank, s)


def select(rule: str, opts: DiffusionOptions, conf_BS, ent_BS, eligible_BS, k_sched_B, key):
    """Boolean [B, S]: which eligible positions to commit this step, by the rule."""
    b, s = conf_BS.shape
    score = conf_BS
    if opts.alg_temp > 0:  # draw positions instead of taking the top ones
        score = conf_BS / opts.alg_temp + jax.random.gumbel(key, conf_BS.shape)
    rank = rank_desc(score, eligible_BS)
    n_elig = jnp.sum(eligible_BS, axis=1)
    if rule == "schedule":
        k = jnp.minimum(k_sched_B, n_elig)
    elif rule == "threshold":
        k = jnp.maximum(jnp.sum(eligible_BS & (conf_BS >= opts.threshold), axis=1), 1)
    elif rule == "factor":
        # sorted confidences c_(1) >= c_(2) >= ...; the largest n with (k+1)(1 - c_(k)) <= f for all k <= n
        sorted_c = jnp.sort(jnp.where(eligible_BS, conf_BS, -jnp.inf), axis=1)[:, ::-1]
        kk = jnp.arange(1, s + 1)[None, :]
        ok = ((kk + 1) * (1.0 - sorted_c) <= opts.factor) & (kk <= n_elig[:, None])
        k = jnp.maximum(jnp.sum(jnp.cumprod(ok.astype(jnp.int32), axis=1), axis=1), 1)
        rank = rank_desc(conf_BS, eligible_BS)
    else:  # eb: ascending entropy; the longest prefix with sum H - max H <= gamma
        rank = rank_desc(-ent_BS, eligible_BS)
        sorted_h = jnp.sort(jnp.where(eligible_BS, ent_BS, jnp.inf), axis=1)
        finite = jnp.isfinite(sorted_h)
        cum = jnp.cumsum(jnp.where(finite, sorted_h, 0.0), axis=1)
        ok = ((cum - jnp.where(finite, sorted_h, 0.0)) <= opts.eb_gamma) & finite  # sorted: max = last
        k = jnp.maximum(jnp.sum(jnp.cumprod(ok.astype(jnp.int32), axis=1), axis=1), 1)
    return eligible_BS & (rank < k[:, None])


def schedule_counts(n_B: jax.Array, steps: int, step) -> jax.Array:
    """LLaDA's transfer count at ``step`` (0-based) for n masks over ``steps`` steps."""
    base, rem = n_B // steps, n_B % steps
    return base + (step < rem).astype(n_B.dtype)


def committed_eos(x_BS, masked_BS, canvas_BS, eos_ids) -> jax.Array:
    """[B, S]: canvas positions holding a committed EOS."""
    return common.is_eos(x_BS, eos_ids) & canvas_BS & ~masked_BS


def answer_done(x_BS, masked_BS, canvas_BS, eos_ids) -> tuple[jax.Array, jax.Array]:
    """(done [B], end [B]): a row is done when an EOS is committed with every canvas position before it
    committed, or when nothing is masked; ``end`` is the first such EOS position (else the canvas end)."""
    s = x_BS.shape[1]
    is_eos = committed_eos(x_BS, masked_BS, canvas_BS, eos_ids)
    before_ok = jnp.cumsum((masked_BS & canvas_BS).astype(jnp.int32), axis=1) == 0  # no mask at or before
    hit = is_eos & before_ok
    first = jnp.where(jnp.any(hit, axis=1), jnp.argmax(hit, axis=1), s)
    return jnp.any(hit, axis=1) | ~jnp.any(masked_BS, axis=1), first


def before_answer_end(x_BS, masked_BS, canvas_BS, eos_ids) -> jax.Array:
    """[B, S]: canvas positions before the row's first committed EOS (the whole canvas while none is committed).
    Masks after it never reach the answer, so the adaptive rules and DiCo leave them alone."""
    hit = committed_eos(x_BS, masked_BS, canvas_BS, eos_ids)
    return canvas_BS & (jnp.cumsum(hit.astype(jnp.int32), axis=1) == 0)


# ------------------------------------------------------------------------------------------------ sampler
def generate(params, prompt_BP, prompt_len_B, key, temperature, top_p, *, cfg: ModelConfig,
             opts: DiffusionOptions, mask_id: int, max_new: int, max_len: int, eos_ids: tuple[int, ...], samp,
             mesh=None):
    """Returns (Outputs, stats). ``max_new`` equals ``opts.gen_length``."""
    del top_p, max_new
    params = decode_layout(params, cfg, fuse=mesh is None)
    b, p = prompt_BP.shape
    g = opts.gen_length
    s = max_len
    pos_S = jnp.arange(s)
    canvas = (pos_S[None, :] >= prompt_len_B[:, None]) & (pos_S[None, :] < (prompt_len_B + g)[:, None])
    x = jnp.zeros((b, s), jnp.int32).at[:, :p].set(prompt_BP)
    x = jnp.where(canvas, mask_id, jnp.where(pos_S[None, :] < prompt_len_B[:, None], x, 0))
    total = prompt_len_B + g
    positions = jnp.broadcast_to(pos_S, (b, s)).astype(jnp.int32)
    mask_full = full_mask(total, s)
    greedy = samp.greedy
    per_layer = unrolled(params)

    def block_span(blk):
        lo = prompt_len_B + blk * opts.block_length
        return lo, lo + opts.block_length

    def in_block(blk):
        lo, hi = block_span(blk)
        return (pos_S[None, :] >= lo[:, None]) & (pos_S[None, :] < hi[:, None])

    def logits_full(xx):
        h = forward(params, cfg, xx, positions, mask_full).hidden
        lg = unembed(params, cfg, h)
        return jnp.concatenate([lg[:, :1], lg[:, :-1]], axis=1) if opts.shift else lg

    def guided(xx, fn):
        lg = fn(xx)
        if opts.cfg_scale > 0:
            un = fn(jnp.where(pos_S[None, :] < prompt_len_B[:, None], mask_id, xx))
            lg = un + (opts.cfg_scale + 1.0) * (lg - un)
        return lg

    n_fwd = 2 if opts.cfg_scale > 0 else 1

    # --- cached forwards (Fast-dLLM): refresh the whole cache at a block start, then recompute part of it
    def refresh(xx):
        c = kvc.init_cache(cfg, b, s, per_layer=per_layer)
        fo = forward(params, cfg, xx, positions, mask_full, cache=c, write_at_B=jnp.zeros((b,), jnp.int32))
        lg = unembed(params, cfg, fo.hidden)
        return (jnp.concatenate([lg[:, :1], lg[:, :-1]], axis=1) if opts.shift else lg), fo.cache

    def partial(xx, c, blk):
        """Recompute the current block (dual) or the block and everything after it (prefix); scatter the
        logits back to [B, S]."""
        lo, _ = block_span(blk)
        width = opts.block_length if opts.cache == "dual" else None

        def run(w):
            # with shifted logits (Dream) the window starts one earlier: position i reads the hidden state at i - 1
            sh = 1 if opts.shift else 0
            idx = lo[:, None] - sh + jnp.arange(w + sh)[None, :]  # [B, w + sh]
            tok = jnp.take_along_axis(xx, jnp.clip(idx, 0, s - 1), axis=1)
            pos = jnp.maximum(idx, 0).astype(jnp.int32)
            qmask = (jnp.arange(s)[None, None, :] < total[:, None, None]) & (idx < s)[:, :, None]
            fo = forward(params, cfg, tok, pos, qmask, cache=c, write_at_B=lo - sh)
            lg = unembed(params, cfg, fo.hidden)[:, :w]
            tgt = lo[:, None] + jnp.arange(w)[None, :]
            out = jnp.zeros((b, s, lg.shape[-1]), lg.dtype)
            out = out.at[jnp.arange(b)[:, None], tgt].set(lg, mode="drop")
            return out, fo.cache

        if width is not None:
            return run(width)
        # prefix cache: the width (block + later canvas) shrinks with the block index: one branch per block
        branches = [lambda xx_c, w=g - k * opts.block_length: run(w) for k in range(opts.num_blocks)]
        return jax.lax.switch(blk, branches, None)

    key, k0 = jax.random.split(key)
    cache0 = None
    if opts.cache != "none":
        cache0 = kvc.init_cache(cfg, b, s, per_layer=per_layer)
    blk_masks0 = jnp.sum(canvas & in_block(0), axis=1).astype(jnp.int32)
    state = DiffState(x=x, masked=canvas, commit_step=jnp.full((b, s), -1, jnp.int32), block=jnp.int32(0),
                      step_in_block=jnp.int32(0), block_masks=blk_masks0, done=jnp.zeros((b,), bool),
                      nfe=jnp.int32(0), steps=jnp.int32(0), key=key, cache=cache0)

    def cond(st: DiffState):
        return ~jnp.all(st.done) & (st.block < opts.num_blocks)

    def body(st: DiffState):
        key, k_tok, k_conf, k_sel = jax.random.split(st.key, 4)
        cache = st.cache
        if opts.cache == "none":
            lg = guided(st.x, logits_full)
        else:
            def do_refresh(_):
                return refresh(st.x)

            def do_partial(_):
                return partial(st.x, cache, st.block)

            # refresh at a block start, and every refresh_every steps when set
            fresh = st.step_in_block % opts.refresh_every == 0 if opts.refresh_every else st.step_in_block == 0
            lg, cache = jax.lax.cond(fresh, do_refresh, do_partial, None)
        lg = no_mask(lg, mask_id)
        x0 = predict(lg, temperature, k_tok, greedy)
        conf = confidence(lg, x0, opts.alg, k_conf)
        ent = entropy(lg) if opts.rule == "eb" else conf
        active = ~st.done
        eligible = st.masked & in_block(st.block) & active[:, None]
        if opts.rule != "schedule":
            eligible = eligible & before_answer_end(st.x, st.masked, canvas, eos_ids)
        k_sched = schedule_counts(st.block_masks, opts.steps_per_block, st.step_in_block)
        commit = select(opts.rule, opts, conf, ent, eligible, k_sched, k_sel)
        x = jnp.where(commit, x0, st.x)
        masked = st.masked & ~commit
        commit_step = jnp.where(commit, st.steps, st.commit_step)
        done, _ = answer_done(x, masked, canvas, eos_ids)
        done = st.done | done
        # the block advances when no active row has masks left in it (schedule: when its steps are spent)
        blk_left = jnp.any(masked & in_block(st.block) & ~done[:, None])
        step_in_block = st.step_in_block + 1
        if opts.rule == "schedule":
            advance = (step_in_block >= opts.steps_per_block) | ~blk_left
        else:
            advance = ~blk_left
        block = st.block + advance.astype(jnp.int32)
        step_in_block = jnp.where(advance, 0, step_in_block)
        blk_masks = jnp.where(advance, jnp.sum(masked & in_block(block), axis=1).astype(jnp.int32),
                              st.block_masks)
        return DiffState(x=x, masked=masked, commit_step=commit_step, block=block, step_in_block=step_in_block,
                         block_masks=blk_masks, done=done, nfe=st.nfe + n_fwd, steps=st.steps + 1, key=key,
                         cache=cache)

    st = jax.lax.while_loop(cond, body, state)
    return finish(st, prompt_len_B, canvas, g, eos_ids)


def finish(st, prompt_len_B, canvas, g: int, eos_ids):
    """Outputs (canvas up to the answer's EOS) and stats of a finished diffusion state."""
    b, s = st.x.shape
    _, end = answer_done(st.x, st.masked, canvas, eos_ids)
    n_out = jnp.where(end < s, end - prompt_len_B + 1, g).astype(jnp.int32)
    idx = prompt_len_B[:, None] + jnp.arange(g)[None, :]
    toks = jnp.take_along_axis(st.x, jnp.minimum(idx, s - 1), axis=1)
    out = common.Outputs(tokens=toks, count=n_out, done=jnp.ones((b,), bool),
                         row_forwards=jnp.full((b,), st.nfe, jnp.int32))
    steps_g = jnp.take_along_axis(st.commit_step, jnp.minimum(idx, s - 1), axis=1)
    return out, {"target_forwards": st.nfe, "steps": st.steps, "commit_step": steps_g}
