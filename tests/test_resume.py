"""Crash and resume: kill -9 mid-epoch, re-run the same command, get the uninterrupted result."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from spectrain.heads.errors import SpectrainError

# Runs train_eagle (EAGLE-1: its feature noise exercises the saved RNG state) in a fresh interpreter; with
# CRASH_AT set, the process SIGKILLs itself right after that optimizer step (after the step's checkpoint, if
# any, was written) — no cleanup, no atexit, exactly like `kill -9`.
SCRIPT = """
import os, signal, sys
from spectrain.train.base import DrafterModule
crash_at = int(os.environ.get("CRASH_AT", "0"))
original = DrafterModule.on_train_batch_end
def on_train_batch_end(self, outputs, batch, batch_idx):
    original(self, outputs, batch, batch_idx)
    if crash_at and self.trainer.global_step == crash_at:
        sys.stdout.flush()
        os.kill(os.getpid(), signal.SIGKILL)
DrafterModule.on_train_batch_end = on_train_batch_end
from spectrain.train.cli import train_eagle
sys.argv = ["train_eagle"] + sys.argv[1:]
train_eagle()
"""


def run(args, crash_at: int = 0):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "WANDB_MODE": "offline", "CRASH_AT": str(crash_at)}
    return subprocess.run([sys.executable, "-c", SCRIPT, *args], capture_output=True, text=True, env=env, timeout=600)


@pytest.fixture
def args_for(verifier_factory, text_file):
    def make(run_dir: Path, *extra: str) -> list[str]:
        return ["--model.variant", "eagle1", "--model.verifier", str(verifier_factory("llama", False)),
                "--data.path", str(text_file), "--data.block_size", "32", "--data.batch_size", "4",
                "--trainer.max_steps", "14", "--trainer.val_check_interval", "7", "--trainer.limit_val_batches", "2",
                "--checkpoint_every", "4", "--run_dir", str(run_dir), "--logger", "csv", *extra]
    return make


@pytest.mark.integration
def test_kill_9_then_rerun_matches_uninterrupted(tmp_path, args_for):
    straight = run(args_for(tmp_path / "straight"))
    assert straight.returncode == 0, straight.stderr[-3000:]

    crashed = run(args_for(tmp_path / "crashed"), crash_at=10)  # last resume checkpoint: step 8 (mid-epoch)
    assert crashed.returncode == -signal.SIGKILL
    assert not (tmp_path / "crashed" / "summary.json").exists()
    assert (tmp_path / "crashed" / "checkpoints" / "resume.ckpt").is_file()

    resumed = run(args_for(tmp_path / "crashed"))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resuming" in resumed.stdout and "(step 8)" in resumed.stdout
    a = load_file(str(tmp_path / "straight" / "model.safetensors"))
    b = load_file(str(tmp_path / "crashed" / "model.safetensors"))
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=1e-5, atol=1e-6)
    s1 = json.loads((tmp_path / "straight" / "summary.json").read_text())
    s2 = json.loads((tmp_path / "crashed" / "summary.json").read_text())
    assert s1["steps"] == s2["steps"] == 14 and s1["trained_tokens"] == s2["trained_tokens"]
    assert s1["tau_pred"] == pytest.approx(s2["tau_pred"], rel=1e-5)

    # Finished: a re-run refuses to touch it; a different config refuses to resume an unfinished one.
    again = run(args_for(tmp_path / "crashed"))
    assert again.returncode == 2 and "holds a finished run" in again.stderr


@pytest.mark.integration
def test_changed_config_or_damaged_checkpoint_is_refused(tmp_path, args_for):
    crashed = run(args_for(tmp_path / "r"), crash_at=5)
    assert crashed.returncode == -signal.SIGKILL
    other = run(args_for(tmp_path / "r", "--model.lr", "0.01"))
    assert other.returncode == 2 and "unfinished run with another config" in other.stderr
    ckpt = tmp_path / "r" / "checkpoints" / "resume.ckpt"
    ckpt.write_bytes(ckpt.read_bytes()[: ckpt.stat().st_size // 2])  # a torn write (not ours: we rename)
    damaged = run(args_for(tmp_path / "r"))
    assert damaged.returncode == 2 and "cannot be read" in damaged.stderr and "Traceback" not in damaged.stderr
    fresh = run(args_for(tmp_path / "r", "--force", "true"))
    assert fresh.returncode == 0, fresh.stderr[-3000:]


@pytest.mark.integration
def test_extend_a_finished_run(tmp_path, args_for):
    """--extend continues a finished run from its last checkpoint with a larger budget; nothing else may change."""
    def with_steps(steps: int, *extra: str) -> list[str]:
        args = args_for(tmp_path / "r", "--checkpoint_every", "7", *extra)  # resume.ckpt and last.ckpt tie at 7
        i = args.index("--trainer.max_steps")
        return args[:i + 1] + [str(steps)] + args[i + 2:]

    first = run(with_steps(7))
    assert first.returncode == 0, first.stderr[-3000:]
    s1 = json.loads((tmp_path / "r" / "summary.json").read_text())
    assert s1["steps"] == 7 and len(s1["curve"]) == 1 and s1["train_seconds"] > 0

    same_budget = run(with_steps(7, "--extend", "true"))
    assert same_budget.returncode == 2 and "does not go beyond the 7 steps" in same_budget.stderr
    assert "Traceback" not in same_budget.stderr and (tmp_path / "r" / "summary.json").is_file()
    other = run(with_steps(14, "--extend", "true", "--model.lr", "0.01"))
    assert other.returncode == 2 and "another config" in other.stderr and "Traceback" not in other.stderr
    both = run(with_steps(14, "--extend", "true", "--force", "true"))
    assert both.returncode == 2 and "pass one of them" in both.stderr
    nothing = run(args_for(tmp_path / "typo", "--extend", "true"))
    assert nothing.returncode == 2 and "no run to extend" in nothing.stderr

    extended = run(with_steps(14, "--extend", "true"))
    assert extended.returncode == 0, extended.stderr[-3000:]
    assert "resuming" in extended.stdout and "last.ckpt (step 7)" in extended.stdout
    s2 = json.loads((tmp_path / "r" / "summary.json").read_text())
    # The step-7 validation (saved in last.ckpt, not in the tied resume.ckpt) stays on the curve.
    assert s2["steps"] == 14 and [c["step"] for c in s2["curve"]] == [7, 14]
    assert s2["trained_tokens"] > s1["trained_tokens"] and s2["curve"][0] == s1["curve"][0]
    assert s2["curve"][1]["train_seconds"] > s2["curve"][0]["train_seconds"] == s1["curve"][0]["train_seconds"]
    assert json.loads((tmp_path / "r" / "summary.before-extend.json").read_text())["steps"] == 7


def test_resuming_with_other_fused_layers_is_refused(verifier_factory):
    """A checkpoint records the layers its EAGLE-3 drafter fuses; a run that would fuse others (say, after the
    small-verifier default changed) refuses it instead of training on other layers with the same fc shape —
    and a checkpoint saved before the record existed is read with the old default."""
    from spectrain.train.eagle import EagleModule

    verifier = str(verifier_factory("llama", False, layers=6))
    module = EagleModule(variant="eagle3", verifier=verifier, verifier_dtype="float32", draft_vocab_size=100)
    assert module.fused_layers() == [1, 3, 5]
    weights = {f"drafter.{k}": v for k, v in module.drafter.state_dict().items()}
    module.on_load_checkpoint({"state_dict": weights, "spectrain": {"method": "eagle3", "aux_layer_ids": [1, 3, 5]}})
    for saved in ({"aux_layer_ids": [1, 3, 6]}, {}):  # {}: saved when the 6-layer default was [1, 3, 6]
        with pytest.raises(SpectrainError, match=r"fuses verifier layers \[1, 3, 6\].*--model.aux_layer_ids"):
            module.on_load_checkpoint({"state_dict": weights, "spectrain": {"method": "eagle3", **saved}})
    other = EagleModule(variant="eagle3", verifier=verifier, verifier_dtype="float32", draft_vocab_size=100,
                        aux_layer_ids=[1, 3])
    with pytest.raises(SpectrainError, match="other shapes"):
        other.on_load_checkpoint({"state_dict": weights, "spectrain": {"method": "eagle3", "aux_layer_ids": [1, 3]}})


def test_a_run_saved_under_the_old_small_verifier_default_resumes_with_its_layers_named(tmp_path, verifier_factory,
                                                                                         text_file):
    """An unfinished EAGLE-3 run saved before checkpoints recorded their fused layers (config: aux_layer_ids null,
    then [1, 3, 6] on a 6-layer verifier): resuming with today's default is refused with the flag to pass, and
    passing it resumes the run (the config check lets the named layers stand for the saved null)."""
    from spectrain.train.cli import train

    verifier = str(verifier_factory("llama", False, layers=6))
    base = ["--model.verifier", verifier, "--data.path", str(text_file), "--data.block_size", "64",
            "--data.batch_size", "4", "--model.draft_vocab_size", "null", "--logger", "none",
            "--run_dir", str(tmp_path / "run"), "--trainer.val_check_interval", "2", "--model.ttt_steps", "2"]
    train("eagle3_tinyshakespeare.yaml", args=base + ["--trainer.max_steps", "4", "--model.aux_layer_ids", "[1, 3, 6]"])
    run = tmp_path / "run"
    (run / "summary.json").unlink()  # unfinished, as a crash after the last checkpoint would leave it
    for ckpt in (run / "checkpoints").glob("*.ckpt"):  # as saved before the record existed
        state = torch.load(ckpt, map_location="cpu", weights_only=True)
        state["spectrain"].pop("aux_layer_ids")
        torch.save(state, ckpt)
    config = (run / "config.yaml").read_text()
    (run / "config.yaml").write_text(config.replace("aux_layer_ids:\n", "aux_layer_ids: null\n", 1).replace(
        "    - 1\n    - 3\n    - 6\n", "", 1) if "aux_layer_ids: null" not in config else config)
    assert "aux_layer_ids: null" in (run / "config.yaml").read_text()
    with pytest.raises(SpectrainError, match=r"fuses verifier layers \[1, 3, 6\].*--model.aux_layer_ids"):
        train("eagle3_tinyshakespeare.yaml", args=base + ["--trainer.max_steps", "4"])
    path = train("eagle3_tinyshakespeare.yaml", args=base + ["--trainer.max_steps", "4", "--model.aux_layer_ids",
                                                             "[1, 3, 6]"])
    assert json.loads(path.read_text())["steps"] == 4


def test_a_saved_config_is_compared_by_what_its_module_declares(tmp_path):
    """The run-dir policy names no family: a resumed config is compared with the saved one without the keys the
    module declares added since (at their old value) or meaningless (``resume_ignores``); any other change is
    refused. EAGLE's: its warm-start keys added later, eagle1 ignoring ``drop_outside_vocab``, a saved null
    ``aux_layer_ids``; a module of another family declares its own."""
    from spectrain.train.base import DrafterModule
    from spectrain.train.eagle import EagleModule
    from spectrain.train.run_dir import check_same_config

    def config(class_path: str | None = "spectrain.train.eagle.EagleModule", **init_args) -> str:
        args = "".join(f"    {k}: {v}\n" for k, v in init_args.items())
        if class_path is None:  # saved before recipes named their class
            return f"model:\n{args.replace('    ', '  ')}trainer:\n  max_steps: 4\nlogger: csv\n"
        return f"model:\n  class_path: {class_path}\n  init_args:\n{args}trainer:\n  max_steps: 4\nlogger: csv\n"

    def resumes(old: str, new: str, module: type = EagleModule, extend: bool = False) -> bool:
        try:
            check_same_config(old, new, module, extend, tmp_path, tmp_path / "config.yaml")
            return True
        except SpectrainError as e:
            assert "holds an unfinished run with another config" in str(e) or extend
            return False

    now = config(variant="eagle3", lr=0.001, layer_init="random", norm_init="default", drop_outside_vocab="false",
                 verifier_device="auto", aux_layer_ids="[1, 3, 6]")
    assert resumes(config(None, variant="eagle3", lr=0.001, aux_layer_ids="null"), now)  # old keys, old class-less
    assert not resumes(config(variant="eagle3", lr=0.001, aux_layer_ids="[1, 3, 5]"), now)  # named layers differ
    assert not resumes(config(variant="eagle3", lr=0.01, aux_layer_ids="null"), now)  # what trains differs
    assert not resumes(config(variant="eagle3", lr=0.001, aux_layer_ids="null", layer_init="verifier"), now)
    assert resumes(config(variant="eagle1", drop_outside_vocab="true"),
                   config(variant="eagle1", drop_outside_vocab="false"))
    assert not resumes(config(variant="eagle3", drop_outside_vocab="true"),
                       config(variant="eagle3", drop_outside_vocab="false"))
    assert resumes(config(variant="eagle3", measure_prompts=0), config(variant="eagle3", measure_prompts=8))
    assert not resumes(config(lr=0.001), config(lr=0.001, layer_init="verifier"), module=DrafterModule)

    class ToyModule(DrafterModule):  # another family's module: shared code takes its declarations alone
        added_init_args = {**DrafterModule.added_init_args, "toy_knob": 1}

        @classmethod
        def resume_ignores(cls, init_args: dict, saved: dict) -> tuple[str, ...]:
            return ("toy_note",)

    toy = "spectrain.tests.ToyModule"
    assert resumes(config(toy, lr=0.001), config(toy, lr=0.001, toy_knob=1, toy_note="x"), module=ToyModule)
    assert not resumes(config(toy, lr=0.001), config(toy, lr=0.001, toy_knob=2), module=ToyModule)
    assert not resumes(config(toy, lr=0.001), config(toy, lr=0.001, toy_knob=1), module=EagleModule)
    extended = config(variant="eagle3").replace("max_steps: 4", "max_steps: 8")
    assert not resumes(config(variant="eagle3"), extended) and resumes(config(variant="eagle3"), extended, extend=True)
