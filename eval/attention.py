"""Attention over a static cache for both decoder paths (:mod:`.static_model`'s hand-written Llama layer and
:mod:`.native`'s attention function for any family's own layers): grouped-query heads folded into the query rows,
and batch-invariant calls of a fixed row count."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def grouped_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor,
                      scale: float, rows: int | None = None) -> torch.Tensor:
    """Attention of (1, heads, n, d) queries over (1, kv_heads, span, d) keys and values through a (1, 1, n, span)
    boolean mask; (1, heads, n, d) out.

    With grouped-query attention (heads = groups x kv_heads) the groups are folded into the query dimension:
    (1, kv_heads, groups * n, d) queries over the keys as they are. SDPA's ``enable_gqa=True`` with a boolean
    mask takes the math path (K/V repeated over every group for the whole span, scores in fp32); folded, every
    backend may take it and nothing is repeated but the n-row mask.

    ``rows``: batch-invariant attention — the folded query rows run in kernel calls of exactly ``rows`` rows
    (the last call padded), batched as calls of one shape. SDPA's fused CPU kernel picks its blocking by the
    number of query rows, so in bf16 one row's result would otherwise depend on how many rows run beside it
    (a 1-token AR step vs the same row in a verify pass: 1 ulp, amplified over the layers into another greedy
    token at near-ties). With fixed-size calls over a fixed span (a static cache), every row of every forward
    goes through the same kernel with the same reduction order.
    """
    heads, kv_heads = q.shape[1], keys.shape[1]
    groups, n, d = heads // kv_heads, q.shape[2], q.shape[3]
    if heads == kv_heads and rows is None:
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=scale)
    folded = q.reshape(1, kv_heads, groups * n, d)  # head h = kv * groups + g, as HF's repeat_kv pairs them
    folded_mask = mask.expand(1, 1, n, mask.shape[-1]).repeat(1, 1, groups, 1)
    if rows is None:
        out = F.scaled_dot_product_attention(folded, keys, values, attn_mask=folded_mask, scale=scale)
        return out.reshape(1, heads, n, d)  # not view: CUDA's memory-efficient kernel returns (B, L, H, D)
    total = groups * n
    calls = -(-total // rows)
    extra = calls * rows - total
    if extra:  # padding rows: zero queries that see what row 0 sees (never an all-masked row), cut below
        folded = torch.cat([folded, folded.new_zeros(1, kv_heads, extra, d)], 2)
        folded_mask = torch.cat([folded_mask, folded_mask[:, :, :1].expand(1, 1, extra, -1)], 2)
    span = keys.shape[2]
    out = F.scaled_dot_product_attention(
        folded.view(kv_heads, calls, rows, d).transpose(0, 1),  # (calls, kv_heads, rows, d)
        keys.expand(calls, kv_heads, span, d), values.expand(calls, kv_heads, span, d),
        attn_mask=folded_mask.view(1, calls, rows, span).transpose(0, 1), scale=scale)
    return out.transpose(0, 1).reshape(1, kv_heads, calls * rows, d)[:, :, :total].reshape(1, heads, n, d)
