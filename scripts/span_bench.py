"""Attention spans in the serving engine, side by side: two engines as `pdecode serve` makes them (16 slots, max_len
1024, paged KV, 8 steps a call), identical but for their step programs' spans, run the serve bench's workload (48
validation prompts of 16-64 tokens, budgets 32-128, greedy) through `Engine.run_once` in one process, passes
interleaved; prints each pass's tokens/s, the medians after the first pass, whether the tokens agree, and the steps
per span. By default the engine's default spans against ``max_len`` alone; ``--a`` / ``--b``: two lists of spans.

    python scripts/span_bench.py [--passes 4] [--a 128 256 512 1024 --b 128 192 256 384 512 1024]
"""

from __future__ import annotations

import argparse
import statistics
import time


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--passes", type=int, default=4)
    ap.add_argument("--model", default="code-target")
    ap.add_argument("--a", type=int, nargs="+", default=None, help="engine a's spans (default: the engine's default)")
    ap.add_argument("--b", type=int, nargs="+", default=[1024], help="engine b's spans")
    ap.add_argument("--budget-max", type=int, default=128)
    args = ap.parse_args(argv)
    import pdecode
    from infer.serve_bench import _workload
    from pdecode.engine import Engine

    m = pdecode.load(args.model, dtype="bfloat16", activation_dtype="float32")
    work = _workload(m, 48, (16, 64), (32, args.budget_max))
    kw = dict(slots=16, max_len=1024, chunk=256, kv_pages=1024, steps_per_call=8)
    engs = {"a": Engine(m, spans=args.a, **kw), "b": Engine(m, spans=args.b, **kw)}
    for k, e in engs.items():
        t = time.time()
        e.warmup()
        print(f"{k}: spans {e.spans}, warm-up {time.time() - t:.1f} s, {e.compiles} programs", flush=True)

    def run(e):
        reqs = [e.submit(p, e.check(p, max_tokens=b, temperature=0.0)) for p, b in work]
        t = time.perf_counter()
        while not e.idle:
            e.run_once()
        return sum(len(r.tokens) for r in reqs) / (time.perf_counter() - t), [r.tokens for r in reqs]

    tps, toks = {k: [] for k in engs}, {}
    for i in range(args.passes):
        for k in (("a", "b") if i % 2 == 0 else ("b", "a")):
            before = dict(engs[k].stats)
            x, toks[k] = run(engs[k])
            tps[k].append(x)
            spans = {s[len("steps_span_"):]: engs[k].stats[s] - before.get(s, 0) for s in engs[k].stats
                     if s.startswith("steps_span_")}
            print(f"pass {i} {k}: {x:.0f} tok/s, step calls per span {spans}", flush=True)
    med = {k: statistics.median(v[1:]) for k, v in tps.items()}
    print(f"median tok/s (passes 2..): a {med['a']:.0f}, b {med['b']:.0f} ({med['b'] / med['a']:.3f}x a); "
          f"identical tokens: {toks['a'] == toks['b']}")


if __name__ == "__main__":
    main()
