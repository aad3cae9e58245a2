"""Offline hidden-state store: online == offline loss, packed rows with the verifier's greedy / top-k tokens,
resumable extraction, refusal of bad and old-format stores, and length-grouped resumable batches."""

from __future__ import annotations

import json

import pytest
import torch

from spectrain.data.datamodule import DrafterDataModule
from spectrain.data.store import HiddenStateStore, extract
from spectrain.heads.errors import SpectrainError
from spectrain.heads.verifier import load_verifier
from spectrain.train.eagle import EagleModule


@pytest.fixture(scope="module")
def setup(tmp_path_factory, verifier_factory, text_file):
    verifier_dir = verifier_factory("llama", False, layers=3)
    data = DrafterDataModule(path=str(text_file), tokenizer=str(verifier_dir), block_size=32)
    data.setup()
    store = tmp_path_factory.mktemp("store")
    verifier = load_verifier(str(verifier_dir))
    for split, rows in (("train", data.train_set), ("validation", data.val_set)):
        extract(verifier, rows, store / split, (1, 2, 3), "corpus", rows_per_shard=16, log=lambda *_: None)
    return verifier_dir, data, store


@pytest.mark.parametrize("variant", ["eagle1", "eagle3"])
def test_online_equals_offline_loss(setup, variant):
    verifier_dir, data, store = setup
    torch.manual_seed(0)
    module = EagleModule(variant=variant, verifier=str(verifier_dir), aux_layer_ids=[1, 2, 3] if variant == "eagle3" else None,
                         feature_noise=0.0, ttt_steps=2)
    offline = DrafterDataModule(path=str(store), tokenizer=str(verifier_dir), block_size=32, batch_size=4)
    offline.setup()
    assert offline.resolved_format() == "store"
    module.use_store(offline.store_meta)
    stored = offline.collate([offline.train_set[i] for i in range(4)])
    online = data.collate([data.train_set[i] for i in range(4)])
    assert torch.equal(stored["input_ids"], online["input_ids"])
    loss_offline, _ = module.drafter_loss(stored, module.features(stored))
    # The online path, cast to the store's dtype (bf16), must give the same loss.
    features = module.features(online)
    features = {"hidden": features["hidden"].bfloat16().float(), "greedy": features["greedy"],
                "layers": [l.bfloat16().float() for l in features["layers"]]}
    loss_online, _ = module.drafter_loss(online, features)
    torch.testing.assert_close(loss_online, loss_offline, rtol=1e-5, atol=1e-6)


def test_a_block_drafter_trains_from_a_store_as_online(setup):
    """DFlash reads its target layers (HF ids = target_layer_ids + 1) and the greedy targets from the store."""
    from spectrain.train.dflash import DFlashModule

    verifier_dir, data, store = setup
    torch.manual_seed(0)
    module = DFlashModule(verifier=str(verifier_dir), num_layers=2, block_size=4, anchors=4)
    assert module.feature_layer_ids() == (1, 2)  # layers 0 and 1 of the 3-layer verifier: outputs = HF ids + 1
    offline = DrafterDataModule(path=str(store), tokenizer=str(verifier_dir), block_size=32, batch_size=4)
    offline.setup()
    module.use_store(offline.store_meta)
    stored = offline.collate([offline.train_set[i] for i in range(4)])
    online = data.collate([data.train_set[i] for i in range(4)])
    torch.manual_seed(5)  # the same anchors both times
    loss_offline, _ = module.drafter_loss(stored, module.features(stored))
    features = module.features(online, greedy=True)
    features = {"hidden": features["hidden"].bfloat16().float(), "greedy": features["greedy"],
                "layers": [l.bfloat16().float() for l in features["layers"]]}
    torch.manual_seed(5)
    loss_online, _ = module.drafter_loss(online, features)
    torch.testing.assert_close(loss_online, loss_offline, rtol=1e-5, atol=1e-6)


def test_extraction_resumes_without_duplicates(setup, tmp_path):
    verifier_dir, data, _ = setup
    verifier = load_verifier(str(verifier_dir))
    rows = data.train_set

    def quiet(msg):
        pass

    extract(verifier, rows.select(range(16)), tmp_path / "part", (1,), "corpus", rows_per_shard=16, log=quiet)
    meta = json.loads((tmp_path / "part" / "metadata.json").read_text())
    assert len(meta["shards"]) == 1 and meta["complete"]
    # A run interrupted after its first shard: metadata lists one finished shard; rerunning completes it.
    full = tmp_path / "full"
    extract(verifier, rows, full, (1,), "corpus", rows_per_shard=16, log=quiet)
    complete = json.loads((full / "metadata.json").read_text())
    interrupted = dict(complete, shards=complete["shards"][:1])
    interrupted.pop("complete")
    (full / "metadata.json").write_text(json.dumps(interrupted))
    first_shard_mtime = (full / "shard-00000.safetensors").stat().st_mtime_ns
    extract(verifier, rows, full, (1,), "corpus", rows_per_shard=16, log=quiet)
    resumed = json.loads((full / "metadata.json").read_text())
    assert [s["index"] for s in resumed["shards"]] == [s["index"] for s in complete["shards"]]
    assert (full / "shard-00000.safetensors").stat().st_mtime_ns == first_shard_mtime  # kept, not redone
    assert len(HiddenStateStore(full)) == len(rows)


def test_bad_stores_are_refused(setup, verifier_factory, tmp_path):
    verifier_dir, _, store = setup
    other = load_verifier(str(verifier_factory("llama", False, hidden=48)))
    with pytest.raises(SpectrainError, match="another verifier"):
        HiddenStateStore(store / "train", verifier_config=other.config)
    with pytest.raises(SpectrainError, match="needs"):
        HiddenStateStore(store / "train", need_layers=(4,))
    module = EagleModule(variant="eagle3", verifier=str(verifier_factory("llama", False, layers=8)))
    with pytest.raises(SpectrainError, match="another verifier"):
        module.use_store(json.loads((store / "train" / "metadata.json").read_text()))
    # Corrupt and truncated shards are named, not skipped.
    import shutil

    bad = tmp_path / "bad"
    shutil.copytree(store / "train", bad)
    shard = bad / "shard-00000.safetensors"
    data = bytearray(shard.read_bytes())
    data[-10] ^= 0xFF
    shard.write_bytes(bytes(data))
    with pytest.raises(SpectrainError, match="shard-00000.safetensors is corrupt"):
        HiddenStateStore(bad)
    shard.write_bytes(bytes(data[:-100]))
    with pytest.raises(SpectrainError, match="shard-00000.safetensors is missing or truncated"):
        HiddenStateStore(bad)
    with pytest.raises(SpectrainError, match="other settings"):
        extract(load_verifier(str(verifier_dir)), [{"input_ids": [1, 2, 3]}], store / "train", (1,), "corpus",
                log=lambda *_: None)


@pytest.mark.parametrize("config,extra", [
    ("medusa_tinyshakespeare.yaml", ["--model.num_heads", "2"]),
    ("eagle1_tinyshakespeare.yaml", []),
    ("eagle3_tinyshakespeare.yaml", ["--model.aux_layer_ids", "[1, 2, 3]", "--model.draft_vocab_size", "64"]),
])
def test_train_from_the_store_in_bf16_mixed_with_clipping(setup, tmp_path, config, extra):
    """What a GPU run does by default (bf16-mixed, fused AdamW, clipping), from stored features, per method."""
    from spectrain.train.cli import train
    from tests.test_precision_and_vocab import GradNormProbe

    verifier_dir, _, store = setup
    clip = 1e-3  # below the raw gradient norm: clipping must act
    GradNormProbe.norms = []
    path = train(config,
                 args=["--model.verifier", str(verifier_dir), "--data.path", str(store), "--data.batch_size", "4",
                       "--trainer.max_steps", "3", "--trainer.val_check_interval", "3", "--trainer.precision",
                       "bf16-mixed", "--trainer.gradient_clip_val", str(clip),
                       "--trainer.callbacks+=tests.test_precision_and_vocab.GradNormProbe",
                       "--run_dir", str(tmp_path / "run"), "--logger", "none", *extra])
    summary = json.loads(path.read_text())
    assert summary["data_format"] == "store" and summary["steps"] == 3 and summary["tau_pred"] is not None
    assert len(GradNormProbe.norms) >= 2 and max(GradNormProbe.norms) <= clip * 1.01


def test_data_parallel_extraction_equals_one_process(setup, tmp_path):
    """Two ranks (run one after the other here, as torchrun would run them side by side) write the same store."""
    verifier_dir, data, store = setup
    verifier = load_verifier(str(verifier_dir))
    for rank in (1, 0):
        extract(verifier, data.train_set, tmp_path / "dp", (1, 2, 3), "corpus", rows_per_shard=16,
                log=lambda *_: None, rank=rank, world=2)
        complete = (tmp_path / "dp" / "metadata.json").is_file()
        assert complete == (rank == 0)  # the store completes when the last rank finishes
    one, two = HiddenStateStore(store / "train"), HiddenStateStore(tmp_path / "dp")
    assert len(one) == len(two)
    for i in (0, len(one) // 2, len(one) - 1):
        for key in ("input_ids", "hidden", "aux", "greedy"):
            assert torch.equal(one[i][key], two[i][key])
    with pytest.raises(SpectrainError, match="outside a world"):
        extract(verifier, data.train_set, tmp_path / "x", (1,), "corpus", rank=2, world=2)


def test_rows_of_different_lengths_batch_together():
    """Rows are stored unpadded: a batch pads every key to its longest row, with masks 0 on the pad."""
    from spectrain.data.store import collate_store

    def row(n):
        return {"input_ids": torch.arange(1, n + 1), "attention_mask": torch.ones(n, dtype=torch.long),
                "loss_mask": torch.ones(n, dtype=torch.long), "hidden": torch.ones(n, 4), "aux": torch.ones(n, 8),
                "greedy": torch.arange(2, n + 2), "topk_ids": torch.ones(n, 3, dtype=torch.long),
                "topk_logprobs": -torch.ones(n, 3)}

    batch = collate_store([row(3), row(5)])
    assert batch["hidden"].shape == (2, 5, 4) and batch["aux"].shape == (2, 5, 8)
    assert batch["attention_mask"][0].tolist() == [1, 1, 1, 0, 0] and batch["loss_mask"][0, 3:].sum() == 0
    assert batch["input_ids"][0].tolist() == [1, 2, 3, 0, 0] and batch["hidden"][0, 3:].abs().sum() == 0
    assert batch["greedy"].dtype == torch.long and batch["greedy"][0].tolist() == [2, 3, 4, 0, 0]
    assert batch["topk_ids"].shape == (2, 5, 3) and batch["topk_ids"][0, 3:].sum() == 0
    assert batch["topk_logprobs"].dtype == torch.float32 and batch["topk_logprobs"][1].tolist() == [[-1.0] * 3] * 5


@pytest.fixture(scope="module")
def ragged(setup, tmp_path_factory):
    """Rows of 1..32 tokens (chat-like loss masks), extracted in fp32 with top-4, in shards of 7, batches of 3."""
    verifier_dir, data, _ = setup
    gen = torch.Generator().manual_seed(0)
    rows = []
    for i in range(23):
        n = int(torch.randint(1, 33, (), generator=gen))
        rows.append({"input_ids": data.train_set[i]["input_ids"][:n],
                     "loss_mask": [int(t >= n // 2) for t in range(n)]})
    out = tmp_path_factory.mktemp("ragged") / "store"
    verifier = load_verifier(str(verifier_dir), dtype="float32")
    extract(verifier, rows, out, (1, 3), "ragged", dtype="float32", rows_per_shard=7, batch_size=3,
            log=lambda *_: None, topk=4)
    return verifier, rows, out


def test_rows_are_stored_unpadded(ragged):
    _, rows, out = ragged
    lengths = [len(r["input_ids"]) for r in rows]
    meta = json.loads((out / "metadata.json").read_text())
    assert (meta["format_version"], meta["layout"], meta["topk"]) == (2, "packed", 4)
    assert meta["extract_tokens"] == sum(lengths) == sum(s["tokens"] for s in meta["shards"])
    assert meta["extract_seconds"] > 0 and [s["rows"] for s in meta["shards"]] == [7, 7, 7, 2]
    from spectrain.heads.io import load_tensors

    stored = [load_tensors(out / s["file"]) for s in meta["shards"]]
    assert sum(t["input_ids"].shape[0] for t in stored) == sum(lengths)  # every stored position is a real token
    assert all(t["hidden"].shape[0] == t["aux"].shape[0] == t["greedy"].shape[0] == t["topk_ids"].shape[0]
               == t["offsets"][-1] for t in stored)
    store = HiddenStateStore(out)
    assert store.lengths() == lengths and len(store) == len(rows)
    for i, r in enumerate(rows):
        row = store[i]
        n = lengths[i]
        assert row["input_ids"].tolist() == r["input_ids"] and row["loss_mask"].tolist() == r["loss_mask"]
        assert row["attention_mask"].tolist() == [1] * n
        for key, dtype, shape in (("input_ids", torch.long, (n,)), ("attention_mask", torch.long, (n,)),
                                  ("loss_mask", torch.long, (n,)), ("greedy", torch.long, (n,)),
                                  ("hidden", torch.float32, (n, 32)), ("aux", torch.float32, (n, 64)),
                                  ("topk_ids", torch.long, (n, 4)), ("topk_logprobs", torch.float32, (n, 4))):
            assert row[key].dtype == dtype and tuple(row[key].shape) == shape, key
    # Only the layers a drafter needs; a row is a view of its shard, not a copy of it.
    assert torch.equal(HiddenStateStore(out, need_layers=(3,))[0]["aux"], store[0]["aux"][:, 32:])
    assert torch.equal(HiddenStateStore(out, need_layers=(3, 1))[0]["aux"], store[0]["aux"].roll(32, -1))
    assert store[1]["hidden"].untyped_storage().data_ptr() == store.shards[0]["hidden"].untyped_storage().data_ptr()


def test_stored_greedy_and_topk_are_the_verifiers(ragged):
    """Batched by length, padded per batch, scattered back: each row equals the verifier run on it alone."""
    verifier, rows, out = ragged
    store = HiddenStateStore(out)
    lengths = store.lengths()
    picks = sorted({0, 5, 13, 22, lengths.index(max(lengths)), lengths.index(min(lengths))})
    for i in picks:
        ids = torch.tensor([rows[i]["input_ids"]])
        with torch.no_grad():
            ref = verifier.model(input_ids=ids, output_hidden_states=True)
        logits = ref.logits[0]
        row = store[i]
        assert torch.equal(row["greedy"], logits.argmax(-1)), i
        values, indices = torch.log_softmax(logits.float(), -1).topk(4, dim=-1)
        torch.testing.assert_close(row["topk_logprobs"], values, atol=1e-4, rtol=1e-4)
        assert torch.equal(row["topk_ids"], indices), i
        assert (row["topk_logprobs"].diff(dim=-1) <= 0).all()  # descending
        torch.testing.assert_close(row["hidden"], ref.hidden_states[-1][0], atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(row["aux"], torch.cat([ref.hidden_states[1][0], ref.hidden_states[3][0]], -1),
                                   atol=1e-4, rtol=1e-4)


def test_a_bf16_verifier_runs_in_bf16(ragged, setup, tmp_path):
    """The verifier runs in the dtype it was loaded with; greedy and top-k come from its own (bf16) logits."""
    _, rows, _ = ragged
    verifier = load_verifier(str(setup[0]), dtype="bfloat16")
    extract(verifier, rows, tmp_path / "bf16", (1,), "ragged", rows_per_shard=7, batch_size=3, log=lambda *_: None,
            topk=4)
    store = HiddenStateStore(tmp_path / "bf16")
    assert json.loads((tmp_path / "bf16" / "metadata.json").read_text())["verifier_dtype"] == "bfloat16"
    for i in range(0, len(rows), 4):
        with torch.no_grad():
            logits = verifier.model(input_ids=torch.tensor([rows[i]["input_ids"]])).logits[0]
        row = store[i]
        assert row["hidden"].dtype == torch.bfloat16 and row["topk_logprobs"].dtype == torch.float32
        assert torch.equal(row["greedy"], logits.argmax(-1)) and torch.equal(row["topk_ids"][:, 0], row["greedy"])
        torch.testing.assert_close(row["topk_logprobs"], torch.log_softmax(logits.float(), -1).topk(4).values,
                                   atol=0.1, rtol=0.02)


def test_old_format_stores_are_refused(ragged, tmp_path):
    verifier, rows, out = ragged
    import shutil

    old = tmp_path / "v1"
    shutil.copytree(out, old)
    meta = json.loads((old / "metadata.json").read_text())
    for version in (1, None):
        v1 = {k: v for k, v in meta.items() if k not in ("format_version", "layout", "topk")}
        if version is not None:
            v1["format_version"] = version
        (old / "metadata.json").write_text(json.dumps(v1))
        with pytest.raises(SpectrainError, match=r"written by an older spectrain \(format 1, padded rows\); "
                                                 r"re-extract it with spectrain-extract --out NEWDIR"):
            HiddenStateStore(old)
        with pytest.raises(SpectrainError, match="older spectrain.*choose another directory or delete it"):
            extract(verifier, rows, old, (1, 3), "ragged", dtype="float32", rows_per_shard=7, log=lambda *_: None,
                    topk=4)
    (old / "metadata.json").write_text(json.dumps(dict(meta, format_version=3)))
    with pytest.raises(SpectrainError, match="newer spectrain"):
        HiddenStateStore(old)


def test_store_batches_are_grouped_by_length(setup):
    verifier_dir, data, store = setup
    offline = DrafterDataModule(path=str(store), tokenizer=str(verifier_dir), batch_size=4)
    offline.setup()
    assert offline.train_dataloader().lengths == offline.train_set.lengths()
    offline.group_by_length = False
    assert offline.train_dataloader().lengths is None
    assert data.train_dataloader().lengths is None  # text blocks are all one length
    import datasets

    chat = DrafterDataModule(batch_size=2)
    chat.train_set = datasets.Dataset.from_list([{"input_ids": [1] * n, "loss_mask": [1] * n} for n in (3, 9, 5, 2)])
    assert chat.train_dataloader().lengths == [3, 9, 5, 2]


def _loader(lengths, batch_size=8, seed=0, position=0):
    from spectrain.data.loader import ResumableLoader

    return ResumableLoader(list(range(len(lengths))), batch_size, lambda rows: rows, seed=seed,
                           position=lambda: position, lengths=lengths)


def test_length_grouped_batches_are_seeded_complete_and_resume(monkeypatch):
    from spectrain.data import loader as loader_module

    lengths = torch.randint(1, 513, (2000,), generator=torch.Generator().manual_seed(0)).tolist()
    grouped, plain = _loader(lengths), _loader(lengths)
    plain.lengths = None
    assert len(grouped) == len(plain) == 250
    epoch = list(grouped)
    assert len(epoch) == 250 and all(len(b) == 8 for b in epoch)
    assert sorted(i for b in epoch for i in b) == list(range(2000))  # every row exactly once
    assert epoch == list(_loader(lengths))  # a pure function of the seed
    assert epoch != list(_loader(lengths, seed=1))
    assert list(_loader(lengths, position=250)) != epoch  # epoch 1 is another order
    for p in (1, 117, 249):
        assert list(_loader(lengths, position=p)) == epoch[p:]  # resuming = the rest of the same epoch
    assert list(_loader(lengths, position=250 + 7)) == list(_loader(lengths, position=250))[7:]

    def padding(batches):
        return sum(max(lengths[i] for i in b) * len(b) - sum(lengths[i] for i in b) for b in batches)

    assert padding(epoch) < 0.05 * padding(list(plain))

    # Data-parallel: each rank's share is grouped on its own; together the ranks read every row once.
    ranks = []
    for rank in (0, 1):
        monkeypatch.setattr(loader_module, "rank_and_world", lambda rank=rank: (rank, 2))
        ranks.append(list(_loader(lengths)))
        assert len(ranks[-1]) == 125
    assert sorted(i for r in ranks for b in r for i in b) == list(range(2000))


def test_resuming_with_grouping_toggled_is_refused():
    loader = _loader([1, 2, 3, 4] * 4, batch_size=2)
    plain = _loader([1, 2, 3, 4] * 4, batch_size=2)
    plain.lengths = None
    loader.load_state_dict(loader.state_dict())
    with pytest.raises(SpectrainError, match="--data.group_by_length false"):
        loader.load_state_dict(plain.state_dict())
    with pytest.raises(SpectrainError, match="--data.group_by_length true"):
        plain.load_state_dict(loader.state_dict())


def test_only_a_nodes_first_rank_checksums_the_store(setup, monkeypatch):
    """Every data-parallel rank opens the store; one per machine hashes its shards (a corrupt byte is then
    caught there and stops that rank, and with it the run)."""
    from spectrain.data import store as store_module
    from spectrain.data.datamodule import DrafterDataModule

    verifier_dir, _, store = setup
    hashed = []
    real = store_module.sha256_files
    monkeypatch.setattr(store_module, "sha256_files", lambda path: hashed.append(path) or real(path))
    for local_rank, expect in (("1", False), ("0", True)):
        hashed.clear()
        monkeypatch.setenv("LOCAL_RANK", local_rank)
        DrafterDataModule(path=str(store), tokenizer=str(verifier_dir)).setup("fit")
        assert bool(hashed) == expect
