"""Gemma 4 assistants (`pdecode.model.families.gemma4_assistant`, `method="assistant"`) against transformers'
Gemma4AssistantForCausalLM and assisted generation, on tiny random target / assistant pairs saved by transformers."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import pdecode
from pdecode.errors import CheckpointError
from pdecode.checkpoint import assistant_io
from pdecode.model.families import gemma4_assistant as A
from pdecode.model import cache as kvc
from pdecode.model.attention import cache_mask, causal_intra
from pdecode.model.transformer import forward

PROMPTS = [[5, 9, 13, 7, 21], list(range(3, 20)), [40, 41, 42, 7, 9, 11, 13, 15, 17]]  # past the window (4)


def make_pair(out, vocab=97, ordered=False, seed=0, target_layers=2):
    """(target dir, assistant dir): a Gemma 4 target (sliding window 4, a global head size of 32) and an assistant
    whose layers match its two kinds (hidden 32 against the target's 64), weights widened from random init."""
    import transformers as tf

    torch.manual_seed(seed)
    kinds = (["sliding_attention", "full_attention"] * 2)[:target_layers]
    common = dict(vocab_size=vocab, num_attention_heads=4, num_key_value_heads=2, head_dim=16, global_head_dim=32,
                  sliding_window=4, hidden_size_per_layer_input=0, vocab_size_per_layer_input=0,
                  max_position_embeddings=256, bos_token_id=1, eos_token_id=2, pad_token_id=0,
                  rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                   "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25,
                                                      "rope_theta": 1e6}})
    tgt = tf.Gemma4ForCausalLM(tf.Gemma4TextConfig(hidden_size=64, intermediate_size=96, layer_types=kinds,
                                                   num_hidden_layers=target_layers, **common)).eval()
    acfg = tf.Gemma4AssistantConfig(
        text_config=tf.Gemma4TextConfig(hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                        layer_types=["sliding_attention", "full_attention"], **common),
        backbone_hidden_size=64, use_ordered_embeddings=ordered, num_centroids=8, centroid_intermediate_top_k=2)
    ast = tf.Gemma4AssistantForCausalLM(acfg).eval()
    with torch.no_grad():
        for m in (tgt, ast):
            for p in m.parameters():
                p.add_(torch.randn_like(p) * (0.05 if p.ndim > 1 else 0.1))
        if ordered:
            ast.masked_embedding.token_ordering.copy_(torch.randperm(vocab))
    tgt.save_pretrained(out / "t")
    ast.save_pretrained(out / "a")
    return tgt, ast


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    d = tmp_path_factory.mktemp("pair")
    tgt, ast = make_pair(d)
    return d, tgt, ast


def _ref_step(tgt, ast, prompt):
    """transformers: the target over the prompt, then one assistant step from its greedy next token."""
    with torch.no_grad():
        o = tgt(torch.tensor([prompt]), output_hidden_states=True, return_shared_kv_states=True)
        nxt = int(o.logits[0, -1].argmax())
        emb = tgt.model.embed_tokens(torch.tensor([[nxt]]))
        ao = ast(inputs_embeds=torch.cat([emb, o.hidden_states[-1][:, -1:]], -1),
                 attention_mask=torch.ones(1, len(prompt) + 1, dtype=torch.long),
                 position_ids=torch.tensor([[len(prompt)]]), shared_kv_states=o.shared_kv_states, use_cache=False)
    return nxt, ao.logits[0, 0].numpy(), ao.last_hidden_state[0, 0].numpy()


def _our_step(m, acfg, ap, prompt, nxt):
    cfg, n = m.cfg, len(prompt)
    cache = kvc.init_cache(cfg, 1, 32, per_layer=True)
    fo = forward(m.params, cfg, jnp.asarray([prompt]), jnp.arange(n)[None],
                 cache_mask(jnp.zeros((1,), jnp.int32), causal_intra(n), 32), cache=cache,
                 write_at_B=jnp.zeros((1,), jnp.int32))
    cache = kvc.set_lengths(fo.cache, jnp.asarray([n]))
    lg, h = A.step(jax.tree.map(jnp.asarray, ap), acfg, cfg, m.params, jnp.asarray([nxt]), fo.hidden[:, -1],
                   jnp.asarray([n]), cache, jnp.asarray([n]))
    return np.asarray(lg)[0], np.asarray(h)[0]


@pytest.mark.parametrize("ordered", [False, True])
def test_assistant_step_matches_transformers(pair, tmp_path, ordered):
    """The assistant's logits and projected hidden state for the same target state (its KV cache over 3, 5 and 9
    tokens: within and past the sliding window of 4) equal Gemma4AssistantForCausalLM's; with ordered embeddings
    (centroid-masked head) too."""
    d, tgt, ast = pair
    if ordered:
        d = tmp_path
        tgt, ast = make_pair(d, vocab=96, ordered=True, seed=1)
    m = pdecode.load(d / "t")
    acfg, ap = assistant_io.load(d / "a", m.cfg)
    assert bool(acfg.num_centroids) == ordered
    for prompt in ([5, 9, 13], [5, 9, 13, 7, 21], PROMPTS[2]):
        nxt, want_lg, want_h = _ref_step(tgt, ast, prompt)
        lg, h = _our_step(m, acfg, ap, prompt, nxt)
        assert np.abs(lg - want_lg).max() <= 1e-4 and np.abs(h - want_h).max() <= 1e-4


def _hf_target_forwards(tgt, ast, prompt, gamma, n_new):
    """transformers' assisted generation with the assistant (gamma tokens per round): (new tokens, target
    forwards)."""
    calls = []
    hook = tgt.register_forward_hook(lambda *a: calls.append(1))
    ast.generation_config.num_assistant_tokens = gamma
    ast.generation_config.num_assistant_tokens_schedule = "constant"
    try:
        with torch.no_grad():
            out = tgt.generate(torch.tensor([prompt]), assistant_model=ast, max_new_tokens=n_new, do_sample=False,
                               eos_token_id=None, pad_token_id=0,
                               attention_mask=torch.ones(1, len(prompt), dtype=torch.long))
    finally:
        hook.remove()
    return out[0, len(prompt):].tolist(), len(calls)


def test_assistant_greedy_equals_ar_and_transformers_assisted_generation(pair):
    """Greedy with the assistant equals AR token for token (a batch of mixed lengths), and each prompt takes as many
    target forwards as transformers' assisted generation with the same pair (the same tokens accepted per step),
    up to the last round."""
    d, tgt, ast = pair
    m = pdecode.attach_heads(pdecode.load(d / "t"), d / "a")
    ar = pdecode.generate(m, PROMPTS, max_new_tokens=16, stop_at_eos=False).tokens
    out = pdecode.generate(m, PROMPTS, method="assistant", gamma=3, max_new_tokens=16, stop_at_eos=False)
    assert out.tokens == ar
    for p, toks in zip(PROMPTS, ar):
        hf, calls = _hf_target_forwards(tgt, ast, p, 3, 16)
        assert hf == toks
        one = pdecode.generate(m, [p], method="assistant", gamma=3, max_new_tokens=16, stop_at_eos=False)
        # both count the prefill; transformers drafts fewer tokens in a round that would pass max_new_tokens (so
        # its last rounds may take one forward more), pdecode drafts gamma and keeps what fits
        assert calls - 1 <= one.stats["target_forwards"] <= calls, (p, one.stats["target_forwards"], calls)


def test_assistant_sampling_is_lossless(tmp_path):
    """Speculative sampling with the assistant: the first 3 sampled tokens' marginals equal the exact AR marginals
    (chi-square over 12000 rows); the same test rejects the chain verified with a wrong q."""
    from pdecode.decode.assistant import AssistantDrafter
    from tests.test_speculative import liar_tokens, marginal_pvalues

    make_pair(tmp_path, vocab=16, seed=3)
    m = pdecode.attach_heads(pdecode.load(tmp_path / "t"), tmp_path / "a")
    prompt, n = [3, 7, 3, 7, 3], 12000
    out = pdecode.generate(m, [prompt] * n, method="assistant", gamma=3, max_new_tokens=3, temperature=1.0, seed=2,
                           stop_at_eos=False)
    assert min(marginal_pvalues(m, prompt, np.array(out.tokens))) > 1e-4
    assert out.stats["tokens_per_forward"] > 1.0
    acfg, ap = m.extras["assistant"]
    assert min(marginal_pvalues(m, prompt, liar_tokens(m, AssistantDrafter(m.cfg, acfg, 3), ap, prompt, n))) < 1e-6


def test_assistant_that_does_not_fit_is_one_error(pair):
    """An assistant for another width, or a target without one attached: one clear error each."""
    import json

    d, _, _ = pair
    target = pdecode.load(d / "t")
    acfg = A.config_from_hf(json.loads((d / "a" / "config.json").read_text()))
    with pytest.raises(CheckpointError, match="does not fit this target: backbone_hidden_size 64 != the target's "
                                              "hidden_size 48"):
        A.check_pair(acfg, target.cfg.replace(hidden_size=48))
    with pytest.raises(pdecode.errors.InputError, match="needs a Gemma 4 assistant"):
        pdecode.generate(target, [[5, 6]], method="assistant", max_new_tokens=2)


def test_assistant_tree_and_draft_argument(pair):
    """The assistant grows an EAGLE-2 tree (its frontier drafted in one pass per level) and decodes like AR; given
    as ``draft=`` (its directory) it attaches itself, in generate and in the serving engine."""
    from pdecode.engine import Engine

    d, _, _ = pair
    t = pdecode.load(d / "t")
    ar = pdecode.generate(t, PROMPTS, max_new_tokens=16, stop_at_eos=False).tokens
    tree = pdecode.generate(t, PROMPTS, method="assistant", draft=d / "a", gamma=3, tree_top_k=2, total_tokens=5,
                            max_new_tokens=16, stop_at_eos=False)
    assert tree.tokens == ar
    assert tree.stats["tokens_per_forward"] > 1.0
    eng = Engine(t, method="assistant", draft=str(d / "a"), slots=2, max_len=64, chunk=32, gamma=2)
    reqs = [eng.submit(p, eng.check(p, max_tokens=10, temperature=0.0)) for p in PROMPTS]
    while not eng.idle:
        eng.run_once()
    assert [r.tokens for r in reqs] == pdecode.generate(t, PROMPTS, max_new_tokens=10).tokens  # (EOS ends a row)
    with pytest.raises(pdecode.ConfigError, match="tree_top_k > 1"):
        pdecode.generate(t, PROMPTS[:1], method="assistant", draft=d / "a", total_tokens=3, max_new_tokens=4)
