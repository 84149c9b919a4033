"""N closed-loop clients on the serving engine in one process, side by side: ar against one sd engine with
speculation="auto", its choice per pass as the cost model makes it, forced plain, and forced drafted (the serve bench's
48 requests, greedy; 16 slots, paged, 8 steps a call, as the serve bench's servers). Prints tokens/s per pass, the
medians and the median of per-pass ratios to ar, what auto chose, and its rates.

    python scripts/clients_bench.py --clients 4 [--passes 3] [--modes auto plain drafted]

(A pass of 48 requests takes about a second here, and this VM's speed moves by 30% within minutes: single passes
ranged 0.61-1.23x for the same two engines; use 15 passes or more for a 5% question.)
"""

from __future__ import annotations

import argparse
import collections
import time

import numpy as np


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--passes", type=int, default=3)
    ap.add_argument("--modes", nargs="+", default=["auto", "plain", "drafted"], choices=["auto", "plain", "drafted"],
                    help="the sd engine's choices run each pass (auto: the cost model's)")
    args = ap.parse_args(argv)
    import pdecode
    from infer.load_bench import closed_loop
    from infer.serve_bench import _workload
    from pdecode.engine import Engine

    pdecode.enable_disk_cache()
    m = pdecode.load("code-target", dtype="bfloat16", activation_dtype="float32")
    d = pdecode.load("code-draft", dtype="bfloat16", activation_dtype="float32")
    work = [(m.tokenizer.encode(p) if isinstance(p, str) else p, b) for p, b in _workload(m, 48, (16, 64), (32, 96))]
    kw = dict(slots=16, max_len=1024, chunk=128, kv_pages=1024, steps_per_call=8)
    ar, sd = Engine(m, method="ar", **kw), Engine(m, method="sd", draft=d, speculation="auto", **kw)
    for e in (ar, sd):
        e.warmup()
    print("warm-up's ratios (row bucket: drafted call / plain call)", {k: round(v, 2) for k, v in sd.spec_costs.items()})
    judge = sd._speculate
    tps = collections.defaultdict(list)
    for i in range(args.passes):
        if i % 2 == 0:  # (ar first on even passes, last on odd ones: a drift of the VM within a pass evens out)
            tps["ar"].append(closed_loop(ar, work, args.clients)[0])
        for mode in args.modes:
            sd._speculate = judge if mode == "auto" else (lambda rows, spans=None, v=mode == "drafted": v)
            before = dict(sd.stats)
            tps[f"sd {mode}"].append(closed_loop(sd, work, args.clients)[0])
            if mode == "auto":
                n = {k: sd.stats[k] - before.get(k, 0) for k in ("drafted_steps", "plain_steps")}
                print(f"  auto: {n['drafted_steps']} drafted and {n['plain_steps']} plain calls, tau {sd.tau:.2f}")
        if i % 2 == 1:
            tps["ar"].append(closed_loop(ar, work, args.clients)[0])
        print(f"pass {i + 1}: " + ", ".join(f"{k} {v[-1]:.1f}" for k, v in tps.items()), flush=True)
    base = np.array(tps["ar"])
    print(f"| {args.clients} clients | tok/s (median) | x ar (median of per-pass ratios) | quartiles |\n|---|---|---|---|")
    for k, v in tps.items():
        r = np.array(v) / base
        print(f"| {k} | {np.median(v):.1f} | {np.median(r):.3f} | {np.quantile(r, 0.25):.3f} - {np.quantile(r, 0.75):.3f} |")
    print("auto's rates (row bucket, span): (drafted, plain) row steps per second per row",
          {k: (round(v[True] or 0), round(v[False] or 0)) for k, v in sorted(sd.rate.items())},
          f"; catch-ups {sd.stats['catch_ups']}")


if __name__ == "__main__":
    main()
