"""The Gemma family: Gemma, Gemma 2 and Gemma 3 (text).

What differs from the Llama block: RMSNorm scales by ``1 + w`` (weights stored around zero) and multiplies before
casting back; embeddings are multiplied by sqrt(hidden_size); a tanh-GELU gated MLP; Gemma 2 and 3 norm each
sublayer's output too ("sandwich" norms) and scale scores by ``query_pre_attn_scalar ** -0.5``; Gemma 2 soft-caps
attention scores and final logits; Gemma 3 normalises q and k per head and gives its sliding layers a rope of their
own (``rope_local_base_freq``). Sliding and global layers alternate as ``layer_types`` says.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pdecode.model.layers.rope import rope_from_hf
from pdecode.errors import ConfigError
from pdecode.model.family import Family, register
from pdecode.model.families.llama import check_act, sliding_from_hf, sliding_to_hf

ACTS = ("gelu_pytorch_tanh", "gelu_tanh")


def gemma_norm(x: jax.Array, w: jax.Array, eps: float) -> jax.Array:
    """RMSNorm scaled by (1 + w), computed in float32 and cast back after the scale (as the reference does)."""
    xf = x.astype(jnp.float32)
    xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return (xf * (1.0 + w.astype(jnp.float32))).astype(x.dtype)


class Gemma(Family):
    model_types = ("gemma", "gemma2", "gemma3_text")
    architectures = {"gemma": "GemmaForCausalLM", "gemma2": "Gemma2ForCausalLM", "gemma3_text": "Gemma3ForCausalLM"}

    @staticmethod
    def sandwich(cfg) -> bool:
        return cfg.family != "gemma"

    def config_from_hf(self, model_type, hf, kw):
        act = hf.get("hidden_activation") or hf.get("hidden_act") or "gelu_pytorch_tanh"
        check_act(model_type, {"hidden_activation": act}, ACTS, "hidden_activation")
        if hf.get("use_bidirectional_attention"):
            raise ConfigError(f"{model_type}: use_bidirectional_attention true is not supported")
        kw.update(hidden_act="gelu_tanh", attention_bias=bool(hf.get("attention_bias", False)),
                  qk_norm=model_type == "gemma3_text", tie_word_embeddings=bool(hf.get("tie_word_embeddings", True)))
        if model_type == "gemma":
            return
        kw.update(attn_scale=float(hf.get("query_pre_attn_scalar") or kw["head_dim"]) ** -0.5,
                  attn_softcap=hf.get("attn_logit_softcapping") or None,
                  final_softcap=hf.get("final_logit_softcapping") or None)
        if model_type == "gemma2" and "layer_types" not in hf:  # older files: every other layer slides
            hf = {**hf, "layer_types": ["sliding_attention" if (i + 1) % 2 else "full_attention"
                                        for i in range(kw["num_layers"])]}
        if model_type == "gemma3_text":
            rp = hf.get("rope_parameters") or {}
            if rp and all(isinstance(v, dict) for v in rp.values()):
                local = dict(rp.get("sliding_attention") or {})
                theta, scaling = rope_from_hf(model_type, hf, local)
                if scaling is not None:
                    raise ConfigError(f"{model_type}: rope_parameters.sliding_attention.rope_type "
                                      f"{dict(scaling)['rope_type']!r} is not supported (default only)")
                kw["local_rope_theta"] = theta
            else:
                kw["local_rope_theta"] = float(hf.get("rope_local_base_freq", 10000.0))
            if "layer_types" not in hf:
                pattern = int(hf.get("sliding_window_pattern", 6))
                hf = {**hf, "layer_types": ["sliding_attention" if (i + 1) % pattern else "full_attention"
                                            for i in range(kw["num_layers"])]}
        sliding_from_hf(model_type, hf, kw)

    def config_to_hf(self, cfg, out):
        super().config_to_hf(cfg, out)
        out.pop("hidden_act", None)
        out.update(hidden_activation="gelu_pytorch_tanh", attention_bias=cfg.attention_bias)
        if cfg.family == "gemma":
            return
        q = cfg.attn_scale ** -2
        out.update(query_pre_attn_scalar=int(round(q)) if abs(q - round(q)) < 1e-6 else q, attn_logit_softcapping=cfg.attn_softcap,
                   final_logit_softcapping=cfg.final_softcap)
        sliding_to_hf(cfg, out)
        if cfg.layer_types is None:
            out["layer_types"] = [("sliding" if cfg.sliding_window else "full") + "_attention"] * cfg.num_layers
        if cfg.family == "gemma3_text":
            glob = {"rope_type": "default", "rope_theta": cfg.rope_theta, **(cfg.rope_scaling_dict or {})}
            out["rope_parameters"] = {"full_attention": glob, "sliding_attention": {
                "rope_type": "default", "rope_theta": cfg.local_rope_theta or cfg.rope_theta}}
            out.pop("rope_theta", None)
            out.pop("rope_scaling", None)

    def layer_specs(self, cfg, num_layers):
        from pdecode.model.transformer import ParamSpec, llama_layer_specs

        s = llama_layer_specs(cfg, num_layers)
        for k in ("attn_norm", "mlp_norm") + (("q_norm", "k_norm") if cfg.qk_norm else ()):
            s[k] = ParamSpec(s[k].shape, s[k].axes, "zeros")  # (Gemma's norms multiply by 1 + w)
        if self.sandwich(cfg):
            s["post_attn_norm"] = ParamSpec((num_layers, cfg.hidden_size), ("layers", None), "zeros")
            s["post_mlp_norm"] = ParamSpec((num_layers, cfg.hidden_size), ("layers", None), "zeros")
        return s

    def embed_scale(self, cfg):
        return cfg.hidden_size ** 0.5

    def norm(self, cfg, x, w):
        return gemma_norm(x, w, cfg.rms_norm_eps)

    def block(self, cfg, lp, x, att, cache, layer_idx, write_at, fused):
        from pdecode.model.transformer import glu_mlp, self_attention

        norm = lambda y, w: gemma_norm(y, w, cfg.rms_norm_eps)  # noqa: E731
        a, cache = self_attention(cfg, lp, norm(x, lp["attn_norm"]), att, cache, layer_idx, write_at, fused, norm)
        if self.sandwich(cfg):
            a = norm(a, lp["post_attn_norm"])
        x = x + a
        m = glu_mlp(cfg, lp, norm(x, lp["mlp_norm"]), fused)
        if self.sandwich(cfg):
            m = norm(m, lp["post_mlp_norm"])
        return x + m, cache

    def block_names(self, cfg):
        from pdecode.model.rules import attention_names

        names = [("input_layernorm.weight", "attn_norm", "plain"), *attention_names(cfg),
                 ("mlp.gate_proj.weight", "w_gate", "linear"), ("mlp.up_proj.weight", "w_up", "linear"),
                 ("mlp.down_proj.weight", "w_down", "linear")]
        if self.sandwich(cfg):
            names += [("post_attention_layernorm.weight", "post_attn_norm", "plain"),
                      ("pre_feedforward_layernorm.weight", "mlp_norm", "plain"),
                      ("post_feedforward_layernorm.weight", "post_mlp_norm", "plain")]
        else:
            names.append(("post_attention_layernorm.weight", "mlp_norm", "plain"))
        return names




GEMMA = register(Gemma())
