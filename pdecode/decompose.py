"""Decomposition-and-fill: split a task into independent points and fill them in parallel, as one batch over one
prefilled prefix, with any decoding method inside.

    out = pdecode.decompose(model, prompt, planner="stubs", method="ar", max_new_tokens=96)
    out.prefix, out.points, out.fills, out.text, out.stats

A planner turns the prompt into ``prefix`` (the text every point sees), ``points`` (each point's own text after the
prefix) and a joiner (how the filled points make the answer). Every row of the fill batch is ``prefix + point``;
the tokens the rows share are prefilled once, as one row, and that row's KV cache is given to every row
(`pdecode.generate(..., shared_prefix=N)`); each row then runs only its own point and continues with the inner
method. A per-point stop rule ends each fill (a function body at the first line back at column 0; a line at its
newline, which also ends the row on the device); rows finish independently.

Planners: ``"stubs"`` (a header, then independent function stubs: one point per stub, the header is the prefix),
``"lines"`` (one sub-task per line of the prompt's last block of lines), ``"skeleton"`` (the model writes a skeleton
first, then every point is filled: a chat model, one whose tokenizer has a chat template, writes numbered short
points through it (Skeleton-of-Thought, our own instructions `SKELETON_INSTRUCTION` / `POINT_INSTRUCTION`); a code
model writes an outline of signature lines with one-line docstrings), or a callable ``prompt -> (prefix, points,
joiner)``. The router (on by default) falls back when decomposing is not worth it or not sound: fewer than two
points (plain generation), or stubs that refer to each other (filled one after another, each seeing the bodies
before it); the decision and its reason are in ``stats["decision"]``.
"""

from __future__ import annotations

import dataclasses
import re
import time
from typing import Any, Callable, Sequence

from pdecode import generation
from pdecode.errors import InputError

PLANNERS = ("stubs", "lines", "skeleton")

_TOP = re.compile(r"^(async\s+def|def|class)\s+([A-Za-z_]\w*)")


@dataclasses.dataclass
class Plan:
    """What a planner returns: the shared ``prefix``, the ``points`` (each point's text after the prefix), how the
    fills are joined into the answer, and the stop rule of a fill (``"body"``, ``"line"`` or ``"none"``)."""

    prefix: str
    points: list[str]
    joiner: Callable[[list[str], list[str]], str] | str = "\n"
    stop: str = "none"
    names: list[str] = dataclasses.field(default_factory=list)  # stubs: each point's function / class name
    plain: str | None = None  # the text plain generation runs (the router's fallback), if not the prompt
    special_tokens: bool = True  # rows are encoded with the tokenizer's special tokens (not for rendered chat text)


@dataclasses.dataclass
class DecomposeOutput:
    prefix: str
    points: list[str]
    fills: list[str]
    fill_tokens: list[list[int]]
    text: str
    stats: dict[str, Any]


# ------------------------------------------------------------------------------------------------ planners
def plan_stubs(prompt: str) -> Plan:
    """A header (imports, constants, helpers before the first stub) and top-level stubs: each stub is a ``def`` /
    ``class`` line (with its decorators) and whatever follows it up to the next top-level line (a docstring; nested
    defs stay inside their stub). The header is the prefix; each point is a stub up to its last character (the fill
    then starts with the newline and indentation of the body, which is how a model continues a docstring); each
    fill is the body; the answer is the header and the stubs with their bodies, in order."""
    lines = prompt.splitlines(keepends=True)
    starts, names = [], []
    i = 0
    while i < len(lines):
        m = _TOP.match(lines[i])
        if m:
            j = i
            while j > 0 and lines[j - 1].startswith("@"):  # decorators belong to their stub
                j -= 1
            starts.append(j)
            names.append(m.group(2))
        i += 1
    if not starts:
        return Plan(prompt, [], stop="body")
    prefix = "".join(lines[: starts[0]])
    points = []
    for k, a in enumerate(starts):
        b = starts[k + 1] if k + 1 < len(starts) else len(lines)
        points.append("".join(lines[a:b]).rstrip())  # the fill starts on the stub's last line ("\n    ...")

    def join(points, fills):
        return prefix + "\n\n\n".join(p + f.rstrip() for p, f in zip(points, fills)) + "\n"

    return Plan(prefix, points, join, stop="body", names=names)


def plan_lines(prompt: str) -> Plan:
    """One point per line of the prompt's last block of consecutive non-empty lines (e.g. ``assert f(2) == `` lines,
    or a numbered list of questions); what comes before that block is the prefix. Each fill continues its line to
    the end of the line."""
    lines = prompt.splitlines(keepends=True)
    end = len(lines)
    while end and not lines[end - 1].strip():
        end -= 1
    start = end
    while start and lines[start - 1].strip():
        start -= 1
    prefix = "".join(lines[:start])
    points = [ln.rstrip("\n") for ln in lines[start:end]]

    def join(points, fills):
        return prefix + "".join(p + f.split("\n", 1)[0] + "\n" for p, f in zip(points, fills))

    return Plan(prefix, points, join, stop="line")


def cut_outline(text: str) -> str:
    """The outline a code model wrote: top-level ``def`` / ``class`` lines, each with at most a one-line docstring
    under it, and blank lines; cut at the first other line (the first body line)."""
    out, after_sig = [], False
    for ln in text.splitlines(keepends=True):
        s = ln.strip()
        if not s:
            out.append(ln)
            continue
        if _TOP.match(ln) and s.endswith(":"):
            out.append(ln)
            after_sig = True
            continue
        one_line_doc = ln[:1].isspace() and len(s) >= 6 and s[:3] in ('"""', "'''") and s.endswith(s[:3])
        if after_sig and one_line_doc:
            out.append(ln)
            after_sig = False
            continue
        break
    return "".join(out)


def plan_skeleton(model, prompt: str, outline_tokens: int = 128, **generate_options) -> tuple[Plan, dict]:
    """Answer-structure planning: the model writes a skeleton first (greedy, up to ``outline_tokens``), then every
    point is filled. A tokenizer with a chat template gets the chat skeleton (`plan_chat_skeleton`); a code model
    continues ``prompt`` with an outline, cut at its first body line (`cut_outline`), whose stubs are the points and
    ``prompt`` the prefix. Returns (plan, the skeleton generation's stats)."""
    from pdecode import api

    if getattr(model.tokenizer, "chat_template", None):
        return plan_chat_skeleton(model, prompt, outline_tokens, **generate_options)
    opts = {k: v for k, v in generate_options.items() if k in ("mesh", "cache_dtype")}
    # in chunks: the outline ends at its first body line, usually long before outline_tokens
    text, forwards, wall, left = "", 0, 0.0, outline_tokens
    while left > 0:
        n = min(OUTLINE_CHUNK, left)
        out = api.generate(model, [prompt + text], max_new_tokens=n, **opts)
        text += out.texts[0]
        forwards, wall, left = forwards + out.stats["target_forwards"], wall + out.stats["wall_s"], left - n
        if len(cut_outline(text)) < len(text.rstrip()) or len(out.tokens[0]) < n:
            break  # a body line (or EOS) came
    outline = cut_outline(text)
    stubs = plan_stubs(outline)
    plan = Plan(prompt, stubs.points, lambda points, fills: prompt + "\n\n\n".join(
        p + f.rstrip() for p, f in zip(points, fills)) + "\n", stop="body", names=stubs.names)
    return plan, {"outline": outline, "skeleton": "code", "forwards": forwards, "s": wall}


OUTLINE_CHUNK = 32  # new tokens per outline call


# the chat skeleton's two prompts (ours): the skeleton request, then one expansion request per point whose
# point-specific part comes last, so the rows share the conversation up to it
SKELETON_INSTRUCTION = (
    "You are planning an answer, not writing it. Give only the skeleton of the answer to the question below: a "
    "numbered list of 3 to 8 points, one per line, each point 3 to 7 words. No details and no other text.\n\n"
    "Question: {question}")
POINT_INSTRUCTION = (
    "Question: {question}\n\nThe skeleton of the answer:\n{skeleton}\n\nWrite point {i} of the answer in one "
    "or two sentences, continuing from its words, and only that point.")
_NUMBERED = re.compile(r"^\s*(\d+)\s*[.)]\s*(.*?)\s*$")


def parse_points(text: str, max_points: int = 16) -> list[str]:
    """The numbered points of a skeleton (``1. ...`` or ``1) ...``, one per line), in order: lines before the first
    point are skipped; the list ends at a number out of sequence (a repeated number: the model started over), an
    empty or repeated point, a non-numbered line after the points, or ``max_points``."""
    points: list[str] = []
    for ln in text.splitlines():
        m = _NUMBERED.match(ln)
        if not m:
            if points and ln.strip():
                break
            continue
        n, body = int(m.group(1)), m.group(2)
        if n != len(points) + 1 or not body or body in points or len(points) == max_points:
            break
        points.append(body)
    return points


def chat_points_plan(tok, question: str, points: Sequence[str]) -> Plan:
    """The fill plan of a chat skeleton: one expansion request per point, rendered through the chat template, each
    answer started with the point's own words (``i. point``); the answer is the points with their expansions."""
    from pdecode import chat

    skeleton = "\n".join(f"{i}. {p}" for i, p in enumerate(points, 1))
    rows = [chat.render(tok, [{"role": "user", "content": POINT_INSTRUCTION.format(
        question=question, skeleton=skeleton, i=i)}]) + f"{i}. {p}" for i, p in enumerate(points, 1)]
    n = len(rows[0])
    for r in rows[1:]:
        n = next((j for j, (a, b) in enumerate(zip(rows[0][:n], r)) if a != b), min(n, len(r)))
    prefix = rows[0][:n]

    def join(pts, fills):
        return "\n".join(f"{i}. {p}{cut_line(f).rstrip()}" for i, (p, f) in enumerate(zip(points, fills), 1))

    plain = chat.render(tok, [{"role": "user", "content": question}])
    return Plan(prefix, [r[n:] for r in rows], join, stop="line", plain=plain, special_tokens=False)


def plan_chat_skeleton(model, question: str, outline_tokens: int = 128, **generate_options) -> tuple[Plan, dict]:
    """Skeleton-of-Thought for chat models: the skeleton request (`SKELETON_INSTRUCTION`) through the tokenizer's
    chat template, the answer started with ``1.``; its numbered points (`parse_points`) are filled in parallel
    (`chat_points_plan`). Returns (plan, the skeleton generation's stats)."""
    from pdecode import api, chat

    tok = model.tokenizer
    opts = {k: v for k, v in generate_options.items() if k in ("mesh", "cache_dtype")}
    text = chat.render(tok, [{"role": "user", "content": SKELETON_INSTRUCTION.format(question=question)}]) + "1."
    out = api.generate(model, [chat.encode_chat(tok, text)], max_new_tokens=outline_tokens, **opts)
    skeleton = "1." + out.texts[0]
    points = parse_points(skeleton)
    plan = chat_points_plan(tok, question, points) if points else Plan(
        question, [], plain=chat.render(tok, [{"role": "user", "content": question}]), special_tokens=False)
    return plan, {"outline": skeleton, "skeleton": "chat", "skeleton_prompt": text,
                  "forwards": out.stats["target_forwards"], "s": out.stats["wall_s"]}


def _plan(planner, prompt: str) -> Plan:
    if callable(planner):
        got = planner(prompt)
        if isinstance(got, Plan):
            return got
        try:
            prefix, points, joiner = got
        except (TypeError, ValueError):
            raise InputError("a planner callable must return (prefix, points, joiner) or a decompose.Plan") from None
        if not isinstance(prefix, str) or not all(isinstance(p, str) for p in points):
            raise InputError("a planner callable must return a str prefix and a list of str points")
        return Plan(prefix, list(points), joiner)
    if planner == "stubs":
        return plan_stubs(prompt)
    if planner == "lines":
        return plan_lines(prompt)
    raise InputError(f"unknown planner {planner!r}: use one of {', '.join(PLANNERS)} or a callable "
                     "prompt -> (prefix, points, joiner)")


def _route(plan: Plan) -> tuple[str, str]:
    """("parallel" | "plain" | "sequential", why)."""
    if len(plan.points) < 2:
        return "plain", f"{len(plan.points)} independent point(s): nothing to fill in parallel"
    if plan.names:
        for i, p in enumerate(plan.points):
            refs = [n for j, n in enumerate(plan.names) if j != i and re.search(rf"\b{re.escape(n)}\b", p)]
            if refs:
                return "sequential", (f"point {i} ({plan.names[i]}) refers to {refs[0]}, another point: filled one "
                                      "after another so each sees the bodies before it")
    return "parallel", f"{len(plan.points)} independent points"


# ------------------------------------------------------------------------------------------------ stop rules
def cut_body(text: str) -> str:
    """A function body continuing its stub's last line: up to the first later line that starts at column 0 with
    something other than whitespace (the next top-level statement), trailing whitespace dropped."""
    lines = text.splitlines(keepends=True)
    out = lines[:1]  # the rest of the stub's own last line
    for ln in lines[1:]:
        if ln.strip() and not ln[0].isspace():
            break
        out.append(ln)
    return "".join(out).rstrip()


def cut_line(text: str) -> str:
    return text.split("\n", 1)[0]


def _cut(rule: str, text: str) -> str:
    return cut_body(text) if rule == "body" else cut_line(text) if rule == "line" else text


def newline_ids(tok) -> tuple[int, ...]:
    """Ids of every token whose text holds a newline (cached on the tokenizer): a ``"line"`` fill stops at one."""
    cached = getattr(tok, "_newline_ids", None)
    if cached is None:
        cached = tuple(i for i in range(tok.vocab_size) if "\n" in tok.decode([i], skip_special_tokens=True))
        tok._newline_ids = cached
    return cached


def _tokens_for(tok, ids: list[int], text: str) -> list[int]:
    """The shortest prefix of ``ids`` whose text covers ``text`` (a fill cut by a stop rule)."""
    for k in range(len(ids) + 1):
        if len(tok.decode(ids[:k])) >= len(text):
            return ids[:k]
    return ids


# ------------------------------------------------------------------------------------------------ the API
def decompose(model, prompt: str, planner: str | Callable = "stubs", method: str = "ar", max_new_tokens: int = 64,
              router: bool = True, outline_tokens: int = 128, **generate_options) -> DecomposeOutput:
    """Plan ``prompt`` into points and fill them as one batch over one prefilled prefix.

    Args:
        model: the target (`pdecode.load`), with a tokenizer.
        prompt: the task's text.
        planner: "stubs", "lines" or a callable ``prompt -> (prefix, points, joiner)`` (joiner: a separator string
            or ``(points, fills) -> text``).
        method: the inner decoding method (ar, sd, lookup, tree, medusa, eagle, mtp); its options and every
            `pdecode.generate` option (``draft=``, ``temperature=``, ...) pass through ``generate_options``.
        max_new_tokens: the budget of each point's fill, or one budget per point (a list as long as the points).
        router: fall back to plain or sequential generation when decomposing is not worth it (see the module).
        outline_tokens: the skeleton planner's budget for the skeleton itself.

    Returns:
        `DecomposeOutput`: ``prefix``, ``points``, ``fills`` and ``fill_tokens`` (per point, after its stop rule),
        ``text`` (the assembled answer) and ``stats`` (points, prefix_tokens, plan / fill forwards and seconds, the
        inner method's stats, the router's decision and why).
    """
    from pdecode import api

    model = api.as_model(model)
    if "draft" in generate_options:
        generate_options["draft"] = api.as_model(generate_options["draft"], "draft", optional=True)
    if model.tokenizer is None:
        raise InputError(f"model {model.name!r} has no tokenizer.json: decompose plans over text")
    if not isinstance(prompt, str):
        raise InputError("decompose takes one prompt text")
    for k in ("shared_prefix", "stop_token_ids", "stop_at_dedent"):
        if k in generate_options:
            raise InputError(f"decompose sets {k} itself; drop it")
    t0 = time.perf_counter()
    planned = {}
    if planner == "skeleton":
        plan, planned = plan_skeleton(model, prompt, outline_tokens, **generate_options)
    else:
        plan = _plan(planner, prompt)
    route, why = _route(plan) if router else ("parallel", "router off")
    if not router and not plan.points:
        raise InputError("the planner found no points in the prompt")
    plan_s = time.perf_counter() - t0
    tok = model.tokenizer
    stop_ids = newline_ids(tok) if plan.stop == "line" and route != "plain" else ()
    stats: dict[str, Any] = {"points": len(plan.points), "planner": planner if isinstance(planner, str) else "callable",
                             "decision": {"mode": route, "reason": why}, "plan_forwards": planned.get("forwards", 0),
                             "plan_s": plan_s}
    if planned:
        stats.update(outline=planned["outline"], skeleton=planned["skeleton"])

    if isinstance(max_new_tokens, (list, tuple)):
        if route == "plain" or len(max_new_tokens) != len(plan.points):
            raise InputError(f"max_new_tokens has {len(max_new_tokens)} budgets but the plan has "
                             f"{len(plan.points)} points ({why}); give one integer or one budget per point")
        budgets = list(max_new_tokens)
    else:
        budgets = [max_new_tokens] * max(len(plan.points), 1)

    # masked-diffusion methods decode a canvas per row: the points are filled as one batch of canvases, without a
    # shared prefix cache (every canvas position attends to the whole row) or in-loop stops
    from pdecode.decode import registry

    masked = registry.get(method).wants_max_new
    if masked and isinstance(max_new_tokens, (list, tuple)):
        raise InputError(f"method {method!r} decodes one canvas length for every row: give one max_new_tokens")

    def run(texts: list[str], shared: int, budget):
        ids = [tok.encode(t, add_special_tokens=plan.special_tokens) for t in texts]
        longest = max(len(x) + n for x, n in zip(ids, budget))
        if longest > model.cfg.max_position_embeddings:
            raise InputError(f"the planned rows are too long for the context: a row's prefix and point with its "
                             f"max_new_tokens take {longest} tokens > {model.cfg.max_position_embeddings}; shorten "
                             f"the prompt or lower max_new_tokens")
        if masked:  # a canvas per row, one budget for all; stop rules cut on the host
            out = api.generate(model, ids, method=method, max_new_tokens=max(budget), **generate_options)
            return out, 0
        n = min(generation.common_prefix(ids), min(len(x) for x in ids) - 1) if shared else 0
        out = api.generate(model, ids, method=method, max_new_tokens=budget if len(set(budget)) > 1 else budget[0],
                           shared_prefix=max(n, 0), stop_token_ids=stop_ids,
                           stop_at_dedent=plan.stop == "body" and route != "plain", **generate_options)
        return out, n

    t1 = time.perf_counter()
    if route == "plain":
        out, n = run([plan.plain or prompt], shared=False, budget=budgets[:1])
        fills, fill_tokens = list(out.texts), [list(t) for t in out.tokens]
        text = fills[0] if plan.plain else prompt + fills[0]
        inner = [out.stats]
    elif route == "sequential":
        fills, fill_tokens, inner, done = [], [], [], plan.prefix
        for p, budget in zip(plan.points, budgets):
            out, n = run([done + p], shared=False, budget=[budget])
            f = _cut(plan.stop, out.texts[0])
            fills.append(f)
            fill_tokens.append(_tokens_for(tok, out.tokens[0], f))
            inner.append(out.stats)
            done = done + p + f.rstrip() + "\n\n\n"
        text = _join(plan, fills)
    else:
        out, n = run([plan.prefix + p for p in plan.points], shared=True, budget=budgets)
        fills = [_cut(plan.stop, t) for t in out.texts]
        fill_tokens = [_tokens_for(tok, ids, f) for ids, f in zip(out.tokens, fills)]
        text = _join(plan, fills)
        inner = [out.stats]
    fill_s = time.perf_counter() - t1
    stats.update(prefix_tokens=n if route == "parallel" else 0,
                 fill_forwards=sum(s["target_forwards"] for s in inner),
                 prefill_tokens=sum(s["prefill_tokens"] for s in inner), fill_s=fill_s,
                 wall_s=plan_s + fill_s, new_tokens=sum(len(t) for t in fill_tokens),
                 inner=inner[0] if len(inner) == 1 else inner)
    return DecomposeOutput(prefix=plan.prefix, points=plan.points, fills=fills, fill_tokens=fill_tokens, text=text,
                           stats=stats)


def _join(plan: Plan, fills: Sequence[str]) -> str:
    if callable(plan.joiner):
        return plan.joiner(plan.points, list(fills))
    return plan.prefix + plan.joiner.join(p + f for p, f in zip(plan.points, fills))
