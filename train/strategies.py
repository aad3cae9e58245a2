"""Distributed training through Lightning's own strategies (no hand-rolled process groups).

* ``--trainer.strategy ddp`` (CPU: gloo, GPU: nccl): every rank holds the frozen verifier and the drafter;
  only the drafter has gradients, so DDP all-reduces drafter gradients alone. The training loader shards
  rows over ranks itself (``data/loader.py``), so ``--data.batch_size`` is per rank.
* ``--trainer.strategy fsdp_drafter``: Lightning's FSDP with a wrap policy that puts each verifier decoder
  layer in a unit of its own (frozen), the drafter in another (trainable) and leaves the verifier's
  embeddings/norm/lm_head in the root (frozen): FSDP never mixes frozen and trainable parameters in one
  flat unit, and the verifier's layers are sharded over ranks, for verifiers that do not fit one device.
  Lightning's FSDP needs CUDA.

Launch: ``torchrun --nnodes N --nproc_per_node G --rdzv_endpoint HOST:PORT $(which train_eagle) ...``
or under SLURM ``srun train_eagle ...``, with ``--trainer.num_nodes N --trainer.devices G`` (Lightning reads
the rank from the launcher's environment).
"""

from __future__ import annotations

from torch import nn


def is_decoder_layer(module: nn.Module) -> bool:
    """HF decoder layers of every family are named ``*DecoderLayer`` (LlamaDecoderLayer, Qwen3DecoderLayer, ...)."""
    return type(module).__name__.endswith("DecoderLayer") and not type(module).__name__.startswith("Eagle")


def is_drafter(module: nn.Module) -> bool:
    from spectrain.heads.eagle import EagleDrafter
    from spectrain.heads.medusa import MedusaHeads

    return isinstance(module, (MedusaHeads, EagleDrafter))


def drafter_wrap_policy(module: nn.Module, recurse: bool, nonwrapped_numel: int = 0) -> bool:
    """torch FSDP ``auto_wrap_policy``: descend everywhere; wrap verifier decoder layers and the drafter."""
    if recurse:
        return not is_drafter(module)  # the drafter is one unit: do not split it further
    return is_decoder_layer(module) or is_drafter(module)


def fsdp_units(root: nn.Module) -> list[nn.Module]:
    """The modules :func:`drafter_wrap_policy` makes FSDP units of, root included (for tests and docs)."""
    units = [root]

    def visit(module: nn.Module) -> None:
        for child in module.children():
            if drafter_wrap_policy(child, recurse=False):
                units.append(child)
            if drafter_wrap_policy(child, recurse=True):
                visit(child)

    visit(root)
    return units


def register_strategies() -> None:
    """Make ``fsdp_drafter`` a strategy name Lightning (and so the CLI) understands."""
    from lightning.pytorch.strategies import FSDPStrategy, StrategyRegistry

    if "fsdp_drafter" not in StrategyRegistry:
        StrategyRegistry.register("fsdp_drafter", FSDPStrategy, description="FSDP: verifier layers and the drafter "
                                  "in separate units (spectrain.train.strategies)", auto_wrap_policy=drafter_wrap_policy)


def mmap_checkpoint_io():
    """Lightning's checkpoint IO, but a local checkpoint is memory-mapped when a run resumes: the drafter's
    weights and Adam moments are paged in as they are restored instead of read whole into host memory first (on
    every rank)."""
    from pathlib import Path

    import torch
    from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO

    class MmapCheckpointIO(TorchCheckpointIO):
        def load_checkpoint(self, path, map_location=lambda storage, loc: storage, weights_only=None):
            if not (isinstance(path, (str, Path)) and Path(path).is_file()):  # remote, or missing: Lightning's path
                return super().load_checkpoint(path, map_location, weights_only)
            return torch.load(path, map_location=map_location, mmap=True,
                              weights_only=True if weights_only is None else weights_only)

    return MmapCheckpointIO()
