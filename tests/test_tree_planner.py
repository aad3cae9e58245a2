"""Tree structure, the tree builder's optimality, and the planner's formulas."""

from __future__ import annotations

import itertools

import pytest

from spectrain.eval.costs import plan
from spectrain.eval.metrics import alphas, distinct_ngram_ratio, expected_tau, histogram, tau
from spectrain.eval.tree import Tree, build_tree, expected_accept_length


def test_tree_indexing():
    tree = Tree.from_paths([[1], [0], [0, 0], [1, 0], [0, 1], [0, 0, 0]])
    assert tree.paths == ((0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0))
    assert tree.parent.tolist() == [-1, -1, 0, 0, 1, 2]
    assert tree.depth.tolist() == [1, 1, 2, 2, 2, 3]
    assert tree.children[0].tolist()[:2] == [0, 1] and tree.children[1].tolist()[:2] == [2, 3]
    assert tree.ancestors[5].tolist() == [True, False, True, False, False, True]
    assert not tree.is_chain and Tree.chain(3).is_chain and Tree.chain(3).max_depth == 3


def all_subtrees(candidates, size):
    for combo in itertools.combinations(candidates, size):
        chosen = set(combo)
        if all(p[:-1] in chosen for p in combo if len(p) > 1):
            yield combo


def test_build_tree_is_optimal():
    accuracy = [[0.6, 0.2, 0.1], [0.5, 0.25, 0.1], [0.4, 0.2, 0.1]]
    candidates = [p for d in range(1, 4) for p in itertools.product(range(3), repeat=d)]
    for size in (1, 3, 5, 7):
        best = max(expected_accept_length(t, accuracy) for t in all_subtrees(candidates, size))
        built = build_tree(accuracy, size)
        assert built.size == size
        assert expected_accept_length(built.paths, accuracy) == pytest.approx(best)


def test_expected_tau_constant_alpha_closed_form():
    a = 0.7
    for n in range(6):
        assert expected_tau([a] * n, n) == pytest.approx((1 - a ** (n + 1)) / (1 - a))


def test_metrics_pooled_definitions():
    # Two prompts: rounds emit 3, 1, 5 and 2 tokens (bonus included): tau = 11 / 4.
    assert tau([[3, 1], [5, 2]]) == pytest.approx(11 / 4)
    accept = [2, 0, 4, 1]
    assert histogram(accept, 4) == [1, 1, 1, 0, 1]
    # alpha_1 = #(a>=1)/#(a>=0) = 3/4, alpha_2 = #(a>=2)/#(a>=1) = 2/3, alpha_3 = 1/2, alpha_4 = 1/1
    assert alphas(accept, 4) == pytest.approx([3 / 4, 2 / 3, 1 / 2, 1.0])
    assert distinct_ngram_ratio([[1, 2, 1, 2, 1, 2, 1, 2]], 4) == pytest.approx(2 / 5)


def test_planner_picks_the_best_chain():
    rows = plan([0.8, 0.6, 0.4], t_decode=1.0, t_verify={1: 1.0, 2: 1.05, 3: 1.5}, t_draft={})
    speedups = {r["n"]: r["expected_speedup"] for r in rows}
    assert speedups[1] == pytest.approx(1.8)
    assert speedups[2] == pytest.approx((1 + 0.8 + 0.48) / 1.05)
    assert max(speedups, key=speedups.get) == 2
