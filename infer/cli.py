"""The ``pdecode`` command.

    pdecode generate --model code-target --prompt "def fib(n):" --max-new-tokens 64 [--method sd --draft code-draft]
    pdecode bench    --methods ar --batch 1 8 --peer transformers
    pdecode train    zoo [--only code-draft]
    pdecode convert  --src code-target --dst out/ --to orbax|hf
    pdecode zoo      (list the shipped models)

Bad input (missing checkpoint, unknown method, prompt too long, invalid sampling values) exits with status 2 and
one line on stderr saying what to fix.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def _parse_value(v: str):
    try:
        return json.loads(v)
    except json.JSONDecodeError:
        return v


def parse_options(items: list[str] | None) -> dict:
    out = {}
    for it in items or []:
        if "=" not in it:
            raise SystemExit(f"error: --option takes key=value, got {it!r}")
        k, v = it.split("=", 1)
        out[k.strip().replace("-", "_")] = _parse_value(v)
    return out


def _read_prompts(args) -> list[str]:
    prompts = list(args.prompt or [])
    for f in args.prompt_file or []:
        p = Path(f)
        if not p.is_file():
            raise SystemExit(f"error: prompt file {f} does not exist")
        prompts.append(p.read_text())
    if args.prompts_jsonl:
        p = Path(args.prompts_jsonl)
        if not p.is_file():
            raise SystemExit(f"error: prompts file {p} does not exist")
        for i, line in enumerate(p.read_text().splitlines()):
            if line.strip():
                try:
                    v = json.loads(line)
                except json.JSONDecodeError:
                    raise SystemExit(f"error: {p}:{i + 1} is not a JSON string") from None
                prompts.append(v if isinstance(v, str) else v["prompt"])
    if not prompts:
        raise SystemExit("error: give at least one --prompt, --prompt-file or --prompts-jsonl")
    return prompts


def cmd_generate(args) -> int:
    import pdecode

    from pdecode.decode import registry
    from pdecode.errors import InputError

    prompts = _read_prompts(args)
    pdecode.enable_disk_cache()  # a second run with the same shapes loads its executable instead of compiling
    if registry.get(args.method).needs_draft and not args.draft:
        raise InputError(f"method {args.method!r} needs a draft model: add --draft (a zoo name such as code-draft, "
                         "or a model directory)")
    m = pdecode.load(args.model, dtype=args.dtype, activation_dtype=args.activation_dtype)
    draft = pdecode.load(args.draft, dtype=args.dtype, activation_dtype=args.activation_dtype) if args.draft else None
    mesh = None
    if args.mesh:
        from pdecode.sharding import make_mesh

        d, mo = (int(x) for x in args.mesh.split("x"))
        mesh = make_mesh(d, mo)
    out = pdecode.generate(m, prompts, method=args.method, max_new_tokens=args.max_new_tokens,
                           temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed,
                           draft=draft, mesh=mesh, stop_at_eos=not args.ignore_eos, **parse_options(args.option))
    if args.json:
        for p, text, toks in zip(prompts, out.texts, out.tokens):
            print(json.dumps({"prompt": p, "text": text, "tokens": toks, "stats": out.stats}))
    else:
        for p, text in zip(prompts, out.texts):
            print(p + text)
            print("-" * 60)
        s = out.stats
        print(f"[{s['method']}] {s['new_tokens']} new tokens, {s['tokens_per_s']:.1f} tok/s, "
              f"{s['tokens_per_forward']:.2f} tokens/forward, {s['target_forwards']} target forwards, "
              f"compile {s['compile_s']:.2f}s", file=sys.stderr)
    if getattr(args, "plot", None) and "commit_step" in out.stats:
        from infer.plots import commit_order_plot

        commit_order_plot(out.stats["commit_step"], args.plot, title=f"{args.method}: step each position was decoded")
        print(f"wrote {args.plot}", file=sys.stderr)
    return 0


def cmd_convert(args) -> int:
    import pdecode
    from pdecode.checkpoint import orbax as orbax_ckpt

    m = pdecode.load(args.src)
    if args.to == "orbax":
        out = orbax_ckpt.save(m.cfg, m.params, args.dst, tokenizer_dir=m.path)
    else:
        out = pdecode.save_hf(m, args.dst, dtype=args.dtype)
    print(f"wrote {out}", file=sys.stderr)
    return 0


def cmd_zoo(args) -> int:
    import pdecode

    for name in pdecode.zoo_names():
        info_f = pdecode.zoo_dir() / name / "train_info.json"
        info = json.loads(info_f.read_text()) if info_f.exists() else {}
        extra = f"val_loss {info['val_loss']:.3f}" if "val_loss" in info else info.get("kind", "")
        print(f"{name:24s} {info.get('params', 0) / 1e6:6.2f}M params  {extra}")
    return 0


def cmd_train(args, rest: list[str]) -> int:
    if args.what == "heads":
        from train.heads import main as heads_main

        heads_main(rest)
        return 0
    from train.zoo import main as zoo_main

    zoo_main(rest)
    return 0


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="pdecode", description="Parallel text generation in JAX.")
    sub = ap.add_subparsers(dest="cmd", required=True)

    g = sub.add_parser("generate", help="generate text with a decoding method")
    g.add_argument("--model", default="code-target", help="zoo name or model directory (default: code-target)")
    g.add_argument("--draft", default=None, help="draft model for draft-and-verify methods")
    g.add_argument("--method", default="ar")
    g.add_argument("--prompt", action="append", help="a prompt (repeat for a batch)")
    g.add_argument("--prompt-file", action="append", help="a file whose whole text is one prompt (repeatable)")
    g.add_argument("--prompts-jsonl", help="one JSON string (or {\"prompt\": ...}) per line")
    g.add_argument("--max-new-tokens", type=int, default=64)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--seed", type=int, default=0)
    # the choices are pdecode.config.DTYPES, written out so building the parser does not import jax
    g.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"], help="params' dtype")
    g.add_argument("--activation-dtype", default=None, choices=["float32", "bfloat16", "float16"],
                   help="residual stream / attention dtype (default: --dtype); --dtype bfloat16 --activation-dtype "
                        "float32 is mixed precision (fastest at batch > 1 on CPU)")
    g.add_argument("--mesh", default=None, help="DATAxMODEL device mesh, e.g. 2x4")
    g.add_argument("--ignore-eos", action="store_true", help="always generate max-new-tokens")
    g.add_argument("-o", "--option", action="append", help="method option key=value (repeatable)")
    g.add_argument("--json", action="store_true", help="one JSON object per prompt with text and stats")
    g.add_argument("--plot", default=None, help="PNG of the step each position was decoded (diffusion methods)")

    b = sub.add_parser("bench", help="benchmark methods side by side (see infer/bench.py)")
    from infer.bench import add_arguments

    add_arguments(b)

    t = sub.add_parser("train", help="train the zoo models or heads", add_help=False)
    t.add_argument("what", choices=["zoo", "heads"],
                   help="zoo: the shipped LMs (`python -m train.zoo -h`); heads: Medusa/EAGLE/MTP heads and the "
                        "native MTP model (`python -m train.heads -h`)")

    c = sub.add_parser("convert", help="convert between HF safetensors and orbax")
    c.add_argument("--src", required=True, help="zoo name or model directory")
    c.add_argument("--dst", required=True)
    c.add_argument("--to", choices=["orbax", "hf"], required=True)
    c.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"])

    sub.add_parser("zoo", help="list the shipped models")
    return ap


def main(argv=None) -> int:
    from pdecode.errors import PdecodeError

    argv = sys.argv[1:] if argv is None else argv
    ap = build_parser()
    args, rest = ap.parse_known_args(argv)
    if rest and args.cmd != "train":
        ap.error(f"unrecognized arguments: {' '.join(rest)}")
    try:
        if args.cmd == "generate":
            return cmd_generate(args)
        if args.cmd == "bench":
            from infer.bench import run_from_args

            return run_from_args(args)
        if args.cmd == "train":
            return cmd_train(args, rest)
        if args.cmd == "convert":
            return cmd_convert(args)
        if args.cmd == "zoo":
            return cmd_zoo(args)
    except PdecodeError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 1


if __name__ == "__main__":
    sys.exit(main())
