"""Helpers shared by tests: tiny random checkpoints made with `transformers` (no downloads)."""

from __future__ import annotations

from pathlib import Path

VOCAB = 97


# the families of issue 28, each tiny, with sliding windows (8) shorter than a prompt plus its new tokens
NEW_FAMILIES = ("gemma", "gemma2", "gemma3", "phi3", "mixtral", "qwen2_moe", "qwen3_moe", "gpt_oss", "gemma4",
                "gemma4_moe")


def _new_family(tf, family: str, common: dict):
    c = {**common, "head_dim": 16}
    moe = dict(num_experts_per_tok=2, moe_intermediate_size=32)
    three = ["sliding_attention", "full_attention", "sliding_attention"][:c["num_hidden_layers"]]
    if family == "gemma":
        return tf.GemmaForCausalLM(tf.GemmaConfig(**c))
    if family == "gemma2":
        return tf.Gemma2ForCausalLM(tf.Gemma2Config(**c, sliding_window=8, query_pre_attn_scalar=24,
                                                    attn_logit_softcapping=5.0, final_logit_softcapping=8.0))
    if family == "gemma3":
        return tf.Gemma3ForCausalLM(tf.Gemma3TextConfig(
            **c, sliding_window=8, query_pre_attn_scalar=24, layer_types=three,
            rope_parameters={"full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 100000.0},
                             "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}))
    if family == "phi3":
        return tf.Phi3ForCausalLM(tf.Phi3Config(**{**common, "pad_token_id": 0}, sliding_window=8))
    if family == "mixtral":
        return tf.MixtralForCausalLM(tf.MixtralConfig(**{**c, "intermediate_size": 32}, num_local_experts=4,
                                                      num_experts_per_tok=2, sliding_window=8))
    if family == "qwen2_moe":
        return tf.Qwen2MoeForCausalLM(tf.Qwen2MoeConfig(**c, num_experts=4, shared_expert_intermediate_size=48,
                                                        norm_topk_prob=False, **moe))
    if family == "qwen3_moe":
        return tf.Qwen3MoeForCausalLM(tf.Qwen3MoeConfig(**c, num_experts=4, norm_topk_prob=True, **moe))
    if family == "gpt_oss":
        return tf.GptOssForCausalLM(tf.GptOssConfig(
            **{**c, "intermediate_size": 32}, num_local_experts=4, num_experts_per_tok=2, sliding_window=8,
            swiglu_limit=0.3, layer_types=three, rope_parameters={"rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0,
                                                "beta_slow": 1.0, "original_max_position_embeddings": 64,
                                                "rope_theta": 150000.0, "truncate": False}))
    if family in ("gemma4", "gemma4_moe"):
        c = {**c, "num_key_value_heads": 2, "global_head_dim": 32, "sliding_window": 8,
             "rope_parameters": {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                 "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25,
                                                    "rope_theta": 1000000.0}}}
        if family == "gemma4":  # per-layer inputs, the last two layers kv-shared with double-wide MLPs
            cfg = tf.Gemma4TextConfig(**{**c, "num_hidden_layers": 4}, hidden_size_per_layer_input=8,
                                      vocab_size_per_layer_input=VOCAB, num_kv_shared_layers=2,
                                      use_double_wide_mlp=True, layer_types=["sliding_attention", "full_attention"] * 2)
        else:  # experts beside the dense MLP, full layers with their keys as values and one kv head
            cfg = tf.Gemma4TextConfig(**c, hidden_size_per_layer_input=0, attention_k_eq_v=True,
                                      num_global_key_value_heads=1, enable_moe_block=True, num_experts=4,
                                      top_k_experts=2, moe_intermediate_size=32, final_logit_softcapping=30.0,
                                      layer_types=three[:1] + ["full_attention"] * (c["num_hidden_layers"] - 1))
        return tf.Gemma4ForCausalLM(cfg)
    raise ValueError(family)


def make_hf_model(family: str, out_dir: Path, seed: int = 0, **overrides):
    import torch
    import transformers as tf

    torch.manual_seed(seed)
    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=256, bos_token_id=1, eos_token_id=2,
                  pad_token_id=0)
    common.update(overrides)
    if family == "llama":
        model = tf.LlamaForCausalLM(tf.LlamaConfig(**common))
    elif family == "llama3":
        model = tf.LlamaForCausalLM(tf.LlamaConfig(
            **common, rope_theta=500000.0,
            rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                          "original_max_position_embeddings": 32}))
    elif family == "qwen2":
        model = tf.Qwen2ForCausalLM(tf.Qwen2Config(**{**common, "tie_word_embeddings": True}))
    elif family == "qwen3":
        model = tf.Qwen3ForCausalLM(tf.Qwen3Config(**{**common, "head_dim": 32}))
    elif family == "mistral":
        model = tf.MistralForCausalLM(tf.MistralConfig(**{**common, "sliding_window": 24}))
    elif family in NEW_FAMILIES:
        model = _new_family(tf, family, common)
    else:
        raise ValueError(family)
    model.eval()
    with torch.no_grad():  # random init is near-uniform; widen it so argmax is decisive and biases are non-zero
        for name, p in model.named_parameters():
            p.add_(torch.randn_like(p) * (0.05 if p.ndim > 1 else 0.1))
        for name, b in model.named_buffers():
            if name.endswith("layer_scalar"):  # Gemma 4: a stored per-layer scale
                b.mul_(1.0 + 0.2 * torch.randn_like(b))
    model.save_pretrained(out_dir)
    return model
