"""Streaming data: lazy reading, packing, a deterministic split, sharding and resumable positions."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from spectrain.data.datamodule import DrafterDataModule
from spectrain.data.streaming import StreamingLoader
from spectrain.heads.errors import SpectrainError


def module(tmp_path, verifier_factory, path, **kw):
    dm = DrafterDataModule(path=str(path), tokenizer=str(verifier_factory("llama", False)), block_size=16,
                           batch_size=4, streaming=True, **kw)
    dm.setup()
    return dm


def test_text_is_packed_without_padding_and_split_by_row(tmp_path, verifier_factory, text_file):
    dm = module(tmp_path, verifier_factory, text_file)
    tok = dm.tokenizer
    lines = text_file.read_text().splitlines(keepends=True)
    val_every = round(1 / dm.val_fraction)
    train_ids = [t for i, line in enumerate(lines) if i % val_every != val_every - 1
                 for t in tok(line, add_special_tokens=False)["input_ids"]]
    blocks = [b["input_ids"] for b in dm.train_set]
    assert all(len(b) == 16 for b in blocks)  # packed: every block full, no padding
    assert [t for b in blocks for t in b] == train_ids[:len(blocks) * 16]  # the stream, in order, nothing lost
    val_blocks = [b["input_ids"] for b in dm.val_set]
    assert val_blocks and not set(map(tuple, val_blocks)) & set(map(tuple, blocks))


def test_loader_positions_shards_and_batches(tmp_path, verifier_factory, text_file):
    dm = module(tmp_path, verifier_factory, text_file, shuffle_buffer=8)
    full = [b["input_ids"] for b in itertools_take(StreamingLoader(dm.train_set, 4, dm.collate, seed=1), 6)]
    resumed = [b["input_ids"] for b in itertools_take(StreamingLoader(dm.train_set, 4, dm.collate, seed=1,
                                                                        position=lambda: 2), 4)]
    for a, b in zip(full[2:], resumed):
        assert torch.equal(a, b)  # skipping 2 consumed batches continues exactly where training stopped
    assert all(b.shape == (4, 16) for b in full)


def itertools_take(iterable, n):
    import itertools

    return list(itertools.islice(iter(iterable), n))


def test_chat_jsonl_streams_and_json_arrays_are_refused(tmp_path, verifier_factory):
    rows = [{"messages": [{"role": "user", "content": f"what is the king {i}"},
                          {"role": "assistant", "content": "the king is good and the queen is fast " * 2}]}
            for i in range(40)]
    jsonl = tmp_path / "chat.jsonl"
    jsonl.write_text("".join(json.dumps(r) + "\n" for r in rows))
    dm = DrafterDataModule(path=str(jsonl), tokenizer=str(verifier_factory("llama", False)), block_size=64,
                           batch_size=2, streaming=True)
    dm.setup()
    sample = next(iter(dm.train_set))
    assert 0 < sum(sample["loss_mask"]) < len(sample["input_ids"])  # assistant-only loss mask
    arr = tmp_path / "chat.json"
    arr.write_text(json.dumps(rows))
    dm = DrafterDataModule(path=str(arr), tokenizer=str(verifier_factory("llama", False)), streaming=True)
    with pytest.raises(SpectrainError, match="convert .* to .jsonl"):
        dm.setup()


@pytest.mark.integration
def test_training_reads_only_what_it_streams(tmp_path, verifier_factory):
    """train_medusa on a 300 MB corpus reads only what it trains on (the kernel's read counter says so)."""
    corpus = tmp_path / "big.txt"
    line = "the king and the queen sat on the green hill under the blue tree and spoke of the night\n"
    with open(corpus, "w") as f:
        for _ in range(18):
            f.write(line * 200_000)  # 18 x 17 MB ~ 300 MB of text, ~60M tokens
    script = (
        "import sys\n"
        "def rchar():\n"
        "    return int(open('/proc/self/io').read().split('rchar: ')[1].split()[0])\n"
        "from spectrain.train.cli import train_medusa\n"
        "start = rchar()  # bytes read so far: Python, torch and Lightning imports\n"
        "sys.argv = ['train_medusa'] + sys.argv[1:]\n"
        "try:\n"
        "    train_medusa()\n"
        "finally:\n"
        "    print('RCHAR', rchar() - start, file=sys.stderr)\n")
    args = ["--model.verifier", str(verifier_factory("llama", False)), "--data.path", str(corpus),
            "--data.streaming", "true", "--data.block_size", "32", "--data.batch_size", "4",
            "--trainer.max_steps", "4", "--trainer.val_check_interval", "4", "--trainer.limit_val_batches", "2",
            "--model.num_heads", "2", "--logger", "none", "--run_dir", str(tmp_path / "run")]
    proc = subprocess.run([sys.executable, "-c", script, *args], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["steps"] == 4
    read = int(proc.stderr.split("RCHAR ")[1].split()[0])
    assert read < corpus.stat().st_size / 3, f"read {read} bytes of a {corpus.stat().st_size}-byte corpus"


def test_hf_dataset_streams_documents_joined_by_eos(tmp_path, verifier_factory):
    """A local HF dataset (a directory of JSONL files) read with load_dataset(streaming=True), never materialized."""
    data = tmp_path / "hfdata"
    data.mkdir()
    docs = [f"the king {i} sat on the green hill and the queen spoke of the night" for i in range(60)]
    (data / "train.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    dm = DrafterDataModule(path=str(data), format="hf", tokenizer=str(verifier_factory("llama", False)),
                           block_size=16, batch_size=2, streaming=True)
    dm.setup()
    tok = dm.tokenizer
    val_every = round(1 / dm.val_fraction)
    expected = []
    for i, d in enumerate(docs):
        if i % val_every != val_every - 1:
            expected += tok(d, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    blocks = [b["input_ids"] for b in dm.train_set]
    assert blocks and [t for b in blocks for t in b] == expected[:len(blocks) * 16]
    assert sum(b.count(tok.eos_token_id) for b in blocks) >= 10  # documents are separated, not run together


def test_each_rank_streams_only_its_own_rows(tmp_path, verifier_factory):
    """Two ranks read disjoint rows (each tokenizes only its own share) that together are one process's rows."""
    from spectrain.data.streaming import RowStream

    rows = [f"row {i}" for i in range(20)]
    seen: dict[int, list] = {}

    def to_samples(rank):
        def inner(raw):
            for r in raw:
                seen.setdefault(rank, []).append(r)  # what this rank had to read and tokenize
                yield {"input_ids": [int(r.split()[1])]}
        return inner

    stream = RowStream(lambda: iter(rows), None, "train", val_every=5)
    shares = []
    for rank in (0, 1):
        stream.to_samples = to_samples(rank)
        shares.append([s["input_ids"][0] for s in stream.shard(rank, 2)])
    stream.to_samples = to_samples(-1)
    one = [s["input_ids"][0] for s in stream]
    assert not set(shares[0]) & set(shares[1]) and sorted(shares[0] + shares[1]) == sorted(one)
    assert len(seen[0]) == len(seen[1]) == len(one) // 2  # neither rank touched the other's rows


@pytest.mark.parametrize("streaming", [True, False])
def test_validation_shares_are_equal_and_padded_without_targets(tmp_path, verifier_factory, text_file, monkeypatch,
                                                                streaming):
    """Every rank gets ceil(n / world) validation rows (a rank with a batch fewer would leave FSDP's gathers
    waiting): rank r reads rows r, r + world, ...; where the rows run out, a copy without targets. A stream (an
    IterableDataset, whose inherited ``__getitem__`` raises) is dealt the same way, not indexed."""
    import spectrain.data.datamodule as datamodule
    from spectrain.train.measure import measure_prompts_from

    dm = DrafterDataModule(path=str(text_file), tokenizer=str(verifier_factory("llama", False)), block_size=16,
                           batch_size=2, streaming=streaming)
    dm.setup()
    rows = list(dm.val_set)
    world = 3
    if len(rows) % world == 0:  # the padding must be exercised
        world = 4 if len(rows) % 4 else 5
    assert len(rows) % world and len(rows) >= world
    shares = []
    for rank in range(world):
        monkeypatch.setattr(datamodule, "rank_and_world", lambda rank=rank: (rank, world))
        shares.append([r for b in dm.val_dataloader() for r in zip(b["input_ids"], b["loss_mask"])])
    assert len({len(s) for s in shares}) == 1 and len(shares[0]) == -(-len(rows) // world)
    real = [(ids, mask) for share in shares for ids, mask in share if mask.any()]
    assert sorted(ids.tolist() for ids, _ in real) == sorted(list(r["input_ids"]) for r in rows)  # each row once
    padding = [mask for share in shares for _, mask in share if not mask.any()]
    assert len(padding) == len(shares[0]) * world - len(rows)
    # Measured-tau prompts read a stream from its start instead of indexing it.
    assert len(measure_prompts_from(dm.val_set, 2)) == 2
