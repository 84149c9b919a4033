"""Prefix caching in the serving engine: time to first token on a shared-system-prompt workload, with and without.

Every request is one shared system prompt (``--system-tokens`` tokens of held-out code) plus its own short question,
asking for ``--max-tokens``; requests come one at a time to an otherwise idle engine (what a chat front end with a
fixed system prompt sends). Two engines in one process, identical but for ``prefix_cache`` (0 and 4), take the
requests alternately (rows interleaved: this VM's speed drifts), each warmed up first and primed with one request.
Reports the median and p90 time to first token (submit -> the first event with text), the prefill calls per
request, and checks both engines give the same tokens.

    python -m infer.prefix_bench [--model code-target --method ar --system-tokens 512 --requests 16]
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

from pdecode.cli_args import ArgumentParser


def _ttft(eng, prompt, max_tokens):
    first = {}
    t0 = time.perf_counter()

    def cb(ev):
        if ev.tokens and "t" not in first:
            first["t"] = time.perf_counter() - t0

    calls0 = eng.stats["prefill_chunks"]
    r = eng.submit(prompt, eng.check(prompt, max_tokens=max_tokens, temperature=0.0), callback=cb)
    while not eng.idle:
        eng.run_once()
    return first["t"], eng.stats["prefill_chunks"] - calls0, r.tokens


def main(argv=None):
    ap = ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="code-target")
    ap.add_argument("--method", default="ar")
    ap.add_argument("--draft", default=None)
    ap.add_argument("--system-tokens", type=int, default=512)
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--chunk", type=int, default=256)
    ap.add_argument("--out", default="runs/prefix_bench.json")
    a = ap.parse_args(argv)
    import pdecode
    from pdecode.engine import Engine
    from train.data import read_text, split_files

    m = pdecode.load(a.model)
    draft = pdecode.load(a.draft) if a.draft else None
    text = "\n".join(read_text(f) for f in split_files()[1][:40])  # held-out files
    ids = m.tokenizer.encode(text)
    system = ids[: a.system_tokens]
    questions = [ids[a.system_tokens + 997 * (i + 1): a.system_tokens + 997 * (i + 1) + 12 + (i * 7) % 29]
                 for i in range(a.requests + 1)]
    kw = dict(method=a.method, draft=draft, slots=4, max_len=a.system_tokens + 128 + 64, chunk=a.chunk)
    engines = {0: Engine(m, prefix_cache=0, **kw), 4: Engine(m, prefix_cache=4, **kw)}
    for n, eng in engines.items():
        t = time.perf_counter()
        eng.warmup()
        print(f"prefix_cache={n}: warm-up {time.perf_counter() - t:.1f} s", flush=True)
        _ttft(eng, system + questions[-1], a.max_tokens)  # primes the kept prefix (and any lazy state)
    rows = {0: [], 4: []}
    calls = {0: [], 4: []}
    same = True
    for i in range(a.requests):
        p = system + questions[i]
        got = {}
        for n in ((0, 4) if i % 2 == 0 else (4, 0)):
            t, c, toks = _ttft(engines[n], p, a.max_tokens)
            rows[n].append(t)
            calls[n].append(c)
            got[n] = toks
        same &= got[0] == got[4]
    q = lambda xs, f: sorted(xs)[min(len(xs) - 1, int(f * len(xs)))]  # noqa: E731
    res = {n: {"ttft_median_s": statistics.median(v), "ttft_p90_s": q(v, 0.9), "prefill_calls": statistics.mean(calls[n]),
               "stats": dict(engines[n].stats)} for n, v in rows.items()}
    ratio = res[0]["ttft_median_s"] / res[4]["ttft_median_s"]
    print(f"\n{a.requests} requests, system prompt {len(system)} tokens + 12-40 own tokens, {a.method}, chunk {a.chunk}")
    print("| prefix cache | TTFT median (ms) | TTFT p90 (ms) | prefill calls / request |\n|---|---|---|---|")
    for n in (0, 4):
        r = res[n]
        print(f"| {'off' if n == 0 else 'on (4 kept)'} | {1e3 * r['ttft_median_s']:.1f} | {1e3 * r['ttft_p90_s']:.1f} | "
              f"{r['prefill_calls']:.2f} |")
    print(f"median TTFT {ratio:.2f}x lower with the prefix cache; tokens identical: {same}")
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps({"args": vars(a), "results": res, "ratio": ratio, "identical": same},
                                      indent=1, default=str))


if __name__ == "__main__":
    main()
