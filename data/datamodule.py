"""The one LightningDataModule for drafter training: text, chat or HF datasets.

Every batch is a dict of (B, T) tensors: ``input_ids``, ``attention_mask`` and
``loss_mask`` (1 where token t is a training target: every real token for
text, assistant tokens only for chat). Batches from a hidden-state store also carry
the verifier's ``hidden``, ``aux`` and ``greedy`` (and ``topk_ids`` / ``topk_logprobs``
when extracted with ``--topk``), see :mod:`spectrain.data.store`.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
from pathlib import Path
from typing import Literal, Optional

import lightning as L
import torch
from torch.utils.data import DataLoader

from spectrain.heads.errors import SpectrainError
from spectrain.heads.io import atomic_dir
from spectrain.heads.verifier import load_tokenizer

from .bundled import bundled_text_path
from .loader import EveryNth, RankShare, is_map_style, rank_and_world
from .text import VAL_FRACTION, text_blocks
from .truncation import Truncation

log = logging.getLogger(__name__)

STREAM_TRUNCATION_ROWS = 1000  # a chat stream's rows rendered at setup to count those cut at block_size
# What was counted, for summaries; where nothing was, the text before ":" is the summary table's cell.
PACKED = "none (packed text): plain text is packed into block_size blocks, no row is cut"
ALL_CONVERSATIONS = "every conversation with an assistant turn (train and validation rows, before the split)"
NOT_RECORDED = ("not recorded (older store): the store was extracted before spectrain counted rows cut at "
                "block_size (re-extract it to count them)")


RENDER_COUNTS = ("length", "loss_tokens", "kept_loss_tokens")  # RenderedChat's counts, columns while counting


def _chat_cache_counts(cache: Path) -> dict | None:
    """A chat cache's ``spectrain.json`` (``skipped`` and the ``truncation`` record); None when the cache is absent,
    or older than the truncation count (or its record unreadable): such a cache is rebuilt."""
    meta = cache / "spectrain.json"
    if not ((cache / "dataset_info.json").is_file() and meta.is_file()):
        return None
    try:
        counts = json.loads(meta.read_text())
        Truncation.from_record(counts["truncation"])
        int(counts["skipped"])
    except (json.JSONDecodeError, KeyError, TypeError, ValueError):
        return None
    return counts


class DrafterDataModule(L.LightningDataModule):
    """Tokenized training data for a drafter, split deterministically into train/validation.

    Args:
        path: a ``.txt`` file, a chat ``.json``/``.jsonl`` file (ShareGPT, ``messages`` or Alpaca), a
            local HF dataset directory, or a hub dataset id (online only). ``None``: the bundled tinyshakespeare.
        format: ``auto`` picks from the path: ``.txt`` -> text, ``.json``/``.jsonl`` -> chat, a directory with
            ``train/metadata.json`` -> store (offline hidden states from ``spectrain-extract``), otherwise hf.
        tokenizer: the verifier whose tokenizer (and chat template) to use; linked to ``model.verifier``.
        gguf_file: GGUF file inside ``tokenizer``, when the verifier is one; linked to ``model.verifier_gguf_file``.
        block_size: tokens per text block; maximum length of a chat sample (longer conversations are cut, counted
            in :attr:`truncation` and warned about above 5 % of rows or loss tokens).
        batch_size: samples per batch.
        val_fraction: held-out fraction (contiguous tail for text; a seeded random subset for chat/hf).
        text_field: column holding plain text in an HF dataset.
        hf_split: split of the HF dataset to read.
        num_workers: DataLoader workers.
        seed: seed for shuffling and for the chat/hf split.
        streaming: read the data lazily instead of loading it (corpora larger than memory): ``.txt`` and HF text
            are tokenized on the fly and packed into ``block_size`` blocks, ``.jsonl`` / HF chat rows rendered one
            by one; every ``1/val_fraction``-th row is held out (see :mod:`spectrain.data.streaming`).
        shuffle_buffer: streaming: samples held in the shuffle buffer.
        group_by_length: batch training rows of similar length together (chat rows and hidden-state stores;
            text blocks are all one length), so little of each batch is padding; the order stays seeded.
    """

    def __init__(
        self,
        path: Optional[str] = None,
        format: Literal["auto", "text", "chat", "hf", "store"] = "auto",
        tokenizer: str = "bundled:tinyshakespeare",
        gguf_file: Optional[str] = None,
        block_size: int = 256,
        batch_size: int = 8,
        val_fraction: float = VAL_FRACTION,
        text_field: str = "text",
        hf_split: str = "train",
        num_workers: int = 0,
        seed: int = 0,
        streaming: bool = False,
        shuffle_buffer: int = 1024,
        group_by_length: bool = True,
    ):
        super().__init__()
        if block_size < 2:
            raise SpectrainError(f"data.block_size must be >= 2, got {block_size}")
        if batch_size < 1:
            raise SpectrainError(f"data.batch_size must be >= 1, got {batch_size}")
        if not 0.0 < val_fraction < 1.0:
            raise SpectrainError(f"data.val_fraction must be in (0, 1), got {val_fraction}")
        self.path, self.format, self.tokenizer_name, self.gguf_file = path, format, tokenizer, gguf_file
        self.block_size, self.batch_size, self.val_fraction = block_size, batch_size, val_fraction
        self.text_field, self.hf_split, self.num_workers, self.seed = text_field, hf_split, num_workers, seed
        if shuffle_buffer < 1:
            raise SpectrainError(f"data.shuffle_buffer must be >= 1, got {shuffle_buffer}")
        self.streaming, self.shuffle_buffer, self.group_by_length = streaming, shuffle_buffer, group_by_length
        self.train_set = self.val_set = None
        self.skipped = 0
        self.tokenizer = None
        self.store_meta = None
        # Rows cut at block_size (None: nothing counted) and which rows were counted: set by setup.
        self.truncation: Truncation | None = None
        self.truncation_counted = PACKED

    # -- what the data is -------------------------------------------------------------------------------------
    @property
    def data_name(self) -> str:
        return "tinyshakespeare (bundled)" if self.path is None else str(self.path)

    def resolved_format(self) -> str:
        if self.format != "auto":
            return self.format
        if self.path is None:
            return "text"
        if (Path(self.path) / "train" / "metadata.json").is_file():
            return "store"
        suffix = Path(self.path).suffix.lower()
        return {".txt": "text", ".json": "chat", ".jsonl": "chat"}.get(suffix, "hf")

    # -- loading ------------------------------------------------------------------------------------------------
    def setup(self, stage: Optional[str] = None) -> None:
        if self.train_set is not None:
            return
        self.tokenizer = load_tokenizer(self.tokenizer_name, self.gguf_file)
        fmt = self.resolved_format()
        if self.streaming:
            self.train_set, self.val_set = self._streams(fmt)
            self._warn_truncation()
            return
        if fmt == "text":
            path = bundled_text_path() if self.path is None else self.path
            self.train_set, self.val_set = text_blocks(path, self.tokenizer, self.block_size, self.val_fraction)
        elif fmt == "chat":
            self.train_set, self.val_set = self._chat_rows(self.path)
        elif fmt == "hf":
            self.train_set, self.val_set = self._hf_rows()
        elif fmt == "store":
            from .store import HiddenStateStore

            # One checksum pass per machine: data-parallel ranks on a node read the same files (sizes and
            # shapes are still checked on every rank).
            verify = int(os.environ.get("LOCAL_RANK", "0")) == 0
            self.train_set = HiddenStateStore(Path(self.path) / "train", check_checksums=verify)
            self.val_set = HiddenStateStore(Path(self.path) / "validation", check_checksums=verify)
            self.store_meta = self.train_set.meta
            self._store_truncation(Path(self.path) / "train" / "metadata.json")
        else:
            raise SpectrainError(f"unknown data.format {self.format!r}; expected auto, text, chat or hf")
        if len(self.val_set) == 0 or len(self.train_set) == 0:
            raise SpectrainError(f"{self.data_name}: too little data for a train/validation split "
                                 f"({len(self.train_set)} train, {len(self.val_set)} validation samples)")
        self._warn_truncation()

    # -- rows cut at block_size ---------------------------------------------------------------------------------
    def truncation_entry(self) -> dict:
        """What was counted (``counted``) and, where something was, :meth:`Truncation.record`'s counts: a store's
        ``metadata.json`` keeps this, a training summary adds :meth:`truncation_warning`."""
        return {"counted": self.truncation_counted, **(self.truncation.record() if self.truncation else {})}

    def truncation_warning(self) -> str | None:
        """The warning when more than 5 % of the counted rows or loss tokens are cut, else None."""
        return self.truncation.warning(self.data_name) if self.truncation else None

    def _warn_truncation(self) -> None:
        """Said at setup, before training or extraction starts, so a user can stop and raise block_size."""
        warning = self.truncation_warning()
        if warning:
            log.warning("warning: %s", warning)

    def _store_truncation(self, meta_path: Path) -> None:
        """A store's rows were cut at extraction: its metadata's record (absent in stores extracted before)."""
        entry = self.store_meta.get("truncation")
        if entry is None:
            self.truncation, self.truncation_counted = None, NOT_RECORDED
            return
        try:
            self.truncation_counted = f"at extraction, {entry['counted']}"
            self.truncation = Truncation.from_record(entry) if "rows" in entry else None
        except (KeyError, TypeError, ValueError) as e:
            raise SpectrainError(f"store metadata {meta_path}: its 'truncation' entry is not a truncation record "
                                 f"({type(e).__name__}: {e}); re-extract the store") from None

    def _streams(self, fmt: str):
        """Lazily read train/validation :class:`~spectrain.data.streaming.RowStream` s (nothing materialized)."""
        from . import streaming as st

        val_every = max(2, round(1 / self.val_fraction))
        tok, block = self.tokenizer, self.block_size
        if fmt == "text":
            path = bundled_text_path() if self.path is None else Path(self.path)
            if not path.is_file():
                raise SpectrainError(f"text data file not found: {path}")
            if path.stat().st_size == 0:
                raise SpectrainError(f"text data file is empty: {path}")
            rows, to_samples = (lambda: st.text_lines(path)), st.packed_text(tok, block)
        elif fmt == "chat":
            path = Path(self.path)
            if not path.is_file():
                raise SpectrainError(f"chat data file not found: {path}")
            if path.suffix.lower() != ".jsonl":
                raise SpectrainError(f"data.streaming reads chat data line by line: convert {path} to .jsonl "
                                     "(one conversation per line)")
            rows, to_samples = (lambda: st.jsonl_records(path)), st.chat_samples(tok, block)
            self._sample_stream_truncation(rows())
        elif fmt == "hf":
            import datasets

            try:
                ds = datasets.load_dataset(self.path, split=self.hf_split, streaming=True)
            except (FileNotFoundError, ValueError, datasets.exceptions.DatasetNotFoundError) as e:
                raise SpectrainError(f"could not stream HF dataset {self.path!r}: {e}") from None
            columns = set(ds.column_names or next(iter(ds)).keys())
            if self.text_field in columns:
                field = self.text_field
                rows = lambda: (r[field] for r in ds)  # noqa: E731
                to_samples = st.packed_text(tok, block, separator=tok.eos_token_id)
            else:
                rows, to_samples = (lambda: iter(ds)), st.chat_samples(tok, block)
                self._sample_stream_truncation(rows())
        else:
            raise SpectrainError(f"data.streaming does not apply to data.format {fmt}: a hidden-state store is "
                                 "already read shard by shard")
        train = st.RowStream(rows, to_samples, "train", val_every)
        val = st.RowStream(rows, to_samples, "validation", val_every)
        if next(iter(val), None) is None or next(iter(train), None) is None:
            raise SpectrainError(f"{self.data_name}: too little data to stream a train/validation split "
                                 f"(every {val_every}th row is held out; blocks of {block} tokens)")
        return train, val

    def _sample_stream_truncation(self, rows) -> None:
        from .streaming import sample_truncation

        self.truncation = sample_truncation(rows, self.tokenizer, self.block_size, STREAM_TRUNCATION_ROWS)
        self.truncation_counted = (f"the stream's first {STREAM_TRUNCATION_ROWS} rows, at setup "
                                   f"({self.truncation.rows} conversations with an assistant turn, train and "
                                   "validation): a stream is not read whole before training")

    def vocab_rows(self, limit: int = 4096):
        """Rows to count token frequencies over (a fixed draft vocabulary's): all of them, or a stream's first."""
        if self.streaming:
            import itertools

            return itertools.islice(iter(self.train_set), limit)
        return self.train_set

    def _split(self, ds):
        parts = ds.train_test_split(test_size=self.val_fraction, seed=self.seed, shuffle=True)
        return parts["train"], parts["test"]

    def _chat_rows(self, path):
        """Tokenized conversations, cached as a ``datasets`` Arrow table keyed by file content, tokenizer and length."""
        import datasets

        from .chat import tokenize_chat_file

        if not Path(path).is_file():
            raise SpectrainError(f"chat data file not found: {path}")
        cache = self._chat_cache_dir(path)
        cache.parent.mkdir(parents=True, exist_ok=True)
        with open(cache.parent / f".{cache.name}.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # data-parallel ranks (or two runs) asking at once: built once
            counts = _chat_cache_counts(cache)
            if counts is None:  # absent, or written before rows cut at block_size were counted: built (again)
                tokenized = tokenize_chat_file(path, self.tokenizer, self.block_size)
                if len(tokenized.rows) < 2:
                    raise SpectrainError(f"{path}: {len(tokenized.rows)} usable conversation(s); need at least 2 "
                                         "for a validation split")
                counts = {"skipped": tokenized.skipped, "truncation": tokenized.truncation.record()}
                with atomic_dir(cache, force=True) as tmp:  # complete or absent: never half a cache
                    datasets.Dataset.from_list(tokenized.rows).save_to_disk(str(tmp))
                    (tmp / "spectrain.json").write_text(json.dumps(counts))
        ds = datasets.load_from_disk(str(cache))
        self.skipped = int(counts["skipped"])
        self.truncation = Truncation.from_record(counts["truncation"])
        self.truncation_counted = ALL_CONVERSATIONS
        if self.skipped:
            log.warning("%s: skipped %d conversation(s) with no assistant turn, or whose assistant turns all fall "
                        "beyond block_size=%d tokens", path, self.skipped, self.block_size)
        return self._split(ds)

    def _chat_cache_dir(self, path) -> Path:
        from spectrain.heads.io import cache_root, sha256_files

        tok = self.tokenizer
        key = repr((tok.name_or_path, len(tok), tok.chat_template, self.block_size)).encode()
        return cache_root() / "tokenized" / f"chat-{sha256_files(path, extra=key)[:24]}"

    def _hf_rows(self):
        import datasets

        from .chat import render_chat_measured, to_messages

        if not self.path:
            raise SpectrainError("data.format=hf needs data.path (a saved dataset directory, data files or a hub id)")
        saved = Path(self.path).expanduser()
        if not saved.exists() and (self.path.count("/") != 1 or self.path.startswith((".", "/", "~"))):
            # A hub id is owner/name; anything else is a local path that is not there (yet).
            raise SpectrainError(f"data.path {self.path!r} does not exist. A hidden-state store is built with "
                                 "spectrain-extract, self-distilled chat data with spectrain-distill (docs/smollm2.md "
                                 "and docs/training.md give the commands)")
        try:
            if any((saved / marker).is_file() for marker in ("dataset_dict.json", "state.json")):
                ds = datasets.load_from_disk(self.path)
                ds = ds[self.hf_split] if isinstance(ds, datasets.DatasetDict) else ds
            else:
                ds = datasets.load_dataset(self.path, split=self.hf_split)
        except (FileNotFoundError, ValueError, KeyError, datasets.exceptions.DatasetNotFoundError) as e:
            raise SpectrainError(f"could not load HF dataset {self.path!r}: {e}") from None
        if self.text_field in ds.column_names:
            tok, block = self.tokenizer, self.block_size

            def blocks(batch):
                flat = [t for row in tok(batch[self.text_field], add_special_tokens=False)["input_ids"] for t in row]
                n = len(flat) // block * block
                return {"input_ids": [flat[i:i + block] for i in range(0, n, block)]}

            train, val = self._split(ds)
            return tuple(d.map(blocks, batched=True, remove_columns=d.column_names) for d in (train, val))
        tok, block = self.tokenizer, self.block_size

        def render(row):
            messages = to_messages(dict(row))  # datasets hands over lazy row mappings
            if not messages:
                return {"input_ids": [], "loss_mask": [], **{c: 0 for c in RENDER_COUNTS}}
            rendered = render_chat_measured(messages, tok, block)
            return {**rendered.row, **{c: getattr(rendered, c) for c in RENDER_COUNTS}}

        ds = ds.map(render, remove_columns=ds.column_names)
        self.truncation, self.truncation_counted = Truncation(block), ALL_CONVERSATIONS
        for length, loss_tokens, kept in zip(*(ds[c] for c in RENDER_COUNTS)):
            if length:  # a row with no assistant turn is not rendered (length 0)
                self.truncation.add(length, loss_tokens, kept)
        ds = ds.filter(lambda r: r["kept_loss_tokens"] > 0).remove_columns(list(RENDER_COUNTS))
        if len(ds) == 0:
            raise SpectrainError(f"HF dataset {self.path!r} has no column {self.text_field!r} and no usable conversations")
        return self._split(ds)

    # -- batches ------------------------------------------------------------------------------------------------
    def collate(self, rows: list[dict]) -> dict[str, torch.Tensor]:
        """Right-pad to the longest row; pads get attention 0 and loss 0. Store rows: :func:`~.store.collate_store`."""
        if "hidden" in rows[0]:
            from .store import collate_store

            return collate_store(rows)
        length = max(len(r["input_ids"]) for r in rows)
        pad = self.tokenizer.pad_token_id if self.tokenizer is not None else 0
        input_ids = torch.full((len(rows), length), pad, dtype=torch.long)
        attention = torch.zeros((len(rows), length), dtype=torch.long)
        loss_mask = torch.zeros((len(rows), length), dtype=torch.long)
        for i, r in enumerate(rows):
            n = len(r["input_ids"])
            input_ids[i, :n] = torch.tensor(r["input_ids"])
            attention[i, :n] = 1
            loss_mask[i, :n] = torch.tensor(r["loss_mask"]) if "loss_mask" in r else 1
        return {"input_ids": input_ids, "attention_mask": attention, "loss_mask": loss_mask}

    def train_dataloader(self):
        """Seeded, rank-sharded batches that resume mid-epoch from the trainer's step (:mod:`.loader`)."""
        from .loader import ResumableLoader

        def position() -> int:
            trainer = getattr(self, "trainer", None)
            return 0 if trainer is None else trainer.global_step * trainer.accumulate_grad_batches

        if self.streaming:
            from .streaming import StreamingLoader

            return StreamingLoader(self.train_set, self.batch_size, self.collate, seed=self.seed, position=position,
                                   shuffle_buffer=self.shuffle_buffer)
        return ResumableLoader(self.train_set, self.batch_size, self.collate, seed=self.seed, position=position,
                               num_workers=self.num_workers, lengths=self.train_lengths())

    def train_lengths(self) -> list[int] | None:
        """Row lengths to group training batches by: a store's or chat rows'; ``None`` for equal-length text blocks
        (and when ``group_by_length`` is off)."""
        if not self.group_by_length:
            return None
        if hasattr(self.train_set, "lengths"):  # a hidden-state store: from its offsets, no row read
            return self.train_set.lengths()
        if "loss_mask" in getattr(self.train_set, "column_names", ()):  # rendered chat rows (file or HF dataset)
            return [len(ids) for ids in self.train_set["input_ids"]]
        return None

    def val_dataloader(self) -> DataLoader:
        """This rank's share of the validation rows (rows rank, rank + world, ...), padded with target-free rows
        to the same number of rows on every rank: the ranks' summed counts equal one process's."""
        rank, world = rank_and_world()
        rows = self.val_set
        if world > 1:
            rows = RankShare(rows, rank, world) if is_map_style(rows) else EveryNth(rows, rank, world)
        return DataLoader(rows, batch_size=self.batch_size, shuffle=False, collate_fn=self.collate,
                          num_workers=self.num_workers, pin_memory=torch.cuda.is_available(),
                          generator=torch.Generator().manual_seed(self.seed))
