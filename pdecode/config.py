"""Model configuration: a frozen (hashable, jit-static) dataclass per model, in three parts.

* `ModelConfig`'s own fields, the core every family shares: sizes, vocabulary, positions and rope, the attention
  kinds of the layers, the special tokens, the stored dtype.
* ``arch``: the family's architecture section, a subclass of `Arch` that the family's module defines and validates
  (Gemma 4's two layer shapes and kv-shared tail, DeepSeek-V3's latent attention and routing, the experts of the
  MoE families, DiffusionGemma's canvas). `Arch` itself is the section of the families with none (Llama & co.)
  and names, with their defaults, the few questions shared code asks of any family (a layer's attention shape,
  whose keys it reads, its experts).
* ``run``: `Runtime`, how the forwards run (activation dtype, attention implementation, expert placement, longrope's
  factors): chosen at load and placement, never part of a checkpoint's config.json.

`pdecode.model.family.config_from_hf` / `config_to_hf` read and write config.json (each family its own section).
"""

from __future__ import annotations

import dataclasses
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
class Runtime:
    """How a model's forwards run: settings of the program, not facts of the network (static under jit)."""

    # dtype of the residual stream, norms and attention; None = the params' dtype. "float32" with bfloat16 params:
    # bfloat16 matmul operands accumulating in float32, everything else in float32 (mixed precision).
    activation_dtype: str | None = None
    # attention implementation (ATTENTION_IMPLS): "auto" picks one by backend and shapes (xla on CPU); an explicit
    # one that cannot serve a call raises ConfigError (`attention.resolve_impl`)
    attention_impl: str = "auto"
    # the experts are split over devices (expert parallelism; set when a model is placed on a mesh): every pass
    # runs each device's own experts on all its tokens, weighted by the routing (`experts.run_experts`), instead of
    # gathering the chosen experts' weights, which would copy them across devices
    experts_sharded: bool = False
    # longrope (Phi-3-128k & co.): whether every forward of a generation rotates with the long factors, decided once
    # from the generation's whole context (set by `generate` / the engine, `with_rope_context`); None: each forward
    # by the positions it holds
    rope_long_factors: bool | None = None

    def __post_init__(self):
        problems = []
        if self.activation_dtype is not None and self.activation_dtype not in DTYPES:
            problems.append(f"activation_dtype must be {', '.join(DTYPES)} or None (got {self.activation_dtype!r})")
        if self.attention_impl not in ATTENTION_IMPLS:
            problems.append(f"attention_impl must be one of {', '.join(ATTENTION_IMPLS)} (got {self.attention_impl!r})")
        if problems:
            raise ConfigError("invalid runtime settings: " + "; ".join(problems))


@dataclasses.dataclass(frozen=True)
class Arch:
    """A family's architecture section: the base, for the families whose networks the core fields describe.

    A family with fields of its own subclasses it (a frozen dataclass in the family's module), validates them in
    `problems` and overrides the per-layer answers below. The class attributes are the shared questions' defaults:
    ``experts`` (`pdecode.model.layers.experts.Experts`, or None: dense MLPs), ``latent``
    (`pdecode.model.layers.latent.Latent`, or None: attention over per-head keys and values), ``kv_shared_layers``
    (the last layers, reading earlier layers' keys), ``per_layer_input_size`` (Gemma 4's per-layer embeddings),
    ``rope_fraction`` (of the full layers' heads that rotate) and ``canvas_length`` (block diffusion's canvas)."""

    experts = None
    latent = None
    kv_shared_layers = 0
    per_layer_input_size = 0
    rope_fraction = 1.0
    canvas_length = 0

    def problems(self, cfg: "ModelConfig") -> list[str]:
        """What is wrong with this section under ``cfg``'s core (one phrase each); none by default."""
        return []

    def layer_attention(self, cfg: "ModelConfig", i: int) -> tuple[int, int]:
        """(kv heads, head size) of layer ``i``."""
        return cfg.num_kv_heads, cfg.head_dim

    def full_head_dim(self, cfg: "ModelConfig") -> int:
        """The head size of the full-attention layers (their rope's, `rope_fraction` of it rotating)."""
        return cfg.head_dim

    def kv_source(self, cfg: "ModelConfig", i: int) -> int:
        """The layer whose keys and values layer ``i`` attends with (itself by default)."""
        return i

    def moe_layer(self, i: int) -> bool:
        """Whether layer ``i``'s MLP is the mixture of experts (else a dense MLP of intermediate_size)."""
        return self.experts is not None and self.experts.sparse(i)

    def for_drafter(self) -> "Arch":
        """The section of a drafter built from this family's block (`ModelConfig.with_layers`)."""
        return self

    def repeat_kv_heads(self, r: int) -> "Arch":
        """This section with every kv-head count of its own repeated ``r`` times (`pdecode.sharding.kv_repeat`)."""
        return self


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """A decoder-only transformer (static under jit): the core every family shares, its family's ``arch`` section
    and the ``run`` settings (the module's docstring).

    ``family`` names the model family (`pdecode.model.family`: the module that owns the block, its params, its
    checkpoint names and its `Arch` subclass; the registry is keyed by HF ``model_type``). ``causal=False`` makes
    the network bidirectional (masked diffusion models).
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
    rotary_dims: int = 0  # RoPE over only the first rotary_dims of each head (GLM's partial rotary); 0: the whole head
    causal: bool = True  # False: bidirectional (masked diffusion models)
    diffusion_shift: bool = False  # Dream: logits at i - 1 predict the token at i
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    pad_token_id: int | None = None
    mask_token_id: int | None = None
    dtype: str = "float32"  # dtype the checkpoint stores (params may be cast at load)
    # the family's architecture section (`Arch`; docs/extending.md): what only its networks read, validated by it
    arch: Arch = Arch()
    # how the forwards run (`Runtime`): set at load and placement, never written to config.json
    run: Runtime = Runtime()

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
        if self.rotary_dims % 2 or not 0 <= self.rotary_dims <= self.head_dim:
            problems.append(f"rotary_dims must be even and at most head_dim (got {self.rotary_dims})")
        sc = self.rope_scaling_dict
        if sc and sc.get("rope_type") == "longrope":
            half = (self.rotary_dims or self.head_dim) // 2
            for key in ("short_factor", "long_factor"):
                if len(sc.get(key) or ()) != half:
                    problems.append(f"longrope {key} must have one entry per rotated pair ({half}; got "
                                    f"{len(sc.get(key) or ())})")
        if self.hidden_act not in ACTIVATIONS:
            problems.append(f"hidden_act must be one of {', '.join(ACTIVATIONS)} (got {self.hidden_act!r})")
        if not isinstance(self.arch, Arch) or not isinstance(self.run, Runtime):
            problems.append(f"arch must be an Arch and run a Runtime (got {type(self.arch).__name__}, "
                            f"{type(self.run).__name__})")
        else:
            problems += self.arch.problems(self)
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

    def with_run(self, **kw) -> "ModelConfig":
        """This config with runtime settings replaced (`Runtime`'s fields)."""
        return dataclasses.replace(self, run=dataclasses.replace(self.run, **kw))

    def with_layers(self, n: int) -> "ModelConfig":
        """This config with ``n`` layers (drafters built from the family's block: EAGLE, MTP). Mixed per-layer kinds
        become full attention (a drafter reads its whole short cache); uniform ones are kept. A drafter's blocks
        have keys and values of their own and no per-layer inputs (`Arch.for_drafter`); with experts, every drafter
        block is a sparse one (DeepSeek-V3's MTP layer is)."""
        kinds = set(self.layer_kinds())
        return self.replace(num_layers=n, layer_types=None, arch=self.arch.for_drafter(),
                            sliding_window=self.sliding_window if kinds == {"sliding"} else None)

    def moe_layer(self, i: int) -> bool:
        """Whether layer ``i``'s MLP is the mixture of experts (`Arch.moe_layer`)."""
        return self.arch.moe_layer(i)

    def layer_attention(self, i: int) -> tuple[int, int]:
        """(kv heads, head size) of layer ``i`` (`Arch.layer_attention`)."""
        return self.arch.layer_attention(self, i)

    def kv_source(self, i: int) -> int:
        """The layer whose keys and values layer ``i`` attends with (`Arch.kv_source`)."""
        return self.arch.kv_source(self, i)
