"""Which floating-point precision to compute in, per device: bf16 where the hardware multiplies it natively.

``auto`` everywhere in spectrain means: bf16 on CUDA devices that support it and on CPUs with native bf16
matrix instructions (AMX or AVX512-BF16, e.g. Sapphire Rapids and later: bf16 matmuls run 2.6-4.4x faster
than fp32 there), fp32 elsewhere (on older CPUs bf16 is emulated and slower than fp32). Capabilities are asked
of torch, never parsed from /proc. What stays fp32 regardless: softmax / log-softmax over the vocabulary and
the losses (``train/losses.py``), RMSNorm variances, rotary frequency tables (see :func:`cast_module`).
"""

from __future__ import annotations

import torch

from .errors import SpectrainError

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
          "float16": torch.float16, "fp16": torch.float16}


def bf16_is_native(device: str | torch.device = "cpu") -> bool:
    """True where bf16 matrix multiplies run in hardware: a bf16-capable CUDA device, or a CPU with AMX/AVX512-BF16."""
    device = torch.device(device)
    if device.type == "cuda":
        # Emulated bf16 (pre-Ampere GPUs) is slower than fp32 there: only native support counts.
        return torch.cuda.is_available() and torch.cuda.is_bf16_supported(including_emulation=False)
    if device.type == "cpu":
        return bool(torch.cpu._is_amx_tile_supported() or torch.cpu._is_avx512_bf16_supported())
    return False


def resolve_dtype(dtype: str | torch.dtype, device: str | torch.device = "cpu") -> torch.dtype:
    """``"auto"`` -> bf16 where :func:`bf16_is_native` on ``device``, else fp32; names and dtypes pass through."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        return torch.bfloat16 if bf16_is_native(device) else torch.float32
    if dtype not in DTYPES:
        raise SpectrainError(f"unknown dtype {dtype!r}; expected auto or one of {sorted(DTYPES)}")
    return DTYPES[dtype]


def training_precision(precision: str | None, device: str | torch.device) -> str:
    """Lightning ``precision`` for a run: ``None``/``"auto"`` -> ``bf16-mixed`` where bf16 is native, else ``32-true``."""
    if precision in (None, "auto"):
        return "bf16-mixed" if bf16_is_native(device) else "32-true"
    return str(precision)


def precision_dtype(precision: str) -> torch.dtype:
    """The compute dtype a Lightning precision string implies for the frozen verifier."""
    text = str(precision)
    if "bf16" in text:
        return torch.bfloat16
    if text.startswith("16"):
        return torch.float16
    return torch.float32


def cast_module(model: torch.nn.Module, dtype: torch.dtype) -> torch.nn.Module:
    """``model.to(dtype)`` that keeps floating-point buffers (RoPE ``inv_freq`` tables) in their own dtype.

    HF computes rotary frequencies in fp32 and a native bf16 load keeps them so; a blanket ``.to(bf16)``
    would round them (phase errors up to ~0.7 rad at position 512 for theta 1e5), so the features would differ
    from the deployed verifier's.
    """
    kept = {name: buf for name, buf in model.named_buffers(remove_duplicate=False) if buf.is_floating_point()}
    model.to(dtype)
    for name, buf in kept.items():
        owner_name, _, attr = name.rpartition(".")
        owner = model.get_submodule(owner_name) if owner_name else model
        owner._buffers[attr] = buf
    return model
