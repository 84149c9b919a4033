"""The DiffusionGemma family (text path): ``diffusion_gemma`` checkpoints (``DiffusionGemmaForBlockDiffusion``).

A Gemma 4 mixture-of-experts network run twice with the same weights (`encode` and `denoise` below): as a causal
*encoder* over the prompt and each committed canvas, writing the KV cache, and as a bidirectional *decoder* over a
canvas of ``canvas_length`` tokens that reads the cache without writing it. Its layers are Gemma 4's with the
expert block always on and the full-attention layers using their keys as values (no ``v_proj``); what is its own:

* the decoder's input: the canvas embedding plus a *self-conditioning* MLP of the previous step's distribution
  (softmax of its logits times the embedding), RMS-normalised without weight (`sc_*` params);
* the decoder's per-layer ``layer_scalar`` buffers, stored apart from the encoder's (``dec_layer_scalar``);
* a final logit soft-cap of 30 (a class attribute of the reference config, not in config.json).

The checkpoint stores the shared weights once, under either the decoder's names (``model.decoder.*``, what
transformers writes) or the encoder's (``model.encoder.language_model.*``); both load. The vision tower is not
read: pdecode runs the text path.

The two passes. One set of layer weights runs as

* `encode`: a causal pass over new tokens (the prompt, then each committed canvas at the positions it was decoded
  at) that writes their keys and values into the KV cache at each row's ``lengths`` (the caller advances them);
  sliding layers see the last ``sliding_window`` positions, as in any causal pass;
* `denoise`: a bidirectional pass over a canvas of L tokens at positions ``lengths .. lengths + L - 1`` that attends
  to every cached token (sliding layers: the last ``sliding_window - 1`` of them, what the reference's sliding
  cache keeps) and to the whole canvas, and returns the canvas's soft-capped logits [B, L, V] in float32. Its
  keys and values are written past ``lengths`` as scratch (never committed: the next `encode` of the committed
  canvas overwrites them), so no cache is copied per step.

The decoder's input is the canvas embedding plus a self-conditioning MLP of the previous step's distribution
(``softmax(sc_logits) @ embedding``, x sqrt(D), zero where ``sc_on`` is False), RMS-normalised without weight.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from pdecode.config import ModelConfig
from pdecode.errors import ConfigError
from pdecode.model import cache as kvc
from pdecode.model.attention import cache_mask, causal_intra
from pdecode.model.families.gemma4 import Gemma4, Gemma4Arch, gemma4_norm
from pdecode.model.family import family_of, register
from pdecode.model.transformer import (
    Attention, activation, embed, final_norm, forward, linear, rope_tables, rope_tables_of, unembed)

SOFTCAP = 30.0
ENC = "model.encoder.language_model."
DEC = "model.decoder."


@dataclasses.dataclass(frozen=True)
class DiffusionGemmaArch(Gemma4Arch):
    """Gemma 4's section plus the length of the canvas the decoder denoises at once."""

    canvas_length: int = 256

    def problems(self, cfg):
        out = super().problems(cfg)
        if self.canvas_length <= 0 or self.experts is None:
            out.append(f"a block-diffusion model needs canvas_length > 0 and experts (got {self.canvas_length}, "
                       f"{self.experts})")
        return out


class DiffusionGemma(Gemma4):
    arch_type = DiffusionGemmaArch
    model_types = ("diffusion_gemma",)
    architectures = {"diffusion_gemma": "DiffusionGemmaForBlockDiffusion"}

    def unwrap(self, model_type, hf):
        text = hf.get("text_config")
        if not isinstance(text, dict):
            raise ConfigError("diffusion_gemma: config.json has no text_config")
        if text.get("use_bidirectional_attention") == "all":
            raise ConfigError("diffusion_gemma: use_bidirectional_attention 'all' (a bidirectional encoder) is not "
                              "supported; pdecode runs the causal encoder of the released model")
        # token ids: the text config's (transformers), else the top level's (where pdecode's save_hf writes them)
        ids = {k: hf[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if k in hf and text.get(k) is None}
        return {**text, **ids, "model_type": model_type, "canvas_length": int(hf.get("canvas_length") or 256),
                "tie_word_embeddings": hf.get("tie_word_embeddings", text.get("tie_word_embeddings", True))}

    def config_from_hf(self, model_type, hf, kw):
        for f in ("num_experts", "top_k_experts", "moe_intermediate_size"):
            if not hf.get(f):
                raise ConfigError(f"diffusion_gemma: text_config.{f} must be set (every layer has its experts)")
        if not hf.get("tie_word_embeddings", True):
            raise ConfigError("diffusion_gemma: tie_word_embeddings false is not supported (the reference ties the "
                              "lm_head to the embedding)")
        # the reference's layers: experts always on, full-attention layers' values are their keys, no PLE / kv sharing
        body = {k: v for k, v in hf.items() if k not in ("num_kv_shared_layers", "hidden_size_per_layer_input",
                                                          "use_double_wide_mlp", "use_bidirectional_attention")}
        super().config_from_hf("gemma4_text", {**body, "enable_moe_block": True, "attention_k_eq_v": True}, kw)
        kw.update(final_softcap=SOFTCAP, causal=False, tie_word_embeddings=True,
                  arch=DiffusionGemmaArch(**vars(kw["arch"]), canvas_length=int(hf["canvas_length"])))

    def config_to_hf(self, cfg, out):
        text = dict(out)
        super().config_to_hf(cfg.replace(family="gemma4_text"), text)
        for k in ("architectures", "attention_k_eq_v", "num_kv_shared_layers", "hidden_size_per_layer_input",
                  "vocab_size_per_layer_input", "use_double_wide_mlp", "enable_moe_block", "final_logit_softcapping",
                  "pdecode_causal", "tie_word_embeddings"):
            text.pop(k, None)
        text["model_type"] = "diffusion_gemma_text"
        top = {k: text.pop(k) for k in ("dtype", "torch_dtype") if k in text}
        for k in list(out):
            del out[k]
        # a one-layer vision tower of the smallest shape: the reference builds one from any config (the default is
        # a full-size one); pdecode never writes or reads its weights
        vision = {"model_type": "gemma4_vision", "hidden_size": 16, "num_hidden_layers": 1, "num_attention_heads": 2,
                  "num_key_value_heads": 1, "head_dim": 8, "intermediate_size": 32}
        out.update(model_type="diffusion_gemma", architectures=["DiffusionGemmaForBlockDiffusion"],
                   canvas_length=cfg.arch.canvas_length, tie_word_embeddings=True, text_config=text,
                   vision_config=vision, **top)

    scan_groups = False  # its encoder and decoder passes loop over layers (`encode` and `denoise` below)

    # -------------------------------------------------------------------------------- params
    def layer_spec(self, cfg, i, own_kv=None):
        from pdecode.model.transformer import ParamSpec

        s = super().layer_spec(cfg, i, own_kv)
        s["dec_layer_scalar"] = ParamSpec((1,), (None,), "ones")
        return s

    def extra_specs(self, cfg):
        from pdecode.model.transformer import ParamSpec

        D, F = cfg.hidden_size, cfg.intermediate_size
        return {"sc_pre_norm": ParamSpec((D,), (None,), "ones"), "sc_gate": ParamSpec((D, F), ("embed", "mlp")),
                "sc_up": ParamSpec((D, F), ("embed", "mlp")), "sc_down": ParamSpec((F, D), ("mlp", "embed"))}

    # -------------------------------------------------------------------------------- checkpoints
    def hf_rules(self, cfg, prefix=None):
        from pdecode.model.rules import Rule

        rules = [Rule(DEC + "embed_tokens.weight", "embed", "plain")]
        for i in range(cfg.num_layers):
            for hf, ours, lay in self.layer_names(cfg, i):
                if ours == "layer_scalar":
                    rules += [Rule(f"{ENC}layers.{i}.layer_scalar", f"layers/{i}/layer_scalar", "plain"),
                              Rule(f"{DEC}layers.{i}.layer_scalar", f"layers/{i}/dec_layer_scalar", "plain")]
                else:
                    rules.append(Rule(f"{DEC}layers.{i}.{hf}", f"layers/{i}/{ours}", lay))
        sc = DEC + "self_conditioning."
        rules += [Rule(DEC + "norm.weight", "final_norm", "plain"), Rule(sc + "pre_norm.weight", "sc_pre_norm", "plain"),
                  Rule(sc + "gate_proj.weight", "sc_gate", "linear"), Rule(sc + "up_proj.weight", "sc_up", "linear"),
                  Rule(sc + "down_proj.weight", "sc_down", "linear")]
        return rules

    def tensor_aliases(self, names) -> dict[str, str]:
        """Tied weights a checkpoint stores under the encoder's names: the decoder's name -> the stored one."""
        have = set(names)
        out = {}
        for n in have:
            if n.startswith(ENC) and not n.endswith("layer_scalar"):
                d = DEC + n[len(ENC):]
                if d not in have:
                    out[d] = n
        return out


DIFFUSION_GEMMA = register(DiffusionGemma())


# ------------------------------------------------------------------------------------------------ the passes
def check(cfg: ModelConfig) -> None:
    if not cfg.arch.canvas_length:
        raise ValueError("block_diffusion: the config has no canvas_length (not a block-diffusion model)")


def encode(params, cfg: ModelConfig, tokens_BT: jax.Array, cache: kvc.KVCache, valid_B: jax.Array | None = None
           ) -> kvc.KVCache:
    """Write the keys and values of ``tokens`` (at positions ``cache.lengths + t``) into ``cache``; lengths do not
    move. ``valid_B``: how many of the T tokens are real in each row (the rest are padding no query reads)."""
    check(cfg)
    b, t = tokens_BT.shape
    start = cache.lengths
    pos = start[:, None] + jnp.arange(t, dtype=jnp.int32)[None]
    intra = jnp.broadcast_to(causal_intra(t), (b, t, t))
    if valid_B is not None:
        intra = intra & (jnp.arange(t)[None, None, :] < valid_B[:, None, None])
    mask = cache_mask(start, intra, cache.max_len)
    return forward(params, cfg, tokens_BT, pos, mask, cache=cache, write_at_B=start).cache


def canvas_input(params, cfg: ModelConfig, canvas_BL: jax.Array, sc_logits_BLV: jax.Array | None,
                 sc_on_B: jax.Array | None) -> jax.Array:
    """The decoder's input [B, L, D]: norm(embed(canvas) + MLP(pre_norm(softmax(sc) @ E x sqrt(D))))."""
    x = embed(params, canvas_BL, cfg)
    eps = cfg.rms_norm_eps
    if sc_logits_BLV is not None:
        w = params["embed"]
        p = jax.nn.softmax(sc_logits_BLV.astype(jnp.float32), axis=-1).astype(w.dtype)
        s = jnp.einsum("blv,vd->bld", p, w) * jnp.asarray(cfg.hidden_size ** 0.5, w.dtype)
        s = s.astype(x.dtype)
        if sc_on_B is not None:
            s = s * sc_on_B[:, None, None].astype(s.dtype)
        h = gemma4_norm(s, params["sc_pre_norm"], eps)
        x = x + linear(activation(cfg, linear(h, params["sc_gate"])) * linear(h, params["sc_up"]), params["sc_down"])
    return gemma4_norm(x, None, eps)


def denoise(params, cfg: ModelConfig, canvas_BL: jax.Array, cache: kvc.KVCache,
            sc_logits_BLV: jax.Array | None = None, sc_on_B: jax.Array | None = None) -> jax.Array:
    """Logits [B, L, V] (float32, soft-capped) of the canvas decoded after each row's ``cache.lengths`` tokens."""
    check(cfg)
    b, l = canvas_BL.shape
    fam = family_of(cfg)
    start = cache.lengths
    pos = start[:, None] + jnp.arange(l, dtype=jnp.int32)[None]
    s = jnp.arange(cache.max_len, dtype=jnp.int32)[None, None, :]
    lo, hi = start[:, None, None], (start + l)[:, None, None]
    canvas_keys = (s >= lo) & (s < hi)
    full = jnp.broadcast_to((s < lo) | canvas_keys, (b, l, cache.max_len))
    window = cfg.sliding_window or cache.max_len
    local = jnp.broadcast_to(((s < lo) & (s >= lo - (window - 1))) | canvas_keys, (b, l, cache.max_len))
    kinds = tuple(k == "sliding" for k in cfg.layer_kinds())
    tables = rope_tables_of(params, cfg) or {}
    att = Attention(rope_tables(cfg, pos, tables.get("global")), full,
                    rope_tables(cfg, pos, tables.get("local"), local=True) if any(kinds) else None,
                    local if any(kinds) else None, kinds, None)
    x = canvas_input(params, cfg, canvas_BL, sc_logits_BLV, sc_on_B)
    for i, lp in enumerate(params["layers"]):
        lp = {**lp, "layer_scalar": lp["dec_layer_scalar"]}
        x, cache = fam.block(cfg, lp, x, att, cache, i, start, False)
    return unembed(params, cfg, final_norm(params, cfg, x))
