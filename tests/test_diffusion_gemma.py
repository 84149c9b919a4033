"""DiffusionGemma (issue 30): the block-diffusion encoder-decoder loaded from a transformers checkpoint (forward
parity of the encoder cache + decoder with self-conditioning, sliding layers, MoE, proportional rope), and its own
entropy-bound sampler reproduced token for token and step for step against transformers' `generate`."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import pdecode
from pdecode.model.family import config_from_hf
from pdecode.errors import InputError
from pdecode.model.families import diffusion_gemma as bd
from pdecode.model import cache as kvc
from tests.test_speculative import small_vocab  # noqa: F401 (fixture)

transformers = pytest.importorskip("transformers")

ENCODE = jax.jit(bd.encode, static_argnums=1)
DENOISE = jax.jit(bd.denoise, static_argnums=1)
PROMPTS = [list(np.random.default_rng(0).integers(3, 99, n)) for n in (5, 13, 9)]  # 13 > the sliding window 8


def _tiny(path, seed=0, layers=3, vocab=99):
    """A random DiffusionGemma of the smallest shape with every path live: sliding and full layers (window 8, full
    layers with their own head size and one kv head, keys as values, partial rope), top-2 of 4 experts, norms,
    router scales and layer scalars randomised (the reference initialises them to ones)."""
    from transformers import DiffusionGemmaConfig, DiffusionGemmaForBlockDiffusion

    torch.manual_seed(seed)
    kinds = ["sliding_attention"] * (layers - 1) + ["full_attention"]
    cfg = DiffusionGemmaConfig(
        text_config=dict(vocab_size=vocab, hidden_size=32, num_attention_heads=2, num_key_value_heads=2, head_dim=16,
                         intermediate_size=32, num_hidden_layers=layers, layer_types=kinds, sliding_window=8,
                         num_experts=4, top_k_experts=2, moe_intermediate_size=8, global_head_dim=32,
                         num_global_key_value_heads=1, pad_token_id=0, eos_token_id=2),
        vision_config=dict(model_type="gemma4_vision", hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                           num_key_value_heads=1, head_dim=8, intermediate_size=32),
        canvas_length=8, initializer_range=0.3)
    m = DiffusionGemmaForBlockDiffusion(cfg).eval()
    with torch.no_grad():
        for n, p in m.named_parameters():
            if "vision" not in n and (p.ndim == 1 or n.endswith("scale")):
                p.copy_(1 + 0.3 * torch.randn_like(p))
        for n, b in m.named_buffers():
            if n.endswith("layer_scalar"):
                b.copy_(1 + 0.3 * torch.randn_like(b))
    m.save_pretrained(path)
    return m


@pytest.fixture(scope="module")
def dg(tmp_path_factory):
    d = tmp_path_factory.mktemp("dg")
    ref = _tiny(d)
    return ref, pdecode.load(d, dtype="float32"), d


def test_forward_parity(dg):
    """Encode a prompt longer than the window, decode a canvas with and without self-conditioning, commit it,
    decode the next: logits equal the reference's (<= 1e-4; they reach ~7)."""
    from transformers import DynamicCache

    ref, m, _ = dg
    assert m.cfg.family == "diffusion_gemma" and m.cfg.arch.canvas_length == 8 and m.cfg.arch.k_eq_v and \
        m.cfg.arch.experts.num_experts == 4
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 99, (2, 13), generator=g)
    canvas, canvas2 = torch.randint(0, 99, (2, 2, 8), generator=g)
    sc = torch.randn(2, 8, 99, generator=g) * 3
    with torch.no_grad():
        c = DynamicCache(config=ref.config.text_config)
        ref.model.encoder(input_ids=ids, cache=c)
        want = [ref(input_ids=None, cache=c, decoder_input_ids=canvas).logits,
                ref(input_ids=None, cache=c, decoder_input_ids=canvas, self_conditioning_logits=sc).logits]
        ref.model.encoder(input_ids=canvas, cache=c)
        want.append(ref(input_ids=None, cache=c, decoder_input_ids=canvas2, self_conditioning_logits=sc).logits)
    j = lambda t: jnp.asarray(t.numpy())  # noqa: E731
    on = jnp.ones((2,), bool)
    cache = kvc.init_cache(m.cfg, 2, 64, jnp.float32, per_layer=True)
    cache = kvc.advance(ENCODE(m.params, m.cfg, j(ids), cache), jnp.full((2,), 13))
    got = [DENOISE(m.params, m.cfg, j(canvas), cache), DENOISE(m.params, m.cfg, j(canvas), cache, j(sc), on)]
    cache = kvc.advance(ENCODE(m.params, m.cfg, j(canvas), cache), jnp.full((2,), 8))
    got.append(DENOISE(m.params, m.cfg, j(canvas2), cache, j(sc), on))
    for a, w in zip(got, want):
        w = w.numpy()
        assert np.abs(w).max() > 3
        np.testing.assert_allclose(np.asarray(a), w, atol=1e-4)
    assert np.abs(want[0].numpy() - want[1].numpy()).max() > 0.1  # self-conditioning matters
    # the sc switch: off equals no sc at all
    np.testing.assert_allclose(np.asarray(DENOISE(m.params, m.cfg, j(canvas2), cache, j(sc), ~on)),
                               np.asarray(DENOISE(m.params, m.cfg, j(canvas2), cache)), atol=1e-4)


def test_checkpoint_under_encoder_names(dg, tmp_path):
    """The tied weights stored under the encoder's names (the other half of the tie) load to the same model."""
    from safetensors.numpy import load_file, save_file

    _, m, d = dg
    t = load_file(str(d / "model.safetensors"))
    enc = {("model.encoder.language_model." + k[len("model.decoder."):]
            if k.startswith("model.decoder.") and "self_conditioning" not in k and not k.endswith("layer_scalar")
            else k): v for k, v in t.items()}
    assert not any(k.startswith("model.decoder.layers.") and not k.endswith("layer_scalar") for k in enc)
    save_file(enc, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text((d / "config.json").read_text())
    m2 = pdecode.load(tmp_path, dtype="float32")
    for a, b in zip(*(jax_leaves(x.params) for x in (m, m2))):
        np.testing.assert_array_equal(a, b)


def test_save_hf_round_trip(dg, tmp_path):
    """`save_hf` writes a checkpoint pdecode and transformers both load back to the same weights: every text-path
    tensor and layer-scalar buffer equal to the original reference model's (the vision tower is not written)."""
    from transformers import DiffusionGemmaForBlockDiffusion

    from pdecode.checkpoint.hf import save_hf

    ref, m, _ = dg
    save_hf(m.cfg, m.params, tmp_path, dtype="float32")
    m2 = pdecode.load(tmp_path, dtype="float32")
    assert m2.cfg == m.cfg
    for a, b in zip(*(jax_leaves(x.params) for x in (m, m2))):
        np.testing.assert_array_equal(a, b)
    back = DiffusionGemmaForBlockDiffusion.from_pretrained(tmp_path).eval().state_dict()
    want = {k: v for k, v in ref.state_dict().items() if "vision" not in k}
    assert set(want) <= set(back) and len(want) > 20
    for k, v in want.items():
        assert torch.equal(back[k], v), k


def jax_leaves(p):
    import jax

    return [np.asarray(x) for x in jax.tree.leaves(p)]


def _patched_reference(monkeypatch, ref):
    """transformers' sampler made deterministic as pdecode's temperature 0 is: argmax draws, the pad token as noise;
    returns a list that collects the decoder calls between encoder calls (steps per canvas)."""
    from transformers.models.diffusion_gemma import generation_diffusion_gemma as G

    monkeypatch.setattr(torch, "multinomial", lambda p, num_samples=1, **k: p.argmax(-1, keepdim=True))
    monkeypatch.setattr(G.EntropyBoundSampler, "initialize_canvas",
                        lambda self, batch_size, device: torch.zeros((batch_size, self.canvas_length),
                                                                     dtype=torch.long, device=device))
    calls = []
    hooks = [ref.model.decoder.register_forward_hook(lambda *a: calls.append("d")),
             ref.model.encoder.register_forward_hook(lambda *a: calls.append("e"))]
    return calls, hooks


@pytest.mark.parametrize("steps,stability,confidence,bound", [(3, 1, 1.5, 0.1), (3, 1, 1.5, 3.0), (4, 0, 2.6, 0.1)])
def test_sampler_reproduces_reference(dg, monkeypatch, steps, stability, confidence, bound):
    """`method="diffusion"` at temperature 0 = transformers' generate (argmax draws, pad noise): the same tokens (to
    the first EOS) and the same denoising steps in every canvas, for a batch of mixed prompt lengths decoded
    together (rows stop canvases at different steps and end on different canvases). The sampler's own float32
    rounding grows through self-conditioning on a random model (~30x per step), so runs are kept to <= 4 steps."""
    from transformers.models.diffusion_gemma.generation_diffusion_gemma import EntropyBoundSamplerConfig

    ref, m, _ = dg
    out = pdecode.generate(m, PROMPTS, method="diffusion", max_new_tokens=24, temperature=0.0, steps=steps,
                           eb_gamma=bound, stability=stability, confidence=confidence)
    calls, hooks = _patched_reference(monkeypatch, ref)
    try:
        for i, p in enumerate(PROMPTS):
            calls.clear()
            with torch.no_grad():
                r = ref.generate(torch.tensor([p]), max_new_tokens=24, eos_token_id=2, pad_token_id=0,
                                 max_denoising_steps=steps, t_min=0.4, t_max=0.8, stability_threshold=stability,
                                 confidence_threshold=confidence,
                                 sampler_config=EntropyBoundSamplerConfig(entropy_bound=bound))
            seq = r.sequences[0, len(p):].tolist()
            seq = seq[: seq.index(2) + 1] if 2 in seq else seq
            assert out.tokens[i] == seq, (i, out.tokens[i], seq)
            per_canvas = [len(s) for s in "".join(calls).split("e")[1:]]
            assert out.stats["canvas_steps"][i][: len(per_canvas)] == per_canvas
            assert sum(out.stats["canvas_steps"][i][len(per_canvas):]) == 0
    finally:
        for h in hooks:
            h.remove()
    if steps == 4:  # early stops happened, at different steps
        assert len({s for row in out.stats["canvas_steps"] for s in row if s}) > 1


def test_generation_config_defaults_and_sampling(dg, tmp_path):
    """Defaults come from generation_config.json; temperature 1 samples (seeded: reproducible, another seed
    differs); a bad schedule is refused in one line."""
    import shutil

    _, m, d = dg
    for f in ("config.json", "model.safetensors"):
        shutil.copy(d / f, tmp_path / f)
    (tmp_path / "generation_config.json").write_text(json.dumps(
        {"max_denoising_steps": 2, "t_min": 0.3, "t_max": 0.9, "stability_threshold": 0, "confidence_threshold": 9.0,
         "sampler_config": {"entropy_bound": 0.5}, "eos_token_id": 2}))
    m2 = pdecode.load(tmp_path, dtype="float32")
    o = pdecode.generate(m2, PROMPTS[:2], method="diffusion", max_new_tokens=16)
    # confidence 9 > any mean entropy and stability 0: every canvas stops after its first step
    assert all(s in (0, 1) for row in o.stats["canvas_steps"] for s in row)
    o = pdecode.generate(m2, PROMPTS[:2], method="diffusion", max_new_tokens=16, confidence=1e-9)
    assert all(s in (0, 2) for row in o.stats["canvas_steps"] for s in row) and o.stats["steps"] >= 2
    a = pdecode.generate(m, PROMPTS, method="diffusion", max_new_tokens=16, temperature=1.0, seed=1, steps=3)
    b = pdecode.generate(m, PROMPTS, method="diffusion", max_new_tokens=16, temperature=1.0, seed=1, steps=3)
    c = pdecode.generate(m, PROMPTS, method="diffusion", max_new_tokens=16, temperature=1.0, seed=2, steps=3)
    g = pdecode.generate(m, PROMPTS, method="diffusion", max_new_tokens=16, temperature=0.0, steps=3)
    assert a.tokens == b.tokens and a.tokens != c.tokens and a.tokens != g.tokens
    assert all(0 < len(t) <= 16 and all(0 <= x < 99 for x in t) for t in a.tokens)
    with pytest.raises(InputError, match=r"t_max \(0.3\) must be > t_min \(0.5\)"):
        pdecode.generate(m, PROMPTS, method="diffusion", max_new_tokens=8, t_min=0.5, t_max=0.3)


@pytest.mark.parametrize("method,kw,budget", [
    ("diffusion", dict(rule="threshold", threshold=0.5), 8), ("diffusion", dict(rule="eb", eb_gamma=1.0), 8),
    ("diffusion", dict(rule="factor"), 8), ("diffusion", dict(rule="schedule", steps=4), 4),
    ("diffusion", dict(rule="threshold", threshold=0.5, remask="cap"), 16), ("dico", dict(block_length=4), 8),
    ("dico", dict(remask="conf"), 16)])
def test_masked_samplers_inside_canvases(dg, method, kw, budget):
    """pdecode's masked samplers run inside each canvas (undecided positions fed as noise): every row's output is
    whole canvases of decided tokens up to its EOS (nothing undecided, nothing after the EOS), and no canvas takes
    more steps than the sampler's budget (one token per step at least: the canvas length; the schedule: its steps;
    ReMDM: each position re-masked at most once)."""
    _, m, _ = dg
    o = pdecode.generate(m, PROMPTS, method=method, max_new_tokens=24, temperature=0.0, **kw)
    for toks, steps in zip(o.tokens, o.stats["canvas_steps"]):
        assert all(0 <= t < 99 for t in toks)
        assert len(toks) == 24 or toks[-1] == 2 and 2 not in toks[:-1]
        used = [s for s in steps if s]
        assert len(used) == -(-len(toks) // 8) and max(used) <= budget
        if kw.get("rule") == "schedule":
            assert all(s == 4 for s in used[:-1])
    assert o.stats["new_tokens"] == sum(len(t) for t in o.tokens)


def test_masked_sampler_commits_the_decoders_prediction(dg):
    """With a threshold every position clears, a canvas is decided in one step, and its tokens are the argmax of one
    decoder pass over a noise canvas (the pad token at temperature 0) after the encoded prompt: the samplers read
    the model, not something else."""
    _, m, _ = dg
    o = pdecode.generate(m, PROMPTS, method="diffusion", max_new_tokens=8, temperature=0.0, rule="threshold",
                         threshold=1e-6)
    assert [s[0] for s in o.stats["canvas_steps"]] == [1, 1, 1]
    lens = jnp.asarray([len(p) for p in PROMPTS])
    ids = jnp.asarray([p + [0] * (13 - len(p)) for p in PROMPTS])
    cache = kvc.init_cache(m.cfg, 3, 64, jnp.float32, per_layer=True)
    cache = kvc.set_lengths(ENCODE(m.params, m.cfg, ids, cache, lens), lens)
    lg = np.asarray(DENOISE(m.params, m.cfg, jnp.zeros((3, 8), jnp.int32), cache))
    for toks, want in zip(o.tokens, lg.argmax(-1).tolist()):
        want = want[: want.index(2) + 1] if 2 in want else want
        assert toks == want


def test_block_diffusion_options_refused_in_one_line(dg):
    _, m, _ = dg
    for kw, words in ((dict(rule="threshold", cfg_scale=1.0), "classifier-free guidance needs a mask token"),
                      (dict(rule="eb", cache="dual"), "the encoder's KV cache"),
                      (dict(rule="eb", block_length=4), "each canvas \\(8 tokens\\) is the block"),
                      (dict(rule="eb", stability=2), "stopping rule of the model's own sampler"),
                      (dict(alg="margin"), "option 'alg' belongs to the masked samplers")):
        with pytest.raises(InputError, match=words):
            pdecode.generate(m, PROMPTS, method="diffusion", max_new_tokens=8, **kw)
    for method in ("oneshot", "mask_predict"):  # the methods that need a mask token
        with pytest.raises(InputError, match="is a block-diffusion model .* use method='diffusion' or 'dico'"):
            pdecode.generate(m, PROMPTS, method=method, max_new_tokens=8)


def test_on_a_mesh_with_experts_sharded(dg):
    """Loaded on a 2x2 mesh (experts and heads split over the model axis, the batch over data): the same tokens and
    steps per canvas as on one device (runs kept short: see the sampler test on float32 rounding)."""
    from pdecode.sharding import make_mesh

    _, m, d = dg
    if len(jax.devices()) < 4:
        pytest.skip("needs 4 devices (XLA_FLAGS=--xla_force_host_platform_device_count=8)")
    mesh = make_mesh(2, 2, devices=jax.devices()[:4])
    mm = pdecode.load(d, dtype="float32", mesh=mesh, indivisible="replicate")
    assert mm.cfg.run.experts_sharded and "model" in str(mm.params["layers"][0]["we_gate"].sharding.spec)
    prompts = PROMPTS + [[7, 8, 9]]
    for kw in (dict(steps=3), dict(rule="schedule", steps=2)):
        a = pdecode.generate(m, prompts, method="diffusion", max_new_tokens=16, **kw)
        b = pdecode.generate(mm, prompts, method="diffusion", max_new_tokens=16, mesh=mesh, **kw)
        assert a.tokens == b.tokens and a.stats["canvas_steps"] == b.stats["canvas_steps"]


def test_plan_a_block_diffusion_model(dg):
    """`pdecode plan --method diffusion` compiles the sampler for a mesh from the config alone and costs its two
    passes over a canvas (the denoising step also runs the self-conditioning product over the vocabulary); a
    block-diffusion model with an AR method, or diffusion on an AR config, is one line."""
    from infer.plan import plan

    _, _, d = dg
    r = plan(str(d), 4, "diffusion", batch=4, max_len=64, mesh_shape=(4, 1), prompt_len=16)  # (vocab 99)
    steps = r["step_costs_per_device"]
    assert r["compiled"] and r["per_device_bytes"] > 0 and set(steps) == {"denoise_canvas", "encode_canvas"}
    assert steps["denoise_canvas"]["flops"] > steps["encode_canvas"]["flops"] > 0
    assert all(p["tokens_per_s"] > 0 and p["denoise_step_s"] > 0 for p in r["projection"].values())
    with pytest.raises(InputError, match="--method diffusion plans a block-diffusion model"):
        plan(str(d), 4, "ar", batch=4, max_len=64)
    with pytest.raises(InputError, match="--method diffusion plans a block-diffusion model"):
        plan("llama-3.2-1b", 4, "diffusion", batch=4, max_len=64)


def test_bench_recipe_and_decomposition(tmp_path):
    """The real-weights recipe on a tiny model with a tokenizer: `pdecode bench --suite diffusion --items-file`
    reads (prompt, answer) lines, runs the model's own sampler, Fast-dLLM and DiCo inside canvases by default, and
    scores exact answers (a GSM8K "#### n" answer against the generation's last number)."""
    import shutil

    from infer import diffusion_bench as DB
    from infer.bench import main as bench_main

    d = tmp_path / "m"
    _tiny(d, vocab=4096)
    shutil.copy(pdecode.api.resolve_path("code-dllm") / "tokenizer.json", d / "tokenizer.json")
    items = tmp_path / "items.jsonl"
    items.write_text("\n".join(json.dumps(x) for x in (
        {"question": "What is 2 + 3?", "answer": "2 + 3 = 5\n#### 5"}, {"prompt": "def f(x):", "answer": "1,000"},
        {"prompt": "print", "answer": "x"})) + "\n")
    out = tmp_path / "out"
    rc = bench_main(["--suite", "diffusion", "--model", str(d), "--items-file", str(items), "--gen-lengths", "16",
                     "--batch", "1", "--items", "2", "--timing-items", "1", "--repeats", "1", "--code-prompts", "0",
                     "--judge", "", "--out", str(out)])
    assert rc == 0
    res = json.loads((out / "results.json").read_text())
    assert [r["sampler"] for r in res["rows"]] == list(DB.BLOCK_SAMPLERS)
    assert all(r["items"] == 2 and r["nfe_per_item"] >= 2 and r["same_tokens"] for r in res["rows"])
    assert res["meta"]["tasks"] == str(items)
    it = DB.file_items(items, None, 5)
    assert [i.answer for i in it] == ["5", "1000", "x"] and it[0].prompt == "What is 2 + 3?"
    assert DB.file_score(it[0], "2 plus 3 makes 5.") and not DB.file_score(it[0], "5 or maybe 6")
    assert DB.file_score(it[1], "it is 1,000") and DB.file_score(it[2], "x\nmore") and not DB.file_score(it[2], "y")
    with pytest.raises(pdecode.InputError, match="is for masked-diffusion models"):
        bench_main(["--suite", "diffusion", "--model", str(d), "--items-file", str(items), "--samplers", "vanilla",
                    "--batch", "1", "--timing-items", "1", "--out", str(out)])
    # decomposition around it: the points fill as one batch of canvases, each as it would alone (short runs: see
    # the sampler test on float32 rounding)
    import importlib

    from tests.test_decompose import STUBS

    D = importlib.import_module("pdecode.decompose")
    m = pdecode.load(d, dtype="float32")
    dec = pdecode.decompose(m, STUBS, method="diffusion", max_new_tokens=16, steps=2)
    assert dec.stats["decision"]["mode"] == "parallel" and len(dec.points) == 4
    for p, f in zip(dec.points, dec.fills):
        ref = pdecode.generate(m, [dec.prefix + p], method="diffusion", max_new_tokens=16, steps=2)
        assert D.cut_body(ref.texts[0]) == f


def test_drafts_for_a_gemma4_target(dg, tmp_path):
    """`diffusion_draft` with a DiffusionGemma draft for a Gemma 4 target on the same vocabulary: the draft's encoder
    keeps the committed text in its own cache, its decoder fills a canvas of gamma noise positions; greedy output
    equals the target's AR output token for token (a chain of two self-conditioned forwards; an adaptive lattice
    tree), for prompts of mixed lengths in one batch."""
    from tests.helpers import VOCAB, make_hf_model

    make_hf_model("gemma4_moe", tmp_path / "t", seed=0)
    target = pdecode.load(tmp_path / "t", dtype="float32")
    _tiny(tmp_path / "d", vocab=VOCAB)
    draft = pdecode.load(tmp_path / "d", dtype="float32")
    prompts = [[5, 9, 13, 7, 21], list(range(3, 17)), [40, 41, 42, 7, 9]]
    ar = pdecode.generate(target, prompts, method="ar", max_new_tokens=12)
    for kw in (dict(gamma=4, steps=2), dict(gamma=3, tree_top_k=2, adaptive=True)):
        out = pdecode.generate(target, prompts, method="diffusion_draft", draft=draft, max_new_tokens=12, **kw)
        assert out.tokens == ar.tokens, kw
        assert out.stats["draft_forwards"] >= 1


def _dg_on(vocab: int, seed: int = 5):
    """A random DiffusionGemma (2 sliding layers of window 8 + 1 full, top-2 of 4 experts) on a given vocabulary."""
    from pdecode.config import ModelConfig
    from pdecode.model.transformer import init_params

    text = dict(vocab_size=vocab, hidden_size=32, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                intermediate_size=32, num_hidden_layers=3, layer_types=["sliding_attention"] * 2 + ["full_attention"],
                sliding_window=8, num_experts=4, top_k_experts=2, moe_intermediate_size=8, global_head_dim=32,
                num_global_key_value_heads=1, pad_token_id=0)
    cfg = config_from_hf({"model_type": "diffusion_gemma", "canvas_length": 8, "text_config": text})
    return pdecode.Model(cfg=cfg, params=init_params(cfg, jax.random.PRNGKey(seed), std=0.3), name="tiny-dg")


def test_block_drafter_sampling_is_lossless(small_vocab):  # noqa: F811
    """Sampled `diffusion_draft` with a DiffusionGemma draft (a chain of 3 from two self-conditioned forwards): the
    first tokens' marginals equal the target's exact AR marginals (chi-square over 12,000 samples). (Trees go
    through the same verifier, tested statistically with the masked drafter in tests/test_combos.py.)"""
    from tests.test_selfdraft import N_SAMPLES, PROMPT, _pvalues

    target, _ = small_vocab
    out = pdecode.generate(target, [PROMPT] * N_SAMPLES, method="diffusion_draft", draft=_dg_on(16), max_new_tokens=3,
                           temperature=1.0, seed=2, stop_at_eos=False, gamma=3, steps=2)
    assert out.stats["draft_forwards"] >= 1
    assert min(_pvalues(target, np.array(out.tokens), 3)) > 1e-4


def test_block_drafter_wrong_rule_is_rejected(small_vocab):  # noqa: F811
    """The same test rejects the block drafter's deterministic canvas verified as if drawn from a uniform q."""
    from pdecode.decode.diffusion_draft import BlockDiffusionDrafter
    from pdecode.decode.verify import Rule
    from tests.test_selfdraft import _OverAccepting, wrong_rule_pvalue

    target, _ = small_vocab
    d = _dg_on(16)
    drafter = _OverAccepting(BlockDiffusionDrafter(d.cfg, mask_id=0, shift=False, gamma=3), rule=Rule.CHAIN_SAMPLING)
    assert wrong_rule_pvalue(target, drafter, d.params) < 1e-6
