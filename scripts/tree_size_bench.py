"""EAGLE trees of several sizes against ar on the real model: tokens per forward, speed, acceptance by depth.

    python scripts/tree_size_bench.py --heads smollm2-135m-instruct-eagle3 [--batch 1] [--new-tokens 128] [--rounds 3]

One held-out ShareGPT prompt (through the chat template) and one HumanEval prompt (``--batch`` of each set), greedy,
float32, ``--new-tokens`` tokens without stopping at EOS. Rows interleaved round by round (the first round is a
warm-up, not counted), medians of the wall times; ``P(>=d)``: the share of drafted steps that accepted at least d
drafted tokens (from `generate`'s accepted_histogram), per depth.
"""

import argparse

import numpy as np

import pdecode
from infer import real_bench as RB

TREES = [("ar", None), ("eagle 8", dict(tree_top_k=4, depth=4, total_tokens=8)),
         ("eagle 12", dict(tree_top_k=4, depth=5, total_tokens=12)),
         ("eagle 16", dict(tree_top_k=6, depth=6, total_tokens=16)),
         ("eagle 24", dict(tree_top_k=8, depth=6, total_tokens=24)), ("eagle 60 (default)", {})]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--heads", required=True)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    m = pdecode.attach_heads(pdecode.load(args.model, dtype="float32"), args.heads)
    sets = {"sharegpt": [p.ids for p in RB.sharegpt_prompts(m.tokenizer, n=args.batch)[0]],
            "humaneval": [p.ids for p in RB.humaneval_prompts(m.tokenizer, n=args.batch)]}
    res: dict = {}
    for rnd in range(args.rounds):
        for name, opts in TREES:
            for sname, prompts in sets.items():
                out = pdecode.generate(m, prompts, method="ar" if opts is None else "eagle",
                                       max_new_tokens=args.new_tokens, stop_at_eos=False, **(opts or {}))
                if rnd:
                    res.setdefault((sname, name), []).append(out)
    print(f"{args.heads} on {args.model}, float32, batch {args.batch}, {args.new_tokens} tokens, "
          f"{args.rounds - 1} timed rounds")
    print("| set | method | tokens per forward | tok/s | x ar | P(>=d), d = 1, 2, ... |")
    print("|---|---|---|---|---|---|")
    for sname in sets:
        ar = np.median([o.stats["wall_s"] for o in res[(sname, "ar")]])
        for name, _ in TREES:
            outs = res[(sname, name)]
            wall = np.median([o.stats["wall_s"] for o in outs])
            n = sum(map(len, outs[0].tokens))
            h = np.asarray(outs[0].stats.get("accepted_histogram") or [], float)
            depth = " ".join(f"{h[d:].sum() / h.sum():.2f}" for d in range(1, len(h))) if h.size else ""
            print(f"| {sname} | {name} | {outs[0].stats['tokens_per_forward']:.2f} | {n / wall:.1f} | "
                  f"{ar / wall:.2f} | {depth} |", flush=True)


if __name__ == "__main__":
    main()
