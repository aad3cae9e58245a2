"""Self-distillation: batched multi-turn generation, ShareGPT output, resumable without lost or doubled rows."""

from __future__ import annotations

import json

import pytest

import spectrain.data.distill as distill_mod
from spectrain.data.distill import distill
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
