"""The verifier's side of a drafter's loss: its features of a batch, the training vocabulary, the frozen
``lm_head`` rows a loss projects onto, and the teacher (the verifier's next-token distributions) a loss compares
the drafter's against.

Helpers of :class:`~.base.DrafterModule`, which keeps the state (the verifier, the ``train_rows`` /
``to_train_row`` buffers, a :class:`FrozenRows` cache) and calls them; nothing here knows a drafter family.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from spectrain.heads.errors import SpectrainError
from spectrain.heads.verifier import LogitTransform, verifier_features
from spectrain.heads.vocab import most_frequent, token_counts

from .losses import projected_topk, sparse_teacher


def batch_features(verifier: torch.nn.Module, batch: dict, layer_ids: Sequence[int],
                   store_layers: Optional[Sequence[int]], greedy: bool, chunk_size: int) -> dict[str, torch.Tensor]:
    """Verifier features of a batch: ``hidden`` (B, T, H) last hidden state, ``layers`` (the ``layer_ids``
    ``hidden_states``, each (B, T, H)) and, where ``greedy`` asks, ``greedy`` (B, T) next tokens.

    A batch from an offline store (``hidden`` and ``aux`` (B, T, H * len(store_layers)) in it: the verifier ran in
    ``spectrain-extract``) is read, not recomputed; its ``greedy`` and top-k teacher (``topk_ids``,
    ``topk_logprobs``, (B, T, k)) pass through. The greedy tokens cost a projection onto the whole vocabulary
    (chunked by ``chunk_size`` rows): computed only when asked for and not carried by the batch.
    """
    head = verifier.get_output_embeddings()
    out: dict[str, torch.Tensor] = {}
    if "hidden" in batch:  # offline store: the verifier already ran (spectrain-extract)
        if store_layers is None:
            raise SpectrainError("a batch from a hidden-state store was given before the store was checked "
                                 "(DrafterModule.use_store)")
        dtype = head.weight.dtype
        last = batch["hidden"].to(dtype)
        width = last.shape[-1]
        stored = list(store_layers)
        layers = [batch["aux"][..., stored.index(i) * width:(stored.index(i) + 1) * width].to(dtype)
                  for i in layer_ids]
        out.update({k: batch[k] for k in ("greedy", "topk_ids", "topk_logprobs") if k in batch})
    else:
        last, layers = verifier_features(verifier, batch["input_ids"], batch.get("attention_mask"), tuple(layer_ids))
    out.update(hidden=last, layers=layers)
    if greedy and "greedy" not in out:
        out["greedy"] = projected_topk(last, head.weight, head.bias, k=1, chunk_size=chunk_size)[..., 0]
    return out


def training_vocabulary(rows, vocab: int, size: Optional[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The ``size`` most frequent loss-masked tokens of ``rows`` over a vocabulary of ``vocab`` ids.

    Returns ``(counts, ids, to_row)``: (vocab,) token counts, (N,) the chosen ids (ranked by :func:`most_frequent`,
    the rule every draft vocabulary follows), (vocab,) each id's row among them or -1 outside.
    """
    counts = token_counts(rows, vocab)
    ids = most_frequent(counts, size)
    to_row = torch.full((counts.shape[0],), -1, dtype=torch.long)
    to_row[ids] = torch.arange(ids.shape[0])
    return counts, ids, to_row


class FrozenRows:
    """The row subset of a frozen projection (the verifier's ``lm_head``), made once and kept: it never changes,
    so neither its gathered rows nor their cast are redone every chunk of every step. One subset is kept at a time
    (a loss reads one per step). Not moved by ``.to()``: :meth:`clear` it when the projection moves or is cast."""

    def __init__(self):
        self._cache: dict = {}

    def clear(self) -> None:
        self._cache = {}

    def get(self, head: torch.nn.Module, rows: Optional[torch.Tensor],
            version: object = None) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """(weight (N, H), bias (N,) or None) of ``head`` restricted to ``rows`` (N,) (all if None).

        ``version`` identifies the row set when ``rows`` is rebuilt per call (default: the tensor itself)."""
        if rows is None:
            return head.weight, head.bias
        key = (id(head), head.weight.device, head.weight.dtype, rows.shape[0],
               rows.data_ptr() if version is None else version)
        if key not in self._cache:
            rows = rows.to(head.weight.device)
            self._cache = {key: (head.weight[rows].detach().contiguous(),
                                 None if head.bias is None else head.bias[rows].detach().contiguous())}
        return self._cache[key]


def sparse_targets(features: dict, start: int, rows: torch.Tensor,
                   to_projected: Optional[torch.Tensor]) -> dict[str, torch.Tensor]:
    """A store's top-k teacher at positions ``start .. T-2`` (flattened, then ``rows`` (N,) of them) mapped into
    the projected rows (``to_projected``: (V,) -> row or -1; None: the whole vocabulary): ``sparse_ids`` and
    ``sparse_probs``, (N, k). No projection at all."""
    end = features["hidden"].shape[1] - 1
    width = features["topk_ids"].shape[-1]
    ids, probs = sparse_teacher(features["topk_ids"][:, start:end].reshape(-1, width)[rows],
                                features["topk_logprobs"][:, start:end].reshape(-1, width)[rows], to_projected)
    return {"sparse_ids": ids, "sparse_probs": probs}


def dense_targets(hidden: torch.Tensor, start: int, rows: torch.Tensor, weight: torch.Tensor,
                  bias: Optional[torch.Tensor], transform: LogitTransform) -> dict[str, torch.Tensor]:
    """The dense teacher: the verifier's last hidden states ``hidden`` (B, T, H) at positions ``start .. T-2``
    (flattened, then ``rows`` (N,) of them) with the (V', H) ``weight`` / (V',) ``bias`` they are projected by
    and the verifier head's ``transform`` of its logits (soft-cap, scale; None when it has none)."""
    end = hidden.shape[1] - 1
    return {"teacher_states": hidden[:, start:end].reshape(-1, hidden.shape[-1])[rows], "teacher_weight": weight,
            "teacher_bias": bias, "teacher_transform": None if transform.identity else transform}
