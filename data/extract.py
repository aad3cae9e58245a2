"""``spectrain-extract``: run the verifier once over a dataset and store its hidden states (:mod:`.store`), or with
``--dry_run`` size that store from the verifier's config alone. Under torchrun / srun each process extracts its
share of the shards (:func:`launcher_rank`)."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import torch

from spectrain.heads.errors import SpectrainError, run_command
from spectrain.heads.io import read_json
from spectrain.heads.layers import spread_layers

from .datamodule import DrafterDataModule
from .store import DTYPES, extract, store_bytes_per_token


def launcher_rank() -> tuple[int, int]:
    """(rank, world size) from torchrun (RANK/WORLD_SIZE) or SLURM (SLURM_PROCID/SLURM_NTASKS); (0, 1) alone."""
    for rank_key, world_key in (("RANK", "WORLD_SIZE"), ("SLURM_PROCID", "SLURM_NTASKS")):
        if rank_key in os.environ and world_key in os.environ:
            return int(os.environ[rank_key]), int(os.environ[world_key])
    return 0, 1


def main(argv=None) -> None:
    """``spectrain-extract``: run the verifier once over a dataset and store its hidden states."""
    p = argparse.ArgumentParser(prog="spectrain-extract", description=main.__doc__)
    p.add_argument("--verifier", default="bundled:tinyshakespeare")
    p.add_argument("--gguf_file", default=None)
    p.add_argument("--data", default=None, help="data path as for train_* --data.path (default: bundled text)")
    p.add_argument("--block_size", type=int, default=128)
    p.add_argument("--layer_ids", default="auto", help="comma-separated HF hidden_states indices, or auto (low, middle and high layers: "
                   "the fusing drafters' default)")
    p.add_argument("--out", default=None, help="store directory; gets train/ and validation/ stores (required unless "
                   "--dry_run)")
    p.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES), help="the store's dtype for hidden states")
    p.add_argument("--verifier_dtype", default="auto",
                   help="dtype the verifier runs in (auto, bfloat16, float16, float32)")
    p.add_argument("--topk", type=int, default=0,
                   help="also store the verifier's K most likely next tokens and their fp32 log-probabilities")
    p.add_argument("--batch_size", type=int, default=8, help="rows per verifier forward (grouped by length)")
    p.add_argument("--rows_per_shard", type=int, default=64)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dry_run", action="store_true",
                   help="size the store from the verifier's config alone (bytes per token and per million tokens); "
                        "nothing is loaded or written but the JSON")
    p.add_argument("--dry_run_out", default=None,
                   help="with --dry_run: the JSON's path (default runs/fit/extract-<verifier>.json)")
    args = p.parse_args(argv)
    if not args.dry_run and not args.out:
        p.error("--out is required (unless --dry_run)")
    run_command(extract_dry_run if args.dry_run else extract_command, args)


def extract_dry_run(args) -> None:
    """``spectrain-extract --dry_run``: the store's bytes per token for this verifier, layers, dtype and top-k."""
    from spectrain.heads.report import finish, format_table
    from spectrain.heads.verifier_shapes import verifier_config

    config, source = verifier_config(args.verifier)
    layers = parse_layer_ids(args.layer_ids, config.num_hidden_layers, spread_layers)
    per_token = store_bytes_per_token(config.hidden_size, len(layers), DTYPES[args.dtype], args.topk)
    summary = {"verifier": args.verifier, "verifier_config": source, "hidden_size": config.hidden_size,
               "layer_ids": layers, "dtype": args.dtype, "topk": args.topk, "bytes_per_token": per_token,
               "bytes_per_million_tokens": per_token * 10 ** 6, "plus_per_row": 8,
               "source": "data.store.estimate_bytes: exact for the tensors a shard holds (safetensors headers aside)"}
    rows = [["verifier", f"{args.verifier} ({source})"], ["captured layers", f"{layers} + the last hidden state"],
            ["bytes per token", f"{per_token:,}"], ["per million tokens", f"{per_token / 1e3:,.2f} GB"]]
    out = args.dry_run_out or str(Path("runs") / "fit" / f"extract-{args.verifier.replace('/', '--').strip('.-')}.json")
    finish(summary, out, tables=[format_table(["store", "value"], rows, title="spectrain-extract --dry_run")])


def parse_layer_ids(text: str, num_layers: int, spread) -> list[int]:
    """``--layer_ids``: comma-separated HF hidden_states indices, or auto (``spread(num_layers)``)."""
    try:
        return spread(num_layers) if text == "auto" else [int(x) for x in text.split(",")]
    except ValueError:
        raise SpectrainError(f"--layer_ids takes comma-separated integers or auto, got {text!r}") from None


def extract_command(args) -> None:
    """``spectrain-extract``'s body: extract both splits, then report them (last line: the train metadata)."""
    from spectrain.heads.verifier import load_verifier

    verifier = load_verifier(args.verifier, gguf_file=args.gguf_file, dtype=args.verifier_dtype, device=args.device)
    layers = parse_layer_ids(args.layer_ids, verifier.config.num_hidden_layers, spread_layers)
    data = DrafterDataModule(path=args.data, tokenizer=args.verifier, gguf_file=args.gguf_file,
                             block_size=args.block_size)
    data.setup()
    rank, world = launcher_rank()  # torchrun / srun: each process extracts its share of the shards
    for split, rows in (("train", data.train_set), ("validation", data.val_set)):
        extract(verifier, rows, Path(args.out) / split, tuple(layers), data.data_name, args.dtype,
                args.rows_per_shard, batch_size=args.batch_size, pad_id=verifier.tokenizer.pad_token_id or 0,
                rank=rank, world=world, topk=args.topk, truncation=data.truncation_entry())
    if world > 1 and not all((Path(args.out) / s / "metadata.json").is_file() for s in ("train", "validation")):
        print(f"rank {rank}: shards written; the store completes when every rank has finished")
        return
    for split in ("train", "validation"):
        meta = read_json(Path(args.out) / split / "metadata.json")
        print(f"{split}: {len(meta['shards'])} shards, {meta['rows']} rows, {meta['extract_tokens']:,} tokens, "
              f"{meta['extract_seconds']} s ({meta['extract_tokens_per_second']:,.0f} tokens/s)")
    print(f"rows cut at block_size: {data.truncation.describe() if data.truncation else 'none counted'} "
          f"(counted: {data.truncation_counted})")
    warning = data.truncation_warning()
    if warning:
        print(f"warning: {warning}")
    print((Path(args.out) / "train" / "metadata.json").resolve())
