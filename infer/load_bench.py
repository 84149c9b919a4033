"""The serving engine under closed-loop load in one process, against fixed batches through `generate`: what the
serve bench's "x fixed batch" is made of, without HTTP.

The serve bench's 48 requests (prompts of 16-64 tokens, budgets of 32-96, greedy, EOS honoured) go to engines as
`pdecode serve` makes them (``--slots`` slots, paged, ``--steps-per-call``), from N closed-loop clients (a client
sends its next request once its last one ended). Side by side in each pass, rows interleaved:

- ``fixed batch``: the serve bench's reference — the same prompts in batches of ``--slots`` through `generate`, 64 new
  tokens each, EOS ignored;
- ``static batches``: the same requests as a server without continuous batching runs them — batches of ``--slots``
  in arrival order through `generate` with each request's own budget and EOS (a batch lasts as long as its longest
  row);
- each engine (``--methods``: ``ar``, ``sd auto`` = code-draft with speculation="auto") at each ``--clients``.

Per engine row: tokens/s (median of passes), x fixed batch, x static batches and (sd) x ar at the same clients
(medians of per-pass ratios); for ar at ``--slots`` clients, the most a closed loop of these requests can fill its
slots (`serve_bench.closed_loop_fill`). ``--profile``: one more pass per engine with every program waited for and timed
(the device's share per program; it removes the host/device overlap, so its tokens/s is not the row's; the passes
before it compiled every program it runs).

    python -m infer.load_bench [--clients 16] [--methods ar "sd auto"] [--passes 8] [--profile]

On this CPU the engine's steps cost what `generate`'s cost at the same span (their compiled loop bodies are the same
ops); what separates the rows is the fill, attention over the longer spans these requests reach, admissions in groups
smaller than a batch, and the host's Python on the same cores (docs/results.md). `scripts/device_check.sh` runs this
on a lent accelerator.
"""

from __future__ import annotations

import collections
import sys
import time

from pdecode.cli_args import ArgumentParser


def closed_loop(engine, work, clients: int) -> tuple[float, list[int]]:
    """(tokens/s, each request's tokens) of ``clients`` closed-loop clients over ``work`` [(prompt ids, budget)],
    greedy."""
    queue, reqs, live = list(work), [], []
    t = time.perf_counter()
    while queue or not engine.idle:
        while queue and len(live) < clients:
            ids, budget = queue.pop(0)
            r = engine.submit(ids, engine.check(ids, max_tokens=budget, temperature=0.0))
            reqs.append(r)
            live.append(r)
        engine.run_once()
        live = [r for r in live if r.finish_reason is None]
    n = [len(r.tokens) for r in reqs]
    return sum(n) / (time.perf_counter() - t), n


def fixed_batch(model, work, slots: int, new: int = 64) -> float:
    """Tokens/s of the serve bench's reference: the prompts in batches of ``slots``, ``new`` tokens each, no EOS."""
    import pdecode

    t, n = time.perf_counter(), 0
    for i in range(0, len(work) - slots + 1, slots):
        pdecode.generate(model, [p for p, _ in work[i: i + slots]], max_new_tokens=new, stop_at_eos=False)
        n += slots * new
    return n / (time.perf_counter() - t)


def static_batches(model, work, slots: int) -> float:
    """Tokens/s of the same requests in batches of ``slots`` (arrival order), each row its own budget and EOS."""
    import pdecode

    t, n = time.perf_counter(), 0
    for i in range(0, len(work), slots):
        group = work[i: i + slots]
        out = pdecode.generate(model, [p for p, _ in group], max_new_tokens=[b for _, b in group])
        n += sum(len(x) for x in out.tokens)
    return n / (time.perf_counter() - t)


def make_engine(name: str, target, draft, slots: int, steps_per_call: int, max_len: int, warm: bool = True):
    """An engine as `pdecode serve` makes it (paged, chunk 128): ``name`` ``ar`` or ``sd auto``."""
    from pdecode.engine import Engine

    kw = dict(slots=slots, max_len=max_len, chunk=128, kv_pages=slots * max_len // 16, steps_per_call=steps_per_call)
    if name == "ar":
        engine = Engine(target, method="ar", **kw)
    elif name == "sd auto":
        engine = Engine(target, method="sd", draft=draft, speculation="auto", **kw)
    else:
        raise SystemExit(f"--methods: ar or 'sd auto', got {name!r}")
    if warm:
        engine.warmup()
    return engine


def profile_pass(engine, work, clients: int) -> dict:
    """One closed-loop pass with every program waited for and timed: {program: (calls, total s)}, and the wall."""
    import jax

    times = collections.defaultdict(list)

    class Timed:
        def __init__(self, key, exe):
            self.key, self.exe = key, exe

        def __call__(self, *a, **k):
            t = time.perf_counter()
            out = jax.block_until_ready(self.exe(*a, **k))
            times[self.key].append(time.perf_counter() - t)
            return out

        def __getattr__(self, name):
            return getattr(self.exe, name)

    saved = dict(engine._exe)
    try:
        for k, exe in saved.items():
            engine._exe[k] = Timed(k, exe)
        t = time.perf_counter()
        closed_loop(engine, work, clients)
        wall = time.perf_counter() - t
    finally:
        engine._exe.update(saved)
    kinds = collections.defaultdict(lambda: [0, 0.0])
    for k, v in times.items():
        kind = k[0] if isinstance(k, tuple) else k
        kinds[kind][0] += len(v)
        kinds[kind][1] += sum(v)
    return {"wall_s": wall, "programs": {k: (n, s) for k, (n, s) in kinds.items()}}


def run(target, draft, methods, clients_list, passes: int, slots: int = 16, steps_per_call: int = 8,
        requests: int = 48, max_len: int = 1024, warm: bool = True, profile: bool = False, log=print,
        deadline: float | None = None) -> dict:
    """The rows (see the module's doc) as a dict: fixed / static tokens/s and one row per (method, clients).
    ``deadline`` (`time.monotonic()`): a method whose programs are not compiled by then is skipped, and passes stop
    there (one at least); what was left out is listed in ``skipped``."""
    import numpy as np

    from infer.serve_bench import _workload, closed_loop_fill

    late = lambda: deadline is not None and time.monotonic() > deadline  # noqa: E731
    work = [(target.tokenizer.encode(p) if isinstance(p, str) else p, b)
            for p, b in _workload(target, requests, (16, 64), (32, 96))]
    fixed_batch(target, work, slots), static_batches(target, work, slots)  # (compiles)
    engines, skipped = {}, []
    for name in methods:  # (each program the passes use, compiled before the first timed pass)
        if late():
            skipped.append(f"{name}: not compiled by the deadline")
            continue
        e = make_engine(name, target, draft, slots, steps_per_call, max_len, warm)
        for c in clients_list:
            closed_loop(e, work, c)
        engines[name] = e
    tps, ends = collections.defaultdict(list), {}
    for i in range(passes):
        if i and late():
            skipped.append(f"passes {i + 1}-{passes}: past the deadline")
            break
        even = i % 2 == 0  # (the order turned every other pass: a drift of the machine within a pass evens out)
        tps["fixed" if even else "static"].append((fixed_batch if even else static_batches)(target, work, slots))
        for name, e in list(engines.items())[:: 1 if even else -1]:
            for c in clients_list:
                r, ends[(name, c)] = closed_loop(e, work, c)
                tps[(name, c)].append(r)
        tps["static" if even else "fixed"].append((static_batches if even else fixed_batch)(target, work, slots))
        log(f"pass {i + 1}/{passes}: " + ", ".join(f"{k if isinstance(k, str) else f'{k[0]} {k[1]}'} {v[-1]:.0f}"
                                                   for k, v in tps.items()))
    fixed, static = np.array(tps["fixed"]), np.array(tps["static"])
    rows = []
    for (name, c), v in ((k, v) for k, v in tps.items() if isinstance(k, tuple)):
        v = np.array(v)
        row = {"method": name, "clients": c, "tokens_per_s": float(np.median(v)),
               "x_fixed": float(np.median(v / fixed)), "x_static": float(np.median(v / static)),
               "x_fixed_q": [float(x) for x in np.quantile(v / fixed, [.25, .75])]}
        if name != "ar" and ("ar", c) in tps:  # (the same clients' ar in the same pass)
            ratio = v / np.array(tps[("ar", c)])
            row["x_ar"], row["x_ar_q"] = float(np.median(ratio)), [float(x) for x in np.quantile(ratio, [.25, .75])]
        if c == slots and name == "ar":  # (each request's tokens as the engine ended it: budget or EOS)
            row["fill_ceiling"] = closed_loop_fill(ends[(name, c)], c)
        rows.append(row)
    res = {"slots": slots, "steps_per_call": steps_per_call, "requests": requests, "passes": len(fixed),
           "fixed_tokens_per_s": float(np.median(fixed)), "static_tokens_per_s": float(np.median(static)),
           "static_x_fixed": float(np.median(static / fixed)), "rows": rows, "skipped": skipped}
    if profile:
        res["profile"] = {f"{name} {c}": profile_pass(e, work, c) for name, e in engines.items() for c in clients_list}
    return res


def to_markdown(res: dict) -> str:
    lines = [f"{res['requests']} requests, {res['slots']} slots, {res['steps_per_call']} steps a call, "
             f"{res['passes']} passes; `generate`: fixed batch {res['fixed_tokens_per_s']:.1f} tok/s, static "
             f"batches of the same requests {res['static_tokens_per_s']:.1f} ({res['static_x_fixed']:.3f}x the fixed "
             "batch)", "", "| engine | clients | tok/s | x fixed batch (quartiles) | x static batches | x ar (quartiles) "
             "| closed loop's fill ceiling |", "|---|---|---|---|---|---|---|"]
    for r in res["rows"]:
        fill = f"{r['fill_ceiling']:.2f}" if "fill_ceiling" in r else "-"
        q = r["x_fixed_q"]
        x_ar = f"{r['x_ar']:.3f} ({r['x_ar_q'][0]:.3f}-{r['x_ar_q'][1]:.3f})" if "x_ar" in r else "-"
        lines.append(f"| {r['method']} | {r['clients']} | {r['tokens_per_s']:.1f} | {r['x_fixed']:.3f} "
                     f"({q[0]:.3f}-{q[1]:.3f}) | {r['x_static']:.3f} | {x_ar} | {fill} |")
    if res.get("skipped"):
        lines.append("\nLeft out: " + "; ".join(res["skipped"]) + ".")
    for key, p in (res.get("profile") or {}).items():
        tot = sum(s for _, s in p["programs"].values())
        parts = ", ".join(f"{k} {n} calls {1e3 * s:.0f} ms ({s / tot:.0%})"
                          for k, (n, s) in sorted(p["programs"].items(), key=lambda kv: -kv[1][1]))
        lines.append(f"\nEvery program waited for, {key} clients: {1e3 * p['wall_s']:.0f} ms wall, "
                     f"{1e3 * tot:.0f} ms in programs: {parts}.")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--clients", type=int, nargs="+", default=[16])
    ap.add_argument("--methods", nargs="+", default=["ar"], help="ar and/or 'sd auto'")
    ap.add_argument("--passes", type=int, default=8)
    ap.add_argument("--slots", type=int, default=16)
    ap.add_argument("--steps-per-call", type=int, default=8)
    ap.add_argument("--profile", action="store_true")
    args = ap.parse_args(argv)
    import pdecode

    pdecode.enable_disk_cache()
    target = pdecode.load("code-target", dtype="bfloat16", activation_dtype="float32")
    draft = pdecode.load("code-draft", dtype="bfloat16", activation_dtype="float32") if "sd auto" in args.methods \
        else None
    res = run(target, draft, args.methods, args.clients, args.passes, args.slots, args.steps_per_call,
              profile=args.profile, log=lambda s: print(s, file=sys.stderr, flush=True))
    print(to_markdown(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
