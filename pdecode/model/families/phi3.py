"""The Phi-3 family (Phi-3, Phi-3.5-mini, Phi-4-mini): the Llama block with q/k/v fused into one ``qkv_proj`` and
gate/up into one ``gate_up_proj`` in its checkpoints (split into our separate weights at load, fused back at save), a
sliding window on every layer when the config sets one, RoPE over the first ``partial_rotary_factor`` of each head
(Phi-4-mini: 0.75).

Rope: default, or ``longrope`` (the 128k models; ``su`` and Phi-3's legacy ``yarn`` name it too, as transformers
reads them). Longrope divides frequency i by ``short_factor[i]`` or ``long_factor[i]`` and multiplies cos and sin by
an attention factor, ``attention_factor`` or sqrt(1 + ln(factor) / ln(original_max_position_embeddings)) with
factor = ``factor`` or max_position_embeddings / original_max_position_embeddings (1 when factor <= 1); the original
context is the config's top-level ``original_max_position_embeddings`` (4096 when absent, transformers' default).

Short or long. transformers picks the set per forward from the length it reaches (long iff its largest position + 1
exceeds the original context), and its generate re-encodes the whole sequence once, dropping the cache, on the step
where the sequence first grows past that length, so each step's logits are those of a plain forward over the
sequence so far. pdecode decides once per generation (`config.with_rope_context`, `config.rope_long`): long iff the
longest prompt + max_new_tokens exceed the original context (the serving engine: iff its context, ``max_len``, does),
whatever cache span, decode phase or draft slots a call attends over; a plain forward decides by its own length.
Every forward of a generation, every method's, rotates alike, so cached keys are never re-encoded. Hence:

* a plain forward (`pdecode.forward_logits`) equals transformers' at every length, either side of the boundary;
* a generation that fits the original context runs the short factors throughout, as transformers does;
* one whose prompt already exceeds it runs the long factors throughout, as transformers does;
* one that crosses it runs the long factors from its first token: from the crossing on it holds what transformers'
  re-encoded cache holds, so given the same tokens its logits are transformers'; the tokens before the crossing come
  from the long factors where transformers used the short ones (they may differ).
"""

from __future__ import annotations

from pdecode.errors import ConfigError
from pdecode.model.families.llama import Llama, check_act, sliding_from_hf
from pdecode.model.family import register

ORIGINAL_CONTEXT = 4096  # Phi3Config's original_max_position_embeddings when config.json has none


class Phi3(Llama):
    model_types = ("phi3",)
    architectures = {"phi3": "Phi3ForCausalLM"}
    own_rope = True  # longrope's aliases and the top-level original context, partial_rotary_factor

    def config_from_hf(self, model_type, hf, kw):
        from pdecode.model.layers.rope import rope_from_hf

        check_act(model_type, hf)
        rp = dict(hf.get("rope_scaling") or hf.get("rope_parameters") or {})
        if rp.get("rope_type", rp.get("type")) in ("su", "yarn", "longrope"):  # Phi3Config's names for longrope
            rp = {k: v for k, v in rp.items() if k != "type"}
            rp["rope_type"] = "longrope"
        frac = float(rp.pop("partial_rotary_factor", None) or hf.get("partial_rotary_factor") or 1.0)
        top = {k: v for k, v in hf.items() if k not in ("partial_rotary_factor", "rope_scaling", "rope_parameters")}
        top.setdefault("original_max_position_embeddings", ORIGINAL_CONTEXT)
        theta, scaling = rope_from_hf(model_type, top, rp)
        hd = kw["head_dim"]
        rot = int(hd * frac)
        if rot % 2 or not 0 < rot <= hd:
            raise ConfigError(f"{model_type}: partial_rotary_factor {frac} of head_dim {hd} gives {rot} rotated dims "
                              "(an even number in 2..head_dim is needed)")
        kw.update(rope_theta=theta, rope_scaling=scaling, rotary_dims=rot if rot != hd else 0, attention_bias=False,
                  qk_norm=False)
        sliding_from_hf(model_type, hf, kw, always=True)

    def config_to_hf(self, cfg, out):
        out["architectures"] = [self.architectures[cfg.family]]
        out["sliding_window"] = cfg.sliding_window
        if cfg.rotary_dims:
            out["partial_rotary_factor"] = cfg.rotary_dims / cfg.head_dim
        sc = cfg.rope_scaling_dict
        if sc and sc["rope_type"] == "longrope":  # Phi3Config reads the original context at the top level
            out["original_max_position_embeddings"] = sc["original_max_position_embeddings"]

    def block_names(self, cfg):
        H, KV, hd, F = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.intermediate_size
        q, k = H * hd, KV * hd
        return [("input_layernorm.weight", "attn_norm", "plain", None),
                ("self_attn.qkv_proj.weight", "wq", "heads_in", (0, q)),
                ("self_attn.qkv_proj.weight", "wk", "heads_in", (q, q + k)),
                ("self_attn.qkv_proj.weight", "wv", "heads_in", (q + k, q + 2 * k)),
                ("self_attn.o_proj.weight", "wo", "heads_out", None),
                ("post_attention_layernorm.weight", "mlp_norm", "plain", None),
                ("mlp.gate_up_proj.weight", "w_gate", "linear", (0, F)),
                ("mlp.gate_up_proj.weight", "w_up", "linear", (F, 2 * F)),
                ("mlp.down_proj.weight", "w_down", "linear", None)]


PHI3 = register(Phi3())
