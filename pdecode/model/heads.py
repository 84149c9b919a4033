"""Self-drafting heads: Medusa heads, EAGLE drafters (EAGLE-1/2 and the EAGLE-3 multi-layer fusion), and
multi-token-prediction modules (DeepSeek-V3 sequential modules; Gloeckle-style independent heads).

Pure functions over params pytrees, like the decoder. Each head family has a frozen config dataclass (static under
jit) with ``specs()`` (shapes and logical axes, drives init / sharding / restore) and the forward pieces the
decoders and the training objectives share.

Conventions. ``h`` is the target's final hidden state *after* its final norm (what its LM head reads, the "feature"
of EAGLE); ``layer_h`` are outputs of chosen target layers before the final norm. Heads that end in logits reuse
the target's LM head unless they own one.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from pdecode.config import ModelConfig
from pdecode.errors import ConfigError
from pdecode.model import cache as kvc
from pdecode.model.transformer import ParamSpec, final_norm, layer_specs, rms_norm, run_layers, unembed


def _lm_head(target_params, cfg: ModelConfig, h, own=None):
    if own is not None:
        return jnp.einsum("...d,dv->...v", h, own, preferred_element_type=jnp.float32)
    return unembed(target_params, cfg, h)


# ------------------------------------------------------------------------------------------------ Medusa
@dataclasses.dataclass(frozen=True)
class MedusaConfig:
    """K heads; head k (0-based) reads the hidden state at t and predicts token t + k + 2 (the base LM head
    predicts t + 1). Each head: ``h + SiLU(W h + b)`` (``num_layers`` such residual blocks), then the LM head
    (the target's, or its own with ``own_head``)."""

    num_heads: int = 4
    num_layers: int = 1
    own_head: bool = False

    def specs(self, cfg: ModelConfig) -> dict:
        k, n, d = self.num_heads, self.num_layers, cfg.hidden_size
        s = {"w": ParamSpec((k, n, d, d), (None, None, "embed", "mlp")),
             "b": ParamSpec((k, n, d), (None, None, None), "zeros")}
        if self.own_head:
            s["lm_head"] = ParamSpec((k, d, cfg.vocab_size), (None, "embed", "vocab"))
        return s


def medusa_init_zero(params: dict) -> dict:
    """Medusa initialises W to zero so each head starts as the base LM head (identity residual)."""
    return {**params, "w": jnp.zeros_like(params["w"])}


def medusa_logits(mp: dict, mcfg: MedusaConfig, target_params, cfg: ModelConfig, h_BD: jax.Array) -> jax.Array:
    """[..., D] -> [K, ..., V] logits of every head."""
    def one(k):
        x = h_BD
        for j in range(mcfg.num_layers):
            x = x + jax.nn.silu(jnp.einsum("...d,de->...e", x, mp["w"][k, j]) + mp["b"][k, j])
        return _lm_head(target_params, cfg, x, mp["lm_head"][k] if mcfg.own_head else None)

    return jnp.stack([one(k) for k in range(mcfg.num_heads)])


# ------------------------------------------------------------------------------------------------ EAGLE
@dataclasses.dataclass(frozen=True)
class EagleConfig:
    """A one-decoder-layer drafter, autoregressive over features.

    Input at position i: ``fc([emb(token_{i+1}); feature_i])`` -> one decoder block (own KV cache) -> the predicted
    feature of position i+1 -> LM head. EAGLE-1/2: the feature is the target's final (normed) hidden state and the
    predicted feature is regressed onto it (no extra norm). EAGLE-3 (``fuse_layers`` set): the target feature is
    ``fuse([h_low; h_mid; h_high])`` of three layer outputs, the block output goes through its own final norm, and
    training is on the target's distribution only (training-time test).
    """

    fuse_layers: tuple[int, ...] = ()  # EAGLE-3: target layers fused into the feature, e.g. (1, 3, 5)
    own_head: bool = False
    fc_bias: bool = False  # EAGLE-1 releases carry a bias on fc
    draft_vocab: int = 0  # EAGLE-3's reduced vocabulary: an own LM head over this many target tokens (0: the target's)

    @property
    def is_eagle3(self) -> bool:
        return bool(self.fuse_layers)

    def block_cfg(self, cfg: ModelConfig) -> ModelConfig:
        return cfg.with_layers(1)

    def specs(self, cfg: ModelConfig) -> dict:
        d = cfg.hidden_size
        s = {"fc": ParamSpec((2 * d, d), (None, "embed")), "layers": layer_specs(cfg, 1)}
        if self.fc_bias:
            s["fc_b"] = ParamSpec((d,), (None,), "zeros")
        if self.is_eagle3:
            s["fuse"] = ParamSpec((len(self.fuse_layers) * d, d), (None, "embed"))
            s["norm"] = ParamSpec((d,), (None,), "ones")
        if self.draft_vocab:
            if self.own_head:
                raise ConfigError("an EAGLE drafter with a draft vocabulary owns its (reduced) LM head: own_head is "
                                  "implied, leave it False")
            if not 0 < self.draft_vocab <= cfg.vocab_size:
                raise ConfigError(f"draft_vocab must be in 1..{cfg.vocab_size} (the target's vocabulary), got "
                                  f"{self.draft_vocab}")
            # EAGLE-3's maps, in its released layout: target id = draft id + d2t[draft id]; t2d marks the target
            # ids the draft vocabulary holds
            s["lm_head"] = ParamSpec((d, self.draft_vocab), ("embed", "vocab"))
            s["d2t"] = ParamSpec((self.draft_vocab,), (None,), "index")
            s["t2d"] = ParamSpec((cfg.vocab_size,), (None,), "flag")
        elif self.own_head:
            s["lm_head"] = ParamSpec((d, cfg.vocab_size), ("embed", "vocab"))
        return s


VOCAB_MAPS = ("d2t", "t2d")  # the drafter's integer buffers (not trained)


def split_vocab_maps(tree: dict) -> tuple[dict, dict]:
    """(the drafter's trained entries, its vocabulary maps) of an EAGLE params or specs dict: the trainers keep the
    maps beside the frozen base, out of the optimiser's reach."""
    return ({k: v for k, v in tree.items() if k not in VOCAB_MAPS},
            {k: v for k, v in tree.items() if k in VOCAB_MAPS})


def draft_vocab_maps(token_ids, vocab_size: int) -> dict:
    """EAGLE-3's maps for a draft vocabulary of the target ids ``token_ids`` (any order; kept sorted): ``d2t``
    [Vd] int offsets (target id = draft id + d2t) and ``t2d`` [V] bool."""
    import numpy as np

    ids = np.unique(np.asarray(token_ids, np.int64))
    if ids.size != len(token_ids) or ids.min() < 0 or ids.max() >= vocab_size:
        raise ConfigError(f"draft vocabulary ids must be distinct and in 0..{vocab_size - 1}")
    t2d = np.zeros((vocab_size,), bool)
    t2d[ids] = True
    return {"d2t": (ids - np.arange(ids.size)).astype(np.int32), "t2d": t2d}


def most_frequent_tokens(tokens, count: int, vocab_size: int):
    """The ``count`` most frequent ids of a token stream (ties: the lower id), sorted: EAGLE-3's draft vocabulary
    from the training data; (draft vocabulary ids, the share of the stream's tokens they cover)."""
    import numpy as np

    freq = np.bincount(np.asarray(tokens, np.int64).ravel(), minlength=vocab_size)[:vocab_size]
    top = np.sort(np.argsort(-freq, kind="stable")[:count])
    return top, float(freq[top].sum() / max(1, freq.sum()))


def draft_ids(ep: dict) -> jax.Array:
    """[Vd] target ids of a reduced draft vocabulary."""
    return jnp.arange(ep["d2t"].shape[0], dtype=jnp.int32) + ep["d2t"].astype(jnp.int32)


def eagle_feature(ep: dict, ecfg: EagleConfig, h_BTD: jax.Array, layer_h_nBTD: jax.Array | None) -> jax.Array:
    """The target feature the drafter reads: final hidden state (EAGLE-1/2) or the fused layer outputs (EAGLE-3)."""
    if not ecfg.is_eagle3:
        return h_BTD
    cat = jnp.concatenate(list(layer_h_nBTD), axis=-1)
    return cat @ ep["fuse"]


def eagle_step(ep: dict, ecfg: EagleConfig, cfg: ModelConfig, target_params, tokens_BT, feat_BTD, positions_BT,
               mask_BTS, cache: kvc.KVCache | None = None, write_at_B=None, draft_space: bool = False):
    """One drafter pass: (next-token logits [B,T,V], predicted features [B,T,D], cache). With a draft vocabulary
    the head reads only its Vd rows; the logits come back over the target's ids (-inf outside the draft
    vocabulary), or over the draft ids themselves with ``draft_space`` (training)."""
    emb = jnp.take(target_params["embed"], tokens_BT, axis=0)
    x = jnp.concatenate([emb, feat_BTD.astype(emb.dtype)], axis=-1) @ ep["fc"]
    if ecfg.fc_bias:
        x = x + ep["fc_b"]
    out, cache, _ = run_layers(ecfg.block_cfg(cfg), ep["layers"], x, positions_BT, mask_BTS, cache, write_at_B)
    h = rms_norm(out, ep["norm"], cfg.rms_norm_eps) if ecfg.is_eagle3 else out
    logits = _lm_head(target_params, cfg, h, ep["lm_head"] if ecfg.own_head or ecfg.draft_vocab else None)
    if ecfg.draft_vocab and not draft_space:
        full = jnp.full(logits.shape[:-1] + (cfg.vocab_size,), -jnp.inf, logits.dtype)
        logits = full.at[..., draft_ids(ep)].set(logits, unique_indices=True, indices_are_sorted=True)
    return logits, out, cache


# ------------------------------------------------------------------------------------------------ MTP
@dataclasses.dataclass(frozen=True)
class MTPConfig:
    """Multi-token prediction.

    ``kind="sequential"`` (DeepSeek-V3): D modules; module k reads ``h^{k-1}_i`` (h^0 = the target's last-layer
    output before its final norm) and the embedding of token i+k, ``proj(concat)`` -> one decoder block -> its
    own norm -> the shared LM head predicts token i+k+1. ``emb_first``: concatenation order; the paper writes
    [norm(h); norm(emb)], DeepSeek-V3's released checkpoints use [enorm(emb); hnorm(h)] (``emb_first=True``).

    ``kind="parallel"`` (Gloeckle et al.): D independent heads, each one decoder block over the shared trunk output
    (the target's last-layer output), head k predicting token i+k+1 through its own norm and the shared LM head.
    """

    num_modules: int = 1
    kind: str = "sequential"
    emb_first: bool = False

    def __post_init__(self):
        if self.kind not in ("sequential", "parallel"):
            raise ConfigError(f"MTP kind must be 'sequential' or 'parallel', got {self.kind!r}")
        if self.num_modules < 1:
            raise ConfigError(f"MTP needs at least one module, got {self.num_modules}")

    def block_cfg(self, cfg: ModelConfig) -> ModelConfig:
        return cfg.with_layers(1)

    def specs(self, cfg: ModelConfig) -> dict:
        d, n = cfg.hidden_size, self.num_modules
        mod: dict[str, Any] = {"layers": layer_specs(cfg, 1), "norm": ParamSpec((d,), (None,), "ones")}
        if self.kind == "sequential":
            mod.update(enorm=ParamSpec((d,), (None,), "ones"), hnorm=ParamSpec((d,), (None,), "ones"),
                       proj=ParamSpec((2 * d, d), (None, "embed")))
        return {"modules": [mod for _ in range(n)]}


def mtp_module(mp: dict, mcfg: MTPConfig, cfg: ModelConfig, target_params, h_prev_BTD, next_tokens_BT, positions_BT,
               mask_BTS, cache: kvc.KVCache | None = None, write_at_B=None):
    """One MTP module: (logits [B,T,V], output hidden h^k [B,T,D] (pre-norm), cache)."""
    if mcfg.kind == "sequential":
        e = rms_norm(jnp.take(target_params["embed"], next_tokens_BT, axis=0), mp["enorm"], cfg.rms_norm_eps)
        hh = rms_norm(h_prev_BTD, mp["hnorm"], cfg.rms_norm_eps)
        x = (jnp.concatenate([e, hh], -1) if mcfg.emb_first else jnp.concatenate([hh, e], -1)) @ mp["proj"]
    else:
        x = h_prev_BTD
    out, cache, _ = run_layers(mcfg.block_cfg(cfg), mp["layers"], x, positions_BT, mask_BTS, cache, write_at_B)
    return unembed(target_params, cfg, rms_norm(out, mp["norm"], cfg.rms_norm_eps)), out, cache


# ------------------------------------------------------------------------------------------------ early exit
@dataclasses.dataclass(frozen=True)
class ExitConfig:
    """An early-exit adapter for layer-skip self-speculation (Kangaroo's idea, LayerSkip's early-exit loss on a
    frozen base): the hidden state after the base's first ``exit_layer`` blocks goes through ``h + W2 SiLU(W1
    norm_in(h))`` (``hidden`` wide; 0: the base's width), its own final norm, and the base's LM head. The base's
    blocks are untouched, so the draft's keys and values of those blocks are the full model's and are kept (the
    layerskip drafter's cache sharing). W2 starts at zero and the norm at the base's final norm: before training the
    adapter is the training-free early exit."""

    exit_layer: int
    hidden: int = 0

    def specs(self, cfg: ModelConfig) -> dict:
        if not 1 <= self.exit_layer < cfg.num_layers:
            raise ConfigError(f"an early exit after {self.exit_layer} blocks needs 1 <= exit_layer < "
                              f"{cfg.num_layers} (the base's blocks)")
        d, f = cfg.hidden_size, self.hidden or cfg.hidden_size
        return {"norm_in": ParamSpec((d,), (None,), "ones"), "w1": ParamSpec((d, f), ("embed", "mlp")),
                "w2": ParamSpec((f, d), ("mlp", "embed"), "zeros"), "norm": ParamSpec((d,), (None,), "ones")}


def exit_logits(xp: dict, cfg: ModelConfig, target_params, h_BTD: jax.Array) -> jax.Array:
    """The adapter's logits [..., V] from the base's hidden state after its exit layer (before any final norm)."""
    a = jax.nn.silu(jnp.einsum("...d,df->...f", rms_norm(h_BTD, xp["norm_in"], cfg.rms_norm_eps), xp["w1"]))
    x = h_BTD + jnp.einsum("...f,fd->...d", a, xp["w2"]).astype(h_BTD.dtype)
    return unembed(target_params, cfg, final_norm({"final_norm": xp["norm"]}, cfg, x))  # (the family's own norm)


# ------------------------------------------------------------------------------------------------ edit heads
@dataclasses.dataclass(frozen=True)
class EditConfig:
    """Levenshtein-style edit heads on a bidirectional (masked) model's final hidden states: for every token,
    delete or keep (two classes); for every pair of neighbours (t, t + 1), how many tokens to insert between them
    (0 .. ``max_insert``). The inserted tokens are the model's own masked predictions (its LM head, on a canvas with
    mask tokens in the gaps). Each head is an MLP: ``W2 silu(W1 x + b1) + b2`` with ``x`` the token's state (delete)
    or the two neighbours' states side by side (insert)."""

    max_insert: int = 8
    hidden: int = 512
    confidence: float = 0.5  # the default decision threshold (`pdecode.refine`); chosen on held-out data by training
    # the threshold for refining a model's own draft (`generate(refine="edit")`, e.g. one-shot fills), which needs
    # bolder edits than repairing given text does no harm with; None: ``confidence``
    draft_confidence: float | None = None

    def specs(self, cfg: ModelConfig) -> dict:
        d, h, k = cfg.hidden_size, self.hidden, self.max_insert + 1
        return {"del_w1": ParamSpec((d, h), ("embed", "mlp")), "del_b1": ParamSpec((h,), (None,), "zeros"),
                "del_w2": ParamSpec((h, 2), ("mlp", None)), "del_b2": ParamSpec((2,), (None,), "zeros"),
                "ins_w1": ParamSpec((2 * d, h), (None, "mlp")), "ins_b1": ParamSpec((h,), (None,), "zeros"),
                "ins_w2": ParamSpec((h, k), ("mlp", None)), "ins_b2": ParamSpec((k,), (None,), "zeros")}


def edit_delete_logits(ep: dict, h_BTD: jax.Array) -> jax.Array:
    """[B, T, 2]: keep (0) or delete (1) each token."""
    x = jax.nn.silu(h_BTD.astype(jnp.float32) @ ep["del_w1"].astype(jnp.float32) + ep["del_b1"])
    return x @ ep["del_w2"].astype(jnp.float32) + ep["del_b2"]


def edit_insert_logits(ep: dict, h_BTD: jax.Array) -> jax.Array:
    """[B, T, max_insert + 1]: at index t, how many tokens go between t and t + 1 (the last index pairs the last
    token with itself and is never used)."""
    nxt = jnp.concatenate([h_BTD[:, 1:], h_BTD[:, -1:]], axis=1)
    x = jnp.concatenate([h_BTD, nxt], axis=-1).astype(jnp.float32)
    x = jax.nn.silu(x @ ep["ins_w1"].astype(jnp.float32) + ep["ins_b1"])
    return x @ ep["ins_w2"].astype(jnp.float32) + ep["ins_b2"]
