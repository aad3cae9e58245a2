"""Training batches that can resume mid-epoch, on one process or many.

``ResumableLoader`` replaces ``DataLoader(shuffle=True)`` for training. The order is a pure function of
(seed, epoch): ``randperm(n, seed + epoch)``, split round-robin over the data-parallel ranks (each rank
reads its own equal share, so no sampler injection is needed), batched with ``drop_last``. Where to start
is a pure function of how many batches training has already consumed (``position()``, from the
trainer's global step), so a run restored from a mid-epoch checkpoint skips exactly the batches it had
already trained on — no dataloader state to save, nothing to get wrong when the fetcher prefetches.

With row ``lengths`` (rows of different lengths: chat, a hidden-state store), batches are grouped by length so
little of a batch is padding: each rank's share of the permutation is cut into groups of ``64 * batch_size``
rows, each group sorted by length and cut into batches, and the batches shuffled by the same (seed, epoch)
generator. Still a pure function of (seed, epoch), with the same rows and number of batches per epoch.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset, Subset


def rank_and_world() -> tuple[int, int]:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank(), torch.distributed.get_world_size()
    return 0, 1


def is_map_style(rows) -> bool:
    """Whether ``rows`` is read by index (``len`` + ``__getitem__``) rather than streamed: torch's
    ``IterableDataset`` inherits a ``__getitem__`` (that raises), so ``hasattr`` alone cannot tell."""
    return not isinstance(rows, IterableDataset) and hasattr(rows, "__getitem__") and hasattr(rows, "__len__")


def without_targets(row: dict) -> dict:
    """``row`` with every ``loss_mask`` entry 0: a padding row that validation counts and losses skip."""
    mask = row.get("loss_mask")
    zeros = torch.zeros_like(torch.as_tensor(mask)) if torch.is_tensor(mask) else [0] * len(row["input_ids"])
    return {**row, "loss_mask": zeros}


class RankShare(Dataset):
    """Rows ``rank``, ``rank + world``, ... of a map-style dataset, padded with target-free copies of row 0 to
    ``ceil(n / world)`` rows: every rank then runs the same number of validation batches (under FSDP each
    forward gathers weights from every rank, so a rank with a batch fewer would leave the others waiting)."""

    def __init__(self, rows, rank: int, world: int):
        self.rows, self.indices = rows, range(rank, len(rows), world)
        self.length = -(-len(rows) // world)

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, i: int) -> dict:
        return self.rows[self.indices[i]] if i < len(self.indices) else without_targets(self.rows[0])


class EveryNth(IterableDataset):
    """Items ``rank``, ``rank + world``, ... of an iterable dataset: one rank's share of a validation stream. A
    last, partial round gives the ranks it does not reach a target-free copy of its first item, so every rank
    yields ``ceil(n / world)`` items (see :class:`RankShare`)."""

    def __init__(self, items, rank: int, world: int):
        self.items, self.rank, self.world = items, rank, world

    def __iter__(self):
        round_: list = []
        for item in self.items:
            round_.append(item)
            if len(round_) == self.world:
                yield round_[self.rank]
                round_ = []
        if round_:
            yield round_[self.rank] if self.rank < len(round_) else without_targets(round_[0])


class ResumableLoader:
    """Seeded, rank-sharded, mid-epoch-resumable training batches (an iterable Lightning accepts as is).

    Args:
        dataset: map-style dataset of rows.
        batch_size: rows per batch on each rank.
        collate_fn: rows -> batch dict.
        seed: the order of epoch e is ``randperm(len(dataset), generator seeded seed + e)``.
        position: callable returning the number of batches (per rank) already trained on, e.g.
            ``global_step * accumulate_grad_batches``; read each time a pass over the data starts.
        num_workers: DataLoader workers.
        lengths: every row's length; when given, batches are grouped by length (see the module docstring).
    """

    GROUP_BATCHES = 64  # batches per length-sorted group: larger = less padding, less randomness per batch

    def __init__(self, dataset: Dataset, batch_size: int, collate_fn: Callable, seed: int = 0,
                 position: Callable[[], int] | None = None, num_workers: int = 0,
                 lengths: Sequence[int] | None = None):
        self.dataset, self.batch_size, self.collate_fn = dataset, batch_size, collate_fn
        self.seed, self.position, self.num_workers = seed, position or (lambda: 0), num_workers
        if lengths is not None and len(lengths) != len(dataset):
            from spectrain.heads.errors import SpectrainError

            raise SpectrainError(f"{len(lengths)} row lengths for a dataset of {len(dataset)} rows")
        self.lengths = None if lengths is None else list(lengths)

    def __len__(self) -> int:
        _, world = rank_and_world()
        return (len(self.dataset) // world) // self.batch_size

    def epoch_indices(self, epoch: int) -> list[int]:
        """This rank's row indices for ``epoch``, in order, ``len(self) * batch_size`` of them."""
        rank, world = rank_and_world()
        generator = torch.Generator().manual_seed(self.seed + epoch)
        order = torch.randperm(len(self.dataset), generator=generator)
        per_rank = len(self.dataset) // world
        mine = order[:per_rank * world][rank::world]
        mine = mine[:len(self) * self.batch_size].tolist()
        if self.lengths is None:
            return mine
        size, group = self.batch_size, self.batch_size * self.GROUP_BATCHES
        batches = []
        for start in range(0, len(mine), group):  # a multiple of batch_size rows: every batch is full
            rows = sorted(mine[start:start + group], key=self.lengths.__getitem__)  # stable: ties keep their order
            batches += [rows[i:i + size] for i in range(0, len(rows), size)]
        # The same generator, drawn on: every rank shuffles its batches alike (long batches meet on one step).
        return [i for b in torch.randperm(len(batches), generator=generator).tolist() for i in batches[b]]

    # Lightning saves these with the checkpoint (it treats loaders with state_dict/load_state_dict as resumable);
    # the position itself comes from the restored step, so the state only guards against changed data.
    def state_dict(self) -> dict:
        state = {"rows": len(self.dataset), "batch_size": self.batch_size, "seed": self.seed}
        if self.lengths is not None:  # absent otherwise: the state older checkpoints saved
            state["group_by_length"] = True
        return state

    def load_state_dict(self, state: dict) -> None:
        mine = self.state_dict()
        if state != mine:
            from spectrain.heads.errors import SpectrainError

            if {k: v for k, v in state.items() if k != "group_by_length"} == \
                    {k: v for k, v in mine.items() if k != "group_by_length"}:
                then = bool(state.get("group_by_length"))
                raise SpectrainError(f"the checkpoint's batches were {'' if then else 'not '}grouped by length; "
                                     f"pass --data.group_by_length {str(then).lower()} to resume the same run, "
                                     "or --force to start over")
            raise SpectrainError(f"the training data changed since the checkpoint ({state} then, {mine} now): "
                                 "resuming would not continue the same run; pass --force to start over")

    def __iter__(self):
        per_epoch = len(self)
        if per_epoch == 0:
            return iter(())
        done = int(self.position())
        epoch, skip = divmod(done, per_epoch)
        indices = self.epoch_indices(epoch)[skip * self.batch_size:]
        # A generator of its own: a DataLoader without one draws its worker seed from the global RNG, which
        # would shift the random stream a resumed run restores (a drafter's feature noise draws from it).
        return iter(DataLoader(Subset(self.dataset, indices), batch_size=self.batch_size, shuffle=False,
                               drop_last=True, collate_fn=self.collate_fn, num_workers=self.num_workers,
                               pin_memory=torch.cuda.is_available(), generator=torch.Generator().manual_seed(self.seed + epoch)))
