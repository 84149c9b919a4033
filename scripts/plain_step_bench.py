"""What a plain step of lookup's gated loop costs against an AR step (SmolLM2, float32, ShareGPT prompts).

    python scripts/plain_step_bench.py [--batch 4] [--new-tokens 128] [--rounds 9]

Rows, interleaved round by round (the first round is a warm-up), ms per target forward, medians: ``ar``; ``gated``:
lookup with a draft that never pays (``draft_cost`` 1e6), so every step is a plain step of the gated loop; ``plain``:
the same method with the gate replaced by the plain step alone (no gate at all), the floor the gated loop should
match. docs/results.md records what it printed when the gate was a ``lax.cond`` and after.
"""

import argparse

import numpy as np

import pdecode
from infer import real_bench as RB
from pdecode.decode import speculative as S


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=9)
    args = ap.parse_args()
    m = pdecode.load("smollm2-135m-instruct", dtype="float32")
    prompts, _ = RB.sharegpt_prompts(m.tokenizer, n=args.batch)
    ids = [p.ids for p in prompts]
    gated = S._gated

    def plain_only(step, tparams, dparams, warp, **kw):
        return S.make_step(tparams, dparams, warp, plain=True, **kw)

    rows = {"ar": ("ar", {}, gated), "gated": ("lookup", {"draft_cost": 1e6}, gated),
            "plain": ("lookup", {"draft_cost": 1e5}, plain_only)}  # (another cost: another compiled program)
    per = {k: [] for k in rows}
    for r in range(args.rounds):
        order = list(rows.items()) if r % 2 else list(rows.items())[::-1]
        for k, (meth, opts, g) in order:
            S._gated = g
            out = pdecode.generate(m, ids, method=meth, max_new_tokens=args.new_tokens, stop_at_eos=False, **opts)
            if r:
                per[k].append(1000 * out.stats["wall_s"] / out.stats["target_forwards"])
    S._gated = gated
    for k, v in per.items():
        print(f"{k:6s} ms per step: median {np.median(v):.1f}  ({', '.join(f'{x:.1f}' for x in v)})")


if __name__ == "__main__":
    main()
