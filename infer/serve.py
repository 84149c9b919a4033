"""`pdecode serve`: an OpenAI-compatible HTTP server over `pdecode.Engine` (continuous batching, any engine method).

    pdecode serve --model code-target --port 8000
    pdecode serve --model code-target --method sd --draft code-draft --slots 16 --port 8000

Endpoints: ``POST /v1/completions``, ``POST /v1/chat/completions`` (the tokenizer's chat template when it has one,
else `pdecode.chat`'s plain format), ``GET /v1/models``, ``GET /health``. ``"stream": true`` answers as server-sent
events in OpenAI's format (``data: {chunk}`` frames, ``data: [DONE]`` last); ``stream_options.include_usage`` adds
a usage chunk. Beyond OpenAI's fields a request may give ``top_k``, ``min_p``, ``repetition_penalty``,
``stop_token_ids`` and ``seed``. Defaults come from the model's generation_config.json, else OpenAI's (temperature
1, completions max_tokens 16, chat max_tokens the rest of the context).

A request the server cannot serve as asked gets a 400 whose message says what to change (invalid JSON, an unknown
or out-of-range field, a prompt too long for the context, ``n`` > 1, top logprobs, ...): never a 500, never a stuck
slot; an unexpected failure is a 500 with a JSON error and a traceback in the log. A client that disconnects frees
its slot at the next engine round. SIGTERM starts a drain: new requests get a 503 (with ``Retry-After``) while the
ones in flight finish for up to ``--drain`` seconds; a request still running at the deadline is cut (a 503, or a
stream that ends with an ``error`` event and no ``[DONE]``) and the server exits. SIGINT stops listening first, then
drains the same way. Every request logs one access line (logger ``pdecode.serve``, ``--log-level``): method, path,
status, prompt and completion tokens, time to first token, total time, tokens per target forward.

Built on aiohttp (the optional ``serve`` extra): one package gives the asyncio HTTP server, streamed responses for
server-sent events and graceful shutdown on signals, with no ASGI layer to configure; the engine runs in one
worker thread and hands events to the request handlers through the event loop.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import itertools
import json
import logging
import math
import os
import signal
import sys
import threading
import time
import uuid
from typing import Any

COMPLETION_FIELDS = {"model", "prompt", "max_tokens", "temperature", "top_p", "n", "stream", "stream_options", "stop",
                     "seed", "logprobs", "echo", "presence_penalty", "frequency_penalty", "best_of", "user",
                     "logit_bias", "suffix", "top_k", "min_p", "repetition_penalty", "stop_token_ids", "ignore_eos",
                     "min_tokens", "response_format", "guided_json", "guided_regex", "guided_choice"}
CHAT_FIELDS = (COMPLETION_FIELDS - {"prompt", "echo", "best_of", "suffix"}) | {
    "messages", "max_completion_tokens", "top_logprobs", "tools", "tool_choice", "parallel_tool_calls"}
GUIDED = {"guided_json": "json_schema", "guided_regex": "regex", "guided_choice": "choice"}  # vLLM's extensions


logger = logging.getLogger("pdecode.serve")
LOG_LEVELS = ("debug", "info", "warning", "error")


class BadRequest(Exception):
    def __init__(self, message: str, param: str | None = None, status: int = 400):
        super().__init__(message)
        self.param, self.status = param, status


class Cut(Exception):
    """A request still running at the drain deadline, cut by the server."""


_CUT = object()  # put on a request's event queue when the drain deadline cuts it
CUT_MESSAGE = "the server shut down before this request finished (the drain deadline passed): retry it"


def _error(e: BadRequest, kind: str = "invalid_request_error", headers=None):
    from aiohttp import web

    body = {"error": {"message": str(e), "type": kind, "param": e.param, "code": None}}
    return web.json_response(body, status=e.status, headers=headers)


@dataclasses.dataclass
class Stats:
    """One request's figures for its access-log line (``request["pdecode"]``)."""

    t0: float
    generates: bool = False  # a completion endpoint: the line has token counts
    prompt: int = 0
    completion: int = 0
    forwards: int = 0  # target forwards of its requests (tokens per forward = completion / forwards)
    ttft: float | None = None  # seconds from arrival to the first token
    finish: list = dataclasses.field(default_factory=list)
    error: str | None = None
    accepted: list | None = None  # draft-and-verify: verify steps by drafted tokens accepted, its requests summed

    def usage(self, prompt: int, completion: int) -> dict:
        """OpenAI's usage, with pdecode's acceptance figures (extensions): ``tokens_per_forward`` (completion tokens
        per target forward, the prefill's included) and, for draft-and-verify methods, ``accepted_per_position``
        (per drafted position 1..depth, the verify steps that accepted the token there) and ``verify_steps``."""
        out = _usage(prompt, completion)
        if self.forwards:
            out["tokens_per_forward"] = round(self.completion / self.forwards, 4)
        if self.accepted:
            from infer.metrics import accepted_per_position

            out["accepted_per_position"] = accepted_per_position(self.accepted)
            out["verify_steps"] = sum(self.accepted)
        return out


# ------------------------------------------------------------------------------------------------ the engine thread
class Worker:
    """Runs the engine in one thread: requests come in through `submit` (any thread), events go out to the event
    loop through each request's asyncio queue."""

    def __init__(self, engine, loop: asyncio.AbstractEventLoop, lockstep=None):
        self.engine, self.loop = engine, loop
        self.lockstep = lockstep  # several processes: every call also goes to the others (pdecode.lockstep)
        self.calls = lockstep or engine
        self._inbox: list = []
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = False
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, name="pdecode-engine", daemon=True)

    def start(self):
        self.thread.start()

    def submit(self, prompt, controls, seed, queue: asyncio.Queue):
        """Queue one request; its events are put on ``queue`` (from the engine thread, via the loop)."""
        holder = {}

        def callback(ev):
            self.loop.call_soon_threadsafe(queue.put_nowait, ev)

        with self._lock:
            self._inbox.append((prompt, controls, seed, callback, holder))
        self._wake.set()
        return holder  # holder["req"] is the engine's Request once the thread has taken it

    def cancel(self, holder):
        with self._lock:
            self._inbox.append(("cancel", holder))
        self._wake.set()

    def in_flight(self) -> int:
        with self._lock:
            pending = sum(1 for x in self._inbox if x[0] != "cancel")
        return pending + len(self.engine.queue) + len(self.engine.running)

    def stop(self):
        self._stop = True
        self._wake.set()
        self.thread.join(timeout=30)
        if self.lockstep is not None:
            self.lockstep.leader.close()  # the other processes stop too

    def _take_inbox(self):
        with self._lock:
            items, self._inbox = self._inbox, []
        for item in items:
            if item[0] == "cancel":
                req = item[1].get("req")
                if req is not None:
                    self.calls.cancel(req)
                else:
                    item[1]["cancelled"] = True
                continue
            prompt, controls, seed, callback, holder = item
            if holder.get("cancelled"):
                continue
            holder["req"] = self.calls.submit(prompt, controls, seed=seed, callback=callback)

    def _run(self):
        try:
            while not self._stop:
                self._take_inbox()
                if self.engine.idle:
                    if self.lockstep is not None:
                        self.lockstep.flush()  # (submissions cancelled before they ran: the others drop them too)
                    self._wake.wait(timeout=0.5)
                    self._wake.clear()
                    continue
                self.calls.run_once()
        except BaseException as e:  # an engine failure: every waiting request learns of it (a 500)
            self.error = e
            logger.exception("the engine failed: every request from now on gets a 500")


# ------------------------------------------------------------------------------------------------ requests
MAX_N = 16  # n and best_of at most


def _seed(c: dict, j: int):
    """The seed of a request's j-th choice: its seed + j when it gave one (else drawn by the engine)."""
    return None if c["seed"] is None else c["seed"] + j


def _number(body, name, default, lo=None, hi=None, integer=False, lo_open=False):
    v = body.get(name, default)
    if v is None:
        return default
    ok = isinstance(v, int) if integer else isinstance(v, (int, float))
    if isinstance(v, bool) or not ok:
        raise BadRequest(f"{name} must be {'an integer' if integer else 'a number'}, got {v!r}", name)
    if lo is not None and (v <= lo if lo_open else v < lo):
        raise BadRequest(f"{name} must be {'>' if lo_open else '>='} {lo}, got {v!r}", name)
    if hi is not None and v > hi:
        raise BadRequest(f"{name} must be <= {hi}, got {v!r}", name)
    return v


class Server:
    def __init__(self, engine, name: str, drain_s: float = 10.0):
        self.engine, self.name, self.drain_s = engine, name, drain_s
        self.gen = dict(engine.model.generation_config)
        self.worker: Worker | None = None
        self.draining = False  # SIGTERM (or SIGINT) seen: new requests get a 503
        self.drain_end = math.inf  # when requests still in flight are cut (time.monotonic)
        self.cut = False  # the deadline passed: requests still running were cut
        self.active = 0  # requests inside a handler
        self._runs: dict[int, tuple] = {}  # id -> (engine holder, event queue) of each request submitted
        self.created = int(time.time())
        self.lockstep = None  # a multi-process run: process 0's side of pdecode.lockstep
        self.lost: str | None = None  # why the run broke (a process died)
        try:
            from infer.metrics import Metrics

            self.metrics = Metrics(name, engine.method, lambda: (len(engine.running), engine.slots, len(engine.queue),
                                                                 XLA_COMPILES["n"]), engine)
        except ImportError:  # prometheus-client (the serve extra) missing: /metrics says so
            self.metrics = None

    def process_lost(self, why: str, exit_after_s: float = 2.0) -> None:
        """Another process of the run died: /health answers 503 at once, and this process exits (code 3) with one
        line shortly after; its engine may be blocked in a collective with the dead process, which nothing ends."""
        self.lost = why
        logger.error("%s: the server stops (restart every process of the run)", why)
        timer = threading.Timer(exit_after_s, lambda: (logging.shutdown(), os._exit(3)))
        timer.daemon = True
        timer.start()

    # -------------------------------------------------------------------------------------- parsing
    def _common(self, body: dict, fields: set, kind: str) -> dict:
        unknown = sorted(set(body) - fields)
        if unknown:
            raise BadRequest(f"unknown field {unknown[0]!r} for {kind}; this server takes: {', '.join(sorted(fields))}",
                             unknown[0])
        model = body.get("model")
        if model is not None and model != self.name:
            raise BadRequest(f"model {model!r} is not served here; this server serves {self.name!r}", "model", 404)
        n = _number(body, "n", 1, 1, MAX_N, integer=True)
        best_of = _number(body, "best_of", n, 1, MAX_N, integer=True)
        if best_of < n:
            raise BadRequest(f"best_of ({best_of}) must be at least n ({n})", "best_of")
        pres, freq = (_number(body, f, 0.0, -2, 2) for f in ("presence_penalty", "frequency_penalty"))
        bias = body.get("logit_bias")
        if bias is not None and not isinstance(bias, dict):
            raise BadRequest("logit_bias must be an object mapping token ids to biases in [-100, 100]", "logit_bias")
        min_tokens = _number(body, "min_tokens", 0, 0, integer=True)
        if body.get("tools") or body.get("tool_choice") not in (None, "none"):
            raise BadRequest("tool calls are not supported", "tools")
        stream = body.get("stream", False)
        if not isinstance(stream, bool):
            raise BadRequest(f"stream must be true or false, got {stream!r}", "stream")
        if stream and best_of > n:
            raise BadRequest("best_of > n cannot be streamed (the best are known at the end): send stream false",
                             "best_of")
        so = body.get("stream_options")
        if so is not None and (not isinstance(so, dict) or set(so) - {"include_usage", "continuous_usage_stats"}
                               or not all(isinstance(v, bool) for v in so.values())):
            raise BadRequest("stream_options takes {\"include_usage\": true|false, \"continuous_usage_stats\": "
                             "true|false}", "stream_options")
        ignore_eos = body.get("ignore_eos", False)
        if not isinstance(ignore_eos, bool):
            raise BadRequest(f"ignore_eos must be true or false, got {ignore_eos!r}", "ignore_eos")
        seed = body.get("seed")
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
            raise BadRequest(f"seed must be an integer, got {seed!r}", "seed")
        ids = body.get("stop_token_ids")
        if ids is not None and (not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool)
                                                                      for t in ids)):
            raise BadRequest("stop_token_ids must be a list of token ids", "stop_token_ids")
        defaults = {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0, "repetition_penalty": 1.0}
        if self.gen.get("do_sample"):  # the model's generation config (as `pdecode.generation`)
            from pdecode import generation

            defaults.update({k: v for k, v in generation.defaults(self.gen).items() if k in defaults})
        elif isinstance(self.gen.get("repetition_penalty"), (int, float)):
            defaults["repetition_penalty"] = float(self.gen["repetition_penalty"])
        return dict(
            temperature=_number(body, "temperature", defaults["temperature"], 0, 2),
            top_p=_number(body, "top_p", defaults["top_p"], 0, 1, lo_open=True),
            top_k=_number(body, "top_k", defaults["top_k"], 0, integer=True),
            min_p=_number(body, "min_p", defaults["min_p"], 0, 1),
            repetition_penalty=_number(body, "repetition_penalty", defaults["repetition_penalty"], 0, lo_open=True),
            presence_penalty=pres, frequency_penalty=freq, logit_bias=bias or None, min_tokens=min_tokens,
            stop=body.get("stop"), stop_token_ids=ids or [], seed=seed, stream=stream, ignore_eos=ignore_eos, n=n,
            best_of=best_of,
            include_usage=bool((so or {}).get("include_usage", False)),
            continuous_usage=bool((so or {}).get("continuous_usage_stats", False)))

    @staticmethod
    def grammar_spec(body: dict):
        """The request's structured output as a `pdecode.generate` grammar (None: free text): OpenAI's
        ``response_format`` (text, json_object, json_schema) or one of vLLM's ``guided_json`` / ``guided_regex`` /
        ``guided_choice``."""
        given = [k for k in ("response_format", *GUIDED) if body.get(k) is not None]
        if len(given) > 1:
            raise BadRequest(f"give one of {given[0]} and {given[1]}, not both", given[1])
        if not given:
            return None
        key = given[0]
        v = body[key]
        if key in GUIDED:
            if key == "guided_json" and isinstance(v, str):
                try:
                    v = json.loads(v)
                except json.JSONDecodeError:
                    raise BadRequest("guided_json must be a JSON schema (an object, or its JSON text)", key) from None
            ok = {"guided_json": dict, "guided_regex": str, "guided_choice": list}[key]
            if not isinstance(v, ok) or not v:
                raise BadRequest(f"{key} must be a non-empty {ok.__name__.replace('dict', 'object')}", key)
            return {GUIDED[key]: v}
        kinds = ("text", "json_object", "json_schema")
        if not isinstance(v, dict) or v.get("type") not in kinds:
            raise BadRequest("response_format must be {\"type\": \"text\"}, {\"type\": \"json_object\"} or "
                             "{\"type\": \"json_schema\", \"json_schema\": {\"name\": ..., \"schema\": {...}}}",
                             key)
        if v["type"] == "text":
            return None
        if v["type"] == "json_object":
            return {"json_object": True}
        js = v.get("json_schema")
        if not isinstance(js, dict) or not isinstance(js.get("schema", {}), dict):
            raise BadRequest("response_format json_schema needs \"json_schema\": {\"name\": ..., \"schema\": "
                             "{...}}", key)
        # a json_schema without a schema allows any JSON object (OpenAI's default schema is empty)
        return {"json_schema": js["schema"]} if js.get("schema") else {"json_object": True}

    async def compile_grammar(self, body: dict):
        """The request's grammar compiled for the engine (in a worker thread: a large schema takes seconds the first
        time; the cache makes a repeated one instant), or None."""
        from pdecode.errors import InputError

        spec = self.grammar_spec(body)
        if spec is None:
            return None
        try:
            return await asyncio.get_running_loop().run_in_executor(None, self.engine.compile_grammar, spec)
        except InputError as e:
            raise BadRequest(str(e), "response_format" if "response_format" in body else next(
                k for k in GUIDED if k in body)) from None

    def _check(self, prompt: list[int], max_tokens, c: dict, logprobs: bool):
        from pdecode.errors import InputError

        try:
            return self.engine.check(prompt, max_tokens=max_tokens, temperature=c["temperature"], top_p=c["top_p"],
                                     top_k=c["top_k"], min_p=c["min_p"], repetition_penalty=c["repetition_penalty"],
                                     stop=c["stop"], stop_token_ids=c["stop_token_ids"], logprobs=logprobs,
                                     ignore_eos=c["ignore_eos"], presence_penalty=c["presence_penalty"],
                                     frequency_penalty=c["frequency_penalty"], logit_bias=c["logit_bias"],
                                     min_tokens=c["min_tokens"], grammar=c.get("grammar"))
        except InputError as e:
            raise BadRequest(str(e)) from None

    def _room(self, prompt) -> int:
        return max(1, self.context - len(prompt))

    def _scoring(self, c: dict, what: str, param: str):
        """Refusals for requests scored by a forward of their own (`pdecode.token_logprobs`)."""
        if c["stream"]:
            raise BadRequest(f"{what} cannot be streamed: send the request with stream false", param)
        if self.lockstep is not None:
            raise BadRequest(f"{what} is not supported on a multi-process server", param)

    def parse_completion(self, body: dict, c: dict):
        """A completion's prompts and their checked controls (``c``: its common fields, `_fields`)."""
        echo = body.get("echo", False)
        if not isinstance(echo, bool):
            raise BadRequest(f"echo must be true or false, got {echo!r}", "echo")
        if body.get("suffix"):
            raise BadRequest("suffix is not supported", "suffix")
        lp = _number(body, "logprobs", None, 0, 20, integer=True)
        c["echo"], c["top"] = echo, lp or 0
        if echo or c["top"]:
            self._scoring(c, "echo" if echo else "logprobs > 0", "echo" if echo else "logprobs")
        prompts = body.get("prompt")
        tok = self.engine.model.tokenizer
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and all(
                isinstance(t, int) and not isinstance(t, bool) for t in prompts)):
            prompts = [prompts]
        if not isinstance(prompts, list) or not prompts:
            raise BadRequest("prompt must be a string, a list of strings, a list of token ids or a list of such "
                             "lists", "prompt")
        ids = []
        for p in prompts:
            if isinstance(p, str):
                if tok is None:
                    raise BadRequest("this model has no tokenizer: send token ids", "prompt")
                ids.append(tok.encode(p))
            elif isinstance(p, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in p):
                ids.append(list(p))
            else:
                raise BadRequest("each prompt must be a string or a list of token ids", "prompt")
        if type(body.get("max_tokens")) is int and body["max_tokens"] == 0 and not echo:
            raise BadRequest("max_tokens must be >= 1, got 0 (0 only with echo: the prompt scored, nothing "
                             "generated)", "max_tokens")
        max_tokens = _number(body, "max_tokens", None, 0 if echo else 1, integer=True)
        if max_tokens == 0:  # echo only: the prompt scored, nothing generated: it may fill the whole context
            for p in ids:
                if len(p) > self.context:
                    raise BadRequest(f"the prompt has {len(p)} tokens; this server's context holds {self.context}: "
                                     "shorten the prompt", "prompt")
                from pdecode.errors import InputError

                try:
                    self.engine.check_ids(p)
                except InputError as e:
                    raise BadRequest(str(e), "prompt") from None
                self._check(p[: self.context - 1], 1, c, False)  # (the controls, with one token of room)
            return ids, [None] * len(ids), c, True
        checked = [self._check(p, 16 if max_tokens is None else max_tokens, c, lp is not None) for p in ids]
        return ids, checked, c, lp is not None

    def parse_chat(self, body: dict, c: dict):
        """A chat request's rendered prompt and its checked controls (``c``: its common fields, `_fields`)."""
        from pdecode import chat
        from pdecode.errors import InputError

        if "messages" not in body:
            raise BadRequest("messages is required", "messages")
        logprobs = body.get("logprobs", False)
        if not isinstance(logprobs, bool):
            raise BadRequest(f"logprobs must be true or false, got {logprobs!r}", "logprobs")
        c["top"] = _number(body, "top_logprobs", 0, 0, 20, integer=True)
        if c["top"]:
            if not logprobs:
                raise BadRequest("top_logprobs needs logprobs: true", "top_logprobs")
            self._scoring(c, "top_logprobs", "top_logprobs")
        tok = self.engine.model.tokenizer
        if tok is None:
            raise BadRequest("this model has no tokenizer, so it cannot render chat messages", "messages")
        try:
            msgs = chat.check_messages(body["messages"])
            prompt = chat.encode_chat(tok, chat.render(tok, msgs))
        except InputError as e:
            raise BadRequest(str(e), "messages") from None
        mt = body.get("max_completion_tokens", body.get("max_tokens"))
        max_tokens = _number({"max_tokens": mt}, "max_tokens", None, 1, integer=True)
        ctl = self._check(prompt, self._room(prompt) if max_tokens is None else max_tokens, c, logprobs)
        return prompt, ctl, c, logprobs

    # -------------------------------------------------------------------------------------- handlers
    async def _fields(self, body: dict, chat: bool) -> dict:
        """The request's common fields, checked once, with its compiled grammar (after them: an unknown field is
        reported first)."""
        c = self._common(body, CHAT_FIELDS if chat else COMPLETION_FIELDS,
                         "/v1/chat/completions" if chat else "/v1/completions")
        c["grammar"] = await self.compile_grammar(body)
        return c

    async def _body(self, request, generates: bool = True) -> dict:
        request["pdecode"].generates = generates
        try:
            body = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError, ValueError):
            raise BadRequest("the request body is not valid JSON") from None
        if not isinstance(body, dict):
            raise BadRequest("the request body must be a JSON object")
        return body

    async def _run(self, request, prompt, ctl, seed, on_event):
        """Submit one request and feed its events to ``on_event`` until it finishes; a client that goes away
        cancels it; the drain deadline raises `Cut`."""
        if self.cut:
            raise Cut()
        st: Stats = request["pdecode"]
        queue: asyncio.Queue = asyncio.Queue()
        holder = self.worker.submit(prompt, ctl, seed, queue)
        key = id(queue)
        self._runs[key] = (holder, queue)
        last = None  # the latest event (its counts are the request's so far)
        t_prev = None  # when its previous tokens arrived
        try:
            while True:
                try:
                    ev = await asyncio.wait_for(queue.get(), timeout=0.5)
                except asyncio.TimeoutError:
                    if self.worker.error is not None:
                        raise RuntimeError(f"the engine failed: {self.worker.error!r}") from None
                    if request.transport is None or request.transport.is_closing():
                        self.worker.cancel(holder)
                        st.error = "client disconnected"
                        return
                    continue
                if ev is _CUT or ev.finish_reason == "cancelled":  # only the server cancels a request it waits on
                    raise Cut()
                last = ev
                if ev.tokens:
                    now = time.perf_counter()
                    if st.ttft is None:
                        st.ttft = now - st.t0
                    if t_prev is not None and self.metrics is not None:
                        self.metrics.tokens(len(ev.tokens), now - t_prev)
                    t_prev = now
                await on_event(ev)
                if ev.finish_reason is not None:
                    st.finish.append(ev.finish_reason)
                    return
        except (asyncio.CancelledError, ConnectionResetError):
            self.worker.cancel(holder)
            st.error = "client disconnected"
            raise
        finally:
            self._runs.pop(key, None)
            if last is not None:
                st.completion += last.completion_tokens
                st.forwards += last.forwards
                if last.accepted:
                    st.accepted = [a + b for a, b in itertools.zip_longest(st.accepted or [], last.accepted,
                                                                           fillvalue=0)]

    @staticmethod
    async def _all(coros):
        """``asyncio.gather`` that lets every coroutine finish (a cut reaches them all) and raises the first
        error."""
        results = await asyncio.gather(*coros, return_exceptions=True)
        for r in results:
            if isinstance(r, BaseException):
                raise r
        return results

    def _retry_after(self) -> dict:
        return {"Retry-After": str(max(1, math.ceil(self.drain_end - time.monotonic())))}

    def _cut_response(self, request):
        request["pdecode"].error = "server_shutdown"
        return _error(BadRequest(CUT_MESSAGE, status=503), "server_shutdown", headers=self._retry_after())

    async def completions(self, request):
        body = await self._body(request)
        ids, checked, c, logprobs = self.parse_completion(body, await self._fields(body, False))
        request["pdecode"].prompt = sum(len(p) for p in ids)
        rid = f"cmpl-{uuid.uuid4().hex}"
        if c["stream"]:
            return await self._stream(request, rid, "text_completion", ids, checked, c, logprobs, chat=False)
        n, bo = c["n"], c["best_of"]
        # best_of > n: the candidates carry their logprobs (their ranking), shown only when asked
        ranked = [None if ctl is None or bo == n else dataclasses.replace(ctl, logprobs=True) for ctl in checked]
        try:
            every = await self._all(
                self._collect(request, p, rk or ctl, _seed(c, j)) if ctl is not None else self._nothing()
                for p, ctl, rk in zip(ids, checked, ranked) for j in range(bo))
        except Cut:
            return self._cut_response(request)
        results, of = [], []  # the choices: n per prompt (the best n of best_of by total log-probability)
        for i in range(len(ids)):
            cands = every[i * bo: (i + 1) * bo]
            if bo > n:
                cands = sorted(cands, key=lambda r: -sum(r[3]))[:n]
                if not logprobs:
                    cands = [(text, reason, toks, []) for text, reason, toks, _ in cands]
            results += cands
            of += [i] * len(cands)
        choices = []
        tok = self.engine.model.tokenizer
        name = (lambda t: tok.decode([t])) if tok else str  # noqa: E731
        for k, (text, reason, toks, lps) in enumerate(results):
            i = of[k]  # the choice's prompt
            lp = None
            if c["echo"] or c["top"]:  # every logprob from one scoring forward over prompt + completion
                full = ids[i] + toks
                got, tops = await self._score(full, c["top"])
                first = 0 if c["echo"] else len(ids[i])  # the first token reported
                shown = full[first:]
                lp = {"tokens": [name(t) for t in shown],
                      "token_logprobs": [None if j == 0 else got[j - 1] for j in range(first, len(full))],
                      "top_logprobs": [None if j == 0 else _top_dict(tops[j - 1], name)
                                       for j in range(first, len(full))] if c["top"] else None,
                      "text_offset": list(itertools.accumulate([0] + [len(name(t)) for t in shown[:-1]]))}
                if c["echo"]:
                    text = (tok.decode(ids[i]) if tok else "") + text
            elif logprobs:
                lp = {"tokens": [name(t) for t in toks], "token_logprobs": lps, "top_logprobs": None,
                      "text_offset": None}
            choices.append({"index": k, "text": text, "finish_reason": reason, "logprobs": lp})
        n_prompt = sum(len(p) for p in ids)
        n_out = sum(len(r[2]) for r in every)  # (every completion generated, best_of's too)
        return _json({"id": rid, "object": "text_completion", "created": int(time.time()), "model": self.name,
                      "choices": choices, "usage": request["pdecode"].usage(n_prompt, n_out)})

    async def chat_completions(self, request):
        body = await self._body(request)
        prompt, ctl, c, logprobs = self.parse_chat(body, await self._fields(body, True))
        request["pdecode"].prompt = len(prompt)
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        if c["stream"]:
            return await self._stream(request, rid, "chat.completion.chunk", [prompt], [ctl], c, logprobs, chat=True)
        try:
            results = await self._all(self._collect(request, prompt, ctl, _seed(c, j)) for j in range(c["n"]))
        except Cut:
            return self._cut_response(request)
        choices = []
        for k, (text, reason, toks, lps) in enumerate(results):
            lp = None
            if logprobs:
                tok = self.engine.model.tokenizer
                tops = [[]] * len(toks)
                if c["top"]:  # chosen and top logprobs from one scoring forward over prompt + completion
                    got, scored = await self._score(prompt + toks, c["top"])
                    lps = got[len(prompt) - 1:]
                    tops = [[{"token": tok.decode([t]), "logprob": v, "bytes": None} for t, v in row]
                            for row in scored[len(prompt) - 1:]]
                lp = {"content": [{"token": tok.decode([t]), "logprob": v, "bytes": None, "top_logprobs": top}
                                  for t, v, top in zip(toks, lps, tops)]}
            choices.append({"index": k, "message": {"role": "assistant", "content": text}, "finish_reason": reason,
                            "logprobs": lp})
        return _json({"id": rid, "object": "chat.completion", "created": int(time.time()), "model": self.name,
                      "choices": choices,
                      "usage": request["pdecode"].usage(len(prompt), sum(len(r[2]) for r in results))})

    @staticmethod
    async def _nothing():
        return "", "length", [], []

    async def _score(self, ids: list[int], top: int):
        """`pdecode.token_logprobs` of ``ids`` off the event loop (the engine thread runs on meanwhile)."""
        import pdecode

        return await asyncio.get_running_loop().run_in_executor(None, pdecode.token_logprobs, self.engine.model, ids,
                                                                top)

    async def _collect(self, request, prompt, ctl, seed):
        parts, toks, lps, reason = [], [], [], None

        async def on_event(ev):
            nonlocal reason
            parts.append(ev.text)
            toks.extend(ev.tokens)
            lps.extend(ev.logprobs or [])
            reason = ev.finish_reason

        await self._run(request, prompt, ctl, seed, on_event)
        return "".join(parts), reason, toks, lps

    async def _stream(self, request, rid, obj, ids, checked, c, logprobs, chat: bool):
        from aiohttp import web

        resp = web.StreamResponse(status=200, headers={"Content-Type": "text/event-stream",
                                                       "Cache-Control": "no-cache"})
        await resp.prepare(request)
        created = int(time.time())
        lock = asyncio.Lock()
        tok = self.engine.model.tokenizer

        async def send(payload):
            async with lock:
                await resp.write(b"data: " + json.dumps(payload).encode() + b"\n\n")

        def chunk(i, delta_text, reason, ev=None):
            if chat:
                delta = {"content": delta_text} if delta_text or reason is None else {}
                ch = {"index": i, "delta": delta, "finish_reason": reason, "logprobs": None}
                if logprobs and ev is not None and ev.tokens:
                    ch["logprobs"] = {"content": [{"token": tok.decode([t]), "logprob": v, "bytes": None,
                                                   "top_logprobs": []} for t, v in zip(ev.tokens, ev.logprobs)]}
            else:
                ch = {"index": i, "text": delta_text, "finish_reason": reason, "logprobs": None}
                if logprobs and ev is not None and ev.tokens:
                    ch["logprobs"] = {"tokens": [tok.decode([t]) if tok else str(t) for t in ev.tokens],
                                      "token_logprobs": ev.logprobs, "top_logprobs": None, "text_offset": None}
            out = {"id": rid, "object": obj, "created": created, "model": self.name, "choices": [ch]}
            if c["continuous_usage"]:  # (vLLM's extension: the usage so far in every chunk, for load testers)
                out["usage"] = _usage(usage["prompt"], usage["sofar"])
            return out

        usage = {"prompt": sum(len(p) for p in ids), "completion": 0, "sofar": 0}

        async def one(i, prompt, ctl, seed):
            if chat:
                await send({"id": rid, "object": obj, "created": created, "model": self.name,
                            "choices": [{"index": i, "delta": {"role": "assistant", "content": ""},
                                         "finish_reason": None, "logprobs": None}]})

            async def on_event(ev):
                usage["sofar"] += len(ev.tokens)
                if ev.finish_reason is None:
                    await send(chunk(i, ev.text, None, ev))
                else:
                    if ev.text or ev.tokens:
                        await send(chunk(i, ev.text, None, ev))
                    usage["completion"] += ev.completion_tokens
                    await send(chunk(i, "", ev.finish_reason))

            await self._run(request, prompt, ctl, seed, on_event)

        st: Stats = request["pdecode"]

        async def fail(message, kind, code):
            """End the stream with an error event and no ``[DONE]``: the openai client raises `APIError`."""
            st.error = kind
            await send({"error": {"message": message, "type": kind, "param": None, "code": code}})
            await resp.write_eof()

        try:
            n = c["n"]  # n choices per prompt, choice i * n + j the prompt i's j-th
            await self._all(one(i * n + j, p, ctl, _seed(c, j)) for i, (p, ctl) in enumerate(zip(ids, checked))
                            for j in range(n))
            if c["include_usage"]:
                await send({"id": rid, "object": obj, "created": created, "model": self.name, "choices": [],
                            "usage": st.usage(usage["prompt"], usage["completion"])})
            await resp.write(b"data: [DONE]\n\n")
            await resp.write_eof()
        except (ConnectionResetError, asyncio.CancelledError):
            pass  # the client went away: `_run` cancelled its requests
        except Cut:
            try:
                await fail(CUT_MESSAGE, "server_shutdown", 503)
            except ConnectionResetError:
                pass
        except Exception as e:  # the response is under way: the error goes in the stream, its traceback in the log
            logger.exception("%s %s: unexpected error while streaming", request.method, request.path)
            try:
                await fail(f"internal server error: {type(e).__name__}: {e}", "server_error", 500)
            except ConnectionResetError:
                pass
        return resp

    @property
    def context(self) -> int:
        """Tokens of prompt + completion one request may hold (what clients such as lm-eval size their inputs by)."""
        return self.engine.context

    def _model_card(self) -> dict:
        return {"id": self.name, "object": "model", "created": self.created, "owned_by": "pdecode",
                "max_model_len": self.context, "context_length": self.context}

    async def models(self, request):
        return _json({"object": "list", "data": [self._model_card()]})

    async def model(self, request):
        name = request.match_info["name"]
        if name != self.name:
            raise BadRequest(f"model {name!r} is not served here; this server serves {self.name!r}", "model", 404)
        return _json(self._model_card())

    async def tokenize(self, request):
        """{"prompt": text} or {"messages": [...]} (chat-rendered) -> {"tokens", "count", "max_model_len"}."""
        from pdecode import chat
        from pdecode.errors import InputError

        body = await self._body(request, generates=False)
        unknown = sorted(set(body) - {"model", "prompt", "messages", "add_special_tokens"})
        if unknown:
            raise BadRequest(f"unknown field {unknown[0]!r} for /tokenize; it takes prompt or messages (and model, "
                             "add_special_tokens)", unknown[0])
        tok = self.engine.model.tokenizer
        if tok is None:
            raise BadRequest("this model has no tokenizer", "prompt")
        if ("prompt" in body) == ("messages" in body):
            raise BadRequest("send exactly one of prompt (a string) or messages (a chat)", "prompt")
        if "messages" in body:
            try:
                ids = chat.encode_chat(tok, chat.render(tok, chat.check_messages(body["messages"])))
            except InputError as e:
                raise BadRequest(str(e), "messages") from None
        else:
            if not isinstance(body["prompt"], str):
                raise BadRequest("prompt must be a string", "prompt")
            special = body.get("add_special_tokens", True)
            if not isinstance(special, bool):
                raise BadRequest("add_special_tokens must be true or false", "add_special_tokens")
            ids = tok.encode(body["prompt"]) if special else tok.encode(body["prompt"], add_special_tokens=False)
        return _json({"tokens": list(ids), "count": len(ids), "max_model_len": self.context})

    async def detokenize(self, request):
        """{"tokens": [ids]} -> {"prompt": text}."""
        body = await self._body(request, generates=False)
        unknown = sorted(set(body) - {"model", "tokens"})
        if unknown:
            raise BadRequest(f"unknown field {unknown[0]!r} for /detokenize; it takes tokens (and model)", unknown[0])
        ids = body.get("tokens")
        vocab = self.engine.vocab
        if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab
                                                for t in ids):
            raise BadRequest(f"tokens must be a list of token ids in [0, {vocab})", "tokens")
        tok = self.engine.model.tokenizer
        if tok is None:
            raise BadRequest("this model has no tokenizer", "tokens")
        return _json({"prompt": tok.decode(ids)})

    async def health(self, request):
        if self.lost is not None:  # a process of a multi-process run died: this one exits in a moment
            return _json({"status": "failed", "error": self.lost}, status=503)
        ok = self.worker is not None and self.worker.error is None
        status = "draining" if ok and self.draining else "ok" if ok else "failed"
        return _json({"status": status, "method": self.engine.method,
                      "slots": self.engine.slots, "in_flight": self.worker.in_flight() if self.worker else 0,
                      "compiles_since_warmup": XLA_COMPILES["n"],
                      "programs_pending": self.engine.pending_programs}, status={"ok": 200, "draining": 503}.get(status, 500))

    async def metrics_page(self, request):
        from aiohttp import web

        if self.metrics is None:
            raise BadRequest("metrics need prometheus-client: pip install 'pdecode[serve]'", status=404)
        return web.Response(body=self.metrics.render(), headers={"Content-Type": "text/plain; version=0.0.4"})

    # -------------------------------------------------------------------------------------- shutdown
    async def drain(self):
        """Answer 503 to new requests, let the ones in flight finish until ``drain_s`` from the first call, then
        cut the rest (each ends with a 503 or a stream error event) and wait briefly for their handlers."""
        if not self.draining:
            self.draining = True
            self.drain_end = time.monotonic() + self.drain_s
            logger.info("draining: %d request(s) in flight, new ones get 503 for up to %.1fs", self.active,
                        self.drain_s)
        while self.active and time.monotonic() < self.drain_end:
            await asyncio.sleep(0.02)
        if self.active and not self.cut:
            self.cut = True
            runs = list(self._runs.values())
            logger.warning("drain deadline: cutting %d request(s) still in flight", len(runs))
            for holder, queue in runs:
                queue.put_nowait(_CUT)
                self.worker.cancel(holder)
        t_end = time.monotonic() + 5
        while self.active and time.monotonic() < t_end:
            await asyncio.sleep(0.02)

    async def _handle(self, request, handler, st: Stats):
        """503 while draining; errors as JSON: a 4xx with its message, anything unexpected a 500 with its traceback
        in the log."""
        from aiohttp import web

        if self.draining and request.path != "/health":
            st.error = "draining"
            return _error(BadRequest("the server is shutting down: retry on another replica or after it restarts",
                                     status=503), "server_shutdown", headers=self._retry_after())
        self.active += 1
        try:
            return await handler(request)
        except web.HTTPException as e:
            if e.status < 400:
                raise
            st.error = f"{e.reason}: {request.method} {request.path}"
            return _error(BadRequest(st.error, status=e.status))
        except BadRequest as e:
            st.error = str(e)
            return _error(e)
        except Exception as e:
            logger.exception("%s %s: unexpected error", request.method, request.path)
            st.error = "server_error"
            return _error(BadRequest(f"internal server error: {type(e).__name__}: {e}", status=500), "server_error")
        finally:
            self.active -= 1

    def _access(self, request, status: int, st: Stats):
        """The request's access-log line (a 5xx a warning; health checks that pass at debug level)."""
        parts = [request.method, request.path, str(status)]
        if st.generates:
            parts += [f"prompt_tokens={st.prompt}", f"completion_tokens={st.completion}",
                      "ttft=" + ("-" if st.ttft is None else f"{st.ttft:.3f}s")]
        parts.append(f"time={time.perf_counter() - st.t0:.3f}s")
        if st.generates:
            parts.append("tokens_per_forward=" + (f"{st.completion / st.forwards:.2f}" if st.forwards else "-"))
        if st.finish:
            parts.append("finish=" + ",".join(st.finish))
        if st.error:
            parts.append("error=" + json.dumps(st.error))
        parts.append(f"from={request.remote}")
        if self.metrics is not None:
            route = request.match_info.route.resource if request.match_info.route else None
            self.metrics.http(route.canonical if route is not None else "other", status)
            if st.generates and status < 400:
                self.metrics.finished(st, time.perf_counter() - st.t0)
        level = logging.WARNING if status >= 500 else \
            logging.DEBUG if request.path == "/health" and status == 200 else logging.INFO
        logger.log(level, " ".join(parts))

    # -------------------------------------------------------------------------------------- app
    def app(self):
        from aiohttp import web

        @web.middleware
        async def serve(request, handler):  # one access-log line per request, whatever happens
            st = request["pdecode"] = Stats(t0=time.perf_counter())
            status = 499  # the client went away before an answer (nginx's code)
            try:
                resp = await self._handle(request, handler, st)
                status = resp.status
                return resp
            except web.HTTPException as e:  # < 400: not an error (none of the routes redirects)
                status = e.status
                raise
            finally:
                self._access(request, status, st)

        app = web.Application(middlewares=[serve], client_max_size=16 * 2**20)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/chat/completions", self.chat_completions)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/v1/models/{name}", self.model)
        app.router.add_post("/tokenize", self.tokenize)
        app.router.add_post("/detokenize", self.detokenize)
        app.router.add_get("/health", self.health)
        app.router.add_get("/metrics", self.metrics_page)

        async def on_startup(app):
            self.worker = Worker(self.engine, asyncio.get_running_loop(), self.lockstep)
            self.worker.start()

        async def on_shutdown(app):  # after the site stopped listening (SIGINT); SIGTERM has drained already
            await self.drain()

        async def on_cleanup(app):
            self.worker.stop()

        app.on_startup.append(on_startup)
        app.on_shutdown.append(on_shutdown)
        app.on_cleanup.append(on_cleanup)
        return app


XLA_COMPILES = {"n": 0, "on": False}  # XLA compiles in this process after warm-up (there should be none)


WARMUP_MULTI = ("--warmup background serves from the programs ready so far, which differ between processes: on "
                "several processes use --warmup full (the default there)")


def _log_warm(engine):
    try:
        if engine.wait_warm():
            logger.info("every program is ready: %d, %.1fs after warm-up began", engine.compiles, engine.warm_all_s)
        # (else the server is stopping and the thread stopped with programs left: `_exit_after_warmup` says so)
    except Exception as e:  # noqa: BLE001 (the engine serves on with the programs it has)
        logger.warning("the warm-up thread stopped: %s: %s; calls keep to the programs ready", type(e).__name__, e)


def _count_compiles():
    import jax

    from pdecode.engine import WARM_THREAD

    def listener(name, secs, **kw):
        if (XLA_COMPILES["on"] and name == "/jax/core/compile/backend_compile_duration"
                and threading.current_thread().name != WARM_THREAD):  # (a background warm-up's are warm-up's)
            XLA_COMPILES["n"] += 1

    jax.monitoring.register_event_duration_secs_listener(listener)


def _top_dict(row: list, name) -> dict:
    """OpenAI's legacy top_logprobs entry: token text -> log-probability, likeliest first (a text two ids decode to
    keeps the likelier)."""
    out: dict = {}
    for t, v in row:
        out.setdefault(name(t), v)
    return out


def _usage(p: int, c: int) -> dict:
    return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}


def _json(obj, status: int = 200):
    from aiohttp import web

    return web.json_response(obj, status=status)


# ------------------------------------------------------------------------------------------------ command line
def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--model", default="code-target", help="zoo name or model directory (default: code-target)")
    ap.add_argument("--method", default="ar", help="ar or a draft-and-verify method (sd, lookup, eagle, ...)")
    ap.add_argument("--draft", default=None, help="draft model for sd / tree")
    ap.add_argument("--heads", default=None, help="drafting heads to attach to --model (a heads directory or zoo "
                    "name trained for it, e.g. smollm2-135m-instruct-eagle3) for eagle / medusa / mtp / layerskip")
    ap.add_argument("--host", default="127.0.0.1", help="address to bind (default: 127.0.0.1, this machine only)")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--slots", type=int, default=8, help="requests decoded together (default: 8)")
    ap.add_argument("--max-len", type=int, default=1024, help="context per slot: prompt + output (default: 1024)")
    ap.add_argument("--chunk", type=int, default=256, help="largest prefill chunk (default: 256)")
    ap.add_argument("--steps-per-call", type=int, default=4, help="decode steps per engine call (default: 4)")
    ap.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    ap.add_argument("--activation-dtype", default=None, choices=["float32", "bfloat16", "float16"])
    ap.add_argument("--served-name", default=None, help="the model name clients use (default: --model)")
    ap.add_argument("--drain", type=float, default=10.0,
                    help="seconds SIGTERM waits for requests in flight (new ones get 503), then cuts the rest")
    ap.add_argument("--log-level", default="info", choices=LOG_LEVELS,
                    help="the server's log (stderr): info has one line per request; debug adds passing health checks")
    ap.add_argument("-o", "--option", action="append", help="method option key=value (repeatable)")
    ap.add_argument("--speculation", default=None, choices=["auto", "always"],
                    help="draft-and-verify methods: auto (the default on one process, or with --spec-cost) drafts only "
                         "while the tokens a drafted step gives pay for its cost over a plain step (timed at warm-up "
                         "and while serving, or --spec-cost; docs/serving.md); always drafts at every step (the "
                         "default on several processes without --spec-cost)")
    ap.add_argument("--spec-cost", type=float, default=None,
                    help="with --speculation auto: a drafted step call's cost over a plain one's (default: measured "
                         "at warm-up; the log says the figure; several processes need it given, to decide alike)")
    ap.add_argument("--warmup", default=None, choices=["background", "full"],
                    help="background (the default on one process): serve once the programs nothing can stand in for "
                         "are compiled (seconds on a restart, the compilation cache warm) and compile the rest "
                         "meanwhile, calls going to ready programs that cover them; full: compile every program "
                         "before serving (the only mode on several processes, which must run the same programs)")
    ap.add_argument("--prefix-cache", type=int, default=0,
                    help="prompt prefixes kept on the device (0: off): a request starting with a kept prefix (a shared "
                         "system prompt longer than --chunk) prefills only the rest")
    ap.add_argument("--kv-pages", type=int, default=None,
                    help="pages of the paged KV cache the slots share (a request holds the pages its prompt and "
                         "max_tokens need, from admission to its end; default: --slots x --max-len positions' worth, "
                         "so raise --slots to serve more requests at once in the same memory; 0: no paging, each "
                         "slot reserves --max-len positions, as with --mesh)")
    ap.add_argument("--page-size", type=int, default=16, help="positions per KV page (with --kv-pages)")
    ap.add_argument("--grammar-states", type=int, default=None,
                    help="structured output: states in the device tables the requests' grammars share (default 4096, "
                         "fewer for vocabularies over 64K tokens; 0: structured output off)")
    ap.add_argument("--grammar-transitions", type=int, default=None,
                    help="structured output: transitions in those tables (default 4194304: 16 MiB)")
    ap.add_argument("--mesh", default=None, help="DATAxMODEL mesh over every process's devices (default: none; on "
                                                 "several processes PROCESSESxLOCAL, slots split over the hosts)")
    from infer.cli import add_distributed_arguments

    add_distributed_arguments(ap)
    ap.add_argument("--control-port", type=int, default=None, help="several processes: the port process 0 sends "
                    "each engine round on to the others (default: the coordinator's port + 1; on a Cloud TPU slice "
                    "with no flags, 8477 on worker 0)")


def speculation_mode(given: str | None, multi: bool, spec_cost: float | None) -> str:
    """The engine's ``speculation`` for ``--speculation`` (None: not given): auto by default, where every process
    decides alike (one process, or a ratio given); always on several processes without ``--spec-cost``."""
    if given is None:
        return "always" if multi and spec_cost is None else "auto"
    if multi and given == "auto" and spec_cost is None:
        from pdecode.errors import InputError

        raise InputError("--speculation auto on several processes needs --spec-cost (every process must make the "
                         "same choice at every step): take the figure one process logs at warm-up, or use "
                         "--speculation always")
    return given


def served_models(args, mesh=None):
    """(model, draft or None) the server decodes with: ``--model`` (with ``--heads`` attached) and ``--draft``."""
    import pdecode

    def load(name, indivisible="error"):
        return pdecode.load(name, dtype=args.dtype, activation_dtype=args.activation_dtype, mesh=mesh,
                            indivisible=indivisible)

    model = load(args.model)
    if args.heads:
        model = pdecode.attach_heads(model, args.heads)
    return model, load(args.draft, "replicate") if args.draft else None


def run_from_args(args) -> int:
    import pdecode
    from infer.cli import parse_options
    from pdecode.engine import Engine
    from pdecode.errors import InputError

    try:
        import aiohttp  # noqa: F401
    except ImportError:
        print("pdecode serve needs aiohttp: pip install 'pdecode[serve]'", file=sys.stderr)
        return 2
    _setup_logging(args.log_level)
    options = parse_options(args.option)
    if args.warmup == "background" and (args.num_processes or 1) > 1:  # (before joining: one line, no hang)
        raise InputError(WARMUP_MULTI)
    multi = pdecode.init_distributed(args.coordinator, args.num_processes, args.process_id, args.dist_timeout)
    # compiled programs kept on disk (PDECODE_COMPILE_CACHE_DIR; "off" to skip): a restart loads them
    cache = pdecode.enable_disk_cache()
    mesh = None
    if args.mesh or multi:
        import jax

        from infer.cli import _parse_mesh
        from pdecode.sharding import make_mesh

        mesh = _parse_mesh(args.mesh) if args.mesh else make_mesh(jax.process_count(), jax.local_device_count())
        pdecode.distributed.check_mesh(mesh)

    model, draft = served_models(args, mesh)
    speculation = speculation_mode(args.speculation, multi, args.spec_cost)
    if multi and args.warmup == "background":
        raise InputError(WARMUP_MULTI)
    background = args.warmup == "background" or (args.warmup is None and not multi)
    kv_pages = args.kv_pages
    if kv_pages is None and mesh is None and args.page_size > 0 and args.max_len % args.page_size == 0:
        kv_pages = args.slots * args.max_len // args.page_size  # the memory of --slots contiguous rows
    engine = Engine(model, method=args.method, draft=draft, slots=args.slots, max_len=args.max_len, chunk=args.chunk,
                    steps_per_call=args.steps_per_call, speculation=speculation, spec_cost=args.spec_cost,
                    grammar_states=args.grammar_states, grammar_transitions=args.grammar_transitions,
                    prefix_cache=args.prefix_cache, kv_pages=kv_pages or None, page_size=args.page_size, **options)
    logger.info("%s (%s, %d slots x %d) warming up ...", args.model, args.method, args.slots, args.max_len)
    if engine.kv_pages:
        logger.info("paged KV cache: %d pages of %d positions shared by the slots", engine.kv_pages, engine.page_size)
    _count_compiles()
    secs = engine.warmup(background=background)
    XLA_COMPILES["on"] = True
    logger.info("%d programs compiled in %.1fs (compilation cache: %s)", engine.compiles, secs, cache or "off")
    if engine.pending_programs:
        logger.info("%d more compile while serving (--warmup background); calls take ready programs that cover "
                    "them meanwhile", engine.pending_programs)
        threading.Thread(target=_log_warm, args=(engine,), daemon=True).start()
    if engine.adaptive:
        logger.info("speculation auto: a drafted step call costs %.2fx a plain one; steps draft while the tokens per "
                    "drafted step (measured as requests run) reach that", engine.spec_cost)
    elif engine.speculation_note:
        logger.info("%s", engine.speculation_note)
    server = Server(engine, args.served_name or args.model, drain_s=args.drain)
    if multi:
        import jax

        from pdecode import lockstep


        flags = pdecode.distributed.settings(args.coordinator, args.num_processes, args.process_id)
        if flags is not None:
            address = lockstep.control_address(flags["coordinator"], args.control_port)
        else:  # a Cloud TPU slice joined by JAX's own detection: worker 0 (JAX's coordinator host) leads
            hosts = [h for h in os.environ.get("TPU_WORKER_HOSTNAMES", "").split(",") if h]
            if not hosts:
                raise InputError("pdecode serve on several processes needs --coordinator (or PDECODE_COORDINATOR): "
                                 "its host carries the control channel")
            address = (hosts[0], args.control_port or lockstep.TPU_CONTROL_PORT)
        if not pdecode.distributed.is_main():  # no HTTP here: repeat process 0's engine calls until it stops
            logger.info("process %d follows process 0's engine rounds", jax.process_index())
            line = lockstep.follow(engine, address, jax.process_index(), timeout_s=args.dist_timeout + 60)
            logger.info("%s", line)
            return 0 if line == "stopped" else 3
        leader = lockstep.Leader(("0.0.0.0" if ":" not in address[0] else "::", address[1]),
                                 jax.process_count() - 1, timeout_s=args.dist_timeout + 60,
                                 on_lost=server.process_lost)
        server.lockstep = lockstep.LockstepEngine(engine, leader)
        logger.info("%d other process(es) follow this one's engine rounds", jax.process_count() - 1)
    asyncio.run(_serve(server, args.host, args.port))
    _exit_after_warmup(engine, server)
    logger.info("stopped")
    return 0


def _exit_after_warmup(engine, server) -> None:
    """A background warm-up still compiling when the server stops: the thread stops after the program in hand, if
    that ends by the drain deadline; else the process exits now, with 0, without waiting for the compiler (which
    cannot be interrupted, and a thread killed inside it ends the process with a C++ exception)."""
    if not engine.pending_programs:
        return
    left = server.drain_end - time.monotonic() if math.isfinite(server.drain_end) else server.drain_s
    if engine.stop_warmup(timeout=max(0.0, left)):
        logger.info("warm-up stopped with %d program(s) not compiled", engine.pending_programs)
        return
    logger.info("stopped (the warm-up thread was compiling a program: not waited for)")
    for h in logger.handlers:
        h.flush()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _setup_logging(level: str) -> None:
    """The server's log on stderr: the ``pdecode.serve`` logger at ``level`` (other loggers untouched)."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s pdecode serve: %(message)s"))
    logger.addHandler(handler)
    logger.setLevel(level.upper())
    logger.propagate = False


async def _serve(server: Server, host: str, port: int) -> None:
    """Serve until a signal. SIGTERM: drain while still listening (new requests get 503), then stop. SIGINT: stop
    listening, then drain (the app's on_shutdown)."""
    from aiohttp import web

    runner = web.AppRunner(server.app(), handle_signals=False, access_log=None, shutdown_timeout=server.drain_s + 10)
    await runner.setup()
    try:
        await web.TCPSite(runner, host, port).start()
        loop = asyncio.get_running_loop()
        stop = asyncio.Event()
        tasks = []

        def on_sigterm():
            if not tasks:
                logger.info("SIGTERM")
                tasks.append(loop.create_task(server.drain()))
                tasks[0].add_done_callback(lambda _: stop.set())

        def on_sigint():
            logger.info("SIGINT: no longer listening")
            stop.set()

        loop.add_signal_handler(signal.SIGTERM, on_sigterm)
        loop.add_signal_handler(signal.SIGINT, on_sigint)
        logger.info("listening on http://%s:%d", host, port)
        await stop.wait()
    finally:
        await runner.cleanup()  # stops listening, on_shutdown (the drain), closes connections, on_cleanup


def main(argv=None) -> int:
    from pdecode.cli_args import ArgumentParser

    ap = ArgumentParser(prog="pdecode serve", description=__doc__,
                        formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(ap)
    return run_from_args(ap.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
