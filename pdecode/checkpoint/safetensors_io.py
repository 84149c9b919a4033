"""Minimal safetensors reading (memory-mapped, bf16 through ml_dtypes) and writing.

The `safetensors` package's numpy backend cannot read bfloat16, which is what our zoo and most checkpoints
store, so reading is done here; the format is a little-endian u64 header length, a JSON header, then raw bytes.

A file may also be stored xz-compressed as ``<name>.safetensors.xz`` (stdlib ``lzma``; bf16 weights shrink to
about 71%). The zoo keeps its later models (heads, the native-MTP target, code-dllm) that way so the whole zoo
stays small; ``code-target`` and ``code-draft`` stay plain so `transformers` reads them as they are. Reading
decompresses into memory; asking for ``x.safetensors`` finds ``x.safetensors.xz`` when only that exists.
"""

from __future__ import annotations

import json
import lzma
import mmap
import struct
from pathlib import Path

import ml_dtypes
import numpy as np

from pdecode.errors import CheckpointError

_DTYPES = {
    "F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16,
    "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8, "BOOL": np.bool_,
    "F8_E4M3": ml_dtypes.float8_e4m3fn,
}
_NAMES = {np.dtype(v): k for k, v in _DTYPES.items()}


XZ = ".xz"


def stored_path(path: str | Path) -> Path:
    """The file that holds ``path``: itself, or its ``.xz``-compressed form when only that exists."""
    path = Path(path)
    xz = path.with_name(path.name + XZ)
    return xz if not path.exists() and xz.exists() else path


def _load(path: Path, spans: dict | None = None) -> tuple[dict[str, np.ndarray], dict | None]:
    """(tensors as read-only numpy views over a memory map or the decompressed bytes of .xz, the header's
    __metadata__) of one safetensors file, plain or .xz. ``spans`` (if given) receives name -> (buffer, start,
    nbytes) of each tensor, for `CheckpointTensors.release`."""
    try:
        f = open(path, "rb")
    except OSError as e:
        raise CheckpointError(f"cannot open {path}: {e.strerror}") from None
    with f:
        if path.name.endswith(XZ):
            try:
                buf = lzma.decompress(f.read())
            except lzma.LZMAError as e:
                raise CheckpointError(f"{path} is not a valid xz file: {e}") from None
        else:
            buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) if path.stat().st_size else b""
    if len(buf) < 8:
        raise CheckpointError(f"{path} is not a safetensors file (too short)")
    (n,) = struct.unpack("<Q", buf[:8])
    if 8 + n > len(buf):
        raise CheckpointError(f"{path} is truncated or not a safetensors file: its header claims {n} bytes, the file "
                              f"has {len(buf)}; copy or download it again")
    try:
        header = json.loads(bytes(buf[8: 8 + n]))
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise CheckpointError(f"{path} is not a safetensors file (bad header)") from None
    base = 8 + n
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        dt = _DTYPES.get(info["dtype"])
        if dt is None:
            raise CheckpointError(f"{path}: tensor {name} has unsupported dtype {info['dtype']}")
        lo, hi = info["data_offsets"]
        if base + hi > len(buf):
            raise CheckpointError(f"{path} is truncated: tensor {name} ends at byte {base + hi}, the file has "
                                  f"{len(buf)} bytes; copy or download it again")
        need = int(np.prod(info["shape"])) * np.dtype(dt).itemsize
        if hi - lo != need:
            raise CheckpointError(f"{path} is corrupt: tensor {name} spans {hi - lo} bytes, its shape "
                                  f"{info['shape']} and dtype {info['dtype']} need {need}")
        arr = np.frombuffer(buf, dtype=dt, count=(hi - lo) // np.dtype(dt).itemsize, offset=base + lo)
        out[name] = arr.reshape(info["shape"])
        if spans is not None:
            spans[name] = (buf, base + lo, hi - lo)
    return out, header.get("__metadata__")


def read_safetensors(path: str | Path) -> dict[str, np.ndarray]:
    """All tensors of one file (``path`` or, when only that exists, ``path.xz``) as read-only numpy views."""
    return _load(stored_path(path))[0]


def write_safetensors(path: str | Path, tensors: dict[str, np.ndarray], metadata: dict[str, str] | None = None,
                      compress: bool = False) -> Path:
    """Write ``path`` (or ``path.xz``, xz-compressed, when ``compress``); a stale copy in the other form is removed.
    Returns the path written."""
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
    path = Path(path)
    xz = path.with_name(path.name + XZ)
    if compress:
        data = struct.pack("<Q", len(blob)) + blob + b"".join(a.tobytes() for a in arrays)
        xz.write_bytes(lzma.compress(data, preset=9 | lzma.PRESET_EXTREME))
        path.unlink(missing_ok=True)
        return xz
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for a in arrays:
            f.write(a.tobytes())
    xz.unlink(missing_ok=True)
    return path


def compress_file(path: str | Path) -> Path:
    """Rewrite a plain .safetensors file as .safetensors.xz (same tensors and metadata); returns the new path."""
    path = Path(path)
    if path.name.endswith(XZ) or not path.is_file():
        raise CheckpointError(f"compress_file needs a plain .safetensors file, got {path}")
    tensors, meta = _load(path)
    return write_safetensors(path, {k: np.array(v) for k, v in tensors.items()}, meta, compress=True)


def read_checkpoint_dir(path: Path, spans: dict | None = None) -> dict[str, np.ndarray]:
    """Tensors of an HF directory: ``model.safetensors``, or the shards named by ``*.safetensors.index.json``
    (read-only views; nothing is read from disk until a tensor is touched)."""
    index = sorted(path.glob("*.safetensors.index.json"))
    if index:
        try:
            weight_map = json.loads(index[0].read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError):
            raise CheckpointError(f"{index[0]} is not a valid safetensors index (needs a weight_map)") from None
        tensors: dict[str, np.ndarray] = {}
        for shard in sorted(set(weight_map.values())):
            if not stored_path(path / shard).exists():
                raise CheckpointError(f"{index[0].name} names shard {shard}, which is missing from {path}")
            tensors.update(_load(stored_path(path / shard), spans)[0])
        return tensors
    plain = sorted(path.glob("*.safetensors"))
    # a plain file wins over an .xz of the same name (as in stored_path); heads files are not model weights
    files = plain + [f for f in sorted(path.glob("*.safetensors" + XZ)) if not f.with_suffix("").exists()]
    files = [f for f in files if not f.name.startswith("heads.safetensors")]
    if not files:
        raise CheckpointError(f"no *.safetensors weights in {path} (pdecode reads HF safetensors checkpoints)")
    tensors = {}
    for f in files:
        tensors.update(_load(f, spans)[0])
    return tensors


def dequantize_blocks(w: np.ndarray, scale_inv: np.ndarray, block: tuple[int, int]) -> np.ndarray:
    """A block-quantized weight [out, in] (fp8) times its per-block scales [ceil(out / bo), ceil(in / bi)], in
    float32 (DeepSeek-V3's ``weight_scale_inv``: the factor that takes the stored values back to the weight)."""
    bo, bi = block
    out, inn = w.shape[-2:]
    want = (-(-out // bo), -(-inn // bi))
    if tuple(scale_inv.shape[-2:]) != want:
        raise CheckpointError(f"a block-quantized weight {tuple(w.shape)} with blocks {block} needs scales {want}, the "
                              f"checkpoint has {tuple(scale_inv.shape)}")
    s = np.repeat(np.repeat(np.asarray(scale_inv, np.float32), bo, axis=-2), bi, axis=-1)[..., :out, :inn]
    return np.asarray(w, np.float32) * s


def quant_block(path: Path) -> tuple[int, int] | None:
    """The weight block of an fp8 block-quantized checkpoint (config.json's quantization_config), or None."""
    f = Path(path) / "config.json"
    if not f.exists():
        return None
    try:
        q = json.loads(f.read_text()).get("quantization_config") or {}
    except json.JSONDecodeError:
        return None
    if q.get("quant_method") != "fp8":
        return None
    b = q.get("weight_block_size") or [128, 128]
    return int(b[0]), int(b[1])


SCALE_SUFFIX = "_scale_inv"


class CheckpointTensors:
    """The tensors of an HF directory, read lazily from memory maps: ``tensors[name]`` is a read-only view, and
    ``release(name)`` tells the kernel the tensor's pages are no longer needed (``MADV_DONTNEED``), so a loader that
    releases each tensor once it is on its devices never holds more than a few tensors' pages resident on the host,
    whatever the checkpoint's size. (An .xz file is decompressed into memory whole; release is then a no-op.)

    An fp8 block-quantized checkpoint (``quantization_config.quant_method`` "fp8": DeepSeek-V3's release) gives each
    quantized weight dequantized to float32 with its ``<name>_scale_inv`` block scales as it is read
    (`dequantize_blocks`), one tensor at a time."""

    def __init__(self, path: Path):
        self._spans: dict = {}
        self.tensors = read_checkpoint_dir(Path(path), self._spans)
        self.block = quant_block(Path(path))
        self._base: dict = {}  # id(buffer) -> its address (memory maps)
        self._runs: dict = {}  # id(buffer) -> [(first page, last page)] of what the loader read
        self.slice_bytes = 0
        self.aliases: dict = {}  # a name the rules use -> the name the file stores it under (tied weights)

    def alias(self, aliases: dict) -> None:
        """Answer for each name in ``aliases`` with the tensor stored under its value (`Family.tensor_aliases`)."""
        self.aliases.update({k: v for k, v in aliases.items() if k not in self.tensors and v in self.tensors})

    def _name(self, name: str) -> str:
        return name if name in self.tensors else self.aliases.get(name, name)

    def note_read(self, name: str, view: np.ndarray) -> None:
        """Account for the loader reading ``view`` (of tensor ``name``): its bytes, and the memory map's pages it
        touches (what the kernel reads from the file). A view that is not over the map (an fp8 weight dequantized,
        an .xz file decompressed) counts its tensor whole."""
        buf, start, n = self._spans.get(self._name(name), (None, 0, 0))
        if buf is None:
            return
        if id(buf) not in self._base:
            self._base[id(buf)] = np.frombuffer(buf, np.uint8, count=1).__array_interface__["data"][0] \
                if len(buf) else 0
        base = self._base[id(buf)]
        addr = view.__array_interface__["data"][0] - base if view.size else start
        runs = self._runs.setdefault(id(buf), [])
        if not isinstance(buf, mmap.mmap) or not start <= addr < start + n:
            self.slice_bytes += n
            runs.append((np.asarray([start // mmap.PAGESIZE]), np.asarray([(start + n - 1) // mmap.PAGESIZE])))
            return
        self.slice_bytes += view.nbytes
        lo, hi = byte_runs(view, addr)
        runs.append((lo // mmap.PAGESIZE, (hi - 1) // mmap.PAGESIZE))

    def read_stats(self) -> dict:
        """What the loader read so far: ``slice_bytes`` (the bytes of the slices it gathered), ``page_bytes`` (the
        file pages those slices touch, each counted once) and ``checkpoint_bytes`` (every tensor's bytes)."""
        pages = 0
        for runs in self._runs.values():
            lo = np.concatenate([r[0] for r in runs])
            hi = np.concatenate([r[1] for r in runs])
            order = np.argsort(lo, kind="stable")
            lo, hi = lo[order], hi[order]
            reach = np.maximum.accumulate(hi)  # pages of a sorted list of page ranges, overlaps counted once
            prev = np.concatenate([[-1], reach[:-1]])
            pages += int(np.clip(hi - np.maximum(lo, prev + 1) + 1, 0, None).sum())
        return {"slice_bytes": int(self.slice_bytes), "page_bytes": pages * mmap.PAGESIZE,
                "checkpoint_bytes": int(sum(n for _, _, n in self._spans.values()))}

    def __contains__(self, name: str) -> bool:
        return self._name(name) in self.tensors

    def __iter__(self):
        return iter(self.tensors)

    def shape_of(self, name: str) -> tuple:
        return tuple(self.tensors[self._name(name)].shape)

    def __getitem__(self, name: str) -> np.ndarray:
        name = self._name(name)
        a = self.tensors[name]
        scale = name + SCALE_SUFFIX
        if self.block is not None and a.dtype == ml_dtypes.float8_e4m3fn and scale in self.tensors:
            return dequantize_blocks(a, self.tensors[scale], self.block)
        if a.dtype == ml_dtypes.float8_e4m3fn:
            raise CheckpointError(f"tensor {name} is fp8 with no block scales ({scale}) and quantization_config "
                                  "fp8; pdecode reads fp8 weights of block-quantized checkpoints only")
        return a

    def release(self, name: str) -> None:
        name = self._name(name)
        if name + SCALE_SUFFIX in self.tensors:
            self.release(name + SCALE_SUFFIX)
        buf, start, n = self._spans.get(name, (None, 0, 0))
        if not isinstance(buf, mmap.mmap) or n == 0 or not hasattr(mmap, "MADV_DONTNEED"):
            return
        lo = start - start % mmap.PAGESIZE
        hi = start + n + (-(start + n)) % mmap.PAGESIZE
        try:  # pages shared with a neighbouring tensor are simply read again when touched
            buf.madvise(mmap.MADV_DONTNEED, lo, min(hi, len(buf)) - lo)
        except (OSError, ValueError):
            pass


def byte_runs(view: np.ndarray, offset: int) -> tuple[np.ndarray, np.ndarray]:
    """(starts, ends) of the contiguous byte runs a strided ``view`` covers, ``offset`` its first byte's position:
    the innermost unit-stride axis is one run per index of the other axes."""
    isz = view.itemsize
    shape, strides = list(view.shape), list(view.strides)
    run = isz
    inner = [i for i, (d, st) in enumerate(zip(shape, strides)) if st == isz and d > 1]
    if inner:
        i = inner[0]
        run = shape[i] * isz
        del shape[i], strides[i]
    if int(np.prod(shape)) > 1 << 22:  # too many runs to list (an interleaved half): the whole extent
        end = offset + sum((d - 1) * st for d, st in zip(shape, strides)) + run
        return np.asarray([offset], np.int64), np.asarray([end], np.int64)
    starts = np.asarray([offset], np.int64)
    for d, st in zip(shape, strides):
        if d > 1:
            starts = (starts[:, None] + np.arange(d, dtype=np.int64)[None, :] * st).reshape(-1)
    return starts, starts + run


class Renamed:
    """A read-only view of a tensor mapping under other names (``names``: new -> old), read lazily; ``prefixes``
    (new prefix, stored prefix) names a tensor that is not there as the checkpoint would store it (`stored_name`)."""

    def __init__(self, tensors, names: dict[str, str], prefixes: tuple[str, str] | None = None):
        self._t, self._names, self._prefixes = tensors, names, prefixes

    def stored_name(self, name: str) -> str:
        """Where the checkpoint holds (or would hold) the tensor this view calls ``name``: for error messages."""
        if name in self._names:
            return self._names[name]
        if self._prefixes and name.startswith(self._prefixes[0]):
            return self._prefixes[1] + name[len(self._prefixes[0]):]
        return name

    def __contains__(self, name: str) -> bool:
        return name in self._names

    def __iter__(self):
        return iter(self._names)

    def __getitem__(self, name: str) -> np.ndarray:
        return self._t[self._names[name]]

    def note_read(self, name: str, view: np.ndarray) -> None:
        if hasattr(self._t, "note_read"):
            self._t.note_read(self._names[name], view)

    def shape_of(self, name: str) -> tuple:
        return shape_of(self._t, self._names[name])


def shape_of(tensors, name: str) -> tuple:
    """A tensor's shape without reading it (a `CheckpointTensors` would dequantize an fp8 weight to answer)."""
    if hasattr(tensors, "shape_of"):
        return tensors.shape_of(name)
    return tuple(tensors[name].shape)


class SharedTensors:
    """A checkpoint's own tensors plus ``names`` read from another checkpoint's (``other``): a draft model that
    stores no embedding of its own and uses its base model's (`pdecode.checkpoint.hf.save_hf`'s ``shared``). The
    loader's interface (`CheckpointTensors`), each name answered by the source that holds it."""

    def __init__(self, own, other, names: tuple[str, ...], dtype):
        self._own, self._other, self._names, self._dtype = own, other, tuple(names), np.dtype(dtype)

    def _src(self, name: str):
        return self._other if name in self._names else self._own

    def alias(self, aliases: dict) -> None:
        self._own.alias(aliases)

    def __contains__(self, name: str) -> bool:
        return name in self._src(name)

    def __iter__(self):
        yield from self._own
        yield from (n for n in self._names if n not in self._own)

    def shape_of(self, name: str) -> tuple:
        return shape_of(self._src(name), name)

    def dtype_of(self, name: str) -> np.dtype:
        """The draft's own stored dtype for a shared tensor: what ``dtype="auto"`` loads the whole model in."""
        if name in self._names:
            return self._dtype
        src = self._own
        return src.dtype_of(name) if hasattr(src, "dtype_of") else src[name].dtype

    def __getitem__(self, name: str) -> np.ndarray:
        return self._src(name)[name]

    def read_slice(self, name: str, take) -> np.ndarray:
        src = self._src(name)
        if hasattr(src, "read_slice"):
            return src.read_slice(name, take)
        a = take(np.asarray(src[name]))
        if hasattr(src, "note_read"):
            src.note_read(name, a)
        return a

    def release(self, name: str) -> None:
        src = self._src(name)
        if hasattr(src, "release"):
            src.release(name)

    def read_stats(self) -> dict:
        stats = [s.read_stats() for s in (self._own, self._other) if hasattr(s, "read_stats")]
        return {k: sum(s.get(k, 0) for s in stats) for k in ("slice_bytes", "page_bytes", "checkpoint_bytes")}
