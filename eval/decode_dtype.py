"""``--dtype auto`` for decoding: the dtype that measures faster for the verifier shapes the job runs.

On CUDA, and on CPUs without native bf16 matrix instructions, ``auto`` is decided by capability alone
(bf16 and fp32 respectively). On CPUs with AMX / AVX512-BF16 it is measured: bf16 wins matrix-matrix work
(a verify pass over several draft tokens) but can lose matrix-vector work (one-token decoding; measured on
SmolLM2-135M: 41 ms bf16 vs 32 ms fp32 per token, while a 6-token verify took 42 vs 48 ms), so the choice
follows the job's verify width: 1 for plain decoding, 1 + drafts for speculative decoding.
"""

from __future__ import annotations

import copy

import torch

from spectrain.heads.precision import bf16_is_native, cast_module, resolve_dtype

from .costs import verify_cost
from .static_model import StaticCausalLM
from .tree import Tree


def decode_dtype(model: torch.nn.Module, device: str | torch.device, width: int, context: int = 128,
                 repeats: int = 5) -> tuple[torch.dtype, dict]:
    """The faster of fp32 / bf16 for one verifier forward over ``width`` tokens after ``context`` cached ones.

    ``model`` is the loaded verifier (either dtype); the other dtype is timed on a cast copy. Returns the dtype
    and a record of why (``reason``, and the measured milliseconds per dtype when measured).
    """
    device = torch.device(device)
    if device.type == "cuda":
        return resolve_dtype("auto", device), {"reason": "CUDA: bf16 where native, else fp32"}
    if not bf16_is_native(device):
        return torch.float32, {"reason": "no native bf16 on this CPU"}
    loaded = next(model.parameters()).dtype
    ms = {}
    for dtype in (torch.float32, torch.bfloat16):
        candidate = model if dtype == loaded else cast_module(copy.deepcopy(model), dtype)
        runner = StaticCausalLM(candidate, max_len=context + width + 8, device=device)
        ms[str(dtype).replace("torch.", "")] = 1000 * verify_cost(runner, Tree.chain(width - 1), context, repeats)
        del runner, candidate
    best = min(ms, key=ms.get)
    return getattr(torch, best), {"reason": f"measured: {width}-token forward after {context} tokens", "width": width,
                                  "ms": ms}
