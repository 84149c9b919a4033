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

    def sampling(self, vocab_size: int | None = None) -> sampling.Sampling:
        return sampling.validate(self.temperature, self.top_k, self.top_p, vocab_size, self.min_p,
                                 self.repetition_penalty, self.logprobs)


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
    return Controls(max_new_tokens=v["max_new_tokens"], temperature=float(v["temperature"]), top_k=int(v["top_k"]),
                    top_p=float(v["top_p"]), min_p=float(v["min_p"]),
                    repetition_penalty=float(v["repetition_penalty"]), stop=stop,
                    stop_token_ids=tuple(int(t) for t in ids), logprobs=bool(given.get("logprobs") or False),
                    ignore_eos=bool(given.get("ignore_eos") or False))


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


def find_stop(text: str, stops: Sequence[str]) -> int:
    """Where the earliest stop string starts in ``text`` (-1: none)."""
    hits = [i for i in (text.find(s) for s in stops) if i >= 0]
    return min(hits) if hits else -1


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


def cut_at_stop(tokens: list[int], decode, stops: Sequence[str]) -> tuple[list[int], str, bool]:
    """(tokens up to the one completing the earliest stop string, the text before that stop string, whether a stop
    string was found); without one: (tokens, their text, False)."""
    text = decode(tokens)
    at = find_stop(text, stops) if stops else -1
    if at < 0:
        return tokens, text, False
    lo, hi = 1, len(tokens)  # the shortest prefix whose text holds the stop string
    while lo < hi:
        mid = (lo + hi) // 2
        if find_stop(decode(tokens[:mid]), stops) >= 0:
            hi = mid
        else:
            lo = mid + 1
    return tokens[:lo], text[:at], True
