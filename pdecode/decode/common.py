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
class Outputs:
    """New tokens per row. ``tokens[b, :count[b]]`` are final (EOS kept, nothing after it)."""

    tokens: jax.Array  # [B, N] int32
    count: jax.Array  # [B] int32
    done: jax.Array  # [B] bool
    row_forwards: jax.Array  # [B] int32: target forwards while the row was active

    @staticmethod
    def empty(batch: int, max_new: int) -> "Outputs":
        return Outputs(tokens=jnp.zeros((batch, max_new), jnp.int32), count=jnp.zeros((batch,), jnp.int32),
                       done=jnp.zeros((batch,), bool), row_forwards=jnp.zeros((batch,), jnp.int32))


def is_eos(tokens: jax.Array, eos_ids: tuple[int, ...]) -> jax.Array:
    if not eos_ids:
        return jnp.zeros(tokens.shape, bool)
    return jnp.isin(tokens, jnp.asarray(eos_ids, tokens.dtype))


def append(out: Outputs, new_BK: jax.Array, n_new_B: jax.Array, eos_ids: tuple[int, ...]) -> tuple[Outputs, jax.Array]:
    """Append the first ``n_new[b]`` tokens of ``new[b]`` to each active row, cut after the first EOS and at the
    buffer size. Counts one target forward for every active row. Returns (outputs, tokens taken per row)."""
    b, k = new_BK.shape
    max_new = out.tokens.shape[1]
    idx = jnp.arange(k)[None, :]
    eos_hit = is_eos(new_BK, eos_ids) & (idx < n_new_B[:, None])
    any_eos = jnp.any(eos_hit, axis=1)
    first_eos = jnp.argmax(eos_hit, axis=1)
    n_take = jnp.where(any_eos, first_eos + 1, n_new_B)
    n_take = jnp.minimum(n_take, max_new - out.count)
    active = ~out.done
    n_take = jnp.where(active, n_take, 0).astype(jnp.int32)
    pos = jnp.where(idx < n_take[:, None], out.count[:, None] + idx, max_new)
    tokens = out.tokens.at[jnp.arange(b)[:, None], pos].set(new_BK.astype(jnp.int32), mode="drop")
    count = out.count + n_take
    hit_eos_taken = any_eos & (first_eos < n_take)
    done = out.done | (active & (hit_eos_taken | (count >= max_new)))
    return Outputs(tokens, count, done, out.row_forwards + active.astype(jnp.int32)), n_take


def prefill(params, cfg: ModelConfig, prompt_BP: jax.Array, prompt_len_B: jax.Array, cache: kvc.KVCache,
            hidden_layers: tuple[int, ...] = (), shared_prefix: int = 0):
    """Run the prompts (right-padded) into an empty cache.

    ``shared_prefix`` = P > 0 (static): every row's first P tokens are the same (the host guarantees it; every
    prompt is longer than P), so they run once, as one row, and that row's keys and values are given to every row;
    then each row runs only its own tokens after P (`pdecode.decompose` fills its points this way).

    Returns (cache with lengths = prompt lengths, last-position logits [B, V], forward output over all p positions).
    """
    b, p = prompt_BP.shape
    if shared_prefix:
        return _prefill_shared(params, cfg, prompt_BP, prompt_len_B, cache, hidden_layers, shared_prefix)
    positions = jnp.broadcast_to(jnp.arange(p, dtype=jnp.int32), (b, p))
    zeros = jnp.zeros((b,), jnp.int32)
    fresh_valid = positions < prompt_len_B[:, None]
    mask = attention.cache_mask(zeros, attention.causal_intra(p), cache.max_len, fresh_valid,
                                window=cfg.sliding_window, query_pos_BT=positions)
    out = forward(params, cfg, prompt_BP, positions, mask, cache=cache, write_at_B=zeros, hidden_layers=hidden_layers)
    last = jnp.take_along_axis(out.hidden, (prompt_len_B - 1)[:, None, None], axis=1)[:, 0]  # [B, D]
    logits = unembed(params, cfg, last)
    return kvc.set_lengths(out.cache, prompt_len_B), logits, out


def _prefill_shared(params, cfg, prompt_BP, prompt_len_B, cache, hidden_layers, n: int):
    b, p = prompt_BP.shape
    one = kvc.init_cache(cfg, 1, cache.max_len, cache.dtype, per_layer=cache.per_layer)
    pos1 = jnp.arange(n, dtype=jnp.int32)[None]
    mask1 = attention.cache_mask(jnp.zeros((1,), jnp.int32), attention.causal_intra(n), cache.max_len,
                                 window=cfg.sliding_window, query_pos_BT=pos1)
    head = forward(params, cfg, prompt_BP[:1, :n], pos1, mask1, cache=one, write_at_B=jnp.zeros((1,), jnp.int32),
                   hidden_layers=hidden_layers)
    shared = kvc.broadcast_rows(kvc.set_lengths(head.cache, jnp.full((1,), n, jnp.int32)), b)
    t = p - n
    positions = jnp.broadcast_to(n + jnp.arange(t, dtype=jnp.int32), (b, t))
    start = jnp.full((b,), n, jnp.int32)
    mask = attention.cache_mask(start, attention.causal_intra(t), cache.max_len, positions < prompt_len_B[:, None],
                                window=cfg.sliding_window, query_pos_BT=positions)
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
    return attention.cache_mask(cache.lengths, intra, cache.max_len, fresh_valid_BT,
                                window=cfg.sliding_window, query_pos_BT=positions_BT)


def gather_rows(x_BT, idx_B):
    """x[b, idx[b]] for a [B, T, ...] array."""
    return jnp.take_along_axis(x_BT, idx_B.reshape((-1,) + (1,) * (x_BT.ndim - 1)), axis=1)[:, 0]
