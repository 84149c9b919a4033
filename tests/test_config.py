"""The model config in three parts (pdecode/config.py): the core, the family's ``arch`` section, the ``run`` settings.

No network runs here: configs only (the fast tier)."""

import dataclasses

import pytest

from infer.plan import CONFIGS, model_config
from pdecode.config import Arch, ModelConfig
from pdecode.errors import ConfigError
from pdecode.model.families.deepseek import DeepseekArch
from pdecode.model.families.gemma4 import Gemma4Arch
from pdecode.model.families.moe import MoEArch
from pdecode.model.family import config_from_hf, config_to_hf, family_of
from pdecode.model.layers.experts import Experts
from pdecode.model.layers.latent import Latent

CORE = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=4, num_heads=4, num_kv_heads=2,
            head_dim=8)


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_every_architecture_round_trips_through_config_json(name):
    """Each family writes its section to config.json and reads it back: the same config, section and all; the run
    settings are never written."""
    cfg = model_config(name)
    assert type(cfg.arch) is family_of(cfg).arch_type
    hf = config_to_hf(cfg)
    assert config_from_hf(hf) == cfg
    tuned = cfg.with_run(activation_dtype="float32", attention_impl="xla", experts_sharded=True)
    assert tuned.run != cfg.run and tuned.arch == cfg.arch
    assert config_to_hf(tuned) == hf


def test_a_family_refuses_another_familys_section():
    moe = MoEArch(Experts(num_experts=4, experts_per_tok=2, moe_intermediate_size=16))
    for family, arch in (("llama", moe), ("qwen3_moe", Arch()), ("deepseek_v3", moe), ("gemma4_text", moe)):
        with pytest.raises(ConfigError, match=f"family '{family}' takes an arch section of type"):
            family_of(ModelConfig(**CORE, family=family, arch=arch))


def test_sections_validate_and_every_fault_is_named_once():
    with pytest.raises(ConfigError) as e:
        ModelConfig(**CORE, family="qwen3_moe", arch=MoEArch(Experts(
            num_experts=6, experts_per_tok=8, moe_intermediate_size=16, expert_groups=4, dense_layer_ids=(5,))))
    msg = str(e.value)
    assert msg.startswith("invalid model config: ")
    for words in ("0 < experts_per_tok <= num_experts", "expert_groups (4) must divide num_experts (6)",
                  "dense_layer_ids must be increasing layer indices in 0..3"):
        assert msg.count(words) == 1, msg
    with pytest.raises(ConfigError, match="kv_shared_layers must be in 0..3"):
        ModelConfig(**CORE, family="gemma4_text", arch=Gemma4Arch(kv_shared_layers=4))
    with pytest.raises(ConfigError, match="every attention kind of the kv-shared layers needs an earlier layer"):
        ModelConfig(**CORE, family="gemma4_text", sliding_window=8, layer_types=("sliding",) * 3 + ("full",),
                    arch=Gemma4Arch(kv_shared_layers=1))
    only = r"Gemma 4's experts take only .* \(got norm_topk_prob=False, dense_layers=1\)"
    with pytest.raises(ConfigError, match=only):
        ModelConfig(**CORE, family="gemma4_text", arch=Gemma4Arch(experts=Experts(4, 2, 16, norm_topk_prob=False,
                                                                                  dense_layers=1)))
    with pytest.raises(ConfigError, match="needs kv_lora_rank, qk_nope_dim and v_head_dim > 0 and num_kv_heads 1"):
        ModelConfig(**CORE, family="deepseek_v3", arch=DeepseekArch(
            Experts(4, 2, 16), Latent(kv_lora_rank=16, qk_nope_dim=8, v_head_dim=8)))  # 2 kv heads
    with pytest.raises(ConfigError, match="deepseek_v3 needs its latent attention section"):
        ModelConfig(**{**CORE, "num_kv_heads": 1}, family="deepseek_v3", arch=DeepseekArch(Experts(4, 2, 16)))
    with pytest.raises(ConfigError, match="invalid runtime settings: attention_impl must be one of"):
        ModelConfig(**CORE).with_run(attention_impl="flash")
    with pytest.raises(ConfigError, match="arch must be an Arch and run a Runtime"):
        ModelConfig(**CORE, arch={"num_experts": 4})


def test_per_layer_answers_come_from_the_section():
    """Shared code asks the section: a layer's attention shape, whose keys it reads, whether its MLP is sparse; a
    drafter built from the block (`with_layers`) gets its own keys, no per-layer inputs and only sparse blocks."""
    kinds = ("sliding", "sliding", "full", "sliding", "sliding", "full")
    g = ModelConfig(**{**CORE, "num_layers": 6}, family="gemma4_text", sliding_window=8, layer_types=kinds,
                    arch=Gemma4Arch(global_head_dim=16, global_kv_heads=1, kv_shared_layers=2, per_layer_input_size=4,
                                    per_layer_vocab=64, experts=Experts(4, 2, 16)))
    assert [g.layer_attention(i) for i in range(6)] == [(2, 8), (2, 8), (1, 16), (2, 8), (2, 8), (1, 16)]
    assert [g.kv_source(i) for i in range(6)] == [0, 1, 2, 3, 3, 2]
    assert all(g.moe_layer(i) for i in range(6))
    d = g.with_layers(1)
    assert (d.num_layers, d.layer_types, d.sliding_window) == (1, None, None)
    assert d.arch == dataclasses.replace(g.arch, kv_shared_layers=0, per_layer_input_size=0, per_layer_vocab=0)
    assert d.layer_attention(0) == (1, 16) and d.kv_source(0) == 0 and d.moe_layer(0)
    plain = ModelConfig(**CORE)
    assert plain.layer_attention(3) == (2, 8) and plain.kv_source(3) == 3 and not plain.moe_layer(3)
