"""Autoregressive generation: prefill, then one token per target forward, the whole loop in one `lax.while_loop`."""

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


def generate(params, prompt_BP, prompt_len_B, key, temperature, top_p, *, cfg: ModelConfig, max_new: int,
             max_len: int, eos_ids: tuple[int, ...], samp: sampling.Sampling, mesh=None, cache_dtype=jnp.float32):
    """Returns (Outputs, stats dict of device scalars)."""
    b = prompt_BP.shape[0]
    params = decode_layout(params, cfg, fuse=mesh is None)
    cache = constrain_cache(kvc.init_cache(cfg, b, max_len, cache_dtype, per_layer=unrolled(params)), mesh)
    cache, logits, _ = common.prefill(params, cfg, prompt_BP, prompt_len_B, cache)
    key, sub = jax.random.split(key)
    first = sampling.sample(sub, logits, samp, temperature, top_p)
    out, _ = common.append(common.Outputs.empty(b, max_new), first[:, None], jnp.ones((b,), jnp.int32), eos_ids)
    state = ARState(out=out, cache=cache, last=first, key=key, forwards=jnp.int32(1))
    one = jnp.ones((1, 1), bool)

    def cond(s: ARState):
        return ~jnp.all(s.out.done)

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

    state = jax.lax.while_loop(cond, body, state)
    return state.out, {"target_forwards": state.forwards}
