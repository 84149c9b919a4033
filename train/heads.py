"""Drafting heads: the zoo's recipes, or heads for your own base model, all trained with the one loop and
objectives module (`pdecode train heads` and `python -m train.heads` are the same command).

    pdecode train heads --only code-target-medusa        # one recipe
    pdecode train heads --self-distill 1500000           # every head recipe on the frozen code-target, trained on
                                                         # 1.5M tokens code-target generated itself (as shipped)
    pdecode train heads --only code-target-mtp           # the target trained natively with an MTP module
    pdecode train heads --base DIR --kind eagle --data FILES... --out DIR    # heads for your own base

Target hidden states are computed on the fly in each step (nothing is dumped to disk). Each result lands in
``zoo/<name>/`` (heads.json + heads.safetensors, or a full model for the native MTP one) with a train_info.json.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import shlex
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from pdecode.model.transformer import num_params
from pdecode.checkpoint.heads_io import save_heads
from pdecode.cli_args import ArgumentParser
from pdecode.errors import InputError
from pdecode.checkpoint.hf import load_hf, save_hf
from pdecode.model import heads as H
from pdecode.model.transformer import init_from_specs, init_params, unembed
from train import data
from train.loop import TrainConfig, train
from train.objectives import causal_hidden, eagle_loss, exit_loss, medusa_loss, mtp_loss
from train.zoo import RECIPES as LM_RECIPES
from train.zoo import ensure_tokenizer, make_eval, token_streams


@dataclasses.dataclass
class HeadRecipe:
    kind: str  # medusa | eagle | mtp | mtp-native
    hcfg: object
    tc: TrainConfig
    seq_len: int = 256
    batch_size: int = 16
    ttt_steps: int = 1  # EAGLE-3 training-time test depth
    base: str = "code-target"


RECIPES: dict[str, HeadRecipe] = {
    "code-target-medusa": HeadRecipe(
        "medusa", H.MedusaConfig(num_heads=4, num_layers=1),
        TrainConfig(steps=500, lr=3e-3, warmup=30, eval_every=250, ckpt_every=100, log_every=10, seed=2)),
    "code-target-eagle": HeadRecipe(
        "eagle", H.EagleConfig(),
        TrainConfig(steps=600, lr=3e-3, warmup=30, eval_every=300, ckpt_every=100, log_every=10, seed=3)),
    "code-target-eagle3": HeadRecipe(
        "eagle", H.EagleConfig(fuse_layers=(1, 3, 5)),
        TrainConfig(steps=400, lr=3e-3, warmup=30, eval_every=200, ckpt_every=100, log_every=10, seed=4),
        ttt_steps=3),
    "code-target-mtp-posthoc": HeadRecipe(
        "mtp", H.MTPConfig(num_modules=1),
        TrainConfig(steps=500, lr=3e-3, warmup=30, eval_every=250, ckpt_every=100, log_every=10, seed=5)),
}

# The target trained from scratch with one MTP module: code-target's recipe, plus lam * the MTP loss.
NATIVE_MTP = "code-target-mtp"


def _objective(r: HeadRecipe, cfg):
    if r.kind == "medusa":
        return medusa_loss(cfg, r.hcfg)
    if r.kind == "eagle":
        return eagle_loss(cfg, r.hcfg, ttt_steps=r.ttt_steps)
    if r.kind == "layerskip":
        return exit_loss(cfg, r.hcfg)
    return mtp_loss(cfg, r.hcfg)


EVAL_BATCH = 8  # held-out windows per evaluation batch; fewer held-out windows than this make a noisy metric
EVAL_WINDOWS = 96  # held-out windows the metric reads at most


def _eval_heads(r: HeadRecipe, cfg, tparams, windows: np.ndarray, maps: dict | None = None):
    """Held-out metric of the heads: top-1 agreement with the target's own greedy next-next token (Medusa head 0,
    EAGLE / MTP depth 1), i.e. the depth-1 acceptance rate under greedy verification. ``maps``: a draft
    vocabulary's d2t / t2d (kept out of the trained params)."""
    from pdecode.model.attention import padded_self_mask

    @jax.jit
    def agree(hp, tparams, maps, w):
        hp = {**hp, **maps} if maps else hp
        x = w[:, :-1]
        b, t = x.shape
        layers = {"eagle": getattr(r.hcfg, "fuse_layers", ()),
                  "layerskip": (getattr(r.hcfg, "exit_layer", 0) - 1,)}.get(r.kind, (cfg.num_layers - 1,))
        h, lh = causal_hidden(tparams, cfg, x, layers)
        t_next = jnp.argmax(unembed(tparams, cfg, h), -1)  # the target's prediction of x_{i+1}
        if r.kind == "layerskip":  # the early exit's first draft: x_{i+1} from the exit layer's state at i
            return jnp.mean(jnp.argmax(H.exit_logits(hp, cfg, tparams, lh[0]), -1) == t_next)
        if r.kind == "medusa":
            pred = jnp.argmax(H.medusa_logits(hp, r.hcfg, tparams, cfg, h)[0], -1)  # predicts x_{i+2}
            return jnp.mean(pred[:, :-1] == t_next[:, 1:])
        n = t - 1
        pos = jnp.broadcast_to(jnp.arange(n), (b, n))
        mask = padded_self_mask(jnp.full((b,), n), n)
        if r.kind == "eagle":
            feat = H.eagle_feature(hp, r.hcfg, h, lh)
            lg, _, _ = H.eagle_step(hp, r.hcfg, cfg, tparams, x[:, 1:], feat[:, :-1], pos, mask)
        else:
            lg, _, _ = H.mtp_module(hp["modules"][0], r.hcfg, cfg, tparams, lh[0][:, :-1], x[:, 1:], pos, mask)
        # pair i = (x_{i+1}, feature_i) predicts x_{i+2}, which the target predicts from position i + 1
        return jnp.mean(jnp.argmax(lg, -1) == t_next[:, 1:])

    def eval_fn(hp):
        vals = [float(agree(hp, tparams, maps, np.asarray(w, np.int32)))
                for w in data.eval_batches(windows, EVAL_BATCH)]
        return {"depth1_agreement": float(np.mean(vals))}

    return eval_fn


def fit_and_save(r: HeadRecipe, cfg, tparams, tr: np.ndarray, va: np.ndarray, out: Path, ckpt_dir: Path,
                 base_model: str, command: str, desc: str, mesh_plan=None) -> dict:
    """Train heads of recipe ``r`` on the frozen base (``cfg``, ``tparams``) over token streams ``tr`` / ``va``,
    save them to ``out`` (heads.json + heads.safetensors.xz, bf16) with a train_info.json; the one path both the
    zoo recipes and `pdecode train heads --base DIR` take."""
    tc = r.tc
    hp = init_from_specs(r.hcfg.specs(cfg), jax.random.PRNGKey(tc.seed))
    if r.kind == "medusa":
        hp = H.medusa_init_zero(hp)
    if r.kind == "layerskip":  # the exit's norm starts as the base's final norm: the training-free early exit
        hp["norm"] = jnp.asarray(tparams["final_norm"], hp["norm"].dtype)
    maps, vocab_note = None, {}
    if getattr(r.hcfg, "draft_vocab", 0):  # EAGLE-3's draft vocabulary: the training data's most frequent tokens
        ids, cover = H.most_frequent_tokens(tr, r.hcfg.draft_vocab, cfg.vocab_size)
        maps = {k: jnp.asarray(v) for k, v in H.draft_vocab_maps(ids, cfg.vocab_size).items()}
        hp, _ = H.split_vocab_maps(hp)
        # the draft head starts as the target's head restricted to those tokens (EAGLE-3 trains it from there)
        w = tparams["embed"][ids].T if cfg.tie_word_embeddings else tparams["lm_head"][:, ids]
        hp["lm_head"] = jnp.asarray(w, hp["lm_head"].dtype)
        vocab_note = {"draft_vocab": r.hcfg.draft_vocab, "draft_vocab_coverage": round(cover, 4)}
        print(f"{desc}: draft vocabulary of {r.hcfg.draft_vocab} tokens covers {cover:.1%} of the training tokens",
              file=sys.stderr)
    batches = data.TokenBatches(tr, r.seq_len, r.batch_size, seed=tc.seed)
    val_windows = data.TokenBatches(va, r.seq_len, 1).fixed_eval(EVAL_WINDOWS) if len(va) > r.seq_len + 1 else []
    if not len(val_windows):
        raise InputError(f"the held-out part is {len(va)} tokens, less than one window of {r.seq_len + 1}: add text "
                         "or lower --seq-len")
    eval_fn = _eval_heads(r, cfg, tparams, val_windows, maps)
    n_params = sum(int(np.prod(a.shape)) for a in jax.tree.leaves(hp))
    print(f"{desc}: {r.kind} heads, {n_params / 1e6:.2f}M params on frozen {base_model}, {tc.steps} steps of "
          f"{r.batch_size}x{r.seq_len}", file=sys.stderr)
    t0 = time.perf_counter()
    hp, hist = train(_objective(r, cfg), hp, tparams if maps is None else (tparams, maps), batches.batch, tc,
                     ckpt_dir=ckpt_dir, eval_fn=eval_fn,
                     desc=desc, mesh_plan=mesh_plan, local_batch_fn=batches.batch)
    wall = time.perf_counter() - t0
    info = {"name": out.name, "command": command, "kind": r.kind, "params": n_params, "base_model": base_model,
            "final_eval": hist["eval"][-1] if hist["eval"] else None,
            "steps": hist["last_step"], "train_minutes_this_run": round(wall / 60, 2),
            "evals": hist["eval"], "loss_curve": {"step": hist["step"], "loss": hist["loss"]},
            "train_config": dataclasses.asdict(tc), "seq_len": r.seq_len, "batch_size": r.batch_size,
            "ttt_steps": r.ttt_steps, **vocab_note}
    from pdecode import distributed
    from pdecode.api import to_host

    # (gathered from every process's devices on a multi-process mesh)
    host = jax.tree.map(to_host, hp if maps is None else {**hp, **maps})
    if distributed.is_main():  # one writer of a multi-process run
        save_heads(out, r.kind, r.hcfg, host, base_model=base_model,
                   dtype=ml_dtypes.bfloat16, compress=True)
        (out / "train_info.json").write_text(json.dumps(info, indent=1) + "\n")
    distributed.barrier("heads saved")
    if hist["eval"]:
        print(f"{desc}: depth-1 agreement {hist['eval'][-1]['depth1_agreement']:.3f}, {wall / 60:.1f} min -> {out}",
              file=sys.stderr)
    return info


def train_heads(name: str, zoo: Path, work: Path, steps: int | None = None, self_distill: int = 0) -> dict:
    """A zoo recipe: heads for the shipped base, trained on the corpus (or its own continuations)."""
    r = RECIPES[name]
    if steps:
        r = dataclasses.replace(r, tc=dataclasses.replace(r.tc, steps=steps))
    tok = ensure_tokenizer(zoo)
    tr, va = token_streams(tok, work / "data")
    cfg, tparams = load_hf(zoo / r.base)
    tparams = jax.tree.map(jnp.asarray, tparams)
    if self_distill:  # train on text the target generated itself (its own distribution, as at decode time)
        tr = data.self_distilled(zoo, work, r.base, tr, self_distill)
    sig = hashlib.sha1(repr((r, r.tc)).encode()).hexdigest()[:10]
    command = f"python -m train.heads --only {name}" + (f" --self-distill {self_distill}" if self_distill else "")
    return fit_and_save(r, cfg, tparams, tr, va, zoo / name, work / "ckpt" / f"{name}-{sig}", r.base, command, name)


KINDS = ("medusa", "eagle", "eagle3", "mtp", "layerskip")


DRAFT_VOCAB_AUTO = 8192  # EAGLE-3's draft vocabulary for bases whose vocabulary exceeds twice this


def draft_vocab_arg(kind: str, draft_vocab: int | str) -> int | str:
    """``--draft-vocab`` as given ("auto" or a number of tokens), checked against the head kind before any model
    loads."""
    if draft_vocab == "auto":
        return "auto"
    try:
        n = int(draft_vocab)
    except (TypeError, ValueError):
        raise InputError(f"--draft-vocab takes a number of tokens or auto, got {draft_vocab!r}") from None
    if n and kind != "eagle3":
        raise InputError(f"--draft-vocab is EAGLE-3's reduced vocabulary: it needs --kind eagle3, not {kind}")
    return n


def draft_vocab_for(kind: str, cfg, draft_vocab: int | str = "auto") -> int:
    """The draft vocabulary an EAGLE-3 head gets: "auto" is 8192 tokens for a vocabulary over 16384 (the head's
    matmul then reads a small part of the target's), else the whole vocabulary (0); a number is taken as given
    (0: the whole vocabulary). Other kinds have none."""
    n = draft_vocab_arg(kind, draft_vocab)
    if n == "auto":
        return DRAFT_VOCAB_AUTO if kind == "eagle3" and cfg.vocab_size > 2 * DRAFT_VOCAB_AUTO else 0
    if not 0 <= n <= cfg.vocab_size:
        raise InputError(f"--draft-vocab must be 0 (the whole vocabulary) up to the base's {cfg.vocab_size}, got {n}")
    return 0 if n == cfg.vocab_size else n


def head_config(kind: str, cfg, draft_vocab: int = 0, exit_layer: int | None = None) -> tuple[object, int]:
    """(head config, EAGLE-3 training-time-test depth) of a head kind for a base: the zoo recipes' shapes (Medusa:
    4 heads of 1 residual layer; EAGLE: one decoder layer; EAGLE-3: fusing layers 1, L/2 and L-1, 3 test steps,
    ``draft_vocab`` tokens in its own head; MTP: one DeepSeek-V3 module; layerskip: an exit adapter after
    ``exit_layer`` blocks, L/4 by default)."""
    if kind == "layerskip":
        n = cfg.num_layers
        e = max(1, n // 4) if exit_layer is None else exit_layer
        if not 1 <= e < n:
            raise InputError(f"--exit-layer must be in 1..{n - 1} (the base has {n} blocks), got {e}")
        return H.ExitConfig(exit_layer=e), 1
    if kind == "medusa":
        return H.MedusaConfig(num_heads=4, num_layers=1), 1
    if kind == "eagle":
        return H.EagleConfig(), 1
    if kind == "eagle3":
        n = cfg.num_layers
        if n < 3:
            raise InputError(f"--kind eagle3 fuses three of the base's layers; it has {n}")
        return H.EagleConfig(fuse_layers=(1, n // 2, n - 1), draft_vocab=draft_vocab), 3
    if kind == "mtp":
        return H.MTPConfig(num_modules=1), 1
    raise InputError(f"--kind must be one of {', '.join(KINDS)}, got {kind!r}")


def train_heads_for(base: str, kind: str, data_paths: list, out: Path, work: Path, steps: int = 500,
                    seq_len: int = 256, batch_size: int = 16, lr: float = 3e-3, self_distill: int = 0,
                    mesh=None, fsdp: bool = False, accum: int = 1, compute_dtype: str | None = None,
                    base_dtype: str = "auto", seed: int = 0, calibrate: bool = True, val_fraction: float = 0.05,
                    command: str | None = None, calibration_prompts: int | None = None,
                    draft_vocab: int | str = "auto",
                    calibrate_only: bool = False, exit_layer: int | None = None) -> dict:
    """Heads of ``kind`` for any supported HF base (a directory or zoo name), trained on the frozen base over the
    user's text files (``data_paths``; the base's tokenizer; the last ``val_fraction`` held out), or on
    ``self_distill`` tokens of the base's own continuations of that text; on a ``mesh`` data-parallel (or ``fsdp``)
    with the base tensor-parallel. ``command`` (recorded in train_info.json): the command line as given, by default
    one with every option spelled out."""
    import pdecode
    from pdecode.model.transformer import param_specs
    from train.loop import MeshPlan

    out = Path(out)
    prompts_n = calibration_prompts
    if prompts_n is None:
        prompts_n = 96 if kind == "medusa" else SIZE_CALIBRATION_PROMPTS
    calibrate = calibrate and prompts_n > 0
    if calibrate_only:  # heads trained before: only their tree calibration, on the same data (checked before loading)
        if kind in ("mtp", "layerskip"):
            raise InputError(f"--calibrate-only: {kind} heads carry no tree calibration (Medusa's tree, EAGLE's tree "
                             "sizes)")
        stored = json.loads((out / "heads.json").read_text()).get("kind") if (out / "heads.json").is_file() else None
        if stored != ("eagle" if kind == "eagle3" else kind):
            raise InputError(f"--calibrate-only calibrates {kind} heads already at --out; {out} holds "
                             f"{'no heads.json' if stored is None else stored + ' heads'}")
        if not calibrate:
            raise InputError("--calibrate-only with --calibration-prompts 0 calibrates nothing: give a number of "
                             "prompts")
    m = pdecode.load(base, dtype=base_dtype, mesh=mesh)
    # heads are trained (and saved) for the base's own kv heads: the frozen base keeps them (replicated over the
    # model axis where it does not divide them) instead of a placed model's repeats
    cfg0, p0 = pdecode.api.stored_kv_heads(m)
    if cfg0 is not m.cfg:
        m = dataclasses.replace(m, cfg=cfg0, params=p0, _sharded={}, _placed=None, _source_cfg=None)
    if m.tokenizer is None:
        raise InputError(f"--base {base}: no tokenizer.json next to the weights; training reads text through it")
    hcfg, ttt = head_config(kind, m.cfg, draft_vocab_for(kind, m.cfg, draft_vocab), exit_layer)
    tc = TrainConfig(steps=steps, lr=lr, warmup=max(1, min(30, steps // 10)), eval_every=max(1, steps // 2),
                     ckpt_every=max(1, min(100, steps)), log_every=max(1, min(10, steps)), seed=seed, accum=accum,
                     compute_dtype=compute_dtype)
    r = HeadRecipe("eagle" if kind == "eagle3" else kind, hcfg, tc, seq_len, batch_size, ttt, base=str(base))
    tr, va = data.user_streams(m.tokenizer, data_paths, seq_len, val_fraction)
    note = held_out_note(len(tr), len(va), seq_len, val_fraction)
    if note:
        print(note, file=sys.stderr)
    if self_distill:
        print(f"self-distillation: generating {self_distill} tokens with {base}", file=sys.stderr)
        tr = data.self_distillation_stream(m, tr, self_distill, batch=min(64, batch_size * 4),
                                           temperature=data.SELF_DISTILL_TEMPERATURE, seed=seed)
    base_model = str(base) if not Path(base).is_dir() else str(Path(base).resolve())
    specs, frozen_specs = hcfg.specs(m.cfg), param_specs(m.cfg)
    if getattr(hcfg, "draft_vocab", 0):  # the vocabulary maps ride with the frozen base (not trained)
        specs, map_specs = H.split_vocab_maps(specs)
        frozen_specs = (frozen_specs, map_specs)
    mesh_plan = MeshPlan(mesh, specs, frozen_specs, fsdp) if mesh is not None else None
    held = (val_fraction,) if val_fraction != 0.05 else ()  # (the default keeps earlier runs' checkpoint names)
    sig = hashlib.sha1(repr((r, base_model, [str(p) for p in data_paths], self_distill) + held
                            ).encode()).hexdigest()[:10]
    if command is None:
        command = command_line("pdecode train heads", base=base, kind=kind, data=data_paths, out=out, work=work,
                               steps=steps, seq_len=seq_len, batch_size=batch_size, lr=lr, seed=seed,
                               val_fraction=val_fraction, self_distill=self_distill, mesh=mesh, fsdp=fsdp,
                               accum=accum, compute_dtype=compute_dtype, base_dtype=base_dtype,
                               calibration_prompts=calibration_prompts,
                               draft_vocab=None if draft_vocab == "auto" else draft_vocab, exit_layer=exit_layer)
    if calibrate_only:
        info, when = {}, ""
    else:
        info = fit_and_save(r, m.cfg, m.params, tr, va, out, work / "ckpt" / f"{out.name}-{sig}", base_model,
                            command, f"heads:{kind}", mesh_plan)
        when = " (tree calibrated after training)"
    if kind == "medusa" and calibrate:
        hcfg_l, hp, meta = _load_saved(out, m.cfg)
        info["tree_calibration"] = _calibrate_tree(out, r, m.cfg, m.params, tr, hcfg_l, hp, meta, MEDUSA_TREE_NODES,
                                                   command + when, prompts_n, mesh=mesh)
    elif kind in ("eagle", "eagle3") and calibrate:
        info["tree_sizes"] = calibrate_tree_sizes(out, m, tr, seq_len, command + when, prompts_n, mesh=mesh)
    return info


def held_out_note(n_train: int, n_val: int, seq_len: int, val_fraction: float) -> str | None:
    """A warning line when the held-out stream of `data.user_streams` has fewer windows than one evaluation batch
    (the metric is then measured on those few, and noisy), saying what to pass; None when it has enough."""
    window = seq_len + 1
    n_win = (n_val - 1) // window
    if n_win >= EVAL_BATCH:
        return None
    need = EVAL_BATCH * window + 1  # tokens for EVAL_BATCH windows
    total = n_train + n_val
    fixes = ["add text to --data", f"lower --seq-len (now {seq_len})"]
    frac = -(-(need + 1) * 100 // total) / 100  # rounded up to a percent
    if frac < 1 and total - int(total * frac) > 2 * window:  # what data.user_streams needs left to train on
        fixes.append(f"hold out more with --val-fraction {frac:g}")
    return (f"warning: the held-out part (last {val_fraction * 100:g}% of --data) is {n_val} tokens, {n_win} window(s) "
            f"of {window} tokens; the held-out metric is measured on those but is noisy below {EVAL_BATCH} windows "
            f"({need} tokens): {', '.join(fixes[:-1])} or {fixes[-1]}")


def command_line(prog: str, **options) -> str:
    """``prog`` with every option spelled out (``seq_len=128`` -> ``--seq-len 128``; lists as several values; True
    as a bare flag; None and False left out; a mesh as DATAxMODEL): a command that repeats a run."""
    parts = [prog]
    for k, v in options.items():
        if v is None or v is False:
            continue
        flag = "--" + k.replace("_", "-")
        if v is True:
            parts.append(flag)
        elif isinstance(v, (list, tuple)):
            parts += [flag, *map(str, v)]
        elif hasattr(v, "devices") and hasattr(v, "shape"):  # a jax Mesh
            parts += [flag, "x".join(str(n) for n in v.shape.values())]
        else:
            parts += [flag, str(v)]
    return parts[0] + " " + shlex.join(parts[1:])


def _load_saved(out: Path, cfg):
    from pdecode.checkpoint.heads_io import load_heads

    _, hcfg, hp, meta = load_heads(out, cfg)
    return hcfg, jax.tree.map(jnp.asarray, hp), meta


def _saved_heads(name: str, zoo: Path, work: Path):
    """(recipe, (train, validation) token streams, base cfg, base params, head config, head params, heads.json) of
    saved heads, params as device arrays."""
    from pdecode.checkpoint.heads_io import load_heads

    r = RECIPES[name]
    streams = token_streams(ensure_tokenizer(zoo), work / "data")
    cfg, tparams = load_hf(zoo / r.base)
    _, hcfg, hp, meta = load_heads(zoo / name, cfg)
    return r, streams, cfg, jax.tree.map(jnp.asarray, tparams), hcfg, jax.tree.map(jnp.asarray, hp), meta


def reevaluate(name: str, zoo: Path, work: Path) -> dict:
    """Recompute the held-out depth-1 agreement of saved heads and record it in their train_info.json."""
    r, (_, va), cfg, tparams, _, hp, _ = _saved_heads(name, zoo, work)
    ev = _eval_heads(r, cfg, tparams, data.TokenBatches(va, r.seq_len, 1).fixed_eval(EVAL_WINDOWS))(hp)
    f = zoo / name / "train_info.json"
    info = json.loads(f.read_text())
    info["final_eval"] = ev
    f.write_text(json.dumps(info, indent=1) + "\n")
    print(f"{name}: {ev}", file=sys.stderr)
    return ev


MEDUSA_TREE_NODES = 64  # size of the calibrated tree shipped with Medusa heads (Medusa ships 63 nodes for 7B)
MEDUSA_CALIBRATION_RANKS = 10
CALIBRATION_PROMPT = 64


def medusa_rank_accuracy(hp, hcfg, cfg, tparams, windows: np.ndarray, max_rank: int = MEDUSA_CALIBRATION_RANKS,
                         start: int = 0):
    """acc [K, R]: how often Medusa head k's rank-r token is the target's own greedy token for that position
    (head k at position i against the target's prediction at i + k + 1), over teacher-forced windows, counting
    positions i >= ``start``."""

    @jax.jit
    def counts(hp, tparams, w):
        x = w[:, :-1]
        b, t = x.shape
        h, _ = causal_hidden(tparams, cfg, x)
        t_next = jnp.argmax(unembed(tparams, cfg, h), -1)
        logits = H.medusa_logits(hp, hcfg, tparams, cfg, h)  # [K, B, T, V]
        ids = jnp.arange(logits.shape[-1])
        rows = []
        for k in range(hcfg.num_heads):
            n = t - k - 1
            lg, want = logits[k, :, start:n], t_next[:, start + k + 1:]
            # the target token's rank in head k's order (top_k's: larger first, ties to the lower id), counted
            # instead of sorting the vocabulary
            lt = jnp.take_along_axis(lg, want[..., None], axis=-1)
            rank = jnp.sum((lg > lt) | ((lg == lt) & (ids < want[..., None])), axis=-1)
            rows.append(jnp.mean(rank[..., None] == jnp.arange(max_rank), axis=(0, 1)))
        return jnp.stack(rows)

    from pdecode.api import to_host

    accs = [to_host(counts(hp, tparams, np.asarray(w, np.int32))) for w in data.eval_batches(windows, EVAL_BATCH)]
    return np.mean(accs, axis=0)


def calibrate_medusa_tree(name: str, zoo: Path, work: Path, nodes: int = MEDUSA_TREE_NODES) -> dict:
    """Calibrate the static tree of zoo Medusa heads (`_calibrate_tree`)."""
    r, (tr, _), cfg, tparams, hcfg, hp, meta = _saved_heads(name, zoo, work)
    return _calibrate_tree(zoo / name, r, cfg, tparams, tr, hcfg, hp, meta, nodes,
                           f"python -m train.heads --only {name} --calibrate-tree {nodes}")


def _calibrate_tree(out: Path, r: HeadRecipe, cfg, tparams, tr: np.ndarray, hcfg, hp, meta: dict, nodes: int,
                    command: str, prompts_n: int = 96, mesh=None) -> dict:
    """Measure the heads' per-rank accuracy where they will be used — on the target's own greedy continuations
    (of ``prompts_n`` (96) training-stream prompts of 64 tokens, to the recipe's window) — and store the best
    ``nodes``-node tree
    (`tree.calibrated_paths`) in heads.json, where ``method="medusa"`` picks it up by default."""
    import pdecode
    from pdecode.decode.tree import calibrated_paths

    prompts = data.TokenBatches(tr, r.seq_len, 1).fixed_eval(prompts_n)[:, :CALIBRATION_PROMPT]
    target = pdecode.Model(cfg=cfg, params=tparams, name=r.base)  # the base already loaded
    cont = [pdecode.generate(target, [list(map(int, p)) for p in prompts[i: i + 16]],
                             max_new_tokens=r.seq_len + 1 - CALIBRATION_PROMPT, stop_at_eos=False, mesh=mesh).tokens
            for i in range(0, len(prompts), 16)]
    windows = np.concatenate([prompts, np.asarray([t for c in cont for t in c], np.int32)], axis=1)
    acc = medusa_rank_accuracy(hp, hcfg, cfg, tparams, windows, start=CALIBRATION_PROMPT)
    paths, expected = calibrated_paths(acc, nodes)
    meta["tree"] = paths
    meta["tree_calibration"] = {"nodes": nodes, "expected_tokens_per_step": round(float(expected), 4),
                                "accuracy": np.round(acc, 4).tolist(),
                                "data": f"the base's greedy continuations of {len(prompts)} training-stream prompts "
                                        f"({CALIBRATION_PROMPT} + {r.seq_len + 1 - CALIBRATION_PROMPT} tokens)",
                                "command": command}
    from pdecode import distributed

    if distributed.is_main():
        (out / "heads.json").write_text(json.dumps(meta, indent=1) + "\n")
    distributed.barrier("tree calibrated")
    print(f"{out.name}: calibrated tree of {nodes} nodes, expected {expected:.3f} tokens/step "
          f"(head top-1 accuracy {', '.join(f'{a:.3f}' for a in acc[:, 0])})", file=sys.stderr)
    return meta["tree_calibration"]


# total_tokens="auto" picks one of these (tree_top_k, depth, total_tokens) by tokens per unit of time on the device
# at hand: from a chain of one token to EAGLE-2's default tree (60 nodes)
TREE_LADDER = ((1, 1, 1), (2, 2, 2), (4, 3, 4), (4, 4, 8), (6, 5, 16), (8, 6, 32), (10, 7, 60))
SIZE_CALIBRATION_PROMPTS = 16
SIZE_CALIBRATION_TOKENS = 48


def calibrate_tree_sizes(out: Path, model, tr: np.ndarray, seq_len: int, command: str,
                         prompts_n: int = SIZE_CALIBRATION_PROMPTS, new_tokens: int = SIZE_CALIBRATION_TOKENS,
                         mesh=None, method: str = "eagle") -> dict:
    """Tokens per forward of each tree of `TREE_LADDER`, measured by decoding greedily with the heads at ``out``
    (attached to the base ``model``) ``new_tokens`` tokens after ``prompts_n`` training-stream prompts of
    `CALIBRATION_PROMPT` tokens; stored in heads.json as ``tree_sizes``, where ``total_tokens="auto"`` weighs them
    against each tree's step cost measured on the device that decodes."""
    import pdecode
    from pdecode import distributed

    prompts = data.TokenBatches(tr, seq_len, 1).fixed_eval(prompts_n)[:, :CALIBRATION_PROMPT]
    m = pdecode.attach_heads(model, out)
    trees, t0 = [], time.perf_counter()
    for i, (k, d, n) in enumerate(TREE_LADDER):
        res = pdecode.generate(m, [list(map(int, p)) for p in prompts], method=method, tree_top_k=k, depth=d,
                               total_tokens=n, max_new_tokens=new_tokens, stop_at_eos=False, mesh=mesh)
        trees.append({"tree_top_k": k, "depth": d, "total_tokens": n,
                      "tokens_per_forward": round(float(res.stats["tokens_per_forward"]), 4)})
        print(f"{out.name}: tree sizes [{i + 1}/{len(TREE_LADDER)}] {n} nodes (top-k {k}, depth {d}): "
              f"{trees[-1]['tokens_per_forward']:.3f} tokens per forward ({time.perf_counter() - t0:.0f} s)",
              file=sys.stderr, flush=True)
    cal = {"trees": trees, "data": f"greedy decoding of {len(prompts)} training-stream prompts "
                                   f"({CALIBRATION_PROMPT} + {new_tokens} tokens)", "command": command}
    meta = json.loads((out / "heads.json").read_text())
    meta["tree_sizes"] = cal
    if distributed.is_main():
        (out / "heads.json").write_text(json.dumps(meta, indent=1) + "\n")
    distributed.barrier("tree sizes calibrated")
    return cal


def train_native_mtp(zoo: Path, work: Path, steps: int | None = None, lam: float = 0.3) -> dict:
    """code-target's recipe (same config, data, steps, seed) with one sequential MTP module trained jointly."""
    base = LM_RECIPES["code-target"]
    tc = dataclasses.replace(base.tc, steps=steps) if steps else base.tc
    mcfg = H.MTPConfig(num_modules=1)
    cfg = base.cfg
    tok = ensure_tokenizer(zoo)
    tr, va = token_streams(tok, work / "data")
    batches = data.TokenBatches(tr, base.seq_len, base.batch_size, seed=tc.seed)
    val_windows = data.TokenBatches(va, base.seq_len, 1).fixed_eval(10_000)
    lm_eval = make_eval(cfg, val_windows)
    key = jax.random.PRNGKey(tc.seed)
    trainable = {"base": init_params(cfg, key), "mtp": init_from_specs(mcfg.specs(cfg), jax.random.fold_in(key, 1))}
    print(f"{NATIVE_MTP}: {num_params(cfg) / 1e6:.2f}M params + 1 MTP module, lam={lam}, {tc.steps} steps",
          file=sys.stderr)
    sig = hashlib.sha1(repr((cfg, tc, lam)).encode()).hexdigest()[:10]
    t0 = time.perf_counter()
    trainable, hist = train(mtp_loss(cfg, mcfg, native=True, lam=lam), trainable, None, batches.batch, tc,
                            ckpt_dir=work / "ckpt" / f"{NATIVE_MTP}-{sig}",
                            eval_fn=lambda p: lm_eval(p["base"]), desc=NATIVE_MTP)
    wall = time.perf_counter() - t0
    out = zoo / NATIVE_MTP
    save_hf(cfg.replace(dtype="bfloat16"), trainable["base"], out, dtype="bfloat16",
            tokenizer_dir=zoo / "code-target", compress=True)
    save_heads(out, "mtp", mcfg, trainable["mtp"], base_model=".", dtype=ml_dtypes.bfloat16, compress=True)
    _, shipped = load_hf(out)
    info = {"name": NATIVE_MTP, "command": f"python -m train.heads --only {NATIVE_MTP}", "params": num_params(cfg),
            "mtp_lambda": lam, "steps": hist["last_step"], "train_minutes_this_run": round(wall / 60, 2),
            "val_loss": lm_eval(jax.tree.map(jnp.asarray, shipped))["val_loss"], "evals": hist["eval"],
            "loss_curve": {"step": hist["step"], "loss": hist["loss"]}, "train_config": dataclasses.asdict(tc)}
    (out / "train_info.json").write_text(json.dumps(info, indent=1) + "\n")
    print(f"{NATIVE_MTP}: next-token validation loss {info['val_loss']:.4f}, {wall / 60:.1f} min", file=sys.stderr)
    return info


def add_base_arguments(ap: argparse.ArgumentParser, what: str, lr: float = 3e-3) -> None:
    """The flags `pdecode train heads --base` and `pdecode train draft` share."""
    g = ap.add_argument_group(f"{what} for your own base model (instead of a zoo recipe)")
    g.add_argument("--base", help="an HF model directory (config.json, *.safetensors, tokenizer.json) or zoo name")
    g.add_argument("--data", nargs="+", metavar="PATH", help="text files or directories to train on (tokenized "
                   "with the base's tokenizer; the last --val-fraction of the tokens held out)")
    g.add_argument("--out", type=Path, help="where to write the result")
    g.add_argument("--seq-len", type=int, default=256, help="tokens per training window")
    g.add_argument("--batch-size", type=int, default=16, help="windows per step")
    g.add_argument("--val-fraction", type=float, default=0.05, metavar="F",
                   help="the part of --data's tokens held out for the validation metric (at least two windows' worth)")
    g.add_argument("--lr", type=float, default=lr, help="peak learning rate")
    if what == "heads":
        g.add_argument("--draft-vocab", default="auto", metavar="N|auto",
                       help="(--kind eagle3) EAGLE-3's reduced vocabulary: the N most frequent tokens of the training "
                            "data get the drafter's own head, with d2t / t2d maps as EAGLE-3 releases carry them; "
                            f"auto: {DRAFT_VOCAB_AUTO} when the base's vocabulary exceeds {2 * DRAFT_VOCAB_AUTO}, "
                            "0: the whole vocabulary")
        g.add_argument("--exit-layer", type=int, default=None, metavar="E",
                       help="(--kind layerskip) the early exit's adapter reads the base's state after its first E "
                            "blocks (default: a quarter of them)")
        g.add_argument("--calibration-prompts", type=int, default=None, metavar="N",
                       help="training-stream prompts whose greedy decoding calibrates the heads' trees after training "
                            "(Medusa: the shipped static tree, default 96; EAGLE: the tokens per forward of each tree "
                            f"size that total_tokens='auto' weighs, default {SIZE_CALIBRATION_PROMPTS}); 0: none")
    g.add_argument("--seed", type=int, default=0, help="initialization and batch order")
    g.add_argument("--mesh", default=None, metavar="DATAxMODEL", help="train on a mesh: data-parallel over DATA, "
                   "the base tensor-parallel over MODEL")
    g.add_argument("--fsdp", action="store_true", help="with --mesh: also split the trained weights over DATA")
    g.add_argument("--accum", type=int, default=1, help="gradient accumulation: micro-batches per step")
    g.add_argument("--compute-dtype", default=None, choices=["bfloat16", "float16"],
                   help="forward/backward in this dtype, float32 master weights")
    g.add_argument("--base-dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                   help="the frozen base's dtype (auto: as stored)")


def check_base_arguments(ap: argparse.ArgumentParser, args, extra_required=()) -> None:
    missing = [f"--{n.replace('_', '-')}" for n in ("data", "out", *extra_required) if not getattr(args, n)]
    if missing:
        ap.error(f"--base needs {' and '.join(missing)}")
    if args.fsdp and not args.mesh:
        ap.error("--fsdp needs --mesh DATAxMODEL")
    for n in ("seq_len", "batch_size", "accum"):
        if getattr(args, n) < 1:
            ap.error(f"--{n.replace('_', '-')} must be >= 1")
    if args.batch_size % args.accum:
        ap.error(f"--accum {args.accum} must divide --batch-size {args.batch_size}")
    if not 0 < args.val_fraction < 1:
        ap.error(f"--val-fraction must be between 0 and 1, got {args.val_fraction:g}")


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """The description as written; each option's help ends with its default (unless None or False; argparse
    shows nothing for an option without help, so every option with a default needs one)."""

    def _get_help_string(self, action):
        h = action.help or ""
        d = action.default
        if action.option_strings and not (d is None or d is False or d == argparse.SUPPRESS) and "%(default)" not in h:
            h += " (default: %(default)s)"
        return h


def build_parser() -> argparse.ArgumentParser:
    ap = ArgumentParser(prog="pdecode train heads", description=__doc__, formatter_class=HelpFormatter)
    ap.add_argument("--only", action="append", choices=sorted(RECIPES) + [NATIVE_MTP], metavar="RECIPE",
                    help=f"train this zoo recipe (repeatable; default: every one but {NATIVE_MTP}): "
                         f"{', '.join(sorted(RECIPES) + [NATIVE_MTP])}")
    ap.add_argument("--zoo", type=Path, default=None, help="the zoo directory (default: pdecode's own)")
    ap.add_argument("--work", type=Path, default=Path("runs/zoo"), help="data and checkpoints (a rerun resumes)")
    ap.add_argument("--steps", type=int, default=None,
                    help="training steps (default: 500 with --base, the recipe's own with --only)")
    ap.add_argument("--eval-only", action="store_true", help="re-measure saved heads' depth-1 agreement")
    ap.add_argument("--calibrate-tree", type=int, default=None, metavar="NODES",
                    help="(Medusa heads) only calibrate and store a static tree of NODES nodes in heads.json")
    ap.add_argument("--calibrate-only", action="store_true",
                    help="(with --base) calibrate the heads already at --out on --data instead of training them: "
                         "Medusa's static tree, EAGLE's tree sizes (what total_tokens='auto' weighs)")
    ap.add_argument("--self-distill", type=int, default=0, metavar="N",
                    help="train heads on N tokens generated by the target itself instead of the corpus")
    ap.add_argument("--kind", choices=KINDS, help="(with --base) which heads to train")
    add_base_arguments(ap, "heads")
    from infer.cli import add_distributed_arguments

    add_distributed_arguments(ap)  # (with --base) one process per host; the default mesh is PROCESSESxLOCAL
    return ap


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    ap = build_parser()
    args = ap.parse_args(argv)
    from pdecode.api import zoo_dir

    if args.base:
        if args.only or args.eval_only or args.calibrate_tree is not None:
            ap.error("--base trains heads for your own model; --only / --eval-only / --calibrate-tree are for the "
                     "zoo recipes")
        check_base_arguments(ap, args, ("kind",))
        if args.exit_layer is not None and args.kind != "layerskip":
            ap.error(f"--exit-layer places the layerskip exit adapter: it needs --kind layerskip, not {args.kind}")
        if args.calibration_prompts is not None and args.calibration_prompts < 0:
            ap.error(f"--calibration-prompts must be >= 0 (0: no calibration), got {args.calibration_prompts}")
        try:  # (before the base loads)
            draft_vocab = draft_vocab_arg(args.kind, args.draft_vocab)
        except InputError as e:
            ap.error(str(e))
        import pdecode
        from pdecode.sharding import make_mesh, mesh_from_spec

        multi = pdecode.init_distributed(args.coordinator, args.num_processes, args.process_id, args.dist_timeout)
        if multi and not args.mesh:  # one process per host: data-parallel over the hosts, the base split within each
            import jax

            mesh = make_mesh(jax.process_count(), jax.local_device_count())
        else:
            mesh = mesh_from_spec(args.mesh) if args.mesh else None
        return train_heads_for(args.base, args.kind, args.data, args.out, args.work, steps=args.steps or 500,
                               seq_len=args.seq_len, batch_size=args.batch_size, lr=args.lr,
                               self_distill=args.self_distill, mesh=mesh, fsdp=args.fsdp, accum=args.accum,
                               compute_dtype=args.compute_dtype, base_dtype=args.base_dtype, seed=args.seed,
                               val_fraction=args.val_fraction, command=f"{ap.prog} {shlex.join(argv)}",
                               calibration_prompts=args.calibration_prompts,
                               draft_vocab=draft_vocab, calibrate_only=args.calibrate_only,
                               exit_layer=args.exit_layer)

    if args.calibrate_only:
        ap.error("--calibrate-only calibrates heads trained for your own base: give --base, --kind, --data and --out")
    zoo = args.zoo or zoo_dir()
    for name in args.only or list(RECIPES):
        if args.calibrate_tree is not None:
            if name not in RECIPES or RECIPES[name].kind != "medusa":
                ap.error(f"--calibrate-tree applies to Medusa heads, not {name}")
            calibrate_medusa_tree(name, zoo, args.work, args.calibrate_tree)
        elif args.eval_only and name != NATIVE_MTP:
            reevaluate(name, zoo, args.work)
        elif name == NATIVE_MTP:
            train_native_mtp(zoo, args.work, args.steps)
        else:
            train_heads(name, zoo, args.work, args.steps, args.self_distill)
            if RECIPES[name].kind == "medusa":
                calibrate_medusa_tree(name, zoo, args.work)


if __name__ == "__main__":
    main()
