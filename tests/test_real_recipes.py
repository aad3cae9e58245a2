"""The recipes for real verifiers (configs/*_8b.yaml) built and trained 2 steps on shape-scaled stand-ins: the
verifier's family and its exact vocabulary (from the shipped config.json), a few layers and a small width."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from spectrain.heads.dflash import default_target_layers
from spectrain.heads.layers import spread_layers
from spectrain.heads.verifier_shapes import shipped_shape_path
from spectrain.train.cli import config_path, train
from tests.test_cli import REAL_VERIFIER_RECIPES

STAND_IN_LAYERS = 8  # deep enough for the recipes' layer rules to pick distinct layers
REAL_RECIPES = {"eagle3_llama31_8b.yaml": ("llama", "meta-llama/Llama-3.1-8B-Instruct"),
                "eagle3_qwen3_8b.yaml": ("qwen3", "Qwen/Qwen3-8B"),
                "dflash_qwen3_8b.yaml": ("qwen3", "Qwen/Qwen3-8B")}


def stand_in(tmp_path: Path, arch: str, hub_id: str, tokenizer) -> Path:
    """A random-weight verifier of ``arch`` with ``hub_id``'s vocabulary size (the shipped shape's), 8 layers."""
    from tests.conftest import make_verifier

    vocab = json.loads(shipped_shape_path(hub_id).read_text())["vocab_size"]
    out = tmp_path / "stand-in"
    model = make_verifier(arch, False, vocab, hidden=32, layers=STAND_IN_LAYERS, max_pos=512)
    assert model.config.vocab_size == vocab
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def test_every_real_recipe_is_trained_here():
    assert set(REAL_RECIPES) == REAL_VERIFIER_RECIPES


@pytest.mark.parametrize("recipe", sorted(REAL_RECIPES))
def test_real_recipe_trains_on_a_stand_in(recipe, tmp_path, tiny_tokenizer, text_file):
    arch, hub_id = REAL_RECIPES[recipe]
    model = yaml.safe_load(Path(config_path(recipe)).read_text())["model"]
    init = model["init_args"]
    assert init["verifier"] == hub_id and recipe in REAL_VERIFIER_RECIPES
    verifier = stand_in(tmp_path, arch, hub_id, tiny_tokenizer)
    run_dir = tmp_path / "run"
    summary = json.loads(train(recipe, args=[
        "--model.verifier", str(verifier), "--data.path", str(text_file), "--data.block_size", "48",
        "--trainer.max_steps", "2", "--trainer.accelerator", "cpu", "--trainer.val_check_interval", "2",
        "--trainer.limit_val_batches", "1", "--run_dir", str(run_dir), "--logger", "none"]).read_text())
    assert summary["steps"] == 2
    drafter = json.loads((run_dir / "config.json").read_text())
    if model["class_path"].endswith("EagleModule"):
        assert drafter["draft_vocab_size"] == init["draft_vocab_size"] == 32000
        assert drafter["aux_layer_ids"] == spread_layers(STAND_IN_LAYERS) == [2, 4, 5]  # [2, N//2, N-3]
        saved = yaml.safe_load((run_dir / "config.yaml").read_text())["model"]["init_args"]
        assert saved["ttt_steps"] == init["ttt_steps"] == 7
    else:
        assert (drafter["block_size"], drafter["num_hidden_layers"]) == (16, 5)
        assert drafter["target_layer_ids"] == default_target_layers(STAND_IN_LAYERS, 5) == [1, 2, 3, 4, 5]
        assert drafter["mask_token_id"] == init["mask_token_id"] == 151669
