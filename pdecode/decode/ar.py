"""Autoregressive generation: prefill, then one token per target forward, with no host round trip per token.

The loop runs in a few *cache phases*: phase i is one `lax.while_loop` over a cache of ``phase_lengths[i]`` slots
(static), and the cache grows (zeros appended) between phases. Every step's attention reads every slot of the cache
it runs on, so a loop that starts on a cache just longer than the prompt and grows it reads far fewer slots than one
sized for the whole generation from the first token; it is the default because it decoded faster on CPU
(docs/performance_code_notes.md). ``phases=1`` is a single loop over the full cache; `common.phase_lengths` gives the
lengths. The result is the same up to float rounding (attention sums over a different number of masked slots).

The pieces a driver other than `generate` needs (the serving engine: `pdecode.engine`) are functions here: `start`
(the loop state after a prefill) and `make_step` (one step of the loop).
"""

from __future__ import annotations

import jax
from flax import struct
import jax.numpy as jnp

from pdecode import sampling
from pdecode.config import ModelConfig
from pdecode.decode import common
from pdecode.model import cache as kvc
from pdecode.model.transformer import decode_layout, forward, unembed, unrolled
from pdecode.sharding import constrain_cache


@struct.dataclass
class ARState:
    out: common.Outputs
    cache: kvc.KVCache
    last: jax.Array  # [B] last token (not yet in the cache)
    key: jax.Array  # one key, or one per row ([B, 2])
    forwards: jax.Array  # scalar int32
    seen: jax.Array | None = None  # [B, V] bool: tokens of prompt and output (the repetition penalty's history)
    counts: jax.Array | None = None  # [B, V] int32: tokens of the output (the presence / frequency penalties')
    gstate: jax.Array | None = None  # [B] int32: each row's grammar state after its tokens (structured output)


def start(prompt_BP, prompt_len_B, cache, logits_BV, key, warp, stops, *, max_new: int, eos_ids: tuple[int, ...],
          samp: sampling.Sampling) -> ARState:
    """The loop state after a prefill (``cache`` holding the prompts, ``logits`` at each prompt's last token): the
    first token drawn and appended."""
    out, first, key, seen, counts, gstate = common.draw_first(prompt_BP, prompt_len_B, logits_BV, key, warp, stops,
                                                              max_new=max_new, eos_ids=eos_ids, samp=samp)
    return ARState(out=out, cache=cache, last=first, key=key, forwards=jnp.int32(1), seen=seen, counts=counts,
                   gstate=gstate)


def make_step(params, warp, *, cfg: ModelConfig, eos_ids: tuple[int, ...], samp: sampling.Sampling, mesh=None):
    """One step of the loop: ``step(state) -> state`` (every row not done takes one token). ``params``: the decode
    layout (`decode_layout`)."""
    one = jnp.ones((1, 1), bool)

    def step(s: ARState) -> ARState:
        b = s.last.shape[0]
        positions = s.cache.lengths[:, None]
        mask = common.step_mask(cfg, s.cache, one, positions)
        fo = forward(params, cfg, s.last[:, None], positions, mask, cache=s.cache)
        raw = unembed(params, cfg, fo.hidden[:, 0])
        v = raw.shape[-1]
        logits = sampling.penalize(raw, s.seen, samp, warp, s.counts,
                                   common.either(common.stop_ban(s.out, eos_ids, v, samp, warp),
                                                 common.grammar_ban(s.gstate, v, samp, warp)))
        k, sub = (s.key, s.key) if samp.greedy else sampling.split(s.key)
        nxt = sampling.sample(sub, logits, samp, warp)
        active = ~s.out.done
        cache = kvc.advance(fo.cache, active.astype(jnp.int32))
        lp = sampling.log_probs(logits, nxt)[:, None] if samp.logprobs else None
        out, _ = common.append(s.out, nxt[:, None], jnp.ones((b,), jnp.int32), eos_ids, lp)
        last = jnp.where(active, nxt, s.last)
        seen = common.mark_taken(s.seen, nxt[:, None], active[:, None], samp)
        counts = common.count_taken(s.counts, nxt[:, None], active[:, None], samp)
        gstate = common.advance_grammar(s.gstate, nxt[:, None], active.astype(jnp.int32), samp, warp)
        return ARState(out=out, cache=constrain_cache(cache, mesh), last=last, key=k, forwards=s.forwards + 1,
                       seen=seen, counts=counts, gstate=gstate)

    return step


def generate(params, prompt_BP, prompt_len_B, key, warp, stops=None, *, cfg: ModelConfig,
             max_new: int, max_len: int, eos_ids: tuple[int, ...], samp: sampling.Sampling, mesh=None,
             cache_dtype=jnp.float32, phases: int = 4, shared_prefix: int = 0):
    """Returns (Outputs, stats dict of device scalars). ``shared_prefix``: see `common.prefill`; ``stops``: per-row
    budgets and the line-start rule (`common.Stops`)."""
    b, p = prompt_BP.shape
    params = decode_layout(params, cfg, fuse=mesh is None)
    lengths = common.phase_lengths(p, max_len, phases)
    cache = constrain_cache(kvc.init_cache(cfg, b, lengths[0], cache_dtype, per_layer=unrolled(params)), mesh)
    cache, logits, _ = common.prefill(params, cfg, prompt_BP, prompt_len_B, cache, shared_prefix=shared_prefix)
    state = start(prompt_BP, prompt_len_B, cache, logits, key, warp, stops, max_new=max_new, eos_ids=eos_ids,
                  samp=samp)
    step = make_step(params, warp, cfg=cfg, eos_ids=eos_ids, samp=samp, mesh=mesh)
    # a step writes each row's last token (one fresh slot) at `lengths`
    state = common.phased_while_loop(lambda s: ~jnp.all(s.out.done), step, state, lengths, fresh=1, mesh=mesh)
    return state.out, {"target_forwards": state.forwards}
