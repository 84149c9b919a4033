"""Per-row budgets and the line-start (dedent) stop inside the decode loops (`common.Stops`)."""

import jax.numpy as jnp
import numpy as np
import pytest

import pdecode
from pdecode.decode import common
from pdecode.decompose import cut_body

# a synthetic vocabulary: every way a token can hold, start or end a newline (no empty tokens: those are specials)
VOCAB = ["\n", "x", "  ", "\n\n", "\ndef", "\n  y", "):\n", "=", " z", "a\nb", "\t", "\n ", "q\n\n"]


def test_line_start_table_bits():
    t = common.line_start_table(lambda i: VOCAB[i], len(VOCAB))
    nl_end = {i for i, s in enumerate(VOCAB) if s.endswith("\n")}
    starts = {i for i, s in enumerate(VOCAB) if not s[0].isspace()}
    inner = {i for i, s in enumerate(VOCAB) if any(s[j] == "\n" and not s[j + 1].isspace() for j in range(len(s) - 1))}
    assert {i for i in range(len(VOCAB)) if t[i] & common.NL_END} == nl_end
    assert {i for i in range(len(VOCAB)) if t[i] & common.STARTS_TEXT} == starts
    assert {i for i in range(len(VOCAB)) if t[i] & common.NL_TEXT} == inner == {4, 9}


def _reference_count(seq) -> int:
    """Tokens a row keeps under the text rule: up to the first token whose text completes a newline followed by a
    non-whitespace character (brute force over the joined text)."""
    for j in range(len(seq)):
        text = "".join(VOCAB[t] for t in seq[: j + 1])
        if any(text[i] == "\n" and not text[i + 1].isspace() for i in range(len(text) - 1)):
            return j + 1
    return len(seq)


def test_line_start_rule_matches_the_text_rule_in_any_chunking():
    rng = np.random.default_rng(0)
    table = jnp.asarray(common.line_start_table(lambda i: VOCAB[i], len(VOCAB)))
    n, k = 10, 4
    hits = 0
    for _ in range(120):
        seq = rng.integers(0, len(VOCAB), n)
        out = common.Outputs.empty(1, n, common.Stops(limit=jnp.array([n], jnp.int32), line_start=table))
        i = 0
        while i < n and not bool(out.done[0]):  # steps of 1..k tokens, as the speculative loops append them
            step = int(rng.integers(1, k + 1))
            chunk = np.zeros((k,), np.int32)
            chunk[: min(step, n - i)] = seq[i: i + step]
            out, _ = common.append(out, jnp.asarray(chunk)[None], jnp.array([min(step, n - i)]), ())
            i += step
        got = np.asarray(out.tokens[0, : int(out.count[0])]).tolist()
        want = _reference_count(seq)
        assert got == seq[:want].tolist()
        hits += want < n
        full, kept = "".join(VOCAB[t] for t in seq), "".join(VOCAB[t] for t in got)
        assert cut_body(kept) == cut_body(full)
    assert 10 < hits < 120  # both outcomes were exercised


@pytest.fixture(scope="module")
def models():
    return pdecode.load("code-target", dtype="float32"), pdecode.load("code-draft", dtype="float32")


PROMPTS = ['def add(a, b):\n    """Return a + b."""\n', "import os\n\n\ndef list_dir(path):\n",
           'def mean(xs):\n    """Return the mean of a list of numbers."""\n    if not xs:\n']


@pytest.mark.parametrize("method", ["ar", "sd"])
def test_per_row_budgets(models, method):
    m, d = models
    kw = {"draft": d, "gamma": 3} if method == "sd" else {}
    budgets = [4, 13, 7]
    ref = pdecode.generate(m, PROMPTS, method=method, max_new_tokens=13, stop_at_eos=False, **kw)
    out = pdecode.generate(m, PROMPTS, method=method, max_new_tokens=budgets, stop_at_eos=False, **kw)
    assert [len(t) for t in out.tokens] == budgets
    assert all(r[:n] == t for r, t, n in zip(ref.tokens, out.tokens, budgets))
    assert out.stats["new_tokens"] == sum(budgets)


@pytest.mark.parametrize("method", ["ar", "sd"])
def test_stop_at_dedent_ends_rows_where_the_body_ends(models, method):
    m, d = models
    kw = {"draft": d, "gamma": 3} if method == "sd" else {}
    full = pdecode.generate(m, PROMPTS, method=method, max_new_tokens=40, **kw)
    cut = pdecode.generate(m, PROMPTS, method=method, max_new_tokens=40, stop_at_dedent=True, **kw)
    for f, c, ft, ct in zip(full.texts, cut.texts, full.tokens, cut.tokens):
        assert ft[: len(ct)] == ct and cut_body(c) == cut_body(f)
    assert sum(map(len, cut.tokens)) < sum(map(len, full.tokens))  # at least one body ended on the device
    assert cut.stats["target_forwards"] < full.stats["target_forwards"]


def test_stop_controls_reject_bad_input(models):
    m, _ = models
    with pytest.raises(pdecode.InputError, match="one per prompt"):
        pdecode.generate(m, PROMPTS, max_new_tokens=[4, 5])
    with pytest.raises(pdecode.InputError, match="max_new_tokens must be"):
        pdecode.generate(m, PROMPTS, max_new_tokens=[4, 0, 5])
    dllm = pdecode.load("code-dllm", dtype="float32")
    with pytest.raises(pdecode.InputError, match="does not take per-row budgets"):
        pdecode.generate(dllm, PROMPTS, method="diffusion", max_new_tokens=[32, 32, 32])
    with pytest.raises(pdecode.InputError, match="does not take stop_at_dedent"):
        pdecode.generate(dllm, PROMPTS, method="diffusion", max_new_tokens=32, stop_at_dedent=True)
