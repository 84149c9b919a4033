"""Helpers shared by tests: tiny random checkpoints made with `transformers` (no downloads)."""

from __future__ import annotations

import contextlib
from pathlib import Path

VOCAB = 97


def parity_tolerance(want) -> float:
    """The logit parity pdecode states against transformers in float32: 1e-4, or 1e-5 of the logits' scale when that
    is larger. A real model's logits reach 30-50, and its activations 1e4 in places: SmolLM2-135M-Instruct differs by
    7e-5 .. 1.6e-4 at logits of 27 .. 47 (2e-6 .. 6e-6 of the scale), its weights bit for bit transformers', the
    difference XLA:CPU's float32 dot accumulation against torch's (tests/test_gguf.py)."""
    import numpy as np

    return max(1e-4, 1e-5 * float(np.abs(np.asarray(want, np.float64)).max()))


def assert_logits_close(got, want) -> float:
    """max |got - want| within `parity_tolerance`; returns it."""
    import numpy as np

    err = float(np.abs(np.asarray(got, np.float64) - np.asarray(want, np.float64)).max())
    assert err <= parity_tolerance(want), (err, parity_tolerance(want))
    return err


# the families of issue 28, each tiny, with sliding windows (8) shorter than a prompt plus its new tokens
NEW_FAMILIES = ("gemma", "gemma2", "gemma3", "phi3", "mixtral", "qwen2_moe", "qwen3_moe", "gpt_oss", "gemma4",
                "gemma4_moe", "deepseek_v3", "glm4_moe")


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
    if family == "deepseek_v3":  # latent attention (q low-rank, interleaved YaRN rope), grouped routing, 1 dense layer
        return tf.DeepseekV3ForCausalLM(tf.DeepseekV3Config(
            **{**common, "num_key_value_heads": common["num_attention_heads"]}, kv_lora_rank=32, q_lora_rank=48,
            qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16, n_routed_experts=8, n_shared_experts=1,
            moe_intermediate_size=32, num_experts_per_tok=2, n_group=4, topk_group=2, routed_scaling_factor=2.5,
            first_k_dense_replace=1,
            rope_parameters={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64,
                             "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 0.8,
                             "rope_theta": 10000.0}))
    if family == "glm4_moe":  # q/k/v biases, q/k norms, RoPE over half of each head, DeepSeek-style experts
        return tf.Glm4MoeForCausalLM(tf.Glm4MoeConfig(
            **c, attention_bias=True, use_qk_norm=True, partial_rotary_factor=0.5, n_routed_experts=8,
            n_shared_experts=1, moe_intermediate_size=32, num_experts_per_tok=2, n_group=4, topk_group=2,
            routed_scaling_factor=2.5, first_k_dense_replace=1))
    raise ValueError(family)


def add_mtp_layer(model, out_dir: Path, seed: int = 0) -> dict:
    """Append a DeepSeek-V3-style MTP layer to a saved checkpoint (``model.layers.{L}.{enorm, hnorm, eh_proj,
    <decoder layer>, shared_head.{norm, head}}``, as the releases carry it; transformers drops these tensors) and
    return its torch modules for a reference written from the report's equations."""
    import torch
    from safetensors.torch import load_file, save_file

    cfg = model.config
    L, d = cfg.num_hidden_layers, cfg.hidden_size
    torch.manual_seed(seed)
    layer_cls = type(model.model.layers[-1])
    norm_cls = type(model.model.norm)
    mods = {"layer": layer_cls(cfg, L), "enorm": norm_cls(d, eps=cfg.rms_norm_eps),
            "hnorm": norm_cls(d, eps=cfg.rms_norm_eps), "eh_proj": torch.nn.Linear(2 * d, d, bias=False),
            "norm": norm_cls(d, eps=cfg.rms_norm_eps)}
    with torch.no_grad():
        for m in mods.values():
            for p in m.parameters():
                p.copy_(torch.randn_like(p) * 0.05 + (1.0 if p.ndim == 1 else 0.0))
            for name, b in m.named_buffers():
                if name.endswith("e_score_correction_bias"):
                    b.copy_(torch.randn_like(b) * 0.1)
    f = Path(out_dir) / "model.safetensors"
    tensors = load_file(f)
    p = f"model.layers.{L}."
    for name, t in mods["layer"].state_dict().items():  # experts in the releases' per-expert naming
        if name.endswith("experts.gate_up_proj"):
            f_ = t.shape[1] // 2
            for e in range(t.shape[0]):
                tensors[f"{p}mlp.experts.{e}.gate_proj.weight"] = t[e, :f_].contiguous()
                tensors[f"{p}mlp.experts.{e}.up_proj.weight"] = t[e, f_:].contiguous()
        elif name.endswith("experts.down_proj"):
            for e in range(t.shape[0]):
                tensors[f"{p}mlp.experts.{e}.down_proj.weight"] = t[e].contiguous()
        else:
            tensors[p + name] = t.contiguous()
    tensors.update({p + "enorm.weight": mods["enorm"].weight.detach(), p + "hnorm.weight": mods["hnorm"].weight.detach(),
                    p + "eh_proj.weight": mods["eh_proj"].weight.detach(),
                    p + "shared_head.norm.weight": mods["norm"].weight.detach(),
                    p + "shared_head.head.weight": model.lm_head.weight.detach().clone(),
                    p + "embed_tokens.weight": model.model.embed_tokens.weight.detach().clone()})
    save_file({k: v.contiguous() for k, v in tensors.items()}, f, metadata={"format": "pt"})
    return mods


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
            if name.endswith("e_score_correction_bias"):  # DeepSeek-V3: the routing bias
                b.add_(0.1 * torch.randn_like(b))
    model.save_pretrained(out_dir)
    return model



@contextlib.contextmanager
def unrolled_layout():
    """Shallow models decode in the production layout (layers unrolled, fused, a cache buffer per layer) while this
    is open; the suite otherwise runs layers under `lax.scan` (PDECODE_UNROLL_MAX_LAYERS=0, tests/conftest.py).
    Compiled programs and traces of the other layout are dropped on entry and on exit."""
    import pdecode
    from pdecode.model import transformer as T

    saved = T.UNROLL_MAX_LAYERS
    pdecode.clear_compile_cache()
    T.UNROLL_MAX_LAYERS = T.UNROLL_DEFAULT
    try:
        yield
    finally:
        T.UNROLL_MAX_LAYERS = saved
        pdecode.clear_compile_cache()
