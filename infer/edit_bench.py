"""Does edit refinement do harm? Token edit distance to the clean code before and after `pdecode.refine` with the
zoo's ``code-edit``, on validation windows (never trained on) at several corruption levels, per decision threshold.

    pdecode bench --suite edit                   # 64 windows: 32 tokens of context, the next 32 the clean text

Levels (`train.edit.corruption_levels`): ``clean`` (the clean text itself: refinement must leave it clean),
``typos`` (character-level slips on the decoded text, about one per 40 characters, re-tokenized: a swapped,
deleted or duplicated character, a doubled operator), ``light`` (token-level deletions, substitutions and
insertions at 0.05 each), ``train`` (`train.edit.corrupt` as in training), and ``oneshot`` (code-dllm's one-shot
fill of the 32 tokens: the drafts `generate(method="oneshot", refine="edit")` refines). Columns: the mean distance
before, after 4 iterations at each threshold (as `generate(refine="edit")` runs it), and after 1 iteration at the
shipped threshold. Harm (`train.edit.harm`): the paired-bootstrap 95% interval of the per-item change lies above
zero. The rule's threshold (`train.edit.choose_confidence`, what `python -m train.edit --calibrate` ships): the
smallest ``train`` distance among the thresholds that do no harm on ``clean``, ``typos`` and ``light``.

    pdecode bench --suite edit --reuse           # the same, reusing --out/results.json's per-item distances

Writes results.md / results.json under --out (default docs/bench/edit).
"""

from __future__ import annotations

import json
import re
import sys
import time
from pathlib import Path

CONTEXT, LENGTH = 32, 32


def measure(editor, n: int = 64, confidences=None, iterations: int = 4, seed: int = 0, oneshot: bool = True,
            log=None, cached: dict | None = None) -> dict:
    """Per level: per-item distances before / after each threshold / after one iteration at the shipped one.
    ``cached``: per-item distances of an earlier run on the same windows (results.json's "per_item"): only the
    missing ones are measured."""
    import pdecode
    from train import edit as tedit

    confidences = list(confidences or tedit.CONFIDENCES)
    tok = editor.tokenizer.backend
    contexts, golds = tedit.validation_windows(tok, n, CONTEXT, LENGTH)
    levels = tedit.corruption_levels(tok, golds, editor.cfg.vocab_size, seed)
    if oneshot:
        levels["oneshot"] = tedit.oneshot_drafts(editor, contexts, LENGTH)
    shipped = float(editor.extras["edit"][0].confidence)
    out = {}
    for name, drafts in levels.items():
        t0 = time.perf_counter()
        old = (cached or {}).get(name, {})
        d = {c: old[str(c)] for c in confidences if str(c) in old}
        d.update(tedit.distances(editor, contexts, golds, drafts, [c for c in confidences if c not in d],
                                 iterations))
        one = f"one_iteration@{shipped}"
        if one not in old:
            r = pdecode.refine(editor, contexts, drafts, max_iterations=1, confidence=shipped)
            old = {**old, one: [tedit.edit_distance(t, g) for t, g in zip(r.tokens, golds)]}
        d["one_iteration"] = old[one]
        out[name] = d
        if log:
            print(f"  {name}: {time.perf_counter() - t0:.0f}s", file=log, flush=True)
    return {"levels": out, "confidences": confidences, "shipped": shipped, "windows": n,
            "example": {"clean": tok.decode(golds[0]), **{k: tok.decode(v[0]) for k, v in levels.items()}}}


def summarize(m: dict) -> dict:
    import numpy as np

    from train import edit as tedit

    cs, lv = m["confidences"], m["levels"]
    rows = []
    for name, d in lv.items():
        row = {"level": name, "before": float(np.mean(d["before"])),
               "after": {str(c): float(np.mean(d[c])) for c in cs},
               "harm": {str(c): tedit.harm(d["before"], d[c]) for c in cs},
               "one_iteration_shipped": float(np.mean(d["one_iteration"])),
               "one_iteration_harm": tedit.harm(d["before"], d["one_iteration"])}
        rows.append(row)
    objective = {c: float(np.mean(lv["train"][c])) for c in cs}
    choice, _ = tedit.choose_confidence(objective, {k: lv[k] for k in tedit.GUARDS})
    return {"rows": rows, "rule_choice": choice}


def to_markdown(s: dict, meta: dict) -> str:
    from train import edit as tedit

    cs = meta["confidences"]
    lines = [f"# pdecode bench --suite edit ({meta['model']})", "",
             f"{meta['windows']} validation windows: {CONTEXT} tokens of context, the next {LENGTH} the clean text. "
             f"Mean token edit distance to the clean text before refinement, after {meta['iterations']} iterations "
             f"at each decision threshold, and after 1 iteration at the shipped threshold ({meta['shipped']}). "
             "`*`: harm (the paired-bootstrap 95% interval of the per-item change lies above zero).", "",
             "| level | before | " + " | ".join(str(c) for c in cs) + f" | 1 it. @ {meta['shipped']} |",
             "|---|---:|" + "---:|" * (len(cs) + 1)]
    for r in s["rows"]:
        cells = [f"{r['after'][str(c)]:.2f}{'*' if r['harm'][str(c)]['harms'] else ''}" for c in cs]
        one = f"{r['one_iteration_shipped']:.2f}{'*' if r['one_iteration_harm']['harms'] else ''}"
        lines.append(f"| {r['level']} | {r['before']:.2f} | " + " | ".join(cells) + f" | {one} |")
    lines += ["", "Items made worse / better (of %d) per threshold:" % meta["windows"], "",
              "| level | " + " | ".join(str(c) for c in cs) + " |", "|---|" + "---:|" * len(cs)]
    for r in s["rows"]:
        lines.append(f"| {r['level']} | " + " | ".join(f"{r['harm'][str(c)]['worse']} / {r['harm'][str(c)]['better']}"
                                                      for c in cs) + " |")
    lines += ["", f"Rule (`train.edit.choose_confidence`): the smallest `train` distance among thresholds doing no "
                  f"harm on {', '.join(tedit.GUARDS)}: **{s['rule_choice']}**.", "",
              f"Wall: {meta['wall_s']:.0f} s{' (with the earlier runs whose distances --reuse kept)' if meta['reused'] else ''}"
              f". Command: `{meta['command']}`.", ""]
    return "\n".join(lines)


def run(args) -> int:
    import pdecode

    out = args.out if args.out != Path("bench_out/latest") else Path("docs/bench/edit")
    editor = pdecode.load(args.model or "code-edit", dtype=args.dtype or "float32")
    t0 = time.perf_counter()
    cached, earlier_s = {}, 0.0
    if args.reuse and (out / "results.json").exists():
        saved = json.loads((out / "results.json").read_text())
        if saved["meta"]["windows"] == (args.prompts or 64):
            cached, earlier_s = saved["per_item"], float(saved["meta"]["wall_s"])
    m = measure(editor, n=args.prompts or 64, confidences=args.confidences, log=sys.stderr, cached=cached)
    s = summarize(m)
    meta = {"model": args.model or "code-edit", "windows": m["windows"], "confidences": m["confidences"],
            "shipped": m["shipped"], "iterations": 4, "wall_s": earlier_s + time.perf_counter() - t0,
            "command": "pdecode bench --suite edit" + (f" --prompts {args.prompts}" if args.prompts else ""),
            "example": m["example"], "reused": bool(cached)}
    out.mkdir(parents=True, exist_ok=True)
    per_item = {k: {str(c): v for c, v in d.items() if c != "one_iteration"} for k, d in m["levels"].items()}
    for k, d in m["levels"].items():
        per_item[k][f"one_iteration@{m['shipped']}"] = d["one_iteration"]
        for key, v in cached.get(k, {}).items():  # one-iteration rows at other thresholds, kept
            if key.startswith("one_iteration@"):
                per_item[k].setdefault(key, v)
    text = json.dumps({"meta": meta, **s, "per_item": per_item}, indent=1)
    text = re.sub(r"\[\s+([-\d.,\s]+?)\s+\]", lambda g: "[" + " ".join(g.group(1).split()) + "]", text)
    (out / "results.json").write_text(text + "\n")  # (per-item lists on one line each)
    md = to_markdown(s, meta)
    (out / "results.md").write_text(md)
    print(md)
    return 0
