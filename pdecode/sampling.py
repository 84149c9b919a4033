"""Logits processing and sampling.

The target's distribution passes two stages, in the order `transformers` applies them:

* *processing* of the raw logits by the decode loop, which knows the history (`penalize`, in vLLM's order): the
  logit bias added (``logit_bias``: per token id); the repetition penalty (a logit of a token already in the prompt
  or the output divided by the penalty when positive, multiplied when negative); the presence and frequency
  penalties (OpenAI's: ``presence * [count > 0] + frequency * count`` subtracted, ``count`` the token's occurrences
  in the output so far); while a row has fewer than ``min_tokens`` new tokens, its stop tokens (EOS and stop
  ids) banned; and every token its grammar forbids in its state (structured output, `pdecode.grammar`) banned;
* *warping* (`warp`): temperature, then top-k, then top-p (nucleus), then min-p.

Every method samples from and verifies against the processed and warped distribution, so the lossless methods stay
lossless with respect to it. A temperature of 0 means greedy (the argmax of the processed logits).

`Sampling` is the static part (jit-static: which stages are compiled in, the largest top-k); `Warp` holds the values,
traced, either one scalar for the whole batch or one value per row (``[B]``: a serving engine's slots each have
their own), so changing them does not recompile. With per-row values, a row whose temperature is 0 is decoded
greedily inside a sampled batch (exactly: its distribution is the one-hot of the argmax, and speculative sampling
against one-hot distributions accepts exactly the greedy tokens).

Random keys are one key for the batch (``[2]``) or one key per row (``[B, 2]``: a row's draws then depend only on its
own key, whatever else is in the batch); `split`, `fold_in`, `uniform` and `gumbel` take either.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
from flax import struct

from pdecode.errors import InputError

NEG_INF = -1e30


@dataclasses.dataclass(frozen=True)
class Sampling:
    """What is compiled in (static). ``greedy``: every row is greedy (no sampling code at all); ``top_k``: the
    largest top-k a row may ask for (0: top-k off); ``use_top_p`` / ``use_min_p`` / ``penalty``: those stages are
    on; ``logprobs``: the loop records the log-probability of every chosen token; ``counts``: the presence /
    frequency penalties (the loop keeps each row's output token counts); ``bias``: a logit bias; ``min_tokens``:
    stop tokens banned below a row's minimum; ``grammar``: structured output (`pdecode.grammar`: the loop keeps each
    row's automaton state and masks what it forbids)."""

    greedy: bool = True
    top_k: int = 0
    use_top_p: bool = False
    use_min_p: bool = False
    penalty: bool = False
    logprobs: bool = False
    counts: bool = False
    bias: bool = False
    min_tokens: bool = False
    grammar: bool = False

    @property
    def processing(self) -> bool:
        """Whether any stage needs the loop's history or the row's output length (methods without the history
        keeping loops refuse these)."""
        return self.penalty or self.counts or self.bias or self.min_tokens or self.grammar


@struct.dataclass
class Warp:
    """The sampling values (traced): each a scalar or a [B] array. ``temperature`` 0 = greedy; ``top_p`` 1 = off;
    ``top_k`` 0 = off (at most `Sampling.top_k`); ``min_p`` 0 = off; ``penalty`` 1 = no repetition penalty;
    ``presence`` / ``frequency`` 0 = off; ``min_tokens`` 0 = off; ``bias``: None, or [V] (the batch) or [B, V]
    (per row) added to the logits; ``grammar``: None, or the `pdecode.grammar.Tables` of the rows' grammars, with
    ``grammar_start`` [B] int32 each row's start state (0: unconstrained)."""

    temperature: jax.Array
    top_p: jax.Array
    top_k: jax.Array
    min_p: jax.Array
    penalty: jax.Array
    presence: jax.Array = None
    frequency: jax.Array = None
    min_tokens: jax.Array = None
    bias: jax.Array | None = None
    grammar: Any = None
    grammar_start: jax.Array | None = None

    @staticmethod
    def of(temperature=0.0, top_p=1.0, top_k=0, min_p=0.0, penalty=1.0, presence=0.0, frequency=0.0,
           min_tokens=0, bias=None, grammar=None, grammar_start=None) -> "Warp":
        f = lambda x: jnp.asarray(x, jnp.float32)  # noqa: E731
        return Warp(temperature=f(temperature), top_p=f(top_p), top_k=jnp.asarray(top_k, jnp.int32),
                    min_p=f(min_p), penalty=f(penalty), presence=f(presence), frequency=f(frequency),
                    min_tokens=jnp.asarray(min_tokens, jnp.int32), bias=None if bias is None else f(bias),
                    grammar=grammar,
                    grammar_start=None if grammar_start is None else jnp.asarray(grammar_start, jnp.int32))


def validate(temperature: float, top_k: int, top_p: float, vocab_size: int | None = None, min_p: float = 0.0,
             repetition_penalty: float = 1.0, logprobs: bool = False, presence_penalty: float = 0.0,
             frequency_penalty: float = 0.0, logit_bias: bool = False, min_tokens: int = 0,
             grammar: bool = False) -> Sampling:
    """Check one request's sampling values; returns the static `Sampling` they need (``logit_bias``: whether the
    request has one)."""
    check_values(temperature, top_k, top_p, vocab_size, min_p, repetition_penalty, presence_penalty,
                 frequency_penalty)
    return Sampling(greedy=temperature == 0, top_k=int(top_k) if temperature else 0,
                    use_top_p=top_p < 1.0 and temperature > 0, use_min_p=min_p > 0 and temperature > 0,
                    penalty=repetition_penalty != 1.0, logprobs=bool(logprobs),
                    counts=presence_penalty != 0 or frequency_penalty != 0, bias=bool(logit_bias),
                    min_tokens=min_tokens > 0, grammar=bool(grammar))


def _number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and not math.isnan(x)


def check_values(temperature, top_k, top_p, vocab_size=None, min_p=0.0, repetition_penalty=1.0,
                 presence_penalty=0.0, frequency_penalty=0.0) -> None:
    """One-line errors for out-of-range sampling values."""
    if not _number(temperature) or temperature < 0 or math.isinf(temperature):
        raise InputError(f"temperature must be a number >= 0 (0 = greedy), got {temperature!r}")
    if not isinstance(top_k, int) or isinstance(top_k, bool) or top_k < 0:
        raise InputError(f"top_k must be an integer >= 0 (0 = off), got {top_k!r}")
    if vocab_size is not None and top_k > vocab_size:
        raise InputError(f"top_k ({top_k}) is larger than the vocabulary ({vocab_size})")
    if not _number(top_p) or not (0.0 < top_p <= 1.0):
        raise InputError(f"top_p must be in (0, 1], got {top_p!r}")
    if not _number(min_p) or not (0.0 <= min_p <= 1.0):
        raise InputError(f"min_p must be in [0, 1] (0 = off), got {min_p!r}")
    if not _number(repetition_penalty) or repetition_penalty <= 0 or math.isinf(repetition_penalty):
        raise InputError(f"repetition_penalty must be a number > 0 (1 = off), got {repetition_penalty!r}")
    for name, v in (("presence_penalty", presence_penalty), ("frequency_penalty", frequency_penalty)):
        if not _number(v) or not -2.0 <= v <= 2.0:
            raise InputError(f"{name} must be a number in [-2, 2] (0 = off), got {v!r}")


def _rows(x: jax.Array, like: jax.Array) -> jax.Array:
    """A scalar, or a per-row [B] value shaped to broadcast against ``like`` [B, ..., V]."""
    x = jnp.asarray(x)
    return x if x.ndim == 0 else x.reshape((-1,) + (1,) * (like.ndim - 1))


def warp(logits: jax.Array, s: Sampling, w: Warp) -> jax.Array:
    """Float32 logits of the warped distribution (filtered entries at -1e30). Greedy returns logits unchanged.
    A filter compiled in but asked for by no row of the batch (top_k 0, top_p 1, min_p 0 everywhere) is skipped
    at run time (`lax.cond`): a batch pays for the filters its rows use."""
    x = logits.astype(jnp.float32)
    if s.greedy:
        return x
    x = x / jnp.maximum(_rows(w.temperature, x).astype(jnp.float32), 1e-6)
    if s.top_k:
        k = jnp.broadcast_to(_rows(w.top_k, x), x.shape[:-1] + (1,))
        x = _when(jnp.any(k > 0), lambda x: _top_k(x, k, s.top_k), x)
    if s.use_top_p:
        p = _rows(w.top_p, x)
        x = _when(jnp.any(p < 1), lambda x: _top_p(x, p), x)
    if s.use_min_p:
        m = _rows(w.min_p, x)

        def min_p(x):
            q = jax.nn.softmax(x, axis=-1)
            return jnp.where(q < m * jnp.max(q, axis=-1, keepdims=True), NEG_INF, x)

        x = _when(jnp.any(m > 0), min_p, x)
    return x


def _when(pred, f, x):
    """``f(x)`` where ``pred`` (a traced bool), else ``x``: one branch runs."""
    return jax.lax.cond(pred, f, lambda x: x, x)


def _top_k(x: jax.Array, k: jax.Array, most: int) -> jax.Array:
    """Keep each row's ``k`` largest entries (and ties of the k-th; k = 0: all), ``k <= most``."""
    vals = jax.lax.top_k(x, most)[0]
    kth = jnp.take_along_axis(vals, jnp.clip(k - 1, 0, most - 1), axis=-1)
    return jnp.where((k > 0) & (x < kth), NEG_INF, x)


def _order_keys(x: jax.Array) -> jax.Array:
    """int32 keys of float32 values in the same order (the sign-magnitude bits turned into two's complement; -0.0
    taken as 0.0, which it equals)."""
    b = jax.lax.bitcast_convert_type(jnp.where(x == 0, 0.0, x), jnp.int32)
    return b ^ ((b >> 31) & 0x7FFFFFFF)


def _top_p(x: jax.Array, top_p) -> jax.Array:
    """Keep the smallest set of top tokens whose mass reaches ``top_p`` (the top token always stays; ties of the
    smallest kept value stay too; rows at top_p >= 1 keep everything).

    The smallest kept value is the largest logit v with mass(x >= v) >= top_p (the rule of sorting and cutting the
    cumulative mass), found by bisection over the values' order keys: 32 masked sums over the vocabulary instead of
    a sort, which XLA on CPU runs 20x slower."""
    p = jax.nn.softmax(x, axis=-1)
    keys = _order_keys(x)
    top_p = jnp.broadcast_to(jnp.asarray(top_p, jnp.float32), x.shape[:-1] + (1,))

    def halve(_, c):  # lo: the predicate holds (mass at or above lo reaches top_p); hi: it does not
        lo, hi = c
        mid = (lo >> 1) + (hi >> 1) + (lo & hi & 1)  # floor((lo + hi) / 2) without int32 overflow
        ok = jnp.sum(jnp.where(keys >= mid, p, 0.0), axis=-1, keepdims=True) >= top_p
        return jnp.where(ok, mid, lo), jnp.where(ok, hi, mid)

    lo = jnp.min(keys, axis=-1, keepdims=True)
    hi = jnp.max(keys, axis=-1, keepdims=True) + 1
    lo, _ = jax.lax.fori_loop(0, 32, halve, (lo, hi))
    return jnp.where((keys < lo) & (top_p < 1), NEG_INF, x)


def penalize(logits: jax.Array, seen: jax.Array | None, s: Sampling, w: Warp, counts: jax.Array | None = None,
             ban: jax.Array | None = None) -> jax.Array:
    """The processing stages compiled in (module docstring): ``seen`` (bool) the repetition penalty's history,
    ``counts`` (int) the output's token counts, ``ban`` (bool) tokens ruled out — each broadcastable to
    ``logits`` [B, ..., V] (None where that stage is off)."""
    if not (s.penalty or s.counts or s.bias) and ban is None:
        return logits
    x = logits.astype(jnp.float32)
    if s.bias:
        x = x + bias_rows(w.bias, x)
    x = _penalties(x, seen, counts, s, w)
    return x if ban is None else jnp.where(ban, NEG_INF, x)


def bias_rows(bias: jax.Array, like: jax.Array) -> jax.Array:
    """A [V] or per-row [B, V] logit bias shaped to broadcast against ``like`` [B, ..., V]."""
    return bias if bias.ndim == 1 else bias.reshape((bias.shape[0],) + (1,) * (like.ndim - 2) + (bias.shape[-1],))


def _penalties(x, seen, counts, s: Sampling, w: Warp):
    """The repetition, presence and frequency penalties of float32 logits ``x`` (after the bias)."""
    if s.penalty:
        pen = _rows(w.penalty, x)
        x = jnp.where(seen, jnp.where(x > 0, x / pen, x * pen), x)
    if s.counts:
        c = counts.astype(jnp.float32)
        x = x - _rows(w.frequency, x) * c - _rows(w.presence, x) * (c > 0)
    return x


def penalize_at(x_at: jax.Array, bias_at: jax.Array | None, counts_at: jax.Array | None, s: Sampling,
                w: Warp) -> jax.Array:
    """`penalize` of raw logits ``x_at`` [B, ..., K] of tokens known to be in the history (seen), ``bias_at`` their
    bias and ``counts_at`` their counts (same shape; None where off): a drafted tree's nodes re-process the tokens
    on their own path this way."""
    x = x_at.astype(jnp.float32)
    if s.bias:
        x = x + bias_at
    return _penalties(x, True, counts_at, s, w)


def mark_seen(seen_BV: jax.Array, tokens_BK: jax.Array, valid_BK: jax.Array) -> jax.Array:
    """The seen-token table [B, V] with ``tokens[b, k]`` added where ``valid[b, k]``."""
    b, v = seen_BV.shape
    idx = jnp.where(valid_BK, tokens_BK, v)
    return seen_BV.at[jnp.arange(b)[:, None], idx].set(True, mode="drop")


def add_counts(counts_BV: jax.Array, tokens_BK: jax.Array, valid_BK: jax.Array) -> jax.Array:
    """The token-count table [B, V] with one more of ``tokens[b, k]`` where ``valid[b, k]``."""
    b, v = counts_BV.shape
    idx = jnp.where(valid_BK, tokens_BK, v)
    return counts_BV.at[jnp.arange(b)[:, None], idx].add(1, mode="drop")


def argmax(x: jax.Array) -> jax.Array:
    """Index of the (first) maximum along the last axis, int32. A max then a min over matching indices: the same
    result as ``jnp.argmax``, kept because on CPU it runs faster than XLA's variadic-reduce argmax
    (docs/performance_code_notes.md)."""
    mx = jnp.max(x, axis=-1, keepdims=True)
    n = x.shape[-1]
    first = jnp.min(jnp.where(x == mx, jnp.arange(n, dtype=jnp.int32), n), axis=-1)
    return jnp.minimum(first, n - 1).astype(jnp.int32)  # (all-NaN rows would otherwise point past the end)


def greedy_rows(w: Warp, like: jax.Array) -> jax.Array:
    """bool, broadcastable to ``like`` without its last axis: rows decoded greedily (temperature 0)."""
    return _rows(w.temperature, like)[..., 0] <= 0 if jnp.ndim(w.temperature) else jnp.asarray(w.temperature) <= 0


def probs(logits: jax.Array, s: Sampling, w: Warp) -> jax.Array:
    """Probabilities of the warped distribution; greedy (the batch, or a row at temperature 0) gives a one-hot of
    the argmax."""
    onehot = jax.nn.one_hot(argmax(logits), logits.shape[-1], dtype=jnp.float32)
    if s.greedy:
        return onehot
    p = jax.nn.softmax(warp(logits, s, w), axis=-1)
    return jnp.where(greedy_rows(w, logits)[..., None], onehot, p)


def sample(key: jax.Array, logits: jax.Array, s: Sampling, w: Warp) -> jax.Array:
    """One token per leading index: argmax when greedy (the batch, or a row at temperature 0), else a draw from the
    warped distribution. ``key``: one key, or one per row ([B, 2])."""
    if s.greedy:
        return argmax(logits)
    drawn = gumbel_argmax(key, warp(logits, s, w))
    return jnp.where(greedy_rows(w, logits), argmax(logits), drawn)


def log_probs(logits: jax.Array, tokens: jax.Array) -> jax.Array:
    """log p(token) under the model's own distribution (the processed logits, before temperature and filters),
    float32, shaped like ``tokens`` (``logits``: tokens.shape + [V])."""
    lp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    return jnp.take_along_axis(lp, tokens[..., None].astype(jnp.int32), axis=-1)[..., 0]


# ------------------------------------------------------------------------------------------------ keys
def per_row(key: jax.Array) -> bool:
    """True for one raw key per row ([B, 2]), False for one key ([2])."""
    return key.ndim == 2


def split(key: jax.Array, n: int = 2) -> jax.Array:
    """``n`` keys (a leading axis of n): of the one key, or of each row's key ([n, B, 2])."""
    if per_row(key):
        return jnp.swapaxes(jax.vmap(lambda k: jax.random.split(k, n))(key), 0, 1)
    return jax.random.split(key, n)


def fold_in(key: jax.Array, i) -> jax.Array:
    if per_row(key):
        return jax.vmap(lambda k: jax.random.fold_in(k, i))(key)
    return jax.random.fold_in(key, i)


def _draw(fn, key: jax.Array, shape: tuple) -> jax.Array:
    if per_row(key):
        if shape[0] != key.shape[0]:
            raise ValueError(f"per-row keys for {key.shape[0]} rows, but a draw of shape {shape}")
        return jax.vmap(lambda k: fn(k, shape[1:], jnp.float32))(key)
    return fn(key, shape, jnp.float32)


def uniform(key: jax.Array, shape: tuple) -> jax.Array:
    return _draw(jax.random.uniform, key, shape)


def gumbel(key: jax.Array, shape: tuple) -> jax.Array:
    return _draw(jax.random.gumbel, key, shape)


def row_keys(seeds) -> jax.Array:
    """One key per row from per-row seeds ([B] ints): [B, 2]."""
    return jax.vmap(jax.random.PRNGKey)(jnp.asarray(seeds, jnp.uint32))


def gumbel_argmax(key: jax.Array, logits: jax.Array) -> jax.Array:
    """A draw from softmax(logits) along the last axis (the Gumbel-max trick, as `jax.random.categorical`)."""
    return argmax(logits + gumbel(key, logits.shape))


def sample_from_probs(key: jax.Array, p: jax.Array) -> jax.Array:
    """Draw from (unnormalised, non-negative) probabilities along the last axis."""
    logp = jnp.where(p > 0, jnp.log(jnp.maximum(p, 1e-38)), NEG_INF)
    return gumbel_argmax(key, logp)
