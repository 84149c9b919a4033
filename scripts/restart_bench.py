"""Warm-up of the serving engine from a cold and from a warm persistent compilation cache: each run is a fresh
process (as a server restart) that builds the engine `pdecode serve` builds (code-target, bf16 weights, 16 slots,
max_len 1024, its default paged KV cache, speculation auto) and warms it up with the cache in a new directory: the
first run compiles and writes it, the second loads from it. Each warm-up either compiles every program before it
returns (``full``) or only those nothing can stand in for, the rest in a thread while the engine would serve
(``background``, `pdecode serve`'s default). Prints, per method and mode, the seconds to ready (the engine can take
requests), to every program compiled, the programs, the process's seconds from start to ready, and the seconds 4
requests of 64 greedy tokens take right after ready (the programs in the background still compiling) and again
once every program is ready (the same tokens).

    python scripts/restart_bench.py [--methods ar sd] [--modes background full] [--serve]

With ``--serve`` each run starts `pdecode serve` itself (`served`) and times it from the command.
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


def served(method: str, mode: str, cache: str) -> dict:
    """`pdecode serve` started as a user would (code-target, 16 slots, max_len 1024; sd with code-draft), the
    compilation cache in ``cache``: seconds from the command to /health answering 200, to one completion of 32 greedy
    tokens answered (sent at once), and to every program compiled."""
    import os
    import signal
    import socket
    import time
    import urllib.request

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    draft = ["--draft", "code-draft"] if method == "sd" else []
    t0 = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "infer.cli", "serve", "--model", "code-target", "--method", method,
                             *draft, "--slots", "16", "--max-len", "1024", "--warmup", mode, "--port", str(port)],
                            env={**os.environ, "PDECODE_COMPILE_CACHE_DIR": cache}, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)

    def health():
        try:
            with urllib.request.urlopen(url + "/health", timeout=5) as r:
                return json.loads(r.read())
        except OSError:
            return None

    try:
        while (h := health()) is None:
            if proc.poll() is not None:
                sys.exit(proc.stderr.read()[-2000:])
            time.sleep(0.05)
        up = time.perf_counter() - t0
        body = json.dumps({"prompt": "def fib(n):", "max_tokens": 32, "temperature": 0}).encode()
        req = urllib.request.Request(url + "/v1/completions", data=body, headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=300) as r:
            r.read()
        answered = time.perf_counter() - t0
        while h is None or h.get("programs_pending"):
            time.sleep(0.2)
            h = health()
        return {"up_s": up, "answered_s": answered, "all_s": time.perf_counter() - t0}
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=120)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--methods", nargs="+", default=["ar", "sd"])
    ap.add_argument("--modes", nargs="+", default=["background", "full"], choices=["background", "full"])
    ap.add_argument("--serve", action="store_true", help="start `pdecode serve` instead (seconds to /health up, to a "
                    "first completion answered, to every program compiled)")
    args = ap.parse_args(argv)
    if args.serve:
        print("| method | --warmup | compilation cache | /health up s | first completion s | every program s |")
        print("|---|---|---|---|---|---|")
        for method in args.methods:
            for mode in args.modes:
                with tempfile.TemporaryDirectory() as d:
                    for label in ("cold (empty)", "warm (a restart)"):
                        r = served(method, mode, d)
                        print(f"| {method} | {mode} | {label} | {r['up_s']:.1f} | {r['answered_s']:.1f} | "
                              f"{r['all_s']:.1f} |", flush=True)
        return
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
