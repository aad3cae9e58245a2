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

import weakref
from typing import Any, Callable

from torch import nn

from spectrain.heads.errors import SpectrainError


def drafter_units() -> tuple[type, ...]:
    """The module classes FSDP wraps as drafter units, each whole: every registered family's drafter class."""
    from spectrain.heads.families import families

    return tuple(family.drafter_class for family in families())


def is_drafter(module: nn.Module) -> bool:
    return isinstance(module, drafter_units())


def is_verifier_layer(module: nn.Module) -> bool:
    """A verifier decoder layer: HF's ``*DecoderLayer`` classes (LlamaDecoderLayer, Qwen3DecoderLayer, ..., from
    ``transformers`` or a hub model's remote code, ``transformers_modules``).

    Asked only of modules outside every drafter unit (:func:`drafter_wrap_policy` never looks inside one), so
    another ``*DecoderLayer`` here belongs to a drafter no family registered: refused, rather than wrapped as a
    frozen verifier unit that would split the drafter's trainable weights over verifier units and the root.
    """
    cls = type(module)
    if not cls.__name__.endswith("DecoderLayer"):
        return False
    if cls.__module__.split(".")[0] in ("transformers", "transformers_modules"):
        return True
    raise SpectrainError(f"{cls.__name__} ({cls.__module__}) is a decoder layer outside the verifier and outside "
                         f"every registered drafter's FSDP units ({', '.join(c.__name__ for c in drafter_units())}): "
                         "register its drafter family (register_family) so FSDP wraps its drafter class with the "
                         "drafter")


_INSIDE_DRAFTER: "weakref.WeakSet[nn.Module]" = weakref.WeakSet()  # strict submodules of a drafter unit seen


def drafter_wrap_policy(module: nn.Module, recurse: bool, nonwrapped_numel: int = 0) -> bool:
    """torch FSDP ``auto_wrap_policy``: each verifier decoder layer one unit, each drafter unit one (never split).

    torch asks ``recurse=True`` first (descend into the module's children? False also means: never wrap it)
    and, after its children, ``recurse=False`` (wrap what is left of it?). So a drafter unit answers True to both,
    and its own submodules — remembered when it is first asked — answer False to both: they stay in its unit.
    """
    if module in _INSIDE_DRAFTER:
        return False
    if is_drafter(module):
        if recurse:
            _INSIDE_DRAFTER.update(m for m in module.modules() if m is not module)
        return True
    return True if recurse else is_verifier_layer(module)


def fsdp_units(root: nn.Module) -> list[nn.Module]:
    """The modules torch's FSDP auto-wrap makes units of with :func:`drafter_wrap_policy`, root included (for
    tests and docs): torch's own recursion (``_recursive_wrap``) with a wrapper that only records."""
    from torch.distributed.fsdp.wrap import _recursive_wrap

    units = [root]

    def record(module: nn.Module, **kwargs) -> nn.Module:
        units.append(module)
        return module

    _recursive_wrap(root, drafter_wrap_policy, record, ignored_modules=set(), ignored_params=set(),
                    only_wrap_children=True)
    return units


def inside_forward(module: nn.Module, fn: Callable[[], Any]) -> Any:
    """``fn()`` run as ``module``'s forward: through ``module(...)``, so the hooks a sharding wrapper puts around
    forward run around it.

    Training calls drafter methods other than ``forward`` (a family's own, such as ``head_states`` or ``ttt_hidden``,
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
    """The drafter's own class, its family's (FSDP2 swaps in a subclass of it; FSDP1 wraps it: pass the inner
    module)."""
    from spectrain.heads.families import family_of

    return family_of(module).drafter_class


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
