"""The zoo's masked-diffusion model ``code-dllm``: a bidirectional Llama-style network on the zoo tokenizer,
trained with the masked-diffusion objective on the zoo corpus and, as SFT, on the checkable task set.

    python -m train.dllm                 # one stage: 1000 steps of 16 x 288 tokens, about 40 minutes on 2 CPU cores
    bash scripts/train_dllm.sh           # the shipped model: four stages (about 2 hours), see that script

Later stages start from an earlier one (``--init-from``) and may change the row length, batch, task kinds and
learning rate (``--seq``, ``--batch``, ``--task-kinds``, ``--lr``); each eval also decodes 64 held-out task items
and reports their exact-answer accuracy.

Each batch mixes corpus windows (every token maskable) and task examples ``prompt + answer + EOS fill`` (only the
response maskable) whose response length varies (16..256 tokens), so the model learns to close an answer with EOS
at any generation length; the EOS fill after the first EOS is down-weighted (0.05) so it does not drown the
answer tokens.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from pdecode.checkpoint.hf import save_hf
from pdecode.model.transformer import init_params
from train import data, tasks
from train.loop import TrainConfig, train
from train.objectives import masked_diffusion_loss
from train.zoo import _cfg, ensure_tokenizer, token_streams

NAME = "code-dllm"
CFG = _cfg(hidden_size=256, intermediate_size=512, num_layers=4, num_heads=4, num_kv_heads=2, head_dim=64,
           causal=False)
TC = TrainConfig(steps=1000, lr=2e-3, warmup=60, eval_every=250, ckpt_every=125, log_every=10, seed=7)
SEQ = 288
BATCH = 16
SFT_FRACTION = 0.875
RESPONSE_LENGTHS = (16, 32, 64, 128, 256)
EOS_FILL_WEIGHT = 0.05  # loss weight of the EOS fill after an answer's first EOS


class MixedBatches:
    """Batch i (deterministic in i): SFT task examples and corpus windows, as (tokens, maskable, lengths,
    weights)."""

    def __init__(self, tok, stream: np.ndarray, items: list, seed: int, seq: int = SEQ, batch: int = BATCH,
                 sft_fraction: float = SFT_FRACTION, response_lengths=RESPONSE_LENGTHS):
        self.stream, self.seed = stream, seed
        self.seq, self.bs, self.sft_fraction, self.response_lengths = seq, batch, sft_fraction, response_lengths
        self.eos = tok.token_to_id(data.EOT)
        self.items = [(tok.encode(it.prompt, add_special_tokens=False).ids,
                       tok.encode(it.answer, add_special_tokens=False).ids) for it in items]

    def batch(self, i: int):
        rng = np.random.default_rng([self.seed, i])
        seq, bs = self.seq, self.bs
        toks = np.full((bs, seq), self.eos, np.int32)
        maskable = np.zeros((bs, seq), bool)
        lengths = np.full((bs,), seq, np.int32)
        weights = np.ones((bs, seq), np.float32)
        n_sft = int(round(bs * self.sft_fraction))
        for r in range(bs):
            if r < n_sft:
                p, a = self.items[rng.integers(len(self.items))]
                resp = max(int(rng.choice(self.response_lengths)), len(a) + 1)
                n = min(len(p) + resp, seq)
                toks[r, : len(p)] = p
                toks[r, len(p): len(p) + len(a)] = a
                maskable[r, len(p): n] = True
                lengths[r] = n
                weights[r, len(p) + len(a) + 1:] = EOS_FILL_WEIGHT
            else:
                s = rng.integers(0, len(self.stream) - seq)
                toks[r] = self.stream[s: s + seq]
                maskable[r] = True
        return toks, maskable, lengths, weights


ACC_ITEMS = 64  # held-out task items decoded at each eval (one-token-per-step sampler, 32 new tokens)


def task_accuracy(params, tok, items) -> dict:
    """Exact-answer accuracy on held-out task items, decoded with the vanilla low-confidence sampler."""
    from pdecode.api import Model, generate
    from pdecode.tokenizer import Tokenizer

    eos = tok.token_to_id(data.EOT)
    m = Model(CFG, params, Tokenizer(tok, bos_id=CFG.bos_token_id, eos_ids=(eos,), pad_id=CFG.pad_token_id,
                                     mask_id=CFG.mask_token_id), name=NAME)
    out = generate(m, [it.prompt for it in items], method="diffusion", max_new_tokens=32, block_length=32,
                   steps=32)
    return {"heldout_task_accuracy": sum(tasks.score(it, t) for it, t in zip(items, out.texts)) / len(items)}


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m train.dllm", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--zoo", type=Path, default=None)
    ap.add_argument("--work", type=Path, default=Path("runs/zoo"))
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--init-from", type=Path, default=None,
                    help="start from this model's weights (a second stage of training on top of a first)")
    ap.add_argument("--seq", type=int, default=SEQ, help=f"tokens per row (default {SEQ})")
    ap.add_argument("--batch", type=int, default=BATCH, help=f"rows per step (default {BATCH})")
    ap.add_argument("--sft-fraction", type=float, default=SFT_FRACTION,
                    help=f"share of rows that are task examples, the rest corpus windows (default {SFT_FRACTION})")
    ap.add_argument("--response-lengths", type=int, nargs="+", default=list(RESPONSE_LENGTHS),
                    help="response lengths a task example is padded to with EOS (one drawn per row)")
    ap.add_argument("--task-kinds", nargs="+", default=list(tasks.KINDS), choices=tasks.KINDS, metavar="KIND",
                    help=f"task kinds to train on (default: all, {' '.join(tasks.KINDS)})")
    ap.add_argument("--lr", type=float, default=None, help=f"peak learning rate (default {TC.lr})")
    ap.add_argument("--warmup", type=int, default=None, help=f"warmup steps (default {TC.warmup})")
    args = ap.parse_args(argv)
    if not 0.0 <= args.sft_fraction <= 1.0:
        ap.error(f"--sft-fraction must be in [0, 1], got {args.sft_fraction}")
    if args.seq < 16 or args.seq > CFG.max_position_embeddings:
        ap.error(f"--seq must be in [16, {CFG.max_position_embeddings}], got {args.seq}")
    seq, bs, frac, resp_lengths = args.seq, args.batch, args.sft_fraction, tuple(args.response_lengths)
    from pdecode.api import zoo_dir

    zoo = args.zoo or zoo_dir()
    tc = dataclasses.replace(TC, **{k: v for k, v in (("steps", args.steps), ("lr", args.lr),
                                                      ("warmup", args.warmup)) if v is not None})
    tok = ensure_tokenizer(zoo)
    tr, va = token_streams(tok, args.work / "data")
    train_items, heldout = tasks.split(kinds=tuple(args.task_kinds))
    batches = MixedBatches(tok, tr, train_items, tc.seed, seq, bs, frac, resp_lengths)
    val = MixedBatches(tok, va, heldout, 12345, seq, bs, frac, resp_lengths)
    loss = masked_diffusion_loss(CFG, mask_id=CFG.mask_token_id)
    val_batches = [jax.tree.map(jnp.asarray, val.batch(j)) for j in range(4)]
    eval_loss = jax.jit(lambda p, b, k: loss(p, None, b, k)[0])

    def eval_fn(params):
        out = {"val_diffusion_loss": float(np.mean([float(eval_loss(params, b, jax.random.PRNGKey(j)))
                                                    for j, b in enumerate(val_batches)]))}
        out.update(task_accuracy(params, tok, heldout[:ACC_ITEMS]))
        return out

    params = init_params(CFG, jax.random.PRNGKey(tc.seed))
    stages = []
    if args.init_from:
        from pdecode.checkpoint.hf import load_hf

        _, init = load_hf(args.init_from)
        params = jax.tree.map(jnp.asarray, init)
        prev = args.init_from / "train_info.json"
        if prev.exists():
            stages = json.loads(prev.read_text()).get("stages", []) or [json.loads(prev.read_text())]
    print(f"{NAME}: {CFG.num_params() / 1e6:.2f}M params (bidirectional), {tc.steps} steps of {bs}x{seq}, "
          f"{frac:.0%} task SFT / rest corpus", file=sys.stderr)
    kinds = tuple(args.task_kinds)
    sig = hashlib.sha1(repr((CFG, tc, seq, bs, frac, resp_lengths, EOS_FILL_WEIGHT, str(args.init_from), len(stages))
                            + ((kinds,) if kinds != tasks.KINDS else ())).encode()).hexdigest()[:10]
    t0 = time.perf_counter()
    params, hist = train(loss, params, None, batches.batch, tc,
                         ckpt_dir=args.work / "ckpt" / f"{NAME}-{sig}", eval_fn=eval_fn, desc=NAME,
                         tokens_per_step=bs * seq)
    wall = time.perf_counter() - t0
    out = zoo / NAME
    save_hf(CFG.replace(dtype="bfloat16"), params, out, dtype="bfloat16", tokenizer_dir=zoo / "code-target",
            compress=True)
    command = "python -m train.dllm" + "".join(f" {a}" for a in (argv if argv is not None else sys.argv[1:]))
    info = {"name": NAME, "command": command, "params": CFG.num_params(), "steps": hist["last_step"],
            "train_minutes_this_run": round(wall / 60, 2), "evals": hist["eval"],
            "loss_curve": {"step": hist["step"], "loss": hist["loss"]}, "train_config": dataclasses.asdict(tc),
            "seq_len": seq, "batch_size": bs, "sft_fraction": frac,
            "response_lengths": resp_lengths, "eos_fill_weight": EOS_FILL_WEIGHT,
            "task_kinds": list(kinds), "task_items": {"train": len(train_items), "heldout": len(heldout)}}
    info["stages"] = [{k: v for k, v in st.items() if k != "stages"} for st in stages] + [
        {k: v for k, v in info.items() if k not in ("loss_curve",)}]
    info["train_minutes_total"] = round(sum(st.get("train_minutes_this_run", 0) for st in info["stages"]), 2)
    (out / "train_info.json").write_text(json.dumps(info, indent=1) + "\n")
    print(f"{NAME}: done in {wall / 60:.1f} min -> {out}", file=sys.stderr)


if __name__ == "__main__":
    main()
