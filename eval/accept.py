"""Lossless acceptance of drafted candidates: one vectorized rule for chains and trees.

Given the verifier's distributions q at the root and at every tree node, walk
down the tree one depth at a time (a loop of at most ``max_depth`` tensor steps,
no host sync, no per-token Python decision):

* deterministic drafts (top-k candidates, n-gram lookups, greedy draft models):
  the children c_1..c_m of the current node are tried in rank order; c_j is
  accepted with probability q'(c_j) / (1 - sum_{i<j} q'(c_i)) — the
  multi-candidate rule with the rejected tokens removed from q' — and if every
  child is rejected the bonus token is drawn from q' with all of them removed.
  Every token x then comes out with probability exactly q'(x).
* sampled drafts (a chain whose tokens were drawn from the drafter's p):
  standard speculative sampling: accept with min(1, q/p), on rejection draw
  from the residual (q - p)+ normalized.

At temperature 0, q is one-hot at the argmax, and both rules reduce to "accept
while the draft equals the verifier's greedy token" (the longest matching path).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .tree import Tree


@dataclass(frozen=True)
class Sampling:
    """How the verifier's next-token distribution is formed. ``temperature == 0`` is greedy."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0

    def __post_init__(self):
        from spectrain.heads.errors import SpectrainError

        if self.temperature < 0:
            raise SpectrainError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise SpectrainError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise SpectrainError(f"top_k must be >= 0, got {self.top_k}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def target_probs(logits: torch.Tensor, sampling: Sampling) -> torch.Tensor:
    """(..., V) logits -> (..., V) probabilities after temperature, top-k and top-p (one-hot if greedy)."""
    logits = logits.float()
    if sampling.greedy:
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).float()
    logits = logits / sampling.temperature
    if sampling.top_k:
        kth = logits.topk(min(sampling.top_k, logits.shape[-1]), dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if sampling.top_p < 1.0:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        cum = sorted_logits.softmax(-1).cumsum(-1)
        drop_sorted = cum - sorted_logits.softmax(-1) >= sampling.top_p  # keep the smallest set reaching top_p
        logits = logits.masked_fill(drop_sorted.scatter(-1, order, drop_sorted), float("-inf"))
    return logits.softmax(-1)


def sample(probs: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """Draw one token per row without a host sync (exponential race: argmax p / E, E ~ Exp(1))."""
    race = torch.empty_like(probs).exponential_(1.0, generator=generator)
    return (probs / race).argmax(-1)


def residual_after_rejection(q: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """(q - p)+, unnormalized: the distribution a rejected sampled draft hands over to."""
    return (q - p).clamp_min(0.0)


def _normalize_or(p: torch.Tensor, fallback: torch.Tensor) -> torch.Tensor:
    """``p`` normalized per row; ``fallback`` where a row of ``p`` has no mass left.

    After a rejection the bonus token comes from what the tried candidates left of q'. When they covered its
    whole support, one of them is accepted with probability 1 in exact arithmetic, but float rounding can leave
    p_accept a hair under 1, and sampling from an all-zero row would return token 0, which q' may give no mass at
    all. Falling back to q' (a measure-zero event) keeps every emitted token inside q's support."""
    total = p.sum(-1, keepdim=True)
    return torch.where(total > 0, p / total.clamp_min(1e-30), fallback)


def sibling_accept_probs(q_tok: torch.Tensor) -> torch.Tensor:
    """(N, width) q'(c_j) of a node's children in rank order -> the probability of accepting c_j once c_1..c_{j-1}
    were rejected: q'(c_j) / (1 - sum_{i<j} q'(c_i)), q' with the rejected siblings' mass removed."""
    tried_before = q_tok.cumsum(1) - q_tok
    return q_tok / (1.0 - tried_before).clamp_min(1e-30)


@dataclass
class Verdict:
    """Outcome of one verify round for a batch of N independent candidate sets.

    Attributes:
        path: (N, max_depth) accepted node ids by depth, -1 past the accept length.
        accept_length: (N,) accepted drafts.
        bonus: (N,) token drawn from the verifier after the accepted path.
    """

    path: torch.Tensor
    accept_length: torch.Tensor
    bonus: torch.Tensor


def accept(q: torch.Tensor, drafts: torch.Tensor, tree: Tree, draft_probs: torch.Tensor | None = None,
           generator: torch.Generator | None = None) -> Verdict:
    """Accept a prefix path of ``tree`` losslessly.

    Args:
        q: (N, n+1, V) verifier probabilities: row 0 at the root, row i+1 after node i.
        drafts: (N, n) drafted tokens of the tree nodes.
        tree: the candidate structure (on q's device).
        draft_probs: (N, n, V) the drafter's p for sampled drafts (chains only); None for deterministic drafts.
    """
    N, rows, V = q.shape
    device = q.device
    batch = torch.arange(N, device=device)
    depth_cap = tree.max_depth
    if draft_probs is not None and not tree.is_chain:
        raise ValueError("sampled drafts are supported on chains; trees take deterministic (top-k) drafts")
    cur = torch.zeros(N, dtype=torch.long, device=device)  # row of q: 0 = root, i+1 = node i
    done = torch.zeros(N, dtype=torch.bool, device=device)
    length = torch.zeros(N, dtype=torch.long, device=device)
    path = torch.full((N, max(depth_cap, 1)), -1, dtype=torch.long, device=device)
    residual = q[:, 0]
    bonus_dist = residual
    for d in range(depth_cap):
        kids = tree.children[cur]  # (N, width)
        valid = (kids >= 0) & ~done[:, None]
        safe = kids.clamp_min(0)
        tokens = drafts.gather(1, safe)  # (N, width)
        u = torch.rand(kids.shape, device=device, generator=generator)
        q_tok = residual.gather(1, tokens) * valid
        if draft_probs is None:
            p_accept = sibling_accept_probs(q_tok)
            # Rejecting every child removes all their tokens from q' (siblings are distinct tokens).
            tried = torch.zeros_like(residual).scatter_add(1, tokens, valid.to(residual.dtype)) > 0
            rejected = residual.masked_fill(tried, 0.0)
        else:
            p_node = draft_probs[batch, safe[:, 0]]  # (N, V): chain => one child
            p_tok = p_node.gather(1, tokens[:, :1])
            p_accept = torch.minimum(torch.ones_like(q_tok), q_tok / p_tok.clamp_min(1e-30))
            rejected = torch.where(valid[:, :1], residual_after_rejection(residual, p_node), residual)
        hit = (u < p_accept) & valid
        any_hit = hit.any(1)
        first = hit.int().argmax(1)
        chosen = kids.gather(1, first[:, None])[:, 0]
        stop_now = ~done & ~any_hit
        bonus_dist = torch.where(stop_now[:, None], _normalize_or(rejected, residual), bonus_dist)
        go = ~done & any_hit
        path[:, d] = torch.where(go, chosen, path[:, d])
        length = length + go.long()
        cur = torch.where(go, chosen + 1, cur)
        residual = torch.where(go[:, None], q[batch, cur], residual)
        done = done | stop_now
    bonus_dist = torch.where(done[:, None], bonus_dist, q[batch, cur])
    return Verdict(path=path, accept_length=length, bonus=sample(bonus_dist, generator))


def accept_greedy(target: torch.Tensor, drafts: torch.Tensor, tree: Tree) -> Verdict:
    """:func:`accept` at temperature 0, on token ids: the longest path of ``tree`` whose drafts equal the
    verifier's argmax after each ancestor, and the argmax after it as the bonus. No vocabulary-sized tensor (no
    one-hot q, no random draws); a chain is a handful of ops, a tree a handful per depth.

    Args:
        target: (N, n+1) the verifier's argmax tokens: column 0 at the root, column i+1 after node i.
        drafts: (N, n) drafted tokens of the tree nodes.
        tree: the candidate structure (on the tensors' device).
    """
    N, n = drafts.shape
    depth_cap = max(tree.max_depth, 1)
    if tree.is_chain:
        length = (drafts == target[:, :n]).long().cumprod(1).sum(1)  # the matching prefix
        steps = torch.arange(depth_cap, device=drafts.device)  # chain node d sits at depth d + 1
        path = torch.where(steps < length[:, None], steps, -1)  # (an empty chain: one column of -1)
        return Verdict(path=path, accept_length=length, bonus=target.gather(1, length[:, None])[:, 0])
    cur = torch.zeros(N, dtype=torch.long, device=drafts.device)  # column of target: 0 = root, i+1 = node i
    go = torch.ones(N, dtype=torch.bool, device=drafts.device)
    path = []
    for _ in range(depth_cap):
        kids = tree.children[cur]  # (N, width)
        hit = (drafts.gather(1, kids.clamp_min(0)) == target.gather(1, cur[:, None])) & (kids >= 0)
        go = go & hit.any(1)
        chosen = kids.gather(1, hit.int().argmax(1, keepdim=True))[:, 0]
        path.append(torch.where(go, chosen, -1))
        cur = torch.where(go, chosen + 1, cur)
    path = torch.stack(path, 1)
    return Verdict(path=path, accept_length=(path >= 0).sum(1), bonus=target.gather(1, cur[:, None])[:, 0])
