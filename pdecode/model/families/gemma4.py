"""The Gemma 4 family (text): ``gemma4_text`` checkpoints and the text model of ``gemma4`` ones.

What differs from Gemma 3: layers of two shapes. The full-attention layers have a head size and kv-head count of
their own (``global_head_dim``, ``num_global_key_value_heads``), may use their keys as values (``attention_k_eq_v``)
and rotate only a fraction of each head ("proportional" rope, frequencies over the whole head size); the sliding
layers rotate with a rope of their own base. Values are RMS-normalised (no weight), scores are not scaled (q and k
are normalised). The last ``num_kv_shared_layers`` layers compute no keys or values: each attends with those of the
last earlier layer of its kind (`ModelConfig.kv_source`), and their MLP may be twice as wide
(``use_double_wide_mlp``). Per-layer embeddings (PLE): a second token embedding, ``hidden_size_per_layer_input`` per
layer, mixed with a projection of the token embeddings and fed to each layer through a gated residual branch. A
layer may add a mixture of experts beside its dense MLP (``enable_moe_block``: its own norms, a router over the
normalised residual with a learned scale and per-expert scales), and ends scaled by ``layer_scalar``. RMSNorm
multiplies by the plain weight.

Its layers differ in shape, but in runs that repeat (e.g. five sliding and one full layer, ten times; the kv-shared
tail): the params are `groups.LayerGroups`, each run stacked and scanned, and the KV cache is grouped alike (one
stacked buffer per position of a group, of that position's shape; none for kv-shared layers, which read their
source's). A shallow network's decode layout unrolls it into per-layer dicts (`transformer.DecodeLayers`) with one
cache buffer per layer.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from pdecode.config import Arch
from pdecode.errors import ConfigError
from pdecode.model.family import LayerwiseFamily, register
from pdecode.model.groups import LayerRef, layer_index, static_layer
from pdecode.model.layers.experts import Experts
from pdecode.model.families.llama import check_act, sliding_from_hf


@dataclasses.dataclass(frozen=True)
class Gemma4Arch(Arch):
    """Gemma 4's section: the full-attention layers' head size and kv heads (None: the core's ``head_dim`` /
    ``num_kv_heads``), their keys used as values too (``k_eq_v``) and the fraction of their head that rotates
    (``rope_fraction``; the rest passes through); the last ``kv_shared_layers`` layers compute no keys or values and
    attend with those of the last earlier layer of their kind; per-layer input embeddings of ``per_layer_input_size``
    per layer (0: none) over ``per_layer_vocab`` tokens; ``double_wide_mlp``: kv-shared layers' MLPs are twice
    intermediate_size; ``experts``: the mixture of experts beside each layer's dense MLP (enable_moe_block)."""

    global_head_dim: int | None = None
    global_kv_heads: int | None = None
    k_eq_v: bool = False
    rope_fraction: float = 1.0
    kv_shared_layers: int = 0
    per_layer_input_size: int = 0
    per_layer_vocab: int = 0
    double_wide_mlp: bool = False
    experts: Experts | None = None

    def problems(self, cfg):
        out = []
        gkv = self.global_kv_heads or cfg.num_kv_heads
        if gkv > 0 and cfg.num_heads % gkv:
            out.append(f"num_heads ({cfg.num_heads}) must be a multiple of global_kv_heads ({gkv})")
        if (self.global_head_dim or 2) % 2 or not 0 < self.rope_fraction <= 1:
            out.append(f"global_head_dim must be even and rope_fraction in (0, 1] (got {self.global_head_dim}, "
                       f"{self.rope_fraction})")
        if not 0 <= self.kv_shared_layers < cfg.num_layers:
            out.append(f"kv_shared_layers must be in 0..{cfg.num_layers - 1} (got {self.kv_shared_layers})")
        elif self.kv_shared_layers:
            kinds = cfg.layer_kinds()
            if set(kinds) - set(kinds[: cfg.num_layers - self.kv_shared_layers]):
                out.append("every attention kind of the kv-shared layers needs an earlier layer of that kind")
        if self.experts is not None:
            out += self.experts.problems(cfg.num_layers)
            # Gemma 4 runs its experts in every layer, softmax-routed and renormalised, beside the dense MLP
            plain = Experts(self.experts.num_experts, self.experts.experts_per_tok, self.experts.moe_intermediate_size)
            odd = [f.name for f in dataclasses.fields(Experts)
                   if getattr(self.experts, f.name) != getattr(plain, f.name)]
            if odd:
                out.append(f"Gemma 4's experts take only num_experts, experts_per_tok and moe_intermediate_size (got "
                           f"{', '.join(f'{k}={getattr(self.experts, k)!r}' for k in odd)})")
        return out

    def layer_attention(self, cfg, i):
        if cfg.layer_kinds()[i] == "full":
            return self.global_kv_heads or cfg.num_kv_heads, self.global_head_dim or cfg.head_dim
        return cfg.num_kv_heads, cfg.head_dim

    def full_head_dim(self, cfg):
        return self.global_head_dim or cfg.head_dim

    def kv_source(self, cfg, i):
        """Itself, or for a kv-shared layer the last layer of its kind before the shared ones."""
        first = cfg.num_layers - self.kv_shared_layers
        if i < first:
            return i
        kinds = cfg.layer_kinds()
        return max(j for j in range(first) if kinds[j] == kinds[i])

    def repeat_kv_heads(self, r):
        return dataclasses.replace(self, global_kv_heads=self.global_kv_heads and self.global_kv_heads * r)

    def for_drafter(self):
        return dataclasses.replace(self, kv_shared_layers=0, per_layer_input_size=0, per_layer_vocab=0,
                                   double_wide_mlp=False,
                                   experts=self.experts and self.experts.for_drafter())


def gemma4_norm(x: jax.Array, w: jax.Array | None, eps: float) -> jax.Array:
    """RMSNorm times the plain weight (None: no weight), in float32 and cast back after the scale."""
    xf = x.astype(jnp.float32)
    xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    if w is not None:
        xf = xf * w.astype(jnp.float32)
    return xf.astype(x.dtype)


def _per_layer(hf: dict, key: str, full: list[int]):
    """A value the full-attention layers override through ``per_layer_config`` (transformers >= 5.2 writes it so),
    the same for every full layer, or None."""
    plc = hf.get("per_layer_config") or {}
    vals = {(plc.get(str(i)) or plc.get(i) or {}).get(key) for i in full}
    others = [k for k in plc if int(k) not in full]
    if others:
        raise ConfigError(f"gemma4: per_layer_config overrides sliding layers {others[:4]}; pdecode supports "
                          "overrides of the full-attention layers only")
    if len(vals) > 1:
        raise ConfigError(f"gemma4: per_layer_config gives full-attention layers different {key}: {sorted(vals)}")
    return vals.pop() if vals else None


class Gemma4(LayerwiseFamily):
    arch_type = Gemma4Arch
    model_types = ("gemma4_text", "gemma4")
    architectures = {"gemma4_text": "Gemma4ForCausalLM"}
    own_rope = True  # rope_parameters per layer kind, read by config_from_hf

    def unwrap(self, model_type, hf):
        """A ``gemma4`` (multimodal) config.json: its text model's config, tensors under "model.language_model."."""
        if model_type != "gemma4":
            return hf
        if "text_config" not in hf:
            raise ConfigError("gemma4: config.json has no text_config")
        return {**hf["text_config"], "model_type": "gemma4"}

    # -------------------------------------------------------------------------------- config
    def config_from_hf(self, model_type, hf, kw):
        act = hf.get("hidden_activation") or hf.get("hidden_act") or "gelu_pytorch_tanh"
        check_act(model_type, {"hidden_activation": act}, ("gelu_pytorch_tanh", "gelu_tanh"), "hidden_activation")
        if hf.get("attention_bias"):
            raise ConfigError(f"{model_type}: attention_bias true is not supported")
        if hf.get("use_bidirectional_attention") == "all":
            raise ConfigError(f"{model_type}: use_bidirectional_attention 'all' is not supported by the causal "
                              "family (DiffusionGemma is its own model_type)")
        n = kw["num_layers"]
        if "layer_types" not in hf:
            hf = {**hf, "layer_types": ["sliding_attention" if (i + 1) % 6 else "full_attention" for i in range(n)]}
        types = list(hf["layer_types"])
        types[-1] = "full_attention"  # as the reference forces
        hf = {**hf, "layer_types": types}
        sliding_from_hf(model_type, {**hf, "sliding_window": hf.get("sliding_window", 512)}, kw)
        full = [i for i, t in enumerate(types) if t == "full_attention"]
        ghd = hf.get("global_head_dim") or _per_layer(hf, "head_dim", full)
        gkv = hf.get("num_global_key_value_heads") or _per_layer(hf, "num_key_value_heads", full)
        k_eq_v = bool(hf.get("attention_k_eq_v", False))
        if not k_eq_v and hf.get("per_layer_config") is None:
            gkv = None  # the reference applies num_global_key_value_heads only with attention_k_eq_v
        rp = hf.get("rope_parameters") or {}
        slide = dict(rp.get("sliding_attention") or {"rope_type": "default", "rope_theta": 10000.0})
        glob = dict(rp.get("full_attention") or {"rope_type": "proportional", "partial_rotary_factor": 0.25,
                                                 "rope_theta": 1e6})
        if slide.get("rope_type", "default") != "default":
            raise ConfigError(f"{model_type}: rope_parameters.sliding_attention.rope_type {slide['rope_type']!r} is "
                              "not supported (default only)")
        gtype = glob.get("rope_type", "default")
        if gtype not in ("default", "proportional"):
            raise ConfigError(f"{model_type}: rope_parameters.full_attention.rope_type {gtype!r} is not supported "
                              "(default, proportional)")
        factor = float(glob.get("factor", 1.0)) if gtype == "proportional" else 1.0
        experts = None
        if hf.get("enable_moe_block", False):
            e, k, f = hf.get("num_experts"), hf.get("top_k_experts"), hf.get("moe_intermediate_size")
            if not (e and k and f):
                raise ConfigError(f"{model_type}: enable_moe_block needs num_experts, top_k_experts and "
                                  "moe_intermediate_size")
            experts = Experts(num_experts=int(e), experts_per_tok=int(k), moe_intermediate_size=int(f))
        shared = int(hf.get("num_kv_shared_layers") or 0)
        kw.update(hidden_act="gelu_tanh", tie_word_embeddings=bool(hf.get("tie_word_embeddings", True)),
                  qk_norm=True, attn_scale=1.0, final_softcap=hf.get("final_logit_softcapping") or None,
                  rope_theta=float(glob.get("rope_theta", 1e6)), local_rope_theta=float(slide.get("rope_theta", 1e4)),
                  rope_scaling=(("factor", factor), ("rope_type", "linear")) if factor != 1.0 else None,
                  arch=Gemma4Arch(
                      rope_fraction=float(glob.get("partial_rotary_factor", 1.0)) if gtype == "proportional" else 1.0,
                      global_head_dim=int(ghd) if ghd else None, global_kv_heads=int(gkv) if gkv else None,
                      k_eq_v=k_eq_v, kv_shared_layers=shared,
                      per_layer_input_size=int(hf.get("hidden_size_per_layer_input") or 0),
                      per_layer_vocab=int(hf.get("vocab_size_per_layer_input") or kw["vocab_size"])
                      if hf.get("hidden_size_per_layer_input") else 0,
                      double_wide_mlp=bool(hf.get("use_double_wide_mlp", False)) and bool(shared),
                      experts=experts))
        if shared >= n:
            raise ConfigError(f"{model_type}: num_kv_shared_layers {shared} of {n} layers (every "
                              "layer shared: an assistant model) is not a model of its own")

    def config_to_hf(self, cfg, out):
        if cfg.family == "gemma4":  # the text model of a multimodal checkpoint: written back inside one
            text = dict(out)
            self.config_to_hf(cfg.replace(family="gemma4_text"), text)
            for k in list(out):
                del out[k]
            out.update(model_type="gemma4", architectures=["Gemma4ForConditionalGeneration"], text_config=text)
            return
        out["architectures"] = ["Gemma4ForCausalLM"]
        out["model_type"] = "gemma4_text"
        out.pop("hidden_act", None)
        out.pop("rope_theta", None)
        out.pop("rope_scaling", None)
        full = {"rope_type": "proportional" if cfg.arch.rope_fraction != 1.0 or cfg.rope_scaling else "default",
                "rope_theta": cfg.rope_theta}
        if full["rope_type"] == "proportional":
            full["partial_rotary_factor"] = cfg.arch.rope_fraction
            if cfg.rope_scaling:
                full["factor"] = float(cfg.rope_scaling_dict["factor"])
        kinds, ex = cfg.layer_kinds(), cfg.arch.experts
        out.update(hidden_activation="gelu_pytorch_tanh", attention_bias=False, final_logit_softcapping=cfg.final_softcap,
                   sliding_window=cfg.sliding_window or 512,
                   layer_types=[f"{k}_attention" for k in kinds],
                   rope_parameters={"full_attention": full, "sliding_attention": {
                       "rope_type": "default", "rope_theta": cfg.local_rope_theta or cfg.rope_theta}},
                   attention_k_eq_v=cfg.arch.k_eq_v, num_kv_shared_layers=cfg.arch.kv_shared_layers,
                   hidden_size_per_layer_input=cfg.arch.per_layer_input_size,
                   vocab_size_per_layer_input=cfg.arch.per_layer_vocab or cfg.vocab_size,
                   use_double_wide_mlp=cfg.arch.double_wide_mlp, enable_moe_block=ex is not None)
        over = {}
        if cfg.arch.global_head_dim:
            over["head_dim"] = cfg.arch.global_head_dim
        if cfg.arch.global_kv_heads:
            over["num_key_value_heads"] = cfg.arch.global_kv_heads
        out["per_layer_config"] = {str(i): dict(over) for i, k in enumerate(kinds) if k == "full" and over}
        if ex is not None:
            out.update(num_experts=ex.num_experts, top_k_experts=ex.experts_per_tok,
                       moe_intermediate_size=ex.moe_intermediate_size)

    # -------------------------------------------------------------------------------- params
    def layer_spec(self, cfg, i: int, own_kv: bool | None = None) -> dict:
        """Layer ``i``'s weights (no stacked axis); ``own_kv=False``: no key / value weights (a Gemma 4 assistant's
        layers, which attend with their target's)."""
        from pdecode.model.transformer import ParamSpec

        D, H, F = cfg.hidden_size, cfg.num_heads, cfg.intermediate_size
        kv, hd = cfg.layer_attention(i)
        own_kv = cfg.kv_source(i) == i if own_kv is None else own_kv
        if cfg.arch.double_wide_mlp and not own_kv:
            F *= 2
        vec = lambda n, init="ones": ParamSpec((n,), (None,), init)  # noqa: E731
        s = {"attn_norm": vec(D), "wq": ParamSpec((D, H, hd), ("embed", "heads", None)), "q_norm": vec(hd),
             "wo": ParamSpec((H, hd, D), ("heads", None, "embed")),
             "post_attn_norm": vec(D), "mlp_norm": vec(D), "post_mlp_norm": vec(D),
             "w_gate": ParamSpec((D, F), ("embed", "mlp")), "w_up": ParamSpec((D, F), ("embed", "mlp")),
             "w_down": ParamSpec((F, D), ("mlp", "embed")), "layer_scalar": vec(1)}
        if own_kv:
            s.update(wk=ParamSpec((D, kv, hd), ("embed", "kv_heads", None)), k_norm=vec(hd))
            if not self.keys_are_values(cfg, i):
                s["wv"] = ParamSpec((D, kv, hd), ("embed", "kv_heads", None))
        if cfg.arch.per_layer_input_size:
            P = cfg.arch.per_layer_input_size
            s.update(ple_gate=ParamSpec((D, P), ("embed", None)), ple_proj=ParamSpec((P, D), (None, "embed")),
                     ple_norm=vec(D))
        if cfg.arch.experts is not None:
            E, Fm = cfg.arch.experts.num_experts, cfg.arch.experts.moe_intermediate_size
            s.update(router=ParamSpec((D, E), ("embed", None)), router_scale=vec(D), expert_scale=vec(E),
                     we_gate=ParamSpec((E, D, Fm), ("experts", "embed", "expert_mlp")),
                     we_up=ParamSpec((E, D, Fm), ("experts", "embed", "expert_mlp")),
                     we_down=ParamSpec((E, Fm, D), ("experts", "expert_mlp", "embed")),
                     post_mlp_norm_1=vec(D), pre_moe_norm=vec(D), post_moe_norm=vec(D))
        return s

    @staticmethod
    def keys_are_values(cfg, i: int) -> bool:
        return cfg.arch.k_eq_v and cfg.layer_kinds()[i] == "full"

    def extra_specs(self, cfg):
        from pdecode.model.transformer import ParamSpec

        if not cfg.arch.per_layer_input_size:
            return {}
        LP = cfg.num_layers * cfg.arch.per_layer_input_size
        return {"ple_embed": ParamSpec((cfg.arch.per_layer_vocab, LP), ("vocab", None)),
                "ple_model_proj": ParamSpec((cfg.hidden_size, LP), ("embed", None)),
                "ple_proj_norm": ParamSpec((cfg.arch.per_layer_input_size,), (None,), "ones")}

    # -------------------------------------------------------------------------------- forward
    def embed_scale(self, cfg):
        return cfg.hidden_size ** 0.5

    def norm(self, cfg, x, w):
        return gemma4_norm(x, w, cfg.rms_norm_eps)

    def layer_inputs(self, cfg, params, tokens_BT, x_BTD):
        """Per-layer inputs [B, T, L, P]: the per-layer embedding of each token (x sqrt(P)) plus the normalised
        projection of its embedding (x 1/sqrt(D)), times 1/sqrt(2)."""
        from pdecode.model.transformer import linear

        if not cfg.arch.per_layer_input_size:
            return None
        b, t = tokens_BT.shape
        L, P = cfg.num_layers, cfg.arch.per_layer_input_size
        w = params["ple_embed"]
        tok = jnp.take(w, jnp.clip(tokens_BT, 0, w.shape[0] - 1), axis=0) * jnp.asarray(P ** 0.5, w.dtype)
        proj = linear(x_BTD, params["ple_model_proj"]) * jnp.asarray(cfg.hidden_size ** -0.5, x_BTD.dtype)
        proj = gemma4_norm(proj.reshape(b, t, L, P), params["ple_proj_norm"], cfg.rms_norm_eps)
        return ((proj + tok.reshape(b, t, L, P).astype(proj.dtype)) * jnp.asarray(2 ** -0.5, proj.dtype))

    def attention(self, cfg, lp, h, att, cache, i, write_at):
        """Layer ``i``'s attention on the normed input: q (normed, rotated); its own k and v (k normed and rotated,
        v normed without weight; v = the k projection with k_eq_v), written to its cache, or its source layer's;
        unscaled scores."""
        from pdecode.model import cache as kvc
        from pdecode.model.attention import attend
        from pdecode.model.transformer import apply_rope, linear

        rep = static_layer(i)  # inside a scanned group, a layer of the same structure; i itself is traced
        eps = cfg.rms_norm_eps
        rope, mask = att.for_layer(i)
        q = apply_rope(gemma4_norm(linear(h, lp["wq"], "btd,dhk->bthk"), lp["q_norm"], eps), rope)
        src = cfg.kv_source(rep)  # a kv-shared layer's source is the same for every repeat of its group
        given = att.extra.get("given", {}) if att.extra is not None else {}
        if rep in given and not isinstance(i, LayerRef):  # keys and values handed in (an assistant's: its target's)
            k, v = given[i]
        elif src == rep:
            k = linear(h, lp["wk"], "btd,dhk->bthk")
            v = k if self.keys_are_values(cfg, rep) else linear(h, lp["wv"], "btd,dhk->bthk")
            k = apply_rope(gemma4_norm(k, lp["k_norm"], eps), rope)
            v = gemma4_norm(v, None, eps)
            k, v = jnp.swapaxes(k, 1, 2), jnp.swapaxes(v, 1, 2)  # [B, KV, T, hd]
            if cache is not None:
                cache = kvc.write_layer(cache, i, k, v, write_at)
                k, v = cache.layer(i)  # [B, KV, hd, S], [B, KV, S, hd]
            else:
                k = jnp.swapaxes(k, 2, 3)
        elif cache is not None:  # its source wrote this forward's keys first (a pass without a cache gets one of its
            k, v = cache.layer(src)  # own tokens: `transformer.pass_cache`)
        else:
            raise ValueError(f"gemma4: layer {rep} attends with layer {src}'s keys and values from a KV cache")
        a = attend(q, k, v, mask, impl=cfg.run.attention_impl, scale=1.0)
        return linear(a, lp["wo"], "bthk,hkd->btd"), cache

    def moe(self, cfg, lp, res_BTD):
        """The experts beside the dense MLP: routed from the residual (RMS-normalised, x scale / sqrt(D)), softmax
        over all, top k renormalised, times each chosen expert's scale; the experts read the residual normed by
        pre_moe_norm."""
        from pdecode.model.layers.experts import run_experts
        from pdecode.model.transformer import linear

        b, t, d = res_BTD.shape
        x = res_BTD.reshape(b * t, d)
        r = gemma4_norm(x, None, cfg.rms_norm_eps) * lp["router_scale"].astype(x.dtype) * jnp.asarray(d ** -0.5,
                                                                                                     x.dtype)
        probs = jax.nn.softmax(linear(r, lp["router"]).astype(jnp.float32), axis=-1)
        top, idx = jax.lax.top_k(probs, cfg.arch.experts.experts_per_tok)
        top = top / jnp.sum(top, axis=-1, keepdims=True)
        w = (top * lp["expert_scale"].astype(jnp.float32)[idx]).astype(x.dtype)
        h = gemma4_norm(x, lp["pre_moe_norm"], cfg.rms_norm_eps)
        return run_experts(cfg, lp, h, w, idx).reshape(b, t, d)

    def block(self, cfg, lp, x, att, cache, layer_idx, write_at, fused):
        from pdecode.model.transformer import glu_mlp

        norm = lambda y, w: gemma4_norm(y, w, cfg.rms_norm_eps)  # noqa: E731
        a, cache = self.attention(cfg, lp, norm(x, lp["attn_norm"]), att, cache, layer_idx, write_at)
        x = x + norm(a, lp["post_attn_norm"])
        m = glu_mlp(cfg, lp, norm(x, lp["mlp_norm"]), fused)
        if cfg.arch.experts is not None:
            m = norm(m, lp["post_mlp_norm_1"]) + norm(self.moe(cfg, lp, x), lp["post_moe_norm"])
        x = x + norm(m, lp["post_mlp_norm"])
        if cfg.arch.per_layer_input_size:
            inputs = att.extra["inputs"] if att.extra is not None else None
            if inputs is None:
                raise ValueError("gemma4: this model's layers need their per-layer inputs (a forward from tokens)")
            from pdecode.model.transformer import activation, linear

            g = activation(cfg, linear(x, lp["ple_gate"])) * inputs[:, :, layer_index(layer_idx)].astype(x.dtype)
            x = x + norm(linear(g, lp["ple_proj"]), lp["ple_norm"])
        return x * lp["layer_scalar"].astype(x.dtype), cache

    # -------------------------------------------------------------------------------- checkpoints
    def layer_names(self, cfg, i: int, own_kv: bool | None = None) -> list[tuple]:
        """Layer ``i``'s tensors: (HF name under the layer prefix, our name, layout)."""
        own_kv = cfg.kv_source(i) == i if own_kv is None else own_kv
        a = "self_attn."
        names = [("input_layernorm.weight", "attn_norm", "plain"), (a + "q_proj.weight", "wq", "heads_in"),
                 (a + "q_norm.weight", "q_norm", "plain"), (a + "o_proj.weight", "wo", "heads_out"),
                 ("post_attention_layernorm.weight", "post_attn_norm", "plain"),
                 ("pre_feedforward_layernorm.weight", "mlp_norm", "plain"),
                 ("post_feedforward_layernorm.weight", "post_mlp_norm", "plain"),
                 ("mlp.gate_proj.weight", "w_gate", "linear"), ("mlp.up_proj.weight", "w_up", "linear"),
                 ("mlp.down_proj.weight", "w_down", "linear"), ("layer_scalar", "layer_scalar", "plain")]
        if own_kv:
            names += [(a + "k_proj.weight", "wk", "heads_in"), (a + "k_norm.weight", "k_norm", "plain")]
        if own_kv and not self.keys_are_values(cfg, i):
            names.append((a + "v_proj.weight", "wv", "heads_in"))
        if cfg.arch.per_layer_input_size:
            names += [("per_layer_input_gate.weight", "ple_gate", "linear"),
                      ("per_layer_projection.weight", "ple_proj", "linear"),
                      ("post_per_layer_input_norm.weight", "ple_norm", "plain")]
        if cfg.arch.experts is not None:
            names += [("router.proj.weight", "router", "linear"), ("router.scale", "router_scale", "plain"),
                      ("router.per_expert_scale", "expert_scale", "plain"),
                      ("experts.gate_up_proj", "we_gate", "first_rows_t"),
                      ("experts.gate_up_proj", "we_up", "second_rows_t"),
                      ("experts.down_proj", "we_down", "linear_stack"),
                      ("post_feedforward_layernorm_1.weight", "post_mlp_norm_1", "plain"),
                      ("pre_feedforward_layernorm_2.weight", "pre_moe_norm", "plain"),
                      ("post_feedforward_layernorm_2.weight", "post_moe_norm", "plain")]
        return names

    def block_names(self, cfg):
        return self.layer_names(cfg, 0)

    def hf_rules(self, cfg, prefix: str | None = None):
        from pdecode.model.rules import Rule

        p = prefix or ("model.language_model." if cfg.family == "gemma4" else "model.")
        rules = super().hf_rules(cfg, p)
        if cfg.arch.per_layer_input_size:
            rules += [Rule(p + "embed_tokens_per_layer.weight", "ple_embed", "plain"),
                      Rule(p + "per_layer_model_projection.weight", "ple_model_proj", "linear"),
                      Rule(p + "per_layer_projection_norm.weight", "ple_proj_norm", "plain")]
        return rules


GEMMA4 = register(Gemma4())
