"""Distil a draft model for any supported base model (what ``method="sd"`` and ``"tree"`` need beside it).

    pdecode train draft --base DIR --data FILES... --out DIR [--layers N --hidden D] [--self-distill N]

The draft shares the base's tokenizer and architecture family, at a fraction of its depth and width (by default a
quarter of the layers, at least 2, and half the width; the shape of the zoo's code-draft next to code-target). It is
trained by soft cross-entropy against the frozen base's next-token distribution, computed on the fly, on the user's
text; ``--self-distill N`` makes half of every batch the base's own sampled continuations (N tokens), which is what
a draft sees at decode time. Same loop and save path as the zoo recipes (`train.zoo.fit_and_save_lm`).
"""

from __future__ import annotations

import hashlib
import shlex
import sys
from pathlib import Path

from pdecode.cli_args import ArgumentParser
from pdecode.config import ModelConfig
from pdecode.errors import InputError
from train import data
from train.heads import HelpFormatter, add_base_arguments, check_base_arguments, command_line, held_out_note
from train.loop import TrainConfig
from train.objectives import distill_loss


def draft_config(base: ModelConfig, layers: int | None = None, hidden: int | None = None, heads: int | None = None,
                 kv_heads: int | None = None, intermediate: int | None = None) -> ModelConfig:
    """The draft's config: the base's family, vocab, RoPE and special tokens; by default a quarter of its layers (at
    least 2), half its width and heads (head_dim kept), three times the width as the MLP, tied embeddings."""
    heads = heads or max(1, base.num_heads // 2)
    kv_heads = kv_heads or max(1, min(heads, base.num_kv_heads // 2 or 1))
    hidden = hidden or max(64, base.hidden_size // 2)
    if heads % kv_heads:
        raise InputError(f"--heads {heads} must be a multiple of --kv-heads {kv_heads}")
    return base.with_layers(layers or max(2, base.num_layers // 4)).replace(hidden_size=hidden,
                        intermediate_size=intermediate or 3 * hidden, num_heads=heads, num_kv_heads=kv_heads,
                        tie_word_embeddings=True, activation_dtype=None)


def train_draft(base: str, data_paths: list, out: Path, work: Path, steps: int = 1000, seq_len: int = 256,
                batch_size: int = 16, lr: float = 2e-3, self_distill: int = 0, mesh=None, fsdp: bool = False,
                accum: int = 1, compute_dtype: str | None = None, base_dtype: str = "auto", seed: int = 0,
                val_fraction: float = 0.05, command: str | None = None, **shape) -> dict:
    """Distil a draft for ``base`` (an HF directory or zoo name) on the text files ``data_paths`` (the last
    ``val_fraction`` held out); writes an HF model directory ``out`` (bf16 weights, config.json, the base's
    tokenizer, train_info.json, which records ``command``: by default one with every option spelled out)."""
    import pdecode
    from pdecode.model.transformer import param_specs
    from train.loop import MeshPlan
    from train.zoo import fit_and_save_lm

    m = pdecode.load(base, dtype=base_dtype, mesh=mesh)
    if m.tokenizer is None or m.path is None:
        raise InputError(f"--base {base}: no tokenizer.json next to the weights; the draft shares the base's tokenizer")
    cfg = draft_config(m.cfg, **shape)
    tc = TrainConfig(steps=steps, lr=lr, warmup=max(1, min(60, steps // 10)), eval_every=max(1, steps // 2),
                     ckpt_every=max(1, min(100, steps)), log_every=max(1, min(10, steps)), seed=seed, accum=accum,
                     compute_dtype=compute_dtype)
    tr, va = data.user_streams(m.tokenizer, data_paths, seq_len, val_fraction)
    note = held_out_note(len(tr), len(va), seq_len, val_fraction)
    if note:
        print(note, file=sys.stderr)
    gen = None
    if self_distill:
        print(f"self-distillation: generating {self_distill} tokens with {base}", file=sys.stderr)
        gen = data.self_distillation_stream(m, tr, self_distill, batch=min(64, batch_size * 4),
                                            temperature=data.SELF_DISTILL_TEMPERATURE, seed=seed)
    mesh_plan = MeshPlan(mesh, param_specs(cfg), param_specs(m.cfg), fsdp) if mesh is not None else None
    out = Path(out)
    sig = hashlib.sha1(repr((cfg, tc, seq_len, batch_size, str(base), [str(p) for p in data_paths],
                             self_distill) + ((val_fraction,) if val_fraction != 0.05 else ())
                        ).encode()).hexdigest()[:10]
    if command is None:
        command = command_line("pdecode train draft", base=base, data=data_paths, out=out, work=work, steps=steps,
                               seq_len=seq_len, batch_size=batch_size, lr=lr, seed=seed, val_fraction=val_fraction,
                               self_distill=self_distill, mesh=mesh, fsdp=fsdp, accum=accum,
                               compute_dtype=compute_dtype, base_dtype=base_dtype, **shape)
    extra = {"teacher": str(base), "self_distill_tokens": self_distill, "data": [str(p) for p in data_paths]}
    return fit_and_save_lm(cfg, tc, seq_len, batch_size, tr, va, out, work / "ckpt" / f"draft-{out.name}-{sig}",
                           distill_loss(cfg, m.cfg), m.params, m.path, command, f"draft for {Path(str(base)).name}",
                           gen=gen, mesh_plan=mesh_plan, info_extra=extra)


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    ap = ArgumentParser(prog="pdecode train draft", description=__doc__, formatter_class=HelpFormatter)
    add_base_arguments(ap, "the draft", lr=2e-3)
    ap.add_argument("--steps", type=int, default=1000, help="training steps")
    ap.add_argument("--work", type=Path, default=Path("runs/draft"), help="checkpoints (a rerun resumes)")
    ap.add_argument("--self-distill", type=int, default=0, metavar="N",
                    help="half of every batch from N tokens of the base's own continuations")
    g = ap.add_argument_group("the draft's shape (defaults: see above)")
    for flag in ("layers", "hidden", "heads", "kv-heads", "intermediate"):
        g.add_argument(f"--{flag}", type=int, default=None)
    args = ap.parse_args(argv)
    if not args.base:
        ap.error("--base DIR is required (the model the draft drafts for)")
    check_base_arguments(ap, args)
    from pdecode.sharding import mesh_from_spec

    mesh = mesh_from_spec(args.mesh) if args.mesh else None
    return train_draft(args.base, args.data, args.out, args.work, steps=args.steps, seq_len=args.seq_len,
                       batch_size=args.batch_size, lr=args.lr,
                       self_distill=args.self_distill, mesh=mesh, fsdp=args.fsdp, accum=args.accum,
                       compute_dtype=args.compute_dtype, base_dtype=args.base_dtype, seed=args.seed,
                       val_fraction=args.val_fraction, command=f"{ap.prog} {shlex.join(argv)}",
                       layers=args.layers, hidden=args.hidden, heads=args.heads, kv_heads=args.kv_heads,
                       intermediate=args.intermediate)


if __name__ == "__main__":
    main()
