"""Drafting heads on disk: pdecode's own format, and importers for the public Medusa / EAGLE / DeepSeek-V3 MTP
layouts.

pdecode format: a directory with ``heads.json`` (``{"kind": "medusa"|"eagle"|"mtp", "config": {...},
"base_model": <zoo name or path of the target>}``) and ``heads.safetensors`` (our params, "/"-joined names).
`pdecode.load(dir)` on such a directory loads the base model and attaches the heads (``model.extras[kind]``).

Layout mappings of the public releases (see README "Checkpoint interop"):

* Medusa (``medusa_lm_head.safetensors``): ``{k}.{j}.linear.weight [D, D]`` / ``.bias [D]`` -> our ``w[k, j]``
  (transposed) / ``b[k, j]``; ``{k}.{n}.weight [V, D]`` (the head's own LM head) -> ``lm_head[k]`` (transposed).
* EAGLE-1/2 (``pytorch_model.bin`` converted to safetensors): ``fc.weight [D, 2D]`` (+ ``fc.bias``) over
  [embedding; feature] -> ``fc`` (transposed); ``layers.0.*`` named like a Llama layer -> our block (EAGLE-1 has no
  ``input_layernorm`` in its single layer: imported as ones).
* DeepSeek-V3 MTP (layer ``model.layers.{L}`` with L = num_hidden_layers): ``enorm``, ``hnorm``, ``eh_proj.weight
  [D, 2D]`` over [enorm(emb); hnorm(h)] (embedding first: ``emb_first=True``), the usual decoder-layer names,
  ``shared_head.norm`` -> our module ``norm``; ``shared_head.head`` / ``embed_tokens`` are the target's (shared).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import jax
import numpy as np

from pdecode.checkpoint.hf import params_to_tensors, tensors_to_params
from pdecode.checkpoint.safetensors_io import (CheckpointTensors, Renamed, read_checkpoint_dir, read_safetensors,
                                              stored_path, write_safetensors)
from pdecode.config import ModelConfig
from pdecode.errors import CheckpointError
from pdecode.model.groups import LayerGroups
from pdecode.model.heads import EagleConfig, EditConfig, ExitConfig, MedusaConfig, MTPConfig

KINDS = {"medusa": MedusaConfig, "eagle": EagleConfig, "mtp": MTPConfig, "edit": EditConfig,
         "layerskip": ExitConfig}


def head_config(kind: str, config: dict):
    if kind not in KINDS:
        raise CheckpointError(f"unknown head kind {kind!r}; expected one of {', '.join(KINDS)}")
    cls = KINDS[kind]
    fields = {f.name for f in dataclasses.fields(cls)}
    unknown = set(config) - fields
    if unknown:
        raise CheckpointError(f"{kind} head config has unknown fields {sorted(unknown)}")
    cfg = {k: tuple(v) if isinstance(v, list) else v for k, v in config.items()}
    return cls(**cfg)


def _flatten(tree, prefix=""):
    out = {}
    if isinstance(tree, dict):
        for k, v in tree.items():
            out.update(_flatten(v, f"{prefix}{k}/"))
    elif isinstance(tree, (list, tuple)):
        for i, v in enumerate(tree):
            out.update(_flatten(v, f"{prefix}{i}/"))
    else:
        out[prefix[:-1]] = np.asarray(jax.device_get(tree))
    return out


def _template(hcfg, cfg: ModelConfig):
    """The heads' params tree with unallocated arrays of the shapes ``cfg`` needs (for `_unflatten_like`)."""
    from pdecode.model.spec import is_spec

    return jax.tree.map(lambda s: np.empty(s.shape, np.float32), hcfg.specs(cfg), is_leaf=is_spec)


def _unflatten_like(flat: dict, template):
    def build(t, prefix):
        if isinstance(t, dict):
            return {k: build(v, f"{prefix}{k}/") for k, v in t.items()}
        if isinstance(t, LayerGroups):  # groups of stacked layers (`pdecode.model.groups`)
            return LayerGroups([tuple(build(v, f"{prefix}{g}/{u}/") for u, v in enumerate(grp))
                                for g, grp in enumerate(t)], t.plan)
        if hasattr(t, "fused"):  # a tuple of per-layer dicts (`transformer.DecodeLayers`: Gemma 4's blocks)
            return type(t)([build(v, f"{prefix}{i}/") for i, v in enumerate(t)], t.fused)
        if isinstance(t, (list, tuple)):
            return [build(v, f"{prefix}{i}/") for i, v in enumerate(t)]
        name = prefix[:-1]
        if name not in flat:
            raise CheckpointError(f"heads checkpoint lacks tensor {name!r}")
        a = flat[name]
        if tuple(a.shape) != tuple(t.shape):
            raise CheckpointError(f"heads tensor {name!r} has shape {tuple(a.shape)}, the model needs {t.shape} "
                                  "(heads trained for another model?)")
        return a

    return build(template, "")


def save_heads(out_dir: str | Path, kind: str, hcfg, params, base_model: str, dtype=None,
               extra: dict | None = None, compress: bool = False) -> Path:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    flat = {k: _stored(v, dtype) for k, v in _flatten(params).items()}
    write_safetensors(out / "heads.safetensors", flat, metadata={"format": "pdecode-heads"}, compress=compress)
    meta = {"kind": kind, "config": dataclasses.asdict(hcfg), "base_model": base_model, **(extra or {})}
    (out / "heads.json").write_text(json.dumps(meta, indent=1) + "\n")
    return out


def is_heads_dir(path: Path) -> bool:
    return (Path(path) / "heads.json").exists()


def load_heads(path: str | Path, cfg: ModelConfig, dtype=np.float32):
    """(kind, head config, params as numpy, metadata) of a pdecode heads directory, checked against ``cfg``."""
    path = Path(path)
    try:
        meta = json.loads((path / "heads.json").read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise CheckpointError(f"cannot read {path}/heads.json: {e}") from None
    kind = meta.get("kind")
    hcfg = head_config(kind, meta.get("config", {}))
    flat = read_safetensors(path / "heads.safetensors")
    try:
        params = _unflatten_like(flat, _template(hcfg, cfg))
    except CheckpointError as e:
        base = meta.get("base_model")
        raise CheckpointError(f"{path}: {e}: these {kind} heads belong to another model"
                              f"{f' ({base!r})' if base and base != '.' else ''}, not this {cfg.family} model "
                              f"(hidden {cfg.hidden_size}, {cfg.num_layers} layers); train heads for it with "
                              f"`pdecode train heads --base <this model>`") from None
    params = jax.tree.map(lambda a: _as_dtype(a, dtype), params)
    return kind, hcfg, params, meta


def _stored(a: np.ndarray, dtype):
    """A tensor as written: floats in ``dtype`` (None: as they are); integer buffers as released EAGLE-3 checkpoints
    store their d2t (int64); bool buffers (t2d) as they are."""
    if np.issubdtype(a.dtype, np.integer):
        return a.astype(np.int64)
    return a.astype(dtype) if dtype is not None and np.issubdtype(a.dtype, np.floating) else a


def _as_dtype(a, dtype):
    """A float tensor in ``dtype``; integer / bool buffers (vocabulary maps) as int32 / bool."""
    a = np.asarray(a)
    if a.dtype == bool:
        return a
    if np.issubdtype(a.dtype, np.integer):
        return a.astype(np.int32)
    return a.astype(dtype)


# ------------------------------------------------------------------------------------------------ public layouts
def import_medusa(tensors: dict[str, np.ndarray], num_heads: int, num_layers: int, dtype=np.float32):
    """Public Medusa head weights -> (MedusaConfig with its own heads, params)."""
    w, b, heads = [], [], []
    try:
        for k in range(num_heads):
            w.append([tensors[f"{k}.{j}.linear.weight"].T for j in range(num_layers)])
            b.append([tensors[f"{k}.{j}.linear.bias"] for j in range(num_layers)])
            heads.append(tensors[f"{k}.{num_layers}.weight"].T)
    except KeyError as e:
        raise CheckpointError(f"not a Medusa head checkpoint with {num_heads} heads x {num_layers} layers: "
                              f"missing {e.args[0]!r}") from None
    mcfg = MedusaConfig(num_heads=num_heads, num_layers=num_layers, own_head=True)
    params = {"w": np.asarray(w, dtype), "b": np.asarray(b, dtype), "lm_head": np.asarray(heads, dtype)}
    return mcfg, params


def _head_block(cfg: ModelConfig, prefix: str) -> list:
    """The tensor rules of a drafter's one decoder block under ``prefix``: the base family's block (biases, q/k
    norms, its own norm and MLP names), as the drafter was built from it."""
    from pdecode.model.family import family_of

    return family_of(cfg).head_block_rules(cfg.with_layers(1), prefix)


def import_eagle(tensors: dict[str, np.ndarray], cfg: ModelConfig, dtype=np.float32):
    """Public EAGLE-1/2 drafter weights (fc over [embedding; feature], optional fc bias, one Llama layer) ->
    (EagleConfig, params)."""
    ecfg = EagleConfig(fc_bias="fc.bias" in tensors)
    tensors = dict(tensors)
    if "layers.0.input_layernorm.weight" not in tensors:  # EAGLE-1 skips the first layer's input norm
        tensors["layers.0.input_layernorm.weight"] = np.ones((cfg.hidden_size,), np.float32)
    specs = ecfg.specs(cfg)
    layer = tensors_to_params(tensors, {"layers": specs["layers"]}, _head_block(cfg, "layers.{i}."), 1, dtype,
                              source="EAGLE checkpoint")
    if "fc.weight" not in tensors:
        raise CheckpointError("not an EAGLE drafter checkpoint: missing 'fc.weight'")
    fc = tensors["fc.weight"]
    if fc.shape != (cfg.hidden_size, 2 * cfg.hidden_size):
        raise CheckpointError(f"EAGLE fc.weight is {fc.shape}, the target needs ({cfg.hidden_size}, "
                              f"{2 * cfg.hidden_size})")
    params = {"fc": np.asarray(fc.T, dtype), "layers": layer["layers"]}
    if ecfg.fc_bias:
        params["fc_b"] = np.asarray(tensors["fc.bias"], dtype)
    return ecfg, params


def import_deepseek_mtp(tensors: dict[str, np.ndarray], cfg: ModelConfig, layer_index: int | None = None,
                        dtype=np.float32):
    """DeepSeek-V3-style MTP layer (``model.layers.{L}.{enorm,hnorm,eh_proj,...}``) -> (MTPConfig, params)."""
    L = cfg.num_layers if layer_index is None else layer_index
    p = f"model.layers.{L}."
    need = [p + "enorm.weight", p + "hnorm.weight", p + "eh_proj.weight", p + "shared_head.norm.weight"]
    missing = [n for n in need if n not in tensors]
    if missing:
        raise CheckpointError(f"not a DeepSeek-V3 MTP layer at index {L}: missing {missing}")
    mcfg = MTPConfig(num_modules=1, kind="sequential", emb_first=True)
    # the layer's decoder-block tensors, renamed to index 0 so the generic per-layer rules apply
    renamed = Renamed(tensors, {"model.layers.0." + k[len(p):]: k for k in tensors if k.startswith(p)},
                      prefixes=("model.layers.0.", p))
    layer = tensors_to_params(renamed, {"layers": mcfg.specs(cfg)["modules"][0]["layers"]},
                              _head_block(cfg, "model.layers.{i}."), 1, dtype, source="MTP layer")
    eh = np.asarray(tensors[p + "eh_proj.weight"])
    if eh.shape != (cfg.hidden_size, 2 * cfg.hidden_size):
        raise CheckpointError(f"eh_proj.weight is {eh.shape}, the target needs ({cfg.hidden_size}, "
                              f"{2 * cfg.hidden_size})")
    mod = {"layers": layer["layers"], "enorm": np.asarray(tensors[p + "enorm.weight"], dtype),
           "hnorm": np.asarray(tensors[p + "hnorm.weight"], dtype), "proj": np.asarray(eh.T, dtype),
           "norm": np.asarray(tensors[p + "shared_head.norm.weight"], dtype)}
    return mcfg, {"modules": [mod]}


def export_deepseek_mtp(mcfg: MTPConfig, params, cfg: ModelConfig) -> dict[str, np.ndarray]:
    """Our first sequential MTP module in DeepSeek-V3's naming (layer index = num_layers)."""
    if mcfg.kind != "sequential" or not mcfg.emb_first:
        raise CheckpointError("DeepSeek-V3's MTP layout holds a sequential module reading [enorm(emb); hnorm(h)]: train "
                              "it with MTPConfig(kind='sequential', emb_first=True)")
    p = f"model.layers.{cfg.num_layers}."
    mod = params["modules"][0]
    block = params_to_tensors({"layers": mod["layers"]}, _head_block(cfg, "model.layers.{i}."))
    out = {p + k[len("model.layers.0."):]: v for k, v in block.items()}
    out[p + "enorm.weight"] = np.asarray(mod["enorm"])
    out[p + "hnorm.weight"] = np.asarray(mod["hnorm"])
    out[p + "eh_proj.weight"] = np.asarray(mod["proj"]).T
    out[p + "shared_head.norm.weight"] = np.asarray(mod["norm"])
    return out


# ------------------------------------------------------------------------------------------------ released dirs
def has_mtp_layer(path: str | Path, cfg: ModelConfig) -> bool:
    """Whether an HF model directory carries its own MTP layer: its config.json declares
    ``num_nextn_predict_layers`` and ``model.layers.{num_layers}.eh_proj.weight`` is there (DeepSeek-V3 / R1,
    GLM-4.5 releases; transformers drops these tensors when it loads the model)."""
    path = Path(path)
    conf = path / "config.json"
    try:  # only a config that declares MTP layers is worth a scan of the tensor headers (done at every load)
        declared = int(json.loads(conf.read_text()).get("num_nextn_predict_layers") or 0) if conf.exists() else 0
    except (json.JSONDecodeError, TypeError, ValueError, AttributeError):
        declared = 0
    if not declared or not list(path.glob("*.safetensors*")):
        return False
    return f"model.layers.{cfg.num_layers}.eh_proj.weight" in CheckpointTensors(path)

def load_released(path: str | Path, cfg: ModelConfig, dtype=np.float32):
    """(kind, head config, params, metadata) of a released head checkpoint directory, recognised by its tensors:

    * Medusa: ``medusa_lm_head.safetensors`` (+ config.json with ``medusa_num_heads`` / ``medusa_num_layers``;
      without it they are counted from the tensor names);
    * EAGLE-1/2: safetensors holding ``fc.weight`` and ``layers.0.*``;
    * DeepSeek-V3 MTP: safetensors holding ``model.layers.{num_layers}.eh_proj.weight`` (e.g. the base model's own
      directory, whose extra layer is the MTP module).
    """
    path = Path(path)
    medusa = stored_path(path / "medusa_lm_head.safetensors")
    if medusa.exists():
        tensors = read_safetensors(medusa)
        conf = {}
        if (path / "config.json").exists():
            conf = json.loads((path / "config.json").read_text())
        try:
            heads = conf.get("medusa_num_heads") or 1 + max(int(k.split(".")[0]) for k in tensors)
            layers = conf.get("medusa_num_layers") or max(int(k.split(".")[1]) for k in tensors)
        except (ValueError, IndexError):
            raise CheckpointError(f"{medusa} has tensors not named '{{head}}.{{layer}}.*' (Medusa's layout); add a "
                                  "config.json with medusa_num_heads and medusa_num_layers") from None
        mcfg, params = import_medusa(tensors, int(heads), int(layers), dtype)
        params = _unflatten_like(_flatten(params), _template(mcfg, cfg))  # shapes checked against the base
        return "medusa", mcfg, params, {"source": "medusa release"}
    if not list(path.glob("*.safetensors*")):
        raise CheckpointError(f"{path} holds no heads.json and no safetensors: pass a pdecode heads directory or a "
                              "released Medusa / EAGLE / DeepSeek-MTP checkpoint directory (safetensors; convert a "
                              "pytorch_model.bin first)")
    tensors = read_checkpoint_dir(path)
    if "d2t" in tensors or any(k.startswith("midlayer.") for k in tensors):
        raise CheckpointError(f"{path} is an EAGLE-3 release (midlayer.*, d2t: [norm(emb); norm(h)] into the "
                              "attention and a reduced draft vocabulary): that layout is not importable; pdecode's "
                              "EAGLE-3-style heads are trained here (docs/heads.md)")
    if "fc.weight" in tensors:
        ecfg, params = import_eagle(tensors, cfg, dtype)
        return "eagle", ecfg, params, {"source": "eagle release"}
    if f"model.layers.{cfg.num_layers}.eh_proj.weight" in tensors:
        mcfg, params = import_deepseek_mtp(CheckpointTensors(path), cfg, dtype=dtype)  # fp8 layers dequantized
        return "mtp", mcfg, params, {"source": "deepseek-v3 mtp layer"}
    raise CheckpointError(f"{path} is not a head checkpoint pdecode knows: no heads.json, no medusa_lm_head, no EAGLE "
                          f"fc.weight and no MTP layer model.layers.{cfg.num_layers}.eh_proj.weight")
