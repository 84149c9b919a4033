"""The decoding methods `pdecode.generate` knows, and how each is prepared.

A method turns (target model, optional draft, options, sampling) into a `Plan`: a pure jit-able function
``fn(params, prompt_BP, prompt_len_B, key, temperature, top_p, **static)`` returning ``(Outputs, stats)``, the
params pytree it takes, its static arguments and how many extra cache slots it needs beyond prompt + new tokens.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

from pdecode.errors import ConfigError, InputError


@dataclasses.dataclass
class Plan:
    fn: Callable
    params: Any
    static: dict[str, Any]
    extra_len: int = 0
    # Host-side post-processing of stats (device scalars already converted to Python numbers).
    finish_stats: Callable[[dict], dict] | None = None


@dataclasses.dataclass(frozen=True)
class Method:
    name: str
    prepare: Callable[..., Plan]  # prepare(model, draft, options: dict, samp) -> Plan
    options: dict[str, Any]  # option name -> default
    needs_draft: bool = False
    summary: str = ""
    wants_max_new: bool = False  # prepare() also takes max_new (diffusion: the canvas length)


METHODS: dict[str, Method] = {}


def register(method: Method) -> Method:
    METHODS[method.name] = method
    return method


def get(name: str) -> Method:
    _load_builtin()
    if name not in METHODS:
        raise InputError(f"unknown method {name!r}; available: {', '.join(sorted(METHODS))}")
    return METHODS[name]


def resolve_options(method: Method, given: dict[str, Any]) -> dict[str, Any]:
    unknown = sorted(set(given) - set(method.options))
    if unknown:
        allowed = ", ".join(sorted(method.options)) or "none"
        raise InputError(f"method {method.name!r} does not take option(s) {', '.join(unknown)}; it takes: {allowed}")
    return {**method.options, **given}


def check_same_vocab(target_cfg, draft_cfg, what: str = "draft") -> None:
    if target_cfg.vocab_size != draft_cfg.vocab_size:
        raise ConfigError(f"the {what} model's vocabulary ({draft_cfg.vocab_size}) does not match the target's "
                          f"({target_cfg.vocab_size}); both must share one tokenizer")


_loaded = False


def _load_builtin():
    global _loaded
    if _loaded:
        return
    _loaded = True
    from pdecode.decode import builtin  # noqa: F401  (registers the methods)
