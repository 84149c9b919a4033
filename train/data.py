"""The zoo corpus (Python standard library sources), its deterministic split, the tokenizer, and batches.

Corpus: every ``*.py`` file under the running interpreter's stdlib, minus test folders and site-packages.
Split: file level, by a hash of the path relative to the stdlib root (about 4% of files go to validation), so the
split is the same on every machine with the same Python version. Validation files are the benchmark prompts.
"""

from __future__ import annotations

import hashlib
import sysconfig
from pathlib import Path

import numpy as np

from pdecode.errors import InputError

EOT, PAD, MASK = "<|endoftext|>", "<|pad|>", "<|mask|>"
SPECIAL_TOKENS = [EOT, PAD, MASK]
_SKIP_DIRS = {"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__", "turtledemo"}
VAL_PERCENT = 4


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def corpus_files(root: Path | None = None) -> list[Path]:
    root = root or stdlib_root()
    out = []
    for p in sorted(root.rglob("*.py")):
        rel = p.relative_to(root)
        if any(part in _SKIP_DIRS or part.startswith("test_") for part in rel.parts[:-1]):
            continue
        if rel.name.startswith("test_"):
            continue
        out.append(p)
    return out


def is_validation(rel_path: str) -> bool:
    h = int(hashlib.sha1(rel_path.encode()).hexdigest(), 16)
    return h % 100 < VAL_PERCENT


def split_files(root: Path | None = None) -> tuple[list[Path], list[Path]]:
    root = root or stdlib_root()
    train, val = [], []
    for p in corpus_files(root):
        (val if is_validation(str(p.relative_to(root))) else train).append(p)
    return train, val


def read_text(p: Path) -> str:
    return p.read_text(encoding="utf-8", errors="replace")


def train_tokenizer(files: list[Path], vocab_size: int = 4096):
    """Byte-level BPE (`tokenizers`), special tokens first: <|endoftext|>=0, <|pad|>=1, <|mask|>=2."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS, min_frequency=2,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator((read_text(p) for p in files), trainer=trainer)
    return tok


def tokenizer_config() -> dict:
    return {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": EOT, "eos_token": EOT, "pad_token": PAD,
            "mask_token": MASK, "model_max_length": 1024, "clean_up_tokenization_spaces": False}


def encode_files(tok, files: list[Path]) -> np.ndarray:
    """One token stream: each file's tokens followed by <|endoftext|>."""
    eot = tok.token_to_id(EOT)
    encs = tok.encode_batch([read_text(p) for p in files], add_special_tokens=False)
    parts = []
    for e in encs:
        parts.append(np.asarray(e.ids, np.int32))
        parts.append(np.asarray([eot], np.int32))
    return np.concatenate(parts) if parts else np.zeros((0,), np.int32)


def user_files(paths: list) -> list[Path]:
    """Text files for training from ``paths``: files as given, directories walked (every regular file, sorted;
    hidden ones skipped). Errors name what is wrong."""
    out: list[Path] = []
    for p in map(Path, paths):
        if p.is_dir():
            out += sorted(f for f in p.rglob("*") if f.is_file() and not any(x.startswith(".") for x in f.parts))
        elif p.is_file():
            out.append(p)
        else:
            raise InputError(f"--data {p}: no such file or directory")
    if not out:
        raise InputError(f"--data {' '.join(map(str, paths))}: no files found")
    return out


def user_streams(tok, paths: list, seq_len: int, val_fraction: float = 0.05) -> tuple[np.ndarray, np.ndarray]:
    """(train, validation) token streams of user text files, tokenized with ``tok`` (a `pdecode.Tokenizer`), each
    file followed by the tokenizer's end-of-sequence id, and of `pdecode train data` directories (each example's
    prompt and answer ids, ended by that id too: `train.chat_data`); the last ``val_fraction`` of the stream (at least
    two windows) is held out."""
    from train import chat_data

    sep = tok.eos_ids[0] if tok.eos_ids else None
    dirs = [p for p in map(Path, paths) if chat_data.is_data_dir(p)]
    parts = [x for d in dirs for x in chat_data.token_parts(d, tuple(tok.eos_ids or ()))]
    texts = [p for p in paths if Path(p) not in dirs]
    files = user_files(texts) if texts or not dirs else []
    for ids in tok.encode_batch([read_text(f) for f in files], add_special_tokens=False) if files else []:
        parts.append(np.asarray(ids + ([sep] if sep is not None else []), np.int32))
    stream = np.concatenate(parts) if parts else np.zeros((0,), np.int32)
    n_val = max(int(len(stream) * val_fraction), 2 * (seq_len + 1))
    if len(stream) - n_val <= 2 * (seq_len + 1):
        raise InputError(f"--data: {len(stream)} tokens in {len(parts)} file(s) or examples is too little to train on "
                         f"windows of {seq_len + 1} tokens with a held-out part (need more than "
                         f"{n_val + 2 * (seq_len + 1)}); add text or lower --seq-len")
    return stream[:-n_val], stream[-n_val:]


def eval_batches(windows: np.ndarray, batch: int = 8) -> list[np.ndarray]:
    """The held-out ``windows`` in batches of ``batch`` (a remainder dropped, so every batch has one shape), or all
    of them as one batch when there are fewer than ``batch``: a metric averaged over these is never empty (nan)
    while any window exists."""
    if len(windows) < batch:
        return [windows] if len(windows) else []
    return [windows[i: i + batch] for i in range(0, len(windows) - batch + 1, batch)]


class TokenBatches:
    """Random windows of ``seq_len + 1`` tokens from a stream; batch ``i`` depends only on (seed, i)."""

    def __init__(self, stream: np.ndarray, seq_len: int, batch_size: int, seed: int = 0):
        if len(stream) <= seq_len + 1:
            raise ValueError(f"token stream of {len(stream)} tokens is shorter than one window ({seq_len + 1})")
        self.stream, self.seq_len, self.batch_size, self.seed = stream, seq_len, batch_size, seed

    def batch(self, i: int, rows: slice | None = None) -> np.ndarray:
        """Batch ``i``; ``rows``: only those rows of it (one process's share of a multi-process run)."""
        rng = np.random.default_rng([self.seed, i])
        starts = rng.integers(0, len(self.stream) - self.seq_len - 1, size=self.batch_size)
        return np.stack([self.stream[s: s + self.seq_len + 1] for s in starts[rows or slice(None)]])

    def fixed_eval(self, n_windows: int) -> np.ndarray:
        """Non-overlapping consecutive windows from the start (deterministic eval set)."""
        n = min(n_windows, (len(self.stream) - 1) // (self.seq_len + 1))
        return np.stack([self.stream[i * (self.seq_len + 1): (i + 1) * (self.seq_len + 1)] for i in range(n)])


def validation_prompts(tok, n: int, prompt_tokens: int, root: Path | None = None, offset_tokens: int = 0) -> list[list[int]]:
    """Prompts of exactly ``prompt_tokens`` tokens cut from validation files (one per file, in path order)."""
    _, val = split_files(root)
    out = []
    for p in val:
        ids = tok.encode(read_text(p), add_special_tokens=False).ids
        if len(ids) >= offset_tokens + prompt_tokens + 64:
            out.append(ids[offset_tokens: offset_tokens + prompt_tokens])
        if len(out) == n:
            break
    return out


def self_distillation_stream(model, stream: np.ndarray, n_tokens: int, prompt_len: int = 64, new_tokens: int = 192,
                             batch: int = 32, temperature: float = 1.0, seed: int = 0) -> np.ndarray:
    """Text generated by the target itself (for heads trained on the target's own distribution): continuations
    of random corpus windows, each ``prompt + generation`` followed by <|endoftext|>, until ``n_tokens``."""
    import pdecode

    rng = np.random.default_rng(seed)
    eot = int(model.cfg.eos_token_ids[0]) if model.cfg.eos_token_ids else 0
    parts, total, i = [], 0, 0
    while total < n_tokens:
        starts = rng.integers(0, len(stream) - prompt_len, size=batch)
        prompts = [stream[s: s + prompt_len].tolist() for s in starts]
        out = pdecode.generate(model, prompts, max_new_tokens=new_tokens, temperature=temperature, seed=seed + i,
                               stop_at_eos=False)
        for p, t in zip(prompts, out.tokens):
            seq = np.asarray(p + t + [eot], np.int32)
            parts.append(seq)
            total += len(seq)
        i += 1
    return np.concatenate(parts)[:n_tokens]


SELF_DISTILL_TEMPERATURE = 0.8


def self_distilled(zoo: Path, work: Path, base: str, stream: np.ndarray, n: int) -> np.ndarray:
    """``n`` tokens of ``base``'s own continuations of corpus windows, cached under ``work/data`` so every recipe
    that asks for the same amount shares them."""
    import sys
    import time

    import pdecode

    f = Path(work) / "data" / f"selfdistill-{base}-{n}-t{SELF_DISTILL_TEMPERATURE}-b64-mixed.npy"
    if f.exists():
        return np.load(f)
    t0 = time.perf_counter()
    # the shipped bf16 weights as bf16 matmul operands (float32 activations): faster than upcast weights on CPU
    # (docs/performance_code_notes.md)
    model = pdecode.load(Path(zoo) / base, dtype="bfloat16", activation_dtype="float32")
    out = self_distillation_stream(model, stream, n, batch=64, temperature=SELF_DISTILL_TEMPERATURE)
    f.parent.mkdir(parents=True, exist_ok=True)
    np.save(f, out)
    print(f"self-distillation: {len(out)} tokens generated by {base} in {time.perf_counter() - t0:.0f}s",
          file=sys.stderr)
    return out
