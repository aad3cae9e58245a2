"""Rows cut at the block size are counted, recorded and warned about: the counter, chat rendering, every chat
source of the data module (file + its cache, HF dataset, stream), hidden-state stores (metadata written at
extraction, read back in training; older stores without the record), the extraction and training summaries.

Expected counts come from full renders (``max_length`` far above every row) and plain Python over them, never
from the counter under test.
"""

from __future__ import annotations

import json
import logging
import math
from argparse import Namespace
from pathlib import Path

import pytest

from spectrain.data.chat import render_chat, render_chat_measured, to_messages, tokenize_chat_file
from spectrain.data.datamodule import DrafterDataModule
from spectrain.data.truncation import Truncation
from spectrain.heads.errors import SpectrainError

FULL = 100_000  # a max_length that cuts nothing
BLOCK = 48
WORDS = "the cat sat on the mat and the dog ran over the green hill".split()


def conversation(i: int, reply_words: int) -> dict:
    reply = " ".join(WORDS[(i + k) % len(WORDS)] for k in range(reply_words))
    return {"messages": [{"role": "user", "content": f"tell me about the cat {i}"},
                         {"role": "assistant", "content": reply}]}


def write_jsonl(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def expected(records: list[dict], tokenizer, block: int) -> dict:
    """The counts, by hand, from each conversation's full render."""
    full = [render_chat(to_messages(r), tokenizer, FULL) for r in records]
    lengths = sorted(len(f["input_ids"]) for f in full)
    return {"rows": len(full), "rows_cut": sum(len(f["input_ids"]) > block for f in full),
            "loss_tokens": sum(sum(f["loss_mask"]) for f in full),
            "loss_tokens_cut": sum(sum(f["loss_mask"][block:]) for f in full),
            "block_size_keeping_95pct": lengths[math.ceil(0.95 * len(lengths)) - 1],
            "block_size_keeping_all": lengths[-1]}


def recorded_counts(record: dict) -> dict:
    return {k: record[k] for k in ("rows", "rows_cut", "loss_tokens", "loss_tokens_cut", "block_size_keeping_95pct",
                                   "block_size_keeping_all")}


@pytest.fixture(scope="module")
def verifier_dir(verifier_factory):
    return verifier_factory("llama", False)


@pytest.fixture(scope="module")
def tokenizer(verifier_dir):
    from spectrain.heads.verifier import load_tokenizer

    return load_tokenizer(str(verifier_dir))


def mixed_records(n_short: int, n_long: int) -> list[dict]:
    """Short conversations that fit BLOCK and long ones of growing length that do not."""
    return [conversation(i, 3) for i in range(n_short)] + [conversation(i, 40 + 5 * i) for i in range(n_long)]


# --------------------------------------------------------------------------- the counter


def test_warning_above_five_percent_not_at_it():
    at = Truncation(10)
    for i in range(20):  # 1 of 20 rows (5 %) cut, losing 5 of 100 loss tokens (5 %)
        at.add(12 if i == 0 else 8, 5, 0 if i == 0 else 5)
    assert (at.rows_cut, at.loss_tokens_cut) == (1, 5) and at.warning("data") is None
    over_rows = at.merge(Truncation(10))
    over_rows.add(11, 5, 5)  # a second cut row that loses no loss token: 2 of 21 rows
    assert over_rows.warning("data") is not None and over_rows.loss_tokens_cut == 5
    over_tokens = Truncation(10)
    for i in range(20):  # 1 of 20 rows (5 %), but 6 of 100 loss tokens
        over_tokens.add(12 if i == 0 else 8, 5 if i else 6, 0 if i == 0 else 5)
    message = over_tokens.warning("data.jsonl")
    assert message.startswith("data.jsonl: 1 of 20 rows (5.0 %)") and "6 of 101 loss tokens (5.9 %)" in message
    assert "block_size=12 keeps every row" in message


def test_a_record_reads_back_with_its_counts_and_warning():
    counter = Truncation(16)
    for length in range(1, 41):  # lengths 1..40: 24 rows longer than 16
        counter.add(length, 2, 1 if length > 16 else 2)
    back = Truncation.from_record(json.loads(json.dumps(counter.record())))
    assert back.record() == counter.record() and back.warning("x") == counter.warning("x")
    assert counter.record()["block_size_keeping_95pct"] == 38 and counter.record()["block_size_keeping_all"] == 40
    with pytest.raises(KeyError):
        Truncation.from_record({"block_size": 16, "rows": 3})


# --------------------------------------------------------------------------- rendering


def test_render_measures_what_the_cut_takes(tokenizer):
    messages = to_messages(conversation(0, 60))
    full = render_chat(messages, tokenizer, FULL)
    for n in (5, BLOCK, len(full["input_ids"]) - 1, len(full["input_ids"]), FULL):
        measured = render_chat_measured(messages, tokenizer, n)
        assert measured.row == render_chat(messages, tokenizer, n)
        assert measured.length == len(full["input_ids"]) and measured.loss_tokens == sum(full["loss_mask"])
        assert measured.kept_loss_tokens == sum(full["loss_mask"][:n])
        assert measured.cut == (n < len(full["input_ids"]))


def test_chat_file_counts_rows_cut(tokenizer, tmp_path):
    records = mixed_records(12, 8) + [{"messages": [{"role": "user", "content": "no answer"}]}]
    path = write_jsonl(tmp_path / "chat.jsonl", records)
    tokenized = tokenize_chat_file(str(path), tokenizer, BLOCK)
    want = expected(records[:-1], tokenizer, BLOCK)  # the row without an answer is skipped, not counted
    assert want["rows_cut"] == 8 and 0 < want["loss_tokens_cut"] < want["loss_tokens"]
    assert recorded_counts(tokenized.truncation.record()) == want
    rows, skipped = tokenized  # callers written before the count unpack two values
    assert rows == tokenized.rows and skipped == 1 and all(len(r["input_ids"]) <= BLOCK for r in rows)


def test_a_row_cut_before_its_reply_is_skipped_and_counted(tokenizer, tmp_path):
    records = [conversation(0, 3), conversation(1, 3)]
    block = max(len(render_chat(to_messages(r), tokenizer, FULL)["input_ids"]) for r in records)
    records.append({"messages": [{"role": "user", "content": " ".join(WORDS * 3)},  # a prompt longer than block
                                 {"role": "assistant", "content": "yes"}]})
    tokenized = tokenize_chat_file(str(write_jsonl(tmp_path / "c.jsonl", records)), tokenizer, block)
    assert tokenized.skipped == 1 and len(tokenized.rows) == 2
    assert recorded_counts(tokenized.truncation.record()) == expected(records, tokenizer, block)
    assert tokenized.truncation.rows_cut == 1
    reply_tokens = sum(render_chat(to_messages(records[2]), tokenizer, FULL)["loss_mask"])
    assert tokenized.truncation.loss_tokens_cut == reply_tokens  # every target of the cut row lost


# --------------------------------------------------------------------------- the data module


def test_chat_file_counts_are_cached_and_warned_at_setup(verifier_dir, tokenizer, tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("SPECTRAIN_CACHE", str(tmp_path / "cache"))
    records = mixed_records(12, 8)
    path = write_jsonl(tmp_path / "chat.jsonl", records)
    with caplog.at_level(logging.WARNING, logger="spectrain.data.datamodule"):
        data = DrafterDataModule(path=str(path), tokenizer=str(verifier_dir), block_size=BLOCK)
        data.setup()
    entry = data.truncation_entry()
    assert recorded_counts(entry) == expected(records, tokenizer, BLOCK)
    assert "train and validation" in entry["counted"]
    warnings = [r.getMessage() for r in caplog.records if "block_size" in r.getMessage()]
    assert len(warnings) == 1 and "8 of 20 rows (40.0 %)" in warnings[0] and str(path) in warnings[0]
    # The cache keeps the record: read again without tokenizing, the same counts.
    from spectrain.data import chat

    monkeypatch.setattr(chat, "tokenize_chat_file", lambda *a, **k: pytest.fail("tokenized again"))
    again = DrafterDataModule(path=str(path), tokenizer=str(verifier_dir), block_size=BLOCK)
    again.setup()
    assert again.truncation_entry() == entry


def test_little_cut_is_counted_without_a_warning(verifier_dir, tokenizer, tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("SPECTRAIN_CACHE", str(tmp_path / "cache"))
    # The shortest reply whose conversation outgrows BLOCK: 1 of 41 rows cut, a few of its loss tokens lost.
    barely = next(conversation(0, k) for k in range(3, 200)
                  if len(render_chat(to_messages(conversation(0, k)), tokenizer, FULL)["input_ids"]) > BLOCK)
    records = [conversation(i, 3) for i in range(40)] + [barely]
    path = write_jsonl(tmp_path / "chat.jsonl", records)
    with caplog.at_level(logging.WARNING, logger="spectrain.data.datamodule"):
        data = DrafterDataModule(path=str(path), tokenizer=str(verifier_dir), block_size=BLOCK)
        data.setup()
    want = expected(records, tokenizer, BLOCK)
    assert recorded_counts(data.truncation_entry()) == want and want["rows_cut"] == 1
    assert 0 < want["loss_tokens_cut"] <= 0.05 * want["loss_tokens"]
    assert data.truncation_warning() is None and not caplog.records


def test_an_older_chat_cache_without_the_record_is_rebuilt(verifier_dir, tokenizer, tmp_path, monkeypatch):
    monkeypatch.setenv("SPECTRAIN_CACHE", str(tmp_path / "cache"))
    records = mixed_records(12, 8)
    path = write_jsonl(tmp_path / "chat.jsonl", records)
    DrafterDataModule(path=str(path), tokenizer=str(verifier_dir), block_size=BLOCK).setup()
    (meta,) = (tmp_path / "cache" / "tokenized").glob("chat-*/spectrain.json")
    meta.write_text(json.dumps({"skipped": 0}))  # what caches written before the count hold
    from spectrain.data import chat

    calls = []
    original = chat.tokenize_chat_file
    monkeypatch.setattr(chat, "tokenize_chat_file", lambda *a, **k: calls.append(1) or original(*a, **k))
    data = DrafterDataModule(path=str(path), tokenizer=str(verifier_dir), block_size=BLOCK)
    data.setup()
    assert calls == [1] and recorded_counts(data.truncation_entry()) == expected(records, tokenizer, BLOCK)
    assert "truncation" in json.loads(meta.read_text())


def test_hf_chat_rows_and_streams_are_counted(verifier_dir, tokenizer, tmp_path, monkeypatch):
    import datasets

    monkeypatch.setenv("SPECTRAIN_CACHE", str(tmp_path / "cache"))
    records = mixed_records(12, 8) + [{"messages": [{"role": "user", "content": "no answer"}]}]
    want = expected(records[:-1], tokenizer, BLOCK)
    saved = tmp_path / "hf"
    datasets.Dataset.from_list(records).save_to_disk(str(saved))
    hf = DrafterDataModule(path=str(saved), tokenizer=str(verifier_dir), block_size=BLOCK)
    hf.setup()
    assert hf.resolved_format() == "hf" and recorded_counts(hf.truncation_entry()) == want
    assert set(hf.train_set.column_names) == {"input_ids", "loss_mask"}
    assert len(hf.train_set) + len(hf.val_set) == 20  # no row lost its every target here
    stream = DrafterDataModule(path=str(write_jsonl(tmp_path / "s.jsonl", records)), tokenizer=str(verifier_dir),
                               block_size=BLOCK, streaming=True)
    stream.setup()
    assert recorded_counts(stream.truncation_entry()) == want and "first 1000 rows" in stream.truncation_counted
    assert stream.truncation_warning() is not None


def test_plain_text_is_packed_not_cut(verifier_dir, text_file):
    data = DrafterDataModule(path=str(text_file), tokenizer=str(verifier_dir), block_size=BLOCK)
    data.setup()
    assert data.truncation is None and data.truncation_warning() is None
    assert data.truncation_entry() == {"counted": data.truncation_counted} and "packed" in data.truncation_counted


# --------------------------------------------------------------------------- stores and the summaries


@pytest.fixture(scope="module")
def chat_store(tmp_path_factory, verifier_dir):
    """A store extracted by ``spectrain-extract``'s body from 20 conversations, 8 of them cut; its printed lines."""
    import contextlib
    import io
    import os

    from spectrain.data.extract import extract_command

    root = tmp_path_factory.mktemp("chat-store")
    path = write_jsonl(root / "chat.jsonl", mixed_records(12, 8))
    args = Namespace(verifier=str(verifier_dir), gguf_file=None, data=str(path), block_size=BLOCK, layer_ids="1,2",
                     out=str(root / "store"), dtype="bfloat16", verifier_dtype="float32", topk=0, batch_size=4,
                     rows_per_shard=8, device="cpu")
    printed = io.StringIO()
    old_cache = os.environ.get("SPECTRAIN_CACHE")
    os.environ["SPECTRAIN_CACHE"] = str(root / "cache")
    try:
        with contextlib.redirect_stdout(printed):
            extract_command(args)
    finally:
        if old_cache is None:
            os.environ.pop("SPECTRAIN_CACHE")
        else:
            os.environ["SPECTRAIN_CACHE"] = old_cache
    return path, root / "store", printed.getvalue().splitlines()


def test_extraction_records_and_prints_the_cut(chat_store, tokenizer):
    path, store, lines = chat_store
    want = expected(mixed_records(12, 8), tokenizer, BLOCK)
    for split in ("train", "validation"):
        entry = json.loads((store / split / "metadata.json").read_text())["truncation"]
        assert recorded_counts(entry) == want and "train and validation" in entry["counted"]
    assert any(l.startswith("rows cut at block_size: 8 of 20 rows cut at block_size=48 (40.0 %)") for l in lines)
    (warning,) = [l for l in lines if l.startswith("warning: ")]
    assert f"block_size={want['block_size_keeping_all']} keeps every row" in warning
    assert lines[-1].endswith("metadata.json")  # the path stays the last line


def test_training_from_a_store_reports_its_extraction(chat_store, verifier_dir, tokenizer, tmp_path, caplog):
    _, store, _ = chat_store
    with caplog.at_level(logging.WARNING, logger="spectrain.data.datamodule"):
        data = DrafterDataModule(path=str(store), tokenizer=str(verifier_dir), block_size=BLOCK)
        data.setup()
    assert data.resolved_format() == "store" and data.truncation_counted.startswith("at extraction, every")
    assert recorded_counts(data.truncation_entry()) == expected(mixed_records(12, 8), tokenizer, BLOCK)
    assert [r for r in caplog.records if "8 of 20 rows" in r.getMessage()]


def test_a_store_without_the_record_still_loads(chat_store, verifier_dir, tmp_path):
    import shutil

    from spectrain.data.store import HiddenStateStore, extract
    from spectrain.heads.verifier import load_verifier

    _, store, _ = chat_store
    old = tmp_path / "old"
    shutil.copytree(store, old)
    for split in ("train", "validation"):  # metadata as stores extracted before the count have it
        meta_path = old / split / "metadata.json"
        meta = json.loads(meta_path.read_text())
        meta.pop("truncation")
        meta_path.write_text(json.dumps(meta))
    assert len(HiddenStateStore(old / "train")) == len(HiddenStateStore(store / "train"))
    data = DrafterDataModule(path=str(old), tokenizer=str(verifier_dir), block_size=BLOCK)
    data.setup()
    assert data.truncation is None and data.truncation_entry()["counted"].startswith("not recorded")
    # Resuming an older interrupted extraction with the record is not "other settings": the record is a report.
    meta_path = old / "train" / "metadata.json"
    meta = json.loads(meta_path.read_text())
    interrupted = dict(meta, shards=meta["shards"][:1])
    interrupted.pop("complete")
    meta_path.write_text(json.dumps(interrupted))
    rows = [HiddenStateStore(store / "train")[i] for i in range(meta["rows"])]
    rows = [{"input_ids": r["input_ids"].tolist(), "loss_mask": r["loss_mask"].tolist()} for r in rows]
    record = json.loads((store / "train" / "metadata.json").read_text())["truncation"]
    extract(load_verifier(str(verifier_dir), dtype="float32"), rows, old / "train", (1, 2), meta["data"],
            rows_per_shard=meta["rows_per_shard"], batch_size=4, log=lambda *_: None, truncation=record)
    resumed = json.loads(meta_path.read_text())
    assert resumed["complete"] and resumed["truncation"] == record


def test_a_bad_record_in_store_metadata_is_named(chat_store, verifier_dir, tmp_path):
    import shutil

    _, store, _ = chat_store
    bad = tmp_path / "bad"
    shutil.copytree(store, bad)
    meta_path = bad / "train" / "metadata.json"
    meta = json.loads(meta_path.read_text())
    meta["truncation"] = {"counted": "x", "rows": 3}
    meta_path.write_text(json.dumps(meta))
    with pytest.raises(SpectrainError, match=r"metadata\.json: its 'truncation' entry is not a truncation record"):
        DrafterDataModule(path=str(bad), tokenizer=str(verifier_dir), block_size=BLOCK).setup()


def test_the_training_summary_carries_the_cut(verifier_dir, tokenizer, tmp_path, monkeypatch, capsys):
    from spectrain.train.cli import train

    monkeypatch.setenv("SPECTRAIN_CACHE", str(tmp_path / "cache"))
    records = mixed_records(12, 8)
    path = write_jsonl(tmp_path / "chat.jsonl", records)
    summary_path = train("medusa_tinyshakespeare.yaml", args=[
        "--model.verifier", str(verifier_dir), "--data.path", str(path), "--data.block_size", str(BLOCK),
        "--data.batch_size", "4", "--run_dir", str(tmp_path / "run"), "--logger", "none", "--trainer.max_steps", "1",
        "--trainer.val_check_interval", "1", "--model.num_heads", "1", "--model.measure_prompts", "0"])
    entry = json.loads(summary_path.read_text())["truncation"]
    assert recorded_counts(entry) == expected(records, tokenizer, BLOCK)
    assert entry["warning"].startswith(f"{path}: 8 of 20 rows (40.0 %)")
    out = capsys.readouterr().out
    assert any(l.startswith("rows cut at block_size") and l.rstrip().endswith(
        f"8 of 20 (40.0 %), {entry['loss_tokens_cut']} of {entry['loss_tokens']} loss tokens "
        f"({100 * entry['loss_token_fraction']:.1f} %)") for l in out.splitlines())
    assert f"warning: {entry['warning']}" in out
