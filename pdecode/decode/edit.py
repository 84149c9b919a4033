"""Edit-based refinement (Levenshtein Transformer style) with a bidirectional model and its edit heads
(`pdecode.model.heads.EditConfig`, the zoo's ``code-edit``): each iteration deletes tokens, inserts placeholders
between neighbours and fills them, until nothing changes or ``max_iterations``.

Layout: row b holds its context at ``[0, P_b)`` (never edited), the draft after it and one EOS closing the draft at
``L_b - 1`` (never edited either: insertions may go right before it), padding after. One iteration, three forwards:

1. **delete**: the delete head on every draft token; the kept tokens are compacted in place (a scatter by the running
   count of kept tokens);
2. **insert**: on the compacted text, the insert head on each neighbour pair from (last context token, first draft
   token) to (last draft token, EOS): ``n`` placeholders (mask tokens) go between them, the row growing by their sum
   (capped at the buffer's size);
3. **fill**: the model's own masked prediction at each placeholder (with its AR shift when it has one).

A row whose iteration deleted and inserted nothing is done and kept as it is; the loop ends when every row is. All
static shapes in one `lax.while_loop`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from pdecode import sampling
from pdecode.config import ModelConfig
from pdecode.decode import canvas as cvs
from pdecode.decode import common
from pdecode.model.attention import padded_self_mask
from pdecode.model.heads import EditConfig, edit_delete_logits, edit_insert_logits
from pdecode.model.transformer import decode_layout, forward, unembed


@struct.dataclass
class EditState:
    x: jax.Array  # [B, S]
    length: jax.Array  # [B] context + draft + the closing EOS
    done: jax.Array  # [B] nothing changed in the row's last iteration
    iterations: jax.Array  # [B] iterations that changed the row
    forwards: jax.Array  # [B] forwards the row waited for
    deleted: jax.Array  # [B] tokens deleted in all
    inserted: jax.Array  # [B] tokens inserted in all
    it: jax.Array  # scalar


def _hidden(params, cfg: ModelConfig, x_BS, length_B):
    b, s = x_BS.shape
    pos = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (b, s))
    return forward(params, cfg, x_BS, pos, padded_self_mask(length_B, s, causal=False)).hidden


def compact(x_BS, keep_BS, pad: int):
    """The kept tokens of each row moved to its front in order (pad after): (x, new length)."""
    b, s = x_BS.shape
    idx = jnp.where(keep_BS, jnp.cumsum(keep_BS.astype(jnp.int32), axis=1) - 1, s)
    out = jnp.full((b, s), pad, x_BS.dtype).at[jnp.arange(b)[:, None], idx].set(x_BS, mode="drop")
    return out, jnp.sum(keep_BS, axis=1).astype(jnp.int32)


def expand(x_BS, length_B, counts_BS, mask_id: int, pad: int):
    """``counts[b, t]`` placeholders inserted after token t of each row (cut where the row would outgrow the
    buffer): (x, new length, placeholder positions)."""
    b, s = x_BS.shape
    valid = jnp.arange(s)[None, :] < length_B[:, None]
    c = jnp.where(valid, counts_BS, 0)
    room = s - length_B
    before = jnp.cumsum(c, axis=1) - c  # placeholders inserted before token t's own ones
    c = jnp.clip(c, 0, jnp.maximum(room[:, None] - before, 0))
    shift = jnp.cumsum(c, axis=1) - c  # tokens before t gained this many placeholders
    new_len = length_B + jnp.sum(c, axis=1)
    idx = jnp.where(valid, jnp.arange(s)[None, :] + shift, s)
    out = jnp.full((b, s), mask_id, x_BS.dtype).at[jnp.arange(b)[:, None], idx].set(x_BS, mode="drop")
    is_tok = jnp.zeros((b, s), bool).at[jnp.arange(b)[:, None], idx].set(valid, mode="drop")
    inside = jnp.arange(s)[None, :] < new_len[:, None]
    return jnp.where(inside, out, pad), new_len.astype(jnp.int32), inside & ~is_tok


def refine_loop(params, ep, x_BS, context_B, length_B, *, cfg: ModelConfig, ecfg: EditConfig, mask_id: int, pad: int,
                max_iterations: int, confidence: float = 0.5) -> EditState:
    """The refinement (module docstring); ``params`` in the decode layout, ``ep`` the edit heads. A token is deleted
    when the delete head gives it probability >= ``confidence``; a gap gets the insert head's most likely count when
    that is not zero and the head gives "none" probability <= 1 - ``confidence`` (0.5: the heads' argmax)."""
    del ecfg
    b, s = x_BS.shape
    z = jnp.zeros((b,), jnp.int32)
    st = EditState(x=x_BS, length=length_B, done=jnp.zeros((b,), bool), iterations=z, forwards=z, deleted=z,
                   inserted=z, it=jnp.int32(0))
    pos = jnp.arange(s)[None, :]

    def body(st: EditState):
        live = ~st.done
        # 1. delete (never the context, never the closing EOS)
        h = _hidden(params, cfg, st.x, st.length)
        editable = (pos >= context_B[:, None]) & (pos < st.length[:, None] - 1)
        p_del = jax.nn.softmax(edit_delete_logits(ep, h).astype(jnp.float32), axis=-1)[..., 1]
        delete = editable & (p_del >= confidence) & live[:, None]
        x1, len1 = compact(st.x, (pos < st.length[:, None]) & ~delete, pad)
        # 2. insert between (last context token, first draft token) ... (last draft token, EOS)
        h1 = _hidden(params, cfg, x1, len1)
        pairs = (pos >= context_B[:, None] - 1) & (pos < len1[:, None] - 1) & live[:, None]
        p_ins = jax.nn.softmax(edit_insert_logits(ep, h1).astype(jnp.float32), axis=-1)
        best = sampling.argmax(p_ins)  # the most likely count, kept when sure enough that something is missing
        counts = jnp.where(pairs & (best > 0) & ((1.0 - p_ins[..., 0]) >= confidence), best, 0)
        x2, len2, holes = expand(x1, len1, counts, mask_id, pad)
        # 3. fill the placeholders with the model's masked predictions
        lg = cvs.shift_logits(unembed(params, cfg, _hidden(params, cfg, x2, len2)), cfg.diffusion_shift)
        x3 = jnp.where(holes, sampling.argmax(cvs.no_mask(lg, mask_id)), x2)
        n_del = jnp.sum(delete, axis=1).astype(jnp.int32)
        n_ins = jnp.sum(holes, axis=1).astype(jnp.int32)
        changed = (n_del + n_ins) > 0
        return EditState(x=jnp.where(live[:, None], x3, st.x), length=jnp.where(live, len2, st.length),
                         done=st.done | ~changed, iterations=st.iterations + (live & changed).astype(jnp.int32),
                         forwards=st.forwards + 3 * live.astype(jnp.int32), deleted=st.deleted + n_del,
                         inserted=st.inserted + n_ins, it=st.it + 1)

    return jax.lax.while_loop(lambda st: ~jnp.all(st.done) & (st.it < max_iterations), body, st)


def refine(params, ep, x_BS, context_B, length_B, *, cfg: ModelConfig, ecfg: EditConfig, mask_id: int, pad: int,
           max_iterations: int, confidence: float = 0.5, mesh=None):
    """`refine_loop` as one compiled call (`pdecode.refine`): returns the final state."""
    params = decode_layout(params, cfg, fuse=mesh is None)
    return refine_loop(params, ep, x_BS, context_B, length_B, cfg=cfg, ecfg=ecfg, mask_id=mask_id, pad=pad,
                       max_iterations=max_iterations, confidence=confidence)


def generate(params, prompt_BP, prompt_len_B, key, warp, *, cfg: ModelConfig, ecfg: EditConfig, mask_id: int,
             eos_id: int, pad: int, context: int, max_new: int, max_len: int, eos_ids: tuple[int, ...], samp,
             max_iterations: int, confidence: float = 0.5, mesh=None):
    """``method="edit"``: each prompt is a draft to refine (its first ``context`` tokens kept as they are); the
    buffer leaves ``max_new`` positions of room for insertions. Returns (Outputs: the refined text after the
    context, its closing EOS not included, stats)."""
    del key, warp, samp, eos_ids
    mparams, ep = params
    mparams = decode_layout(mparams, cfg, fuse=mesh is None)
    b, p = prompt_BP.shape
    s = max_len
    x = jnp.full((b, s), pad, jnp.int32).at[:, :p].set(prompt_BP)
    x = jnp.where(jnp.arange(s)[None, :] < prompt_len_B[:, None], x, pad)
    x = x.at[jnp.arange(b), prompt_len_B].set(eos_id, mode="drop")  # the closing EOS
    ctx = jnp.minimum(jnp.full((b,), context, jnp.int32), prompt_len_B)
    st = refine_loop(mparams, ep, x, ctx, prompt_len_B + 1, cfg=cfg, ecfg=ecfg, mask_id=mask_id, pad=pad,
                     max_iterations=max_iterations, confidence=confidence)
    n = st.length - 1 - ctx
    idx = jnp.minimum(ctx[:, None] + jnp.arange(s)[None, :], s - 1)
    toks = jnp.take_along_axis(st.x, idx, axis=1)
    out = common.Outputs(tokens=toks, count=n.astype(jnp.int32), done=jnp.ones((b,), bool), row_forwards=st.forwards)
    return out, {"target_forwards": jnp.max(st.forwards), "iterations": st.iterations, "deleted": st.deleted,
                 "inserted": st.inserted}
