"""What sampling costs in the serving engine: one step call (16 live rows, span 256, 8 steps) of the greedy program
and of the full sampler (per-row temperature, top-k, top-p, min-p, penalties, logit bias, logprobs, grammar) with
every row asking for the same controls, for ar and sd; with ``--sort-top-p`` also the full sampler with top-p cut
by sorting the vocabulary (the rule before the bisection of `sampling._top_p`), side by side in one process.

    python scripts/sampler_bench.py [--methods ar sd] [--sort-top-p]

Prints milliseconds per call (median of 5 after one warm call) per method, program and controls.
"""

from __future__ import annotations

import argparse
import time

import numpy as np

CONTROLS = [("greedy", dict(temperature=0.0)), ("temperature 1", dict(temperature=1.0)),
            ("temperature 1, top_p 0.95", dict(temperature=1.0, top_p=0.95)),
            ("temperature 1, top_k 40", dict(temperature=1.0, top_k=40)),
            ("temperature 1, presence 0.5", dict(temperature=1.0, presence_penalty=0.5))]


def _sorted_top_p(x, top_p):
    """The sort-and-cut rule (what `sampling._top_p` computed before its bisection; rows at top_p >= 1 keep all, as
    the bisection's do)."""
    import jax.numpy as jnp
    import jax

    from pdecode import sampling

    srt = jnp.sort(x, axis=-1)[..., ::-1]
    p = jax.nn.softmax(srt, axis=-1)
    keep = jnp.cumsum(p, axis=-1) - p < top_p
    thresh = jnp.min(jnp.where(keep, srt, jnp.inf), axis=-1, keepdims=True)
    return jnp.where((x < thresh) & (top_p < 1), sampling.NEG_INF, x)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--methods", nargs="+", default=["ar", "sd"])
    ap.add_argument("--sort-top-p", action="store_true", help="also time top-p by a sort of the vocabulary")
    args = ap.parse_args(argv)
    import jax

    import pdecode
    from pdecode import sampling
    from pdecode.engine import Engine

    m = pdecode.load("code-target", dtype="bfloat16", activation_dtype="float32")
    d = pdecode.load("code-draft", dtype="bfloat16", activation_dtype="float32")
    kw = dict(slots=16, max_len=1024, chunk=128, kv_pages=1024, steps_per_call=8, spans=[256], row_buckets=[16])
    prompt = list(range(10, 50))
    print("| method | controls | greedy program ms | full sampler ms |" + (" full, top-p by sort ms |"
                                                                             if args.sort_top_p else ""))
    print("|---|---|---|---|" + ("---|" if args.sort_top_p else ""))
    bisect = sampling._top_p
    for method in args.methods:
        e = Engine(m, method="ar", **kw) if method == "ar" else Engine(m, method="sd", draft=d, **kw)
        e.warmup()
        progs = {"fast": e._step_exe(e.fast, False, 256, 16), "full": e._step_exe(e.full, False, 256, 16)}
        if args.sort_top_p:
            sampling._top_p = _sorted_top_p
            progs["sort"] = e._compile(("step-sort",), e._step_fn, e.params, e.state, static={
                "samp": e.full, "k": e.k, "plain": False, "span": 256, "rows": 16}, donate=(1,))
            sampling._top_p = bisect
        for name, ctl in CONTROLS:
            for s in list(e.running):
                e._free(s)
            for _ in range(16):
                e.submit(prompt, e.check(prompt, max_tokens=600, **ctl))
            e._admit()
            e._inflight.clear()
            jax.block_until_ready(e.state)
            ts = {k: [] for k in progs if k != "fast" or name == "greedy"}
            for _ in range(6):
                for k in ts:
                    st = jax.tree.map(lambda a: a.copy(), e.state)  # (the programs donate their state)
                    jax.block_until_ready(st)
                    t = time.perf_counter()
                    jax.block_until_ready(progs[k](e.params, st)[1])
                    ts[k].append(time.perf_counter() - t)
            ms = {k: f"{np.median(v[1:]) * 1e3:.1f}" for k, v in ts.items()}
            print(f"| {method} | {name} | {ms.get('fast', '')} | {ms['full']} |"
                  + (f" {ms['sort']} |" if args.sort_top_p else ""), flush=True)
        del e


if __name__ == "__main__":
    main()
