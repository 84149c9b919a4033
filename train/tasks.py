"""A deterministic, checkable task set written as Python-like text, for diffusion models and samplers.

Each item is a prompt and an exact answer: arithmetic (``assert 37 + 58 == `` -> ``95``), sorting
(``sorted([5, 2, 9]) == `` -> ``[2, 5, 9]``), reversal and copying of strings (``'abc'[::-1] == `` -> ``'cba'``)
and of digit lists (``[3, 1, 4][::-1] == `` -> ``[4, 1, 3]``), the maximum of a digit list, and bracket completion
(``close('([{') == `` -> ``'}])'``). String kinds are hard for a small model on the zoo's BPE (letters merge into
multi-character tokens); the digit-list kinds keep one token per element, so position-wise copying suffices.
Items are generated from a seed; the split between train and held-out is by a hash of the prompt, so it never
depends on the generation order.
"""

from __future__ import annotations

import dataclasses
import hashlib
import random

KINDS = ("add", "sub", "mul", "sort", "reverse", "copy", "brackets", "copy_list", "reverse_list", "max")
HELDOUT_PERCENT = 20


@dataclasses.dataclass(frozen=True)
class Item:
    kind: str
    prompt: str
    answer: str

    @property
    def heldout(self) -> bool:
        return int(hashlib.sha1(self.prompt.encode()).hexdigest(), 16) % 100 < HELDOUT_PERCENT


def _item(rng: random.Random, kind: str) -> Item:
    if kind == "add":
        a, b = rng.randint(0, 99), rng.randint(0, 99)
        return Item(kind, f"assert {a} + {b} == ", str(a + b))
    if kind == "sub":
        a, b = rng.randint(0, 99), rng.randint(0, 99)
        a, b = max(a, b), min(a, b)
        return Item(kind, f"assert {a} - {b} == ", str(a - b))
    if kind == "mul":
        a, b = rng.randint(0, 12), rng.randint(0, 12)
        return Item(kind, f"assert {a} * {b} == ", str(a * b))
    if kind == "sort":
        xs = [rng.randint(0, 9) for _ in range(rng.randint(3, 6))]
        return Item(kind, f"assert sorted({xs}) == ", str(sorted(xs)))
    if kind in ("copy_list", "reverse_list", "max"):
        xs = [rng.randint(0, 9) for _ in range(rng.randint(3, 6))]
        if kind == "copy_list":
            return Item(kind, f"assert list({tuple(xs)}) == ", str(xs))
        if kind == "reverse_list":
            return Item(kind, f"assert {xs}[::-1] == ", str(xs[::-1]))
        return Item(kind, f"assert max({xs}) == ", str(max(xs)))
    letters = "abcdefghij"
    if kind == "reverse":
        s = "".join(rng.choice(letters) for _ in range(rng.randint(3, 7)))
        return Item(kind, f"assert {s!r}[::-1] == ", repr(s[::-1]))
    if kind == "copy":
        s = "".join(rng.choice(letters) for _ in range(rng.randint(3, 6)))
        return Item(kind, f"assert list({s!r}) == ", str(list(s)))
    if kind == "brackets":
        pairs = {"(": ")", "[": "]", "{": "}"}
        opens = "".join(rng.choice("([{") for _ in range(rng.randint(2, 6)))
        return Item(kind, f"assert close({opens!r}) == ", repr("".join(pairs[c] for c in reversed(opens))))
    raise ValueError(kind)


def generate_items(n: int, seed: int = 0, kinds: tuple[str, ...] = KINDS) -> list[Item]:
    """n distinct items (by prompt), ``kinds`` in rotation."""
    unknown = set(kinds) - set(KINDS)
    if not kinds or unknown:
        raise ValueError(f"unknown task kinds {sorted(unknown)}; choose from {', '.join(KINDS)}")
    rng = random.Random(seed)
    seen, out = set(), []
    i = 0
    while len(out) < n:
        it = _item(rng, kinds[i % len(kinds)])
        i += 1
        if it.prompt not in seen:
            seen.add(it.prompt)
            out.append(it)
        if i > 50 * n:
            break
    return out


def split(n: int = 6000, seed: int = 0, kinds: tuple[str, ...] = KINDS) -> tuple[list[Item], list[Item]]:
    items = generate_items(n, seed, tuple(kinds))
    return [x for x in items if not x.heldout], [x for x in items if x.heldout]


def score(item: Item, generated: str) -> bool:
    """Exact answer: the generated text, up to the end of its first line, equals the answer."""
    return generated.split("\n", 1)[0].strip() == item.answer
