"""Speculation by cost in the serving engine, side by side: ar, sd with speculation="always" and sd with
speculation="auto" run the serve bench's workload (48 validation prompts of 16-64 tokens, budgets 32-96, greedy)
through `Engine.run_once` in one process, the engines' passes interleaved; prints tokens/s medians, the median of
per-pass ratios to ar, and what auto measured (calls by kind, tau, the timed cost ratio).

    python scripts/spec_cost_bench.py --slots 16 --passes 5 [--engines ar 'sd auto']

Engines as `pdecode serve` makes them: paged (a pool of slots x 1024 positions), default spans and row buckets.
"""

from __future__ import annotations

import argparse
import time

import numpy as np


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--slots", type=int, default=16)
    ap.add_argument("--passes", type=int, default=5)
    ap.add_argument("--model", default="code-target")
    ap.add_argument("--draft", default="code-draft")
    ap.add_argument("--engines", nargs="+", default=["ar", "sd always", "sd auto"],
                    help="which of ar, 'sd always', 'sd auto' (three engines' programs may not fit one process here)")
    args = ap.parse_args(argv)
    import pdecode
    from infer.serve_bench import _workload
    from pdecode.engine import Engine

    m = pdecode.load(args.model, dtype="bfloat16", activation_dtype="float32")
    d = pdecode.load(args.draft, dtype="bfloat16", activation_dtype="float32")
    work = _workload(m, 48, (16, 64), (32, 96))
    kw = dict(slots=args.slots, max_len=1024, chunk=128, kv_pages=args.slots * 1024 // 16)  # `pdecode serve`'s
    make = {"ar": lambda: Engine(m, method="ar", **kw), "sd always": lambda: Engine(m, method="sd", draft=d, **kw),
            "sd auto": lambda: Engine(m, method="sd", draft=d, speculation="auto", **kw)}
    engs = {k: make[k]() for k in args.engines}
    for e in engs.values():
        e.warmup()
    auto = engs.get("sd auto")
    if auto is not None:
        print(f"slots {args.slots}; auto's warm-up cost ratio {auto.spec_cost:.2f}", flush=True)
    ids = [m.tokenizer.encode(p) if isinstance(p, str) else p for p, _ in work]
    tps = {k: [] for k in engs}
    for i in range(args.passes):
        for k, e in engs.items():
            t = time.perf_counter()
            reqs = [e.submit(x, e.check(x, max_tokens=b, temperature=0.0)) for x, (_, b) in zip(ids, work)]
            while not e.idle:
                e.run_once()
            tps[k].append(sum(len(r.tokens) for r in reqs) / (time.perf_counter() - t))
        print(f"pass {i + 1}: " + ", ".join(f"{k} {v[-1]:.1f}" for k, v in tps.items()), flush=True)
    ar = np.array(tps["ar"])
    print("| engine | tok/s (median) | x ar (median of per-pass ratios) |\n|---|---|---|")
    for k, v in tps.items():
        print(f"| {k} | {np.median(v):.1f} | {np.median(np.array(v) / ar):.3f} |")
    if auto is None:
        return
    st = auto.stats
    print(f"auto: {st['drafted_steps']} drafted and {st['plain_steps']} plain step calls; tau {auto.tau:.2f}; "
          f"row steps per second per live row by (row bucket, span) (drafted, plain): "
          f"{ {r: (round(c[True] or 0, 1), round(c[False] or 0, 1)) for r, c in sorted(auto.rate.items())} }; "
          f"break-even tau (all slots) {auto.spec_cost:.2f}")


if __name__ == "__main__":
    main()
