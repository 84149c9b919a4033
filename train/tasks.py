"""A deterministic, checkable task set written as Python-like text, for diffusion models and samplers.

Each item is a prompt and an exact answer: arithmetic (``assert 37 + 58 == `` -> ``95``), sorting
(``sorted([5, 2, 9]) == `` -> ``[2, 5, 9]``), reversal and copying of strings (``'abc'[::-1] == `` -> ``'cba'``)
and of digit lists (``[3, 1, 4][::-1] == `` -> ``[4, 1, 3]``), the maximum of a digit list, and bracket completion
(``close('([{') == `` -> ``'}])'``). String kinds are hard for a small model on the zoo's BPE (letters merge into
multi-character tokens); the digit-list kinds keep one token per element, so position-wise copying suffices.
Items are generated from a seed; the split between train and held-out is by a hash of the prompt, so it never
depends on the generation order.

The *long* kinds (``LONG_KINDS``) have answers of 40-200 tokens, checkable token by token, so a sampler decodes a
long answer in parallel instead of filling an EOS tail: a digit list of 24-56 elements copied (``copy_long``),
reversed (``reverse_long``) or sorted (``sort_long``), a short digit list repeated to 24-56 elements
(``repeat_long``: ``[3, 1] * 20``), and an arithmetic progression of 16-28 numbers (``range_long``:
``list(range(7, 120, 4))``). On the zoo tokenizer a digit element is two tokens (``,`` and `` d``), so the
answers are about 2n tokens (49-127, median about 85), so they fit a 128-token canvas. `position_score` scores them by the fraction of the answer's tokens
that are right in place, beside the exact `score`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import random

KINDS = ("add", "sub", "mul", "sort", "reverse", "copy", "brackets", "copy_list", "reverse_list", "max")
LONG_KINDS = ("copy_long", "reverse_long", "sort_long", "repeat_long", "range_long")
ALL_KINDS = KINDS + LONG_KINDS
HELDOUT_PERCENT = 20
LONG_MIN, LONG_MAX = 24, 56  # elements in a long kind's answer
LONG_MAX_TOKENS = 126  # answer + EOS fit a 128-token canvas
RANGE_MIN, RANGE_MAX = 16, 28  # elements of a range_long answer (numbers below 352: at most 4 tokens each)


def long_answer_tokens(xs: list[int]) -> int:
    """Tokens of ``str(xs)`` on the zoo tokenizer: the brackets, the first digit, then ``,`` and `` d`` per further
    element (`` 9`` is two tokens there); tests/test_train.py checks this against the tokenizer."""
    return 2 * len(xs) + 1 + xs[1:].count(9)


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
    if kind in LONG_KINDS:
        n = rng.randint(LONG_MIN, LONG_MAX)
        if kind == "range_long":  # an arithmetic progression of 1-3 digit numbers: each element the last + s
            a, step = rng.randint(0, 99), rng.randint(1, 9)
            xs = list(range(a, a + step * rng.randint(RANGE_MIN, RANGE_MAX), step))
            return Item(kind, f"assert list(range({a}, {xs[-1] + 1}, {step})) == ", str(xs))
        if kind == "repeat_long":
            base = [rng.randint(0, 9) for _ in range(rng.randint(2, 6))]
            k = max(n // len(base), 2)
            while k > 2 and long_answer_tokens(base * k) > LONG_MAX_TOKENS:
                k -= 1
            return Item(kind, f"assert {base} * {k} == ", str(base * k))
        xs = [rng.randint(0, 9) for _ in range(n)]
        while long_answer_tokens(xs) > LONG_MAX_TOKENS:
            xs.pop()
        if kind == "copy_long":
            return Item(kind, f"assert list({tuple(xs)}) == ", str(xs))
        if kind == "reverse_long":
            return Item(kind, f"assert {xs}[::-1] == ", str(xs[::-1]))
        return Item(kind, f"assert sorted({xs}) == ", str(sorted(xs)))
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
    unknown = set(kinds) - set(ALL_KINDS)
    if not kinds or unknown:
        raise ValueError(f"unknown task kinds {sorted(unknown)}; choose from {', '.join(ALL_KINDS)}")
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


def split_long(n: int = 3000, seed: int = 1) -> tuple[list[Item], list[Item]]:
    """(train, held-out) items of the long kinds: about 600 held out of the default 3000. Training draws fresh long
    items from `long_items` instead (random digit lists hardly ever repeat); this fixed list is for evaluation."""
    return split(n, seed, LONG_KINDS)


def long_items(rng: random.Random, n: int) -> list[Item]:
    """n fresh long items for training, never one whose prompt the held-out split would take."""
    out = []
    while len(out) < n:
        it = _item(rng, LONG_KINDS[rng.randrange(len(LONG_KINDS))])
        if not it.heldout:
            out.append(it)
    return out


def encode_item(tok, it: Item) -> tuple[list[int], list[int]]:
    """(prompt ids, answer ids) of an item on ``tok`` (a `tokenizers.Tokenizer`), no special tokens."""
    return tok.encode(it.prompt, add_special_tokens=False).ids, tok.encode(it.answer, add_special_tokens=False).ids


def answer_line(generated: str) -> str:
    return generated.split("\n", 1)[0].strip()


def score(item: Item, generated: str) -> bool:
    """Exact answer: the generated text, up to the end of its first line, equals the answer."""
    return answer_line(generated) == item.answer


def position_score(item: Item, generated: str, tok) -> float:
    """Fraction of the answer's tokens (``tok``, a `tokenizers.Tokenizer`) that the generated first line has right at
    the same position: a long answer with one wrong digit scores near 1, a shifted or truncated one much lower."""
    want = tok.encode(item.answer, add_special_tokens=False).ids
    got = tok.encode(answer_line(generated), add_special_tokens=False).ids
    return sum(a == b for a, b in zip(want, got)) / max(len(want), 1)
