"""Generation controls shared by `pdecode.generate`, the serving engine and the server: the model's
``generation_config.json`` defaults, the check of one request's values, and stop strings.

Defaults follow `transformers`: a value the caller does not give comes from the checkpoint's generation_config.json,
else pdecode's own default. Sampling is on only where the file says ``do_sample: true`` (then temperature, top-k —
50 unless the file says otherwise, as `transformers` — top-p and min-p are the file's); otherwise decoding is greedy.
The file's ``eos_token_id`` (an id or a list) ends rows as EOS does; its ``repetition_penalty`` and
``max_new_tokens`` apply either way.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any, Sequence

from pdecode import sampling
from pdecode.errors import InputError

BUILTIN = {"max_new_tokens": 64, "temperature": 0.0, "top_k": 0, "top_p": 1.0, "min_p": 0.0,
           "repetition_penalty": 1.0}
HF_SAMPLING_TOP_K = 50  # transformers' default top_k when a generation config samples


def read_generation_config(path: str | Path | None) -> dict:
    """The checkpoint directory's generation_config.json ({} when absent or unreadable)."""
    if path is None:
        return {}
    f = Path(path) / "generation_config.json"
    try:
        d = json.loads(f.read_text()) if f.exists() else {}
    except (OSError, ValueError):
        return {}
    return d if isinstance(d, dict) else {}


def defaults(gen: dict) -> dict:
    """pdecode's defaults with the generation config's applied (module docstring)."""
    out = dict(BUILTIN)
    if isinstance(gen.get("max_new_tokens"), int) and gen["max_new_tokens"] > 0:
        out["max_new_tokens"] = gen["max_new_tokens"]
    if isinstance(gen.get("repetition_penalty"), (int, float)):
        out["repetition_penalty"] = float(gen["repetition_penalty"])
    if gen.get("do_sample"):
        out["temperature"] = float(gen["temperature"]) if gen.get("temperature") is not None else 1.0
        out["top_k"] = int(gen["top_k"]) if gen.get("top_k") is not None else HF_SAMPLING_TOP_K
        out["top_p"] = float(gen["top_p"]) if gen.get("top_p") is not None else 1.0
        out["min_p"] = float(gen["min_p"]) if gen.get("min_p") is not None else 0.0
    return out


def config_eos_ids(gen: dict) -> tuple[int, ...]:
    e = gen.get("eos_token_id")
    if isinstance(e, int):
        return (e,)
    if isinstance(e, list):
        return tuple(int(x) for x in e if isinstance(x, int))
    return ()


@dataclasses.dataclass(frozen=True)
class Controls:
    """One request's resolved sampling values and stops."""

    max_new_tokens: int
    temperature: float
    top_k: int
    top_p: float
    min_p: float
    repetition_penalty: float
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    logprobs: bool = False
    ignore_eos: bool = False  # the serving engine: EOS does not end this request (its budget or stops do)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias) pairs, ids ascending
    min_tokens: int = 0  # EOS and stop ids banned (and stop strings not matched) before this many new tokens
    grammar: Any = None  # structured output: a compiled `pdecode.grammar.Grammar` (the serving engine), or None

    def sampling(self, vocab_size: int | None = None) -> sampling.Sampling:
        return sampling.validate(self.temperature, self.top_k, self.top_p, vocab_size, self.min_p,
                                 self.repetition_penalty, self.logprobs, self.presence_penalty,
                                 self.frequency_penalty, bool(self.logit_bias), self.min_tokens)

    @property
    def processing(self) -> bool:
        """Whether a stage of logits processing is on (`sampling.Sampling.processing`)."""
        return (self.repetition_penalty != 1.0 or self.presence_penalty != 0 or self.frequency_penalty != 0
                or bool(self.logit_bias) or self.min_tokens > 0 or self.grammar is not None)

    def bias_vector(self, vocab_size: int):
        """The logit bias as a dense [V] float32 vector (numpy)."""
        import numpy as np

        v = np.zeros((vocab_size,), np.float32)
        for t, b in self.logit_bias:
            v[t] = b
        return v


def resolve(gen: dict, vocab_size: int, given: dict[str, Any]) -> Controls:
    """``given`` (None = not given) over the defaults of ``gen``; every value checked (one-line InputError)."""
    d = defaults(gen)
    v = {k: (d[k] if given.get(k) is None else given[k]) for k in BUILTIN}
    sampling.check_values(v["temperature"], v["top_k"], v["top_p"], vocab_size, v["min_p"], v["repetition_penalty"])
    stop = check_stop(given.get("stop"))
    ids = given.get("stop_token_ids") or ()
    bad = [t for t in ids if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab_size]
    if bad:
        raise InputError(f"stop_token_ids must be token ids in [0, {vocab_size}), got {bad[0]!r}")
    pres, freq = (0.0 if given.get(k) is None else given[k] for k in ("presence_penalty", "frequency_penalty"))
    sampling.check_values(0.0, 0, 1.0, presence_penalty=pres, frequency_penalty=freq)
    bias = check_logit_bias(given.get("logit_bias"), vocab_size)
    mn = given.get("min_tokens")
    mn = 0 if mn is None else mn
    if not isinstance(mn, int) or isinstance(mn, bool) or mn < 0:
        raise InputError(f"min_tokens must be an integer >= 0, got {mn!r}")
    if mn > v["max_new_tokens"]:
        raise InputError(f"min_tokens ({mn}) is larger than the new-token budget ({v['max_new_tokens']})")
    return Controls(max_new_tokens=v["max_new_tokens"], temperature=float(v["temperature"]), top_k=int(v["top_k"]),
                    top_p=float(v["top_p"]), min_p=float(v["min_p"]),
                    repetition_penalty=float(v["repetition_penalty"]), stop=stop,
                    stop_token_ids=tuple(int(t) for t in ids), logprobs=bool(given.get("logprobs") or False),
                    ignore_eos=bool(given.get("ignore_eos") or False), presence_penalty=float(pres),
                    frequency_penalty=float(freq), logit_bias=bias, min_tokens=int(mn))


def common_prefix(rows: Sequence[Sequence[int]]) -> int:
    """How many leading tokens every row shares (decomposition's shared prefill; the engine's kept prefixes)."""
    n = min(len(r) for r in rows)
    for i in range(n):
        t = rows[0][i]
        if any(r[i] != t for r in rows):
            return i
    return n


MAX_LOGIT_BIAS = 1024  # entries per request


def check_logit_bias(bias, vocab_size: int) -> tuple[tuple[int, float], ...]:
    """A logit bias ({token id: bias in [-100, 100]}; ids may be strings of digits, as JSON keys are) as sorted
    (id, bias) pairs; None or {}: ()."""
    import math

    if bias is None:
        return ()
    if not isinstance(bias, dict):
        raise InputError(f"logit_bias must be a map from token id to a bias in [-100, 100], got {type(bias).__name__}")
    if len(bias) > MAX_LOGIT_BIAS:
        raise InputError(f"logit_bias has {len(bias)} entries; at most {MAX_LOGIT_BIAS}")
    out = {}
    for k, b in bias.items():
        t = int(k) if isinstance(k, str) and k.strip().lstrip("-").isdigit() else k
        if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab_size:
            raise InputError(f"logit_bias keys must be token ids in [0, {vocab_size}), got {k!r}")
        if not isinstance(b, (int, float)) or isinstance(b, bool) or math.isnan(b) or not -100 <= b <= 100:
            raise InputError(f"logit_bias values must be numbers in [-100, 100], got {b!r} for token {t}")
        out[t] = float(b)
    return tuple(sorted(out.items()))


MAX_STOP_STRINGS = 16


def check_stop(stop) -> tuple[str, ...]:
    """Stop strings as a tuple (a string or a list of non-empty strings; None: none)."""
    if stop is None:
        return ()
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, (list, tuple)) or not all(isinstance(s, str) and s for s in stop):
        raise InputError(f"stop must be a non-empty string or a list of them, got {stop!r}")
    if len(stop) > MAX_STOP_STRINGS:
        raise InputError(f"at most {MAX_STOP_STRINGS} stop strings, got {len(stop)}")
    return tuple(stop)


def find_stop(text: str, stops: Sequence[str], after: int = 0) -> int:
    """Where the earliest stop string ending past character ``after`` starts in ``text`` (-1: none)."""
    hits = [i for i in (text.find(s, max(0, after - len(s) + 1)) for s in stops) if i >= 0]
    return min(hits) if hits else -1


def stop_after(tokens: list[int], decode, min_tokens: int) -> int:
    """Where stop strings may end past (characters; `find_stop`'s ``after``) with ``min_tokens``: -1 while fewer
    tokens are out."""
    if not min_tokens:
        return 0
    if len(tokens) < min_tokens:
        return -1
    return len(decode(tokens[: min_tokens - 1]))


def held_back(text: str, stops: Sequence[str]) -> int:
    """How many characters at the end of ``text`` could begin a stop string (a stream holds them back until the
    next tokens show whether the stop string follows)."""
    n = 0
    for s in stops:
        for k in range(min(len(s) - 1, len(text)), n, -1):
            if text.endswith(s[:k]):
                n = k
                break
    return n


def cut_at_stop(tokens: list[int], decode, stops: Sequence[str], min_tokens: int = 0) -> tuple[list[int], str, bool]:
    """(tokens up to the one completing the earliest stop string, the text before that stop string, whether a stop
    string was found); without one: (tokens, their text, False). With ``min_tokens``, a stop string counts only
    once that many tokens are out and only where it ends past the text of the first ``min_tokens - 1``."""
    text = decode(tokens)
    after = stop_after(tokens, decode, min_tokens)
    at = find_stop(text, stops, after) if stops and after >= 0 else -1
    if at < 0:
        return tokens, text, False
    lo, hi = max(1, min_tokens), len(tokens)  # the shortest prefix whose text holds the stop string
    while lo < hi:
        mid = (lo + hi) // 2
        if find_stop(decode(tokens[:mid]), stops, after) >= 0:
            hi = mid
        else:
            lo = mid + 1
    return tokens[:lo], text[:at], True
