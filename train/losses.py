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


def _compute_dtype(weight: torch.Tensor) -> torch.dtype:
    """The dtype a projection by ``weight`` runs in here: autocast's when it is on, else the weight's own."""
    device = weight.device.type
    return torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else weight.dtype


def _teacher_logits(states, weight, bias, transform):
    """A dense teacher's logits: the verifier's ``lm_head`` rows, then its family's logit transform (Gemma's
    soft-cap, Granite's scaling: ``heads.verifier.LogitTransform``; None = the identity)."""
    logits = F.linear(states.to(weight.dtype), weight, bias)
    return logits if transform is None else transform(logits)


def _chunk_loss_and_grad(logits, target_ids, teacher_states, teacher_weight, teacher_bias, teacher_transform,
                         sparse_ids, sparse_probs, want_grad: bool):
    """Summed CE of one chunk's ``logits`` and, with ``want_grad``, d(loss)/d(logits) in fp32. A dense teacher
    is projected here, per chunk (its (N, V) distribution never exists whole)."""
    teacher_probs = None
    if teacher_states is not None:
        teacher = _teacher_logits(teacher_states, teacher_weight, teacher_bias, teacher_transform)
        teacher_probs = teacher.softmax(-1, dtype=_fp32(teacher))
    logp = logits.log_softmax(-1, dtype=_fp32(logits))
    if target_ids is not None:
        loss = -logp.gather(-1, target_ids[:, None]).sum()
        weights = None
    elif sparse_ids is not None:
        loss = -(logp.gather(-1, sparse_ids.clamp(min=0)) * sparse_probs).sum()
        weights = sparse_probs
    else:
        loss = -torch.dot(logp.reshape(-1), teacher_probs.to(logp.dtype).reshape(-1))
        weights = teacher_probs
    if not want_grad:
        return loss, None
    grad = logp.exp_()  # softmax(z) * sum(target weights) - target weights
    if target_ids is not None:
        grad[torch.arange(grad.shape[0], device=grad.device), target_ids] -= 1
    elif sparse_ids is not None:
        grad.mul_(sparse_probs.sum(-1, keepdim=True).to(grad.dtype))
        grad.scatter_add_(-1, sparse_ids.clamp(min=0), -sparse_probs.to(grad.dtype))
    else:
        grad.mul_(weights.sum(-1, keepdim=True).to(grad.dtype)).sub_(weights.to(grad.dtype))
    return loss, grad


class _ChunkedProjectionCE(torch.autograd.Function):
    """Summed CE of ``states @ weight.T (+ bias)`` chunk by chunk, logits recomputed in backward.

    What activation checkpointing per chunk did, with the weight cast to the compute dtype once per pass
    instead of once per chunk in forward and again per chunk in recompute (Lightning's autocast runs without
    a cast cache: at 128K x 4096 with 4 heads that was ~1.5 TB of memory traffic per step). The weight's and
    bias's gradients are summed over chunks in fp32, each chunk's product in the compute dtype as before.
    """

    @staticmethod
    def forward(ctx, states, weight, bias, target_ids, teacher_states, teacher_weight, teacher_bias,
                teacher_transform, sparse_ids, sparse_probs, chunk_size):
        dtype = _compute_dtype(weight)
        with torch.autocast(weight.device.type, enabled=False):
            w, b, teacher = _cast_once(dtype, weight, bias, teacher_weight, teacher_bias, teacher_transform)
            total = torch.zeros((), dtype=torch.promote_types(dtype, torch.float32), device=states.device)
            for start in range(0, states.shape[0], chunk_size):
                rows = slice(start, start + chunk_size)
                logits = F.linear(states[rows].to(dtype), w, b)
                loss, _ = _chunk_loss_and_grad(logits, *_targets_of(rows, target_ids, teacher_states, teacher,
                                                                      sparse_ids, sparse_probs), want_grad=False)
                total += loss.to(total.dtype)
        ctx.save_for_backward(states, weight, bias, target_ids, teacher_states, teacher_weight, teacher_bias,
                              sparse_ids, sparse_probs)
        ctx.dtype, ctx.chunk_size, ctx.teacher_transform = dtype, chunk_size, teacher_transform
        return total

    @staticmethod
    def backward(ctx, grad_loss):
        (states, weight, bias, target_ids, teacher_states, teacher_weight, teacher_bias, sparse_ids,
         sparse_probs) = ctx.saved_tensors
        dtype = ctx.dtype
        with torch.autocast(weight.device.type, enabled=False):
            w, b, teacher = _cast_once(dtype, weight, bias, teacher_weight, teacher_bias, ctx.teacher_transform)
            d_states = torch.empty(states.shape, dtype=dtype, device=states.device) if ctx.needs_input_grad[0] else None
            acc = torch.promote_types(dtype, torch.float32)  # gradients summed over chunks in fp32 (or better)
            d_weight = torch.zeros(weight.shape, dtype=acc, device=weight.device) if ctx.needs_input_grad[1] else None
            d_bias = (torch.zeros(bias.shape, dtype=acc, device=bias.device)
                      if bias is not None and ctx.needs_input_grad[2] else None)
            for start in range(0, states.shape[0], ctx.chunk_size):
                rows = slice(start, start + ctx.chunk_size)
                chunk = states[rows].to(dtype)
                _, grad = _chunk_loss_and_grad(F.linear(chunk, w, b), *_targets_of(rows, target_ids, teacher_states,
                                                                                    teacher, sparse_ids, sparse_probs),
                                               want_grad=True)
                grad = grad.mul_(grad_loss).to(dtype)
                if d_states is not None:
                    d_states[rows] = grad @ w
                if d_weight is not None:
                    d_weight += (grad.T @ chunk).to(acc)
                if d_bias is not None:
                    d_bias += grad.sum(0).to(acc)
        return (None if d_states is None else d_states.to(states.dtype),
                None if d_weight is None else d_weight.to(weight.dtype),
                None if d_bias is None else d_bias.to(bias.dtype), None, None, None, None, None, None, None, None)


def _cast_once(dtype, weight, bias, teacher_weight, teacher_bias, teacher_transform):
    """The projection (and a dense teacher's) in the compute dtype: one cast per pass, not one per chunk."""
    def cast(t):
        return None if t is None else t.to(dtype)
    return cast(weight), cast(bias), (cast(teacher_weight), cast(teacher_bias), teacher_transform)


def _targets_of(rows: slice, target_ids, teacher_states, teacher, sparse_ids, sparse_probs):
    """One chunk's targets, in :func:`_chunk_loss_and_grad`'s argument order."""
    def pick(t):
        return None if t is None else t[rows]
    return pick(target_ids), pick(teacher_states), *teacher, pick(sparse_ids), pick(sparse_probs)


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
                         teacher_transform, sparse_ids, sparse_probs):
    """Summed CE of ``states @ weight.T`` against hard ids, the teacher's softmax, or sparse (ids, probs)."""
    logits = F.linear(states.to(weight.dtype), weight, bias)
    if target_ids is not None:
        return F.nll_loss(logits.log_softmax(-1, dtype=_fp32(logits)), target_ids, reduction="sum")
    if sparse_ids is not None:
        logp = logits.log_softmax(-1, dtype=_fp32(logits)).gather(-1, sparse_ids.clamp(min=0))
        return -(logp * sparse_probs).sum()
    with torch.no_grad():
        teacher = _teacher_logits(teacher_states, teacher_weight, teacher_bias, teacher_transform)
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
    teacher_transform=None,
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
        teacher_states, teacher_weight, teacher_bias: (N, H'), (V, H'), (V,) whose softmax (after
            ``teacher_transform``, the verifier's ``LogitTransform``, when given) is the soft target, or
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
    targets = (target_ids, teacher_states, teacher_weight, teacher_bias, teacher_transform, sparse_ids, sparse_probs)
    if sparse_ids is not None:  # rows whose whole top-k fell outside the projected rows teach nothing: not counted
        n = (sparse_probs.sum(-1) > 0).sum().clamp(min=1)
    if chunk_size is None or not recompute or states.shape[0] <= chunk_size:
        return _chunk_cross_entropy(states, weight, bias, *targets) / n
    return _ChunkedProjectionCE.apply(states, weight, bias, *targets, chunk_size) / n


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


# -- acceptance-targeted losses (LK, arXiv 2602.23881), for every family ----------------------------------------------
TOKEN_LOSSES = ("ce", "lk_alpha", "lk_hybrid")


def teacher_distribution(teacher: dict, vocab: int) -> torch.Tensor:
    """(N, V') fp32 probabilities of a :meth:`~spectrain.train.base.DrafterModule.teacher` dict over the projected rows:
    the dense teacher's softmax, or the sparse top-k scattered into its rows (zero elsewhere)."""
    if "sparse_ids" in teacher:
        ids, probs = teacher["sparse_ids"], teacher["sparse_probs"]
        out = probs.new_zeros(ids.shape[0], vocab)
        return out.scatter_add_(1, ids.clamp_min(0), probs * (ids >= 0))
    with torch.no_grad():
        return _teacher_logits(teacher["teacher_states"], teacher["teacher_weight"], teacher["teacher_bias"],
                               teacher.get("teacher_transform")).float().softmax(-1)


def acceptance_loss(logp: torch.Tensor, q: torch.Tensor, kind: str, eta: float = 3.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row LK losses of a drafter's log-probabilities ``logp`` (N, V') against the verifier's ``q`` (N, V').

    alpha = sum min(p, q) is the probability that a draft sampled from p is accepted. ``lk_alpha``: -log alpha;
    ``lk_hybrid``: lam * KL(q || p) + (1 - lam) * (1 - alpha) with lam = exp(-eta * alpha) detached (KL while
    acceptance is low, the acceptance gap itself once it is high; speculators' ``lk_hybrid``, eta = 3).
    Returns (loss (N,), alpha (N,)).
    """
    alpha = torch.minimum(logp.exp(), q).sum(-1)
    if kind == "lk_alpha":
        return -alpha.clamp_min(1e-5).log(), alpha
    if kind != "lk_hybrid":
        raise ValueError(f"unknown acceptance loss {kind!r}")
    lam = torch.exp(-eta * alpha).detach()
    kl = (q * (q.clamp_min(1e-12).log() - logp)).sum(-1)
    return lam * kl + (1 - lam) * (1 - alpha), alpha


def projected_token_loss(states: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, teacher: dict,
                         kind: str, eta: float = 3.0, **ce_options) -> torch.Tensor:
    """The token loss of a drafter family: ``ce`` (:func:`projected_cross_entropy` against ``teacher``, chunked as
    memory needs) or an LK loss (the logits over the projected rows kept whole: train with a training vocabulary
    on large ones). Mean over rows."""
    if kind == "ce":
        return projected_cross_entropy(states, weight, bias, **teacher, **ce_options)
    if states.shape[0] == 0:
        return states.sum() * 0
    logp = F.linear(states.to(weight.dtype), weight, bias).float().log_softmax(-1)
    q = teacher_distribution(teacher, weight.shape[0])
    loss, _ = acceptance_loss(logp, q, kind, eta)
    has_mass = q.sum(-1) > 0  # a sparse teacher that kept none of its tokens: nothing to compare (CE gives 0 too)
    return (loss * has_mass).sum() / has_mass.sum().clamp_min(1)
