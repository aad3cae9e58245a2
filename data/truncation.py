"""Rows cut at the block size, counted and reported: no silent truncation.

Training, extraction and distillation render chat rows with the verifier's chat template and keep at most
``block_size`` tokens of each; a row longer than that loses its tail (its last replies, and the end-of-turn marker
the drafter must learn). :class:`Truncation` counts such rows and the loss tokens they lose; :meth:`warning` says
so, with the numbers and the block sizes that would keep them, when more than :data:`WARN_FRACTION` of the rows or
of the loss tokens are cut.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

WARN_FRACTION = 0.05  # above 5 % of rows or of loss tokens cut, the summary warns
KEPT_FRACTIONS = (0.95, 1.0)  # the block sizes a record names: keeping 95 % of rows whole, and every row
RECORD_KEEPING = {0.95: "block_size_keeping_95pct", 1.0: "block_size_keeping_all"}  # record() key per fraction


@dataclass
class Truncation:
    """Counts over rendered rows against one ``block_size``.

    ``add(length, loss_tokens, kept_loss_tokens)`` takes each row's full rendered length in tokens, its loss
    (assistant) tokens before the cut and those within the block; the lengths of the cut rows are kept so the
    report can name the block size that would keep them.
    """

    block_size: int
    rows: int = 0
    rows_cut: int = 0
    loss_tokens: int = 0
    loss_tokens_cut: int = 0
    lengths: list[int] = field(default_factory=list, repr=False)
    # A counter read back from a record has no lengths: the block sizes that keep 95 % / all rows whole are the
    # recorded ones, {fraction: block size}.
    recorded_keeping: dict[float, int] = field(default_factory=dict, repr=False)

    def add(self, length: int, loss_tokens: int = 0, kept_loss_tokens: int | None = None) -> None:
        self.rows += 1
        self.lengths.append(int(length))
        self.loss_tokens += int(loss_tokens)
        if length > self.block_size:
            self.rows_cut += 1
            kept = loss_tokens if kept_loss_tokens is None else kept_loss_tokens
            self.loss_tokens_cut += int(loss_tokens) - int(kept)

    def merge(self, other: "Truncation") -> "Truncation":
        """Both counts together (the same block size)."""
        if other.block_size != self.block_size:
            raise ValueError(f"block sizes differ: {self.block_size} vs {other.block_size}")
        # Read-back counters keep only the 95 % / all sizes: the larger of two is a size that keeps at least
        # that fraction of both together (exact for "all").
        recorded = {f: max(self.block_size_keeping(f), other.block_size_keeping(f)) for f in KEPT_FRACTIONS} \
            if self.recorded_keeping or other.recorded_keeping else {}
        return Truncation(self.block_size, self.rows + other.rows, self.rows_cut + other.rows_cut,
                          self.loss_tokens + other.loss_tokens, self.loss_tokens_cut + other.loss_tokens_cut,
                          self.lengths + other.lengths, recorded)

    @property
    def row_fraction(self) -> float:
        return self.rows_cut / self.rows if self.rows else 0.0

    @property
    def loss_token_fraction(self) -> float:
        return self.loss_tokens_cut / self.loss_tokens if self.loss_tokens else 0.0

    def block_size_keeping(self, fraction: float) -> int:
        """The smallest block size that keeps at least ``fraction`` of the rows whole (1.0: every row)."""
        counted = sorted(self.lengths)[max(math.ceil(fraction * len(self.lengths)) - 1, 0)] if self.lengths else 0
        if self.recorded_keeping:  # read back (or merged with such): the recorded size bounds the rows not counted here
            return max(self.recorded_keeping.get(fraction, self.block_size), counted)
        return counted if self.lengths else self.block_size

    def record(self) -> dict:
        """What a summary JSON keeps: the counts, fractions and the block sizes that keep 95 % / all rows whole."""
        out = {k: v for k, v in asdict(self).items() if k not in ("lengths", "recorded_keeping")}
        out.update(row_fraction=round(self.row_fraction, 4), loss_token_fraction=round(self.loss_token_fraction, 4),
                   **{key: self.block_size_keeping(f) for f, key in RECORD_KEEPING.items()})
        return out

    @classmethod
    def from_record(cls, record: dict) -> "Truncation":
        """A counter back from :meth:`record` (a chat cache's or a store's metadata): the counts as they were, the
        block sizes keeping 95 % / all rows as recorded (the row lengths are not kept). Raises ``KeyError`` /
        ``TypeError`` / ``ValueError`` on a record that is not one; callers name the file."""
        counts = {k: int(record[k]) for k in ("block_size", "rows", "rows_cut", "loss_tokens", "loss_tokens_cut")}
        return cls(**counts, recorded_keeping={f: int(record[key]) for f, key in RECORD_KEEPING.items()})

    def describe(self) -> str:
        """One line of the counts: rows and loss tokens cut, against the block size."""
        return (f"{self.rows_cut} of {self.rows} rows cut at block_size={self.block_size} "
                f"({100 * self.row_fraction:.1f} %), {self.loss_tokens_cut} of {self.loss_tokens} loss tokens "
                f"({100 * self.loss_token_fraction:.1f} %)")

    def warning(self, what: str) -> str | None:
        """A warning naming the numbers when more than 5 % of rows or of loss tokens are cut, else None."""
        if self.row_fraction <= WARN_FRACTION and self.loss_token_fraction <= WARN_FRACTION:
            return None
        return (f"{what}: {self.rows_cut} of {self.rows} rows ({100 * self.row_fraction:.1f} %) are longer than "
                f"block_size={self.block_size} and are cut, losing {self.loss_tokens_cut} of {self.loss_tokens} loss "
                f"tokens ({100 * self.loss_token_fraction:.1f} %); block_size={self.block_size_keeping(0.95)} keeps "
                f"95 % of rows whole, block_size={self.block_size_keeping(1.0)} keeps every row")
