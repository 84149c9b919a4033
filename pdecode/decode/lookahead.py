"""Lookahead decoding: a 2-D Jacobi window and an n-gram pool, both in static-shape arrays per row, with the
lookahead branch and the verification branch in one target forward.

Our formulation (after Fu et al., "Break the sequential dependency of LLM inference using lookahead decoding"):

* **Window.** ``W`` columns, each a short sequence the target extends by one token per step; ``levels[l, w]``
  (l = 0 .. N-2) holds column w's last N-1 tokens, oldest first. Node (l, w) sits at position root + l + w + 1 and
  attends to the root, to level 0's earlier columns (positions 1 .. w) and to its own column's lower levels: a
  contiguous context. The target's prediction at (N-2, w) extends column w; the columns' n-grams
  ``levels[0..N-2, w] + prediction`` go into the pool. For the first N-2 steps the levels fill one per step.
* **Pool.** Per row ``[buckets, G, N]`` (key token, then its N-1 continuation) with an age per slot: keyed by the
  token the n-gram starts with (bucket = key mod ``buckets``, the stored key checked; one bucket per token for
  vocabularies up to `MAX_BUCKETS`); an n-gram already there is refreshed, a new one replaces its bucket's least
  recently used slot. Optionally seeded with the prompt's own n-grams.
* **Verification branch.** The pool's G most recent candidates for the root, merged into a trie (candidates that
  share a prefix share its nodes), verified by the shared verifier: greedy accepts the longest matching candidate;
  sampling uses the multi-candidate rule for deterministic drafts (``TREE_DETERMINISTIC``, lossless).

One forward holds 1 + G (N-1) + W (N-1) nodes: `speculative.Proposal`'s explicit ``positions`` and ``intra`` mask
place them, and ``visible`` nodes (the window) are run but never verified.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from pdecode import sampling
from pdecode.decode.speculative import Context, Drafter, Proposal
from pdecode.decode.verify import Rule, Verified, rule_for
from pdecode.model import attention

MAX_BUCKETS = 32768
EMPTY = np.iinfo(np.int32).min  # the age of an empty pool slot (prompt n-grams get negative ages, steps positive)


@struct.dataclass
class LookaheadState:
    levels: jax.Array  # [B, N-1, W] the window
    filled: jax.Array  # scalar int32: levels holding real tokens (1 .. N-1)
    pool: jax.Array  # [B, K, G, N] key token + continuation; key -1 = empty slot
    age: jax.Array  # [B, K, G] int32 last insert / refresh (EMPTY: an empty slot)
    clock: jax.Array  # scalar int32


def window_layout(n: int, w: int) -> tuple[np.ndarray, np.ndarray]:
    """(position offsets [(N-1) W], intra mask [(N-1) W, (N-1) W]) of the window's nodes, level-major: node (l, c)
    at index l * W + c, position l + c + 1; it sees level 0's columns < c and its own column's levels <= l."""
    m = n - 1
    pos = np.array([l + c + 1 for l in range(m) for c in range(w)], np.int32)
    intra = np.zeros((m * w, m * w), bool)
    for l in range(m):
        for c in range(w):
            i = l * w + c
            intra[i, [c2 for c2 in range(c)]] = True
            intra[i, [l2 * w + c for l2 in range(l + 1)]] = True
    return pos, intra


def insert(pool, age, key_B, cont_BM, ok_B, now):
    """Insert one n-gram per row (``ok``: rows that insert): refresh it if present, else replace the least recently
    used slot of its bucket."""
    b, k, g, _ = pool.shape
    rows = jnp.arange(b)
    bucket = key_B % k
    gram = jnp.concatenate([key_B[:, None], cont_BM], axis=1)  # [B, N]
    slots = pool[rows, bucket]  # [B, G, N]
    same = jnp.all(slots == gram[:, None, :], axis=-1)  # [B, G]
    present = jnp.any(same, axis=-1)
    slot = jnp.where(present, jnp.argmax(same, axis=-1), jnp.argmin(age[rows, bucket], axis=-1))
    bucket = jnp.where(ok_B, bucket, k)  # out of range: dropped
    pool = pool.at[rows, bucket, slot].set(gram, mode="drop")
    age = age.at[rows, bucket, slot].set(now, mode="drop")
    return pool, age


@dataclasses.dataclass(frozen=True)
class LookaheadDrafter(Drafter):
    window: int = 7  # W
    ngram: int = 5  # N
    guesses: int = 7  # G
    seed_prompt: bool = True
    vocab_size: int = 0

    @property
    def buckets(self) -> int:
        return min(self.vocab_size, MAX_BUCKETS)

    @property
    def tree_size(self) -> int:
        return 1 + (self.guesses + self.window) * (self.ngram - 1)

    @property
    def max_depth(self) -> int:
        return self.ngram - 1

    @property
    def max_children(self) -> int:
        return self.guesses

    def init(self, dparams, tparams, prompt_BP, plen_B, prefill_out, max_len: int, cache_dtype=None,
             shared_prefix: int = 0):
        b, p = prompt_BP.shape
        m, w, g = self.ngram - 1, self.window, self.guesses
        # level 0 starts as prompt tokens spread over the prompt; the other levels fill during the first steps
        idx = (plen_B[:, None] * (jnp.arange(w)[None, :] + 1)) // (w + 1)
        lvl0 = jnp.take_along_axis(prompt_BP, jnp.clip(idx, 0, p - 1), axis=1)
        levels = jnp.broadcast_to(lvl0[:, None, :], (b, m, w))
        pool = jnp.full((b, self.buckets, g, m + 1), -1, jnp.int32)
        age = jnp.full((b, self.buckets, g), EMPTY, jnp.int32)
        if self.seed_prompt:  # every n-gram of the prompt, later ones more recent
            def body(i, pa):
                gi = jnp.clip(i + jnp.arange(m + 1), 0, p - 1)
                gram = prompt_BP[:, gi]
                return insert(pa[0], pa[1], gram[:, 0], gram[:, 1:], i + m < plen_B, i - p)

            pool, age = jax.lax.fori_loop(0, max(p - m, 0), body, (pool, age))
        return LookaheadState(levels=levels, filled=jnp.int32(1), pool=pool, age=age, clock=jnp.int32(0))

    def candidates(self, st: LookaheadState, root_B):
        """The root's pool entries, most recent first: (continuations [B, G, N-1], found [B, G])."""
        b = root_B.shape[0]
        slots = st.pool[jnp.arange(b), root_B % self.buckets]  # [B, G, N]
        ages = st.age[jnp.arange(b), root_B % self.buckets]
        found = (slots[..., 0] == root_B[:, None]) & (ages > EMPTY)
        order = jnp.argsort(jnp.where(found, -ages.astype(jnp.float32), np.inf), axis=1, stable=True)
        cont = jnp.take_along_axis(slots[..., 1:], order[:, :, None], axis=1)
        return cont, jnp.take_along_axis(found, order, axis=1)

    def propose(self, dparams, st: LookaheadState, ctx: Context, key, samp, warp):
        b = ctx.seq.shape[0]
        m, w, g = self.ngram - 1, self.window, self.guesses
        root = jnp.take_along_axis(ctx.seq, (ctx.seq_len - 1)[:, None], axis=1)[:, 0]
        cont, found = self.candidates(st, root)  # [B, G, M]
        # the trie: candidate j's depth-d node merges into the first candidate with the same first d + 1 tokens
        eq = jnp.cumprod((cont[:, :, None, :] == cont[:, None, :, :]).astype(jnp.int32), axis=-1).astype(bool)
        eq = eq & found[:, :, None, None] & found[:, None, :, None]  # [B, G, G', M]
        canon = jnp.argmax(eq, axis=2)  # [B, G, M] first g' with the same prefix (itself when unmatched)
        node = 1 + canon * m + jnp.arange(m)[None, None, :]  # canonical node index of (g, d)
        parent = jnp.concatenate([jnp.zeros((b, g, 1), jnp.int32), node[:, :, :-1]], axis=2)
        is_canon = (canon == jnp.arange(g)[None, :, None]) & found[:, :, None]
        v_par = parent.reshape(b, g * m)
        v_ok = is_canon.reshape(b, g * m)
        n_win = m * w
        w_pos, w_intra = window_layout(self.ngram, w)
        parents = jnp.concatenate([jnp.full((b, 1), -1, jnp.int32), v_par, jnp.zeros((b, n_win), jnp.int32)], 1)
        tokens = jnp.concatenate([root[:, None], cont.reshape(b, g * m), st.levels.reshape(b, n_win)], axis=1)
        valid = jnp.concatenate([jnp.ones((b, 1), bool), v_ok, jnp.zeros((b, n_win), bool)], axis=1)
        visible = jnp.concatenate([jnp.ones((b, 1 + g * m), bool) & valid[:, : 1 + g * m],
                                   jnp.ones((b, n_win), bool)], axis=1)
        # the mask: the verification trie's ancestors, the window's own layout, the root seen by all
        n_ver = 1 + g * m
        ver_anc = attention.tree_intra(jnp.where(valid[:, :n_ver], parents[:, :n_ver], -1).at[:, 0].set(-1))
        intra = jnp.zeros((b, self.tree_size, self.tree_size), bool)
        intra = intra.at[:, :n_ver, :n_ver].set(ver_anc)
        intra = intra.at[:, n_ver:, n_ver:].set(jnp.asarray(w_intra)[None])
        intra = intra.at[:, :, 0].set(True)
        depth = jnp.tile(jnp.arange(1, m + 1, dtype=jnp.int32), g)
        positions = jnp.concatenate([jnp.zeros((1,), jnp.int32), depth, jnp.asarray(w_pos)])
        return Proposal(tokens=tokens, parents=parents, valid=valid, q=None, draft_forwards=jnp.int32(0),
                        rule=rule_for(samp, Rule.TREE_DETERMINISTIC), positions=positions, intra=intra,
                        visible=visible), st

    def update(self, dparams, st: LookaheadState, ctx: Context, ver: Verified, hidden_BND, layers_nBND):
        b = ctx.seq.shape[0]
        m, w, g = self.ngram - 1, self.window, self.guesses
        n_ver = 1 + g * m
        y = sampling.argmax(ctx.logits[:, n_ver:]).reshape(b, m, w)  # the target's next token after each window node
        full = st.filled >= m
        now = st.clock + 1
        pool, age = st.pool, st.age
        # the columns' n-grams, once the window is full: levels 0 .. N-2 of column c, then its prediction
        for c in range(w):
            gram = jnp.concatenate([st.levels[:, :, c], y[:, m - 1, c][:, None]], axis=1)  # [B, N]
            pool, age = insert(pool, age, gram[:, 0], gram[:, 1:], ctx.active & full, now)
        # fill the next level while warming up, else shift every column by one token
        below = jax.lax.dynamic_index_in_dim(y, jnp.clip(st.filled - 1, 0, m - 1), axis=1)  # [B, 1, W]
        fill = jnp.where(jnp.arange(m)[None, :, None] == st.filled, below, st.levels)
        shifted = jnp.concatenate([st.levels[:, 1:], y[:, m - 1:]], axis=1)
        levels = jnp.where(full, shifted, fill)
        levels = jnp.where(ctx.active[:, None, None], levels, st.levels)
        return LookaheadState(levels=levels, filled=jnp.minimum(st.filled + 1, m), pool=pool, age=age, clock=now)
