"""Warm-up of the serving engine from a cold and from a warm persistent compilation cache: each run is a fresh
process (as a server restart) that builds the engine `pdecode serve` builds (code-target, bf16 weights, 16 slots,
max_len 1024, its default paged KV cache, speculation auto) and warms it up with the cache in a new directory: the
first run compiles and writes it, the second loads from it. Each warm-up either compiles every program before it
returns (``full``) or only those nothing can stand in for, the rest in a thread while the engine would serve
(``background``, `pdecode serve`'s default). Prints, per method and mode, the seconds to ready (the engine can take
requests), to every program compiled, the programs, the process's seconds from start to ready, and the seconds 4
requests of 64 greedy tokens take right after ready (the programs in the background still compiling) and again
once every program is ready (the same tokens).

    python scripts/restart_bench.py [--methods ar sd] [--modes background full]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile

CHILD = """
import json, sys, time
t0 = time.perf_counter()
import pdecode
from pdecode.engine import Engine
d = pdecode.enable_disk_cache(sys.argv[1])
method, mode = sys.argv[2], sys.argv[3]
m = pdecode.load("code-target", dtype="bfloat16", activation_dtype="float32")
draft = pdecode.load("code-draft", dtype="bfloat16", activation_dtype="float32") if method == "sd" else None
eng = Engine(m, method=method, draft=draft, slots=16, max_len=1024, chunk=256, kv_pages=1024, speculation="auto")
secs = eng.warmup(background=mode == "background")
ready = time.perf_counter() - t0
prompts = [[1 + i] + list(range(40, 80)) for i in range(4)]  # 4 requests of 41 tokens, 64 greedy tokens each
def answer():
    t = time.perf_counter()
    out = eng.generate(prompts, max_tokens=64, temperature=0.0, ignore_eos=True)
    return time.perf_counter() - t, [e.tokens for e in out]
first, toks = answer()  # right after ready (a background warm-up still compiling)
eng.wait_warm()
later, again = answer()
assert toks == again
print(json.dumps({"warmup_s": secs, "all_s": eng.warm_all_s, "programs": eng.compiles, "process_s": ready,
                  "first_s": first, "later_s": later}))
"""


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--methods", nargs="+", default=["ar", "sd"])
    ap.add_argument("--modes", nargs="+", default=["background", "full"], choices=["background", "full"])
    args = ap.parse_args(argv)
    print("| method | warm-up | compilation cache | ready s | every program s | programs | process start to ready s "
          "| 4 requests at ready s | 4 requests later s |")
    print("|---|---|---|---|---|---|---|---|---|")
    for method in args.methods:
        for mode in args.modes:
            with tempfile.TemporaryDirectory() as d:
                for label in ("cold (empty)", "warm (a restart)"):
                    out = subprocess.run([sys.executable, "-c", CHILD, d, method, mode], capture_output=True,
                                         text=True)
                    if out.returncode:
                        sys.exit(out.stderr[-2000:])
                    r = json.loads(out.stdout.strip().splitlines()[-1])
                    print(f"| {method} | {mode} | {label} | {r['warmup_s']:.1f} | {r['all_s']:.1f} | {r['programs']} "
                          f"| {r['process_s']:.1f} | {r['first_s']:.2f} | {r['later_s']:.2f} |", flush=True)


if __name__ == "__main__":
    main()
