"""The own-model stage of the prepared GPU training check (``benchmarks/gpu_train_check.py --own_model``), run on the
CPU with tiny sizes: docs/own-model.md's path on one device, every step recorded in the JSON."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

STEPS = ["verifier", "fallback verifier", "replies", "fit check", "train", "evaluate", "export"]


def run_own_model(tmp_path: Path, verifier: str, *more: str) -> tuple[int, dict, list[str]]:
    """(exit code, the JSON summary, stdout lines) of ``--only_own_model --small --device cpu`` on ``verifier``,
    the script run as a user runs it."""
    argv = ["--only_own_model", "--small", "--device", "cpu", "--steps", "2", "--verifier", verifier,
            "--out", str(tmp_path), *more]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "WANDB_MODE": "offline"}
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_train_check.py"), *argv], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=600)
    lines = done.stdout.strip().splitlines()
    assert lines, done.stderr[-3000:]
    return done.returncode, json.loads(Path(lines[-1]).read_text()), lines


def assert_ran_after_verifier(steps: dict, engine: str = "our loop") -> None:
    """Replies, fit check, training, evaluation and export ran and passed, with what each must show."""
    for name in STEPS[2:]:
        assert steps[name]["ran"] and steps[name]["ok"], steps[name]
    replies = steps["replies"]
    assert replies["engine"] == engine and replies["replies_written"] > 0 and replies["tokens_per_second"] > 0
    assert steps["fit check"]["total_bytes"] > 0 and steps["fit check"]["block_size"] == 64
    train = steps["train"]
    assert train["steps"] == 2 and train["trained_tokens"] > 0 and train["precision"] == "32-true"
    assert train["cuda_peak"] is None and "CPU" in train["why"]
    evaluate = steps["evaluate"]
    assert evaluate["tau"] >= 1 and evaluate["identical_to_greedy"] and evaluate["k"] == 4
    layouts = steps["export"]["layouts"]
    assert sorted(layouts) == ["eagle3", "speculators"]
    for fmt, layout in layouts.items():
        assert layout["detected_format"] == fmt and layout["tensors_read_back_equal"]
        assert {"config.json", "model.safetensors"} <= set(layout["files"])
        for name, size in layout["files"].items():
            assert (Path(layout["path"]) / name).stat().st_size == size > 0


@pytest.mark.integration
def test_own_model_stage_runs_every_step(tmp_path, verifier_factory):
    """On a tiny random verifier with a chat template: every step ran and passed, the fallback was not needed,
    and the JSON path is the last stdout line."""
    verifier = str(verifier_factory("llama", False))
    code, summary, lines = run_own_model(tmp_path, verifier)
    own = summary["own_model"]
    steps = {s["step"]: s for s in own["steps"]}
    assert code == 0 and summary["passed"] and own["passed"] and summary["runs"] == []
    assert [s["step"] for s in own["steps"]] == STEPS and own["verifier_used"] == verifier
    assert steps["verifier"]["ok"] and steps["verifier"]["chat_template"]
    assert not steps["fallback verifier"]["ran"] and "not needed" in steps["fallback verifier"]["why"]
    assert_ran_after_verifier(steps)
    assert lines[-1] == str((tmp_path / "gpu_train_check.json").resolve())
    assert any(line.startswith("own model on cpu") for line in lines)  # the stage's table


@pytest.mark.integration
def test_own_model_stage_records_a_verifier_that_does_not_load(tmp_path):
    """``--verifier /nonexistent``: that step failed with its error, the built Llama stood in and every later step
    ran on it; the check exits 1 (a step that ran failed)."""
    code, summary, lines = run_own_model(tmp_path, "/nonexistent")
    own = summary["own_model"]
    steps = {s["step"]: s for s in own["steps"]}
    assert code == 1 and not summary["passed"] and [s["step"] for s in own["steps"]] == STEPS
    failed = steps["verifier"]
    assert failed["ran"] and not failed["ok"] and "/nonexistent" in failed["error"] and failed["traceback"]
    fallback = steps["fallback verifier"]
    assert fallback["ok"] and fallback["chat_template"]
    assert own["verifier_used"] == fallback["verifier_used"] == str(tmp_path / "own_model" / "verifier")
    assert_ran_after_verifier(steps)
    assert lines[-1] == str((tmp_path / "gpu_train_check.json").resolve())


@pytest.mark.integration
def test_own_model_stage_takes_its_replies_from_a_server(tmp_path, verifier_factory):
    """``--server URL``: the replies come from the OpenAI-compatible engine, after its served-verifier check."""
    from spectrain.heads.verifier import load_verifier
    from tests.fake_engine import FakeEngine

    verifier = str(verifier_factory("llama", False))
    engine = FakeEngine(load_verifier(verifier, dtype="float32"))
    try:
        code, summary, _ = run_own_model(tmp_path, verifier, "--server", engine.url)
    finally:
        engine.close()
    steps = {s["step"]: s for s in summary["own_model"]["steps"]}
    assert code == 0 and summary["passed"] and engine.completions > 0
    assert_ran_after_verifier(steps, engine=engine.url)
    assert not steps["replies"]["verifier_check"].get("skipped")
