"""The DeepSeek-V3 family (``deepseek_v3``; DeepSeek-R1 and V3.1 share it): multi-head latent attention (MLA) and
DeepSeek's mixture of experts.

MLA. Per token, one projection gives a latent of ``kv_lora_rank`` values (RMS-normalised) and one rotated key of
``head_dim`` (qk_rope_head_dim) shared by every head; each head's key is [W_uk c; k_rope] and its value W_uv c. The
cache holds only the latent and the shared rotated key (`cache.py`: 576 values per token and layer at V3's shape,
where full K and V would take 128 x (192 + 128) = 40,960). Queries go through a ``q_lora_rank`` bottleneck (or one
projection when q_lora_rank is null); YaRN rope with the softmax scale times mscale(factor, mscale_all_dim)^2.

Two ways to attend, the same numbers (`mla_expanded` picks by FLOPs from the static shapes):

* absorbed (decode steps and verifies): W_uk is folded into the query (q_lat = q_nope W_uk^T, per head, over the
  latent) and W_uv applied after the weighted sum of latents, so the cache is read as it is, as one shared key/value
  head (multi-query attention over [latent; rope key]);
* expanded (long passes without much cache: prefill, training): the latents of every key are decompressed into
  per-head keys and values once and attended to as usual.

Experts. Sigmoid router scores; the choice adds a learned per-expert bias (``e_score_correction_bias``) and keeps
only the ``topk_group`` best of ``n_group`` groups (a group scores the sum of its two best); the chosen experts
weigh their unbiased scores, renormalised (``norm_topk_prob``) and times ``routed_scaling_factor``; shared experts
(``n_shared_experts`` x moe_intermediate_size, no gate) run beside them. The first ``first_k_dense_replace`` layers
have a dense MLP instead, so the blocks differ in shape: the params are `groups.LayerGroups`, the dense layers stacked
and scanned as one group and the sparse ones as another (V3: 3 and 58).

Released weights are fp8 (e4m3) with one scale per 128 x 128 block (``weight_scale_inv``): dequantized as they are
read (`pdecode.checkpoint.safetensors_io.CheckpointTensors`). The checkpoint's MTP layer(s)
(``model.layers.{num_hidden_layers}``) are attached as the model's `method="mtp"` drafter when present
(`pdecode.load`).
"""

from __future__ import annotations

import dataclasses

from pdecode.errors import ConfigError
from pdecode.model.family import Family, LayerwiseFamily, register
from pdecode.model.groups import static_layer
from pdecode.model.layers.experts import Experts, route_grouped, run_experts
from pdecode.model.layers.latent import (  # noqa: F401  (importable from the family too)
    Latent, latent_attention, mla_expanded, rope_pairs)
from pdecode.model.families.llama import check_act
from pdecode.model.families.moe import MoEArch


@dataclasses.dataclass(frozen=True)
class DeepseekArch(MoEArch):
    """DeepSeek-V3's section: its experts (grouped sigmoid routing) and its latent attention."""

    latent: Latent | None = None

    def problems(self, cfg):
        if not isinstance(self.latent, Latent):
            return [f"deepseek_v3 needs its latent attention section (got {self.latent!r})"]
        return super().problems(cfg) + self.latent.problems(cfg)


def routing_from_hf(model_type: str, hf: dict, kw: dict) -> Experts:
    """DeepSeek-V3's experts section (GLM-4.5 shares it)."""
    e = int(hf.get("n_routed_experts") or hf.get("num_local_experts") or 0)
    if not e:
        raise ConfigError(f"{model_type}: config.json lacks n_routed_experts")
    f = int(hf["moe_intermediate_size"])
    return Experts(num_experts=e, experts_per_tok=int(hf["num_experts_per_tok"]), moe_intermediate_size=f,
                   shared_expert_size=int(hf.get("n_shared_experts") or 0) * f,
                   norm_topk_prob=bool(hf.get("norm_topk_prob", True)), router_score="sigmoid",
                   expert_groups=int(hf.get("n_group") or 1), groups_per_tok=int(hf.get("topk_group") or 1),
                   routed_scale=float(hf.get("routed_scaling_factor", 1.0)),
                   dense_layers=min(int(hf.get("first_k_dense_replace") or 0), kw["num_layers"]))


def routing_to_hf(cfg) -> dict:
    """The config.json expert fields of `routing_from_hf` (the MTP layers are not written: none are saved)."""
    ex = cfg.arch.experts
    return dict(n_routed_experts=ex.num_experts, num_experts_per_tok=ex.experts_per_tok,
                moe_intermediate_size=ex.moe_intermediate_size,
                n_shared_experts=ex.shared_expert_size // ex.moe_intermediate_size,
                norm_topk_prob=ex.norm_topk_prob, n_group=ex.expert_groups, topk_group=ex.groups_per_tok,
                routed_scaling_factor=ex.routed_scale, first_k_dense_replace=ex.dense_layers,
                num_nextn_predict_layers=0)


class DeepseekV3(LayerwiseFamily):
    arch_type = DeepseekArch
    model_types = ("deepseek_v3",)
    architectures = {"deepseek_v3": "DeepseekV3ForCausalLM"}

    # -------------------------------------------------------------------------------- config
    def config_from_hf(self, model_type, hf, kw):
        check_act(model_type, hf)
        if hf.get("attention_bias"):
            raise ConfigError(f"{model_type}: attention_bias true is not supported")
        for key in ("kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim"):
            if not hf.get(key):
                raise ConfigError(f"{model_type}: config.json lacks {key}")
        topk = hf.get("topk_method", "noaux_tc")
        if topk != "noaux_tc":
            raise ConfigError(f"{model_type}: topk_method {topk!r} is not supported (noaux_tc: DeepSeek-V3's)")
        scoring = hf.get("scoring_func", "sigmoid")
        if scoring != "sigmoid":
            raise ConfigError(f"{model_type}: scoring_func {scoring!r} is not supported (sigmoid)")
        if int(hf.get("moe_layer_freq", 1)) != 1:
            raise ConfigError(f"{model_type}: moe_layer_freq {hf['moe_layer_freq']} is not supported (1)")
        dr = int(hf["qk_rope_head_dim"])
        dn = int(hf["qk_nope_head_dim"])
        sc = kw.get("rope_scaling")
        scale = (dn + dr) ** -0.5
        if sc:
            sc = dict(sc)
            m_all = float(sc.get("mscale_all_dim") or 0)
            if m_all and float(sc.get("factor", 1.0)) > 1:  # the reference's yarn_get_mscale, squared
                import math

                m = 0.1 * m_all * math.log(float(sc["factor"])) + 1.0
                scale *= m * m
        fmt = (hf.get("quantization_config") or {})
        if fmt and fmt.get("quant_method") != "fp8":
            raise ConfigError(f"{model_type}: quantization_config {fmt.get('quant_method')!r} is not supported "
                              "(fp8 block scales are)")
        latent = Latent(kv_lora_rank=int(hf["kv_lora_rank"]), q_lora_rank=int(hf.get("q_lora_rank") or 0),
                        qk_nope_dim=dn, v_head_dim=int(hf["v_head_dim"]),
                        rope_interleave=bool(hf.get("rope_interleave", True)))
        kw.update(num_kv_heads=1, head_dim=dr, attn_scale=scale,
                  arch=DeepseekArch(routing_from_hf(model_type, hf, kw), latent))

    def config_to_hf(self, cfg, out):
        super().config_to_hf(cfg, out)
        sc = cfg.rope_scaling_dict
        out.pop("rope_scaling", None)
        out.pop("head_dim", None)
        la = cfg.arch.latent
        out.update(num_key_value_heads=cfg.num_heads, kv_lora_rank=la.kv_lora_rank,
                   q_lora_rank=la.q_lora_rank or None, qk_rope_head_dim=cfg.head_dim, qk_nope_head_dim=la.qk_nope_dim,
                   v_head_dim=la.v_head_dim, rope_interleave=la.rope_interleave, attention_bias=False,
                   **routing_to_hf(cfg), topk_method="noaux_tc", scoring_func="sigmoid",
                   rope_parameters={"rope_theta": cfg.rope_theta, "rope_type": "default", **(sc or {})})

    # -------------------------------------------------------------------------------- params
    def layer_spec(self, cfg, i: int) -> dict:
        return {**self.attention_spec(cfg), **self.mlp_spec(cfg, i)}

    def attention_spec(self, cfg) -> dict:
        """One layer's latent attention weights and its input norm."""
        from pdecode.model.transformer import ParamSpec

        D, H, la = cfg.hidden_size, cfg.num_heads, cfg.arch.latent
        r, dr, dn, dv, rq = la.kv_lora_rank, cfg.head_dim, la.qk_nope_dim, la.v_head_dim, la.q_lora_rank
        vec = lambda n: ParamSpec((n,), (None,), "ones")  # noqa: E731
        s = {"attn_norm": vec(D), "wkv_a": ParamSpec((D, r + dr), ("embed", None)), "kv_a_norm": vec(r),
             "wkv_b": ParamSpec((r, H, dn + dv), (None, "heads", None)),
             "wo": ParamSpec((H, dv, D), ("heads", None, "embed"))}
        if rq:
            s.update(wq_a=ParamSpec((D, rq), ("embed", None)), q_a_norm=vec(rq),
                     wq_b=ParamSpec((rq, H, dn + dr), (None, "heads", None)))
        else:
            s["wq"] = ParamSpec((D, H, dn + dr), ("embed", "heads", None))
        return s

    def mlp_spec(self, cfg, i: int) -> dict:
        """Layer ``i``'s MLP weights and its norm: dense, or routed experts beside shared ones."""
        from pdecode.model.transformer import ParamSpec

        D, ex = cfg.hidden_size, cfg.arch.experts
        vec = lambda n, init="ones": ParamSpec((n,), (None,), init)  # noqa: E731
        s = {"mlp_norm": vec(D)}
        F = ex.shared_expert_size if cfg.moe_layer(i) else cfg.intermediate_size
        if F:
            s.update(w_gate=ParamSpec((D, F), ("embed", "mlp")), w_up=ParamSpec((D, F), ("embed", "mlp")),
                     w_down=ParamSpec((F, D), ("mlp", "embed")))
        if cfg.moe_layer(i):
            E, Fm = ex.num_experts, ex.moe_intermediate_size
            s.update(router=ParamSpec((D, E), ("embed", None)), router_corr=vec(E, "zeros"),
                     we_gate=ParamSpec((E, D, Fm), ("experts", "embed", "expert_mlp")),
                     we_up=ParamSpec((E, D, Fm), ("experts", "embed", "expert_mlp")),
                     we_down=ParamSpec((E, Fm, D), ("experts", "expert_mlp", "embed")))
        return s

    # -------------------------------------------------------------------------------- forward
    def attention(self, cfg, lp, h, att, cache, i, write_at, form: str | None = None):
        """Latent attention of layer ``i`` on the normed input (`layers.latent.latent_attention`)."""
        return latent_attention(cfg, lp, h, att, cache, i, write_at, form)

    def moe(self, cfg, lp, h_BTD):
        from pdecode.model.transformer import glu_mlp

        b, t, d = h_BTD.shape
        x = h_BTD.reshape(b * t, d)
        w, idx = route_grouped(cfg, lp, x)
        out = run_experts(cfg, lp, x, w, idx).reshape(b, t, d)
        return out + glu_mlp(cfg, lp, h_BTD, False) if cfg.arch.experts.shared_expert_size else out

    def block(self, cfg, lp, x, att, cache, layer_idx, write_at, fused):
        from pdecode.model.transformer import glu_mlp, rms_norm

        a, cache = self.attention(cfg, lp, rms_norm(x, lp["attn_norm"], cfg.rms_norm_eps), att, cache, layer_idx,
                                  write_at)
        x = x + a
        h = rms_norm(x, lp["mlp_norm"], cfg.rms_norm_eps)
        if cfg.moe_layer(static_layer(layer_idx)):
            return x + self.moe(cfg, lp, h), cache
        return x + glu_mlp(cfg, lp, h, False), cache

    # -------------------------------------------------------------------------------- checkpoints
    def layer_names(self, cfg, i: int) -> list[tuple]:
        return self.attention_names(cfg) + self.mlp_names(cfg, i)

    def attention_names(self, cfg) -> list[tuple]:
        """The tensors of `attention_spec`: the input norm and the latent attention."""
        a = "self_attn."
        names = [("input_layernorm.weight", "attn_norm", "plain"),
                 (a + "kv_a_proj_with_mqa.weight", "wkv_a", "linear"), (a + "kv_a_layernorm.weight", "kv_a_norm", "plain"),
                 (a + "kv_b_proj.weight", "wkv_b", "heads_in"), (a + "o_proj.weight", "wo", "heads_out")]
        if cfg.arch.latent.q_lora_rank:
            names += [(a + "q_a_proj.weight", "wq_a", "linear"), (a + "q_a_layernorm.weight", "q_a_norm", "plain"),
                      (a + "q_b_proj.weight", "wq_b", "heads_in")]
        else:
            names.append((a + "q_proj.weight", "wq", "heads_in"))
        return names

    def mlp_names(self, cfg, i: int) -> list[tuple]:
        """The tensors of `mlp_spec`."""
        moe = cfg.moe_layer(i)
        names = [("post_attention_layernorm.weight", "mlp_norm", "plain")]
        mlp = "mlp.shared_experts." if moe else "mlp."
        if not moe or cfg.arch.experts.shared_expert_size:
            names += [(f"{mlp}{n}_proj.weight", f"w_{n}", "linear") for n in ("gate", "up", "down")]
        if moe:
            names += [("mlp.gate.weight", "router", "linear"),
                      ("mlp.gate.e_score_correction_bias", "router_corr", "plain")]
            names += [(f"mlp.experts.{{e}}.{n}_proj.weight", f"we_{n}", "linear") for n in ("gate", "up", "down")]
        return names


DEEPSEEK_V3 = register(DeepseekV3())


class Glm4Moe(DeepseekV3):
    """GLM-4.5 / GLM-4.5-Air (``glm4_moe``): grouped-query attention (q/k/v biases with ``attention_bias``, per-head
    q/k norms with ``use_qk_norm``, RoPE over the first ``partial_rotary_factor`` of each head) and DeepSeek-V3's
    experts (sigmoid routing with the correction bias, groups, shared experts, the first dense layers); its releases
    carry one MTP layer in DeepSeek-V3's layout, attached as the `method="mtp"` drafter the same way."""

    arch_type = MoEArch
    model_types = ("glm4_moe",)
    architectures = {"glm4_moe": "Glm4MoeForCausalLM"}
    own_rope = True  # partial_rotary_factor read here (rope_from_hf refuses it)

    def config_from_hf(self, model_type, hf, kw):
        from pdecode.model.layers.rope import rope_from_hf

        check_act(model_type, hf)
        rp = dict(hf.get("rope_parameters") or {})
        frac = float(rp.pop("partial_rotary_factor", hf.get("partial_rotary_factor", 0.5)) or 0.5)
        theta, scaling = rope_from_hf(model_type, {k: v for k, v in hf.items() if k != "partial_rotary_factor"},
                                      rp or None)
        hd = kw["head_dim"]
        rot = int(hd * frac)
        if rot % 2:
            raise ConfigError(f"{model_type}: partial_rotary_factor {frac} of head_dim {hd} is odd ({rot})")
        kw.update(rope_theta=theta, rope_scaling=scaling, rotary_dims=rot if rot != hd else 0,
                  attention_bias=bool(hf.get("attention_bias", False)), qk_norm=bool(hf.get("use_qk_norm", False)),
                  arch=MoEArch(routing_from_hf(model_type, hf, kw)))

    def config_to_hf(self, cfg, out):
        Family.config_to_hf(self, cfg, out)
        sc = cfg.rope_scaling_dict
        out.pop("rope_scaling", None)
        out.pop("rope_theta", None)
        out.update(attention_bias=cfg.attention_bias, use_qk_norm=cfg.qk_norm, **routing_to_hf(cfg),
                   rope_parameters={"rope_theta": cfg.rope_theta, "rope_type": "default", **(sc or {}),
                                    "partial_rotary_factor": (cfg.rotary_dims or cfg.head_dim) / cfg.head_dim})

    def attention_spec(self, cfg) -> dict:
        from pdecode.model.spec import drop_layers
        from pdecode.model.transformer import attention_specs

        return {k: drop_layers(v) for k, v in attention_specs(cfg, 1).items()}

    def attention(self, cfg, lp, h, att, cache, i, write_at, form=None):
        from pdecode.model.transformer import self_attention

        return self_attention(cfg, lp, h, att, cache, i, write_at)

    def attention_names(self, cfg) -> list[tuple]:
        from pdecode.model.rules import attention_names

        return [("input_layernorm.weight", "attn_norm", "plain"), *attention_names(cfg)]


GLM4_MOE = register(Glm4Moe())
