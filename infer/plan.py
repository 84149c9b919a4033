"""`pdecode plan`: will a model fit on a mesh, and how fast could it go — without any weights.

    pdecode plan --config llama-3-8b --devices 8 --method sd --batch 8 --max-len 4096
    pdecode plan --config llama-3-70b --devices 64 --mesh 2x32 --method ar --batch 8 --max-len 4096 --json

The model's params are abstract (shapes, dtypes and shardings only). `generate`'s compiled function for the method
is lowered and compiled AOT for the mesh on forced CPU devices (``--xla_force_host_platform_device_count``, set
before JAX starts), and XLA reports per-device bytes (`memory_analysis`: arguments, outputs, temporaries). One
decode step of each kind the method runs (an AR step over one token, a verify over k tokens, a draft step) is
compiled the same way; its `cost_analysis` gives FLOPs and bytes per device per step, and a roofline over published
peak FLOP/s and HBM bandwidth projects tokens/s. For speculative methods the projection takes τ (tokens per target
forward) measured on the zoo models, so it says what τ buys at that size, not what a real draft would reach.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pdecode.model.families.deepseek import DeepseekArch
from pdecode.model.families.diffusion_gemma import DiffusionGemmaArch
from pdecode.model.families.gemma4 import Gemma4Arch
from pdecode.model.families.moe import MoEArch
from pdecode.model.family import config_from_hf
from pdecode.model.layers.experts import Experts
from pdecode.model.layers.latent import Latent
from pdecode.model.transformer import active_params, attention_width, num_params
import time

# name -> HF-style architecture (public configs of these models)
CONFIGS = {
    "llama-3-8b": dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_layers=32, num_heads=32,
                       num_kv_heads=8, head_dim=128, max_position_embeddings=8192, rope_theta=500000.0),
    "llama-3-70b": dict(vocab_size=128256, hidden_size=8192, intermediate_size=28672, num_layers=80, num_heads=64,
                        num_kv_heads=8, head_dim=128, max_position_embeddings=8192, rope_theta=500000.0),
    "llama-3.2-1b": dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_layers=16, num_heads=32,
                         num_kv_heads=8, head_dim=64, max_position_embeddings=131072, rope_theta=500000.0,
                         tie_word_embeddings=True),
    "qwen3-32b": dict(vocab_size=151936, hidden_size=5120, intermediate_size=25600, num_layers=64, num_heads=64,
                      num_kv_heads=8, head_dim=128, max_position_embeddings=40960, rope_theta=1000000.0,
                      family="qwen3", qk_norm=True),
    # the families of issue 28 (public config.json values)
    "gemma-3-27b": dict(vocab_size=262208, hidden_size=5376, intermediate_size=21504, num_layers=62, num_heads=32,
                        num_kv_heads=16, head_dim=128, max_position_embeddings=131072, rope_theta=1000000.0,
                        rope_scaling=(("factor", 8.0), ("rope_type", "linear")), local_rope_theta=10000.0,
                        family="gemma3_text", qk_norm=True, hidden_act="gelu_tanh", attn_scale=168 ** -0.5,
                        sliding_window=1024, tie_word_embeddings=True,
                        layer_types=tuple("full" if (i + 1) % 6 == 0 else "sliding" for i in range(62))),
    # Gemma 4 31B (dense, text): 60 layers, hidden 5376, 32 heads; sliding layers 16 kv heads of 256, every sixth
    # layer full attention with 4 kv heads of 512 and keys as values (the model cards' figures)
    "gemma-4-31b": dict(vocab_size=262144, hidden_size=5376, intermediate_size=21504, num_layers=60, num_heads=32,
                        num_kv_heads=16, head_dim=256, max_position_embeddings=262144, rope_theta=1000000.0,
                        local_rope_theta=10000.0, family="gemma4_text", qk_norm=True, hidden_act="gelu_tanh",
                        attn_scale=1.0, final_softcap=30.0, sliding_window=1024, tie_word_embeddings=True,
                        arch=Gemma4Arch(global_head_dim=512, global_kv_heads=4, k_eq_v=True, rope_fraction=0.25),
                        layer_types=tuple("full" if (i + 1) % 6 == 0 else "sliding" for i in range(60))),
    "mixtral-8x7b": dict(vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_layers=32, num_heads=32,
                         num_kv_heads=8, head_dim=128, max_position_embeddings=32768, rope_theta=1000000.0,
                         family="mixtral", arch=MoEArch(Experts(8, 2, 14336))),
    "qwen3-30b-a3b": dict(vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_layers=48, num_heads=32,
                          num_kv_heads=4, head_dim=128, max_position_embeddings=40960, rope_theta=1000000.0,
                          family="qwen3_moe", qk_norm=True, arch=MoEArch(Experts(128, 8, 768))),
    "qwen3-235b-a22b": dict(vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_layers=94,
                            num_heads=64, num_kv_heads=4, head_dim=128, max_position_embeddings=40960,
                            rope_theta=1000000.0, family="qwen3_moe", qk_norm=True,
                            arch=MoEArch(Experts(128, 8, 1536))),
    "gpt-oss-120b": dict(vocab_size=201088, hidden_size=2880, intermediate_size=2880, num_layers=36, num_heads=64,
                         num_kv_heads=8, head_dim=64, max_position_embeddings=131072, rope_theta=150000.0,
                         rope_scaling=(("beta_fast", 32.0), ("beta_slow", 1.0), ("factor", 32.0),
                                       ("original_max_position_embeddings", 4096), ("rope_type", "yarn"),
                                       ("truncate", False)),
                         family="gpt_oss", attention_bias=True, sliding_window=128,
                         arch=MoEArch(Experts(128, 4, 2880, swiglu_limit=7.0)),
                         layer_types=tuple("sliding" if i % 2 == 0 else "full" for i in range(36))),
    # DeepSeek-V3 / R1 (671B, 37B active): latent attention (kv_lora 512 + a 64-dim rope key cached per token), 256
    # routed experts in 8 groups (4 chosen), 1 shared, the first 3 layers dense; its MTP layer is `--method mtp`
    "deepseek-v3": dict(vocab_size=129280, hidden_size=7168, intermediate_size=18432, num_layers=61, num_heads=128,
                        num_kv_heads=1, head_dim=64, max_position_embeddings=163840, rope_theta=10000.0,
                        rope_scaling=(("beta_fast", 32.0), ("beta_slow", 1.0), ("factor", 40.0), ("mscale", 1.0),
                                      ("mscale_all_dim", 1.0), ("original_max_position_embeddings", 4096),
                                      ("rope_type", "yarn")),
                        family="deepseek_v3",
                        attn_scale=192 ** -0.5 * (0.1 * __import__("math").log(40.0) + 1) ** 2,
                        arch=DeepseekArch(Experts(256, 8, 2048, shared_expert_size=2048, router_score="sigmoid",
                                                  expert_groups=8, groups_per_tok=4, routed_scale=2.5, dense_layers=3),
                                          Latent(kv_lora_rank=512, q_lora_rank=1536, qk_nope_dim=128, v_head_dim=128,
                                                 rope_interleave=True))),
    # GLM-4.5-Air (106B, 12B active): GQA with q/k/v biases, RoPE over half of each head, 128 experts, 1 shared
    "glm-4.5-air": dict(vocab_size=151552, hidden_size=4096, intermediate_size=10944, num_layers=46, num_heads=96,
                        num_kv_heads=8, head_dim=128, max_position_embeddings=131072, rope_theta=1000000.0,
                        rms_norm_eps=1e-5, family="glm4_moe", attention_bias=True, rotary_dims=64,
                        arch=MoEArch(Experts(128, 8, 1408, shared_expert_size=1408, router_score="sigmoid",
                                             dense_layers=1))),
    # DiffusionGemma 26B-A4B (google/diffusiongemma-26B-A4B-it): Gemma 4 26B-A4B's network as a block-diffusion
    # encoder-decoder over canvases of 256. Figures from third-party model cards (not checked against the release):
    # 30 layers (5:1 sliding 1024 / full), hidden 2816, 16 heads, 8 kv heads of 256 (full layers: 512, 2 kv heads,
    # keys as values), a dense MLP of 2112 beside 128 experts of 704 (top 8): 25.2B parameters, 3.8B active
    "diffusiongemma-26b-a4b": dict(vocab_size=262144, hidden_size=2816, intermediate_size=2112, num_layers=30,
                                   num_heads=16, num_kv_heads=8, head_dim=256, max_position_embeddings=262144,
                                   rope_theta=1000000.0, local_rope_theta=10000.0, family="diffusion_gemma",
                                   qk_norm=True, hidden_act="gelu_tanh", attn_scale=1.0, final_softcap=30.0,
                                   sliding_window=1024, tie_word_embeddings=True, causal=False,
                                   arch=DiffusionGemmaArch(global_head_dim=512, global_kv_heads=2, k_eq_v=True,
                                                           rope_fraction=0.25, experts=Experts(128, 8, 704),
                                                           canvas_length=256),
                                   layer_types=tuple("full" if (i + 1) % 6 == 0 else "sliding" for i in range(30))),
}
DEFAULT_DRAFT = "llama-3.2-1b"
# DiffusionGemma's generation_config.json: at most 48 denoising steps per canvas (the plan's worst case)
BLOCK_DIFFUSION_STEPS = 48

# published peak dense bf16 FLOP/s and HBM bandwidth per chip
HARDWARE = {
    "tpu-v5e": dict(flops=197e12, hbm_bw=819e9, hbm=16e9),
    "tpu-v5p": dict(flops=459e12, hbm_bw=2765e9, hbm=95e9),
    "h100": dict(flops=989e12, hbm_bw=3350e9, hbm=80e9),
    "h200": dict(flops=989e12, hbm_bw=4800e9, hbm=141e9),
}
# tokens per target forward measured on the zoo (docs/results.md: greedy, 8 validation prompts): what the
# speculative projections assume
ZOO_TAU = {"sd": 2.66, "eagle": 3.58}
# the checkpoint's own MTP layer drafting one token: DeepSeek-V3's report (85-90% of second tokens accepted, so
# about 1.85 tokens per forward), not measured here
REPORTED_TAU = {"mtp": 1.85}


def model_config(name_or_dir: str, vocab: int | None = None):
    from pdecode.checkpoint.hf import read_config
    from pdecode.config import ModelConfig
    from pdecode.errors import InputError

    if name_or_dir in CONFIGS:
        kw = dict(CONFIGS[name_or_dir])
        if vocab:
            kw["vocab_size"] = vocab
        return ModelConfig(**kw)
    from pathlib import Path

    p = Path(name_or_dir)
    if not (p / "config.json").exists():
        raise InputError(f"--config {name_or_dir!r}: not one of {', '.join(CONFIGS)} and not a directory with a "
                         "config.json")
    return config_from_hf(read_config(p))


def abstract_params(cfg, dtype, mesh, specs=None):
    """ShapeDtypeStructs with the logical shardings of ``specs`` (default: the model's) on ``mesh``."""
    import jax

    from pdecode.model.transformer import is_spec, param_specs
    from pdecode.sharding import param_shardings

    specs = param_specs(cfg) if specs is None else specs
    shard = param_shardings(specs, mesh)
    return jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, dtype, sharding=sh), specs, shard,
                        is_leaf=is_spec)


def _bytes(tree) -> int:
    import jax
    import numpy as np

    return int(sum(np.prod(a.shape) * np.dtype(a.dtype).itemsize for a in jax.tree.leaves(tree)))


def _shard_bytes(tree) -> int:
    """Bytes one device holds of a tree of sharded ShapeDtypeStructs (the largest shard)."""
    import jax
    import numpy as np

    return int(sum(np.prod(a.sharding.shard_shape(a.shape)) * np.dtype(a.dtype).itemsize
                   for a in jax.tree.leaves(tree)))


def _cache_shapes(cfg, batch, max_len, dtype, mesh):
    import jax
    from jax.sharding import NamedSharding

    from pdecode.model import cache as kvc
    from pdecode.sharding import batch_sharding, cache_spec

    from pdecode.model.transformer import DecodeLayers, layer_specs

    # the layout a forward over the canonical params writes: one buffer per layer for blocks run as a loop, else
    # stacked (by group, for layers of several shapes)
    per_layer = isinstance(layer_specs(cfg, cfg.num_layers), DecodeLayers)
    shapes = jax.eval_shape(lambda: kvc.init_cache(cfg, batch, max_len, dtype, per_layer=per_layer))
    return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=NamedSharding(
        mesh, cache_spec(a.shape, mesh) if a.ndim >= 4 else batch_sharding(mesh, a.shape).spec)), shapes)


def _memory(compiled) -> dict:
    ma = compiled.memory_analysis()
    out = {k: int(getattr(ma, k + "_size_in_bytes", 0) or 0) for k in ("argument", "output", "temp", "alias")}
    out["total"] = out["argument"] + out["output"] + out["temp"] - out["alias"]
    return out


def _cost(compiled) -> dict:
    ca = compiled.cost_analysis()
    if isinstance(ca, list):
        ca = ca[0] if ca else {}
    return {"flops": float(ca.get("flops", 0.0)), "bytes": float(ca.get("bytes accessed", 0.0))}


def _step_cost(cfg, params, mesh, batch: int, k: int, max_len: int, cache_dtype) -> dict:
    """FLOPs and bytes per device of one forward over k new tokens per row against a full cache of max_len."""
    import jax
    import jax.numpy as jnp

    from pdecode.model.transformer import forward, unembed
    from pdecode.sharding import batch_sharding, constrain_cache

    def step(params, cache, toks):
        p = params  # stacked layers under lax.scan: the step reads each weight once, as a decode loop does
        cache = constrain_cache(cache, mesh)
        pos = cache.lengths[:, None] + jnp.arange(k)[None, :]
        from pdecode.decode.common import step_mask

        mask = step_mask(cfg, cache, jnp.tril(jnp.ones((k, k), bool)), pos)
        out = forward(p, cfg, toks, pos, mask, cache=cache, write_at_B=cache.lengths)
        return unembed(p, cfg, out.hidden[:, -1:]), out.cache

    cache = _cache_shapes(cfg, batch, max_len, cache_dtype, mesh)
    toks = jax.ShapeDtypeStruct((batch, k), jnp.int32, sharding=batch_sharding(mesh, (batch, k)))
    compiled = jax.jit(step, donate_argnums=1).lower(params, cache, toks).compile()
    return _cost(compiled)


def _canvas_costs(cfg, params, mesh, batch: int, max_len: int, cache_dtype) -> dict:
    """FLOPs and bytes per device of a block-diffusion model's two passes over one canvas, against a cache of
    max_len: the decoder's denoising step (self-conditioned) and the encoder's pass that commits the canvas."""
    import jax
    import jax.numpy as jnp

    from pdecode.model.families import diffusion_gemma as bd
    from pdecode.sharding import batch_sharding, constrain_cache

    L = cfg.arch.canvas_length
    cache = _cache_shapes(cfg, batch, max_len, cache_dtype, mesh)
    toks = jax.ShapeDtypeStruct((batch, L), jnp.int32, sharding=batch_sharding(mesh, (batch, L)))
    sc = jax.ShapeDtypeStruct((batch, L, cfg.vocab_size), jnp.float32,
                              sharding=batch_sharding(mesh, (batch, L, cfg.vocab_size)))
    on = jax.ShapeDtypeStruct((batch,), jnp.bool_, sharding=batch_sharding(mesh, (batch,)))

    def denoise(params, cache, toks, sc, on):
        return bd.denoise(params, cfg, toks, constrain_cache(cache, mesh), sc, on)

    def encode(params, cache, toks):
        return bd.encode(params, cfg, toks, constrain_cache(cache, mesh))

    return {"denoise_canvas": _cost(jax.jit(denoise).lower(params, cache, toks, sc, on).compile()),
            "encode_canvas": _cost(jax.jit(encode, donate_argnums=1).lower(params, cache, toks).compile())}


def plan(config: str, devices: int, method: str = "ar", batch: int = 8, max_len: int = 4096, mesh_shape=None,
         dtype: str = "bfloat16", cache_dtype: str | None = None, draft_config: str | None = None,
         gamma: int = 4, tree_nodes: int = 60, prompt_len: int = 128, options: dict | None = None) -> dict:
    import jax
    import jax.numpy as jnp

    import pdecode
    from pdecode import sampling
    from pdecode.decode import registry
    from pdecode.errors import InputError
    from pdecode.model import heads as H
    from pdecode.sharding import batch_sharding, make_mesh

    if len(jax.devices()) < devices:
        raise InputError(f"plan needs {devices} devices and JAX sees {len(jax.devices())}: run through `pdecode "
                         "plan` (it forces CPU devices before JAX starts) or set XLA_FLAGS="
                         f"--xla_force_host_platform_device_count={devices}")
    data, model_ax = mesh_shape or (1, devices)
    if data * model_ax != devices:
        raise InputError(f"--mesh {data}x{model_ax} does not use --devices {devices}")
    mesh = make_mesh(data, model_ax, devices=jax.devices()[:devices])
    cfg = model_config(config).with_run(activation_dtype=None)
    jdt = jnp.dtype(dtype)
    cdt = jnp.dtype(cache_dtype or dtype)
    if max_len > cfg.max_position_embeddings:
        raise InputError(f"--max-len {max_len} exceeds the model's context ({cfg.max_position_embeddings})")
    if method not in ("ar", "sd", "eagle", "mtp", "diffusion"):
        raise InputError(f"plan covers ar, sd, eagle, mtp and diffusion; got {method!r}")
    if (method == "diffusion") != bool(cfg.arch.canvas_length):
        raise InputError(f"--method diffusion plans a block-diffusion model (such as diffusiongemma-26b-a4b) and a "
                         f"block-diffusion model plans only with it; {config} with {method!r} is neither")
    meth = registry.get(method)
    from pdecode.sharding import kv_repeat, placed_cfg

    stored_bytes = _bytes(abstract_params(cfg, jdt, mesh))  # the checkpoint's own weights
    r = kv_repeat(cfg, mesh)  # kv heads repeated to the model axis, as Model.on_mesh does
    cfg = placed_cfg(cfg, mesh)
    params = abstract_params(cfg, jdt, mesh)
    target = pdecode.Model(cfg=cfg, params=params, name=config)
    draft, extra_params, opts = None, 0, {}
    if meth.needs_draft:
        dcfg = model_config(draft_config or DEFAULT_DRAFT, vocab=cfg.vocab_size)
        dcfg = placed_cfg(dcfg, mesh)
        draft = pdecode.Model(cfg=dcfg, params=abstract_params(dcfg, jdt, mesh), name=draft_config or DEFAULT_DRAFT)
        extra_params = _bytes(draft.params)
        opts = {"gamma": gamma}
    elif method == "eagle":
        ecfg = H.EagleConfig()
        ep = abstract_params(cfg, jdt, mesh, ecfg.specs(cfg))
        target.extras["eagle"] = (ecfg, ep)
        extra_params = _bytes(ep)
        opts = {"total_tokens": tree_nodes}
    elif method == "mtp":  # the model's own MTP layer (DeepSeek-V3, GLM-4.5 ship one), drafting a chain
        mcfg = H.MTPConfig(num_modules=1, kind="sequential", emb_first=True)
        ep = abstract_params(cfg, jdt, mesh, mcfg.specs(cfg))
        target.extras["mtp"] = (mcfg, ep)
        extra_params = _bytes(ep)
    opts = registry.resolve_options(meth, {**opts, **(options or {})})
    samp = sampling.validate(0.0, 0, 1.0, cfg.vocab_size)
    if method == "diffusion":  # whole canvases after the prompt
        p = meth.prepare(target, draft, opts, samp, max_new=(max_len - prompt_len) // cfg.arch.canvas_length
                         * cfg.arch.canvas_length)
    else:
        p = meth.prepare(target, draft, opts, samp)
    max_new = max_len - prompt_len - p.extra_len
    if max_new < 1:
        raise InputError(f"--max-len {max_len} leaves no room for new tokens after a {prompt_len}-token prompt")
    static = dict(p.static, max_new=max_new, max_len=max_len, eos_ids=(), samp=samp, mesh=mesh)
    if p.token_loop or p.takes_cache_dtype:  # (the plan declares what its program takes)
        static["cache_dtype"] = cdt
    prompt = jax.ShapeDtypeStruct((batch, prompt_len), jnp.int32, sharding=batch_sharding(mesh, (batch, prompt_len)))
    lens = jax.ShapeDtypeStruct((batch,), jnp.int32, sharding=batch_sharding(mesh, (batch,)))
    args = (p.params, prompt, lens, jax.random.PRNGKey(0), sampling.Warp.of(0.0))
    t0 = time.perf_counter()
    compiled = jax.jit(p.fn, static_argnames=tuple(static)).lower(*args, **static).compile()
    compile_s = time.perf_counter() - t0
    hlo_chars = len(compiled.as_text())  # the optimized program's size (what compile time grows with)
    mem = _memory(compiled)

    def held(c, weights):
        """Bytes one device holds of a model's weights and of its KV cache at full length."""
        return _shard_bytes(weights) + _shard_bytes(_cache_shapes(c, batch, max_len, cdt, mesh))

    # the steps the method runs: (name, config, weights, tokens per row): the target's forward over 1 token (AR)
    # or over the verified tree, and one step of the drafter
    kinds = [("target_1", cfg, params, 1)]
    draft_steps = 0
    if method == "sd":
        kinds += [("target_verify", cfg, params, opts["gamma"] + 1), ("draft_1", draft.cfg, draft.params, 1)]
        draft_steps = opts["gamma"]
        mem["weights_and_caches"] = held(cfg, params) + held(draft.cfg, draft.params)
    elif method in ("eagle", "mtp"):
        one_layer = cfg.with_layers(1)
        nodes = opts["total_tokens"] if method == "eagle" else 1 + (opts["total_tokens"] or opts["depth"] * opts[
            "tree_top_k"])  # (mtp: the root and the drafted chain or tree)
        kinds += [("target_verify", cfg, params, nodes),
                  ("draft_1", one_layer, abstract_params(one_layer, jdt, mesh), opts["tree_top_k"])]
        draft_steps = opts["depth"]
        mem["weights_and_caches"] = held(cfg, params) + _shard_bytes(ep) + \
            _shard_bytes(_cache_shapes(one_layer, batch, max_len, cdt, mesh))
    else:
        mem["weights_and_caches"] = held(cfg, params)
    if method == "diffusion":
        L = cfg.arch.canvas_length
        kinds = [("denoise_canvas", cfg, params, L), ("encode_canvas", cfg, params, L)]

    def counted(c, w, k):
        """A step by count: every weight shard read once, the cache shards read at full length, 2 FLOPs per weight
        per token plus attention (4 per cached key per head per token)."""
        n_w = _shard_bytes(w) / jnp.dtype(jdt).itemsize
        if method == "diffusion":  # a token runs through k of E experts (the other plans count every weight)
            n_w *= active_params(c) / num_params(c)
        heads_dev = c.num_heads / (model_ax if c.num_heads % model_ax == 0 else 1)
        return {"flops": float(2 * n_w * batch / data * k + 2 * batch / data * k * c.num_layers * heads_dev
                               * attention_width(c) * max_len), "bytes": float(held(c, w))}

    # XLA:CPU's own counts count a layer stack under lax.scan once, not once per layer, and include the float32
    # copies XLA:CPU makes of bfloat16 matmul operands, which accelerators do not make: the projection uses the
    # counted steps, and both are reported
    steps = _canvas_costs(cfg, params, mesh, batch, max_len, cdt) if method == "diffusion" else \
        {name: _step_cost(c, w, mesh, batch, k, max_len, cdt) for name, c, w, k in kinds}
    analytic = {name: counted(c, w, k) for name, c, w, k in kinds}
    proj = {}
    for hw, h in HARDWARE.items():
        t = lambda c: max(c["flops"] / h["flops"], c["bytes"] / h["hbm_bw"])  # noqa: E731
        if method == "diffusion":  # a canvas: at most BLOCK_DIFFUSION_STEPS denoising steps, then its encoding
            canvas_s = BLOCK_DIFFUSION_STEPS * t(analytic["denoise_canvas"]) + t(analytic["encode_canvas"])
            proj[hw] = {"ar_tokens_per_s": None, "fits": mem["total"] <= h["hbm"],
                        "fits_weights_and_caches": mem["weights_and_caches"] <= h["hbm"],
                        "denoise_step_s": t(analytic["denoise_canvas"]),
                        "tokens_per_s": batch * cfg.arch.canvas_length / canvas_s}
            continue
        ar = batch / t(analytic["target_1"])
        row = {"ar_tokens_per_s": ar, "fits": mem["total"] <= h["hbm"],
               "fits_weights_and_caches": mem["weights_and_caches"] <= h["hbm"], "tokens_per_s": ar}
        if method in ZOO_TAU or method in REPORTED_TAU:
            step = t(analytic["target_verify"]) + draft_steps * t(analytic["draft_1"])
            row["tokens_per_s"] = batch * {**ZOO_TAU, **REPORTED_TAU}[method] / step
        proj[hw] = row
    return {"config": config, "method": method, "devices": devices, "mesh": f"{data}x{model_ax}", "batch": batch,
            "max_len": max_len, "dtype": str(jdt), "cache_dtype": str(cdt), "compiled": True,
            "compile_s": compile_s, "hlo_chars": hlo_chars, "param_bytes": stored_bytes, "kv_repeat": r,
            "extra_param_bytes": extra_params,
            "per_device": mem, "per_device_bytes": mem["total"], "step_costs_per_device": steps,
            "step_floor_per_device": analytic,
            "tau_assumed": ZOO_TAU.get(method) or REPORTED_TAU.get(method),
            "tau_source": "zoo" if method in ZOO_TAU else ("reported" if method in REPORTED_TAU else None),
            "cache_values_per_token": _cache_values(cfg), "projection": proj}


def _cache_values(cfg) -> dict:
    """Values the KV cache holds per token (all layers), and what full per-head K and V would hold: for latent
    attention, the latent and rope key against every head's key (nope + rope) and value."""
    from pdecode.model.cache import value_dim

    held = sum(cfg.layer_attention(i)[0] * (cfg.layer_attention(i)[1] + value_dim(cfg, i))
               for i in range(cfg.num_layers) if cfg.kv_source(i) == i)
    la = cfg.arch.latent
    full = cfg.num_layers * cfg.num_heads * (la.qk_nope_dim + cfg.head_dim + la.v_head_dim) if la is not None \
        else held
    return {"held": int(held), "full_kv": int(full), "per_layer_held": int(held // cfg.num_layers),
            "per_layer_full_kv": int(full // cfg.num_layers)}


def largest_constant(hlo_text: str) -> int:
    """Bytes of the largest constant in a lowered (StableHLO) program: a closed-over weight would show up here."""
    import re

    import numpy as np

    widths = {"f32": 4, "bf16": 2, "f16": 2, "i32": 4, "i64": 8, "i8": 1, "ui8": 1, "i1": 1, "f64": 8, "ui32": 4}
    best = 0
    for shape in re.findall(r"stablehlo\.constant dense<[^>]*> : tensor<([0-9x]*[a-z]+[0-9]*)>", hlo_text):
        *dims, dt = shape.split("x")
        best = max(best, int(np.prod([int(d) for d in dims] or [1])) * widths.get(dt, 4))
    return best


def plan_train_heads(config: str, devices: int, kind: str = "eagle", batch: int = 8, seq_len: int = 2048,
                     mesh_shape=None, dtype: str = "bfloat16", fsdp: bool = True, accum: int = 1) -> dict:
    """The heads training step for a base of ``config`` on a forced-device mesh, from abstract params: lowered
    (the largest constant it holds: the frozen base must be an argument, not baked in) and compiled (per-device
    bytes). The base is frozen in ``dtype``, tensor-parallel over ``model``; the heads train in float32 (AdamW
    moments beside them); with ``fsdp`` both are also split over ``data`` (`train.loop.MeshPlan`, as `pdecode train
    heads --mesh --fsdp` lays them out); the batch is split over ``data``."""
    import jax
    import jax.numpy as jnp

    from pdecode.errors import InputError
    from pdecode.model.transformer import is_spec, param_specs
    from pdecode.sharding import batch_sharding, make_mesh
    from train.heads import HeadRecipe, _objective, head_config
    from train.loop import MeshPlan, TrainConfig, _step_fn, make_optimizer

    if len(jax.devices()) < devices:
        raise InputError(f"plan needs {devices} devices and JAX sees {len(jax.devices())}")
    data, model_ax = mesh_shape or (1, devices)
    if data * model_ax != devices:
        raise InputError(f"--mesh {data}x{model_ax} does not use --devices {devices}")
    if batch % (data * accum):
        raise InputError(f"--batch {batch} must be a multiple of the data axis times --accum ({data} x {accum})")
    mesh = make_mesh(data, model_ax, devices=jax.devices()[:devices])
    cfg = model_config(config).with_run(activation_dtype=None)
    hcfg, ttt = head_config(kind, cfg)
    r = HeadRecipe("eagle" if kind == "eagle3" else kind, hcfg, TrainConfig(steps=1, accum=accum), seq_len, batch, ttt)
    mp = MeshPlan(mesh, hcfg.specs(cfg), param_specs(cfg), fsdp)
    base = jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, jnp.dtype(dtype), sharding=sh), param_specs(cfg),
                        mp.frozen_shardings(), is_leaf=is_spec)
    shard = mp.param_shardings()
    heads = jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, jnp.float32, sharding=sh), hcfg.specs(cfg), shard,
                         is_leaf=is_spec)
    opt = make_optimizer(r.tc)
    # the AdamW moments take the shardings XLA gives them from their params (as `train` makes them)
    init = jax.jit(opt.init).lower(heads).compile()
    from jax.sharding import NamedSharding, PartitionSpec as P

    rep = NamedSharding(mesh, P())  # a step count lands on one device; replicate it as `train` does
    opt_state = jax.tree.map(lambda a, sh: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sh if len(
        sh.device_set) > 1 else rep), jax.eval_shape(opt.init, heads), init.output_shardings)
    toks = jax.ShapeDtypeStruct((batch, seq_len + 1), jnp.int32, sharding=batch_sharding(mesh, (batch, seq_len + 1)))
    step = _step_fn(_objective(r, cfg), opt, accum, None, shard)
    t0 = time.perf_counter()
    lowered = step.lower(heads, base, opt_state, toks, jax.random.PRNGKey(0))
    biggest = largest_constant(lowered.as_text())
    compiled = lowered.compile()
    compile_s = time.perf_counter() - t0
    mem = _memory(compiled)
    return {"config": config, "train_heads": kind, "devices": devices, "mesh": f"{data}x{model_ax}", "batch": batch,
            "seq_len": seq_len, "accum": accum, "fsdp": fsdp, "dtype": dtype, "compiled": True,
            "compile_s": compile_s, "base_param_bytes": _bytes(base), "head_param_bytes": _bytes(heads),
            "largest_constant_bytes": biggest, "per_device": mem, "per_device_bytes": mem["total"],
            "base_shard_bytes": _shard_bytes(base), "head_and_moments_shard_bytes": 3 * _shard_bytes(heads)}


def train_to_text(r: dict) -> str:
    gb = lambda b: f"{b / 1e9:.2f} GB" if b >= 1e8 else f"{b / 1e6:.2f} MB"  # noqa: E731
    m = r["per_device"]
    return "\n".join([
        f"{r['config']} · {r['train_heads']} heads training step · {r['devices']} devices (mesh data x model = "
        f"{r['mesh']}) · batch {r['batch']} x {r['seq_len']} tokens · accum {r['accum']} · base {r['dtype']} frozen, "
        f"heads float32{' FSDP' if r['fsdp'] else ''}",
        f"compiled in {r['compile_s']:.1f} s; base {gb(r['base_param_bytes'])}, heads {gb(r['head_param_bytes'])}; "
        f"largest constant in the program: {r['largest_constant_bytes']} bytes", "",
        "| per device | bytes |", "|---|---|",
        f"| arguments (base shard, heads, moments, batch) | {gb(m['argument'])} |", f"| outputs | {gb(m['output'])} |",
        f"| temporaries (activations, gradients) | {gb(m['temp'])} |", f"| **total (XLA)** | **{gb(m['total'])}** |",
        f"| base shard + heads + AdamW moments (count) | "
        f"{gb(r['base_shard_bytes'] + r['head_and_moments_shard_bytes'])} |"])


def to_text(r: dict) -> str:
    gb = lambda b: f"{b / 1e9:.2f} GB" if b >= 1e8 else f"{b / 1e6:.2f} MB"  # noqa: E731
    m = r["per_device"]
    lines = [f"{r['config']} · {r['method']} · {r['devices']} devices (mesh data x model = {r['mesh']}) · batch "
             f"{r['batch']} · {r['max_len']} tokens · params {r['dtype']}, cache {r['cache_dtype']}",
             f"compiled in {r['compile_s']:.1f} s ({r['hlo_chars'] / 1e6:.2f}M characters of HLO); weights "
             f"{gb(r['param_bytes'])} in all"
             + (f" + {gb(r['extra_param_bytes'])} drafter" if r["extra_param_bytes"] else "")
             + (f"; kv heads repeated x{r['kv_repeat']} to the model axis" if r.get("kv_repeat", 1) > 1 else ""),
             "", "| per device | bytes |", "|---|---|",
             f"| arguments (weights, prompt) | {gb(m['argument'])} |", f"| outputs | {gb(m['output'])} |",
             f"| temporaries (caches, activations) | {gb(m['temp'])} |", f"| **total (XLA)** | **{gb(m['total'])}** |",
             f"| weights + KV caches at full length (shards) | {gb(m['weights_and_caches'])} |",
             "", "| step (per device) | GFLOP (XLA:CPU) | GB (XLA:CPU) | GFLOP (count) | GB (count) |",
             "|---|---|---|---|---|"]
    for k, c in r["step_costs_per_device"].items():
        f = r["step_floor_per_device"][k]
        lines.append(f"| {k} | {c['flops'] / 1e9:.2f} | {c['bytes'] / 1e9:.3f} | {f['flops'] / 1e9:.2f} | "
                     f"{f['bytes'] / 1e9:.3f} |")
    src = "as DeepSeek-V3's report gives it" if r.get("tau_source") == "reported" else "as measured on the zoo"
    tau = f" (τ {r['tau_assumed']} {src})" if r["tau_assumed"] else ""
    cv = r.get("cache_values_per_token")
    if cv and cv["full_kv"] != cv["held"]:
        lines += ["", f"KV cache per token and layer: {cv['per_layer_held']} values held (latent + rope key) vs "
                      f"{cv['per_layer_full_kv']} for full per-head K and V ({cv['per_layer_full_kv'] / cv['per_layer_held']:.1f}x)"]
    lines += ["", f"Roofline from the counted steps (weights and caches read once per step), per device:", "",
              f"| hardware | fits (XLA / weights + caches) | AR tok/s | {r['method']} tok/s{tau} |", "|---|---|---|---|"]
    if r["method"] == "diffusion":
        lines[-2:] = [f"| hardware | fits (XLA / weights + caches) | one denoising step (ms) | tok/s at "
                      f"{BLOCK_DIFFUSION_STEPS} steps per canvas (the most) |", "|---|---|---|---|"]
        lines += [f"| {hw} | {'yes' if p['fits'] else 'no'} / {'yes' if p['fits_weights_and_caches'] else 'no'} | "
                  f"{p['denoise_step_s'] * 1e3:.2f} | {p['tokens_per_s']:.0f} |" for hw, p in r["projection"].items()]
        return "\n".join(lines)
    for hw, p in r["projection"].items():
        lines.append(f"| {hw} | {'yes' if p['fits'] else 'no'} / {'yes' if p['fits_weights_and_caches'] else 'no'} | "
                     f"{p['ar_tokens_per_s']:.0f} | "
                     f"{p['tokens_per_s']:.0f} |")
    return "\n".join(lines)


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--config", required=True, help=f"{', '.join(CONFIGS)} or an HF directory (config.json)")
    ap.add_argument("--devices", type=int, required=True, help="devices of the mesh (forced CPU devices)")
    ap.add_argument("--mesh", default=None, help="DATAxMODEL (default 1xDEVICES: params sharded over all)")
    ap.add_argument("--method", default="ar", choices=["ar", "sd", "eagle", "mtp", "diffusion"],
                    help="diffusion: a block-diffusion model (DiffusionGemma), its own sampler")
    ap.add_argument("--draft-config", default=None, help=f"sd/tree: the draft's config (default {DEFAULT_DRAFT})")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--max-len", type=int, default=4096)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32", "float16"])
    ap.add_argument("--cache-dtype", default=None, choices=["bfloat16", "float32", "float16", "float8_e4m3fn",
                                                            "float8_e5m2"], help="KV cache dtype (default: --dtype)")
    ap.add_argument("--train-heads", default=None, choices=["medusa", "eagle", "eagle3", "mtp"],
                    help="plan the heads training step for this base instead of a decode (with --batch, --seq-len)")
    ap.add_argument("--seq-len", type=int, default=2048, help="--train-heads: tokens per training window")
    ap.add_argument("--accum", type=int, default=1, help="--train-heads: gradient accumulation micro-batches")
    ap.add_argument("--json", action="store_true", help="one JSON object")
    from infer.cli import add_distributed_arguments

    add_distributed_arguments(ap)


def run_from_args(args) -> int:
    import pdecode
    from infer.cli import _parse_mesh_shape

    # on several processes --devices is the run's total (each process forced devices / processes of them); every
    # process compiles the same plan, process 0 prints it
    pdecode.init_distributed(args.coordinator, args.num_processes, args.process_id, args.dist_timeout)
    main = pdecode.distributed.is_main()
    mesh_shape = _parse_mesh_shape(args.mesh) if args.mesh else None
    if args.train_heads:
        r = plan_train_heads(args.config, args.devices, args.train_heads, args.batch, args.seq_len, mesh_shape,
                             args.dtype, accum=args.accum)
        if main:
            print(json.dumps(r) if args.json else train_to_text(r))
        return 0
    r = plan(args.config, args.devices, args.method, args.batch, args.max_len, mesh_shape, args.dtype,
             args.cache_dtype, args.draft_config)
    if main:
        print(json.dumps(r) if args.json else to_text(r))
    return 0


def _flag(argv: list[str], name: str) -> str:
    v = ""
    for i, a in enumerate(argv):
        if a == name and i + 1 < len(argv):
            v = argv[i + 1]
        elif a.startswith(name + "="):
            v = a.split("=", 1)[1]
    return v


def force_devices(argv: list[str]) -> None:
    """Before JAX starts: as many forced CPU devices as ``--devices`` asks for, on the CPU platform (on a run of
    ``--num-processes`` P, ``--devices`` / P on each process)."""
    n = _flag(argv, "--devices")
    procs = _flag(argv, "--num-processes") or os.environ.get("PDECODE_NUM_PROCESSES", "")
    if n:
        if n.isascii() and n.isdecimal():
            if procs.isascii() and procs.isdecimal() and int(procs) > 1 and int(n) % int(procs) == 0:
                n = str(int(n) // int(procs))
            flags = [f for f in os.environ.get("XLA_FLAGS", "").split() if "device_count" not in f]
            os.environ["XLA_FLAGS"] = " ".join(flags + [f"--xla_force_host_platform_device_count={n}"])
            os.environ.setdefault("JAX_PLATFORMS", "cpu")


if __name__ == "__main__":
    force_devices(sys.argv)
    from infer.cli import main

    sys.exit(main(["plan", *sys.argv[1:]]))
