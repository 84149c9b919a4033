"""What a new user passes by mistake gets one line saying what to pass (or just works): model names where a Model is
expected, prompts of the wrong type, a masked-diffusion model under an autoregressive method, heads of another
model."""

import pytest

import pdecode
from pdecode.errors import CheckpointError, InputError


def test_zoo_names_work_where_a_model_is_expected():
    m, d = pdecode.load("code-target"), pdecode.load("code-draft")
    ref = pdecode.generate(m, ["def f(x):"], method="sd", draft=d, max_new_tokens=6)
    out = pdecode.generate("code-target", ["def f(x):"], method="sd", draft="code-draft", max_new_tokens=6)
    assert out.tokens == ref.tokens
    assert pdecode.forward_logits("code-draft", [[5, 6, 7]]).shape == (1, 3, d.cfg.vocab_size)


@pytest.mark.parametrize("model,prompts,match", [
    (3.5, ["x"], "model must be a pdecode.Model .*got float"),
    ("code-target", 123, "prompts must be a text, a list of texts or a list of token-id lists; got int"),
    ("code-target", [[1, 2], "x", 3], "got an item of type int"),
    ("code-target", [1, 2, 3], "one flat list of ints: wrap it as \\[ids\\]"),
    ("code-target", [[1, 2.5]], "got an item of type list"),
    ("code-target", {"a": 1}, "got dict"),
])
def test_wrong_types_are_one_line(model, prompts, match):
    with pytest.raises(InputError, match=match):
        pdecode.generate(model, prompts, max_new_tokens=2)


def test_token_arrays_are_prompts():
    import jax.numpy as jnp
    import numpy as np

    ids = [[5, 6, 7, 8], [9, 10, 11, 12]]
    ref = pdecode.generate("code-draft", ids, max_new_tokens=3).tokens
    assert pdecode.generate("code-draft", jnp.asarray(ids), max_new_tokens=3).tokens == ref
    assert pdecode.generate("code-draft", np.asarray(ids), max_new_tokens=3).tokens == ref


def test_a_draft_of_the_wrong_type_is_one_line():
    with pytest.raises(InputError, match="draft must be a pdecode.Model"):
        pdecode.generate("code-target", ["x"], method="sd", draft=7, max_new_tokens=2)


@pytest.mark.parametrize("method,model,draft,match", [
    ("ar", "code-dllm", None, "method 'ar' decodes left to right .* masked-diffusion"),
    ("lookup", "code-dllm", None, "method 'lookup' decodes left to right"),
    ("sd", "code-target", "code-dllm", "needs an autoregressive draft model .*diffusion_draft"),
    ("diffusion_draft", "code-target", "code-draft", "needs a masked-diffusion draft model"),
    ("diffusion", "code-target", None, "needs a masked-diffusion \\(bidirectional\\) model"),
])
def test_a_model_of_the_wrong_kind_is_refused(method, model, draft, match):
    with pytest.raises(InputError, match=match):
        pdecode.generate(model, ["def f():"], method=method, draft=draft, max_new_tokens=4)


def test_the_engine_refuses_a_masked_model_too():
    with pytest.raises(InputError, match="masked-diffusion"):
        pdecode.Engine("code-dllm", method="ar", slots=1, max_len=64)


def test_heads_of_another_model_name_the_model_they_belong_to(hf_dirs):
    qwen = pdecode.load(hf_dirs["qwen2"][0])
    with pytest.raises(CheckpointError, match="these eagle heads belong to another model \\('code-target'\\), not "
                                              "this qwen2 model .*pdecode train heads --base"):
        pdecode.attach_heads(qwen, "code-target-eagle")
