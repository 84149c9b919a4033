"""HF tensor naming rules: how a checkpoint's tensor names map onto a params tree (a leaf module).

A `Rule` names one HF tensor (with "{i}" for the layer index and "{e}" for the expert index) and the param it fills,
with the layout to convert through (`pdecode.checkpoint.hf` does the reading and writing). Each family builds its
rules from these helpers (`Family.hf_rules`); this module imports nothing of pdecode's model, checkpoint or sharding
layers, so families can name their tensors without importing the checkpoint code that reads them.
"""

from __future__ import annotations

from typing import NamedTuple


class Rule(NamedTuple):
    hf: str  # HF tensor name, "{i}" for the layer index, "{e}" for the expert index
    ours: str  # "/"-joined path in our params
    layout: str  # plain | linear | heads_in | heads_out | bias_heads
    rows: tuple[int, int] | None = None  # a fused HF tensor (Phi-3's qkv_proj): this param is its rows [a, b)
    # the layers a stacked "{i}" axis holds: entry j is layer first + j * step (a group of `groups.LayerGroups`);
    # None: entry j is layer j
    at: tuple[int, int] | None = None


# our decoder block's weights, in order, with their layouts; the names each checkpoint family gives them
_BLOCK = (("layers/attn_norm", "plain"), ("layers/wq", "heads_in"), ("layers/wk", "heads_in"),
          ("layers/wv", "heads_in"), ("layers/wo", "heads_out"), ("layers/mlp_norm", "plain"),
          ("layers/w_gate", "linear"), ("layers/w_up", "linear"), ("layers/w_down", "linear"))
HF_BLOCK_NAMES = ("input_layernorm", "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                  "post_attention_layernorm", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
LLADA_BLOCK_NAMES = ("attn_norm", "q_proj", "k_proj", "v_proj", "attn_out", "ff_norm", "ff_proj", "up_proj",
                     "ff_out")


def block_rules(p: str, names: tuple[str, ...] = HF_BLOCK_NAMES) -> list[Rule]:
    """One decoder block under prefix ``p`` (e.g. "model.layers.{i}."), transformers' names by default."""
    return [Rule(f"{p}{n}.weight", ours, layout) for n, (ours, layout) in zip(names, _BLOCK, strict=True)]


def llama_rules(cfg, prefix: str = "model.") -> list[Rule]:
    """Llama / Mistral / Qwen2 / Qwen3 names (the layout transformers uses for all four)."""
    return named_rules(cfg, llama_block_names(cfg), prefix)


def llama_block_names(cfg) -> list[tuple[str, str, str]]:
    """The Llama block's (HF name under the layer prefix, ours, layout): norms, attention (biases and q/k norms as
    the config has them), the gated MLP."""
    return [("input_layernorm.weight", "attn_norm", "plain"), *attention_names(cfg),
            ("post_attention_layernorm.weight", "mlp_norm", "plain"), ("mlp.gate_proj.weight", "w_gate", "linear"),
            ("mlp.up_proj.weight", "w_up", "linear"), ("mlp.down_proj.weight", "w_down", "linear")]


def named_rules(cfg, block: list[tuple], prefix: str = "model.") -> list[Rule]:
    """A family's rules from its block's (HF name under the layer prefix, our name, layout[, rows]) tuples:
    embedding, final norm and lm_head (untied) named as transformers names them."""
    p = prefix + "layers.{i}."
    rules = [Rule(prefix + "embed_tokens.weight", "embed", "plain"),
             *[Rule(p + hf, "layers/" + ours, *rest) for hf, ours, *rest in block],
             Rule(prefix + "norm.weight", "final_norm", "plain")]
    if not cfg.tie_word_embeddings:
        rules.append(Rule("lm_head.weight", "lm_head", "linear"))
    return rules


def attention_names(cfg) -> list[tuple[str, str, str]]:
    """The attention weights' (HF name, ours, layout) under a layer, as Llama-style checkpoints name them."""
    out = [(f"self_attn.{n}_proj.weight", f"w{n}", "heads_in") for n in "qkv"]
    out.append(("self_attn.o_proj.weight", "wo", "heads_out"))
    if cfg.attention_bias:
        out += [(f"self_attn.{n}_proj.bias", f"b{n}", "bias_heads") for n in "qkv"]
    if cfg.qk_norm:
        out += [("self_attn.q_norm.weight", "q_norm", "plain"), ("self_attn.k_norm.weight", "k_norm", "plain")]
    return out


def llada_rules(cfg) -> list[Rule]:
    """LLaDA's checkpoint names (``model.transformer.blocks.N.*``); the network is our Llama block, run
    bidirectionally."""
    rules = [Rule("model.transformer.wte.weight", "embed", "plain"),
             *block_rules("model.transformer.blocks.{i}.", LLADA_BLOCK_NAMES),
             Rule("model.transformer.ln_f.weight", "final_norm", "plain")]
    if not cfg.tie_word_embeddings:
        rules.append(Rule("model.transformer.ff_out.weight", "lm_head", "linear"))
    return rules
