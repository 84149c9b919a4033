"""The decoding methods `pdecode.generate` knows, and how each is prepared.

A method turns (target model, optional draft, options, sampling) into a `Plan`: a pure jit-able function
``fn(params, prompt_BP, prompt_len_B, key, warp, **static)`` returning ``(Outputs, stats)``, the
params pytree it takes, its static arguments and how many extra cache slots it needs beyond prompt + new tokens.
"""

from __future__ import annotations

import dataclasses
import numbers
from typing import Any, Callable

from pdecode.errors import ConfigError, InputError


@dataclasses.dataclass
class Plan:
    """What a method runs. Besides the function, its params and statics, the plan *declares* what its program takes
    (nothing is read off the function's signature): ``loop`` "token" is the autoregressive token loop (`ar` or the
    draft-and-verify loop: per-row ``stops``, ``cache_dtype``, ``shared_prefix``, the history the logits processing
    needs, logprobs), "canvas" any other (masked, edit, ...); ``engine`` the serving engine's driver for it ("ar",
    "draft_verify": the loop's `start` / `make_step`; None: `pdecode.Engine` does not serve it);
    ``takes_cache_dtype`` for a canvas loop that keeps caches of its own."""

    fn: Callable
    params: Any
    static: dict[str, Any]
    extra_len: int = 0
    # Host-side post-processing of stats (device scalars already converted to Python numbers).
    finish_stats: Callable[[dict], dict] | None = None
    loop: str = "canvas"
    engine: str | None = None
    takes_cache_dtype: bool = False

    def __post_init__(self):
        if self.loop not in ("token", "canvas") or self.engine not in (None, "ar", "draft_verify"):
            raise ConfigError(f"a Plan's loop is 'token' or 'canvas' and its engine None, 'ar' or 'draft_verify'; got "
                              f"{self.loop!r} / {self.engine!r}")

    @property
    def token_loop(self) -> bool:
        return self.loop == "token"

    @property
    def history_controls(self) -> bool:
        """The loop keeps the history the logits processing needs and records logprobs (the token loops)."""
        return self.token_loop


_TYPES = {"int": (numbers.Integral,), "float": (numbers.Real,), "bool": (bool,), "str": (str,), "list": (list, tuple),
          "tree": ()}  # "tree": a `tree.StaticTree` (checked lazily, to keep this module free of the decode code)
_PY = {"int": int, "float": float, "bool": bool}


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

    def check(self, method: str, name: str, value: Any) -> Any:
        """``value`` as the method will see it (numpy scalars become Python numbers: static jit arguments must
        hash alike), or an InputError that says what the option takes."""
        import numpy as np

        if value is None and self.default is None:
            return value
        if isinstance(value, np.bool_):
            value = bool(value)
        for k in (k.strip() for k in self.type.split("|")):
            if k == "tree":
                from pdecode.decode.tree import StaticTree

                if isinstance(value, StaticTree):
                    return value
            elif isinstance(value, _TYPES[k]) and not (k in ("int", "float") and isinstance(value, (bool, np.bool_))):
                value = _PY[k](value) if k in _PY else value
                if self.choices and isinstance(value, str) and value not in self.choices:
                    raise InputError(f"option {name!r} of method {method!r} must be one of "
                                     f"{', '.join(self.choices)}, got {value!r}")
                return value
        raise InputError(f"option {name!r} of method {method!r} takes {self.type}, got {value!r}")


@dataclasses.dataclass(frozen=True)
class Method:
    name: str
    prepare: Callable[..., Plan]  # prepare(model, draft, options: dict, samp) -> Plan
    options: dict[str, Option]  # option name -> spec
    needs_draft: bool = False
    summary: str = ""  # one line: what the method does
    wants_max_new: bool = False  # prepare() also takes max_new (diffusion: the canvas length)
    wants_batch: bool = False  # prepare() also takes batch, context (rows, cache slots: sizing by cost) and engine
    needs: str = "nothing"  # what it needs beyond the target: "draft model", "medusa heads", "diffusion model", ...
    lossless: str = "yes"  # "yes" (output distribution = AR's), or why not
    target: str = "causal"  # the model it decodes with: "causal" (autoregressive) or "masked" (masked diffusion)
    draft: str = "causal"  # likewise for its draft model, when it takes one

    def __post_init__(self):
        if self.target not in _KINDS or self.draft not in _KINDS:
            raise TypeError(f"method {self.name!r}: target and draft must be one of {', '.join(_KINDS)}")
        for k, o in self.options.items():
            if not isinstance(o, Option):
                raise TypeError(f"method {self.name!r}: option {k!r} must be a registry.Option, got {o!r}")
            for t in o.type.split("|"):
                if t.strip() not in _TYPES:
                    raise TypeError(f"method {self.name!r}: option {k!r} has unknown type {o.type!r}")

    @property
    def defaults(self) -> dict[str, Any]:
        return {k: o.default for k, o in self.options.items()}


_KINDS = ("causal", "masked")
METHODS: dict[str, Method] = {}
_MASKED_HINT = "a masked method (diffusion, dico, oneshot, mask_predict)"


def check_models(method: Method, model, draft=None) -> None:
    """Refuse a model of the wrong kind for ``method`` (an autoregressive method over a masked-diffusion model
    decodes garbage, not an error) with one line saying which kind it needs."""

    def name(m):
        return repr(m.name) if getattr(m, "name", "") else "this model"

    if method.target == "causal" and not model.cfg.causal:
        raise InputError(f"method {method.name!r} decodes left to right with an autoregressive model; {name(model)} "
                         f"is a masked-diffusion (bidirectional) model: use {_MASKED_HINT}, or an autoregressive "
                         "model such as code-target")
    if method.target == "masked" and model.cfg.causal:
        raise InputError(f"method {method.name!r} needs a masked-diffusion (bidirectional) model such as code-dllm; "
                         f"{name(model)} is autoregressive")
    if draft is None or not method.needs_draft:
        return
    if method.draft == "causal" and not draft.cfg.causal:
        hint = " (a masked-diffusion draft drafts with method diffusion_draft)" if method.target == "causal" else ""
        raise InputError(f"method {method.name!r} needs an autoregressive draft model such as code-draft; the draft "
                         f"{name(draft)} is a masked-diffusion (bidirectional) model{hint}")
    if method.draft == "masked" and draft.cfg.causal:
        raise InputError(f"method {method.name!r} needs a masked-diffusion draft model such as code-dllm; the draft "
                         f"{name(draft)} is autoregressive")


def register(method: Method) -> Method:
    METHODS[method.name] = method
    return method


def get(name: str) -> Method:
    _load_builtin()
    if name not in METHODS:
        import difflib

        close = difflib.get_close_matches(str(name), sorted(METHODS), n=1)
        hint = f"did you mean {close[0]}? " if close else ""
        raise InputError(f"unknown method {name!r}; {hint}available: {', '.join(sorted(METHODS))}")
    return METHODS[name]


def resolve_options(method: Method, given: dict[str, Any], near: tuple[str, ...] = ()) -> dict[str, Any]:
    """The method's defaults updated with ``given``, each value checked against its `Option`. A name the method does
    not take is one line, with the closest of its options and of ``near`` (the caller's own keywords, which a
    misspelling more likely meant)."""
    unknown = sorted(set(given) - set(method.options))
    if unknown:
        import difflib

        name = unknown[0]
        also = f" (also unknown: {', '.join(unknown[1:])})" if len(unknown) > 1 else ""
        others = sorted(m.name for m in METHODS.values() if name in m.options)
        # another method's option (sd's gamma given to ar) is not a misspelling: say who takes it instead
        close = [] if others else difflib.get_close_matches(name, list(near) + sorted(method.options), n=1)
        if close:
            raise InputError(f"unknown option {name!r} for method {method.name!r}: did you mean {close[0]}?{also}")
        allowed = ", ".join(sorted(method.options)) or "none"
        whose = f" ({name} is an option of {', '.join(others)})" if others else ""
        raise InputError(f"unknown option {name!r} for method {method.name!r}{also}; it takes: {allowed}{whose}")
    checked = {k: method.options[k].check(method.name, k, v) for k, v in given.items()}
    return {**method.defaults, **checked}


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
