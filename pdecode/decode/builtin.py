"""Registers the built-in decoding methods."""

from __future__ import annotations

from pdecode.decode import ar, speculative
from pdecode.decode import tree as tree_lib
from pdecode.decode.registry import Method, Plan, check_same_vocab, register
from pdecode.errors import ConfigError


def _int_opt(opts, name, lo=1):
    v = opts[name]
    if not isinstance(v, int) or isinstance(v, bool) or v < lo:
        raise ConfigError(f"{name} must be an integer >= {lo}, got {v!r}")
    return v


def _prepare_ar(model, draft, opts, samp):
    return Plan(fn=ar.generate, params=model.params,
                static={"cfg": model.cfg, "phases": _int_opt(opts, "cache_phases")})


PHASES = {"cache_phases": 4}  # every loop over a target KV cache runs in phases (`common.phase_lengths`)


def _spec_plan(model, draft_params, drafter, opts) -> Plan:
    return Plan(fn=speculative.generate, params=(model.params, draft_params),
                static={"cfg": model.cfg, "drafter": drafter, "phases": _int_opt(opts, "cache_phases")},
                extra_len=drafter.tree_size + 2,
                finish_stats=lambda s: speculative.acceptance_stats({**s, "tree_size": drafter.tree_size}))


def _prepare_sd(model, draft, opts, samp):
    from pdecode.decode.draft_model import DraftChain

    check_same_vocab(model.cfg, draft.cfg)
    gamma = _int_opt(opts, "gamma")
    adaptive = bool(opts["adaptive"])
    gmax = opts["gamma_max"] if opts["gamma_max"] is not None else (max(2 * gamma, 8) if adaptive else gamma)
    if not isinstance(gmax, int) or gmax < gamma:
        raise ConfigError(f"gamma_max must be an integer >= gamma ({gamma}), got {gmax!r}")
    return _spec_plan(model, draft.params, DraftChain(draft.cfg, gamma, gmax, adaptive), opts)


def _prepare_tree(model, draft, opts, samp):
    from pdecode.decode.draft_model import DraftDynamicTree, DraftStaticTree

    check_same_vocab(model.cfg, draft.cfg)
    if opts["tree"] == "dynamic":
        drafter = DraftDynamicTree(draft.cfg, *_tree_opts(opts))
    else:
        drafter = DraftStaticTree(draft.cfg, tree_lib.resolve(opts["tree"]))
    return _spec_plan(model, draft.params, drafter, opts)


def _prepare_lookup(model, draft, opts, samp):
    from pdecode.decode.lookup import LookupDrafter

    g, nmax, nmin, br = (_int_opt(opts, k) for k in ("gamma", "ngram_max", "ngram_min", "branches"))
    if nmin > nmax:
        raise ConfigError(f"ngram_min ({nmin}) must not exceed ngram_max ({nmax})")
    return _spec_plan(model, None, LookupDrafter(gamma=g, ngram_max=nmax, ngram_min=nmin, branches=br), opts)


register(Method("ar", _prepare_ar, options=dict(PHASES),
                summary="autoregressive, one token per forward (cache_phases: the loop runs over a cache grown in "
                        "up to this many steps, 1 = one loop over the full cache)"))
register(Method("sd", _prepare_sd, options={"gamma": 4, "adaptive": False, "gamma_max": None, **PHASES},
                needs_draft=True,
                summary="speculative decoding with a draft model, chain of gamma tokens (optionally adaptive)"))
register(Method("tree", _prepare_tree,
                options={"tree": "dynamic", "tree_top_k": 4, "depth": 5, "total_tokens": 24, **PHASES},
                needs_draft=True,
                summary="draft-model token tree: EAGLE-2-style dynamic (tree_top_k = EAGLE-2's top_k, depth, "
                        "total_tokens) or a static "
                        "preset / choice paths"))
register(Method("lookup", _prepare_lookup,
                options={"gamma": 4, "ngram_max": 3, "ngram_min": 1, "branches": 1, **PHASES},
                summary="prompt lookup (n-gram) drafting, chain or multi-candidate tree; no extra model"))


def _heads(model, kind: str):
    from pdecode.errors import InputError

    if kind not in model.extras:
        raise InputError(f"method {kind!r} needs {kind} heads on the model: load a heads directory "
                         f"(e.g. pdecode.load('code-target-{kind}')) or attach them with "
                         f"pdecode.attach_heads(model, path)")
    return model.extras[kind]


def _prepare_medusa(model, draft, opts, samp):
    from pdecode.decode.medusa import MedusaDrafter, check_tree

    mcfg, mp = _heads(model, "medusa")
    meta = model.extras.get("medusa_meta", {})
    spec = opts["tree"]
    if spec is None:  # the tree calibrated for these heads (in heads.json), else medusa-18 cut to their depth
        spec = "calibrated" if meta.get("tree") else [p for p in tree_lib.PRESETS["medusa-18"]
                                                       if len(p) <= mcfg.num_heads]
    if spec == "calibrated" or (isinstance(spec, str) and spec.startswith("calibrated:")):
        # "calibrated": the tree shipped with the heads; "calibrated:N": the best N nodes for their accuracies
        size = spec.partition(":")[2]
        if size and not size.isdigit():
            raise ConfigError(f"invalid tree spec {spec!r}: use 'calibrated' or 'calibrated:N' with N nodes")
        if not meta.get("tree_calibration" if size else "tree"):
            raise ConfigError(f"tree={spec!r} needs heads calibrated with `python -m train.heads --calibrate-tree N`"
                              f"; these heads have no calibration in heads.json")
        spec = tree_lib.calibrated_paths(meta["tree_calibration"]["accuracy"], int(size))[0] if size else meta["tree"]
    tr = tree_lib.resolve(spec)
    check_tree(tr, mcfg)
    typical = None
    if opts["typical"]:
        typical = (float(opts["typical_epsilon"]), float(opts["typical_delta"]))
    return _spec_plan(model, mp, MedusaDrafter(model.cfg, mcfg, tr, typical), opts)


def _tree_opts(opts):
    k, d, n = _int_opt(opts, "tree_top_k"), _int_opt(opts, "depth"), _int_opt(opts, "total_tokens")
    pool = k + (d - 1) * k * k
    if n > pool:
        raise ConfigError(f"total_tokens ({n}) exceeds the {pool} nodes a tree with tree_top_k={k}, depth={d} grows")
    return k, d, n


def _prepare_eagle(model, draft, opts, samp):
    from pdecode.decode.eagle import EagleDrafter

    ecfg, ep = _heads(model, "eagle")
    return _spec_plan(model, ep, EagleDrafter(model.cfg, ecfg, *_tree_opts(opts)), opts)


def _prepare_mtp(model, draft, opts, samp):
    from pdecode.decode.eagle import MTPDrafter

    mcfg, mp = _heads(model, "mtp")
    if mcfg.kind != "sequential":
        raise ConfigError("decoding with parallel (Gloeckle-style) MTP heads is not implemented; method 'mtp' "
                          "drafts with sequential (DeepSeek-V3-style) modules")
    if opts.get("total_tokens") is None:  # default: every node of the chain / the depth x top_k frontier
        opts = {**opts, "total_tokens": _int_opt(opts, "depth") * _int_opt(opts, "tree_top_k")}
    return _spec_plan(model, mp, MTPDrafter(model.cfg, mcfg, *_tree_opts(opts)), opts)


register(Method("medusa", _prepare_medusa,
                options={"tree": None, "typical": False, "typical_epsilon": 0.09, "typical_delta": 0.3, **PHASES},
                summary="Medusa heads, static tree; lossless verification (typical=True: Medusa's lossy typical "
                        "acceptance)"))
register(Method("eagle", _prepare_eagle, options={"tree_top_k": 10, "depth": 7, "total_tokens": 60, **PHASES},
                summary="EAGLE / EAGLE-3 drafter with EAGLE-2 dynamic trees (defaults: EAGLE-2's top_k 10, depth 7, "
                        "total_tokens 60)"))
register(Method("mtp", _prepare_mtp, options={"tree_top_k": 1, "depth": 1, "total_tokens": None, **PHASES},
                summary="multi-token prediction module as drafter: chain (default, one token) or tree; depth > 1 "
                        "reuses the first module on its own output (total_tokens defaults to depth x tree_top_k)"))


def _diffusion_model(model, method):
    from pdecode.errors import InputError

    if model.cfg.causal:
        raise InputError(f"method {method!r} needs a masked-diffusion (bidirectional) model such as code-dllm; "
                         f"{model.name or 'this model'} is autoregressive")
    mask_id = model.cfg.mask_token_id
    if mask_id is None and model.tokenizer is not None:
        mask_id = model.tokenizer.mask_id
    if mask_id is None:
        raise InputError(f"method {method!r} needs the model's mask token: set mask_token_id in config.json")
    return int(mask_id)


def _prepare_diffusion(model, draft, opts, samp, max_new=None):
    from pdecode.decode import diffusion

    mask_id = _diffusion_model(model, "diffusion")
    g = max_new
    kw = {k: v for k, v in opts.items() if v is not None}
    kw.setdefault("block_length", g)
    kw.setdefault("steps", g)
    o = diffusion.DiffusionOptions(gen_length=g, shift=model.cfg.diffusion_shift, **kw)
    return Plan(fn=diffusion.generate, params=model.params,
                static={"cfg": model.cfg, "opts": o, "mask_id": mask_id}, extra_len=0,
                finish_stats=_diffusion_stats)


def _prepare_dico(model, draft, opts, samp, max_new=None):
    from pdecode.decode import dico

    mask_id = _diffusion_model(model, "dico")
    o = dico.DiCoOptions(gen_length=max_new, shift=model.cfg.diffusion_shift, **opts)
    return Plan(fn=dico.generate, params=model.params, static={"cfg": model.cfg, "opts": o, "mask_id": mask_id},
                extra_len=0, finish_stats=_diffusion_stats)


def _diffusion_stats(s):
    """``nfe``: the model forwards a row waited for, averaged over the rows (a row alone would take as many);
    ``target_forwards``: the passes the batch ran (a cached step where only some rows start a block runs two)."""
    import numpy as np

    s["nfe"] = s["row_forwards"] / max(s["batch"], 1)
    s["tokens_per_forward"] = s["new_tokens"] / max(s["row_forwards"], 1)
    s["commit_step"] = np.asarray(s["commit_step"]).tolist()
    return s


register(Method("diffusion", _prepare_diffusion, wants_max_new=True,
                options={"block_length": None, "steps": None, "rule": "schedule", "alg": "confidence",
                         "threshold": 0.9, "factor": 1.0, "eb_gamma": 0.1, "alg_temp": 0.0, "cfg_scale": 0.0,
                         "cache": "none", "refresh_every": 0},
                summary="masked diffusion: LLaDA schedule / Fast-dLLM threshold & factor / EB-sampler rules, "
                        "Dream confidence algorithms, semi-AR blocks, prefix & dual KV cache, CFG"))
def _dico_defaults():
    import dataclasses

    from pdecode.decode.dico import DiCoOptions

    return {f.name: f.default for f in dataclasses.fields(DiCoOptions) if f.name not in ("gen_length", "shift")}


register(Method("dico", _prepare_dico, wants_max_new=True, options=_dico_defaults(),
                summary="DiCo divide-conquer-finalize decoding for masked diffusion models"))
