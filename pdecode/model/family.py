"""Model families: the seam between pdecode's decoding methods and the networks they run.

A family is one module (`pdecode/model/families/<name>.py`) with one `Family` object that owns everything
architecture-specific about its networks:

* its HF config fields, both ways (`config_from_hf` fills the core `ModelConfig` fields it reads and its own
  architecture section, ``arch``, an instance of its `arch_type`, a `pdecode.config.Arch` subclass its module
  defines; `config_to_hf` writes them back; anything it does not support is refused naming the field and value);
* its params (`layer_specs`: one block's weights with logical axes, stacked on ``layers``; `extra_specs`: weights
  outside the blocks);
* its forward pieces: `embed_scale`, `norm` (the final norm and any norm inside its block) and `block` (one
  decoder block over the residual stream: attention through `pdecode.model.transformer.self_attention`, which
  applies the layer's own attention kind, window and rope, and the family's MLP);
* its HF tensor names, both ways (`hf_rules`, `pdecode.model.rules.Rule`; `pdecode.checkpoint.hf` reads and
  writes them).

Everything else (the KV cache, masks, the decode loops, drafters, training) is shared and never reads a family's
fields: a method that runs on one family runs on all. Families register under every HF ``model_type`` they read
(`register`); `family_for_model_type` finds one, `family_of(cfg)` the one of a loaded config. docs/extending.md,
"Adding a model family", walks through one.
"""

from __future__ import annotations

import importlib
import json
from pathlib import Path
from typing import Any

from pdecode.config import Arch, ModelConfig
from pdecode.errors import ConfigError
from pdecode.model.groups import LayerGroups, plan_groups
from pdecode.model.layers.norms import rms_norm
from pdecode.model.layers.rope import rope_from_hf
from pdecode.model.rules import Rule, named_rules
from pdecode.model.spec import stack as stack_spec

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
    arch_type: type = Arch  # the class of its configs' ``arch`` section (`pdecode.config.Arch`: none of its own)

    own_rope: bool = False  # config_from_hf reads the rope fields itself (else `config.rope_from_hf` does)
    # the shared attention's optional weights beyond the config's (`attention_bias`, `qk_norm`): a bias on the
    # output projection ("bo") and a learned sink logit per head ("sinks"), as gpt-oss has
    output_bias: bool = False
    attention_sinks: bool = False
    expert_biases: bool = False  # biases on the router and the experts' projections (gpt-oss)

    def unwrap(self, model_type: str, hf: dict[str, Any]) -> dict[str, Any]:
        """The config.json fields of the network pdecode runs (a multimodal config: its text model's)."""
        return hf

    def name_for(self, model_type: str) -> str:
        """The ``ModelConfig.family`` a config.json of this model_type gets (the model_type itself)."""
        return model_type

    # -------------------------------------------------------------------------------- config
    def config_from_hf(self, model_type: str, hf: dict[str, Any], kw: dict[str, Any]) -> None:
        """Fill ``kw`` (the ModelConfig fields, common ones already read) with this family's, its ``arch`` section
        included; raise ConfigError naming the family, field and value for anything not implemented."""

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
        return named_rules(cfg, self.block_names(cfg), prefix)

    def tensor_aliases(self, names) -> dict[str, str]:
        """Tensors a checkpoint may store under another name (tied weights): a name the rules use -> the name found
        among ``names`` (the checkpoint's); none by default."""
        return {}

    def head_block_rules(self, cfg, prefix: str) -> list:
        """The rules of one block under ``prefix`` (e.g. "model.layers.{i}."): drafter heads saved with it."""
        return [Rule(prefix + hf, "layers/" + ours, *rest) for hf, ours, *rest in self.block_names(cfg)]


class LayerwiseFamily(Family):
    """A family whose blocks differ in shape (Gemma 4, DeepSeek-V3): each layer's params are its own (`layer_spec`)
    and so are its tensor names (`layer_names`). With ``scan_groups`` the params are `groups.LayerGroups`: runs of
    identical layers (`layer_signature`) stacked and scanned, so compile time stays flat in depth; else a
    `transformer.DecodeLayers` tuple of per-layer dicts, run as a loop over layers."""

    scan_groups: bool = True

    def layer_spec(self, cfg, i: int) -> dict:
        """Layer ``i``'s weights (`ParamSpec`s with no stacked axis)."""
        raise NotImplementedError

    def layer_signature(self, cfg, i: int):
        """What makes two layers interchangeable under one scan: their weights' specs and everything static about
        them that the block reads (attention kind, where their keys and values come from)."""
        spec = self.layer_spec(cfg, i)
        src = cfg.kv_source(i)  # its own keys, or (a kv-shared layer) those of one fixed earlier layer
        return (tuple(sorted((k, s.shape, s.axes, s.init) for k, s in spec.items())), cfg.layer_kinds()[i],
                "own" if src == i else src, cfg.moe_layer(i))

    def layer_plan(self, cfg, num_layers: int | None = None):
        """The `groups.Group`s of a stack of ``num_layers`` blocks (default the config's)."""
        n = cfg.num_layers if num_layers is None else num_layers
        c = cfg if n == cfg.num_layers else cfg.with_layers(n)
        return plan_groups([self.layer_signature(c, i) for i in range(n)])

    def layer_specs(self, cfg, num_layers):
        from pdecode.model.transformer import DecodeLayers

        c = cfg if num_layers == cfg.num_layers else cfg.with_layers(num_layers)
        if not self.scan_groups:
            return DecodeLayers([self.layer_spec(c, i) for i in range(num_layers)], False)
        plan = self.layer_plan(c)
        return LayerGroups([tuple({k: stack_spec(s, g.count) for k, s in self.layer_spec(c, g.first + u).items()}
                                  for u in range(g.period)) for g in plan], plan)

    def layer_names(self, cfg, i: int) -> list[tuple]:
        """Layer ``i``'s tensors: (HF name under the layer prefix, our name, layout)."""
        raise NotImplementedError

    def block_names(self, cfg):
        return self.layer_names(cfg, cfg.num_layers - 1)

    def layer_rules(self, cfg, prefix: str) -> list:
        """The rules of every layer under ``prefix`` (with "{i}" where the layer index goes)."""
        if not self.scan_groups:
            return [Rule(prefix.replace("{i}", str(i)) + hf, f"layers/{i}/{ours}", lay)
                    for i in range(cfg.num_layers) for hf, ours, lay in self.layer_names(cfg, i)]
        return [Rule(prefix + hf, f"layers/{g}/{u}/{ours}", lay, None, (p.first + u, p.period))
                for g, p in enumerate(self.layer_plan(cfg)) for u in range(p.period)
                for hf, ours, lay in self.layer_names(cfg, p.first + u)]

    def hf_rules(self, cfg, prefix: str = "model."):
        rules = [Rule(prefix + "embed_tokens.weight", "embed", "plain"), *self.layer_rules(cfg, prefix + "layers.{i}."),
                 Rule(prefix + "norm.weight", "final_norm", "plain")]
        if not cfg.tie_word_embeddings:
            rules.append(Rule("lm_head.weight", "lm_head", "linear"))
        return rules

    def head_block_rules(self, cfg, prefix):
        return self.layer_rules(cfg.with_layers(1), prefix)


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


def _registered(name, unknown) -> Family:
    """The family registered under ``name``, or a ConfigError whose message ``unknown(known names)`` gives."""
    _load_builtin()
    if name not in FAMILIES:
        raise ConfigError(unknown(", ".join(sorted(FAMILIES))))
    return FAMILIES[name]


def family_for_model_type(model_type: str | None) -> Family:
    """The family registered for an HF ``model_type``, or a ConfigError listing the supported ones."""
    return _registered(model_type, lambda known: f"unsupported model_type {model_type!r} in config.json; pdecode "
                                                 f"loads {known} (and llada, dream)")


def family_of(cfg) -> Family:
    """The family of a config (`ModelConfig.family`), or a ConfigError listing the known ones or naming the
    architecture section the family expects."""
    fam = _registered(cfg.family, lambda known: f"unknown family {cfg.family!r}; expected one of {known}")
    if type(cfg.arch) is not fam.arch_type:
        raise ConfigError(f"family {cfg.family!r} takes an arch section of type {fam.arch_type.__name__} (got "
                          f"{type(cfg.arch).__name__})")
    return fam


def supported() -> list[str]:
    _load_builtin()
    return sorted(FAMILIES)


# ------------------------------------------------------------------------------------------------ config.json
def config_from_hf(hf: dict[str, Any]) -> ModelConfig:
    """Build from a Hugging Face config.json dictionary (LLaDA and Dream configs included)."""
    model_type = hf.get("model_type")
    if model_type == "llada":
        return _from_llada(hf)
    if model_type in ("Dream", "dream"):
        # Dream: a Qwen2 network run bidirectionally, logits shifted by one
        base = config_from_hf({**hf, "model_type": "qwen2"})
        return base.replace(causal=False, diffusion_shift=True)
    fam = family_for_model_type(model_type)
    hf = fam.unwrap(model_type, hf)
    try:
        hidden = int(hf["hidden_size"])
        heads = int(hf["num_attention_heads"])
        cfg_kw: dict[str, Any] = dict(
            vocab_size=int(hf["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(hf.get("intermediate_size") or 0) or int(hf["moe_intermediate_size"]),
            num_layers=int(hf["num_hidden_layers"]),
            num_heads=heads,
        )
    except KeyError as e:
        raise ConfigError(f"{model_type}: config.json lacks the required field {e.args[0]!r}") from None
    cfg_kw["num_kv_heads"] = int(hf.get("num_key_value_heads") or heads)
    cfg_kw["head_dim"] = int(hf.get("head_dim") or hidden // heads)
    eos = hf.get("eos_token_id")
    eos_ids = tuple(eos) if isinstance(eos, (list, tuple)) else ((eos,) if eos is not None else ())
    cfg_kw.update(
        family=fam.name_for(model_type),
        max_position_embeddings=int(hf.get("max_position_embeddings", 2048)),
        rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        bos_token_id=hf.get("bos_token_id"),
        eos_token_ids=tuple(int(e) for e in eos_ids),
        pad_token_id=hf.get("pad_token_id"),
        mask_token_id=hf.get("mask_token_id"),
        causal=bool(hf.get("pdecode_causal", True)),
        diffusion_shift=bool(hf.get("pdecode_diffusion_shift", False)),
        dtype=str(hf.get("torch_dtype") or hf.get("dtype") or "float32"),
    )
    if not fam.own_rope:
        theta, scaling = rope_from_hf(model_type, hf)
        cfg_kw.update(rope_theta=theta, rope_scaling=scaling)
    fam.config_from_hf(model_type, hf, cfg_kw)
    return ModelConfig(**cfg_kw)


def _from_llada(hf: dict[str, Any]) -> ModelConfig:
    try:
        d, heads, layers = int(hf["d_model"]), int(hf["n_heads"]), int(hf["n_layers"])
        ff = int(hf.get("mlp_hidden_size") or int(hf["mlp_ratio"]) * d)
    except KeyError as e:
        raise ConfigError(f"LLaDA config.json lacks the field {e.args[0]!r}") from None
    vocab = int(hf.get("embedding_size") or hf["vocab_size"])
    eos = hf.get("eos_token_id")
    return ModelConfig(vocab_size=vocab, hidden_size=d, intermediate_size=ff, num_layers=layers, num_heads=heads,
                       num_kv_heads=int(hf.get("n_kv_heads") or heads), head_dim=d // heads, family="llama",
                       max_position_embeddings=int(hf.get("max_sequence_length", 4096)),
                       rope_theta=float(hf.get("rope_theta", 10000.0)),
                       rms_norm_eps=float(hf.get("rms_norm_eps", 1e-5)),
                       tie_word_embeddings=bool(hf.get("weight_tying", False)), causal=False,
                       eos_token_ids=(int(eos),) if eos is not None else (), pad_token_id=hf.get("pad_token_id"),
                       mask_token_id=hf.get("mask_token_id", 126336),
                       dtype=str(hf.get("torch_dtype") or "float32"))


def config_to_hf(cfg: ModelConfig) -> dict[str, Any]:
    """A config.json dictionary that `transformers` loads (AutoConfig / AutoModelForCausalLM)."""
    out: dict[str, Any] = {
        "model_type": cfg.family,
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": cfg.max_position_embeddings,
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope_theta,
        "rope_scaling": cfg.rope_scaling_dict,
        "tie_word_embeddings": cfg.tie_word_embeddings,
        "attention_dropout": 0.0,
        "torch_dtype": cfg.dtype,
    }
    family_of(cfg).config_to_hf(cfg, out)
    if cfg.bos_token_id is not None:
        out["bos_token_id"] = cfg.bos_token_id
    if cfg.eos_token_ids:
        out["eos_token_id"] = cfg.eos_token_ids[0] if len(cfg.eos_token_ids) == 1 else list(cfg.eos_token_ids)
    if cfg.pad_token_id is not None:
        out["pad_token_id"] = cfg.pad_token_id
    if cfg.mask_token_id is not None:
        out["mask_token_id"] = cfg.mask_token_id
    if not cfg.causal:  # a masked-diffusion model: transformers would run it causally, pdecode does not
        out["pdecode_causal"] = False
        out["pdecode_diffusion_shift"] = cfg.diffusion_shift
    return out


def load_config(path: str | Path) -> ModelConfig:
    """The config of a model directory (its config.json) or of a config.json file."""
    path = Path(path)
    f = path / "config.json" if path.is_dir() else path
    if not f.exists():
        raise ConfigError(f"no config.json at {f}")
    try:
        data = json.loads(f.read_text())
    except json.JSONDecodeError as e:
        raise ConfigError(f"{f} is not valid JSON: {e}") from None
    return config_from_hf(data)
