"""Mixture-of-experts families: Mixtral, Qwen2-MoE, Qwen3-MoE.

The attention is the Llama block's (Qwen2-MoE: q/k/v biases; Qwen3-MoE: per-head q/k norms); the MLP is a router
over E experts, each a SiLU-GLU of ``moe_intermediate_size``, the k most probable run per token. Routing as the
references: softmax over all E (float32), top k, renormalised to sum 1 when ``norm_topk_prob`` (Mixtral always),
weights cast to the activations' dtype. Qwen2-MoE adds a shared expert scaled by sigmoid(x @ shared_gate).

Dense layers among the sparse ones (Qwen-MoE's ``mlp_only_layers``, and ``decoder_sparse_step``: layer i is sparse
iff (i + 1) % step == 0 and i is not listed; `ModelConfig.dense_layer_ids`) have a plain SiLU-GLU MLP of
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

import jax
import jax.numpy as jnp

from pdecode.errors import ConfigError
from pdecode.model.family import Family, LayerwiseFamily, family_of, register
from pdecode.model.groups import static_layer
from pdecode.model.families.llama import check_act, sliding_from_hf


def route(cfg, router_DE: jax.Array, x_ND: jax.Array, bias_E: jax.Array | None = None):
    """(weights [N, k] in x's dtype, expert ids [N, k]) as the references route: softmax over all E then the top k
    (renormalised when ``norm_topk_prob``); with a router bias (gpt-oss), the top k logits then a softmax over
    them."""
    from pdecode.model.transformer import linear

    logits = linear(x_ND, router_DE)
    if bias_E is not None:
        top, idx = jax.lax.top_k(logits + bias_E, cfg.experts_per_tok)
        return jax.nn.softmax(top.astype(jnp.float32), axis=-1).astype(x_ND.dtype), idx
    probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
    top, idx = jax.lax.top_k(probs, cfg.experts_per_tok)
    if cfg.norm_topk_prob:
        top = top / jnp.sum(top, axis=-1, keepdims=True)
    return top.astype(x_ND.dtype), idx


def _glu(cfg, g, u):
    """The experts' gated unit: act(gate) * up, or gpt-oss's clamped SwiGLU (``swiglu_limit``)."""
    from pdecode.model.transformer import activation

    if cfg.swiglu_limit is None:
        return activation(cfg, g) * u
    lim = cfg.swiglu_limit
    g = jnp.minimum(g, lim)
    u = jnp.clip(u, -lim, lim)
    return (u + 1) * (g * jax.nn.sigmoid(g * SWIGLU_ALPHA))


SWIGLU_ALPHA = 1.702  # gpt-oss's sigmoid sharpness (config swiglu_alpha; others refused at load)


def _bias(cfg, lp, name, idx=None):
    """An expert bias (gathered for expert ids ``idx``), or 0 when the family's experts have none."""
    if not family_of(cfg).expert_biases:
        return 0.0
    return lp[name] if idx is None else lp[name][idx]


def experts_gathered(cfg, lp, x_ND, w_Nk, idx_Nk):
    """Each (token, expert) pair with its expert's weights gathered: N * k expert MLPs, nothing else."""
    dt = lp["we_gate"].dtype
    xc = x_ND.astype(dt)
    pet = x_ND.dtype
    g = jnp.einsum("nd,nkdf->nkf", xc, lp["we_gate"][idx_Nk], preferred_element_type=pet) + \
        _bias(cfg, lp, "we_gate_b", idx_Nk)
    u = jnp.einsum("nd,nkdf->nkf", xc, lp["we_up"][idx_Nk], preferred_element_type=pet) + _bias(cfg, lp, "we_up_b", idx_Nk)
    y = jnp.einsum("nkf,nkfd->nkd", _glu(cfg, g, u).astype(dt), lp["we_down"][idx_Nk], preferred_element_type=pet)
    return jnp.einsum("nk,nkd->nd", w_Nk, y + _bias(cfg, lp, "we_down_b", idx_Nk))


def experts_grouped(cfg, lp, x_ND, w_Nk, idx_Nk):
    """The (token, expert) pairs sorted by expert, each expert's group through grouped matmuls (ragged_dot)."""
    n, k = idx_Nk.shape
    e = lp["we_gate"].shape[0]
    dt, pet = lp["we_gate"].dtype, x_ND.dtype
    flat = idx_Nk.reshape(-1)
    order = jnp.argsort(flat, stable=True)
    tok = order // k
    sizes = jnp.bincount(flat, length=e).astype(jnp.int32)
    xs = x_ND[tok].astype(dt)
    e_sorted = flat[order]
    g = jax.lax.ragged_dot(xs, lp["we_gate"], sizes, preferred_element_type=pet) + _bias(cfg, lp, "we_gate_b", e_sorted)
    u = jax.lax.ragged_dot(xs, lp["we_up"], sizes, preferred_element_type=pet) + _bias(cfg, lp, "we_up_b", e_sorted)
    y = jax.lax.ragged_dot(_glu(cfg, g, u).astype(dt), lp["we_down"], sizes, preferred_element_type=pet)
    y = (y + _bias(cfg, lp, "we_down_b", e_sorted)) * w_Nk.reshape(-1)[order][:, None]
    return jnp.zeros_like(x_ND).at[tok].add(y)


DENSE_CHUNK = 256  # tokens per piece of `experts_dense` (bounds its [tokens, E, F] temporaries)


def experts_dense(cfg, lp, x_ND, w_Nk, idx_Nk):
    """Every expert on every token, weighted by the routing (zero off the top k): E/k of the selected work, but one
    dense product; what CPU runs for long passes (its XLA lowers ragged_dot to a dense product over all N*k pairs
    and every expert, twice this for k=2). Long passes run in pieces of DENSE_CHUNK tokens."""
    n, e = x_ND.shape[0], lp["we_gate"].shape[0]
    dt, pet = lp["we_gate"].dtype, x_ND.dtype
    w_NE = jnp.zeros((n, e), w_Nk.dtype).at[jnp.arange(n)[:, None], idx_Nk].add(w_Nk)

    def piece(xw):
        x, w = xw
        xc = x.astype(dt)
        g = jnp.einsum("nd,edf->nef", xc, lp["we_gate"], preferred_element_type=pet) + _bias(cfg, lp, "we_gate_b")
        u = jnp.einsum("nd,edf->nef", xc, lp["we_up"], preferred_element_type=pet) + _bias(cfg, lp, "we_up_b")
        y = jnp.einsum("nef,efd->ned", _glu(cfg, g, u).astype(dt), lp["we_down"], preferred_element_type=pet)
        return jnp.einsum("ne,ned->nd", w, y + _bias(cfg, lp, "we_down_b"))

    if n <= DENSE_CHUNK:
        return piece((x_ND, w_NE))
    pad = -n % DENSE_CHUNK
    xs = jnp.pad(x_ND, ((0, pad), (0, 0))).reshape(-1, DENSE_CHUNK, x_ND.shape[1])
    ws = jnp.pad(w_NE, ((0, pad), (0, 0))).reshape(-1, DENSE_CHUNK, e)
    return jax.lax.map(piece, (xs, ws)).reshape(-1, x_ND.shape[1])[:n]


def run_experts(cfg, lp, x_ND, w_Nk, idx_Nk):
    """The routed experts' output for N tokens: gathered weights when N * k <= E (decode steps, short verifies),
    else grouped matmuls (dense over every expert on CPU). Experts split over devices (``cfg.experts_sharded``)
    always run dense: each device runs its own experts on every token, and the weighted sum over experts is the one
    cross-device reduction (a gather of chosen experts' weights would copy them between devices every step)."""
    if cfg.experts_sharded:
        return experts_dense(cfg, lp, x_ND, w_Nk, idx_Nk)
    if x_ND.shape[0] * cfg.experts_per_tok <= cfg.num_experts:
        run = experts_gathered
    else:
        run = experts_dense if jax.default_backend() == "cpu" else experts_grouped
    return run(cfg, lp, x_ND, w_Nk, idx_Nk)


def moe_mlp(cfg, lp, h_BTD: jax.Array, fused: bool) -> jax.Array:
    from pdecode.model.transformer import glu_mlp, linear

    b, t, d = h_BTD.shape
    x = h_BTD.reshape(b * t, d)
    w, idx = route(cfg, lp["router"], x, lp["router_b"] if family_of(cfg).expert_biases else None)
    out = run_experts(cfg, lp, x, w, idx).reshape(b, t, d)
    if cfg.shared_expert_size:
        gate = jax.nn.sigmoid(linear(h_BTD, lp["shared_gate"]))
        out = out + gate * glu_mlp(cfg, lp, h_BTD, fused)
    return out


class MoE(LayerwiseFamily):
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
            f = kw["intermediate_size"]
            kw.update(norm_topk_prob=True, num_experts=int(e), experts_per_tok=int(k), moe_intermediate_size=int(f))
        else:
            kw["dense_layer_ids"] = dense = dense_layer_ids(model_type, hf, kw["num_layers"])
            kw.update(num_experts=int(e), experts_per_tok=int(k), moe_intermediate_size=int(hf["moe_intermediate_size"]),
                      norm_topk_prob=bool(hf.get("norm_topk_prob", False)),
                      shared_expert_size=int(hf.get("shared_expert_intermediate_size") or 0)
                      if model_type == "qwen2_moe" else 0,
                      attention_bias=bool(hf.get("qkv_bias", hf.get("attention_bias", model_type == "qwen2_moe"))),
                      qk_norm=model_type == "qwen3_moe")
            if kw["shared_expert_size"] and not dense:  # (with dense layers: theirs, config.json's)
                kw["intermediate_size"] = kw["shared_expert_size"]
        sliding_from_hf(model_type, {**hf, "sliding_window": hf.get("sliding_window") or None}, kw,
                        always=model_type == "mixtral")

    def config_to_hf(self, cfg, out):
        super().config_to_hf(cfg, out)
        out.update(num_experts_per_tok=cfg.experts_per_tok, sliding_window=cfg.sliding_window)
        if cfg.family == "mixtral":
            out.update(num_local_experts=cfg.num_experts, intermediate_size=cfg.moe_intermediate_size)
            return
        out.update(num_experts=cfg.num_experts, moe_intermediate_size=cfg.moe_intermediate_size,
                   norm_topk_prob=cfg.norm_topk_prob, decoder_sparse_step=1, mlp_only_layers=list(cfg.dense_layer_ids),
                   use_sliding_window=cfg.sliding_window is not None)
        if cfg.family == "qwen2_moe":
            out.update(shared_expert_intermediate_size=cfg.shared_expert_size, qkv_bias=cfg.attention_bias)
        else:
            out["attention_bias"] = cfg.attention_bias

    def layer_specs(self, cfg, num_layers):
        """A stacked dict when every layer is sparse, else `LayerGroups` of the runs of sparse and dense layers."""
        c = cfg if num_layers == cfg.num_layers else cfg.with_layers(num_layers)
        if not c.dense_layer_ids:
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

        L, D, E, F = num_layers, cfg.hidden_size, cfg.num_experts, cfg.moe_intermediate_size
        s = attention_specs(cfg, num_layers)
        s.update({
            "mlp_norm": ParamSpec((L, D), ("layers", None), "ones"),
            "router": ParamSpec((L, D, E), ("layers", "embed", None)),
            "we_gate": ParamSpec((L, E, D, F), ("layers", "experts", "embed", "expert_mlp")),
            "we_up": ParamSpec((L, E, D, F), ("layers", "experts", "embed", "expert_mlp")),
            "we_down": ParamSpec((L, E, F, D), ("layers", "experts", "expert_mlp", "embed")),
        })
        if cfg.shared_expert_size:
            S = cfg.shared_expert_size
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
        if cfg.dense_layer_ids and not cfg.moe_layer(static_layer(layer_idx)):
            return x + glu_mlp(cfg, lp, h, fused), cache
        return x + moe_mlp(cfg, lp, h, fused), cache

    def hf_rules(self, cfg, prefix="model."):
        if cfg.dense_layer_ids:  # blocks of two shapes: per-layer names, as a layerwise family gives them
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
        if cfg.shared_expert_size:
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
        kw.update(num_experts=int(hf["num_local_experts"]), experts_per_tok=int(hf["num_experts_per_tok"]),
                  moe_intermediate_size=kw["intermediate_size"], swiglu_limit=float(hf.get("swiglu_limit", 7.0)),
                  attention_bias=True, qk_norm=False)
        sliding_from_hf(model_type, hf, kw)

    def config_to_hf(self, cfg, out):
        Family.config_to_hf(self, cfg, out)
        out.update(num_local_experts=cfg.num_experts, num_experts_per_tok=cfg.experts_per_tok,
                   intermediate_size=cfg.moe_intermediate_size, swiglu_limit=cfg.swiglu_limit,
                   swiglu_alpha=SWIGLU_ALPHA, attention_bias=True, sliding_window=cfg.sliding_window,
                   layer_types=[f"{k}_attention" for k in cfg.layer_kinds()])
        if cfg.rope_scaling is not None:
            out["rope_parameters"] = {"rope_theta": cfg.rope_theta, **cfg.rope_scaling_dict}
            out.pop("rope_scaling", None)

    def layer_specs(self, cfg, num_layers):
        from pdecode.model.transformer import ParamSpec

        L, D, E, F = num_layers, cfg.hidden_size, cfg.num_experts, cfg.moe_intermediate_size
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
