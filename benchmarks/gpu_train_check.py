"""GPU training check: the drafter of every bundled default recipe (``configs/*_tinyshakespeare.yaml``: one per
drafter family and variant) trained a few hundred bf16-mixed steps on one GPU, and one recipe's (``--fsdp_recipe``)
under the ``fsdp_drafter`` strategy on one device; tokens/s and MFU against the GPU's bf16 peak; exits 1 when any
run fails.

Needs torch, transformers, lightning, safetensors and this package (``pip install --no-deps``) — not
``datasets``, ``wandb`` or ``jsonargparse``, which a bare GPU image may lack: it builds each recipe's
LightningModule (its ``class_path`` with its ``init_args``, the verifier, learning-rate warm-up and measured-τ
settings of this check over them) as ``spectrain-train --config RECIPE`` would, and fits it with a plain
``lightning.Trainer`` (bf16-mixed, fused AdamW, gradient clipping, validation with measured tau) on token blocks
of the bundled tinyshakespeare text — the module's own ``setup`` sees them as a data module's training set — and a
randomly initialised GQA Llama verifier built here (no downloads):

    python benchmarks/gpu_train_check.py [--steps 300] [--out runs/gpu_train_check]
    python benchmarks/gpu_train_check.py --small --device cpu     # the same path, tiny sizes (tested in CI)

FLOPs per token are counted (``torch.utils.flop_counter``) on one training step — the verifier's forward and
the drafter's forward and backward — so MFU = tokens/s x FLOPs per token / peak. Prints a table; the last
stdout line is the JSON path.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
import traceback
from pathlib import Path

import torch

from spectrain.heads.errors import SpectrainError, run_command
from spectrain.heads.report import finish, format_table

SIZES = {  # hidden, layers, heads, kv heads, intermediate, vocab, block, batch
    "full": (1024, 12, 16, 4, 2816, 8192, 512, 16),
    "small": (64, 2, 4, 2, 128, 512, 32, 4),
}
PEAK_BF16_TFLOPS = {"H200": 989.0, "H100": 989.0, "A100": 312.0, "L40S": 362.0, "A10G": 125.0, "L4": 121.0}


def build_verifier(out: Path, size: str) -> Path:
    """A random-weight Llama with grouped-query attention and a BPE tokenizer trained on the bundled text."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from spectrain.data.bundled import bundled_text_path, split_text, train_tokenizer

    hidden, layers, heads, kv_heads, inter, vocab, _, _ = SIZES[size]
    train_text, _ = split_text(bundled_text_path().read_text())
    tokenizer = train_tokenizer(train_text, vocab)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=inter,
                         num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                         max_position_embeddings=4096, bos_token_id=tokenizer.bos_token_id,
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def token_blocks(verifier_dir: Path, size: str) -> tuple[list[dict], list[dict]]:
    """Train / validation rows: ``block``-token windows of the bundled text, every token a target."""
    from transformers import AutoTokenizer

    from spectrain.data.bundled import bundled_text_path, split_text
    from spectrain.data.text import tokenize_lines

    block = SIZES[size][6]
    tokenizer = AutoTokenizer.from_pretrained(verifier_dir)
    rows = []
    for text in split_text(bundled_text_path().read_text()):
        ids = torch.tensor(tokenize_lines(tokenizer, text.splitlines(keepends=True)))
        n = len(ids) // block
        rows.append([{"input_ids": b, "attention_mask": torch.ones_like(b), "loss_mask": torch.ones_like(b)}
                     for b in ids[:n * block].view(n, block)])
    return rows[0], rows[1]


def bundled_recipes() -> list[str]:
    """The bundled default recipes, one per drafter family and variant (``configs/*_tinyshakespeare.yaml``)."""
    from importlib.resources import files

    return sorted(p.name for p in files("spectrain.configs").iterdir() if p.name.endswith("_tinyshakespeare.yaml"))


def run_name(recipe: str, strategy: str) -> str:
    """``eagle3_tinyshakespeare.yaml`` -> ``eagle3`` (``-fsdp`` under an FSDP strategy): a run's name in the table
    and the JSON."""
    return recipe.split("_")[0] + ("-fsdp" if "fsdp" in strategy else "")


def build_module(recipe: str, verifier_dir: Path, size: str, strategy: str = "auto"):
    """The recipe's LightningModule for the verifier built here: its ``init_args``, with this check's verifier,
    learning-rate warm-up and measured-τ settings over them (a fixed draft vocabulary: a quarter of the verifier's)."""
    from importlib.resources import files

    import yaml

    from spectrain.heads.families import resolve_class_path

    model = yaml.safe_load(files("spectrain.configs").joinpath(recipe).read_text())["model"]
    init_args = {**model.get("init_args", {}), "verifier": str(verifier_dir), "lr": 1e-3, "warmup_steps": 20,
                 "measure_prompts": 4, "measure_new_tokens": 32,
                 "verifier_device": "cpu" if "fsdp" in strategy else "auto"}  # as the CLIs set it: FSDP shards
    # from the host
    if "draft_vocab_size" in init_args:  # the recipe's default is sized for a real vocabulary
        init_args["draft_vocab_size"] = SIZES[size][5] // 4
    return resolve_class_path(model["class_path"])(**init_args)


def flops_per_token(module, batch: dict) -> float:
    """Counted FLOPs of one training step (verifier forward, drafter forward + backward) per token."""
    from torch.utils.flop_counter import FlopCounterMode

    module.drafter.zero_grad(set_to_none=True)
    with FlopCounterMode(display=False) as counter:
        with torch.autocast(batch["input_ids"].device.type, dtype=torch.bfloat16):
            loss, _ = module.step_loss(batch)
        loss.backward()
    module.drafter.zero_grad(set_to_none=True)
    return counter.get_total_flops() / batch["input_ids"].numel()


def blocks_module(rows: tuple[list[dict], list[dict]], batch_size: int, device: torch.device):
    """The token blocks as a data module (``train_set``, ``vocab_rows``, loaders): what a recipe's module reads in
    its ``setup`` (a fixed draft vocabulary, counted over the training rows) it reads here as from the CLIs' data."""
    import lightning as L
    from torch.utils.data import DataLoader

    class Blocks(L.LightningDataModule):
        def __init__(self):
            super().__init__()
            self.train_set, self.val_set = rows[0], rows[1][:8 * batch_size]

        def vocab_rows(self):
            return self.train_set[:512]

        def train_dataloader(self):
            return DataLoader(self.train_set, batch_size=batch_size, shuffle=True, drop_last=True,
                              generator=torch.Generator().manual_seed(0), pin_memory=device.type == "cuda")

        def val_dataloader(self):
            return DataLoader(self.val_set, batch_size=batch_size)

    return Blocks()


def train_one(recipe: str, strategy: str, verifier_dir: Path, rows: tuple[list[dict], list[dict]], args) -> dict:
    import lightning as L

    from spectrain.train.strategies import register_strategies

    register_strategies()
    method = run_name(recipe, strategy)
    train_rows, _ = rows
    batch_size = SIZES[args.size][7]
    device = torch.device(args.device)
    module = build_module(recipe, verifier_dir, args.size, strategy)
    probe = {k: torch.stack([r[k] for r in train_rows[:batch_size]]).to(device) for k in train_rows[0]}
    module.to(device)
    flops = flops_per_token(module, probe)
    trainer = L.Trainer(accelerator="gpu" if device.type == "cuda" else "cpu", devices=1, strategy=strategy,
                        precision="bf16-mixed", max_steps=args.steps, val_check_interval=args.steps,
                        limit_val_batches=4, gradient_clip_val=1.0, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0)
    t0 = time.perf_counter()
    trainer.fit(module, datamodule=blocks_module(rows, batch_size, device))
    wall = time.perf_counter() - t0
    losses = [float(v) for k, v in trainer.callback_metrics.items() if k == "train/loss"]
    tokens_per_second = module.trained_tokens / max(module.train_seconds, 1e-9)
    metrics = module.last_val_metrics
    if not (trainer.global_step == args.steps and losses and all(math.isfinite(x) for x in losses)
            and module.trained_tokens == args.steps * batch_size * SIZES[args.size][6]):
        raise SpectrainError(f"{method}: {trainer.global_step} of {args.steps} steps, loss {losses}, "
                             f"{module.trained_tokens} tokens")
    drafter = module.plain_drafter()  # the gathered weights the export would write
    return {"method": method, "recipe": recipe, "strategy": strategy, "steps": trainer.global_step, "trained_tokens":
            module.trained_tokens, "train_seconds": module.train_seconds, "wall_seconds": wall,
            "tokens_per_second": tokens_per_second, "flops_per_token": flops,
            "tflops": tokens_per_second * flops / 1e12, "final_loss": losses[-1],
            "tau_pred": metrics.get("tau_pred"), "tau_measured": metrics.get("tau_measured"),
            "drafter_parameters": sum(p.numel() for p in drafter.parameters())}


def peak_tflops(args) -> float | None:
    if args.peak_tflops:
        return args.peak_tflops
    if args.device.startswith("cuda") and torch.cuda.is_available():
        name = torch.cuda.get_device_name()
        return next((v for k, v in PEAK_BF16_TFLOPS.items() if k in name), None)
    return None


def check(args) -> Path:
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        raise SpectrainError("--device cuda, but CUDA is not available here (use --small --device cpu to try the path)")
    out = Path(args.out)
    verifier_dir = build_verifier(out / "verifier", args.size)
    rows = token_blocks(verifier_dir, args.size)
    recipes = bundled_recipes()
    if args.fsdp_recipe not in recipes:
        raise SpectrainError(f"--fsdp_recipe {args.fsdp_recipe}: not a bundled recipe ({', '.join(recipes)})")
    runs = [(recipe, "auto") for recipe in recipes]
    if args.device.startswith("cuda"):
        runs.append((args.fsdp_recipe, "fsdp_drafter"))  # Lightning's FSDP needs CUDA
    peak = peak_tflops(args)
    results = []
    for recipe, strategy in runs:
        method = run_name(recipe, strategy)
        try:
            result = train_one(recipe, strategy, verifier_dir, rows, args)
            result["mfu"] = None if peak is None else result["tflops"] / peak
            result["ok"] = True
        except Exception as e:  # noqa: BLE001 - every run is reported; the exit code says whether all passed
            result = {"method": method, "recipe": recipe, "strategy": strategy, "ok": False,
                      "error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-4000:]}
        results.append(result)
        print(f"gpu_train_check: {method} ({strategy}): {'ok' if result['ok'] else result['error']}", flush=True)
    device_name = torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu"
    summary = {"command": "python benchmarks/gpu_train_check.py " + " ".join(sys.argv[1:]), "device": device_name,
               "torch": torch.__version__, "size": args.size, "shape": dict(zip(
                   ("hidden", "layers", "heads", "kv_heads", "intermediate", "vocab", "block", "batch"),
                   SIZES[args.size])), "peak_bf16_tflops": peak, "runs": results,
               "passed": all(r["ok"] for r in results)}
    table = format_table(
        ["run", "strategy", "ok", "steps", "tokens/s", "GFLOP/token", "TFLOP/s", "MFU", "tau_pred", "tau measured"],
        [[r["method"], r["strategy"], r["ok"], r.get("steps", "-"), round(r.get("tokens_per_second", 0), 1),
          round(r.get("flops_per_token", 0) / 1e9, 3), round(r.get("tflops", 0), 2),
          "-" if r.get("mfu") is None else f"{100 * r['mfu']:.1f}%",
          "-" if r.get("tau_pred") is None else round(r["tau_pred"], 3),
          "-" if r.get("tau_measured") is None else round(r["tau_measured"], 3)] for r in results],
        title=f"bf16-mixed training on {device_name} ({args.size} verifier)")
    path = finish(summary, out / "gpu_train_check.json", tables=[table])
    if not summary["passed"]:
        for r in results:
            if not r["ok"]:
                print(r["traceback"], file=sys.stderr)
        raise SystemExit(1)
    return path


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python benchmarks/gpu_train_check.py", description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--small", dest="size", action="store_const", const="small", default="full",
                   help="tiny verifier and blocks: the same path in seconds")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--fsdp_recipe", default="medusa_tinyshakespeare.yaml",
                   help="the recipe also trained under the fsdp_drafter strategy (CUDA only)")
    p.add_argument("--peak_tflops", type=float, default=None, help="the device's dense bf16 peak (default: by name)")
    p.add_argument("--out", default="runs/gpu_train_check")
    return p.parse_args(argv)


def main(argv=None) -> None:
    run_command(check, parse_args(argv))


if __name__ == "__main__":
    main()
