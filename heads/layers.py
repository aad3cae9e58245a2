"""Llama building blocks shared by drafter families: RMSNorm, RoPE, attention, SwiGLU, causal masks.

Nothing here knows about a drafter family; a family's decoder layer is built from these,
and a new family's module imports them rather than copying them. Submodule names follow HF Llama's
(``q_proj`` .. ``o_proj``, ``gate_proj`` / ``up_proj`` / ``down_proj``, ``weight``), so state-dict keys match
the serving engines' layouts.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .errors import SpectrainError


def spread_layers(num_layers: int) -> list[int]:
    """HF ``hidden_states`` indices of low, middle and high layers of a verifier: the layers a drafter that fuses
    several and a feature store capture by default.

    ``hidden_states[i]`` is the input of decoder layer i (index 0, the embeddings, is never used), so for N >= 7
    layers this is ``[2, N//2, N-3]`` (the choice of the paper that introduced fusing them). Smaller verifiers get min(3, N - 1) distinct
    ids spread evenly over [1, N - 1] (N=6 -> [1, 3, 5], N=3 -> [1, 2]): ``hidden_states[N]`` is taken after the
    final norm, which serving engines do not capture, so an exportable default never fuses it (a 1- or 2-layer
    verifier gets [1]: a 1-layer one has nothing else). A fusing drafter's ``fc`` then takes ``len(ids) * hidden``
    inputs instead of 3h.
    """
    if not isinstance(num_layers, int) or num_layers < 1:
        raise SpectrainError(f"the verifier must have at least one layer, got {num_layers!r}")
    if num_layers >= 7:
        return [2, num_layers // 2, num_layers - 3]
    count = min(3, num_layers - 1)
    if count <= 1:
        return [1]
    return sorted({1 + (k * (num_layers - 2)) // (count - 1) for k in range(count)})


class RMSNorm(nn.Module):
    """Llama's RMSNorm: variance in fp32, then the weight multiplies the input-dtype result."""

    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(..., h) -> (..., h)."""
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def rotary_cos_sin(positions: torch.Tensor, head_dim: int, theta: float,
                   dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """Default RoPE tables for (B, T) positions -> cos, sin, each (B, 1, T, head_dim).

    Frequencies are computed on the fly in fp32 rather than held in a buffer, so ``module.to(bf16)``
    cannot round them and nothing RoPE-related enters the state dict.
    """
    inv_freq = theta ** (-torch.arange(0, head_dim, 2, device=positions.device, dtype=torch.float32) / head_dim)
    angles = positions.float()[..., None] * inv_freq  # (B, T, d/2)
    emb = torch.cat((angles, angles), dim=-1)[:, None]  # Llama's half-split layout
    return emb.cos().to(dtype), emb.sin().to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """(B, heads, T, d) rotated by (B, 1, T, d) tables."""
    return x * cos + _rotate_half(x) * sin


def causal_mask(T: int, S: int, device=None) -> torch.Tensor:
    """(T, S) bool: query t (the last T of S positions) sees keys 0 .. S - T + t."""
    return torch.arange(S, device=device)[None, :] <= (S - T) + torch.arange(T, device=device)[:, None]


class Attention(nn.Module):
    """Llama attention (no biases, GQA, RoPE on q and k) over this call's keys plus optional cached ones.

    ``in_width`` is the width of the input x (a drafter may feed more than ``hidden_size``, e.g. 2h for a fused-layer drafter);
    the output is ``hidden_size`` wide.
    """

    def __init__(self, in_width: int, hidden_size: int, num_heads: int, num_kv_heads: int, head_dim: int):
        super().__init__()
        self.head_dim = head_dim
        self.q_proj = nn.Linear(in_width, num_heads * head_dim, bias=False)
        self.k_proj = nn.Linear(in_width, num_kv_heads * head_dim, bias=False)
        self.v_proj = nn.Linear(in_width, num_kv_heads * head_dim, bias=False)
        self.o_proj = nn.Linear(num_heads * head_dim, hidden_size, bias=False)

    def _heads(self, proj: nn.Linear, x: torch.Tensor) -> torch.Tensor:
        """(B, T, in) -> (B, heads, T, d)."""
        return proj(x).view(x.shape[0], x.shape[1], -1, self.head_dim).transpose(1, 2)

    def qkv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """(B, T, in) -> q (B, heads, T, d), k and v (B, kv_heads, T, d); q and k rotated by (B, 1, T, d) tables."""
        q = apply_rotary(self._heads(self.q_proj, x), cos, sin)
        k = apply_rotary(self._heads(self.k_proj, x), cos, sin)
        return q, k, self._heads(self.v_proj, x)

    def forward(self, x, cos, sin, mask, past_k=None, past_v=None):
        """x (B, T, in); mask (B|1, 1, T, S) bool, True = may attend, S = past + T; None = causal without a past
        (SDPA's ``is_causal``, which lets flash kernels skip the masked half instead of computing it).

        Returns (out (B, T, h), k, v): k/v are this call's (B, kv_heads, T, d), k already rotated, so a
        caller caches them by concatenating along dim 2.
        """
        q, k, v = self.qkv(x, cos, sin)
        keys = k if past_k is None else torch.cat((past_k, k), dim=2)
        values = v if past_v is None else torch.cat((past_v, v), dim=2)
        if mask is None and past_k is not None:  # is_causal aligns top-left: only right for a square mask
            mask = causal_mask(k.shape[2], keys.shape[2], x.device)[None, None]
        out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, is_causal=mask is None,
                                             enable_gqa=q.shape[1] != keys.shape[1])
        return self.o_proj(out.transpose(1, 2).reshape(x.shape[0], x.shape[1], -1)), k, v


class SwiGLU(nn.Module):
    """Llama MLP: ``down(silu(gate(x)) * up(x))``, (..., h) -> (..., h)."""

    def __init__(self, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
