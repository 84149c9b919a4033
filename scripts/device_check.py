"""The accelerator check: run it (scripts/device_check.sh) whenever a session is lent a GPU or TPU host.

In at most 10 minutes on one host it measures, on whatever JAX's default backend is:

1. the attention implementations' tests (tests/test_attention_impl.py) on the device: the cuDNN path on a GPU, the
   compiled Pallas splash kernel on a TPU (neither has run on hardware before this script);
2. tokens/s, tau and compile seconds of ar / sd / lookup / eagle / dico on the zoo at batch 1 and 8 (8 validation
   prompts of 64 tokens, 64 new tokens, greedy, rounds interleaved, median);
3. tokens/s and compile seconds of ar and lookup on random-weight Llama-3.2-1B and Llama-3-8B shapes (bfloat16;
   random weights: their tau says nothing, the step cost is real), placed over every local device;
4. the verify cost: one target forward over k = 1..64 fresh tokens vs k = 1 (zoo target, 1B, 8B), at batch 1
   and 8 — where it stays near 1, drafted tokens are verified for free;
5. the serving engine under closed-loop load in one process (`infer.load_bench`: ar and sd with speculation="auto" at
   1, 4 and 16 clients against a fixed batch of 16 through `generate`): the serve bench's figures without HTTP, the
   ones this CPU cannot show — when the run reaches it by 380 s; what is not compiled by 540 s is skipped and listed
   (results.json holds phases 1-4 before it starts);

and writes bench_out/device_check/results.json plus a dated section in docs/results.md (between the
``device_check`` markers; the newest run first). Each phase has a time budget: rows left when it runs out are
listed as skipped, never silently dropped. ``--quick`` is the CPU smoke run the tests use (tiny shapes).
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

START, END = "<!-- device_check:start -->", "<!-- device_check:end -->"
ZOO_METHODS = [("ar", "code-target", {}), ("sd", "code-target", {"gamma": 4}), ("lookup", "code-target", {}),
               ("eagle", "code-target-eagle", {}), ("dico", "code-dllm", {})]
BIG = {"llama-3.2-1b": 16, "llama-3-8b": 32}  # plan configs and their layer counts (shapes from infer.plan.CONFIGS)
VERIFY_KS = (1, 2, 4, 8, 16, 32, 64)
LOAD_START_BY_S = 380  # the engine phase runs only if it can start by then (its compiles take minutes) ...
LOAD_END_S = 540  # ... and skips what is not compiled, and the passes left, past this (the script's limit is 600 s)


class Budget:
    def __init__(self, seconds: float):
        self.end = time.monotonic() + seconds

    def left(self) -> bool:
        return time.monotonic() < self.end


def attention_tests(quick: bool, budget_s: float) -> dict:
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(ROOT / "tests" / "test_attention_impl.py")]
    if quick:
        cmd += ["-k", "refuses_before"]
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=budget_s, cwd=ROOT,
                           env={**__import__("os").environ, "JAX_DEFAULT_MATMUL_PRECISION": "highest"})
        out = r.stdout.strip().splitlines()
        summary = out[-1] if out else r.stderr.strip()[-300:]
        failed = [x for x in out if x.startswith("FAILED")]
        return {"summary": summary, "rc": r.returncode, "failed": failed[:20]}
    except subprocess.TimeoutExpired:
        return {"summary": f"timed out after {budget_s:.0f}s", "rc": None, "failed": []}


def random_model(name: str, layers: int | None, quick: bool):
    """A random-weight model of a plan config's shapes (bfloat16), placed over every local device."""
    import jax
    import jax.numpy as jnp

    import pdecode
    from infer.plan import model_config
    from pdecode.model.transformer import init_params, param_specs
    from pdecode.sharding import make_mesh, param_shardings

    cfg = model_config(name).with_run(activation_dtype=None).replace(dtype="bfloat16")
    if quick:  # the CPU smoke run: the config's kind, tiny
        cfg = cfg.replace(vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                          num_kv_heads=2, head_dim=16)
    n = jax.local_device_count()
    mesh = make_mesh(1, n) if n > 1 else None
    init = jax.jit(lambda k: init_params(cfg, k, dtype=jnp.bfloat16),
                   **({"out_shardings": param_shardings(param_specs(cfg), mesh, indivisible="replicate")}
                      if mesh is not None else {}))
    m = pdecode.Model(cfg=cfg, params=init(jax.random.PRNGKey(0)), name=f"random {name}")
    return (m.on_mesh(mesh, "replicate") if mesh is not None else m), mesh


def run(args) -> dict:
    import jax
    import numpy as np

    import pdecode
    from infer.bench import OurRunner, default_prompts, run_rows, verify_cost

    t_start = time.monotonic()
    devs = jax.devices()
    res = {"date": time.strftime("%Y-%m-%d %H:%M"), "backend": jax.default_backend(),
           "devices": f"{len(devs)} x {devs[0].device_kind}", "jax": jax.__version__, "host": platform.node(),
           "quick": args.quick, "rows": [], "verify": [], "skipped": []}
    print(f"device check on {res['devices']} ({res['backend']})", file=sys.stderr, flush=True)

    print("1/5 attention tests on the device ...", file=sys.stderr, flush=True)
    res["attention"] = attention_tests(args.quick, 40 if args.quick else 150)
    print(f"    {res['attention']['summary']}", file=sys.stderr, flush=True)

    new = 8 if args.quick else 64
    repeats = 1 if args.quick else 3
    batches = (1,) if args.quick else (1, 8)
    print("2/5 zoo: tokens/s at batch " + " and ".join(map(str, batches)) + " ...", file=sys.stderr, flush=True)
    budget = Budget(30 if args.quick else 150)
    target = pdecode.load("code-target")
    draft = pdecode.load("code-draft")
    prompts = default_prompts(target, 8, 64)
    methods = ZOO_METHODS[:1] if args.quick else ZOO_METHODS
    loaded = {"code-target": target}
    for b in batches:
        runners = []
        for method, model, opts in methods:
            if model not in loaded:
                loaded[model] = pdecode.load(model)
            runners.append(OurRunner(loaded[model], method, opts, draft=draft if method == "sd" else None,
                                     label=f"zoo {method}"))
        if not budget.left():
            res["skipped"] += [f"zoo {r.label} batch {b}" for r in runners]
            continue
        for row in run_rows(runners, prompts[:1] if args.quick else prompts, b, new, 0.0, repeats):
            res["rows"].append(_row(row, "zoo"))

    print("3/5 random-weight 1B / 8B shapes: ar and lookup ...", file=sys.stderr, flush=True)
    budget = Budget(40 if args.quick else 170)
    for name in (["llama-3.2-1b"] if args.quick else list(BIG)):
        if not budget.left():
            res["skipped"].append(f"{name}: tokens/s and verify cost")
            continue
        m, mesh = random_model(name, BIG[name], args.quick)
        rng = np.random.default_rng(0)
        rand_prompts = [rng.integers(0, m.cfg.vocab_size, 64).tolist() for _ in range(8)]
        for b in batches:
            if not budget.left():
                res["skipped"].append(f"{name} batch {b}")
                continue
            runners = [OurRunner(m, meth, {}, label=f"{name} {meth}", mesh=mesh)
                       for meth in (("ar",) if args.quick else ("ar", "lookup"))]
            for row in run_rows(runners, rand_prompts[:b], b, 32 if not args.quick else 8, 0.0, max(1, repeats - 1)):
                res["rows"].append(_row(row, name))
        if mesh is None and budget.left():
            ks = (1, 2) if args.quick else VERIFY_KS
            res["verify"] += verify_cost(m.cfg, m.params, ks=ks, batches=batches, context=128, repeats=3,
                                         label=name)
        elif mesh is not None:
            res["skipped"].append(f"{name} verify cost (measured on one device only)")
        del m
        pdecode.clear_compile_cache()

    print("4/5 verify cost of the zoo target ...", file=sys.stderr, flush=True)
    budget = Budget(20 if args.quick else 60)
    if budget.left():
        res["verify"] += verify_cost(target.cfg, target.params, ks=(1, 2) if args.quick else VERIFY_KS,
                                     batches=batches, context=128, repeats=3, label="code-target")

    print("5/5 the serving engine under load ...", file=sys.stderr, flush=True)
    save_json(args.out, res)  # (phases 1-4 kept should the last one still be cut by the 600 s timeout)
    if args.quick or time.monotonic() - t_start < LOAD_START_BY_S:
        from infer import load_bench

        kw = dict(methods=["ar"], clients_list=[2], passes=1, slots=2, requests=4, max_len=256) if args.quick else \
            dict(methods=["ar", "sd auto"], clients_list=[1, 4, 16], passes=3)
        res["load"] = load_bench.run(target, draft, warm=False, deadline=t_start + LOAD_END_S,
                                     log=lambda x: print("    " + x, file=sys.stderr, flush=True), **kw)
        res["skipped"] += [f"load: {x}" for x in res["load"]["skipped"]]
    else:
        res["skipped"].append("the serving engine under load (started past "
                              f"{LOAD_START_BY_S} s: `python -m infer.load_bench --clients 1 4 16 --methods ar "
                              "'sd auto' --passes 3` alone)")
    res["seconds"] = round(time.monotonic() - t_start, 1)
    return res


def _row(row: dict, model: str) -> dict:
    return {"model": model, "method": row["method"].split()[-1], "batch": row["batch"],
            "tokens_per_s": round(row["tokens_per_s"], 1), "tau": None if row["tau"] is None else round(row["tau"], 3),
            "compile_s": round(row["compile_s"], 2)}


def to_markdown(res: dict) -> str:
    lines = [f"### {res['date']}: {res['devices']} ({res['backend']}, jax {res['jax']})" +
             (" — CPU smoke run (--quick), not a device figure" if res["quick"] else ""), "",
             f"`bash scripts/device_check.sh` ({res['seconds']} s). Attention tests on the device: "
             f"{res['attention']['summary']}" + (f"; failed: {', '.join(res['attention']['failed'])}"
                                                 if res["attention"]["failed"] else ""), "",
             "| model | method | batch | tokens/s | tau | compile s |", "|---|---|---|---|---|---|"]
    for r in res["rows"]:
        lines.append(f"| {r['model']} | {r['method']} | {r['batch']} | {r['tokens_per_s']} | {r['tau'] or '-'} | "
                     f"{r['compile_s']} |")
    if res["verify"]:
        lines += ["", "Verify cost (one forward over k fresh tokens / k = 1):", "",
                  "| model | batch | " + " | ".join(f"k={k}" for k in sorted({v['k'] for v in res['verify']})) + " |",
                  "|---|---|" + "---|" * len({v["k"] for v in res["verify"]})]
        for (model, b) in dict.fromkeys((v["model"], v["batch"]) for v in res["verify"]):
            cells = [f"{v['ratio_to_k1']:.2f}" for v in res["verify"] if v["model"] == model and v["batch"] == b]
            lines.append(f"| {model} | {b} | " + " | ".join(cells) + " |")
    if res.get("load"):
        from infer import load_bench

        lines += ["", "The serving engine under closed-loop load, in process (`infer.load_bench`):", "",
                  load_bench.to_markdown(res["load"]).rstrip("\n")]
    if res["skipped"]:
        lines += ["", "Skipped (time budget): " + "; ".join(res["skipped"])]
    return "\n".join(lines) + "\n"


def save_json(out: Path, res: dict) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(res, indent=1))


def record(results: Path, md: str) -> None:
    """Put ``md`` first in the results file's device-check block (made at the end if missing)."""
    text = results.read_text() if results.exists() else ""
    if START not in text:
        text = text.rstrip("\n") + ("\n\n" if text else "") + "## Accelerator check (scripts/device_check.sh)\n\n" \
            f"{START}\n{END}\n"
    head, rest = text.split(START, 1)
    results.write_text(head + START + "\n" + md + "\n" + rest.lstrip("\n"))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="the CPU smoke run (tiny shapes, one repeat)")
    ap.add_argument("--results", type=Path, default=ROOT / "docs" / "results.md")
    ap.add_argument("--out", type=Path, default=ROOT / "bench_out" / "device_check")
    args = ap.parse_args(argv)
    res = run(args)
    save_json(args.out, res)
    md = to_markdown(res)
    record(args.results, md)
    print(md)
    print(f"wrote {args.out}/results.json and a section in {args.results} ({res['seconds']} s)", file=sys.stderr)
    return 0 if res["attention"]["rc"] in (0, 5) else 1


if __name__ == "__main__":
    sys.exit(main())
