"""The zoo's masked-diffusion model ``code-dllm``: a bidirectional Llama-style network on the zoo tokenizer,
trained with the masked-diffusion objective on the zoo corpus and, as SFT, on the checkable task set.

    python -m train.dllm                 # about 30 minutes on 2 CPU cores

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

    def __init__(self, tok, stream: np.ndarray, items: list, seed: int):
        self.stream, self.seed = stream, seed
        self.eos = tok.token_to_id(data.EOT)
        self.items = [(tok.encode(it.prompt, add_special_tokens=False).ids,
                       tok.encode(it.answer, add_special_tokens=False).ids) for it in items]

    def batch(self, i: int):
        rng = np.random.default_rng([self.seed, i])
        toks = np.full((BATCH, SEQ), self.eos, np.int32)
        maskable = np.zeros((BATCH, SEQ), bool)
        lengths = np.full((BATCH,), SEQ, np.int32)
        weights = np.ones((BATCH, SEQ), np.float32)
        n_sft = int(round(BATCH * SFT_FRACTION))
        for r in range(BATCH):
            if r < n_sft:
                p, a = self.items[rng.integers(len(self.items))]
                resp = max(int(rng.choice(RESPONSE_LENGTHS)), len(a) + 1)
                n = min(len(p) + resp, SEQ)
                toks[r, : len(p)] = p
                toks[r, len(p): len(p) + len(a)] = a
                maskable[r, len(p): n] = True
                lengths[r] = n
                weights[r, len(p) + len(a) + 1:] = EOS_FILL_WEIGHT
            else:
                s = rng.integers(0, len(self.stream) - SEQ)
                toks[r] = self.stream[s: s + SEQ]
                maskable[r] = True
        return toks, maskable, lengths, weights


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m train.dllm", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--zoo", type=Path, default=None)
    ap.add_argument("--work", type=Path, default=Path("runs/zoo"))
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--init-from", type=Path, default=None,
                    help="start from this model's weights (a second stage of training on top of a first)")
    args = ap.parse_args(argv)
    from pdecode.api import zoo_dir

    zoo = args.zoo or zoo_dir()
    tc = dataclasses.replace(TC, steps=args.steps) if args.steps else TC
    tok = ensure_tokenizer(zoo)
    tr, va = token_streams(tok, args.work / "data")
    train_items, heldout = tasks.split()
    batches = MixedBatches(tok, tr, train_items, tc.seed)
    val = MixedBatches(tok, va, heldout, 12345)
    loss = masked_diffusion_loss(CFG, mask_id=CFG.mask_token_id)
    val_batches = [jax.tree.map(jnp.asarray, val.batch(j)) for j in range(4)]
    eval_loss = jax.jit(lambda p, b, k: loss(p, None, b, k)[0])

    def eval_fn(params):
        return {"val_diffusion_loss": float(np.mean([float(eval_loss(params, b, jax.random.PRNGKey(j)))
                                                     for j, b in enumerate(val_batches)]))}

    params = init_params(CFG, jax.random.PRNGKey(tc.seed))
    stages = []
    if args.init_from:
        from pdecode.checkpoint.hf import load_hf

        _, init = load_hf(args.init_from)
        params = jax.tree.map(jnp.asarray, init)
        prev = args.init_from / "train_info.json"
        if prev.exists():
            stages = json.loads(prev.read_text()).get("stages", []) or [json.loads(prev.read_text())]
    print(f"{NAME}: {CFG.num_params() / 1e6:.2f}M params (bidirectional), {tc.steps} steps of {BATCH}x{SEQ}, "
          f"{SFT_FRACTION:.0%} task SFT / rest corpus", file=sys.stderr)
    sig = hashlib.sha1(repr((CFG, tc, SEQ, BATCH, SFT_FRACTION, RESPONSE_LENGTHS, EOS_FILL_WEIGHT,
                             str(args.init_from), len(stages))).encode()).hexdigest()[:10]
    t0 = time.perf_counter()
    params, hist = train(loss, params, None, batches.batch, tc,
                         ckpt_dir=args.work / "ckpt" / f"{NAME}-{sig}", eval_fn=eval_fn, desc=NAME,
                         tokens_per_step=BATCH * SEQ)
    wall = time.perf_counter() - t0
    out = zoo / NAME
    save_hf(CFG.replace(dtype="bfloat16"), params, out, dtype="bfloat16", tokenizer_dir=zoo / "code-target")
    command = "python -m train.dllm" + (f" --init-from {args.init_from} --steps {tc.steps}" if args.init_from else "")
    info = {"name": NAME, "command": command, "params": CFG.num_params(), "steps": hist["last_step"],
            "train_minutes_this_run": round(wall / 60, 2), "evals": hist["eval"],
            "loss_curve": {"step": hist["step"], "loss": hist["loss"]}, "train_config": dataclasses.asdict(tc),
            "seq_len": SEQ, "batch_size": BATCH, "sft_fraction": SFT_FRACTION,
            "response_lengths": RESPONSE_LENGTHS, "eos_fill_weight": EOS_FILL_WEIGHT,
            "task_items": {"train": len(train_items), "heldout": len(heldout)}}
    info["stages"] = [{k: v for k, v in st.items() if k != "stages"} for st in stages] + [
        {k: v for k, v in info.items() if k not in ("loss_curve",)}]
    info["train_minutes_total"] = round(sum(st.get("train_minutes_this_run", 0) for st in info["stages"]), 2)
    (out / "train_info.json").write_text(json.dumps(info, indent=1) + "\n")
    print(f"{NAME}: done in {wall / 60:.1f} min -> {out}", file=sys.stderr)


if __name__ == "__main__":
    main()
