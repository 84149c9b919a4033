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
from pdecode.model.attention import CausalSelfMask, padded_self_mask
from pdecode.model.transformer import forward, layout_of, unembed, unrolled, unstack_layers


def cross_entropy(logits: jax.Array, targets: jax.Array, weights: jax.Array | None = None) -> jax.Array:
    """Mean token cross-entropy (float32), optionally weighted."""
    ce = optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), targets)
    if weights is None:
        return ce.mean()
    return (ce * weights).sum() / jnp.maximum(weights.sum(), 1.0)


def training_layout(params, cfg: ModelConfig):
    """Params as the forward runs them fastest, inside a differentiated function: layers unstacked with q/k/v and
    gate/up fused into single matmuls (the decode layout's weights; gradients flow back to the stacked params).
    Kept because a training step ran faster this way than with the stacked layers under `lax.scan` on CPU
    (docs/performance_code_notes.md)."""
    return dict(params, layers=unstack_layers(params["layers"], cfg, fuse=True))


def causal_hidden(params, cfg: ModelConfig, tokens_BT: jax.Array, hidden_layers: tuple[int, ...] = ()):
    """Full causal pass over unpadded windows: (final hidden [B,T,D], requested layer outputs)."""
    b, t = tokens_BT.shape
    pos = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    mask = CausalSelfMask(padded_self_mask(jnp.full((b,), t, jnp.int32), t, causal=True))
    out = forward(training_layout(params, cfg), cfg, tokens_BT, pos, mask, hidden_layers=hidden_layers)
    return out.hidden, out.layer_hidden


def lm_loss(cfg: ModelConfig):
    """Next-token prediction. ``batch``: int [B, T+1] windows."""

    def loss(params, frozen, batch, rng):
        del frozen, rng
        h, _ = causal_hidden(params, cfg, batch[:, :-1])
        ce = cross_entropy(unembed(params, cfg, h), batch[:, 1:])
        return ce, {"ce": ce}

    return loss


def layerskip_loss(cfg: ModelConfig, exit_layer: int, dropout_max: float = 0.1, exit_weight: float = 1.0):
    """LayerSkip's recipe (continual training of a full model): layer dropout rising linearly with depth (layer i of
    L skipped per sequence with probability ``dropout_max * i / (L - 1)``, a residual block skipped is the identity),
    and an early-exit loss through the shared final norm and LM head after every layer up to ``exit_layer`` (weights
    rising with depth, normalised), added to the last layer's next-token loss with ``exit_weight``. Trains the early
    exit that `method="layerskip"` drafts with."""
    from pdecode.model.transformer import _block, attention_for, embed, final_norm, layer_list, rope_tables_of

    n = cfg.num_layers
    if not 1 <= exit_layer < n:
        raise ValueError(f"exit_layer must be in 1..{n - 1}, got {exit_layer}")
    weights = jnp.arange(1, exit_layer + 1, dtype=jnp.float32)
    weights = weights / weights.sum()

    def loss(params, frozen, batch, rng):
        del frozen
        tokens, targets = batch[:, :-1], batch[:, 1:]
        b, t = tokens.shape
        p = training_layout(params, cfg)
        pos = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
        mask = padded_self_mask(jnp.full((b,), t, jnp.int32), t, causal=True)
        att = attention_for(cfg, pos, mask, rope_tables_of(p, cfg))
        drop_p = dropout_max * jnp.arange(n, dtype=jnp.float32) / max(n - 1, 1)
        keep = jax.random.uniform(rng, (n, b)) >= drop_p[:, None]
        x = embed(p, tokens, cfg)
        exit_ce = jnp.float32(0.0)
        lay = layout_of(p)  # unstacked and fused, or (a deep model) stacked: then sliced here
        layers = layer_list(p["layers"])
        for i, lp in enumerate(layers):
            y, _ = _block(cfg, lp, x, att, None, i, None, fused=lay.fused)
            x = jnp.where(keep[i][:, None, None], y, x)
            if i < exit_layer:
                h = final_norm(p, cfg, x)
                exit_ce = exit_ce + weights[i] * cross_entropy(unembed(p, cfg, h), targets)
        ce = cross_entropy(unembed(p, cfg, final_norm(p, cfg, x)), targets)
        return ce + exit_weight * exit_ce, {"ce": ce, "exit_ce": exit_ce}

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


# ------------------------------------------------------------------------------------------------ heads
def _target_pass(tparams, cfg: ModelConfig, x_BT, hidden_layers=()):
    """Frozen target: (final hidden [B,T,D], layer outputs, logits [B,T,V]), no gradient."""
    h, lh = causal_hidden(tparams, cfg, x_BT, hidden_layers)
    logits = unembed(tparams, cfg, h)
    return jax.lax.stop_gradient((h, lh, logits))


def medusa_loss(cfg: ModelConfig, mcfg, joint: bool = False, lm_weight: float = 1.0, decay: float = 0.8):
    """Medusa-1 (frozen base): head k at position t predicts token t+k+2, per-head CE weighted decay^k.
    Medusa-2-style ``joint``: ``trainable = {"base": ..., "heads": ...}``, base LM loss x lm_weight + heads."""
    from pdecode.model.heads import medusa_logits

    def loss(trainable, frozen, batch, rng):
        del rng
        x = batch[:, :-1]
        if joint:
            base, heads = trainable["base"], trainable["heads"]
            h, _ = causal_hidden(base, cfg, x)
            lm = cross_entropy(unembed(base, cfg, h), batch[:, 1:])
        else:
            base, heads = frozen, trainable
            h, _, _ = _target_pass(base, cfg, x)
            lm = jnp.float32(0.0)
        logits = medusa_logits(heads, mcfg, base, cfg, h)  # [K, B, T, V]
        t = x.shape[1]
        total, metrics = lm_weight * lm, {"lm": lm}
        for k in range(mcfg.num_heads):
            # position i predicts batch[:, i + k + 2] (batch holds T+1 tokens: targets exist for i < T-1-k)
            n = t - 1 - k
            ce = cross_entropy(logits[k, :, :n], batch[:, k + 2: k + 2 + n])
            total = total + (decay ** k) * ce
            metrics[f"head{k}"] = ce
        return total, metrics

    return loss


def smooth_l1(x, y, beta: float = 1.0):
    """Huber-style SmoothL1 (as torch's default): 0.5 d^2 / beta below beta, |d| - 0.5 beta above."""
    d = jnp.abs(x.astype(jnp.float32) - y.astype(jnp.float32))
    return jnp.where(d < beta, 0.5 * d * d / beta, d - 0.5 * beta)


def eagle_loss(cfg: ModelConfig, ecfg, ttt_steps: int = 1, decay: float = 0.8, reg_weight: float = 1.0,
               ce_weight: float = 0.1):
    """EAGLE drafter training on the fly from the frozen target (``frozen`` = target params).

    EAGLE-1 (``ttt_steps = 1``, no fused layers): from (emb(x_{i+1}), f_i) predict f_{i+1}; SmoothL1 to the
    target's feature + ce_weight x soft CE against the target's distribution there.
    EAGLE-3 training-time test (``ttt_steps = n``): step j feeds the drafter's own outputs of step j-1 (as at
    decode time) and attends to the true-feature pass of step 0 for the prefix and to its own chain for the
    drafted positions; loss sum_j decay^j soft CE against the target's distribution of token i+j+2.
    With a draft vocabulary (``ecfg.draft_vocab``) ``frozen`` is ``(target params, {"d2t", "t2d"})`` (the maps are
    not trained): the target's distribution is taken over the draft vocabulary's ids, renormalised, and positions
    whose target argmax lies outside it are left out of the loss (EAGLE-3's rule).
    """
    from pdecode.model import attention
    from pdecode.model import cache as kvc
    from pdecode.model.heads import draft_ids, eagle_feature, eagle_step

    def loss(ep, frozen, batch, rng):
        del rng
        x = batch[:, :-1]
        b, t = x.shape
        tparams = frozen[0] if ecfg.draft_vocab else frozen
        h, lh, t_logits = _target_pass(tparams, cfg, x, ecfg.fuse_layers)
        keep = None
        if ecfg.draft_vocab:
            ep = {**ep, **frozen[1]}
            keep = jnp.take(frozen[1]["t2d"], jnp.argmax(t_logits, -1)).astype(jnp.float32)  # [B, T]
            t_logits = jnp.take(t_logits, draft_ids(ep), axis=-1)
        t_probs = jax.nn.softmax(t_logits, axis=-1)
        feat = jax.lax.stop_gradient(eagle_feature(ep, ecfg, h, lh)) if not ecfg.is_eagle3 else \
            eagle_feature(ep, ecfg, h, lh)
        n = t - 1  # pairs (x_{i+1}, f_i) for i < T-1
        steps = ttt_steps
        cache = kvc.init_cache(ecfg.block_cfg(cfg), b, steps * n, dtype=h.dtype)
        i = jnp.arange(n)
        total, metrics = jnp.float32(0.0), {}
        f_in = feat[:, :n]
        for j in range(steps):
            m = n - j  # positions whose targets exist at this depth
            # queries at i: step-0 keys p <= i, steps 1..j keys at the same i
            slot_step = jnp.arange(steps * n) // n
            slot_pos = jnp.arange(steps * n) % n
            vis = ((slot_step[None, :] == 0) & (slot_pos[None, :] <= i[:, None])) | \
                  ((slot_step[None, :] >= 1) & (slot_step[None, :] <= j) & (slot_pos[None, :] == i[:, None]))
            mask = jnp.broadcast_to(vis[None], (b, n, steps * n))
            tok_j = jnp.take_along_axis(x, jnp.minimum(i + 1 + j, t - 1)[None, :].repeat(b, 0), axis=1)
            pos = jnp.broadcast_to(i + j, (b, n))
            logits, out, cache = eagle_step(ep, ecfg, cfg, tparams, tok_j, f_in, pos, mask, cache,
                                            jnp.full((b,), j * n, jnp.int32), draft_space=True)
            tgt = t_probs[:, 1 + j: 1 + j + m]  # distribution of token i+j+2
            ce = soft_cross_entropy(logits[:, :m], tgt, None if keep is None else keep[:, 1 + j: 1 + j + m])
            total = total + (decay ** j) * (ce_weight if not ecfg.is_eagle3 and steps == 1 else 1.0) * ce
            metrics[f"ce{j}"] = ce
            if j == 0 and not ecfg.is_eagle3:
                reg = jnp.mean(smooth_l1(out[:, :m], feat[:, 1: 1 + m]))
                total = total + reg_weight * reg
                metrics["smooth_l1"] = reg
            f_in = out  # the next step reads its own predicted features
        return total, metrics

    return loss


def exit_loss(cfg: ModelConfig, xcfg):
    """An early-exit adapter on the frozen target (``frozen`` = its params): LayerSkip's early-exit loss, taken
    against the full model's distribution at the same position (what the layerskip drafter's tokens are verified
    against): KL(target || the adapter's logits after ``xcfg.exit_layer`` blocks), i.e. the soft CE less the target's
    entropy."""
    from pdecode.model.heads import exit_logits

    def loss(xp, frozen, batch, rng):
        del rng
        _, lh, t_logits = _target_pass(frozen, cfg, batch[:, :-1], (xcfg.exit_layer - 1,))
        t_logp = jax.nn.log_softmax(t_logits.astype(jnp.float32), axis=-1)
        t_probs = jnp.exp(t_logp)
        # KL(target || exit): the soft CE less the target's own entropy (0 for an exit that matches it)
        kl = soft_cross_entropy(exit_logits(xp, cfg, frozen, lh[0]), t_probs) + jnp.mean(jnp.sum(t_probs * t_logp,
                                                                                                  -1))
        return kl, {"kl": kl}

    return loss


def mtp_loss(cfg: ModelConfig, mcfg, native: bool = False, lam: float = 0.3):
    """DeepSeek-V3 MTP: module k at position i reads h^{k-1}_i and emb(x_{i+k}) and predicts x_{i+k+1};
    parallel heads (Gloeckle) read the trunk output h^0_i directly. Post-hoc (frozen base, ``trainable`` = the
    modules): mean_k CE_k. Native (``trainable = {"base": ..., "mtp": ...}``): main LM loss + lam / D sum_k CE_k."""
    from pdecode.model.heads import mtp_module

    def loss(trainable, frozen, batch, rng):
        del rng
        x = batch[:, :-1]
        b, t = x.shape
        if native:
            base, mp = trainable["base"], trainable["mtp"]
            h, lh = causal_hidden(base, cfg, x, (cfg.num_layers - 1,))
            main = cross_entropy(unembed(base, cfg, h), batch[:, 1:])
        else:
            base, mp = frozen, trainable
            h, lh, _ = _target_pass(base, cfg, x, (cfg.num_layers - 1,))
            main = jnp.float32(0.0)
        d = mcfg.num_modules
        prev = lh[0]  # h^0: last layer output before the final norm
        total_mtp, metrics = jnp.float32(0.0), {"main": main}
        for k in range(1, d + 1):
            n = t - k  # positions i with x_{i+k} inside the window and a target x_{i+k+1} in batch
            pos = jnp.broadcast_to(jnp.arange(n, dtype=jnp.int32), (b, n))
            mask = padded_self_mask(jnp.full((b,), n, jnp.int32), n, causal=True)
            h_in = prev[:, :n] if mcfg.kind == "sequential" else lh[0][:, :n]
            logits, out, _ = mtp_module(mp["modules"][k - 1], mcfg, cfg, base, h_in, x[:, k: k + n], pos, mask)
            ce = cross_entropy(logits, batch[:, k + 1: k + 1 + n])
            total_mtp = total_mtp + ce
            metrics[f"mtp{k}"] = ce
            prev = out
        if native:
            return main + lam / d * total_mtp, metrics
        return total_mtp / d, metrics

    return loss


# ------------------------------------------------------------------------------------------------ diffusion
def masked_diffusion_loss(cfg: ModelConfig, mask_id: int, shift: bool = False, eps: float = 1e-3,
                          glancing: float = 0.0):
    """Masked diffusion (LLaDA): per sequence t ~ U(eps, 1), every token masked with probability t, CE on the
    masked tokens weighted by 1/t, averaged over the maskable slots. ``batch`` = (tokens [B, T], maskable [B, T],
    lengths [B]), optionally with per-token loss weights [B, T] and an attention openness ``r`` (a scalar) after
    them: the SFT variant passes maskable = response positions only (the prompt stays visible) and may down-weight
    a long EOS fill so it does not drown the answer; positions past a row's length are padding (not attended, not
    scored). ``shift``: Dream-style logits, position i predicted from the hidden state at i-1.

    ``r`` anneals the attention from causal to bidirectional (DiffuLLaMA): a query sees the keys at or before it
    and, beyond them, each later key with probability ``r`` (drawn per row, query and key); ``r = 1`` is the full
    bidirectional mask. A model adapted from an AR one starts at r = 0, where its weights already work.

    ``glancing`` > 0 (GLAT, for one-shot and Mask-Predict decoding): instead of a random t, a first pass (no gradient)
    predicts every maskable position from an all-mask input; ``glancing`` x (the number it got wrong) of the
    maskable positions, drawn at random, are revealed with their gold tokens and the loss is the cross-entropy on the
    rest (unweighted): the fewer a model gets right in one pass, the more it is shown."""

    def loss(params, frozen, batch, rng):
        del frozen
        tokens, maskable, lengths = batch[:3]
        tok_w = batch[3] if len(batch) > 3 else None
        openness = batch[4] if len(batch) > 4 else None
        b, t = tokens.shape
        maskable = maskable & (jnp.arange(t)[None, :] < lengths[:, None])
        k_t, k_m, k_a = jax.random.split(rng, 3)
        pos = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
        mask = padded_self_mask(lengths, t, causal=False)
        if openness is not None:
            seen = (jnp.arange(t)[None, :, None] >= jnp.arange(t)[None, None, :]) | (
                jax.random.uniform(k_a, (b, t, t)) < openness)
            mask = mask & seen
        slots = maskable.astype(jnp.float32)  # the loss is averaged over the maskable slots
        if shift:  # position 0 has no predictor: never masked (in the input nor in the loss)
            maskable = maskable.at[:, 0].set(False)

        def logits_of(x):
            lg = unembed(params, cfg, forward(training_layout(params, cfg), cfg, x, pos, mask).hidden)
            return jnp.concatenate([lg[:, :1], lg[:, :-1]], axis=1) if shift else lg  # logits at i-1 predict i

        if glancing > 0:  # GLAT: reveal glancing x (wrong in one pass) gold tokens, score the rest
            first = jax.lax.stop_gradient(logits_of(jnp.where(maskable, mask_id, tokens)))
            wrong = jnp.sum((jnp.argmax(first, axis=-1) != tokens) & maskable, axis=1, keepdims=True)
            n_show = jnp.floor(glancing * wrong.astype(jnp.float32))
            order = jnp.argsort(jnp.where(maskable, jax.random.uniform(k_m, (b, t)), 2.0), axis=1)
            rank = jnp.argsort(order, axis=1)
            masked = maskable & (rank >= n_show)
            tt = jnp.ones((b, 1))
        else:
            tt = jax.random.uniform(k_t, (b, 1), minval=eps, maxval=1.0)
            masked = (jax.random.uniform(k_m, (b, t)) < tt) & maskable
        logits = logits_of(jnp.where(masked, mask_id, tokens))
        ce = optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), tokens)
        w = masked.astype(jnp.float32) / tt
        if tok_w is not None:
            w, slots = w * tok_w, slots * tok_w
        denom = jnp.maximum(jnp.sum(slots, axis=1, keepdims=True), 1.0)
        val = jnp.mean(jnp.sum(ce * w / denom, axis=1))
        return val, {"masked_ce": jnp.sum(ce * masked) / jnp.maximum(jnp.sum(masked), 1)}

    return loss


def diffusion_nll_bound(cfg: ModelConfig, mask_id: int, shift: bool = False, levels: int = 8):
    """The masked-diffusion bound on the negative log-likelihood, nats per token, of whole windows
    ``tokens [B, T]`` (every token maskable, bidirectional attention) with the expectation over the masking level
    t taken on a fixed grid of ``levels`` midpoints (t = (j + 0.5) / levels) instead of sampled, so the same
    windows always give the same figure: comparable, window for window, with an AR model's cross-entropy. With
    ``shift`` position 0 has no predictor and is left out (both the numerator and the token count)."""

    def nll(params, tokens, rng):
        b, t = tokens.shape
        maskable = jnp.ones((b, t), bool)
        if shift:
            maskable = maskable.at[:, 0].set(False)
        pos = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
        mask = padded_self_mask(jnp.full((b,), t, jnp.int32), t, causal=False)
        p = training_layout(params, cfg)
        total = jnp.float32(0.0)
        for j in range(levels):
            tt = (j + 0.5) / levels
            masked = (jax.random.uniform(jax.random.fold_in(rng, j), (b, t)) < tt) & maskable
            h = forward(p, cfg, jnp.where(masked, mask_id, tokens), pos, mask).hidden
            logits = unembed(params, cfg, h)
            if shift:
                logits = jnp.concatenate([logits[:, :1], logits[:, :-1]], axis=1)
            ce = optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), tokens)
            total = total + jnp.sum(ce * masked) / tt
        return total / (levels * jnp.sum(maskable))

    return nll


# ------------------------------------------------------------------------------------------------ block diffusion
def block_diffusion_loss(cfg: ModelConfig, eps: float = 1e-3, sc_rate: float = 0.5, t_min: float = 0.4,
                         t_max: float = 0.8, pad_rate: float = 0.0):
    """The diffusion objective on a block-diffusion encoder-decoder (DiffusionGemma's layout,
    `pdecode.model.families.diffusion_gemma`): the causal encoder writes each row's prefix (prompt + the gold earlier canvases)
    into a KV cache; per row t ~ U(eps, 1), each canvas position replaced by a uniform random token with probability
    t (the noise the sampler draws: there is no mask token; for ``pad_rate`` of the rows the pad token instead, the
    noise pdecode's sampler feeds at temperature 0); the decoder predicts the clean canvas from the noisy one
    and the cache; the loss is the weighted cross-entropy over every canvas position (a kept position still has to be
    recognised as right). Self-conditioning as the sampler runs it: for ``sc_rate`` of the rows a first decoder pass
    (no gradient) gives logits that, divided by a temperature drawn from [t_min, t_max], feed the second.

    ``batch`` = (prefix [B, P] right-padded, prefix_len [B], canvas [B, L], weights [B, L]). Gradients reach the
    shared layer weights through both passes (the encoder's keys and values, the decoder)."""
    from pdecode.model.families import diffusion_gemma as bd
    from pdecode.model import cache as kvc

    bd.check(cfg)

    def loss(params, frozen, batch, rng):
        del frozen
        prefix, plen, canvas, w = batch
        b, p = prefix.shape
        L = canvas.shape[1]
        lp = dict(params, layers=unstack_layers(params["layers"], cfg, fuse=False))
        cache = kvc.init_cache(cfg, b, p + L, jnp.float32, per_layer=unrolled(lp))
        cache = kvc.set_lengths(bd.encode(lp, cfg, prefix, cache, plen), plen)
        k_t, k_n, k_v, k_s, k_T = jax.random.split(rng, 5)
        t = jax.random.uniform(k_t, (b, 1), minval=eps, maxval=1.0)
        noisy = jax.random.uniform(k_n, (b, L)) < t
        noise = jax.random.randint(k_v, (b, L), 0, cfg.vocab_size)
        if pad_rate > 0:  # the pad token as noise, as pdecode's sampler feeds it at temperature 0
            k_v, k_p = jax.random.split(k_v)
            noise = jnp.where(jax.random.uniform(k_p, (b, 1)) < pad_rate, cfg.pad_token_id or 0, noise)
        x = jnp.where(noisy, noise, canvas)
        first = jax.lax.stop_gradient(bd.denoise(lp, cfg, x, cache))
        temp = jax.random.uniform(k_T, (b, 1, 1), minval=t_min, maxval=t_max)
        on = jax.random.uniform(k_s, (b,)) < sc_rate
        logits = bd.denoise(lp, cfg, x, cache, first / temp, on)
        ce = optax.softmax_cross_entropy_with_integer_labels(logits, canvas)
        val = jnp.sum(ce * w) / jnp.maximum(jnp.sum(w), 1.0)
        return val, {"noisy_ce": jnp.sum(ce * noisy) / jnp.maximum(jnp.sum(noisy), 1),
                     "kept_ce": jnp.sum(ce * ~noisy) / jnp.maximum(jnp.sum(~noisy), 1)}

    return loss
