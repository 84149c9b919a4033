"""Block diffusion with an encoder-decoder model (DiffusionGemma): the model's own sampler, one jit call.

Canvas after canvas until every row has an EOS or ``canvases`` are written (the outer `lax.while_loop`); inside
a canvas, denoising steps until every row's canvas is stable and confident or ``steps`` ran (the inner one):

1. the decoder (`pdecode.model.block_diffusion.denoise`) predicts every canvas position from the current canvas,
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
and ``target_forwards`` the batch's decoder steps and all passes (decoder steps + encoder passes).
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
from pdecode.model import block_diffusion as bd
from pdecode.model import cache as kvc
from pdecode.model.transformer import decode_layout

DEFAULTS = dict(steps=48, t_min=0.4, t_max=0.8, entropy_bound=0.1, stability=1, confidence=0.005)
# generation_config.json's names for them (transformers' DiffusionGemma generation config)
GEN_CONFIG_NAMES = dict(steps="max_denoising_steps", t_min="t_min", t_max="t_max", stability="stability_threshold",
                        confidence="confidence_threshold")


@dataclasses.dataclass(frozen=True)
class BlockDiffusionOptions:
    canvases: int  # canvases at most (ceil(max_new_tokens / canvas))
    canvas: int  # the model's canvas_length
    steps: int = 48  # denoising steps per canvas at most
    t_min: float = 0.4
    t_max: float = 0.8
    entropy_bound: float = 0.1
    stability: int = 1  # the argmax canvas must equal this many previous ones (0: always stable)
    confidence: float = 0.005  # ... and the canvas's mean entropy be below this
    noise_id: int = 0  # the noise token at temperature 0

    def __post_init__(self):
        problems = []
        if self.steps < 1:
            problems.append(f"steps must be >= 1 (got {self.steps})")
        if not self.t_max > self.t_min >= 0:
            problems.append(f"t_max ({self.t_max}) must be > t_min ({self.t_min}) >= 0")
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
class _Gen:
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


def generate(params, prompt_BP, prompt_len_B, key, warp, *, cfg: ModelConfig, opts: BlockDiffusionOptions,
             max_new: int, max_len: int, eos_ids: tuple[int, ...], samp: sampling.Sampling, mesh=None,
             cache_dtype=jnp.float32):
    """Returns (Outputs, stats); see the module docstring."""
    params = decode_layout(params, cfg, fuse=False)
    b = prompt_BP.shape[0]
    L, V, N = opts.canvas, cfg.vocab_size, opts.steps
    cache = kvc.init_cache(cfg, b, max_len, cache_dtype, per_layer=True)
    cache = kvc.set_lengths(bd.encode(params, cfg, prompt_BP, cache, prompt_len_B), prompt_len_B)
    greedy_B = jnp.broadcast_to(sampling._greedy_rows(warp, jnp.zeros((b, 1))) | samp.greedy, (b,))
    eos = jnp.asarray(eos_ids or (-1,), jnp.int32)

    def noise(k):
        return jnp.where(greedy_B[:, None], opts.noise_id, jax.random.randint(k, (b, L), 0, V, jnp.int32))

    def denoise_canvas(g: _Gen) -> _Canvas:
        key, k0 = jax.random.split(g.key)
        c0 = _Canvas(cur=noise(k0), sc=jnp.zeros((b, L, V), jnp.float32), sc_on=jnp.zeros((b,), bool),
                     amax=jnp.zeros((b, L), jnp.int32), hist=jnp.full((max(opts.stability, 1), b, L), -1, jnp.int32),
                     fin=g.done, n=jnp.zeros((b,), jnp.int32), step=jnp.int32(0), key=key)

        def cond(c: _Canvas):
            return ~jnp.all(c.fin) & (c.step < N)

        def body(c: _Canvas):
            key, k_draw, k_noise = jax.random.split(c.key, 3)
            lg = bd.denoise(params, cfg, c.cur, g.cache, c.sc, c.sc_on)
            t = opts.t_min + (opts.t_max - opts.t_min) * (N - c.step).astype(jnp.float32) / N
            proc = lg / t
            draw = sampling.sample(k_draw, proc, samp, warp)
            amax = sampling.argmax(proc)
            h = _entropy(proc)
            nxt = jnp.where(entropy_bound_accept(h, opts.entropy_bound), draw, noise(k_noise))
            stable = jnp.all(jnp.all(amax[None] == c.hist, axis=-1), axis=0) if opts.stability else \
                jnp.ones((b,), bool)
            stop = stable & (jnp.mean(h, axis=-1) < opts.confidence)
            live = ~c.fin
            keep = lambda new, old: jnp.where(live.reshape((b,) + (1,) * (new.ndim - 1)), new, old)  # noqa: E731
            hist = jnp.concatenate([c.hist[1:], amax[None]], axis=0) if opts.stability else c.hist
            return _Canvas(cur=keep(nxt, c.cur), sc=keep(proc, c.sc), sc_on=c.sc_on | live, amax=keep(amax, c.amax),
                           hist=hist, fin=c.fin | stop, n=c.n + live.astype(jnp.int32), step=c.step + 1, key=key)

        return jax.lax.while_loop(cond, body, c0)

    def cond(g: _Gen):
        return ~jnp.all(g.done) & (g.k < opts.canvases)

    def body(g: _Gen):
        c = denoise_canvas(g)
        live = ~g.done
        commit = c.amax
        cache = bd.encode(params, cfg, commit, g.cache)
        cache = kvc.advance(cache, jnp.where(live, L, 0))
        hit = jnp.any(commit[..., None] == eos, axis=-1)  # [B, L]
        first = jnp.where(jnp.any(hit, axis=1), jnp.argmax(hit, axis=1) + 1, L)
        n_new = jnp.where(live, first, 0)
        rows = jnp.arange(b)[:, None]
        cols = g.count[:, None] + jnp.arange(L)[None]
        cols = jnp.where(jnp.arange(L)[None] < n_new[:, None], cols, opts.canvases * L)
        out = g.out.at[rows, cols].set(commit, mode="drop")
        return _Gen(out=out, count=g.count + n_new, done=g.done | (live & jnp.any(hit, axis=1)), cache=cache,
                    canvas_steps=g.canvas_steps.at[:, g.k].set(c.n), row_forwards=g.row_forwards + c.n,
                    k=g.k + 1, steps=g.steps + c.step, key=c.key)

    g = _Gen(out=jnp.zeros((b, opts.canvases * L), jnp.int32), count=jnp.zeros((b,), jnp.int32),
             done=jnp.zeros((b,), bool), cache=cache, canvas_steps=jnp.zeros((b, opts.canvases), jnp.int32),
             row_forwards=jnp.zeros((b,), jnp.int32), k=jnp.int32(0), steps=jnp.int32(0), key=key)
    g = jax.lax.while_loop(cond, body, g)
    count = jnp.minimum(g.count, max_new)
    out = common.Outputs(tokens=g.out[:, :max_new], count=count, done=jnp.ones((b,), bool),
                         row_forwards=g.row_forwards)
    stats = {"target_forwards": g.steps + g.k + 1, "steps": g.steps, "canvases": g.k, "canvas_steps": g.canvas_steps}
    return out, stats
