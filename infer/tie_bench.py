"""Every lossless method against AR at the zoo's stored precision (bfloat16), greedy: how many rows are identical,
and where they are not, whether the first divergence sits at a floating-point near-tie (`pdecode.divergence`).

    pdecode bench --suite ties                              # 24 validation prompts x 64 tokens, 128 new tokens
    pdecode bench --suite ties --dtype float32              # the same in float32 (expected: every row identical)

Writes results.md / results.json under --out (default docs/bench/ties).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

# (target, method, draft, heads model): every lossless method of the registry on the zoo model it is trained for
CASES = [
    ("code-target", "sd", "code-draft", None),
    ("code-target", "tree", "code-draft", None),
    ("code-target", "lookup", None, None),
    ("code-target", "eagle", None, "code-target-eagle"),
    ("code-target", "eagle", None, "code-target-eagle3"),
    ("code-target", "medusa", None, "code-target-medusa"),
    ("code-target", "mtp", None, "code-target-mtp-posthoc"),
    ("code-target-mtp", "mtp", None, None),
    ("code-target", "jacobi", None, None),
    ("code-target", "lookahead", None, None),
    ("code-target", "pearl", "code-draft", None),
    ("code-target-layerskip", "layerskip", None, None),
    ("code-target", "diffusion_draft", "code-dllm", None),
]


def sweep(prompts, new_tokens: int, cases=CASES, dtype: str = "auto", log=None) -> list[dict]:
    """One row per case: identical rows, and the first divergence of every other row with its float32 margin."""
    import pdecode
    from pdecode.divergence import first_divergences

    loaded: dict = {}

    def get(name):
        if name not in loaded:
            loaded[name] = pdecode.load(name, dtype=dtype)
        return loaded[name]

    refs: dict = {}
    rows = []
    for target, method, draft, heads in cases:
        m = get(heads or target)
        if target not in refs:
            refs[target] = pdecode.generate(get(target), prompts, max_new_tokens=new_tokens, stop_at_eos=False).tokens
        t0 = time.perf_counter()
        out = pdecode.generate(m, prompts, method=method, draft=get(draft) if draft else None,
                               max_new_tokens=new_tokens, stop_at_eos=False)
        divs = [d for d in first_divergences(m, prompts, refs[target], out.tokens) if d is not None]
        row = {"target": target, "method": method + (f"@{heads}" if heads else ""), "draft": draft,
               "rows": len(prompts), "identical": len(prompts) - len(divs),
               "ties": sum(d.tie for d in divs), "non_ties": sum(not d.tie for d in divs),
               "margins": [round(d.margin, 5) for d in divs], "positions": [d.position for d in divs],
               "tolerances": [round(d.tolerance, 5) for d in divs],
               "tokens_per_forward": round(out.stats["tokens_per_forward"], 3), "s": round(time.perf_counter() - t0, 1)}
        rows.append(row)
        if log:
            log(f"{row['method']:32s} identical {row['identical']}/{row['rows']}, ties {row['ties']}, "
                f"non-ties {row['non_ties']}, margins {row['margins']}")
    return rows


def to_markdown(rows: list[dict], meta: dict) -> str:
    lines = [f"Greedy, {meta['n_prompts']} validation prompts x {meta['prompt_tokens']} tokens, {meta['new_tokens']} "
             f"new tokens, weights and activations {meta['dtype']}; command: `{meta['command']}`.", "",
             "| target | method | draft | rows identical to AR | diverged at a near-tie | diverged elsewhere | "
             "float32 log-prob gap of the two tokens at the divergences (nats) / its tie tolerance | tokens/forward |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        gaps = ", ".join(f"{m:.4f}/{t:.3f}" for m, t in zip(r["margins"], r.get("tolerances", [])))
        lines.append(f"| {r['target']} | {r['method']} | {r['draft'] or '-'} | {r['identical']}/{r['rows']} | "
                     f"{r['ties']} | {r['non_ties']} | {gaps or '-'} | {r['tokens_per_forward']:.2f} |")
    lines += ["", "Near-tie: the gap is within the dtype's rounding at the two logits' size (`pdecode.divergence."
              "tie_tolerance`: max(floor, u x |logit| x sqrt(layers)))."]
    return "\n".join(lines) + "\n"


def run(args) -> int:
    import pdecode
    from infer.bench import default_prompts

    from pdecode.errors import InputError

    n = args.prompts or 24
    cases = [c for c in CASES if not args.methods or c[1] in args.methods]
    if not cases:
        raise InputError(f"--suite ties: --methods {' '.join(args.methods)} names no lossless method it runs "
                         f"({', '.join(sorted({c[1] for c in CASES}))})")
    if args.model or args.draft:
        raise InputError("--suite ties runs each method on the zoo model it is trained for: drop --model / --draft")
    prompts = default_prompts(pdecode.load("code-target"), n, args.prompt_tokens)
    rows = sweep(prompts, args.new_tokens, cases=cases, dtype=args.dtype,
                 log=lambda s: print(s, file=sys.stderr, flush=True))
    meta = {"n_prompts": n, "prompt_tokens": args.prompt_tokens, "new_tokens": args.new_tokens,
            "dtype": "as stored (bfloat16)" if args.dtype == "auto" else args.dtype,
            "command": "pdecode " + " ".join(sys.argv[1:])}
    out = Path("docs/bench/ties") if Path(args.out) == Path("bench_out/latest") else Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    md = to_markdown(rows, meta)
    (out / "results.md").write_text(md)
    print(md)
    return 0 if all(r["non_ties"] == 0 for r in rows) else 1
