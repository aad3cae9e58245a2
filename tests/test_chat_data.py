"""Chat data: file loading, record formats and the assistant-only loss mask.

The tokenizer is the bundled recipe's byte-level BPE (ChatML-like template),
trained in-process on a few KB of generated text, so nothing is read from disk
caches or the network.
"""

from __future__ import annotations

import json
import random

import pytest

from spectrain.data.bundled import train_tokenizer
from spectrain.data.chat import load_records, render_chat, to_messages, tokenize_chat_file
from spectrain.heads.errors import SpectrainError

END = "<|im_end|>"
WORDS = ("the a cat dog sat on mat ran fast slow river hill tree bird sings quietly under over green blue house "
         "what is where why how capital city of france paris big small answer question tell me about").split()


@pytest.fixture(scope="module")
def tok():
    rng = random.Random(0)
    text = "\n".join(" ".join(rng.choice(WORDS) for _ in range(12)) + rng.choice(".?!") for _ in range(400))
    return train_tokenizer(text, vocab_size=300)


def decode(tok, ids: list[int]) -> str:
    return tok.decode(ids, clean_up_tokenization_spaces=False)


def split_by_mask(tok, row: dict) -> tuple[str, str]:
    """(text of the masked tokens, text of the unmasked tokens)."""
    ids, mask = row["input_ids"], row["loss_mask"]
    assert len(ids) == len(mask)
    return (decode(tok, [t for t, m in zip(ids, mask) if m]),
            decode(tok, [t for t, m in zip(ids, mask) if not m]))


def assert_targets(tok, record: dict, users: list[str], assistants: list[str]) -> None:
    """Masked tokens decode to exactly the assistant contents, each closed by the end-of-turn marker."""
    row = render_chat(to_messages(record), tok, max_length=4096)
    masked, unmasked = split_by_mask(tok, row)
    assert masked == "".join(a + END for a in assistants)
    for u in users:
        assert u in unmasked
    for a in assistants:
        assert a not in unmasked
    assert "<|im_start|>assistant\n" in unmasked  # the role header is context, not a target


# --------------------------------------------------------------------------- formats


def test_sharegpt(tok):
    rec = {"conversations": [{"from": "human", "value": "where is the cat?"},
                             {"from": "gpt", "value": "The cat sat on the mat."}]}
    assert_targets(tok, rec, ["where is the cat?"], ["The cat sat on the mat."])


def test_openai_messages_with_system_prompt(tok):
    rec = {"messages": [{"role": "system", "content": "You answer about birds."},
                        {"role": "user", "content": "why does a bird sing?"},
                        {"role": "assistant", "content": "Birds sing quietly under green trees."}]}
    assert_targets(tok, rec, ["You answer about birds.", "why does a bird sing?"],
                   ["Birds sing quietly under green trees."])


def test_alpaca_without_input(tok):
    rec = {"instruction": "tell me about the river", "input": "", "output": "A slow blue river."}
    assert to_messages(rec)[0]["content"] == "tell me about the river"
    assert_targets(tok, rec, ["tell me about the river"], ["A slow blue river."])


def test_alpaca_with_input(tok):
    rec = {"instruction": "what is the capital?", "input": "city of france", "output": "Paris, a big city."}
    assert to_messages(rec)[0]["content"] == "what is the capital?\n\ncity of france"
    assert_targets(tok, rec, ["what is the capital?\n\ncity of france"], ["Paris, a big city."])


def test_multi_turn_two_assistant_turns_and_non_ascii(tok):
    rec = {"conversations": [{"from": "system", "value": "be brief"},
                             {"from": "human", "value": "how fast is the dog?"},
                             {"from": "chatgpt", "value": "The dog ran fast."},
                             {"from": "user", "value": "and the cat?"},
                             {"from": "assistant", "value": "The café cat is slow ☕"},
                             {"from": "human", "value": "thanks"}]}  # trailing user turn is dropped
    msgs = to_messages(rec)
    assert [m["role"] for m in msgs] == ["system", "user", "assistant", "user", "assistant"]
    assert_targets(tok, rec, ["be brief", "how fast is the dog?", "and the cat?"],
                   ["The dog ran fast.", "The café cat is slow ☕"])


def test_mt_bench_turns_have_no_assistant(tok):
    assert to_messages({"turns": ["what is a tree?", "and a hill?"]}) is None


# --------------------------------------------------------------------------- records


def test_no_assistant_turn_returns_none():
    assert to_messages({"messages": [{"role": "user", "content": "hi"}]}) is None
    assert to_messages({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": ""}]}) is None
    assert to_messages({"instruction": "do it", "output": ""}) is None


def test_unknown_role_is_named():
    with pytest.raises(SpectrainError, match="'narrator'"):
        to_messages({"conversations": [{"from": "narrator", "value": "once"}]})
    with pytest.raises(SpectrainError, match="'tool'"):
        to_messages({"messages": [{"role": "tool", "content": "42"}]})


def test_unrecognised_format_lists_keys():
    with pytest.raises(SpectrainError, match=r"\['prompt', 'text'\]"):
        to_messages({"text": "x", "prompt": "y"})


# --------------------------------------------------------------------------- rendering


def test_truncation_keeps_lengths_equal(tok):
    rec = {"messages": [{"role": "user", "content": "tell me about the house"},
                        {"role": "assistant", "content": "The green house is on the hill over the river."}]}
    full = render_chat(to_messages(rec), tok, max_length=4096)
    for n in (1, 5, 12, len(full["input_ids"]) - 1):
        row = render_chat(to_messages(rec), tok, max_length=n)
        assert len(row["input_ids"]) == len(row["loss_mask"]) == n
        assert row["input_ids"] == full["input_ids"][:n]
        assert row["loss_mask"] == full["loss_mask"][:n]


def test_no_chat_template_is_a_clear_error(tok, monkeypatch):
    monkeypatch.setattr(tok, "chat_template", None)
    with pytest.raises(SpectrainError, match="has no chat template"):
        render_chat([{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}], tok, 64)


def test_slow_tokenizer_is_refused():
    class Slow:
        name_or_path = "some/slow-model"
        chat_template = "{{ messages }}"
        is_fast = False

    with pytest.raises(SpectrainError, match="some/slow-model.*slow"):
        render_chat([{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}], Slow(), 64)


def test_prefix_inconsistent_template_is_refused(tok, monkeypatch):
    # Writing the message count first changes the text of every earlier prefix.
    monkeypatch.setattr(tok, "chat_template", "{{ messages|length }}{% for m in messages %}{{ m['content'] }}{% endfor %}")
    with pytest.raises(SpectrainError, match="prefix-consistent"):
        render_chat([{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}], tok, 64)


# --------------------------------------------------------------------------- files


def write_jsonl(path, rows) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


GOOD = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello there"}]}
NO_ANSWER = {"messages": [{"role": "user", "content": "hi"}]}


def test_tokenize_file_counts_skips(tok, tmp_path):
    path = write_jsonl(tmp_path / "chat.jsonl", [GOOD, NO_ANSWER, GOOD, {"turns": ["q"]}])
    rows, skipped = tokenize_chat_file(path, tok, max_length=256)
    assert len(rows) == 2 and skipped == 2
    assert all(set(r) == {"input_ids", "loss_mask"} and any(r["loss_mask"]) for r in rows)


def test_rows_truncated_to_no_target_are_skipped(tok, tmp_path):
    path = write_jsonl(tmp_path / "chat.jsonl", [GOOD])
    with pytest.raises(SpectrainError, match="truncation"):
        tokenize_chat_file(path, tok, max_length=3)


def test_file_without_assistant_turns_is_an_error(tok, tmp_path):
    path = write_jsonl(tmp_path / "prompts.jsonl", [NO_ANSWER, {"turns": ["q"]}])
    with pytest.raises(SpectrainError, match=r"no usable conversations in .*prompts\.jsonl: all 2 rows"):
        tokenize_chat_file(path, tok, max_length=256)


def test_bad_record_error_names_file_and_record(tok, tmp_path):
    path = write_jsonl(tmp_path / "chat.jsonl", [GOOD, {"conversations": [{"from": "robot", "value": "x"}]}])
    with pytest.raises(SpectrainError, match=r"chat\.jsonl, record 1: .*'robot'"):
        tokenize_chat_file(path, tok, max_length=256)


def test_load_json_shapes(tmp_path):
    (tmp_path / "a.json").write_text(json.dumps([GOOD]))
    (tmp_path / "b.json").write_text(json.dumps({"train": [GOOD, GOOD]}))
    (tmp_path / "c.jsonl").write_text("\n" + json.dumps(GOOD) + "\n\n" + json.dumps(GOOD) + "\n")
    assert len(load_records(str(tmp_path / "a.json"))) == 1
    assert len(load_records(str(tmp_path / "b.json"))) == 2
    assert len(load_records(str(tmp_path / "c.jsonl"))) == 2


def test_missing_file(tmp_path):
    path = str(tmp_path / "nope.jsonl")
    with pytest.raises(SpectrainError, match=f"chat data file not found: {path}"):
        load_records(path)


@pytest.mark.parametrize("name,content", [("e.jsonl", ""), ("e.json", "  \n"), ("l.json", "[]"), ("b.jsonl", "\n\n")])
def test_empty_file(tmp_path, name, content):
    (tmp_path / name).write_text(content)
    with pytest.raises(SpectrainError, match=f"{tmp_path / name}.* is empty"):
        load_records(str(tmp_path / name))


def test_malformed_json(tmp_path):
    (tmp_path / "bad.json").write_text('[{"messages": [}')
    with pytest.raises(SpectrainError, match=r"bad\.json is not valid JSON"):
        load_records(str(tmp_path / "bad.json"))


def test_malformed_jsonl_names_line(tmp_path):
    (tmp_path / "bad.jsonl").write_text(json.dumps(GOOD) + "\n\n{oops\n")
    with pytest.raises(SpectrainError, match=r"bad\.jsonl, line 3"):
        load_records(str(tmp_path / "bad.jsonl"))


@pytest.mark.parametrize("content", ['{"other": [1]}', "[1, 2]", '"text"'])
def test_top_level_not_list_of_objects(tmp_path, content):
    (tmp_path / "shape.json").write_text(content)
    with pytest.raises(SpectrainError, match=r"shape\.json"):
        load_records(str(tmp_path / "shape.json"))


def test_jsonl_lines_end_at_newline_only(tmp_path):
    """json.dumps(ensure_ascii=False) leaves U+2028 / U+0085 raw inside strings; they must not split a row."""
    rows = [{"conversations": [{"from": "human", "value": "a\u2028b\x85c\x1cd"}, {"from": "gpt", "value": "ok\u2029"}]},
            {"conversations": [{"from": "human", "value": "second"}, {"from": "gpt", "value": "fine"}]}]
    path = tmp_path / "odd.jsonl"
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
    assert load_records(str(path)) == rows


def test_two_processes_build_the_chat_cache_once(tmp_path, monkeypatch, verifier_factory):
    """Data-parallel ranks set up the same data at once: one builds the tokenized cache, the other waits for it
    (a lock), and both read the same complete cache."""
    import threading
    import time

    from spectrain.data import datamodule as dm

    monkeypatch.setenv("SPECTRAIN_CACHE", str(tmp_path / "cache"))
    chat = tmp_path / "chat.jsonl"
    chat.write_text("\n".join(json.dumps({"messages": [{"role": "user", "content": f"question {i}"},
                                                        {"role": "assistant", "content": f"answer {i}"}]})
                              for i in range(12)))
    from spectrain.data import chat as chat_module

    calls = []

    original = chat_module.tokenize_chat_file

    def slow(*args, **kwargs):
        calls.append(1)
        time.sleep(0.5)  # wide open for the other thread to start building too, were there no lock
        return original(*args, **kwargs)

    monkeypatch.setattr(chat_module, "tokenize_chat_file", slow)
    verifier = str(verifier_factory("llama", False))
    modules = [dm.DrafterDataModule(path=str(chat), tokenizer=verifier, block_size=64) for _ in range(2)]
    errors = []

    def setup(m):
        try:
            m.setup("fit")
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=setup, args=(m,)) for m in modules]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and len(calls) == 1
    a, b = (list(m.train_set["input_ids"]) + list(m.val_set["input_ids"]) for m in modules)
    assert a == b and len(a) == 12
    assert not [p for p in (tmp_path / "cache" / "tokenized").iterdir() if p.name.endswith(".tmp")]
