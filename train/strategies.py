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

from typing import Any, Callable

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


def inside_forward(module: nn.Module, fn: Callable[[], Any]) -> Any:
    """``fn()`` run as ``module``'s forward: through ``module(...)``, so the hooks a sharding wrapper puts around
    forward run around it.

    Training calls drafter methods other than ``forward`` (Medusa's ``head_states``, EAGLE's ``ttt_hidden``,
    the lm_head weights directly). Under FSDP the drafter's parameters exist whole only between its forward
    pre- and post-hooks (elsewhere they are flat shards), and only a forward's outputs get the hook that gathers
    them again for backward. So the whole loss runs as one forward of the drafter. Works for torch's FSDP1
    wrapper (its inner module's forward is the one swapped) and FSDP2 (``fully_shard``: hooks on the module).
    """
    inner = unwrapped(module)

    def run(*args, **kwargs):
        del inner.forward  # the real forward again, for ``fn``'s own calls (through ``unwrapped(module).forward``)
        return fn()

    inner.forward = run  # an instance attribute shadows the class's forward
    try:
        return module()
    finally:
        inner.__dict__.pop("forward", None)


def unwrapped(module: nn.Module) -> nn.Module:
    """The module inside torch's FSDP1 wrapper (itself otherwise). Code already running inside the drafter's
    forward (:func:`inside_forward`) calls ``unwrapped(drafter).forward(...)``: no second round of hooks."""
    return getattr(module, "_fsdp_wrapped_module", module)


def is_sharded(module: nn.Module) -> bool:
    """Wrapped by torch's FSDP1, or sharded by FSDP2 (``fully_shard``: DTensor parameters)."""
    return hasattr(module, "_fsdp_wrapped_module") or any(hasattr(p, "full_tensor") for p in module.parameters())


def drafter_class(module: nn.Module) -> type:
    """The drafter's own class (FSDP2 swaps in a subclass of it; FSDP1 wraps it: pass the inner module)."""
    from spectrain.heads.eagle import EagleDrafter
    from spectrain.heads.medusa import MedusaHeads

    return next(c for c in type(module).__mro__ if c in (MedusaHeads, EagleDrafter))


def decay_names(drafter: nn.Module) -> set[str]:
    """Names of the drafter's weights that decay (matrices), taken before any sharding wrapper flattens them
    (FSDP's views of a shard are 1-D, so ``ndim`` read after wrapping would turn weight decay off)."""
    return {name for name, p in drafter.named_parameters() if p.ndim >= 2}


def clean_name(name: str) -> str:
    """A parameter name without the prefixes FSDP and activation checkpointing insert."""
    for wrapper in ("_fsdp_wrapped_module.", "_checkpoint_wrapped_module.", "_orig_mod."):
        name = name.replace(wrapper, "")
    return name


def full_state_dict(module: nn.Module) -> dict:
    """``module``'s whole state dict on every rank: gathered from the shards under FSDP (a collective: every rank
    must call it), as it is otherwise."""
    try:
        from torch.distributed.fsdp import FullStateDictConfig, FullyShardedDataParallel, StateDictType
    except ImportError:  # torch without distributed
        return module.state_dict()
    if isinstance(module, FullyShardedDataParallel):
        config = FullStateDictConfig(offload_to_cpu=True, rank0_only=False)
        with FullyShardedDataParallel.state_dict_type(module, StateDictType.FULL_STATE_DICT, config):
            return {clean_name(k): v for k, v in module.state_dict().items()}
    return {k: v.full_tensor() if hasattr(v, "full_tensor") else v for k, v in module.state_dict().items()}


def register_strategies() -> None:
    """Make ``fsdp_drafter`` a strategy name Lightning (and so the CLI) understands."""
    from lightning.pytorch.strategies import FSDPStrategy, StrategyRegistry

    class DrafterFSDPStrategy(FSDPStrategy):
        """Lightning's FSDP with mixed precision that casts neither buffers nor gradient reductions: Lightning's
        bf16-mixed sets ``buffer_dtype=bf16``, which rounds the verifier's fp32 RoPE tables (``inv_freq``: phase
        errors up to ~0.7 rad at position 512) and averages gradients in bf16. Checkpoints gather the drafter only.

        Activation checkpointing is refused: the verifier runs without gradients (nothing to recompute), and a
        checkpoint wrapper around the drafter would recompute its forward in backward after
        :func:`inside_forward` has put the real one back (the loss recomputes itself: ``model.loss_recompute``)."""

        def __init__(self, *args, activation_checkpointing_policy=None, activation_checkpointing=None, **kwargs):
            from spectrain.heads.errors import SpectrainError

            if activation_checkpointing_policy is not None or activation_checkpointing is not None:
                raise SpectrainError("fsdp_drafter takes no activation checkpointing: the verifier runs without "
                                     "gradients and the drafter's loss recomputes itself (--model.loss_recompute)")
            super().__init__(*args, **kwargs)

        @property
        def mixed_precision_config(self):
            import torch
            from torch.distributed.fsdp import MixedPrecision

            config = super().mixed_precision_config
            if config is None or self.mixed_precision:  # the user's own config wins
                return config
            return MixedPrecision(param_dtype=config.param_dtype, reduce_dtype=torch.float32, buffer_dtype=None)

        def lightning_module_state_dict(self) -> dict:
            """What a checkpoint holds: the drafter's weights alone, gathered from its shards (a collective, as
            Lightning calls it on every rank; each gets the whole tensors, on the host). Lightning's own gathers
            the whole model, the frozen verifier included, which the module's ``on_save_checkpoint`` then drops:
            a 30B verifier's weights through rank 0's host memory at every checkpoint."""
            if self._state_dict_type != "full":
                return super().lightning_module_state_dict()
            return {f"drafter.{k}": v for k, v in full_state_dict(self.lightning_module.drafter).items()}

    if "fsdp_drafter" not in StrategyRegistry:
        StrategyRegistry.register("fsdp_drafter", DrafterFSDPStrategy, description="FSDP: verifier layers and the "
                                  "drafter in separate units, fp32 buffers and reductions (spectrain.train.strategies)",
                                  auto_wrap_policy=drafter_wrap_policy)


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
            # Our checkpoints hold tensors, numbers, strings and lists only: never unpickle code from them.
            return torch.load(path, map_location=map_location, mmap=True, weights_only=True)

    return MmapCheckpointIO()
