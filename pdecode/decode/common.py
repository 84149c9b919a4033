"""Pieces every decode loop shares: the output buffer, prefill, stats counters.

All functions are pure and jit-able with static shapes; rows finish independently (``done`` mask) and a finished
row is carried along untouched until the whole batch is done.
"""

from __future__ import annotations

import jax
from flax import struct
import jax.numpy as jnp

from pdecode.config import ModelConfig
from pdecode.model import attention
from pdecode.model import cache as kvc
from pdecode.model.transformer import forward, unembed
from pdecode.sharding import constrain_cache


@struct.dataclass
class Stops:
    """Per-call stop controls, passed to a method as a jit argument (new values reuse the compiled program).

    ``limit``: [B] int32, each row's budget of new tokens (at most the buffer's size, the call's largest budget).
    ``line_start``: None, or a [V] int8 table of `line_start_table` bits: a row then ends at the first token that
    starts a line at column 0 with something other than whitespace (a line after the first new one), the end of a
    function body; the token is kept, as EOS is. ``stop_ids``: per row, more ids that end it as EOS does (kept).
    """

    limit: jax.Array
    line_start: jax.Array | None = None
    stop_ids: jax.Array | None = None  # [B, S] int32: more tokens that end a row as EOS does (-1: unused)


NL_END, STARTS_TEXT, NL_TEXT = 1, 2, 4  # line_start_table bits


def line_start_table(decode_one, vocab_size: int):
    """[V] int8 (numpy): per token id, NL_END if its text ends with a newline, STARTS_TEXT if it starts with a
    non-whitespace character, NL_TEXT if it holds a newline followed by a non-whitespace character.
    ``decode_one(i)``: the text of token i (special tokens: empty)."""
    import numpy as np

    t = np.zeros((vocab_size,), np.int8)
    for i in range(vocab_size):
        s = decode_one(i)
        if not s:
            continue
        t[i] = (NL_END * s.endswith("\n") + STARTS_TEXT * (not s[0].isspace())
                + NL_TEXT * any(not c.isspace() for c in (a[:1] for a in s.split("\n")[1:]) if c))
    return t


@struct.dataclass
class Outputs:
    """New tokens per row. ``tokens[b, :count[b]]`` are final (EOS kept, nothing after it)."""

    tokens: jax.Array  # [B, N] int32
    count: jax.Array  # [B] int32
    done: jax.Array  # [B] bool
    row_forwards: jax.Array  # [B] int32: target forwards while the row was active
    limit: jax.Array | None = None  # [B] int32 per-row budgets (None: N for every row)
    line_start: jax.Array | None = None  # [V] int8 (`Stops.line_start`)
    prev: jax.Array | None = None  # [B] int32 the last token taken (-1: none yet); kept with line_start
    logprobs: jax.Array | None = None  # [B, N] float32 log p of each token (`sampling.log_probs`), when asked
    stop_ids: jax.Array | None = None  # [B, S] int32 (`Stops.stop_ids`)

    @staticmethod
    def empty(batch: int, max_new: int, stops: Stops | None = None, logprobs: bool = False) -> "Outputs":
        z = jnp.zeros((batch,), jnp.int32)
        ls = None if stops is None else stops.line_start
        return Outputs(tokens=jnp.zeros((batch, max_new), jnp.int32), count=z, done=jnp.zeros((batch,), bool),
                       row_forwards=z, limit=None if stops is None else jnp.minimum(stops.limit, max_new),
                       line_start=ls, prev=None if ls is None else jnp.full((batch,), -1, jnp.int32),
                       logprobs=jnp.zeros((batch, max_new), jnp.float32) if logprobs else None,
                       stop_ids=None if stops is None else stops.stop_ids)


def is_eos(tokens: jax.Array, eos_ids: tuple[int, ...]) -> jax.Array:
    if not eos_ids:
        return jnp.zeros(tokens.shape, bool)
    return jnp.isin(tokens, jnp.asarray(eos_ids, tokens.dtype))


def prompt_seen(prompt_BP: jax.Array, prompt_len_B: jax.Array, vocab: int, samp) -> jax.Array | None:
    """The repetition penalty's seen-token table [B, V] of the prompts (None when the penalty is off)."""
    if not samp.penalty:
        return None
    from pdecode.sampling import mark_seen

    valid = jnp.arange(prompt_BP.shape[1])[None, :] < prompt_len_B[:, None]
    return mark_seen(jnp.zeros((prompt_BP.shape[0], vocab), bool), prompt_BP, valid)


def output_counts(batch: int, vocab: int, samp) -> jax.Array | None:
    """The presence / frequency penalties' token-count table [B, V] of an empty output (None when they are off)."""
    return jnp.zeros((batch, vocab), jnp.int32) if samp.counts else None


def count_taken(counts_BV: jax.Array | None, tokens_BK: jax.Array, valid_BK: jax.Array, samp=None) -> jax.Array | None:
    """``counts`` with the taken tokens counted (None stays None; unchanged when ``samp`` has the presence /
    frequency penalties off, as `mark_taken`)."""
    if counts_BV is None or (samp is not None and not samp.counts):
        return counts_BV
    from pdecode.sampling import add_counts

    return add_counts(counts_BV, tokens_BK, valid_BK)


def draw_first(prompt_BP: jax.Array, prompt_len_B: jax.Array, logits_BV: jax.Array, key, warp, stops, *,
               max_new: int, eos_ids: tuple[int, ...], samp):
    """A token loop's first token, after its prefill (``logits`` at each prompt's last token): the processing
    history of the prompts started, the first token drawn from the processed distribution and appended to empty
    outputs. Returns (outputs, the first tokens [B], the key after the draw, seen, counts, grammar state)."""
    from pdecode import sampling

    b, v = prompt_BP.shape[0], logits_BV.shape[-1]
    seen = prompt_seen(prompt_BP, prompt_len_B, v, samp)
    counts = output_counts(b, v, samp)
    gstate = jnp.broadcast_to(warp.grammar_start, (b,)).astype(jnp.int32) if samp.grammar else None
    empty = Outputs.empty(b, max_new, stops, samp.logprobs)
    logits_BV = sampling.penalize(logits_BV, seen, samp, warp, counts,
                                  either(stop_ban(empty, eos_ids, v, samp, warp), grammar_ban(gstate, v, samp, warp)))
    key, sub = sampling.split(key)
    first = sampling.sample(sub, logits_BV, samp, warp)
    lp = sampling.log_probs(logits_BV, first)[:, None] if samp.logprobs else None
    out, _ = append(empty, first[:, None], jnp.ones((b,), jnp.int32), eos_ids, lp)
    taken = jnp.ones((b, 1), bool)
    return (out, first, key, mark_taken(seen, first[:, None], taken), count_taken(counts, first[:, None], taken),
            advance_grammar(gstate, first[:, None], jnp.ones((b,), jnp.int32), samp, warp))


def either(a: jax.Array | None, b: jax.Array | None) -> jax.Array | None:
    """The union of two optional ban masks."""
    return b if a is None else a if b is None else a | b


def grammar_ban(gstate: jax.Array | None, vocab: int, samp, warp) -> jax.Array | None:
    """[*gstate.shape, V] bool: the tokens each row's (or node's) grammar state forbids (None when grammars are
    off)."""
    if not samp.grammar:
        return None
    from pdecode import grammar

    return grammar.ban(warp.grammar, gstate, vocab)


def grammar_masker(gstate: jax.Array | None, vocab: int, samp, warp):
    """For drafters that draw a chain token by token: ``fn(logits [B, V], state, last) -> (masked logits, state)``,
    the state first advanced by ``last`` [B], the token drawn before (-1: nothing to advance, the first draw). A chain
    starts from ``gstate`` (the root's state) with ``last`` -1. Logits and state pass unchanged when grammars are off
    or the vocabularies differ."""
    from pdecode import grammar, sampling

    on = samp.grammar and gstate is not None and vocab <= warp.grammar.allow.shape[1] * 32

    def fn(logits, state, last):
        if not on:
            return logits, state
        last = jnp.asarray(last, jnp.int32)
        state = jnp.where(last >= 0, grammar.advance(warp.grammar, state, last), state)
        return jnp.where(grammar.ban(warp.grammar, state, vocab), sampling.NEG_INF, logits.astype(jnp.float32)), state

    return fn


def advance_grammar(gstate: jax.Array | None, tokens_BK: jax.Array, n_B: jax.Array, samp, warp) -> jax.Array | None:
    """Each row's grammar state after its first ``n[b]`` taken tokens (None stays None)."""
    if not samp.grammar or gstate is None:
        return gstate
    from pdecode import grammar

    return grammar.advance_taken(warp.grammar, gstate, tokens_BK, n_B)


def stop_ban(out: "Outputs", eos_ids: tuple[int, ...], vocab: int, samp, warp, depth=None) -> jax.Array | None:
    """``min_tokens``: [B, V] (or [B, N, V] with ``depth`` [B, N], each node's tokens after the last committed
    one) True at a row's stop tokens (EOS, its stop ids) while the token to be drawn would come before its
    ``min_tokens``-th new token; None when that stage is off."""
    if not samp.min_tokens:
        return None
    b = out.count.shape[0]
    stop = jnp.zeros((b, vocab), bool)
    if eos_ids:
        stop = stop.at[:, jnp.asarray(eos_ids, jnp.int32)].set(True)
    if out.stop_ids is not None:
        ids = jnp.where(out.stop_ids >= 0, out.stop_ids, vocab)
        stop = stop.at[jnp.arange(b)[:, None], ids].set(True, mode="drop")
    need = jnp.asarray(warp.min_tokens, jnp.int32)
    if depth is None:
        return stop & (out.count < need)[:, None]
    return stop[:, None, :] & (out.count[:, None] + depth < jnp.reshape(need, (-1, 1)))[..., None]


def mark_taken(seen_BV: jax.Array | None, tokens_BK: jax.Array, valid_BK: jax.Array, samp=None) -> jax.Array | None:
    """``seen`` with the taken tokens added (None stays None; unchanged when ``samp`` has the penalty off: a loop
    without the penalty compiled in keeps no history)."""
    if seen_BV is None or (samp is not None and not samp.penalty):
        return seen_BV
    from pdecode.sampling import mark_seen

    return mark_seen(seen_BV, tokens_BK, valid_BK)


def _line_starts(out: Outputs, new_BK: jax.Array) -> jax.Array:
    """[B, K] bool: new token k starts a line at column 0 (see `Stops`), its predecessor being new token k - 1 or,
    for k = 0, the row's last taken token."""
    prev = jnp.concatenate([out.prev[:, None], new_BK[:, :-1]], axis=1)
    bits = jnp.take(out.line_start, new_BK, mode="clip").astype(jnp.int32)
    pbits = jnp.where(prev >= 0, jnp.take(out.line_start, jnp.maximum(prev, 0), mode="clip"), 0).astype(jnp.int32)
    return ((bits & NL_TEXT) != 0) | (((pbits & NL_END) != 0) & ((bits & STARTS_TEXT) != 0))


def append(out: Outputs, new_BK: jax.Array, n_new_B: jax.Array, eos_ids: tuple[int, ...],
           logp_BK: jax.Array | None = None) -> tuple[Outputs, jax.Array]:
    """Append the first ``n_new[b]`` tokens of ``new[b]`` to each active row, cut after the first stop (EOS, or a
    line start when ``out.line_start`` is set) and at the row's budget; ``logp``: their log-probabilities (kept
    when ``out.logprobs`` is). Counts one target forward for every active row. Returns (outputs, tokens taken per
    row)."""
    b, k = new_BK.shape
    max_new = out.tokens.shape[1]
    cap = max_new if out.limit is None else out.limit
    idx = jnp.arange(k)[None, :]
    stop = is_eos(new_BK, eos_ids)
    if out.stop_ids is not None:
        stop = stop | jnp.any(new_BK[:, :, None] == out.stop_ids[:, None, :], axis=-1)
    if out.line_start is not None:
        stop = stop | _line_starts(out, new_BK)
    eos_hit = stop & (idx < n_new_B[:, None])
    any_eos = jnp.any(eos_hit, axis=1)
    first_eos = jnp.argmax(eos_hit, axis=1)
    n_take = jnp.where(any_eos, first_eos + 1, n_new_B)
    n_take = jnp.minimum(n_take, cap - out.count)
    active = ~out.done
    n_take = jnp.maximum(jnp.where(active, n_take, 0), 0).astype(jnp.int32)
    pos = jnp.where(idx < n_take[:, None], out.count[:, None] + idx, max_new)
    tokens = out.tokens.at[jnp.arange(b)[:, None], pos].set(new_BK.astype(jnp.int32), mode="drop")
    logprobs = out.logprobs
    if logprobs is not None and logp_BK is not None:  # (a loop that records none leaves the buffer be)
        logprobs = logprobs.at[jnp.arange(b)[:, None], pos].set(logp_BK.astype(jnp.float32), mode="drop")
    count = out.count + n_take
    hit_eos_taken = any_eos & (first_eos < n_take)
    done = out.done | (active & (hit_eos_taken | (count >= cap)))
    prev = out.prev
    if prev is not None:
        last = jnp.take_along_axis(new_BK, jnp.maximum(n_take - 1, 0)[:, None], axis=1)[:, 0].astype(jnp.int32)
        prev = jnp.where(n_take > 0, last, prev)
    return out.replace(tokens=tokens, count=count, done=done, row_forwards=out.row_forwards + active.astype(jnp.int32),
                       prev=prev, logprobs=logprobs), n_take


def prefill(params, cfg: ModelConfig, prompt_BP: jax.Array, prompt_len_B: jax.Array, cache: kvc.KVCache,
            hidden_layers: tuple[int, ...] = (), shared_prefix: int = 0):
    """Run the prompts (right-padded) into an empty cache.

    ``shared_prefix`` = P > 0 (static): every row's first P tokens are the same (the host guarantees it; every
    prompt is longer than P), so they run once, as one row, and that row's keys and values are given to every row;
    then each row runs only its own tokens after P (`pdecode.decompose` fills its points this way).

    Returns (cache with lengths = prompt lengths, last-position logits [B, V], forward output over all p positions).
    """
    if shared_prefix:
        return _prefill_shared(params, cfg, prompt_BP, prompt_len_B, cache, hidden_layers, shared_prefix)
    zeros = jnp.zeros((prompt_BP.shape[0],), jnp.int32)
    return prefill_at(params, cfg, prompt_BP, zeros, prompt_len_B, kvc.set_lengths(cache, zeros), hidden_layers)


def prefill_at(params, cfg: ModelConfig, tokens_BT: jax.Array, start_B: jax.Array, n_B: jax.Array,
               cache: kvc.KVCache, hidden_layers: tuple[int, ...] = ()):
    """Run ``tokens[b, :n[b]]`` (right-padded) at positions ``start[b]`` onwards into a cache already holding
    ``start[b]`` tokens per row (``cache.lengths == start``): one chunk of a prompt prefilled in pieces (the serving
    engine's long prompts), or a whole prompt at start 0. Rows with ``n == 0`` are left as they are.

    Returns (cache with lengths = start + n, logits at each row's last fed token [B, V], forward output over the
    chunk's T positions)."""
    b, t = tokens_BT.shape
    positions = start_B[:, None] + jnp.arange(t, dtype=jnp.int32)[None, :]
    fresh_valid = jnp.arange(t)[None, :] < n_B[:, None]
    mask = attention.cache_mask(start_B, attention.causal_intra(t), cache.max_len, fresh_valid)
    out = forward(params, cfg, tokens_BT, positions, mask, cache=cache, write_at_B=start_B,
                  hidden_layers=hidden_layers)
    last = jnp.take_along_axis(out.hidden, jnp.maximum(n_B - 1, 0)[:, None, None], axis=1)[:, 0]  # [B, D]
    logits = unembed(params, cfg, last)
    return kvc.set_lengths(out.cache, start_B + n_B), logits, out


def _prefill_shared(params, cfg, prompt_BP, prompt_len_B, cache, hidden_layers, n: int):
    b, p = prompt_BP.shape
    one = kvc.init_cache(cfg, 1, cache.max_len, cache.dtype, per_layer=cache.per_layer)
    pos1 = jnp.arange(n, dtype=jnp.int32)[None]
    mask1 = attention.cache_mask(jnp.zeros((1,), jnp.int32), attention.causal_intra(n), cache.max_len)
    head = forward(params, cfg, prompt_BP[:1, :n], pos1, mask1, cache=one, write_at_B=jnp.zeros((1,), jnp.int32),
                   hidden_layers=hidden_layers)
    shared = kvc.broadcast_rows(kvc.set_lengths(head.cache, jnp.full((1,), n, jnp.int32)), b)
    t = p - n
    positions = jnp.broadcast_to(n + jnp.arange(t, dtype=jnp.int32), (b, t))
    start = jnp.full((b,), n, jnp.int32)
    mask = attention.cache_mask(start, attention.causal_intra(t), cache.max_len, positions < prompt_len_B[:, None])
    tail = forward(params, cfg, prompt_BP[:, n:], positions, mask, cache=shared, write_at_B=start,
                   hidden_layers=hidden_layers)
    last = jnp.take_along_axis(tail.hidden, (prompt_len_B - 1 - n)[:, None, None], axis=1)[:, 0]
    logits = unembed(params, cfg, last)
    # the forward output over all p positions, as an unshared prefill returns it (drafters read prompt states)
    def cat(h1, h2, row_axis):
        return jnp.concatenate([jnp.repeat(h1, b, axis=row_axis), h2], axis=row_axis + 1)

    out = tail._replace(hidden=cat(head.hidden, tail.hidden, 0),
                        layer_hidden=None if tail.layer_hidden is None else cat(head.layer_hidden, tail.layer_hidden, 1))
    return kvc.set_lengths(tail.cache, prompt_len_B), logits, out


PHASE_ALIGN = 16  # phase lengths (but the last, max_len) are multiples of this many slots


def phase_lengths(prompt_len: int, max_len: int, phases: int) -> tuple[int, ...]:
    """Cache lengths of the decode phases: at most ``phases`` lengths, evenly spaced after the prompt (at least
    2 * PHASE_ALIGN slots apart), the last one ``max_len``."""
    base = -(-prompt_len // PHASE_ALIGN) * PHASE_ALIGN
    span = max_len - base
    step = max(2 * PHASE_ALIGN, -(-span // max(phases, 1) // PHASE_ALIGN) * PHASE_ALIGN)
    if phases <= 1 or span < 2 * step:
        return (max_len,)
    return tuple(range(base + step, max_len - PHASE_ALIGN, step)) + (max_len,)


def phased_while_loop(cond, body, state, lengths: tuple[int, ...], fresh: int, mesh=None):
    """`lax.while_loop(cond, body, state)` run as one loop per cache phase. ``state`` carries ``out`` (`Outputs`) and
    ``cache`` (the target `KVCache`); a step writes ``fresh`` tokens per row at slots ``lengths`` onwards.
    Phase i runs while ``cond`` holds and those writes fit ``lengths[i]`` slots for every row still generating; the
    cache is grown to the next length between phases. The last phase runs until ``cond`` fails."""
    for i, n in enumerate(lengths):
        if i:
            state = state.replace(cache=constrain_cache(kvc.grow(state.cache, n), mesh))
        if i == len(lengths) - 1:
            state = jax.lax.while_loop(cond, body, state)
        else:
            state = jax.lax.while_loop(lambda s, n=n: cond(s) & (_active_max_length(s) + fresh <= n), body, state)
    return state


def _active_max_length(s) -> jax.Array:
    """The longest committed length among rows still generating (0 when none is)."""
    return jnp.max(jnp.where(s.out.done, 0, s.cache.lengths))


def step_mask(cfg: ModelConfig, cache: kvc.KVCache, intra, positions_BT: jax.Array, fresh_valid_BT=None):
    """Mask for fresh tokens written at ``cache.lengths`` with the given intra mask ([T,T] or [B,T,T])."""
    return attention.cache_mask(cache.lengths, intra, cache.max_len, fresh_valid_BT)


def gather_rows(x_BT, idx_B):
    """x[b, idx[b]] for a [B, T, ...] array."""
    return jnp.take_along_axis(x_BT, idx_B.reshape((-1,) + (1,) * (x_BT.ndim - 1)), axis=1)[:, 0]
