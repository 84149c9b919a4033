"""Block diffusion with an encoder-decoder model (DiffusionGemma): the model's own sampler, one jit call.

Canvas after canvas until every row has an EOS or ``canvases`` are written (the outer `lax.while_loop`); inside
a canvas, denoising steps until every row's canvas is stable and confident or ``steps`` ran (the inner one):

1. the decoder (`pdecode.model.families.diffusion_gemma.denoise`) predicts every canvas position from the current canvas,
   the encoded prompt and earlier canvases, and the previous step's logits (self-conditioning);
2. the logits are divided by the step's temperature ``T = t_min + (t_max - t_min) * r / steps`` (r = steps left,
   ``steps`` .. 1), and each position draws a token from them (at ``temperature`` 0: its argmax);
3. *entropy-bound acceptance*: positions sorted by entropy, the longest prefix whose entropies below the last sum to
   at most ``entropy_bound`` keep their draw; every other position gets noise (a uniform random token; at
   ``temperature`` 0 the fixed ``noise_id``): nothing is frozen, every position is predicted again next step;
4. a row stops when its argmax canvas equals the last ``stability`` ones and its mean entropy is below
   ``confidence`` (its canvas, argmax and self-conditioning logits are then frozen while other rows go on).

The argmax canvas is what is committed: the encoder writes it into the KV cache at the positions it was decoded at
(never recomputed), and a row whose canvas holds an EOS ends there. Rows have their own prompt lengths and
positions (no left padding). ``temperature`` scales the draws on top of the schedule (1: the reference sampler;
top-k / top-p filter the draws); the schedule's temperatures always set the entropies and self-conditioning.

Stats: ``canvas_steps [B, canvases]``, the denoising steps row b ran in each canvas (0: not reached); ``steps``
and ``target_forwards`` the batch's decoder steps and all passes (decoder steps + encoder passes);
``encoder_tokens [B]`` the tokens each row's encoder ran (its prompt and committed canvases, once each) and
``uncached_encoder_tokens [B]`` what it would run without the encoder cache (the prompt and the committed canvases
again before every decoder step).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import struct

from pdecode import sampling
from pdecode.config import ModelConfig
from pdecode.decode import common
from pdecode.errors import InputError
from pdecode.model.families import diffusion_gemma as bd
from pdecode.model import cache as kvc
from pdecode.model.transformer import decode_layout, unrolled
from pdecode.sharding import constrain_vocab

DEFAULTS = dict(steps=48, t_min=0.4, t_max=0.8, entropy_bound=0.1, stability=1, confidence=0.005)
# generation_config.json's names for them (transformers' DiffusionGemma generation config)
GEN_CONFIG_NAMES = dict(steps="max_denoising_steps", t_min="t_min", t_max="t_max", stability="stability_threshold",
                        confidence="confidence_threshold")


def _schedule_problems(t_min: float, t_max: float) -> list[str]:
    return [] if t_max > t_min >= 0 else [f"t_max ({t_max}) must be > t_min ({t_min}) >= 0"]


@dataclasses.dataclass(frozen=True)
class BlockDiffusionOptions:
    canvases: int  # canvases at most (ceil(max_new_tokens / canvas))
    canvas: int  # the model's canvas_length
    steps: int = DEFAULTS["steps"]  # denoising steps per canvas at most
    t_min: float = DEFAULTS["t_min"]
    t_max: float = DEFAULTS["t_max"]
    entropy_bound: float = DEFAULTS["entropy_bound"]
    stability: int = DEFAULTS["stability"]  # the argmax canvas must equal this many previous ones (0: always stable)
    confidence: float = DEFAULTS["confidence"]  # ... and the canvas's mean entropy be below this
    noise_id: int = 0  # the noise token at temperature 0

    def __post_init__(self):
        problems = _schedule_problems(self.t_min, self.t_max)
        if self.steps < 1:
            problems.append(f"steps must be >= 1 (got {self.steps})")
        if not self.entropy_bound > 0:
            problems.append(f"entropy_bound must be > 0 (got {self.entropy_bound})")
        if self.stability < 0:
            problems.append(f"stability must be >= 0 (got {self.stability})")
        if not self.confidence > 0:
            problems.append(f"confidence must be > 0 (got {self.confidence})")
        if problems:
            raise InputError("diffusion: " + "; ".join(problems))


@struct.dataclass
class _Canvas:
    """The inner loop's state (one canvas)."""

    cur: jax.Array  # [B, L] the canvas the next step reads
    sc: jax.Array  # [B, L, V] self-conditioning logits (the last step's temperature-scaled ones)
    sc_on: jax.Array  # [B] bool: a previous step exists
    amax: jax.Array  # [B, L] the last argmax canvas (frozen when the row finished)
    hist: jax.Array  # [stability, B, L] the argmax canvases before it (-1: none)
    fin: jax.Array  # [B] bool
    n: jax.Array  # [B] int32 steps each row ran
    step: jax.Array  # int32
    key: jax.Array


@struct.dataclass
class _Gen:  # the outer loop's state
    out: jax.Array  # [B, canvases * L]
    count: jax.Array  # [B] tokens written
    done: jax.Array  # [B] bool: EOS written
    cache: kvc.KVCache
    canvas_steps: jax.Array  # [B, canvases]
    row_forwards: jax.Array  # [B]
    k: jax.Array  # int32 canvases done
    steps: jax.Array  # int32 decoder passes of the batch
    key: jax.Array


def entropy_bound_accept(h_BL: jax.Array, bound: float) -> jax.Array:
    """[B, L] bool: in ascending entropy order, the positions whose lower entropies sum to at most ``bound``
    (the lowest is always accepted)."""
    order = jnp.argsort(h_BL, axis=-1)
    hs = jnp.take_along_axis(h_BL, order, axis=-1)
    ok = (jnp.cumsum(hs, axis=-1) - hs) <= bound
    rows = jnp.arange(h_BL.shape[0])[:, None]
    return jnp.zeros(h_BL.shape, bool).at[rows, order].set(ok)


def _entropy(lg):
    lp = jax.nn.log_softmax(lg, axis=-1)
    return -jnp.sum(jnp.exp(lp) * lp, axis=-1)


def _outer(params, cfg: ModelConfig, prompt_BP, prompt_len_B, key, *, canvases: int, canvas: int, max_new: int,
           max_len: int, eos_ids, cache_dtype, inner):
    """Canvas after canvas: ``inner(cache, done_B, key) -> (tokens [B, L] (-1: undecided), steps_B, passes, key)``
    decodes one canvas; its tokens are committed up to the first EOS and encoded into the cache."""
    params = decode_layout(params, cfg, fuse=False)
    b, L = prompt_BP.shape[0], canvas
    cache = kvc.init_cache(cfg, b, max_len, cache_dtype, per_layer=unrolled(params))
    cache = kvc.set_lengths(bd.encode(params, cfg, prompt_BP, cache, prompt_len_B), prompt_len_B)
    eos = jnp.asarray(eos_ids or (-1,), jnp.int32)

    def cond(g: _Gen):
        return ~jnp.all(g.done) & (g.k < canvases)

    def body(g: _Gen):
        commit, n_steps, passes, key = inner(params, g.cache, g.done, g.key)
        live = ~g.done
        cache = bd.encode(params, cfg, jnp.maximum(commit, 0), g.cache)
        cache = kvc.advance(cache, jnp.where(live, L, 0))
        hit = jnp.any(commit[..., None] == eos, axis=-1)  # [B, L]
        first = jnp.where(jnp.any(hit, axis=1), jnp.argmax(hit, axis=1) + 1, L)
        n_new = jnp.where(live, first, 0)
        rows = jnp.arange(b)[:, None]
        cols = g.count[:, None] + jnp.arange(L)[None]
        cols = jnp.where(jnp.arange(L)[None] < n_new[:, None], cols, canvases * L)
        out = g.out.at[rows, cols].set(commit, mode="drop")
        return _Gen(out=out, count=g.count + n_new, done=g.done | (live & jnp.any(hit, axis=1)), cache=cache,
                    canvas_steps=g.canvas_steps.at[:, g.k].set(n_steps), row_forwards=g.row_forwards + n_steps,
                    k=g.k + 1, steps=g.steps + passes, key=key)

    g = _Gen(out=jnp.zeros((b, canvases * L), jnp.int32), count=jnp.zeros((b,), jnp.int32),
             done=jnp.zeros((b,), bool), cache=cache, canvas_steps=jnp.zeros((b, canvases), jnp.int32),
             row_forwards=jnp.zeros((b,), jnp.int32), k=jnp.int32(0), steps=jnp.int32(0), key=key)
    g = jax.lax.while_loop(cond, body, g)
    count = jnp.minimum(g.count, max_new)
    out = common.Outputs(tokens=g.out[:, :max_new], count=count, done=jnp.ones((b,), bool),
                         row_forwards=g.row_forwards)
    # the encoder's work: each row's prompt and committed canvases once, against the tokens a sampler without the
    # encoder cache would encode (the prompt and every committed canvas again before each decoder step)
    before = prompt_len_B[:, None] + L * jnp.arange(canvases, dtype=jnp.int32)[None]
    reached = jnp.sum(g.canvas_steps > 0, axis=1)
    stats = {"target_forwards": g.steps + g.k + 1, "steps": g.steps, "canvases": g.k, "canvas_steps": g.canvas_steps,
             "encoder_tokens": prompt_len_B + L * reached, "uncached_encoder_tokens": jnp.sum(g.canvas_steps * before,
                                                                                              axis=1)}
    return out, stats


def _noise(greedy_B, noise_id: int, key, shape, vocab: int):
    """Uniform random tokens; the fixed ``noise_id`` in greedy rows."""
    return jnp.where(greedy_B[:, None], noise_id, jax.random.randint(key, shape, 0, vocab, jnp.int32))


def _greedy(warp, samp, b):
    return jnp.broadcast_to(sampling.greedy_rows(warp, jnp.zeros((b, 1))) | samp.greedy, (b,))


def generate(params, prompt_BP, prompt_len_B, key, warp, *, cfg: ModelConfig, opts: BlockDiffusionOptions,
             max_new: int, max_len: int, eos_ids: tuple[int, ...], samp: sampling.Sampling, mesh=None,
             cache_dtype=jnp.float32):
    """The model's own sampler; returns (Outputs, stats) (see the module docstring)."""
    b = prompt_BP.shape[0]
    L, V, N = opts.canvas, cfg.vocab_size, opts.steps
    greedy_B = _greedy(warp, samp, b)

    def inner(params, cache, done_B, key):
        key, k0 = jax.random.split(key)
        c0 = _Canvas(cur=_noise(greedy_B, opts.noise_id, k0, (b, L), V),
                     sc=constrain_vocab(jnp.zeros((b, L, V), jnp.float32), mesh),
                     sc_on=jnp.zeros((b,), bool), amax=jnp.zeros((b, L), jnp.int32),
                     hist=jnp.full((max(opts.stability, 1), b, L), -1, jnp.int32), fin=done_B,
                     n=jnp.zeros((b,), jnp.int32), step=jnp.int32(0), key=key)

        def cond(c: _Canvas):
            return ~jnp.all(c.fin) & (c.step < N)

        def body(c: _Canvas):
            key, k_draw, k_noise = jax.random.split(c.key, 3)
            lg = constrain_vocab(bd.denoise(params, cfg, c.cur, cache, c.sc, c.sc_on), mesh)
            t = opts.t_min + (opts.t_max - opts.t_min) * (N - c.step).astype(jnp.float32) / N
            proc = lg / t
            draw = sampling.sample(k_draw, proc, samp, warp)
            amax = sampling.argmax(proc)
            h = _entropy(proc)
            nxt = jnp.where(entropy_bound_accept(h, opts.entropy_bound), draw,
                            _noise(greedy_B, opts.noise_id, k_noise, (b, L), V))
            stable = jnp.all(jnp.all(amax[None] == c.hist, axis=-1), axis=0) if opts.stability else \
                jnp.ones((b,), bool)
            stop = stable & (jnp.mean(h, axis=-1) < opts.confidence)
            live = ~c.fin
            keep = lambda new, old: jnp.where(live.reshape((b,) + (1,) * (new.ndim - 1)), new, old)  # noqa: E731
            hist = jnp.concatenate([c.hist[1:], amax[None]], axis=0) if opts.stability else c.hist
            return _Canvas(cur=keep(nxt, c.cur), sc=constrain_vocab(keep(proc, c.sc), mesh), sc_on=c.sc_on | live, amax=keep(amax, c.amax),
                           hist=hist, fin=c.fin | stop, n=c.n + live.astype(jnp.int32), step=c.step + 1, key=key)

        c = jax.lax.while_loop(cond, body, c0)
        return c.amax, c.n, c.step, c.key

    return _outer(params, cfg, prompt_BP, prompt_len_B, key, canvases=opts.canvases, canvas=L, max_new=max_new,
                  max_len=max_len, eos_ids=eos_ids, cache_dtype=cache_dtype, inner=inner)


# ------------------------------------------------------------------------------------------------ masked samplers
@dataclasses.dataclass(frozen=True)
class MaskedCanvasOptions:
    """pdecode's masked-diffusion samplers inside each canvas of a block-diffusion model: ``sampler`` "rule" (the
    `diffusion` rules: ``rule_opts`` a `DiffusionOptions` over one canvas) or "dico" (``rule_opts`` a
    `DiCoOptions`). Undecided positions are fed as noise (the model has no mask token), and the decoder is
    self-conditioned on the last step's logits at a temperature falling from ``t_max`` to ``t_min`` with the
    canvas's undecided fraction."""

    canvases: int
    canvas: int
    sampler: str
    rule_opts: object
    t_min: float = DEFAULTS["t_min"]
    t_max: float = DEFAULTS["t_max"]
    noise_id: int = 0

    def __post_init__(self):
        problems = _schedule_problems(self.t_min, self.t_max)
        if problems:
            raise InputError("diffusion: " + "; ".join(problems))


def generate_masked(params, prompt_BP, prompt_len_B, key, warp, *, cfg: ModelConfig, opts: MaskedCanvasOptions,
                    max_new: int, max_len: int, eos_ids: tuple[int, ...], samp: sampling.Sampling, mesh=None,
                    cache_dtype=jnp.float32):
    """Fast-dLLM / EB / LLaDA schedule / DiCo (and ReMDM remasking) committing tokens for good inside each canvas;
    a canvas is done when every position before its first EOS is decided. Returns (Outputs, stats)."""
    from pdecode.decode import canvas as cvs
    from pdecode.decode import dico
    from pdecode.decode import diffusion as dif

    b = prompt_BP.shape[0]
    L, V = opts.canvas, cfg.vocab_size
    ro = opts.rule_opts
    greedy_B = _greedy(warp, samp, b)
    dico_on = opts.sampler == "dico"
    sub = ro.block_length if dico_on and 0 < ro.block_length < L else L
    cv = cvs.Canvas(prompt_len_B=jnp.zeros((b,), jnp.int32), canvas_BS=jnp.ones((b, L), bool),
                    positions_BS=jnp.zeros((b, L), jnp.int32), attn_BSS=jnp.ones((1, 1, 1), bool), gen=L, block=sub,
                    mask_id=opts.noise_id, shift=False)
    remask = ro.remask != "none"
    limit = (2 if remask else 1) * L + 1
    z_BL, zb = jnp.zeros((b, L), jnp.float32), jnp.zeros((b,), jnp.int32)

    def inner(params, cache, done_B, key):
        x0 = jnp.full((b, L), opts.noise_id, jnp.int32)
        masked0 = jnp.ones((b, L), bool)
        if dico_on:
            st = dico.DiCoState(x=x0, masked=masked0, commit_step=jnp.full((b, L), -1, jnp.int32),
                                cluster=jnp.zeros((b, L), bool), phase=jnp.full((b,), dico.DIVIDE, jnp.int32), cbar=z_BL,
                                c_prev=z_BL, seen=jnp.zeros((b, L), bool), block=zb, done=done_B, row_nfe=zb,
                                passes=jnp.int32(0), steps=jnp.int32(0), key=key,
                                phase_steps=jnp.zeros((3,), jnp.int32))
        else:
            st = dif.DiffState(x=x0, masked=masked0, commit_step=jnp.full((b, L), -1, jnp.int32), block=zb,
                               step_in_block=zb, block_masks=jnp.full((b,), L, jnp.int32), done=done_B, row_nfe=zb,
                               passes=jnp.int32(0), steps=jnp.int32(0), key=key, caches=None)
        if remask:
            st = st.replace(remasked=jnp.zeros((b, L), bool), commit_conf=z_BL, remasks=jnp.int32(0))
        carry = (st, constrain_vocab(jnp.zeros((b, L, V), jnp.float32), mesh), jnp.zeros((b,), bool))

        def cond(c):
            return ~jnp.all(c[0].done) & (c[0].steps < limit)

        def body(c):
            st, sc, sc_on = c
            key, k_noise, k_tok, k_re = jax.random.split(st.key, 4)
            inp = jnp.where(st.masked, _noise(greedy_B, opts.noise_id, k_noise, (b, L), V), st.x)
            lg = constrain_vocab(bd.denoise(params, cfg, inp, cache, sc, sc_on), mesh)
            if dico_on:
                sg = dico.signals(ro, cv, st, lg, k_tok, warp, samp, eos_ids)
                nxt = dico.transition(ro, cv, st, sg, eos_ids, k_re if remask else None)
            else:
                commit, x0 = dif.choose(ro, cv, st, lg, k_tok, warp, samp, eos_ids)
                x = jnp.where(commit, x0, st.x)
                masked = st.masked & ~commit
                remasked, commit_conf, remasks = st.remasked, st.commit_conf, st.remasks
                if remask:
                    commit_conf = jnp.where(commit, cvs.prob_stats(lg, x0)[0], commit_conf)
                    x, masked, remasked, hit = cvs.remask(x, masked, commit, cv.canvas_BS, commit_conf, remasked,
                                                          st.done, cv.mask_id, ro.remask, ro.remask_eta, k_re)
                    remasks = remasks + jnp.sum(hit)
                done = st.done | cvs.answer_done(x, masked, cv.canvas_BS, eos_ids)[0]
                nxt = st.replace(x=x, masked=masked, commit_step=jnp.where(commit, st.steps, st.commit_step),
                                 step_in_block=st.step_in_block + 1, done=done,
                                 row_nfe=st.row_nfe + (~st.done).astype(jnp.int32), passes=st.passes + 1,
                                 steps=st.steps + 1, remasked=remasked, commit_conf=commit_conf, remasks=remasks)
            live = ~st.done
            frac = jnp.mean(nxt.masked.astype(jnp.float32), axis=1)
            t = opts.t_min + (opts.t_max - opts.t_min) * frac
            return nxt.replace(key=key), constrain_vocab(lg / t[:, None, None], mesh), sc_on | live

        st, _, _ = jax.lax.while_loop(cond, body, carry)
        return jnp.where(st.masked, -1, st.x), st.row_nfe, st.steps, st.key

    return _outer(params, cfg, prompt_BP, prompt_len_B, key, canvases=opts.canvases, canvas=L, max_new=max_new,
                  max_len=max_len, eos_ids=eos_ids, cache_dtype=cache_dtype, inner=inner)
