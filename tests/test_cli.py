"""train_medusa end to end: outputs, the stdout contract, config YAMLs, bad input."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from importlib import resources
from pathlib import Path

import pytest
import torch

from spectrain.heads.errors import SpectrainError
from spectrain.heads.medusa import MedusaHeads
from spectrain.heads.verifier import load_verifier
from spectrain.train.cli import config_path, train

CONFIGS = sorted(p.name for p in resources.files("spectrain.configs").iterdir() if p.name.endswith(".yaml"))


def small_args(verifier: Path, data: Path, run_dir: Path, *extra: str, logger: str = "none") -> list[str]:
    return ["--model.verifier", str(verifier), "--data.path", str(data), "--data.block_size", "64",
            "--data.batch_size", "4", "--run_dir", str(run_dir), "--logger", logger, *extra]


def test_every_config_names_only_arguments_its_classes_take():
    """Each recipe names its LightningModule (model.class_path) and its model / data / trainer keys are parameters
    of that class / DrafterDataModule / Trainer (a misspelt key would otherwise surface only when someone runs that recipe)."""
    import importlib
    import inspect

    import lightning as L
    import yaml

    from spectrain.data.datamodule import DrafterDataModule
    from spectrain.train.base import DrafterModule

    assert {"medusa_tinyshakespeare.yaml", "eagle3_smollm2.yaml", "medusa_gpu_check.yaml"} <= set(CONFIGS)
    for name in CONFIGS:
        recipe = yaml.safe_load(Path(config_path(name)).read_text())
        module_path, _, class_name = recipe["model"]["class_path"].rpartition(".")  # the recipe names its class
        module = getattr(importlib.import_module(module_path), class_name)
        assert issubclass(module, DrafterModule), name
        for section, cls, keys in (("model", module, recipe["model"]["init_args"]), ("data", DrafterDataModule,
                                   recipe.get("data")), ("trainer", L.Trainer, recipe.get("trainer"))):
            accepted = set(inspect.signature(cls.__init__).parameters)
            if cls is not L.Trainer and issubclass(cls, L.LightningModule):
                accepted |= {p for klass in cls.__mro__ if "__init__" in vars(klass)
                             for p in inspect.signature(klass.__init__).parameters}
            unknown = set(keys or {}) - accepted
            assert not unknown, f"{name}: {section} keys {sorted(unknown)} are not arguments of {cls.__name__}"


@pytest.mark.parametrize("config", CONFIGS)
def test_fast_dev_run_per_config(config, verifier_factory, text_file, tmp_path):
    """Each recipe YAML parses into its module's typed __init__ args and runs one step."""
    # The tiny vocabulary is smaller than the recipes' draft / training vocabularies.
    extra = (["--model.draft_vocab_size", "null"] if config.startswith("eagle3") else
             ["--model.train_vocab_size", "null"] if "train_vocab_size" in Path(config_path(config)).read_text() else [])
    path = train(config,
                 args=small_args(verifier_factory("llama", False), text_file, tmp_path / "run", "--trainer.fast_dev_run",
                                 "true", *extra))
    summary = json.loads(path.read_text())
    assert summary["steps"] == 1
    assert (tmp_path / "run" / "model.safetensors").is_file()


def run_cli(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "WANDB_MODE": "offline", "WANDB_SILENT": "true"}
    return subprocess.run([sys.executable, "-c", "from spectrain.train.cli import train_medusa; train_medusa()", *args],
                          capture_output=True, text=True, env=env, cwd=cwd, timeout=600)


@pytest.mark.integration
def test_train_medusa_end_to_end(verifier_factory, text_file, tmp_path):
    verifier_dir = verifier_factory("qwen3", True)
    run_dir = tmp_path / "run"
    proc = run_cli(*small_args(verifier_dir, text_file, run_dir, "--trainer.max_steps", "6",
                               "--trainer.val_check_interval", "3", "--model.num_heads", "3"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    last_line = proc.stdout.strip().splitlines()[-1]
    assert Path(last_line) == (run_dir / "summary.json").resolve()
    summary = json.loads(Path(last_line).read_text())
    assert summary["steps"] == 6 and summary["method"] == "medusa" and summary["target"] == "greedy"
    assert [row[0] for row in summary["per_position"]["rows"]] == [1, 2, 3]
    assert summary["per_position"]["columns"][1] == "top1 vs verifier"
    assert 1.0 <= summary["tau_pred"] <= 4.0
    assert "top1 vs verifier" in proc.stdout
    for name in ("config.yaml", "config.json", "model.safetensors", "checkpoints/best.ckpt"):
        assert (run_dir / name).is_file(), name
    assert "num_heads: 3" in (run_dir / "config.yaml").read_text()

    # The export is the best checkpoint's heads, and reloads to identical logits.
    verifier = load_verifier(str(verifier_dir)).model
    exported = MedusaHeads.from_pretrained(run_dir, verifier_model=verifier)
    ckpt = torch.load(run_dir / "checkpoints" / "best.ckpt", map_location="cpu", weights_only=True)
    from_ckpt = MedusaHeads(exported.config)
    from_ckpt.load_state_dict({k[len("drafter."):]: v for k, v in ckpt["state_dict"].items()})
    hidden = torch.randn(2, 7, verifier.config.hidden_size)
    lm_head = verifier.get_output_embeddings()
    assert torch.equal(exported(hidden, lm_head), from_ckpt(hidden, lm_head))

    # Checkpoints hold the drafter and resume state, never the verifier.
    assert all(k.startswith("drafter.") for k in ckpt["state_dict"])
    assert {"optimizer_states", "lr_schedulers", "global_step"} <= set(ckpt)
    drafter_bytes = sum(t.numel() * t.element_size() for t in exported.state_dict().values())
    verifier_bytes = sum(p.numel() * p.element_size() for p in verifier.parameters())
    ckpt_bytes = (run_dir / "checkpoints" / "best.ckpt").stat().st_size
    assert ckpt_bytes < 3 * drafter_bytes + 64 * 1024 < ckpt_bytes + verifier_bytes
    assert (run_dir / "model.safetensors").stat().st_size < drafter_bytes + 8 * 1024

    # A finished run is not overwritten without --force.
    before = (run_dir / "summary.json").read_text()
    again = run_cli(*small_args(verifier_dir, text_file, run_dir, "--trainer.max_steps", "2"))
    assert again.returncode == 2 and "--force" in again.stderr and "Traceback" not in again.stderr
    assert (run_dir / "summary.json").read_text() == before


@pytest.mark.integration
def test_print_config():
    proc = run_cli("--print_config")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "num_heads: 4" in proc.stdout and "verifier: bundled:tinyshakespeare" in proc.stdout


def test_checkpoint_without_verifier_weights_is_small(verifier_factory, text_file, tmp_path):
    """A deep verifier and shared-lm_head heads: the checkpoint is a fraction of the verifier's size."""
    verifier_dir = verifier_factory("llama", False, layers=6, hidden=64)
    train("medusa_tinyshakespeare.yaml",
          args=small_args(verifier_dir, text_file, tmp_path / "run", "--trainer.max_steps", "2",
                          "--trainer.val_check_interval", "2", "--model.shared_lm_head", "true",
                          "--model.num_heads", "2", "--model.num_layers", "1"))
    verifier_bytes = sum(p.numel() * 4 for p in load_verifier(str(verifier_dir)).model.parameters())
    drafter_bytes = (tmp_path / "run" / "model.safetensors").stat().st_size
    ckpt = tmp_path / "run" / "checkpoints" / "last.ckpt"
    # weights + two AdamW moments + bookkeeping: far below what one copy of the verifier would add
    assert ckpt.stat().st_size < 3 * drafter_bytes + 64 * 1024 < verifier_bytes / 4
    state = torch.load(ckpt, map_location="cpu", weights_only=True)["state_dict"]
    assert state and all(k.startswith("drafter.blocks.") for k in state)


def test_wandb_offline_logging(verifier_factory, text_file, tmp_path):
    train("medusa_tinyshakespeare.yaml",
          args=small_args(verifier_factory("llama", False), text_file, tmp_path / "run", "--trainer.max_steps", "2",
                          "--trainer.val_check_interval", "2", logger="wandb"))
    runs = list((tmp_path / "run" / "wandb").glob("offline-run-*"))
    assert runs, "an offline W&B run directory is written when there is no API key"


CONSOLE_NOISE = ("Run history", "wandb:", "litlogger", "/-2", "Total FLOPs", "LeafSpec", "Loading weights")


@pytest.mark.integration
def test_the_console_shows_the_result_not_the_noise(verifier_factory, text_file, tmp_path):
    """train_medusa as a user runs it (W&B offline, no WANDB_SILENT in the shell): no W&B banner or run-history
    dump, no tip to install another logger, no "Epoch 0/-2", no model summary of zero FLOPs, no weight-loading
    bars — the table and the summary path. The same run with the quieting switched off shows the noise."""
    env = {k: v for k, v in os.environ.items() if k != "WANDB_SILENT"}
    verifier = verifier_factory("llama", False)

    def console(quiet: bool, run_dir: Path) -> tuple[str, str]:
        argv = small_args(verifier, text_file, run_dir, "--trainer.max_steps", "2", "--trainer.val_check_interval", "2",
                          logger="wandb")
        code = ("import sys, spectrain.train.cli as c\n" + ("" if quiet else "c.quiet_console = lambda: None\n")
                + f"sys.argv = ['train_medusa'] + {argv!r}\n" + "c.train_medusa()\n")
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=600)
        assert proc.returncode == 0, proc.stderr[-2000:]
        return proc.stdout, proc.stderr

    out, err = console(True, tmp_path / "quiet")
    assert not [noise for noise in CONSOLE_NOISE if noise in out + err], out + err
    assert "predicted tau" in out and out.strip().splitlines()[-1].endswith("summary.json")
    assert f"W&B run (offline) in {tmp_path / 'quiet' / 'wandb'}" in out
    out, err = console(False, tmp_path / "noisy")
    assert "wandb:" in out + err  # the check above can fail


# ------------------------------------------------------------------------------------------ bad input


def write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


BAD_CASES = {
    "verifier path missing": (lambda d, v, t: ["--model.verifier", str(d / "nope")], "verifier path not found"),
    "data file missing": (lambda d, v, t: ["--data.path", str(d / "missing.jsonl")], "not found"),
    "text file empty": (lambda d, v, t: ["--data.path", str(write(d / "empty.txt", ""))], "empty"),
    "chat file empty": (lambda d, v, t: ["--data.path", str(write(d / "empty.json", ""))], "empty"),
    "malformed json": (lambda d, v, t: ["--data.path", str(write(d / "bad.json", '[{"conversations": [}'))], "not valid JSON"),
    "malformed jsonl": (lambda d, v, t: ["--data.path", str(write(d / "bad.jsonl", '{"messages": []}\n{oops\n'))], "line 2"),
    "no assistant turn": (lambda d, v, t: ["--data.path", str(write(d / "q.jsonl", '{"turns": ["hi"]}\n' * 3))], "no usable conversations"),
    "block size beyond context": (lambda d, v, t: ["--data.block_size", "512"], "exceeds the verifier's context of 256"),
    "zero heads": (lambda d, v, t: ["--model.num_heads", "0"], "num_heads must be >= 1"),
}


@pytest.mark.parametrize("case", sorted(BAD_CASES))
def test_bad_input_is_a_clear_error_and_leaves_no_run(case, verifier_factory, text_file, tmp_path):
    make_args, message = BAD_CASES[case]
    run_dir = tmp_path / "run"
    args = small_args(verifier_factory("llama", False), text_file, run_dir) + make_args(tmp_path, None, None)
    with pytest.raises(SpectrainError, match=message):
        train("medusa_tinyshakespeare.yaml", args=args)
    assert not run_dir.exists()


@pytest.mark.integration
def test_bad_input_exit_code_without_traceback(tmp_path):
    proc = run_cli("--model.verifier", str(tmp_path / "absent"), "--run_dir", str(tmp_path / "run"))
    assert proc.returncode == 2
    assert "error: verifier path not found" in proc.stderr and "Traceback" not in proc.stderr
    assert not (tmp_path / "run").exists()


def test_chat_data_skips_rows_without_assistant(verifier_factory, tmp_path):
    rows = [{"conversations": [{"from": "human", "value": f"tell me about the king {i}"},
                               {"from": "gpt", "value": f"the king {i} sat on the hill and did speak thou good night."}]}
            for i in range(12)] + [{"messages": [{"role": "user", "content": "alone"}]}] * 3
    data = write(tmp_path / "chat.jsonl", "\n".join(json.dumps(r) for r in rows))
    path = train("medusa_tinyshakespeare.yaml",
                 args=small_args(verifier_factory("llama", True), data, tmp_path / "run", "--trainer.max_steps", "2",
                                 "--trainer.val_check_interval", "1", "--model.measure_prompts", "2",
                                 "--model.measure_new_tokens", "8"))
    summary = json.loads(path.read_text())
    assert summary["data_format"] == "chat" and summary["skipped_rows"] == 3
    # Measured tau at every validation: the learning curve in the summary, against tokens trained.
    curve = summary["curve"]
    assert [c["step"] for c in curve] == [1, 2] and curve[0]["trained_tokens"] < curve[1]["trained_tokens"]
    assert all(1.0 <= c["tau_measured"] <= 5.0 and "tau_pred" in c for c in curve)
    assert summary["tau_measured"] == curve[-1]["tau_measured"]


def test_time_budget_without_a_step_budget_is_a_clear_error(verifier_factory, text_file, tmp_path):
    """max_time alone leaves the cosine schedule without a length: refused by name, not an OverflowError."""
    with pytest.raises(SpectrainError, match="finite length"):
        train("medusa_tinyshakespeare.yaml",
              args=small_args(verifier_factory("llama", False), text_file, tmp_path / "run", "--trainer.max_steps",
                              "-1", "--trainer.max_time", "00:00:00:30"))
