"""What "identical to AR" means at reduced precision, as a check.

At greedy, a lossless method picks exactly the token AR picks *from the logits its own forward computed*. A verify
forward over k tokens adds up the same numbers as AR's one-token forward in another order (other matmul shapes,
other tilings), so in bfloat16 the two sets of logits differ in their last bits. Where AR's top two tokens are
that close, the two runs can take different tokens and then continue from different texts. In float32 they agree
token for token (the tests assert it); at reduced precision the claim is: **identical until the first
floating-point near-tie**, a position where the exact (float32) log-probabilities of the two tokens taken lie within
the rounding of the dtype at that position (`tie_tolerance`) of each other.

`first_divergences` finds, per row, the first position where two generations differ and measures, with a float32
pass of the same weights, how far apart the two tokens taken there are, so a user (``pdecode generate --compare``) and the tests can tell a rounding
tie from a real disagreement (a bug).
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import jax.numpy as jnp
import numpy as np

# The rounding a forward in each activation dtype leaves in a logit, relative to its size: the unit roundoff
# 2^-(significand bits) (bfloat16: 8 bits; float16: 11; float32: 24).
UNIT_ROUNDOFF = {"bfloat16": 2.0 ** -8, "float16": 2.0 ** -11, "float32": 2.0 ** -24}
# nats under which a divergence is always a rounding tie, whatever the logits' size (the tolerance's floor)
TIE_TOLERANCE = {"bfloat16": 0.05, "float16": 0.01, "float32": 1e-4}


@dataclasses.dataclass(frozen=True)
class Divergence:
    """Row ``row`` first differs at new token ``position``; ``margin``: how far apart the float32 log-probs of the
    two tokens taken there are (AR's and the method's; where one row simply ended, AR's top two)."""

    row: int
    position: int
    margin: float
    tolerance: float

    @property
    def tie(self) -> bool:
        return self.margin <= self.tolerance

    def describe(self) -> str:
        what = "a near-tie" if self.tie else "NOT a tie"
        return (f"row {self.row}, new token {self.position}: {what} (the two tokens' float32 log-probs "
                f"{self.margin:.4f} apart, tolerance {self.tolerance:.3g})")


def tie_tolerance(m, logit: float = 0.0) -> float:
    """The nats under which two tokens' float32 log-probs count as a rounding tie for ``m``'s activation dtype (its
    params' dtype unless set apart), where the larger of the two tokens' logits is ``logit`` in size:
    ``max(TIE_TOLERANCE[dtype], u * |logit| * sqrt(num_layers))``, u the dtype's unit roundoff.

    Why: a forward in that dtype rounds the residual stream at every layer (relative u each, of either sign, so the
    error grows as the square root of the depth) and the logits themselves (relative u): a logit of size z carries
    an error of order u * z * sqrt(layers), and so does the gap between two logits of that size. Measured, bfloat16
    against float32, the error of the top-2 gap reached 0.38 (code-target, 6 layers, logits to 13) and 0.65
    (SmolLM2-135M, 30 layers, logits to 48) of u * z * sqrt(layers): 0.42 nats on SmolLM2, where a fixed 0.05 called
    a 0.059-nat divergence a bug. A confident position (a gap of nats) stays far above it (docs/methods.md)."""
    dt = str(jnp.dtype(m.cfg.run.activation_dtype or m.dtype))
    return max(TIE_TOLERANCE[dt], UNIT_ROUNDOFF[dt] * abs(float(logit)) * float(np.sqrt(m.cfg.num_layers)))


def first_divergences(m, prompts, reference: Sequence[Sequence[int]],
                      tokens: Sequence[Sequence[int]]) -> list[Divergence | None]:
    """Per row, None where ``tokens`` equals ``reference`` (AR's greedy new tokens), else the first `Divergence`;
    a row that is a strict prefix of the other (one stopped earlier) diverges where the shorter ends. The margin
    comes from one float32 forward of ``m``'s weights over prompt + ``reference`` up to that position: the gap
    between the log-probs of AR's token and the method's token there (a method that took a token far below AR's is
    no tie, however close AR's own top two are)."""
    from pdecode.api import Model, encode_prompts, forward_logits
    from pdecode.model.transformer import cast_params

    ids = encode_prompts(m, prompts)
    if not (len(ids) == len(reference) == len(tokens)):
        raise ValueError(f"{len(ids)} prompts, {len(reference)} reference rows and {len(tokens)} rows")
    found = []
    for i, (a, b) in enumerate(zip(reference, tokens)):
        a, b = list(a), list(b)
        if a == b:
            continue
        n = min(len(a), len(b))
        found.append((i, next((k for k in range(n) if a[k] != b[k]), n)))
    out: list[Divergence | None] = [None] * len(ids)
    if not found:
        return out
    contexts = [ids[i] + list(reference[i][:p]) for i, p in found]
    width = max(32, -(-max(map(len, contexts)) // 32) * 32)  # one compile per 32-token bucket
    batch = np.zeros((len(contexts), width), np.int32)
    for r, c in enumerate(contexts):
        batch[r, :len(c)] = c  # right padding: a causal pass reads only what lies before each row's last token
    exact = Model(cfg=m.cfg.with_run(activation_dtype="float32"), params=cast_params(m.params, jnp.float32))
    logits = np.asarray(forward_logits(exact, batch), np.float64)
    for r, (i, p) in enumerate(found):
        lg = logits[r, len(contexts[r]) - 1]  # a gap of logits is the gap of their log-probs
        a, b = list(reference[i]), list(tokens[i])
        if p < len(a) and p < len(b):
            pair = lg[[a[p], b[p]]]
        else:  # one row ended here: how close AR came to another token
            pair = np.sort(lg)[-2:]
        gap = abs(float(pair[1] - pair[0]))
        out[i] = Divergence(row=i, position=p, margin=gap, tolerance=tie_tolerance(m, np.abs(pair).max()))
    return out
