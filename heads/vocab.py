"""Frequency-ranked vocabularies: which verifier tokens a drafter drafts over.

A drafter's vocabulary projection is most of a draft step's cost on a small verifier (SmolLM2: the 49,152 x 576
``lm_head`` is ~87% of a one-layer drafter's step). Restricting the *draft* head to the N most frequent tokens of the
training data (FR-Spec; a fixed draft vocabulary; SGLang's ``--speculative-token-map``) cuts that cost while
the verifier still verifies over the full vocabulary, so decoding stays lossless: the drafter's p is zero
outside its rows, and the acceptance rule only ever proposes tokens it has.

One rule picks the rows everywhere (training vocabulary, fixed draft vocabulary, ranked draft heads):
:func:`most_frequent` (ties: the lower id). A drafter keeps the counts it was trained on in
``vocab_ranking.json`` beside its weights (:func:`save_ranking` / :func:`load_ranking`), so any N can be chosen
at evaluation time; its default N is the vocabulary it trained over.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from .errors import SpectrainError
from .io import read_json, write_json

RANKING_FILE = "vocab_ranking.json"  # not *.safetensors: engines load every safetensors file of a directory
RANKING_FORMAT = 1


def most_frequent(token_counts: torch.Tensor, n: int) -> torch.Tensor:
    """(n,) int64 ids of the n largest counts, ascending; equal counts go to the lower id (deterministic)."""
    order = torch.sort(torch.as_tensor(token_counts).flatten().double(), descending=True, stable=True).indices
    return order[:n].sort().values.to(torch.int64)


def build_vocab_map(token_counts: torch.Tensor, draft_vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The draft vocabulary: the ``draft_vocab_size`` most frequent tokens (ties: lower id first).

    Args:
        token_counts: (V,) occurrences of each verifier token id in the training data.
    Returns:
        d2t (D,) int64 with ``target_id = i + d2t[i]`` (draft ids sorted by target id), and
        t2d (V,) bool, True for target ids in the draft vocabulary.
    """
    counts = torch.as_tensor(token_counts).flatten()
    vocab = counts.numel()
    if not isinstance(draft_vocab_size, int) or isinstance(draft_vocab_size, bool) or draft_vocab_size < 1:
        raise SpectrainError(f"draft_vocab_size must be an integer >= 1, got {draft_vocab_size!r}")
    if draft_vocab_size > vocab:
        raise SpectrainError(f"draft_vocab_size {draft_vocab_size} exceeds the {vocab} token counts given")
    chosen = most_frequent(counts, draft_vocab_size)
    d2t = chosen - torch.arange(draft_vocab_size, dtype=torch.int64)
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[chosen] = True
    return d2t, t2d


def check_vocab_map(d2t: torch.Tensor, t2d: torch.Tensor, vocab_size: int, draft_vocab_size: int) -> None:
    """Raise unless d2t/t2d describe ``draft_vocab_size`` distinct target ids, ascending, marked in t2d."""
    if d2t.shape != (draft_vocab_size,) or d2t.dtype != torch.int64:
        raise SpectrainError(f"d2t must be int64 of shape ({draft_vocab_size},), got {d2t.dtype} {tuple(d2t.shape)}")
    if t2d.shape != (vocab_size,) or t2d.dtype != torch.bool:
        raise SpectrainError(f"t2d must be bool of shape ({vocab_size},), got {t2d.dtype} {tuple(t2d.shape)}")
    target = torch.arange(draft_vocab_size, device=d2t.device) + d2t
    if target.min() < 0 or target.max() >= vocab_size or (target.diff() <= 0).any():
        raise SpectrainError("d2t must map draft ids to ascending, distinct target ids in the verifier's vocabulary")
    if int(t2d.sum()) != draft_vocab_size or not t2d[target.to(t2d.device)].all():
        raise SpectrainError("t2d must mark exactly the target ids that d2t maps to")


@dataclass
class Ranking:
    """Token counts of a drafter's training data and the draft vocabulary size it defaults to.

    ``counts`` (V,) int64; ``default_size`` 0 = the full vocabulary (the drafter trained over all of it)."""

    counts: torch.Tensor
    default_size: int = 0
    source: str = ""

    @property
    def vocab_size(self) -> int:
        return self.counts.numel()

    def ids(self, n: int | None = None) -> torch.Tensor | None:
        """(n,) ascending int64 target ids of the n most frequent tokens, or None for the full vocabulary
        (n = 0, or n >= V). ``n=None``: the default size."""
        n = self.default_size if n is None else n
        return ranked_ids(self.counts, n)


def ranked_ids(counts: torch.Tensor, n: int) -> torch.Tensor | None:
    """The n most frequent ids of ``counts`` (ascending), None when n is 0 or covers the whole vocabulary."""
    if not isinstance(n, int) or isinstance(n, bool) or n < 0:
        raise SpectrainError(f"a draft vocabulary size must be an integer >= 0 (0 = full), got {n!r}")
    counts = torch.as_tensor(counts).flatten()
    if n == 0 or n >= counts.numel():
        return None
    return most_frequent(counts, n)


def save_ranking(directory: str | Path, counts: torch.Tensor, default_size: int = 0, source: str = "") -> Path:
    """Write ``vocab_ranking.json`` (nonzero counts only) into ``directory``, atomically."""
    counts = torch.as_tensor(counts).flatten().to(torch.int64)
    nonzero = counts.nonzero().flatten()
    path = Path(directory) / RANKING_FILE
    write_json(path, {"format": RANKING_FORMAT, "vocab_size": counts.numel(), "default_size": int(default_size or 0),
                      "source": source, "ids": nonzero.tolist(), "counts": counts[nonzero].tolist()})
    return path


def load_ranking(directory: str | Path) -> Ranking | None:
    """The drafter's :class:`Ranking` from ``directory``, or None when it has none (an older drafter)."""
    path = Path(directory) / RANKING_FILE
    if not path.is_file():
        return None
    raw = read_json(path)
    try:
        if raw["format"] != RANKING_FORMAT:
            raise SpectrainError(f"{path}: ranking format {raw['format']!r}, this spectrain reads {RANKING_FORMAT}")
        vocab, ids, values = int(raw["vocab_size"]), raw["ids"], raw["counts"]
        counts = torch.zeros(vocab, dtype=torch.int64)
        if len(ids) != len(values):
            raise SpectrainError(f"{path}: {len(ids)} ids but {len(values)} counts")
        if ids:
            index = torch.tensor(ids, dtype=torch.int64)
            if index.min() < 0 or index.max() >= vocab:
                raise SpectrainError(f"{path}: token ids outside the vocabulary of {vocab}")
            counts[index] = torch.tensor(values, dtype=torch.int64)
        default = int(raw.get("default_size", 0))
    except (KeyError, TypeError, ValueError) as err:
        raise SpectrainError(f"{path} is not a vocabulary ranking ({type(err).__name__}: {err})") from None
    if not 0 <= default <= vocab:
        raise SpectrainError(f"{path}: default_size {default} outside 0..{vocab}")
    return Ranking(counts=counts, default_size=default, source=str(raw.get("source", "")))


def token_counts(rows, vocab_size: int) -> torch.Tensor:
    """(V,) int64 counts of the loss-masked tokens (all tokens where a row has no ``loss_mask``) over ``rows``."""
    kept = []
    for row in rows:
        ids = torch.as_tensor(row["input_ids"]).reshape(-1)
        kept.append(ids[torch.as_tensor(row["loss_mask"]).reshape(-1).bool()] if "loss_mask" in row else ids)
    ids = torch.cat(kept) if kept else torch.zeros(0, dtype=torch.long)
    return torch.bincount(ids.long(), minlength=vocab_size)[:vocab_size]


def coverage(counts: torch.Tensor, n: int) -> float:
    """Fraction of the counted tokens that the n most frequent ids cover (1.0 for n = 0: the full vocabulary)."""
    counts = torch.as_tensor(counts).flatten()
    ids = ranked_ids(counts, n)
    total = int(counts.sum())
    return 1.0 if ids is None or total == 0 else float(counts[ids].sum()) / total
