"""Vocabulary-projection losses and metrics computed in chunks.

A drafter's logits over all heads x batch x sequence x vocabulary do not fit in
memory for real vocabularies (3 heads x 1024 tokens x 128K x fp32 = 1.5 GB, and
autograd keeps more). Every function here projects a chunk of rows at a time;
the training loss wraps each chunk in activation checkpointing so its logits
are recomputed in backward instead of kept, and peak memory stays at one chunk.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint


def _at_least_fp32(x: torch.Tensor) -> torch.Tensor:
    """Softmax in fp32 (or better): bf16 log-probabilities over a large vocabulary lose the tail."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


def _chunk_cross_entropy(states, weight, bias, target_ids, teacher_states, teacher_weight, teacher_bias):
    """Summed CE of ``states @ weight.T`` against hard ids or the teacher's softmax (rows of one chunk)."""
    logits = _at_least_fp32(F.linear(states.to(weight.dtype), weight, bias))
    if teacher_states is None:
        return F.cross_entropy(logits, target_ids, reduction="sum")
    with torch.no_grad():
        teacher_probs = _at_least_fp32(F.linear(teacher_states, teacher_weight, teacher_bias)).softmax(-1)
    return F.cross_entropy(logits, teacher_probs, reduction="sum")


def projected_cross_entropy(
    states: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    target_ids: torch.Tensor | None = None,
    teacher_states: torch.Tensor | None = None,
    teacher_weight: torch.Tensor | None = None,
    teacher_bias: torch.Tensor | None = None,
    chunk_size: int | None = 256,
) -> torch.Tensor:
    """Mean cross-entropy of ``states @ weight.T (+ bias)`` over rows, without keeping full logits.

    Args:
        states: (N, H) rows to score (already restricted to loss-masked positions).
        weight, bias: (V, H), (V,) the vocabulary projection.
        target_ids: (N,) hard targets, or
        teacher_states, teacher_weight, teacher_bias: (N, H'), (V, H'), (V,) whose softmax is the soft target.
        chunk_size: rows per chunk; ``None`` computes everything at once (reference path for tests/benchmarks).
    Returns:
        scalar mean loss (0 with a graph when N == 0).
    """
    n = states.shape[0]
    if n == 0:
        return states.sum() * 0.0
    if (target_ids is None) == (teacher_states is None):
        raise ValueError("give exactly one of target_ids or teacher_states")
    if chunk_size is None:
        return _chunk_cross_entropy(states, weight, bias, target_ids, teacher_states, teacher_weight, teacher_bias) / n
    total = states.new_zeros((), dtype=torch.promote_types(states.dtype, torch.float32))
    for start in range(0, n, chunk_size):
        rows = slice(start, start + chunk_size)
        total = total + checkpoint(
            _chunk_cross_entropy, states[rows], weight, bias,
            None if target_ids is None else target_ids[rows],
            None if teacher_states is None else teacher_states[rows], teacher_weight, teacher_bias,
            use_reentrant=False,
        )
    return total / n


@torch.no_grad()
def projected_topk(states: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, k: int = 1,
                   chunk_size: int = 4096) -> torch.Tensor:
    """Top-k token ids of ``states @ weight.T``: (..., H) -> (..., k), one chunk of rows at a time."""
    flat = states.reshape(-1, states.shape[-1])
    out = torch.empty(flat.shape[0], k, dtype=torch.long, device=states.device)
    for start in range(0, flat.shape[0], chunk_size):
        logits = F.linear(flat[start:start + chunk_size].to(weight.dtype), weight, bias)
        out[start:start + chunk_size] = logits.topk(k, dim=-1).indices
    return out.view(*states.shape[:-1], k)
