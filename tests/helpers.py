"""Helpers shared by tests: tiny random checkpoints made with `transformers` (no downloads)."""

from __future__ import annotations

from pathlib import Path

VOCAB = 97


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
    else:
        raise ValueError(family)
    model.eval()
    with torch.no_grad():  # random init is near-uniform; widen it so argmax is decisive and biases are non-zero
        for name, p in model.named_parameters():
            p.add_(torch.randn_like(p) * (0.05 if p.ndim > 1 else 0.1))
    model.save_pretrained(out_dir)
    return model
