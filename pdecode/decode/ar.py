"""Autoregressive generation: prefill, then one token per target forward, with no host round trip per token.

The loop runs in a few *cache phases*: phase i is one `lax.while_loop` over a cache of ``phase_lengths[i]`` slots
(static), and the cache grows (zeros appended) between phases. Every step's attention reads every slot of the cache
it runs on, so a loop that starts on a cache just longer than the prompt and grows it reads far fewer slots than one
sized for the whole generation from the first token; it is the default because it decoded faster on CPU
(docs/performance_code_notes.md). ``phases=1`` is a single loop over the full cache; `common.phase_lengths` gives the
lengths. The result is the same up to float rounding (attention sums over a different number of masked slots).
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
    key: jax.Array
    forwards: jax.Array  # scalar int32


def generate(params, prompt_BP, prompt_len_B, key, temperature, top_p, stops=None, *, cfg: ModelConfig,
             max_new: int, max_len: int, eos_ids: tuple[int, ...], samp: sampling.Sampling, mesh=None,
             cache_dtype=jnp.float32, phases: int = 4, shared_prefix: int = 0):
    """Returns (Outputs, stats dict of device scalars). ``shared_prefix``: see `common.prefill`; ``stops``: per-row
    budgets and the line-start rule (`common.Stops`)."""
    b, p = prompt_BP.shape
    params = decode_layout(params, cfg, fuse=mesh is None)
    lengths = common.phase_lengths(p, max_len, phases)
    cache = constrain_cache(kvc.init_cache(cfg, b, lengths[0], cache_dtype, per_layer=unrolled(params)), mesh)
    cache, logits, _ = common.prefill(params, cfg, prompt_BP, prompt_len_B, cache, shared_prefix=shared_prefix)
    key, sub = jax.random.split(key)
    first = sampling.sample(sub, logits, samp, temperature, top_p)
    out, _ = common.append(common.Outputs.empty(b, max_new, stops), first[:, None], jnp.ones((b,), jnp.int32),
                           eos_ids)
    state = ARState(out=out, cache=cache, last=first, key=key, forwards=jnp.int32(1))
    one = jnp.ones((1, 1), bool)

    def body(s: ARState):
        positions = s.cache.lengths[:, None]
        mask = common.step_mask(cfg, s.cache, one, positions)
        fo = forward(params, cfg, s.last[:, None], positions, mask, cache=s.cache)
        logits = unembed(params, cfg, fo.hidden[:, 0])
        k, sub = jax.random.split(s.key)
        nxt = sampling.sample(sub, logits, samp, temperature, top_p)
        active = ~s.out.done
        cache = kvc.advance(fo.cache, active.astype(jnp.int32))
        out, _ = common.append(s.out, nxt[:, None], jnp.ones((b,), jnp.int32), eos_ids)
        last = jnp.where(active, nxt, s.last)
        return ARState(out=out, cache=constrain_cache(cache, mesh), last=last, key=k, forwards=s.forwards + 1)

    # a step writes each row's last token (one fresh slot) at `lengths`
    state = common.phased_while_loop(lambda s: ~jnp.all(s.out.done), body, state, lengths, fresh=1, mesh=mesh)
    return state.out, {"target_forwards": state.forwards}
