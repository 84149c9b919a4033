"""The production decode layout of shallow models, on its own. `pdecode` decodes a model of <= 16 layers (every model
in the zoo) with its layers unrolled, q/k/v and gate/up fused into single matmuls and one cache buffer per layer; the
rest of this suite runs every model's layers under `lax.scan` (PDECODE_UNROLL_MAX_LAYERS=0, tests/conftest.py),
which compiles in about half the time. Here the unrolled layout is on: every family's fused blocks decode what
transformers decodes (AR, and on three families a draft-model chain, over the per-layer caches), and every lossless
decoding loop on the zoo's 6-layer models, and the serving engine, give AR's tokens."""

import jax
import pytest

import pdecode
from pdecode.engine import Engine
from tests.helpers import NEW_FAMILIES, make_hf_model, unrolled_layout

pytestmark = pytest.mark.xdist_group("unrolled")  # one worker, one switch of the layout
PROMPTS = [[5, 9, 13, 7, 21], list(range(3, 20)), [40, 41, 42, 7, 9, 11, 13, 15, 17, 19, 21]]
NEW = 16


@pytest.fixture(scope="module", autouse=True)
def _layout():
    with unrolled_layout():
        yield


def test_the_switch_gives_the_production_layout():
    import os
    import subprocess
    import sys

    bad = subprocess.run([sys.executable, "-c", "import pdecode"], capture_output=True, text=True,
                         env={**os.environ, "PDECODE_UNROLL_MAX_LAYERS": "all"})
    assert bad.returncode != 0 and "PDECODE_UNROLL_MAX_LAYERS must be an integer >= 0" in bad.stderr
    from pdecode.model.transformer import decode_layout

    m = pdecode.load("code-target")
    dp = jax.eval_shape(lambda p: decode_layout(p, m.cfg), m.params)  # traced, nothing run
    assert dp.layout.unrolled and dp.layout.fused


# (the draft-model chain on the families whose caches differ most: latent (MLA), sliding + global, sinks; the dense
# Llama block is the zoo's, below)
CHAIN = ("gemma3", "gpt_oss", "deepseek_v3")


@pytest.mark.parametrize("fam", NEW_FAMILIES)
def test_family_decodes_like_transformers(fam, tmp_path):
    import torch

    from tests.test_families import _draft_of, _ref_greedy

    ref_model = make_hf_model(fam, tmp_path, seed=3, num_hidden_layers=2)
    m = pdecode.load(tmp_path)
    with torch.no_grad():
        want = [_ref_greedy(ref_model, p, NEW) for p in PROMPTS]
    assert pdecode.generate(m, PROMPTS, max_new_tokens=NEW, stop_at_eos=False).tokens == want, fam
    if fam not in CHAIN:
        return
    out = pdecode.generate(m, PROMPTS, method="sd", draft=_draft_of(m), gamma=3, max_new_tokens=NEW, stop_at_eos=False)
    assert out.tokens == want, fam


CODE = ["def add(a, b):\n", "import os\n\n\nclass Config:\n    def __init__(self", "x = [1, 2, 3]\nfor i in x:"]
# (target, method, options): every lossless loop on the zoo's 6-layer models (one case per loop: a static tree verifies
# through the tree loop below (tests/test_speculative.py runs one), and EAGLE-1's heads through the EAGLE loop with
# EAGLE-3's (tests/test_zoo.py runs both))
CASES = [("code-target", "sd", {"draft": "code-draft", "gamma": 3}),
         ("code-target", "tree", {"draft": "code-draft", "tree_top_k": 2, "depth": 3, "total_tokens": 6}),
         ("code-target", "lookup", {"gamma": 3}),
         ("code-target", "jacobi", {"block": 4}),
         ("code-target", "lookahead", {"window": 3, "ngram": 3, "guesses": 2}),
         ("code-target", "pearl", {"draft": "code-draft", "gamma": 2}),
         ("code-target", "diffusion_draft", {"draft": "code-dllm", "gamma": 4}),
         ("code-target-medusa", "medusa", {}),
         ("code-target-eagle3", "eagle", {"tree_top_k": 2, "depth": 3, "total_tokens": 6}),
         ("code-target-mtp", "mtp", {}),
         ("code-target-layerskip", "layerskip", {"exit_layer": 3, "gamma": 3})]
_REF = {}


def _ar(name):
    if name not in _REF:
        _REF[name] = pdecode.generate(pdecode.load(name), CODE, max_new_tokens=24).tokens
    return _REF[name]


@pytest.mark.parametrize("name,method,opts", CASES, ids=[f"{c[1]}-{i}" for i, c in enumerate(CASES)])
def test_lossless_methods_equal_ar(name, method, opts):
    opts = {k: pdecode.load(v) if k == "draft" else v for k, v in opts.items()}
    out = pdecode.generate(pdecode.load(name), CODE, method=method, max_new_tokens=24, **opts)
    assert out.tokens == _ar(name), (name, method)
    assert out.stats["tokens_per_forward"] > 1.0 or method == "jacobi"


def test_engine_equals_generate():
    t, d = pdecode.load("code-target"), pdecode.load("code-draft")
    eng = Engine(t, method="sd", draft=d, gamma=3, slots=2, max_len=128, chunk=32, steps_per_call=2)
    eng.warmup()
    ids = [t.tokenizer.encode(p) for p in CODE]
    reqs = [eng.submit(p, eng.check(p, max_tokens=20, temperature=0.0)) for p in ids]
    while not eng.idle:
        eng.run_once()
    ref = pdecode.generate(t, ids, max_new_tokens=20)
    assert [r.tokens for r in reqs] == ref.tokens
