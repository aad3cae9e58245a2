"""Validation counts every drafter family shares: the joint chain statistics (how far a chain of drafts matches
the verifier) and the sums of every count over ranks. Helpers of :class:`~.base.DrafterModule`."""

from __future__ import annotations

import torch


def chain_counts(hits: list[torch.Tensor], masks: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    """Joint chain statistics: depth j is reached only if depths 1..j all match the verifier.

    Args:
        hits, masks: per depth j, (B, n_j) top-1 matches and target validity; n_j shrinks with depth.
    Returns:
        counts over the positions where every depth has a target: ``chain_n``, ``chain_len`` (sum of
        leading matches) and ``chain_ge_j`` (chains reaching past depth j).
    """
    n_pos = min(h.shape[1] for h in hits)
    chain_ok = torch.ones_like(hits[0][:, :n_pos])
    leading = torch.ones_like(chain_ok)
    length = torch.zeros_like(hits[0][:, :n_pos], dtype=torch.long)
    for hit, mask in zip(hits, masks):
        chain_ok &= mask[:, :n_pos]
        leading &= hit[:, :n_pos]
        length += leading.long()
    counts = {"chain_n": chain_ok.sum(), "chain_len": (length * chain_ok).sum()}
    for j in range(len(hits)):
        counts[f"chain_ge_{j}"] = ((length > j) & chain_ok).sum()
    return counts


def reduce_sums(sums: dict[str, torch.Tensor], strategy, world: int, device) -> dict[str, torch.Tensor]:
    """Validation count sums added over ranks. A rank that saw no batch (or no key another rank saw) adds zeros
    of the same shape, so every rank enters the same reductions in the same order. A collective when
    ``world > 1``."""
    if world > 1:
        shapes: list = [None] * world
        torch.distributed.all_gather_object(shapes, {k: tuple(v.shape) for k, v in sums.items()})
        union = {k: shape for rank in shapes for k, shape in rank.items()}
        sums = {k: sums[k] if k in sums else torch.zeros(union[k], dtype=torch.float64, device=device)
                for k in sorted(union)}
    return {k: strategy.reduce(v, reduce_op="sum") for k, v in sums.items()}
