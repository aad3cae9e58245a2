"""Lossless at T > 0 through the whole decode loop: tokens from ``generate()`` with a depth-3 tree (siblings
at every level) follow the verifier's own sampling distribution, and a known bug in the sibling rule is caught."""

from __future__ import annotations

import collections

import pytest
import torch

from spectrain.eval import accept as accept_mod
from spectrain.eval.accept import Sampling, target_probs
from spectrain.eval.decode import generate
from spectrain.eval.drafters import Drafter, Proposal
from spectrain.eval.static_model import StaticCausalLM
from spectrain.eval.tree import Tree
from tests.eval_helpers import bigram_verifier

TREE = Tree.from_paths([[0], [1], [2], [0, 0], [0, 1], [1, 0], [0, 0, 0], [0, 0, 1], [0, 1, 0]])
SAMPLING = Sampling(temperature=20.0, top_k=5)  # q' spread over 5 tokens per position: every bin well filled
PROMPT = [3, 17, 42, 7]
DRAWS = 3000


class RankOracle(Drafter):
    """Drafts each tree node as the verifier's own rank-r token after the node's parent: deterministic
    candidates that q' gives real mass, so accepts and rejections happen at every level and between siblings."""

    def __init__(self, model):
        super().__init__(TREE)
        self.model, self.cache = model, {}

    def ranked(self, context: tuple[int, ...]) -> list[int]:
        if context not in self.cache:
            with torch.no_grad():
                self.cache[context] = self.model(torch.tensor([context])).logits[0, -1].topk(3).indices.tolist()
        return self.cache[context]

    def propose(self, state):
        context = tuple(state.tokens[:state.length].tolist())
        drafts = {}
        for path in TREE.paths:  # parents precede children
            parent = tuple(drafts[path[:i]] for i in range(1, len(path)))
            drafts[path] = self.ranked(context + parent)[path[-1]]
        return Proposal(tokens=torch.tensor([drafts[p] for p in TREE.paths]))


@pytest.fixture(scope="module")
def setup():
    model, _ = bigram_verifier("llama", mix=0.3)
    return model, RankOracle(model)


def q_after(model, tokens: list[int]) -> torch.Tensor:
    """The verifier's q' (temperature, top-k) for the token after ``tokens``, from HF's own forward."""
    with torch.no_grad():
        logits = model(torch.tensor([tokens])).logits[0, -1]
    return target_probs(logits, SAMPLING)


def draw(model, drafter) -> list[tuple[int, ...]]:
    """DRAWS runs of prefill + one tree round: tokens 1 (prefill's), 2 and 3 (the round's) of each."""
    runner = StaticCausalLM(model, max_len=32)
    g = torch.Generator().manual_seed(1)  # (min p over seeds 0-5: 0.015, 0.17, 0.55, 0.15, 0.47, 0.14: uniform, as under H0)
    out = []
    for _ in range(DRAWS):
        out.append(tuple(generate(runner, drafter, PROMPT, 3, SAMPLING, generator=g).tokens[:3]))
    return out


def chi_square_p(observed: collections.Counter, q: torch.Tensor) -> float:
    from scipy.stats import chisquare

    support = (q > 0).nonzero()[:, 0].tolist()
    assert sum(observed[t] for t in support) == sum(observed.values()), "a token outside q's support was emitted"
    total = sum(observed.values())
    expected = q[support].double() / q[support].double().sum() * total  # (sums must agree to 1e-8)
    return chisquare([observed[t] for t in support], expected.tolist()).pvalue


def conditional_p_values(model, draws) -> list[float]:
    """χ² p of token 2 given the most frequent token 1, and of token 3 given the most frequent (1, 2) pair."""
    first = collections.Counter(d[0] for d in draws).most_common(1)[0][0]
    seconds = collections.Counter(d[1] for d in draws if d[0] == first)
    second = seconds.most_common(1)[0][0]
    thirds = collections.Counter(d[2] for d in draws if d[:2] == (first, second))
    assert sum(thirds.values()) > 300, "too few draws reach the third token for a test"
    return [chi_square_p(seconds, q_after(model, PROMPT + [first])),
            chi_square_p(thirds, q_after(model, PROMPT + [first, second]))]


def test_generate_samples_the_verifier_distribution_through_a_tree(setup):
    model, drafter = setup
    draws = draw(model, drafter)
    lengths = collections.Counter()
    runner = StaticCausalLM(model, max_len=32)
    for seed in range(200):  # the round accepts 0, 1, 2 and 3 drafts: every level of the tree is exercised
        lengths.update(generate(runner, drafter, PROMPT, 5, SAMPLING,
                                generator=torch.Generator().manual_seed(seed)).accept_lengths[:1])
    assert set(lengths) == {0, 1, 2, 3}, lengths
    assert min(conditional_p_values(model, draws)) > 0.01


def test_a_sibling_rule_without_renormalization_is_detected(setup, monkeypatch):
    """Negative control: trying sibling c_j with probability q'(c_j) instead of q'(c_j) / (1 - sum_{i<j} q'(c_i))
    (the rejected siblings' mass not removed) must fail the same test."""
    monkeypatch.setattr(accept_mod, "sibling_accept_probs", lambda q_tok: q_tok)
    model, drafter = setup
    assert min(conditional_p_values(model, draw(model, drafter))) < 1e-6
