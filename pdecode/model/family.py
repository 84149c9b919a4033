"""Model families: the seam between pdecode's decoding methods and the networks they run.

A family is one module (`pdecode/model/families/<name>.py`) with one `Family` object that owns everything
architecture-specific about its networks:

* its HF config fields, both ways (`config_from_hf` fills the `ModelConfig` fields it reads, `config_to_hf`
  writes them back, naming the field and value of anything it does not support);
* its params (`layer_specs`: one block's weights with logical axes, stacked on ``layers``; `extra_specs`: weights
  outside the blocks);
* its forward pieces: `embed_scale`, `norm` (the final norm and any norm inside its block) and `block` (one
  decoder block over the residual stream: attention through `pdecode.model.transformer.self_attention`, which
  applies the layer's own attention kind, window and rope, and the family's MLP);
* its HF tensor names, both ways (`hf_rules`, `pdecode.checkpoint.hf.Rule`).

Everything else (the KV cache, masks, the decode loops, drafters, training) is shared and never reads a family's
fields: a method that runs on one family runs on all. Families register under every HF ``model_type`` they read
(`register`); `family_for_model_type` finds one, `family_of(cfg)` the one of a loaded config. docs/extending.md,
"Adding a model family", walks through one.
"""

from __future__ import annotations

import importlib
from typing import Any

from pdecode.errors import ConfigError

FAMILIES: dict[str, "Family"] = {}  # HF model_type -> family
_LOADED = False
# the modules that register the built-in families (imported on the first lookup)
BUILTIN = ("pdecode.model.families.llama", "pdecode.model.families.gemma", "pdecode.model.families.moe",
           "pdecode.model.families.phi3", "pdecode.model.families.gemma4", "pdecode.model.families.deepseek",
           "pdecode.model.families.diffusion_gemma")


class Family:
    """The protocol every family implements; the defaults are the Llama block's (pre-norm, RMSNorm, SiLU-GLU)."""

    model_types: tuple[str, ...] = ()  # HF model_type values this family reads (and writes back as they were)
    architectures: dict[str, str] = {}  # model_type -> the HF architectures[0] written by `config_to_hf`

    own_rope: bool = False  # config_from_hf reads the rope fields itself (else `config.rope_from_hf` does)

    def unwrap(self, model_type: str, hf: dict[str, Any]) -> dict[str, Any]:
        """The config.json fields of the network pdecode runs (a multimodal config: its text model's)."""
        return hf

    def name_for(self, model_type: str) -> str:
        """The ``ModelConfig.family`` a config.json of this model_type gets (the model_type itself)."""
        return model_type

    # -------------------------------------------------------------------------------- config
    def config_from_hf(self, model_type: str, hf: dict[str, Any], kw: dict[str, Any]) -> None:
        """Fill ``kw`` (the ModelConfig fields, common ones already read) with this family's; raise ConfigError
        naming the family, field and value for anything not implemented."""

    def config_to_hf(self, cfg, out: dict[str, Any]) -> None:
        """Complete ``out`` (common fields written) into a config.json transformers loads for this family."""
        out["architectures"] = [self.architectures[cfg.family]]

    # -------------------------------------------------------------------------------- params
    def layer_specs(self, cfg, num_layers: int) -> dict:
        raise NotImplementedError

    def extra_specs(self, cfg) -> dict:
        """Weights outside the blocks beyond embed / final_norm / lm_head (none by default)."""
        return {}

    # -------------------------------------------------------------------------------- forward
    def embed_scale(self, cfg) -> float | None:
        """A factor the token embeddings are multiplied by (Gemma: sqrt(hidden_size)); None: none."""
        return None

    def layer_inputs(self, cfg, params, tokens_BT, x_BTD):
        """Inputs the blocks read besides the residual stream, computed once per forward from the tokens and their
        embeddings ``x`` (Gemma 4's per-layer embeddings); blocks find them in ``att.extra["inputs"]``. None: none."""
        return None

    def norm(self, cfg, x, w):
        from pdecode.model.transformer import rms_norm

        return rms_norm(x, w, cfg.rms_norm_eps)

    def block(self, cfg, lp: dict, x, att, cache, layer_idx, write_at, fused: bool):
        """One decoder block: (x, cache). ``att`` is the forward's `transformer.Attention` (ropes and masks of
        every layer kind); ``layer_idx`` a static int or, under `lax.scan`, a traced one."""
        raise NotImplementedError

    # -------------------------------------------------------------------------------- checkpoints
    def block_names(self, cfg) -> list[tuple]:
        """One block's tensors: (HF name under the layer prefix, our name, layout[, rows]) per weight."""
        raise NotImplementedError

    def hf_rules(self, cfg, prefix: str = "model.") -> list:
        """The whole checkpoint's rules: embedding, `block_names` under "model.layers.{i}.", final norm, lm_head."""
        from pdecode.checkpoint.hf import named_rules

        return named_rules(cfg, self.block_names(cfg), prefix)

    def tensor_aliases(self, names) -> dict[str, str]:
        """Tensors a checkpoint may store under another name (tied weights): a name the rules use -> the name found
        among ``names`` (the checkpoint's); none by default."""
        return {}

    def head_block_rules(self, cfg, prefix: str) -> list:
        """The rules of one block under ``prefix`` (e.g. "model.layers.{i}."): drafter heads saved with it."""
        from pdecode.checkpoint.hf import Rule

        return [Rule(prefix + hf, "layers/" + ours, *rest) for hf, ours, *rest in self.block_names(cfg)]


class LayerwiseFamily(Family):
    """A family whose blocks differ in shape (Gemma 4, DeepSeek-V3): its params are a tuple of per-layer dicts
    (`transformer.DecodeLayers`) and its tensor names are given per layer (`layer_names`)."""

    def layer_names(self, cfg, i: int) -> list[tuple]:
        """Layer ``i``'s tensors: (HF name under the layer prefix, our name, layout)."""
        raise NotImplementedError

    def block_names(self, cfg):
        return self.layer_names(cfg, cfg.num_layers - 1)

    def hf_rules(self, cfg, prefix: str = "model."):
        from pdecode.checkpoint.hf import Rule

        rules = [Rule(prefix + "embed_tokens.weight", "embed", "plain")]
        for i in range(cfg.num_layers):
            rules += [Rule(f"{prefix}layers.{i}.{hf}", f"layers/{i}/{ours}", lay)
                      for hf, ours, lay in self.layer_names(cfg, i)]
        rules.append(Rule(prefix + "norm.weight", "final_norm", "plain"))
        if not cfg.tie_word_embeddings:
            rules.append(Rule("lm_head.weight", "lm_head", "linear"))
        return rules

    def head_block_rules(self, cfg, prefix):
        from pdecode.checkpoint.hf import Rule

        return [Rule(prefix.replace("{i}", "0") + hf, "layers/0/" + ours, lay)
                for hf, ours, lay in self.layer_names(cfg.with_layers(1), 0)]


def register(family: Family) -> Family:
    for t in family.model_types:
        if t in FAMILIES and FAMILIES[t] is not family:
            raise ValueError(f"model_type {t!r} is registered twice ({FAMILIES[t]!r}, {family!r})")
        FAMILIES[t] = family
    return family


def _load_builtin() -> None:
    global _LOADED
    if not _LOADED:
        _LOADED = True
        for mod in BUILTIN:
            importlib.import_module(mod)


def family_for_model_type(model_type: str | None) -> Family:
    """The family registered for an HF ``model_type``, or a ConfigError listing the supported ones."""
    _load_builtin()
    if model_type not in FAMILIES:
        raise ConfigError(f"unsupported model_type {model_type!r} in config.json; pdecode loads "
                          f"{', '.join(sorted(FAMILIES))} (and llada, dream)")
    return FAMILIES[model_type]


def family_of(cfg) -> Family:
    return family_for_model_type(cfg.family)


def supported() -> list[str]:
    _load_builtin()
    return sorted(FAMILIES)
