"""Vocabulary-projection losses and metrics, chunked only when memory needs it.

A drafter's logits over all heads x batch x sequence x vocabulary can exceed memory for real vocabularies
(3 heads x 1024 tokens x 128K x fp32 = 1.5 GB, and autograd keeps more). :func:`projected_cross_entropy`
therefore either projects every row at once and keeps its logits for backward (fast: one large matmul, no
recompute), or, when those logits would not fit a memory budget, one chunk at a time under activation
checkpointing, so each chunk's logits are recomputed in backward and peak memory stays at one chunk.
:func:`logits_bytes` / :func:`default_memory_budget` let the caller decide.

Precision: the projection may run in bf16 (under autocast or with bf16 weights); the logits are cast to fp32
before every softmax / log-softmax / cross-entropy here, because a bf16 log-softmax over tens of thousands of
tokens loses the tail of the distribution and the loss it feeds.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

# Bytes autograd keeps per logit when a projection is not recomputed: the bf16/fp32 linear output, its fp32 copy
# and the fp32 log-softmax saved for backward (an upper bound; fp32 projections keep less).
BYTES_PER_KEPT_LOGIT = 10


def _fp32(x: torch.Tensor) -> torch.dtype:
    """The dtype softmaxes run in: fp32 (or better): bf16 log-probabilities over a large vocabulary lose the tail."""
    return torch.promote_types(x.dtype, torch.float32)


class _SoftTargetCrossEntropy(torch.autograd.Function):
    """Summed ``-sum_v p_v log softmax(z)_v`` over rows, for logits z of any float dtype (bf16 from the projection).

    The log-softmax runs in fp32 inside one kernel (no fp32 copy of z), the loss is one dot product (no (N, V)
    product temporary) and the gradient ``softmax(z) * sum(p) - p`` one expression: on a CPU these (N, V)
    elementwise passes, not the matmuls, are most of a soft-label step, and this does about half as many as
    ``F.cross_entropy(z.float(), p)``.
    """

    @staticmethod
    def forward(ctx, logits: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
        logp = torch.log_softmax(logits, -1, dtype=_fp32(logits))
        ctx.save_for_backward(logp, probs)
        ctx.logits_dtype = logits.dtype
        return -torch.dot(logp.reshape(-1), probs.to(logp.dtype).reshape(-1))

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor):
        logp, probs = ctx.saved_tensors
        grad = torch.exp(logp).mul_(probs.sum(-1, keepdim=True)).sub_(probs).mul_(grad_loss)
        return grad.to(ctx.logits_dtype), None


def logits_bytes(rows: int, vocab: int) -> int:
    """Memory kept for backward by an unchunked projection of ``rows`` rows onto ``vocab`` tokens."""
    return rows * vocab * BYTES_PER_KEPT_LOGIT


def default_memory_budget(device: torch.device | str = "cpu") -> int:
    """Bytes the loss may keep for backward: a quarter of the memory available now (device or host)."""
    device = torch.device(device)
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free // 4
    try:
        with open("/proc/meminfo") as f:
            info = dict(line.split(":", 1) for line in f)
        return int(info["MemAvailable"].split()[0]) * 1024 // 4
    except (OSError, KeyError, ValueError):
        return (os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")) // 4


def _chunk_cross_entropy(states, weight, bias, target_ids, teacher_states, teacher_weight, teacher_bias,
                         sparse_ids, sparse_probs):
    """Summed CE of ``states @ weight.T`` against hard ids, the teacher's softmax, or sparse (ids, probs)."""
    logits = F.linear(states.to(weight.dtype), weight, bias)
    if target_ids is not None:
        return F.nll_loss(logits.log_softmax(-1, dtype=_fp32(logits)), target_ids, reduction="sum")
    if sparse_ids is not None:
        logp = logits.log_softmax(-1, dtype=_fp32(logits)).gather(-1, sparse_ids.clamp(min=0))
        return -(logp * sparse_probs).sum()
    with torch.no_grad():
        teacher = F.linear(teacher_states.to(teacher_weight.dtype), teacher_weight, teacher_bias)
        teacher_probs = teacher.softmax(-1, dtype=_fp32(teacher))
    return _SoftTargetCrossEntropy.apply(logits, teacher_probs)


def projected_cross_entropy(
    states: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    target_ids: torch.Tensor | None = None,
    teacher_states: torch.Tensor | None = None,
    teacher_weight: torch.Tensor | None = None,
    teacher_bias: torch.Tensor | None = None,
    sparse_ids: torch.Tensor | None = None,
    sparse_probs: torch.Tensor | None = None,
    chunk_size: int | None = 256,
    recompute: bool = True,
) -> torch.Tensor:
    """Mean cross-entropy of ``states @ weight.T (+ bias)`` over rows.

    ``weight`` may be a subset of a vocabulary's rows (a training or draft vocabulary): targets are then
    indices into those rows, and a soft teacher's distribution is its softmax over the same rows.

    Args:
        states: (N, H) rows to score (already restricted to loss-masked positions).
        weight, bias: (V, H), (V,) the vocabulary projection.
        target_ids: (N,) hard targets in [0, V), or
        teacher_states, teacher_weight, teacher_bias: (N, H'), (V, H'), (V,) whose softmax is the soft target, or
        sparse_ids, sparse_probs: (N, k) target indices in [0, V) (-1 = none) and their probabilities (0 where
            none), e.g. a stored top-k of the teacher renormalised over the kept tokens.
        chunk_size: rows per chunk when recomputing; ``None`` projects everything at once.
        recompute: project chunk by chunk under activation checkpointing (logits recomputed in backward,
            peak memory one chunk); ``False`` projects all rows at once and keeps the logits (no recompute:
            about a third less work), for when :func:`logits_bytes` fits the memory budget.
    Returns:
        scalar mean loss (0 with a graph through ``states`` and ``weight`` when N == 0).
    """
    n = states.shape[0]
    if n == 0:  # a 0-row projection costs nothing and keeps ``weight`` in the graph: DDP needs every trainable
        # parameter to take part in every step (a head or TTT step without targets in this rank's batch)
        return F.linear(states.to(weight.dtype), weight, bias).sum() * 0.0
    given = sum(x is not None for x in (target_ids, teacher_states, sparse_ids))
    if given != 1 or (sparse_ids is None) != (sparse_probs is None):
        raise ValueError("give exactly one of target_ids, teacher_states or sparse_ids (with sparse_probs)")
    targets = (target_ids, teacher_states, teacher_weight, teacher_bias, sparse_ids, sparse_probs)
    if sparse_ids is not None:  # rows whose whole top-k fell outside the projected rows teach nothing: not counted
        n = (sparse_probs.sum(-1) > 0).sum().clamp(min=1)
    if chunk_size is None or not recompute or states.shape[0] <= chunk_size:
        return _chunk_cross_entropy(states, weight, bias, *targets) / n
    total = states.new_zeros((), dtype=torch.promote_types(states.dtype, torch.float32))
    for start in range(0, states.shape[0], chunk_size):
        rows = slice(start, start + chunk_size)
        total = total + checkpoint(
            _chunk_cross_entropy, states[rows], weight, bias,
            None if target_ids is None else target_ids[rows],
            None if teacher_states is None else teacher_states[rows], teacher_weight, teacher_bias,
            None if sparse_ids is None else sparse_ids[rows], None if sparse_probs is None else sparse_probs[rows],
            use_reentrant=False,
        )
    return total / n


def sparse_teacher(topk_ids: torch.Tensor, topk_logprobs: torch.Tensor,
                   to_rows: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """A stored top-k teacher as (ids, probs) over a row subset: ids outside it dropped, probs renormalised.

    Args:
        topk_ids, topk_logprobs: (N, k) the verifier's k most likely tokens and their log-probabilities.
        to_rows: (V,) map from vocabulary ids to row indices of the projected subset (-1 = not in it);
            ``None`` when the projection covers the whole vocabulary.
    Returns:
        (N, k) row indices (-1 where dropped) and (N, k) fp32 probabilities summing to 1 per row (0 if none kept).
    """
    ids = topk_ids if to_rows is None else to_rows[topk_ids]
    logp = topk_logprobs.float().masked_fill(ids < 0, float("-inf"))
    probs = logp.softmax(-1).nan_to_num(0.0)  # renormalised over the kept tokens; all dropped -> zeros
    return ids, probs


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
