"""The Phi-3 family: the Llama block with q/k/v fused into one ``qkv_proj`` and gate/up into one ``gate_up_proj`` in
its checkpoints (split into our separate weights at load, fused back at save), a sliding window on every layer when
the config sets one. Rope: default, linear or llama3; ``longrope`` / ``su`` (the 128k models) is refused at load."""

from __future__ import annotations

from pdecode.model.families.llama import Llama, check_act, sliding_from_hf
from pdecode.model.family import register


class Phi3(Llama):
    model_types = ("phi3",)
    architectures = {"phi3": "Phi3ForCausalLM"}

    def config_from_hf(self, model_type, hf, kw):
        check_act(model_type, hf)
        kw.update(attention_bias=False, qk_norm=False)
        sliding_from_hf(model_type, hf, kw, always=True)

    def config_to_hf(self, cfg, out):
        out["architectures"] = [self.architectures[cfg.family]]
        out["sliding_window"] = cfg.sliding_window

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
