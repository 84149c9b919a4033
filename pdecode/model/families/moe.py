"""Mixture-of-experts families: Mixtral, Qwen2-MoE, Qwen3-MoE.

The attention is the Llama block's (Qwen2-MoE: q/k/v biases; Qwen3-MoE: per-head q/k norms); the MLP is a router
over E experts, each a SiLU-GLU of ``moe_intermediate_size``, the k most probable run per token. Routing as the
references: softmax over all E (float32), top k, renormalised to sum 1 when ``norm_topk_prob`` (Mixtral always),
weights cast to the activations' dtype. Qwen2-MoE adds a shared expert scaled by sigmoid(x @ shared_gate).

Dense layers among the sparse ones (Qwen-MoE's ``mlp_only_layers``, and ``decoder_sparse_step``: layer i is sparse
iff (i + 1) % step == 0 and i is not listed; `Experts.dense_layer_ids`) have a plain SiLU-GLU MLP of
``intermediate_size`` (no shared expert). Such a stack holds blocks of two shapes, so its params are a tuple of
per-layer dicts (`transformer.DecodeLayers`, run as a loop over layers, as DeepSeek-V3's first dense layers are) and
its checkpoint names are per layer; a stack of sparse layers only keeps one stacked dict under `lax.scan`.

Compute: `moe_mlp` runs only the selected experts' work. A pass with few token-expert pairs (N * k <= E: decode
steps and short verifies) gathers each pair's expert weights and multiplies them (k/E of the FLOPs of running every
expert, the bytes of the selected experts only); a longer pass sorts the pairs by expert and runs grouped matmuls
(`jax.lax.ragged_dot`: grouped kernels on TPU and GPU); on CPU, whose XLA lowers ragged_dot to a dense product
over every pair and expert, a long pass runs every expert once instead (`experts_dense`, half the FLOPs of that at
k = 2).
Expert parallelism: expert weights carry the logical axis ``experts`` (`pdecode.sharding`).
"""

from __future__ import annotations

import dataclasses

from pdecode.config import Arch
from pdecode.errors import ConfigError
from pdecode.model.family import Family, LayerwiseFamily, register
from pdecode.model.groups import static_layer
from pdecode.model.layers.experts import (  # noqa: F401  (the names this family's users import from it)
    DENSE_CHUNK, SWIGLU_ALPHA, Experts, experts_dense, experts_gathered, experts_grouped, moe_mlp, route, run_experts)
from pdecode.model.families.llama import check_act, sliding_from_hf


@dataclasses.dataclass(frozen=True)
class MoEArch(Arch):
    """The section of a family whose MLPs are mixtures of experts (`layers.experts.Experts`)."""

    experts: Experts

    def problems(self, cfg):
        if not isinstance(self.experts, Experts):
            return [f"a mixture-of-experts family needs its experts section (got {self.experts!r})"]
        return self.experts.problems(cfg.num_layers)

    def for_drafter(self):
        return dataclasses.replace(self, experts=self.experts.for_drafter())


class MoE(LayerwiseFamily):
    arch_type = MoEArch
    model_types = ("mixtral", "qwen2_moe", "qwen3_moe")
    architectures = {"mixtral": "MixtralForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM",
                     "qwen3_moe": "Qwen3MoeForCausalLM"}

    def config_from_hf(self, model_type, hf, kw):
        check_act(model_type, hf)
        e = hf.get("num_local_experts") or hf.get("num_experts")
        k = hf.get("num_experts_per_tok")
        if not e or not k:
            raise ConfigError(f"{model_type}: config.json lacks num_experts / num_experts_per_tok")
        if model_type == "mixtral":
            ex = Experts(num_experts=int(e), experts_per_tok=int(k), moe_intermediate_size=kw["intermediate_size"])
        else:
            dense = dense_layer_ids(model_type, hf, kw["num_layers"])
            ex = Experts(num_experts=int(e), experts_per_tok=int(k),
                         moe_intermediate_size=int(hf["moe_intermediate_size"]),
                         norm_topk_prob=bool(hf.get("norm_topk_prob", False)),
                         shared_expert_size=int(hf.get("shared_expert_intermediate_size") or 0)
                         if model_type == "qwen2_moe" else 0, dense_layer_ids=dense)
            kw.update(attention_bias=bool(hf.get("qkv_bias", hf.get("attention_bias", model_type == "qwen2_moe"))),
                      qk_norm=model_type == "qwen3_moe")
            if ex.shared_expert_size and not dense:  # (with dense layers: theirs, config.json's)
                kw["intermediate_size"] = ex.shared_expert_size
        kw["arch"] = MoEArch(ex)
        sliding_from_hf(model_type, {**hf, "sliding_window": hf.get("sliding_window") or None}, kw,
                        always=model_type == "mixtral")

    def config_to_hf(self, cfg, out):
        super().config_to_hf(cfg, out)
        ex = cfg.arch.experts
        out.update(num_experts_per_tok=ex.experts_per_tok, sliding_window=cfg.sliding_window)
        if cfg.family == "mixtral":
            out.update(num_local_experts=ex.num_experts, intermediate_size=ex.moe_intermediate_size)
            return
        out.update(num_experts=ex.num_experts, moe_intermediate_size=ex.moe_intermediate_size,
                   norm_topk_prob=ex.norm_topk_prob, decoder_sparse_step=1, mlp_only_layers=list(ex.dense_layer_ids),
                   use_sliding_window=cfg.sliding_window is not None)
        if cfg.family == "qwen2_moe":
            out.update(shared_expert_intermediate_size=ex.shared_expert_size, qkv_bias=cfg.attention_bias)
        else:
            out["attention_bias"] = cfg.attention_bias

    def layer_specs(self, cfg, num_layers):
        """A stacked dict when every layer is sparse, else `LayerGroups` of the runs of sparse and dense layers."""
        c = cfg if num_layers == cfg.num_layers else cfg.with_layers(num_layers)
        if not c.arch.experts.dense_layer_ids:
            return self.stacked_specs(c, num_layers)
        return LayerwiseFamily.layer_specs(self, c, num_layers)

    def layer_spec(self, cfg, i: int) -> dict:
        """Layer ``i``'s own specs: the sparse block's, or the Llama block's for a dense layer."""
        from pdecode.model.spec import drop_layers
        from pdecode.model.transformer import llama_layer_specs

        one = self.stacked_specs(cfg, 1) if cfg.moe_layer(i) else llama_layer_specs(cfg, 1)
        return {k: drop_layers(v) for k, v in one.items()}

    def stacked_specs(self, cfg, num_layers):
        """Specs of ``num_layers`` sparse blocks stacked on ``layers``."""
        from pdecode.model.transformer import ParamSpec, attention_specs

        ex = cfg.arch.experts
        L, D, E, F = num_layers, cfg.hidden_size, ex.num_experts, ex.moe_intermediate_size
        s = attention_specs(cfg, num_layers)
        s.update({
            "mlp_norm": ParamSpec((L, D), ("layers", None), "ones"),
            "router": ParamSpec((L, D, E), ("layers", "embed", None)),
            "we_gate": ParamSpec((L, E, D, F), ("layers", "experts", "embed", "expert_mlp")),
            "we_up": ParamSpec((L, E, D, F), ("layers", "experts", "embed", "expert_mlp")),
            "we_down": ParamSpec((L, E, F, D), ("layers", "experts", "expert_mlp", "embed")),
        })
        if ex.shared_expert_size:
            S = ex.shared_expert_size
            s.update({
                "w_gate": ParamSpec((L, D, S), ("layers", "embed", "mlp")),
                "w_up": ParamSpec((L, D, S), ("layers", "embed", "mlp")),
                "w_down": ParamSpec((L, S, D), ("layers", "mlp", "embed")),
                "shared_gate": ParamSpec((L, D, 1), ("layers", "embed", None)),
            })
        return s

    def block(self, cfg, lp, x, att, cache, layer_idx, write_at, fused):
        from pdecode.model.transformer import glu_mlp, rms_norm, self_attention

        a, cache = self_attention(cfg, lp, rms_norm(x, lp["attn_norm"], cfg.rms_norm_eps), att, cache, layer_idx,
                                  write_at, fused)
        x = x + a
        h = rms_norm(x, lp["mlp_norm"], cfg.rms_norm_eps)
        if cfg.arch.experts.dense_layer_ids and not cfg.moe_layer(static_layer(layer_idx)):
            return x + glu_mlp(cfg, lp, h, fused), cache
        return x + moe_mlp(cfg, lp, h, fused), cache

    def hf_rules(self, cfg, prefix="model."):
        if cfg.arch.experts.dense_layer_ids:  # blocks of two shapes: per-layer names, as a layerwise family gives them
            return LayerwiseFamily.hf_rules(self, cfg, prefix)
        return Family.hf_rules(self, cfg, prefix)

    def head_block_rules(self, cfg, prefix):
        return Family.head_block_rules(self, cfg, prefix)  # a drafter's blocks are all sparse: one stack

    def layer_names(self, cfg, i: int) -> list[tuple]:
        """Layer ``i``'s tensors: the sparse block's, or the Llama block's for a dense layer."""
        from pdecode.model.rules import llama_block_names

        return self.block_names(cfg) if cfg.moe_layer(i) else llama_block_names(cfg)

    def block_names(self, cfg):
        from pdecode.model.rules import attention_names

        names = [("input_layernorm.weight", "attn_norm", "plain"), *attention_names(cfg),
                 ("post_attention_layernorm.weight", "mlp_norm", "plain")]
        if cfg.family == "mixtral":
            m = "block_sparse_moe."
            names += [(m + "gate.weight", "router", "linear"), (m + "experts.{e}.w1.weight", "we_gate", "linear"),
                      (m + "experts.{e}.w3.weight", "we_up", "linear"), (m + "experts.{e}.w2.weight", "we_down", "linear")]
        else:
            names += [("mlp.gate.weight", "router", "linear")]
            names += [(f"mlp.experts.{{e}}.{n}_proj.weight", f"we_{n}", "linear") for n in ("gate", "up", "down")]
        if cfg.arch.experts.shared_expert_size:
            names += [(f"mlp.shared_expert.{n}_proj.weight", f"w_{n}", "linear") for n in ("gate", "up", "down")]
            names.append(("mlp.shared_expert_gate.weight", "shared_gate", "linear"))
        return names




def dense_layer_ids(model_type: str, hf: dict, num_layers: int) -> tuple[int, ...]:
    """The layers of a Qwen-MoE config.json with a dense MLP: those in ``mlp_only_layers`` and those i with
    (i + 1) % ``decoder_sparse_step`` != 0 (transformers' rule)."""
    step = hf.get("decoder_sparse_step")
    step = 1 if step is None else int(step)
    if step < 1:
        raise ConfigError(f"{model_type}: decoder_sparse_step {step} is not supported (a positive step: every step-th "
                          "layer sparse)")
    only = {int(i) for i in hf.get("mlp_only_layers") or ()}
    return tuple(i for i in range(num_layers) if i in only or (i + 1) % step)


MOE = register(MoE())


class GptOss(MoE):
    """gpt-oss: attention with q/k/v/o biases and a learned sink logit per head, sliding and full layers
    alternating, YaRN rope; a biased router (top k of the logits, softmax over them) and experts with biases and a
    clamped SwiGLU, their gate and up columns interleaved in the checkpoint's ``gate_up_proj``."""

    model_types = ("gpt_oss",)
    architectures = {"gpt_oss": "GptOssForCausalLM"}
    output_bias = attention_sinks = expert_biases = True

    def config_from_hf(self, model_type, hf, kw):
        check_act(model_type, hf)
        alpha = float(hf.get("swiglu_alpha", SWIGLU_ALPHA))
        if abs(alpha - SWIGLU_ALPHA) > 1e-9:
            raise ConfigError(f"{model_type}: swiglu_alpha {alpha} is not supported (pdecode runs {SWIGLU_ALPHA})")
        kw.update(arch=MoEArch(Experts(num_experts=int(hf["num_local_experts"]),
                                       experts_per_tok=int(hf["num_experts_per_tok"]),
                                       moe_intermediate_size=kw["intermediate_size"],
                                       swiglu_limit=float(hf.get("swiglu_limit", 7.0)))),
                  attention_bias=True, qk_norm=False)
        sliding_from_hf(model_type, hf, kw)

    def config_to_hf(self, cfg, out):
        Family.config_to_hf(self, cfg, out)
        ex = cfg.arch.experts
        out.update(num_local_experts=ex.num_experts, num_experts_per_tok=ex.experts_per_tok,
                   intermediate_size=ex.moe_intermediate_size, swiglu_limit=ex.swiglu_limit,
                   swiglu_alpha=SWIGLU_ALPHA, attention_bias=True, sliding_window=cfg.sliding_window,
                   layer_types=[f"{k}_attention" for k in cfg.layer_kinds()])
        if cfg.rope_scaling is not None:
            out["rope_parameters"] = {"rope_theta": cfg.rope_theta, **cfg.rope_scaling_dict}
            out.pop("rope_scaling", None)

    def layer_specs(self, cfg, num_layers):
        from pdecode.model.transformer import ParamSpec

        L, D, E, F = num_layers, cfg.hidden_size, cfg.arch.experts.num_experts, cfg.arch.experts.moe_intermediate_size
        s = super().stacked_specs(cfg, num_layers)
        s.update({
            "bo": ParamSpec((L, D), ("layers", None), "zeros"),
            "sinks": ParamSpec((L, cfg.num_heads), ("layers", "heads"), "zeros"),
            "router_b": ParamSpec((L, E), ("layers", None), "zeros"),
            "we_gate_b": ParamSpec((L, E, F), ("layers", "experts", "expert_mlp"), "zeros"),
            "we_up_b": ParamSpec((L, E, F), ("layers", "experts", "expert_mlp"), "zeros"),
            "we_down_b": ParamSpec((L, E, D), ("layers", "experts", None), "zeros"),
        })
        return s

    def block_names(self, cfg):
        from pdecode.model.rules import attention_names

        m = "mlp.experts."
        return [("input_layernorm.weight", "attn_norm", "plain"), *attention_names(cfg),
                ("self_attn.o_proj.bias", "bo", "plain"), ("self_attn.sinks", "sinks", "plain"),
                ("post_attention_layernorm.weight", "mlp_norm", "plain"),
                ("mlp.router.weight", "router", "linear"), ("mlp.router.bias", "router_b", "plain"),
                (m + "gate_up_proj", "we_gate", "even_last"), (m + "gate_up_proj", "we_up", "odd_last"),
                (m + "gate_up_proj_bias", "we_gate_b", "even_last"), (m + "gate_up_proj_bias", "we_up_b", "odd_last"),
                (m + "down_proj", "we_down", "plain"), (m + "down_proj_bias", "we_down_b", "plain")]


GPT_OSS = register(GptOss())
