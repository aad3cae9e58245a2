"""Offline hidden-state store: run the verifier once over a dataset, train drafters many times.

Layout of a store directory (format version 2, ``"layout": "packed"``):

* ``metadata.json`` — ``format_version`` 2, verifier name and shape (hidden size, layers, vocabulary), the HF
  ``hidden_states`` indices stored (``layer_ids``; the last hidden state is always stored as ``hidden``), store
  dtype, ``topk``, data source, extraction throughput (``extract_tokens``, ``extract_seconds``), the rows cut at
  the block size (``truncation``: what was counted and the counts; absent in stores extracted before it was
  recorded, which load as before) and the list of finished shards with their rows, tokens, byte sizes and
  SHA-256. It is rewritten atomically after every shard, so an interrupted extraction resumes at the first
  unfinished shard.
* ``shard-00000.safetensors`` … — rows packed end to end, no padding (every stored position is a real token):
  ``offsets`` (rows + 1,) int64 (row r is positions ``[offsets[r], offsets[r+1])``), ``input_ids`` (P,) int32,
  ``loss_mask`` (P,) uint8, ``hidden`` (P, H) and ``aux`` (P, len(layer_ids) * H) in the store dtype (bf16 by
  default), ``greedy`` (P,) int32 (the verifier's argmax next token at each position) and, when ``topk`` K > 0,
  ``topk_ids`` (P, K) int32 and ``topk_logprobs`` (P, K) float32 (the K largest fp32 log-probabilities over the
  full vocabulary, descending); P = the shard's tokens.

Extraction sorts a shard's rows by length and runs the verifier on batches padded only to their own longest row.
Reading checks the format version, the metadata against the verifier and the layers a drafter needs, and every
shard's size and checksum: a truncated or corrupt shard is named, never skipped. Format 1 stores (rows padded to
their shard's longest) are refused with a note to re-extract.
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path

import torch

from spectrain.heads.errors import SpectrainError
from spectrain.heads.host_memory import keep_freed_memory
from spectrain.heads.io import load_tensors, read_json, save_tensors, sha256_files, write_json
from spectrain.heads.verifier import verifier_logits, verifier_signature

FORMAT_VERSION = 2
LAYOUT = "packed"
LOGIT_CHUNK = 4096  # positions projected onto the vocabulary at a time
DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}
REPORTED = ("shards", "truncation")  # metadata that reports on the extraction: not compared when it resumes


def estimate_bytes(tokens: int, hidden_size: int, num_layers: int, dtype: torch.dtype, topk: int = 0,
                   rows: int = 0) -> int:
    """Bytes a packed store of ``tokens`` positions in ``rows`` rows takes: features, ids, loss mask, greedy
    tokens (int32 each), top-k ids (int32) and log-probabilities (fp32), row offsets (int64)."""
    width = torch.empty((), dtype=dtype).element_size()
    return tokens * (hidden_size * (1 + num_layers) * width + 4 + 1 + 4 + topk * (4 + 4)) + (rows + 1) * 8


def store_bytes_per_token(hidden_size: int, num_layers: int, dtype: torch.dtype, topk: int = 0) -> int:
    """Bytes a store spends per token (:func:`estimate_bytes` without the per-row offsets): what ``--dry_run``
    reports per million tokens."""
    return estimate_bytes(1, hidden_size, num_layers, dtype, topk) - 8  # less the one offset of an empty store


def extract(verifier, rows, out_dir: str | Path, layer_ids: tuple[int, ...], data_name: str, dtype: str = "bfloat16",
            rows_per_shard: int = 64, batch_size: int = 8, pad_id: int = 0, log=print, rank: int = 0,
            world: int = 1, topk: int = 0, truncation: dict | None = None) -> Path:
    """Run ``verifier`` (a loaded :class:`~spectrain.heads.verifier.Verifier`) over ``rows`` and store features.

    ``rows`` is a sequence of dicts with ``input_ids`` (and optionally ``loss_mask``), e.g. a data module's split.
    Inside a shard the rows are sorted by length and run ``batch_size`` at a time, each batch padded only to its
    own longest row; the verifier runs in the dtype it was loaded with, ``dtype`` is the store's. Every position
    gets the verifier's greedy next token; ``topk`` > 0 also stores the top-``topk`` fp32 log-probabilities.
    Resumable: finished shards recorded in ``metadata.json`` are kept, the rest is (re)written.
    ``truncation``: the rows' cut at the block size as the data module counted it
    (:meth:`~spectrain.data.datamodule.DrafterDataModule.truncation_entry`), kept in the metadata as ``truncation``
    (a report, not a setting: a resumed extraction does not compare it; stores without it still load).
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
    vocab = model.get_output_embeddings().weight.shape[0]
    if not 0 <= topk <= vocab:
        raise SpectrainError(f"topk must be in 0..{vocab} (the verifier's vocabulary), got {topk}")
    if batch_size < 1 or rows_per_shard < 1:
        raise SpectrainError(f"batch_size and rows_per_shard must be >= 1, got {batch_size} and {rows_per_shard}")
    if not 0 <= rank < world:
        raise SpectrainError(f"rank {rank} outside a world of {world} processes")
    meta = {"format_version": FORMAT_VERSION, "layout": LAYOUT, "verifier": verifier.name,
            "signature": verifier_signature(config), "verifier_dtype": str(next(model.parameters()).dtype)[6:],
            "layer_ids": list(layer_ids), "dtype": dtype, "topk": topk, "data": data_name, "rows": len(rows),
            "rows_per_shard": rows_per_shard, "shards": []}
    if truncation is not None:
        meta["truncation"] = truncation
    settings = [k for k in meta if k not in REPORTED]
    for old_path in [out / "metadata.json", *sorted(out.glob("metadata.rank*.json"))]:
        if not old_path.is_file():
            continue
        old = read_json(old_path, "store metadata")
        if old.get("format_version", 1) != FORMAT_VERSION:
            raise SpectrainError(f"{_format_problem(out, old)}; choose another directory or delete it")
        same = {k: old.get(k) for k in settings} == {k: meta[k] for k in settings}
        if not same:
            raise SpectrainError(f"{out} holds a store made with other settings (verifier, its dtype, layers, topk, "
                                 "data or dtype); choose another directory")
        known = {s["index"] for s in meta["shards"]}
        meta["shards"] += [s for s in old["shards"] if s["index"] not in known]
    tokens = sum(len(r["input_ids"]) for r in rows)
    need = estimate_bytes(tokens, config.hidden_size, len(layer_ids), DTYPES[dtype], topk=topk, rows=len(rows))
    out.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(out).free
    log(f"store: {len(rows)} rows, {tokens:,} tokens, layers {list(layer_ids)}, top-{topk} -> about "
        f"{need / 2**30:.2f} GiB ({need / max(tokens, 1) * 1000 / 2**20:.2f} MiB per 1K tokens); "
        f"{free / 2**30:.1f} GiB free")
    if need > free:
        raise SpectrainError(f"the store needs about {need / 2**30:.2f} GiB but only {free / 2**30:.2f} GiB is free in {out}")
    device = next(model.parameters()).device
    if device.type == "cpu":
        keep_freed_memory()  # large logits chunks would otherwise page-fault afresh every batch
    done = {s["index"] for s in meta["shards"]}
    record = out / ("metadata.json" if world == 1 else f"metadata.rank{rank}.json")
    total = -(-len(rows) // rows_per_shard)
    run_tokens, run_seconds = 0, 0.0
    for index, start in enumerate(range(0, len(rows), rows_per_shard)):
        if index in done or index % world != rank:
            continue
        t0 = time.perf_counter()
        chunk = rows[start:start + rows_per_shard] if not hasattr(rows, "select") else \
            rows.select(range(start, min(start + rows_per_shard, len(rows))))
        tensors = _features_of(chunk, model, layer_ids, DTYPES[dtype], batch_size, pad_id, device, topk,
                               verifier_features)
        path = out / f"shard-{index:05d}.safetensors"
        save_tensors(path, tensors)
        seconds = time.perf_counter() - t0
        n_tokens = int(tensors["input_ids"].shape[0])
        run_tokens, run_seconds = run_tokens + n_tokens, run_seconds + seconds
        meta["shards"].append({"index": index, "file": path.name, "rows": int(tensors["offsets"].shape[0] - 1),
                               "tokens": n_tokens, "seconds": round(seconds, 3), "bytes": path.stat().st_size,
                               "sha256": sha256_files(path)})
        meta["shards"].sort(key=lambda s: s["index"])
        write_json(record, meta)  # after the shard: a crash never records a missing shard
        log(f"store: shard {index + 1}/{total}: {n_tokens:,} tokens in {seconds:.1f} s "
            f"({n_tokens / max(seconds, 1e-9):,.0f} tokens/s)")
    if run_tokens:
        log(f"store: extracted {run_tokens:,} tokens in {run_seconds:.1f} s "
            f"({run_tokens / max(run_seconds, 1e-9):,.0f} tokens/s)")
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
    # Summed over shards (whichever run or rank wrote them): the verifier's throughput, not one call's wall time.
    meta["extract_tokens"] = sum(s["tokens"] for s in meta["shards"])
    meta["extract_seconds"] = round(sum(s["seconds"] for s in meta["shards"]), 2)
    meta["extract_tokens_per_second"] = round(meta["extract_tokens"] / max(meta["extract_seconds"], 1e-9), 1)
    write_json(out / "metadata.json", meta)
    return out


@torch.no_grad()
def _features_of(chunk, model, layer_ids, dtype, batch_size, pad_id, device, topk, verifier_features) -> dict:
    """One shard's tensors, packed: rows sorted by length, batched, padded per batch, scattered back in order."""
    ids_rows = [torch.as_tensor(r["input_ids"], dtype=torch.long).reshape(-1) for r in chunk]
    lengths = [len(x) for x in ids_rows]
    offsets = torch.tensor([0] + lengths, dtype=torch.long).cumsum(0)
    total, h, n_aux = int(offsets[-1]), model.config.hidden_size, len(layer_ids)
    loss_rows = [torch.as_tensor(r["loss_mask"], dtype=torch.uint8).reshape(-1) if "loss_mask" in r
                 else torch.ones(n, dtype=torch.uint8) for r, n in zip(chunk, lengths)]
    for r, (m, n) in enumerate(zip(loss_rows, lengths)):
        if len(m) != n:
            raise SpectrainError(f"row {r} of the shard has {n} input_ids but {len(m)} loss_mask entries")
    out = {"offsets": offsets, "input_ids": torch.cat(ids_rows).to(torch.int32), "loss_mask": torch.cat(loss_rows),
           "hidden": torch.zeros((total, h), dtype=dtype), "aux": torch.zeros((total, n_aux * h), dtype=dtype),
           "greedy": torch.zeros(total, dtype=torch.int32)}
    if topk:
        out["topk_ids"] = torch.zeros((total, topk), dtype=torch.int32)
        out["topk_logprobs"] = torch.zeros((total, topk), dtype=torch.float32)
    vocab = model.get_output_embeddings().weight.shape[0]
    chunk_rows = max(1, min(LOGIT_CHUNK, (1 << 28) // vocab))  # at most ~1 GiB of fp32 logits at a time
    # Longest first (an out-of-memory shows at once); stable, so the batches depend on the shard's rows alone.
    order = [i for i in sorted(range(len(chunk)), key=lambda i: -lengths[i]) if lengths[i] > 0]
    for b in range(0, len(order), batch_size):
        batch = order[b:b + batch_size]
        length = lengths[batch[0]]
        ids = torch.full((len(batch), length), pad_id, dtype=torch.long)
        attention = torch.zeros((len(batch), length), dtype=torch.long)
        for j, i in enumerate(batch):
            ids[j, :lengths[i]] = ids_rows[i]
            attention[j, :lengths[i]] = 1
        last, layers = verifier_features(model, ids.to(device), attention.to(device), layer_ids)
        real = attention.bool().to(device)  # right padding: row j's real tokens are its first lengths[i]
        last = last[real]
        dest = torch.cat([torch.arange(int(offsets[i]), int(offsets[i + 1])) for i in batch])
        out["hidden"][dest] = last.to(dtype).cpu()
        if layers:
            out["aux"][dest] = torch.cat(layers, -1)[real].to(dtype).cpu()
        for c in range(0, len(dest), chunk_rows):
            logits = verifier_logits(model, last[c:c + chunk_rows])  # the verifier's own dtype: its greedy token
            where = dest[c:c + chunk_rows]
            out["greedy"][where] = logits.argmax(-1).to(torch.int32).cpu()
            if topk:  # log-softmax in fp32: bf16 over a large vocabulary loses the tail
                values, indices = logits.float().log_softmax(-1).topk(topk, dim=-1)
                # Ties (common with bf16 logits) in a fixed order, lowest id first, as argmax breaks them.
                indices, by_id = indices.sort(dim=-1)
                values, by_value = values.gather(-1, by_id).sort(dim=-1, descending=True, stable=True)
                indices = indices.gather(-1, by_value)
                out["topk_ids"][where] = indices.to(torch.int32).cpu()
                out["topk_logprobs"][where] = values.cpu()
            del logits
    return out


def _format_problem(path: Path, meta: dict) -> str:
    version = meta.get("format_version", 1)
    if version < FORMAT_VERSION:
        return (f"store {path} was written by an older spectrain (format {version}, padded rows); "
                f"re-extract it with spectrain-extract --out NEWDIR (same flags)")
    return f"store {path} was written by a newer spectrain (format {version}); upgrade spectrain to read it"


class HiddenStateStore(torch.utils.data.Dataset):
    """Rows of a finished store, checked against the verifier and the layers a drafter needs.

    ``store[i]`` is a dict of one row's tensors (T = the row's own length): ``input_ids``, ``attention_mask``
    (ones), ``loss_mask`` and ``greedy`` (T,) int64; ``hidden`` (T, H) and ``aux`` (T, len(need_layers) * H; every
    stored layer when ``need_layers`` is empty) in the store dtype; with a top-k store also ``topk_ids`` (T, K)
    int64 and ``topk_logprobs`` (T, K) float32. :meth:`lengths` gives every row's length without reading rows.
    """

    def __init__(self, path: str | Path, verifier_config=None, verifier_name: str | None = None,
                 need_layers: tuple[int, ...] = (), check_checksums: bool = True):
        self.path = Path(path)
        meta = read_json(self.path / "metadata.json", "hidden-state store metadata")
        if meta.get("format_version", 1) != FORMAT_VERSION:
            raise SpectrainError(_format_problem(self.path, meta))
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
        h = meta["signature"]["hidden_size"]
        cols = [meta["layer_ids"].index(l) for l in self.need_layers]
        # Column ranges of aux to hand out: one contiguous view when the needed layers are stored side by side.
        self._aux_cols = None if not cols or cols == list(range(cols[0], cols[0] + len(cols))) else \
            [(c * h, (c + 1) * h) for c in cols]
        self._aux_span = (cols[0] * h, (cols[-1] + 1) * h) if cols and self._aux_cols is None else None
        self.shards, self._rows = [], []
        for s, shard in enumerate(meta["shards"]):
            file = self.path / shard["file"]
            if not file.is_file() or file.stat().st_size != shard["bytes"]:
                raise SpectrainError(f"store shard {file} is missing or truncated "
                                     f"({file.stat().st_size if file.is_file() else 0} of {shard['bytes']} bytes)")
            if check_checksums and sha256_files(file) != shard["sha256"]:
                raise SpectrainError(f"store shard {file} is corrupt (checksum mismatch)")
            tensors = load_tensors(file)
            expected = {"offsets", "input_ids", "loss_mask", "hidden", "aux", "greedy"} | \
                ({"topk_ids", "topk_logprobs"} if meta.get("topk") else set())
            offsets = tensors.get("offsets")
            if (not expected <= tensors.keys() or offsets.shape[0] != shard["rows"] + 1
                    or int(offsets[-1]) != tensors["input_ids"].shape[0]):
                raise SpectrainError(f"store shard {file} does not match its metadata (tensors "
                                     f"{sorted(tensors)}, {shard['rows']} rows): re-extract the store")
            self.shards.append(tensors)
            bounds = offsets.tolist()
            self._rows += [(s, bounds[r], bounds[r + 1]) for r in range(shard["rows"])]

    def __len__(self) -> int:
        return len(self._rows)

    def lengths(self) -> list[int]:
        """Every row's length (tokens), in row order, from the shards' offsets (no row is read)."""
        return [b - a for _, a, b in self._rows]

    def __getitem__(self, i: int) -> dict:
        s, a, b = self._rows[i]
        t = self.shards[s]
        aux = t["aux"][a:b]  # views of the shard: only what a row needs is ever copied
        if self._aux_span is not None:
            aux = aux[:, self._aux_span[0]:self._aux_span[1]]
        elif self._aux_cols is not None:
            aux = torch.cat([aux[:, lo:hi] for lo, hi in self._aux_cols], -1)
        row = {"input_ids": t["input_ids"][a:b].long(), "attention_mask": torch.ones(b - a, dtype=torch.long),
               "loss_mask": t["loss_mask"][a:b].long(), "hidden": t["hidden"][a:b], "aux": aux,
               "greedy": t["greedy"][a:b].long()}
        if "topk_ids" in t:
            row["topk_ids"] = t["topk_ids"][a:b].long()
            row["topk_logprobs"] = t["topk_logprobs"][a:b]
        return row


def collate_store(rows: list[dict]) -> dict[str, torch.Tensor]:
    """Stack store rows, right-padding every key with zeros to the batch's longest row: attention and loss masks
    are 0 on the pads, so nothing there (ids, features, greedy or top-k) is ever trained on."""
    length = max(r["input_ids"].shape[0] for r in rows)

    def padded(t: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.pad(t, (0, 0) * (t.dim() - 1) + (0, length - t.shape[0]))

    return {k: torch.stack([padded(r[k]) for r in rows]) for k in rows[0]}
