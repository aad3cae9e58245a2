"""``--dtype auto`` for decoding: a rule, not a race, so the same command gives the same numbers on every run.

bf16 where bf16 matrix multiplies are native (a bf16-capable CUDA device, a CPU with AMX / AVX512-BF16), fp32
elsewhere — the rule training uses (:func:`spectrain.heads.precision.resolve_dtype`). On the AMX development CPU
bf16 measured faster than fp32 at every verify width we run (1, 6 and 65 tokens on SmolLM2-135M; docs/LOG.md).
An earlier ``auto`` timed one forward in each dtype per job and kept the faster; on shared cores that race
flipped between runs of the same command, and with it τ and the lossless check.
"""

from __future__ import annotations

import torch

from spectrain.heads.precision import bf16_is_native


def decode_dtype(device: str | torch.device) -> tuple[torch.dtype, dict]:
    """The decoding dtype ``auto`` stands for on ``device``, and a record of why (for ``eval.json``)."""
    device = torch.device(device)
    if bf16_is_native(device):
        where = "CUDA device" if device.type == "cuda" else "CPU (AMX / AVX512-BF16)"
        return torch.bfloat16, {"rule": f"bf16: native bf16 matrix multiplies on this {where}"}
    return torch.float32, {"rule": f"fp32: no native bf16 on this {device.type}"}
