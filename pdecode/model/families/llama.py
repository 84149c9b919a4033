"""The Llama family: Llama 2/3, Mistral, Qwen2, Qwen3 and pdecode's own models.

A pre-norm block (RMSNorm; attention with GQA, optional q/k/v biases (Qwen2) and per-head q/k RMSNorm (Qwen3);
a SiLU-GLU MLP). Sliding-window attention per layer (Mistral: every layer; Qwen2: the layers ``layer_types``
names).
"""

from __future__ import annotations

from typing import Any

from pdecode.errors import ConfigError
from pdecode.model.family import Family, register


def sliding_from_hf(model_type: str, hf: dict[str, Any], kw: dict[str, Any], always: bool = False) -> None:
    """``sliding_window`` and ``layer_types`` from a config.json: transformers >= 5 lists ``layer_types``
    ("sliding_attention" / "full_attention"); older files switch the window on for every layer (``always``, Mistral)
    or by ``use_sliding_window``. Every layer sliding is stored as layer_types None."""
    window = hf.get("sliding_window")
    types = hf.get("layer_types")
    if types is not None:
        unknown = sorted({t for t in types if t not in ("sliding_attention", "full_attention")})
        if unknown:
            raise ConfigError(f"{model_type}: layer_types {unknown} is not supported (pdecode runs sliding_attention "
                              "and full_attention layers)")
        kinds = tuple("sliding" if t == "sliding_attention" else "full" for t in types)
        if "sliding" in kinds and not window:
            raise ConfigError(f"{model_type}: layer_types has sliding layers but sliding_window is {window!r}")
        if "sliding" not in kinds:
            window = None
    elif window and (always or hf.get("use_sliding_window")):
        kinds = None
    else:
        kinds, window = None, None
    if kinds is not None and len(set(kinds)) == 1:  # uniform: the window (or its absence) says it
        kinds = None
    kw.update(sliding_window=int(window) if window else None, layer_types=kinds)


def sliding_to_hf(cfg, out: dict[str, Any]) -> None:
    out["sliding_window"] = cfg.sliding_window
    if cfg.layer_types is not None:
        out["layer_types"] = [f"{k}_attention" for k in cfg.layer_types]


def check_act(model_type: str, hf: dict[str, Any], allowed=("silu",), key: str = "hidden_act") -> str:
    act = hf.get(key) or allowed[0]
    if act not in allowed:
        raise ConfigError(f"{model_type}: {key} {act!r} is not supported (pdecode runs {', '.join(allowed)})")
    return act


class Llama(Family):
    model_types = ("llama", "mistral", "qwen2", "qwen3")
    architectures = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
                     "qwen3": "Qwen3ForCausalLM"}

    def config_from_hf(self, model_type, hf, kw):
        check_act(model_type, hf)
        if hf.get("mlp_bias"):
            raise ConfigError(f"{model_type}: mlp_bias true is not supported")
        kw.update(attention_bias=bool(hf.get("attention_bias", model_type == "qwen2")),
                  qk_norm=model_type == "qwen3")
        if model_type == "qwen2" and hf.get("layer_types") is None and hf.get("use_sliding_window"):
            # transformers' Qwen2 rule: the layers from max_window_layers on slide
            n, first = kw["num_layers"], int(hf.get("max_window_layers", kw["num_layers"]))
            if first < n:
                hf = {**hf, "layer_types": ["full_attention" if i < first else "sliding_attention" for i in range(n)]}
        sliding_from_hf(model_type, hf, kw, always=model_type == "mistral")

    def config_to_hf(self, cfg, out):
        super().config_to_hf(cfg, out)
        if cfg.family in ("llama", "qwen3"):
            out["attention_bias"] = cfg.attention_bias
        if cfg.family == "llama":
            out["mlp_bias"] = False
        if cfg.family == "mistral":
            out["sliding_window"] = cfg.sliding_window
        if cfg.family in ("qwen2", "qwen3"):
            out["use_sliding_window"] = cfg.sliding_window is not None
            out["max_window_layers"] = 0 if cfg.sliding_window is not None else cfg.num_layers
            sliding_to_hf(cfg, out)
            if cfg.sliding_window is not None and cfg.layer_types is None:
                out["layer_types"] = ["sliding_attention"] * cfg.num_layers

    def layer_specs(self, cfg, num_layers):
        from pdecode.model.transformer import llama_layer_specs

        return llama_layer_specs(cfg, num_layers)

    def block(self, cfg, lp, x, att, cache, layer_idx, write_at, fused):
        from pdecode.model.transformer import llama_block

        return llama_block(cfg, lp, x, att, cache, layer_idx, write_at, fused)

    def block_names(self, cfg):
        from pdecode.model.rules import llama_block_names

        return llama_block_names(cfg)


LLAMA = register(Llama())
