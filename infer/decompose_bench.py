"""`pdecode bench --suite decompose`: decomposition-and-fill against filling the same points one after another,
against one AR generation of all the bodies in sequence, and against the same batch without prefix sharing.

Prompts are multi-stub prompts cut from validation files of the corpus (never trained on): the file's header (its
imports and what comes before the first top-level function) and the signatures and docstrings of its first N
top-level functions. Every variant fills the same points with the same budget; rows are timed interleaved, medians
over repeats, after one warm-up call per shape; bodies are judged by code-target's perplexity.
"""

from __future__ import annotations

import ast
import importlib
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

D = importlib.import_module("pdecode.decompose")
from pdecode import generation  # noqa: E402


def stub_prompts(n_points: int, count: int, long_prefix: bool = False, prefix_chars: int = 1600) -> list[str]:
    """``count`` (prompt, header, stubs) of a header plus ``n_points`` stubs from validation files with enough documented functions.
    The header is what comes before the file's first top-level definition; with ``long_prefix`` the stubs are the
    file's last documented functions and the header is the ``prefix_chars`` of code before them (whole lines:
    complete earlier functions, a long shared prefix; the "stubs" planner would take those functions for stubs too,
    so these prompts are planned by a callable that returns the header and the stubs)."""
    from train import data

    _, val = data.split_files()
    out = []
    for f in val:
        src = data.read_text(f)
        try:
            tree = ast.parse(src)
        except SyntaxError:
            continue
        fns = [n for n in tree.body if isinstance(n, ast.FunctionDef) and ast.get_docstring(n) and not n.decorator_list]
        if len(fns) < n_points:
            continue
        lines = src.splitlines(keepends=True)
        if long_prefix:
            fns = fns[-n_points:]
            before = "".join(lines[: fns[0].lineno - 1])
            if len(before) < prefix_chars:
                continue
            cut = before[-prefix_chars:]
            header = cut[cut.index("\n") + 1:].rstrip() + "\n\n\n"
        else:
            first = min(n.lineno for n in tree.body
                        if isinstance(n, (ast.FunctionDef, ast.ClassDef, ast.AsyncFunctionDef)))
            header = "".join(lines[: first - 1]).rstrip() + "\n\n\n"
            if len(header) > 4000:
                continue
        stubs = []
        for fn in fns[:n_points]:
            doc = fn.body[0]
            stubs.append("".join(lines[fn.lineno - 1: doc.end_lineno]).rstrip())
        prompt = header + "\n\n\n".join(stubs) + "\n"
        if not long_prefix and len(D.plan_stubs(prompt).points) != n_points:
            continue
        out.append((prompt, header, stubs))
        if len(out) == count:
            break
    return out


def _time(fn, repeats: int) -> float:
    ts = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def judge_ppl(judge, prefix_points_fills: list[tuple[str, str]]) -> float:
    """code-target's perplexity of the fills given their contexts (token-weighted over all fills)."""
    import pdecode

    nll, n = 0.0, 0
    for ctx, fill in prefix_points_fills:
        a = judge.tokenizer.encode(ctx)
        b = judge.tokenizer.encode(ctx + fill)
        if len(b) <= len(a):
            continue
        padded = b + [0] * (-len(b) % 64)  # causal: padding after the text changes none of its logits; few shapes
        logits = np.asarray(pdecode.forward_logits(judge, [padded]))[0][: len(b)]
        lp = logits - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1, keepdims=True)) - \
            logits.max(-1, keepdims=True)
        tgt = np.asarray(b[len(a):])
        nll -= float(lp[np.arange(len(a) - 1, len(b) - 1), tgt].sum())
        n += len(tgt)
    return float(np.exp(nll / max(n, 1)))


def run(args) -> int:
    import pdecode

    m = pdecode.load(args.model, dtype="float32")
    draft = pdecode.load(args.draft or "code-draft", dtype="float32")
    judge = pdecode.load(args.judge or "code-target", dtype="float32")
    budget = args.new_tokens
    rows = []
    points_list = args.points or [2, 4, 8]
    methods = args.methods or ["ar", "sd", "lookup"]
    for n_points in points_list:
        prompts = stub_prompts(n_points, args.prompts)
        if not prompts:
            print(f"decompose bench: no validation file has {n_points} documented functions", file=sys.stderr)
            continue
        prompts = [p for p, _, _ in prompts]
        for method in methods:
            kw = {"draft": draft} if method == "sd" else {}
            res = {"decompose": [], "no_sharing": [], "one_by_one": [], "one_ar_call": []}
            ppl_ctx = {"decompose": [], "one_by_one": []}
            forwards = {"decompose": [], "one_by_one": []}
            router = [D._route(D.plan_stubs(p))[0] for p in prompts]  # what the router would have done
            for prompt in prompts:
                plan = D.plan_stubs(prompt)
                ids = [m.tokenizer.encode(plan.prefix + p) for p in plan.points]

                def dec():  # the router off: these files' functions may call each other; fill them in parallel anyway
                    return pdecode.decompose(m, prompt, method=method, max_new_tokens=budget, router=False, **kw)

                # the baselines end each body as decompose does (on the device, at its first line back at column 0)
                def nosh():
                    return pdecode.generate(m, ids, method=method, max_new_tokens=budget, stop_at_dedent=True, **kw)

                def seq():
                    return [pdecode.generate(m, [x], method=method, max_new_tokens=budget, stop_at_dedent=True, **kw)
                            for x in ids]

                def one():
                    return pdecode.generate(m, [m.tokenizer.encode(prompt)], method=method,
                                            max_new_tokens=budget * n_points, **kw)

                fns = {"decompose": dec, "no_sharing": nosh, "one_by_one": seq, "one_ar_call": one}
                for f in fns.values():  # compile every shape first
                    f()
                times = {k: [] for k in fns}
                for _ in range(args.repeats):  # interleaved
                    for k, f in fns.items():
                        t0 = time.perf_counter()
                        f()
                        times[k].append(time.perf_counter() - t0)
                for k in fns:
                    res[k].append(statistics.median(times[k]))
                d = dec()
                s = seq()
                ppl_ctx["decompose"] += [(plan.prefix + p, f) for p, f in zip(plan.points, d.fills)]
                ppl_ctx["one_by_one"] += [(plan.prefix + p, D.cut_body(o.texts[0])) for p, o in zip(plan.points, s)]
                forwards["decompose"].append(d.stats["fill_forwards"])
                forwards["one_by_one"].append(sum(o.stats["target_forwards"] for o in s))
            row = {"points": n_points, "method": method, "prompts": len(prompts), "new_tokens_per_point": budget,
                   "router_would": router,
                   **{f"{k}_s": float(np.median(v)) for k, v in res.items()},
                   "speedup_vs_one_by_one": float(np.median(np.array(res["one_by_one"]) / np.array(res["decompose"]))),
                   "speedup_vs_no_sharing": float(np.median(np.array(res["no_sharing"]) / np.array(res["decompose"]))),
                   "speedup_vs_one_ar_call": float(np.median(np.array(res["one_ar_call"]) /
                                                            np.array(res["decompose"]))),
                   "fill_forwards": float(np.mean(forwards["decompose"])),
                   "one_by_one_forwards": float(np.mean(forwards["one_by_one"])),
                   "ppl_decompose": judge_ppl(judge, ppl_ctx["decompose"]),
                   "ppl_one_by_one": judge_ppl(judge, ppl_ctx["one_by_one"])}
            rows.append(row)
            print(json.dumps(row), file=sys.stderr)
            pdecode.clear_compile_cache()  # every executable holds code pages: a long sweep would exhaust the maps
    # the long shared prefix: headers of at least ~300 tokens
    long_rows = []
    prompts = stub_prompts(4, args.prompts, long_prefix=True)
    for prompt, header, stubs in prompts:
        ids = [m.tokenizer.encode(header + p) for p in stubs]
        planner = lambda p, h=header, st=stubs: (h, st, "\n\n\n")  # noqa: E731
        dec = lambda pl=planner: pdecode.decompose(m, prompt, planner=pl, max_new_tokens=budget)  # noqa: E731
        nosh = lambda x=ids: pdecode.generate(m, x, max_new_tokens=budget)  # noqa: E731
        dec(), nosh()
        td, tn = [], []
        for _ in range(args.repeats):  # interleaved
            td.append(_time(dec, 1))
            tn.append(_time(nosh, 1))
        pdecode.clear_compile_cache()
        long_rows.append({"prefix_tokens": generation.common_prefix(ids), "decompose_s": statistics.median(td),
                          "no_sharing_s": statistics.median(tn), "speedup": statistics.median(tn) / statistics.median(td)})
    skel_rows = skeleton_rows(m, stub_prompts(2, args.prompts), budget, args.repeats)
    out = Path(args.out or "docs/bench/decompose")
    out.mkdir(parents=True, exist_ok=True)
    meta = {"command": "pdecode " + " ".join(sys.argv[1:]), "model": args.model,
            "repeats": args.repeats, "date": time.strftime("%Y-%m-%d")}
    (out / "results.json").write_text(json.dumps({"meta": meta, "rows": rows, "long_prefix": long_rows,
                                                        "skeleton": skel_rows}, indent=1))
    md = to_markdown(rows, long_rows, meta, skel_rows)
    (out / "results.md").write_text(md)
    try:
        plot(rows, out / "latency.png")
    except ImportError:
        pass
    print(md)
    return 0


def skeleton_rows(m, prompts, budget: int, repeats: int) -> list[dict]:
    """The skeleton planner end to end on each file's header (code-target writes an outline of stubs, then fills
    them), against one AR call writing as many new tokens as outline and bodies together."""
    import pdecode

    rows = []
    for _, header, _ in prompts:
        dec = lambda h=header: pdecode.decompose(m, h, planner="skeleton", max_new_tokens=budget)  # noqa: E731
        d = dec()
        total = len(m.tokenizer.encode(d.stats["outline"], add_special_tokens=False)) + d.stats["new_tokens"]
        one = lambda h=header, n=total: pdecode.generate(m, [h], max_new_tokens=n, stop_at_eos=False)  # noqa: E731
        one()
        td, to = [], []
        for _ in range(repeats):  # interleaved
            td.append(_time(dec, 1))
            to.append(_time(one, 1))
        pdecode.clear_compile_cache()
        rows.append({"points": len(d.points), "mode": d.stats["decision"]["mode"], "outline_forwards": d.stats["plan_forwards"],
                     "fill_forwards": d.stats["fill_forwards"], "new_tokens": total,
                     "skeleton_s": statistics.median(td), "one_ar_call_s": statistics.median(to),
                     "speedup": statistics.median(to) / statistics.median(td)})
    return rows


def to_markdown(rows, long_rows, meta, skel_rows=()) -> str:
    lines = [f"# Decomposition-and-fill ({meta['date']})", "", f"`{meta['command']}`; model {meta['model']}, medians of "
             f"{meta['repeats']} interleaved repeats per prompt, then the median over prompts.", "",
             "| points | method | decompose s | one by one s | one AR call s | no sharing s | × vs one by one | "
             "× vs one AR call | × vs no sharing | fill forwards (one by one) | judge ppl decompose / one by one |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['points']} | {r['method']} | {r['decompose_s']:.3f} | {r['one_by_one_s']:.3f} | "
                     f"{r['one_ar_call_s']:.3f} | {r['no_sharing_s']:.3f} | {r['speedup_vs_one_by_one']:.2f} | "
                     f"{r['speedup_vs_one_ar_call']:.2f} | {r['speedup_vs_no_sharing']:.2f} | {r['fill_forwards']:.0f} "
                     f"({r['one_by_one_forwards']:.0f}) | {r['ppl_decompose']:.2f} / {r['ppl_one_by_one']:.2f} |")
    if long_rows:
        lines += ["", "Long shared prefix (4 points, ar):", "", "| prefix tokens | decompose s | same batch, no sharing s "
                  "| × |", "|---|---|---|---|"]
        for r in long_rows:
            lines.append(f"| {r['prefix_tokens']} | {r['decompose_s']:.3f} | {r['no_sharing_s']:.3f} | "
                         f"{r['speedup']:.2f} |")
    if skel_rows:
        lines += ["", "Skeleton planner end to end (a file's header; the model writes an outline, then the bodies; "
                  "router on), against one AR call of as many new tokens:", "",
                  "| points | router | outline forwards | fill forwards | new tokens | skeleton s | one AR call s | × |",
                  "|---|---|---|---|---|---|---|---|"]
        for r in skel_rows:
            lines.append(f"| {r['points']} | {r['mode']} | {r['outline_forwards']} | {r['fill_forwards']} | {r['new_tokens']} | "
                         f"{r['skeleton_s']:.3f} | {r['one_ar_call_s']:.3f} | {r['speedup']:.2f} |")
    return "\n".join(lines) + "\n"


def plot(rows, path: Path) -> None:
    """Seconds per prompt against the number of points: decompose (solid) and one by one (dashed), one colour per
    inner method."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for c, method in enumerate(sorted({r["method"] for r in rows})):
        rs = sorted((r for r in rows if r["method"] == method), key=lambda r: r["points"])
        col = f"C{c}"
        ax.plot([r["points"] for r in rs], [r["decompose_s"] for r in rs], "o-", color=col,
                label=f"decompose ({method} inside)")
        ax.plot([r["points"] for r in rs], [r["one_by_one_s"] for r in rs], "x--", color=col,
                label=f"one by one ({method})")
    ax.set_xlabel("points (function stubs per prompt)")
    ax.set_ylabel("seconds per prompt (median)")
    ax.set_title("Filling N stubs: one batch over one prefix vs one after another")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def merged_plot(out: Path = Path("docs/bench/decompose")) -> Path:
    """The recorded plot: the main run's rows, its 8-point rows replaced by the router-off run in ``out/points8``."""
    rows = json.loads((out / "results.json").read_text())["rows"]
    p8 = out / "points8" / "results.json"
    if p8.exists():
        eight = json.loads(p8.read_text())["rows"]
        rows = [r for r in rows if r["points"] not in {e["points"] for e in eight}] + eight
    plot(rows, out / "latency.png")
    return out / "latency.png"


if __name__ == "__main__":
    print(merged_plot())
