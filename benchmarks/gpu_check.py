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
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from spectrain.heads.errors import SpectrainError, run_command
from spectrain.data.bundled import bundled_text_path, split_text, train_tokenizer
from spectrain.data.text import tokenize_lines
from spectrain.eval.evaluate import evaluate_drafter, load_drafter
from spectrain.eval.prompts import load_prompts
from spectrain.heads.families import family_of, resolve_class_path
from spectrain.heads.report import finish, format_table
from spectrain.heads.schedule import cosine_with_warmup
from spectrain.heads.verifier import load_verifier

# What each family's verifier sets beyond the shared sizes (small experts, windows that bind within a prompt).
FAMILY_OPTIONS = {
    "llama": {}, "qwen2": {}, "qwen3": {}, "phi3": {}, "olmo2": {},
    "mistral": {"sliding_window": 64},
    "gemma2": {"sliding_window": 64, "final_logit_softcapping": 30.0, "attn_logit_softcapping": 50.0},
    "gemma3_text": {"sliding_window": 64, "final_logit_softcapping": 30.0},
    "granite": {"embedding_multiplier": 12.0, "residual_multiplier": 0.22, "attention_multiplier": 0.015,
                "logits_scaling": 4.0},
    "qwen3_moe": {"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": "inter/4"},
    "gpt_oss": {"num_local_experts": 8, "num_experts_per_tok": 2, "sliding_window": 64,
                "layer_types": "alternating", "rope_parameters": {"rope_type": "default", "rope_theta": 150000.0}},
}

SIZES = {  # the verifier: hidden, layers, heads, intermediate, steps, batch, block (the heads: configs/, RECIPE)
    "full": (576, 8, 9, 1536, 1500, 64, 256),
    "small": (64, 2, 2, 128, 30, 8, 64),
}


def batches(ids: torch.Tensor, batch: int, block: int, gen: torch.Generator, device):
    offsets = torch.arange(block + 1)
    while True:
        starts = torch.randint(0, len(ids) - block - 1, (batch,), generator=gen)
        yield ids[starts[:, None] + offsets].to(device)


def autocast(device):
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda")


def verifier_config(family: str, vocab_size: int, hidden: int, layers: int, heads: int, inter: int, tok):
    """The check's verifier: ``family``'s config at the shared sizes plus :data:`FAMILY_OPTIONS`."""
    from transformers import AutoConfig

    if family not in FAMILY_OPTIONS:
        raise SpectrainError(f"--family must be one of {', '.join(FAMILY_OPTIONS)}, not {family!r}")
    options = dict(FAMILY_OPTIONS[family])
    if options.get("moe_intermediate_size") == "inter/4":
        options["moe_intermediate_size"] = inter // 4
    if options.get("layer_types") == "alternating":
        options["layer_types"] = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)]
    if family.startswith("gemma"):
        options["query_pre_attn_scalar"] = hidden // heads
    return AutoConfig.for_model(family, vocab_size=vocab_size, hidden_size=hidden, intermediate_size=inter,
                                num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=heads,
                                head_dim=hidden // heads, max_position_embeddings=2048, tie_word_embeddings=True,
                                bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                                pad_token_id=tok.pad_token_id, **options)


def train_verifier(out: Path, size: str, device, log, family: str = "llama") -> tuple[Path, dict]:
    from transformers import AutoModelForCausalLM

    hidden, layers, heads, inter, steps, batch, block = SIZES[size]
    train_text, val_text = split_text(bundled_text_path().read_text())
    tok = train_tokenizer(train_text, 2048)
    train_ids = torch.tensor(tokenize_lines(tok, train_text.splitlines(keepends=True)))
    val_ids = torch.tensor(tokenize_lines(tok, val_text.splitlines(keepends=True)))
    config = verifier_config(family, len(tok), hidden, layers, heads, inter, tok)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=2e-3, betas=(0.9, 0.95), weight_decay=0.1, fused=True)
    data = batches(train_ids, batch, block, torch.Generator().manual_seed(0), device)
    t0 = time.time()
    for step in range(steps):
        for g in opt.param_groups:
            g["lr"] = 2e-3 * cosine_with_warmup(step, 50, steps, 0.1)
        chunk = next(data)
        with autocast(device):
            logits = model(input_ids=chunk[:, :-1]).logits
        loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), chunk[:, 1:].flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if step % 250 == 0:
            log(f"verifier step {step}/{steps} loss {loss.item():.3f} ({time.time() - t0:.0f}s)")
    model.eval()
    with torch.no_grad(), autocast(device):
        n = (len(val_ids) - 1) // block
        x = val_ids[:n * block].view(n, block).to(device)
        y = val_ids[1:n * block + 1].view(n, block).to(device)
        val_ce = sum(float(torch.nn.functional.cross_entropy(model(input_ids=x[i:i + 32]).logits.float().flatten(0, 1),
                                                             y[i:i + 32].flatten(), reduction="sum"))
                     for i in range(0, n, 32)) / y.numel()
    model.save_pretrained(out)
    tok.save_pretrained(out)
    info = {"family": family, "parameters": sum(p.numel() for p in model.parameters()), "steps": steps,
            "val_cross_entropy": val_ce, "train_seconds": time.time() - t0}
    return out, info


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


def speed_checks(results: dict, hf: dict, min_ar_vs_hf: float, min_speedup_vs_ideal: float) -> dict:
    """Each speed target with what it compared: our AR tokens/s over HF ``generate()``'s, and per speculative
    setting its measured speedup over the ideal one (tau and its rounds' draft + verify time), each against its minimum."""
    ours, theirs = results["ar"]["tokens_per_second"], hf["tokens_per_second"]
    ratio = ours / theirs if theirs > 0 else float("inf")
    per_setting = {}
    for name, res in results.items():
        if name == "ar":
            continue
        value = res["speedup"] / res["ideal_speedup"]
        per_setting[name] = {"speedup": res["speedup"], "ideal_speedup": res["ideal_speedup"], "ratio": value,
                             "min": min_speedup_vs_ideal, "passed": value >= min_speedup_vs_ideal}
    return {"ar_vs_hf_generate": {"ours_tokens_per_second": ours, "hf_tokens_per_second": theirs, "ratio": ratio,
                                  "min": min_ar_vs_hf, "passed": ratio >= min_ar_vs_hf},
            "speedup_vs_ideal": per_setting}


def required_checks(checks: dict, speed: bool) -> dict[str, bool]:
    """The checks that decide ``passed``: fp32 greedy identity always, the speed targets when ``speed``."""
    required = {f"fp32_greedy_identical/{k}": v for k, v in checks["fp32_greedy_identical"].items()}
    if speed:
        required["ar_vs_hf_generate"] = checks["ar_vs_hf_generate"]["passed"]
        required.update({f"speedup_vs_ideal/{k}": v["passed"] for k, v in checks["speedup_vs_ideal"].items()})
    return required


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

    def measure(dtype: torch.dtype, num_prompts: int, max_new_tokens: int, **options) -> dict:
        verifier = load_verifier(str(verifier_dir), dtype=dtype, device=args.device)
        prompts = load_prompts("bundled:tinyshakespeare", num_prompts, verifier.tokenizer, prompt_tokens=64)
        drafter = load_drafter(str(out / "heads"), verifier)
        result = evaluate_drafter(verifier, prompts, method=family_of(drafter).name, drafter=drafter, k=4,
                                  tree="auto:32", chat_template=False, max_new_tokens=max_new_tokens, **options)
        return result.to_dict()

    fast = measure(torch.bfloat16 if device.type == "cuda" else torch.float32, args.num_prompts, args.max_new_tokens,
                   compile=device.type == "cuda", hf_generate=3)
    exact = measure(torch.float32, 3, 64, hf_generate=0)
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
    required = required_checks(checks, speed)
    summary["speed_checks_required"] = speed
    summary["failed"] = sorted(k for k, ok in required.items() if not ok)
    summary["passed"] = all(required.values())
    path = finish(summary, out / "gpu_check.json", tables=[table, json.dumps(checks, indent=1)])
    if not summary["passed"]:
        print(f"gpu check: FAILED {', '.join(summary['failed'])} (see checks above)", file=sys.stderr)
        raise SystemExit(1)
    return path


if __name__ == "__main__":
    main()
