"""Row buckets in the serving engine, side by side: per method, two engines (16 slots, max_len 1024, paged) identical
but for their step programs' row counts (4 and 16 — the default when this was measured — and 16 alone), and `pdecode.generate` at batch 1, on
the serve bench's workload: requests one at a time (one client), then all 48 at once. Passes interleaved in one
process; prints tokens/s per pass and the medians after the first pass.

    python scripts/rows_bench.py [--methods ar sd] [--passes 3] [--requests 12]
"""

from __future__ import annotations

import argparse
import statistics
import time


def one_client(e, work) -> float:
    """Tokens/s of engine ``e`` serving ``work`` ((prompt, budget) pairs, greedy) one request after another."""
    n, t = 0, time.perf_counter()
    for p, b in work:
        r = e.submit(p, e.check(p, max_tokens=b, temperature=0.0))
        while not e.idle:
            e.run_once()
        n += len(r.tokens)
    return n / (time.perf_counter() - t)


def generate_one_by_one(m, method: str, work, kw) -> float:
    """Tokens/s of `pdecode.generate` at batch 1 over ``work``, one request after another."""
    import pdecode

    n, t = 0, time.perf_counter()
    for p, b in work:
        n += len(pdecode.generate(m, [p], method=method, max_new_tokens=b, **kw).tokens[0])
    return n / (time.perf_counter() - t)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--methods", nargs="+", default=["ar", "sd"])
    ap.add_argument("--passes", type=int, default=3)
    ap.add_argument("--requests", type=int, default=12, help="requests of the one-client rows")
    args = ap.parse_args(argv)
    import pdecode
    from infer.serve_bench import _workload
    from pdecode.engine import Engine

    m = pdecode.load("code-target", dtype="bfloat16", activation_dtype="float32")
    d = pdecode.load("code-draft", dtype="bfloat16", activation_dtype="float32")
    work = _workload(m, 48, (16, 64), (32, 96))
    one = work[: args.requests]
    rows_md = ["| method | load | rows 4 + 16 tok/s | rows 16 alone tok/s | x | generate batch 1 tok/s | "
               "default x generate |", "|---|---|---|---|---|---|---|"]
    for method in args.methods:
        kw = {"draft": d} if method == "sd" else {}
        engs = {"buckets": Engine(m, method=method, slots=16, max_len=1024, chunk=256, kv_pages=1024, row_buckets=[4],
                                  **kw),
                "all": Engine(m, method=method, slots=16, max_len=1024, chunk=256, kv_pages=1024, row_buckets=[],
                              **kw)}
        for k, e in engs.items():
            t = time.time()
            e.warmup()
            print(f"{method} {k}: rows {e.row_buckets}, warm-up {time.time() - t:.1f} s, {e.compiles} programs",
                  flush=True)

        def serial(e):
            return one_client(e, one)

        def burst(e):
            reqs = [e.submit(p, e.check(p, max_tokens=b, temperature=0.0)) for p, b in work]
            t = time.perf_counter()
            while not e.idle:
                e.run_once()
            return sum(len(r.tokens) for r in reqs) / (time.perf_counter() - t)

        def gen1():
            return generate_one_by_one(m, method, one, kw)

        gen1()  # compile generate's programs for these shapes first
        res = {(k, load): [] for k in engs for load in ("one", "burst")}
        res["gen"] = []
        for i in range(args.passes):
            for k in (("buckets", "all") if i % 2 == 0 else ("all", "buckets")):
                res[(k, "one")].append(serial(engs[k]))
                res[(k, "burst")].append(burst(engs[k]))
            res["gen"].append(gen1())
            print(f"{method} pass {i}: " + ", ".join(f"{k}: {v[-1]:.0f}" for k, v in res.items()), flush=True)
        med = {k: statistics.median(v[1:]) for k, v in res.items()}
        for load, label in (("one", "one client"), ("burst", "48 at once")):
            a, b = med[("buckets", load)], med[("all", load)]
            g = f"{med['gen']:.0f}" if load == "one" else ""
            x = f"{a / med['gen']:.2f}x" if load == "one" else ""
            rows_md.append(f"| {method} | {label} | {a:.0f} | {b:.0f} | {a / b:.2f}x | {g} | {x} |")
        print("\n".join(rows_md), flush=True)


if __name__ == "__main__":
    main()
