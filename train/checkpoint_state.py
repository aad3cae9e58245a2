"""What a training checkpoint holds besides the drafter's weights, and the checks a resumed one passes.

A checkpoint never holds the verifier (its weights are filtered out: :func:`without_verifier`); it records the
run's progress (tokens, training seconds, the learning curve) and every rank's RNG streams, so a resumed run
draws the same numbers as an uninterrupted one. Helpers of :class:`~.base.DrafterModule`'s
``on_save_checkpoint`` / ``on_load_checkpoint``; nothing here knows a drafter family.
"""

from __future__ import annotations

from typing import Optional

import torch

from spectrain.heads.errors import SpectrainError

VERIFIER_PREFIX = "verifier."  # the frozen verifier's names in the module's state dict
DRAFTER_PREFIX = "drafter."


def without_verifier(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A module's state dict minus the frozen verifier: checkpoints hold only what trains."""
    return {k: v for k, v in state_dict.items() if not k.startswith(VERIFIER_PREFIX)}


def rank_rng_state(device: torch.device) -> dict[str, torch.Tensor]:
    """This rank's RNG streams: the CPU's, and its own device's on CUDA."""
    return {"torch": torch.get_rng_state(),
            **({"cuda": torch.cuda.get_rng_state(device)} if device.type == "cuda" else {})}


def gathered_rng_state(mine: dict, world: int) -> dict:
    """Every rank's streams (``mine`` on this rank), gathered so rank 0's checkpoint holds them all (a collective
    when ``world > 1``): ``{"ranks": [rank 0's, rank 1's, ...]}``."""
    ranks = [mine] * world
    if world > 1:
        torch.distributed.all_gather_object(ranks, mine)
    return {"ranks": ranks}


def restore_rank_rng(rng: dict, world: int, rank: int, device: torch.device) -> None:
    """Set this rank's saved streams from a checkpoint's ``rng`` record. A run resumed on another number of ranks
    keeps its fresh per-rank seeds; a checkpoint from before per-rank streams holds rank 0's only."""
    ranks = rng.get("ranks") or ([{"torch": rng["torch"]}] if "torch" in rng else [])
    if len(ranks) != world:
        return
    mine = ranks[rank]
    torch.set_rng_state(mine["torch"])
    if "cuda" in mine and device.type == "cuda":
        torch.cuda.set_rng_state(mine["cuda"], device)


def check_method_and_names(saved: dict, own: dict[str, torch.Tensor], weights: Optional[dict],
                           method: str) -> None:
    """Refuse a checkpoint of another method (its ``"spectrain"`` record ``saved``) or one that lacks any of the
    drafter's weights ``own`` (names without the ``drafter.`` prefix) among its state dict ``weights``."""
    if saved.get("method", method) != method:
        raise SpectrainError(f"checkpoint is for {saved.get('method')!r}, not {method!r}")
    missing = [k for k in own if f"{DRAFTER_PREFIX}{k}" not in weights]
    if missing:
        raise SpectrainError(f"checkpoint lacks drafter weights {missing[:4]}: it is not a {method} checkpoint")


def check_shapes(own: dict[str, torch.Tensor], weights: Optional[dict]) -> None:
    """Refuse a checkpoint whose drafter weights have other shapes than ``own``: another config trained it."""
    wrong = [k for k, v in own.items() if tuple(weights[f"{DRAFTER_PREFIX}{k}"].shape) != tuple(v.shape)]
    if wrong:
        raise SpectrainError(f"the checkpoint's drafter has other shapes ({wrong[:3]}): it was trained with "
                             "another config")


def drafter_state(path: str) -> dict[str, torch.Tensor]:
    """The drafter's weights (names without the ``drafter.`` prefix) from a Lightning checkpoint of a
    ``DrafterModule`` (loaded with weights_only, memory-mapped)."""
    state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)["state_dict"]
    return {k[len(DRAFTER_PREFIX):]: v for k, v in state.items() if k.startswith(DRAFTER_PREFIX)}


def check_same_drafter(source: torch.nn.Module, drafter: torch.nn.Module, path: str) -> None:
    """Refuse ``model.init_from``'s drafter ``source`` (read from ``path``) unless it is of ``drafter``'s class and
    method, with the same tensor names and shapes."""
    ours, theirs = drafter.state_dict(), source.state_dict()
    if type(source) is not type(drafter) or set(theirs) != set(ours) or (
            source.config.method != drafter.config.method):
        raise SpectrainError(f"model.init_from {path} holds a drafter of another kind or shape than this run's "
                             f"({type(source).__name__} {source.config.method} with {len(theirs)} tensors vs "
                             f"{len(ours)}): match --model.* to it")
    wrong = [k for k in ours if ours[k].shape != theirs[k].shape]
    if wrong:
        raise SpectrainError(f"model.init_from {path}: tensor shapes differ from this run's drafter: {wrong[:4]}")
