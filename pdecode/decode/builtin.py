"""Registers the built-in decoding methods."""

from __future__ import annotations

import dataclasses

import jax

from pdecode.decode import ar, speculative
from pdecode.decode import tree as tree_lib
from pdecode.decode.registry import METHODS, Method, Option, Plan, check_same_vocab, register
from pdecode.errors import ConfigError, InputError


def _int_opt(opts, name, lo=1):
    v = opts[name]
    if not isinstance(v, int) or isinstance(v, bool) or v < lo:
        raise ConfigError(f"{name} must be an integer >= {lo}, got {v!r}")
    return v


def _prepare_ar(model, draft, opts, samp):
    return Plan(fn=ar.generate, params=model.params,
                static={"cfg": model.cfg, "phases": _int_opt(opts, "cache_phases")}, loop="token", engine="ar")


# every loop over a target KV cache runs in phases (`common.phase_lengths`)
PHASES = {"cache_phases": Option(4, "int", "the loop runs over a target KV cache grown in this many steps (1: one "
                                           "loop over the full cache, the shortest compile)")}


def _spec_plan(model, draft_params, drafter, opts) -> Plan:
    return speculative.make_plan(model, drafter, draft_params, _int_opt(opts, "cache_phases"))


def _draft_params(draft, opts) -> dict:
    """The draft model's params, with its reduced vocabulary (`with_draft_vocab`) under ``draft_vocab``: "auto"
    (the one the draft ships, if any, and when its params are not sharded), True (required) or False."""
    from pdecode.decode.draft_model import with_draft_vocab

    want, ids = opts["draft_vocab"], draft.extras.get("draft_vocab")
    if want is False or (want == "auto" and (ids is None or draft._placed is not None)):
        return draft.params
    if ids is None:
        raise ConfigError(f"draft_vocab=True: the draft {draft.name or 'model'} ships no reduced vocabulary (make "
                          "one with `pdecode train draft --draft-vocab N`); use draft_vocab='auto' or False")
    if draft._placed is not None:
        raise ConfigError("draft_vocab=True needs the draft on one device (its params are sharded on a mesh); use "
                          "draft_vocab='auto' or False")
    return with_draft_vocab(draft.params, draft.cfg, ids)


DRAFT_VOCAB = {"draft_vocab": Option("auto", "bool | str", "the draft's head reads only the reduced vocabulary the "
                                     "draft model ships (its config.json's pdecode_draft_vocab): auto (when it ships "
                                     "one), True, False; lossless either way", choices=("auto",))}


def _prepare_sd(model, draft, opts, samp):
    from pdecode.decode.draft_model import DraftChain

    check_same_vocab(model.cfg, draft.cfg)
    gamma = _int_opt(opts, "gamma")
    adaptive = bool(opts["adaptive"])
    gmax = opts["gamma_max"] if opts["gamma_max"] is not None else (max(2 * gamma, 8) if adaptive else gamma)
    if not isinstance(gmax, int) or gmax < gamma:
        raise ConfigError(f"gamma_max must be an integer >= gamma ({gamma}), got {gmax!r}")
    return _spec_plan(model, _draft_params(draft, opts), DraftChain(draft.cfg, gamma, gmax, adaptive), opts)


def _prepare_tree(model, draft, opts, samp):
    from pdecode.decode.draft_model import DraftDynamicTree, DraftStaticTree

    check_same_vocab(model.cfg, draft.cfg)
    if opts["tree"] == "dynamic":
        drafter = DraftDynamicTree(draft.cfg, *_tree_opts(opts))
    else:
        drafter = DraftStaticTree(draft.cfg, tree_lib.resolve(opts["tree"]))
    return _spec_plan(model, _draft_params(draft, opts), drafter, opts)


def _prepare_lookup(model, draft, opts, samp, batch=None, context=None, engine=False):
    from pdecode.decode.lookup import NGRAM_MAX_LIMIT, LookupDrafter

    g, nmax, nmin, br = (_int_opt(opts, k) for k in ("gamma", "ngram_max", "ngram_min", "branches"))
    if nmin > nmax:
        raise ConfigError(f"ngram_min ({nmin}) must not exceed ngram_max ({nmax})")
    if nmax > NGRAM_MAX_LIMIT:
        raise ConfigError(f"ngram_max must be <= {NGRAM_MAX_LIMIT}, got {nmax}")
    from pdecode.decode import cost

    c = opts["draft_cost"]
    if c == "auto":
        # the engine keeps its own speculation policy (it times its step calls while serving): nothing to measure
        c = 1.0 if engine or _unmeasurable(model, batch) else cost.step_cost(
            model, batch, "lookup", {"gamma": g, "ngram_max": nmax, "ngram_min": nmin, "branches": br,
                                     "draft_cost": 0.0, "cache_phases": opts["cache_phases"]},
            1 + g * br, context or cost.CONTEXT, repeat=True)
    elif isinstance(c, str) or not c >= 0:
        raise ConfigError(f"draft_cost must be a number >= 0 or 'auto' (measured), got {c!r}")
    c = float(c)
    plan = _spec_plan(model, None, LookupDrafter(gamma=g, ngram_max=nmax, ngram_min=nmin, branches=br, cost=c), opts)
    return _add_stats(plan, {"verify_cost": round(c, 3)})


register(Method("ar", _prepare_ar, options=dict(PHASES),
                summary="autoregressive, one token per target forward (the baseline every method is compared with)"))
register(Method("sd", _prepare_sd, needs_draft=True, needs="draft model",
                options={"gamma": Option(4, "int", "draft tokens per step (the chain's length)"),
                         "adaptive": Option(False, "bool", "per row, gamma +2 after a fully accepted chain and -1 "
                                                           "otherwise (HF's heuristic)"),
                         "gamma_max": Option(None, "int", "adaptive: the largest gamma (default max(2 gamma, 8))"),
                         **DRAFT_VOCAB, **PHASES},
                summary="speculative decoding: a small draft model proposes a chain of gamma tokens, the target "
                        "verifies them in one forward"))
TREE_OPTS = {
    "tree_top_k": Option(4, "int", "dynamic tree: children expanded per node (EAGLE-2's top_k)"),
    "depth": Option(5, "int", "dynamic tree: draft steps (the tree's depth)"),
    "total_tokens": Option(24, "int", "dynamic tree: nodes kept for verification, by cumulative draft probability"),
}
register(Method("tree", _prepare_tree, needs_draft=True, needs="draft model",
                options={"tree": Option("dynamic", "str | list | tree",
                                        "'dynamic' (EAGLE-2-style, built from the draft's "
                                        "probabilities), a preset name (e.g. 'binary-14', 'medusa-63') or choice "
                                        "paths such as [[0], [1], [0, 0]]"),
                         **TREE_OPTS, **DRAFT_VOCAB, **PHASES},
                summary="a draft model's token tree (dynamic or static) verified in one forward, several candidates "
                        "per depth"))
register(Method("lookup", _prepare_lookup, wants_batch=True,
                options={"gamma": Option(10, "int", "tokens drafted after the best match"),
                         "ngram_max": Option(8, "int", "the longest context (tokens before a match) compared "
                                                           "with the row's end"),
                         "ngram_min": Option(1, "int", "the shortest context that counts as a match"),
                         "branches": Option(1, "int", "candidate continuations verified together (a tree; 1: a "
                                                      "chain)"),
                         "draft_cost": Option("auto", "float | str",
                                              "a drafted step's cost in plain steps: a step drafts when each row "
                                              "furthest from its end expects that many tokens (0: whenever a row "
                                              "has a match); 'auto': "
                                              "measured on this device at the generation's batch (pdecode.decode."
                                              "cost)"),
                         **PHASES},
                summary="prompt lookup: drafts what followed the best match of the row's end in its own prompt and "
                        "output; no extra model"))



JACOBI_BLOCKS = (1, 2, 4, 8)  # block="auto": the largest of these a verify can afford (`cost.choose`)
LOOKAHEAD_SIZES = (1, 2, 3, 5, 7)  # window="auto": W (and G when auto too) from these


def _unmeasurable(model, batch) -> bool:
    """No batch given, or a model of abstract shapes (`infer.plan`): nothing to time a verify with."""
    return batch is None or any(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves(model.params))


def _sized(model, batch, context, candidates, what, method, opts_of):
    """`cost.choose` (``method``'s steps at ``opts_of(size)`` timed against ar's) on a model with weights; an
    unmeasurable one gets the largest candidate."""
    from pdecode.decode import cost

    if _unmeasurable(model, batch):
        size, tokens = max(candidates, key=lambda c: c[1])
        return cost.Sizing(size, tokens, None, f"{what} {size}: nothing measured (no batch, or abstract weights)")
    return cost.choose(model, batch, candidates, context or cost.CONTEXT, what, method, opts_of)


def _add_stats(plan, extra: dict):
    """``plan`` whose stats also hold ``extra`` (after the plan's own finishing)."""
    own = plan.finish_stats or (lambda st: st)
    return dataclasses.replace(plan, finish_stats=lambda st: {**own(st), **extra})


def _as_ar(model, opts, samp, sizing, what: str = "window"):
    """A method whose window (or tree) does not pay on this device at any size: AR's plan, its stats saying why
    (``what``: 0 and ``what + "_note"``)."""
    plan = _prepare_ar(model, None, {"cache_phases": opts["cache_phases"]}, samp)
    return _add_stats(plan, {what: 0, f"{what}_note": sizing.note})


def _with_window(plan, sizing, value, what: str = "window"):
    return _add_stats(plan, {what: value, **({f"{what}_note": sizing.note} if sizing is not None else {})})


def _auto_int(opts, name):
    v = opts[name]
    if v == "auto":
        return None
    if isinstance(v, str):
        raise ConfigError(f"{name} must be an integer >= 1 or 'auto' (sized by the measured verify cost), got {v!r}")
    return _int_opt(opts, name)


def _prepare_jacobi(model, draft, opts, samp, batch=None, context=None, engine=False):
    from pdecode.decode.jacobi import JacobiDrafter

    block, sizing = _auto_int(opts, "block"), None
    if block is None:
        sizing = _sized(model, batch, context, [(k, k + 1) for k in JACOBI_BLOCKS], "block", "jacobi",
                        lambda k: {"block": k, "cache_phases": opts["cache_phases"]})
        if sizing.size == 0:
            return _as_ar(model, opts, samp, sizing)
        block = sizing.size
    return _with_window(_spec_plan(model, None, JacobiDrafter(block=block), opts), sizing, block)


def _prepare_lookahead(model, draft, opts, samp, batch=None, context=None, engine=False):
    from pdecode.decode.lookahead import LookaheadDrafter

    n = _int_opt(opts, "ngram")
    if n < 2:
        raise ConfigError(f"ngram must be >= 2 (a key token and at least one continuation token), got {n}")
    w, g, sizing = _auto_int(opts, "window"), _auto_int(opts, "guesses"), None
    if w is None or g is None:
        cands = [(s, 1 + (n - 1) * ((w or s) + (g or s))) for s in LOOKAHEAD_SIZES]
        sizing = _sized(model, batch, context, cands, "window", "lookahead",
                        lambda k: {"window": w or k, "guesses": g or k, "ngram": n, "seed_prompt": opts["seed_prompt"],
                                   "cache_phases": opts["cache_phases"]})
        if sizing.size == 0:
            return _as_ar(model, opts, samp, sizing)
        w, g = w or sizing.size, g or sizing.size
    return _with_window(_spec_plan(model, None, LookaheadDrafter(window=w, ngram=n, guesses=g,
                                                                 seed_prompt=bool(opts["seed_prompt"]),
                                                                 vocab_size=model.cfg.vocab_size), opts),
                        sizing, {"window": w, "guesses": g})


AUTO_HELP = ("; 'auto': the largest whose step costs at most 1/0.95 of an ar step on this device (measured), "
             "none: the method runs as ar (pdecode.decode.cost)")
register(Method("jacobi", _prepare_jacobi, wants_batch=True,
                options={"block": Option("auto", "int | str", "guessed tokens iterated toward the fixed point per "
                                                              "step (1, 2, 4 or 8 when auto)" + AUTO_HELP),
                         **PHASES},
                summary="Jacobi decoding: the target refines a block of guesses in parallel each forward and keeps "
                        "the converged prefix; no extra model"))
register(Method("lookahead", _prepare_lookahead, wants_batch=True,
                options={"window": Option("auto", "int | str", "W: lookahead columns, each extended by one token "
                                                               "per step (1 .. 7 when auto)" + AUTO_HELP),
                         "ngram": Option(5, "int", "N: n-gram length kept in the pool (candidates of N-1 tokens)"),
                         "guesses": Option("auto", "int | str", "G: pool candidates verified per step (and kept per "
                                                                "key); 'auto': W's size when W is auto, else sized "
                                                                "as W is"),
                         "seed_prompt": Option(True, "bool", "seed the n-gram pool with the prompt's n-grams"),
                         **PHASES},
                summary="lookahead decoding: a 2-D Jacobi window and an n-gram pool; the lookahead and verification "
                        "branches share one target forward; no extra model"))


def _prepare_layerskip(model, draft, opts, samp):
    from pdecode.decode.layerskip import LayerSkipDrafter

    n_layers = model.cfg.num_layers
    xcfg, xp = model.extras.get("layerskip", (None, None))  # a trained early-exit adapter, when attached
    if xcfg is not None:
        if opts["exit_layer"] not in (None, xcfg.exit_layer) or opts["skip"]:
            raise ConfigError(f"the attached layerskip heads are an exit adapter after layer {xcfg.exit_layer}: leave "
                              f"exit_layer and skip unset (or decode with the base model alone)")
        opts = {**opts, "exit_layer": xcfg.exit_layer}
    exit_layer = opts["exit_layer"] if opts["exit_layer"] is not None else max(1, n_layers // 2)
    if not isinstance(exit_layer, int) or not 1 <= exit_layer <= n_layers:
        raise ConfigError(f"exit_layer must be an integer in 1..{n_layers} (the model's layers), got {exit_layer!r}")
    skip = tuple(sorted(set(opts["skip"] or ())))
    if any(not isinstance(i, int) or not 0 <= i < n_layers for i in skip):
        raise ConfigError(f"skip must list layer indices in 0..{n_layers - 1}, got {list(opts['skip'])!r}")
    layers = tuple(i for i in range(exit_layer) if i not in skip)
    if not layers or layers == tuple(range(n_layers)):
        raise ConfigError(f"the draft must run some but not all of the {n_layers} layers: exit_layer={exit_layer}, "
                          f"skip={list(skip)} leaves {len(layers)}")
    thr = opts["threshold"]
    if not 0.0 <= thr < 1.0:
        raise ConfigError(f"threshold must be in [0, 1), got {thr}")
    d = LayerSkipDrafter(model.cfg, layers, gamma=_int_opt(opts, "gamma"), threshold=float(thr),
                         adaptive=bool(opts["adaptive"]), exit_adapter=xcfg is not None)
    return _spec_plan(model, xp, d, opts)


register(Method("layerskip", _prepare_layerskip,
                options={"exit_layer": Option(None, "int", "the draft runs the target's layers below this one "
                                                           "(default: half of them), then its final norm and head"),
                         "skip": Option(None, "list", "layers below exit_layer the draft also skips (Draft & Verify)"),
                         "gamma": Option(6, "int", "most tokens drafted per step"),
                         "threshold": Option(0.0, "float", "stop drafting when the draft's top-1 probability falls "
                                                           "below this (0: always draft gamma tokens)"),
                         "adaptive": Option(True, "bool", "adapt the threshold to the acceptance rate"),
                         **PHASES},
                summary="layer-skip self-speculation: the target's own first layers draft, the rest verify, reusing "
                        "the shared layers' KV; no extra weights, or a trained early-exit adapter (layerskip heads)"))


def _prepare_pearl(model, draft, opts, samp):
    from pdecode.decode.pearl import PearlDrafter

    check_same_vocab(model.cfg, draft.cfg)
    drafter = PearlDrafter(draft.cfg, gamma=_int_opt(opts, "gamma"))
    if opts["placement"] != "split":
        return _spec_plan(model, draft.params, drafter, opts)
    devices = _pipe_devices(model, draft)
    plan = speculative.make_plan(model, drafter, _replicated(draft, devices), _int_opt(opts, "cache_phases"),
                                 pipe_devices=devices)
    plan.params = (_replicated(model, devices), plan.params[1])
    return plan


def _replicated(m, devices):
    """``m``'s params with a copy on each of ``devices`` (kept on the model: placed once)."""
    import jax
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    key = ("replicated", devices)
    if key not in m._sharded:
        by_id = {d.id: d for d in jax.devices()}
        mesh = Mesh(np.asarray([by_id[i] for i in devices]), (speculative.PIPE,))
        m._sharded[key] = jax.device_put(m.params, NamedSharding(mesh, PartitionSpec()))
    return m._sharded[key]


def _pipe_devices(model, draft) -> tuple[int, int]:
    """The two devices of a pipeline placement: the first two of the default backend."""
    import jax

    from pdecode.errors import InputError

    devs = jax.devices()
    if len(devs) < 2:
        raise InputError(f"placement='split' runs the draft on a device of its own and needs 2 devices; this "
                         f"{devs[0].platform} backend has {len(devs)} (on CPU: XLA_FLAGS="
                         f"--xla_force_host_platform_device_count=2)")
    if model._placed is not None or draft._placed is not None:
        raise InputError("placement='split' places the target and the draft itself (device 0 and device 1): "
                         "drop mesh=")
    return devs[0].id, devs[1].id


register(Method("pearl", _prepare_pearl, needs_draft=True, needs="draft model",
                options={"gamma": Option(4, "int", "tokens the draft writes past the window each step (the next "
                                                   "window's length)"),
                         "placement": Option("same", "str", "same: both models on the same devices, one half of a "
                                                            "step after the other; split: the target on device 0 and "
                                                            "the draft on device 1, the halves at once in one program",
                                             choices=("same", "split")),
                         **PHASES},
                summary="PEARL: the draft writes the next window while the target verifies the current one (pre- "
                        "and post-verify); a rejection costs one target token, not a wasted window"))

def _prepare_diffusion_draft(model, draft, opts, samp):
    from pdecode.decode.diffusion_draft import BlockDiffusionDrafter, DiffusionDrafter

    check_same_vocab(model.cfg, draft.cfg)
    block = bool(draft.cfg.arch.canvas_length)  # DiffusionGemma: no mask token; undecided positions are the pad token
    mask_id = int(draft.cfg.pad_token_id or 0) if block else _diffusion_model(draft, "diffusion_draft")
    g, steps, k = (_int_opt(opts, n) for n in ("gamma", "steps", "tree_top_k"))
    if steps > g:
        raise ConfigError(f"steps ({steps}) must not exceed gamma ({g}): each denoising forward commits >= 1 token")
    total = opts["total_tokens"]
    if k > 1:
        total = total if total is not None else min(2 * g * k, k + (g - 1) * k * k)
        if not isinstance(total, int) or total < 1 or total > k + (g - 1) * k * k:
            raise ConfigError(f"total_tokens must be an integer in [1, {k + (g - 1) * k * k}] for tree_top_k={k}, "
                              f"gamma={g}; got {total!r}")
        if opts["refill"]:
            raise ConfigError("refill re-fills a chain's block: use it with tree_top_k=1")
    kind = BlockDiffusionDrafter if block else DiffusionDrafter
    drafter = kind(draft.cfg, mask_id=mask_id, shift=draft.cfg.diffusion_shift, gamma=g, steps=steps,
                   tree_top_k=k, total_tokens=total or 0, adaptive=bool(opts["adaptive"]), refill=bool(opts["refill"]))
    plan = _spec_plan(model, draft.params, drafter, opts)
    plan.extra_len = max(plan.extra_len, 2 * g + 2)  # the draft writes its block past the committed text
    return plan


register(Method("diffusion_draft", _prepare_diffusion_draft, draft="masked", needs_draft=True,
                needs="masked-diffusion draft model",
                options={"gamma": Option(8, "int", "masked positions the draft fills per step (the block)"),
                         "steps": Option(1, "int", "denoising forwards per block (each commits the most confident "
                                                   "masked positions; 1: one forward fills the block)"),
                         "tree_top_k": Option(1, "int", "candidates per block position (1: a chain of the top-1; "
                                                        "more: a tree over the per-position top-k lattice)"),
                         "total_tokens": Option(None, "int", "tree nodes kept, by cumulative draft log-probability "
                                                             "(default 2 x gamma x tree_top_k)"),
                         "adaptive": Option(False, "bool", "adapt each row's block length to acceptance (+2 after a "
                                                           "fully accepted block, -1 otherwise)"),
                         "refill": Option(False, "bool", "after a rejection, start the next block from the last "
                                                         "block's tokens past the bonus, re-filled by the draft model, "
                                                         "instead of masks"),
                         **PHASES},
                summary="a masked-diffusion model drafts a block of positions in one (or a few) denoising forwards; "
                        "a chain or a top-k lattice tree, verified losslessly (SpecDiff / DiffuSpec)"))


def _heads(model, kind: str):
    from pdecode.errors import InputError

    if kind not in model.extras:
        raise InputError(f"method {kind!r} needs {kind} heads on the model: load a heads directory "
                         f"(e.g. pdecode.load('code-target-{kind}')) or attach them with "
                         f"pdecode.attach_heads(model, path)",
                         cli=f"method {kind!r} needs {kind} heads on the model: pass a heads directory as the model "
                             f"(--model code-target-{kind}: it loads its base model too), or in --compare name it "
                             f"after the method ({kind}@code-target-{kind})")
    return model.extras[kind]


MEDUSA_AUTO_NODES = (1, 2, 4, 8, 16, 32, 64)  # tree="auto": the calibrated tree of one of these sizes


def _medusa_auto(model, batch, context, meta, opts):
    """tree="auto": of the calibrated trees of `MEDUSA_AUTO_NODES` nodes (each's expected tokens per step from the
    heads' accuracy table, Medusa's estimate), the one with the most expected tokens per unit of time, its step timed
    here against ar's (`cost.choose_rate`). Returns (paths or None when none beats ar, sizing)."""
    if not (meta.get("tree_calibration") or {}).get("accuracy"):
        raise ConfigError("tree='auto' sizes the tree from the heads' calibrated accuracies (heads.json "
                          "'tree_calibration'), which these heads lack: calibrate them (pdecode train heads --base "
                          "BASE --kind medusa --data FILES --out HEADS --calibrate-only) or give a tree")
    cands = []
    for n in MEDUSA_AUTO_NODES:
        paths, expected = tree_lib.calibrated_paths(meta["tree_calibration"]["accuracy"], n)
        if not cands or len(paths) > len(cands[-1][0]["tree"]):  # (few heads and ranks: the trees stop growing)
            cands.append(({**opts, "tree": paths}, len(paths) + 1, expected))
    best, sizing = _choose_tree(model, batch, context, "medusa", cands)
    return (None if best is None else best["tree"]), sizing


def _prepare_medusa(model, draft, opts, samp, batch=None, context=None, engine=False):
    from pdecode.decode.medusa import MedusaDrafter, check_tree

    mcfg, mp = _heads(model, "medusa")
    meta = model.extras.get("medusa_meta", {})
    spec = opts["tree"]
    sizing = None
    if spec == "auto":
        spec, sizing = _medusa_auto(model, batch, context, meta, opts)
        if spec is None:  # no tree pays on this device
            return _as_ar(model, opts, samp, sizing, "tree")
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
    plan = _spec_plan(model, mp, MedusaDrafter(model.cfg, mcfg, tr, typical), opts)
    return plan if sizing is None else _with_window(plan, sizing, sizing.size, "tree")


def _tree_opts(opts):
    k, d, n = _int_opt(opts, "tree_top_k"), _int_opt(opts, "depth"), _int_opt(opts, "total_tokens")
    pool = k + (d - 1) * k * k
    if n > pool:
        raise ConfigError(f"total_tokens ({n}) exceeds the {pool} nodes a tree with tree_top_k={k}, depth={d} grows")
    return k, d, n


def _sized_tree(model, batch, context, method: str, opts):
    """``total_tokens="auto"``: the tree of the heads' calibrated ladder (heads.json ``tree_sizes``: each tree's
    tokens per step, measured on the drafter's calibration data) with the most expected tokens per unit of time, its
    step timed here against ar's (`cost.choose_rate`); (None, sizing) when none beats ar. Returns (opts, sizing)."""
    cal = (model.extras.get(f"{method}_meta") or {}).get("tree_sizes")
    if not cal:
        raise ConfigError("total_tokens='auto' sizes the tree from the heads' tree-size calibration (heads.json "
                          "'tree_sizes'), which these heads lack: calibrate them (pdecode train heads --base BASE "
                          "--kind KIND --data FILES --out HEADS --calibrate-only) or give total_tokens")
    cands = [({**opts, "tree_top_k": t["tree_top_k"], "depth": t["depth"], "total_tokens": t["total_tokens"]},
              t["total_tokens"] + 1, float(t["tokens_per_forward"])) for t in cal["trees"]]
    return _choose_tree(model, batch, context, method, cands)


def _choose_tree(model, batch, context, method: str, cands):
    """`cost.choose_rate` over the candidate trees ``(opts, verify tokens, expected tokens per step)`` on a model
    with weights; an unmeasurable one gets the candidate expected to accept most. Returns (opts or None, sizing)."""
    from pdecode.decode import cost

    if _unmeasurable(model, batch):
        o, tokens, _ = max(cands, key=lambda c: c[2])
        return o, cost.Sizing(tokens - 1, tokens, None, f"tree {tokens - 1}: the calibrated tree accepting most "
                                                        "(nothing measured: no batch, or abstract weights)")
    return cost.choose_rate(model, batch, cands, context or cost.CONTEXT, "tree", method)


def _prepare_eagle(model, draft, opts, samp, batch=None, context=None, engine=False):
    from pdecode.decode.eagle import EagleDrafter

    ecfg, ep = _heads(model, "eagle")
    sizing = None
    if opts["total_tokens"] == "auto":
        sized, sizing = _sized_tree(model, batch, context, "eagle", opts)
        if sized is None:  # no tree pays on this device
            return _as_ar(model, opts, samp, sizing, "tree")
        opts = sized
    elif isinstance(opts["total_tokens"], str):
        raise ConfigError(f"total_tokens must be an integer >= 1 or 'auto' (the calibrated tree with the most "
                          f"tokens per unit of time on this device), got {opts['total_tokens']!r}")
    plan = _spec_plan(model, ep, EagleDrafter(model.cfg, ecfg, *_tree_opts(opts)), opts)
    if sizing is None:
        return plan
    return _with_window(plan, sizing, {k: opts[k] for k in ("tree_top_k", "depth", "total_tokens")}, "tree")


def _prepare_mtp(model, draft, opts, samp):
    from pdecode.decode.eagle import MTPDrafter

    mcfg, mp = _heads(model, "mtp")
    if mcfg.kind != "sequential":
        raise ConfigError("decoding with parallel (Gloeckle-style) MTP heads is not implemented; method 'mtp' "
                          "drafts with sequential (DeepSeek-V3-style) modules")
    if opts.get("total_tokens") is None:  # default: every node of the chain / the depth x top_k frontier
        opts = {**opts, "total_tokens": _int_opt(opts, "depth") * _int_opt(opts, "tree_top_k")}
    return _spec_plan(model, mp, MTPDrafter(model.cfg, mcfg, *_tree_opts(opts)), opts)


register(Method("medusa", _prepare_medusa, needs="Medusa heads", wants_batch=True,
                lossless="yes (typical=true: no, Medusa's typical acceptance)",
                options={"tree": Option(None, "str | list | tree",
                                        "static tree: None = the tree calibrated for the heads "
                                        "(heads.json), 'calibrated:N', a preset or choice paths; 'auto': the "
                                        "calibrated tree (1 .. 64 nodes) with the most expected tokens per unit of "
                                        "time, its step measured on this device (none beats ar: the method runs as "
                                        "ar)"),
                         "typical": Option(False, "bool", "Medusa's typical acceptance (lossy) instead of lossless "
                                                          "verification"),
                         "typical_epsilon": Option(0.09, "float", "typical acceptance: probability floor epsilon"),
                         "typical_delta": Option(0.3, "float", "typical acceptance: entropy scale delta"),
                         **PHASES},
                summary="Medusa heads on the target's last hidden state propose a static tree of their top-k"))
register(Method("eagle", _prepare_eagle, needs="EAGLE heads", wants_batch=True,
                options={"tree_top_k": Option(10, "int", "children expanded per node (EAGLE-2's top_k)"),
                         "depth": Option(7, "int", "draft steps (the tree's depth)"),
                         "total_tokens": Option(60, "int | str", "nodes kept for verification; 'auto': tree_top_k, "
                                                                 "depth and total_tokens of the heads' calibrated tree "
                                                                 "with the most expected tokens per unit of time, its "
                                                                 "step measured on this device (none beats ar: the "
                                                                 "method runs as ar)"),
                         **PHASES},
                summary="EAGLE-1/2 or EAGLE-3-style feature drafter growing EAGLE-2 dynamic trees"))
register(Method("mtp", _prepare_mtp, needs="MTP module",
                options={"tree_top_k": Option(1, "int", "candidates per depth (1: a chain)"),
                         "depth": Option(1, "int", "tokens drafted; depth > 1 reuses the first module on its own "
                                                   "output"),
                         "total_tokens": Option(None, "int", "tree nodes kept (default depth x tree_top_k)"),
                         **PHASES},
                summary="DeepSeek-V3-style multi-token-prediction modules draft a chain (default one token) or a "
                        "tree"))


def _prepare_assistant(model, draft, opts, samp):
    from pdecode.decode.assistant import AssistantDrafter
    from pdecode.errors import InputError

    if "assistant" not in model.extras:
        raise InputError("method 'assistant' needs a Gemma 4 assistant on the model: attach its directory (a "
                         "gemma4_assistant checkpoint) with pdecode.attach_heads(model, path)")
    acfg, ap = model.extras["assistant"]
    k, g = _int_opt(opts, "tree_top_k"), _int_opt(opts, "gamma")
    n = opts.get("total_tokens")
    if n is not None:
        n = _int_opt(opts, "total_tokens")
        if k == 1 or n > k + (g - 1) * k * k:
            raise ConfigError(f"total_tokens ({n}) needs tree_top_k > 1 and at most the {k + (g - 1) * k * k} nodes "
                              f"a tree with tree_top_k={k}, gamma={g} grows")
    return _spec_plan(model, ap, AssistantDrafter(model.cfg, acfg, g, k, n or 0), opts)


register(Method("assistant", _prepare_assistant, needs="Gemma 4 assistant",
                options={"gamma": Option(4, "int", "tokens drafted per step (the chain's length, the tree's depth)"),
                         "tree_top_k": Option(1, "int", "children per expanded node (1: a chain; more: an EAGLE-2 "
                                                        "dynamic tree)"),
                         "total_tokens": Option(None, "int", "tree nodes kept (default gamma x tree_top_k)"),
                         **PHASES},
                summary="a Gemma 4 assistant (gemma4_assistant, attached or given as draft=) reads the target's KV "
                        "cache and last hidden state and drafts a chain or a tree at the root's position"))


def _diffusion_model(model, method):
    from pdecode.errors import InputError

    if model.cfg.causal:
        raise InputError(f"method {method!r} needs a masked-diffusion (bidirectional) model such as code-dllm; "
                         f"{model.name or 'this model'} is autoregressive")
    if model.cfg.arch.canvas_length:  # (diffusion and dico handle block-diffusion models before asking for a mask)
        raise InputError(f"method {method!r} needs a mask token; {model.name or 'this model'} is a block-diffusion "
                         "model (noise, not masks, in its canvases): use method='diffusion' or 'dico'")
    mask_id = model.cfg.mask_token_id
    if mask_id is None and model.tokenizer is not None:
        mask_id = model.tokenizer.mask_id
    if mask_id is None:
        raise InputError(f"method {method!r} needs the model's mask token: set mask_token_id in config.json")
    return int(mask_id)


BLOCK_ONLY = ("t_min", "t_max", "stability", "confidence")


def _prepare_block_diffusion(model, opts, max_new):
    """method diffusion on a block-diffusion encoder-decoder (DiffusionGemma): its own sampler, its defaults from
    the checkpoint's generation_config.json (`pdecode.decode.block_diffusion`)."""
    from pdecode.decode import block_diffusion as bdf

    name = model.name or "this model"
    L = model.cfg.arch.canvas_length
    defaults = METHODS["diffusion"].defaults
    own = opts.get("rule") in (None, "model")
    if own:
        masked_only = sorted(k for k, v in opts.items() if k not in BLOCK_ONLY + ("steps", "eb_gamma", "rule")
                             and v != defaults[k])
        if masked_only:
            raise InputError(f"method 'diffusion' on {name} (block diffusion, canvas of {L}) runs the model's own "
                             f"entropy-bound sampler unless rule= picks a masked one; option {masked_only[0]!r} "
                             "belongs to the masked samplers (rule=schedule, threshold, factor or eb): add one")
    else:
        for k, why in (("cfg_scale", "classifier-free guidance needs a mask token to hide the prompt, and "
                                     "DiffusionGemma has none"),
                       ("cache", "the encoder's KV cache of the prompt and committed canvases is always used (it "
                                 "is Fast-dLLM's prefix cache); there is no suffix to cache"),
                       ("refresh_every", "the encoder's cache never goes stale"),
                       ("block_length", f"each canvas ({L} tokens) is the block")):
            if opts.get(k) != defaults[k] and not (k == "block_length" and opts.get(k) == L):
                raise InputError(f"option {k!r} of method 'diffusion' does not apply on {name} (block diffusion): "
                                 f"{why}; drop it")
    kw = _block_settings(model, opts)
    if not own:
        from pdecode.decode import diffusion

        for k in ("stability", "confidence"):
            if opts.get(k) is not None:
                raise InputError(f"option {k!r} is the stopping rule of the model's own sampler (rule 'model'); "
                                 f"rule {opts['rule']!r} decides every position for good: drop it")
        kw2 = {k: opts[k] for k in ("rule", "alg", "threshold", "factor", "alg_temp", "remask", "remask_eta")}
        ro = diffusion.DiffusionOptions(gen_length=L, block_length=L, steps=int(opts.get("steps") or L),
                                        eb_gamma=float(opts.get("eb_gamma") or 0.1), **kw2)
        return _masked_canvas_plan(model, ro, "rule", kw, max_new)
    o = bdf.BlockDiffusionOptions(canvases=-(-max_new // L), canvas=L, noise_id=int(model.cfg.pad_token_id or 0),
                                  steps=int(kw["steps"]), t_min=float(kw["t_min"]), t_max=float(kw["t_max"]),
                                  entropy_bound=float(kw["entropy_bound"]), stability=int(kw["stability"]),
                                  confidence=float(kw["confidence"]))
    return Plan(fn=bdf.generate, params=model.params, static={"cfg": model.cfg, "opts": o},
                extra_len=o.canvases * L - max_new, finish_stats=_diffusion_stats, takes_cache_dtype=True)


def _block_settings(model, opts) -> dict:
    """The block-diffusion sampler's settings (`block_diffusion.DEFAULTS`): each as the caller gives it (the entropy
    bound as ``eb_gamma``), else the checkpoint's generation_config.json's, else the reference's default."""
    from pdecode.decode import block_diffusion as bdf

    gen = model.generation_config or {}
    sampler = gen.get("sampler_config") if isinstance(gen.get("sampler_config"), dict) else {}
    kw = {}
    for k, default in bdf.DEFAULTS.items():
        given = opts.get("eb_gamma" if k == "entropy_bound" else k)
        stored = sampler.get("entropy_bound", gen.get("entropy_bound")) if k == "entropy_bound" else \
            gen.get(bdf.GEN_CONFIG_NAMES[k])
        kw[k] = given if given is not None else (stored if stored is not None else default)
    return kw


def _masked_canvas_plan(model, rule_opts, sampler, kw, max_new):
    from pdecode.decode import block_diffusion as bdf

    L = model.cfg.arch.canvas_length
    o = bdf.MaskedCanvasOptions(canvases=-(-max_new // L), canvas=L, sampler=sampler, rule_opts=rule_opts,
                                t_min=float(kw["t_min"]), t_max=float(kw["t_max"]),
                                noise_id=int(model.cfg.pad_token_id or 0))
    return Plan(fn=bdf.generate_masked, params=model.params, static={"cfg": model.cfg, "opts": o},
                extra_len=o.canvases * L - max_new, finish_stats=_diffusion_stats, takes_cache_dtype=True)


def _prepare_diffusion(model, draft, opts, samp, max_new=None):
    from pdecode.decode import diffusion

    if model.cfg.arch.canvas_length:
        return _prepare_block_diffusion(model, opts, max_new)
    if opts.get("rule") == "model":
        raise InputError("rule 'model' (the model's own sampler) is for block-diffusion models such as DiffusionGemma; "
                         f"{model.name or 'this model'} is a masked-diffusion model: use schedule, threshold, factor "
                         "or eb")
    given = sorted(k for k in BLOCK_ONLY if opts.get(k) is not None)
    if given:
        raise InputError(f"option {given[0]!r} of method 'diffusion' is for block-diffusion models (DiffusionGemma); "
                         f"{model.name or 'this model'} is a masked-diffusion model: drop it")
    mask_id = _diffusion_model(model, "diffusion")
    g = max_new
    kw = {k: v for k, v in opts.items() if v is not None}
    kw.setdefault("block_length", g)
    kw.setdefault("steps", g)
    o = diffusion.DiffusionOptions(gen_length=g, shift=model.cfg.diffusion_shift, **kw)
    return Plan(fn=diffusion.generate, params=model.params,
                static={"cfg": model.cfg, "opts": o, "mask_id": mask_id}, extra_len=0,
                finish_stats=_diffusion_stats, takes_cache_dtype=True)


def _prepare_dico(model, draft, opts, samp, max_new=None):
    from pdecode.decode import dico

    if model.cfg.arch.canvas_length:  # DiffusionGemma: divide / conquer / finalize inside each canvas
        o = dico.DiCoOptions(gen_length=model.cfg.arch.canvas_length, shift=False, **opts)
        return _masked_canvas_plan(model, o, "dico", _block_settings(model, {}), max_new)
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
    if "commit_step" in s:  # (a block-diffusion model's samplers report steps per canvas instead)
        s["commit_step"] = np.asarray(s["commit_step"]).tolist()
    return s


NOT_AR = "no: a masked-diffusion model's own distribution"
register(Method("diffusion", _prepare_diffusion, target="masked", wants_max_new=True, needs="diffusion model",
                lossless=NOT_AR,
                options={
                    "block_length": Option(None, "int", "semi-AR block length (None: the whole canvas, one block)"),
                    "steps": Option(None, "int", "schedule rule: total denoising steps (None: one per token)"),
                    "rule": Option(None, "str", "how many positions to commit per step: LLaDA's schedule, "
                                   "Fast-dLLM's threshold or factor, EB-sampler's entropy bound; None: schedule "
                                   "(a block-diffusion model: 'model', its own sampler)",
                                   choices=("schedule", "threshold", "factor", "eb", "model")),
                    "alg": Option("confidence", "str", "which positions first: top-1 probability, top-1 minus "
                                  "top-2 margin, negative entropy, or random (Dream's algorithms)",
                                  choices=("confidence", "margin", "entropy", "random")),
                    "threshold": Option(0.9, "float", "threshold rule: commit every position above this confidence"),
                    "factor": Option(1.0, "float", "factor rule: Fast-dLLM's factor f (commit n with (n+1)(1-c_n) "
                                                   "< f)"),
                    "eb_gamma": Option(None, "float", "eb rule: the entropy budget gamma per step (None: 0.1); on "
                                       "a block-diffusion model its entropy_bound (None: generation_config.json's)"),
                    "alg_temp": Option(0.0, "float", "Dream's alg_temp: sample the order from softmax(conf / "
                                                     "alg_temp) (0: deterministic)"),
                    "cfg_scale": Option(0.0, "float", "classifier-free guidance scale (0: off; one more pass per "
                                                      "step)"),
                    "cache": Option("none", "str", "Fast-dLLM KV cache: none, prefix (prompt and finished blocks) "
                                    "or dual (also the suffix)", choices=("none", "prefix", "dual")),
                    "refresh_every": Option(0, "int", "cached runs: also refresh the cache every this many steps "
                                                      "(0: only at a block start)"),
                    "remask": Option("none", "str", "ReMDM: re-mask committed tokens of the block so later steps can "
                                     "correct them (threshold / factor / eb rules): none, cap, rescale or conf",
                                     choices=("none", "cap", "rescale", "conf")),
                    "remask_eta": Option(0.1, "float", "ReMDM's eta: the cap (cap) or scale (rescale, conf) of the "
                                                       "re-masking probability"),
                    "t_min": Option(None, "float", "block diffusion: the temperature of a canvas's last step "
                                    "(None: generation_config.json's, else 0.4)"),
                    "t_max": Option(None, "float", "block diffusion: the temperature of a canvas's first step "
                                    "(None: generation_config.json's, else 0.8)"),
                    "stability": Option(None, "int", "block diffusion: a row stops when its argmax canvas equals "
                                        "this many previous ones (None: generation_config.json's, else 1)"),
                    "confidence": Option(None, "float", "block diffusion: ... and its mean entropy is below this "
                                         "(None: generation_config.json's, else 0.005)"),
                },
                summary="masked diffusion: LLaDA schedule, Fast-dLLM threshold/factor with prefix or dual cache, "
                        "EB-sampler, Dream's orderings, semi-AR blocks, CFG"))
DICO_HELP = {
    "num_seeds": ("int", "Divide: seed positions picked per phase"),
    "seed_low": ("float", "Divide: lowest confidence a seed may have (moderate, not low)"),
    "seed_high": ("float", "Divide: highest confidence a seed may have (not already certain)"),
    "stability": ("float", "Divide: a seed's confidence may have moved at most this much since the previous step"),
    "stability_weight": ("float", "Divide: weight of that drift, subtracted from the confidence in the seed score"),
    "traj_beta": ("float", "Divide: EMA weight of the past in the trajectory confidence (0: the current step only)"),
    "nms_sigma": ("float", "Divide: spread between seeds (the Gaussian width of the suppression, in positions)"),
    "grow_threshold": ("float", "Divide: a neighbour joins a seed's cluster above this confidence"),
    "max_radius": ("int", "Divide: how far a cluster may grow each side of its seed"),
    "conquer_growth": ("int", "Conquer: positions a cluster may take in at each boundary per step"),
    "final_masks": ("int", "Finalize: switch to Finalize when this many masks or fewer are left"),
    "final_threshold": ("float", "Finalize: commit every mask whose confidence + margin score reaches this (and always the best)"),
    "margin_weight": ("float", "Finalize: weight of the top-1 minus top-2 logit margin"),
    "block_length": ("int", "semi-AR blocks (0: the whole canvas is one block)"),
    "divide_commit": ("str", "what Divide commits: 'factor' (the factor rule inside the new clusters) or 'seeds'"),
    "remask": ("str", "ReMDM: re-mask committed tokens of the block so later steps can correct them: none, cap, "
                      "rescale or conf (the least confident first)"),
    "remask_eta": ("float", "ReMDM's eta: the cap (cap) or the scale (rescale, conf) of the re-masking probability"),
}


def _dico_options():
    import dataclasses

    from pdecode.decode.dico import DiCoOptions

    fields = [f for f in dataclasses.fields(DiCoOptions) if f.name not in ("gen_length", "shift")]
    if {f.name for f in fields} != set(DICO_HELP):
        raise RuntimeError("every DiCoOptions field needs a line in DICO_HELP")
    return {f.name: Option(f.default, DICO_HELP[f.name][0], DICO_HELP[f.name][1],
                           choices={"divide_commit": ("factor", "seeds"), "remask": ("none", "cap", "rescale", "conf")}.get(f.name, ()))
            for f in fields}


register(Method("dico", _prepare_dico, target="masked", wants_max_new=True, options=_dico_options(),
                needs="diffusion model",
                lossless=NOT_AR,
                summary="DiCo: Divide picks spread-out seeds and grows clusters, Conquer decodes them in parallel, "
                        "Finalize fills the last masks"))


def _prepare_mask_predict(model, draft, opts, samp, max_new=None, oneshot=False):
    from pdecode.decode import mask_predict as mp

    name = "oneshot" if oneshot else "mask_predict"
    mask_id = _diffusion_model(model, name)
    eos = model.cfg.eos_token_ids or (model.tokenizer.eos_ids if model.tokenizer else ())
    if not eos:
        raise ConfigError(f"method {name!r} pads each answer with EOS: the model needs an eos_token_id")
    o = mp.MaskPredictOptions(iterations=1 if oneshot else _int_opt(opts, "iterations"), beams=_int_opt(opts, "beams"),
                              length=opts["length"])
    return Plan(fn=mp.generate, params=model.params,
                static={"cfg": model.cfg, "opts": o, "mask_id": mask_id, "eos_id": int(eos[0])}, extra_len=0,
                finish_stats=_mask_predict_stats)


def _mask_predict_stats(s):
    s["nfe"] = s["target_forwards"]
    s["tokens_per_forward"] = s["new_tokens"] / max(s["row_forwards"], 1)
    return s


_LENGTH = {"beams": Option(3, "int", "length beams: the most likely answer lengths, decoded in parallel; the best "
                                     "by mean log-probability is kept"),
           "length": Option("eos", "str", "eos: lengths from one pass's EOS probabilities over a canvas of masks; "
                                          "full: the whole canvas (beams 1)", choices=("eos", "full"))}
register(Method("oneshot", lambda m, d, o, s, max_new=None: _prepare_mask_predict(m, d, o, s, max_new, oneshot=True),
                target="masked",
                wants_max_new=True, options=dict(_LENGTH), needs="diffusion model", lossless=NOT_AR,
                summary="one-shot non-autoregressive: one forward fills the answer at a predicted length (length "
                        "beams from the model's EOS probabilities)"))
register(Method("mask_predict", _prepare_mask_predict, target="masked", wants_max_new=True,
                needs="diffusion model", lossless=NOT_AR,
                options={"iterations": Option(10, "int", "T: fill all, then re-mask the N (T - t) / T least probable "
                                                         "tokens and predict them again"), **_LENGTH},
                summary="Mask-Predict (CMLM): iterative refinement at predicted lengths, T forwards per length beam"))


def _prepare_edit(model, draft, opts, samp, max_new=None):
    from pdecode.decode import edit
    from pdecode.errors import InputError

    if "edit" not in model.extras:
        raise InputError(f"method 'edit' needs a model with edit heads, such as code-edit; {model.name or 'this model'} "
                         "has none")
    mask_id = _diffusion_model(model, "edit")
    ecfg, ep = model.extras["edit"]
    eos = model.cfg.eos_token_ids or (model.tokenizer.eos_ids if model.tokenizer else ())
    pad = model.cfg.pad_token_id if model.cfg.pad_token_id is not None else 0
    return Plan(fn=edit.generate, params=(model.params, ep),
                static={"cfg": model.cfg, "ecfg": ecfg, "mask_id": mask_id, "eos_id": int(eos[0]), "pad": int(pad),
                        "context": _int_opt(opts, "context", lo=0), "max_iterations": _int_opt(opts, "iterations"),
                        "confidence": float(ecfg.confidence)},  # the edit model's shipped decision threshold
                extra_len=1, finish_stats=_mask_predict_stats)


register(Method("edit", _prepare_edit, target="masked", wants_max_new=True, needs="edit model (code-edit)",
                lossless="no: the edit model's rewrite of the text",
                options={"context": Option(0, "int", "leading tokens of each prompt kept as they are (the rest is the "
                                                      "draft refined)"),
                         "iterations": Option(4, "int", "the most delete / insert / fill iterations")},
                summary="Levenshtein-style refinement of the given text: delete, insert placeholders, fill, until "
                        "nothing changes (max_new_tokens: room to grow)"))
