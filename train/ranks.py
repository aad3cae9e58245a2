"""Where each rank of a data-parallel run works: the device it trains on and what DDP must leave alone. Helpers of
:class:`~.base.DrafterModule`."""

from __future__ import annotations

import os

import torch

from .checkpoint_state import VERIFIER_PREFIX


def local_device() -> torch.device:
    """The device this process trains on: its local rank's GPU (``LOCAL_RANK``, set by Lightning's launcher and
    torchrun; ``SLURM_LOCALID`` under srun), the CPU without CUDA."""
    if not torch.cuda.is_available():
        return torch.device("cpu")
    local = int(os.environ.get("LOCAL_RANK", os.environ.get("SLURM_LOCALID", "0")))
    return torch.device("cuda", local % torch.cuda.device_count())


def ddp_ignored_names(module: torch.nn.Module) -> list[str]:
    """Names DDP must neither broadcast nor sync: the frozen verifier's parameters and every buffer."""
    frozen = [n for n, _ in module.named_parameters() if n.startswith(VERIFIER_PREFIX)]
    return frozen + [n for n, _ in module.named_buffers()]
