"""Host reads of device values, counted: each is a stall on a GPU (the host waits for the device to catch up), so
the decode loop keeps them to one per round (``benchmarks/round_ops.py`` counts them per round; tests assert a
drafter's proposal makes none).

Counted with a torch function mode, which sees every tensor call: ``item``, ``tolist``, ``int`` / ``float`` /
``bool`` / ``index`` of a tensor, ``nonzero`` (its output's size is data-dependent, so it reads the device too).
"""

from __future__ import annotations

import torch

SYNCS = {torch.Tensor.item, torch.Tensor.tolist, torch.Tensor.__int__, torch.Tensor.__float__,
         torch.Tensor.__bool__, torch.Tensor.__index__, torch.Tensor.nonzero, torch.nonzero}


class HostReads(torch.overrides.TorchFunctionMode):
    """Counts the tensor calls that read device values on the host (a stall each on a GPU): ``with HostReads() as
    reads: ...`` then ``reads.count``; set ``paused`` to leave a stretch uncounted (the verifier's own forward)."""

    def __init__(self):
        super().__init__()
        self.count = 0
        self.paused = False

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in SYNCS and not self.paused:
            self.count += 1
        return func(*args, **(kwargs or {}))
