"""Layer-skip self-speculation: the target drafts with a shallow pass of its own layers and verifies with the rest.

The draft is the target's blocks ``draft_layers`` (the first E for early exit, LayerSkip / Kangaroo; or all but a
skip set, Draft & Verify), then the final norm and the shared LM head: no extra weights; or, for an early exit, a
trained exit adapter (`pdecode.model.heads.ExitConfig`, attached as ``layerskip`` heads) before the shared head.
Each step feeds the root and then each drafted token through those blocks (one token per draft forward, up to
``gamma`` tokens), writing their keys and values into the **target's own cache**. Drafting stops early, per row,
when the draft's top-1 probability falls below a threshold that adapts to the row's acceptance rate (Draft &
Verify's adaptive exit): the threshold rises by ``step`` while the smoothed acceptance rate is under
``target_rate`` and falls otherwise.

Cache sharing: blocks ``0 .. r-1`` (the longest run of draft layers from the bottom; r = E for early exit) see
exactly what the full model sees, so their keys and values for the drafted tokens are the full model's and stay;
the verify forward runs only blocks ``r ..`` from the hidden states the draft computed entering block r (static
shapes: a chain of gamma + 1 nodes, those past a row's draft masked). Blocks the draft ran above r are overwritten
by the verify pass. Greedy output equals AR; sampled drafts are verified by speculative sampling against the
draft's own distribution (lossless).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import struct

from pdecode import sampling
from pdecode.config import ModelConfig
from pdecode.decode import tree as tree_lib
from pdecode.decode.speculative import Context, Drafter, Proposal, StaticTreeShape
from pdecode.decode.verify import Rule, Verified, rule_for
from pdecode.model import attention
from pdecode.model.heads import exit_logits
from pdecode.model.transformer import forward_layers, unembed


def shared_prefix_layers(draft_layers: tuple[int, ...]) -> int:
    """r: the draft's blocks 0 .. r-1 are the target's first r blocks run in order (their KV is reusable)."""
    r = 0
    while r < len(draft_layers) and draft_layers[r] == r:
        r += 1
    return r


@struct.dataclass
class LayerSkipState:
    threshold: jax.Array  # [B] current exit threshold on the draft's top-1 probability
    rate: jax.Array  # [B] smoothed acceptance rate
    drafted: jax.Array  # [B] tokens drafted in the last step


@dataclasses.dataclass(frozen=True)
class LayerSkipDrafter(StaticTreeShape, Drafter):
    cfg: ModelConfig
    draft_layers: tuple[int, ...]
    gamma: int = 6
    threshold: float = 0.0  # 0: never stop early (a fixed draft length)
    adaptive: bool = True
    target_rate: float = 0.8
    step: float = 0.05
    exit_adapter: bool = False  # the draft's logits through a trained early-exit adapter (dparams: `ExitConfig`'s)

    @property
    def tree(self) -> tree_lib.StaticTree:
        return tree_lib.chain(self.gamma)

    @property
    def reuse(self) -> int:
        return shared_prefix_layers(self.draft_layers)

    def init(self, dparams, tparams, prompt_BP, plen_B, prefill_out, max_len: int, cache_dtype=None,
             shared_prefix: int = 0):
        b = prompt_BP.shape[0]
        return LayerSkipState(threshold=jnp.full((b,), self.threshold, jnp.float32),
                              rate=jnp.full((b,), self.target_rate, jnp.float32), drafted=jnp.zeros((b,), jnp.int32))

    def propose(self, dparams, st: LayerSkipState, ctx: Context, key, samp, warp):
        tp, cfg, g = ctx.target, self.cfg, self.gamma
        b = ctx.seq.shape[0]
        n = g + 1
        start = ctx.cache.lengths
        root = jnp.take_along_axis(ctx.seq, (ctx.seq_len - 1)[:, None], axis=1)[:, 0]
        tokens = jnp.zeros((b, n), jnp.int32).at[:, 0].set(root)
        d = cfg.hidden_size
        act = jnp.dtype(cfg.run.activation_dtype) if cfg.run.activation_dtype else tp["embed"].dtype
        hid = jnp.zeros((b, n, d), act)
        q = None if samp.greedy else jnp.zeros((b, n, cfg.vocab_size), jnp.float32)
        causal = attention.causal_intra(n)
        reuse = self.reuse

        def cond(c):
            j, _, _, _, _, _, n_d, _ = c
            return (j <= g) & jnp.any(j <= n_d)

        def body(c):
            j, tokens, hid, q, cache, live, n_d, key = c
            pos = (start + j)[:, None]
            mask = attention.cache_mask(start, jax.lax.dynamic_slice_in_dim(causal, j, 1, axis=0), cache.max_len)
            tok = jax.lax.dynamic_slice_in_dim(tokens, j, 1, axis=1)
            fo, cap = forward_layers(tp, cfg, pos, mask, cache, start + j, self.draft_layers, tokens_BT=tok,
                                     capture=reuse)
            hid = jax.lax.dynamic_update_slice_in_dim(hid, cap.astype(hid.dtype), j, axis=1)
            if self.exit_adapter:  # (cap: the hidden state after the exit layer, before any norm)
                logits = exit_logits(dparams, cfg, tp, cap[:, 0])
            else:
                logits = unembed(tp, cfg, fo.hidden[:, 0])
            key, sub = sampling.split(key)
            if samp.greedy:
                nxt = sampling.argmax(logits)
                conf = jnp.max(jax.nn.softmax(logits.astype(jnp.float32), axis=-1), axis=-1)
            else:
                probs = sampling.probs(logits, samp, warp)
                nxt = sampling.sample_from_probs(sub, probs)
                conf = jnp.max(probs, axis=-1)
                q = jax.lax.dynamic_update_slice_in_dim(q, probs[:, None], j, axis=1)
            go = live & (j < g) & (conf >= st.threshold)
            tokens = jnp.where(go[:, None] & (jnp.arange(n)[None, :] == j + 1), nxt[:, None], tokens)
            n_d = jnp.where(go, j + 1, n_d)
            return j + 1, tokens, hid, q, fo.cache, go, n_d, key

        init = (jnp.int32(0), tokens, hid, q, ctx.cache, ctx.active, jnp.zeros((b,), jnp.int32), key)
        j, tokens, hid, q, cache, _, n_d, _ = jax.lax.while_loop(cond, body, init)
        valid = jnp.arange(n)[None, :] <= n_d[:, None]
        prop = Proposal(tokens=tokens, parents=self.tree, valid=valid, q=q, draft_forwards=j,
                        rule=rule_for(samp, Rule.CHAIN_SAMPLING), from_layer=reuse, hidden_in=hid, cache=cache)
        return prop, st.replace(drafted=n_d)

    def update(self, dparams, st: LayerSkipState, ctx: Context, ver: Verified, hidden_BND, layers_nBND):
        if not self.adaptive or self.threshold <= 0:
            return st
        drafted = st.drafted
        rate = ver.n_accepted / jnp.maximum(drafted, 1)
        ok = ctx.active & (drafted > 0)
        ema = jnp.where(ok, 0.9 * st.rate + 0.1 * rate, st.rate)
        thr = jnp.where(ok, jnp.where(ema < self.target_rate, st.threshold + self.step, st.threshold - self.step),
                        st.threshold)
        return st.replace(threshold=jnp.clip(thr, 0.05, 0.95), rate=ema)


def _greedy_choices(params, tokens_BT, lengths_B, *, cfg: ModelConfig, ids: tuple[int, ...]):
    """[B, T] the greedy next token at every position through blocks ``ids`` (teacher forced)."""
    b, t = tokens_BT.shape
    pos = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    mask = attention.padded_self_mask(lengths_B, t, causal=True)
    out, _ = forward_layers(params, cfg, pos, mask, None, None, ids, tokens_BT=tokens_BT)
    return sampling.argmax(unembed(params, cfg, out.hidden))


def agreement(model, tokens_BT, lengths_B, ids: tuple[int, ...], full_BT=None) -> float:
    """Fraction of valid positions where the draft through blocks ``ids`` picks the full model's greedy token
    (``full_BT``: those tokens, when already computed)."""
    from pdecode.api import compiled

    def choices(layers):
        exe, _ = compiled(_greedy_choices, {"cfg": model.cfg, "ids": layers}, model.params, tokens_BT, lengths_B)
        return exe(model.params, tokens_BT, lengths_B)

    if full_BT is None:
        full_BT = choices(tuple(range(model.cfg.num_layers)))
    valid = jnp.arange(tokens_BT.shape[1])[None, :] < lengths_B[:, None]
    return float(jnp.sum((choices(ids) == full_BT) & valid) / jnp.maximum(jnp.sum(valid), 1))


def search_skip(model, texts, n_skip: int, exit_layer: int | None = None, max_tokens: int = 256):
    """A training-free search for the layers a Draft & Verify draft skips: greedily, ``n_skip`` times, the layer
    whose removal keeps the draft's greedy choice closest to the full model's on calibration ``texts`` (top-1
    agreement, teacher forced; one batched forward per candidate). Returns (skip tuple, agreement after each pick).
    Use it as ``generate(..., method="layerskip", exit_layer=E, skip=list(skip))``."""
    from pdecode.api import compiled, encode_prompts
    from pdecode.errors import InputError

    cfg = model.cfg
    e = cfg.num_layers if exit_layer is None else exit_layer
    if not 0 <= n_skip < e:
        raise InputError(f"n_skip must be in 0..{e - 1} (the draft keeps at least one of its {e} layers), got {n_skip}")
    ids = [x[:max_tokens] for x in encode_prompts(model, list(texts))]
    t = max(len(x) for x in ids)
    tok = jnp.asarray([x + [0] * (t - len(x)) for x in ids], jnp.int32)
    lens = jnp.asarray([len(x) for x in ids], jnp.int32)
    exe, _ = compiled(_greedy_choices, {"cfg": cfg, "ids": tuple(range(cfg.num_layers))}, model.params, tok, lens)
    full = exe(model.params, tok, lens)  # the full model's choices, once for every candidate
    skip: list[int] = []
    history = []
    for _ in range(n_skip):
        best = None
        for cand in range(e):
            if cand in skip:
                continue
            layers = tuple(i for i in range(e) if i not in skip + [cand])
            a = agreement(model, tok, lens, layers, full_BT=full)
            if best is None or a > best[1]:
                best = (cand, a)
        skip.append(best[0])
        history.append(best[1])
    return tuple(sorted(skip)), history
