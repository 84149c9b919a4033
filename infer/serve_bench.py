"""`pdecode bench --suite serve`: load on a `pdecode serve` process over 127.0.0.1, against one request at a time and
against fixed batches through `generate`.

For each method (``--methods ar sd``) the bench starts a server (``--slots``, the model's mixed-precision load) and
runs, all greedy and streamed, with validation prompts of mixed lengths and mixed budgets:

* ``one at a time``: a single client, each request after the previous one finished;
* ``N concurrent``: N clients in a closed loop (each sends its next request when its last one ends);
* ``poisson R``: requests arriving as a Poisson process of R per second (open loop), for each rate in ``--rates``.

Per row: requests, failures, throughput (completion tokens over the wall time from the first send to the last
answer), time to first token (TTFT) and inter-token latency (ITL: the gap between streamed chunks, divided by the
tokens in the later chunk) at p50 / p99, and the XLA compiles the server made after its warm-up. Then fixed batches
of 1 and ``--slots`` through `pdecode.generate` in this process (``--new-tokens`` each), the reference the issue
names. Results: results.json, results.md and a plot (throughput and TTFT p99 against the arrival rate).

``--driver guidellm``: the load rows come from guidellm (a load tester, `pip install guidellm`; not a pdecode extra)
instead: its default streaming run against each server, closed loops of 1, 4 and ``--clients`` streams, synthetic
prompts of ``--prompt-tokens`` asking for ``--new-tokens``, ``--requests`` per level; its benchmarks.json is kept
under ``--out`` and read into the same table (`guidellm_rows`). ``--guidellm-data sharegpt``: ShareGPT's first
human turns from conversation 12,000 on (chat messages) asking for their recorded answers' lengths (capped at
``--new-tokens``), the fixed batches on the same prompts; ``--guidellm-rates R ...``: Poisson arrivals at each
rate instead of the closed loops. ``--dtype`` picks the server's precision (default bfloat16 weights with float32
activations).
"""

from __future__ import annotations

import asyncio
import json
import re
import statistics
import sys
import time
from pathlib import Path


def _pct(xs, q):
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q / 100 * (len(xs) - 1))))]


async def _one(session, url, body, out: dict):
    """One streamed completion: TTFT, chunk gaps, tokens; failures recorded, never raised."""
    t0 = time.perf_counter()
    out.update(ok=False, ttft=None, itl=[], tokens=0, text="")
    try:
        async with session.post(url + "/v1/completions", json=body) as resp:
            if resp.status != 200:
                out["error"] = f"HTTP {resp.status}: {(await resp.text())[:200]}"
                return
            last = None
            async for raw in resp.content:
                line = raw.decode().strip()
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                if data == "[DONE]":
                    out["ok"] = True
                    break
                obj = json.loads(data)
                now = time.perf_counter()
                if obj.get("usage"):
                    out["tokens"] = obj["usage"]["completion_tokens"]
                if not obj.get("choices"):
                    continue
                ch = obj["choices"][0]
                if ch.get("text"):
                    if out["ttft"] is None:
                        out["ttft"] = now - t0
                        out["first"] = now
                    elif last is not None:
                        out["itl"].append(now - last)
                    last = now
                    out["text"] += ch["text"]
                    out["last"] = now
                if ch.get("finish_reason"):
                    out["finish"] = ch["finish_reason"]
    except Exception as e:  # noqa: BLE001 (a failure is a measurement)
        out["error"] = repr(e)
    out["end"] = time.perf_counter()
    out["start"] = t0


async def _run_load(url, bodies, mode: str, rate: float = 0.0, clients: int = 1, seed: int = 0):
    import aiohttp
    import numpy as np

    results = [dict() for _ in bodies]
    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        t0 = time.perf_counter()
        if mode == "poisson":
            rng = np.random.default_rng(seed)
            tasks = []
            for i, b in enumerate(bodies):
                tasks.append(asyncio.create_task(_one(session, url, b, results[i])))
                await asyncio.sleep(rng.exponential(1.0 / rate))
            await asyncio.gather(*tasks)
        else:  # closed loop: `clients` workers take the next request when their last one ends
            nxt = iter(range(len(bodies)))

            async def worker():
                for i in nxt:
                    await _one(session, url, bodies[i], results[i])

            await asyncio.gather(*(worker() for _ in range(clients)))
        wall = time.perf_counter() - t0
    return results, wall


def _summary(label, results, wall, compiles) -> dict:
    ok = [r for r in results if r.get("ok")]
    ttft = [r["ttft"] for r in ok if r.get("ttft") is not None]
    itl = [x for r in ok for x in r["itl"]]
    tpot = [(r["last"] - r["first"]) / (r["tokens"] - 1) for r in ok if r.get("first") and r["tokens"] > 1]
    toks = sum(r["tokens"] for r in ok)
    row = {"row": label, "requests": len(results), "failed": len(results) - len(ok), "wall_s": wall,
           "completion_tokens": toks, "tokens_per_s": toks / wall if wall else 0.0,
           "ttft_p50": _pct(ttft, 50), "ttft_p99": _pct(ttft, 99), "itl_p50": _pct(itl, 50),
           "itl_p99": _pct(itl, 99), "tpot_p50": _pct(tpot, 50), "tpot_p99": _pct(tpot, 99),
           "compiles_after_warmup": compiles}
    errs = [r.get("error") for r in results if r.get("error")]
    if errs:
        row["errors"] = errs[:3]
    return row


def closed_loop_fill(tokens: list[int], clients: int) -> float:
    """The most a closed loop of ``clients`` can fill ``clients`` slots with these requests (completion ``tokens`` of
    each, in the order sent): an engine with no gaps, each client's next request decoded from the step after its last
    one ended, one token per step. The rest is the tail: the last requests run with few others. A closed-loop row's
    x fixed batch cannot pass this (steps cost the same at any number of rows; on hardware where fewer rows cost
    less, a little)."""
    import heapq

    ends = [0] * clients
    for t in tokens:
        heapq.heappush(ends, heapq.heappop(ends) + t)
    steps = max(ends)
    return sum(tokens) / (clients * steps) if steps else 0.0


def _get(url):
    import urllib.request

    with urllib.request.urlopen(url, timeout=30) as r:
        return json.loads(r.read().decode())


def _workload(model, n: int, prompt_tokens: tuple[int, int], budgets: tuple[int, int], seed: int = 0):
    """``n`` requests: validation prompts cut to lengths in ``prompt_tokens`` and budgets in ``budgets``."""
    import numpy as np

    from train.data import validation_prompts

    rng = np.random.default_rng(seed)
    base = validation_prompts(model.tokenizer.backend, max(8, n), prompt_tokens[1])
    out = []
    for i in range(n):
        p = base[i % len(base)][: int(rng.integers(prompt_tokens[0], prompt_tokens[1] + 1))]
        out.append((p, int(rng.integers(budgets[0], budgets[1] + 1))))
    return out


class Server:
    """A `pdecode serve` subprocess on 127.0.0.1, stopped by its pid."""

    def __init__(self, args: list[str]):
        import os
        import signal  # noqa: F401
        import socket
        import subprocess

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        root = Path(__file__).resolve().parent.parent
        env = {**os.environ, "PYTHONPATH": str(root)}
        self.proc = subprocess.Popen([sys.executable, "-m", "infer.serve", *args, "--port", str(self.port)],
                                     cwd=root, env=env, stderr=subprocess.PIPE, text=True)
        t_end = time.time() + 900
        while time.time() < t_end:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited: {self.proc.stderr.read()[-2000:]}")
            try:  # (measured once every program is compiled: --warmup background serves before)
                h = _get(self.url + "/health")
                if h["status"] == "ok" and not h.get("programs_pending"):
                    return
            except OSError:
                pass
            time.sleep(1)
        self.stop()
        raise RuntimeError("the server did not come up in 15 minutes")

    def stop(self):
        import os
        import signal

        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGTERM)
        self.proc.wait(timeout=120)


def run_suite(args) -> int:
    import pdecode

    if getattr(args, "driver", "pdecode") == "guidellm" and _guidellm() is None:
        print("error: --driver guidellm: guidellm is not installed (pip install guidellm)", file=sys.stderr)
        return 2
    out = Path(args.out) if args.out else Path("docs/bench/serve")
    out.mkdir(parents=True, exist_ok=True)
    # mixed precision (bfloat16 weights, float32 activations) unless --dtype names one
    dtype, act = (args.dtype, None) if getattr(args, "dtype", None) else ("bfloat16", "float32")
    model = pdecode.load(args.model or "code-target", dtype=dtype, activation_dtype=act)
    n = args.requests
    sharegpt = getattr(args, "guidellm_data", "synthetic") == "sharegpt"
    if sharegpt:  # ShareGPT's first human turns and their recorded answers' lengths (guidellm's data file)
        from infer.real_bench import sharegpt_requests

        reqs = sharegpt_requests(model.tokenizer, n, args.max_prompt_tokens, args.new_tokens)
        data_file = out / "sharegpt_requests.jsonl"
        data_file.write_text("".join(json.dumps({k: r[k] for k in ("prompt", "output_tokens_count")}) + "\n"
                                     for r in reqs))
        args.guidellm_file = data_file
        from pdecode import chat

        work = [(chat.encode_chat(model.tokenizer, chat.render(model.tokenizer, [{"role": "user",
                                                                                   "content": r["prompt"]}])),
                 r["output_tokens_count"]) for r in reqs]
    else:
        work = _workload(model, n, (args.prompt_min, args.prompt_tokens), (args.budget_min, args.new_tokens))
    bodies = [{"prompt": p, "max_tokens": b, "temperature": 0, "stream": True,
               "stream_options": {"include_usage": True}} for p, b in work]
    rows, meta = [], {"model": args.model or "code-target", "requests": n, "slots": args.slots,
                      "fixed_new_tokens": args.fixed_new_tokens, "steps_per_call": args.steps_per_call,
                      "max_len": args.max_len,
                      "prompt_tokens": [args.prompt_min, args.prompt_tokens],
                      "budgets": [args.budget_min, args.new_tokens], "rates": args.rates, "dtype": dtype,
                      "activation_dtype": act,
                      "data": "sharegpt" if sharegpt else "synthetic",
                      "date": time.strftime("%Y-%m-%d %H:%M")}
    if sharegpt:  # the requests' own spans: chat-rendered prompt tokens, recorded answers' lengths (capped)
        meta.update(prompt_tokens=[min(len(p) for p, _ in work), max(len(p) for p, _ in work)],
                    budgets=[min(b for _, b in work), max(b for _, b in work)])
    for method in args.methods:
        name, _, optstr = method.partition(":")
        sargs = ["--model", args.model or "code-target", "--dtype", dtype,
                 *(["--activation-dtype", act] if act else []), "--method", name,
                 "--slots", str(args.slots), "--max-len", str(args.max_len), "--chunk", "128",
                 "--steps-per-call", str(args.steps_per_call),
                 "--log-level", "warning"]  # no access line per request: stderr is a pipe read only at exit
        if name in ("sd", "tree", "pearl"):
            sargs += ["--draft", args.draft or "code-draft"]
        # method options; speculation= / spec_cost= / heads= (heads attached to --model by name): server flags
        for kv in filter(None, optstr.split(",")):
            key, _, val = kv.partition("=")
            sargs += [f"--{key.replace('_', '-')}", val] if key in ("speculation", "spec_cost", "heads") else \
                ["-o", kv]
        print(f"[serve bench] {method}: starting the server ...", file=sys.stderr, flush=True)
        t0 = time.perf_counter()
        srv = Server(sargs)
        meta.setdefault("server_start_s", {})[method] = time.perf_counter() - t0
        try:
            if getattr(args, "driver", "pdecode") == "guidellm":
                before = _get(srv.url + "/health")["compiles_since_warmup"]
                # (a directory name guidellm's key=value flags can carry: no ':', '=' or ',')
                got = _run_guidellm(srv.url, args, out / ("guidellm-" + re.sub(r"[^A-Za-z0-9_.@-]", "-", method)))
                comp = _get(srv.url + "/health")["compiles_since_warmup"] - before
                for row in got:
                    row.update(method=method, compiles_after_warmup=comp)  # (over guidellm's whole run)
                    rows.append(row)
                    print(f"    {method} {row['row']}: {row['tokens_per_s']:.1f} tok/s, failed {row['failed']}",
                          file=sys.stderr, flush=True)
                continue
            loads = [("one at a time", "closed", 0.0, 1), (f"{args.clients} concurrent", "closed", 0.0, args.clients)]
            loads += [(f"poisson {r:g}/s", "poisson", r, 0) for r in args.rates]
            for label, mode, rate, clients in loads:
                before = _get(srv.url + "/health")["compiles_since_warmup"]
                res, wall = asyncio.run(_run_load(srv.url, bodies, mode, rate, clients))
                comp = _get(srv.url + "/health")["compiles_since_warmup"] - before
                row = _summary(label, res, wall, comp)
                row.update(method=method, mode=mode, rate=rate, clients=clients)
                if mode == "closed" and clients > 1 and not row["failed"]:
                    row["ideal_fill"] = closed_loop_fill([r["tokens"] for r in res], clients)
                rows.append(row)
                print(f"    {method} {label}: {row['tokens_per_s']:.1f} tok/s, TTFT p99 "
                      f"{_fmt(row['ttft_p99'])} s, failed {row['failed']}, compiles {comp}", file=sys.stderr,
                      flush=True)
        finally:
            srv.stop()
    rows += _fixed_batches(model, work, args)
    _ratios(rows)
    (out / "results.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    md = to_markdown(rows, meta)
    (out / "results.md").write_text(md)
    _plot(rows, out / "load.png")
    print(md)
    return 0


def _fixed_batches(model, work, args) -> list[dict]:
    """Fixed batches through `generate` in this process: batch 1 and batch ``slots`` of the same prompts (the first
    ``max(16, slots)``), ``--fixed-new-tokens`` each (64: the issue's reference), EOS ignored, median of 3
    (`load_bench.fixed_batch`)."""
    from infer.load_bench import fixed_batch

    rows, n_new = [], args.fixed_new_tokens
    for b in (1, args.slots):
        part = work[: max(16, b)]
        fixed_batch(model, part[:b], b, n_new)  # compile
        tps = statistics.median(fixed_batch(model, part, b, n_new) for _ in range(3))
        toks = len(part) // b * b * n_new
        rows.append({"row": f"generate, fixed batch {b}", "method": "ar", "mode": "fixed", "requests": toks //
                     n_new, "failed": 0, "tokens_per_s": tps, "wall_s": toks / tps, "completion_tokens": toks})
    return rows


def _guidellm():
    import shutil

    return shutil.which("guidellm")


def _run_guidellm(url: str, args, out: Path) -> list[dict]:
    """guidellm's default streaming run against ``url``: closed loops of 1, 4 and ``--clients`` streams; its results
    in ``out`` (benchmarks.json, its console log run.log), read by `guidellm_rows`."""
    import subprocess

    from pdecode import api

    out.mkdir(parents=True, exist_ok=True)
    tok = api.resolve_path(args.model or "code-target")
    if tok.is_file():  # a GGUF file: guidellm's HF tokenizer written from its metadata
        from pdecode.checkpoint.hf import copy_tokenizer

        copy_tokenizer(tok, out / "tokenizer")
        tok = out / "tokenizer"
    rates = getattr(args, "guidellm_rates", None)
    if rates:  # open loop: requests arrive as a Poisson process at each rate
        profile = ["--profile", "kind=poisson", "--override", "profile.rate", ",".join(f"{r:g}" for r in rates)]
    else:
        profile = ["--profile", "kind=concurrent", "--override", "profile.streams",
                   ",".join(str(x) for x in sorted({1, 4, args.clients}))]
    data_file = getattr(args, "guidellm_file", None)
    data = (f"kind=json_file,path={Path(data_file).resolve()}" if data_file else
            f"kind=synthetic_text,prompt_tokens={args.prompt_tokens},output_tokens={args.new_tokens}")
    cmd = [_guidellm(), "run", "--backend", f"kind=openai_http,target={url}", *profile, "--data", data,
           "--tokenizer", f"kind=hf_auto,model={tok}", "--constraint", f"kind=max_requests,count={args.requests}",
           "--disable-progress"]
    print(f"[serve bench] guidellm: {' '.join(cmd[1:])}", file=sys.stderr, flush=True)
    res = subprocess.run(cmd, cwd=out, capture_output=True, text=True)
    (out / "run.log").write_text(res.stdout + res.stderr)
    path = out / "benchmarks.json"
    if not path.exists():  # (guidellm may exit 0 having run nothing)
        raise RuntimeError(f"guidellm wrote no benchmarks.json (exit {res.returncode}): {(res.stderr or '')[-500:]}")
    return guidellm_rows(path)


def guidellm_rows(path: Path) -> list[dict]:
    """The serve bench's rows from a guidellm benchmarks.json: one per concurrency level (its closed loop of N
    streams) or per Poisson arrival rate: requests, failed (errored + incomplete), output tokens per second
    (guidellm's mean), TTFT, ITL (its inter-token latency) and time per output token at p50 / p99, in seconds as the
    bench's own rows.
    """
    data = json.loads(Path(path).read_text())
    rows = []
    for b in data["benchmarks"]:
        strategy = b["config"]["strategy"]
        n, rate = strategy.get("streams"), strategy.get("rate")
        label = f"guidellm, {n} concurrent" if n is not None else f"guidellm, poisson {rate:g}/s"
        m = b["metrics"]
        tot = m["request_totals"]

        def stat(name, q):
            s = m[name]["successful"]
            return None if not s.get("count") else s["percentiles"][q] / 1e3

        rows.append({"row": label, "mode": "guidellm", "clients": n or 0, "rate": float(rate or 0.0),
                     "requests": tot["total"], "failed": tot["errored"] + tot["incomplete"],
                     "wall_s": b["duration"], "completion_tokens": m["output_token_count"]["successful"]["total_sum"],
                     "tokens_per_s": m["output_tokens_per_second"]["successful"]["mean"],
                     "ttft_p50": stat("time_to_first_token_ms", "p50"),
                     "ttft_p99": stat("time_to_first_token_ms", "p99"),
                     "itl_p50": stat("inter_token_latency_ms", "p50"), "itl_p99": stat("inter_token_latency_ms", "p99"),
                     "tpot_p50": stat("time_per_output_token_ms", "p50"),
                     "tpot_p99": stat("time_per_output_token_ms", "p99"), "compiles_after_warmup": None})
    return rows


def _ratios(rows):
    one = {r["method"]: r["tokens_per_s"] for r in rows
           if r["row"] == "one at a time" or (r["mode"] == "guidellm" and r["clients"] == 1)}
    fixed = next((r["tokens_per_s"] for r in rows if r["mode"] == "fixed" and not r["row"].endswith(" 1")), None)
    for r in rows:
        if r["mode"] != "fixed" and r["method"] in one:
            r["x_one_at_a_time"] = r["tokens_per_s"] / one[r["method"]]
            if fixed:
                r["x_fixed_batch"] = r["tokens_per_s"] / fixed


def _fmt(x, nd=3):
    return "-" if x is None else f"{x:.{nd}f}"


def to_markdown(rows, meta) -> str:
    what = ("ShareGPT first human turns from conversation 12,000 (chat template), each asking for its recorded "
            "answer's length: " if meta.get("data") == "sharegpt" else "")
    lines = [f"{what}{meta['requests']} requests per row, prompts of {meta['prompt_tokens'][0]}-"
             f"{meta['prompt_tokens'][1]} "
             f"tokens, budgets {meta['budgets'][0]}-{meta['budgets'][1]} new tokens, greedy, streamed; "
             f"{meta['slots']} slots; {meta['date']}.", "",
             "| method | load | failed | tok/s | x one at a time | x fixed batch | TTFT p50 / p99 s "
             "| ITL p50 / p99 ms (chunk gaps) | per-token p50 / p99 ms | compiles after warm-up |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    fills = {r["row"]: r["ideal_fill"] for r in rows if r.get("ideal_fill")}
    for label, f in fills.items():
        lines[1:1] = ["", f"{label}: a closed loop over these requests fills at most {100 * f:.0f}% of its slots "
                      f"(no engine gaps, the tail alone: `closed_loop_fill`), so x fixed batch <= {f:.2f} there."]
    for r in rows:
        if r["mode"] == "fixed":
            lines.append(f"| {r['method']} | {r['row']} | 0 | {r['tokens_per_s']:.1f} | | | | | | |")
            continue
        ms = lambda a, b: "-" if a is None else f"{1e3 * a:.1f} / {1e3 * b:.1f}"  # noqa: E731
        lines.append(f"| {r['method']} | {r['row']} | {r['failed']} | {r['tokens_per_s']:.1f} | "
                     f"{_fmt(r.get('x_one_at_a_time'), 2)} | {_fmt(r.get('x_fixed_batch'), 2)} | "
                     f"{_fmt(r['ttft_p50'], 2)} / {_fmt(r['ttft_p99'], 2)} | {ms(r['itl_p50'], r['itl_p99'])} | "
                     f"{ms(r['tpot_p50'], r['tpot_p99'])} | {r['compiles_after_warmup']} |")
    return "\n".join(lines) + "\n"


def _plot(rows, path: Path):
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 4))
    for method in dict.fromkeys(r["method"] for r in rows if r["mode"] == "poisson"):
        pts = sorted((r["rate"], r["tokens_per_s"], r["ttft_p99"] or 0) for r in rows
                     if r["method"] == method and r["mode"] == "poisson")
        a1.plot([p[0] for p in pts], [p[1] for p in pts], "o-", label=f"{method} (continuous batching)")
        a2.plot([p[0] for p in pts], [p[2] for p in pts], "o-", label=method)
        one = next((r["tokens_per_s"] for r in rows if r["method"] == method and r["row"] == "one at a time"), None)
        if one:
            a1.axhline(one, ls=":", color=a1.lines[-1].get_color(), label=f"{method} one at a time")
    for r in rows:
        if r["mode"] == "fixed":
            a1.axhline(r["tokens_per_s"], ls="--", color="grey" if r["row"].endswith(" 1") else "black",
                       label=r["row"])
    a1.set_xlabel("arrival rate (requests/s)")
    a1.set_ylabel("completion tokens/s")
    a1.legend(fontsize=7, loc="center right")
    a2.set_xlabel("arrival rate (requests/s)")
    a2.set_ylabel("time to first token, p99 (s)")
    a2.legend(fontsize=7)
    fig.suptitle("pdecode serve under load (2-core CPU, code-target)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
