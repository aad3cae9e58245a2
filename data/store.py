"""Offline hidden-state store: run the verifier once over a dataset, train drafters many times.

Layout of a store directory:

* ``metadata.json`` — verifier name and shape (hidden size, layers, vocabulary), the HF ``hidden_states``
  indices stored (``layer_ids``; the last hidden state is always stored as ``hidden``), dtype, data source,
  and the list of finished shards with their row counts, byte sizes and SHA-256. It is rewritten atomically
  after every shard, so an interrupted extraction resumes at the first unfinished shard.
* ``shard-00000.safetensors`` … — ``input_ids`` (N, T) int64, ``attention_mask`` / ``loss_mask`` (N, T) uint8,
  ``hidden`` (N, T, H) and ``aux`` (N, T, len(layer_ids) * H) in the store dtype (bf16 by default).

Reading checks the metadata against the verifier and the layers a drafter needs, and every shard's size and
checksum: a truncated or corrupt shard is named, never skipped.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import sys
import time
from pathlib import Path

import torch

from spectrain.heads.errors import SpectrainError
from spectrain.heads.io import load_tensors, read_json, save_tensors, write_json

FORMAT_VERSION = 1
DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}


def verifier_signature(config) -> dict:
    return {"model_type": config.model_type, "hidden_size": config.hidden_size,
            "num_hidden_layers": config.num_hidden_layers, "vocab_size": config.vocab_size}


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def estimate_bytes(tokens: int, hidden_size: int, num_layers: int, dtype: torch.dtype) -> int:
    """Bytes a store of ``tokens`` positions takes: features + ids + masks."""
    width = torch.empty((), dtype=dtype).element_size()
    return tokens * (hidden_size * (1 + num_layers) * width + 8 + 2)


@torch.no_grad()
def launcher_rank() -> tuple[int, int]:
    """(rank, world size) from torchrun (RANK/WORLD_SIZE) or SLURM (SLURM_PROCID/SLURM_NTASKS); (0, 1) alone."""
    for rank_key, world_key in (("RANK", "WORLD_SIZE"), ("SLURM_PROCID", "SLURM_NTASKS")):
        if rank_key in os.environ and world_key in os.environ:
            return int(os.environ[rank_key]), int(os.environ[world_key])
    return 0, 1


def extract(verifier, rows, out_dir: str | Path, layer_ids: tuple[int, ...], data_name: str, dtype: str = "bfloat16",
            rows_per_shard: int = 64, batch_size: int = 8, pad_id: int = 0, log=print, rank: int = 0,
            world: int = 1) -> Path:
    """Run ``verifier`` (a loaded :class:`~spectrain.heads.verifier.Verifier`) over ``rows`` and store features.

    ``rows`` is a sequence of dicts with ``input_ids`` (and optionally ``loss_mask``), e.g. a data module's split.
    Resumable: finished shards recorded in ``metadata.json`` are kept, the rest is (re)written.
    Data-parallel: with ``world`` > 1 (one process per rank, e.g. under torchrun), rank r writes shards
    i with i % world == r and records them in ``metadata.rank<r>.json``; whichever rank finds every shard
    recorded writes the merged, complete ``metadata.json`` (the same content whoever writes it).
    """
    from spectrain.heads.verifier import verifier_features

    out = Path(out_dir)
    if dtype not in DTYPES:
        raise SpectrainError(f"store dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    model, config = verifier.model, verifier.model.config
    layer_ids = tuple(sorted(set(layer_ids)))
    if any(not 0 < i <= config.num_hidden_layers for i in layer_ids):
        raise SpectrainError(f"layer ids {list(layer_ids)} outside 1..{config.num_hidden_layers}")
    meta = {"format_version": FORMAT_VERSION, "verifier": verifier.name, "signature": verifier_signature(config),
            "layer_ids": list(layer_ids), "dtype": dtype, "data": data_name, "rows": len(rows),
            "rows_per_shard": rows_per_shard, "shards": []}
    if not 0 <= rank < world:
        raise SpectrainError(f"rank {rank} outside a world of {world} processes")
    for old_path in [out / "metadata.json", *sorted(out.glob("metadata.rank*.json"))]:
        if not old_path.is_file():
            continue
        old = read_json(old_path, "store metadata")
        same = {k: old.get(k) for k in meta if k != "shards"} == {k: v for k, v in meta.items() if k != "shards"}
        if not same:
            raise SpectrainError(f"{out} holds a store made with other settings (verifier, layers, data or dtype); "
                                 "choose another directory")
        known = {s["index"] for s in meta["shards"]}
        meta["shards"] += [s for s in old["shards"] if s["index"] not in known]
    tokens = sum(len(r["input_ids"]) for r in rows)
    need = estimate_bytes(tokens, config.hidden_size, len(layer_ids), DTYPES[dtype])
    out.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(out).free
    log(f"store: {len(rows)} rows, {tokens:,} tokens, layers {list(layer_ids)} -> about {need / 2**30:.2f} GiB "
        f"({need / max(tokens, 1) * 1000 / 2**20:.2f} MiB per 1K tokens); {free / 2**30:.1f} GiB free")
    if need > free:
        raise SpectrainError(f"the store needs about {need / 2**30:.2f} GiB but only {free / 2**30:.2f} GiB is free in {out}")
    device = next(model.parameters()).device
    t0, done = time.time(), {s["index"] for s in meta["shards"]}
    record = out / ("metadata.json" if world == 1 else f"metadata.rank{rank}.json")
    total = -(-len(rows) // rows_per_shard)
    for index, start in enumerate(range(0, len(rows), rows_per_shard)):
        if index in done or index % world != rank:
            continue
        chunk = rows[start:start + rows_per_shard] if not hasattr(rows, "select") else \
            rows.select(range(start, min(start + rows_per_shard, len(rows))))
        tensors = _features_of(chunk, model, layer_ids, DTYPES[dtype], batch_size, pad_id, device, verifier_features)
        path = out / f"shard-{index:05d}.safetensors"
        save_tensors(path, tensors)
        meta["shards"].append({"index": index, "file": path.name, "rows": int(tensors["input_ids"].shape[0]),
                               "bytes": path.stat().st_size, "sha256": _sha256(path)})
        meta["shards"].sort(key=lambda s: s["index"])
        write_json(record, meta)  # after the shard: a crash never records a missing shard
    if world > 1:
        write_json(record, meta)
        merged = {s["index"]: s for p in sorted(out.glob("metadata.rank*.json"))
                  for s in read_json(p, "store metadata")["shards"]}
        merged.update({s["index"]: s for s in meta["shards"]})
        if len(merged) < total:
            log(f"store: rank {rank}/{world} done; {total - len(merged)} shard(s) left to other ranks")
            return out
        meta["shards"] = [merged[i] for i in sorted(merged)]
    meta["complete"] = True
    meta["extract_seconds"] = round(time.time() - t0, 2)
    write_json(out / "metadata.json", meta)
    return out


def _features_of(chunk, model, layer_ids, dtype, batch_size, pad_id, device, verifier_features) -> dict:
    length = max(len(r["input_ids"]) for r in chunk)
    n = len(chunk)
    ids = torch.full((n, length), pad_id, dtype=torch.long)
    attention = torch.zeros((n, length), dtype=torch.uint8)
    loss_mask = torch.zeros((n, length), dtype=torch.uint8)
    for i, r in enumerate(chunk):
        k = len(r["input_ids"])
        ids[i, :k] = torch.as_tensor(r["input_ids"])
        attention[i, :k] = 1
        loss_mask[i, :k] = torch.as_tensor(r["loss_mask"]) if "loss_mask" in r else 1
    hidden, aux = [], []
    for b in range(0, n, batch_size):
        last, layers = verifier_features(model, ids[b:b + batch_size].to(device),
                                         attention[b:b + batch_size].to(device).long(), layer_ids)
        hidden.append(last.to(dtype).cpu())
        aux.append(torch.cat(layers, -1).to(dtype).cpu() if layers else last.new_zeros(last.shape[:2] + (0,)).cpu())
    return {"input_ids": ids, "attention_mask": attention, "loss_mask": loss_mask,
            "hidden": torch.cat(hidden), "aux": torch.cat(aux)}


class HiddenStateStore(torch.utils.data.Dataset):
    """Rows of a finished store, checked against the verifier and the layers a drafter needs."""

    def __init__(self, path: str | Path, verifier_config=None, verifier_name: str | None = None,
                 need_layers: tuple[int, ...] = (), check_checksums: bool = True):
        self.path = Path(path)
        meta = read_json(self.path / "metadata.json", "hidden-state store metadata")
        if not meta.get("complete"):
            raise SpectrainError(f"store {self.path} is unfinished: rerun the extraction to complete it")
        if verifier_config is not None and meta["signature"] != verifier_signature(verifier_config):
            raise SpectrainError(f"store {self.path} was made with another verifier ({meta['verifier']}, "
                                 f"{meta['signature']}), not this one ({verifier_signature(verifier_config)})")
        if verifier_name is not None and meta["verifier"] != verifier_name:
            raise SpectrainError(f"store {self.path} was made with verifier {meta['verifier']!r}, not {verifier_name!r}")
        missing = [i for i in need_layers if i not in meta["layer_ids"]]
        if missing:
            raise SpectrainError(f"store {self.path} holds layers {meta['layer_ids']}; the drafter needs {list(need_layers)}")
        self.meta, self.need_layers = meta, tuple(need_layers)
        self.shards = []
        for shard in meta["shards"]:
            file = self.path / shard["file"]
            if not file.is_file() or file.stat().st_size != shard["bytes"]:
                raise SpectrainError(f"store shard {file} is missing or truncated "
                                     f"({file.stat().st_size if file.is_file() else 0} of {shard['bytes']} bytes)")
            if check_checksums and _sha256(file) != shard["sha256"]:
                raise SpectrainError(f"store shard {file} is corrupt (checksum mismatch)")
            self.shards.append(load_tensors(file))
        self.index = [(s, r) for s, t in enumerate(self.shards) for r in range(t["input_ids"].shape[0])]

    def __len__(self) -> int:
        return len(self.index)

    def __getitem__(self, i: int) -> dict:
        s, r = self.index[i]
        t = self.shards[s]
        h = self.meta["signature"]["hidden_size"]
        cols = [self.meta["layer_ids"].index(l) for l in self.need_layers]
        aux = torch.cat([t["aux"][r, :, c * h:(c + 1) * h] for c in cols], -1) if cols else t["aux"][r]
        return {"input_ids": t["input_ids"][r], "attention_mask": t["attention_mask"][r].long(),
                "loss_mask": t["loss_mask"][r].long(), "hidden": t["hidden"][r], "aux": aux}


def collate_store(rows: list[dict]) -> dict[str, torch.Tensor]:
    """Stack store rows, right-padding with zeros (attention and loss 0) to the longest: each shard is padded only
    to its own longest row, so rows from different shards differ in length."""
    length = max(r["input_ids"].shape[0] for r in rows)

    def padded(t: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.pad(t, (0, 0) * (t.dim() - 1) + (0, length - t.shape[0]))

    return {k: torch.stack([padded(r[k]) for r in rows]) for k in rows[0]}


def main(argv=None) -> None:
    """``spectrain-extract``: run the verifier once over a dataset and store its hidden states."""
    p = argparse.ArgumentParser(prog="spectrain-extract", description=main.__doc__)
    p.add_argument("--verifier", default="bundled:tinyshakespeare")
    p.add_argument("--gguf_file", default=None)
    p.add_argument("--data", default=None, help="data path as for train_* --data.path (default: bundled text)")
    p.add_argument("--block_size", type=int, default=128)
    p.add_argument("--layer_ids", default="auto", help="comma-separated HF hidden_states indices, or auto (EAGLE-3's)")
    p.add_argument("--out", required=True, help="store directory; gets train/ and validation/ stores")
    p.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES))
    p.add_argument("--rows_per_shard", type=int, default=64)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = p.parse_args(argv)
    try:
        from spectrain.heads.eagle import default_aux_layers
        from spectrain.heads.verifier import load_verifier

        from .datamodule import DrafterDataModule

        verifier = load_verifier(args.verifier, gguf_file=args.gguf_file, device=args.device)
        layers = (default_aux_layers(verifier.config.num_hidden_layers) if args.layer_ids == "auto"
                  else [int(x) for x in args.layer_ids.split(",")])
        data = DrafterDataModule(path=args.data, tokenizer=args.verifier, gguf_file=args.gguf_file,
                                 block_size=args.block_size)
        data.setup()
        rank, world = launcher_rank()  # torchrun / srun: each process extracts its share of the shards
        for split, rows in (("train", data.train_set), ("validation", data.val_set)):
            extract(verifier, rows, Path(args.out) / split, tuple(layers), data.data_name, args.dtype,
                    args.rows_per_shard, pad_id=verifier.tokenizer.pad_token_id or 0, rank=rank, world=world)
        if world > 1 and not all((Path(args.out) / s / "metadata.json").is_file() for s in ("train", "validation")):
            print(f"rank {rank}: shards written; the store completes when every rank has finished")
            return
    except SpectrainError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    for split in ("train", "validation"):
        meta = read_json(Path(args.out) / split / "metadata.json")
        print(f"{split}: {len(meta['shards'])} shards, {meta['rows']} rows, {meta['extract_seconds']} s")
    print((Path(args.out) / "train" / "metadata.json").resolve())
