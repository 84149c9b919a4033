"""Non-autoregressive generation at a predicted length: one-shot (one forward fills the answer) and Mask-Predict
(CMLM: fill all, then re-mask the least confident and predict again, ``iterations`` forwards), on the masked-diffusion
canvas of `pdecode.decode.canvas`.

**Length.** A masked model trained to end its answers with EOS padding (code-dllm) says where an answer ends: one
*length pass* over the prompt and a canvas of masks gives each position's probability of EOS, and with it a
distribution over answer lengths, ``P(L = j) = p_eos(j) * prod_{i < j} (1 - p_eos(i))`` (``L = G``: no EOS on the
canvas). The top ``beams`` lengths are decoded
in parallel, each as its own canvas (``L`` masks, then EOS up to the canvas end, as the model was trained); the beam
with the highest mean log-probability of its tokens is the answer (Mask-Predict's length beams).

**Filling.** Iteration 1 predicts every masked position (argmax, or a draw at temperature > 0); iteration t of T
re-masks the ``n = L (T - t) / T`` tokens of lowest probability and predicts them again (the others keep their tokens
and probabilities). The output never holds a mask token (the mask is never a prediction), and a row's forwards are at
most ``T x beams + 1``.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from pdecode import sampling
from pdecode.config import ModelConfig
from pdecode.decode import canvas as cvs
from pdecode.decode import common
from pdecode.errors import ConfigError
from pdecode.model.transformer import decode_layout


@dataclasses.dataclass(frozen=True)
class MaskPredictOptions:
    iterations: int = 10  # T (1: one-shot)
    beams: int = 3  # length beams decoded in parallel
    length: str = "eos"  # eos: from the length pass's EOS probabilities; full: the whole canvas, no length pass

    def __post_init__(self):
        if self.iterations < 1 or self.beams < 1:
            raise ConfigError(f"iterations and beams must be >= 1, got {self.iterations} and {self.beams}")
        if self.length not in ("eos", "full"):
            raise ConfigError(f"length must be one of eos, full, got {self.length!r}")
        if self.length == "full" and self.beams != 1:
            raise ConfigError("length='full' decodes the whole canvas: beams must be 1")


def length_distribution(p_eos_BG: jax.Array) -> jax.Array:
    """[B, G + 1] P(answer length = j), j = 0..G, from each canvas position's EOS probability."""
    p = jnp.clip(p_eos_BG.astype(jnp.float32), 1e-6, 1 - 1e-6)
    survive = jnp.exp(jnp.cumsum(jnp.log1p(-p), axis=1))  # prod_{i <= j} (1 - p_i)
    before = jnp.concatenate([jnp.ones_like(p[:, :1]), survive[:, :-1]], axis=1)
    return jnp.concatenate([p * before, survive[:, -1:]], axis=1)


def beam_canvas(x_BS, cv: cvs.Canvas, lengths_BL, eos_id: int):
    """The B x beams canvases: each row's prompt, then ``L`` masks, then EOS to the canvas end; ([B*L, S] tokens,
    [B*L, S] masked, the repeated canvas)."""
    b, s = x_BS.shape
    nb = lengths_BL.shape[1]
    rep = lambda a: jnp.repeat(a, nb, axis=0)  # noqa: E731
    x, canvas, plen = rep(x_BS), rep(cv.canvas_BS), rep(cv.prompt_len_B)
    rel = jnp.arange(s)[None, :] - plen[:, None]
    length = lengths_BL.reshape(-1)
    content = canvas & (rel < length[:, None])
    x = jnp.where(content, cv.mask_id, jnp.where(canvas, eos_id, x))
    cvb = dataclasses.replace(cv, prompt_len_B=plen, canvas_BS=canvas, positions_BS=rep(cv.positions_BS),
                              attn_BSS=rep(cv.attn_BSS))
    return x, content, cvb


def fill(params, cfg, cv: cvs.Canvas, x_BS, masked_BS, iterations: int, key, warp, samp):
    """Mask-Predict over the canvases (module docstring). Returns (tokens, log-probability of each position's token,
    forwards)."""
    n_mask = jnp.sum(masked_BS, axis=1)
    todo = masked_BS
    logp = jnp.zeros(x_BS.shape, jnp.float32)
    for t in range(iterations):
        key, sub = jax.random.split(key)
        lg = cvs.no_mask(cvs.full_logits(params, cfg, x_BS, cv), cv.mask_id)
        pred = cvs.predict(lg, samp, warp, sub)
        lp = jnp.take_along_axis(jax.nn.log_softmax(lg.astype(jnp.float32), axis=-1), pred[..., None], -1)[..., 0]
        x_BS = jnp.where(todo, pred, x_BS)
        logp = jnp.where(todo, lp, logp)
        if t == iterations - 1:
            break
        n = (n_mask * (iterations - 1 - t)) // iterations  # re-mask the n least probable tokens
        score = jnp.where(masked_BS, logp, jnp.inf)
        rank = jnp.argsort(jnp.argsort(score, axis=1), axis=1)
        todo = masked_BS & (rank < n[:, None])
        x_BS = jnp.where(todo, cv.mask_id, x_BS)
    return x_BS, logp, iterations


def generate(params, prompt_BP, prompt_len_B, key, warp, *, cfg: ModelConfig, opts: MaskPredictOptions,
             mask_id: int, eos_id: int, max_new: int, max_len: int, eos_ids: tuple[int, ...], samp, mesh=None):
    """Returns (Outputs, stats): the best length beam per row (module docstring)."""
    params = decode_layout(params, cfg, fuse=mesh is None)
    b = prompt_BP.shape[0]
    g = max_new
    cv, x = cvs.make_canvas(prompt_BP, prompt_len_B, gen=g, block=g, max_len=max_len, mask_id=mask_id,
                            shift=cfg.diffusion_shift)
    nb = opts.beams
    forwards = 0
    if opts.length == "full":
        lengths = jnp.full((b, 1), g, jnp.int32)
        dist = jnp.zeros((b, g + 1)).at[:, g].set(1.0)
    else:  # the length pass: EOS probability at each canvas position
        lg = cvs.full_logits(params, cfg, x, cv)
        p = jax.nn.softmax(lg.astype(jnp.float32), axis=-1)[..., eos_id]
        idx = jnp.minimum(cv.prompt_len_B[:, None] + jnp.arange(g)[None, :], x.shape[1] - 1)
        dist = length_distribution(jnp.take_along_axis(p, idx, axis=1))
        forwards += 1
        dist = dist.at[:, 0].set(0.0)  # an answer has at least one token
        lengths = jax.lax.top_k(dist, nb)[1].astype(jnp.int32)  # [B, beams]
    xb, masked, cvb = beam_canvas(x, cv, lengths, eos_id)
    xb, logp, iters = fill(params, cfg, cvb, xb, masked, opts.iterations, key, warp, samp)
    forwards += iters * nb
    # the beam with the highest mean log-probability over its tokens
    score = jnp.sum(jnp.where(masked, logp, 0.0), axis=1) / jnp.maximum(jnp.sum(masked, axis=1), 1)
    best = jnp.argmax(score.reshape(b, nb), axis=1)
    pick = jnp.arange(b) * nb + best
    xs = xb[pick]
    length = lengths[jnp.arange(b), best]
    s = xs.shape[1]
    idx = jnp.minimum(prompt_len_B[:, None] + jnp.arange(g)[None, :], s - 1)
    toks = jnp.take_along_axis(xs, idx, axis=1)
    count = jnp.minimum(length + 1, g)  # the answer and its EOS (none when it fills the canvas)
    if eos_ids:  # an EOS the model wrote inside the answer ends it there
        hit = common.is_eos(toks, eos_ids) & (jnp.arange(g)[None, :] < count[:, None])
        count = jnp.where(jnp.any(hit, axis=1), jnp.argmax(hit, axis=1) + 1, count)
    out = common.Outputs(tokens=toks, count=count.astype(jnp.int32), done=jnp.ones((b,), bool),
                         row_forwards=jnp.full((b,), forwards, jnp.int32))
    return out, {"target_forwards": jnp.int32(forwards), "length": length, "length_probability":
                 dist[jnp.arange(b), length], "beam_lengths": lengths, "beam_scores": score.reshape(b, nb)}
