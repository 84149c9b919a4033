"""Attention spans in the serving engine, side by side: two engines (16 slots, max_len 1024) identical but for their
step programs' spans (the default 256 / 512 / 1024, and 1024 alone) run the serve bench's workload (48 validation
prompts of 16-64 tokens, budgets 32-96, greedy) through `Engine.run_once` in one process, passes interleaved; prints
each pass's tokens/s, the medians after the first pass, whether the tokens agree, and the steps per span.

    python scripts/span_bench.py [--passes 4]
"""

from __future__ import annotations

import argparse
import statistics
import time


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--passes", type=int, default=4)
    ap.add_argument("--model", default="code-target")
    args = ap.parse_args(argv)
    import pdecode
    from infer.serve_bench import _workload
    from pdecode.engine import Engine

    m = pdecode.load(args.model, dtype="bfloat16", activation_dtype="float32")
    work = _workload(m, 48, (16, 64), (32, 96))
    engs = {"spans": Engine(m, slots=16, max_len=1024, chunk=256),
            "full": Engine(m, slots=16, max_len=1024, chunk=256, spans=[1024])}
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
        for k in (("spans", "full") if i % 2 == 0 else ("full", "spans")):
            x, toks[k] = run(engs[k])
            tps[k].append(x)
    print({k: [round(x) for x in v] for k, v in tps.items()})
    med = {k: statistics.median(v[1:]) for k, v in tps.items()}
    print(f"median tok/s: spans {med['spans']:.0f}, full {med['full']:.0f} ({med['spans'] / med['full']:.2f}x); "
          f"identical tokens: {toks['spans'] == toks['full']}; "
          f"{ {k: v for k, v in engs['spans'].stats.items() if k.startswith('steps_span')} }")


if __name__ == "__main__":
    main()
