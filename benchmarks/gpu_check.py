"""GPU check: train a ~30M-parameter verifier and its Medusa heads on the GPU, then race AR vs HF ``generate()``
vs Medusa chain vs Medusa tree (batch 1, bf16, 256 new tokens) and check the targets. The heads are trained by the
recipe ``configs/medusa_gpu_check.yaml`` through ``train_medusa``'s module (on a plain Lightning Trainer).

Needs only torch, transformers, lightning and safetensors (plus this package installed with ``--no-deps``):

    python benchmarks/gpu_check.py                 # on a CUDA machine, about 3-4 minutes
    python benchmarks/gpu_check.py --small --device cpu   # the same path, tiny sizes (tested in CI)
    python benchmarks/gpu_check.py --family gemma2  # the verifier of another family (FAMILY_OPTIONS): decoded
                                                    # through its own layers (--decoder layers)

Targets: our AR loop >= HF static-cache compiled ``generate()`` tokens/s; spec speedup >= 85% of the
ideal implied by tau and the rounds' own draft + verify time (the loop's overhead: its time outside the two passes
is at most 15% of a round); greedy identity in fp32; bf16 divergences reported with the
logit margin at the first differing token. The speed targets are required on CUDA and only reported elsewhere
(``--speed_checks on`` requires them anywhere; ``--min_ar_vs_hf`` / ``--min_speedup_vs_ideal`` set them). Prints a
table; the last stdout line is the JSON path; exit code 1 when a required check fails.

The verifier comes from ``spectrain.data.family_verifiers``, the targets and the verdict from
``spectrain.eval.speed_targets`` (tested).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch

from spectrain.data.bundled import bundled_text_path
from spectrain.data.text import split_text
from spectrain.data.family_verifiers import FAMILY_OPTIONS, train_verifier
from spectrain.data.text import tokenize_lines
from spectrain.eval.evaluate import EvalSettings, evaluate_drafter, load_drafter
from spectrain.eval.prompts import load_prompts
from spectrain.eval.speed_targets import failed_checks, speed_checks
from spectrain.heads.errors import run_command
from spectrain.heads.families import resolve_class_path
from spectrain.heads.report import finish, format_table
from spectrain.heads.verifier import load_verifier

RECIPE = "medusa_gpu_check.yaml"  # configs/: the heads' GPU recipe


def token_rows(tokenizer, text: str, block: int) -> list[dict]:
    """``block``-token windows of ``text``, every token a target (what train_medusa makes of plain text)."""
    ids = torch.tensor(tokenize_lines(tokenizer, text.splitlines(keepends=True)))
    n = len(ids) // block
    return [{"input_ids": b, "attention_mask": torch.ones_like(b), "loss_mask": torch.ones_like(b)}
            for b in ids[:n * block].view(n, block)]


def train_heads(verifier_dir: Path, out: Path, size: str, device, log) -> dict:
    """Medusa heads by the recipe ``configs/medusa_gpu_check.yaml``: the module ``train_medusa`` builds from it,
    on a plain Lightning Trainer with the recipe's trainer settings (a bare GPU image has no jsonargparse for the
    CLI), on token blocks of the bundled text. ``small``: the same with tiny blocks and a few steps."""
    from importlib import resources

    import lightning as L
    import yaml
    from torch.utils.data import DataLoader
    from transformers import AutoTokenizer

    recipe = yaml.safe_load((resources.files("spectrain.configs") / RECIPE).read_text())
    block, batch, steps = (recipe["data"]["block_size"], recipe["data"]["batch_size"], recipe["trainer"]["max_steps"])
    if size == "small":
        block, batch, steps = 64, 8, 20
    L.seed_everything(recipe["seed_everything"], verbose=False)
    module = resolve_class_path(recipe["model"]["class_path"])(  # the recipe's module, as the CLI builds it
        **{**recipe["model"]["init_args"], "verifier": str(verifier_dir)})
    tokenizer = AutoTokenizer.from_pretrained(verifier_dir)
    train_text, val_text = split_text(bundled_text_path().read_text())
    loader = DataLoader(token_rows(tokenizer, train_text, block), batch_size=batch, shuffle=True, drop_last=True,
                        generator=torch.Generator().manual_seed(0), pin_memory=device.type == "cuda")
    val_loader = DataLoader(token_rows(tokenizer, val_text, block)[:4 * batch], batch_size=batch)
    settings = {**recipe["trainer"], "max_steps": steps, "val_check_interval": steps,
                "accelerator": "gpu" if device.type == "cuda" else "cpu",
                "precision": recipe["trainer"]["precision"] if device.type == "cuda" else "32-true"}
    trainer = L.Trainer(**settings, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False)
    t0 = time.time()
    trainer.fit(module, loader, val_loader)
    log(f"heads: {trainer.global_step} steps, {module.trained_tokens} tokens in {module.train_seconds:.0f}s, "
        f"validation {module.last_val_metrics}")
    module.export(out, module.plain_drafter().float())
    return {"recipe": f"configs/{RECIPE}", "steps": trainer.global_step, "trained_tokens": module.trained_tokens,
            "train_seconds": module.train_seconds, "wall_seconds": time.time() - t0,
            "validation": module.last_val_metrics}


def main(argv: list[str] | None = None) -> Path:
    """Bad input: ``error: ...`` on stderr and exit code 2 (no traceback)."""
    return run_command(_main, argv)


def _main(argv: list[str] | None = None) -> Path:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda")
    p.add_argument("--small", action="store_true", help="tiny sizes, for testing the path on a CPU")
    p.add_argument("--family", default="llama", choices=sorted(FAMILY_OPTIONS),
                   help="the verifier's family (llama: our hand-written decoder; the others: their own layers)")
    p.add_argument("--out", default="runs/gpu_check")
    p.add_argument("--num_prompts", type=int, default=8)
    p.add_argument("--max_new_tokens", type=int, default=256)
    p.add_argument("--speed_checks", choices=("auto", "on", "off"), default="auto",
                   help="require the speed targets: auto = on CUDA only (a CPU run reports them)")
    p.add_argument("--min_ar_vs_hf", type=float, default=1.0, help="our AR tokens/s over HF generate()'s, at least")
    p.add_argument("--min_speedup_vs_ideal", type=float, default=0.85,
                   help="each setting's measured speedup over its ideal speedup, at least")
    args = p.parse_args(argv)
    size = "small" if args.small else "full"
    device = torch.device(args.device)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    def log(msg):
        print(msg, flush=True)

    t0 = time.time()
    verifier_dir, verifier_info = train_verifier(out / "verifier", size, device, log, args.family)
    heads_info = train_heads(verifier_dir, out / "heads", size, device, log)

    chain_and_tree = EvalSettings(k=4, tree="auto:32", chat_template=False)  # what both runs decode

    def measure(dtype: torch.dtype, num_prompts: int, settings: EvalSettings) -> dict:
        verifier = load_verifier(str(verifier_dir), dtype=dtype, device=args.device)
        prompts = load_prompts("bundled:tinyshakespeare", num_prompts, verifier.tokenizer, prompt_tokens=64)
        drafter = load_drafter(str(out / "heads"), verifier)
        return evaluate_drafter(verifier, prompts, drafter, settings).to_dict()

    fast = measure(torch.bfloat16 if device.type == "cuda" else torch.float32, args.num_prompts,
                   replace(chain_and_tree, max_new_tokens=args.max_new_tokens, compile=device.type == "cuda",
                           hf_generate=3))
    exact = measure(torch.float32, 3, replace(chain_and_tree, max_new_tokens=64, hf_generate=0))
    r, hf = fast["results"], fast["hf_generate"]
    rows = [["HF generate()" + (" (static, compiled)" if device.type == "cuda" else ""), "-",
             hf["tokens_per_second"], "-", "-", "-", "-"]]
    for name, res in r.items():
        rows.append([name, res["tau"], res["tokens_per_second"], res["decode_ms_per_token"], res.get("speedup", 1.0),
                     res.get("ideal_speedup", 1.0), res.get("speedup_vs_ideal", 1.0)])
    speed = args.speed_checks == "on" or (args.speed_checks == "auto" and device.type == "cuda")
    checks = {
        **speed_checks(r, hf, args.min_ar_vs_hf, args.min_speedup_vs_ideal),
        "fp32_greedy_identical": {k: v["identical_to_ar"] for k, v in exact["results"].items() if k != "ar"},
        "bf16_divergences": {k: v.get("divergences") for k, v in r.items() if k != "ar"},
    }
    summary = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
               "date": time.strftime("%Y-%m-%d"), "size": size, "verifier": verifier_info, "heads": heads_info,
               "decoder": fast["decoder"],
               "bf16": {"results": r, "hf_generate": hf, "costs": fast["costs"], "planner": fast["planner"]},
               "fp32": {k: {"tau": v["tau"], "identical_to_ar": v.get("identical_to_ar")} for k, v in exact["results"].items()},
               "checks": checks, "wall_seconds": time.time() - t0}
    table = format_table(["setting", "tau", "tok/s", "ms/token", "speedup", "ideal", "speedup/ideal"], rows,
                         title=f"GPU check on {summary['device']}: {verifier_info['parameters'] / 1e6:.1f}M "
                               f"{args.family} verifier (decoder: {fast['decoder']}), "
                               f"batch 1, {args.max_new_tokens} new tokens")
    # Correctness must hold everywhere; the speed targets are GPU targets (a CPU run reports them unless
    # --speed_checks on).
    summary["speed_checks_required"] = speed
    summary["failed"] = failed_checks(checks, speed)
    summary["passed"] = not summary["failed"]
    path = finish(summary, out / "gpu_check.json", tables=[table, json.dumps(checks, indent=1)])
    if not summary["passed"]:
        print(f"gpu check: FAILED {', '.join(summary['failed'])} (see checks above)", file=sys.stderr)
        raise SystemExit(1)
    return path


if __name__ == "__main__":
    main()
