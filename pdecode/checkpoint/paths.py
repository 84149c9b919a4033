"""Where models are found: the zoo's folder, its names, and what a model name or path resolves to."""

from __future__ import annotations

import os
from pathlib import Path

from pdecode.checkpoint import gguf_io
from pdecode.errors import CheckpointError


def zoo_dir() -> Path:
    """Where the shipped models live: ``$PDECODE_ZOO`` or the repository's ``zoo/``."""
    env = os.environ.get("PDECODE_ZOO")
    return Path(env) if env else Path(__file__).resolve().parents[2] / "zoo"


def zoo_names() -> list[str]:
    d = zoo_dir()
    if not d.is_dir():
        return []
    return sorted(p.name for p in d.iterdir() if (p / "config.json").exists() or (p / "heads.json").exists())


def resolve_path(name_or_path: str | os.PathLike) -> Path:
    """A model directory, a GGUF file, a zoo folder, or the GGUF file of a real model installed as a wheel
    (`gguf_io.WHEEL_MODELS`: ``smollm2-135m-instruct``)."""
    p = Path(name_or_path)
    if p.is_dir() or gguf_io.is_gguf(p):
        return p
    z = zoo_dir() / str(name_or_path)
    if z.is_dir():
        return z
    if str(name_or_path) in gguf_io.WHEEL_MODELS:
        return gguf_io.wheel_model(str(name_or_path))
    names = zoo_names() + list(gguf_io.WHEEL_MODELS)
    avail = ", ".join(names)
    if p.exists():
        raise CheckpointError(f"{p} is a file but not a GGUF file; pass a model directory (config.json + "
                              "*.safetensors) or a .gguf file")
    import difflib

    close = difflib.get_close_matches(str(name_or_path), names, n=1)
    hint = f"did you mean {close[0]}? " if close else ""
    raise CheckpointError(f"no model {str(name_or_path)!r}: not a directory and not a zoo name; {hint}(zoo: {avail})")
