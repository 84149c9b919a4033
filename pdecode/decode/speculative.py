"""The draft-and-verify engine: a `lax.while_loop` of (draft a tree, verify it in one target forward, commit), run
as one loop per cache phase (the target cache grows between phases, as in `ar`; `common.phased_while_loop`).

Every drafter (draft model chain/tree, n-gram lookup, Medusa, EAGLE, MTP) plugs in through the `Drafter`
interface; the engine owns the target cache, the token history, verification, cache commit, EOS and stats. A
proposal names the `verify.Rule` it is verified by; a drafter's state is a `flax.struct.dataclass` of its own.

Invariants per row: ``seq[:seq_len]`` is prompt + generated tokens; the last one (the *root*) is not yet in the
target cache, so ``cache.lengths == seq_len - 1``. A step feeds the root and the drafted nodes at positions
``seq_len - 1 + depth``, verifies, commits the accepted path (a gather by node index) and appends the accepted
tokens plus the bonus token. Rows finish independently; finished rows are carried untouched.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from flax import struct

from pdecode import grammar, sampling
from pdecode.config import ModelConfig
from pdecode.decode import common
from pdecode.decode.tree import StaticTree, depths_of
from pdecode.decode.verify import Rule, Verified, rule_for, verify
from pdecode.model import attention
from pdecode.model import cache as kvc
from pdecode.model.transformer import ForwardOut, decode_layout, forward, forward_layers, unembed, unrolled
from pdecode.sharding import constrain_cache


class Context(NamedTuple):
    """What a drafter may read when it proposes."""

    seq: jax.Array  # [B, S] prompt + generated tokens
    seq_len: jax.Array  # [B]
    root_hidden: jax.Array  # [B, D] target's final hidden state at the token before the root
    root_layers: jax.Array | None  # [n, B, D] requested target layer outputs there (EAGLE-3), or None
    active: jax.Array  # [B] rows still generating
    target: Any = None  # the target's params (decode layout): heads read its embedding and LM head
    logits: jax.Array | None = None  # [B, N, V] the verify forward's logits at the step's nodes (`update` only)
    cache: Any = None  # the target's KV cache (`propose` only): self-speculative drafters run the target's layers
    side: Any = None  # what the proposal's ``side`` work returned (`update` only; None without side work)
    gstate: Any = None  # [B] each row's grammar state after the root (structured output), or None
    remaining: jax.Array | None = None  # [B] tokens each row may still take (`Drafter.worth_drafting` only), or None


class Proposal(NamedTuple):
    """What a drafter asks the target to run and verify. A tree by default: node i sits at position root + depth(i)
    and attends to its ancestors, and ``valid`` nodes are both fed and verified. The three optional fields describe
    anything else in the same forward (lookahead's 2-D window next to its candidates): explicit ``positions``, an
    explicit ``intra`` mask, and ``visible`` nodes that are fed but, unless also ``valid``, never verified."""

    tokens: jax.Array  # [B, N]; node 0 is the root token
    parents: Any  # a StaticTree, or [B, N] int (dynamic trees): the verification tree over the valid nodes
    valid: jax.Array  # [B, N] the verification candidates (node 0 always)
    q: jax.Array | None  # [B, N, V] distribution each node's children were drawn from (sampled rules) or None
    draft_forwards: jax.Array  # scalar int32
    rule: Rule  # how `verify` tests the nodes (static; `verify.rule_for(samp, ...)`)
    positions: jax.Array | None = None  # [N] or [B, N] position offsets from the root (default: tree depth)
    intra: jax.Array | None = None  # [N, N] or [B, N, N] bool: node i attends to fresh node j (default: ancestors)
    visible: jax.Array | None = None  # [B, N] nodes the target runs (default: valid); must include every valid node
    # self-speculation (layer skip): the drafter already ran the target's blocks below ``from_layer`` on the nodes,
    # writing their keys and values into the target cache it returns (``cache``); the verify forward runs only the
    # blocks from ``from_layer`` on, from ``hidden_in`` [B, N, D] (the hidden states entering that block)
    from_layer: int = 0
    hidden_in: jax.Array | None = None
    cache: Any = None
    # work of the drafter's that needs nothing from this step's verify forward (PEARL: drafting the next window):
    # a thunk returning a pytree of arrays, run beside the verify forward and handed to `update` as ``ctx.side``.
    # On a pipeline placement (``pipe``) it runs on the draft's device while the target verifies on its own.
    side: Any = None


class Drafter:
    """Interface. Subclasses are frozen dataclasses (hashable: they are static jit arguments)."""

    tree_size: int  # N, root included
    max_depth: int
    max_children: int
    hidden_layers: tuple[int, ...] = ()  # target layers whose outputs the drafter wants (EAGLE-3)
    typical: tuple[float, float] | None = None  # (epsilon, delta) of the TYPICAL rule, for drafters proposing it
    follows = False  # `follow` keeps the state right across a plain step (a serving engine may then stop drafting)
    follows_late = False  # `follow_late` catches up after plain steps that skipped `follow` (one pass, not one a step)

    def prepare(self, dparams, mesh):
        """Rearrange the drafter's params once per call, before the loop (e.g. `decode_layout`)."""
        return dparams

    def init(self, dparams, tparams, prompt_BP, plen_B, prefill_out, max_len: int, cache_dtype=jnp.float32,
             shared_prefix: int = 0):
        """The drafter's state carried through the loop (a `flax.struct.dataclass`; ``()`` for none); a drafter
        with its own KV cache keeps it in ``cache_dtype``; ``shared_prefix``: leading prompt tokens every row shares
        (a drafter that prefills may do them once). Every drafter takes these arguments (the one interface the
        loops call)."""
        return ()

    def propose(self, dparams, dstate, ctx: Context, key, samp: sampling.Sampling, warp):
        """(Proposal, new state): the tree to verify, with the `Rule` it is verified by."""
        raise NotImplementedError

    def update(self, dparams, dstate, ctx: Context, ver: Verified, hidden_BND, layers_nBND):
        return dstate

    def worth_drafting(self, dparams, dstate, ctx: Context):
        """Not overridden: every step drafts. Overridden: a scalar bool, whether this step drafts at all. A drafter
        that knows it has nothing to propose for any live row (lookup with no match) lets `generate`'s loop take a
        plain step instead, which costs one token's forward instead of the whole tree's and yields the same one
        token; it must set ``follows``. The answer may depend on anything before this step (the sequence, the
        drafter's state), never on this step's draws: each kind of step is lossless given the past."""
        return None

    def follow(self, dparams, dstate, ctx: Context):
        """The state after a *plain* step (``make_step(plain=True)``: the target took one token alone, nothing was
        drafted), for drafters that set ``follows``; ``ctx`` holds the sequence with that token appended."""
        raise NotImplementedError(f"{type(self).__name__} cannot follow plain steps")

    def follow_late(self, dparams, dstate, seq_BL, seq_len_B, width: int, slack: int = 0):
        """The state after plain steps made with ``make_step(follow=False)`` (``seq`` / ``seq_len``: the sequence
        after them), for drafters that set ``follows_late``: catch-up passes of ``width`` tokens instead of a
        `follow` per step, while a row lacks more than ``slack`` committed tokens besides the last (``slack`` = the
        drafter's ``max_depth``: what its next `propose` feeds itself; more: the lag is left to later calls)."""
        raise NotImplementedError(f"{type(self).__name__} cannot follow plain steps late")

    def lag(self, dstate, seq_len_B):
        """[B]: the committed tokens each row's state lacks besides the last (what `follow_late` would feed), for
        drafters that set ``follows_late``."""
        raise NotImplementedError(f"{type(self).__name__} cannot follow plain steps late")


ROOT_ONLY = StaticTree(parents=(-1,), ranks=(0,))  # a proposal of the root alone: verifying it is one AR step


class StaticTreeShape:
    """Drafters whose every step proposes the same static ``tree``."""

    tree: Any

    @property
    def tree_size(self) -> int:
        return self.tree.size

    @property
    def max_depth(self) -> int:
        return self.tree.max_depth

    @property
    def max_children(self) -> int:
        return self.tree.max_children


class DynamicTreeShape:
    """Drafters growing EAGLE-2 dynamic trees: ``tree_top_k`` children per expanded node, ``depth`` levels, the
    best ``total_tokens`` nodes kept."""

    tree_top_k: int
    depth: int
    total_tokens: int

    @property
    def tree_size(self) -> int:
        return self.total_tokens + 1

    @property
    def max_depth(self) -> int:
        return self.depth

    @property
    def max_children(self) -> int:
        return self.tree_top_k


@struct.dataclass
class SpecState:
    out: common.Outputs
    cache: kvc.KVCache
    seq: jax.Array
    seq_len: jax.Array
    root_hidden: jax.Array
    root_layers: Any
    dstate: Any
    key: jax.Array  # one key, or one per row ([B, 2])
    forwards: jax.Array
    draft_forwards: jax.Array
    acc_hist: jax.Array  # [D+1] histogram of accepted draft tokens per (row, step)
    row_acc: jax.Array  # [B, D+1] the same per row (a serving engine's per-request acceptance)
    seen: jax.Array | None = None  # [B, V] bool: tokens of prompt and output (the repetition penalty's history)
    counts: jax.Array | None = None  # [B, V] int32: tokens of the output (the presence / frequency penalties')
    gstate: jax.Array | None = None  # [B] int32: each row's grammar state after its committed tokens, root included


def start(tparams, dparams, prompt_BP, prompt_len_B, cache, logits_BV, pre, key, warp, stops, *, cfg: ModelConfig,
          drafter: Drafter, max_new: int, max_len: int, eos_ids: tuple[int, ...], samp: sampling.Sampling,
          cache_dtype=jnp.float32, shared_prefix: int = 0, feed_draft: bool = True) -> SpecState:
    """The loop state after the target's prefill (``cache`` holding the prompts, ``logits`` at each prompt's last
    token, ``pre`` the prefill's forward output over the prompt positions): the first token drawn and appended, the
    drafter's state initialised. ``params`` in the decode layout, the drafter's `prepare`d. ``feed_draft`` False (a
    drafter that `follows_late`): its state left empty, the prompt not fed (`Drafter.follow_late` feeds it later)."""
    b, p = prompt_BP.shape
    n_hid = drafter.hidden_layers
    out, first, key, seen, counts, gstate = common.draw_first(prompt_BP, prompt_len_B, logits_BV, key, warp, stops,
                                                              max_new=max_new, eos_ids=eos_ids, samp=samp)
    seq = jnp.zeros((b, max_len), jnp.int32).at[:, :p].set(prompt_BP)
    seq = seq.at[jnp.arange(b), prompt_len_B].set(first, mode="drop")
    last_idx = prompt_len_B - 1
    root_hidden = common.gather_rows(pre.hidden, last_idx)
    root_layers = None if not n_hid else jax.vmap(lambda h: common.gather_rows(h, last_idx))(pre.layer_hidden)
    if not feed_draft and not drafter.follows_late:
        raise ValueError(f"{type(drafter).__name__} cannot be fed its prompt late (Drafter.follows_late is False)")
    dstate = drafter.init(dparams, tparams, prompt_BP, prompt_len_B, pre, max_len, cache_dtype=cache_dtype,
                          shared_prefix=shared_prefix or 0,  # (a draft model prefills a shared prefix once too)
                          **({} if feed_draft else {"feed": False}))
    return SpecState(out=out, cache=cache, seq=seq, seq_len=prompt_len_B + 1, root_hidden=root_hidden,
                     root_layers=root_layers, dstate=dstate, key=key, forwards=jnp.int32(1),
                     draft_forwards=jnp.int32(0), acc_hist=jnp.zeros((drafter.max_depth + 1,), jnp.int32),
                     row_acc=jnp.zeros((b, drafter.max_depth + 1), jnp.int32), seen=seen,
                     counts=counts, gstate=gstate)


def penalize_nodes(logits_BNV, seen_BV, tokens_BN, parents_BN, max_depth: int, samp, warp, counts_BV=None,
                   out=None, eos_ids: tuple[int, ...] = (), node_gstate=None):
    """The processing stages (`sampling.penalize`) at every node of a drafted tree: node i's history is the
    committed sequence (``seen`` / ``counts``, the root included) plus the tokens on its path from the root (its
    ancestors and itself), and the token it predicts comes that many tokens after the committed ones
    (``min_tokens``: ``out``'s count), so each node is processed exactly as AR would be after taking that path;
    ``node_gstate`` [B, N]: each node's grammar state after its path (`grammar.node_states`)."""
    if not samp.processing:
        return logits_BNV
    b, n, v = logits_BNV.shape
    node = jnp.broadcast_to(jnp.arange(n, dtype=jnp.int32), (b, n))
    path_tok, depth = [], jnp.zeros((b, n), jnp.int32)
    for _ in range(max_depth):  # a node's own token, then its ancestors', up to (not including) the root
        below_root = node > 0
        depth = depth + below_root
        path_tok.append(jnp.where(below_root, jnp.take_along_axis(tokens_BN, node, axis=1), v))
        node = jnp.where(below_root, jnp.take_along_axis(parents_BN, node, axis=1), 0)
    ban = common.stop_ban(out, eos_ids, v, samp, warp, depth) if out is not None else None
    ban = common.either(ban, common.grammar_ban(node_gstate, v, samp, warp))
    x = sampling.penalize(logits_BNV, None if seen_BV is None else seen_BV[:, None, :], samp, warp,
                          None if counts_BV is None else counts_BV[:, None, :])
    if samp.penalty or samp.counts:
        idx = jnp.stack(path_tok, axis=-1)  # [B, N, D], v where none
        at = jnp.minimum(idx, v - 1)
        orig = jnp.take_along_axis(logits_BNV.astype(jnp.float32), at, axis=-1)
        bias_at = None
        if samp.bias:
            bias = sampling.bias_rows(warp.bias, logits_BNV)
            bias_at = jnp.take_along_axis(jnp.broadcast_to(bias, (b, n, v)), at, axis=-1)
        counts_at = None
        if samp.counts:  # committed count + the token's occurrences on the path
            on_path = jnp.sum((idx[..., :, None] == idx[..., None, :]) & (idx[..., None, :] < v), axis=-1)
            counts_at = jnp.take_along_axis(jnp.broadcast_to(counts_BV[:, None, :], (b, n, v)), at, axis=-1) + on_path
        pen = sampling.penalize_at(orig, bias_at, counts_at, samp, warp)
        x = x.astype(jnp.float32).at[jnp.arange(b)[:, None, None], jnp.arange(n)[None, :, None], idx].set(
            pen, mode="drop")
    return x if ban is None else jnp.where(ban, sampling.NEG_INF, x)


def make_step(tparams, dparams, warp, *, cfg: ModelConfig, drafter: Drafter, max_len: int,
              eos_ids: tuple[int, ...], samp: sampling.Sampling, mesh=None, pipe: bool = False, plain: bool = False,
              follow: bool = True):
    """One step of the loop, ``step(state) -> state``: draft, verify in one target forward, commit, append. ``pipe``:
    the step runs inside `pipelined` (a proposal's side work on the draft's device, `_overlap`). ``plain``: nothing
    is drafted; the target runs the root alone and takes one token (an AR step: the bonus of an empty tree, drawn
    from the same processed distribution), and the drafter's state is kept by its `Drafter.follow` (drafters with
    ``follows``; ``follow=False``: not kept, the loop calls `Drafter.follow_late` after its plain steps). A loop may
    mix both kinds of step in any order: each is lossless given the sequence so far."""
    if plain and not drafter.follows:
        raise ValueError(f"{type(drafter).__name__} cannot follow plain steps (Drafter.follows is False)")
    if not follow and not drafter.follows_late:
        raise ValueError(f"{type(drafter).__name__} cannot follow plain steps late (Drafter.follows_late is False)")
    n_hid = drafter.hidden_layers
    d_max = drafter.max_depth

    def step(s: SpecState) -> SpecState:
        b = s.seq.shape[0]
        rows = jnp.arange(b)
        # (a greedy plain step draws nothing: its key is left as it is, as AR's greedy step leaves it)
        key, k_draft, k_ver = (s.key,) * 3 if plain and samp.greedy else sampling.split(s.key, 3)
        active = ~s.out.done
        if plain:
            root = jnp.take_along_axis(s.seq, (s.seq_len - 1)[:, None], axis=1)
            prop = Proposal(tokens=root, parents=ROOT_ONLY, valid=jnp.ones((b, 1), bool), q=None,
                            draft_forwards=jnp.int32(0), rule=rule_for(samp, Rule.TREE_DETERMINISTIC))
            dstate = s.dstate
        else:
            ctx = Context(s.seq, s.seq_len, s.root_hidden, s.root_layers, active, tparams, cache=s.cache,
                          gstate=s.gstate)
            prop, dstate = drafter.propose(dparams, s.dstate, ctx, k_draft, samp, warp)
        n = prop.tokens.shape[1]
        if isinstance(prop.parents, StaticTree):  # mask and depths are constants
            parents_BN = jnp.broadcast_to(jnp.asarray(prop.parents.parents, jnp.int32), (b, n))
            intra = jnp.asarray(prop.parents.ancestors)
            depth = jnp.asarray(prop.parents.depths)[None, :]
        else:
            parents_BN = prop.parents
            intra = attention.tree_intra(parents_BN)
            depth = depths_of(parents_BN, d_max)
        if prop.intra is not None:
            intra = prop.intra
        node_g = None
        if samp.grammar:  # each node's grammar state; deterministic drafts take the grammar's forced tokens
            force = prop.q is None and not prop.from_layer and prop.rule in (Rule.GREEDY, Rule.TREE_DETERMINISTIC)
            tokens, node_g = grammar.node_states(warp.grammar, s.gstate, prop.tokens, parents_BN, d_max, force)
            if force:
                prop = prop._replace(tokens=jnp.where(prop.valid, tokens, prop.tokens))
        if prop.positions is not None:
            depth = jnp.broadcast_to(jnp.asarray(prop.positions, jnp.int32), (b, n))
        positions = s.cache.lengths[:, None] + depth
        visible = None if plain else prop.valid if prop.visible is None else prop.visible  # (a root: always valid)
        mask = common.step_mask(cfg, s.cache, intra, positions, visible)

        def verify_forward():
            if prop.from_layer:
                f, _ = forward_layers(tparams, cfg, positions, mask, prop.cache, s.cache.lengths,
                                      tuple(range(prop.from_layer, cfg.num_layers)), x_in_BTD=prop.hidden_in,
                                      tokens_BT=prop.tokens)
            else:
                f = forward(tparams, cfg, prop.tokens, positions, mask, cache=s.cache, hidden_layers=n_hid)
            return unembed(tparams, cfg, f.hidden), f

        side = None
        if prop.side is not None and pipe:
            logits, fo, side = _overlap(verify_forward, prop.side, s.cache)
        else:
            logits, fo = verify_forward()
            if prop.side is not None:
                side = prop.side()
        logits = penalize_nodes(logits, s.seen, prop.tokens, parents_BN, d_max, samp, warp, s.counts, s.out,
                                eos_ids, node_g)
        if plain:  # the root alone: its next token drawn as AR draws it (no tree to walk: fewer ops a step)
            bonus = sampling.sample(k_ver, logits[:, 0], samp, warp).astype(jnp.int32)
            zero = jnp.zeros((b, 1), jnp.int32)
            ver = Verified(path=zero, n_accepted=zero[:, 0], bonus=bonus, tokens=bonus[:, None])
        else:
            ver = verify(logits, prop.tokens, parents_BN, prop.valid, k_ver, samp, warp,
                         rule=prop.rule, max_depth=d_max, max_children=drafter.max_children, draft_q_BNV=prop.q,
                         typical=drafter.typical)
        n_new = jnp.where(active, ver.n_accepted + 1, 0)
        if isinstance(prop.parents, StaticTree) and prop.parents.max_children <= 1:
            cache = kvc.advance(fo.cache, n_new)  # a chain's accepted path is its prefix: already in place
        else:
            cache = kvc.commit(fo.cache, ver.path, n_new)
        lp = None
        if samp.logprobs:  # the token after path node j came from node j's distribution
            lp = sampling.log_probs(jnp.take_along_axis(logits, ver.path[:, :, None], axis=1), ver.tokens)
        out, n_take = common.append(s.out, ver.tokens, n_new, eos_ids, lp)
        k = ver.tokens.shape[1]
        taken = jnp.arange(k)[None, :] < n_new[:, None]
        pos = jnp.where(taken, s.seq_len[:, None] + jnp.arange(k)[None, :], max_len)
        seq = s.seq.at[rows[:, None], pos].set(ver.tokens, mode="drop")
        seq_len = s.seq_len + n_new
        last_node = ver.path[rows, ver.n_accepted]
        root_hidden = jnp.where(active[:, None], common.gather_rows(fo.hidden, last_node), s.root_hidden)
        root_layers = s.root_layers
        if n_hid:
            new_layers = jax.vmap(lambda h: common.gather_rows(h, last_node))(fo.layer_hidden)
            root_layers = jnp.where(active[None, :, None], new_layers, s.root_layers)
        ctx2 = Context(seq, seq_len, root_hidden, root_layers, active, tparams, logits, side=side)
        if plain:  # no verify step: the acceptance histograms count drafted steps only
            dstate = drafter.follow(dparams, dstate, ctx2) if follow else dstate
            hist, row_acc = s.acc_hist, s.row_acc
        else:
            dstate = drafter.update(dparams, dstate, ctx2, ver, fo.hidden, fo.layer_hidden)
            hist = s.acc_hist.at[ver.n_accepted].add(active.astype(jnp.int32))
            row_acc = s.row_acc.at[rows, ver.n_accepted].add(active.astype(jnp.int32))
        return SpecState(out=out, cache=constrain_cache(cache, mesh), seq=seq, seq_len=seq_len,
                         root_hidden=root_hidden, root_layers=root_layers, dstate=dstate, key=key,
                         forwards=s.forwards + 1, draft_forwards=s.draft_forwards + prop.draft_forwards,
                         acc_hist=hist, row_acc=row_acc,
                         seen=common.mark_taken(s.seen, ver.tokens, taken, samp),
                         counts=common.count_taken(s.counts, ver.tokens, taken, samp),
                         gstate=common.advance_grammar(s.gstate, ver.tokens, n_new, samp, warp))

    return step


def generate(params, prompt_BP, prompt_len_B, key, warp, stops=None, *, cfg: ModelConfig,
             drafter: Drafter, max_new: int, max_len: int, eos_ids: tuple[int, ...], samp: sampling.Sampling, mesh=None,
             cache_dtype=jnp.float32, phases: int = 4, shared_prefix: int = 0, pipe: bool = False):
    """The whole draft-and-verify generation: prefill, `start`, then `make_step` in a loop. ``pipe``: the call runs
    inside `pipelined` (shard_map over the `PIPE` axis of two devices): a proposal's ``side`` work runs on device 1
    while device 0 runs the verify forward (the draft's device never runs the target's layers in the loop)."""
    tparams, dparams = params
    tparams = decode_layout(tparams, cfg, fuse=mesh is None)
    dparams = drafter.prepare(dparams, mesh)
    b, p = prompt_BP.shape
    lengths = common.phase_lengths(p, max_len, phases)  # the target cache grows between phases (see `ar`)
    cache = constrain_cache(kvc.init_cache(cfg, b, lengths[0], cache_dtype, per_layer=unrolled(tparams)), mesh)
    cache, logits, pre = common.prefill(tparams, cfg, prompt_BP, prompt_len_B, cache,
                                        hidden_layers=drafter.hidden_layers, shared_prefix=shared_prefix)
    state = start(tparams, dparams, prompt_BP, prompt_len_B, cache, logits, pre, key, warp, stops, cfg=cfg,
                  drafter=drafter, max_new=max_new, max_len=max_len, eos_ids=eos_ids, samp=samp,
                  cache_dtype=cache_dtype, shared_prefix=shared_prefix)
    step = make_step(tparams, dparams, warp, cfg=cfg, drafter=drafter, max_len=max_len, eos_ids=eos_ids, samp=samp,
                     mesh=mesh, pipe=pipe)
    step = _gated(step, tparams, dparams, warp, cfg=cfg, drafter=drafter, max_len=max_len, eos_ids=eos_ids,
                  samp=samp, mesh=mesh, pipe=pipe)
    # a verify pass writes the whole tree at slots lengths .. lengths + N - 1
    state = common.phased_while_loop(lambda s: ~jnp.all(s.out.done), step, state, lengths,
                                     fresh=drafter.tree_size, mesh=mesh)
    return state.out, {"target_forwards": state.forwards, "draft_forwards": state.draft_forwards,
                       "accepted_histogram": state.acc_hist}


def _gated(step, tparams, dparams, warp, **kw):
    """``step``, or, for a drafter whose `Drafter.worth_drafting` answers, plain steps (the target alone, one token
    a row) while drafting does not pay, then one drafted step: an inner `lax.while_loop` of plain steps, not a
    `lax.cond` between the two steps (on XLA:CPU a cond over the loop's state, KV cache included, made every plain
    step of SmolLM2 at batch 4 cost 1.2x AR's; a while loop updates the state in place). The plain steps stop while
    a drafted step's ``fresh`` writes still fit the cache of the loop's phase (`common.phased_while_loop` checked
    them for the first step). A drafted step reached after the last row ended commits nothing and is not counted."""
    drafter = kw["drafter"]
    own = getattr(getattr(drafter, "worth_drafting", None), "__func__", Drafter.worth_drafting)
    if not getattr(drafter, "follows", False) or own is Drafter.worth_drafting:
        return step
    plain = make_step(tparams, dparams, warp, plain=True, **kw)
    fresh = drafter.tree_size

    def worth(s: SpecState):
        budget = s.out.limit if s.out.limit is not None else s.out.tokens.shape[1]
        ctx = Context(s.seq, s.seq_len, s.root_hidden, s.root_layers, ~s.out.done, tparams, cache=s.cache,
                      gstate=s.gstate, remaining=budget - s.out.count)
        return drafter.worth_drafting(dparams, s.dstate, ctx)

    def keep_plain(s: SpecState):
        room = common._active_max_length(s) + 1 + fresh <= s.cache.max_len
        return ~jnp.all(s.out.done) & room & ~worth(s)

    def gated(s: SpecState) -> SpecState:
        s = jax.lax.while_loop(keep_plain, plain, s)
        live = ~jnp.all(s.out.done)
        after = step(s)
        return after.replace(forwards=jnp.where(live, after.forwards, s.forwards),
                             draft_forwards=jnp.where(live, after.draft_forwards, s.draft_forwards))

    return gated


PIPE = "pipe"  # the mesh axis of a pipeline placement: device 0 verifies, device 1 drafts


def _overlap(verify_forward, side, cache):
    """Run the verify forward on device 0 of the `PIPE` axis and the drafter's side work on device 1 at once (one
    `lax.cond` on the axis index: each device runs one branch), then give both results to both devices (a psum
    where the other branch contributes zeros). The target cache is device 0's alone: device 1 keeps its stale copy,
    whose lengths still move with the committed tokens, so both devices run the same loop."""
    lg_shape, fo_shape = jax.eval_shape(verify_forward)
    side_shape = jax.eval_shape(side)
    zeros = lambda t: jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), t)  # noqa: E731

    def target_branch():
        lg, fo = verify_forward()
        return lg, fo.hidden, fo.layer_hidden, fo.cache, zeros(side_shape)

    def draft_branch():
        return (zeros(lg_shape), zeros(fo_shape.hidden), zeros(fo_shape.layer_hidden), cache, side())

    lg, hidden, layers, new_cache, side_out = jax.lax.cond(jax.lax.axis_index(PIPE) == 0, target_branch, draft_branch)
    lg, hidden, layers, side_out = jax.lax.psum((lg, hidden, layers, side_out), PIPE)
    return lg, ForwardOut(hidden=hidden, cache=new_cache, layer_hidden=layers), side_out


def pipelined(params, prompt_BP, prompt_len_B, key, warp, stops=None, *, devices: tuple[int, ...],
              cache_dtype=jnp.float32, shared_prefix: int = 0, **static):
    """`generate` on a pipeline placement: one program over the devices with ids ``devices`` (two, static), the
    target's verify forward on the first and the drafter's side work on the second in every step. Every argument
    is replicated; the outputs are the same on both devices."""
    import functools

    import numpy as np
    from jax.sharding import Mesh, PartitionSpec as P

    by_id = {d.id: d for d in jax.devices()}
    mesh = Mesh(np.asarray([by_id[i] for i in devices]), (PIPE,))
    fn = functools.partial(generate, cache_dtype=cache_dtype, shared_prefix=shared_prefix, pipe=True, **static)
    run = jax.shard_map(fn, mesh=mesh, in_specs=P(), out_specs=P(), check_vma=False)
    return run(params, prompt_BP, prompt_len_B, key, warp, stops)


def acceptance_stats(stats: dict) -> dict:
    """Host side: acceptance per depth P(accept depth d | reached d-1) and mean accepted per step."""
    hist = [int(x) for x in stats.pop("accepted_histogram", [])]
    if hist:
        total = sum(hist)
        reached = [sum(hist[d:]) for d in range(len(hist))]
        stats["acceptance_per_depth"] = [round(reached[d] / reached[d - 1], 4) if reached[d - 1] else None
                                         for d in range(1, len(hist))]
        stats["mean_accepted"] = sum(d * h for d, h in enumerate(hist)) / total if total else 0.0
        stats["accepted_histogram"] = hist
    return stats


def make_plan(model, drafter: Drafter, draft_params=None, cache_phases: int = 4,
              pipe_devices: tuple[int, ...] | None = None):
    """The `registry.Plan` that runs ``drafter`` against ``model`` in the shared draft-and-verify loop: what a
    method's ``prepare`` returns (docs/extending.md). ``draft_params``: the drafter's weights (a jit argument).
    ``pipe_devices``: two device ids for a pipeline placement (`pipelined`; the drafter's proposals carry side
    work), or None."""
    from pdecode.decode.registry import Plan

    static = {"cfg": model.cfg, "drafter": drafter, "phases": cache_phases}
    if pipe_devices is not None:
        static["devices"] = tuple(pipe_devices)
    return Plan(fn=generate if pipe_devices is None else pipelined, params=(model.params, draft_params),
                static=static,
                extra_len=drafter.tree_size + 2, loop="token", engine="draft_verify" if pipe_devices is None else None,
                finish_stats=lambda s: acceptance_stats({**s, "tree_size": drafter.tree_size}))
