"""DiCo: divide-and-conquer decoding for masked diffusion LMs (arXiv 2602.23792), as one `lax.while_loop`.

The paper's text is all there is (no public code); where it is silent we chose, and say so below. Each loop
iteration runs one model forward, then acts according to the phase it is in:

* **Divide** — seeds are masked positions whose confidence is *moderate and stable*: the trajectory-weighted
  confidence ``cbar`` (an EMA of the top-1 probability over the steps so far, weight ``traj_beta``) lies in
  ``[seed_low, seed_high]`` and moved less than ``stability`` since the previous step. Up to ``num_seeds`` are
  picked greedily by score ``cbar - stability_weight * |c - c_prev|``; after each pick, the scores around it are
  damped soft-NMS style by ``1 - exp(-(d / nms_sigma)^2)`` so seeds spread out. Each seed grows both ways over
  contiguous masked neighbours with confidence >= ``grow_threshold`` (at most ``max_radius`` each side);
  overlapping or touching clusters merge (a cluster is a run of cluster positions). The new clusters are
  conquered in the same step (``divide_commit="factor"``: the factor rule below inside each, and at least the
  most confident cluster token); ``divide_commit="seeds"`` commits the seeds themselves instead.
  If no seed qualifies, or at most ``final_masks`` masks remain, the loop moves to Finalize.
* **Conquer** — every cluster decodes in parallel: inside a cluster the masked positions sorted by confidence
  c_(1) >= c_(2) >= ... are committed while ``(k + 1)(1 - c_(k)) < 1`` (the factor rule with f = 1, the set
  S_t = {i : (|S_t| + 1)(1 - c_i) < 1}). Cluster boundaries then take in up to ``conquer_growth`` adjacent
  masked positions each side whose confidence clears ``grow_threshold``. A Conquer step that commits nothing, or
  a cluster set with no masks left, returns to Divide.
* **Finalize** — the remaining masks are decoded by the compound score ``c + margin_weight * (top1 - top2)``:
  every mask scoring >= ``final_threshold`` is committed, and always the best one.

Every phase works on the masks of the row's current semi-AR block (``block_length``; 0, the default, makes the
whole canvas one block) that lie before the row's first committed EOS: masks after it never reach the answer.

Defaults: ``grow_threshold`` 0.6 and blocks of 32, chosen by ``--tune-dico`` (below) on code-dllm at length 256;
``num_seeds`` 8 (the paper reports DiCo stable for 2-10 seeds); ``conquer_growth`` = ``max_radius`` (8):
"boundaries updated as tokens pass" does not say by how much, and small steps cost many more forwards at the same
accuracy (docs/performance_code_notes.md). The
knobs the paper leaves open (the EMA form of the trajectory weight, the seed band and stability limit, the
Gaussian NMS kernel, what Divide commits, the growth threshold and step, blocks, Finalize's threshold and weight)
are chosen with ``pdecode bench --suite diffusion --tune-dico`` on held-out items the reported benchmark never
uses; docs/diffusion_results.md has the grid and the pick.

The canvas, the AR shift, sampling (temperature, top-k, top-p) and EOS handling are shared with the other masked
samplers (`pdecode.decode.canvas`); each loop iteration is `signals` (one forward and what every phase reads from
it), then `transition` (`divide`, `conquer` or `finalize`, and the phase and block bookkeeping).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import struct

from pdecode.config import ModelConfig
from pdecode.decode import canvas as cvs
from pdecode.errors import ConfigError
from pdecode.model.transformer import decode_layout

DIVIDE, CONQUER, FINALIZE = 0, 1, 2


@dataclasses.dataclass(frozen=True)
class DiCoOptions:
    gen_length: int = 64
    num_seeds: int = 8
    seed_low: float = 0.3
    seed_high: float = 0.95
    stability: float = 0.2
    stability_weight: float = 1.0
    traj_beta: float = 0.5
    nms_sigma: float = 8.0
    grow_threshold: float = 0.6
    max_radius: int = 8
    conquer_growth: int = 8
    final_masks: int = 4
    final_threshold: float = 0.9
    margin_weight: float = 0.5
    block_length: int = 32  # semi-AR blocks (0: the whole canvas is one block)
    divide_commit: str = "factor"  # "factor": the factor rule in the new clusters at once; "seeds": commit the seeds
    remask: str = "none"  # ReMDM remasking of committed tokens in the block (`canvas.remask`)
    remask_eta: float = 0.1
    shift: bool = False

    def __post_init__(self):
        if not (0.0 <= self.seed_low < self.seed_high <= 1.0):
            raise ConfigError(f"need 0 <= seed_low < seed_high <= 1, got {self.seed_low}, {self.seed_high}")
        if (self.num_seeds < 1 or self.max_radius < 0 or self.conquer_growth < 0 or self.final_masks < 0
                or self.nms_sigma <= 0):
            raise ConfigError("num_seeds >= 1, max_radius >= 0, conquer_growth >= 0, final_masks >= 0 and "
                              "nms_sigma > 0 are required")
        if self.divide_commit not in ("seeds", "factor"):
            raise ConfigError(f"divide_commit must be 'seeds' or 'factor', got {self.divide_commit!r}")
        if self.block_length < 0:
            raise ConfigError(f"block_length must be >= 0 (0 = the whole canvas), got {self.block_length}")
        if not 0.0 <= self.traj_beta < 1.0:
            raise ConfigError(f"traj_beta must be in [0, 1), got {self.traj_beta}")
        if self.remask not in cvs.REMASK or not 0.0 <= self.remask_eta <= 1.0:
            raise ConfigError(f"remask must be one of {', '.join(cvs.REMASK)} and remask_eta in [0, 1], got "
                              f"{self.remask!r}, {self.remask_eta}")


@struct.dataclass
class DiCoState:
    x: jax.Array
    masked: jax.Array
    commit_step: jax.Array
    cluster: jax.Array  # [B, S] positions belonging to a cluster
    phase: jax.Array  # [B]
    cbar: jax.Array  # [B, S] trajectory-weighted confidence
    c_prev: jax.Array  # [B, S]
    seen: jax.Array  # [B, S] whether cbar has been initialised
    block: jax.Array  # [B] the semi-AR block each row works in
    done: jax.Array
    row_nfe: jax.Array  # [B] forwards each row waited for
    passes: jax.Array  # scalar: model passes the batch ran
    steps: jax.Array
    key: jax.Array
    phase_steps: jax.Array  # [3] iterations spent per phase
    remasked: jax.Array | None = None  # [B, S] positions re-masked once (ReMDM; None when off)
    commit_conf: jax.Array | None = None  # [B, S] confidence when committed
    remasks: jax.Array | None = None  # scalar: re-masked tokens in all


def runs_id(member_BS: jax.Array) -> jax.Array:
    """Id of the contiguous run each member position belongs to (-1 outside): clusters that touch merge."""
    start = member_BS & ~jnp.concatenate([jnp.zeros_like(member_BS[:, :1]), member_BS[:, :-1]], axis=1)
    rid = jnp.cumsum(start.astype(jnp.int32), axis=1) - 1
    return jnp.where(member_BS, rid, -1)


def grow(seed_BS, masked_BS, conf_BS, thresh, radius: int) -> jax.Array:
    """Extend each seed left and right over contiguous masked positions with conf >= thresh (<= radius steps)."""
    ok = masked_BS & (conf_BS >= thresh)
    out = seed_BS
    left = right = seed_BS
    for _ in range(radius):
        left = jnp.concatenate([left[:, 1:], jnp.zeros_like(left[:, :1])], axis=1) & ok
        right = jnp.concatenate([jnp.zeros_like(right[:, :1]), right[:, :-1]], axis=1) & ok
        out = out | left | right
    return out


def pick_seeds(score_BS, eligible_BS, n: int, sigma: float) -> jax.Array:
    """Greedy soft-NMS: n picks, each damping the scores around it by 1 - exp(-(d/sigma)^2)."""
    b, s = score_BS.shape
    pos = jnp.arange(s)
    sc = jnp.where(eligible_BS, jnp.maximum(score_BS, 1e-6), 0.0)
    seeds = jnp.zeros((b, s), bool)
    for _ in range(n):
        best = jnp.argmax(sc, axis=1)
        has = jnp.max(sc, axis=1) > 0
        pick = (pos[None, :] == best[:, None]) & has[:, None]
        seeds = seeds | pick
        d = (pos[None, :] - best[:, None]).astype(jnp.float32)
        sc = jnp.where(pick, 0.0, sc * (1.0 - jnp.exp(-(d / sigma) ** 2)))
    return seeds


def factor_in_clusters(conf_BS, eligible_BS, cluster_id_BS) -> jax.Array:
    """Per cluster: commit the top n while (k + 1)(1 - c_(k)) < 1 holds for k = 1..n."""
    b, s = conf_BS.shape
    same = (cluster_id_BS[:, :, None] == cluster_id_BS[:, None, :]) & (cluster_id_BS[:, :, None] >= 0)
    better = eligible_BS[:, None, :] & same & (
        (conf_BS[:, None, :] > conf_BS[:, :, None]) |
        ((conf_BS[:, None, :] == conf_BS[:, :, None]) & (jnp.arange(s)[None, None, :] < jnp.arange(s)[None, :, None])))
    k = jnp.sum(better, axis=2) + 1  # 1-based rank inside the cluster
    # the rule must hold for every rank up to k: sorted confidences make (k+1)(1-c) increasing, so it suffices
    # that it holds at the position itself
    return eligible_BS & ((k + 1) * (1.0 - conf_BS) < 1.0)


@struct.dataclass
class Signals:
    """What one forward tells every phase: predictions, confidences and the row's decodable masks."""

    x0: jax.Array  # [B, S] predicted tokens
    c: jax.Array  # [B, S] confidence of x0
    margin: jax.Array  # [B, S] top-1 minus top-2 probability
    cbar: jax.Array  # [B, S] trajectory-weighted confidence
    drift: jax.Array  # [B, S] |c - c at the previous step|
    blk: jax.Array  # [B, S] the row's current block
    masked: jax.Array  # [B, S] masks the row may decode now (its block, before its answer's end, row active)


def signals(opts: DiCoOptions, cv: cvs.Canvas, st: DiCoState, lg, key, warp, samp, eos_ids) -> Signals:
    x0 = cvs.predict(lg, samp, warp, key)
    c, first, second = cvs.prob_stats(lg, x0)
    cbar = jnp.where(st.seen, opts.traj_beta * st.cbar + (1 - opts.traj_beta) * c, c)
    drift = jnp.where(st.seen, jnp.abs(c - st.c_prev), 0.0)
    blk = cv.in_block(st.block)
    live = cvs.before_answer_end(st.x, st.masked, cv.canvas_BS, eos_ids)
    masked = st.masked & ~st.done[:, None] & blk & live
    return Signals(x0=x0, c=c, margin=first - second, cbar=cbar, drift=drift, blk=blk, masked=masked)


def divide(opts: DiCoOptions, sg: Signals):
    """(commit, new clusters, go to Finalize): seeds of moderate, stable confidence spread by soft NMS, grown into
    clusters, the new clusters conquered at once (``divide_commit="factor"``) or their seeds committed."""
    pos_S = jnp.arange(sg.c.shape[1])
    eligible = sg.masked & (sg.cbar >= opts.seed_low) & (sg.cbar <= opts.seed_high) & (sg.drift <= opts.stability)
    seeds = pick_seeds(sg.cbar - opts.stability_weight * sg.drift, eligible, opts.num_seeds, opts.nms_sigma)
    clusters = grow(seeds, sg.masked, sg.c, opts.grow_threshold, opts.max_radius)
    go_final = ~jnp.any(seeds, axis=1) | (jnp.sum(sg.masked, axis=1) <= opts.final_masks)
    if opts.divide_commit == "seeds":
        return seeds, clusters, go_final
    # the factor rule inside each new cluster, and at least the most confident cluster token when it takes none
    in_new = sg.masked & clusters
    fac = factor_in_clusters(sg.c, in_new, runs_id(clusters))
    best = jnp.argmax(jnp.where(in_new, sg.c, -1.0), axis=1)
    return fac | (in_new & (pos_S[None, :] == best[:, None]) & ~jnp.any(fac, axis=1)[:, None]), clusters, go_final


def conquer(sg: Signals, cluster_BS) -> jax.Array:
    """Commit inside every cluster in parallel by the factor rule with f = 1."""
    return factor_in_clusters(sg.c, sg.masked & cluster_BS, runs_id(cluster_BS))


def finalize(opts: DiCoOptions, sg: Signals) -> jax.Array:
    """Commit every mask whose compound score c + margin_weight * margin clears the threshold, and the best one."""
    score = jnp.where(sg.masked, sg.c + opts.margin_weight * sg.margin, -jnp.inf)
    best = jnp.argmax(score, axis=1)
    return sg.masked & ((score >= opts.final_threshold) | (jnp.arange(score.shape[1])[None, :] == best[:, None]))


def transition(opts: DiCoOptions, cv: cvs.Canvas, st: DiCoState, sg: Signals, eos_ids, key=None) -> DiCoState:
    """One step's phase logic: the phase that acts (a Conquer with nothing to commit falls through to Divide, a
    Divide with no seed or few masks left to Finalize, so every step of an active row commits at least one
    token), its commits, the clusters after them and each row's next phase and block."""
    div_commit, new_cluster, go_final = divide(opts, sg)
    con_commit = conquer(sg, st.cluster)
    eff = jnp.where((st.phase == CONQUER) & ~jnp.any(con_commit, axis=1), DIVIDE, st.phase)
    eff = jnp.where((eff == DIVIDE) & go_final, FINALIZE, eff)
    ph = eff[:, None]
    commit = jnp.where(ph == DIVIDE, div_commit, jnp.where(ph == CONQUER, con_commit, finalize(opts, sg))) & sg.masked
    x = jnp.where(commit, sg.x0, st.x)
    masked = st.masked & ~commit
    remasked, commit_conf, remasks = st.remasked, st.commit_conf, st.remasks
    if opts.remask != "none":  # before the block may advance: a fully decoded block re-masks nothing
        commit_conf = jnp.where(commit, sg.c, commit_conf)
        x, masked, remasked, hit = cvs.remask(x, masked, commit, sg.blk & cv.canvas_BS, commit_conf, remasked,
                                              st.done, cv.mask_id, opts.remask, opts.remask_eta, key)
        remasks = remasks + jnp.sum(hit)
    # clusters: fresh ones from the seeds (Divide), or the old ones grown at their boundaries (Conquer)
    grown = grow(st.cluster, masked & sg.blk, sg.c, opts.grow_threshold, opts.conquer_growth)
    cluster = jnp.where(ph == DIVIDE, new_cluster, jnp.where(ph == CONQUER, grown, False))
    phase = jnp.where(eff == FINALIZE, FINALIZE, CONQUER)
    done = st.done | cvs.answer_done(x, masked, cv.canvas_BS, eos_ids)[0]
    # a row whose block is fully decoded moves to the next one and starts again with Divide
    advance = ~jnp.any(masked & sg.blk, axis=1)
    active = ~st.done
    return DiCoState(x=x, masked=masked, commit_step=jnp.where(commit, st.steps, st.commit_step),
                     cluster=cluster & ~advance[:, None], phase=jnp.where(advance, DIVIDE, phase), cbar=sg.cbar,
                     c_prev=sg.c, seen=st.seen | cv.canvas_BS, block=st.block + advance.astype(jnp.int32),
                     done=done, row_nfe=st.row_nfe + active.astype(jnp.int32), passes=st.passes + 1,
                     steps=st.steps + 1, key=st.key, phase_steps=st.phase_steps.at[eff].add(active.astype(jnp.int32)),
                     remasked=remasked, commit_conf=commit_conf, remasks=remasks)


def generate(params, prompt_BP, prompt_len_B, key, warp, *, cfg: ModelConfig, opts: DiCoOptions,
             mask_id: int, max_new: int, max_len: int, eos_ids: tuple[int, ...], samp, mesh=None):
    del max_new
    params = decode_layout(params, cfg, fuse=mesh is None)
    b = prompt_BP.shape[0]
    g = opts.gen_length
    cv, x = cvs.make_canvas(prompt_BP, prompt_len_B, gen=g, block=opts.block_length if 0 < opts.block_length < g
                            else g, max_len=max_len, mask_id=mask_id, shift=opts.shift)
    zeros = jnp.zeros(x.shape, jnp.float32)
    zeros_B = jnp.zeros((b,), jnp.int32)
    state = DiCoState(x=x, masked=cv.canvas_BS, commit_step=jnp.full(x.shape, -1, jnp.int32),
                      cluster=jnp.zeros(x.shape, bool), phase=jnp.full((b,), DIVIDE, jnp.int32), cbar=zeros,
                      c_prev=zeros, seen=jnp.zeros(x.shape, bool), block=zeros_B, done=jnp.zeros((b,), bool),
                      row_nfe=zeros_B, passes=jnp.int32(0), steps=jnp.int32(0), key=key,
                      phase_steps=jnp.zeros((3,), jnp.int32))

    if opts.remask != "none":
        state = state.replace(remasked=jnp.zeros(x.shape, bool), commit_conf=zeros, remasks=jnp.int32(0))
    limit = (2 if opts.remask != "none" else 1) * g + 1

    def cond(st):
        # every step commits >= 1 token per active row, each position is re-masked at most once (a guard)
        return ~jnp.all(st.done) & (st.steps < limit)

    def body(st: DiCoState):
        key, k_tok, *k_re = jax.random.split(st.key, 3 if opts.remask != "none" else 2)
        lg = cvs.no_mask(cvs.full_logits(params, cfg, st.x, cv), mask_id)
        sg = signals(opts, cv, st, lg, k_tok, warp, samp, eos_ids)
        return transition(opts, cv, st, sg, eos_ids, k_re[0] if k_re else None).replace(key=key)

    st = jax.lax.while_loop(cond, body, state)
    out, stats = cvs.finish(st.x, st.masked, st.commit_step, st.row_nfe, st.passes, st.steps, cv, eos_ids)
    stats["phase_steps"] = st.phase_steps
    if opts.remask != "none":
        stats["remasked_tokens"] = st.remasks
    return out, stats
