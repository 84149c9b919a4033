"""Benchmark of the masked-diffusion samplers on the checkable task set, side by side in one process.

    pdecode bench --suite diffusion --model code-dllm --gen-lengths 64 256 --batch 1 8

For each generation length and batch size, every sampler decodes the same held-out task prompts; reported: exact-
answer accuracy, model forwards (NFE) per prompt, new tokens per forward, tokens/s (the answer's tokens, EOS
included), compile time. Then generative perplexity of free code continuations under ``--judge`` (code-target),
with a repetition check (distinct 4-grams) and token entropy. One PNG per sampler shows the step at which each
canvas position was decoded.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

SAMPLERS = {
    # name: (method, options given the generation length g)
    "vanilla": ("diffusion", lambda g: dict(block_length=g, steps=g)),
    "llada-blocks": ("diffusion", lambda g: dict(block_length=min(32, g), steps=g)),
    "fast-dllm-0.9": ("diffusion", lambda g: dict(block_length=min(32, g), rule="threshold", threshold=0.9)),
    "fast-dllm-0.9-dual": ("diffusion", lambda g: dict(block_length=min(32, g), rule="threshold", threshold=0.9,
                                                        cache="dual")),
    "fast-dllm-0.9-dual-r2": ("diffusion", lambda g: dict(block_length=min(32, g), rule="threshold", threshold=0.9,
                                                           cache="dual", refresh_every=2)),
    "eb-sampler": ("diffusion", lambda g: dict(block_length=min(32, g), rule="eb", eb_gamma=0.3)),
    "dico": ("dico", lambda g: {}),
    "dico-blocks": ("dico", lambda g: dict(block_length=min(32, g))),
}


def _run(m, prompts, method, opts, g, seed=0):
    import pdecode

    return pdecode.generate(m, prompts, method=method, max_new_tokens=g, seed=seed, **opts)


def accuracy_rows(m, items, samplers, gen_lengths, batches, repeats: int) -> list[dict]:
    """One row per (length, batch, sampler). The repeats are interleaved (every sampler once per round), so drift
    in this machine's speed over a run touches all samplers alike; tokens/s is the median over rounds."""
    from train.tasks import score

    rows = []
    for g in gen_lengths:
        for b in batches:
            groups = [items[i: i + b] for i in range(0, len(items) - b + 1, b)]
            n = len(groups) * b
            opts = {name: SAMPLERS[name][1](g) for name in samplers}
            warm = {name: _run(m, [it.prompt for it in groups[0]], SAMPLERS[name][0], opts[name], g)
                    for name in samplers}
            walls: dict[str, list[float]] = {name: [] for name in samplers}
            tally: dict[str, dict] = {}
            for r in range(repeats):
                for name in samplers:
                    wall, correct, nfe, toks = 0.0, 0, 0, 0
                    by_kind: dict[str, list[int]] = {}
                    for grp in groups:
                        out = _run(m, [it.prompt for it in grp], SAMPLERS[name][0], opts[name], g)
                        wall += out.stats["wall_s"]
                        for it, t in zip(grp, out.texts):
                            ok = score(it, t)
                            correct += ok
                            by_kind.setdefault(it.kind, []).append(int(ok))
                        nfe += out.stats["nfe"] * len(grp)
                        toks += out.stats["new_tokens"]
                    walls[name].append(wall)
                    tally[name] = {"correct": correct, "nfe": nfe, "toks": toks, "by_kind": by_kind}
            for name in samplers:
                t = tally[name]
                med = statistics.median(walls[name])
                row = {"sampler": name, "gen_length": g, "batch": b, "accuracy": t["correct"] / n, "items": n,
                       "nfe_per_prompt": t["nfe"] / n, "tokens_per_forward": t["toks"] / max(t["nfe"], 1),
                       "tokens_per_s": t["toks"] / med, "wall_s_median": med,
                       "compile_s": warm[name].stats["compile_s"],
                       "accuracy_by_kind": {k: float(np.mean(v)) for k, v in sorted(t["by_kind"].items())},
                       "options": opts[name]}
                rows.append(row)
                print(f"  gen {g} batch {b} {name}: acc {row['accuracy']:.3f}, NFE {row['nfe_per_prompt']:.1f}, "
                      f"{row['tokens_per_s']:.1f} tok/s", file=sys.stderr, flush=True)
    return rows


def free_generation_quality(m, judge, samplers, g: int, n_prompts: int) -> list[dict]:
    """Generative perplexity under the judge (an AR model) of free continuations of validation code."""
    import pdecode
    from train.data import validation_prompts

    prompts = validation_prompts(m.tokenizer.backend, n_prompts, 32, offset_tokens=64)
    rows = []
    for name in samplers:
        method, mk = SAMPLERS[name]
        out = _run(m, prompts, method, {**mk(g)}, g)
        nll, count, distinct, ent = 0.0, 0, [], []
        for p, toks in zip(prompts, out.tokens):
            toks = [t for t in toks if t not in (m.cfg.eos_token_ids or ())]
            if len(toks) < 2:
                continue
            seq = p + toks
            lg = np.asarray(pdecode.forward_logits(judge, [seq]))[0]
            logp = lg - lg.max(-1, keepdims=True)
            logp = logp - np.log(np.exp(logp).sum(-1, keepdims=True))
            idx = np.arange(len(p) - 1, len(seq) - 1)
            nll += -float(logp[idx, np.asarray(seq)[idx + 1]].sum())
            count += len(toks)
            grams = [tuple(toks[i: i + 4]) for i in range(len(toks) - 3)]
            distinct.append(len(set(grams)) / max(len(grams), 1))
            c = np.bincount(toks)
            pr = c[c > 0] / c.sum()
            ent.append(float(-(pr * np.log(pr)).sum()))
        rows.append({"sampler": name, "gen_length": g, "gen_ppl": float(np.exp(nll / max(count, 1))),
                     "distinct4": float(np.mean(distinct)) if distinct else 0.0,
                     "token_entropy": float(np.mean(ent)) if ent else 0.0, "tokens": count,
                     "nfe": out.stats["nfe"]})
        print(f"  free gen {name}: ppl {rows[-1]['gen_ppl']:.1f}, distinct-4 {rows[-1]['distinct4']:.2f}",
              file=sys.stderr, flush=True)
    return rows


def pictures(m, items, samplers, g: int, out_dir: Path) -> list[str]:
    from infer.plots import commit_order_plot

    paths = []
    prompts = [it.prompt for it in items[:4]]
    for name in samplers:
        method, mk = SAMPLERS[name]
        out = _run(m, prompts, method, mk(g), g, seed=0)
        steps = np.asarray(out.stats["commit_step"])
        p = commit_order_plot(steps, out_dir / f"commit_order_{name}_g{g}.png",
                              title=f"{name}, gen length {g}: decoding step per position (NFE {out.stats['nfe']})")
        paths.append(str(p))
    return paths


def to_markdown(rows, quality, meta) -> str:
    lines = [f"Held-out task items: {meta['items']} per row, {meta['repeats']} repeats interleaved across samplers "
             f"(median wall), model {meta['model']}, {meta['machine']}.", "",
             "| gen length | batch | sampler | accuracy | NFE / prompt | tokens / forward | tokens/s | compile s |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['gen_length']} | {r['batch']} | {r['sampler']} | {r['accuracy']:.3f} | "
                     f"{r['nfe_per_prompt']:.1f} | {r['tokens_per_forward']:.2f} | {r['tokens_per_s']:.1f} | "
                     f"{r['compile_s']:.1f} |")
    big = [r for r in rows if r["gen_length"] == max(x["gen_length"] for x in rows) and r["batch"] == rows[0]["batch"]]
    kinds = sorted({k for r in big for k in r.get("accuracy_by_kind", {})})
    if kinds:
        counts = ", ".join(f"{k} {n}" for k, n in meta.get("items_by_kind", {}).items())
        lines += ["", f"Accuracy by task kind (gen length {big[0]['gen_length']}, batch {big[0]['batch']}; items per "
                      f"kind: {counts}):", "",
                  "| sampler | " + " | ".join(kinds) + " |", "|---" * (len(kinds) + 1) + "|"]
        for r in big:
            lines.append(f"| {r['sampler']} | " + " | ".join(f"{r['accuracy_by_kind'].get(k, 0):.2f}" for k in kinds)
                         + " |")
    if quality:
        lines += ["", f"Free generation ({quality[0]['gen_length']} tokens after 32-token validation-code prompts), "
                      f"judged by {meta['judge']}:", "",
                  "| sampler | generative perplexity | distinct 4-grams | token entropy | NFE |", "|---|---|---|---|---|"]
        for q in quality:
            lines.append(f"| {q['sampler']} | {q['gen_ppl']:.1f} | {q['distinct4']:.2f} | {q['token_entropy']:.2f} | "
                         f"{q['nfe']} |")
    if meta.get("pictures"):
        lines += ["", "Pictures: " + ", ".join(meta["pictures"])]
    return "\n".join(lines) + "\n"


def run(args) -> int:
    import os
    import platform

    import jax

    import pdecode
    from train.tasks import split

    m = pdecode.load(args.model)
    _, heldout = split()
    items = heldout[: args.items]
    samplers = args.samplers or list(SAMPLERS)
    unknown = set(samplers) - set(SAMPLERS)
    if unknown:
        raise pdecode.InputError(f"unknown sampler(s) {sorted(unknown)}; choose from {', '.join(SAMPLERS)}")
    t0 = time.perf_counter()
    rows = accuracy_rows(m, items, samplers, args.gen_lengths, args.batch, args.repeats)
    quality = []
    if args.judge:
        quality = free_generation_quality(m, pdecode.load(args.judge), samplers, min(args.gen_lengths), 8)
    out = args.out
    out.mkdir(parents=True, exist_ok=True)
    meta = {"model": args.model, "items": len(items), "repeats": args.repeats, "judge": args.judge,
            "items_by_kind": {k: sum(it.kind == k for it in items) for k in sorted({it.kind for it in items})},
            "machine": f"{platform.machine()} {os.cpu_count()} CPUs, {jax.devices()[0].platform}",
            "bench_minutes": (time.perf_counter() - t0) / 60}
    meta["pictures"] = pictures(m, items, samplers, max(args.gen_lengths), out)
    (out / "results.json").write_text(json.dumps({"meta": meta, "rows": rows, "quality": quality}, indent=1))
    md = to_markdown(rows, quality, meta)
    (out / "results.md").write_text(md)
    print(md)
    return 0
