"""Masked-diffusion samplers (LLaDA / Dream / Fast-dLLM / EB-sampler), each the whole generation in one
`lax.while_loop` with static shapes and batch > 1, on the shared canvas of `pdecode.decode.canvas` (layout, AR
shift, per-row semi-AR blocks, sampling, EOS).

Each step runs the model (`step_logits`), predicts every masked position and commits, inside each row's current
block, the masked positions the *rule* picks (`select`); the row then moves to its next block when its block is
decoded (`advance_blocks`):

* ``schedule`` (LLaDA): the per-block step budget spreads the block's masks evenly over its steps
  (``masks // steps``, +1 for the first ``masks % steps`` steps); the most confident ones are committed.
* ``threshold`` (Fast-dLLM): every mask whose confidence is >= ``threshold``, and always the most confident one.
* ``factor`` (Fast-dLLM): the top n while ``(k + 1) (1 - c_(k)) <= factor`` holds for k = 1..n (at least one).
* ``eb`` (EB-sampler): sort by entropy; the longest prefix with ``sum H - max H <= eb_gamma`` (at least one).

Confidence (``alg``): ``confidence`` = probability of the predicted token (LLaDA low-confidence remasking, Dream
maskgit_plus), ``margin`` = top1 - top2 (Dream topk_margin), ``entropy`` = -H (Dream entropy), ``random``
(LLaDA random remasking). ``alg_temp > 0`` draws the positions (Gumbel top-k on confidence / alg_temp) instead of
taking the top ones. Tokens: the argmax at temperature 0, else a draw from the warped distribution (temperature,
top-k, top-p). Classifier-free guidance: ``logits = un + (s + 1)(cond - un)`` with the prompt masked in the
unconditional pass; with a KV cache the unconditional pass keeps a cache of its own.

Caching (Fast-dLLM): ``prefix`` keeps the KV of everything before a row's block from a full pass at the block start
and recomputes the block and what follows; ``dual`` also keeps the suffix and recomputes only the block. A row's
cache is refreshed at its own block starts (and every ``refresh_every`` steps of a block when set), so a batch
decodes every row exactly as it would alone: a step where only some rows start a block runs the full pass for
those rows beside the partial pass for the rest (``target_forwards`` counts both passes; every row waits one).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import struct

from pdecode.config import ModelConfig
from pdecode.decode import canvas as cvs
from pdecode.decode.canvas import (  # noqa: F401  (the canvas pieces, also under their old names here)
    answer_done, before_answer_end, committed_eos, confidence, entropy, full_mask, no_mask, prob_stats)
from pdecode.errors import ConfigError
from pdecode.model import cache as kvc
from pdecode.model.transformer import decode_layout, forward, unembed, unrolled


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
    remask: str = "none"  # ReMDM remasking of committed tokens in the block: none | cap | rescale | conf
    remask_eta: float = 0.1

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
        if self.remask not in cvs.REMASK:
            problems.append(f"remask must be one of {', '.join(cvs.REMASK)}, got {self.remask!r}")
        if self.remask != "none" and self.rule == "schedule":
            problems.append("remask needs an adaptive rule (threshold, factor or eb): the schedule's step budget "
                            "would leave re-masked positions undecoded")
        if not 0.0 <= self.remask_eta <= 1.0:
            problems.append(f"remask_eta must be in [0, 1], got {self.remask_eta}")
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

    @property
    def passes(self) -> int:
        """Model passes per forward: two with classifier-free guidance (conditional and unconditional)."""
        return 2 if self.cfg_scale > 0 else 1


@struct.dataclass
class DiffState:
    x: jax.Array  # [B, S] tokens (mask id where not yet decoded)
    masked: jax.Array  # [B, S] canvas positions still masked
    commit_step: jax.Array  # [B, S] step at which each canvas position was committed (-1: prompt / never)
    block: jax.Array  # [B] each row's current block
    step_in_block: jax.Array  # [B] steps the row has spent in its block
    block_masks: jax.Array  # [B] masks in the row's block when it started (schedule rule)
    done: jax.Array  # [B]
    row_nfe: jax.Array  # [B] model forwards each row waited for
    passes: jax.Array  # scalar: model passes the batch ran
    steps: jax.Array  # scalar
    key: jax.Array
    caches: tuple | None  # (conditional,) or (conditional, unconditional) KV caches, or None
    remasked: jax.Array | None = None  # [B, S] positions re-masked once (ReMDM; None when off)
    commit_conf: jax.Array | None = None  # [B, S] confidence when committed (remask="conf")
    remasks: jax.Array | None = None  # scalar: re-masked tokens in all


# ------------------------------------------------------------------------------------------------ rules
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


# ------------------------------------------------------------------------------------------------ forwards
def refresh_pass(params, cfg: ModelConfig, cv: cvs.Canvas, x_BS, cache_dtype=jnp.float32):
    """A full pass that also writes a fresh KV cache of every position: (logits [B, S, V], cache)."""
    b, s = x_BS.shape
    c = kvc.init_cache(cfg, b, s, cache_dtype, per_layer=unrolled(params))
    fo = forward(params, cfg, x_BS, cv.positions_BS, cv.attn_BSS, cache=c, write_at_B=jnp.zeros((b,), jnp.int32))
    return cvs.shift_logits(unembed(params, cfg, fo.hidden), cv.shift), fo.cache


def window_pass(params, cfg: ModelConfig, cv: cvs.Canvas, x_BS, cache, lo_B, width: int):
    """Recompute positions ``[lo_B, lo_B + width)`` of each row over the cache (which gets their fresh KV); the
    logits come back scattered to [B, S, V] (zeros elsewhere). With the AR shift the window starts one earlier:
    position i reads the hidden state at i - 1. Window slots past a row's canvas are never visible and dropped."""
    b, s = x_BS.shape
    sh = 1 if cv.shift else 0
    idx = lo_B[:, None] - sh + jnp.arange(width + sh)[None, :]  # [B, width + sh]
    tok = jnp.take_along_axis(x_BS, jnp.clip(idx, 0, s - 1), axis=1)
    pos = jnp.maximum(idx, 0).astype(jnp.int32)
    qmask = (jnp.arange(s)[None, None, :] < cv.total_B[:, None, None]) & (idx < s)[:, :, None]
    fo = forward(params, cfg, tok, pos, qmask, cache=cache, write_at_B=lo_B - sh)
    lg = unembed(params, cfg, fo.hidden)[:, :width]
    tgt = lo_B[:, None] + jnp.arange(width)[None, :]
    out = jnp.zeros((b, s, lg.shape[-1]), lg.dtype).at[jnp.arange(b)[:, None], tgt].set(lg, mode="drop")
    return out, fo.cache


def partial_pass(params, cfg, cv: cvs.Canvas, opts: DiffusionOptions, x_BS, cache, block_B, active_B):
    """The cached forward between refreshes: the row's block (dual) or its block and everything after (prefix).
    The prefix window shrinks as blocks advance: one branch per block, sized for the furthest-behind active row."""
    lo, _ = cv.block_bounds(block_B)
    if opts.cache == "dual":
        return window_pass(params, cfg, cv, x_BS, cache, lo, cv.block)
    behind = jnp.min(jnp.where(active_B, jnp.minimum(block_B, cv.num_blocks - 1), cv.num_blocks - 1))
    branches = [lambda c, w=cv.gen - k * cv.block: window_pass(params, cfg, cv, x_BS, c, lo, w)
                for k in range(cv.num_blocks)]
    return jax.lax.switch(behind, branches, cache)


def cached_logits(params, cfg, cv: cvs.Canvas, opts: DiffusionOptions, x_BS, cache, block_B, active_B, fresh_B):
    """(logits, cache, passes) of a cached step: rows in ``fresh_B`` get a full pass and a fresh cache, the others
    the partial pass over their cache; a step where both kinds of rows are active runs both passes."""
    def full(c):
        lg, nc = refresh_pass(params, cfg, cv, x_BS, cache.dtype)
        return lg, nc, jnp.int32(1)

    def part(c):
        lg, nc = partial_pass(params, cfg, cv, opts, x_BS, c, block_B, active_B)
        return lg, nc, jnp.int32(1)

    def both(c):
        lf, cf = refresh_pass(params, cfg, cv, x_BS, cache.dtype)
        lp, cp = partial_pass(params, cfg, cv, opts, x_BS, c, block_B, active_B)
        return jnp.where(fresh_B[:, None, None], lf, lp), kvc.where_rows(fresh_B, cf, cp), jnp.int32(2)

    n_fresh = jnp.sum(fresh_B & active_B)
    case = jnp.where(n_fresh == jnp.sum(active_B), 0, jnp.where(n_fresh > 0, 2, 1))
    return jax.lax.switch(case, [full, part, both], cache)


def step_logits(params, cfg, cv: cvs.Canvas, opts: DiffusionOptions, st: DiffState):
    """(logits with the mask token removed, caches, passes) of one step, guided when ``cfg_scale > 0``."""
    active = ~st.done
    inputs = (st.x, cvs.unconditional(st.x, cv)) if opts.cfg_scale > 0 else (st.x,)
    if opts.cache == "none":
        lgs, caches, passes = [cvs.full_logits(params, cfg, xx, cv) for xx in inputs], None, jnp.int32(len(inputs))
    else:
        every = opts.refresh_every
        fresh = (st.step_in_block % every == 0) if every else (st.step_in_block == 0)
        runs = [cached_logits(params, cfg, cv, opts, xx, c, st.block, active, fresh)
                for xx, c in zip(inputs, st.caches)]
        lgs, caches, passes = [r[0] for r in runs], tuple(r[1] for r in runs), sum(r[2] for r in runs)
    lg = lgs[0]
    if opts.cfg_scale > 0:
        lg = lgs[1] + (opts.cfg_scale + 1.0) * (lgs[0] - lgs[1])
    return cvs.no_mask(lg, cv.mask_id), caches, passes


# ------------------------------------------------------------------------------------------------ steps
def choose(opts: DiffusionOptions, cv: cvs.Canvas, st: DiffState, lg, key, warp, samp, eos_ids):
    """(commit [B, S], x0 [B, S]): the predictions and the positions the rule commits in each row's block."""
    k_tok, k_conf, k_sel = jax.random.split(key, 3)
    x0 = cvs.predict(lg, samp, warp, k_tok)
    conf = cvs.confidence(lg, x0, opts.alg, k_conf)
    ent = cvs.entropy(lg) if opts.rule == "eb" else conf
    eligible = st.masked & cv.in_block(st.block) & ~st.done[:, None]
    if opts.rule != "schedule":
        eligible = eligible & cvs.before_answer_end(st.x, st.masked, cv.canvas_BS, eos_ids)
    k_sched = schedule_counts(st.block_masks, opts.steps_per_block, st.step_in_block)
    return select(opts.rule, opts, conf, ent, eligible, k_sched, k_sel), x0


def advance_blocks(opts: DiffusionOptions, cv: cvs.Canvas, st: DiffState, masked_BS, done_B):
    """(block, step_in_block, block_masks) per row: a row moves on when its block has no masks left (schedule: also
    when its block's steps are spent)."""
    left = jnp.any(masked_BS & cv.in_block(st.block), axis=1)
    step = st.step_in_block + 1
    advance = ~left | ((step >= opts.steps_per_block) if opts.rule == "schedule" else False)
    advance = advance & ~done_B
    block = st.block + advance.astype(jnp.int32)
    fresh_masks = jnp.sum(masked_BS & cv.in_block(block), axis=1).astype(jnp.int32)
    return block, jnp.where(advance, 0, step), jnp.where(advance, fresh_masks, st.block_masks)


def generate(params, prompt_BP, prompt_len_B, key, warp, *, cfg: ModelConfig,
             opts: DiffusionOptions, mask_id: int, max_new: int, max_len: int, eos_ids: tuple[int, ...], samp,
             mesh=None, cache_dtype=jnp.float32):
    """Returns (Outputs, stats). ``max_new`` equals ``opts.gen_length``; the prefix / dual caches (``opts.cache``)
    are kept in ``cache_dtype``."""
    del max_new
    params = decode_layout(params, cfg, fuse=mesh is None)
    b = prompt_BP.shape[0]
    cv, x = cvs.make_canvas(prompt_BP, prompt_len_B, gen=opts.gen_length, block=opts.block_length, max_len=max_len,
                            mask_id=mask_id, shift=opts.shift)
    caches = None
    if opts.cache != "none":
        caches = tuple(kvc.init_cache(cfg, b, max_len, cache_dtype, per_layer=unrolled(params))
                       for _ in range(opts.passes))
    zeros_B = jnp.zeros((b,), jnp.int32)
    st = DiffState(x=x, masked=cv.canvas_BS, commit_step=jnp.full(x.shape, -1, jnp.int32), block=zeros_B,
                   step_in_block=zeros_B,
                   block_masks=jnp.sum(cv.canvas_BS & cv.in_block(zeros_B), axis=1).astype(jnp.int32),
                   done=jnp.zeros((b,), bool), row_nfe=zeros_B, passes=jnp.int32(0), steps=jnp.int32(0), key=key,
                   caches=caches)

    if opts.remask != "none":
        st = st.replace(remasked=jnp.zeros(x.shape, bool), commit_conf=jnp.zeros(x.shape, jnp.float32),
                        remasks=jnp.int32(0))
    # never reached: every step commits or ends a block (each position is re-masked at most once; a guard)
    limit = (2 if opts.remask != "none" else 1) * max(opts.steps, opts.gen_length) + 1

    def cond(st: DiffState):
        return ~jnp.all(st.done) & (st.steps < limit)

    def body(st: DiffState):
        key, k_step, *k_re = jax.random.split(st.key, 3 if opts.remask != "none" else 2)
        lg, caches, passes = step_logits(params, cfg, cv, opts, st)
        commit, x0 = choose(opts, cv, st, lg, k_step, warp, samp, eos_ids)
        x = jnp.where(commit, x0, st.x)
        masked = st.masked & ~commit
        remasked, commit_conf, remasks = st.remasked, st.commit_conf, st.remasks
        if opts.remask != "none":
            commit_conf = jnp.where(commit, cvs.prob_stats(lg, x0)[0], commit_conf)
            x, masked, remasked, hit = cvs.remask(x, masked, commit, cv.in_block(st.block) & cv.canvas_BS,
                                                  commit_conf, remasked, st.done, cv.mask_id, opts.remask,
                                                  opts.remask_eta, k_re[0])
            remasks = remasks + jnp.sum(hit)
        done = st.done | answer_done(x, masked, cv.canvas_BS, eos_ids)[0]
        block, step_in_block, block_masks = advance_blocks(opts, cv, st, masked, done)
        return DiffState(x=x, masked=masked, commit_step=jnp.where(commit, st.steps, st.commit_step), block=block,
                         step_in_block=step_in_block, block_masks=block_masks, done=done,
                         row_nfe=st.row_nfe + (~st.done).astype(jnp.int32) * opts.passes,
                         passes=st.passes + passes, steps=st.steps + 1, key=key, caches=caches, remasked=remasked,
                         commit_conf=commit_conf, remasks=remasks)

    st = jax.lax.while_loop(cond, body, st)
    out, stats = cvs.finish(st.x, st.masked, st.commit_step, st.row_nfe, st.passes, st.steps, cv, eos_ids)
    if opts.remask != "none":
        stats["remasked_tokens"] = st.remasks
    return out, stats
