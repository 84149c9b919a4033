"""`pdecode serve` as a client sees it: the official `openai` client (completions, chat, both streamed), concurrent
clients whose greedy answers equal `pdecode.generate`'s, every bad request a 4xx with a message, a client that
disconnects mid-stream frees its slot, an access-log line per request, an unexpected error a JSON 500 with its
traceback logged, SIGTERM drains (503 to new requests meanwhile) and cuts what outlasts --drain so that the client
sees an error, then exits. Servers bind 127.0.0.1 and are stopped by pid."""

import asyncio
import concurrent.futures as cf
import json
import logging
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

import pdecode

pytestmark = pytest.mark.xdist_group("serve")
ROOT = Path(__file__).resolve().parent.parent
ARGS = ["--model", "code-target", "--dtype", "float32", "--slots", "4", "--max-len", "256", "--chunk", "64"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProc:
    def __init__(self, extra=(), env_extra=None):
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        env = {**os.environ, "PYTHONPATH": str(ROOT), "XLA_FLAGS": "", **(env_extra or {})}
        self.log_path = Path(os.environ.get("TMPDIR", "/tmp")) / f"pdecode-serve-{self.port}.log"
        self.log = open(self.log_path, "w")
        self.proc = subprocess.Popen([sys.executable, "-m", "infer.serve", *ARGS, *extra, "--port", str(self.port)],
                                     cwd=ROOT, env=env, stdout=self.log, stderr=subprocess.STDOUT)
        t_end = time.time() + 300
        while time.time() < t_end:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited: {self.output()}")
            try:
                if get(self.url + "/health")[0] == 200:
                    return
            except OSError:
                pass
            time.sleep(0.5)
        self.stop()
        raise RuntimeError(f"the server did not come up: {self.output()}")

    def log_text(self) -> str:
        """Everything the server wrote (read through a file of its own: the server's offset is not moved)."""
        return self.log_path.read_text()

    def output(self) -> str:
        return self.log_text()[-3000:]

    def stop(self, timeout=60) -> int:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGTERM)
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            raise


def request(url, body=None, raw: bytes | None = None, method="POST", headers=False):
    """(status, body text), and the response headers when ``headers``."""
    data = raw if raw is not None else (None if body is None else json.dumps(body).encode())
    req = urllib.request.Request(url, data=data, method=method, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            out = r.status, r.read().decode(), r.headers
    except urllib.error.HTTPError as e:
        out = e.code, e.read().decode(), e.headers
    return out if headers else out[:2]


def get(url):
    return request(url, method="GET")


@pytest.fixture(scope="module")
def server():
    s = ServerProc()
    yield s
    assert s.stop() == 0, s.output()


@pytest.fixture
def shutdown_server(request):
    """A server of its own for a test that stops it: 2 slots over 1024 positions (a request of up to ~1000 tokens
    takes seconds here), --drain from the test's parameter (default 0.5 s), debug log."""
    drain = getattr(request, "param", 0.5)
    s = ServerProc(extra=["--slots", "2", "--max-len", "1024", "--drain", str(drain), "--log-level", "debug"])
    yield s
    if s.proc.poll() is None:
        s.proc.kill()
        s.proc.wait()


@pytest.fixture(scope="module")
def model():
    return pdecode.load("code-target", dtype="float32")


def _ref(model, prompt, n):
    return pdecode.generate(model, [prompt], max_new_tokens=n).texts[0]


def test_openai_client(server, model):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none")
    assert [m.id for m in client.models.list()] == ["code-target"]
    prompt = "def fib(n):"
    want = _ref(model, prompt, 24)
    r = client.completions.create(model="code-target", prompt=prompt, max_tokens=24, temperature=0)
    assert r.choices[0].text == want and r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 24 and r.usage.prompt_tokens == len(model.tokenizer.encode(prompt))
    pieces = [c.choices[0].text for c in client.completions.create(model="code-target", prompt=prompt, max_tokens=24,
                                                                    temperature=0, stream=True)]
    assert "".join(pieces) == want and len(pieces) > 2
    msgs = [{"role": "system", "content": "You write Python."}, {"role": "user", "content": "Sort a list."}]
    from pdecode import chat

    ids = chat.encode_chat(model.tokenizer, chat.render(model.tokenizer, msgs))
    want = pdecode.generate(model, [ids], max_new_tokens=16).texts[0]
    r = client.chat.completions.create(model="code-target", messages=msgs, max_tokens=16, temperature=0)
    assert r.choices[0].message.content == want and r.choices[0].message.role == "assistant"
    stream = client.chat.completions.create(model="code-target", messages=msgs, max_tokens=16, temperature=0,
                                            stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want
    assert chunks[-1].usage.completion_tokens == 16
    # logprobs and a seeded sample
    r = client.completions.create(model="code-target", prompt=prompt, max_tokens=8, temperature=0, logprobs=0)
    assert len(r.choices[0].logprobs.token_logprobs) == 8 and all(x <= 0 for x in r.choices[0].logprobs.token_logprobs)
    a = client.completions.create(model="code-target", prompt=prompt, max_tokens=12, temperature=1.0, seed=7)
    b = client.completions.create(model="code-target", prompt=prompt, max_tokens=12, temperature=1.0, seed=7)
    assert a.choices[0].text == b.choices[0].text


def test_concurrent_clients_get_generates_answers(server, model):
    prompts = ["def fib(n):", "import os\n", "class Stack:\n", "x = [", "def main():\n    args = ", "for i in range(",
               "# utilities\n", "while True:\n", "try:\n    import json\n", "def f(a, b):\n    return"]
    budgets = [30, 12, 45, 8, 25, 17, 40, 5, 33, 21]

    def one(i):
        body = {"prompt": prompts[i], "max_tokens": budgets[i], "temperature": 0, "stream": i % 2 == 1}
        status, text = request(server.url + "/v1/completions", body)
        assert status == 200, text
        if body["stream"]:
            frames = [ln[6:] for ln in text.splitlines() if ln.startswith("data: ")]
            assert frames[-1] == "[DONE]"
            return "".join(json.loads(f)["choices"][0]["text"] for f in frames[:-1])
        return json.loads(text)["choices"][0]["text"]

    with cf.ThreadPoolExecutor(len(prompts)) as ex:
        got = list(ex.map(one, range(len(prompts))))
    ref = pdecode.generate(model, prompts, max_new_tokens=budgets).texts  # one budget per row, one compile
    for p, want, g in zip(prompts, ref, got):
        assert g == want, p
    # warm-up in the background (the default): the server took requests before its last programs were compiled
    t_end = time.time() + 300
    while (h := json.loads(get(server.url + "/health")[1]))["programs_pending"] and time.time() < t_end:
        time.sleep(0.5)
    assert h["programs_pending"] == 0 and h["compiles_since_warmup"] == 0  # (the warm-up thread's not counted)
    assert "more compile while serving" in server.log_text() and "every program is ready" in server.log_text()


BAD = [
    ("/v1/completions", b"{not json", 400, "not valid JSON"),
    ("/v1/completions", b"[1, 2]", 400, "JSON object"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 4, "frobnicate": 1}, 400, "unknown field 'frobnicate'"),
    ("/v1/completions", {"prompt": "x", "temperature": 7}, 400, "temperature must be <= 2"),
    ("/v1/completions", {"prompt": "x", "top_p": 0}, 400, "top_p must be > 0"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 0}, 400, "max_tokens must be >= 1"),
    ("/v1/completions", {"prompt": "x", "max_tokens": "ten"}, 400, "max_tokens must be an integer"),
    ("/v1/completions", {"prompt": "x" * 4000}, 400, "shorten the prompt"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 10000}, 400, "ask for at most"),
    ("/v1/completions", {"prompt": "x", "n": 17}, 400, "n must be <= 16"),
    ("/v1/completions", {"prompt": "x", "n": 2, "best_of": 1}, 400, "best_of (1) must be at least n (2)"),
    ("/v1/completions", {"prompt": "x", "best_of": 3, "stream": True}, 400, "best_of > n cannot be streamed"),
    ("/v1/completions", {"prompt": "x", "logprobs": 21}, 400, "logprobs must be <= 20"),
    ("/v1/completions", {"prompt": "x", "echo": True, "stream": True}, 400, "echo cannot be streamed"),
    ("/v1/completions", {"prompt": "x", "echo": "yes"}, 400, "echo must be true or false"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 0}, 400, "max_tokens must be >= 1"),
    ("/v1/completions", {"prompt": "x", "presence_penalty": 3}, 400, "presence_penalty must be <= 2"),
    ("/v1/completions", {"prompt": "x", "logit_bias": {"99999": 1}}, 400, "logit_bias keys must be token ids"),
    ("/v1/completions", {"prompt": "x", "logit_bias": {"5": 300}}, 400, "logit_bias values must be numbers"),
    ("/v1/completions", {"prompt": "x", "logit_bias": [5]}, 400, "logit_bias must be an object"),
    ("/v1/completions", {"prompt": "x", "stop": [""]}, 400, "stop must be"),
    ("/v1/completions", {"prompt": 5}, 400, "prompt must be"),
    ("/v1/completions", {"prompt": [[1, -4]]}, 400, "token ids must lie"),
    ("/v1/completions", {"prompt": "x", "stream": "yes"}, 400, "stream must be true or false"),
    ("/v1/completions", {"prompt": "x", "model": "gpt-9"}, 404, "not served here"),
    ("/v1/chat/completions", {"max_tokens": 3}, 400, "messages is required"),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}, 400, "role must be one of"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, 400,
     "top_logprobs needs logprobs: true"),
    ("/v1/nowhere", {"prompt": "x"}, 404, "Not Found"),
    ("/v1/completions", {"prompt": "x", "stream": True, "stream_options": {"usage": True}}, 400, "stream_options takes"),
    ("/tokenize", {"prompt": "x", "messages": []}, 400, "exactly one of prompt"),
    ("/tokenize", {"prompt": 3}, 400, "prompt must be a string"),
    ("/tokenize", {"text": "x"}, 400, "unknown field 'text'"),
    ("/detokenize", {"tokens": [1, -2]}, 400, "token ids in"),
    ("/detokenize", {"tokens": "abc"}, 400, "token ids in"),
    ("/v1/completions", {"prompt": "x", "ignore_eos": "yes"}, 400, "ignore_eos must be true or false"),
    ("/v1/completions", {"prompt": "x", "min_tokens": 9, "max_tokens": 4}, 400, "min_tokens (9) is larger"),
]


@pytest.mark.parametrize("path,body,status,msg", BAD, ids=[f"{i}-{b[3][:20]}" for i, b in enumerate(BAD)])
def test_bad_requests_get_4xx_with_a_message(server, path, body, status, msg):
    raw = body if isinstance(body, bytes) else None
    code, text = request(server.url + path, None if raw else body, raw=raw)
    assert code == status, text
    err = json.loads(text)["error"]
    assert msg in err["message"], err


def test_models_tokenize_developer_role_and_continuous_usage(server, model):
    """What lm-eval and load testers read: the context length in /v1/models (and /v1/models/{id}); /tokenize and
    /detokenize; the developer role (as system); usage in every streamed chunk with continuous_usage_stats."""
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none")
    card = json.loads(get(server.url + "/v1/models")[1])["data"][0]
    assert card["max_model_len"] == 255 and card["context_length"] == 255  # --max-len 256, ar: one slot kept
    assert client.models.retrieve("code-target").id == "code-target"
    assert get(server.url + "/v1/models/gpt-9")[0] == 404
    code, text = request(server.url + "/tokenize", {"prompt": "def fib(n):"})
    got = json.loads(text)
    assert code == 200 and got["tokens"] == model.tokenizer.encode("def fib(n):") and got["count"] == len(got["tokens"])
    assert json.loads(request(server.url + "/detokenize", {"tokens": got["tokens"]})[1])["prompt"] == \
        model.tokenizer.decode(got["tokens"])
    msgs = [{"role": "developer", "content": "You write Python."}, {"role": "user", "content": "Sort a list."}]
    as_system = [{**msgs[0], "role": "system"}, msgs[1]]
    chat_ids = json.loads(request(server.url + "/tokenize", {"messages": msgs})[1])["tokens"]
    assert chat_ids == json.loads(request(server.url + "/tokenize", {"messages": as_system})[1])["tokens"]
    a = client.chat.completions.create(model="code-target", messages=msgs, max_tokens=8, temperature=0)
    b = client.chat.completions.create(model="code-target", messages=as_system, max_tokens=8, temperature=0)
    assert a.choices[0].message.content == b.choices[0].message.content
    chunks = list(client.completions.create(model="code-target", prompt="def fib(n):", max_tokens=12, temperature=0,
                                            stream=True, stream_options={"include_usage": True,
                                                                         "continuous_usage_stats": True}))
    sofar = [c.usage.completion_tokens for c in chunks if c.choices]
    assert all(c.usage is not None for c in chunks) and sofar == sorted(sofar) and sofar[-1] == 12
    assert chunks[-1].usage.completion_tokens == 12 and not chunks[-1].choices
    r = client.completions.create(model="code-target", prompt="def fib(n):", max_tokens=6, temperature=0,
                                  extra_body={"ignore_eos": True})  # (guidellm's default request)
    assert r.usage.completion_tokens == 6


def test_penalties_logit_bias_and_min_tokens_like_generate(server, model):
    """presence / frequency penalties, logit_bias (ids as JSON's string keys) and min_tokens reach the engine's
    slots: greedy output equal to `pdecode.generate` with the same controls, streamed or not; a bias of +100 on a
    token makes every token that one."""
    import pdecode

    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none")
    free = pdecode.generate(model, ["def fib(n):"], max_new_tokens=12, stop_at_eos=False)
    sid = free.tokens[0][1]
    kw = dict(presence_penalty=0.7, frequency_penalty=0.9, logit_bias={free.tokens[0][4]: -4.0, 11: 2.0})
    want = pdecode.generate(model, ["def fib(n):"], max_new_tokens=12, stop_token_ids=[sid], min_tokens=5, **kw)
    assert want.tokens != free.tokens and len(want.tokens[0]) >= 5
    body = dict(presence_penalty=0.7, frequency_penalty=0.9,
                logit_bias={str(k): v for k, v in kw["logit_bias"].items()})
    extra = {"min_tokens": 5, "stop_token_ids": [sid]}
    r = client.completions.create(model="code-target", prompt="def fib(n):", max_tokens=12, temperature=0,
                                  extra_body=extra, **body)
    assert r.choices[0].text == want.texts[0]
    streamed = client.completions.create(model="code-target", prompt="def fib(n):", max_tokens=12, temperature=0,
                                         stream=True, extra_body=extra, **body)
    assert "".join(c.choices[0].text for c in streamed if c.choices) == want.texts[0]
    forced = client.completions.create(model="code-target", prompt="x = ", max_tokens=4, temperature=0,
                                       logit_bias={"9": 100})
    assert forced.choices[0].text == model.tokenizer.decode([9] * 4)


def test_structured_output(server, model):
    """response_format json_schema / json_object and vLLM's guided_regex / guided_choice through the openai client:
    greedy output = `pdecode.generate` with the same grammar, every answer parses (and validates); bad grammars 400."""
    openai = pytest.importorskip("openai")
    jsonschema = pytest.importorskip("jsonschema")
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none")
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8}, "ok": {"type": "boolean"}},
              "required": ["name", "ok"]}
    msgs = [{"role": "user", "content": "Describe a list as JSON."}]
    from pdecode import chat

    ids = chat.encode_chat(model.tokenizer, chat.render(model.tokenizer, msgs))
    want = pdecode.generate(model, [ids], max_new_tokens=48, json_schema=schema).texts[0]
    fmt = {"type": "json_schema", "json_schema": {"name": "thing", "schema": schema, "strict": True}}
    r = client.chat.completions.create(model="code-target", messages=msgs, max_tokens=48, temperature=0,
                                       response_format=fmt)
    assert r.choices[0].message.content == want and r.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(want), schema)
    for c in client.chat.completions.create(model="code-target", messages=msgs, max_tokens=48, temperature=1.0,
                                            seed=3, n=3, response_format=fmt).choices:
        if c.finish_reason == "stop":
            jsonschema.validate(json.loads(c.message.content), schema)
    pieces = [c.choices[0].delta.content or "" for c in client.chat.completions.create(
        model="code-target", messages=msgs, max_tokens=48, temperature=0, response_format=fmt, stream=True)
        if c.choices]
    assert "".join(pieces) == want
    r = client.completions.create(model="code-target", prompt="config = ", max_tokens=64, temperature=0,
                                  extra_body={"response_format": {"type": "json_object"}})
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(r.choices[0].text), dict)
    r = client.completions.create(model="code-target", prompt="answer: ", max_tokens=8, temperature=1.0, seed=1,
                                  extra_body={"guided_choice": ["yes", "no", "maybe so"]})
    assert r.choices[0].text in ("yes", "no", "maybe so")
    r = client.completions.create(model="code-target", prompt="phone: ", max_tokens=12, temperature=0,
                                  extra_body={"guided_regex": r"[0-9]{3}-[0-9]{4}"})
    assert re.fullmatch(r"[0-9]{3}-[0-9]{4}", r.choices[0].text)
    bad = [({"response_format": {"type": "xml"}}, "response_format must be"),
           ({"response_format": {"type": "json_schema", "json_schema": {"schema": "x"}}}, "json_schema needs"),
           ({"guided_regex": "[0-9"}, "cannot compile"),
           ({"guided_choice": "yes"}, "guided_choice must be"),
           ({"guided_regex": "a", "response_format": {"type": "json_object"}}, "not both"),
           ({"guided_regex": "a+", "min_tokens": 2}, "min_tokens"),
           ({"guided_json": {"type": "objekt"}}, "breaks the JSON Schema spec at type"),
           ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
               "type": "object", "properties": {"a": {"type": "integer", "minimum": "ten"}}}}}},
            "at properties.a.minimum: 'ten' is not of type 'number'")]
    for extra, msg in bad:
        status, text = request(server.url + "/v1/completions", {"prompt": "x", "max_tokens": 4, **extra})
        assert status == 400 and msg in json.loads(text)["error"]["message"], (extra, text)


def test_prometheus_metrics(server):
    """/metrics (Prometheus text): requests by endpoint and status, tokens, TTFT / inter-token / e2e histograms,
    slots, queue, compiles since warm-up; each moves by what one request did; usage carries tokens_per_forward."""
    from prometheus_client.parser import text_string_to_metric_families

    def scrape():
        code, text = get(server.url + "/metrics")
        assert code == 200
        return {(s.name, tuple(sorted((k, v) for k, v in s.labels.items() if k not in ("model", "method")))): s.value
                for f in text_string_to_metric_families(text) for s in f.samples}

    before = scrape()
    code, text = request(server.url + "/v1/completions", {"prompt": "def fib(n):", "max_tokens": 7,
                                                          "temperature": 0, "stream": True,
                                                          "stream_options": {"include_usage": True}})
    usage = [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: {")][-1]["usage"]
    assert code == 200 and usage["completion_tokens"] == 7 and usage["tokens_per_forward"] == 1.0  # (ar)
    assert request(server.url + "/v1/completions", {"prompt": "x", "top_p": 0})[0] == 400
    after = scrape()
    d = lambda name, **lb: after.get((name, tuple(sorted(lb.items()))), 0) - before.get(  # noqa: E731
        (name, tuple(sorted(lb.items()))), 0)
    assert d("pdecode_requests_total", endpoint="/v1/completions", status="200") == 1
    assert d("pdecode_requests_total", endpoint="/v1/completions", status="400") == 1
    assert d("pdecode_generation_tokens_total") == 7 and d("pdecode_target_forwards_total") == 7
    assert d("pdecode_prompt_tokens_total") == usage["prompt_tokens"]
    assert d("pdecode_time_to_first_token_seconds_count") == 1 and d("pdecode_e2e_request_latency_seconds_count") == 1
    assert d("pdecode_inter_token_latency_seconds_count") == 6  # 7 tokens: 6 gaps
    assert d("pdecode_request_finished_total", finish_reason="length") == 1
    assert after[("pdecode_slots", ())] == 4 and after[("pdecode_compiles_since_warmup", ())] == 0
    assert after[("pdecode_slots_in_use", ())] == 0 and after[("pdecode_queue_length", ())] == 0
    # the paged KV cache by default: --slots x --max-len positions in pages of 16, all free again
    assert after[("pdecode_kv_pages_in_use", ())] == 0 and after[("pdecode_kv_page_waits", ())] == 0
    assert "paged KV cache: 64 pages of 16 positions" in server.log_text()


def test_n_and_best_of(server):
    """n choices per prompt, choice j sampled with seed + j (so each equals the one-choice request with that seed),
    streamed or not, completions and chat; best_of returns the n of its candidates with the highest total
    log-probability."""
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none")
    kw = dict(model="code-target", prompt="def fib(n):", max_tokens=6, temperature=1.0)
    singles = [client.completions.create(seed=5 + j, logprobs=0, **kw).choices[0] for j in range(3)]
    assert len({c.text for c in singles}) > 1
    many = client.completions.create(seed=5, n=3, **kw)
    assert [c.index for c in many.choices] == [0, 1, 2]
    assert [c.text for c in many.choices] == [c.text for c in singles]
    streamed = {}
    for ch in client.completions.create(seed=5, n=3, stream=True, **kw):
        for c in ch.choices:
            streamed[c.index] = streamed.get(c.index, "") + c.text
    assert [streamed[i] for i in range(3)] == [c.text for c in singles]
    best = client.completions.create(seed=5, n=1, best_of=3, **kw).choices
    top = max(singles, key=lambda c: sum(c.logprobs.token_logprobs))
    assert len(best) == 1 and best[0].text == top.text and best[0].logprobs is None
    msgs = [{"role": "user", "content": "Sort a list."}]
    chat = client.chat.completions.create(model="code-target", messages=msgs, max_tokens=5, temperature=0, n=2)
    assert [c.index for c in chat.choices] == [0, 1] and chat.choices[0].message.content == \
        chat.choices[1].message.content


def test_echo_and_top_logprobs_score_like_forward_logits(server, model):
    """lm-evaluation-harness's loglikelihood request (echo, logprobs=1, max_tokens=1): every prompt token after the
    first gets its log-probability given the ones before (the first none), equal to `pdecode.forward_logits`'s, with
    its top alternative; max_tokens=0 only scores; logprobs=k gives k alternatives per generated token, and chat's
    top_logprobs the same."""
    import numpy as np

    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none")
    prompt = "def fib(n):\n    return fib(n - 1) + fib(n - 2)"
    ids = model.tokenizer.encode(prompt)
    logp = np.asarray(jax_log_softmax(pdecode.forward_logits(model, [ids])[0]))
    want = [float(logp[t - 1, ids[t]]) for t in range(1, len(ids))]
    r = client.completions.create(model="code-target", prompt=prompt, max_tokens=1, temperature=0, echo=True,
                                  logprobs=1)
    lp = r.choices[0].logprobs
    assert r.choices[0].text.startswith(prompt) and len(lp.tokens) == len(ids) + 1
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    np.testing.assert_allclose(lp.token_logprobs[1: len(ids)], want, atol=2e-3)
    assert abs(sum(lp.token_logprobs[1: len(ids)]) - sum(want)) <= 2e-3
    for t in range(1, len(ids)):  # the top-1 alternative is the argmax of the same distribution
        (text, v), = lp.top_logprobs[t].items()
        assert text == model.tokenizer.decode([int(logp[t - 1].argmax())]) and abs(v - logp[t - 1].max()) < 2e-3
    # lm-eval's own requests (infer/lmeval_run.py runs lm-eval itself): token-id prompts, several per call, a seed
    ids2 = model.tokenizer.encode("assert 1 + 2 == 3")
    body = {"model": "code-target", "prompt": [ids, ids2], "temperature": 0, "max_tokens": 1, "logprobs": 1,
            "seed": 1234, "echo": True}
    got = json.loads(request(server.url + "/v1/completions", body)[1])["choices"]
    assert [c["index"] for c in got] == [0, 1]
    logp2 = np.asarray(jax_log_softmax(pdecode.forward_logits(model, [ids2])[0]))
    for c, toks, lp_ in ((got[0], ids, logp), (got[1], ids2, logp2)):
        np.testing.assert_allclose(c["logprobs"]["token_logprobs"][1:len(toks)],
                                   [float(lp_[t - 1, toks[t]]) for t in range(1, len(toks))], atol=2e-3)
    gen = json.loads(request(server.url + "/v1/completions", {"model": "code-target", "prompt": ["def f(x):", "import"],
                                                           "max_tokens": 8, "temperature": 0, "stop": ["\n"],
                                                           "seed": 1234})[1])["choices"]
    assert len(gen) == 2 and all("\n" not in c["text"] for c in gen)
    only = client.completions.create(model="code-target", prompt=prompt, max_tokens=0, echo=True, logprobs=0)
    assert only.choices[0].text == prompt and only.usage.completion_tokens == 0
    np.testing.assert_allclose(only.choices[0].logprobs.token_logprobs[1:], want, atol=2e-3)
    r = client.completions.create(model="code-target", prompt="def fib(n):", max_tokens=6, temperature=0, logprobs=3)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == 6 and all(len(top) == 3 for top in lp.top_logprobs)
    assert all(max(top, key=top.get) == t for top, t in zip(lp.top_logprobs, lp.tokens))  # greedy: the top-1
    c = client.chat.completions.create(model="code-target", messages=[{"role": "user", "content": "Sort a list."}],
                                       max_tokens=5, temperature=0, logprobs=True, top_logprobs=2)
    content = c.choices[0].logprobs.content
    assert len(content) == 5 and all(len(x.top_logprobs) == 2 and x.top_logprobs[0].token == x.token
                                     for x in content)
    # the context (--max-len 256: 255) said one way everywhere: a scoring request (echo, max_tokens 0) may fill it,
    # a generating one leaves a token of room, and the errors name the same number (here, after
    # test_prometheus_metrics: the scoring forward at this length compiles)
    full = [5 + i % 50 for i in range(255)]
    code, text = request(server.url + "/v1/completions", {"prompt": full, "echo": True, "max_tokens": 0,
                                                          "logprobs": 0})
    assert code == 200 and len(json.loads(text)["choices"][0]["logprobs"]["token_logprobs"]) == 255, text
    code, text = request(server.url + "/v1/completions", {"prompt": full + [5], "echo": True, "max_tokens": 0})
    assert code == 400 and "context holds 255" in text, text
    code, text = request(server.url + "/v1/completions", {"prompt": full[:-1] + [10**6], "echo": True,
                                                          "max_tokens": 0})
    assert code == 400 and "token ids must lie in" in text, text
    code, text = request(server.url + "/v1/completions", {"prompt": full, "max_tokens": 1})
    assert code == 400 and "context holds 255 tokens" in text and "at most 254" in text, text
    code, text = request(server.url + "/v1/completions", {"prompt": full[:250], "max_tokens": 6})
    assert code == 400 and "context (255): ask for at most 5 tokens" in text, text
    code, text = request(server.url + "/v1/completions", {"prompt": "x", "max_tokens": 0})
    assert code == 400 and "0 only with echo" in text, text


def jax_log_softmax(x):
    import jax

    return jax.nn.log_softmax(x.astype("float32"), axis=-1)


def test_disconnect_mid_stream_frees_the_slot(server, model):
    body = json.dumps({"prompt": "def fib(n):", "max_tokens": 200, "temperature": 0, "stream": True}).encode()
    s = socket.create_connection(("127.0.0.1", server.port))
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
    got = b""
    while got.count(b"data: ") < 2:
        got += s.recv(4096)
    s.close()
    t_end = time.time() + 30
    while time.time() < t_end:
        h = json.loads(get(server.url + "/health")[1])
        if h["in_flight"] == 0:
            break
        time.sleep(0.2)
    assert h["in_flight"] == 0, h
    assert json.loads(request(server.url + "/v1/completions", {"prompt": "import os\n", "max_tokens": 6,
                                                              "temperature": 0})[1])["choices"][0]["text"] \
        == _ref(model, "import os\n", 6)


def _wait_in_flight(srv, n):
    t_end = time.time() + 30
    while json.loads(get(srv.url + "/health")[1])["in_flight"] < n and time.time() < t_end:
        time.sleep(0.02)


@pytest.mark.parametrize("shutdown_server", [30], indirect=True)
def test_sigterm_drains_requests_in_flight_and_exits(shutdown_server):
    """While it drains the server still listens and answers new requests 503 with Retry-After; the requests in
    flight (two decoding, one queued for a slot) finish normally; then it exits 0."""
    srv = shutdown_server
    body = {"prompt": "def f():", "max_tokens": 150, "temperature": 0}
    with cf.ThreadPoolExecutor(3) as ex:
        futs = [ex.submit(request, srv.url + "/v1/completions", body) for _ in range(3)]
        _wait_in_flight(srv, 3)
        os.kill(srv.proc.pid, signal.SIGTERM)
        t_end = time.time() + 10
        while (h := get(srv.url + "/health"))[0] != 503 and time.time() < t_end:
            time.sleep(0.02)
        assert h[0] == 503 and json.loads(h[1])["status"] == "draining", h
        status, text, headers = request(srv.url + "/v1/completions", {"prompt": "x", "max_tokens": 2}, headers=True)
        assert json.loads(get(srv.url + "/health")[1])["in_flight"] > 0  # the 503 came while they ran
        assert status == 503 and int(headers["Retry-After"]) >= 1, (status, text, dict(headers))
        assert json.loads(text)["error"]["type"] == "server_shutdown"
        results = [f.result(timeout=120) for f in futs]
    for status, text in results:
        assert status == 200 and json.loads(text)["usage"]["completion_tokens"] == 150, text
        assert json.loads(text)["choices"][0]["finish_reason"] == "length"
    assert srv.proc.wait(timeout=60) == 0, srv.output()
    log = srv.log_text()
    assert "stopped" in log and "cutting" not in log
    assert "GET /health 200" in log  # --log-level debug logs passing health checks too


def test_sigterm_while_warmup_compiles_exits_within_the_drain(tmp_path):
    """SIGTERM while the background warm-up is still compiling (a compilation cache of its own, so it compiles):
    the server exits 0 within its --drain deadline and a little, without a logging error or a traceback, even though
    an XLA compile cannot be interrupted."""
    srv = ServerProc(extra=["--slots", "2", "--max-len", "1024", "--drain", "1"],
                     env_extra={"JAX_COMPILATION_CACHE_DIR": str(tmp_path / "xla")})
    try:
        h = json.loads(get(srv.url + "/health")[1])
        assert h["programs_pending"] > 0, h  # still compiling
        t0 = time.time()
        os.kill(srv.proc.pid, signal.SIGTERM)
        rc = srv.proc.wait(timeout=60)
        waited = time.time() - t0
    finally:
        if srv.proc.poll() is None:
            srv.proc.kill()
            srv.proc.wait()
    log = srv.log_text()
    assert rc == 0 and "Logging error" not in log and "Traceback" not in log, log[-3000:]
    assert "stopped" in log and waited < 1 + 4, (waited, log[-2000:])  # the drain, then the process's own exit


def test_requests_past_the_drain_deadline_are_cut_with_an_error(shutdown_server):
    """A stream still running at the --drain deadline ends with an error event and no [DONE] (the openai client
    raises, not a normal end); a plain request gets a 503; the server exits 0."""
    openai = pytest.importorskip("openai")
    srv = shutdown_server
    client = openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0)
    with cf.ThreadPoolExecutor(1) as ex:
        plain = ex.submit(request, srv.url + "/v1/completions",
                          {"prompt": "def f():", "max_tokens": 1000, "temperature": 0}, headers=True)
        stream = iter(client.completions.create(model="code-target", prompt="def f():", max_tokens=1000,
                                                temperature=0, stream=True))
        pieces = [next(stream).choices[0].text for _ in range(3)]
        _wait_in_flight(srv, 2)
        t0 = time.time()
        os.kill(srv.proc.pid, signal.SIGTERM)
        with pytest.raises(openai.APIError, match="drain deadline"):
            for c in stream:
                pieces.append(c.choices[0].text)
        waited = time.time() - t0
        status, text, headers = plain.result(timeout=60)
    assert waited >= 0.4 and len(pieces) > 3  # cut at the deadline (0.5 s), not at the signal
    assert status == 503 and json.loads(text)["error"]["type"] == "server_shutdown" and headers["Retry-After"]
    assert srv.proc.wait(timeout=60) == 0, srv.output()
    assert "cutting 2 request(s)" in srv.log_text()


def test_access_log_line_per_request(server, model):
    """One line per request on the server's log: method, path, status, token counts, times, tokens per forward;
    a rejected request's line has its status and message."""
    before = len(server.log_text())
    prompt = "import sys\n"
    assert request(server.url + "/v1/completions", {"prompt": prompt, "max_tokens": 5, "temperature": 0})[0] == 200
    assert request(server.url + "/v1/completions", {"prompt": prompt, "max_tokens": 5, "top_p": 0})[0] == 400
    lines = [ln for ln in server.log_text()[before:].splitlines() if "POST /v1/" in ln]
    n = len(model.tokenizer.encode(prompt))
    assert len(lines) == 2, lines
    assert re.search(rf"INFO .*POST /v1/completions 200 prompt_tokens={n} completion_tokens=5 ttft=0\.\d+s "
                     rf"time=\d+\.\d+s tokens_per_forward=1\.00 finish=length", lines[0]), lines[0]
    assert re.search(r"POST /v1/completions 400 prompt_tokens=0 completion_tokens=0 .*"
                     r'error="top_p must be > 0', lines[1]), lines[1]
    assert "GET /health 200" not in server.log_text()  # passing health checks only at --log-level debug


class _FailingEngine:
    """Enough of an `Engine` for the server, whose device fails at the first request."""

    class model:
        generation_config: dict = {}
        tokenizer = None

    method, slots, queue, running, idle = "ar", 1, (), {}, True

    def check(self, prompt, **controls):
        return controls

    def submit(self, *args, **kwargs):
        raise RuntimeError("device lost")


def test_unexpected_error_is_a_json_500_with_a_traceback_in_the_log(caplog):
    from aiohttp.test_utils import TestClient, TestServer

    from infer.serve import Server

    async def go():
        async with TestClient(TestServer(Server(_FailingEngine(), "broken").app())) as client:
            r = await client.post("/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 2})
            s = await client.post("/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 2, "stream": True})
            return r.status, await r.json(), s.status, await s.text()

    with caplog.at_level(logging.INFO, logger="pdecode.serve"):
        status, body, s_status, s_text = asyncio.run(go())
    assert status == 500 and body["error"]["type"] == "server_error" and "device lost" in body["error"]["message"]
    frames = [ln[6:] for ln in s_text.splitlines() if ln.startswith("data: ")]
    assert s_status == 200 and json.loads(frames[-1])["error"]["type"] == "server_error" and "[DONE]" not in frames
    recs = [r for r in caplog.records if r.name == "pdecode.serve"]
    tracebacks = [r for r in recs if r.exc_info and "POST /v1/completions" in r.getMessage()]
    assert len(tracebacks) == 2 and "Traceback" in caplog.text and "RuntimeError: the engine failed" in caplog.text
    assert any(r.getMessage().startswith("POST /v1/completions 500 ") for r in recs)


def test_heads_attach_by_name():
    """`pdecode serve --model M --heads NAME --method eagle`: the heads trained for M, attached by name."""
    import argparse

    from infer.serve import add_arguments, served_models

    ap = argparse.ArgumentParser()
    add_arguments(ap)
    model, draft = served_models(ap.parse_args(["--model", "code-target", "--heads", "code-target-eagle",
                                                "--method", "eagle", "--dtype", "float32"]))
    assert "eagle" in model.extras and draft is None and model.cfg.num_layers == pdecode.load("code-target").cfg.num_layers
    with pytest.raises(pdecode.CheckpointError, match="no model 'no-such-heads'"):
        served_models(ap.parse_args(["--model", "code-target", "--heads", "no-such-heads"]))
