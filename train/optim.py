"""The drafter's optimizer: AdamW over its trainable weights, with the weight-decay groups and fusing rules of
:class:`~.base.DrafterModule` (benchmarks build it alone)."""

from __future__ import annotations

from typing import Optional

import torch

from .strategies import clean_name


def build_optimizer(drafter: torch.nn.Module, lr: float, weight_decay: float, loss_scaling: bool = False,
                    no_decay: tuple[torch.Tensor, ...] = (), decaying: Optional[set[str]] = None) -> torch.optim.AdamW:
    """AdamW over the drafter's trainable weights (no decay on biases and norms).

    Fused where possible: the unfused CPU AdamW allocates W-sized temporaries per parameter, which is the peak
    of the whole step for per-head lm_heads over a large vocabulary (see benchmarks/bench_memory.py); fused is faster too.
    Not fused under fp16 loss scaling (``loss_scaling``): a fused AdamW unscales inside its step, after
    clipping would have seen the scaled gradients. ``no_decay``: further weights kept out of weight decay.
    ``decaying``: names of the weights that decay (:func:`~.strategies.decay_names`, taken before a sharding
    wrapper flattened them); default: every matrix.
    """
    named = [(clean_name(n), p) for n, p in drafter.named_parameters() if p.requires_grad]
    params = [p for _, p in named]
    excluded = {id(p) for p in no_decay}
    decays = [(n in decaying if decaying is not None else p.ndim >= 2) and id(p) not in excluded for n, p in named]
    groups = [{"params": [p for p, d in zip(params, decays) if d], "weight_decay": weight_decay},
              {"params": [p for p, d in zip(params, decays) if not d], "weight_decay": 0.0}]
    fused = all(p.device.type in ("cpu", "cuda") and p.dtype == torch.float32 for p in params) and not loss_scaling
    return torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95), fused=fused or None)
