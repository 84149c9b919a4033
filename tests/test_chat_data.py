"""`pdecode train data`: a chat model's own answers to ShareGPT conversations below the held-out index, every human
turn, per temperature; sharded, resumable, never reading the held-out conversations."""

import json

import numpy as np
import pytest

import pdecode
from pdecode import chat
from tests.test_bench import tiny_hf
from train import chat_data as CD


def write_conversations(path, n=12_004):
    """``n`` ShareGPT-layout conversations: conversation i has i % 3 + 1 human turns (answers recorded), conversation
    2 opens with a gpt turn (skipped), conversation 4's second human turn is empty (it ends there)."""
    items = []
    for i in range(n):
        turns = []
        for k in range(i % 3 + 1):
            turns += [{"from": "human", "value": "" if (i == 4 and k == 1) else f"def f{i}_{k}(x): return x"},
                      {"from": "gpt", "value": f"answer {i} {k}"}]
        if i == 2:
            turns = turns[1:]
        items.append({"id": f"c{i}", "conversations": turns})
    path.write_text(json.dumps(items))
    return path


@pytest.fixture(scope="module")
def sharegpt(tmp_path_factory):
    return write_conversations(tmp_path_factory.mktemp("sg") / "sg.json")


def test_turns_stop_at_the_held_out_index(sharegpt):
    got = [(i, t, [m["role"] for m in msgs]) for i, t, msgs in CD.conversation_turns(sharegpt, start=0, count=4)]
    assert got[:4] == [(0, 0, ["user"]), (1, 0, ["user"]), (1, 1, ["user", "assistant", "user"]), (3, 0, ["user"])]
    assert [(i, t) for i, t, _ in got[4:]] == [(4, 0)]  # 2 opens with gpt; 4 stops at its empty turn
    assert sorted({i for i, _, _ in got}) == [0, 1, 3, 4]
    late = list(CD.conversation_turns(sharegpt, start=11_998, count=50))
    assert {i for i, _, _ in late} == {11_998, 11_999}  # never 12,000 and on, though the file holds them
    with pytest.raises(pdecode.PdecodeError, match="held out"):
        next(CD.conversation_turns(sharegpt, stop=12_001))
    with pytest.raises(pdecode.PdecodeError, match="held out"):
        CD.main(["--base", "unused", "--out", "x", "--start", "12000"])


def test_answers_are_the_models_own_and_a_stopped_run_resumes(sharegpt, tmp_path, monkeypatch):
    m = pdecode.load(tiny_hf(tmp_path / "tiny"))
    out = tmp_path / "data"
    kw = dict(conversations=4, temperatures=(0.0, 0.7), batch=2, new_tokens=6, max_prompt_tokens=64, shard=3,
              sharegpt=sharegpt, stream=open("/dev/null", "w"))
    man = CD.generate_data(m, out, **kw)
    exs, _ = CD.examples(m.tokenizer, sharegpt, 0, 4, 64)
    assert man["examples"] == len(exs) == 5 and man["shards"] == 2  # 1 + 2 + 1 + 1 turns of conversations 0, 1, 3, 4
    rows = CD.read(out)
    assert len(rows) == 10 and {r["temperature"] for r in rows} == {0.0, 0.7}
    greedy = [r for r in rows if r["temperature"] == 0.0]
    prompts = [ids for _, _, ids in exs]
    msgs = [msgs for _, _, msgs in CD.conversation_turns(sharegpt, 0, 4)]
    assert [r["ids"][: r["prompt_len"]] for r in greedy] == prompts
    assert prompts[2] == chat.encode_chat(m.tokenizer, chat.render(m.tokenizer, msgs[2]))  # the later turn, in context
    ref = pdecode.generate(m, prompts, max_new_tokens=6)
    assert [r["ids"][r["prompt_len"]:] for r in greedy] == ref.tokens
    sampled = [r["ids"][r["prompt_len"]:] for r in rows if r["temperature"] == 0.7]
    assert sampled != ref.tokens  # sampled, not greedy
    # a run stopped mid-way: the missing shard (and only it) is generated again, the same examples
    (out / "shard-t0-00001.npz").unlink()
    calls = []
    real = pdecode.generate
    monkeypatch.setattr(pdecode, "generate", lambda *a, **k: calls.append(len(a[1])) or real(*a, **k))
    CD.generate_data(m, out, **kw)
    assert calls == [2] and CD.read(out)[3:5] == rows[3:5]
    with pytest.raises(pdecode.PdecodeError, match="other settings"):
        CD.generate_data(m, out, **{**kw, "new_tokens": 7})
    # the heads' and draft's trainers read the directory as a token stream: each example, then EOS unless it ended so
    from train import data

    tr, va = data.user_streams(m.tokenizer, [out], seq_len=4, val_fraction=0.1)
    eos = m.tokenizer.eos_ids
    want = [t for r in CD.read(out) for t in r["ids"] + ([] if r["ids"][-1] in eos else [eos[0]])]
    assert np.concatenate([tr, va]).tolist() == want
    z = np.load(out / "shard-t0.7-00000.npz")
    assert z["tokens"].dtype == np.int32 and z["offsets"][-1] == len(z["tokens"])


def test_recorded_answers_instead_of_generating(sharegpt, tmp_path, monkeypatch):
    """``--recorded``: the conversations' own answers (capped, EOS-ended unless cut), nothing generated."""
    m = pdecode.load(tiny_hf(tmp_path / "tiny"))
    monkeypatch.setattr(pdecode, "generate", lambda *a, **k: pytest.fail("recorded answers generate nothing"))
    out = tmp_path / "rec"
    man = CD.generate_data(m, out, conversations=4, new_tokens=3, max_prompt_tokens=64, shard=3, sharegpt=sharegpt,
                           recorded=True, stream=open("/dev/null", "w"))
    assert man["settings"]["answers"] == "recorded" and man["settings"]["temperatures"] == []
    rows = CD.read(out)
    assert [r["temperature"] for r in rows] == [None] * 5 and (out / "shard-recorded-00001.npz").exists()
    eos = m.tokenizer.eos_ids[0]
    for r, (i, t, _, reply) in zip(rows, CD.conversation_turns(sharegpt, 0, 4, with_reply=True)):
        ans = m.tokenizer.encode(reply, add_special_tokens=False)
        assert (r["conversation"], r["turn"]) == (i, t) and reply == f"answer {i} {t}"
        assert r["ids"][r["prompt_len"]:] == (ans[:3] if len(ans) >= 3 else ans + [eos])
    assert CD.is_data_dir(out) and CD.main(["--base", str(tmp_path / "tiny"), "--out", str(out), "--conversations",
                                            "4", "--new-tokens", "3", "--max-prompt-tokens", "64", "--shard", "3",
                                            "--sharegpt-file", str(sharegpt), "--recorded"])["examples"] == 5
