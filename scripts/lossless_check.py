"""Is sampling with trained heads lossless on the real model? A two-sample chi-square test against AR's samples.

    python scripts/lossless_check.py --heads smollm2-135m-instruct-eagle3 [--method eagle] [--rows 900]
        [--temperature 0.7] [--tokens 3] [--prompt-index 0] [--out docs/bench/lossless_eagle3]

One held-out prompt (ShareGPT from index 12,000, through the chat template), ``--rows`` copies of it sampled at
``--temperature`` by AR and by ``--method`` with the heads attached, each row its own random stream. For every
position after the first (the first token comes from the prompt's own forward in both, drafting starts after it),
the counts of each token are compared by a chi-square test of homogeneity (tokens seen fewer than 10 times in both
samples pooled into one bin). The same test is run on a **wrong rule**: the method drafting a chain (tree_top_k 1)
whose drafts are accepted by speculative sampling against a uniform q instead of the q = 1 rule its deterministic
drafts need (accepting nearly every draft). A lossless method passes (p above 0.001 at every position); the wrong
rule must fail at some position, or the test had no power. Writes results.json and prints a table.
"""

import argparse
import json
import time
from pathlib import Path

import numpy as np


def counts_test(a: np.ndarray, b: np.ndarray, floor: int = 10) -> dict:
    """Chi-square homogeneity of two samples of token ids (rare tokens pooled)."""
    from scipy import stats

    keys = np.union1d(a, b)
    ca = np.array([(a == k).sum() for k in keys])
    cb = np.array([(b == k).sum() for k in keys])
    common = (ca + cb) >= floor
    table = np.stack([np.append(ca[common], ca[~common].sum()), np.append(cb[common], cb[~common].sum())])
    table = table[:, table.sum(0) > 0]
    if table.shape[1] < 2:
        return {"p": 1.0, "bins": int(table.shape[1]), "top_share": [1.0, 1.0]}
    chi2, p, dof, _ = stats.chi2_contingency(table)
    top = keys[np.argmax(ca + cb)]
    return {"p": float(p), "chi2": round(float(chi2), 2), "bins": int(table.shape[1]),
            "top_token": int(top), "top_share": [round(float((x == top).mean()), 4) for x in (a, b)]}


def sample(m, prompt, rows: int, chunk: int, method: str, temperature: float, tokens: int, seed: int, **opts):
    import pdecode

    out, tpf = [], []
    for i in range(0, rows, chunk):
        n = min(chunk, rows - i)
        r = pdecode.generate(m, [prompt] * n, method=method, max_new_tokens=tokens, temperature=temperature,
                             seed=seed + i, stop_at_eos=False, **opts)
        out += [t[:tokens] for t in r.tokens]
        tpf.append(r.stats.get("tokens_per_forward", 1.0))
    return np.array(out), float(np.mean(tpf))


def wrong_rule():
    """Patch the feature drafters' proposals to be verified by speculative sampling against a uniform q (a rule
    their deterministic drafts do not satisfy); returns the undo."""
    import jax.numpy as jnp

    from pdecode.decode import eagle
    from pdecode.decode.verify import Rule

    orig = eagle.FeatureDrafter.propose

    def propose(self, dparams, dstate, ctx, key, samp, warp):
        prop, st = orig(self, dparams, dstate, ctx, key, samp, warp)
        if samp.greedy:
            return prop, st
        b, n = prop.tokens.shape
        v = self.cfg.vocab_size
        return prop._replace(rule=Rule.CHAIN_SAMPLING, q=jnp.full((b, n, v), 1.0 / v, jnp.float32)), st

    eagle.FeatureDrafter.propose = propose
    return lambda: setattr(eagle.FeatureDrafter, "propose", orig)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--heads", required=True, help="heads directory or zoo name trained for --model")
    ap.add_argument("--method", default="eagle", choices=["eagle", "mtp"])
    ap.add_argument("--rows", type=int, default=900)
    ap.add_argument("--chunk", type=int, default=25, help="rows per generate call (a sampled EAGLE-2 tree keeps the "
                    "draft distribution of its whole candidate pool: rows x 610 nodes x the vocabulary's floats)")
    ap.add_argument("--temperature", type=float, default=0.7)
    ap.add_argument("--tokens", type=int, default=3)
    ap.add_argument("--prompt-index", type=int, default=0, help="which held-out ShareGPT prompt")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    import pdecode
    from infer import real_bench as RB

    m = pdecode.attach_heads(pdecode.load(args.model, dtype="float32"), args.heads)
    prompts, _ = RB.sharegpt_prompts(m.tokenizer, n=args.prompt_index + 1, max_tokens=64)
    prompt = prompts[args.prompt_index].ids
    t0 = time.perf_counter()
    ar, _ = sample(m, prompt, args.rows, args.chunk, "ar", args.temperature, args.tokens, seed=1)
    sp, tpf = sample(m, prompt, args.rows, args.chunk, args.method, args.temperature, args.tokens, seed=100_003)
    undo = wrong_rule()
    try:
        bad, bad_tpf = sample(m, prompt, args.rows, args.chunk, args.method, args.temperature, args.tokens,
                              seed=200_003, tree_top_k=1, depth=args.tokens, total_tokens=args.tokens)
    finally:
        undo()
    res = {"model": args.model, "heads": str(args.heads), "method": args.method, "rows": args.rows,
           "temperature": args.temperature, "prompt": prompts[args.prompt_index].key, "prompt_tokens": len(prompt),
           "tokens_per_forward": round(tpf, 3), "wrong_rule_tokens_per_forward": round(bad_tpf, 3),
           "positions": [], "wall_s": None}
    print(f"{args.method} with {args.heads} against ar, {args.rows} rows each, T={args.temperature}, "
          f"prompt {res['prompt']} ({len(prompt)} tokens)")
    print("| token | bins | p (method) | p (wrong rule) | top token share ar / method / wrong |")
    print("|---|---|---|---|---|")
    for i in range(1, args.tokens):
        good, wrong = counts_test(ar[:, i], sp[:, i]), counts_test(ar[:, i], bad[:, i])
        res["positions"].append({"token": i + 1, "method": good, "wrong_rule": wrong})
        wshare = wrong["top_share"][1] if wrong.get("top_token") == good.get("top_token") else float("nan")
        print(f"| {i + 1} | {good['bins']} | {good['p']:.3g} | {wrong['p']:.3g} | "
              f"{good['top_share'][0]:.3f} / {good['top_share'][1]:.3f} / {wshare:.3f} |")
    res["lossless"] = all(p["method"]["p"] > 1e-3 for p in res["positions"])
    res["wrong_rule_rejected"] = any(p["wrong_rule"]["p"] < 1e-3 for p in res["positions"])
    res["wall_s"] = round(time.perf_counter() - t0, 1)
    print(f"lossless (every p > 0.001): {res['lossless']}; wrong rule rejected (some p < 0.001): "
          f"{res['wrong_rule_rejected']}; tokens per forward {tpf:.2f} (wrong rule {bad_tpf:.2f}); "
          f"{res['wall_s']:.0f} s")
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "results.json").write_text(json.dumps(res, indent=1) + "\n")


if __name__ == "__main__":
    main()
