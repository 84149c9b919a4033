"""`cache_dtype`: every KV cache (target, draft, EAGLE / MTP heads, diffusion prefix / dual) in the dtype asked for,
defaulting to the activations' dtype; lossless methods stay identical to AR under the same cache dtype."""

import pytest

import pdecode
from pdecode import api

PROMPTS = ["def f(x):", "import os\n", "class A:\n    def g(self):"]


@pytest.fixture(scope="module")
def target():
    return pdecode.load("code-target", dtype="float32")


def _last_hlo() -> str:
    exe = next(reversed(api._COMPILED.values()))
    return exe.as_text()


@pytest.fixture(scope="module")
def ar_bf16(target):
    out = pdecode.generate(target, PROMPTS, max_new_tokens=20, stop_at_eos=False, cache_dtype="bfloat16")
    return out.tokens, _last_hlo()


def test_bf16_cache_is_bf16_and_close_to_fp32(target, ar_bf16):
    tokens, hlo = ar_bf16
    assert "bf16[" in hlo  # fp32 params: the only bf16 buffers are the caches
    ref = pdecode.generate(target, PROMPTS, max_new_tokens=20, stop_at_eos=False)
    assert "bf16[" not in _last_hlo()  # the default follows the fp32 activations
    agree = sum(a == b for x, y in zip(tokens, ref.tokens) for a, b in zip(x, y))
    assert agree >= 0.9 * 60, agree  # measured 60/60 on these prompts


@pytest.mark.parametrize("method,model,opts", [
    ("sd", "code-target", {"gamma": 3}),
    ("lookup", "code-target", {}),
    ("eagle", "code-target-eagle", {"tree_top_k": 3, "depth": 3, "total_tokens": 8}),
    ("mtp", "code-target-mtp-posthoc", {}),
])
def test_lossless_methods_equal_ar_under_a_bf16_cache(ar_bf16, method, model, opts):
    m = pdecode.load(model, dtype="float32")
    draft = pdecode.load("code-draft", dtype="float32") if method == "sd" else None
    out = pdecode.generate(m, PROMPTS, method=method, draft=draft, max_new_tokens=20, stop_at_eos=False,
                           cache_dtype="bfloat16", **opts)
    assert out.tokens == ar_bf16[0]
    assert "bf16[" in _last_hlo()  # the drafter's own caches too (the draft model's, the heads')


def test_diffusion_dual_cache_in_bf16():
    m = pdecode.load("code-dllm", dtype="float32")
    kw = dict(method="diffusion", max_new_tokens=32, block_length=8, rule="threshold", threshold=0.9, cache="dual")
    ref = pdecode.generate(m, PROMPTS[:2], **kw)
    out = pdecode.generate(m, PROMPTS[:2], cache_dtype="bfloat16", **kw)
    assert "bf16[" in _last_hlo()
    agree = sum(a == b for x, y in zip(out.tokens, ref.tokens) for a, b in zip(x, y))
    assert agree >= 0.75 * sum(map(len, ref.tokens)), agree


def test_fp8_cache_runs_and_bad_dtype_is_refused(target):
    out = pdecode.generate(target, PROMPTS[:1], max_new_tokens=8, cache_dtype="float8_e4m3fn")
    assert len(out.tokens[0]) >= 1 and "f8e4m3fn[" in _last_hlo()
    with pytest.raises(pdecode.InputError, match="cache_dtype must be one of"):
        pdecode.generate(target, PROMPTS[:1], max_new_tokens=4, cache_dtype="int8")


def test_cache_dtype_on_a_method_without_a_cache_is_refused():
    m = pdecode.load("code-dllm", dtype="float32")
    with pytest.raises(pdecode.InputError, match="method 'dico' keeps no KV cache"):
        pdecode.generate(m, PROMPTS[:1], method="dico", max_new_tokens=32, cache_dtype="bfloat16")
