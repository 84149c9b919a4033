"""Mixtures of experts: routing (softmax top-k, DeepSeek's grouped sigmoid routing) and the routed experts' MLPs,
run three ways by the number of token-expert pairs (gathered weights, grouped matmuls, dense over every expert).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from pdecode.model.family import family_of
from pdecode.model.layers.linear import linear
from pdecode.model.layers.mlp import activation, glu_mlp


@dataclasses.dataclass(frozen=True)
class Experts:
    """The mixture of experts of a family's arch section (`pdecode.config.Arch.experts`): every sparse layer's MLP is
    ``num_experts`` experts of ``moe_intermediate_size``, ``experts_per_tok`` per token.

    Routing: softmax over all experts, the top k, renormalised to sum 1 when ``norm_topk_prob``; or DeepSeek's
    (``router_score="sigmoid"``): sigmoid scores, the top k by score + a learned bias among the best
    ``groups_per_tok`` of ``expert_groups`` groups, weights the chosen scores x ``routed_scale``. A shared expert of
    ``shared_expert_size`` runs beside the routed ones (gated in Qwen2-MoE, plain in DeepSeek). gpt-oss's experts clamp
    their SwiGLU at ``swiglu_limit``. The first ``dense_layers`` layers and those in ``dense_layer_ids`` (Qwen-MoE's
    mlp_only_layers) have a dense MLP of intermediate_size instead."""

    num_experts: int
    experts_per_tok: int
    moe_intermediate_size: int
    shared_expert_size: int = 0
    norm_topk_prob: bool = True
    swiglu_limit: float | None = None
    router_score: str = "softmax"
    expert_groups: int = 1
    groups_per_tok: int = 1
    routed_scale: float = 1.0
    dense_layers: int = 0
    dense_layer_ids: tuple[int, ...] = ()

    def problems(self, num_layers: int) -> list[str]:
        out = []
        if not (0 < self.experts_per_tok <= self.num_experts and self.moe_intermediate_size > 0):
            out.append(f"a mixture of experts needs 0 < experts_per_tok <= num_experts and moe_intermediate_size > 0 "
                       f"(got {self.experts_per_tok}, {self.num_experts}, {self.moe_intermediate_size})")
        if self.router_score not in ("softmax", "sigmoid"):
            out.append(f"router_score must be 'softmax' or 'sigmoid' (got {self.router_score!r})")
        if self.num_experts % max(self.expert_groups, 1) or not 0 < self.groups_per_tok <= self.expert_groups:
            out.append(f"expert_groups ({self.expert_groups}) must divide num_experts ({self.num_experts}) and "
                       f"0 < groups_per_tok ({self.groups_per_tok}) <= expert_groups")
        if not 0 <= self.dense_layers <= num_layers:
            out.append(f"dense_layers must be in 0..{num_layers} (got {self.dense_layers})")
        if list(self.dense_layer_ids) != sorted(set(self.dense_layer_ids)) or \
                any(not 0 <= i < num_layers for i in self.dense_layer_ids):
            out.append(f"dense_layer_ids must be increasing layer indices in 0..{num_layers - 1} "
                       f"(got {self.dense_layer_ids})")
        return out

    def sparse(self, i: int) -> bool:
        """Whether layer ``i``'s MLP is this mixture (else a dense MLP of intermediate_size)."""
        return i >= self.dense_layers and i not in self.dense_layer_ids

    def for_drafter(self) -> "Experts":
        """A drafter's experts: every block sparse (DeepSeek-V3's MTP layer is)."""
        return dataclasses.replace(self, dense_layers=0, dense_layer_ids=())


def route(cfg, router_DE: jax.Array, x_ND: jax.Array, bias_E: jax.Array | None = None):
    """(weights [N, k] in x's dtype, expert ids [N, k]) as the references route: softmax over all E then the top k
    (renormalised when ``norm_topk_prob``); with a router bias (gpt-oss), the top k logits then a softmax over
    them."""
    ex = cfg.arch.experts
    logits = linear(x_ND, router_DE)
    if bias_E is not None:
        top, idx = jax.lax.top_k(logits + bias_E, ex.experts_per_tok)
        return jax.nn.softmax(top.astype(jnp.float32), axis=-1).astype(x_ND.dtype), idx
    probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
    top, idx = jax.lax.top_k(probs, ex.experts_per_tok)
    if ex.norm_topk_prob:
        top = top / jnp.sum(top, axis=-1, keepdims=True)
    return top.astype(x_ND.dtype), idx


def _glu(cfg, g, u):
    """The experts' gated unit: act(gate) * up, or gpt-oss's clamped SwiGLU (``swiglu_limit``)."""
    lim = cfg.arch.experts.swiglu_limit
    if lim is None:
        return activation(cfg, g) * u
    g = jnp.minimum(g, lim)
    u = jnp.clip(u, -lim, lim)
    return (u + 1) * (g * jax.nn.sigmoid(g * SWIGLU_ALPHA))


SWIGLU_ALPHA = 1.702  # gpt-oss's sigmoid sharpness (config swiglu_alpha; others refused at load)


def _bias(cfg, lp, name, idx=None):
    """An expert bias (gathered for expert ids ``idx``), or 0 when the family's experts have none."""
    if not family_of(cfg).expert_biases:
        return 0.0
    return lp[name] if idx is None else lp[name][idx]


def experts_gathered(cfg, lp, x_ND, w_Nk, idx_Nk):
    """Each (token, expert) pair with its expert's weights gathered: N * k expert MLPs, nothing else."""
    dt = lp["we_gate"].dtype
    xc = x_ND.astype(dt)
    pet = x_ND.dtype
    g = jnp.einsum("nd,nkdf->nkf", xc, lp["we_gate"][idx_Nk], preferred_element_type=pet) + \
        _bias(cfg, lp, "we_gate_b", idx_Nk)
    u = jnp.einsum("nd,nkdf->nkf", xc, lp["we_up"][idx_Nk], preferred_element_type=pet) + _bias(cfg, lp, "we_up_b", idx_Nk)
    y = jnp.einsum("nkf,nkfd->nkd", _glu(cfg, g, u).astype(dt), lp["we_down"][idx_Nk], preferred_element_type=pet)
    return jnp.einsum("nk,nkd->nd", w_Nk, y + _bias(cfg, lp, "we_down_b", idx_Nk))


def experts_grouped(cfg, lp, x_ND, w_Nk, idx_Nk):
    """The (token, expert) pairs sorted by expert, each expert's group through grouped matmuls (ragged_dot)."""
    n, k = idx_Nk.shape
    e = lp["we_gate"].shape[0]
    dt, pet = lp["we_gate"].dtype, x_ND.dtype
    flat = idx_Nk.reshape(-1)
    order = jnp.argsort(flat, stable=True)
    tok = order // k
    sizes = jnp.bincount(flat, length=e).astype(jnp.int32)
    xs = x_ND[tok].astype(dt)
    e_sorted = flat[order]
    g = jax.lax.ragged_dot(xs, lp["we_gate"], sizes, preferred_element_type=pet) + _bias(cfg, lp, "we_gate_b", e_sorted)
    u = jax.lax.ragged_dot(xs, lp["we_up"], sizes, preferred_element_type=pet) + _bias(cfg, lp, "we_up_b", e_sorted)
    y = jax.lax.ragged_dot(_glu(cfg, g, u).astype(dt), lp["we_down"], sizes, preferred_element_type=pet)
    y = (y + _bias(cfg, lp, "we_down_b", e_sorted)) * w_Nk.reshape(-1)[order][:, None]
    return jnp.zeros_like(x_ND).at[tok].add(y)


DENSE_CHUNK = 256  # tokens per piece of `experts_dense` (bounds its [tokens, E, F] temporaries)


def experts_dense(cfg, lp, x_ND, w_Nk, idx_Nk):
    """Every expert on every token, weighted by the routing (zero off the top k): E/k of the selected work, but one
    dense product; what CPU runs for long passes (its XLA lowers ragged_dot to a dense product over all N*k pairs
    and every expert, twice this for k=2). Long passes run in pieces of DENSE_CHUNK tokens."""
    n, e = x_ND.shape[0], lp["we_gate"].shape[0]
    dt, pet = lp["we_gate"].dtype, x_ND.dtype
    w_NE = jnp.zeros((n, e), w_Nk.dtype).at[jnp.arange(n)[:, None], idx_Nk].add(w_Nk)

    def piece(xw):
        x, w = xw
        xc = x.astype(dt)
        g = jnp.einsum("nd,edf->nef", xc, lp["we_gate"], preferred_element_type=pet) + _bias(cfg, lp, "we_gate_b")
        u = jnp.einsum("nd,edf->nef", xc, lp["we_up"], preferred_element_type=pet) + _bias(cfg, lp, "we_up_b")
        y = jnp.einsum("nef,efd->ned", _glu(cfg, g, u).astype(dt), lp["we_down"], preferred_element_type=pet)
        return jnp.einsum("ne,ned->nd", w, y + _bias(cfg, lp, "we_down_b"))

    if n <= DENSE_CHUNK:
        return piece((x_ND, w_NE))
    pad = -n % DENSE_CHUNK
    xs = jnp.pad(x_ND, ((0, pad), (0, 0))).reshape(-1, DENSE_CHUNK, x_ND.shape[1])
    ws = jnp.pad(w_NE, ((0, pad), (0, 0))).reshape(-1, DENSE_CHUNK, e)
    return jax.lax.map(piece, (xs, ws)).reshape(-1, x_ND.shape[1])[:n]


def run_experts(cfg, lp, x_ND, w_Nk, idx_Nk):
    """The routed experts' output for N tokens: gathered weights when N * k <= E (decode steps, short verifies),
    else grouped matmuls (dense over every expert on CPU). Experts split over devices (``cfg.run.experts_sharded``)
    always run dense: each device runs its own experts on every token, and the weighted sum over experts is the one
    cross-device reduction (a gather of chosen experts' weights would copy them between devices every step)."""
    if cfg.run.experts_sharded:
        return experts_dense(cfg, lp, x_ND, w_Nk, idx_Nk)
    ex = cfg.arch.experts
    if x_ND.shape[0] * ex.experts_per_tok <= ex.num_experts:
        run = experts_gathered
    else:
        run = experts_dense if jax.default_backend() == "cpu" else experts_grouped
    return run(cfg, lp, x_ND, w_Nk, idx_Nk)


def moe_mlp(cfg, lp, h_BTD: jax.Array, fused: bool) -> jax.Array:
    b, t, d = h_BTD.shape
    x = h_BTD.reshape(b * t, d)
    w, idx = route(cfg, lp["router"], x, lp["router_b"] if family_of(cfg).expert_biases else None)
    out = run_experts(cfg, lp, x, w, idx).reshape(b, t, d)
    if cfg.arch.experts.shared_expert_size:
        gate = jax.nn.sigmoid(linear(h_BTD, lp["shared_gate"]))
        out = out + gate * glu_mlp(cfg, lp, h_BTD, fused)
    return out


def route_grouped(cfg, lp, x_ND: jax.Array):
    """(weights [N, k] in x's dtype, expert ids [N, k]) by DeepSeek-V3's rule: sigmoid scores in float32, the top k
    of score + correction bias within the best ``groups_per_tok`` groups, weighted by their scores (renormalised
    when ``norm_topk_prob``) x ``routed_scale``."""
    n, ex = x_ND.shape[0], cfg.arch.experts
    e, g = ex.num_experts, ex.expert_groups
    logits = jnp.matmul(x_ND.astype(jnp.float32), lp["router"].astype(jnp.float32))
    scores = jax.nn.sigmoid(logits)
    choice = scores + lp["router_corr"].astype(jnp.float32)
    if g > 1:
        per = choice.reshape(n, g, e // g)
        group_score = jnp.sum(jax.lax.top_k(per, min(2, e // g))[0], axis=-1)  # [N, G]
        _, best = jax.lax.top_k(group_score, ex.groups_per_tok)
        keep = jnp.zeros((n, g), bool).at[jnp.arange(n)[:, None], best].set(True)
        choice = jnp.where(jnp.repeat(keep, e // g, axis=1), choice, -jnp.inf)
    _, idx = jax.lax.top_k(choice, ex.experts_per_tok)
    w = jnp.take_along_axis(scores, idx, axis=1)
    if ex.norm_topk_prob:
        w = w / (jnp.sum(w, axis=-1, keepdims=True) + 1e-20)
    return (w * ex.routed_scale).astype(x_ND.dtype), idx
