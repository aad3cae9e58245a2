"""Corpora larger than memory: rows read lazily, text packed into blocks on the fly, nothing materialized.

``--data.streaming true`` swaps the data module's in-memory datasets for these iterables:

* text (a ``.txt`` file, read line by line, or an HF dataset's text column via ``load_dataset(...,
  streaming=True)``): lines are tokenized as they are read and **packed** — concatenated (documents of an HF
  dataset joined with the EOS token) and cut into blocks of exactly ``block_size`` tokens, so no padding is
  wasted;
* chat (``.jsonl`` read line by line, or HF ``messages``/``conversations`` rows): one rendered, loss-masked
  conversation per sample, cut at ``block_size``; the rows cut are counted over the stream's first rows at setup
  (:func:`sample_truncation`), the stream itself is not read whole before training.

The split is by row: every ``val_every``-th row is held out (``val_every = round(1 / val_fraction)``), so
train and validation never share a row and the split needs no pass over the data. Batches for training come
from :class:`StreamingLoader`: seeded shuffling inside a bounded buffer, rank-sharded by batch, resumable by
skipping the batches the restored step says were consumed (the stream is re-read, never held).
"""

from __future__ import annotations

import itertools
import json
import random
from pathlib import Path
from typing import Callable, Iterable, Iterator

import torch
from torch.utils.data import IterableDataset

from spectrain.heads.errors import SpectrainError

from .loader import rank_and_world
from .truncation import Truncation


def text_lines(path: str | Path) -> Iterator[str]:
    """Lines of a UTF-8 text file, newline kept, read lazily; a clear error at the first bad byte."""
    path = Path(path)
    line_no = 0
    try:
        with open(path, encoding="utf-8") as f:
            for line_no, line in enumerate(f, 1):
                yield line
    except UnicodeDecodeError as e:
        raise SpectrainError(f"text data file {path} is not UTF-8 text ({e.reason} near line {line_no + 1})") from None


def jsonl_records(path: str | Path) -> Iterator[dict]:
    path = Path(path)
    with open(path, encoding="utf-8") as f:
        for i, line in enumerate(f, 1):
            if line.strip():
                try:
                    yield json.loads(line)
                except json.JSONDecodeError as e:
                    raise SpectrainError(f"{path}, line {i}: not valid JSON ({e.msg})") from None


class RowStream(IterableDataset):
    """Samples ``{"input_ids", "loss_mask"?}`` from a lazily read source, one split of it.

    Args:
        rows: callable returning a fresh iterator over raw rows (str lines or dict records) — called once per pass.
        to_samples: raw rows (an iterator) -> samples (an iterator); packing happens here for text.
        split: ``train`` or ``validation``.
        val_every: row i is held out when ``i % val_every == val_every - 1``.
    """

    def __init__(self, rows: Callable[[], Iterable], to_samples: Callable[[Iterator], Iterator[dict]],
                 split: str, val_every: int):
        if val_every < 2:
            raise SpectrainError(f"streaming needs val_fraction <= 0.5, got 1/{val_every}")
        self.rows, self.to_samples, self.split, self.val_every = rows, to_samples, split, val_every

    def _mine(self, rank: int = 0, world: int = 1) -> Iterator:
        """This split's raw rows; of those, rows rank, rank + world, ... (one data-parallel rank's share)."""
        held_out = self.split == "validation"
        kept = 0
        for i, row in enumerate(self.rows()):
            if (i % self.val_every == self.val_every - 1) == held_out:
                if kept % world == rank:
                    yield row
                kept += 1

    def __iter__(self) -> Iterator[dict]:
        return self.to_samples(self._mine())

    def shard(self, rank: int, world: int) -> Iterator[dict]:
        """Samples from this rank's share of the rows only: each rank tokenizes and packs its own rows."""
        return self.to_samples(self._mine(rank, world))


def packed_text(tokenizer, block_size: int, separator: int | None = None):
    """raw text rows -> ``block_size`` token blocks, concatenated across rows (``separator`` between rows)."""

    def to_samples(rows: Iterator[str]) -> Iterator[dict]:
        buffer: list[int] = []
        for text in rows:
            buffer.extend(tokenizer(text, add_special_tokens=False)["input_ids"])
            if separator is not None:
                buffer.append(separator)
            while len(buffer) >= block_size:
                yield {"input_ids": buffer[:block_size]}
                del buffer[:block_size]
    return to_samples


def chat_samples(tokenizer, block_size: int, truncation: Truncation | None = None):
    """raw chat records -> rendered, loss-masked conversations cut to ``block_size`` (those left with no target
    dropped); every conversation rendered is counted into ``truncation`` when one is given."""
    from .chat import render_chat_measured, to_messages

    def to_samples(rows: Iterator[dict]) -> Iterator[dict]:
        for row in rows:
            messages = to_messages(dict(row))
            if not messages:
                continue
            rendered = render_chat_measured(messages, tokenizer, block_size)
            if truncation is not None:
                rendered.count_into(truncation)
            if rendered.kept_loss_tokens > 0:
                yield rendered.row
    return to_samples


def sample_truncation(rows: Iterable[dict], tokenizer, block_size: int, limit: int) -> Truncation:
    """Rows cut at ``block_size`` among the first ``limit`` raw chat rows of a stream (both splits): a stream is
    not read whole before training, so its count is this prefix's, rendered as training renders it."""
    truncation = Truncation(block_size)
    for _ in chat_samples(tokenizer, block_size, truncation)(itertools.islice(iter(rows), limit)):
        pass
    return truncation


class StreamingLoader:
    """Training batches from a :class:`RowStream`: shuffled in a bounded buffer, sharded, resumable.

    Each data-parallel rank reads, tokenizes and packs only its own rows (raw rows rank, rank + world, ... of
    the split: :meth:`RowStream.shard`), so no rank does another's work. Pass p over a rank's share shuffles
    with seed ``seed + p`` inside a buffer of ``shuffle_buffer`` samples (memory stays bounded).
    ``position()`` (batches already trained on, per rank) is read when iteration starts, and that many of this
    rank's batches are skipped. Each rank cycles its share, so training length is set by ``max_steps`` and
    ranks never run out of batches at different times.
    """

    def __init__(self, stream: RowStream, batch_size: int, collate_fn: Callable, seed: int = 0,
                 position: Callable[[], int] | None = None, shuffle_buffer: int = 1024):
        self.stream, self.batch_size, self.collate_fn = stream, batch_size, collate_fn
        self.seed, self.position, self.shuffle_buffer = seed, position or (lambda: 0), shuffle_buffer

    def _shuffled(self, samples: Iterator[dict], rng: random.Random) -> Iterator[dict]:
        buffer: list[dict] = []
        for sample in samples:
            buffer.append(sample)
            if len(buffer) >= self.shuffle_buffer:
                yield buffer.pop(rng.randrange(len(buffer)))
        rng.shuffle(buffer)
        yield from buffer

    def _batches(self) -> Iterator[list[dict]]:
        rank, world = rank_and_world()
        for epoch in itertools.count():
            samples = self._shuffled(self.stream.shard(rank, world), random.Random(self.seed + epoch))
            produced = 0
            while True:
                rows = list(itertools.islice(samples, self.batch_size))
                if len(rows) < self.batch_size:
                    break  # drop the last partial batch, as the in-memory loader does
                produced += 1
                yield rows
            if produced == 0:
                raise SpectrainError(f"rank {rank}'s share of the training stream holds less than one batch "
                                     f"({self.batch_size} samples from every {world}th row)")

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        batches = itertools.islice(self._batches(), int(self.position()), None)
        return (self.collate_fn(rows) for rows in batches)

    # Stateful for Lightning (see ResumableLoader): the position comes from the restored step.
    def state_dict(self) -> dict:
        return {"batch_size": self.batch_size, "seed": self.seed, "streaming": True}

    def load_state_dict(self, state: dict) -> None:
        if state != self.state_dict():
            raise SpectrainError(f"the training data settings changed since the checkpoint ({state} then, "
                                 f"{self.state_dict()} now); pass --force to start over")
