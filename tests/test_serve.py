"""`pdecode serve` as a client sees it: the official `openai` client (completions, chat, both streamed), concurrent
clients whose greedy answers equal `pdecode.generate`'s, every bad request a 4xx with a message, a client that
disconnects mid-stream frees its slot, SIGTERM drains and exits. Servers bind 127.0.0.1 and are stopped by pid."""

import concurrent.futures as cf
import json
import os
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
    def __init__(self, extra=()):
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        env = {**os.environ, "PYTHONPATH": str(ROOT), "XLA_FLAGS": ""}
        self.log = open(Path(os.environ.get("TMPDIR", "/tmp")) / f"pdecode-serve-{self.port}.log", "w+")
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

    def output(self) -> str:
        self.log.flush()
        self.log.seek(0)
        return self.log.read()[-3000:]

    def stop(self, timeout=60) -> int:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGTERM)
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            raise


def request(url, body=None, raw: bytes | None = None, method="POST"):
    data = raw if raw is not None else (None if body is None else json.dumps(body).encode())
    req = urllib.request.Request(url, data=data, method=method, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def get(url):
    return request(url, method="GET")


@pytest.fixture(scope="module")
def server():
    s = ServerProc()
    yield s
    assert s.stop() == 0, s.output()


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
    assert json.loads(get(server.url + "/health")[1])["compiles_since_warmup"] == 0


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
    ("/v1/completions", {"prompt": "x", "n": 2}, 400, "n > 1 is not supported"),
    ("/v1/completions", {"prompt": "x", "logprobs": 3}, 400, "top logprobs are not supported"),
    ("/v1/completions", {"prompt": "x", "presence_penalty": 0.5}, 400, "repetition_penalty"),
    ("/v1/completions", {"prompt": "x", "stop": [""]}, 400, "stop must be"),
    ("/v1/completions", {"prompt": 5}, 400, "prompt must be"),
    ("/v1/completions", {"prompt": [[1, -4]]}, 400, "token ids must lie"),
    ("/v1/completions", {"prompt": "x", "stream": "yes"}, 400, "stream must be true or false"),
    ("/v1/completions", {"prompt": "x", "model": "gpt-9"}, 404, "not served here"),
    ("/v1/chat/completions", {"max_tokens": 3}, 400, "messages is required"),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}, 400, "role must be one of"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, 400,
     "top_logprobs is not supported"),
    ("/v1/nowhere", {"prompt": "x"}, 404, "Not Found"),
]


@pytest.mark.parametrize("path,body,status,msg", BAD, ids=[f"{i}-{b[3][:20]}" for i, b in enumerate(BAD)])
def test_bad_requests_get_4xx_with_a_message(server, path, body, status, msg):
    raw = body if isinstance(body, bytes) else None
    code, text = request(server.url + path, None if raw else body, raw=raw)
    assert code == status, text
    err = json.loads(text)["error"]
    assert msg in err["message"], err


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


def test_sigterm_drains_requests_in_flight_and_exits():
    srv = ServerProc(extra=["--slots", "2"])
    with cf.ThreadPoolExecutor(1) as ex:
        fut = ex.submit(request, srv.url + "/v1/completions", {"prompt": "def f():", "max_tokens": 150,
                                                               "temperature": 0})
        t_end = time.time() + 30
        while json.loads(get(srv.url + "/health")[1])["in_flight"] == 0 and time.time() < t_end:
            time.sleep(0.05)
        assert srv.stop() == 0, srv.output()
        status, text = fut.result(timeout=60)
    assert status == 200 and json.loads(text)["usage"]["completion_tokens"] == 150
    assert "stopped" in srv.output()
