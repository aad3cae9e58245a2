"""GPU training check: the drafter of every bundled default recipe (``configs/*_tinyshakespeare.yaml``: one per
drafter family and variant) trained a few hundred bf16-mixed steps on one GPU, and one recipe's (``--fsdp_recipe``)
under the ``fsdp_drafter`` strategy on one device; tokens/s and MFU against the GPU's bf16 peak; and, on request, the
own-model path of docs/own-model.md (below); exits 1 when any run or step fails.

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
the drafter's forward and backward — so MFU = tokens/s x FLOPs per token / peak.

The own-model stage (``--own_model`` after the recipe runs, ``--only_own_model`` alone) runs docs/own-model.md's
path on one device, a recorded step each: the verifier (``--verifier``; if it does not load, the random Llama built
here stands in, recorded), replies from ``--server`` or our loop, the fit check of ``configs/eagle3_llama31_8b.yaml``,
its drafter trained ``--own_seconds`` (on CUDA the peak against the estimate), τ and identity in our loop, and the
``eagle3`` / ``speculators`` exports read back; a step whose input is missing is recorded as not run, with why:

    python benchmarks/gpu_train_check.py --only_own_model --verifier bundled:smollm2 [--server URL] [--prompts FILE]
    python benchmarks/gpu_train_check.py --only_own_model --small --device cpu --steps 2 --verifier DIR  # tested in CI

Prints a table per stage; the last stdout line is the JSON path; exits 1 when any run or step that ran failed.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
import traceback
from pathlib import Path
from typing import NamedTuple

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

    from spectrain.data.bundled import bundled_text_path, train_tokenizer
    from spectrain.data.text import split_text

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

    from spectrain.data.bundled import bundled_text_path
    from spectrain.data.text import split_text, tokenize_lines

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


CHECK_SETTINGS = {"lr": 1e-3, "warmup_steps": 20, "measure_prompts": 4, "measure_new_tokens": 32}


def read_recipe(recipe: str) -> dict:
    """The bundled recipe file ``recipe`` (a name in ``spectrain.configs``), parsed."""
    from importlib.resources import files

    import yaml

    return yaml.safe_load(files("spectrain.configs").joinpath(recipe).read_text())


def module_args(recipe: str, verifier: str | Path, strategy: str = "auto",
                settings: dict = CHECK_SETTINGS) -> tuple[type, dict]:
    """(the recipe's LightningModule class, its ``init_args``) with ``verifier`` and ``settings`` over them, and the
    verifier's device as the CLIs set it (FSDP shards from the host)."""
    from spectrain.heads.families import resolve_class_path

    model = read_recipe(recipe)["model"]
    init_args = {**model.get("init_args", {}), **settings, "verifier": str(verifier),
                 "verifier_device": "cpu" if "fsdp" in strategy else "auto"}
    return resolve_class_path(model["class_path"]), init_args


def build_module(recipe: str, verifier_dir: Path, size: str, strategy: str = "auto"):
    """The recipe's LightningModule for the verifier built here: its ``init_args``, with this check's verifier,
    learning-rate warm-up and measured-τ settings over them (a fixed draft vocabulary: a quarter of the verifier's)."""
    module_class, init_args = module_args(recipe, verifier_dir, strategy)
    if "draft_vocab_size" in init_args:  # the recipe's default is sized for a real vocabulary
        init_args["draft_vocab_size"] = SIZES[size][5] // 4
    return module_class(**init_args)


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
    cuda = args.device.startswith("cuda") and torch.cuda.is_available()
    return next((v for k, v in PEAK_BF16_TFLOPS.items() if k in torch.cuda.get_device_name()), None) if cuda else None


# --------------------------------------------------------------------------- the own-model stage (docs/own-model.md)


class OwnSize(NamedTuple):
    """The own-model stage's sizes: prompts distilled, training block and batch, evaluation prompts, reply and
    evaluation lengths, prompts per batch of our distillation loop."""

    prompts: int
    block: int
    batch: int
    eval_prompts: int
    new_tokens: int
    eval_new_tokens: int
    distill_batch: int


OWN_RECIPE = "eagle3_llama31_8b.yaml"  # docs/own-model.md's $RECIPE
OWN_SIZES = {"full": OwnSize(256, 2048, 1, 8, 256, 128, 64), "small": OwnSize(8, 64, 2, 4, 16, 16, 8)}
OWN_SETTINGS = {"measure_prompts": 2, "measure_new_tokens": 16}  # over the recipe's init_args (validation is off)
OWN_CHAIN = 4  # drafts per round in the evaluation
REPLY_TEMPERATURE = 0.8  # docs/own-model.md's distillation command


class NotRun(Exception):
    """A step with nothing to do: recorded as ``"ran": False`` with this message as its ``why``."""


def own_device(args) -> tuple[torch.dtype, str]:
    """(the verifier's dtype, the Lightning precision) of the stage: bf16 / bf16-mixed on CUDA, fp32 on CPU."""
    return (torch.bfloat16, "bf16-mixed") if args.device.startswith("cuda") else (torch.float32, "32-true")


def verifier_record(verifier) -> dict:
    """What the JSON says of a loaded verifier: its parameters, vocabulary, dtype, device and chat template."""
    param = next(verifier.model.parameters())
    return {"verifier_used": verifier.name, "parameters": sum(p.numel() for p in verifier.model.parameters()),
            "vocab": verifier.model.get_output_embeddings().weight.shape[0], "dtype": str(param.dtype),
            "device": str(param.device), "chat_template": bool(getattr(verifier.tokenizer, "chat_template", None))}


def own_verifier(args, state: dict) -> dict:
    """Step 1: ``--verifier`` loaded (into ``state["verifier"]``); returns its record."""
    from spectrain.heads.verifier import load_verifier

    state["verifier"] = load_verifier(args.verifier, device=args.device, dtype=own_device(args)[0])
    return verifier_record(state["verifier"])


def own_fallback_verifier(args, state: dict) -> dict:
    """Step 1b, only when ``--verifier`` did not load: the random-weight Llama of :func:`build_verifier` (its
    tokenizer has a ChatML template) saved and loaded into ``state["verifier"]``; returns its record."""
    from spectrain.heads.verifier import load_verifier

    if "verifier" in state:
        raise NotRun(f"not needed: {args.verifier} loaded")
    directory = build_verifier(state["out"] / "verifier", args.size)
    state["verifier"] = load_verifier(str(directory), device=args.device, dtype=own_device(args)[0])
    return {**verifier_record(state["verifier"]), "built": f"random-weight GQA Llama (this script's {args.size} shape)"}


def shakespeare_prompts(n: int) -> list[dict]:
    """``n`` deterministic prompts ``{"turns": ["Continue this speech: " + line]}`` from evenly spaced lines of the
    bundled tinyshakespeare text (speech lines only: no speaker names, none shorter than 30 characters)."""
    from spectrain.data.bundled import bundled_text_path

    lines = [line.strip() for line in bundled_text_path().read_text().splitlines()]
    lines = [line for line in lines if len(line) >= 30 and not line.endswith(":")]
    step = max(1, len(lines) // n)
    return [{"turns": ["Continue this speech: " + line]} for line in lines[::step][:n]]


def own_prompt_records(args, n: int) -> list[dict]:
    """The stage's prompts: the first ``n`` records of ``--prompts`` (a chat file), else :func:`shakespeare_prompts`."""
    from spectrain.data.chat import load_records

    records = load_records(args.prompts)[:n] if args.prompts else shakespeare_prompts(n)
    if not records:
        raise SpectrainError(f"no prompts in {args.prompts}")
    return records


def distill_settings(args, verifier_name: str, size: OwnSize) -> dict:
    """The settings ``spectrain-distill`` records for these replies (as its ``run`` builds them)."""
    return {"verifier": verifier_name, "data": [Path(args.prompts).name if args.prompts else "tinyshakespeare"],
            "limit": [size.prompts], "max_turns": 1, "max_new_tokens": size.new_tokens,
            "temperature": REPLY_TEMPERATURE, "seed": 0}


def served_replies(args, records: list[dict], settings: dict, out: Path) -> dict:
    """The replies from ``--server`` (:func:`spectrain.data.distill.run_served`: the served-verifier check, then the
    engine's replies); returns the counts and the check."""
    from spectrain.data import distill

    dtype = str(own_device(args)[0]).removeprefix("torch.")
    served_args = distill.parse_args(["--server", args.server, "--verifier", settings["verifier"], "--out", str(out),
                                      "--device", args.device, "--dtype", dtype])
    counts, _, served = distill.run_served(served_args, records, settings, out)
    return {**counts, "verifier_check": served["verifier_check"]}


def own_replies(args, state: dict) -> dict:
    """Step 2: self-distilled replies to the prompts, from ``--server`` or our batched loop, into
    ``state["replies"]`` (the JSONL) and ``state["records"]`` (the prompts); returns engine, tokens/s and counts."""
    from spectrain.data.chat import load_records, to_messages
    from spectrain.data.distill import distill

    size, verifier = OWN_SIZES[args.size], state["verifier"]
    state["records"] = records = own_prompt_records(args, size.prompts)
    settings = distill_settings(args, verifier.name, size)
    out = state["out"] / "replies.jsonl"
    for old in (out, out.with_name(out.name + ".meta.json")):  # each check distills anew
        old.unlink(missing_ok=True)
    note = {}
    if args.server and verifier.name != args.verifier:
        note = {"server_not_used": f"{args.server} serves {args.verifier}, which did not load here: the stand-in "
                                   "answers in our loop"}
    t0 = time.perf_counter()
    if args.server and not note:
        engine, counts = args.server, served_replies(args, records, settings, out)
    else:
        engine, counts = "our loop", distill(verifier, records, out, settings, size.distill_batch)
    seconds = time.perf_counter() - t0  # the counts' own seconds are rounded to 0.1
    written = load_records(str(out))
    rows, kept = len(written), sum(to_messages(row) is not None for row in written)
    if not kept:
        raise SpectrainError(f"no reply kept in {out} ({rows} rows: {counts.get('loops_dropped')} stopped by loops)")
    state["replies"] = out
    return {"engine": engine, **note, "prompts": len(records), "replies_written": kept, "rows": rows,
            "generated_tokens": counts["generated_tokens"], "loops_dropped": counts["loops_dropped"],
            "generation_seconds": seconds, "tokens_per_second": counts["generated_tokens"] / seconds,
            "temperature": REPLY_TEMPERATURE, "max_new_tokens": size.new_tokens, "path": str(out.resolve()),
            **({"verifier_check": counts["verifier_check"]} if "verifier_check" in counts else {})}


def own_module_args(args, verifier) -> tuple[type, dict]:
    """(module class, ``init_args``) of :data:`OWN_RECIPE` for ``verifier``: the recipe's arguments with the verifier,
    its dtype, small measured-τ settings and a draft vocabulary that fits (the recipe's when smaller than the
    verifier's vocabulary, else a quarter of it)."""
    module_class, init_args = module_args(OWN_RECIPE, verifier.name, settings=OWN_SETTINGS)
    init_args["verifier_dtype"] = str(own_device(args)[0]).removeprefix("torch.")
    if init_args.get("draft_vocab_size"):
        vocab = verifier.model.get_output_embeddings().weight.shape[0]
        if init_args["draft_vocab_size"] >= vocab:
            init_args["draft_vocab_size"] = vocab // 4
    return module_class, init_args


def own_fit_check(args, state: dict) -> dict:
    """Step 3: the recipe's fit estimate (``train/fit.py``) for the verifier used, at this stage's block and batch,
    against the whole device memory on CUDA; into ``state["estimate"]``; returns its figures."""
    from spectrain.heads.verifier_shapes import meta_verifier, verifier_config
    from spectrain.train.fit import GIB, Recipe, estimate

    size, (dtype, precision) = OWN_SIZES[args.size], own_device(args)
    module_class, init_args = own_module_args(args, state["verifier"])
    config, source = verifier_config(state["verifier"].name)
    recipe = Recipe(module=module_class, init_args=init_args, verifier_dtype=dtype, precision=precision,
                    batch_size=size.batch, block_size=size.block, accumulation=1, devices=1, data_path=None)
    verifier = meta_verifier(config)
    with torch.device("meta"):
        drafter = module_class.fit_drafter(init_args, verifier)
    memory = torch.cuda.get_device_properties(args.device).total_memory if args.device.startswith("cuda") else None
    state["estimate"] = figures = estimate(recipe, config, verifier, drafter, memory)
    return {"recipe": OWN_RECIPE, "verifier_config": source, "precision": precision,
            "device_memory_bytes": memory, "estimate_total_gib": round(figures["total_bytes"] / GIB, 3), **figures}


def padded_row(row: dict, block: int, pad_id: int) -> dict:
    """A rendered chat row as (``block``,) tensors: right-padded, pads attended 0 and never a target."""
    n = len(row["input_ids"])
    input_ids = torch.full((block,), pad_id, dtype=torch.long)
    input_ids[:n] = torch.tensor(row["input_ids"])
    attention, loss_mask = torch.zeros(block, dtype=torch.long), torch.zeros(block, dtype=torch.long)
    attention[:n], loss_mask[:n] = 1, torch.tensor(row["loss_mask"])
    return {"input_ids": input_ids, "attention_mask": attention, "loss_mask": loss_mask}


def chat_rows(path: Path, tokenizer, block: int) -> list[dict]:
    """The replies rendered as training renders them (``render_chat``: assistant tokens the targets), each padded
    to ``block`` tokens (every batch is as wide as the fit check's); rows without a target are left out."""
    from spectrain.data.chat import load_records, render_chat, to_messages

    rows = []
    for record in load_records(str(path)):
        messages = to_messages(record)
        if messages is not None:
            row = render_chat(messages, tokenizer, block)
            if sum(row["loss_mask"]):
                rows.append(padded_row(row, block, tokenizer.pad_token_id))
    return rows


def release_verifier(state: dict) -> None:
    """Drop the stage's loaded verifier (the module loads its own): training's peak sees one verifier only."""
    import gc

    state.pop("verifier", None)
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def peak_record(args, estimate: dict | None) -> dict:
    """The measured CUDA peak of the fit against the fit check's estimate (ratio; the goal: within 20 %), or why
    there is none."""
    if not args.device.startswith("cuda"):
        return {"cuda_peak": None, "why": "trained on the CPU: no CUDA allocator to measure"}
    peak = torch.cuda.max_memory_allocated()
    record = {"cuda_peak": peak, "cuda_peak_gib": round(peak / 2 ** 30, 3)}
    if estimate is None:
        return {**record, "peak_over_estimate": None, "why": "no fit estimate to compare (the fit check failed)"}
    ratio = peak / estimate["total_bytes"]
    return {**record, "peak_over_estimate": ratio, "within_20_percent": abs(ratio - 1) <= 0.2}


def own_train(args, state: dict) -> dict:
    """Step 4: the recipe's module trained on the rendered replies with a plain ``lightning.Trainer`` for
    ``--own_seconds`` (``--steps`` at most under ``--small``); into ``state["module"]``; returns steps, tokens/s,
    loss and the CUDA peak against the estimate."""
    import lightning as L

    size, (_, precision) = OWN_SIZES[args.size], own_device(args)
    device = torch.device(args.device)
    module_class, init_args = own_module_args(args, state["verifier"])
    release_verifier(state)
    module = module_class(**init_args)
    rows = chat_rows(state["replies"], module.tokenizer, size.block)
    if len(rows) < size.batch:
        raise SpectrainError(f"{len(rows)} trainable rows in {state['replies']}: fewer than one batch of {size.batch}")
    recipe_trainer = read_recipe(OWN_RECIPE).get("trainer", {})
    max_steps = args.steps if args.size == "small" else int(recipe_trainer.get("max_steps") or 10000)
    trainer = L.Trainer(accelerator="gpu" if device.type == "cuda" else "cpu", devices=1, precision=precision,
                        max_steps=max_steps, max_time={"seconds": args.own_seconds}, limit_val_batches=0,
                        gradient_clip_val=recipe_trainer.get("gradient_clip_val", 0.5), logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        num_sanity_val_steps=0)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    trainer.fit(module, datamodule=blocks_module((rows, rows), size.batch, device))
    wall = time.perf_counter() - t0
    loss = trainer.callback_metrics.get("train/loss")
    if not trainer.global_step or loss is None or not math.isfinite(float(loss)):
        raise SpectrainError(f"{trainer.global_step} steps trained, loss {loss}")
    state["module"] = module
    return {"recipe": OWN_RECIPE, "precision": precision, "rows": len(rows), "block_size": size.block,
            "batch_size": size.batch, "draft_vocab_size": init_args.get("draft_vocab_size"),
            "steps": trainer.global_step, "max_steps": max_steps, "own_seconds": args.own_seconds,
            "trained_tokens": module.trained_tokens, "train_seconds": module.train_seconds, "wall_seconds": wall,
            "tokens_per_second": module.trained_tokens / max(module.train_seconds, 1e-9), "final_loss": float(loss),
            **peak_record(args, state.get("estimate"))}


def own_evaluate(args, state: dict) -> dict:
    """Step 5: the trained drafter in our lossless loop (chain of :data:`OWN_CHAIN`, T = 0) on the first prompts;
    returns τ, α and whether every output equals plain greedy decoding (else: every parting a measured near-tie)."""
    from spectrain.data.distill_rows import prompts_of
    from spectrain.eval.evaluate import EvalSettings, evaluate_drafter
    from spectrain.heads.verifier import Verifier

    size, module = OWN_SIZES[args.size], state["module"]
    param = module.verifier_lm_head.weight  # the drafter decodes on the verifier's device and dtype
    drafter = module.plain_drafter().to(param.device, param.dtype).eval()
    verifier = Verifier(model=module.verifier, tokenizer=module.tokenizer, name=module.verifier_name)
    prompts = [turns for turns in (prompts_of(r, 1)[1] for r in state["records"][:size.eval_prompts]) if turns]
    result = evaluate_drafter(verifier, prompts, drafter, EvalSettings(
        k=OWN_CHAIN, max_new_tokens=size.eval_new_tokens, temperature=0.0, hf_generate=0, costs=False))
    chain = result.results[f"chain-{OWN_CHAIN}"]
    parted = chain.get("divergences") or {}
    record = {"method": result.method, "prompts": len(prompts), "k": OWN_CHAIN, "tau": chain["tau"],
              "alpha": chain.get("alpha"), "identical_to_greedy": chain["identical_to_ar"],
              "identical_turns": chain["identical_turns"], "diverged": parted.get("diverged", 0),
              "near_ties": parted.get("near_ties", 0), "speedup": chain["speedup"], "decoder": result.decoder,
              "dtype": result.dtype, "eval_seconds": result.eval_seconds}
    if not chain["tau"] >= 1 or record["diverged"] > record["near_ties"]:
        raise SpectrainError(f"lossless loop: tau {chain['tau']}, {record['diverged']} turns part from greedy "
                             f"({record['near_ties']} near-ties)")
    return record


def own_export(args, state: dict) -> dict:
    """Step 6: the trained drafter exported to vLLM's ``eagle3`` and the ``speculators`` layouts (validated against
    each loader as written) in ``export/<layout>``, each re-read (format detection, then every tensor compared);
    returns files and sizes per layout."""
    from spectrain.heads.serving.formats import detect_format, export_drafter, import_drafter
    from spectrain.heads.verifier import verifier_identity

    module = state["module"]
    drafter = module.plain_drafter().float().cpu()
    signature = verifier_identity(module.verifier, module.tokenizer)
    layouts = {}
    for fmt in ("eagle3", "speculators"):
        out = export_drafter(drafter, fmt, state["out"] / "export" / fmt, verifier_name=module.verifier_name,
                             force=True, verifier_signature=signature)
        back = import_drafter(out, verifier_model=module.verifier)  # its format detected, as a user loads it
        mismatched = [k for k, v in drafter.state_dict().items()
                      if not torch.equal(back.state_dict()[k].to(v.dtype).cpu(), v)]
        if mismatched:
            raise SpectrainError(f"{fmt} export read back differs in {mismatched[:5]}")
        layouts[fmt] = {"path": str(out.resolve()), "detected_format": detect_format(out),
                        "files": {p.name: p.stat().st_size for p in sorted(out.iterdir()) if p.is_file()},
                        "tensors_read_back_equal": True}
    return {"layouts": layouts}


OWN_STEPS = (("verifier", own_verifier, ()), ("fallback verifier", own_fallback_verifier, ()),
             ("replies", own_replies, ("verifier",)), ("fit check", own_fit_check, ("verifier",)),
             ("train", own_train, ("verifier", "replies")), ("evaluate", own_evaluate, ("module", "records")),
             ("export", own_export, ("module",)))
PROVIDED_BY = {"verifier": ("verifier", "fallback verifier"), "replies": ("replies",), "records": ("replies",),
               "module": ("train",)}


def why_not_run(key: str, records: list[dict]) -> str:
    """Why a step that needs ``key`` did not run: what became of the steps that provide it."""
    fates = [f"{r['step']} {'failed' if r.get('ran') else 'did not run'}" for r in records
             if r["step"] in PROVIDED_BY[key]]
    return f"needs the {key} of {' or '.join(PROVIDED_BY[key])}: {', '.join(fates)}"


def run_step(name: str, fn, args, state: dict) -> dict:
    """One step run and recorded: ``{"step", "ran", "ok", "seconds", ...its details}``, ``"error"`` and
    ``"traceback"`` when it raised, ``"ran": False`` and ``"why"`` when it had nothing to do."""
    t0 = time.perf_counter()
    try:
        details = fn(args, state)
    except NotRun as e:
        return {"step": name, "ran": False, "why": str(e)}
    except Exception as e:  # noqa: BLE001 - every step is reported; the exit code says whether all passed
        return {"step": name, "ran": True, "ok": False, "seconds": time.perf_counter() - t0,
                "error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-4000:]}
    return {"step": name, "ran": True, "ok": True, "seconds": time.perf_counter() - t0, **details}


def own_model_stage(args, out: Path) -> dict:
    """The own-model path of docs/own-model.md on one device, step by step (:data:`OWN_STEPS`; a step whose inputs
    are missing is recorded as not run, with why); returns the stage's record for the JSON."""
    out.mkdir(parents=True, exist_ok=True)
    state, records = {"out": out}, []
    for name, fn, needs in OWN_STEPS:
        missing = [key for key in needs if key not in state]
        record = ({"step": name, "ran": False, "why": why_not_run(missing[0], records)} if missing
                  else run_step(name, fn, args, state))
        records.append(record)
        outcome = ("ok" if record["ok"] else record["error"]) if record["ran"] else f"not run ({record['why']})"
        print(f"gpu_train_check: own model, {name}: {outcome}", flush=True)
    used = next((r["verifier_used"] for r in records if r.get("ok") and "verifier_used" in r), None)
    return {"verifier": args.verifier, "verifier_used": used, "recipe": OWN_RECIPE, "server": args.server,
            "prompts": args.prompts or "tinyshakespeare (built in)", "sizes": OWN_SIZES[args.size]._asdict(),
            "steps": records, "passed": all(r["ok"] for r in records if r["ran"])}


def step_detail(r: dict) -> str:
    """A step's table cell: its outcome in a few words."""
    if not r["ran"]:
        return r["why"]
    if not r["ok"]:
        return r["error"][:120]
    details = {
        "verifier": lambda: f"{r['verifier_used']} ({r['parameters']:,} parameters, {r['dtype']})",
        "fallback verifier": lambda: f"{r['verifier_used']} ({r['parameters']:,} parameters, {r['dtype']})",
        "replies": lambda: f"{r['replies_written']} replies, {r['tokens_per_second']:.1f} tokens/s ({r['engine']})",
        "fit check": lambda: f"estimate {r['estimate_total_gib']} GiB per device (block {r['block_size']})",
        "train": lambda: f"{r['steps']} steps, {r['tokens_per_second']:.0f} tokens/s, loss {r['final_loss']:.3f}, "
                         + ("no CUDA peak" if r["cuda_peak"] is None else f"peak {r['cuda_peak_gib']} GiB"
                            + ("" if r.get("peak_over_estimate") is None
                               else f" = {r['peak_over_estimate']:.2f} x estimate")),
        "evaluate": lambda: f"tau {r['tau']:.3f}, " + ("equals greedy" if r["identical_to_greedy"]
                                                        else f"{r['diverged']} near-tie partings"),
        "export": lambda: ", ".join(f"{fmt} ({len(v['files'])} files, {sum(v['files'].values()) / 2 ** 20:.2f} MiB)"
                                    for fmt, v in r["layouts"].items()),
    }
    return details[r["step"]]()


def own_table(own: dict, device_name: str) -> str:
    """The own-model stage's table: every step, whether it ran, its outcome."""
    rows = [[r["step"], r["ran"], r.get("ok", "-"), f"{r['seconds']:.1f}" if "seconds" in r else "-", step_detail(r)]
            for r in own["steps"]]
    return format_table(["step", "ran", "ok", "seconds", "detail"], rows,
                        title=f"own model on {device_name}: {own['verifier']} -> {own['verifier_used']}, "
                              f"{own['recipe']}")


def recipe_runs(args, out: Path) -> list[dict]:
    """Every bundled recipe trained on the verifier built here (and ``--fsdp_recipe`` under FSDP on CUDA); one record
    per run (its figures, or its error)."""
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
    return results


def recipe_table(results: list[dict], device_name: str, size: str) -> str:
    """The recipe runs' table: steps, tokens/s, FLOPs, MFU and τ per run."""
    return format_table(
        ["run", "strategy", "ok", "steps", "tokens/s", "GFLOP/token", "TFLOP/s", "MFU", "tau_pred", "tau measured"],
        [[r["method"], r["strategy"], r["ok"], r.get("steps", "-"), round(r.get("tokens_per_second", 0), 1),
          round(r.get("flops_per_token", 0) / 1e9, 3), round(r.get("tflops", 0), 2),
          "-" if r.get("mfu") is None else f"{100 * r['mfu']:.1f}%",
          "-" if r.get("tau_pred") is None else round(r["tau_pred"], 3),
          "-" if r.get("tau_measured") is None else round(r["tau_measured"], 3)] for r in results],
        title=f"bf16-mixed training on {device_name} ({size} verifier)")


def failed_tracebacks(results: list[dict], own: dict | None) -> list[str]:
    """The tracebacks of the recipe runs and own-model steps that ran and failed."""
    steps = own["steps"] if own else []
    return [r["traceback"] for r in results + steps if r.get("ran", True) and not r["ok"]]


def check(args) -> Path:
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        raise SpectrainError("--device cuda, but CUDA is not available here (use --small --device cpu to try the path)")
    out = Path(args.out)
    results = [] if args.only_own_model else recipe_runs(args, out)
    own = own_model_stage(args, out / "own_model") if args.own_model or args.only_own_model else None
    device_name = torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu"
    summary = {"command": "python benchmarks/gpu_train_check.py " + " ".join(sys.argv[1:]), "device": device_name,
               "torch": torch.__version__, "size": args.size, "shape": dict(zip(
                   ("hidden", "layers", "heads", "kv_heads", "intermediate", "vocab", "block", "batch"),
                   SIZES[args.size])), "peak_bf16_tflops": peak_tflops(args), "runs": results, "own_model": own,
               "passed": all(r["ok"] for r in results) and (own is None or own["passed"])}
    tables = ([recipe_table(results, device_name, args.size)] if results else []) + \
        ([own_table(own, device_name)] if own else [])
    path = finish(summary, out / "gpu_train_check.json", tables=tables)
    if not summary["passed"]:
        for text in failed_tracebacks(results, own):
            print(text, file=sys.stderr)
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
    o = p.add_argument_group("the own-model stage (docs/own-model.md on one device)")
    o.add_argument("--own_model", action="store_true", help="after the recipe runs, run the own-model stage")
    o.add_argument("--only_own_model", action="store_true", help="run the own-model stage alone")
    o.add_argument("--verifier", default="bundled:smollm2",
                   help="the verifier (a hub id, a directory or bundled:NAME); if it does not load, the failure is "
                        "recorded and the random-weight Llama built here stands in")
    o.add_argument("--server", default=None, metavar="URL",
                   help="an OpenAI-compatible endpoint serving --verifier, to write the replies (default: our loop)")
    o.add_argument("--prompts", default=None, help="a chat file of prompts (default: lines of tinyshakespeare)")
    o.add_argument("--own_seconds", type=float, default=120.0, help="training time of the stage (--small: also "
                   "at most --steps steps)")
    return p.parse_args(argv)


def main(argv=None) -> None:
    run_command(check, parse_args(argv))


if __name__ == "__main__":
    main()
