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
# Recipes whose verifier is a real hub model: run on shape-scaled stand-ins by tests/test_real_recipes.py instead.
REAL_VERIFIER_RECIPES = {"eagle3_llama31_8b.yaml", "eagle3_qwen3_8b.yaml", "dflash_qwen3_8b.yaml"}


def small_args(verifier: Path, data: Path, run_dir: Path, *extra: str, logger: str = "none") -> list[str]:
    return ["--model.verifier", str(verifier), "--data.path", str(data), "--data.block_size", "64",
            "--data.batch_size", "4", "--run_dir", str(run_dir), "--logger", logger, *extra]


def recomputed_medusa_validation(verifier_dir: Path, heads: MedusaHeads, data_path: Path, block_size: int,
                                 batch_size: int, batches: int) -> tuple[float, list[float]]:
    """Predicted tau and each head's top-1 agreement with the verifier on a run's validation batches, by brute force
    (fp32): the verifier's full logits, every head's argmax, chains walked position by position."""
    from itertools import islice

    from transformers import AutoModelForCausalLM

    from spectrain.data.datamodule import DrafterDataModule

    data = DrafterDataModule(path=str(data_path), tokenizer=str(verifier_dir), block_size=block_size,
                             batch_size=batch_size)
    data.setup("fit")
    model = AutoModelForCausalLM.from_pretrained(verifier_dir, dtype=torch.float32).eval()
    K = heads.config.num_heads
    chains, hits, counts = [], [0] * K, [0] * K
    for batch in islice(data.val_dataloader(), batches):
        with torch.no_grad():
            out = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], output_hidden_states=True)
            greedy = out.logits.argmax(-1)  # (B, T): the verifier's next token after each position
            drafts = heads(out.hidden_states[-1], model.get_output_embeddings()).argmax(-1)  # (K, B, T)
        valid = (batch["loss_mask"] * batch["attention_mask"]).bool()
        B, T = greedy.shape
        for b in range(B):  # head k (0-based) at t drafts the token at t + k + 2, the verifier's greedy at t + k + 1
            for k in range(K):
                for t in range(T - k - 2):
                    if valid[b, t + k + 2]:
                        counts[k] += 1
                        hits[k] += int(drafts[k, b, t] == greedy[b, t + k + 1])
            for t in range(T - K - 1):
                if all(valid[b, t + k + 2] for k in range(K)):
                    length = 0
                    while length < K and drafts[length, b, t] == greedy[b, t + length + 1]:
                        length += 1
                    chains.append(length)
    return 1.0 + sum(chains) / len(chains), [h / n for h, n in zip(hits, counts)]


def measured_by_decoding(run_dir: Path, data_path: Path, num_prompts: int, new_tokens: int):
    """``measure(heads) -> (tau, alpha_1)``: the run's measure prompts (its validation set's first) decoded with
    ``heads`` through the evaluator's loop (chain of min(5, heads), T = 0) in the run's verifier dtype, tau and
    alpha_1 counted from the rounds."""
    import yaml

    from spectrain.data.datamodule import DrafterDataModule
    from spectrain.eval.decode import generate
    from spectrain.eval.medusa import MedusaDrafter
    from spectrain.eval.static_model import StaticCausalLM
    from spectrain.eval.tree import Tree
    from spectrain.train.measure import measure_prompts_from

    config = yaml.safe_load((run_dir / "config.yaml").read_text())
    model_args = config["model"]["init_args"]
    dtype = getattr(torch, model_args["verifier_dtype"])
    verifier = load_verifier(model_args["verifier"], dtype=dtype).model
    data = DrafterDataModule(**{**config["data"], "path": str(data_path), "tokenizer": model_args["verifier"]})
    data.setup("fit")
    prompts = measure_prompts_from(data.val_set, num_prompts)
    assert len(prompts) == num_prompts

    def measure(heads: MedusaHeads) -> tuple[float, float]:
        k = min(model_args["measure_k"], heads.config.num_heads)
        chain = MedusaDrafter(heads.to(dtype).eval(), verifier.get_output_embeddings(), Tree.chain(k))
        runner = StaticCausalLM(verifier, max_len=max(map(len, prompts)) + new_tokens + k + 2)
        outs = [generate(runner, chain, p, new_tokens) for p in prompts]
        accepts = [a for o in outs for a in o.accept_lengths]
        assert sum(len(o.tokens) for o in outs) == len(prompts) + sum(sum(o.emitted_per_round) for o in outs)
        return sum(sum(o.emitted_per_round) for o in outs) / len(accepts), sum(a >= 1 for a in accepts) / len(accepts)

    return measure


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
def test_fast_dev_run_per_config(config, verifier_factory, text_file, tmp_path, monkeypatch):
    """Each recipe YAML parses into its module's typed __init__ args and runs one step with its own vocabulary
    knobs: a recipe's training or draft vocabulary of N rows runs on a verifier of 320 + N (the tiny tokenizer's
    tokens and N padded rows), and the drafter trained has the recipe's N."""
    import yaml
    from safetensors.torch import load_file

    from spectrain.train.base import DrafterModule

    if config in REAL_VERIFIER_RECIPES:
        pytest.skip("a recipe for a real 8B verifier (a hub id, a GPU): tests/test_real_recipes.py trains it on a "
                    "stand-in with the verifier's own vocabulary")
    init = yaml.safe_load(Path(config_path(config)).read_text())["model"]["init_args"]
    knob = init.get("train_vocab_size") or init.get("draft_vocab_size") or 0
    verifier = verifier_factory("llama", False, vocab_size_extra=knob)
    vocab = json.loads((verifier / "config.json").read_text())["vocab_size"]
    assert vocab > knob
    chosen = []  # the training vocabulary each module chose
    real = DrafterModule.set_train_vocab
    monkeypatch.setattr(DrafterModule, "set_train_vocab",
                        lambda self, rows: (real(self, rows), chosen.append(self.train_rows.clone())))
    run_dir = tmp_path / "run"
    path = train(config, args=small_args(verifier, text_file, run_dir, "--trainer.fast_dev_run", "true"))
    summary = json.loads(path.read_text())
    assert summary["steps"] == 1
    assert (run_dir / "model.safetensors").is_file()
    metrics = summary["val_metrics"]
    if init.get("train_vocab_size"):  # Medusa / EAGLE-1: the loss projects onto the N most frequent tokens
        assert [len(rows) for rows in chosen] == [init["train_vocab_size"]]
        assert 0 < metrics["train_vocab_coverage"] <= 1
    else:
        assert chosen == [] and "train_vocab_coverage" not in metrics
    if init.get("variant") == "eagle3":  # its own lm_head over the draft vocabulary (null: min(V, 32000))
        expected = init.get("draft_vocab_size") or min(vocab, 32000)
        weights = load_file(run_dir / "model.safetensors")
        assert json.loads((run_dir / "config.json").read_text())["draft_vocab_size"] == expected
        assert weights["lm_head.weight"].shape[0] == expected == weights["d2t"].shape[0]


def run_cli(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "WANDB_MODE": "offline", "WANDB_SILENT": "true"}
    return subprocess.run([sys.executable, "-c", "from spectrain.train.cli import train_medusa; train_medusa()", *args],
                          capture_output=True, text=True, env=env, cwd=cwd, timeout=600)


@pytest.mark.integration
def test_train_medusa_end_to_end(verifier_factory, text_file, tmp_path):
    verifier_dir = verifier_factory("qwen3", True)
    run_dir = tmp_path / "run"
    # fp32, so the brute-force recomputation below sees the argmaxes the run saw
    proc = run_cli(*small_args(verifier_dir, text_file, run_dir, "--trainer.max_steps", "6",
                               "--trainer.val_check_interval", "3", "--model.num_heads", "3",
                               "--trainer.precision", "32-true"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    last_line = proc.stdout.strip().splitlines()[-1]
    assert Path(last_line) == (run_dir / "summary.json").resolve()
    summary = json.loads(Path(last_line).read_text())
    assert summary["steps"] == 6 and summary["method"] == "medusa" and summary["target"] == "greedy"
    assert [row[0] for row in summary["per_position"]["rows"]] == [1, 2, 3]
    assert summary["per_position"]["columns"][1] == "top1 vs verifier"
    assert "top1 vs verifier" in proc.stdout
    for name in ("config.yaml", "config.json", "model.safetensors", "checkpoints/best.ckpt"):
        assert (run_dir / name).is_file(), name
    assert "num_heads: 3" in (run_dir / "config.yaml").read_text()

    # The export is the best checkpoint's heads, and reloads to identical logits.
    verifier = load_verifier(str(verifier_dir)).model
    exported = MedusaHeads.from_pretrained(run_dir, verifier_model=verifier)
    # The summary's predicted tau and per-head table are the exported heads' on the validation batches
    # (the recipe's limit_val_batches: 20), recomputed by brute force.
    tau, top1 = recomputed_medusa_validation(verifier_dir, exported, text_file, 64, 4, 20)
    assert summary["tau_pred"] == pytest.approx(tau, abs=1e-9) and summary["tau_pred"] > 1.0
    assert summary["tau_pred"] == pytest.approx(1 + sum(summary["val_metrics"][f"p_chain_{j}"] for j in (1, 2, 3)))
    assert [row[1] for row in summary["per_position"]["rows"]] == pytest.approx(top1, abs=1e-9)
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
    assert all("tau_pred" in c for c in curve)
    # The summary's measured tau and alpha_1 are the lossless loop's on the first two validation prompts,
    # re-decoded here with the exported (best) heads; the learning curve holds them at the best checkpoint's step.
    run_dir = tmp_path / "run"
    exported = MedusaHeads.from_pretrained(run_dir)
    tau, alpha1 = measured_by_decoding(run_dir, data, num_prompts=2, new_tokens=8)(exported)
    assert (summary["tau_measured"], summary["val_metrics"]["alpha1_measured"]) == pytest.approx((tau, alpha1))
    best_step = torch.load(run_dir / "checkpoints" / "best.ckpt", map_location="cpu", weights_only=True)["global_step"]
    at_best = next(c for c in curve if c["step"] == best_step)
    assert (at_best["tau_measured"], at_best["alpha1_measured"]) == pytest.approx((tau, alpha1))


def test_time_budget_without_a_step_budget_is_a_clear_error(verifier_factory, text_file, tmp_path):
    """max_time alone leaves the cosine schedule without a length: refused by name, not an OverflowError."""
    with pytest.raises(SpectrainError, match="finite length"):
        train("medusa_tinyshakespeare.yaml",
              args=small_args(verifier_factory("llama", False), text_file, tmp_path / "run", "--trainer.max_steps",
                              "-1", "--trainer.max_time", "00:00:00:30"))
