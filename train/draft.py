"""Distil a draft model for any supported base model (what ``method="sd"`` and ``"tree"`` need beside it).

    pdecode train draft --base DIR --data FILES... --out DIR [--layers N --hidden D] [--self-distill N]
    pdecode train draft --base DIR --data FILES... --out DIR --from-base-layers auto|I,J,... [--layers N]

The draft shares the base's tokenizer and architecture family, at a fraction of its depth and width (by default a
quarter of the layers, at least 2, and half the width; the shape of the zoo's code-draft next to code-target). It is
trained by soft cross-entropy against the frozen base's next-token distribution, computed on the fly, on the user's
text; ``--self-distill N`` makes half of every batch the base's own sampled continuations (N tokens), which is what
a draft sees at decode time. Same loop and save path as the zoo recipes (`train.zoo.fit_and_save_lm`).

``--from-base-layers`` starts the draft from the base itself instead of random weights: its embedding, final norm
and head, and the listed layers (``auto``: the first N-1 and the last, N = ``--layers``, default 4), at the base's
width; distillation then teaches the shortened stack to behave like the whole one.
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
                        tie_word_embeddings=True).with_run(activation_dtype=None)


FROM_BASE_LAYERS = 4  # a draft started from the base keeps this many of its layers unless --layers says


def base_layer_choice(base: ModelConfig, spec: str, layers: int | None = None) -> list[int]:
    """The base's layers a draft starts from: ``auto`` (the first N-1 and the last; N = ``layers`` or 4) or a
    comma-separated list of distinct layer indices in increasing order."""
    n_base = base.num_layers
    if spec == "auto":
        n = layers or FROM_BASE_LAYERS
        if not 1 <= n < n_base:
            raise InputError(f"--layers {n}: a draft from the base keeps 1 to {n_base - 1} of its {n_base} layers")
        return list(range(n - 1)) + [n_base - 1]
    try:
        idx = [int(x) for x in spec.split(",")]
    except ValueError:
        raise InputError(f"--from-base-layers takes auto or layer indices like 0,1,2,{n_base - 1}; got {spec!r}") \
            from None
    if not idx or any(not 0 <= i < n_base for i in idx) or sorted(set(idx)) != idx or len(idx) >= n_base:
        raise InputError(f"--from-base-layers {spec}: distinct increasing indices in 0..{n_base - 1}, fewer than the "
                         f"base's {n_base} layers")
    if layers is not None and layers != len(idx):
        raise InputError(f"--layers {layers} disagrees with --from-base-layers' {len(idx)} layers; give one of them")
    return idx


def draft_from_base(base: ModelConfig, params, idx: list[int]):
    """(draft config, params): the base's embedding, final norm, head and the layers ``idx`` (its width kept)."""
    if not isinstance(params.get("layers"), dict):
        raise InputError(f"--from-base-layers needs the base's layers stacked; a {base.family} model keeps them per "
                         "layer: train a draft of its own shape instead")
    import jax.numpy as jnp

    cfg = base.with_layers(len(idx)).with_run(activation_dtype=None)
    take = jnp.asarray(idx)
    return cfg, {**params, "layers": {k: jnp.take(v, take, axis=0) for k, v in params["layers"].items()}}


def train_draft(base: str, data_paths: list, out: Path, work: Path, steps: int = 1000, seq_len: int = 256,
                batch_size: int = 16, lr: float = 2e-3, self_distill: int = 0, mesh=None, fsdp: bool = False,
                accum: int = 1, compute_dtype: str | None = None, base_dtype: str = "auto", seed: int = 0,
                val_fraction: float = 0.05, command: str | None = None, from_base_layers: str | None = None,
                share_embedding: bool = False, draft_vocab: int = 0, **shape) -> dict:
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
    init = None
    if share_embedding and not from_base_layers:
        raise InputError("--share-embedding keeps the base's embedding, which needs the base's width: add "
                         "--from-base-layers")
    if from_base_layers:
        if any(shape.get(k) is not None for k in ("hidden", "heads", "kv_heads", "intermediate")):
            raise InputError("--from-base-layers keeps the base's width: drop --hidden / --heads / --kv-heads / "
                             "--intermediate")
        idx = base_layer_choice(m.cfg, from_base_layers, shape.get("layers"))
        cfg, init = draft_from_base(m.cfg, m.params, idx)
        print(f"draft from the base's layers {idx}", file=sys.stderr)
    else:
        cfg = draft_config(m.cfg, **shape)
    tc = TrainConfig(steps=steps, lr=lr, warmup=max(1, min(60, steps // 10)), eval_every=max(1, steps // 2),
                     ckpt_every=max(1, min(100, steps)), log_every=max(1, min(10, steps)), seed=seed, accum=accum,
                     compute_dtype=compute_dtype)
    tr, va = data.user_streams(m.tokenizer, data_paths, seq_len, val_fraction)
    note = held_out_note(len(tr), len(va), seq_len, val_fraction)
    if note:
        print(note, file=sys.stderr)
    vocab_cfg, vocab_info = None, {}
    if draft_vocab:  # EAGLE-3's reduced vocabulary, for a draft model: the most frequent tokens of the training data
        from pdecode.checkpoint.hf import DRAFT_VOCAB_KEY
        from pdecode.model.heads import most_frequent_tokens

        if not 0 < draft_vocab <= m.cfg.vocab_size:
            raise InputError(f"--draft-vocab must be in 1..{m.cfg.vocab_size} (the base's vocabulary), got "
                             f"{draft_vocab}")
        ids, cover = most_frequent_tokens(tr, draft_vocab, m.cfg.vocab_size)
        vocab_cfg = {DRAFT_VOCAB_KEY: [int(i) for i in ids]}
        vocab_info = {"draft_vocab": int(draft_vocab), "draft_vocab_coverage": round(cover, 4)}
        print(f"draft vocabulary: the {draft_vocab} most frequent tokens cover {cover:.1%} of the training tokens",
              file=sys.stderr)
    gen = None
    if self_distill:
        print(f"self-distillation: generating {self_distill} tokens with {base}", file=sys.stderr)
        gen = data.self_distillation_stream(m, tr, self_distill, batch=min(64, batch_size * 4),
                                            temperature=data.SELF_DISTILL_TEMPERATURE, seed=seed)
    shared = None
    if share_embedding:  # the base's embedding (and head, if untied) stays frozen and is not saved with the draft
        keys = tuple(k for k in ("embed", "lm_head") if k in init)
        shared = (str(Path(base).resolve()) if Path(str(base)).exists() else str(base), keys)
        print(f"the draft shares the base's {' and '.join(keys)} (frozen, read from the base at load)",
              file=sys.stderr)
    specs = {k: v for k, v in param_specs(cfg).items() if not shared or k not in shared[1]}
    mesh_plan = MeshPlan(mesh, specs, param_specs(m.cfg), fsdp) if mesh is not None else None
    out = Path(out)
    sig = hashlib.sha1(repr((cfg, tc, seq_len, batch_size, str(base), [str(p) for p in data_paths],
                             self_distill) + ((val_fraction,) if val_fraction != 0.05 else ())
                            + ((from_base_layers,) if from_base_layers else ())
                            + (("shared",) if share_embedding else ())
                        ).encode()).hexdigest()[:10]
    if command is None:
        command = command_line("pdecode train draft", base=base, data=data_paths, out=out, work=work, steps=steps,
                               seq_len=seq_len, batch_size=batch_size, lr=lr, seed=seed, val_fraction=val_fraction,
                               self_distill=self_distill, mesh=mesh, fsdp=fsdp, accum=accum,
                               compute_dtype=compute_dtype, base_dtype=base_dtype,
                               from_base_layers=from_base_layers, share_embedding=share_embedding,
                               draft_vocab=draft_vocab or None, **shape)
    extra = {"teacher": str(base), "self_distill_tokens": self_distill, "data": [str(p) for p in data_paths],
             **({"from_base_layers": idx} if from_base_layers else {}),
             **({"shared_with_base": list(shared[1])} if shared else {}), **vocab_info}
    return fit_and_save_lm(cfg, tc, seq_len, batch_size, tr, va, out, work / "ckpt" / f"draft-{out.name}-{sig}",
                           distill_loss(cfg, m.cfg), m.params, m.path, command, f"draft for {Path(str(base)).name}",
                           gen=gen, mesh_plan=mesh_plan, info_extra=extra, params=init, shared=shared,
                           extra_config=vocab_cfg)


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    ap = ArgumentParser(prog="pdecode train draft", description=__doc__, formatter_class=HelpFormatter)
    add_base_arguments(ap, "the draft", lr=2e-3)
    ap.add_argument("--steps", type=int, default=1000, help="training steps")
    ap.add_argument("--work", type=Path, default=Path("runs/draft"), help="checkpoints (a rerun resumes)")
    ap.add_argument("--self-distill", type=int, default=0, metavar="N",
                    help="half of every batch from N tokens of the base's own continuations")
    ap.add_argument("--from-base-layers", default=None, metavar="auto|I,J,...",
                    help="start from the base's own weights: these of its layers (auto: the first N-1 and the last, "
                         f"N = --layers, default {FROM_BASE_LAYERS}), its embedding and head, at its width")
    ap.add_argument("--share-embedding", action="store_true",
                    help="with --from-base-layers: keep the base's embedding (and head) frozen and read it from the "
                         "base at load instead of saving a copy (a real model's vocabulary is most of a small "
                         "draft's size)")
    ap.add_argument("--draft-vocab", type=int, default=0, metavar="N",
                    help="ship a reduced vocabulary with the draft: the N most frequent tokens of --data (its head "
                         "then reads only those rows when it drafts, as EAGLE-3's heads do; 0: the whole vocabulary)")
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
                       from_base_layers=args.from_base_layers, share_embedding=args.share_embedding,
                       draft_vocab=args.draft_vocab,
                       layers=args.layers, hidden=args.hidden,
                       heads=args.heads, kv_heads=args.kv_heads, intermediate=args.intermediate)


if __name__ == "__main__":
    main()
