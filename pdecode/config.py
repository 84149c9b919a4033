"""Model configuration: one frozen (hashable, jit-static) dataclass for every decoder family pdecode runs.

`config_from_hf(dict)` reads a Hugging Face `config.json` (Llama 2/3, Mistral, Qwen2, Qwen3 and the
pdecode-native families); `to_hf()` writes one that `transformers` loads back.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any

from pdecode.errors import ConfigError

# the dtypes params and activations may take (validation, `pdecode.load`, the CLI's choices)
DTYPES = ("float32", "bfloat16", "float16")
# attention implementations (`pdecode.model.attention.attend`; docs/performance.md, "Attention implementations")
ATTENTION_IMPLS = ("auto", "xla", "dot_product", "cudnn", "pallas", "pallas_interpret")

# per-layer attention kinds (`ModelConfig.layer_types`) and the activations of the MLPs
LAYER_KINDS = ("full", "sliding")
ACTIVATIONS = ("silu", "gelu_tanh")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Architecture of a decoder-only transformer (static under jit).

    ``family`` names the model family (`pdecode.model.family`: the module that owns the block, its params and its
    checkpoint names; the registry is keyed by HF ``model_type``). The fields below are the architectural facts the
    families read; each family says which it supports. ``causal=False`` makes the network bidirectional (masked
    diffusion models).
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    family: str = "llama"
    max_position_embeddings: int = 2048
    rope_theta: float = 10000.0
    # Rope scaling as a sorted tuple of (key, value) pairs so the config stays hashable; None = plain RoPE.
    rope_scaling: tuple[tuple[str, Any], ...] | None = None
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # bias on q, k, v projections (Qwen2)
    qk_norm: bool = False  # RMSNorm on each head of q and k before RoPE (Qwen3)
    sliding_window: int | None = None  # the window of the "sliding" layers
    # per-layer attention kind ("full" / "sliding"); None: every layer "sliding" when sliding_window is set (Mistral),
    # else "full". Applied inside the model (`pdecode.model.transformer`); decode loops never build windows.
    layer_types: tuple[str, ...] | None = None
    local_rope_theta: float | None = None  # RoPE base of the sliding layers (Gemma 3); None: rope_theta
    hidden_act: str = "silu"  # MLP activation (ACTIVATIONS)
    attn_scale: float | None = None  # attention score scale; None: 1/sqrt(head_dim)
    attn_softcap: float | None = None  # scores -> cap * tanh(scores / cap) (Gemma 2)
    final_softcap: float | None = None  # logits -> cap * tanh(logits / cap) (Gemma 2)
    # mixture of experts (num_experts > 0): every layer's MLP is E experts of moe_intermediate_size, k per token
    num_experts: int = 0
    experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    shared_expert_size: int = 0  # a shared expert beside the routed ones, with a sigmoid gate (Qwen2-MoE)
    norm_topk_prob: bool = True  # renormalise the k routing weights to sum to 1
    swiglu_limit: float | None = None  # gpt-oss: experts' clamped SwiGLU (gate <= limit, |up| <= limit)
    # layers of two shapes (Gemma 4): the full-attention layers' head size and kv heads (None: head_dim /
    # num_kv_heads), their keys used as values too (``k_eq_v``) and the fraction of their head that rotates
    # (``rope_fraction``; the rest passes through); the last ``kv_shared_layers`` layers compute no keys or values
    # and attend with those of the last earlier layer of their kind; per-layer input embeddings of
    # ``per_layer_input_size`` per layer (0: none) over ``per_layer_vocab`` tokens; ``double_wide_mlp``: kv-shared
    # layers' MLPs are twice intermediate_size
    global_head_dim: int | None = None
    global_kv_heads: int | None = None
    k_eq_v: bool = False
    rope_fraction: float = 1.0
    kv_shared_layers: int = 0
    per_layer_input_size: int = 0
    per_layer_vocab: int = 0
    double_wide_mlp: bool = False
    # multi-head latent attention (DeepSeek-V2/V3, ``kv_lora_rank`` > 0): keys and values come from a per-token
    # latent of ``kv_lora_rank`` values plus one shared rotated key of ``head_dim`` (the rope part of each head:
    # qk_rope_head_dim), which is all the cache holds; each head's query and key have ``qk_nope_dim`` more
    # unrotated dims, its value ``v_head_dim``; queries through a ``q_lora_rank`` bottleneck (0: one projection);
    # ``rope_interleave``: the rotated dims are stored as interleaved pairs
    kv_lora_rank: int = 0
    q_lora_rank: int = 0
    qk_nope_dim: int = 0
    v_head_dim: int = 0
    rope_interleave: bool = False
    rotary_dims: int = 0  # RoPE over only the first rotary_dims of each head (GLM's partial rotary); 0: the whole head
    # DeepSeek-style routing: sigmoid scores (``router_score``), the top k chosen by score + a learned bias among
    # the best ``groups_per_tok`` of ``expert_groups`` groups (each scored by its two best), weights the chosen
    # scores (renormalised when norm_topk_prob) x ``routed_scale``; the first ``dense_layers`` layers have a dense
    # MLP of intermediate_size; the others shared experts (``shared_expert_size``, no gate) beside the routed ones
    router_score: str = "softmax"
    expert_groups: int = 1
    groups_per_tok: int = 1
    routed_scale: float = 1.0
    dense_layers: int = 0
    # further layers whose MLP is dense (intermediate_size) among the sparse ones (Qwen-MoE's mlp_only_layers and
    # decoder_sparse_step); their blocks differ in shape from the others, so the params are a tuple of per-layer dicts
    dense_layer_ids: tuple[int, ...] = ()
    # the experts are split over devices (expert parallelism; set when a model is placed on a mesh): every pass
    # runs each device's own experts on all its tokens, weighted by the routing (`moe.run_experts`), instead of
    # gathering the chosen experts' weights, which would copy them across devices
    experts_sharded: bool = False
    causal: bool = True  # False: bidirectional (masked diffusion models)
    # block diffusion in an encoder-decoder layout (DiffusionGemma): the network encodes the prompt and each committed
    # canvas causally into the KV cache, and denoises a canvas of ``canvas_length`` tokens that attends to itself and
    # to that cache (`pdecode.model.families.diffusion_gemma`); 0: not such a model
    canvas_length: int = 0
    diffusion_shift: bool = False  # Dream: logits at i - 1 predict the token at i
    layout: str = "hf"  # tensor naming of the source checkpoint: "hf" (transformers) or "llada"
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    pad_token_id: int | None = None
    mask_token_id: int | None = None
    dtype: str = "float32"  # dtype the checkpoint stores (params may be cast at load)
    # dtype of the residual stream, norms and attention; None = the params' dtype. "float32" with bfloat16 params:
    # bfloat16 matmul operands accumulating in float32, everything else in float32 (mixed precision).
    activation_dtype: str | None = None
    # attention implementation (ATTENTION_IMPLS): "auto" picks one by backend and shapes (xla on CPU); an explicit
    # one that cannot serve a call raises ConfigError (`attention.resolve_impl`)
    attention_impl: str = "auto"
    # longrope (Phi-3-128k & co.): whether every forward of a generation rotates with the long factors, decided once
    # from the generation's whole context (set by `generate` / the engine, `with_rope_context`); None: each forward
    # by the positions it holds
    rope_long_factors: bool | None = None

    def __post_init__(self):
        problems = []
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                     "num_kv_heads", "head_dim"):
            if int(getattr(self, name)) <= 0:
                problems.append(f"{name} must be positive (got {getattr(self, name)})")
        if self.num_kv_heads > 0 and self.num_heads % self.num_kv_heads:
            problems.append(f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})")
        if self.head_dim % 2:
            problems.append(f"head_dim must be even for RoPE (got {self.head_dim})")
        if self.layer_types is not None:
            if len(self.layer_types) != self.num_layers:
                problems.append(f"layer_types has {len(self.layer_types)} entries for {self.num_layers} layers")
            if any(k not in LAYER_KINDS for k in self.layer_types):
                problems.append(f"layer_types must hold {' / '.join(LAYER_KINDS)} (got {self.layer_types})")
            if "sliding" in self.layer_types and not self.sliding_window:
                problems.append("sliding layers need a sliding_window")
        gkv = self.global_kv_heads or self.num_kv_heads
        if self.num_kv_heads > 0 and gkv > 0 and self.num_heads % gkv:
            problems.append(f"num_heads ({self.num_heads}) must be a multiple of global_kv_heads ({gkv})")
        if self.rotary_dims % 2 or not 0 <= self.rotary_dims <= self.head_dim:
            problems.append(f"rotary_dims must be even and at most head_dim (got {self.rotary_dims})")
        if (self.global_head_dim or 2) % 2 or not 0 < self.rope_fraction <= 1:
            problems.append(f"global_head_dim must be even and rope_fraction in (0, 1] (got {self.global_head_dim}, "
                            f"{self.rope_fraction})")
        if not 0 <= self.kv_shared_layers < self.num_layers:
            problems.append(f"kv_shared_layers must be in 0..{self.num_layers - 1} (got {self.kv_shared_layers})")
        elif self.kv_shared_layers:
            own = set(self.layer_kinds()[: self.num_layers - self.kv_shared_layers])
            if set(self.layer_kinds()) - own:
                problems.append("every attention kind of the kv-shared layers needs an earlier layer of that kind")
        if self.kv_lora_rank and not (self.qk_nope_dim > 0 and self.v_head_dim > 0 and self.num_kv_heads == 1):
            problems.append(f"latent attention (kv_lora_rank {self.kv_lora_rank}) needs qk_nope_dim > 0, v_head_dim > 0 "
                            f"and num_kv_heads 1 (got {self.qk_nope_dim}, {self.v_head_dim}, {self.num_kv_heads})")
        if self.router_score not in ("softmax", "sigmoid"):
            problems.append(f"router_score must be 'softmax' or 'sigmoid' (got {self.router_score!r})")
        if self.num_experts and (self.num_experts % self.expert_groups or
                                 not 0 < self.groups_per_tok <= self.expert_groups):
            problems.append(f"expert_groups ({self.expert_groups}) must divide num_experts ({self.num_experts}) and "
                            f"0 < groups_per_tok ({self.groups_per_tok}) <= expert_groups")
        if not 0 <= self.dense_layers <= self.num_layers:
            problems.append(f"dense_layers must be in 0..{self.num_layers} (got {self.dense_layers})")
        if list(self.dense_layer_ids) != sorted(set(self.dense_layer_ids)) or \
                any(not 0 <= i < self.num_layers for i in self.dense_layer_ids):
            problems.append(f"dense_layer_ids must be increasing layer indices in 0..{self.num_layers - 1} "
                            f"(got {self.dense_layer_ids})")
        sc = self.rope_scaling_dict
        if sc and sc.get("rope_type") == "longrope":
            half = (self.rotary_dims or self.head_dim) // 2
            for key in ("short_factor", "long_factor"):
                if len(sc.get(key) or ()) != half:
                    problems.append(f"longrope {key} must have one entry per rotated pair ({half}; got "
                                    f"{len(sc.get(key) or ())})")
        if self.hidden_act not in ACTIVATIONS:
            problems.append(f"hidden_act must be one of {', '.join(ACTIVATIONS)} (got {self.hidden_act!r})")
        if self.num_experts and not (0 < self.experts_per_tok <= self.num_experts and self.moe_intermediate_size > 0):
            problems.append(f"a mixture of experts needs 0 < experts_per_tok <= num_experts and moe_intermediate_size "
                            f"> 0 (got {self.experts_per_tok}, {self.num_experts}, {self.moe_intermediate_size})")
        if self.activation_dtype is not None and self.activation_dtype not in DTYPES:
            problems.append(f"activation_dtype must be {', '.join(DTYPES)} or None (got {self.activation_dtype!r})")
        if self.attention_impl not in ATTENTION_IMPLS:
            problems.append(f"attention_impl must be one of {', '.join(ATTENTION_IMPLS)} (got {self.attention_impl!r})")
        if problems:
            raise ConfigError("invalid model config: " + "; ".join(problems))

    # ----------------------------------------------------------------------------------------------------
    @property
    def num_groups(self) -> int:
        return self.num_heads // self.num_kv_heads

    @property
    def rope_scaling_dict(self) -> dict[str, Any] | None:
        return dict(self.rope_scaling) if self.rope_scaling else None

    def replace(self, **kw) -> "ModelConfig":
        return dataclasses.replace(self, **kw)

    def layer_kinds(self) -> tuple[str, ...]:
        """The attention kind of every layer ("full" / "sliding"), `layer_types` resolved."""
        if self.layer_types is not None:
            return self.layer_types
        return ("sliding" if self.sliding_window else "full",) * self.num_layers

    def with_layers(self, n: int) -> "ModelConfig":
        """This config with ``n`` layers (drafters built from the family's block: EAGLE, MTP). Mixed per-layer kinds
        become full attention (a drafter reads its whole short cache); uniform ones are kept. A drafter's blocks
        have keys and values of their own and no per-layer inputs; with experts, every drafter block is a sparse one
        (DeepSeek-V3's MTP layer is)."""
        kinds = set(self.layer_kinds())
        return self.replace(num_layers=n, layer_types=None, kv_shared_layers=0, per_layer_input_size=0,
                            per_layer_vocab=0, double_wide_mlp=False, dense_layers=0, dense_layer_ids=(),
                            sliding_window=self.sliding_window if kinds == {"sliding"} else None)

    def moe_layer(self, i: int) -> bool:
        """Whether layer ``i``'s MLP is the mixture of experts (else a dense MLP of intermediate_size)."""
        return bool(self.num_experts) and i >= self.dense_layers and i not in self.dense_layer_ids

    def layer_attention(self, i: int) -> tuple[int, int]:
        """(kv heads, head size) of layer ``i``."""
        if self.layer_kinds()[i] == "full":
            return self.global_kv_heads or self.num_kv_heads, self.global_head_dim or self.head_dim
        return self.num_kv_heads, self.head_dim

    def cache_value_dim(self, i: int) -> int:
        """The size of what layer ``i``'s cache holds per token as its "values": the head size, or with latent
        attention the latent (``kv_lora_rank``; its "keys" are then the one rotated key of ``head_dim``)."""
        return self.kv_lora_rank or self.layer_attention(i)[1]

    def kv_source(self, i: int) -> int:
        """The layer whose keys and values layer ``i`` attends with: itself, or for a kv-shared layer the last
        layer of its kind before the shared ones."""
        first = self.num_layers - self.kv_shared_layers
        if i < first:
            return i
        kind = self.layer_kinds()[i]
        return max(j for j in range(first) if self.layer_kinds()[j] == kind)

    @property
    def uniform_layers(self) -> bool:
        """Whether every layer has a cache of its own of one shape (else the cache is per layer, `init_cache`)."""
        return not (self.kv_shared_layers or len({self.layer_attention(i) for i in range(self.num_layers)}) > 1)
