"""A tiny DiffusionGemma-layout model trained here (``dg-tiny``): the block-diffusion encoder-decoder of
`pdecode.model.families.diffusion_gemma` at 4096 tokens of vocabulary (the zoo tokenizer), trained from scratch
with pdecode's diffusion objective adapted to that layout (`train.objectives.block_diffusion_loss`), so that the
samplers' confidence is a model's, not noise.

    python -m train.block_dllm                       # -> runs/dg-tiny (~17 min on 2 CPU cores)
    python -m train.block_dllm --steps 600 --out DIR

Each row is one canvas to denoise after a prefix: a task item (the zoo's short and long kinds; the long ones'
answers span several canvases) cut at a canvas boundary of its answer, or a corpus window cut anywhere. The prefix
goes through the causal encoder (teacher forcing: the gold earlier canvases, as the sampler commits them); the
canvas, corrupted at a rate t ~ U(0, 1) by the sampler's noise (random tokens, no mask token; in half of the rows
the pad token, what pdecode's sampler feeds at temperature 0), through the bidirectional decoder, half the rows
self-conditioned on a first pass's temperature-scaled logits.

Not a model to use for its answers: it is 2M parameters trained for minutes. It exists so that the block-diffusion
samplers (the reference entropy-bound sampler, Fast-dLLM, DiCo inside canvases) can be compared on a model whose
confidence varies by position (`infer/diffusion_bench.py`, docs/diffusion_results.md "DiffusionGemma").
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from pdecode.model.family import config_from_hf
from pdecode.model.transformer import active_params, num_params
from pdecode.checkpoint.hf import save_hf
from pdecode.cli_args import ArgumentParser
from pdecode.config import ModelConfig
from pdecode.model.transformer import init_params
from train import tasks
from train.dllm import TaskBatches
from train.loop import TrainConfig, train
from train.objectives import block_diffusion_loss
from train.zoo import VOCAB, ensure_tokenizer, token_streams

NAME = "dg-tiny"
EOS_FILL_WEIGHT = 0.05  # loss weight of the EOS fill after an answer's first EOS
PAD_NOISE_RATE = 0.5  # rows noised with the pad token (greedy decoding's noise) instead of random tokens


def tiny_config(canvas: int = 32, window: int = 64, vocab: int = VOCAB, layers: int = 4, hidden: int = 128,
                eos: int | None = 0) -> ModelConfig:
    """``layers`` (sliding of ``window``, the last full with keys as values), hidden 128, top-2 of 4 experts."""
    text = dict(vocab_size=vocab, hidden_size=hidden, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                intermediate_size=2 * hidden, num_hidden_layers=layers,
                layer_types=["sliding_attention"] * (layers - 1) + ["full_attention"], sliding_window=window,
                num_experts=4, top_k_experts=2, moe_intermediate_size=hidden, global_head_dim=64,
                num_global_key_value_heads=1, max_position_embeddings=1024, rms_norm_eps=1e-6,
                bos_token_id=0, eos_token_id=eos, pad_token_id=1)
    return config_from_hf({"model_type": "diffusion_gemma", "canvas_length": canvas, "text_config": text})


@dataclasses.dataclass(frozen=True)
class Recipe:
    tc: TrainConfig
    prefix: int = 256  # encoder tokens per row (prompt + earlier canvases), right-padded
    batch: int = 16
    task_fraction: float = 0.75  # the rest: corpus windows
    long_fraction: float = 0.5  # of the task rows


RECIPE = Recipe(tc=TrainConfig(steps=800, lr=2e-3, warmup=40, eval_every=200, ckpt_every=100, log_every=10,
                               seed=11))


class CanvasBatches(TaskBatches):
    """Batch i (deterministic in i): (prefix [B, P], prefix_len [B], canvas [B, L], weights [B, L])."""

    def __init__(self, tok, stream: np.ndarray, items: list, seed: int, prefix: int, canvas: int, batch: int,
                 task_fraction: float, long_fraction: float):
        super().__init__(tok, stream, items, seed)
        self.P, self.L, self.bs = prefix, canvas, batch
        self.task_fraction, self.long_fraction = task_fraction, long_fraction

    def batch(self, i: int):
        rng = self._rng(i)
        P, L, bs = self.P, self.L, self.bs
        pre = np.full((bs, P), self.eos, np.int32)
        plen = np.zeros((bs,), np.int32)
        can = np.full((bs, L), self.eos, np.int32)
        w = np.ones((bs, L), np.float32)
        n_task = int(round(bs * self.task_fraction))
        n_long = int(round(n_task * self.long_fraction))
        fresh = [self._encode(it) for it in tasks.long_items(random.Random(f"{self.seed}-{i}"), n_long)]
        for r in range(bs):
            if r < n_task:
                p, a = fresh[r] if r < n_long else self.items[rng.integers(len(self.items))]
                a = list(a) + [self.eos]
                k = int(rng.integers(0, -(-len(a) // L)))  # a canvas of the answer
                head = (list(p) + a[: k * L])[-P:]
                body = a[k * L: (k + 1) * L]
                pre[r, : len(head)], plen[r] = head, len(head)
                can[r, : len(body)] = body
                w[r, len(body):] = EOS_FILL_WEIGHT
            else:
                n = int(rng.integers(1, P + 1))
                s = int(rng.integers(0, len(self.stream) - n - L))
                pre[r, :n], plen[r] = self.stream[s: s + n], n
                can[r] = self.stream[s + n: s + n + L]
        return pre, plen, can, w


def heldout_jsonl(path: Path, n: int) -> Path:
    """The first ``n`` held-out long-task items as a bench items file ({"prompt", "answer"} per line)."""
    _, heldout = tasks.split_long()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps({"prompt": it.prompt, "answer": it.answer}) + "\n" for it in heldout[:n]))
    return path


def main(argv=None):
    ap = ArgumentParser(prog="python -m train.block_dllm", description=__doc__,
                        formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--zoo", type=Path, default=None, help="where the tokenizer is (default: the shipped zoo)")
    ap.add_argument("--work", type=Path, default=Path("runs/zoo"), help="data cache and checkpoints")
    ap.add_argument("--out", type=Path, default=Path("runs") / NAME)
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--batch", type=int, default=None)
    ap.add_argument("--canvas", type=int, default=32, help="canvas_length")
    ap.add_argument("--eval-every", type=int, default=None)
    args = ap.parse_args(argv)
    r = RECIPE
    tc = dataclasses.replace(r.tc, **{k: v for k, v in (("steps", args.steps), ("eval_every", args.eval_every))
                                      if v is not None})
    bs = args.batch or r.batch
    if tc.steps < 1 or bs < 1 or args.canvas < 4:
        ap.error("need --steps >= 1, --batch >= 1, --canvas >= 4")
    from pdecode.api import zoo_dir

    zoo = args.zoo or zoo_dir()
    cfg = tiny_config(args.canvas)
    tok = ensure_tokenizer(zoo)
    tr, va = token_streams(tok, args.work / "data")
    train_items, _ = tasks.split()
    batches = CanvasBatches(tok, tr, train_items, tc.seed, r.prefix, cfg.arch.canvas_length, bs, r.task_fraction,
                            r.long_fraction)
    val = CanvasBatches(tok, va, tasks.split()[1], tc.seed + 1, r.prefix, cfg.arch.canvas_length, bs, r.task_fraction,
                        r.long_fraction)
    loss = block_diffusion_loss(cfg, pad_rate=PAD_NOISE_RATE)
    val_loss = jax.jit(lambda p, b, k: loss(p, None, b, k)[0])

    def eval_fn(params):  # the same corruption every call: comparable across evals
        vals = [float(val_loss(params, tuple(map(jnp.asarray, val.batch(j))), jax.random.PRNGKey(j)))
                for j in range(4)]
        return {"val_loss": float(np.mean(vals))}

    params = init_params(cfg, jax.random.PRNGKey(tc.seed))
    print(f"{NAME}: {num_params(cfg) / 1e6:.2f}M params ({active_params(cfg) / 1e6:.2f}M active), canvas "
          f"{cfg.arch.canvas_length}, {tc.steps} steps of {bs} canvases after prefixes of up to {r.prefix}",
          file=sys.stderr)
    t0 = time.perf_counter()
    params, hist = train(loss, params, None, batches.batch, tc, ckpt_dir=None, eval_fn=eval_fn, desc=NAME,
                         tokens_per_step=bs * (r.prefix + cfg.arch.canvas_length))
    wall = time.perf_counter() - t0
    save_hf(cfg, params, args.out, dtype="float32", tokenizer_dir=zoo / "code-target")
    # the sampler's defaults, where the reference reads them
    gen = json.loads((args.out / "generation_config.json").read_text())
    gen.update(max_denoising_steps=cfg.arch.canvas_length, t_min=0.4, t_max=0.8, stability_threshold=1,
               confidence_threshold=0.005, sampler_config={"entropy_bound": 0.1})
    (args.out / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
    command = "python -m train.block_dllm" + "".join(f" {a}" for a in (argv if argv is not None else sys.argv[1:]))
    info = {"name": NAME, "command": command, "params": num_params(cfg), "active_params": active_params(cfg),
            "steps": hist["last_step"], "train_minutes": round(wall / 60, 2), "evals": hist["eval"],
            "loss_curve": {"step": hist["step"], "loss": hist["loss"]}, "train_config": dataclasses.asdict(tc),
            "batch": bs, "prefix": r.prefix, "canvas": cfg.arch.canvas_length, "eos_fill_weight": EOS_FILL_WEIGHT,
            "pad_noise_rate": PAD_NOISE_RATE}
    (args.out / "train_info.json").write_text(json.dumps(info, indent=1) + "\n")
    last = hist["eval"][-1] if hist["eval"] else {}
    print(f"{NAME}: done in {wall / 60:.1f} min -> {args.out}; validation loss {last.get('val_loss', float('nan')):.3f}"
          f" (uniform {np.log(VOCAB):.3f})", file=sys.stderr)


if __name__ == "__main__":
    main()
