"""Training throughput on SmolLM2-135M shapes: today's fp32 path vs the new default, measured in one run.

    python benchmarks/train_throughput.py [--json PATH] [--steps 3] [--baseline REV]

A random-weight verifier shaped like SmolLM2-135M-Instruct (hidden 576, 30 layers, 9/3 heads, vocabulary
49,152, tied embeddings) trains every registered drafter method that has a SmolLM2 recipe
(``configs/<method>_smollm2.yaml``) in both trees (``--methods``: some of them), each through its family's
training module (its recipe's ``model.class_path``) with each side's recipe, batch 4 x 512, online (text blocks
through the verifier) and from a hidden-state store (variable-length rows of 64-512 tokens, as chat data is, holding
the verifier layers any of the drafters reads), through Lightning's real ``Trainer.fit`` (precision plugin,
clipping, fused AdamW). ``spectrain-extract``'s ``extract()`` is timed on the same rows. "old" is the library at
``--baseline`` (checked out of git into a temporary directory), "new" is this working tree; each side runs in its
own subprocess, one after the other.

Reported per row: real (unpadded) tokens/s, the FLOP per token of what a step computes (verifier forward, greedy
projection when computed, drafter forward + backward, loss projections incl. recompute: every matmul and
attention, counted by torch's FLOP counter on one untimed step before the warm-up), the achieved GFLOP/s, and
that as a fraction of this machine's matmul peak in the row's precision, measured in the same run. Not a test: it
prints a table, writes JSON, and its last stdout line is the JSON's path.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DEFAULT_BASELINE = "d113343"  # the last commit before bf16 training / packed stores / training vocabularies
SMOLLM2 = dict(hidden=576, layers=30, heads=9, kv_heads=3, intermediate=1536, vocab=49152)
WORDS = ("the a cat dog sat on mat ran fast slow river hill tree bird sings quietly under over green blue house what "
         "is where why how king queen lord speak thou thee thy good night day love").split()


# ----------------------------------------------------------------------------------------------- setup (parent)
def zipf_ids(n: int, generator, vocab: int = SMOLLM2["vocab"]) -> list[int]:
    """Token ids with a Zipf-like frequency (rank r ~ 1/(r+10)^1.1), as real text has: a few thousand tokens
    carry most of the mass, which is what training and draft vocabularies rely on."""
    import torch

    weights = 1.0 / (torch.arange(vocab - 3, dtype=torch.float64) + 10) ** 1.1
    return (torch.multinomial(weights, n, replacement=True, generator=generator) + 3).tolist()


def build_workdir(work: Path, args) -> dict:
    """Random SmolLM2-shaped verifier + tokenizer, a text corpus, Zipf-distributed token rows: fixed 512-token
    blocks (online) and variable-length rows (the store)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from spectrain.data.bundled import train_tokenizer

    rng = random.Random(0)
    text = "\n".join(" ".join(rng.choice(WORDS) for _ in range(rng.randint(5, 15))) + "." for _ in range(6000)) + "\n"
    (work / "corpus.txt").write_text(text)
    tokenizer = train_tokenizer(text[:200_000], vocab_size=400)
    s = SMOLLM2
    config = LlamaConfig(vocab_size=s["vocab"], hidden_size=s["hidden"], intermediate_size=s["intermediate"],
                         num_hidden_layers=args.layers, num_attention_heads=s["heads"], num_key_value_heads=s["kv_heads"],
                         max_position_embeddings=2048, rope_theta=100000.0, tie_word_embeddings=True,
                         rms_norm_eps=1e-5)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    with torch.no_grad():  # random weights would predict uniformly over 49K ids; real models predict frequent
        model.get_output_embeddings().weight[3:3 + 8192].mul_(4.0)  # tokens, which vocabularies of 8K cover
    model.save_pretrained(work / "verifier")
    tokenizer.save_pretrained(work / "verifier")
    g = torch.Generator().manual_seed(1)
    # Real chat rows average ~290 tokens (64-512 here): the padded store layout computed on ~40% padding.
    rows = []
    for _ in range(args.store_rows):
        n = int(torch.randint(64, args.block_size + 1, (1,), generator=g))
        rows.append({"input_ids": zipf_ids(n, g), "loss_mask": [1] * n})
    (work / "rows.json").write_text(json.dumps(rows))
    blocks = [{"input_ids": zipf_ids(args.block_size, g), "loss_mask": [1] * args.block_size}
              for _ in range(args.batch_size * (args.warmup + args.steps + 3))]
    (work / "blocks.json").write_text(json.dumps(blocks))
    return {"store_rows": len(rows), "store_tokens": sum(len(r["input_ids"]) for r in rows), "online_blocks": len(blocks)}


def baseline_tree(rev: str, work: Path) -> Path:
    """The library at git revision ``rev`` as an importable ``spectrain`` package under ``work/old``, with this
    tree's ``train/throughput.py`` copied in: both sides count FLOPs with the same counter."""
    from spectrain.train import throughput

    root = work / "old"
    src = work / "old-src"
    src.mkdir(parents=True, exist_ok=True)
    archive = subprocess.run(["git", "-C", str(REPO), "archive", rev], capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", str(src)], input=archive, check=True)
    shutil.copy(throughput.__file__, src / "train" / "throughput.py")
    (root / "spectrain").mkdir(parents=True, exist_ok=True)
    for part in ("heads", "data", "train", "eval", "configs"):
        (root / "spectrain" / part).symlink_to(src / part)
    return root


def matmul_peak(dtype_name: str, repeats: int = 5) -> float:
    """GFLOP/s of the vocabulary-projection shape (2048 x 576 @ 576 x 49152) in ``dtype_name`` on this machine."""
    import torch

    dtype = getattr(torch, dtype_name)
    a, b = torch.randn(2048, 576, dtype=dtype), torch.randn(49152, 576, dtype=dtype)
    for _ in range(2):
        a @ b.T
    t0 = time.perf_counter()
    for _ in range(repeats):
        a @ b.T
    return 2 * 2048 * 576 * 49152 * repeats / (time.perf_counter() - t0) / 1e9


# ----------------------------------------------------------------------------------------------- worker (one side)
def store_layers(drafters: dict, verifier_dir: str) -> tuple[int, ...]:
    """The verifier layers the store holds: every layer any timed drafter reads (its module's
    ``feature_layer_ids``), each module built once on the verifier to ask it."""
    layers: set[int] = set()
    for module_class, recipe in drafters.values():
        layers.update(module_class(verifier=verifier_dir, **recipe).feature_layer_ids())
    return tuple(sorted(layers))


def loss_rows(module) -> int:
    """Vocabulary rows a module's loss projects onto: its training vocabulary, else its drafter's own draft
    vocabulary, else the verifier's whole vocabulary."""
    train_rows = getattr(module, "train_rows", None)
    if train_rows is not None:
        return train_rows.shape[0]
    return getattr(module.drafter.config, "draft_vocab_size", None) or SMOLLM2["vocab"]


def worker(side: str, work: Path, args) -> dict:
    """Runs in a subprocess whose ``spectrain`` is the side's code; returns its measurements."""
    import importlib

    import lightning as L
    import torch
    import yaml
    from datasets import Dataset

    import spectrain.train.base as base
    from spectrain.data.datamodule import DrafterDataModule
    from spectrain.data.store import extract
    from spectrain.heads.verifier import load_verifier
    from spectrain.train.throughput import flop_counter  # in the old tree too: baseline_tree copies it there

    torch.set_num_threads(args.threads)
    code = Path(base.__file__).resolve().parents[1]
    if side == "old":
        assert str(code).startswith(str(work)), f"old side imported {code}"
        precision = "32-true"  # today's CPU default
    else:
        from spectrain.heads.precision import training_precision

        precision = training_precision(None, "cpu")
    verifier_dir = str(work / "verifier")
    rows = json.loads((work / "rows.json").read_text())
    blocks = json.loads((work / "blocks.json").read_text())
    n_val = max(args.batch_size, len(rows) // 8)
    out = {"side": side, "code": str(code), "precision": precision, "rows": {}}
    configs = code / "configs"
    drafters = {}  # method -> (its training module, its recipe's init args), this side's
    for method, dotted in json.loads((work / "methods.json").read_text()).items():
        module_path, _, class_name = dotted.partition(":")
        model = yaml.safe_load((configs / f"{method}_smollm2.yaml").read_text())["model"]
        recipe = dict(model.get("init_args", model))  # recipes name their class since 2026-12-01
        recipe.pop("verifier", None)
        drafters[method] = getattr(importlib.import_module(module_path), class_name), recipe
    layers = store_layers(drafters, verifier_dir)

    # -- extraction: the verifier in the side's default dtype, store rows as written by each side
    verifier = load_verifier(verifier_dir)
    store = work / f"store-{side}"
    t0 = time.perf_counter()
    extract(verifier, rows[n_val:], store / "train", layers, "bench", rows_per_shard=16, log=lambda *_: None)
    seconds = time.perf_counter() - t0
    tokens = sum(len(r["input_ids"]) for r in rows[n_val:])
    extract(verifier, rows[:n_val], store / "validation", layers, "bench", rows_per_shard=16, log=lambda *_: None)
    out["extract"] = {"tokens": tokens, "seconds": seconds, "tokens_per_second": tokens / seconds,
                      "verifier_dtype": str(next(verifier.model.parameters()).dtype).replace("torch.", "")}
    del verifier

    class Clock(L.Callback):
        """Times every step but the first, whose FLOPs it counts instead (the counter slows the step it counts)."""

        def __init__(self):
            self.steps, self.counted = [], None  # counted: (FLOP, tokens) of the first step

        def on_train_batch_start(self, trainer, module, batch, batch_idx):
            self.tokens = int(batch["attention_mask"].sum())
            if self.counted is None:
                self.counter = flop_counter()
                self.counter.__enter__()
            self.t0 = time.perf_counter()

        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            seconds = time.perf_counter() - self.t0
            if self.counted is None:
                self.counter.__exit__(None, None, None)
                self.counted = (self.counter.get_total_flops(), self.tokens)
            else:
                self.steps.append((seconds, self.tokens))
            dropped = trainer.callback_metrics.get("train/dropped_frac")
            self.dropped = None if dropped is None else float(dropped)

    for method, (module_class, recipe) in drafters.items():
        for source in ("online", "store"):
            torch.manual_seed(0)
            module = module_class(verifier=verifier_dir, **recipe)
            path = str(work / "corpus.txt") if source == "online" else str(store)
            data = DrafterDataModule(path=path, tokenizer=verifier_dir, block_size=args.block_size,
                                     batch_size=args.batch_size)
            if source == "online":  # token blocks as they are (a setup() finding train_set set keeps it)
                data.train_set, data.val_set = Dataset.from_list(blocks[args.batch_size:]), Dataset.from_list(blocks[:args.batch_size])
            decisions = []
            if side == "new":  # the loss's own recompute-or-keep decisions, as made in the steps
                decide = module.recompute_loss
                module.recompute_loss = lambda rows, vocab: decisions.append(decide(rows, vocab)) or decisions[-1]
            clock = Clock()
            trainer = L.Trainer(max_steps=1 + args.warmup + args.steps, precision=precision, gradient_clip_val=1.0,
                                accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                                enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
                                num_sanity_val_steps=0, use_distributed_sampler=False, callbacks=[clock])
            trainer.fit(module, datamodule=data)
            timed = clock.steps[args.warmup:]  # the counted step is not among them
            seconds, tokens = sum(s for s, _ in timed), sum(t for _, t in timed)
            settings = {"vocab_rows": loss_rows(module), "recompute": True, "greedy": True}
            if side == "new":
                settings.update(recompute=any(decisions),
                                greedy=module.needs_greedy(training=True) and source == "online",
                                dropped_frac=getattr(clock, "dropped", None))
            counted_flop, counted_tokens = clock.counted
            out["rows"][f"{method}/{source}"] = {
                "tokens_per_second": tokens / seconds, "step_seconds": seconds / len(timed),
                "tokens_per_step": tokens / len(timed), "settings": settings,
                "mean_row_length": tokens / len(timed) / args.batch_size, "recipe": recipe,
                "flop_per_token": counted_flop / counted_tokens}
            del module, trainer, data
    return out


# ----------------------------------------------------------------------------------------------- the table
def report(sides: dict, peaks: dict, args, setup: dict) -> dict:
    rows, speedup, speedup_store, peak_fraction, peak_fraction_store = [], {}, {}, {}, {}
    for key in sides["new"]["rows"]:
        method, source = key.split("/")
        tps = {}
        for side in ("old", "new"):
            r = sides[side]["rows"][key]
            dtype = "bfloat16" if "bf16" in sides[side]["precision"] else "float32"
            flop = r["flop_per_token"]
            gflops = flop * r["tokens_per_second"] / 1e9
            r.update(gflops=gflops, peak_gflops=peaks[dtype], peak_fraction=gflops / peaks[dtype])
            tps[side] = r["tokens_per_second"]
            dropped = r["settings"].get("dropped_frac")
            rows.append([method, source, side, sides[side]["precision"], r["settings"]["vocab_rows"],
                         "-" if dropped is None else f"{100 * dropped:.1f}%",
                         "yes" if r["settings"]["recompute"] else "no", "yes" if r["settings"]["greedy"] else "no",
                         f"{r['tokens_per_second']:.0f}", f"{r['step_seconds']:.2f}", f"{flop / 1e6:.0f}",
                         f"{gflops:.0f}", f"{100 * r['peak_fraction']:.0f}%"])
        ratio = tps["new"] / tps["old"]
        (speedup if source == "online" else speedup_store)[method] = ratio
        (peak_fraction if source == "online" else peak_fraction_store)[method] = sides["new"]["rows"][key]["peak_fraction"]
    old_x, new_x = sides["old"]["extract"], sides["new"]["extract"]
    speedup["extract"] = new_x["tokens_per_second"] / old_x["tokens_per_second"]
    from spectrain.heads.report import format_table

    print(format_table(["method", "data", "side", "precision", "loss rows", "dropped", "recompute", "greedy", "tok/s",
                        "s/step",
                        "MFLOP/tok", "GFLOP/s", "of peak"], rows,
                       title=f"Training throughput, SmolLM2-135M shapes ({args.layers} layers), batch "
                             f"{args.batch_size} x {args.block_size}, {args.threads} threads; old = {args.baseline}"))
    print(format_table(["", "old", "new", "speedup"], [
        ["extract tok/s", f"{old_x['tokens_per_second']:.0f} ({old_x['verifier_dtype']})",
         f"{new_x['tokens_per_second']:.0f} ({new_x['verifier_dtype']})", f"{speedup['extract']:.2f}x"],
        *[[f"{m} tok/s speedup", "", "", f"online {speedup[m]:.2f}x, store {speedup_store[m]:.2f}x"]
          for m in speedup_store],
        ["matmul peak GFLOP/s", f"fp32 {peaks['float32']:.0f}", f"bf16 {peaks['bfloat16']:.0f}", ""]]))
    return {"speedup": speedup, "speedup_store": speedup_store, "peak_fraction": peak_fraction,
            "peak_fraction_store": peak_fraction_store, "peak_gflops": peaks, "sides": sides, "setup": setup,
            "settings": vars(args)}


def main(argv: list[str] | None = None) -> None:
    """Bad input: ``error: ...`` on stderr and exit code 2 (no traceback)."""
    from spectrain.heads.errors import run_command  # here: the sides this script compares import their own

    return run_command(_main, argv)


def _main(argv: list[str] | None = None) -> None:
    from spectrain.train.throughput import timed_methods  # the parent: this tree's

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", default="runs/bench/train_throughput.json")
    p.add_argument("--baseline", default=DEFAULT_BASELINE, help="git revision of the 'old' side")
    p.add_argument("--steps", type=int, default=3, help="timed optimizer steps per row")
    p.add_argument("--warmup", type=int, default=1, help="untimed steps before them (after the step whose FLOPs "
                                                          "are counted)")
    p.add_argument("--methods", default=None, help="drafter methods to time, M,M (default: every registered method "
                                                   "with a SmolLM2 recipe in both trees)")
    p.add_argument("--batch_size", type=int, default=4)
    p.add_argument("--block_size", type=int, default=512)
    p.add_argument("--layers", type=int, default=30, help="verifier layers (SmolLM2-135M has 30)")
    p.add_argument("--store_rows", type=int, default=48)
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    p.add_argument("--work", default=None, help="working directory (default: a temporary one)")
    p.add_argument("--worker", choices=["old", "new"], help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        print(json.dumps(worker(args.worker, Path(args.work), args)))
        return
    with tempfile.TemporaryDirectory(prefix="spectrain-bench-") as tmp:
        work = Path(args.work or tmp)
        work.mkdir(parents=True, exist_ok=True)
        old_root = baseline_tree(args.baseline, work)
        methods = timed_methods(work / "old-src", args.methods, REPO)  # before the verifier: bad input fails fast
        (work / "methods.json").write_text(json.dumps(methods))
        setup = build_workdir(work, args)
        peaks = {d: matmul_peak(d) for d in ("float32", "bfloat16")}
        sides = {}
        for side in ("old", "new"):
            env = dict(os.environ, WANDB_MODE="disabled", HF_HUB_OFFLINE="1",
                       PYTHONPATH=os.pathsep.join(filter(None, [str(old_root) if side == "old" else "",
                                                                os.environ.get("PYTHONPATH", "")])))
            cmd = [sys.executable, __file__, "--worker", side, "--work", str(work), *(sys.argv[1:] if argv is None else argv)]
            proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=str(work))
            if proc.returncode != 0:
                sys.exit(f"{side} side failed:\n{proc.stderr[-4000:]}")
            sides[side] = json.loads(proc.stdout.strip().splitlines()[-1])
        peaks_after = {d: matmul_peak(d) for d in ("float32", "bfloat16")}
        peaks = {d: max(peaks[d], peaks_after[d]) for d in peaks}  # the better of before/after: a loaded machine
        result = report(sides, peaks, args, setup)
    path = Path(args.json)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp_path = path.with_name(path.name + ".tmp")
    tmp_path.write_text(json.dumps(result, indent=2))
    os.replace(tmp_path, path)
    print(path.resolve())


if __name__ == "__main__":
    main()
