"""Candidate structures: chains and static sparse trees, plus the tree builder.

A tree is given as a list of paths over top-k ranks: ``(0,)`` is
head 1's top token, ``(0, 1)`` head 2's second token after it, and so on. A
chain of k drafts is ``[(0,), (0, 0), ..., (0,)*k]``. Node i of the verify input
(after the root, i.e. the last emitted token) is ``paths[i]`` in sorted order.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from spectrain.heads.errors import SpectrainError


@dataclass(frozen=True)
class Tree:
    """Static candidate tree; nodes sorted by (depth, path), so parents precede children.

    Attributes:
        paths: one rank tuple per node.
        parent: (n,) index of the parent node, -1 for depth-1 nodes (children of the root).
        depth: (n,) 1-based depth; node i drafts the token ``depth[i]`` places after the root.
        rank: (n,) the top-k rank this node takes from its depth's drafter distribution.
        ancestors: (n, n) bool, ancestors[i, j] = node j is on the path to node i (itself included).
        children: (n + 1, max_children) node ids of the children of the root (row 0) and of node i (row i+1),
            ordered by rank, padded with -1.
    """

    paths: tuple[tuple[int, ...], ...]
    parent: torch.Tensor
    depth: torch.Tensor
    rank: torch.Tensor
    ancestors: torch.Tensor
    children: torch.Tensor

    @property
    def size(self) -> int:
        return len(self.paths)

    @property
    def max_depth(self) -> int:
        return max((len(p) for p in self.paths), default=0)

    @property
    def is_chain(self) -> bool:
        return all(p == (0,) * len(p) for p in self.paths) and len({len(p) for p in self.paths}) == self.size

    def to(self, device) -> "Tree":
        return Tree(self.paths, *(t.to(device) for t in (self.parent, self.depth, self.rank, self.ancestors,
                                                           self.children)))

    @classmethod
    def chain(cls, k: int) -> "Tree":
        if k < 0:
            raise SpectrainError(f"chain length must be >= 0, got {k}")
        return cls.from_paths([(0,) * d for d in range(1, k + 1)])

    @classmethod
    def from_paths(cls, paths) -> "Tree":
        """Validate and index a list of rank paths (every prefix of a path must itself be a path)."""
        try:
            paths = sorted({tuple(int(r) for r in p) for p in paths}, key=lambda p: (len(p), p))
        except (TypeError, ValueError):
            raise SpectrainError("a tree is a list of paths, each a list of non-negative integer ranks") from None
        if any(len(p) == 0 or min(p) < 0 for p in paths):
            raise SpectrainError("tree paths must be non-empty lists of non-negative ranks")
        index = {p: i for i, p in enumerate(paths)}
        missing = [p[:-1] for p in paths if len(p) > 1 and p[:-1] not in index]
        if missing:
            raise SpectrainError(f"tree path {list(missing[0])} is missing: every prefix of a path must be in the tree")
        n = len(paths)
        parent = torch.tensor([index[p[:-1]] if len(p) > 1 else -1 for p in paths], dtype=torch.long)
        depth = torch.tensor([len(p) for p in paths], dtype=torch.long)
        rank = torch.tensor([p[-1] for p in paths], dtype=torch.long)
        ancestors = torch.zeros(n, n, dtype=torch.bool)
        for i, p in enumerate(paths):
            for d in range(1, len(p) + 1):
                ancestors[i, index[p[:d]]] = True
        kids: list[list[int]] = [[] for _ in range(n + 1)]
        for i in range(n):
            kids[int(parent[i]) + 1].append(i)  # paths are sorted, so children come in rank order
        width = max((len(k) for k in kids), default=0) or 1
        children = torch.full((n + 1, width), -1, dtype=torch.long)
        for row, k in enumerate(kids):
            children[row, :len(k)] = torch.tensor(k, dtype=torch.long)
        return cls(tuple(paths), parent, depth, rank, ancestors, children)

    @classmethod
    def load(cls, spec: str) -> "Tree":
        """A tree from a JSON file or inline JSON list of paths."""
        text = Path(spec).read_text() if Path(spec).is_file() else spec
        try:
            paths = json.loads(text)
        except json.JSONDecodeError:
            raise SpectrainError(f"tree spec {spec[:80]!r} is neither a file nor a JSON list of paths") from None
        if not isinstance(paths, list) or not all(isinstance(p, list) for p in paths):
            raise SpectrainError("a tree spec is a JSON list of paths, e.g. [[0], [1], [0, 0]]")
        return cls.from_paths(paths)


@dataclass(frozen=True)
class DeviceTree:
    """A tree built on the device every round (dynamic trees): :class:`Tree`'s tensors, with its size and
    a depth bound as host ints fixed by the drafter's settings, so neither building nor verifying it reads the
    device. Nodes are in depth order (parents precede children); a node's ``rank`` is its place among its
    parent's candidates, and ``children`` rows may have gaps (-1) where a candidate was not kept.
    """

    parent: torch.Tensor
    depth: torch.Tensor
    rank: torch.Tensor
    ancestors: torch.Tensor
    children: torch.Tensor
    size: int
    max_depth: int

    is_chain = False

    def to(self, device) -> "DeviceTree":
        if self.parent.device == torch.device(device):
            return self
        return DeviceTree(*(t.to(device) for t in (self.parent, self.depth, self.rank, self.ancestors,
                                                   self.children)), self.size, self.max_depth)

    @property
    def paths(self) -> tuple[tuple[int, ...], ...]:
        """The rank paths, read back to the host (one sync: for host-side code such as a hybrid's merge)."""
        paths: list[tuple[int, ...]] = []
        for parent, rank in zip(self.parent.tolist(), self.rank.tolist()):
            paths.append((paths[parent] if parent >= 0 else ()) + (rank,))
        return tuple(paths)

    @classmethod
    def from_parents(cls, parent: torch.Tensor, rank: torch.Tensor, depth: torch.Tensor, width: int,
                     max_depth: int) -> "DeviceTree":
        """From (n,) parent indices (-1: the root; parents precede children), ranks (< ``width``) and depths."""
        n, device = parent.numel(), parent.device
        nodes = torch.arange(n, device=device)
        up = torch.cat([torch.where(parent >= 0, parent, n), parent.new_full((1,), n)])  # n: past the root
        ancestors = torch.zeros(n, n + 1, dtype=torch.bool, device=device)
        ancestors[nodes, nodes] = True
        above = up[:n]
        for _ in range(max_depth - 1):
            ancestors[nodes, above] = True
            above = up[above]
        children = torch.full(((n + 1) * width,), -1, dtype=torch.long, device=device)
        children[(parent + 1) * width + rank] = nodes
        return cls(parent, depth, rank, ancestors[:, :n], children.view(n + 1, width), n, max_depth)


def expected_accept_length(paths, accuracy) -> float:
    """Expected number of accepted drafts: sum over nodes of the product of per-depth rank accuracies.

    ``accuracy[d][r]``: probability that the rank-r candidate at depth d+1 is the verifier's token, given
    the path to it was accepted (measured top-k accuracies per head).
    """
    total = 0.0
    for p in paths:
        prob = 1.0
        for d, r in enumerate(p):
            prob *= accuracy[d][r] if d < len(accuracy) and r < len(accuracy[d]) else 0.0
        total += prob
    return total


def build_tree(accuracy, size: int) -> Tree:
    """The tree of ``size`` nodes with the highest expected acceptance for these per-depth rank accuracies.

    A node's value is the product of accuracies along its path, which never exceeds its parent's value, so
    taking nodes greedily by value (best first, frontier expansion) is optimal and always yields a tree.
    """
    if size < 1:
        raise SpectrainError(f"tree size must be >= 1, got {size}")
    import heapq

    def value(path):
        prob = 1.0
        for d, r in enumerate(path):
            prob *= accuracy[d][r]
        return prob

    frontier = [(-value((r,)), (r,)) for r in range(len(accuracy[0]))]
    heapq.heapify(frontier)
    chosen = []
    while frontier and len(chosen) < size:
        neg, path = heapq.heappop(frontier)
        chosen.append(path)
        if len(path) < len(accuracy):
            for r in range(len(accuracy[len(path)])):
                heapq.heappush(frontier, (-value(path + (r,)), path + (r,)))
    return Tree.from_paths(chosen)
