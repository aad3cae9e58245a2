"""The fit check (``--dry_run``): its estimate against a real training step's measured peak memory, the store size
against a real extraction, the shipped shapes, and bad input."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from spectrain.heads.errors import SpectrainError
from spectrain.train.cli import train

ROOT = Path(__file__).resolve().parents[1]


def dry_run(recipe: str, *args: str, out: Path) -> dict:
    path = train(recipe, args=[*args, "--dry_run", "true", "--fit_out", str(out)])
    assert path == out
    return json.loads(out.read_text())


# (recipe, verifier family, block size, batch size, extra flags): EAGLE-3 and DFlash at several shapes and blocks
MEASURED = [("eagle3_tinyshakespeare.yaml", "llama", 512, 4, ()),
            ("eagle3_tinyshakespeare.yaml", "qwen3", 1024, 2, ()),
            ("dflash_tinyshakespeare.yaml", "qwen3", 512, 4, ()),
            ("dflash_tinyshakespeare.yaml", "llama", 1024, 2, ("--model.anchors", "64"))]


@pytest.fixture(scope="module")
def wide_verifiers(verifier_factory, tiny_tokenizer):
    """Verifiers wide enough (hidden 256, vocabulary 8,192) that a step's memory dwarfs the allocator's noise."""
    return {arch: verifier_factory(arch, False, 8192 - len(tiny_tokenizer), hidden=256, layers=4, max_pos=2048)
            for arch in ("llama", "qwen3")}


@pytest.fixture(scope="module")
def long_text(tmp_path_factory) -> Path:
    from tests.conftest import sample_text

    path = tmp_path_factory.mktemp("fit-data") / "corpus.txt"
    path.write_text(sample_text(3000, seed=1))
    return path


@pytest.mark.integration
@pytest.mark.parametrize("recipe,arch,block,batch,extra", MEASURED)
def test_estimate_within_20_percent_of_the_measured_step(recipe, arch, block, batch, extra, wide_verifiers,
                                                         long_text, tmp_path):
    """A subprocess trains 3 steps (tests/fit_probe.py): the steady-state step's peak RSS above its start (fp32,
    32-true) against the estimate's step (gradients + features + activations + logits); parameter counts, the
    verifier's weights and AdamW's states exactly."""
    args = ["--model.verifier", str(wide_verifiers[arch]), "--data.path", str(long_text), "--data.block_size",
            str(block), "--data.batch_size", str(batch), "--trainer.precision", "32-true", *extra]
    estimate = dry_run(recipe, *args, out=tmp_path / "fit.json")
    probe = tmp_path / "probe.json"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "WANDB_MODE": "offline"}
    done = subprocess.run(
        [sys.executable, "-m", "tests.fit_probe", str(probe), "--", "--config", str(ROOT / "configs" / recipe), *args,
         "--trainer.max_steps", "3", "--logger", "none", "--run_dir", str(tmp_path / "run"), "--model.measure_prompts",
         "0", "--trainer.val_check_interval", "3", "--trainer.limit_val_batches", "1"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=1200)
    assert done.returncode == 0, done.stderr[-3000:]
    measured = json.loads(probe.read_text())
    assert estimate["drafter_params"] == measured["drafter_params"]
    assert estimate["drafter_trainable"] == measured["drafter_trainable"]
    assert estimate["verifier_weight_bytes"] == measured["verifier_weight_bytes"]
    assert estimate["drafter_optimizer_bytes"] - 4 * estimate["drafter_params"] == measured["optimizer_state_bytes"]
    peak = max(measured["step_peak_bytes"])
    assert peak > 100 * 2 ** 20  # large enough that allocator noise is small beside it
    assert abs(estimate["step_bytes"] - peak) <= 0.2 * peak, (estimate["step_bytes"], measured["step_peak_bytes"])


def test_store_size_is_exact_against_a_real_extract(verifier_factory, text_file, tmp_path, capsys):
    """``spectrain-extract --dry_run``'s bytes per token times the tokens extracted, plus the row offsets, equals
    the bytes of every tensor in the store's shards; the training dry run reports the same per-token figure for the
    layers its drafter reads."""
    from safetensors import safe_open

    from spectrain.data.extract import main as extract_main

    verifier = verifier_factory("llama", False, layers=8)
    extract_main(["--verifier", str(verifier), "--layer_ids", "2,4,5", "--topk", "3", "--dry_run",
                  "--dry_run_out", str(tmp_path / "extract.json")])
    sized = json.loads((tmp_path / "extract.json").read_text())
    assert capsys.readouterr().out.strip().splitlines()[-1] == str((tmp_path / "extract.json").resolve())
    assert not (tmp_path / "store").exists()
    extract_main(["--verifier", str(verifier), "--data", str(text_file), "--block_size", "64", "--layer_ids",
                  "2,4,5", "--topk", "3", "--out", str(tmp_path / "store"), "--verifier_dtype", "float32"])
    tensor_bytes = rows = tokens = shards = 0
    for shard in sorted((tmp_path / "store" / "train").glob("shard-*.safetensors")):
        with safe_open(shard, "pt") as f:
            for name in f.keys():
                t = f.get_tensor(name)
                tensor_bytes += t.numel() * t.element_size()
            offsets = f.get_tensor("offsets")
        rows, tokens, shards = rows + offsets.numel() - 1, tokens + int(offsets[-1]), shards + 1
    assert tokens > 0
    assert tensor_bytes == sized["bytes_per_token"] * tokens + 8 * (rows + shards)
    fit = dry_run("eagle3_tinyshakespeare.yaml", "--model.verifier", str(verifier), "--data.block_size", "64",
                  out=tmp_path / "fit.json")
    assert fit["captured_layers"] == [2, 4, 5]
    from spectrain.data.store import store_bytes_per_token

    assert fit["store_bytes_per_token"] == store_bytes_per_token(32, 3, torch.bfloat16) == \
        sized["bytes_per_token"] - 3 * 8  # the same store without top-k


def test_shipped_shapes_size_the_8b_recipes(tmp_path):
    """Offline, from the shipped config.json: an 8B Llama with three fused layers stores 32,777 bytes a token
    (~32.8 GB per million); the verifier's parameters are the real model's; --device_memory says fit or not."""
    fit = dry_run("eagle3_llama31_8b.yaml", "--device_memory", "80", out=tmp_path / "llama.json")
    assert fit["verifier_config"].startswith("shipped:")
    assert fit["verifier_params"] == 8_030_261_248 and fit["verifier_dtype"] == "bfloat16"
    assert fit["store_bytes_per_token"] == 4096 * 4 * 2 + 9 and fit["captured_layers"] == [2, 16, 29]
    assert fit["tokens_per_optimizer_step"] == 4096
    assert fit["fits"] and fit["largest_block_size"] >= 4096
    small = dry_run("eagle3_llama31_8b.yaml", "--device_memory", "24", out=tmp_path / "small.json")
    assert not small["fits"] and 0 < small["largest_block_size"] < 4096
    dflash = dry_run("dflash_qwen3_8b.yaml", out=tmp_path / "dflash.json")
    assert dflash["captured_layers"] == [2, 10, 18, 26, 34]  # target layers [1, 9, 17, 25, 33] + 1
    assert dflash["logit_rows"] == 512 * 15 and dflash["logit_vocab"] == 151936
    assert dflash["tokens_per_optimizer_step"] == 3072 * 4
    # The page's multi-GPU line: --trainer.devices 8 (parsed as the string '8') and 2 nodes count every device.
    eight = dry_run("eagle3_llama31_8b.yaml", "--trainer.devices", "8", "--trainer.num_nodes", "2",
                    out=tmp_path / "eight.json")
    assert eight["devices"] == 16 and eight["tokens_per_optimizer_step"] == 4096 * 16
    assert eight["total_bytes"] == fit["total_bytes"]  # memory is per device


def test_bad_input_is_named(tmp_path, verifier_factory):
    with pytest.raises(SpectrainError, match="no shipped shape"):
        dry_run("eagle3_llama31_8b.yaml", "--model.verifier", "nobody/no-such-model", out=tmp_path / "a.json")
    with pytest.raises(SpectrainError, match="--device_memory must be > 0"):
        dry_run("eagle3_llama31_8b.yaml", "--device_memory", "0", out=tmp_path / "b.json")
    recipe = tmp_path / "no_block.yaml"
    recipe.write_text(f"model:\n  class_path: spectrain.train.eagle.EagleModule\n  init_args:\n    verifier: "
                      f"{verifier_factory('llama', False)}\n")
    with pytest.raises(SpectrainError, match="names no data.block_size"):
        train(None, args=["--config", str(recipe), "--dry_run", "true", "--fit_out", str(tmp_path / "c.json")])
    assert not any((tmp_path / n).exists() for n in ("a.json", "b.json", "c.json"))


@pytest.mark.integration
def test_bad_input_exits_2_without_traceback(tmp_path):
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    done = subprocess.run([sys.executable, "-c", "from spectrain.train.cli import spectrain_train; spectrain_train()",
                           "--config", str(ROOT / "configs" / "eagle3_qwen3_8b.yaml"), "--dry_run", "true",
                           "--device_memory", "-1", "--fit_out", str(tmp_path / "x.json")],
                          capture_output=True, text=True, env=env, cwd=tmp_path, timeout=600)
    assert done.returncode == 2 and "Traceback" not in done.stderr and "--device_memory" in done.stderr
