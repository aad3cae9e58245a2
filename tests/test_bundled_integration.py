"""Integration: the bundled default verifier (built on first use, ~4 minutes on 2 CPU cores, then cached)."""

from __future__ import annotations

import json

import pytest

from spectrain.data.bundled import bundled_text_path, ensure_bundled_verifier
from spectrain.data.text import split_text
from spectrain.heads.verifier import load_verifier

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def bundled():
    return ensure_bundled_verifier()


def test_bundled_verifier_models_the_text(bundled):
    report = json.loads((bundled / "build_report.json").read_text())
    assert report["ratio_to_unigram"] <= 0.75, report
    v = load_verifier("bundled:tinyshakespeare")
    assert v.config.model_type == "llama" and v.config.num_hidden_layers >= 6
    assert 2000 <= len(v.tokenizer) <= 8192
    assert 1e6 <= report["parameters"] <= 2e7
    assert v.tokenizer.chat_template  # chat data can be rendered with it
    # Byte-level BPE: any text round-trips exactly.
    sample = "KING RICHARD III:\nNow is the winter of our discontent — ünïcödé ✓\n"
    assert v.tokenizer.decode(v.tokenizer(sample)["input_ids"]) == sample
    # The held-out split is the contiguous tail of the text.
    train, val = split_text(bundled_text_path().read_text())
    assert bundled_text_path().read_text() == train + val and len(val) < len(train) / 5


def test_train_medusa_on_the_bundled_default(bundled, tmp_path):
    from spectrain.train.cli import train

    path = train("medusa_tinyshakespeare.yaml",
                 args=["--run_dir", str(tmp_path / "run"), "--logger", "none", "--trainer.max_steps", "30",
                       "--trainer.val_check_interval", "30", "--trainer.limit_val_batches", "4"])
    summary = json.loads(path.read_text())
    assert summary["verifier_report"]["ratio_to_unigram"] <= 0.75
    _, top1_ver, top5_ver, _, _ = summary["per_position"]["rows"][0]
    # 30 steps already lift head 1 well above chance (1/2048) towards the verifier's greedy token.
    assert top1_ver > 0.2 and top5_ver > top1_ver
