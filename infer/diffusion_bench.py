"""Benchmark of the masked-diffusion samplers and DiCo: quality against speed, side by side in one process.

    pdecode bench --suite diffusion                       # code-dllm, lengths 128 and 256, batch 1 and 8
    pdecode bench --suite diffusion --tune-dico           # choose DiCo's knobs on the tuning slice, nothing else

Two workloads per generation length:

* **Long tasks** (`train.tasks.LONG_KINDS`, answers of 47-126 tokens): held-out items taken evenly across the kinds
  (``--items``; ``--tasks short`` uses the short kinds instead), scored exactly and by the fraction of the answer's
  tokens right in place; model forwards per item (NFE: the forwards a row waits for) and tokens/s.
* **Free code**: continuations of validation-file prompts (``--code-prompts`` of ``--prompt-tokens`` tokens), judged
  by the perplexity of ``--judge`` (code-target) on the generated tokens and by the distinct-4-gram ratio
  (repetition), beside ``--ar-reference`` (code-draft)'s greedy AR continuation and the real text of the same files.

Quality comes from one pass over every item at the largest batch; the samplers decode every row of a batch exactly
as alone (a tested property), so speed is timed on the first ``--timing-items`` items at every batch size, in
rounds that run every sampler once (interleaved; tokens/s is the median over ``--repeats`` rounds), and the bench
checks the timed tokens equal the quality pass's. DiCo's knobs are chosen with ``--tune-dico`` on held-out items the reported rows
never use (``TUNING_SLICE``). Output: results.md / results.json and a Pareto plot (``pareto.png``: accuracy and
judge perplexity against forwards and tokens/s).
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import re
import statistics
import sys
import time
from pathlib import Path

import numpy as np


def _b(g: int) -> int:
    return min(32, g)


SAMPLERS = {
    # name: (method, options given the generation length g). Fast-dLLM: a threshold sweep without cache and the
    # prefix / dual caches; EB-sampler: a gamma sweep; DiCo: its defaults (chosen by --tune-dico) and its main knobs
    # moved one at a time.
    "vanilla": ("diffusion", lambda g: dict(block_length=g, steps=g)),
    "llada-b32": ("diffusion", lambda g: dict(block_length=_b(g), steps=g)),
    "llada-b8": ("diffusion", lambda g: dict(block_length=8, steps=g)),
    **{f"fast-dllm-{t}{'-' + c if c != 'none' else ''}": (
        "diffusion", lambda g, t=t, c=c: dict(block_length=_b(g), rule="threshold", threshold=t, cache=c))
       for c, ts in (("none", (0.5, 0.7, 0.9)), ("prefix", (0.9,)), ("dual", (0.7, 0.9))) for t in ts},
    **{f"eb-{gm}": ("diffusion", lambda g, gm=gm: dict(block_length=_b(g), rule="eb", eb_gamma=gm))
       for gm in (0.1, 1.0)},
    "dico": ("dico", lambda g: {}),
    "dico-seeds2": ("dico", lambda g: dict(num_seeds=2)),
    "dico-canvas": ("dico", lambda g: dict(block_length=0)),
    # ReMDM remasking on an adaptive rule and on DiCo (committed tokens re-masked so later steps can correct them)
    "fast-dllm-0.9-remask": ("diffusion", lambda g: dict(block_length=_b(g), rule="threshold", threshold=0.9,
                                                        remask="conf", remask_eta=0.1)),
    "dico-remask": ("dico", lambda g: dict(remask="conf", remask_eta=0.1)),
    # the rest of the non-AR family: one-shot at predicted lengths (or the full canvas), Mask-Predict, and the
    # edit model (code-edit) refining their output (its forwards counted in NFE)
    "oneshot": ("oneshot", lambda g: {}),
    "oneshot-full": ("oneshot", lambda g: dict(length="full", beams=1)),
    "mask-predict-4": ("mask_predict", lambda g: dict(iterations=4)),
    "mask-predict-10": ("mask_predict", lambda g: dict(iterations=10)),
    "oneshot+edit": ("oneshot", lambda g: dict(refine="edit", editor=_editor())),
    "oneshot-full+edit": ("oneshot", lambda g: dict(length="full", beams=1, refine="edit", editor=_editor())),
    "oneshot-full+edit-0.7": ("oneshot", lambda g: dict(length="full", beams=1, refine="edit", editor=_editor(0.7))),
    "mask-predict-10+edit": ("mask_predict", lambda g: dict(iterations=10, refine="edit", editor=_editor())),
    # a block-diffusion model (DiffusionGemma): its own sampler (generation_config.json's defaults), Fast-dLLM's
    # threshold and EB-sampler inside each canvas, and DiCo inside each canvas
    "bd-model": ("diffusion", lambda g: {}),
    "bd-fast-dllm-0.9": ("diffusion", lambda g: dict(rule="threshold", threshold=0.9)),
    "bd-eb-0.1": ("diffusion", lambda g: dict(rule="eb", eb_gamma=0.1)),
    "bd-dico": ("dico", lambda g: {}),
}
BLOCK_SAMPLERS = ("bd-model", "bd-fast-dllm-0.9", "bd-dico")  # the default rows for a block-diffusion model
EDITOR = "code-edit"
_EDITOR: list = []


def _editor(confidence: float | None = None):
    """The edit model (loaded once); ``confidence``: its decision threshold instead of the shipped default."""
    import dataclasses

    import pdecode

    if not _EDITOR:
        _EDITOR.append(pdecode.load(EDITOR, dtype="float32"))
    e = _EDITOR[0]
    if confidence is None:
        return e
    ecfg, ep = e.extras["edit"]
    return dataclasses.replace(e, extras={**e.extras, "edit": (dataclasses.replace(ecfg, confidence=confidence), ep)})
# knobs --tune-dico searches (the rest stay at DiCoOptions' defaults)
DICO_GRID = {"num_seeds": (4, 8), "grow_threshold": (0.3, 0.6), "block_length": (0, 32)}
TUNING_SLICE = slice(400, 432)
PICTURED = ("vanilla", "fast-dllm-0.9", "eb-0.1", "dico")  # held-out long items --tune-dico uses; the reported rows take items before 400


def _run(m, prompts, method, opts, g, seed=0, temperature=None):
    import pdecode

    out = pdecode.generate(m, prompts, method=method, max_new_tokens=g, seed=seed, temperature=temperature, **opts)
    if "refine" in opts:  # the edit model's forwards (a batch waits for its slowest row) and time; its tokens
        out.stats["nfe"] += max(out.stats["refine"]["forwards"])
        out.stats["wall_s"] += out.stats["refine"]["wall_s"]
        out.stats["new_tokens"] = sum(len(t) for t in out.tokens)
    return out


def balanced(items: list, n: int) -> list:
    """The first n items taken round-robin across kinds (the same items for every sampler and run)."""
    by: dict[str, list] = {}
    for it in items:
        by.setdefault(it.kind, []).append(it)
    out = [it for grp in itertools.zip_longest(*by.values()) for it in grp if it is not None]
    return out[:n]


def task_items(kind: str, n: int) -> list:
    from train import tasks

    heldout = tasks.split_long()[1] if kind == "long" else tasks.split()[1]
    return balanced(heldout[: TUNING_SLICE.start], n)


@dataclasses.dataclass(frozen=True)
class FileItem:
    """An item of a user's JSONL (``--items-file``): the prompt as the model sees it and the exact answer."""

    kind: str
    prompt: str
    answer: str


def final_answer(answer: str) -> str:
    """A GSM8K-style answer's final part (after ``####``), stripped; numbers without thousands separators."""
    a = answer.split("####")[-1].strip()
    return a.replace(",", "") if NUMBER.fullmatch(a.replace(",", "")) else a


NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def file_score(item: FileItem, generated: str) -> bool:
    """A numeric answer: the last number in the generation equals it (GSM8K's convention); otherwise the generation's
    first line equals the answer."""
    if NUMBER.fullmatch(item.answer):
        nums = NUMBER.findall(generated.replace(",", ""))
        return bool(nums) and float(nums[-1]) == float(item.answer)
    from train.tasks import answer_line

    return answer_line(generated) == item.answer


def file_items(path: Path, tok, n: int) -> list[FileItem]:
    """The first n items of a JSONL of {"prompt" (or "question"), "answer"}; the prompt goes through the model's chat
    template when it has one (an instruction-tuned model), as one user turn."""
    import pdecode
    from pdecode.chat import render

    items = []
    for i, line in enumerate(Path(path).read_text().splitlines()):
        if not line.strip():
            continue
        try:
            d = json.loads(line)
            q, a = d.get("prompt", d.get("question")), d["answer"]
        except (json.JSONDecodeError, KeyError, AttributeError):
            raise pdecode.InputError(f"{path}:{i + 1}: each line must be a JSON object with \"prompt\" (or "
                                     "\"question\") and \"answer\"") from None
        if not isinstance(q, str):
            raise pdecode.InputError(f"{path}:{i + 1}: \"prompt\" must be a string")
        prompt = render(tok, [{"role": "user", "content": q}]) if getattr(tok, "chat_template", None) else q
        items.append(FileItem(kind=Path(path).stem, prompt=prompt, answer=final_answer(str(a))))
    if not items:
        raise pdecode.InputError(f"{path} holds no items")
    return items[:n]


def _score(items, texts, tok):
    from train.tasks import position_score, score

    if items and isinstance(items[0], FileItem):
        exact = [int(file_score(it, t)) for it, t in zip(items, texts)]
        return exact, [float(e) for e in exact]
    exact = [int(score(it, t)) for it, t in zip(items, texts)]
    pos = [position_score(it, t, tok) for it, t in zip(items, texts)]
    return exact, pos


def _groups(xs, b):
    return [xs[i: i + b] for i in range(0, len(xs) - b + 1, b)]


CANVAS_FIGURES = ("forwards_per_canvas", "canvases_per_item", "encoder_tokens_per_item",
                  "uncached_encoder_tokens_per_item")


def canvas_figures(outs) -> dict:
    """A block-diffusion model's figures over every row of ``outs``: decoder forwards per canvas (each canvas a row
    reached), canvases per item, and the encoder's tokens per item with its cache and without it (every committed
    canvas and the prompt encoded again before each decoder step). Empty for a masked-diffusion model."""
    if not outs or "canvas_steps" not in outs[0].stats:
        return {}
    steps = np.concatenate([np.asarray(o.stats["canvas_steps"]) for o in outs])
    enc = np.concatenate([np.asarray(o.stats["encoder_tokens"]) for o in outs])
    raw = np.concatenate([np.asarray(o.stats["uncached_encoder_tokens"]) for o in outs])
    return {"forwards_per_canvas": float(steps[steps > 0].mean()),
            "canvases_per_item": float((steps > 0).sum(1).mean()),
            "encoder_tokens_per_item": float(enc.mean()), "uncached_encoder_tokens_per_item": float(raw.mean())}


def encoder_cache_bytes_per_token(cfg, dtype) -> int:
    """Bytes the KV cache holds per token (every layer's keys and values, as pdecode lays them out)."""
    import jax

    from pdecode.model import cache as kvc

    shapes = jax.eval_shape(lambda: kvc.init_cache(cfg, 1, 8, dtype, per_layer=True))
    return int(sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(shapes) if x.ndim >= 3) // 8)


def check_args(args) -> None:
    """The diffusion suite's arguments, checked before any model loads (one InputError naming the flag)."""
    from pdecode.errors import InputError

    if not args.batch or min(args.batch) < 1:
        raise InputError(f"--batch sizes must be >= 1, got {args.batch}")
    if args.timing_items < 1 or any(args.timing_items % b for b in args.batch):
        raise InputError(f"--timing-items ({args.timing_items}) must be a positive multiple of every --batch size "
                         f"({' '.join(map(str, args.batch))})")
    if args.items < max(args.batch, default=1) or args.items < args.timing_items:
        raise InputError(f"--items ({args.items}) must be at least the largest batch ({max(args.batch)}) and "
                         f"--timing-items ({args.timing_items})")
    if args.repeats < 1 or not args.gen_lengths or min(args.gen_lengths) < 1:
        raise InputError(f"--repeats ({args.repeats}) and every --gen-lengths ({args.gen_lengths}) must be >= 1")
    if len(getattr(args, "temperature", None) or [None]) != 1:
        raise InputError("the diffusion suite runs at one --temperature (0: greedy; 1: a block-diffusion model's own "
                         "sampler as released)")


def task_rows(m, items, samplers, g: int, batches, repeats: int, timing_items: int,
              temperature: float | None = None) -> list[dict]:
    """One row per (sampler, batch) at length g. Quality (accuracy, NFE) from one pass over every item at the
    largest batch; speed from ``repeats`` rounds over the first ``timing_items`` items at every batch size, each
    round running every sampler once (interleaved), tokens/s the median over rounds. The timed runs must give the
    quality pass's tokens (a row decodes the same alone as in a batch)."""
    big = max(batches)
    groups = _groups(items, big)
    n = len(groups) * big
    used = items[:n]
    opts = {name: SAMPLERS[name][1](g) for name in samplers}
    tok = m.tokenizer.backend
    quality: dict = {}
    for name in samplers:
        outs = [_run(m, [it.prompt for it in grp], SAMPLERS[name][0], opts[name], g, temperature=temperature)
                for grp in groups]
        texts = [t for o in outs for t in o.texts]
        exact, pos = _score(used, texts, tok)
        quality[name] = dict(tokens=[t for o in outs for t in o.tokens], exact=exact, pos=pos,
                             nfe=float(np.mean([o.stats["nfe"] for o in outs])), compile_s=outs[0].stats["compile_s"],
                             **canvas_figures(outs))
        print(f"  gen {g} {name}: acc {np.mean(exact):.3f} (pos {np.mean(pos):.3f}), NFE {quality[name]['nfe']:.1f}",
              file=sys.stderr, flush=True)
    timed = used[:timing_items]
    walls = {(name, b): [] for name in samplers for b in batches}
    speed: dict = {}
    for b in batches:  # warm-up of every timed shape
        for name in samplers:
            _run(m, [it.prompt for it in timed[:b]], SAMPLERS[name][0], opts[name], g, temperature=temperature)
    for r in range(repeats):
        for name in samplers:
            for b in batches:
                sub = _groups(timed, b)
                outs = [_run(m, [it.prompt for it in grp], SAMPLERS[name][0], opts[name], g, temperature=temperature)
                        for grp in sub]
                walls[(name, b)].append(sum(o.stats["wall_s"] for o in outs))
                if r == 0:
                    toks = [t for o in outs for t in o.tokens]
                    speed[(name, b)] = dict(same=toks == quality[name]["tokens"][: len(toks)], items=len(toks),
                                            new_tokens=sum(o.stats["new_tokens"] for o in outs),
                                            compile_s=outs[0].stats["compile_s"])
        print(f"  gen {g}: timing round {r + 1}/{repeats} done", file=sys.stderr, flush=True)
    rows = []
    for name in samplers:
        q = quality[name]
        by_kind: dict[str, list] = {}
        for it, e, p in zip(used, q["exact"], q["pos"]):
            by_kind.setdefault(it.kind, []).append((e, p))
        for b in batches:
            sp = speed[(name, b)]
            med = statistics.median(walls[(name, b)])
            row = {"sampler": name, "method": SAMPLERS[name][0], "options": opts[name], "gen_length": g, "batch": b,
                   "items": n, "accuracy": float(np.mean(q["exact"])), "position_accuracy": float(np.mean(q["pos"])),
                   "accuracy_by_kind": {k: float(np.mean([e for e, _ in v])) for k, v in sorted(by_kind.items())},
                   "position_accuracy_by_kind": {k: float(np.mean([p for _, p in v])) for k, v in sorted(by_kind.items())},
                   "nfe_per_item": q["nfe"], "tokens_per_s": sp["new_tokens"] / med, "wall_s_median": med,
                   "timed_items": sp["items"], "compile_s": sp["compile_s"], "same_tokens": sp["same"],
                   **{k: q[k] for k in CANVAS_FIGURES if k in q}}
            rows.append(row)
            print(f"  gen {g} batch {b} {name}: acc {row['accuracy']:.3f} (pos {row['position_accuracy']:.3f}), "
                  f"NFE {row['nfe_per_item']:.1f}, {row['tokens_per_s']:.1f} tok/s", file=sys.stderr, flush=True)
    return rows


def judge_nll(judge, prompt_ids, new_ids) -> tuple[float, int]:
    """Summed negative log-likelihood of ``new_ids`` after ``prompt_ids`` under the AR judge, and the count."""
    import pdecode

    seq = list(prompt_ids) + list(new_ids)
    lg = np.asarray(pdecode.forward_logits(judge, [seq]), np.float64)[0]
    lg = lg - lg.max(-1, keepdims=True)
    logp = lg - np.log(np.exp(lg).sum(-1, keepdims=True))
    idx = np.arange(len(prompt_ids) - 1, len(seq) - 1)
    return -float(logp[idx, np.asarray(seq)[idx + 1]].sum()), len(new_ids)


def distinct4(toks) -> float:
    grams = [tuple(toks[i: i + 4]) for i in range(len(toks) - 3)]
    return len(set(grams)) / max(len(grams), 1)


def text_quality(judge, prompts, continuations, eos_ids) -> dict:
    nll, count, dist = 0.0, 0, []
    for p, toks in zip(prompts, continuations):
        toks = [t for t in toks if t not in eos_ids]
        if len(toks) < 4:
            continue
        a, c = judge_nll(judge, p, toks)
        nll, count = nll + a, count + c
        dist.append(distinct4(toks))
    return {"judge_ppl": float(np.exp(nll / max(count, 1))), "distinct4": float(np.mean(dist)) if dist else 0.0,
            "tokens": count}


def code_prompts(tok, n: int, prompt_tokens: int, g: int):
    """(prompts, real continuations of g tokens) from validation files."""
    from train.data import read_text, split_files

    _, val = split_files()
    prompts, real = [], []
    for p in val:
        ids = tok.encode(read_text(p), add_special_tokens=False).ids
        off = 64  # skip the file's header (licence, module docstring start)
        if len(ids) >= off + prompt_tokens + g:
            prompts.append(ids[off: off + prompt_tokens])
            real.append(ids[off + prompt_tokens: off + prompt_tokens + g])
        if len(prompts) == n:
            break
    return prompts, real


def code_rows(m, judge, ref, samplers, g: int, n_prompts: int, prompt_tokens: int, batch: int) -> list[dict]:
    import pdecode

    prompts, real = code_prompts(m.tokenizer.backend, n_prompts, prompt_tokens, g)
    eos = set(m.cfg.eos_token_ids or ())
    rows = [{"sampler": "real text", "gen_length": g, "nfe_per_item": None, **text_quality(judge, prompts, real, eos)}]
    if ref is not None:
        outs = [pdecode.generate(ref, grp, max_new_tokens=g, stop_at_eos=False) for grp in _groups(prompts, batch)]
        rows.append({"sampler": f"{ref.name} greedy AR", "gen_length": g, "nfe_per_item": float(g),
                     **text_quality(judge, prompts, [t for o in outs for t in o.tokens], eos)})
    for name in samplers:
        method, mk = SAMPLERS[name]
        outs = [_run(m, grp, method, mk(g), g) for grp in _groups(prompts, batch)]
        toks = [t for o in outs for t in o.tokens]
        rows.append({"sampler": name, "gen_length": g, "nfe_per_item": float(np.mean([o.stats["nfe"] for o in outs])),
                     **text_quality(judge, prompts, toks, eos), "sample": m.tokenizer.decode(toks[0])[:200]})
        print(f"  free code {g} {name}: ppl {rows[-1]['judge_ppl']:.1f}, distinct-4 {rows[-1]['distinct4']:.2f}, "
              f"NFE {rows[-1]['nfe_per_item']:.1f}", file=sys.stderr, flush=True)
    for r in rows[:2]:
        print(f"  free code {g} {r['sampler']}: ppl {r['judge_ppl']:.1f}, distinct-4 {r['distinct4']:.2f}",
              file=sys.stderr, flush=True)
    return rows


def tune_dico(m, g: int, batch: int, out: Path) -> dict:
    """Grid over DICO_GRID on the tuning slice at length g: accuracy and NFE per setting; the pick is the setting
    with the fewest forwards among those within one point of the best per-position accuracy (the exact accuracy of
    a small model on long answers is too coarse to rank settings by)."""
    from train import tasks

    items = tasks.split_long()[1][TUNING_SLICE]
    items = items[: len(items) // batch * batch]
    tok = m.tokenizer.backend
    keys = list(DICO_GRID)
    results = []
    for vals in itertools.product(*(DICO_GRID[k] for k in keys)):
        opts = dict(zip(keys, vals))
        outs = [_run(m, [it.prompt for it in grp], "dico", opts, g) for grp in _groups(items, batch)]
        exact, pos = _score(items, [t for o in outs for t in o.texts], tok)
        res = {"options": opts, "accuracy": float(np.mean(exact)), "position_accuracy": float(np.mean(pos)),
               "nfe_per_item": float(np.mean([o.stats["nfe"] for o in outs]))}
        results.append(res)
        print(f"  tune {opts}: acc {res['accuracy']:.3f} pos {res['position_accuracy']:.3f} NFE "
              f"{res['nfe_per_item']:.1f}", file=sys.stderr, flush=True)
    best = max(r["position_accuracy"] for r in results)
    pick = min((r for r in results if r["position_accuracy"] >= best - 0.01), key=lambda r: r["nfe_per_item"])
    out.mkdir(parents=True, exist_ok=True)
    rep = {"gen_length": g, "batch": batch, "items": len(items), "slice": [TUNING_SLICE.start, TUNING_SLICE.stop],
           "grid": DICO_GRID, "results": results, "pick": pick}
    (out / "dico_tuning.json").write_text(json.dumps(rep, indent=1))
    print(f"DiCo pick on the tuning slice ({len(items)} items, length {g}): {pick}")
    return rep


def pictures(m, items, samplers, g: int, out_dir: Path) -> list[str]:
    """One PNG per sampler: the step at which each canvas position of 4 items was decoded."""
    from infer.plots import commit_order_plot

    paths = []
    for name in samplers:
        method, mk = SAMPLERS[name]
        out = _run(m, [it.prompt for it in items[:4]], method, mk(g), g)
        paths.append(str(commit_order_plot(np.asarray(out.stats["commit_step"]), out_dir / f"commit_order_{name}_g{g}.png",
                                           title=f"{name}, length {g}: decoding step per position "
                                                 f"(NFE {out.stats['nfe']:.0f})")))
    return paths


def pareto_plot(rows, code, path: Path) -> Path:
    """Accuracy (long tasks) and judge perplexity (free code) against forwards per item and tokens/s, per length;
    the non-dominated samplers joined by a line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import NullFormatter, ScalarFormatter

    lengths = sorted({r["gen_length"] for r in rows})
    big = max(r["batch"] for r in rows)
    fig, axes = plt.subplots(len(lengths), 3, figsize=(16, 4.6 * len(lengths)), squeeze=False)
    fam = lambda s: s.split("-")[0] if not s.startswith("fast") else "fast-dllm"  # noqa: E731
    colors = {"vanilla": "black", "llada": "grey", "fast-dllm": "tab:blue", "eb": "tab:green", "dico": "tab:red"}
    for i, g in enumerate(lengths):
        rs = [r for r in rows if r["gen_length"] == g and r["batch"] == big]
        cs = [r for r in code if r["gen_length"] == g and r.get("nfe_per_item") and r["sampler"] in SAMPLERS]
        yk = "accuracy" if any(r["accuracy"] > 0 for r in rs) else "position_accuracy"  # exact 0 everywhere: rank
        what = "exact" if yk == "accuracy" else "per-position"  # by the fraction of correct positions
        panels = [(axes[i][0], rs, "nfe_per_item", yk, f"long tasks, length {g}: {what} accuracy", True, False),
                  (axes[i][1], rs, "tokens_per_s", yk, f"long tasks, length {g}, batch {big}", True, True),
                  (axes[i][2], cs, "nfe_per_item", "judge_ppl", f"free code, length {g}: judge perplexity", False,
                   False)]
        for ax, data, xk, yk, title, higher, x_higher in panels:
            for r in data:
                ax.scatter(r[xk], r[yk], color=colors.get(fam(r["sampler"]), "tab:purple"), s=28)
                ax.annotate(r["sampler"], (r[xk], r[yk]), fontsize=6.5, xytext=(3, 2), textcoords="offset points")
            front = _front(data, xk, yk, higher, x_higher)
            if front:
                ax.plot([r[xk] for r in front], [r[yk] for r in front], color="tab:orange", lw=1, zorder=0)
            ax.set_xscale("log")
            ax.xaxis.set_major_formatter(ScalarFormatter())
            ax.xaxis.set_minor_formatter(NullFormatter())
            ax.set_xlabel({"nfe_per_item": "model forwards per item (log)", "tokens_per_s": "tokens/s (log)"}[xk])
            ax.set_ylabel({"accuracy": "exact accuracy", "position_accuracy": "per-position accuracy",
                           "judge_ppl": "perplexity under code-target"}[yk])
            ax.set_title(title, fontsize=10)
            ax.grid(alpha=0.3)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _front(data, xk, yk, higher: bool, x_higher: bool) -> list[dict]:
    """Non-dominated points: fewer forwards (or more tokens/s) and better quality."""
    def better(a, b):
        xa, xb = (a[xk], b[xk]) if x_higher else (-a[xk], -b[xk])
        ya, yb = (a[yk], b[yk]) if higher else (-a[yk], -b[yk])
        return xa >= xb and ya >= yb and (xa > xb or ya > yb)

    front = [r for r in data if not any(better(o, r) for o in data)]
    return sorted(front, key=lambda r: r[xk])


def to_markdown(rows, code, meta) -> str:
    big = max(r["batch"] for r in rows)
    lines = [f"Model {meta['model']}, {meta['machine']}; {meta['items']} held-out {meta['tasks']} task items per row "
             f"(evenly across kinds), quality from one pass at batch {big}; tokens/s over the first "
             f"{meta['timing_items']} items at every batch, median of {meta['repeats']} interleaved rounds (timed "
             f"tokens equal the quality pass's: {meta['same_tokens']}"
             + (f"; temperature {meta['temperature']}: a row samples differently in a batch of another size"
                if meta.get("temperature") else "") + f"). {meta['bench_minutes']:.1f} min.", "",
             "| length | batch | sampler | exact acc. | per-position acc. | NFE / item | tokens/s | compile s |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['gen_length']} | {r['batch']} | {r['sampler']} | {r['accuracy']:.3f} | "
                     f"{r['position_accuracy']:.3f} | {r['nfe_per_item']:.1f} | {r['tokens_per_s']:.1f} | "
                     f"{r['compile_s']:.1f} |")
    for g in sorted({r["gen_length"] for r in rows}):
        rs = [r for r in rows if r["gen_length"] == g and r["batch"] == big]
        kinds = list(rs[0]["accuracy_by_kind"])
        lines += ["", f"Exact accuracy by kind (length {g}):", "", "| sampler | " + " | ".join(kinds) + " |",
                  "|---" * (len(kinds) + 1) + "|"]
        lines += [f"| {r['sampler']} | " + " | ".join(f"{r['accuracy_by_kind'][k]:.2f}" for k in kinds) + " |"
                  for r in rs]
    canv = [r for r in rows if r["batch"] == big and "forwards_per_canvas" in r]
    if canv:
        lines += ["", f"Per canvas (a block-diffusion model; its KV cache holds {meta['cache_bytes_per_token']} bytes "
                      f"per token at {meta['cache_dtype']}): decoder forwards per canvas, and the tokens the encoder "
                      "ran per item with its cache against re-encoding the prompt and committed canvases before each "
                      "decoder step:", "",
                  "| length | sampler | forwards / canvas | canvases / item | encoder tokens / item | without the cache "
                  "| saved |", "|---|---|---|---|---|---|---|"]
        lines += [f"| {r['gen_length']} | {r['sampler']} | {r['forwards_per_canvas']:.2f} | "
                  f"{r['canvases_per_item']:.2f} | {r['encoder_tokens_per_item']:.0f} | "
                  f"{r['uncached_encoder_tokens_per_item']:.0f} | "
                  f"{r['uncached_encoder_tokens_per_item'] / max(r['encoder_tokens_per_item'], 1):.1f}x |" for r in canv]
    if code:
        lines += ["", f"Free code: continuations of {meta['code_prompts']} validation-file prompts of "
                      f"{meta['prompt_tokens']} tokens, judged by {meta['judge']}:", "",
                  "| length | sampler | judge perplexity | distinct 4-grams | NFE / item |", "|---|---|---|---|---|"]
        for q in code:
            nfe = "" if q["nfe_per_item"] is None else f"{q['nfe_per_item']:.1f}"
            lines.append(f"| {q['gen_length']} | {q['sampler']} | {q['judge_ppl']:.1f} | {q['distinct4']:.2f} | {nfe} |")
    if meta.get("plot"):
        lines += ["", f"Pareto plot: {meta['plot']}"]
    return "\n".join(lines) + "\n"


def run(args) -> int:
    import os
    import platform

    import jax

    import pdecode

    check_args(args)  # before anything loads or runs
    # the recorded zoo figures ran float32 weights; a user's own checkpoint loads as --dtype says (default: as stored)
    items_file = getattr(args, "items_file", None)
    m = pdecode.load(args.model, dtype=(getattr(args, "dtype", None) or "auto") if items_file else "float32")
    if getattr(args, "tune_dico", False):
        tune_dico(m, max(args.gen_lengths), max(args.batch), args.out)
        return 0
    block = bool(m.cfg.arch.canvas_length)
    samplers = args.samplers or (list(BLOCK_SAMPLERS) if block else [s for s in SAMPLERS if not s.startswith("bd-")])
    wrong = [s for s in samplers if s in SAMPLERS and s.startswith("bd-") != block]
    if wrong:
        raise pdecode.InputError(f"sampler {wrong[0]!r} is for {'masked' if block else 'block'}-diffusion models; "
                                 f"{args.model} is a {'block' if block else 'masked'}-diffusion model: use "
                                 f"{', '.join(BLOCK_SAMPLERS) if block else 'the others'}")
    unknown = set(samplers) - set(SAMPLERS)
    if unknown:
        raise pdecode.InputError(f"unknown sampler(s) {sorted(unknown)}; choose from {', '.join(SAMPLERS)}")
    temperature = (getattr(args, "temperature", None) or [None])[0]
    items = file_items(items_file, m.tokenizer, args.items) if items_file else task_items(args.tasks, args.items)
    if len(items) < max(args.batch):
        raise pdecode.InputError(f"{len(items)} items are fewer than the largest --batch ({max(args.batch)})")
    t0 = time.perf_counter()
    rows, code = [], []
    judge = pdecode.load(args.judge, dtype="float32") if args.judge else None
    ref = pdecode.load(args.ar_reference, dtype="float32") if args.ar_reference else None
    out = args.out
    out.mkdir(parents=True, exist_ok=True)
    try:
        for g in args.gen_lengths:
            rows += task_rows(m, items, samplers, g, sorted(args.batch), args.repeats, args.timing_items, temperature)
            if judge is not None and args.code_prompts:
                code += code_rows(m, judge, ref, samplers, g, args.code_prompts, args.prompt_tokens, max(args.batch))
    except BaseException as e:  # what was measured is kept: results.json with the rows done so far, then the error
        (out / "results.json").write_text(json.dumps(
            {"meta": {"model": args.model, "incomplete": f"{type(e).__name__}: {e}",
                      "bench_minutes": (time.perf_counter() - t0) / 60}, "rows": rows, "code": code},
            indent=1, default=lambda o: getattr(o, "name", None) or str(o)))
        print(f"  stopped by {type(e).__name__}: the {len(rows)} row(s) measured are in {out / 'results.json'}",
              file=sys.stderr, flush=True)
        raise
    big = max(args.batch)
    meta = {"model": args.model, "tasks": str(items_file) if items_file else args.tasks,
            "items": len(items) // big * big, "repeats": args.repeats, "temperature": temperature,
            "judge": args.judge, "ar_reference": args.ar_reference, "timing_items": args.timing_items,
            "code_prompts": args.code_prompts, "prompt_tokens": args.prompt_tokens,
            "same_tokens": all(r["same_tokens"] for r in rows),
            "machine": f"{platform.machine()} {os.cpu_count()} CPUs, {jax.devices()[0].platform}",
            "bench_minutes": (time.perf_counter() - t0) / 60}
    if block:
        dt = jax.tree.leaves(m.params)[0].dtype  # the cache takes the params' dtype
        meta.update(cache_dtype=str(dt), cache_bytes_per_token=encoder_cache_bytes_per_token(m.cfg, dt))
    meta["plot"] = str(pareto_plot(rows, code, out / "pareto.png"))
    meta["pictures"] = pictures(m, items, [s for s in PICTURED if s in samplers], max(args.gen_lengths), out)
    (out / "results.json").write_text(json.dumps({"meta": meta, "rows": rows, "code": code}, indent=1,
                                                 default=lambda o: getattr(o, "name", None) or str(o)))  # an editor: its name
    md = to_markdown(rows, code, meta)
    (out / "results.md").write_text(md)
    print(md)
    return 0
