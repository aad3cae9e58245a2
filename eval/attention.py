"""Attention over a static cache for both decoder paths (:mod:`.static_model`'s hand-written Llama layer and
:mod:`.native`'s attention function for any family's own layers): grouped-query heads folded into the query rows,
and batch-invariant calls of a fixed row count.

A forward prepares its mask once (:func:`plan_attention`: folded, padded, additive) and every layer attends
through that plan (:func:`attend`); a plan may cut the forward's rows into parts that attend over spans of their
own (batch-invariant decoding: a row's span depends on its slot only, see
:meth:`~spectrain.eval.static_model.StaticCausalLM.row_spans`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class AttentionPart:
    """Query rows ``start:stop`` of a forward attending over the first ``span`` cache slots. ``mask``: additive
    (0 / -inf in the queries' dtype, what SDPA makes of a boolean mask), GQA groups folded into the rows: (1, 1,
    groups * rows, span), or batch-invariant (``calls`` > 0) (calls, 1, rows, span), padded to whole calls."""

    start: int
    stop: int
    span: int
    mask: torch.Tensor
    calls: int = 0


def plan_attention(mask: torch.Tensor, groups: int, rows: int | None, ranges: list[tuple[int, int, int]],
                   dtype: torch.dtype) -> list[AttentionPart]:
    """A forward's attention, prepared once for all its layers.

    Args:
        mask: (n, >= span) bool, True = may attend.
        groups: query heads per KV head (1: no GQA).
        rows: batch-invariant attention in calls of this many query rows (None: one call per part).
        ranges: (start, stop, span) per part: its query rows and the slots they attend over.
        dtype: the queries' dtype (the additive mask's).
    """
    return [_part(mask[start:stop, :span], start, stop, span, groups, rows, dtype) for start, stop, span in ranges]


def _part(mask, start, stop, span, groups, rows, dtype) -> AttentionPart:
    folded = mask.repeat(groups, 1) if groups > 1 else mask  # row g * n + t: head h = kv * groups + g, as repeat_kv
    calls = 0
    if rows is not None:
        total = folded.shape[0]
        calls = -(-total // rows)
        extra = calls * rows - total
        if extra:  # padding rows see what row 0 sees (never an all-masked row); cut off after the call
            folded = torch.cat([folded, folded[:1].expand(extra, -1)])
    additive = torch.zeros(folded.shape, dtype=dtype, device=mask.device).masked_fill_(~folded, float("-inf"))
    shape = (calls, 1, rows, span) if calls else (1, 1, folded.shape[0], span)
    return AttentionPart(start, stop, span, additive.view(shape), calls)


def attend(plan: list[AttentionPart], q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
           scale: float) -> torch.Tensor:
    """(1, heads, n, d) queries over (1, kv_heads, >= span, d) keys and values through a plan: (1, heads, n, d)."""
    outs = [_attend(part, q[:, :, part.start:part.stop], keys[:, :, :part.span], values[:, :, :part.span], scale)
            for part in plan]
    return outs[0] if len(outs) == 1 else torch.cat(outs, 2)


def _attend(part: AttentionPart, q, keys, values, scale) -> torch.Tensor:
    heads, kv_heads = q.shape[1], keys.shape[1]
    groups, n, d = heads // kv_heads, q.shape[2], q.shape[3]
    if groups == 1 and not part.calls:
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=part.mask, scale=scale)
    folded = q.reshape(1, kv_heads, groups * n, d)
    if not part.calls:
        out = F.scaled_dot_product_attention(folded, keys, values, attn_mask=part.mask, scale=scale)
        return out.reshape(1, heads, n, d)  # not view: CUDA's memory-efficient kernel returns (B, L, H, D)
    total, calls, rows, span = groups * n, part.calls, part.mask.shape[2], keys.shape[2]
    if calls * rows > total:  # padding rows: zero queries, cut below
        folded = torch.cat([folded, folded.new_zeros(1, kv_heads, calls * rows - total, d)], 2)
    out = F.scaled_dot_product_attention(
        folded.view(kv_heads, calls, rows, d).transpose(0, 1),  # (calls, kv_heads, rows, d)
        keys.expand(calls, kv_heads, span, d), values.expand(calls, kv_heads, span, d),
        attn_mask=part.mask, scale=scale)
    return out.transpose(0, 1).reshape(1, kv_heads, calls * rows, d)[:, :, :total].reshape(1, heads, n, d)


def grouped_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor,
                      scale: float, rows: int | None = None) -> torch.Tensor:
    """Attention of (1, heads, n, d) queries over (1, kv_heads, span, d) keys and values through a (1, 1, n, span)
    boolean mask; (1, heads, n, d) out (one layer's call: :func:`plan_attention` + :func:`attend`).

    With grouped-query attention (heads = groups x kv_heads) the groups are folded into the query dimension:
    (1, kv_heads, groups * n, d) queries over the keys as they are. SDPA's ``enable_gqa=True`` with a boolean
    mask takes the math path (K/V repeated over every group for the whole span, scores in fp32); folded, every
    backend may take it and nothing is repeated but the n-row mask.

    ``rows``: batch-invariant attention — the folded query rows run in kernel calls of exactly ``rows`` rows
    (the last call padded), batched as calls of one shape. SDPA's fused CPU kernel picks its blocking by the
    number of query rows, so in bf16 one row's result would otherwise depend on how many rows run beside it
    (a 1-token AR step vs the same row in a verify pass: 1 ulp, amplified over the layers into another greedy
    token at near-ties). With fixed-size calls over a fixed span, every row of every forward goes through the
    same kernel with the same reduction order.
    """
    n, span = q.shape[2], keys.shape[2]
    plan = plan_attention(mask.expand(1, 1, n, span)[0, 0], q.shape[1] // keys.shape[1], rows, [(0, n, span)],
                          q.dtype)
    return attend(plan, q, keys, values, scale)
