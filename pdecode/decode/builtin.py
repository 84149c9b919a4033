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
    return Plan(fn=ar.generate, params=model.params, static={"cfg": model.cfg})


def _spec_plan(model, draft_params, drafter) -> Plan:
    return Plan(fn=speculative.generate, params=(model.params, draft_params),
                static={"cfg": model.cfg, "drafter": drafter}, extra_len=drafter.tree_size + 2,
                finish_stats=lambda s: speculative.acceptance_stats({**s, "tree_size": drafter.tree_size}))


def _prepare_sd(model, draft, opts, samp):
    from pdecode.decode.draft_model import DraftChain

    check_same_vocab(model.cfg, draft.cfg)
    gamma = _int_opt(opts, "gamma")
    adaptive = bool(opts["adaptive"])
    gmax = opts["gamma_max"] if opts["gamma_max"] is not None else (max(2 * gamma, 8) if adaptive else gamma)
    if not isinstance(gmax, int) or gmax < gamma:
        raise ConfigError(f"gamma_max must be an integer >= gamma ({gamma}), got {gmax!r}")
    return _spec_plan(model, draft.params, DraftChain(draft.cfg, gamma, gmax, adaptive))


def _prepare_tree(model, draft, opts, samp):
    from pdecode.decode.draft_model import DraftDynamicTree, DraftStaticTree

    check_same_vocab(model.cfg, draft.cfg)
    if opts["tree"] == "dynamic":
        k, d, n = _int_opt(opts, "tree_top_k"), _int_opt(opts, "depth"), _int_opt(opts, "total_tokens")
        pool = k + (d - 1) * k * k
        if n > pool:
            raise ConfigError(f"total_tokens ({n}) exceeds the {pool} nodes a tree with tree_top_k={k}, depth={d} "
                              f"grows")
        drafter = DraftDynamicTree(draft.cfg, k, d, n)
    else:
        drafter = DraftStaticTree(draft.cfg, tree_lib.resolve(opts["tree"]))
    return _spec_plan(model, draft.params, drafter)


def _prepare_lookup(model, draft, opts, samp):
    from pdecode.decode.lookup import LookupDrafter

    g, nmax, nmin, br = (_int_opt(opts, k) for k in ("gamma", "ngram_max", "ngram_min", "branches"))
    if nmin > nmax:
        raise ConfigError(f"ngram_min ({nmin}) must not exceed ngram_max ({nmax})")
    return _spec_plan(model, None, LookupDrafter(gamma=g, ngram_max=nmax, ngram_min=nmin, branches=br))


register(Method("ar", _prepare_ar, options={}, summary="autoregressive, one token per forward"))
register(Method("sd", _prepare_sd, options={"gamma": 4, "adaptive": False, "gamma_max": None}, needs_draft=True,
                summary="speculative decoding with a draft model, chain of gamma tokens (optionally adaptive)"))
register(Method("tree", _prepare_tree, options={"tree": "dynamic", "tree_top_k": 4, "depth": 5, "total_tokens": 24},
                needs_draft=True,
                summary="draft-model token tree: EAGLE-2-style dynamic (tree_top_k = EAGLE-2's top_k, depth, "
                        "total_tokens) or a static "
                        "preset / choice paths"))
register(Method("lookup", _prepare_lookup, options={"gamma": 4, "ngram_max": 3, "ngram_min": 1, "branches": 1},
                summary="prompt lookup (n-gram) drafting, chain or multi-candidate tree; no extra model"))
