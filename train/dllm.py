"""The zoo's masked-diffusion model ``code-dllm``, adapted from the AR model ``code-target`` (the default recipe), or
trained from scratch (the earlier recipe, kept reproducible).

    python -m train.dllm                     # the shipped model: code-target -> code-dllm (recipe ar-init)
    python -m train.dllm --recipe scratch    # the earlier from-scratch model (one stage; scripts/train_dllm.sh
                                             # --scratch runs its four stages; run time:
                                             # docs/performance_code_notes.md)

**ar-init** adapts an AR model the way Dream and DiffuLLaMA do: the weights start as ``code-target``'s; the logits
keep the AR shift (the hidden state at i predicts the token at i + 1, so every weight keeps its role: a masked
position is predicted from the position before it); the attention is annealed from causal to bidirectional over the
first ``anneal_steps`` (each key after a query becomes visible with a probability rising linearly from 0 to 1); the
objective is the masked-diffusion loss. Batches mix corpus windows (a random visible prefix, the rest maskable: the
continuation task), the long task kinds (answers of 41-126 tokens) and the short ones, each task padded with EOS to
a canvas drawn from the lengths samplers run at (128, 256), so an answer closes with EOS wherever it ends.

Each eval reports the masked-diffusion bound on the validation windows' NLL and the exact and per-position accuracy
of held-out long-task items; at the end the bound of the shipped (bf16) weights is measured beside code-target's AR
cross-entropy on the same validation windows (``train_info.json``).
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import random
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from pdecode.model.transformer import num_params
from pdecode.checkpoint.hf import load_hf, save_hf
from pdecode.cli_args import ArgumentParser
from pdecode.model.transformer import init_params
from train import data, tasks
from train.loop import TrainConfig, train
from train.objectives import diffusion_nll_bound, masked_diffusion_loss
from train.zoo import RECIPES as AR_RECIPES
from train.zoo import _cfg, ensure_tokenizer, make_eval, token_streams

NAME = "code-dllm"
EOS_FILL_WEIGHT = 0.05  # loss weight of the EOS fill after an answer's first EOS


@dataclasses.dataclass(frozen=True)
class Recipe:
    cfg: object
    tc: TrainConfig
    seq: int
    batch: int
    sft_fraction: float  # share of rows that are task examples (the rest: corpus windows)
    long_fraction: float  # share of rows that are long-kind task examples (part of the sft rows)
    response_lengths: tuple[int, ...]  # canvas lengths a task answer is padded to with EOS (one drawn per row)
    init_from: str | None = None  # zoo model whose weights start the run
    anneal_steps: int = 0  # steps over which the attention opens from causal to bidirectional
    corpus_prefix: float = 0.0  # corpus rows: a visible prefix of up to this share of the row


RECIPES = {
    "ar-init": Recipe(
        cfg=AR_RECIPES["code-target"].cfg.replace(causal=False, diffusion_shift=True),
        tc=TrainConfig(steps=2800, lr=4e-4, warmup=40, eval_every=700, ckpt_every=100, log_every=10, seed=7),
        seq=384, batch=8, sft_fraction=0.625, long_fraction=0.5, response_lengths=(128, 256),
        init_from="code-target", anneal_steps=400, corpus_prefix=0.5),
    "scratch": Recipe(
        cfg=_cfg(hidden_size=256, intermediate_size=512, num_layers=4, num_heads=4, num_kv_heads=2, head_dim=64,
                 causal=False),
        tc=TrainConfig(steps=1000, lr=2e-3, warmup=60, eval_every=250, ckpt_every=125, log_every=10, seed=7),
        seq=288, batch=16, sft_fraction=0.875, long_fraction=0.0, response_lengths=(16, 32, 64, 128, 256)),
}


class TaskBatches:
    """What the diffusion models' batch makers share: the tokenizer, a corpus stream, task items encoded once, the
    EOS id, and a generator per batch index (batch i is deterministic in i)."""

    def __init__(self, tok, stream: np.ndarray, items: list, seed: int):
        self.stream, self.seed, self.tok = stream, seed, tok
        self.eos = tok.token_to_id(data.EOT)
        self.items = [self._encode(it) for it in items]

    def _encode(self, it):
        return tasks.encode_item(self.tok, it)

    def _rng(self, i: int) -> np.random.Generator:
        return np.random.default_rng([self.seed, i])


class MixedBatches(TaskBatches):
    """Batch i (deterministic in i): task examples and corpus windows, as (tokens, maskable, lengths, weights).

    Task rows hold ``prompt + answer + EOS fill`` with only the response maskable; ``long_fraction`` of the rows
    are fresh long-kind items (`train.tasks.long_items`, never a held-out prompt), the other task rows draw from
    ``items``. Corpus rows are windows of ``stream``, maskable after a visible prefix of up to ``corpus_prefix``
    of the row (0: maskable everywhere)."""

    def __init__(self, tok, stream: np.ndarray, items: list, seed: int, seq: int, batch: int, sft_fraction: float,
                 response_lengths, long_fraction: float = 0.0, corpus_prefix: float = 0.0):
        super().__init__(tok, stream, items, seed)
        self.seq, self.bs, self.sft_fraction, self.response_lengths = seq, batch, sft_fraction, response_lengths
        self.long_fraction, self.corpus_prefix = long_fraction, corpus_prefix

    def batch(self, i: int):
        rng = self._rng(i)
        seq, bs = self.seq, self.bs
        toks = np.full((bs, seq), self.eos, np.int32)
        maskable = np.zeros((bs, seq), bool)
        lengths = np.full((bs,), seq, np.int32)
        weights = np.ones((bs, seq), np.float32)
        n_sft = int(round(bs * self.sft_fraction))
        n_long = min(int(round(bs * self.long_fraction)), n_sft)
        fresh = [self._encode(it) for it in tasks.long_items(random.Random(f"{self.seed}-{i}"), n_long)]
        for r in range(bs):
            if r < n_sft:
                p, a = fresh[r] if r < n_long else self.items[rng.integers(len(self.items))]
                fits = [x for x in self.response_lengths if x > len(a)] or [len(a) + 1]
                resp = int(rng.choice(fits))
                n = min(len(p) + resp, seq)
                toks[r, : len(p)] = p
                toks[r, len(p): len(p) + len(a)] = a[: seq - len(p)]
                maskable[r, len(p): n] = True
                lengths[r] = n
                weights[r, len(p) + len(a) + 1:] = EOS_FILL_WEIGHT
            else:
                s = rng.integers(0, len(self.stream) - seq)
                toks[r] = self.stream[s: s + seq]
                keep = int(rng.integers(0, int(self.corpus_prefix * seq) + 1))
                maskable[r, keep:] = True
        return toks, maskable, lengths, weights


def openness(step: int, anneal_steps: int) -> float:
    """Attention openness at a training step: 0 (causal) rising linearly to 1 (bidirectional)."""
    return 1.0 if anneal_steps <= 0 else min(step / anneal_steps, 1.0)


ACC_ITEMS = 32  # held-out long-task items decoded at each eval


def _model(cfg, params, tok):
    from pdecode.api import Model
    from pdecode.tokenizer import Tokenizer

    eos = tok.token_to_id(data.EOT)
    return Model(cfg, params, Tokenizer(tok, bos_id=cfg.bos_token_id, eos_ids=(eos,), pad_id=cfg.pad_token_id,
                                        mask_id=cfg.mask_token_id), name=NAME)


def task_accuracy(cfg, params, tok, items, prefix: str = "heldout_long") -> dict:
    """Exact and per-position accuracy on held-out task items (Fast-dLLM threshold 0.9, 32-token blocks, a
    128-token canvas: cheap enough to run at every eval)."""
    from pdecode.api import generate

    out = generate(_model(cfg, params, tok), [it.prompt for it in items], method="diffusion", max_new_tokens=128,
                   block_length=32, rule="threshold", threshold=0.9)
    return {f"{prefix}_accuracy": float(np.mean([tasks.score(it, t) for it, t in zip(items, out.texts)])),
            f"{prefix}_position_accuracy": float(np.mean([tasks.position_score(it, t, tok)
                                                          for it, t in zip(items, out.texts)]))}


def validation_bound(cfg, params, windows: np.ndarray, batch: int = 8, levels: int = 8) -> float:
    """The masked-diffusion NLL bound (nats per token) on validation windows, the same masks every call."""
    nll = jax.jit(diffusion_nll_bound(cfg, cfg.mask_token_id, shift=cfg.diffusion_shift, levels=levels))
    vals = [float(nll(params, jnp.asarray(windows[i: i + batch]), jax.random.PRNGKey(i)))
            for i in range(0, len(windows) - batch + 1, batch)]
    return float(np.mean(vals))


def main(argv=None):
    ap = ArgumentParser(prog="python -m train.dllm", description=__doc__,
                        formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--recipe", choices=sorted(RECIPES), default="ar-init",
                    help="ar-init: adapt code-target (the shipped model); scratch: the earlier from-scratch model")
    ap.add_argument("--zoo", type=Path, default=None)
    ap.add_argument("--work", type=Path, default=Path("runs/zoo"))
    ap.add_argument("--out", type=Path, default=None, help="where the model goes (default: zoo/code-dllm)")
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--init-from", type=Path, default=None,
                    help="start from this model directory's weights instead of the recipe's (a later stage)")
    ap.add_argument("--seq", type=int, default=None, help="tokens per row")
    ap.add_argument("--batch", type=int, default=None, help="rows per step")
    ap.add_argument("--sft-fraction", type=float, default=None,
                    help="share of rows that are task examples, the rest corpus windows")
    ap.add_argument("--long-fraction", type=float, default=None, help="share of rows that are long-kind tasks")
    ap.add_argument("--response-lengths", type=int, nargs="+", default=None,
                    help="response lengths a task example is padded to with EOS (one drawn per row)")
    ap.add_argument("--task-kinds", nargs="+", default=list(tasks.KINDS), choices=tasks.KINDS, metavar="KIND",
                    help=f"short task kinds to train on (default: all, {' '.join(tasks.KINDS)})")
    ap.add_argument("--lr", type=float, default=None, help="peak learning rate")
    ap.add_argument("--warmup", type=int, default=None, help="warmup steps")
    ap.add_argument("--anneal-steps", type=int, default=None, help="steps from causal to bidirectional attention")
    ap.add_argument("--eval-every", type=int, default=None)
    ap.add_argument("--time-budget-min", type=float, default=None, help="stop (and ship) after this many minutes")
    args = ap.parse_args(argv)
    r = RECIPES[args.recipe]
    over = {k: v for k, v in (("seq", args.seq), ("batch", args.batch), ("sft_fraction", args.sft_fraction),
                              ("long_fraction", args.long_fraction), ("anneal_steps", args.anneal_steps),
                              ("response_lengths", tuple(args.response_lengths) if args.response_lengths else None))
            if v is not None}
    tc = dataclasses.replace(r.tc, **{k: v for k, v in (
        ("steps", args.steps), ("lr", args.lr), ("warmup", args.warmup), ("eval_every", args.eval_every),
        ("time_budget_s", args.time_budget_min * 60 if args.time_budget_min else None)) if v is not None})
    r = dataclasses.replace(r, tc=tc, **over)
    if not 0.0 <= r.sft_fraction <= 1.0 or not 0.0 <= r.long_fraction <= r.sft_fraction:
        ap.error("need 0 <= --long-fraction <= --sft-fraction <= 1")
    if r.seq < 16 or r.seq > r.cfg.max_position_embeddings:
        ap.error(f"--seq must be in [16, {r.cfg.max_position_embeddings}], got {r.seq}")
    from pdecode.api import zoo_dir

    zoo = args.zoo or zoo_dir()
    cfg = r.cfg
    tok = ensure_tokenizer(zoo)
    tr, va = token_streams(tok, args.work / "data")
    kinds = tuple(args.task_kinds)
    train_items, heldout = tasks.split(kinds=kinds)
    _, heldout_long = tasks.split_long()
    batches = MixedBatches(tok, tr, train_items, tc.seed, r.seq, r.batch, r.sft_fraction, r.response_lengths,
                           r.long_fraction, r.corpus_prefix)

    def batch_fn(step):
        b = batches.batch(step)
        return b + (np.float32(openness(step, r.anneal_steps)),) if r.anneal_steps else b

    loss = masked_diffusion_loss(cfg, mask_id=cfg.mask_token_id, shift=cfg.diffusion_shift)
    val_windows = data.TokenBatches(va, r.seq - 1, 1).fixed_eval(10_000)  # windows of r.seq tokens

    def eval_fn(params):
        out = {"val_nll_bound": validation_bound(cfg, params, val_windows[:32], levels=4)}
        out.update(task_accuracy(cfg, params, tok, heldout_long[:ACC_ITEMS]))
        return out

    init_dir = args.init_from or (zoo / r.init_from if r.init_from else None)
    stages = []
    if init_dir is not None:
        _, init = load_hf(init_dir)
        params = jax.tree.map(lambda a: jnp.asarray(a, jnp.float32), init)
        prev = Path(init_dir) / "train_info.json"
        if args.init_from and prev.exists():
            stages = json.loads(prev.read_text()).get("stages", []) or [json.loads(prev.read_text())]
    else:
        params = init_params(cfg, jax.random.PRNGKey(tc.seed))
    print(f"{NAME} ({args.recipe}): {num_params(cfg) / 1e6:.2f}M params, from "
          f"{init_dir or 'random init'}, {tc.steps} steps of {r.batch}x{r.seq}, task rows {r.sft_fraction:.0%} "
          f"(long {r.long_fraction:.0%}), attention annealed over {r.anneal_steps} steps", file=sys.stderr)
    sig = hashlib.sha1(repr((args.recipe, r, str(init_dir), len(stages))
                            + ((kinds,) if kinds != tasks.KINDS else ())).encode()).hexdigest()[:10]
    t0 = time.perf_counter()
    params, hist = train(loss, params, None, batch_fn, tc, ckpt_dir=args.work / "ckpt" / f"{NAME}-{sig}",
                         eval_fn=eval_fn, desc=NAME, tokens_per_step=r.batch * r.seq)
    wall = time.perf_counter() - t0
    out = args.out or zoo / NAME
    save_hf(cfg.replace(dtype="bfloat16"), params, out, dtype="bfloat16", tokenizer_dir=zoo / "code-target",
            compress=True)
    command = "python -m train.dllm" + "".join(f" {a}" for a in (argv if argv is not None else sys.argv[1:]))
    info = {"name": NAME, "recipe": args.recipe, "command": command, "params": num_params(cfg),
            "init_from": str(init_dir) if init_dir else None, "steps": hist["last_step"],
            "stopped_early": hist["stopped_early"], "train_minutes_this_run": round(wall / 60, 2),
            "tokens_seen": int(hist["last_step"] * r.batch * r.seq), "evals": hist["eval"],
            "loss_curve": {"step": hist["step"], "loss": hist["loss"]}, "train_config": dataclasses.asdict(tc),
            "seq_len": r.seq, "batch_size": r.batch, "sft_fraction": r.sft_fraction,
            "long_fraction": r.long_fraction, "response_lengths": list(r.response_lengths),
            "anneal_steps": r.anneal_steps, "corpus_prefix": r.corpus_prefix, "eos_fill_weight": EOS_FILL_WEIGHT,
            "task_kinds": list(kinds) + (list(tasks.LONG_KINDS) if r.long_fraction else []),
            "task_items": {"train": len(train_items), "heldout": len(heldout), "heldout_long": len(heldout_long)}}
    # the shipped (bf16) weights on the validation windows, beside the AR model's cross-entropy on the same windows
    _, shipped = load_hf(out)
    shipped = jax.tree.map(jnp.asarray, shipped)
    info["val_nll_bound"] = validation_bound(cfg, shipped, val_windows[:64])
    info["val_windows"] = {"count": int(min(len(val_windows), 64)), "tokens": r.seq}
    ar_cfg, ar_params = load_hf(zoo / "code-target")
    info["code_target_val_ce"] = make_eval(ar_cfg, val_windows[:64])(jax.tree.map(jnp.asarray, ar_params))["val_loss"]
    info.update(task_accuracy(cfg, shipped, tok, heldout_long[:128], prefix="shipped_heldout_long"))
    info["stages"] = [{k: v for k, v in st.items() if k != "stages"} for st in stages] + [
        {k: v for k, v in info.items() if k not in ("loss_curve",)}]
    info["train_minutes_total"] = round(sum(st.get("train_minutes_this_run", 0) for st in info["stages"]), 2)
    (out / "train_info.json").write_text(json.dumps(info, indent=1) + "\n")
    print(f"{NAME}: done in {wall / 60:.1f} min -> {out}; validation NLL bound {info['val_nll_bound']:.3f} nats/token "
          f"(code-target AR CE on the same windows {info['code_target_val_ce']:.3f}); held-out long tasks exact "
          f"{info['shipped_heldout_long_accuracy']:.3f}, per position {info['shipped_heldout_long_position_accuracy']:.3f}",
          file=sys.stderr)


if __name__ == "__main__":
    main()
