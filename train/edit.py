"""The zoo's edit model ``code-edit``: Levenshtein-style edit heads (`pdecode.model.heads.EditConfig`) on the frozen
masked model ``code-dllm``, trained by imitating edit-distance expert actions on corrupted code.

    python -m train.edit                     # the shipped heads (zoo/code-edit, base code-dllm)
    python -m train.edit --calibrate         # only re-choose their decision threshold (validation windows)

A training item is a corpus window cut into a context (16-64 tokens) and a gold continuation (16-64 tokens, then
EOS), and a corrupted continuation: either the gold one with random deletions, insertions and substitutions (each
at a rate drawn per item from [0, 0.25]), or code-dllm's own one-shot fill of the gold length (the errors the edit
model is meant to fix). The expert (`expert_actions`) aligns the corrupted text with the gold one by their longest
common subsequence — the fewest deletions plus insertions: a substitution is a deletion and an insertion, the two
actions the model has — and gives the labels of both passes:

* **delete**: every corrupted token outside the alignment;
* **insert**: for each neighbour pair of the kept tokens (from the last context token to EOS), how many gold
  tokens go between them (at most ``max_insert``: a longer gap is filled over several iterations).

The loss is the cross-entropy of both heads on those labels (the base is frozen: its masked predictions fill the
placeholders). Evaluation: the heads' accuracy on held-out items (delete, insert) and the edit distance to the
gold continuation before and after one refinement iteration. The decision threshold the heads ship with
(``confidence``: how sure a head must be to edit) is chosen by `choose_confidence`: among the thresholds of
`CONFIDENCES` that do no harm (`harm`: no paired-bootstrap-significant rise of the edit distance to the clean text)
on clean, typo-corrupted and lightly corrupted validation windows (`corruption_levels`), the one with the
smallest edit distance after refinement of the same windows corrupted as in training (issue 27: at the argmax
threshold 0.5 the heads damaged clean code; the higher thresholds up to 0.99 are there for the heads to abstain).
`pdecode bench --suite edit` (infer/edit_bench.py) measures the same rule on every corruption level.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax

from pdecode.cli_args import ArgumentParser
from pdecode.model.attention import padded_self_mask
from pdecode.model.heads import EditConfig, edit_delete_logits, edit_insert_logits
from pdecode.model.transformer import forward, init_from_specs
from train.loop import TrainConfig, train

NAME = "code-edit"
BASE = "code-dllm"


# ------------------------------------------------------------------------------------------------ the expert
def lcs_table(a: list[int], b: list[int]) -> np.ndarray:
    """[len(a) + 1, len(b) + 1] LCS lengths of suffixes: t[i, j] = LCS(a[i:], b[j:])."""
    n, m = len(a), len(b)
    t = np.zeros((n + 1, m + 1), np.int32)
    bb = np.asarray(b)
    for i in range(n - 1, -1, -1):
        eq = (bb == a[i]).astype(np.int32)
        diag = t[i + 1, 1:] + eq
        row = np.maximum(diag, t[i + 1, :-1])
        # t[i, j] = max(t[i + 1, j], t[i, j + 1], t[i + 1, j + 1] + eq): the left-to-right dependency as a
        # running max from the right
        t[i, :-1] = np.maximum.accumulate(np.maximum(row, t[i + 1, :-1])[::-1])[::-1]
    return t


def expert_actions(src: list[int], tgt: list[int]) -> tuple[np.ndarray, list[list[int]]]:
    """The fewest deletions + insertions turning ``src`` into ``tgt`` (a longest common subsequence kept): (keep
    [len(src)] bool, gaps: m + 1 lists of the tgt tokens to insert before the first kept token, between kept
    tokens, and after the last)."""
    t = lcs_table(src, tgt)
    keep = np.zeros(len(src), bool)
    gaps: list[list[int]] = [[]]
    i = j = 0
    while i < len(src) and j < len(tgt):
        if src[i] == tgt[j] and t[i, j] == t[i + 1, j + 1] + 1:
            keep[i] = True
            gaps.append([])
            i, j = i + 1, j + 1
        elif t[i + 1, j] >= t[i, j + 1]:
            i += 1  # delete src[i]
        else:
            gaps[-1].append(tgt[j])  # insert tgt[j]
            j += 1
    gaps[-1].extend(tgt[j:])
    return keep, gaps


def apply_actions(src: list[int], keep, gaps) -> list[int]:
    out = list(gaps[0])
    for tok, g in zip([s for s, k in zip(src, keep) if k], gaps[1:]):
        out += [tok] + list(g)
    return out


# ------------------------------------------------------------------------------------------------ items
def corrupt(gold: list[int], rng: np.random.Generator, vocab: int, special: int = 3,
            rates: tuple[float, float, float] | None = None) -> list[int]:
    """Random deletions, substitutions and insertions, each at a rate drawn from [0, 0.25] (the training
    distribution), or at the given ``rates`` (deletion, substitution, insertion)."""
    p_del, p_sub, p_ins = rng.uniform(0, 0.25, size=3) if rates is None else rates
    out = []
    for tok in gold:
        u = rng.random()
        if u < p_del:
            pass
        elif u < p_del + p_sub:
            out.append(int(rng.integers(special, vocab)))
        else:
            out.append(tok)
        while rng.random() < p_ins:
            out.append(int(rng.integers(special, vocab)))
    return out


@dataclasses.dataclass
class Items:
    """Padded arrays of both passes' inputs and labels (-1: no label)."""

    x_del: np.ndarray  # [N, S] context + corrupted + EOS
    len_del: np.ndarray
    y_del: np.ndarray  # [N, S] 1 delete, 0 keep
    x_ins: np.ndarray  # [N, S] context + kept + EOS
    len_ins: np.ndarray
    y_ins: np.ndarray  # [N, S] gap size after position t (clipped to max_insert)
    gold: list
    corrupted: list
    context: list


def make_items(contexts, golds, corrupted, s: int, eos: int, pad: int, max_insert: int) -> Items:
    n = len(golds)
    x_del = np.full((n, s), pad, np.int32)
    y_del = np.full((n, s), -1, np.int32)
    x_ins = np.full((n, s), pad, np.int32)
    y_ins = np.full((n, s), -1, np.int32)
    len_del = np.zeros(n, np.int32)
    len_ins = np.zeros(n, np.int32)
    for i, (c, g, d) in enumerate(zip(contexts, golds, corrupted)):
        keep, gaps = expert_actions(d, g)
        seq = c + d + [eos]
        x_del[i, : len(seq)] = seq
        len_del[i] = len(seq)
        y_del[i, len(c): len(c) + len(d)] = (~keep).astype(np.int32)
        kept = [t for t, k in zip(d, keep) if k]
        seq = c + kept + [eos]
        x_ins[i, : len(seq)] = seq
        len_ins[i] = len(seq)
        y_ins[i, len(c) - 1: len(c) + len(kept)] = np.minimum([len(gg) for gg in gaps], max_insert)
    return Items(x_del, len_del, y_del, x_ins, len_ins, y_ins, golds, corrupted, contexts)


def one_shot_fills(model, contexts, lengths, batch: int = 64) -> list[list[int]]:
    """code-dllm's own one-shot fill of each context, at the gold length (one forward per batch)."""
    import pdecode

    out = []
    for i in range(0, len(contexts), batch):
        cs, ls = contexts[i: i + batch], lengths[i: i + batch]
        g = max(ls)
        o = pdecode.generate(model, cs, method="oneshot", length="full", beams=1, max_new_tokens=g)
        out += [t[:n] for t, n in zip(o.tokens, ls)]
    return out


def build(stream: np.ndarray, n: int, model, rng: np.random.Generator, s: int, ecfg: EditConfig,
          model_fraction: float = 0.5) -> Items:
    eos = int(model.cfg.eos_token_ids[0])
    pad = model.cfg.pad_token_id if model.cfg.pad_token_id is not None else 1
    starts = rng.integers(0, len(stream) - 130, size=n)
    contexts, golds = [], []
    for st in starts:
        p, t = int(rng.integers(16, 65)), int(rng.integers(16, 65))
        contexts.append(stream[st: st + p].tolist())
        golds.append(stream[st + p: st + p + t].tolist())
    use_model = rng.random(n) < model_fraction
    idx = np.nonzero(use_model)[0].tolist()
    fills = one_shot_fills(model, [contexts[i] for i in idx], [len(golds[i]) for i in idx]) if idx else []
    corrupted = [corrupt(g, rng, model.cfg.vocab_size) for g in golds]
    for i, f in zip(idx, fills):
        corrupted[i] = [t for t in f if t != eos]
    return make_items(contexts, golds, corrupted, s, eos, pad, ecfg.max_insert)


# ------------------------------------------------------------------------------------------------ objective
def edit_loss(cfg, ecfg: EditConfig):
    """Cross-entropy of the delete and insert heads on the expert's labels; ``frozen``: the base model's params.
    ``batch`` = (x_del, len_del, y_del, x_ins, len_ins, y_ins)."""
    def hidden(base, x, length):
        b, s = x.shape
        pos = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (b, s))
        return jax.lax.stop_gradient(forward(base, cfg, x, pos, padded_self_mask(length, s, causal=False)).hidden)

    def ce(logits, y):
        w = (y >= 0).astype(jnp.float32)
        losses = optax.softmax_cross_entropy_with_integer_labels(logits, jnp.maximum(y, 0))
        acc = (jnp.argmax(logits, -1) == y).astype(jnp.float32)
        n = jnp.maximum(jnp.sum(w), 1.0)
        return jnp.sum(losses * w) / n, jnp.sum(acc * w) / n

    def loss(ep, base, batch, rng):
        del rng
        x_del, len_del, y_del, x_ins, len_ins, y_ins = batch
        l_del, a_del = ce(edit_delete_logits(ep, hidden(base, x_del, len_del)), y_del)
        l_ins, a_ins = ce(edit_insert_logits(ep, hidden(base, x_ins, len_ins)), y_ins)
        return l_del + l_ins, {"delete_acc": a_del, "insert_acc": a_ins}

    return loss


def edit_distance(a, b) -> int:
    return len(a) + len(b) - 2 * int(lcs_table(a, b)[0, 0])


CONFIDENCES = (0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 0.97, 0.99)  # the decision thresholds calibration chooses among


# ------------------------------------------------------------------------------------------------ no harm
OPERATORS = "+-*/%=<>&|^~!:."


def typos(text: str, rng: np.random.Generator, per_chars: int = 40) -> str:
    """Character-level slips, about one per ``per_chars`` characters (at least one): a swap of two neighbouring
    characters, a deleted or duplicated character, or a doubled operator (``a + + b``), never in whitespace."""
    chars = list(text)
    n = max(1, int(rng.binomial(len(chars), 1.0 / per_chars))) if chars else 0
    for _ in range(n):
        spots = [i for i, ch in enumerate(chars) if not ch.isspace()]
        if not spots:
            break
        ops = [i for i in spots if chars[i] in OPERATORS]
        kind = int(rng.integers(4))
        if kind == 3 and ops:  # a doubled operator, spaced as written around it
            i = ops[int(rng.integers(len(ops)))]
            sep = " " if i + 1 < len(chars) and chars[i + 1] == " " else ""
            chars[i + 1: i + 1] = list(sep + chars[i])
            continue
        i = spots[int(rng.integers(len(spots)))]
        if kind == 0 and i + 1 < len(chars) and not chars[i + 1].isspace():
            chars[i], chars[i + 1] = chars[i + 1], chars[i]
        elif kind == 1:
            del chars[i]
        else:
            chars.insert(i, chars[i])
    return "".join(chars)


LIGHT_RATES = (0.05, 0.05, 0.05)  # token-level deletion, substitution, insertion rates of the "light" level
GUARDS = ("clean", "typos", "light")  # the levels on which the shipped threshold must do no harm


def corruption_levels(tok, golds: list[list[int]], vocab: int, seed: int = 0) -> dict[str, list[list[int]]]:
    """The drafts the no-harm measurement refines, per level: ``clean`` (the gold text itself: it must stay
    clean), ``typos`` (`typos` on the decoded text, re-tokenized), ``light`` (`corrupt` at `LIGHT_RATES`) and
    ``train`` (`corrupt` as in training). ``tok``: a ``tokenizers.Tokenizer``."""
    r_typo, r_light, r_train = (np.random.default_rng([seed, k]) for k in range(3))
    return {
        "clean": [list(g) for g in golds],
        "typos": [tok.encode(typos(tok.decode(g), r_typo), add_special_tokens=False).ids for g in golds],
        "light": [corrupt(g, r_light, vocab, rates=LIGHT_RATES) for g in golds],
        "train": [corrupt(g, r_train, vocab) for g in golds],
    }


def validation_windows(tok, n: int = 64, context: int = 32, length: int = 32) -> tuple[list, list]:
    """(contexts, golds): ``n`` windows of validation code (never trained on), each ``context`` tokens kept as
    context and the next ``length`` tokens the clean text; several non-overlapping windows per file (offsets 0,
    context + length, ...) when the files with one are too few."""
    from train.data import validation_prompts

    w, out, off = context + length, [], 0
    while len(out) < n:
        got = validation_prompts(tok, n - len(out), w, offset_tokens=off)
        if not got:
            break
        out += got
        off += w
    if len(out) < n:
        raise ValueError(f"only {len(out)} validation windows of {w} tokens")
    return [x[:context] for x in out], [x[context:] for x in out]


def distances(editor, contexts, golds, drafts, confidences, iterations: int = 4) -> dict:
    """Per-item token edit distances to ``golds``: "before" (the drafts), and after refinement at each threshold
    (`pdecode.refine`, ``iterations`` as `generate(refine="edit")` runs it)."""
    import pdecode

    out = {"before": [edit_distance(d, g) for d, g in zip(drafts, golds)]}
    for c in confidences:
        r = pdecode.refine(editor, contexts, drafts, max_iterations=iterations, confidence=c)
        out[c] = [edit_distance(t, g) for t, g in zip(r.tokens, golds)]
    return out


def harm(before, after, resamples: int = 2000, seed: int = 0) -> dict:
    """Paired comparison of per-item distances after vs before: mean change, its 95% paired-bootstrap interval,
    items made worse / better. ``harms``: the interval lies above zero (worse beyond resampling noise); on clean
    text (before all zero) that is more than one or two items damaged out of 64."""
    d = np.asarray(after, np.float64) - np.asarray(before, np.float64)
    idx = np.random.default_rng(seed).integers(0, len(d), size=(resamples, len(d)))
    lo, hi = np.percentile(d[idx].mean(axis=1), [2.5, 97.5])
    return {"mean_change": float(d.mean()), "ci95": [float(lo), float(hi)], "worse": int((d > 0).sum()),
            "better": int((d < 0).sum()), "harms": bool(lo > 0)}


def choose_confidence(objective: dict, guards: dict) -> tuple[float | None, dict]:
    """The shipped-threshold rule: among the thresholds of ``objective`` (threshold -> mean edit distance after
    refinement on the training distribution) that do no harm (`harm`) on any guard (name -> per-item distances,
    "before" and per threshold: clean and lightly corrupted validation windows), the one with the smallest
    objective (ties: the higher threshold). None if every threshold harms. Also returns the harm verdicts."""
    verdicts = {c: {name: harm(g["before"], g[c]) for name, g in guards.items()} for c in objective}
    ok = [c for c in objective if not any(v["harms"] for v in verdicts[c].values())]
    best = min(ok, key=lambda c: (objective[c], -c)) if ok else None
    return best, verdicts


CALIBRATION_RULE = ("the threshold with the smallest mean edit distance to the clean text after refinement (4 "
                    "iterations) of training-distribution corruptions (corrupt) of 64 validation windows, among "
                    "those doing no harm (paired-bootstrap 95% interval of the per-item change not above zero) on "
                    "the same windows clean, with character typos and with light token-level corruption "
                    "(corruption_levels)")


def calibrate(editor, tok, iterations: int = 4, windows: int = 64) -> tuple[float, dict]:
    """The decision threshold (`EditConfig.confidence`) by `choose_confidence` over `CONFIDENCES`: the smallest mean
    edit distance to the clean text after refinement (as `generate(refine="edit")` runs it) of ``windows``
    validation windows corrupted as in training, among the thresholds that do no harm on the same windows clean,
    with typos and lightly corrupted (`GUARDS`, `corruption_levels`; the measurement `pdecode bench --suite edit`
    repeats, with one more level). If
    every threshold harms, the highest (the most abstaining) is returned and the table says so. ``tok``: a
    ``tokenizers.Tokenizer``. Returns it and the table (per threshold: the objective and the guards' verdicts)."""
    wc, wg = validation_windows(tok, windows)
    levels = corruption_levels(tok, wg, editor.cfg.vocab_size)
    d = {k: distances(editor, wc, wg, levels[k], CONFIDENCES, iterations) for k in ("train",) + GUARDS}
    objective = {c: float(np.mean(d["train"][c])) for c in CONFIDENCES}
    best, verdicts = choose_confidence(objective, {k: d[k] for k in GUARDS})
    table: dict = {"rule": CALIBRATION_RULE, "train_before": float(np.mean(d["train"]["before"])),
                   "train_after": {str(c): v for c, v in objective.items()},
                   "no_harm": {str(c): {k: {"after": float(np.mean(d[k][c])), **v} for k, v in verdicts[c].items()}
                               for c in CONFIDENCES},
                   "every_threshold_harms": best is None}
    return (best if best is not None else max(CONFIDENCES)), table


def oneshot_drafts(editor, contexts, length: int) -> list[list[int]]:
    """The editor's base model's one-shot fills of ``contexts`` (``length`` tokens, EOS dropped): the drafts
    `generate(method="oneshot", refine="edit")` refines."""
    import pdecode

    fills = pdecode.generate(editor, contexts, method="oneshot", length="full", beams=1,
                             max_new_tokens=length).tokens
    eos = set(editor.cfg.eos_token_ids)
    return [[t for t in f[:length] if t not in eos] for f in fills]


def calibrate_draft(editor, tok, iterations: int = 4, windows: int = 64) -> tuple[float, dict]:
    """`EditConfig.draft_confidence`: the threshold of `CONFIDENCES` with the smallest mean edit distance to the clean
    text after refining code-dllm's own one-shot fills of ``windows`` validation windows (the drafts
    `generate(method="oneshot", refine="edit")` refines). Returns it and the table (per threshold)."""
    wc, wg = validation_windows(tok, windows)
    drafts = oneshot_drafts(editor, wc, len(wg[0]))
    d = distances(editor, wc, wg, drafts, CONFIDENCES, iterations)
    table = {"before": float(np.mean(d["before"])), **{str(c): float(np.mean(d[c])) for c in CONFIDENCES}}
    return min(CONFIDENCES, key=lambda c: table[str(c)]), table


# ------------------------------------------------------------------------------------------------ main
def main(argv=None) -> int:
    ap = ArgumentParser(prog="python -m train.edit", description=__doc__,
                        formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--zoo", type=Path, default=Path(__file__).resolve().parent.parent / "zoo")
    ap.add_argument("--work", type=Path, default=Path("/tmp/pdecode-train"))
    ap.add_argument("--steps", type=int, default=1500)
    ap.add_argument("--items", type=int, default=6000, help="training items built before training")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--calibrate", action="store_true",
                    help="only choose the shipped heads' decision threshold on validation windows (no training)")
    args = ap.parse_args(argv)

    import ml_dtypes

    import pdecode
    from pdecode.checkpoint.heads_io import save_heads
    from train.zoo import ensure_tokenizer, token_streams

    t_start = time.perf_counter()
    model = pdecode.load(args.zoo / BASE, dtype="float32")
    tok = ensure_tokenizer(args.zoo)
    tr, va = token_streams(tok, args.work / "data")
    ecfg = EditConfig()
    s = 192
    rng = np.random.default_rng(0)
    out = args.zoo / NAME
    if args.calibrate:
        editor = pdecode.load(out, dtype="float32")
        ecfg, ep = editor.extras["edit"]
        best, table = calibrate(editor, tok)
        best_draft, table_draft = calibrate_draft(editor, tok)
        ecfg = dataclasses.replace(ecfg, confidence=best, draft_confidence=best_draft)
        meta = json.loads((out / "heads.json").read_text())  # the weights (heads.safetensors.xz) stay as they are
        meta["config"] = dataclasses.asdict(ecfg)
        (out / "heads.json").write_text(json.dumps(meta, indent=1) + "\n")
        info = json.loads((out / "train_info.json").read_text())
        info.update(confidence=best, calibration_edit_distance=table, draft_confidence=best_draft,
                    draft_calibration_edit_distance=table_draft, config=dataclasses.asdict(ecfg))
        (out / "train_info.json").write_text(json.dumps(info, indent=1) + "\n")
        print(f"{NAME}: confidence {best} (edit distance after refinement per threshold: {table['train_after']}; "
              f"before {table['train_before']:.2f}; harm: "
              f"{ {c: [k for k, v in g.items() if v['harms']] for c, g in table['no_harm'].items()} })",
              file=sys.stderr)
        return 0
    print(f"{NAME}: building {args.items} training items (expert actions, one-shot fills) ...", file=sys.stderr,
          flush=True)
    items = build(tr, args.items, model, rng, s, ecfg)
    held = build(va, 256, model, np.random.default_rng(1), s, ecfg)
    t_data = time.perf_counter() - t_start
    arrays = (items.x_del, items.len_del, items.y_del, items.x_ins, items.len_ins, items.y_ins)

    def batch_fn(i):
        idx = np.random.default_rng([7, i]).integers(0, len(items.gold), size=args.batch)
        return tuple(a[idx] for a in arrays)

    loss = edit_loss(model.cfg, ecfg)
    held_arrays = tuple(jnp.asarray(a) for a in (held.x_del, held.len_del, held.y_del, held.x_ins, held.len_ins,
                                                 held.y_ins))
    held_fn = jax.jit(lambda ep, base: loss(ep, base, held_arrays, None))

    def eval_fn(ep):
        val, aux = held_fn(ep, model.params)
        return {"val_loss": float(val), "delete_acc": float(aux["delete_acc"]), "insert_acc": float(aux["insert_acc"])}

    tc = TrainConfig(steps=args.steps, lr=3e-3, warmup=50, eval_every=250, ckpt_every=10**9, log_every=100)
    ep0 = init_from_specs(ecfg.specs(model.cfg), jax.random.PRNGKey(0))
    before = eval_fn(ep0)
    t0 = time.perf_counter()
    ep, hist = train(loss, ep0, model.params, batch_fn, tc, eval_fn=eval_fn, desc=NAME)
    t_train = time.perf_counter() - t0
    save_heads(out, "edit", ecfg, jax.device_get(ep), base_model=BASE, dtype=ml_dtypes.bfloat16, compress=True)
    # one refinement on held-out corrupted items: edit distance to the gold continuation before and after
    editor = pdecode.load(out, dtype="float32")
    best, table = calibrate(editor, tok)  # the shipped decision thresholds: repairing text, refining drafts
    best_draft, table_draft = calibrate_draft(editor, tok)
    ecfg = dataclasses.replace(ecfg, confidence=best, draft_confidence=best_draft)
    save_heads(out, "edit", ecfg, jax.device_get(ep), base_model=BASE, dtype=ml_dtypes.bfloat16, compress=True)
    editor = pdecode.load(out, dtype="float32")
    r = pdecode.refine(editor, held.context[:128], held.corrupted[:128], max_iterations=1)
    dist_before = float(np.mean([edit_distance(d, g) for d, g in zip(held.corrupted[:128], held.gold[:128])]))
    dist_after = float(np.mean([edit_distance(t, g) for t, g in zip(r.tokens, held.gold[:128])]))
    info = {"name": NAME, "command": "python -m train.edit", "base_model": BASE, "config": dataclasses.asdict(ecfg),
            "params": int(sum(np.prod(a.shape) for a in jax.tree.leaves(ep))), "steps": args.steps,
            "items": args.items, "confidence": best, "calibration_edit_distance": table,
            "draft_confidence": best_draft, "draft_calibration_edit_distance": table_draft, "eval_before": before, "final_eval": hist["eval"][-1] if hist["eval"] else None,
            "heldout_edit_distance_before_after_one_iteration": [dist_before, dist_after],
            "data_minutes": round(t_data / 60, 2), "train_minutes": round(t_train / 60, 2),
            "total_minutes": round((time.perf_counter() - t_start) / 60, 2),
            "loss_curve": {"step": hist["step"], "loss": hist["loss"]}}
    (out / "train_info.json").write_text(json.dumps(info, indent=1) + "\n")
    print(f"{NAME}: {info['final_eval']}; held-out edit distance {dist_before:.1f} -> {dist_after:.1f} after one "
          f"iteration; {info['total_minutes']} min -> {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
