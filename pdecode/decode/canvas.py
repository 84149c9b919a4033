"""The canvas every masked-diffusion sampler decodes on, and the pieces they share (`diffusion`, `dico`).

Layout: row b holds its prompt at ``[0, P_b)``, its generation canvas at ``[P_b, P_b + G)`` (initially all mask
tokens) and padding after; attention is bidirectional over the row's valid positions and RoPE positions are the
natural ones, so rows of different prompt lengths need no left-padding tricks. The canvas splits into
semi-autoregressive blocks of ``block`` positions; **each row has its own current block** (``block_B``): a row that
finishes its block moves on without waiting for the others.

Logits: a model trained with the AR shift (Dream, and code-dllm, adapted from an AR model) predicts position i from
the hidden state at i - 1; `shift_logits` puts the prediction for position i at index i either way, so samplers
never see the difference.

Tokens: `predict` draws x0 from the warped distribution of `pdecode.sampling` (temperature, top-k, top-p; argmax
at temperature 0); confidences (`prob_stats`, `confidence`) are those of the model's own distribution, as LLaDA and
Fast-dLLM define them, so ``top_k=1`` at any temperature decodes exactly as greedy.

EOS: a row stops as soon as an EOS is committed with every canvas position before it committed (`answer_done`);
the answer is the canvas up to that EOS, and masks after a committed EOS are never decoded (`before_answer_end`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from pdecode import sampling
from pdecode.config import ModelConfig
from pdecode.decode import common
from pdecode.model.transformer import forward, unembed

NEG = -1e30


@struct.dataclass
class Canvas:
    """Static layout of one masked generation (see the module docstring)."""

    prompt_len_B: jax.Array
    canvas_BS: jax.Array  # bool: generation positions
    positions_BS: jax.Array  # int32 RoPE positions (the natural ones)
    attn_BSS: jax.Array  # bool: bidirectional mask over each row's valid positions
    gen: int = struct.field(pytree_node=False)
    block: int = struct.field(pytree_node=False)
    mask_id: int = struct.field(pytree_node=False)
    shift: bool = struct.field(pytree_node=False)

    @property
    def total_B(self) -> jax.Array:
        return self.prompt_len_B + self.gen

    @property
    def num_blocks(self) -> int:
        return self.gen // self.block

    @property
    def size(self) -> int:
        return self.canvas_BS.shape[1]

    def block_bounds(self, block_B: jax.Array) -> tuple[jax.Array, jax.Array]:
        """[lo, hi) of each row's block ``block_B``."""
        lo = self.prompt_len_B + block_B * self.block
        return lo, lo + self.block

    def in_block(self, block_B: jax.Array) -> jax.Array:
        """[B, S]: the positions of each row's block ``block_B`` (none once a row is past its last block)."""
        lo, hi = self.block_bounds(block_B)
        pos = jnp.arange(self.size)[None, :]
        return (pos >= lo[:, None]) & (pos < hi[:, None])

    def prompt_BS(self) -> jax.Array:
        return jnp.arange(self.size)[None, :] < self.prompt_len_B[:, None]


def make_canvas(prompt_BP, prompt_len_B, *, gen: int, block: int, max_len: int, mask_id: int,
                shift: bool) -> tuple[Canvas, jax.Array]:
    """(canvas, x [B, S]): prompts in place, the canvas all masks, padding zeros."""
    b, p = prompt_BP.shape
    pos_S = jnp.arange(max_len)
    canvas = (pos_S[None, :] >= prompt_len_B[:, None]) & (pos_S[None, :] < (prompt_len_B + gen)[:, None])
    x = jnp.zeros((b, max_len), jnp.int32).at[:, :p].set(prompt_BP)
    x = jnp.where(canvas, mask_id, jnp.where(pos_S[None, :] < prompt_len_B[:, None], x, 0))
    cv = Canvas(prompt_len_B=prompt_len_B, canvas_BS=canvas,
                positions_BS=jnp.broadcast_to(pos_S, (b, max_len)).astype(jnp.int32),
                attn_BSS=full_mask(prompt_len_B + gen, max_len), gen=gen, block=block, mask_id=mask_id, shift=shift)
    return cv, x


def full_mask(total_len_B: jax.Array, s: int) -> jax.Array:
    """[B, S, S] bidirectional mask over each row's valid positions (padding queries see position 0)."""
    valid = jnp.arange(s)[None, :] < total_len_B[:, None]
    m = valid[:, None, :] & valid[:, :, None]
    return m | (~valid[:, :, None] & (jnp.arange(s)[None, None, :] == 0))


def shift_logits(logits_BSV: jax.Array, shift: bool) -> jax.Array:
    """Put the prediction for position i at index i: with the AR shift it comes from the hidden state at i - 1."""
    return jnp.concatenate([logits_BSV[:, :1], logits_BSV[:, :-1]], axis=1) if shift else logits_BSV


def full_logits(params, cfg: ModelConfig, x_BS: jax.Array, cv: Canvas) -> jax.Array:
    """One bidirectional pass over the whole canvas: [B, S, V] logits, the prediction of position i at i."""
    h = forward(params, cfg, x_BS, cv.positions_BS, cv.attn_BSS).hidden
    return shift_logits(unembed(params, cfg, h), cv.shift)


def unconditional(x_BS: jax.Array, cv: Canvas) -> jax.Array:
    """The input of classifier-free guidance's unconditional pass: the prompt masked."""
    return jnp.where(cv.prompt_BS(), cv.mask_id, x_BS)


def no_mask(logits: jax.Array, mask_id: int) -> jax.Array:
    """The mask token is never a prediction: its logit is removed before any sampler looks at the logits."""
    return logits.at[..., mask_id].set(NEG)


def predict(logits: jax.Array, samp: sampling.Sampling, warp, key) -> jax.Array:
    """x0 per position: the argmax when greedy, else a draw from the warped distribution (temperature, top-k,
    top-p, as every other method samples)."""
    return sampling.sample(key, logits, samp, warp)


def prob_stats(logits: jax.Array, x0: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(p(x0), top-1 probability, top-2 probability) per position, from the logits through their logsumexp: the
    [..., V] probabilities are never materialised (a few passes over the logits fewer per step). The second value
    is a masked max, not `lax.top_k`: inside a `while_loop` that lowers to a sort on XLA:CPU, far slower than the
    model forward it follows (docs/performance_code_notes.md)."""
    lg = logits.astype(jnp.float32)
    lse = jax.nn.logsumexp(lg, axis=-1)
    mx = jnp.max(lg, axis=-1)
    arg = sampling.argmax(lg)  # not jnp.argmax: XLA:CPU's variadic-reduce argmax over the vocabulary is slower
    m2 = jnp.max(jnp.where(jnp.arange(lg.shape[-1]) == arg[..., None], -jnp.inf, lg), axis=-1)
    at = jnp.take_along_axis(lg, x0[..., None], axis=-1)[..., 0]
    return jnp.exp(at - lse), jnp.exp(mx - lse), jnp.exp(m2 - lse)


def entropy(logits: jax.Array) -> jax.Array:
    p = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
    return -jnp.sum(p * jnp.log(jnp.maximum(p, 1e-30)), axis=-1)


def confidence(logits: jax.Array, x0: jax.Array, alg: str, key) -> jax.Array:
    """Per-position confidence of the prediction x0 under the model's distribution (higher = surer)."""
    if alg == "random":
        return jax.random.uniform(key, x0.shape)
    if alg == "entropy":
        return -entropy(logits)
    c, first, second = prob_stats(logits, x0)
    return c if alg == "confidence" else first - second  # top-1 probability / margin


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


def finish(x_BS, masked_BS, commit_step_BS, row_nfe_B, passes, steps, cv: Canvas, eos_ids):
    """Outputs (canvas up to the answer's EOS) and stats of a finished masked generation. ``row_nfe_B``: the model
    forwards each row waited for; ``passes``: the model passes the batch ran (their cost)."""
    b, s = x_BS.shape
    g = cv.gen
    _, end = answer_done(x_BS, masked_BS, cv.canvas_BS, eos_ids)
    n_out = jnp.where(end < s, end - cv.prompt_len_B + 1, g).astype(jnp.int32)
    idx = jnp.minimum(cv.prompt_len_B[:, None] + jnp.arange(g)[None, :], s - 1)
    toks = jnp.take_along_axis(x_BS, idx, axis=1)
    out = common.Outputs(tokens=toks, count=n_out, done=jnp.ones((b,), bool), row_forwards=row_nfe_B)
    return out, {"target_forwards": passes, "steps": steps, "commit_step": jnp.take_along_axis(commit_step_BS, idx, 1)}


REMASK = ("none", "cap", "rescale", "conf")


def remask(x_BS, masked_BS, commit_BS, region_BS, conf_BS, remasked_BS, done_B, mask_id: int, mode: str, eta: float,
           key):
    """ReMDM remasking: tokens of each row's ``region`` (its current block) committed before this step and never
    re-masked are masked again with probability sigma, so a later step can correct them. With alpha the region's
    decoded fraction before this step's commits and after them (alpha_t, alpha_s), sigma_max = min(1, (1 - alpha_s) /
    alpha_t), which falls to 0 as the region fills (remasking fades out; every position is re-masked at most once,
    so the loop ends). ``mode``: ``cap`` sigma = min(eta, sigma_max); ``rescale`` sigma = eta * sigma_max; ``conf``
    the rescaled budget spread over the decoded tokens by softmax(-confidence at commit) (the least sure first).
    Returns (x, masked, remasked, the positions re-masked now)."""
    decoded = region_BS & ~masked_BS & ~commit_BS & ~remasked_BS & ~done_B[:, None]
    n_dec = jnp.sum(region_BS & ~masked_BS & ~commit_BS, axis=1).astype(jnp.float32)
    n_left = jnp.sum(region_BS & masked_BS & ~commit_BS, axis=1).astype(jnp.float32)
    sig_max = jnp.minimum(1.0, n_left / jnp.maximum(n_dec, 1.0))[:, None]
    if mode == "cap":
        sigma = jnp.minimum(eta, sig_max)
    elif mode == "rescale":
        sigma = eta * sig_max
    else:  # conf
        w = jax.nn.softmax(jnp.where(decoded, -conf_BS, -jnp.inf), axis=1)
        sigma = jnp.minimum(1.0, eta * sig_max * jnp.sum(decoded, axis=1, keepdims=True) * w)
    hit = decoded & (jax.random.uniform(key, x_BS.shape) < sigma)
    return jnp.where(hit, mask_id, x_BS), masked_BS | hit, remasked_BS | hit, hit
