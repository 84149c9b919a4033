"""Warm-up of the serving engine from a cold and from a warm persistent compilation cache: each run is a fresh
process (as a server restart) that builds the engine `pdecode serve` builds (code-target, bf16 weights, 16 slots,
max_len 1024, its default paged KV cache) and warms it up with the cache in a new directory: the first run compiles
and writes it, the second loads from it. Prints the warm-up seconds and programs of each run, per method.

    python scripts/restart_bench.py [--methods ar sd]
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
method = sys.argv[2]
m = pdecode.load("code-target", dtype="bfloat16", activation_dtype="float32")
draft = pdecode.load("code-draft", dtype="bfloat16", activation_dtype="float32") if method == "sd" else None
eng = Engine(m, method=method, draft=draft, slots=16, max_len=1024, chunk=256, kv_pages=1024)
secs = eng.warmup()
print(json.dumps({"warmup_s": secs, "programs": eng.compiles, "process_s": time.perf_counter() - t0}))
"""


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--methods", nargs="+", default=["ar", "sd"])
    args = ap.parse_args(argv)
    print("| method | compilation cache | warm-up s | programs | process start to ready s |")
    print("|---|---|---|---|---|")
    for method in args.methods:
        with tempfile.TemporaryDirectory() as d:
            for label in ("cold (empty)", "warm (a restart)"):
                out = subprocess.run([sys.executable, "-c", CHILD, d, method], capture_output=True, text=True)
                if out.returncode:
                    sys.exit(out.stderr[-2000:])
                r = json.loads(out.stdout.strip().splitlines()[-1])
                print(f"| {method} | {label} | {r['warmup_s']:.1f} | {r['programs']} | {r['process_s']:.1f} |",
                      flush=True)


if __name__ == "__main__":
    main()
