"""The benchmark harness end to end on a tiny budget: rows, peer rows, files, verify-cost projection."""

import json

import pytest

from infer.bench import main as bench_main
from infer.bench import parse_method, projections, run_rows, verify_cost


def tiny_hf(path, causal=True):
    """A 2-layer random model on the zoo's tokenizer, saved in HF format (the suites compile in seconds on it)."""
    import jax

    import pdecode
    from pdecode.checkpoint.hf import save_hf
    from pdecode.config import ModelConfig
    from pdecode.model.transformer import init_params

    cfg = ModelConfig(vocab_size=4096, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=2,
                      num_kv_heads=1, head_dim=16, max_position_embeddings=512, causal=causal, mask_token_id=2,
                      eos_token_ids=(0,), pad_token_id=1, tie_word_embeddings=True)
    save_hf(cfg, init_params(cfg, jax.random.PRNGKey(0)), path, tokenizer_dir=pdecode.zoo_dir() / "code-target")
    return str(path)


def test_parse_method():
    assert parse_method("sd:gamma=4,adaptive=true") == ("sd", {"gamma": 4, "adaptive": True})
    assert parse_method("tree:tree=binary-14") == ("tree", {"tree": "binary-14"})
    assert parse_method("ar") == ("ar", {})
    assert parse_method("sd:draft_vocab=False,gamma=2") == ("sd", {"draft_vocab": False, "gamma": 2})  # as -o
    # a per-method model, before or after the options
    assert parse_method("eagle@code-target-eagle3:depth=7") == ("eagle@code-target-eagle3", {"depth": 7})
    assert parse_method("mtp:depth=3,tree_top_k=1@m") == ("mtp@m", {"depth": 3, "tree_top_k": 1})


def test_decode_suite_writes_tables_and_plot(tmp_path):
    out = tmp_path / "b"
    model = tiny_hf(tmp_path / "tiny")  # also the draft of sd (a self-draft accepts every token)
    rc = bench_main(["--model", model, "--draft", model, "--methods", "ar", "sd:gamma=2", "lookup",
                     "--peer", "transformers", "transformers-lookup",
                     "--batch", "1", "2", "--prompts", "2", "--new-tokens", "8", "--repeats", "1", "--no-limit",
                     "--out", str(out)])
    assert rc == 0
    res = json.loads((out / "results.json").read_text())
    rows = {(r["method"], r["batch"]): r for r in res["rows"]}
    assert ("transformers-lookup", 2) not in rows  # HF assisted generation is batch-1 only: skipped, not faked
    assert rows[("ar", 1)]["tau"] == 1.0 and rows[("sd:gamma=2", 2)]["tau"] >= 1.0
    assert rows[("sd:gamma=2", 1)]["speedup_vs_ar"] > 0 and rows[("transformers", 2)]["tokens_per_s"] > 0
    assert (out / "tokens_per_s.png").stat().st_size > 1000
    md = (out / "results.md").read_text()
    assert "| 0 | 2 | sd:gamma=2 |" in md and "acceptance per depth" in md


def test_precision_rows_and_cpu_limit(tmp_path):
    """A row may load the model in another precision ("ar:dtype=bfloat16,activation_dtype=float32"); the CPU limit
    compares each AR row with the model's own matmuls timed alone in that row's operand dtype."""
    out = tmp_path / "p"
    rc = bench_main(["--methods", "ar", "ar:dtype=bfloat16,activation_dtype=float32", "--batch", "2",
                     "--prompts", "2", "--new-tokens", "8", "--repeats", "1", "--out", str(out)])
    assert rc == 0
    res = json.loads((out / "results.json").read_text())
    rows = {r["method"]: r for r in res["rows"]}
    mixed = rows["ar:dtype=bfloat16,activation_dtype=float32"]
    assert mixed["tau"] == 1.0 and mixed["speedup_vs_ar"] > 0  # compared with the float32 AR row
    util = res["meta"]["limit"]["utilization"]
    assert util["ar batch 2"]["operands"] == "float32"
    u = util["ar:dtype=bfloat16,activation_dtype=float32 batch 2"]
    assert u["operands"] == "bfloat16" and 0 < u["of_floor"] and u["matmul_floor_ms"] > 0
    assert abs(u["step_ms"] - 1e3 * 2 / mixed["tokens_per_s"]) < 1e-6
    assert "matmul floor" in (out / "results.md").read_text()


def test_rounds_interleave_runners():
    """Every round runs each row once (after all warm-ups), so the machine's drift touches all rows alike."""
    calls = []

    class Fake:
        def __init__(self, label, wall):
            self.label, self.wall = label, wall

        def run(self, batch, new_tokens, temperature, seed):
            calls.append(self.label)
            return {"new_tokens": new_tokens * len(batch), "wall_s": self.wall, "compile_s": 0.5,
                    "target_forwards": new_tokens, "row_forwards": new_tokens * len(batch), "extra": {}}

    rows = run_rows([Fake("a", 0.1), Fake("b", 0.2)], [[1], [2], [3], [4]], 2, 8, 0.0, repeats=3)
    assert calls == ["a", "b"] + ["a", "a", "b", "b"] * 3  # warm-ups, then rounds of (a's batches, b's batches)
    assert [r["method"] for r in rows] == ["a", "b"]
    assert rows[0]["tokens_per_s"] == 32 / 0.2 and rows[1]["wall_s_all"] == [0.4, 0.4, 0.4]
    assert rows[0]["tau"] == 1.0 and rows[1]["compile_s"] == 0.5


def test_verify_cost_and_projection(tiny):
    rows = verify_cost(tiny.cfg, tiny.params, ks=(1, 4), batches=(1,), context=8, repeats=1, label="tiny")
    assert [r["k"] for r in rows] == [1, 4] and rows[0]["ratio_to_k1"] == 1.0 and rows[1]["seconds"] > 0
    bench_rows = [{"method": "ar", "batch": 1, "temperature": 0.0, "wall_s_median": 1.0, "target_forwards": 100,
                   "tau": 1.0},
                  {"method": "sd", "batch": 1, "temperature": 0.0, "wall_s_median": 0.8, "target_forwards": 40,
                   "tau": 2.5, "tree_size": 4}]
    cost = [{"batch": 1, "k": 1, "seconds": 0.01}, {"batch": 1, "k": 4, "seconds": 0.015}]
    projections(bench_rows, cost)
    sd = bench_rows[1]
    # t_step = 0.02, overhead = 0.005, flat = 0.015, t_ar = 0.01: projected = 2.5 * 0.01 / 0.015
    assert abs(sd["projected_speedup_flat_verify"] - 2.5 * 0.01 / 0.015) < 1e-9
    assert abs(sd["overhead_fraction_of_flat_step"] - 0.005 / 0.015) < 1e-9


@pytest.mark.parametrize("flags,msg", [
    (["--batch", "1", "8", "--timing-items", "4"], r"--timing-items \(4\) must be a positive multiple of every --batch"),
    (["--timing-items", "0"], r"--timing-items \(0\) must be a positive multiple"),
    (["--items", "4", "--timing-items", "8"], r"--items \(4\) must be at least"),
    (["--repeats", "0"], r"--repeats \(0\)"),
    (["--temperature", "0", "1"], "one --temperature"),
])
def test_diffusion_suite_checks_arguments_before_loading(tmp_path, monkeypatch, flags, msg):
    """Arguments the suite cannot run with are refused before any model loads (--timing-items 0 used to run for
    minutes, then fail with "no prompts given")."""
    import pdecode
    from pdecode.errors import InputError

    monkeypatch.setattr(pdecode, "load", lambda *a, **k: pytest.fail("a model loaded before the arguments were checked"))
    with pytest.raises(InputError, match=msg):
        bench_main(["--suite", "diffusion", "--gen-lengths", "16", "--items", "16", *flags, "--out", str(tmp_path)])


def test_diffusion_suite_keeps_what_it_measured_when_stopped(tmp_path, monkeypatch):
    """An error after some rows were measured: results.json holds those rows and says why it is incomplete."""
    from infer import diffusion_bench

    def boom(*a, **k):
        raise RuntimeError("the judge ran out of memory")

    monkeypatch.setattr(diffusion_bench, "code_rows", boom)
    model, ar, out = tiny_hf(tmp_path / "dllm", causal=False), tiny_hf(tmp_path / "ar"), tmp_path / "d"
    with pytest.raises(RuntimeError, match="out of memory"):
        bench_main(["--suite", "diffusion", "--model", model, "--gen-lengths", "16", "--batch", "1", "--items", "2",
                    "--timing-items", "1", "--samplers", "vanilla", "--repeats", "1", "--code-prompts", "1",
                    "--judge", ar, "--ar-reference", "", "--out", str(out)])
    res = json.loads((out / "results.json").read_text())
    assert res["meta"]["incomplete"] == "RuntimeError: the judge ran out of memory"
    assert [(r["sampler"], r["batch"]) for r in res["rows"]] == [("vanilla", 1)]


def test_diffusion_suite_runs_end_to_end(tmp_path):
    import numpy as np

    out = tmp_path / "d"
    model = tiny_hf(tmp_path / "dllm", causal=False)
    ar = tiny_hf(tmp_path / "ar")  # the AR reference and the judge are autoregressive models
    samplers = ("vanilla", "dico")
    rc = bench_main(["--suite", "diffusion", "--model", model, "--gen-lengths", "16", "--batch", "1", "2",
                     "--items", "10", "--timing-items", "2", "--samplers", *samplers, "--repeats", "1",
                     "--code-prompts", "2", "--prompt-tokens", "16", "--ar-reference", ar, "--judge", ar,
                     "--out", str(out)])
    assert rc == 0
    res = json.loads((out / "results.json").read_text())
    assert {(r["sampler"], r["batch"]) for r in res["rows"]} == {(s, b) for s in samplers for b in (1, 2)}
    for r in res["rows"]:
        assert 0.0 <= r["accuracy"] <= r["position_accuracy"] + 1e-9 <= 1.0 + 1e-9
        assert r["nfe_per_item"] >= 1 and r["tokens_per_s"] > 0 and r["items"] == 10
        assert r["same_tokens"] and r["timed_items"] == 2  # the timed runs decode as the quality pass did
        # the overall accuracy is the item-weighted mean of the per-kind ones (items are spread evenly: 2 per kind)
        assert len(r["accuracy_by_kind"]) == 5
        assert abs(np.mean(list(r["accuracy_by_kind"].values())) - r["accuracy"]) < 1e-9
    names = [q["sampler"] for q in res["code"]]
    assert names[0] == "real text" and names[1].endswith("greedy AR") and set(names[2:]) == set(samplers)
    assert all(np.isfinite(q["judge_ppl"]) and 0 < q["distinct4"] <= 1 for q in res["code"])
    md = (out / "results.md").read_text()
    assert "Exact accuracy by kind" in md and "Free code" in md and (out / "pareto.png").exists()
    for p in res["meta"]["pictures"]:
        assert __import__("pathlib").Path(p).exists()


def test_dico_tuning_picks_the_cheapest_setting_near_the_best(tmp_path, monkeypatch):
    from infer import diffusion_bench as DB

    monkeypatch.setattr(DB, "DICO_GRID", {"num_seeds": (2, 8)})
    monkeypatch.setattr(DB, "TUNING_SLICE", slice(400, 404))
    model = tiny_hf(tmp_path / "dllm", causal=False)
    import pdecode

    rep = DB.tune_dico(pdecode.load(model, dtype="float32"), 16, 2, tmp_path / "t")
    assert len(rep["results"]) == 2 and rep["items"] == 4
    best = max(r["position_accuracy"] for r in rep["results"])
    near = [r for r in rep["results"] if r["position_accuracy"] >= best - 0.01]
    assert rep["pick"] == min(near, key=lambda r: r["nfe_per_item"])
    assert (tmp_path / "t" / "dico_tuning.json").exists()


def test_guidellm_poisson_rows_and_command(tmp_path, monkeypatch):
    """guidellm's Poisson runs (--guidellm-rates): one row per arrival rate (tests/data: guidellm 0.8.1 at 2 and 4
    requests/s against `pdecode serve --slots 4`, code-target, 2026-12-07, the per-request lists dropped); the
    command asks for Poisson rates and reads a data file when one is given."""
    import subprocess
    from pathlib import Path
    from types import SimpleNamespace

    from infer import serve_bench

    rows = serve_bench.guidellm_rows(Path(__file__).parent / "data" / "guidellm_poisson_benchmarks.json")
    assert [(r["row"], r["rate"], r["clients"]) for r in rows] == [("guidellm, poisson 2/s", 2.0, 0),
                                                                   ("guidellm, poisson 4/s", 4.0, 0)]
    assert [(r["requests"], r["failed"]) for r in rows] == [(6, 0)] * 2
    assert [round(r["tokens_per_s"], 1) for r in rows] == [186.6, 338.3]  # guidellm's console table
    assert all(0 < r["ttft_p50"] <= r["ttft_p99"] and 0 < r["itl_p50"] <= r["itl_p99"] for r in rows)
    seen = []

    def fake_run(cmd, cwd, **kw):
        seen.append(cmd)
        (Path(cwd) / "benchmarks.json").write_text(
            (Path(__file__).parent / "data" / "guidellm_poisson_benchmarks.json").read_text())
        return SimpleNamespace(stdout="", stderr="", returncode=0)

    monkeypatch.setattr(subprocess, "run", fake_run)
    monkeypatch.setattr(serve_bench, "_guidellm", lambda: "guidellm")
    data = tmp_path / "reqs.jsonl"
    data.write_text('{"prompt": "hi", "output_tokens_count": 3}\n')
    args = SimpleNamespace(model="code-target", guidellm_rates=[0.5, 1.0], guidellm_file=data, clients=16,
                           prompt_tokens=64, new_tokens=96, requests=8)
    got = serve_bench._run_guidellm("http://127.0.0.1:1", args, tmp_path / "out")
    cmd = " ".join(seen[0])
    assert "--profile kind=poisson --override profile.rate 0.5,1" in cmd
    assert f"--data kind=json_file,path={data.resolve()}" in cmd and len(got) == 2


def test_guidellm_rows_from_its_benchmarks_json(tmp_path, monkeypatch):
    """The serve bench's guidellm driver reads guidellm's benchmarks.json into its own rows: tests/data holds the
    metrics of a real run (guidellm 0.8.1's default streaming run against `pdecode serve --slots 16`, ar, 2026-12-05;
    the per-request lists dropped): one row per concurrency with guidellm's figures in the bench's units; and
    ``--driver guidellm`` without guidellm installed is a one-line error before any server starts."""
    from pathlib import Path

    from infer import serve_bench

    rows = serve_bench.guidellm_rows(Path(__file__).parent / "data" / "guidellm_benchmarks.json")
    assert [r["clients"] for r in rows] == [1, 4, 16]
    assert [(r["requests"], r["failed"]) for r in rows] == [(32, 0)] * 3
    assert [round(r["tokens_per_s"], 1) for r in rows] == [84.0, 233.2, 489.4]  # guidellm's console table
    assert rows[0]["ttft_p50"] == pytest.approx(0.0495, abs=1e-4)
    assert rows[2]["itl_p50"] == pytest.approx(0.0235, abs=1e-4)
    assert all(r["ttft_p50"] <= r["ttft_p99"] and r["itl_p50"] <= r["itl_p99"] for r in rows)
    rows = [dict(r, method="ar") for r in rows]  # (run_suite adds each server's method)
    serve_bench._ratios(rows)  # guidellm's one stream is the one-at-a-time reference
    assert rows[0]["x_one_at_a_time"] == 1.0 and rows[2]["x_one_at_a_time"] == pytest.approx(489.4 / 84.0, rel=1e-3)
    assert "| ar | guidellm, 16 concurrent | 0 | 489.4 | 5.83 |" in serve_bench.to_markdown(
        rows, {"requests": 32, "prompt_tokens": [136, 136], "budgets": [64, 64], "slots": 16, "date": "-"})
    monkeypatch.setattr(serve_bench, "_guidellm", lambda: None)
    started = []
    monkeypatch.setattr(serve_bench, "Server", lambda *a: started.append(a))
    assert bench_main(["--suite", "serve", "--driver", "guidellm", "--out", str(tmp_path)]) == 2
    assert not started


def test_closed_loop_fill_is_the_tail_alone():
    """The serve bench's ceiling for a closed-loop row: the share of slot-steps a gapless engine keeps busy when each
    of ``clients`` sends its next request as its last one ends; said above the table for the row."""
    from infer import serve_bench

    assert serve_bench.closed_loop_fill([10] * 16, 16) == 1.0  # one request per client: all end together
    assert serve_bench.closed_loop_fill([10] * 17, 16) == pytest.approx(170 / (16 * 20))  # one runs alone after
    assert serve_bench.closed_loop_fill([1, 1, 1, 9], 2) == pytest.approx(12 / 20)  # the 9 starts at step 1
    rows = [{"row": "16 concurrent", "method": "ar", "mode": "closed", "failed": 0, "tokens_per_s": 1.0,
             "ttft_p50": None, "ttft_p99": None, "itl_p50": None, "itl_p99": None, "tpot_p50": None, "tpot_p99": None,
             "compiles_after_warmup": 0, "ideal_fill": 0.8}]
    md = serve_bench.to_markdown(rows, {"requests": 48, "prompt_tokens": [16, 64], "budgets": [32, 96], "slots": 16,
                                        "date": "-"})
    assert "16 concurrent: a closed loop over these requests fills at most 80% of its slots" in md
