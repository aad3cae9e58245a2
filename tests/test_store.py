"""Offline hidden-state store: online == offline loss, resumable extraction, and refusal of bad stores."""

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


def test_train_eagle_from_the_store(setup, tmp_path):
    from spectrain.train.cli import module_for_config, train

    verifier_dir, _, store = setup
    path = train(module_for_config("eagle3_x.yaml"), "eagle3_tinyshakespeare.yaml",
                 args=["--model.verifier", str(verifier_dir), "--model.aux_layer_ids", "[1, 2, 3]", "--data.path",
                       str(store), "--data.batch_size", "4", "--trainer.max_steps", "3", "--trainer.val_check_interval",
                       "3", "--run_dir", str(tmp_path / "run"), "--logger", "none"])
    summary = json.loads(path.read_text())
    assert summary["data_format"] == "store" and summary["steps"] == 3


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
        for key in ("input_ids", "hidden", "aux"):
            assert torch.equal(one[i][key], two[i][key])
    with pytest.raises(SpectrainError, match="outside a world"):
        extract(verifier, data.train_set, tmp_path / "x", (1,), "corpus", rank=2, world=2)


def test_rows_from_shards_of_different_lengths_batch_together():
    """Each shard is padded to its own longest row: a batch across shards pads again, with masks 0 on the pad."""
    from spectrain.data.store import collate_store

    def row(n):
        return {"input_ids": torch.arange(1, n + 1), "attention_mask": torch.ones(n, dtype=torch.uint8),
                "loss_mask": torch.ones(n, dtype=torch.uint8), "hidden": torch.ones(n, 4), "aux": torch.ones(n, 8)}

    batch = collate_store([row(3), row(5)])
    assert batch["hidden"].shape == (2, 5, 4) and batch["aux"].shape == (2, 5, 8)
    assert batch["attention_mask"][0].tolist() == [1, 1, 1, 0, 0] and batch["loss_mask"][0, 3:].sum() == 0
    assert batch["input_ids"][0].tolist() == [1, 2, 3, 0, 0] and batch["hidden"][0, 3:].abs().sum() == 0
