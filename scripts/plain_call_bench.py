"""A plain step call of a `speculation="auto"` sd engine against an ar engine's step call, side by side: 16 live rows
(``--rows``: 1 or 4, a row bucket of that many; one-token prompts, greedy), 4 steps a call (`LONE_STEPS` times that
for a row alone), at one span; one call's ms as the mean of 16 consecutive calls (a draft
lagging through plain calls is fed once in several), medians of 9 repeats, the engines interleaved in one process.

    python scripts/plain_call_bench.py [--span 128] [--rows 16] [--repeats 9]

Only the step program timed is compiled (no warm-up of the rest). Engines as `pdecode serve` makes them (paged).
"""

from __future__ import annotations

import argparse
import time

import jax
import numpy as np


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--span", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--calls", type=int, default=16)
    ap.add_argument("--rows", type=int, default=16, help="live rows (a row bucket of that many: 1, 4 or 16)")
    args = ap.parse_args(argv)
    import pdecode
    from pdecode.engine import Engine

    m = pdecode.load("code-target", dtype="bfloat16", activation_dtype="float32")
    d = pdecode.load("code-draft", dtype="bfloat16", activation_dtype="float32")
    kw = dict(slots=16, max_len=1024, chunk=128, kv_pages=1024)
    engs = {"ar": Engine(m, method="ar", **kw), "sd plain": Engine(m, method="sd", draft=d, speculation="auto", **kw)}
    for e in engs.values():  # the empty state alone (the step program compiles at its first call below)
        e._init_state()
    ms = {k: [] for k in engs}
    for _ in range(args.repeats):
        for k, e in engs.items():
            e._fill_for_timing(args.rows, 1000)
            exe = e._step_exe(e.fast, k != "ar", args.span, args.rows)
            e.state, o = exe(e.params, e.state)  # (a first run costs more on XLA:CPU)
            jax.block_until_ready(o)
            t = time.perf_counter()
            for _ in range(args.calls):
                e.state, o = exe(e.params, e.state)
            jax.block_until_ready(o)
            ms[k].append((time.perf_counter() - t) / args.calls * 1e3)
            e.state = e._empty_exe(e.params)
    ar = np.array(ms["ar"])
    print(f"span {args.span}, {args.rows} rows, {engs['ar'].steps_for(args.rows)} steps a call; ms per call (median), "
          f"x ar (median of per-repeat ratios)")
    for k, v in ms.items():
        print(f"{k}: {np.median(v):.2f} ms, {np.median(np.array(v) / ar):.3f}x")


if __name__ == "__main__":
    main()
