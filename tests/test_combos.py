"""The survey's combinations: a masked-diffusion model drafting for an AR target (`diffusion_draft`): greedy output
identical to AR (chain, tree, several denoising steps, adaptive block, refill; batch 8, mixed lengths), sampling
lossless against exact AR marginals, and a wrong rule the same test rejects."""


import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pdecode
from pdecode import sampling
from pdecode.config import ModelConfig
from pdecode.decode.verify import Rule
from pdecode.model.transformer import init_params
from tests.test_selfdraft import PROMPT, N_SAMPLES, _OverAccepting, _pvalues, wrong_rule_pvalue
from tests.test_speculative import PROMPTS, models, small_vocab  # noqa: F401 (fixtures)


def _dllm(target, shift: bool, seed: int = 3):
    """A tiny random masked-diffusion model on the target's vocabulary (its last id is the mask)."""
    v = target.cfg.vocab_size
    cfg = ModelConfig(vocab_size=v, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=2, num_kv_heads=1,
                      head_dim=16, max_position_embeddings=512, causal=False, mask_token_id=v - 1,
                      diffusion_shift=shift, pad_token_id=0)
    return pdecode.Model(cfg=cfg, params=init_params(cfg, jax.random.PRNGKey(seed), std=0.3), name="tiny-dllm")


DD = [(True, dict(gamma=4)), (False, dict(gamma=3)), (True, dict(gamma=6, steps=3)),
      (True, dict(gamma=4, tree_top_k=3, total_tokens=10)), (True, dict(gamma=5, adaptive=True)),
      (True, dict(gamma=4, refill=True)), (True, dict(gamma=4, refill=True, steps=2))]


@pytest.mark.parametrize("shift,opts", DD, ids=[f"dd-{i}" for i in range(len(DD))])
def test_diffusion_draft_greedy_identical_to_ar(models, shift, opts):  # noqa: F811
    t = models["target"]
    d = _dllm(t, shift)
    ref = pdecode.generate(t, PROMPTS, max_new_tokens=30, stop_at_eos=False)
    out = pdecode.generate(t, PROMPTS, method="diffusion_draft", draft=d, max_new_tokens=30, stop_at_eos=False,
                           **opts)
    assert out.tokens == ref.tokens
    assert out.stats["draft_forwards"] >= out.stats["target_forwards"] - 1


@pytest.mark.parametrize("opts", [dict(gamma=3), dict(gamma=3, tree_top_k=2, total_tokens=5)], ids=["chain", "tree"])
def test_diffusion_draft_sampling_matches_ar(small_vocab, opts):  # noqa: F811
    target, _ = small_vocab
    d = _dllm(target, True)
    out = pdecode.generate(target, [PROMPT] * N_SAMPLES, method="diffusion_draft", draft=d, max_new_tokens=3,
                           temperature=1.0, seed=2, stop_at_eos=False, **opts)
    assert min(_pvalues(target, np.array(out.tokens), 3)) > 1e-4


def test_a_wrong_rule_fails_the_distribution_test(small_vocab):  # noqa: F811
    from pdecode.decode.diffusion_draft import DiffusionDrafter

    target, _ = small_vocab
    d = _dllm(target, True)
    # the drafter's deterministic block verified as if drawn from a uniform q
    drafter = _OverAccepting(DiffusionDrafter(d.cfg, mask_id=15, shift=True, gamma=3), rule=Rule.CHAIN_SAMPLING)
    assert wrong_rule_pvalue(target, drafter, d.params) < 1e-6


def test_diffusion_draft_errors(models):  # noqa: F811
    from pdecode.errors import ConfigError, InputError

    t = models["target"]
    d = _dllm(t, True)
    with pytest.raises(InputError, match="needs a masked-diffusion"):
        pdecode.generate(t, PROMPTS[:1], method="diffusion_draft", draft=models["small"], max_new_tokens=4)
    with pytest.raises(ConfigError, match="steps"):
        pdecode.generate(t, PROMPTS[:1], method="diffusion_draft", draft=d, gamma=2, steps=3, max_new_tokens=4)
    with pytest.raises(ConfigError, match="refill"):
        pdecode.generate(t, PROMPTS[:1], method="diffusion_draft", draft=d, tree_top_k=2, refill=True,
                         max_new_tokens=4)


# ------------------------------------------------------------------------------------------------ the README's matrix
# Cells of the compatibility matrix that are not tested elsewhere: decomposition around the new methods, and
# edit refinement after masked / one-shot generation and around decomposition (the zoo's code-target, code-dllm and
# code-edit).
@pytest.fixture(scope="module")
def zoo3():
    return (pdecode.load("code-target", dtype="float32"), pdecode.load("code-dllm", dtype="float32"),
            pdecode.load("code-edit", dtype="float32"))


def test_matrix_decomposition_around_diffusion_draft_and_mtp(zoo3):
    from tests.test_decompose import STUBS

    t, dllm, _ = zoo3
    out = pdecode.decompose(t, STUBS, method="diffusion_draft", draft=dllm, max_new_tokens=16)
    assert out.stats["decision"]["mode"] == "parallel" and out.stats["prefix_tokens"] > 0
    mtp = pdecode.load("code-target-mtp-posthoc", dtype="float32")  # (float32: no near-tie decides a token)
    out_mtp = pdecode.decompose(mtp, STUBS, method="mtp", max_new_tokens=16)
    assert out_mtp.points == out.points and out_mtp.prefix == out.prefix
    # lossless inside: each point's fill is the target's own greedy continuation (rows decode as they would alone)
    ref = pdecode.generate(t, [out.prefix + p for p in out.points], max_new_tokens=16).tokens
    for o in (out, out_mtp):
        for r, ft in zip(ref, o.fill_tokens):
            assert r[: len(ft)] == ft


def test_matrix_edit_refines_masked_one_shot_and_decomposed_output(zoo3):
    from tests.test_decompose import STUBS

    _, dllm, editor = zoo3
    prompts = ["def add(a, b):\n", "import os\n\n\ndef main():\n"]
    mask = dllm.cfg.mask_token_id
    for method, opts in (("oneshot", {}), ("diffusion", {"steps": 8})):
        plain = pdecode.generate(dllm, prompts, method=method, max_new_tokens=24, **opts)
        out = pdecode.generate(dllm, prompts, method=method, max_new_tokens=24, refine="edit", editor=editor, **opts)
        # a masked method's own draft is refined at the heads' draft threshold (issue 27)
        by_hand = pdecode.refine(editor, [dllm.tokenizer.encode(p) for p in prompts], plain.tokens, keep_eos=True,
                                 confidence=editor.extras["edit"][0].draft_confidence)
        assert out.tokens == by_hand.tokens and all(mask not in t for t in out.tokens)
        assert out.stats["refine"]["iterations"] == by_hand.stats["iterations"]
    dec = pdecode.decompose(dllm, STUBS, method="oneshot", max_new_tokens=16, refine="edit", editor=editor)
    assert dec.stats["inner"]["refine"]["forwards"] and len(dec.fills) == len(dec.points)
