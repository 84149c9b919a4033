"""Decomposition-and-fill: planners, the router, one shared prefix prefilled once, and fills equal to generating each
point on its own (greedy), with ar, sd and a tree method inside."""

import json

import pytest

import pdecode
import importlib

D = importlib.import_module("pdecode.decompose")  # the module (pdecode.decompose is also the function)

HEADER = "import os\nimport sys\nimport re\nfrom collections import defaultdict\n\nLIMIT = 100\n\n\n"
STUBS = HEADER + '''def read_lines(path):
    """Return the lines of the file at path."""


@staticmethod
def count_words(text):
    """Return a dict of word counts in text."""


def is_empty(s):
    def inner(x):
        return x
    """Whether s is empty."""


def join_paths(a, b):
'''


@pytest.fixture(scope="module")
def models():
    return pdecode.load("code-target", dtype="float32"), pdecode.load("code-draft", dtype="float32")


def test_stub_planner_parsing():
    plan = D.plan_stubs(STUBS)
    assert plan.prefix == HEADER and plan.names == ["read_lines", "count_words", "is_empty", "join_paths"]
    assert plan.points[0] == 'def read_lines(path):\n    """Return the lines of the file at path."""'
    assert plan.points[1].startswith("@staticmethod\ndef count_words(text):")  # decorators stay with their stub
    assert "def inner(x)" in plan.points[2]  # a nested def is part of its stub
    assert plan.points[3] == "def join_paths(a, b):"  # a stub without a docstring
    assert D.plan_stubs("x = 1\n").points == []
    text = D._join(plan, ["\n    return 1"] * 4)
    assert text.startswith(HEADER) and text.count("return 1") == 4 and text.endswith("return 1\n")


def test_line_planner_parsing():
    prompt = "def sq(x):\n    return x * x\n\n\nassert sq(2) == \nassert sq(3) == \nassert sq(10) == \n\n"
    plan = D.plan_lines(prompt)
    assert plan.prefix == "def sq(x):\n    return x * x\n\n\n"
    assert plan.points == ["assert sq(2) == ", "assert sq(3) == ", "assert sq(10) == "] and plan.stop == "line"
    assert D._join(plan, ["4\nmore", "9", "100"]) == plan.prefix + "assert sq(2) == 4\nassert sq(3) == 9\n" \
        "assert sq(10) == 100\n"
    q = D.plan_lines("Answer each:\n1. What is 2+2?\n2. Name a colour.")
    assert q.prefix == "" and q.points == ["Answer each:", "1. What is 2+2?", "2. Name a colour."]


def test_stop_rules():
    assert D.cut_body('\n    x = 1\n\n    return x\n\ndef g():\n    pass') == "\n    x = 1\n\n    return x"
    assert D.cut_body("\n    return 1\n\n\nclass A:\n") == "\n    return 1"
    assert D.cut_line("42\nassert") == "42"


@pytest.mark.parametrize("method,opts", [("ar", {}), ("sd", {"gamma": 3}), ("tree", {})])
def test_fills_equal_each_point_generated_alone(models, method, opts):
    m, d = models
    kw = dict(opts, draft=d) if method != "ar" else opts
    out = pdecode.decompose(m, STUBS, method=method, max_new_tokens=24, **kw)
    s = out.stats
    assert s["decision"]["mode"] == "parallel" and s["points"] == 4 and out.prefix == HEADER
    # the prefix is prefilled once: the target's prefill ran it once, then each row's own tokens
    rows = [m.tokenizer.encode(out.prefix + p) for p in out.points]
    shared = s["prefix_tokens"] // 16 * 16
    assert s["prefix_tokens"] >= 16 and s["prefill_tokens"] == shared + sum(len(r) - shared for r in rows)
    assert s["prefill_tokens"] < sum(len(r) for r in rows)
    for p, f, ft in zip(out.points, out.fills, out.fill_tokens):
        ref = pdecode.generate(m, [out.prefix + p], max_new_tokens=24)
        assert ref.tokens[0][: len(ft)] == ft  # a prefix of it: the stop rule cut the rest
        assert ref.texts[0].startswith(f)
    assert out.text.startswith(HEADER) and all(p in out.text for p in out.points)


def test_body_fills_stop_on_the_device_with_per_point_budgets(models):
    m, _ = models
    budgets = [40, 12, 40, 20]
    out = pdecode.decompose(m, STUBS, max_new_tokens=budgets)
    inner = out.stats["inner"]
    for p, ft, n in zip(out.points, out.fill_tokens, budgets):
        ref = pdecode.generate(m, [out.prefix + p], max_new_tokens=n)
        assert ref.tokens[0][: len(ft)] == ft
    # rows ended at their own budgets or at the end of their body: fewer tokens than the budgets allow
    assert inner["new_tokens"] < sum(budgets) and all(len(t) <= n for t, n in zip(out.fill_tokens, budgets))
    with pytest.raises(pdecode.InputError, match="budgets but the plan has 4 points"):
        pdecode.decompose(m, STUBS, max_new_tokens=[8, 8])


def test_line_fills_stop_on_the_device(models):
    m, _ = models
    prompt = "def sq(x):\n    return x * x\n\n\nassert sq(2) == \nassert sq(3) == \nassert sq(4) == "
    out = pdecode.decompose(m, prompt, planner="lines", max_new_tokens=32)
    assert all("\n" not in f for f in out.fills)
    # a newline token ends each row inside the loop: far fewer forwards than the budget
    assert out.stats["fill_forwards"] < 32


def test_router_falls_back(models):
    m, _ = models
    one = pdecode.decompose(m, HEADER + "def f(x):\n    \"\"\"Double x.\"\"\"", max_new_tokens=8)
    assert one.stats["decision"]["mode"] == "plain" and "nothing to fill in parallel" in one.stats["decision"]["reason"]
    dep = HEADER + 'def f(x):\n    """Double x."""\n\n\ndef g(x):\n    """Call f twice."""\n'
    out = pdecode.decompose(m, dep, max_new_tokens=8)
    assert out.stats["decision"]["mode"] == "sequential" and "refers to f" in out.stats["decision"]["reason"]
    assert len(out.fills) == 2 and isinstance(out.stats["inner"], list)


def test_callable_planner_and_errors(models):
    m, _ = models
    out = pdecode.decompose(m, "ignored", planner=lambda p: ("x = [", ["1, 2", "3, 4"], " | "), max_new_tokens=4)
    assert out.points == ["1, 2", "3, 4"] and out.text.startswith("x = [1, 2") and " | 3, 4" in out.text
    with pytest.raises(pdecode.InputError, match="unknown planner 'outline'"):
        pdecode.decompose(m, STUBS, planner="outline")
    with pytest.raises(pdecode.InputError, match="too long for the context"):
        pdecode.decompose(m, STUBS, max_new_tokens=m.cfg.max_position_embeddings)
    with pytest.raises(pdecode.InputError, match="decompose sets shared_prefix itself"):
        pdecode.decompose(m, STUBS, shared_prefix=4)
    with pytest.raises(pdecode.InputError, match="must return"):
        pdecode.decompose(m, STUBS, planner=lambda p: 3)


def test_generate_shared_prefix_checks_its_input(models):
    m, _ = models
    with pytest.raises(pdecode.InputError, match="does not start with the same 3 tokens"):
        pdecode.generate(m, [[5, 6, 7, 8], [5, 6, 9, 8]], shared_prefix=3)
    with pytest.raises(pdecode.InputError, match="needs at least one token after the shared prefix"):
        pdecode.generate(m, [[5, 6, 7], [5, 6, 7, 8]], shared_prefix=3)
    with pytest.raises(pdecode.InputError, match="does not share a prompt prefix"):
        pdecode.generate(pdecode.load("code-dllm", dtype="float32"), [[5, 6, 7, 8]], method="diffusion",
                         shared_prefix=2, max_new_tokens=8)


def test_cli_decompose(capsys):
    from infer import cli

    rc = cli.main(["generate", "--decompose", "stubs", "--prompt", STUBS, "--max-new-tokens", "8", "--json",
                   "--dtype", "float32"])
    rec = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert rc == 0 and rec["stats"]["points"] == 4 and len(rec["fills"]) == 4 and rec["prefix"] == HEADER


def test_outline_cut_and_skeleton_planner(models):
    outline = D.cut_outline('\ndef a(x):\n    """Do a."""\n\ndef b(y):\n    """Do b."""\n    return y\n')
    assert outline == '\ndef a(x):\n    """Do a."""\n\ndef b(y):\n    """Do b."""\n'  # cut at the first body line
    assert D.cut_outline("x = 1\ndef a():\n") == ""
    m, _ = models
    out = pdecode.decompose(m, HEADER, planner="skeleton", max_new_tokens=8)
    s = out.stats
    assert s["plan_forwards"] > 0 and isinstance(s["outline"], str)
    assert out.points == D.plan_stubs(s["outline"]).points and out.prefix == HEADER
    assert s["decision"]["mode"] == ("parallel" if len(out.points) >= 2 else "plain")


def test_masked_diffusion_fills_points_as_one_batch_of_canvases():
    dllm = pdecode.load("code-dllm", dtype="float32")
    out = pdecode.decompose(dllm, STUBS, method="diffusion", max_new_tokens=16)
    assert out.stats["decision"]["mode"] == "parallel" and out.stats["prefix_tokens"] == 0
    for p, f in zip(out.points, out.fills):
        ref = pdecode.generate(dllm, [out.prefix + p], method="diffusion", max_new_tokens=16)
        assert D.cut_body(ref.texts[0]) == f
    with pytest.raises(pdecode.InputError, match="one canvas length"):
        pdecode.decompose(dllm, STUBS, method="diffusion", max_new_tokens=[16, 16, 16, 16])


# ------------------------------------------------------------------------------------------------ chat skeleton
CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory):
    """A tiny random Qwen2 chat model: the zoo tokenizer with ChatML's two special tokens and a ChatML template."""
    from tokenizers import Tokenizer

    from tests.helpers import make_hf_model

    d = tmp_path_factory.mktemp("chat")
    tok = Tokenizer.from_file(str(pdecode.zoo_dir() / "code-target" / "tokenizer.json"))
    tok.add_special_tokens(["<|im_start|>", "<|im_end|>"])
    tok.save(str(d / "tokenizer.json"))
    end = tok.token_to_id("<|im_end|>")
    make_hf_model("qwen2", d, vocab_size=tok.get_vocab_size(), eos_token_id=end, max_position_embeddings=1024)
    (d / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>", "chat_template": CHATML}))
    return pdecode.load(d, dtype="float32")


def test_chat_render_template_plain_format_and_errors(chat_model, monkeypatch):
    from pdecode import chat

    tok = chat_model.tokenizer
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    assert chat.render(tok, msgs) == ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
                                      "<|im_start|>assistant\n")
    assert chat.render(tok, msgs, add_generation_prompt=False).endswith("Hi<|im_end|>\n")
    # the template's special tokens are tokens, and encoding adds no others
    ids = chat.encode_chat(tok, chat.render(tok, msgs))
    assert ids.count(tok.backend.token_to_id("<|im_start|>")) == 3
    plain = pdecode.load("code-target").tokenizer
    assert chat.render(plain, msgs) == "system: Be brief.\n\nuser: Hi\n\nassistant:"
    with pytest.raises(pdecode.InputError, match="role must be one of"):
        chat.render(tok, [{"role": "robot", "content": "x"}])
    with pytest.raises(pdecode.InputError, match="content must be a string"):
        chat.render(tok, [{"role": "user", "content": 3}])
    monkeypatch.setattr(tok, "chat_template", "{{ raise_exception('no system role') }}")
    with pytest.raises(pdecode.InputError, match="refused the conversation: no system role"):
        chat.render(tok, msgs)
    monkeypatch.setattr(tok, "chat_template", "{% for m in messages %}")
    with pytest.raises(pdecode.InputError, match="does not parse"):
        chat.render(tok, msgs)
    monkeypatch.setattr(tok, "chat_template", CHATML + " ")
    import sys

    monkeypatch.setitem(sys.modules, "jinja2", None)
    with pytest.raises(pdecode.InputError, match="pdecode\\[chat\\]"):
        chat.render(tok, msgs)


def test_skeleton_point_parsing():
    assert D.parse_points("Sure, here it is:\n1. Warm up first\n2) Learn to float\n\n3. Kick") == [
        "Warm up first", "Learn to float", "Kick"]
    assert D.parse_points("1. a\n2. b\n2. b\n3. c") == ["a", "b"]  # a repeated number: the model started over
    assert D.parse_points("1. a\n2. b\n1. a\n2. b") == ["a", "b"]
    assert D.parse_points("1. a\n3. c") == ["a"]
    assert D.parse_points("1. a\n2. a") == ["a"]
    assert D.parse_points("1. a\nsome prose\n2. b") == ["a"]
    assert D.parse_points("no list here") == [] and D.parse_points("1.\n2. x") == []


def test_chat_skeleton_fills_equal_each_point_generated_alone(chat_model):
    from pdecode import chat

    m, tok = chat_model, chat_model.tokenizer
    q = "How do I learn to swim as an adult?"
    points = ["Warm up in shallow water", "Learn to float", "Practice kicking"]
    plan = D.chat_points_plan(tok, q, points)
    assert plan.prefix.startswith("<|im_start|>user\nQuestion: " + q) and plan.prefix.endswith("Write point ")
    rows = [plan.prefix + p for p in plan.points]
    assert rows[1].endswith("<|im_start|>assistant\n2. Learn to float")
    out = pdecode.decompose(m, q, planner=lambda _: plan, max_new_tokens=12)
    assert out.stats["decision"]["mode"] == "parallel" and out.stats["prefix_tokens"] >= 16
    for r, ft, f in zip(rows, out.fill_tokens, out.fills):
        ref = pdecode.generate(m, [chat.encode_chat(tok, r)], max_new_tokens=12)
        assert ref.tokens[0][: len(ft)] == ft and "\n" not in f
    assert out.text.startswith("1. Warm up in shallow water") and "\n3. Practice kicking" in out.text


def test_chat_skeleton_planner_end_to_end(chat_model):
    q = "How do I learn to swim as an adult?"
    out = pdecode.decompose(chat_model, q, planner="skeleton", max_new_tokens=6, outline_tokens=24)
    s = out.stats
    assert s["skeleton"] == "chat" and s["outline"].startswith("1.") and s["plan_forwards"] >= 1
    n = len(D.parse_points(s["outline"]))
    assert s["points"] == n and s["decision"]["mode"] == ("parallel" if n >= 2 else "plain")
    assert len(out.fills) == max(n, 1)
