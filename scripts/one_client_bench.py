"""One client on the serving engine: engines of 16 slots as `pdecode serve` makes them (code-target, bf16, max_len 1024,
paged, default row buckets and spans) with 4 steps per call (the engine's default) and with 8 (the serve bench's),
against `pdecode.generate` at batch 1, on 12 of the serve bench's requests one after another; engines interleaved,
medians of passes 2-3.

    python scripts/one_client_bench.py ar|sd ["4 steps per call" | "8 steps per call" | "auto, 4 steps per call" |
                                              "auto, 8 steps per call"]
"""
import statistics, sys, time
import pdecode
from infer.serve_bench import _workload
from pdecode.engine import Engine
method = sys.argv[1]
pdecode.enable_disk_cache()  # (the programs `pdecode serve` compiled for the same engine load from disk)
m = pdecode.load("code-target", dtype="bfloat16", activation_dtype="float32")
kw = {"draft": pdecode.load("code-draft", dtype="bfloat16", activation_dtype="float32")} if method == "sd" else {}
work = _workload(m, 48, (16, 64), (32, 96))[:12]
V = {"4 steps per call": {}, "8 steps per call": {"steps_per_call": 8},  # auto: sd's plain steps where drafting loses
     "auto, 4 steps per call": {"speculation": "auto"},
     "auto, 8 steps per call": {"speculation": "auto", "steps_per_call": 8}}
if len(sys.argv) > 2:  # e.g. one engine of sd: two warmed sd engines use most of Linux's 65530 memory maps per process
    V = {k: V[k] for k in sys.argv[2:]}
engs = {}
for k, o in V.items():
    e = Engine(m, method=method, slots=16, max_len=1024, chunk=128, kv_pages=1024, **kw, **o)
    t = time.time(); e.warmup(); print(k, e.row_buckets, e.spans, f"warm-up {time.time()-t:.1f}s {e.compiles} programs", flush=True)
    engs[k] = e
from rows_bench import generate_one_by_one, one_client  # noqa: E402 (scripts/: python puts it on the path)


def serial(e):
    return one_client(e, work)


def gen1():
    return generate_one_by_one(m, method, work, kw)


gen1()
res = {k: [] for k in list(V) + ["generate"]}
for i in range(3):
    order = list(V) if i % 2 == 0 else list(V)[::-1]
    for k in order:
        res[k].append(serial(engs[k]))
    res["generate"].append(gen1())
    print(i, {k: round(v[-1]) for k, v in res.items()}, flush=True)
g = statistics.median(res["generate"][1:])
for k, v in res.items():
    med = statistics.median(v[1:])
    print(f"| {method} | {k} | {med:.0f} | {med / g:.2f}x |")
