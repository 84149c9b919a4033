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


_TYPES = {"int": (int,), "float": (float, int), "bool": (bool,), "str": (str,), "list": (list, tuple)}


@dataclasses.dataclass(frozen=True)
class Option:
    """One method option: its default, its type (``"int"``, ``"float"``, ``"bool"``, ``"str"``, ``"list"`` or
    alternatives such as ``"str | list"``; ``None`` is accepted where the default is ``None``), allowed values
    (``choices``, for strings) and one line of help. `generate` checks the type and the choices before the method
    sees the value; ranges are the method's own checks."""

    default: Any
    type: str
    help: str
    choices: tuple = ()

    def check(self, method: str, name: str, value: Any) -> None:
        if value is None and self.default is None:
            return
        kinds = [k.strip() for k in self.type.split("|")]
        ok = any(isinstance(value, _TYPES[k]) and not (k in ("int", "float") and isinstance(value, bool))
                 for k in kinds)
        if not ok:
            raise InputError(f"option {name!r} of method {method!r} takes {self.type}, got {value!r}")
        if self.choices and isinstance(value, str) and value not in self.choices:
            raise InputError(f"option {name!r} of method {method!r} must be one of {', '.join(self.choices)}, "
                             f"got {value!r}")


@dataclasses.dataclass(frozen=True)
class Method:
    name: str
    prepare: Callable[..., Plan]  # prepare(model, draft, options: dict, samp) -> Plan
    options: dict[str, Option]  # option name -> spec
    needs_draft: bool = False
    summary: str = ""  # one line: what the method does
    wants_max_new: bool = False  # prepare() also takes max_new (diffusion: the canvas length)
    needs: str = "nothing"  # what it needs beyond the target: "draft model", "medusa heads", "diffusion model", ...
    lossless: str = "yes"  # "yes" (output distribution = AR's), or why not

    def __post_init__(self):
        for k, o in self.options.items():
            if not isinstance(o, Option):
                raise TypeError(f"method {self.name!r}: option {k!r} must be a registry.Option, got {o!r}")
            for t in o.type.split("|"):
                if t.strip() not in _TYPES:
                    raise TypeError(f"method {self.name!r}: option {k!r} has unknown type {o.type!r}")

    @property
    def defaults(self) -> dict[str, Any]:
        return {k: o.default for k, o in self.options.items()}


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
    """The method's defaults updated with ``given``, each value checked against its `Option`."""
    unknown = sorted(set(given) - set(method.options))
    if unknown:
        allowed = ", ".join(sorted(method.options)) or "none"
        raise InputError(f"method {method.name!r} does not take option(s) {', '.join(unknown)}; it takes: {allowed}")
    for k, v in given.items():
        method.options[k].check(method.name, k, v)
    return {**method.defaults, **given}


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
