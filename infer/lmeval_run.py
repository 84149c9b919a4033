"""lm-evaluation-harness against `pdecode serve`: a local loglikelihood (multiple-choice) task and a generate_until
task, run through lm-eval's own OpenAI-completions client, and every loglikelihood checked against
`pdecode.forward_logits` on the same tokens.

    pip install "lm-eval[api]"                       # not a pdecode extra: ~50 s to install here
    python -m infer.lmeval_run                       # code-target, 24 items per task -> bench_out/lmeval
    python -m infer.lmeval_run --url http://127.0.0.1:8000 --model code-target   # a server already running
    python -m infer.lmeval_run --model smollm2-135m-instruct   # the real model (its GGUF's tokenizer is written out)

The tasks are written as lm-eval task YAMLs over local JSONL (nothing is downloaded): ``pdecode_mc`` asks for the
value of held-out task-set asserts (``assert 7 * 3 ==``) among four choices (lm-eval sends each choice as an
``echo, logprobs=1, max_tokens=1`` completion over the token ids of context + choice), ``pdecode_gen`` generates
the value up to a newline. The check: lm-eval's loglikelihood of each (context, choice) equals the sum of
`pdecode.forward_logits`'s log-probabilities of the choice's tokens (the HF tokenizer's split, as lm-eval makes it)
within 2e-3. Writes results.json and results.md under ``--out``.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

from pdecode.cli_args import ArgumentParser

TOLERANCE = 2e-3

MC_YAML = """task: pdecode_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{context}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{label}}}}"
metric_list:
  - metric: acc
"""

GEN_YAML = """task: pdecode_gen
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: generate_until
doc_to_text: "{{{{context}}}}"
doc_to_target: "{{{{answer}}}}"
generation_kwargs:
  until: ["\\n"]
  max_gen_toks: 8
metric_list:
  - metric: exact_match
    aggregation: mean
    higher_is_better: true
"""


def write_tasks(d: Path, n: int, seed: int = 0) -> Path:
    """The two tasks' YAML and JSONL under ``d`` (an lm-eval include path) from held-out arithmetic / max asserts."""
    from train import tasks

    rng = random.Random(seed)
    held = [x for x in tasks.split()[1] if x.kind in ("add", "sub", "mul", "max")][:n]
    mc, gen = [], []
    for it in held:
        wrong: set[str] = set()
        while len(wrong) < 3:
            w = str(int(it.answer) + rng.choice([-3, -2, -1, 1, 2, 3, 10]))
            if w != it.answer:
                wrong.add(w)
        choices = [it.answer] + sorted(wrong)
        rng.shuffle(choices)
        mc.append({"context": it.prompt.rstrip(), "choices": choices, "label": choices.index(it.answer)})
        gen.append({"context": it.prompt, "answer": it.answer})
    d.mkdir(parents=True, exist_ok=True)
    for name, rows, yaml in (("mc", mc, MC_YAML), ("gen", gen, GEN_YAML)):
        (d / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        (d / f"{name}.yaml").write_text(yaml.format(data=d / f"{name}.jsonl"))
    return d


def check_loglikelihoods(model, tokenizer, samples: list[dict]) -> dict:
    """Each (context, continuation) of lm-eval's samples scored by `pdecode.forward_logits` on lm-eval's tokens."""
    import jax
    import numpy as np

    import pdecode

    diffs, n = [], 0
    for s in samples:
        pairs = s["arguments"]  # in memory: (context, continuation) tuples; as written to disk: {"arg_0", "arg_1"}
        pairs = [(a["arg_0"], a["arg_1"]) for a in pairs.values()] if isinstance(pairs, dict) else pairs
        for (ctx, cont), resp in zip(pairs, s["resps"]):
            whole = tokenizer.encode(ctx + cont, add_special_tokens=False)
            ctx_len = len(tokenizer.encode(ctx, add_special_tokens=False))
            logp = np.asarray(jax.nn.log_softmax(pdecode.forward_logits(model, [whole])[0].astype("float32"), -1))
            want = sum(float(logp[t - 1, whole[t]]) for t in range(ctx_len, len(whole)))
            diffs.append(abs(float(resp[0][0]) - want))
            n += 1
    return {"loglikelihoods": n, "max_abs_diff": max(diffs), "mean_abs_diff": float(np.mean(diffs)),
            "within_tolerance": all(d <= TOLERANCE for d in diffs), "tolerance": TOLERANCE}


def main(argv=None) -> int:
    ap = ArgumentParser(prog="python -m infer.lmeval_run", description=__doc__,
                        formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="code-target", help="zoo name or model directory (its tokenizer is lm-eval's)")
    ap.add_argument("--url", default=None, help="a running `pdecode serve` (default: start one on a free port)")
    ap.add_argument("--items", type=int, default=24, help="items per task")
    ap.add_argument("--dtype", default="float32", help="the server's and the check's params dtype (default float32)")
    ap.add_argument("--batch-size", type=int, default=1, help="lm-eval's requests per API call")
    ap.add_argument("--num-concurrent", type=int, default=4, help="lm-eval's concurrent API calls")
    ap.add_argument("--out", type=Path, default=Path("bench_out/lmeval"))
    args = ap.parse_args(argv)
    try:
        import lm_eval
        from lm_eval.tasks import TaskManager
    except ImportError:
        print('lm-eval is not installed: pip install "lm-eval[api]"', file=sys.stderr)
        return 2
    from transformers import AutoTokenizer

    import pdecode
    from infer.serve_bench import Server

    model = pdecode.load(args.model, dtype=args.dtype)
    model_dir = pdecode.api.resolve_path(args.model)
    if model_dir.is_file():  # a GGUF file: lm-eval's HF tokenizer written from its metadata
        from pdecode.checkpoint.hf import copy_tokenizer

        tok_dir = args.out / "tokenizer"
        tok_dir.mkdir(parents=True, exist_ok=True)
        copy_tokenizer(model_dir, tok_dir)
        model_dir = tok_dir
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    tasks_dir = write_tasks(args.out / "tasks", args.items)
    srv = None if args.url else Server(["--model", args.model, "--dtype", args.dtype])
    url = args.url or srv.url
    try:
        t0 = time.perf_counter()
        res = lm_eval.simple_evaluate(
            model="local-completions",
            model_args=dict(model=model.name or args.model, base_url=url.rstrip("/") + "/v1/completions",
                            tokenizer_backend="huggingface", tokenizer=str(model_dir),
                            num_concurrent=args.num_concurrent, max_retries=1, batch_size=args.batch_size),
            tasks=["pdecode_mc", "pdecode_gen"], task_manager=TaskManager(include_path=str(tasks_dir)),
            log_samples=True)
        wall = time.perf_counter() - t0
    finally:
        if srv is not None:
            srv.stop()
    check = check_loglikelihoods(model, tok, res["samples"]["pdecode_mc"])
    out = {"model": args.model, "dtype": args.dtype, "lm_eval": getattr(lm_eval, "__version__", "?"),
           "items": args.items, "batch_size": args.batch_size, "num_concurrent": args.num_concurrent, "wall_s": wall,
           "results": {t: {k: v for k, v in r.items() if isinstance(v, (int, float, str))}
                       for t, r in res["results"].items()},
           "generations": [s["resps"][0][0] for s in res["samples"]["pdecode_gen"]][:8], "check": check}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps(out, indent=1) + "\n")
    mc, gen = out["results"]["pdecode_mc"], out["results"]["pdecode_gen"]
    md = (f"lm-eval {out['lm_eval']} (local-completions, batch {args.batch_size}, {args.num_concurrent} concurrent) "
          f"against `pdecode serve --model {args.model} --dtype {args.dtype}`, {args.items} items per task, "
          f"{wall:.1f} s:\n\n"
          "| task | kind | metric | value |\n|---|---|---|---|\n"
          f"| pdecode_mc | loglikelihood (4 choices) | acc | {mc.get('acc,none', float('nan')):.3f} |\n"
          f"| pdecode_gen | generate_until | exact_match | {gen.get('exact_match,none', float('nan')):.3f} |\n\n"
          f"{check['loglikelihoods']} loglikelihoods against `pdecode.forward_logits` on the same tokens: max |diff| "
          f"{check['max_abs_diff']:.2e}, mean {check['mean_abs_diff']:.2e} (tolerance {TOLERANCE}: "
          f"{'all within' if check['within_tolerance'] else 'NOT all within'}).\n")
    (args.out / "results.md").write_text(md)
    print(md)
    return 0 if check["within_tolerance"] else 1


if __name__ == "__main__":
    sys.exit(main())
