"""Training objectives, one module for all of them.

Every objective has the signature ``loss(trainable, frozen, batch, rng) -> (scalar loss, metrics dict)`` so the one
loop in `train.loop` trains any of them: the plain LM here; Medusa/EAGLE/MTP heads and masked diffusion join with
the same shape (heads take the frozen base in ``frozen``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

from pdecode.config import ModelConfig
from pdecode.model.attention import padded_self_mask
from pdecode.model.transformer import forward, unembed


def cross_entropy(logits: jax.Array, targets: jax.Array, weights: jax.Array | None = None) -> jax.Array:
    """Mean token cross-entropy (float32), optionally weighted."""
    ce = optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), targets)
    if weights is None:
        return ce.mean()
    return (ce * weights).sum() / jnp.maximum(weights.sum(), 1.0)


def causal_hidden(params, cfg: ModelConfig, tokens_BT: jax.Array, hidden_layers: tuple[int, ...] = ()):
    """Full causal pass over unpadded windows: (final hidden [B,T,D], requested layer outputs)."""
    b, t = tokens_BT.shape
    pos = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    mask = padded_self_mask(jnp.full((b,), t, jnp.int32), t, causal=True, window=cfg.sliding_window)
    out = forward(params, cfg, tokens_BT, pos, mask, hidden_layers=hidden_layers)
    return out.hidden, out.layer_hidden


def lm_loss(cfg: ModelConfig):
    """Next-token prediction. ``batch``: int [B, T+1] windows."""

    def loss(params, frozen, batch, rng):
        del frozen, rng
        h, _ = causal_hidden(params, cfg, batch[:, :-1])
        ce = cross_entropy(unembed(params, cfg, h), batch[:, 1:])
        return ce, {"ce": ce}

    return loss


def soft_cross_entropy(logits: jax.Array, target_probs: jax.Array, weights: jax.Array | None = None) -> jax.Array:
    """Mean over tokens of -sum_v p_target(v) log p(v) (float32), optionally weighted."""
    ce = -jnp.sum(target_probs * jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1), axis=-1)
    if weights is None:
        return ce.mean()
    return (ce * weights).sum() / jnp.maximum(weights.sum(), 1.0)


def distill_loss(student_cfg: ModelConfig, teacher_cfg: ModelConfig, hard_weight: float = 0.0):
    """Knowledge distillation of a small LM from a frozen teacher (``frozen`` = teacher params): soft CE against
    the teacher's next-token distribution, computed on the fly, plus ``hard_weight`` x the data CE. Used for
    ``code-draft``: a draft that imitates its target is accepted more often."""

    def loss(params, teacher, batch, rng):
        del rng
        x, y = batch[:, :-1], batch[:, 1:]
        th, _ = causal_hidden(teacher, teacher_cfg, x)
        t_probs = jax.lax.stop_gradient(jax.nn.softmax(unembed(teacher, teacher_cfg, th), axis=-1))
        h, _ = causal_hidden(params, student_cfg, x)
        logits = unembed(params, student_cfg, h)
        kd = soft_cross_entropy(logits, t_probs)
        ce = cross_entropy(logits, y)
        return kd + hard_weight * ce, {"kd": kd, "ce": ce}

    return loss
