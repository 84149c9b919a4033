"""Gemma 4 assistants (``gemma4_assistant`` checkpoints): the small drafter Google ships beside a Gemma 4 model.

An assistant has no keys or values of its own. Each of its layers attends with the target's: the keys and values of
the target's last layer of the same kind (full / sliding) before any kv-shared layers, straight from the target's
KV cache, over the tokens the target has committed (bidirectionally: the queries sit after them all; a sliding layer
sees the last ``sliding_window + 1`` of them, as the reference's flipped bidirectional window does). A draft step reads the last seen token's embedding (the target's, scaled)
beside a hidden state of the target's width — the target's final hidden state for the first draft, then the
assistant's own output projected back (``post_projection``) — projects the pair down (``pre_projection``), runs its
Gemma 4 blocks at one fixed position (the last seen token's) and predicts the next token through its LM head: the
whole vocabulary, or (``use_ordered_embeddings``) only the tokens of the ``centroid_intermediate_top_k`` clusters its
centroids pick, the rest one below the smallest selected logit.

transformers' ``Gemma4AssistantForCausalLM`` is the reference (tests/test_assistant.py).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from pdecode.config import ModelConfig
from pdecode.errors import CheckpointError


@dataclasses.dataclass(frozen=True)
class AssistantConfig:
    cfg: ModelConfig  # the assistant's own blocks (a gemma4_text config; its layers hold no key / value weights)
    backbone_hidden_size: int  # the target's hidden size
    num_centroids: int = 0  # > 0: the LM head scores only the tokens of the top centroids (use_ordered_embeddings)
    centroid_top_k: int = 0

    def specs(self, target_cfg: ModelConfig | None = None) -> dict:
        from pdecode.model.families.gemma4 import GEMMA4
        from pdecode.model.transformer import DecodeLayers, ParamSpec

        c = self.cfg
        d, db = c.hidden_size, self.backbone_hidden_size
        s = {"pre_proj": ParamSpec((2 * db, d), (None, "embed")), "post_proj": ParamSpec((d, db), ("embed", None)),
             "layers": DecodeLayers([GEMMA4.layer_spec(c, i, own_kv=False) for i in range(c.num_layers)], False),
             "final_norm": ParamSpec((d,), (None,), "ones"), "head": ParamSpec((c.vocab_size, d), ("vocab", "embed"))}
        if self.num_centroids:
            s["centroids"] = ParamSpec((d, self.num_centroids), ("embed", None))
            s["token_ordering"] = ParamSpec((c.vocab_size,), (None,), "zeros")  # int32 token ids
        return s


def store_layers(tcfg: ModelConfig) -> dict[str, int]:
    """kind -> the target layer whose keys and values an assistant layer of that kind reads: the last layer of the
    kind before the kv-shared ones (transformers' "store" layers)."""
    first = tcfg.num_layers - tcfg.arch.kv_shared_layers
    kinds = tcfg.layer_kinds()
    return {k: max(j for j in range(first) if kinds[j] == k) for k in set(kinds[:first])}


def check_pair(acfg: AssistantConfig, tcfg: ModelConfig, source: str = "assistant") -> None:
    """One CheckpointError naming what does not fit, or None: widths, vocabulary and each kind's attention shape."""
    problems = []
    if tcfg.family not in ("gemma4_text", "gemma4"):
        problems.append(f"its target must be a Gemma 4 model (got family {tcfg.family!r})")
    if acfg.backbone_hidden_size != tcfg.hidden_size:
        problems.append(f"backbone_hidden_size {acfg.backbone_hidden_size} != the target's hidden_size "
                        f"{tcfg.hidden_size}")
    if acfg.cfg.vocab_size != tcfg.vocab_size:
        problems.append(f"vocab_size {acfg.cfg.vocab_size} != the target's {tcfg.vocab_size}")
    if not problems:
        store = store_layers(tcfg)
        kinds = acfg.cfg.layer_kinds()
        for i, k in enumerate(kinds):
            if k not in store:
                problems.append(f"layer {i} is {k} attention, which the target has no layer of")
                break
            if acfg.cfg.layer_attention(i) != tcfg.layer_attention(store[k]):
                problems.append(f"layer {i} ({k}) has (kv heads, head_dim) {acfg.cfg.layer_attention(i)}, the "
                                f"target's {k} layers {tcfg.layer_attention(store[k])}")
                break
    if problems:
        raise CheckpointError(f"{source} does not fit this target: " + "; ".join(problems))


def config_from_hf(hf: dict) -> AssistantConfig:
    text = dict(hf.get("text_config") or {})
    if not text:
        raise CheckpointError("gemma4_assistant config.json has no text_config")
    for key in ("hidden_size_per_layer_input", "vocab_size_per_layer_input"):
        if text.get(key):
            raise CheckpointError(f"gemma4_assistant: text_config.{key} {text[key]} is not supported (0 expected)")
    if text.get("enable_moe_block"):
        raise CheckpointError("gemma4_assistant: text_config.enable_moe_block true is not supported")
    # its layers attend with the target's keys and values: as a network of its own, no layer shares another's
    from pdecode.model.family import config_from_hf as text_config

    cfg = text_config({**text, "model_type": "gemma4_text", "num_kv_shared_layers": 0,
                       "hidden_size_per_layer_input": 0, "use_double_wide_mlp": False})
    ordered = bool(hf.get("use_ordered_embeddings", False))
    return AssistantConfig(cfg=cfg, backbone_hidden_size=int(hf.get("backbone_hidden_size", cfg.hidden_size)),
                           num_centroids=int(hf.get("num_centroids", 2048)) if ordered else 0,
                           centroid_top_k=int(hf.get("centroid_intermediate_top_k", 32)) if ordered else 0)


def rules(acfg: AssistantConfig, tensors) -> list:
    from pdecode.model.families.gemma4 import GEMMA4
    from pdecode.model.rules import Rule

    c = acfg.cfg
    out = [Rule("pre_projection.weight", "pre_proj", "linear"), Rule("post_projection.weight", "post_proj", "linear"),
           Rule("model.norm.weight", "final_norm", "plain"),
           Rule("lm_head.weight" if "lm_head.weight" in tensors else "model.embed_tokens.weight", "head", "plain")]
    for i in range(c.num_layers):
        out += [Rule(f"model.layers.{i}.{hf}", f"layers/{i}/{ours}", lay)
                for hf, ours, lay in GEMMA4.layer_names(c, i, own_kv=False)]
    if acfg.num_centroids:
        out.append(Rule("masked_embedding.centroids.weight", "centroids", "linear"))
    return out


# ------------------------------------------------------------------------------------------------ forward
def head_logits(ap, acfg: AssistantConfig, h_BD: jax.Array) -> jax.Array:
    """float32 logits [B, V] of the assistant's LM head (centroid-masked when the assistant has centroids)."""
    from pdecode.model.transformer import linear

    w = ap["head"]
    if not acfg.num_centroids:
        return jnp.einsum("bd,vd->bv", h_BD.astype(w.dtype), w, preferred_element_type=jnp.float32)
    b = h_BD.shape[0]
    c, k = acfg.num_centroids, acfg.centroid_top_k
    v = w.shape[0]
    _, top = jax.lax.top_k(linear(h_BD, ap["centroids"]), k)  # [B, k]
    canon = ap["token_ordering"].reshape(c, v // c)[top].reshape(b, -1)  # [B, k * V/C] token ids
    sel = jnp.einsum("bd,bnd->bn", h_BD.astype(w.dtype), w[canon], preferred_element_type=jnp.float32)
    out = jnp.full((b, v), jnp.min(sel) - 1.0, jnp.float32)  # (the reference's fill: the batch's least, minus 1)
    return out.at[jnp.arange(b)[:, None], canon].set(sel)


def step(ap, acfg: AssistantConfig, tcfg: ModelConfig, tparams, tok_B: jax.Array, h_BD: jax.Array, pos_B: jax.Array,
         tcache, n_B: jax.Array) -> tuple[jax.Array, jax.Array]:
    """One draft step: the last seen token ``tok`` at position ``pos`` with a target-width hidden state ``h``,
    attending to the target cache's first ``n`` slots. Returns (float32 logits [B, V], the next hidden state
    [B, backbone]). ``tok`` [B, T], ``h`` [B, T, D], ``pos`` [B, T]: T independent steps per row in one pass (the
    frontier of a tree: the drafted tokens write no keys, so the steps do not see one another)."""
    from pdecode.model.families.gemma4 import GEMMA4
    from pdecode.model.transformer import Attention, embed, final_norm, linear, rope_tables

    many = tok_B.ndim == 2
    tok, h, pos = (tok_B, h_BD, pos_B) if many else (tok_B[:, None], h_BD[:, None], pos_B[:, None])
    c = acfg.cfg
    e = embed(tparams, tok, tcfg)  # [B, T, Dt], the target's scaled embedding
    x = linear(jnp.concatenate([e, h.astype(e.dtype)], axis=-1), ap["pre_proj"])  # [B, T, D]
    s = jnp.arange(tcache.max_len)
    seen = s[None, :] < n_B[:, None]
    full = seen[:, None, :]  # [B, 1, S]: every query of a row sees the same keys
    # a sliding layer: the last sliding_window + 1 committed tokens (the reference's bidirectional window, flipped)
    win = (seen & (s[None, :] >= n_B[:, None] - c.sliding_window - 1))[:, None, :] if c.sliding_window else full
    kinds = c.layer_kinds()
    store = store_layers(tcfg)
    given = {i: tcache.layer(store[k]) for i, k in enumerate(kinds)}
    att = Attention(rope_tables(c, pos), full, rope_tables(c, pos, local=True), win,
                    tuple(k == "sliding" for k in kinds), {"inputs": None, "given": given})
    for i, lp in enumerate(ap["layers"]):
        x, _ = GEMMA4.block(c, lp, x, att, None, i, None, False)
    h = final_norm({"final_norm": ap["final_norm"]}, c, x)
    b, t, d = h.shape
    lg = head_logits(ap, acfg, h.reshape(b * t, d)).reshape(b, t, -1)
    h = linear(h, ap["post_proj"])
    return (lg, h) if many else (lg[:, 0], h[:, 0])
