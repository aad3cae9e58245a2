"""Acceptance metrics pooled over prompts, exactly as defined in DEVELOPERS.md.

tau   = total tokens emitted by verify rounds / total verify rounds (prefill excluded,
        counting the bonus token, stopping at EOS or the token limit);
alpha_k = P(draft at depth k accepted | depths < k accepted) = #(a >= k) / #(a >= k-1 and depth k drafted):
        a round that drafted fewer than k (a hybrid's shorter lookup round, a chain cut by its confidence head)
        says nothing about depth k.
"""

from __future__ import annotations

from collections import Counter


def tau(emitted_per_round: list[list[int]]) -> float:
    rounds = sum(len(r) for r in emitted_per_round)
    return sum(sum(r) for r in emitted_per_round) / max(rounds, 1)


def alphas(accept_lengths: list[int], depth: int, drafted: list[int] | None = None) -> list[float | None]:
    """alpha_1..alpha_depth from per-round accept lengths and, per round, the depth it drafted (None: every round
    drafted every depth); None where no round reached depth k - 1 with a draft at depth k."""
    if drafted is not None and len(drafted) != len(accept_lengths):
        raise ValueError(f"{len(accept_lengths)} accept lengths but {len(drafted)} drafted depths")
    drafted = drafted if drafted is not None else [depth] * len(accept_lengths)
    out = []
    for k in range(1, depth + 1):
        reached = sum(a >= k - 1 and d >= k for a, d in zip(accept_lengths, drafted))
        out.append(sum(a >= k for a in accept_lengths) / reached if reached else None)
    return out


def histogram(accept_lengths: list[int], depth: int) -> list[int]:
    counts = Counter(accept_lengths)
    return [counts.get(a, 0) for a in range(depth + 1)]


def expected_tau(alpha: list[float], n: int) -> float:
    """1 + sum_{j<=n} prod_{i<=j} alpha_i: tokens per verify call for a chain of n drafts (product form)."""
    total, prod = 1.0, 1.0
    for a in alpha[:n]:
        prod *= a
        total += prod
    return total


def distinct_ngram_ratio(sequences: list[list[int]], n: int = 4) -> float:
    """Distinct n-grams / all n-grams over the outputs: near 0 for degenerate repeating text."""
    grams = [tuple(s[i:i + n]) for s in sequences for i in range(len(s) - n + 1)]
    return len(set(grams)) / len(grams) if grams else 0.0
