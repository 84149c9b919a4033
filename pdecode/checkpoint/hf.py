"""Hugging Face checkpoints, both ways: name/layout rules per family, load into our params, save for transformers.

A rule maps one HF tensor (``{i}`` = layer index) to a path in our params tree and says how the layout
differs. HF linear weights are ``[out, in]``; ours are ``[in, out]`` with heads split out, e.g. ``wq: [D, H, hd]``.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from pdecode.checkpoint.safetensors_io import read_checkpoint_dir, write_safetensors
from pdecode.config import ModelConfig
from pdecode.errors import CheckpointError, ConfigError
from pdecode.model.transformer import param_specs

import jax


class Rule(NamedTuple):
    hf: str  # HF tensor name, "{i}" for the layer index
    ours: str  # "/"-joined path in our params
    layout: str  # plain | linear | heads_in | heads_out | bias_heads


# our decoder block's weights, in order, with their layouts; the names each checkpoint family gives them
_BLOCK = (("layers/attn_norm", "plain"), ("layers/wq", "heads_in"), ("layers/wk", "heads_in"),
          ("layers/wv", "heads_in"), ("layers/wo", "heads_out"), ("layers/mlp_norm", "plain"),
          ("layers/w_gate", "linear"), ("layers/w_up", "linear"), ("layers/w_down", "linear"))
HF_BLOCK_NAMES = ("input_layernorm", "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                  "post_attention_layernorm", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
LLADA_BLOCK_NAMES = ("attn_norm", "q_proj", "k_proj", "v_proj", "attn_out", "ff_norm", "ff_proj", "up_proj",
                     "ff_out")


def block_rules(p: str, names: tuple[str, ...] = HF_BLOCK_NAMES) -> list[Rule]:
    """One decoder block under prefix ``p`` (e.g. "model.layers.{i}."), transformers' names by default."""
    return [Rule(f"{p}{n}.weight", ours, layout) for n, (ours, layout) in zip(names, _BLOCK, strict=True)]


def llama_rules(cfg: ModelConfig, prefix: str = "model.") -> list[Rule]:
    """Llama / Mistral / Qwen2 / Qwen3 names (the layout transformers uses for all four)."""
    p = prefix + "layers.{i}."
    rules = [Rule(prefix + "embed_tokens.weight", "embed", "plain"), *block_rules(p),
             Rule(prefix + "norm.weight", "final_norm", "plain")]
    if cfg.attention_bias:
        rules += [Rule(p + f"self_attn.{n}_proj.bias", f"layers/b{n}", "bias_heads") for n in "qkv"]
    if cfg.qk_norm:
        rules += [Rule(p + "self_attn.q_norm.weight", "layers/q_norm", "plain"),
                  Rule(p + "self_attn.k_norm.weight", "layers/k_norm", "plain")]
    if not cfg.tie_word_embeddings:
        rules.append(Rule("lm_head.weight", "lm_head", "linear"))
    return rules


def llada_rules(cfg: ModelConfig) -> list[Rule]:
    """LLaDA's checkpoint names (``model.transformer.blocks.N.*``); the network is our Llama block, run
    bidirectionally."""
    rules = [Rule("model.transformer.wte.weight", "embed", "plain"),
             *block_rules("model.transformer.blocks.{i}.", LLADA_BLOCK_NAMES),
             Rule("model.transformer.ln_f.weight", "final_norm", "plain")]
    if not cfg.tie_word_embeddings:
        rules.append(Rule("model.transformer.ff_out.weight", "lm_head", "linear"))
    return rules


def rules_for(cfg: ModelConfig) -> list[Rule]:
    return llada_rules(cfg) if cfg.layout == "llada" else llama_rules(cfg)


def _to_ours(a: np.ndarray, layout: str, shape: tuple[int, ...]) -> np.ndarray:
    if layout == "plain":
        return a.reshape(shape)
    if layout == "linear":
        return a.T.reshape(shape)
    if layout == "heads_in":  # [H*hd, D] -> [D, H, hd]
        return a.T.reshape(shape)
    if layout == "heads_out":  # [D, H*hd] -> [H, hd, D]
        return a.T.reshape(shape)
    if layout == "bias_heads":
        return a.reshape(shape)
    raise ValueError(layout)


def _to_hf(a: np.ndarray, layout: str) -> np.ndarray:
    if layout in ("plain",):
        return a
    if layout == "bias_heads":
        return a.reshape(-1)
    if layout in ("linear",):
        return a.T
    if layout == "heads_in":  # [D, H, hd] -> [H*hd, D]
        return a.reshape(a.shape[0], -1).T
    if layout == "heads_out":  # [H, hd, D] -> [D, H*hd]
        return a.reshape(-1, a.shape[-1]).T
    raise ValueError(layout)


def _get(tree: dict, path: str):
    for part in path.split("/"):
        tree = tree[part]
    return tree


def _set(tree: dict, path: str, value):
    parts = path.split("/")
    for part in parts[:-1]:
        tree = tree.setdefault(part, {})
    tree[parts[-1]] = value


def tensors_to_params(tensors: dict[str, np.ndarray], specs: dict, rules: list[Rule], num_layers: int,
                      dtype=None, source: str = "checkpoint") -> dict:
    """Gather HF tensors into a params tree (numpy), checking every name and shape against the spec tree."""
    params: dict = {}
    missing, bad = [], []
    for r in rules:
        spec = _get(specs, r.ours)
        layered = "{i}" in r.hf
        names = [r.hf.format(i=i) for i in range(num_layers)] if layered else [r.hf]
        per_shape = spec.shape[1:] if layered else spec.shape
        parts = []
        for name in names:
            if name not in tensors:
                missing.append(name)
                continue
            a = tensors[name]
            if int(np.prod(a.shape)) != int(np.prod(per_shape)):
                bad.append(f"{name}: checkpoint {tuple(a.shape)} vs config {per_shape}")
                continue
            parts.append(_to_ours(np.asarray(a), r.layout, per_shape))
        if len(parts) == len(names):
            arr = np.stack(parts) if layered else parts[0]
            _set(params, r.ours, arr.astype(dtype) if dtype is not None else arr)
    if missing or bad:
        msg = []
        if missing:
            msg.append(f"missing tensors {missing[:4]}{' ...' if len(missing) > 4 else ''} ({len(missing)} in all)")
        if bad:
            msg.append("shape mismatch: " + "; ".join(bad[:4]))
        raise CheckpointError(f"{source} does not match its config.json: " + "; ".join(msg))
    return params


def params_to_tensors(params: dict, rules: list[Rule], dtype=None) -> dict[str, np.ndarray]:
    out = {}
    for r in rules:
        a = np.asarray(jax.device_get(_get(params, r.ours)))
        if dtype is not None:
            a = a.astype(dtype)
        if "{i}" in r.hf:
            for i in range(a.shape[0]):
                out[r.hf.format(i=i)] = np.ascontiguousarray(_to_hf(a[i], r.layout))
        else:
            out[r.hf] = np.ascontiguousarray(_to_hf(a, r.layout))
    return out


def read_config(path: Path) -> dict[str, Any]:
    f = path / "config.json"
    if not f.exists():
        raise CheckpointError(f"{path} has no config.json (expected an HF model directory)")
    try:
        return json.loads(f.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{f} is not valid JSON: {e}") from None


def load_hf(path: str | Path, dtype=np.float32) -> tuple[ModelConfig, dict]:
    """Read an HF directory (config.json + model.safetensors or sharded with index) -> (cfg, numpy params)."""
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"no model directory at {path}")
    hf_cfg = read_config(path)
    try:
        cfg = ModelConfig.from_hf(hf_cfg)
    except ConfigError as e:
        raise CheckpointError(f"{path}/config.json: {e}") from None
    tensors = read_checkpoint_dir(path)
    if cfg.tie_word_embeddings is False and "lm_head.weight" not in tensors and "model.embed_tokens.weight" in tensors:
        raise CheckpointError(f"{path}: config says untied embeddings but the checkpoint has no lm_head.weight")
    params = tensors_to_params(tensors, param_specs(cfg), rules_for(cfg), cfg.num_layers, dtype, source=str(path))
    # once loaded, the params are ours: saving writes the transformers (Llama/Qwen) naming
    return cfg.replace(layout="hf"), params


def save_hf(cfg: ModelConfig, params: dict, out_dir: str | Path, dtype: str = "float32",
            tokenizer_dir: str | Path | None = None, extra_config: dict | None = None, compress: bool = False) -> Path:
    """Write config.json + model.safetensors (+ tokenizer files copied from ``tokenizer_dir``); ``compress`` writes
    model.safetensors.xz instead (pdecode reads it; `transformers` needs the plain file)."""
    import ml_dtypes

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    np_dtype = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16, "float16": np.float16}[dtype]
    tensors = params_to_tensors(params, llama_rules(cfg), np_dtype)
    write_safetensors(out / "model.safetensors", tensors, metadata={"format": "pt"}, compress=compress)
    hf = cfg.replace(dtype=dtype).to_hf()
    if extra_config:
        hf.update(extra_config)
    (out / "config.json").write_text(json.dumps(hf, indent=2) + "\n")
    gen = {k: v for k, v in (("bos_token_id", hf.get("bos_token_id")), ("eos_token_id", hf.get("eos_token_id")),
                             ("pad_token_id", hf.get("pad_token_id"))) if v is not None}
    (out / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
    if tokenizer_dir is not None:
        for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
            src = Path(tokenizer_dir) / name
            if src.exists() and src.resolve() != (out / name).resolve():
                shutil.copy(src, out / name)
    return out
