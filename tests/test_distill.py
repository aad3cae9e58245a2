"""Self-distillation: batched multi-turn generation, ShareGPT output, resumable without lost or doubled rows."""

from __future__ import annotations

import json

import pytest

import spectrain.data.distill as distill_mod
from spectrain.data.distill import distill
from spectrain.data.distill_rows import prompt_length
from spectrain.heads.errors import SpectrainError
from spectrain.heads.verifier import load_verifier

SETTINGS = {"verifier": "tiny", "data": ["x.jsonl"], "limit": None, "max_turns": 2, "max_new_tokens": 6,
            "temperature": 0.0, "seed": 0}


@pytest.fixture(scope="module")
def setup(verifier_factory):
    verifier = load_verifier(str(verifier_factory("llama", False)))
    records = [{"messages": [{"role": "user", "content": f"tell me of the king {i}"},
                             {"role": "assistant", "content": "an old answer we replace"},
                             {"role": "user", "content": "and the queen?"}]} for i in range(9)]
    records.append({"turns": ["what is the river", "and the hill"]})  # MT-bench style: no assistant turns at all
    records.append({"messages": [{"role": "assistant", "content": "no user turn"}]})  # nothing to prompt: skipped
    return verifier, records


def rows_of(path):
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def test_generates_two_turns_per_conversation(tmp_path, setup):
    verifier, records = setup
    out = tmp_path / "d.jsonl"
    counts = distill(verifier, records, out, SETTINGS, batch_size=4, log=lambda *_: None)
    rows = rows_of(out)
    assert counts["written"] == 10 and counts["skipped_without_user_turn"] == 1
    assert sorted(r["id"] for r in rows) == list(range(10))  # written in prompt-length order
    rows = sorted(rows, key=lambda r: r["id"])
    for r in rows:
        roles = [t["from"] for t in r["conversations"]]
        assert roles == ["human", "gpt", "human", "gpt"] and r["generation"] == SETTINGS
        assert "an old answer we replace" not in json.dumps(r)
    # Greedy and batched (left padding) equals one conversation at a time.
    single = tmp_path / "single.jsonl"
    distill(verifier, records[:1], single, SETTINGS, batch_size=1, log=lambda *_: None)
    assert rows_of(single)[0]["conversations"] == rows[0]["conversations"]


def test_resume_after_a_crash_loses_and_doubles_nothing(tmp_path, setup, monkeypatch):
    verifier, records = setup
    straight = tmp_path / "straight.jsonl"
    distill(verifier, records, straight, SETTINGS, batch_size=4, log=lambda *_: None)

    out = tmp_path / "crashed.jsonl"
    calls = {"n": 0}
    real = distill_mod.answer_batch

    def crashing(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 3:  # batch 2, first turn: batch 1 is on disk, batch 2 is not
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(distill_mod, "answer_batch", crashing)
    with pytest.raises(KeyboardInterrupt):
        distill(verifier, records, out, SETTINGS, batch_size=4, log=lambda *_: None)
    monkeypatch.setattr(distill_mod, "answer_batch", real)
    assert len(rows_of(out)) == 4
    with open(out, "a") as f:
        f.write('{"id": 4, "conversations": [{"from": "hu')  # a torn write from a kill mid-line
    counts = distill(verifier, records, out, SETTINGS, batch_size=4, log=lambda *_: None)
    assert counts["already_done"] == 4 and counts["written"] == 6
    assert rows_of(out) == rows_of(straight)  # same rows, same order, nothing lost or doubled

    with pytest.raises(SpectrainError, match="other settings"):
        distill(verifier, records, out, {**SETTINGS, "temperature": 1.0}, batch_size=4, log=lambda *_: None)


def test_original_responses_are_the_raw_twin(tmp_path, setup):
    """--responses original: the same conversations and turns, the dataset's replies cut at the token cap."""
    verifier, records = setup
    tok = verifier.tokenizer
    records = [dict(r) for r in records]
    long_reply = " ".join(["word"] * 100)
    records[0] = {"conversations": [{"from": "human", "value": "first question"}, {"from": "gpt", "value": long_reply},
                                    {"from": "human", "value": "second question"}, {"from": "gpt", "value": "short"},
                                    {"from": "human", "value": "third turn, beyond max_turns"},
                                    {"from": "gpt", "value": "dropped"}]}
    settings = {**SETTINGS, "max_new_tokens": 30, "responses": "original", "temperature": None, "seed": None}
    out = tmp_path / "raw.jsonl"
    distill(verifier, records, out, settings, batch_size=4, log=lambda *_: None)
    rows = {r["id"]: r for r in rows_of(out)}
    first = [t["value"] for t in rows[0]["conversations"]]
    assert first[0] == "first question" and first[2] == "second question" and first[3] == "short"
    assert len(first) == 4 and "dropped" not in json.dumps(rows[0])
    assert len(tok(first[1], add_special_tokens=False)["input_ids"]) <= 30 and long_reply.startswith(first[1])
    # Short replies are kept verbatim; a turn without a reply ends the conversation; no reply at all: skipped.
    assert sorted(rows) == list(range(9))
    for i in range(1, 9):
        assert [t["value"] for t in rows[i]["conversations"]] == [f"tell me of the king {i}", "an old answer we replace"]


def test_loop_filter_and_distinct4():
    from spectrain.data.distill_rows import distinct_n, looping

    assert looping([7, 8, 9] + [1, 2, 3, 4, 5, 6, 7, 8] * 4)  # a period of 8 repeated 4 times at the end
    assert looping([5] * 30)
    assert not looping([5] * 10)  # too short a run to call a loop
    assert not looping(list(range(100)))
    assert not looping([1, 2, 3, 4] * 3 + list(range(10, 60)))  # repeats early, then moves on
    assert distinct_n([[1, 2, 3, 4, 5]]) == 1.0 and distinct_n([[1, 1, 1, 1, 1, 1]]) == pytest.approx(1 / 3)


def test_looping_replies_end_their_conversation_and_are_counted(tmp_path, setup, monkeypatch):
    """A reply caught by the loop filter is not kept, nor is its user turn; later turns are not asked."""
    verifier, records = setup
    real = distill_mod.answer_batch
    loop = " ".join(["la la la la"] * 40)

    def looping_first(model, tokenizer, histories, *args):
        replies = real(model, tokenizer, histories, *args)
        return [loop if "king 3" in h[-1]["content"] else r for h, r in zip(histories, replies)]

    monkeypatch.setattr(distill_mod, "answer_batch", looping_first)
    out = tmp_path / "d.jsonl"
    counts = distill(verifier, records, out, SETTINGS, batch_size=4, log=lambda *_: None)
    rows = {r["id"]: r for r in rows_of(out)}
    assert counts["loops_dropped"] == 1 and rows[3]["stopped_by_loop"] and rows[3]["conversations"] == []
    assert len(rows[4]["conversations"]) == 4 and "stopped_by_loop" not in rows[4]
    stats = distill_mod.mix([str(out)], verifier.tokenizer)[0]
    assert stats["conversations"] == 9 and stats["replies"] == 18 and stats["stopped_by_loop"] == 1
    assert 0 < stats["distinct4"] <= 1


def test_max_prompt_tokens_skips_long_prompts_and_later_turns(tmp_path, setup):
    verifier, records = setup
    tok = verifier.tokenizer
    records = [{"messages": [{"role": "user", "content": "word " * 60}, {"role": "assistant", "content": "x"}]}] + records
    short = prompt_length(tok, [{"role": "user", "content": "tell me of the king 1"}])
    out = tmp_path / "d.jsonl"
    counts = distill(verifier, records, out, {**SETTINGS, "max_prompt_tokens": short + 2}, batch_size=4,
                     log=lambda *_: None)
    rows = {r["id"]: r for r in rows_of(out)}
    assert counts["prompt_too_long"] == 1 and rows[0]["conversations"] == []
    assert [t["from"] for t in rows[1]["conversations"]] == ["human", "gpt"]  # the second turn would not fit


def test_report_command(tmp_path, setup, verifier_factory, capsys):
    verifier, records = setup
    out = tmp_path / "d.jsonl"
    distill(verifier, records, out, SETTINGS, batch_size=4, log=lambda *_: None)
    path = distill_mod.run(distill_mod.parse_args(["--report", str(out), str(out), "--verifier",
                                                   str(verifier_factory("llama", False)), "--out",
                                                   str(tmp_path / "mix.json")]))
    assert capsys.readouterr().out.strip().splitlines()[-1] == str(path)
    stats = json.loads(path.read_text())["mix"]
    assert [s["data"] for s in stats][-1] == "all" and stats[-1]["replies"] == 2 * stats[0]["replies"]


def test_the_raw_twin_command_says_nothing_was_generated(tmp_path, setup, verifier_factory, capsys):
    """spectrain-distill --responses original reports reply tokens written, not a generation speed."""
    verifier, records = setup
    data = tmp_path / "chat.jsonl"
    data.write_text("\n".join(json.dumps(r) for r in records[:3]) + "\n")
    distill_mod.main(["--verifier", str(verifier_factory("llama", False)), "--data", str(data), "--responses",
                      "original", "--max_new_tokens", "8", "--device", "cpu", "--out", str(tmp_path / "raw.jsonl")])
    out = capsys.readouterr().out
    assert "nothing generated" in out and "reply tokens written" in out
    assert "self-distillation" not in out and "tokens/s" not in out
