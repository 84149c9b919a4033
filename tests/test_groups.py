"""Layers of several shapes scanned by group (`pdecode.model.groups`): the plan of groups, and networks whose groups
repeat (so the scanned path with its traced layer index and grouped KV cache runs) against transformers.

Gemma 4: eight layers, (sliding, full) twice with keys of their own, then twice more kv-shared with double-wide MLPs
and per-layer inputs; DeepSeek-V3: one dense layer, then three sparse ones."""

import numpy as np
import pytest
import torch

import pdecode
from pdecode.model.groups import Group, LayerGroups, plan_groups
from tests.helpers import VOCAB, assert_logits_close

PROMPTS = [[5, 9, 13, 7, 21], list(range(3, 20)), [40, 41, 42, 7, 9, 11, 13, 15, 17, 19, 21]]  # mixed lengths
NEW = 12


def test_plan_groups():
    assert plan_groups(list("DDDMMMMM")) == (Group(0, 1, 3), Group(3, 1, 5))
    assert plan_groups(list("SSSSSF" * 10)) == (Group(0, 6, 10),)
    assert plan_groups(list("SFSFab")) == (Group(0, 2, 2), Group(4, 1, 1), Group(5, 1, 1))
    assert plan_groups(list("abc")) == (Group(0, 1, 1), Group(1, 1, 1), Group(2, 1, 1))
    assert plan_groups([]) == ()
    # every layer covered once, in order
    for sig in ("SSFSSFSSFX", "ABABABCC", "AAAAAAAAAAAAAAAAAAB"):
        cover = [g.layer(r, u) for g in plan_groups(list(sig)) for r in range(g.count) for u in range(g.period)]
        assert cover == list(range(len(sig)))


def _gemma4(d):
    import transformers as tf

    torch.manual_seed(4)
    cfg = tf.Gemma4TextConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=8, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, global_head_dim=32, sliding_window=8, max_position_embeddings=256,
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                         "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25,
                                            "rope_theta": 1000000.0}},
        hidden_size_per_layer_input=8, vocab_size_per_layer_input=VOCAB, num_kv_shared_layers=4,
        use_double_wide_mlp=True, layer_types=["sliding_attention", "full_attention"] * 4, tie_word_embeddings=True)
    return tf.Gemma4ForCausalLM(cfg)


def _deepseek(d):
    import transformers as tf

    torch.manual_seed(5)
    return tf.DeepseekV3ForCausalLM(tf.DeepseekV3Config(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=4, max_position_embeddings=256, kv_lora_rank=32, q_lora_rank=48, qk_rope_head_dim=8,
        qk_nope_head_dim=16, v_head_dim=16, n_routed_experts=8, n_shared_experts=1, moe_intermediate_size=32,
        num_experts_per_tok=2, n_group=4, topk_group=2, routed_scaling_factor=2.5, first_k_dense_replace=1))


def _ref_greedy(ref, prompt):
    with torch.no_grad():
        out = ref.generate(torch.tensor([prompt]), max_new_tokens=NEW, do_sample=False, eos_token_id=None,
                           pad_token_id=0, attention_mask=torch.ones(1, len(prompt), dtype=torch.long))
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize("fam,plan", [("gemma4", (Group(0, 2, 2), Group(4, 2, 2))),
                                      ("deepseek_v3", (Group(0, 1, 1), Group(1, 1, 3)))])
def test_scanned_groups_match_transformers(tmp_path, fam, plan):
    ref = (_gemma4 if fam == "gemma4" else _deepseek)(tmp_path)
    for p in ref.parameters():  # larger random weights than the default init: logits that tell layers apart
        torch.nn.init.normal_(p, std=0.08) if p.ndim > 1 else None
    ref.eval()
    ref.save_pretrained(tmp_path)
    m = pdecode.load(tmp_path)
    layers = m.params["layers"]
    assert isinstance(layers, LayerGroups) and layers.plan == plan
    ids = np.random.default_rng(1).integers(3, VOCAB, size=(2, 24))
    with torch.no_grad():
        want = ref(torch.tensor(ids)).logits.numpy()
    assert_logits_close(np.asarray(pdecode.forward_logits(m, ids)), want)
    # the cached decode: every group one scan, keys and values in the grouped cache (Gemma 4: one stacked buffer
    # per position of the first group; the kv-shared group reads them)
    out = pdecode.generate(m, PROMPTS, max_new_tokens=NEW, stop_at_eos=False)
    assert out.tokens == [_ref_greedy(ref, p) for p in PROMPTS]
    # a method that commits accepted tokens by moving them in the cache (lookup) gives the same tokens
    assert pdecode.generate(m, PROMPTS, method="lookup", max_new_tokens=NEW, stop_at_eos=False).tokens == out.tokens
    if fam == "gemma4":  # the serving engine's paged pool (pages of 16 positions), also grouped
        eng = pdecode.Engine(m, slots=2, max_len=64, chunk=32, kv_pages=8)
        assert [e.tokens for e in eng.generate(PROMPTS[:2], max_tokens=NEW, stop_at_eos=False)] == \
            out.tokens[:2]
