"""Recipes for the shipped models, trained here on 2 CPU cores.

    python -m train.zoo                      # tokenizer + code-target + code-draft (distilled); run time:
                                             # docs/performance_code_notes.md
    python -m train.zoo --only code-draft    # one model (the tokenizer is reused when present)
    python -m train.zoo --time-step          # seconds per training step of each recipe, nothing trained

Each model lands in ``zoo/<name>/`` in HF format (bf16 safetensors, config.json, tokenizer files) with a
``train_info.json`` recording the command, steps, tokens seen, wall time and validation loss.
"""

from __future__ import annotations

import argparse
import hashlib
import dataclasses
import json
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from pdecode.model.transformer import num_params
from pdecode.checkpoint.hf import save_hf
from pdecode.cli_args import ArgumentParser
from pdecode.config import ModelConfig
from pdecode.model.transformer import init_params, unembed
from train import data
from train.loop import TrainConfig, time_step, train
from train.objectives import causal_hidden, cross_entropy, distill_loss, lm_loss

VOCAB = 4096
CONTEXT = 1024


def _cfg(**kw) -> ModelConfig:
    base = dict(vocab_size=VOCAB, family="llama", max_position_embeddings=CONTEXT, rope_theta=10000.0,
                rms_norm_eps=1e-5, tie_word_embeddings=True, bos_token_id=0, eos_token_ids=(0,), pad_token_id=1,
                mask_token_id=2)
    base.update(kw)
    return ModelConfig(**base)


@dataclasses.dataclass
class Recipe:
    cfg: ModelConfig
    tc: TrainConfig
    seq_len: int
    batch_size: int
    teacher: str | None = None  # distil from this zoo model instead of plain next-token training
    self_distill: int = 0  # train on this many tokens the teacher generated itself (half the batches)
    init_from: str | None = None  # continual training: start from this zoo model's weights
    exit_layer: int = 0  # > 0: the LayerSkip objective (layer dropout + early-exit loss up to this layer)


RECIPES: dict[str, Recipe] = {
    # ~4.6M params: 6 layers x 256, GQA 4 query / 2 kv heads, trained on 512-token windows.
    "code-target": Recipe(
        _cfg(hidden_size=256, intermediate_size=512, num_layers=6, num_heads=4, num_kv_heads=2, head_dim=64),
        TrainConfig(steps=850, lr=2e-3, warmup=60, eval_every=425, ckpt_every=100, log_every=10, seed=0),
        seq_len=512, batch_size=8),
    # ~0.92M params: 2 layers x 128, same tokenizer, distilled from code-target (soft labels computed on the
    # fly): a draft should imitate its target, not the data.
    "code-draft": Recipe(
        _cfg(hidden_size=128, intermediate_size=384, num_layers=2, num_heads=2, num_kv_heads=1, head_dim=64),
        TrainConfig(steps=480, lr=3e-3, warmup=30, eval_every=120, ckpt_every=60, log_every=10, seed=1),
        seq_len=512, batch_size=16, teacher="code-target", self_distill=1_500_000),
    # code-target trained on with LayerSkip's recipe (layer dropout rising to 0.1, early-exit losses up to layer 3):
    # its first 3 layers + the shared head become the `layerskip` draft; no extra parameters.
    "code-target-layerskip": Recipe(
        _cfg(hidden_size=256, intermediate_size=512, num_layers=6, num_heads=4, num_kv_heads=2, head_dim=64),
        TrainConfig(steps=300, lr=5e-4, warmup=20, eval_every=150, ckpt_every=50, log_every=10, seed=2),
        seq_len=512, batch_size=8, init_from="code-target", exit_layer=3),
}


def tokenizer_dir(zoo: Path) -> Path:
    return zoo / "code-target"


def ensure_tokenizer(zoo: Path, retrain: bool = False):
    from tokenizers import Tokenizer

    d = tokenizer_dir(zoo)
    f = d / "tokenizer.json"
    if f.exists() and not retrain:
        return Tokenizer.from_file(str(f))
    train_files, _ = data.split_files()
    t0 = time.perf_counter()
    tok = data.train_tokenizer(train_files, VOCAB)
    d.mkdir(parents=True, exist_ok=True)
    tok.save(str(f))
    (d / "tokenizer_config.json").write_text(json.dumps(data.tokenizer_config(), indent=2) + "\n")
    print(f"tokenizer: {tok.get_vocab_size()} tokens trained in {time.perf_counter() - t0:.1f}s", file=sys.stderr)
    return tok


def token_streams(tok, cache_dir: Path):
    """(train stream, validation stream), cached as .npy under ``cache_dir``."""
    cache_dir.mkdir(parents=True, exist_ok=True)
    paths = cache_dir / "train.npy", cache_dir / "val.npy"
    vocab_sig = cache_dir / "tokenizer.sig"
    sig = hashlib.sha1(tok.to_str().encode()).hexdigest()
    if all(p.exists() for p in paths) and vocab_sig.exists() and vocab_sig.read_text() == sig:
        return np.load(paths[0]), np.load(paths[1])
    train_files, val_files = data.split_files()
    tr, va = data.encode_files(tok, train_files), data.encode_files(tok, val_files)
    np.save(paths[0], tr)
    np.save(paths[1], va)
    vocab_sig.write_text(sig)
    return tr, va


def make_eval(cfg: ModelConfig, val_windows: np.ndarray, batch: int = 8):
    @jax.jit
    def ce_batch(params, w):
        h, _ = causal_hidden(params, cfg, w[:, :-1])
        return cross_entropy(unembed(params, cfg, h), w[:, 1:])

    def eval_fn(params):
        vals = [float(ce_batch(params, jnp.asarray(w))) for w in data.eval_batches(val_windows, batch)]
        return {"val_loss": float(np.mean(vals))}

    return eval_fn


def _objective(r: Recipe, zoo: Path):
    """(objective, frozen) of a recipe: plain LM, or distillation from the teacher's shipped weights."""
    if r.exit_layer:
        from train.objectives import layerskip_loss

        return layerskip_loss(r.cfg, r.exit_layer), None
    if not r.teacher:
        return lm_loss(r.cfg), None
    from pdecode.checkpoint.hf import load_hf

    t_cfg, t_params = load_hf(zoo / r.teacher)
    return distill_loss(r.cfg, t_cfg), jax.tree.map(jnp.asarray, t_params)


def time_recipe_step(name: str, zoo: Path, repeats: int = 5) -> dict:
    """Seconds per training step of a recipe (random tokens of its batch shape; the teacher from ``zoo``)."""
    r = RECIPES[name]
    objective, frozen = _objective(r, zoo)
    batch = np.random.default_rng(0).integers(0, r.cfg.vocab_size, (r.batch_size, r.seq_len + 1), dtype=np.int32)
    res = time_step(objective, init_params(r.cfg, jax.random.PRNGKey(r.tc.seed)), frozen, batch, r.tc, repeats)
    print(f"{name}: {res['step_s']:.3f} s per step of {r.batch_size}x{r.seq_len} tokens (median of {repeats}; "
          f"first step with compile {res['first_step_s']:.1f} s) -> {r.tc.steps} steps ~"
          f"{res['step_s'] * r.tc.steps / 60:.1f} min", file=sys.stderr)
    return res


def fit_and_save_lm(cfg: ModelConfig, tc: TrainConfig, seq_len: int, batch_size: int, tr: np.ndarray, va: np.ndarray,
                    out: Path, ckpt_dir: Path, objective, frozen, tokenizer_dir: Path, command: str, desc: str,
                    gen: np.ndarray | None = None, mesh_plan=None, info_extra: dict | None = None,
                    params=None, shared: tuple[str, tuple[str, ...]] | None = None,
                    extra_config: dict | None = None) -> dict:
    """Train an LM (plain next-token, or distilled from the frozen teacher ``frozen`` by ``objective``) and save it in
    HF format (bf16) with a train_info.json: the one path the zoo recipes and `pdecode train draft` take. ``gen``
    (the teacher's own continuations): half of every batch comes from it, what a draft sees at decode time.
    ``shared`` = (teacher's name, param names): those params are the teacher's own (``frozen``), never trained, and
    the saved model reads them from the teacher at load (`pdecode.checkpoint.hf.save_hf`). ``extra_config``: more
    config.json keys (a draft's reduced vocabulary)."""
    batches = data.TokenBatches(tr, seq_len, batch_size, seed=tc.seed)
    batch_fn = batches.batch
    if gen is not None:
        g = data.TokenBatches(gen, seq_len, batch_size // 2, seed=tc.seed + 1)
        corpus = data.TokenBatches(tr, seq_len, batch_size - batch_size // 2, seed=tc.seed)
        batch_fn = lambda i: np.concatenate([corpus.batch(i), g.batch(i)])  # noqa: E731
    val_windows = data.TokenBatches(va, seq_len, 1).fixed_eval(10_000)
    eval_fn = make_eval(cfg, val_windows)
    if params is None:
        params = init_params(cfg, jax.random.PRNGKey(tc.seed))
    print(f"{desc}: {num_params(cfg) / 1e6:.2f}M params, {tc.steps} steps of {batch_size}x{seq_len} tokens, train "
          f"stream {len(tr)} tokens, validation {len(val_windows)} windows", file=sys.stderr)
    t0 = time.perf_counter()
    keys = tuple(shared[1]) if shared else ()
    if keys:  # train the rest; the shared params enter every forward from the frozen teacher
        params = {k: v for k, v in params.items() if k not in keys}
        whole = lambda p, f: {**p, **{k: f[k] for k in keys}}  # noqa: E731
        inner_objective, inner_eval = objective, eval_fn
        objective = lambda p, f, batch, rng: inner_objective(whole(p, f), f, batch, rng)  # noqa: E731
        eval_fn = lambda p: inner_eval(whole(p, frozen))  # noqa: E731
    params, hist = train(objective, params, frozen, batch_fn, tc, ckpt_dir=ckpt_dir, eval_fn=eval_fn, desc=desc,
                         mesh_plan=mesh_plan)
    wall = time.perf_counter() - t0
    if keys:
        params = {**params, **{k: frozen[k] for k in keys}}
        eval_fn = inner_eval
    save_hf(cfg.replace(dtype="bfloat16"), jax.device_get(params), out, dtype="bfloat16", tokenizer_dir=tokenizer_dir,
            shared=shared, extra_config=extra_config)
    # Validation loss of the weights as shipped (bf16), which is what users load.
    from pdecode.checkpoint.hf import load_hf

    _, shipped = load_hf(out)
    info = {
        "name": out.name,
        "command": command,
        "params": num_params(cfg),
        "steps": hist["last_step"],
        "tokens_seen": int(hist["last_step"] * batch_size * seq_len),
        "train_tokens": int(len(tr)),
        "train_minutes_this_run": round(wall / 60, 2),
        "val_loss": eval_fn(jax.tree.map(jnp.asarray, shipped))["val_loss"],
        "val_loss_fp32": hist["eval"][-1]["val_loss"] if hist["eval"] else None,
        "loss_curve": {"step": hist["step"], "loss": hist["loss"]},
        "evals": hist["eval"],
        "train_config": dataclasses.asdict(tc),
        "seq_len": seq_len,
        "batch_size": batch_size,
        "python": sys.version.split()[0],
        **(info_extra or {}),
    }
    (out / "train_info.json").write_text(json.dumps(info, indent=1) + "\n")
    print(f"{desc}: validation loss {info['val_loss']:.4f} (bf16 weights), {wall / 60:.1f} min -> {out}",
          file=sys.stderr)
    return info


def train_model(name: str, zoo: Path, work: Path, steps: int | None = None) -> dict:
    r = RECIPES[name]
    tc = dataclasses.replace(r.tc, steps=steps) if steps else r.tc
    tok = ensure_tokenizer(zoo)
    tr, va = token_streams(tok, work / "data")
    gen = data.self_distilled(zoo, work, r.teacher, tr, r.self_distill) if r.self_distill else None
    objective, frozen = _objective(r, zoo)
    # checkpoints are keyed by the recipe, so a changed recipe never resumes from another one's state
    sig = hashlib.sha1(repr((r.cfg, tc, r.seq_len, r.batch_size, r.teacher, r.self_distill, r.init_from,
                             r.exit_layer)).encode()).hexdigest()[:10]
    params = None
    if r.init_from:  # continual training from a shipped model (its bf16 weights, trained on in float32)
        from pdecode.checkpoint.hf import load_hf

        _, p0 = load_hf(zoo / r.init_from)
        params = jax.tree.map(lambda a: jnp.asarray(a, jnp.float32), p0)
    extra = {"corpus": "Python stdlib sources (tests excluded), validation = files with sha1(path) % 100 < 4",
             "teacher": r.teacher, "self_distill_tokens": r.self_distill, "init_from": r.init_from,
             "exit_layer": r.exit_layer}
    info = fit_and_save_lm(r.cfg, tc, r.seq_len, r.batch_size, tr, va, zoo / name, work / "ckpt" / f"{name}-{sig}",
                           objective, frozen, tokenizer_dir(zoo), f"python -m train.zoo --only {name}",
                           name + (f" (distilled from {r.teacher})" if r.teacher else ""), gen=gen, info_extra=extra,
                           params=params)
    if name not in PLAIN:
        compress_weights(zoo / name)
    return info


PLAIN = ("code-target", "code-draft")  # the HF pair stays plain safetensors; later models are stored xz-compressed


def compress_weights(model_dir: Path) -> None:
    """model.safetensors -> model.safetensors.xz (stdlib lzma; pdecode reads either)."""
    import lzma

    f = model_dir / "model.safetensors"
    (model_dir / "model.safetensors.xz").write_bytes(lzma.compress(f.read_bytes(), preset=9))
    f.unlink()


def main(argv=None):
    ap = ArgumentParser(prog="python -m train.zoo", description=__doc__,
                        formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", action="append", choices=sorted(RECIPES), help="train only these models")
    ap.add_argument("--zoo", type=Path, default=None, help="output folder (default: the repository's zoo/)")
    ap.add_argument("--work", type=Path, default=Path("runs/zoo"), help="checkpoints and token cache")
    ap.add_argument("--steps", type=int, default=None, help="override the recipe's step count (smoke runs)")
    ap.add_argument("--retrain-tokenizer", action="store_true")
    ap.add_argument("--time-step", action="store_true",
                    help="only time one training step of each recipe (median of 5) and print the projected time")
    args = ap.parse_args(argv)
    from pdecode.api import zoo_dir

    zoo = args.zoo or zoo_dir()
    if args.time_step:
        return {name: time_recipe_step(name, zoo) for name in args.only or list(RECIPES)}
    t0 = time.perf_counter()
    ensure_tokenizer(zoo, retrain=args.retrain_tokenizer)
    for name in args.only or list(RECIPES):
        train_model(name, zoo, args.work, args.steps)
    print(f"zoo: done in {(time.perf_counter() - t0) / 60:.1f} min", file=sys.stderr)


if __name__ == "__main__":
    main()
