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

from pdecode.model.family import config_to_hf, load_config
from pdecode.config import ModelConfig
from pdecode.errors import CheckpointError
from pdecode.model.transformer import abstract_params, param_specs


def is_orbax_dir(path: Path) -> bool:
    return (Path(path) / "params").is_dir() and (Path(path) / "config.json").exists()


CHUNK_BYTES = 1 << 20


# axes split one index per chunk: a heads / experts axis is what a mesh's model axis divides, and orbax's own choice
# (halving the largest dimension) would leave it whole in a weight under CHUNK_BYTES
PER_INDEX_AXES = ("heads", "kv_heads", "experts")


def _save_args(cfg: ModelConfig, params):
    """Chunks of at most CHUNK_BYTES, a heads / experts axis split one index per chunk: a process of a multi-host
    run restores only the chunks its devices' slices cover, not each whole array."""
    import orbax.checkpoint as ocp

    from pdecode.model.spec import is_spec

    specs = {jax.tree_util.keystr(k): s
             for k, s in jax.tree_util.tree_flatten_with_path(param_specs(cfg), is_leaf=is_spec)[0]}

    def one(path, a):
        spec = specs.get(jax.tree_util.keystr(path))
        axes = () if spec is None or len(spec.axes) != a.ndim else \
            tuple(i for i, name in enumerate(spec.axes) if name in PER_INDEX_AXES)
        return ocp.SaveArgs(chunk_byte_size=CHUNK_BYTES, shard_axes=axes[:1])

    return jax.tree_util.tree_map_with_path(one, params)


def save(cfg: ModelConfig, params, out_dir: str | Path, tokenizer_dir: str | Path | None = None) -> Path:
    import orbax.checkpoint as ocp

    out = Path(out_dir).resolve()
    out.mkdir(parents=True, exist_ok=True)
    if (out / "params").exists():
        shutil.rmtree(out / "params")
    save_args = _save_args(cfg, params)
    with ocp.StandardCheckpointer() as ckptr:
        ckptr.save(out / "params", params, save_args=save_args)
        ckptr.wait_until_finished()
    stored = str(jax.tree.leaves(params)[0].dtype)  # what dtype="auto" restores
    cfg = cfg.replace(dtype=stored) if stored in ("float32", "bfloat16", "float16") else cfg
    (out / "config.json").write_text(json.dumps(config_to_hf(cfg), indent=2) + "\n")
    from pdecode.checkpoint.hf import copy_tokenizer

    copy_tokenizer(tokenizer_dir, out, ("tokenizer.json", "tokenizer_config.json"))
    return out


def restore(path: str | Path, dtype=None, mesh=None, indivisible: str = "error") -> tuple[ModelConfig, dict]:
    """(cfg, params) read straight into their shardings on ``mesh`` (one device without); ``dtype`` None: the
    dtype the checkpoint was saved in (config.json's ``torch_dtype``)."""
    import jax.numpy as jnp
    import orbax.checkpoint as ocp

    path = Path(path).resolve()
    if not is_orbax_dir(path):
        raise CheckpointError(f"{path} is not a pdecode orbax directory (needs config.json and params/)")
    cfg = load_config(path)
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
