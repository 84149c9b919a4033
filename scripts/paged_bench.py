"""A paged KV cache in the serving engine, side by side: in one KV memory budget (16 rows of max_len 1024, the
positions a 16-slot engine reserves), engines with a contiguous cache (16 slots), a paged cache of as many positions
in pages of 16 with the same 16 slots (the cost of gathering pages), and the same pages shared by 48 slots (the
requests that now fit at once). Each pass runs the serve bench's workload (48 validation prompts of 16-64 tokens,
budgets 32-96, greedy, all submitted at once) through `Engine.run_once`, passes interleaved; prints per engine the
requests decoding at once (peak), the target cache's bytes, tokens/s (median after the first pass) and whether its
tokens equal the contiguous engine's.

    python scripts/paged_bench.py [--passes 4] [--model code-target]
"""

from __future__ import annotations

import argparse
import statistics
import time


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--passes", type=int, default=4)
    ap.add_argument("--model", default="code-target")
    ap.add_argument("--max-len", type=int, default=1024)
    ap.add_argument("--slots", type=int, default=16, help="the contiguous engine's slots (the memory budget)")
    ap.add_argument("--paged-slots", type=int, default=48)
    args = ap.parse_args(argv)
    import jax

    import pdecode
    from infer.serve_bench import _workload
    from pdecode.engine import PAGE_SIZE, Engine

    m = pdecode.load(args.model, dtype="bfloat16", activation_dtype="float32")
    work = _workload(m, 48, (16, 64), (32, 96))
    pages = args.slots * args.max_len // PAGE_SIZE
    engs = {"contiguous": Engine(m, slots=args.slots, max_len=args.max_len, chunk=256),
            f"paged {args.slots}": Engine(m, slots=args.slots, max_len=args.max_len, chunk=256, kv_pages=pages),
            f"paged {args.paged_slots}": Engine(m, slots=args.paged_slots, max_len=args.max_len, chunk=256,
                                                kv_pages=pages)}
    kv = {}
    for k, e in engs.items():
        t = time.time()
        e.warmup()
        kv[k] = sum(x.nbytes for x in jax.tree.leaves(e.state.loop.cache))
        print(f"{k}: warm-up {time.time() - t:.1f} s, {e.compiles} programs, target KV cache {kv[k] / 2**20:.1f} MiB",
              flush=True)

    def run(e):
        reqs = [e.submit(p, e.check(p, max_tokens=b, temperature=0.0)) for p, b in work]
        peak = 0
        t = time.perf_counter()
        while not e.idle:
            e.run_once()
            peak = max(peak, sum(1 for r in e.running.values() if r.inserted))
        return sum(len(r.tokens) for r in reqs) / (time.perf_counter() - t), [r.tokens for r in reqs], peak

    names = list(engs)
    tps, toks, peaks = {k: [] for k in engs}, {}, {}
    for i in range(args.passes):
        for k in (names if i % 2 == 0 else names[::-1]):
            x, toks[k], peaks[k] = run(engs[k])
            tps[k].append(x)
            print(f"pass {i} {k}: {x:.0f} tok/s, peak {peaks[k]} requests decoding", flush=True)
    base = statistics.median(tps["contiguous"][1:])
    print("| engine | slots | KV positions | target KV MiB | requests decoding at once (peak) | tok/s (median) | "
          "x contiguous | tokens = contiguous |")
    print("|---|---|---|---|---|---|---|---|")
    for k, e in engs.items():
        med = statistics.median(tps[k][1:])
        positions = e.slots * e.max_len if e.kv_pages is None else e.kv_pages * e.page_size
        same = sum(a == b for a, b in zip(toks[k], toks["contiguous"]))
        print(f"| {k} | {e.slots} | {positions} | {kv[k] / 2**20:.1f} | {peaks[k]} | {med:.0f} | {med / base:.2f}x | "
              f"{same}/{len(work)} |")


if __name__ == "__main__":
    main()
