"""The model families of pdecode.model.families against transformers (CPU torch): logits, greedy output, save_hf
round trip, bf16 loading, and every decoding method on every family giving AR's output token for token.

Each family is a tiny random checkpoint transformers saves (tests/helpers.NEW_FAMILIES), with sliding windows of 8
(shorter than a prompt plus its new tokens) where the family has them; MoE families route 2 of 4 experts."""

import dataclasses

import jax
import numpy as np
import pytest
import torch

import pdecode
from pdecode.model.groups import LayerGroups
from pdecode.model.transformer import layer_list
from pdecode.errors import CheckpointError, ConfigError
from pdecode.model import heads as H
from pdecode.model.transformer import init_from_specs
from tests.helpers import NEW_FAMILIES, VOCAB, assert_logits_close, make_hf_model

PROMPTS = [[5, 9, 13, 7, 21], list(range(3, 20)), [40, 41, 42, 7, 9, 11, 13, 15, 17, 19, 21]]  # mixed lengths
NEW = 16


@pytest.fixture(scope="module")
def fam_dirs(tmp_path_factory):
    out = {}
    for f in NEW_FAMILIES:
        d = tmp_path_factory.mktemp(f)
        out[f] = (d, make_hf_model(f, d, seed=3, num_hidden_layers=2))  # gemma3 / gpt_oss: a sliding and a full
    return out


def _ids(b, t, seed=0):
    return np.random.default_rng(seed).integers(3, VOCAB, size=(b, t))


def _ref_greedy(ref_model, prompt, n=NEW):
    with torch.no_grad():
        out = ref_model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, eos_token_id=None,
                                 pad_token_id=0, attention_mask=torch.ones(1, len(prompt), dtype=torch.long))
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize("fam", NEW_FAMILIES)
def test_family_matches_transformers(fam_dirs, fam, tmp_path):
    d, ref = fam_dirs[fam]
    m = pdecode.load(d)
    ids = _ids(2, 40, seed=1)
    with torch.no_grad():
        want = ref(torch.tensor(ids)).logits.numpy()
    got = np.asarray(pdecode.forward_logits(m, ids))
    assert_logits_close(got, want)
    out = pdecode.generate(m, PROMPTS, max_new_tokens=NEW, stop_at_eos=False)
    assert out.tokens == [_ref_greedy(ref, p) for p in PROMPTS]
    # save_hf writes what transformers loads back with the same logits
    import transformers

    pdecode.save_hf(m, tmp_path / "saved")
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "saved").eval()
    with torch.no_grad():
        again = back(torch.tensor(ids)).logits.numpy()
    assert_logits_close(again, want)
    # bfloat16 loads and stays close
    mb = pdecode.load(d, dtype="bfloat16")
    lb = np.asarray(pdecode.forward_logits(mb, ids))
    per_pos = np.abs(lb - want).max(-1)
    # a mixture of experts may route one token differently in bfloat16 (a tie broken otherwise): one position of 80
    flips = 1 if m.cfg.arch.experts else 0
    assert np.isfinite(lb).all() and np.sort(per_pos.ravel())[-1 - flips] <= 0.25 * np.abs(want).max()


def _draft_of(m):
    """A same-family draft: the target's first layer (embedding, final norm and head shared; a weight the one-layer
    config shapes differently, e.g. Gemma 4's per-layer inputs, random)."""
    from pdecode.model.transformer import param_specs

    cfg = m.cfg.with_layers(1)
    params = init_from_specs(param_specs(cfg), jax.random.PRNGKey(1), std=0.05)
    same = lambda a, b: a if a.shape == b.shape else b  # noqa: E731
    first = layer_list(m.params["layers"])[0]  # the target's layer 0, its own weights
    mine = params["layers"]
    if isinstance(mine, dict):  # one stack
        layers = jax.tree.map(lambda a: a[:1], m.params["layers"])
    elif isinstance(mine, LayerGroups):  # one group of one layer, stacked [1, ...]
        layers = LayerGroups([({k: same(first[k][None], v) if k in first else v for k, v in mine[0][0].items()},)],
                             mine.plan)
    else:
        layers = type(mine)([{k: same(first[k], v) if k in first else v for k, v in mine[0].items()}], False)
    params.update(embed=m.params["embed"], final_norm=m.params["final_norm"], layers=layers)
    return pdecode.Model(cfg=cfg, params=params, tokenizer=None)


HEADS = {"medusa": H.MedusaConfig(num_heads=3), "eagle": H.EagleConfig(), "mtp": H.MTPConfig(num_modules=1)}
METHODS = [("sd", {"gamma": 3}), ("lookup", {}), ("tree", {}), ("lookahead", {}), ("layerskip", {"exit_layer": 1}),
           ("medusa", {}), ("eagle", {"tree_top_k": 2, "depth": 3, "total_tokens": 6}), ("mtp", {})]


def methods_for(fam: str) -> list:
    """The methods CI runs on a family: 2 of the 8 in rotation (each method on 3 of the 12 families, every family on
    2 methods: 1/4 of the compiles of the whole matrix); PDECODE_FULL_MATRIX=1 runs all 8 on each, as
    scripts/family_parity.py does for docs/bench/families.md."""
    import os

    if os.environ.get("PDECODE_FULL_MATRIX") == "1":
        return METHODS
    i = NEW_FAMILIES.index(fam)
    start = 2 * i + 4 * (i // 8)  # (Gemma 4 with kv-shared layers: layerskip and heads)
    return [METHODS[(start + r) % len(METHODS)] for r in range(2)]


@pytest.mark.parametrize("fam", NEW_FAMILIES)
def test_every_method_equals_ar_on_family(fam_dirs, fam):
    d, _ = fam_dirs[fam]
    m = pdecode.load(d)
    ref = pdecode.generate(m, PROMPTS, max_new_tokens=NEW, stop_at_eos=False).tokens
    draft = _draft_of(m)
    for method, opts in methods_for(fam):
        target = m
        if method in HEADS:
            hcfg = HEADS[method]
            hp = init_from_specs(hcfg.specs(m.cfg), jax.random.PRNGKey(0), std=0.05)
            target = dataclasses.replace(m, extras={method: (hcfg, hp)})
        kw = {"draft": draft} if method in ("sd", "tree") else {}
        out = pdecode.generate(target, PROMPTS, method=method, max_new_tokens=NEW, stop_at_eos=False, **kw, **opts)
        assert out.tokens == ref, (fam, method)




def test_unsupported_features_fail_at_load(tmp_path):
    import json

    d = tmp_path / "m"
    make_hf_model("qwen3_moe", d, seed=0)
    cfg = json.loads((d / "config.json").read_text())
    for change, words in [({"model_type": "granite"}, "unsupported model_type 'granite'"),
                          ({"decoder_sparse_step": 0}, "qwen3_moe: decoder_sparse_step 0 is not supported"),
                          ({"rope_parameters": {"rope_type": "dynamic", "factor": 4.0, "rope_theta": 1e4}},
                           "qwen3_moe: rope_parameters.rope_type 'dynamic' is not supported"),
                          ({"rope_parameters": {"rope_type": "longrope", "factor": 4.0, "rope_theta": 1e4}},
                           "qwen3_moe: rope_parameters.rope_type 'longrope' needs short_factor"),
                          ({"rope_parameters": {"rope_type": "default", "rope_theta": 1e4,
                                                "partial_rotary_factor": 0.5}},
                           "qwen3_moe: partial_rotary_factor 0.5 is not supported"),
                          ({"hidden_act": "gelu"}, "qwen3_moe: hidden_act 'gelu' is not supported")]:
        (d / "config.json").write_text(json.dumps({**cfg, **change}))
        with pytest.raises((CheckpointError, ConfigError), match=words.replace("[", r"\[").replace("]", r"\]")):
            pdecode.load(d)
    d4 = tmp_path / "g4"
    make_hf_model("gemma4_moe", d4, seed=0, num_hidden_layers=2)
    cfg4 = json.loads((d4 / "config.json").read_text())
    rope = cfg4["rope_parameters"]
    for change, words in [({"use_bidirectional_attention": "all"}, "gemma4_text: use_bidirectional_attention 'all'"),
                          ({"attention_bias": True}, "gemma4_text: attention_bias true is not supported"),
                          ({"rope_parameters": {**rope, "full_attention": {"rope_type": "yarn", "factor": 2.0}}},
                           "gemma4_text: rope_parameters.full_attention.rope_type 'yarn' is not supported"),
                          ({"per_layer_config": {"0": {"head_dim": 8}}}, "gemma4: per_layer_config overrides sliding "
                                                                          "layers"),
                          ({"num_kv_shared_layers": 2}, "gemma4_text: num_kv_shared_layers 2 of 2 layers")]:
        (d4 / "config.json").write_text(json.dumps({**cfg4, **change}))
        with pytest.raises((CheckpointError, ConfigError), match=words.replace("[", r"\[").replace("]", r"\]")):
            pdecode.load(d4)


def _phi3_longrope(d, partial=1.0, **rope):
    """A tiny Phi-3 with longrope over an original context of 32 of 128 positions and no sliding window (the 128k
    releases' window, 262144, covers their whole context), saved by transformers; returns transformers' model."""
    import transformers as tf

    torch.manual_seed(0)
    half = int(16 * partial) // 2
    rng = np.random.default_rng(0)
    rp = {"rope_type": "longrope", "rope_theta": 10000.0,
          "short_factor": [float(x) for x in 1 + 0.3 * rng.random(half)],
          "long_factor": [float(x) for x in np.linspace(1.0, 6.0, half)], **rope}
    cfg = tf.Phi3Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                        original_max_position_embeddings=32, rope_parameters=rp, partial_rotary_factor=partial,
                        bos_token_id=1, eos_token_id=2, pad_token_id=0)
    model = tf.Phi3ForCausalLM(cfg).eval()
    with torch.no_grad():  # as tests.helpers.make_hf_model: widen the near-uniform init
        for p in model.parameters():
            p.add_(torch.randn_like(p) * (0.05 if p.ndim > 1 else 0.1))
    model.save_pretrained(d)
    return model


_close = assert_logits_close


@pytest.mark.parametrize("partial,rope", [(1.0, {}), (0.75, {"attention_factor": 1.3})], ids=["phi3-128k", "phi4-mini"])
def test_phi3_longrope_matches_transformers(tmp_path, partial, rope):
    """Longrope (Phi-3-mini-128k: the whole head, attention factor from max / original context; Phi-4-mini's 3/4 of
    the head rotating, here with an explicit attention_factor): a plain forward equals transformers' below, at and
    above the original context (transformers switches to the long factors past 32 tokens); save_hf writes a config
    transformers reads back with the same logits."""
    import transformers

    ref = _phi3_longrope(tmp_path / "m", partial, **rope)
    m = pdecode.load(tmp_path / "m")
    assert m.cfg.rotary_dims == (12 if partial < 1 else 0)
    for t in (20, 32, 33, 80):
        ids = _ids(2, t, seed=t)
        with torch.no_grad():
            want = ref(torch.tensor(ids)).logits.numpy()
        _close(pdecode.forward_logits(m, ids), want)
    pdecode.save_hf(m, tmp_path / "saved")
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "saved").eval()
    for t in (20, 80):
        ids = _ids(2, t, seed=t)
        with torch.no_grad():
            _close(pdecode.forward_logits(m, ids), back(torch.tensor(ids)).logits.numpy())
    assert pdecode.load(tmp_path / "saved").cfg == m.cfg


def test_phi3_longrope_generation_either_side_of_original_context(tmp_path):
    """A generation rotates with one set of factors, long iff its prompt + new tokens exceed the original context
    (phi3.py's docstring), whatever its cache (64 slots by default here, or 32) or a method's draft slots: one within
    it and one whose prompts already exceed it equal transformers' greedy generate (short, resp. long factors
    throughout), speculative decoding equals AR; one
    that crosses it runs the long factors from the start, so its tokens are a long-factor plain forward's argmax and,
    from the crossing on, what transformers' generate continues with from the same prefix."""
    ref = _phi3_longrope(tmp_path / "m")
    m = pdecode.load(tmp_path / "m")
    short = [[5, 9, 13, 7, 21, 4, 6, 8, 10, 12], [3, 4, 5, 6, 7, 8]]
    want = [_ref_greedy(ref, p) for p in short]
    for max_len in (None, 32):
        assert pdecode.generate(m, short, max_new_tokens=16, max_len=max_len, stop_at_eos=False).tokens == want
    assert pdecode.generate(m, short, method="sd", draft=m, gamma=3, max_new_tokens=16, stop_at_eos=False).tokens == \
        want
    long = [_ids(1, 40, seed=5)[0].tolist(), _ids(1, 36, seed=6)[0].tolist()]
    ar = pdecode.generate(m, long, max_new_tokens=NEW, stop_at_eos=False).tokens
    assert ar == [_ref_greedy(ref, p) for p in long]
    assert pdecode.generate(m, long, method="sd", draft=m, gamma=3, max_new_tokens=NEW, stop_at_eos=False).tokens == ar
    prompt = _ids(1, 20, seed=7)[0].tolist()
    toks = pdecode.generate(m, [prompt], max_new_tokens=24, stop_at_eos=False).tokens[0]
    seq = prompt + toks
    with torch.no_grad():
        lg = ref(torch.tensor([seq[:-1]])).logits[0].numpy()  # 43 tokens: the long factors
    assert lg[len(prompt) - 1:].argmax(-1).tolist() == toks
    cross = 33 - len(prompt)  # the first prefix longer than the original context
    assert _ref_greedy(ref, seq[:33], n=len(toks) - cross) == toks[cross:]


@pytest.mark.parametrize("fam,dense,ids", [("qwen2_moe", {"mlp_only_layers": [1]}, (1,)),
                                           ("qwen3_moe", {"decoder_sparse_step": 2}, (0, 2))])
def test_qwen_moe_dense_layers_match_transformers(tmp_path, fam, dense, ids):
    """Qwen-MoE with dense MLPs among the sparse ones (mlp_only_layers; decoder_sparse_step: every 2nd layer
    sparse): logits and greedy output equal transformers', speculative decoding equals AR, and save_hf writes what
    transformers loads back with the same layers and logits."""
    import transformers

    ref = make_hf_model(fam, tmp_path / "m", seed=3, num_hidden_layers=3, **dense)
    m = pdecode.load(tmp_path / "m")
    assert m.cfg.arch.experts.dense_layer_ids == ids
    x = _ids(2, 40, seed=1)
    with torch.no_grad():
        want = ref(torch.tensor(x)).logits.numpy()
    _close(pdecode.forward_logits(m, x), want)
    ar = pdecode.generate(m, PROMPTS, max_new_tokens=NEW, stop_at_eos=False).tokens
    assert ar == [_ref_greedy(ref, p) for p in PROMPTS]
    assert pdecode.generate(m, PROMPTS, method="sd", draft=m, gamma=3, max_new_tokens=NEW,
                            stop_at_eos=False).tokens == ar
    pdecode.save_hf(m, tmp_path / "saved")
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "saved").eval()
    assert [type(a.mlp) for a in back.model.layers] == [type(a.mlp) for a in ref.model.layers]
    with torch.no_grad():
        _close(back(torch.tensor(x)).logits.numpy(), want)


@pytest.mark.parametrize("fam", ["qwen3_moe", "gemma4_moe", "deepseek_v3"])
def test_experts_sharded_over_devices_match_one_device(fam_dirs, fam):
    """Expert parallelism: a MoE checkpoint loaded onto a 2x4 mesh puts each device's experts (a quarter of them) there
    (per-expert tensors: read straight from them); logits and greedy output equal one device's."""
    from pdecode.sharding import make_mesh

    if jax.device_count() < 8:
        pytest.skip("needs 8 devices (XLA_FLAGS=--xla_force_host_platform_device_count=8)")
    d, _ = fam_dirs[fam]
    one = pdecode.load(d)
    mesh = make_mesh(2, 4)
    m = pdecode.load(d, mesh=mesh, indivisible="replicate")  # (the tiny vocab, 97, does not divide 4)
    # the last layer's experts (DeepSeek-V3's first layer is dense; its latent cache is whole on every device, heads
    # split): a stack [layers, experts, ...], a group's stack [count, experts, ...], or (Gemma 4) a per-layer dict
    def last_experts(layers):
        if isinstance(layers, dict):
            return layers["we_gate"], 1
        if isinstance(layers, LayerGroups):
            return layers[-1][-1]["we_gate"], 1
        return layers[-1]["we_gate"], 0

    (w, ax), (w1, _) = last_experts(m.params["layers"]), last_experts(one.params["layers"])
    assert w.sharding.spec[ax] == "model"  # [(layers,) experts, embed, expert_mlp]: experts over the model axis
    shard = w.addressable_shards[0]
    assert shard.data.shape[ax] == w.shape[ax] // 4 and np.array_equal(np.asarray(shard.data), np.asarray(w1)[shard.index])
    ids = _ids(2, 24, seed=4)
    np.testing.assert_allclose(np.asarray(pdecode.forward_logits(m, ids)),
                               np.asarray(pdecode.forward_logits(one, ids)), atol=1e-5)
    assert pdecode.generate(m, PROMPTS, max_new_tokens=8, stop_at_eos=False).tokens == \
        pdecode.generate(one, PROMPTS, max_new_tokens=8, stop_at_eos=False).tokens


def test_moe_decode_step_computes_only_selected_experts():
    """XLA's cost analysis of one MoE layer's MLP on a decode step (one token per row, N*k <= E): its FLOPs are
    about k/E of running every expert (the dense product over all E)."""
    import jax.numpy as jnp

    from pdecode.config import ModelConfig
    from pdecode.model.families.moe import Experts, MoEArch, moe_mlp
    from pdecode.model.transformer import init_params

    cfg = ModelConfig(vocab_size=64, hidden_size=128, intermediate_size=256, num_layers=1, num_heads=4,
                      num_kv_heads=2, head_dim=32, family="qwen3_moe", arch=MoEArch(Experts(16, 2, 256)))
    lp = jax.tree.map(lambda a: a[0], init_params(cfg, jax.random.PRNGKey(0))["layers"])
    h = jax.random.normal(jax.random.PRNGKey(1), (4, 1, 128))  # a decode step of 4 rows: 8 pairs <= 16 experts

    def every_expert(lp, h):
        g = jnp.einsum("btd,edf->btef", h, lp["we_gate"])
        u = jnp.einsum("btd,edf->btef", h, lp["we_up"])
        return jnp.einsum("btef,efd->btd", jax.nn.silu(g) * u, lp["we_down"])

    def flops(f):
        c = jax.jit(f).lower(lp, h).compile().cost_analysis()
        return (c[0] if isinstance(c, list) else c)["flops"]

    sel, dense = flops(lambda lp, h: moe_mlp(cfg, lp, h, False)), flops(every_expert)
    ratio = sel / dense
    assert 2 / 16 * 0.8 <= ratio <= 2 / 16 * 1.5, ratio


def test_moe_expert_paths_agree():
    """The three ways `moe_mlp` runs experts (gathered weights for decode, grouped ragged_dot for long passes on
    accelerators, every expert weighted on CPU) give the same outputs, and match a per-token loop."""
    from pdecode.config import ModelConfig
    from pdecode.model.families import moe
    from pdecode.model.transformer import init_params

    cfg = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=1, num_heads=2,
                      num_kv_heads=1, head_dim=16, family="mixtral", arch=moe.MoEArch(moe.Experts(4, 2, 48)))
    lp = jax.tree.map(lambda a: a[0], init_params(cfg, jax.random.PRNGKey(0), std=0.2)["layers"])
    x = jax.random.normal(jax.random.PRNGKey(1), (12, 32))
    w, idx = moe.route(cfg, lp["router"], x)
    outs = [np.asarray(f(cfg, lp, x, w, idx)) for f in (moe.experts_gathered, moe.experts_grouped,
                                                         moe.experts_dense)]
    p = {k: np.asarray(v) for k, v in lp.items()}
    silu = lambda z: z / (1 + np.exp(-z))  # noqa: E731
    want = np.stack([sum(float(w[n, j]) * ((silu(x[n] @ p["we_gate"][e]) * (x[n] @ p["we_up"][e])) @ p["we_down"][e])
                         for j, e in enumerate(np.asarray(idx[n]))) for n in range(12)])
    for o in outs:
        np.testing.assert_allclose(o, want, atol=1e-5)


@pytest.mark.parametrize("fam", ["gemma3", "gemma4"])
def test_masked_diffusion_and_engine_on_family(fam_dirs, fam):
    """The non-AR and serving paths on a new family: Gemma 3 / Gemma 4 (per-layer inputs, kv-shared layers) run
    bidirectionally as a masked-diffusion model (one commit per step, most confident first) equal a reference loop
    over plain bidirectional forwards; the continuous-batching engine gives generate's tokens."""
    from pdecode.engine import Engine

    d, _ = fam_dirs[fam]
    m = pdecode.load(d)
    mask = VOCAB - 1
    dm = dataclasses.replace(m, cfg=m.cfg.replace(causal=False, mask_token_id=mask))
    prompts, g = [[5, 9, 13, 7, 21, 4, 6], [3, 4, 5]], 10  # canvases of 17 and 13 > the window (8)
    out = pdecode.generate(dm, prompts, method="diffusion", max_new_tokens=g, stop_at_eos=False)
    for p, toks in zip(prompts, out.tokens):
        canvas = list(p) + [mask] * g
        for _ in range(g):
            lg = np.array(pdecode.forward_logits(dm, [canvas]))[0]
            lg[:, mask] = -np.inf  # the mask token is never a prediction
            pr = np.exp(lg - lg.max(-1, keepdims=True))
            pr /= pr.sum(-1, keepdims=True)
            masked = [i for i, t in enumerate(canvas) if t == mask]
            best = max(masked, key=lambda i: pr[i].max())
            canvas[best] = int(pr[best].argmax())
        assert toks == canvas[len(p):]

    eng = Engine(m, method="ar", slots=2, max_len=64, chunk=32, steps_per_call=4)
    reqs = [eng.submit(p, eng.check(p, max_tokens=12, temperature=0.0)) for p in PROMPTS]
    while not eng.idle:
        eng.run_once()
    ref = pdecode.generate(m, PROMPTS, max_new_tokens=12)
    assert [r.tokens for r in reqs] == ref.tokens


def test_moe_speculative_sampling_is_lossless(tmp_path):
    """Speculative sampling on a Mixtral target with a Mixtral draft: the first 3 sampled tokens' marginals equal
    the exact AR marginals (chi-square over 12000 rows); the same test rejects the draft verified with a wrong q."""
    import jax.numpy as jnp
    import scipy.stats as sstats

    from pdecode import sampling
    from pdecode.api import compiled
    from pdecode.decode import speculative
    from pdecode.decode.draft_model import DraftChain
    from tests.test_speculative import _exact_marginals, _LyingChain

    kw = dict(vocab_size=16, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=2,
              num_key_value_heads=1, bos_token_id=None, eos_token_id=None, pad_token_id=0)
    make_hf_model("mixtral", tmp_path / "t", seed=10, **kw)
    make_hf_model("mixtral", tmp_path / "d", seed=11, **{**kw, "num_hidden_layers": 1})
    target, draft = pdecode.load(tmp_path / "t"), pdecode.load(tmp_path / "d")
    prompt, n = [3, 7, 3, 7, 3], 12000
    margs = _exact_marginals(target, prompt, 3)

    def pvalues(toks):
        return [sstats.chisquare(np.bincount(toks[:, i], minlength=16), margs[i] / margs[i].sum() * n).pvalue
                for i in range(3)]

    out = pdecode.generate(target, [prompt] * n, method="sd", draft=draft, gamma=3, max_new_tokens=3,
                           temperature=1.0, seed=2, stop_at_eos=False)
    assert min(pvalues(np.array(out.tokens))) > 1e-4
    assert out.stats["tokens_per_forward"] > 1.0
    prompt_a = jnp.asarray([prompt + [0] * 27] * n, jnp.int32)
    args = ((target.params, draft.params), prompt_a, jnp.full((n,), len(prompt), jnp.int32), jax.random.PRNGKey(1),
            sampling.Warp.of(1.0))
    exe, _ = compiled(speculative.generate, dict(cfg=target.cfg, drafter=_LyingChain(DraftChain(draft.cfg, 3, 3)),
                                                 max_new=3, max_len=64, eos_ids=(),
                                                 samp=sampling.Sampling(greedy=False), mesh=None), *args)
    assert min(pvalues(np.asarray(exe(*args)[0].tokens))) < 1e-6


@pytest.mark.parametrize("fam,kind", [("gemma4", "eagle"), ("qwen3_moe", "mtp")])
def test_heads_trained_on_a_family_decode_like_ar(tmp_path, fam, kind):
    """`pdecode train heads` on a new family's checkpoint (code-target's tokenizer beside it, Python text): the
    heads are built from the family's own block, train a few steps, save, load with their base and decode
    token for token like AR."""
    import shutil
    from pathlib import Path

    from infer import cli

    root = Path(__file__).resolve().parent.parent
    d = tmp_path / fam
    make_hf_model(fam, d, seed=5, num_hidden_layers=2, vocab_size=4096)
    shutil.copy(root / "zoo" / "code-target" / "tokenizer.json", d / "tokenizer.json")
    out = tmp_path / "heads"
    cli.main(["train", "heads", "--base", str(d), "--kind", kind, "--data", str(root / "pdecode" / "model"),
              "--out", str(out), "--steps", "3", "--seq-len", "48", "--batch-size", "4", "--work", str(tmp_path / "w"),
              "--calibration-prompts", "0"])  # (EAGLE's tree calibration: tests/test_train_cli.py)
    m = pdecode.load(out)
    assert kind in m.extras and m.cfg.family == pdecode.load(d).cfg.family
    prompts = ["def fib(n):", "import os\n", "class Stack:\n    def push(self, x):"]
    ref = pdecode.generate(m, prompts, max_new_tokens=16, stop_at_eos=False).tokens
    assert pdecode.generate(m, prompts, method=kind, max_new_tokens=16, stop_at_eos=False).tokens == ref


def test_gemma4_multimodal_checkpoint_loads_its_text_model(fam_dirs, tmp_path):
    """A `gemma4` (multimodal) directory: config.json nests the text model in ``text_config`` and its tensors sit
    under ``model.language_model.`` beside the vision tower's (ignored). pdecode runs the text model (the same logits
    as the ``gemma4_text`` checkpoint) and saves it back in the same layout, which loads again."""
    import json

    from pdecode.checkpoint.safetensors_io import read_safetensors, write_safetensors

    d, _ = fam_dirs["gemma4"]
    text = pdecode.load(d)
    mm = tmp_path / "mm"
    mm.mkdir()
    tensors = {k.replace("model.", "model.language_model.", 1): v
               for k, v in read_safetensors(d / "model.safetensors").items()}
    tensors["model.vision_tower.patch_embedder.weight"] = np.zeros((4, 4), np.float32)
    write_safetensors(mm / "model.safetensors", tensors, metadata={"format": "pt"})
    cfg = json.loads((d / "config.json").read_text())
    (mm / "config.json").write_text(json.dumps({"model_type": "gemma4", "architectures": [
        "Gemma4ForConditionalGeneration"], "text_config": cfg, "vision_config": {"hidden_size": 4}}))
    m = pdecode.load(mm)
    assert m.cfg.family == "gemma4" and m.cfg.arch.kv_shared_layers == 2
    ids = _ids(2, 12, seed=7)
    want = np.asarray(pdecode.forward_logits(text, ids))
    np.testing.assert_allclose(np.asarray(pdecode.forward_logits(m, ids)), want, atol=1e-6)
    pdecode.save_hf(m, tmp_path / "saved")
    saved = json.loads((tmp_path / "saved" / "config.json").read_text())
    assert saved["model_type"] == "gemma4" and saved["text_config"]["model_type"] == "gemma4_text"
    assert "model.language_model.layers.0.self_attn.q_proj.weight" in read_safetensors(
        tmp_path / "saved" / "model.safetensors")
    np.testing.assert_allclose(np.asarray(pdecode.forward_logits(pdecode.load(tmp_path / "saved"), ids)), want,
                               atol=1e-6)
