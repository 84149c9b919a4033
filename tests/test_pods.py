"""Multi-host runs on one machine (issue 31): two processes with 4 forced CPU devices each join one runtime over
gloo (127.0.0.1) and decode on a 2x4 mesh spanning both; every method tried gives the tokens one process with all 8
devices gives. Bad input (an id out of range, no coordinator, a mesh short of the run's devices, prompts that
differ between processes) is one line and a non-zero exit within a bounded time."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import pytest

import pdecode

ROOT = Path(__file__).resolve().parent.parent
WORKER = str(ROOT / "tests" / "pods_worker.py")
pytestmark = pytest.mark.xdist_group("pods")  # its subprocesses take both cores: one worker runs them


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env(devices: int) -> dict:
    env = dict(os.environ)
    flags = [f for f in env.get("XLA_FLAGS", "").split() if "device_count" not in f]
    env["XLA_FLAGS"] = " ".join(flags + [f"--xla_force_host_platform_device_count={devices}"])
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env.pop("PDECODE_COORDINATOR", None)
    return env


def _pair(argv_of, timeout: float = 400, env: dict | None = None):
    """Run two processes (argv_of(i) for i = 0, 1) to the end: [(rc, stdout, stderr)] in order."""
    procs = [subprocess.Popen(argv_of(i), env={**_env(4), **(env or {})}, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for i in range(2)]
    try:
        return [(p.wait(timeout=timeout), p.stdout.read(), p.stderr.read()) for p in procs]
    finally:
        for p in procs:
            p.kill()


def _wide_checkpoint(d: Path) -> int:
    """A random Llama whose weights split evenly over 8 devices (8 heads, wide MLP rows), as HF safetensors (hf/)
    and orbax (orbax/); returns the orbax directory's bytes on disk."""
    from pdecode.checkpoint import orbax as orbax_ckpt
    from pdecode.checkpoint.hf import save_hf
    from pdecode.config import ModelConfig
    from pdecode.model.transformer import init_params

    cfg = ModelConfig(vocab_size=4096, hidden_size=512, intermediate_size=4096, num_layers=2, num_heads=8,
                      num_kv_heads=8, head_dim=64)
    params = jax.tree.map(lambda a: a.astype("bfloat16"), init_params(cfg, jax.random.PRNGKey(0)))
    save_hf(cfg, params, d / "hf", dtype="bfloat16")
    orbax_ckpt.save(cfg, params, d / "orbax")
    return sum(f.stat().st_size for f in (d / "orbax").rglob("*") if f.is_file())


PLAN_CONFIG = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 512, "hidden_size": 64,
               "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 8, "num_key_value_heads": 8,
               "head_dim": 8, "max_position_embeddings": 1024, "torch_dtype": "bfloat16"}


@pytest.fixture(scope="module")
def pods(tmp_path_factory):
    """One run of tests/pods_worker.py on two processes (4 devices each): the methods on a 2x4 mesh, the loads of a
    checkpoint split over both, then `pdecode generate / bench / plan / train heads` on both (one start-up for all
    of them: the tests below each check one part)."""
    if jax.device_count() < 8:
        pytest.skip("the one-process reference needs 8 devices (XLA_FLAGS=--xla_force_host_platform_device_count=8)")
    d = tmp_path_factory.mktemp("pods")
    orbax_bytes = _wide_checkpoint(d / "wide")
    (d / "plan").mkdir()
    (d / "plan" / "config.json").write_text(json.dumps(PLAN_CONFIG))
    (d / "data.txt").write_text((ROOT / "pdecode" / "api.py").read_text()[:20000])
    port = _port()
    res = _pair(lambda i: [sys.executable, WORKER, str(i), str(port), str(d / "multi.json")],
                env={"PODS_WIDE": str(d / "wide"), "PODS_WORK": str(d)}, timeout=600)
    assert all(rc == 0 for rc, _, _ in res), res[0][2][-2000:] + res[1][2][-2000:]
    return {"dir": d, "multi": json.loads((d / "multi.json").read_text()), "orbax_bytes": orbax_bytes,
            "commands": [json.loads((d / f"commands.{i}.json").read_text()) for i in range(2)]}


def _worker():
    sys.path.insert(0, str(ROOT / "tests"))
    import pods_worker

    return pods_worker


def test_two_processes_decode_like_one_with_all_devices(pods):
    multi = pods["multi"]
    assert multi["processes"] == 2 and multi["devices"] == 8
    from pdecode.sharding import make_mesh

    single = _worker().run(make_mesh(2, 4))
    for method in ("ar", "sd", "eagle", "dico", "decompose"):
        assert multi[method] == single[method], method
    assert "covers 4 of the run's 8 devices" in multi["mesh_error"]
    assert "differ between processes" in multi["prompt_error"]


def test_each_process_reads_its_share_of_a_checkpoint(pods):
    """With the model axis across both processes, each reads about half of a safetensors or orbax checkpoint: the
    slices of its own 4 devices (and the file pages they touch: a row-split weight's rows are read to page
    granularity), the orbax chunks its slices cover; and the params are the checkpoint's."""
    from pdecode.sharding import make_mesh

    wide = pods["dir"] / "wide"
    ckpt = (wide / "hf" / "model.safetensors").stat().st_size
    r = pods["multi"]["reads"]
    assert max(r["hf_slice"]) <= 0.6 * ckpt, (r, ckpt)
    assert max(r["hf_pages"]) <= 0.7 * ckpt, (r, ckpt)
    assert max(r["orbax_read"]) <= 0.6 * pods["orbax_bytes"], (r, pods["orbax_bytes"])
    ref = _worker().sums(pdecode.load(str(wide / "hf"), mesh=make_mesh(1, 8)))
    assert r["hf_sums"] == pytest.approx(ref, rel=1e-5) and r["orbax_sums"] == pytest.approx(ref, rel=1e-5)


def test_cli_runs_on_two_processes_and_prints_once(pods):
    zero, one = (c["generate"] for c in pods["commands"])
    assert zero["rc"] == one["rc"] == 0
    rows = [json.loads(line) for line in zero["stdout"].splitlines() if line.startswith("{")]
    assert len(rows) == 1 and len(rows[0]["tokens"]) == 8
    assert not one["stdout"].strip()  # process 1 ran the same steps and printed none of it


def test_bench_on_two_processes_writes_once(pods):
    zero, one = (c["bench"] for c in pods["commands"])
    assert zero["rc"] == one["rc"] == 0
    got = json.loads((pods["dir"] / "bench" / "results.json").read_text())
    assert got["meta"]["mesh"] == "2x4 over 2 process(es)" and [r["method"] for r in got["rows"]] == ["ar"]
    assert "tokens/s" in zero["stdout"] and not one["stdout"].strip()
    from infer import cli

    assert cli.main(["bench", "--suite", "edit", "--mesh", "2x4"]) == 2  # other suites refuse a mesh, one line


def test_plan_on_two_processes_is_the_one_process_plan(pods):
    """`pdecode plan --devices 8` over both processes prints once the per-device bytes one process computes."""
    zero, one = (c["plan"] for c in pods["commands"])
    assert zero["rc"] == one["rc"] == 0 and not one["stdout"].strip()
    multi = json.loads(zero["stdout"])
    from infer.plan import plan

    single = plan(str(pods["dir"] / "plan"), 8, "ar", 4, 256)
    assert multi["per_device"] == single["per_device"] and multi["param_bytes"] == single["param_bytes"]


def test_heads_train_on_two_processes_like_one(pods):
    """`pdecode train heads` with each process making its own rows of every batch (the data axis across the
    processes on a 2x4 mesh) reaches the loss and heads one process with all 8 devices reaches."""
    assert [c["heads"]["rc"] for c in pods["commands"]] == [0, 0]
    from train import heads

    d = pods["dir"]
    heads.main([*_worker().HEADS_ARGS, "--data", str(d / "data.txt"), "--out", str(d / "heads_single"),
                "--work", str(d / "heads_work_single")])
    multi = json.loads((d / "heads_multi" / "train_info.json").read_text())
    single = json.loads((d / "heads_single" / "train_info.json").read_text())
    assert multi["loss_curve"]["loss"] == pytest.approx(single["loss_curve"]["loss"], rel=1e-5)
    assert multi["final_eval"]["depth1_agreement"] == pytest.approx(single["final_eval"]["depth1_agreement"], abs=1e-6)
    from pdecode.checkpoint.heads_io import load_heads

    cfg = pdecode.load("code-target").cfg
    a, b = load_heads(d / "heads_multi", cfg)[2], load_heads(d / "heads_single", cfg)[2]
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        np.testing.assert_allclose(np.asarray(x, np.float32), np.asarray(y, np.float32), atol=2e-2)


@pytest.mark.parametrize("argv,msg", [
    (["--coordinator", "127.0.0.1:1", "--num-processes", "2", "--process-id", "5"], "--process-id must be in 0..1"),
    (["--num-processes", "2", "--process-id", "0"], "needs --coordinator"),
    (["--coordinator", "nohost", "--num-processes", "2", "--process-id", "0"], "must be HOST:PORT"),
])
def test_bad_distributed_flags_are_one_line(argv, msg, capsys):
    from infer import cli

    assert cli.main(["generate", "--prompt", "x", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert msg in err and len(err.splitlines()) == 1


def test_serve_background_warmup_on_several_processes_is_one_line(capsys):
    from infer import cli

    assert cli.main(["serve", "--warmup", "background", "--coordinator", "127.0.0.1:1", "--num-processes", "2",
                     "--process-id", "0"]) == 2
    err = capsys.readouterr().err.strip()
    assert "--warmup full" in err and len(err.splitlines()) == 1


def test_a_missing_coordinator_fails_within_the_timeout():
    """Process 1 of 2 with no process 0 listening: one line and exit 2 after --dist-timeout, not a hang."""
    t0 = time.perf_counter()
    r = subprocess.run([sys.executable, "-m", "infer.cli", "generate", "--prompt", "x", "--coordinator",
                        f"127.0.0.1:{_port()}", "--num-processes", "2", "--process-id", "1", "--dist-timeout", "5"],
                       env=_env(4), capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and time.perf_counter() - t0 < 90
    lines = [x for x in r.stderr.splitlines() if x.startswith("error:")]
    assert len(lines) == 1 and "could not reach the coordinator" in lines[0]


def _serve_pair(port: int, http: int):
    """`pdecode serve` on two processes (2x4 mesh: the slots split over the processes); (procs, health url)."""
    cmd = [sys.executable, "-m", "infer.cli", "serve", "--port", str(http), "--slots", "2", "--max-len", "64",
           "--chunk", "32", "--steps-per-call", "2", "--mesh", "2x4", "--coordinator", f"127.0.0.1:{port}",
           "--num-processes", "2", "--dist-timeout", "120"]
    procs = [subprocess.Popen(cmd + ["--process-id", str(i)], env=_env(4), stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for i in range(2)]
    url = f"http://127.0.0.1:{http}"
    import urllib.request

    end = time.monotonic() + 400
    while time.monotonic() < end:
        assert all(p.poll() is None for p in procs), procs[0].stderr.read()[-2000:] + procs[1].stderr.read()[-2000:]
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as r:
                if r.status == 200:
                    return procs, url
        except OSError:
            time.sleep(1)
    raise AssertionError("the two-process server did not come up")


def _health(url: str) -> int:
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(url + "/health", timeout=2) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code
    except OSError:
        return 0


def test_serve_on_two_processes(tmp_path):
    """Process 0 serves HTTP and sends each engine round to process 1: the openai client gets what
    `pdecode.generate` gives (plain and streamed); SIGTERM on process 0 drains and stops both. A second run: the
    follower killed, /health answers 503 and process 0 exits with one line within 30 s."""
    openai = pytest.importorskip("openai")
    prompts = ["def fib(n):", "class Stack:\n    def push(self, x):"]
    procs, url = _serve_pair(_port(), _port())
    try:
        client = openai.OpenAI(base_url=url + "/v1", api_key="none")
        got = [client.completions.create(model="code-target", prompt=p, max_tokens=8, temperature=0).choices[0].text
               for p in prompts]
        streamed = "".join(c.choices[0].text for c in client.completions.create(
            model="code-target", prompt=prompts[1], max_tokens=8, temperature=0, stream=True))
        procs[0].send_signal(signal.SIGTERM)
        rcs = [p.wait(timeout=90) for p in procs]
    finally:
        for p in procs:
            p.kill()
    m = pdecode.load("code-target")
    ref = pdecode.generate(m, prompts, max_new_tokens=8).texts
    assert got == ref and streamed == ref[1]
    assert rcs == [0, 0], procs[1].stderr.read()[-1500:]

    procs, url = _serve_pair(_port(), _port())
    try:
        procs[1].kill()
        t0 = time.monotonic()
        codes = []
        while procs[0].poll() is None and time.monotonic() - t0 < 60:
            codes.append(_health(url))
            time.sleep(0.2)
        took = time.monotonic() - t0
        rc = procs[0].wait(timeout=30)
        err = procs[0].stderr.read()
    finally:
        for p in procs:
            p.kill()
    assert took < 30 and rc == 3, (took, rc, err[-1500:])
    assert 503 in codes and 200 not in codes[codes.index(503):]
    assert len([x for x in err.splitlines() if "process 1 of the run is gone" in x]) == 1
