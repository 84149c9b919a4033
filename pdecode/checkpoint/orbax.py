"""Orbax save/restore of params (sharded-ready).

A pdecode orbax model directory holds ``config.json`` (HF-style, so the architecture is readable by anyone),
tokenizer files, and ``params/`` written by orbax's StandardCheckpointer. Restoring takes an optional mesh: each
array is read straight into its NamedSharding (no full copy on one host first).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import jax

from pdecode.config import ModelConfig
from pdecode.errors import CheckpointError
from pdecode.model.transformer import abstract_params, param_specs


def is_orbax_dir(path: Path) -> bool:
    return (Path(path) / "params").is_dir() and (Path(path) / "config.json").exists()


CHUNK_BYTES = 1 << 20


def save(cfg: ModelConfig, params, out_dir: str | Path, tokenizer_dir: str | Path | None = None) -> Path:
    import orbax.checkpoint as ocp

    out = Path(out_dir).resolve()
    out.mkdir(parents=True, exist_ok=True)
    if (out / "params").exists():
        shutil.rmtree(out / "params")
    # chunks of at most CHUNK_BYTES: a process of a multi-host run restores only the chunks its devices' slices
    # cover, not each whole array
    save_args = jax.tree.map(lambda _: ocp.SaveArgs(chunk_byte_size=CHUNK_BYTES), params)
    with ocp.StandardCheckpointer() as ckptr:
        ckptr.save(out / "params", params, save_args=save_args)
        ckptr.wait_until_finished()
    stored = str(jax.tree.leaves(params)[0].dtype)  # what dtype="auto" restores
    cfg = cfg.replace(dtype=stored) if stored in ("float32", "bfloat16", "float16") else cfg
    (out / "config.json").write_text(json.dumps(cfg.to_hf(), indent=2) + "\n")
    if tokenizer_dir is not None:
        for name in ("tokenizer.json", "tokenizer_config.json"):
            src = Path(tokenizer_dir) / name
            if src.exists() and src.resolve() != (out / name).resolve():
                shutil.copy(src, out / name)
    return out


def restore(path: str | Path, dtype=None, mesh=None, indivisible: str = "error") -> tuple[ModelConfig, dict]:
    """(cfg, params) read straight into their shardings on ``mesh`` (one device without); ``dtype`` None: the
    dtype the checkpoint was saved in (config.json's ``torch_dtype``)."""
    import jax.numpy as jnp
    import orbax.checkpoint as ocp

    path = Path(path).resolve()
    if not is_orbax_dir(path):
        raise CheckpointError(f"{path} is not a pdecode orbax directory (needs config.json and params/)")
    cfg = ModelConfig.load(path)
    abstract = abstract_params(cfg, dtype or jnp.dtype(cfg.dtype))
    if mesh is not None:
        from pdecode.sharding import param_shardings

        shard = param_shardings(param_specs(cfg), mesh, indivisible=indivisible)
        abstract = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract, shard)
    try:
        with ocp.StandardCheckpointer() as ckptr:
            params = ckptr.restore(path / "params", abstract)
    except (ValueError, KeyError) as e:
        raise CheckpointError(f"{path}/params does not match its config.json: {str(e).splitlines()[0]}") from None
    return cfg, params
