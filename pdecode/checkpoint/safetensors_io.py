"""Minimal safetensors reading (memory-mapped, bf16 through ml_dtypes) and writing.

The `safetensors` package's numpy backend cannot read bfloat16, which is what our zoo and most checkpoints
store, so reading is done here; the format is a little-endian u64 header length, a JSON header, then raw bytes.
"""

from __future__ import annotations

import json
import mmap
import struct
from pathlib import Path

import ml_dtypes
import numpy as np

from pdecode.errors import CheckpointError

_DTYPES = {
    "F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16,
    "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8, "BOOL": np.bool_,
}
_NAMES = {np.dtype(v): k for k, v in _DTYPES.items()}


def read_safetensors(path: str | Path) -> dict[str, np.ndarray]:
    """All tensors of one file as read-only numpy views over a memory map."""
    path = Path(path)
    try:
        f = open(path, "rb")
    except OSError as e:
        raise CheckpointError(f"cannot open {path}: {e.strerror}") from None
    with f:
        head = f.read(8)
        if len(head) < 8:
            raise CheckpointError(f"{path} is not a safetensors file (too short)")
        (n,) = struct.unpack("<Q", head)
        try:
            header = json.loads(f.read(n))
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise CheckpointError(f"{path} is not a safetensors file (bad header)") from None
        mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    base = 8 + n
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        dt = _DTYPES.get(info["dtype"])
        if dt is None:
            raise CheckpointError(f"{path}: tensor {name} has unsupported dtype {info['dtype']}")
        lo, hi = info["data_offsets"]
        arr = np.frombuffer(mm, dtype=dt, count=(hi - lo) // np.dtype(dt).itemsize, offset=base + lo)
        out[name] = arr.reshape(info["shape"])
    return out


def write_safetensors(path: str | Path, tensors: dict[str, np.ndarray], metadata: dict[str, str] | None = None):
    header: dict = {}
    if metadata:
        header["__metadata__"] = metadata
    offset = 0
    arrays = []
    for name in sorted(tensors):
        a = np.ascontiguousarray(tensors[name])
        if a.dtype not in _NAMES:
            raise CheckpointError(f"cannot write tensor {name} of dtype {a.dtype}")
        header[name] = {"dtype": _NAMES[a.dtype], "shape": list(a.shape),
                        "data_offsets": [offset, offset + a.nbytes]}
        offset += a.nbytes
        arrays.append(a)
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # align the data section
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for a in arrays:
            f.write(a.tobytes())


def read_checkpoint_dir(path: Path) -> dict[str, np.ndarray]:
    """Tensors of an HF directory: ``model.safetensors``, or the shards named by ``*.safetensors.index.json``."""
    index = sorted(path.glob("*.safetensors.index.json"))
    if index:
        try:
            weight_map = json.loads(index[0].read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError):
            raise CheckpointError(f"{index[0]} is not a valid safetensors index (needs a weight_map)") from None
        tensors: dict[str, np.ndarray] = {}
        for shard in sorted(set(weight_map.values())):
            if not (path / shard).exists():
                raise CheckpointError(f"{index[0].name} names shard {shard}, which is missing from {path}")
            tensors.update(read_safetensors(path / shard))
        return tensors
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"no *.safetensors weights in {path} (pdecode reads HF safetensors checkpoints)")
    tensors = {}
    for f in files:
        tensors.update(read_safetensors(f))
    return tensors
