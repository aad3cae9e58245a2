"""The bad-input matrix: every case gives a clear error naming the problem and damages no existing output.

A finished training run, an offline store and an export exist before the matrix runs; every case is
attempted against (or beside) them, and afterwards their files must be byte-for-byte what they were.
docs/troubleshooting.md lists these cases with their messages.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from spectrain.data.datamodule import DrafterDataModule
from spectrain.data.store import HiddenStateStore, extract
from spectrain.heads.errors import SpectrainError
from spectrain.heads.serving.formats import export_drafter, import_drafter
from spectrain.heads.verifier import load_verifier
from spectrain.train.cli import train


def small(verifier: Path, data: Path, run_dir: Path, *extra: str) -> list[str]:
    return ["--model.verifier", str(verifier), "--data.path", str(data), "--data.block_size", "32",
            "--data.batch_size", "4", "--trainer.max_steps", "2", "--trainer.val_check_interval", "2",
            "--trainer.limit_val_batches", "1", "--run_dir", str(run_dir), "--logger", "none", *extra]


def tree_digest(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def world(tmp_path_factory, verifier_factory, text_file):
    """Existing outputs the matrix must not damage: a finished Medusa run, an EAGLE-1 run, a store, an export."""
    root = tmp_path_factory.mktemp("matrix")
    verifier = verifier_factory("llama", False, layers=3)
    train("medusa_tinyshakespeare.yaml",
          args=small(verifier, text_file, root / "medusa-run"))
    train("eagle1_tinyshakespeare.yaml",
          args=small(verifier, text_file, root / "eagle1-run"))
    data = DrafterDataModule(path=str(text_file), tokenizer=str(verifier), block_size=32)
    data.setup()
    extract(load_verifier(str(verifier)), data.val_set, root / "store" / "train", (1, 2, 3), "corpus",
            rows_per_shard=4, log=lambda *_: None)
    drafter = import_drafter(root / "eagle1-run")
    export_drafter(drafter, "eagle", root / "export")
    return {"root": root, "verifier": verifier, "text": text_file,
            "digests": {name: tree_digest(root / name) for name in ("medusa-run", "eagle1-run", "store", "export")}}


def train_medusa_args(w, *extra):
    return small(w["verifier"], w["text"], w["root"] / "new-run", *extra)


def expect_cli_error(w, extra, message):
    """LightningCLI/jsonargparse parse errors exit 2 after naming the key."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "WANDB_MODE": "offline"}
    proc = subprocess.run([sys.executable, "-c", "from spectrain.train.cli import train_medusa; train_medusa()",
                           *train_medusa_args(w, *extra)], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert message in proc.stderr, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr


def raises(message, fn, *args, **kwargs):
    with pytest.raises(SpectrainError, match=message):
        fn(*args, **kwargs)


def corrupt_copy(w, name: str, edit) -> Path:
    copy = w["root"] / f"copy-{name}-{edit.__name__}"
    shutil.rmtree(copy, ignore_errors=True)
    shutil.copytree(w["root"] / name, copy)
    edit(copy)
    return copy


def empty_shard(store: Path):
    (store / "train" / "shard-00000.safetensors").write_bytes(b"")


def flipped_byte(store: Path):
    shard = store / "train" / "shard-00000.safetensors"
    data = bytearray(shard.read_bytes())
    data[-5] ^= 0xFF
    shard.write_bytes(bytes(data))


def pickled_weights(run: Path):
    torch.save({"fc.weight": torch.zeros(2, 2)}, run / "model.safetensors")  # a pickle under a safetensors name


def remote_code_model(w) -> Path:
    path = w["root"] / "remote-code-model"
    path.mkdir(exist_ok=True)
    (path / "config.json").write_text(json.dumps({"model_type": "my_custom_lm", "architectures": ["MyLM"],
                                                  "auto_map": {"AutoConfig": "modeling_my.MyConfig",
                                                               "AutoModelForCausalLM": "modeling_my.MyLM"}}))
    (path / "modeling_my.py").write_text("raise SystemExit('custom code must not run without trust_remote_code')\n")
    return path


def non_utf8(w) -> Path:
    path = w["root"] / "latin1.txt"
    path.write_bytes("caf\xe9 au lait\n".encode("latin-1") * 50)
    return path


CASES = {
    # -- CLI and config ---------------------------------------------------------------------------------------
    "unknown config key": lambda w: expect_cli_error(w, ["--model.num_headz", "3"], "num_headz"),
    "wrong type": lambda w: expect_cli_error(w, ["--data.block_size", "many"], "block_size"),
    "zero batch size": lambda w: raises(
        "data.batch_size must be >= 1", train, "medusa_tinyshakespeare.yaml",
        args=train_medusa_args(w, "--data.batch_size", "0")),
    "negative learning rate": lambda w: raises(
        "model.lr must be > 0", train, "medusa_tinyshakespeare.yaml",
        args=train_medusa_args(w, "--model.lr", "-1")),
    "zero checkpoint interval": lambda w: raises(
        "--checkpoint_every must be >= 1", train, "medusa_tinyshakespeare.yaml",
        args=train_medusa_args(w, "--checkpoint_every", "0")),
    "finished run without --force": lambda w: raises(
        "holds a finished run", train, "medusa_tinyshakespeare.yaml",
        args=small(w["verifier"], w["text"], w["root"] / "medusa-run")),
    # -- data ---------------------------------------------------------------------------------------------------
    "non-UTF-8 text": lambda w: raises(
        "not UTF-8", train, "medusa_tinyshakespeare.yaml",
        args=small(w["verifier"], non_utf8(w), w["root"] / "new-run")),
    "missing data file": lambda w: raises(
        "not found", train, "medusa_tinyshakespeare.yaml",
        args=small(w["verifier"], w["root"] / "absent.jsonl", w["root"] / "new-run")),
    "missing store directory": lambda w: raises(  # not an HF hub id: say how such a path is made
        "does not exist. A hidden-state store is built with spectrain-extract", train,
        "medusa_tinyshakespeare.yaml",
        args=small(w["verifier"], w["root"] / "stores" / "distilled", w["root"] / "new-run")),
    # -- stores -------------------------------------------------------------------------------------------------
    "empty store shard": lambda w: raises(
        "shard-00000.safetensors is missing or truncated", HiddenStateStore,
        corrupt_copy(w, "store", empty_shard) / "train"),
    "store checksum mismatch": lambda w: raises(
        "shard-00000.safetensors is corrupt", HiddenStateStore, corrupt_copy(w, "store", flipped_byte) / "train"),
    # -- checkpoints and drafters -------------------------------------------------------------------------------
    "checkpoint of another method": lambda w: raises(
        "another kind or shape", train, "medusa_tinyshakespeare.yaml",
        args=train_medusa_args(w, "--model.init_from", str(w["root"] / "eagle1-run"))),
    "pickle where safetensors are expected": lambda w: raises(
        "is not a readable safetensors file", import_drafter, corrupt_copy(w, "eagle1-run", pickled_weights)),
    "export to a format of another method": lambda w: raises(
        "format eagle3 holds eagle3 drafters, but this run trained eagle1", export_drafter,
        import_drafter(w["root"] / "eagle1-run"), "eagle3", w["root"] / "new-export"),
    "export over an existing export": lambda w: raises(
        "already exists; pass --force", export_drafter, import_drafter(w["root"] / "eagle1-run"), "eagle",
        w["root"] / "export"),
    # -- verifiers ----------------------------------------------------------------------------------------------
    "remote-code verifier without the flag": lambda w: raises(
        "needs custom code; enable trust_remote_code", load_verifier, str(remote_code_model(w))),
    "missing verifier": lambda w: raises("verifier path not found", load_verifier, str(w["root"] / "no-such-model")),
}


SPAWNING_CASES = {"unknown config key", "wrong type"}  # the real console script in a subprocess


@pytest.mark.parametrize("case", [pytest.param(c, marks=pytest.mark.integration) if c in SPAWNING_CASES else c
                                  for c in sorted(CASES)])
def test_bad_input(case, world):
    CASES[case](world)
    root = world["root"]
    for name, digest in world["digests"].items():
        assert tree_digest(root / name) == digest, f"{case} changed {name}"
    assert not (root / "new-run").exists() and not (root / "new-export").exists()


def test_matrix_is_large_enough():
    assert len(CASES) >= 15


@pytest.mark.integration
def test_wandb_key_is_never_written(tmp_path, verifier_factory, text_file):
    """A W&B API key in the environment must not end up in configs, logs or summaries."""
    secret = "0123456789abcdef0123456789abcdef01234567"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "WANDB_API_KEY": secret, "WANDB_MODE": "offline",
           "WANDB_SILENT": "true"}
    run_dir = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-c", "from spectrain.train.cli import train_medusa; train_medusa()",
                           *small(verifier_factory("llama", False), text_file, run_dir)[:-2], "--logger", "wandb"],
                          capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert secret not in proc.stdout + proc.stderr
    for path in run_dir.rglob("*"):
        if path.is_file():
            assert secret.encode() not in path.read_bytes(), f"W&B key written to {path}"
