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
    # Rounds that drafted 2, 1, 4, 2 deep: round 1 accepted both of its 2 drafts, so it says nothing of depth 3:
    # alpha_2 = #(a>=2) / #(a>=1, drafted>=2) = 2/3 (rounds 1, 3, 4), alpha_3 = #(a>=3) / #(a>=2, drafted>=3) = 1/1
    # (round 3 only; without depths 1/2), alpha_4 = 1/1.
    assert alphas(accept, 4, [2, 1, 4, 2]) == pytest.approx([3 / 4, 2 / 3, 1.0, 1.0])
    assert alphas([1, 1, 2], 2, [1, 2, 2]) == pytest.approx([1.0, 1 / 2])  # without depths: 1/3
    assert alphas([1, 1, 2], 2) == pytest.approx([1.0, 1 / 3])
    with pytest.raises(ValueError):
        alphas([1, 2], 2, [2])
    assert distinct_ngram_ratio([[1, 2, 1, 2, 1, 2, 1, 2]], 4) == pytest.approx(2 / 5)


def test_planner_picks_the_best_chain():
    rows = plan([0.8, 0.6, 0.4], t_decode=1.0, t_verify={1: 1.0, 2: 1.05, 3: 1.5}, t_draft={})
    speedups = {r["n"]: r["expected_speedup"] for r in rows}
    assert speedups[1] == pytest.approx(1.8)
    assert speedups[2] == pytest.approx((1 + 0.8 + 0.48) / 1.05)
    assert max(speedups, key=speedups.get) == 2


def test_rank_accuracies_follow_the_decoding_temperature():
    """The tree planner's rank accuracy is how often the verifier emits a candidate: at T = 0 the greedy hit
    rate; at T > 0 the mean q'(candidate) (a deterministic candidate is accepted with exactly that probability),
    here checked against q' computed straight from HF's forward."""
    import torch

    from spectrain.eval.accept import Sampling, target_probs
    from spectrain.eval.medusa import MedusaDrafter, medusa_diagnostics
    from spectrain.eval.static_model import StaticCausalLM
    from tests.eval_helpers import bigram_verifier, oracle_medusa

    model, perm = bigram_verifier("llama", mix=0.3)
    drafter = MedusaDrafter(oracle_medusa(model, perm, 2, noise=1.0), model.get_output_embeddings(), Tree.chain(2))
    prompt = torch.randint(0, 300, (4,), generator=torch.Generator().manual_seed(0))
    seq = model.generate(prompt[None], max_new_tokens=20, do_sample=False)[0].tolist()  # the verifier's own text
    runner = StaticCausalLM(model, max_len=32)
    sampled = Sampling(temperature=20.0, top_k=5)
    greedy = medusa_diagnostics(runner, drafter, [seq], [4], max_rank=3)
    at_t = medusa_diagnostics(runner, drafter, [seq], [4], max_rank=3, decoding=sampled)
    with torch.no_grad():
        logits = model(torch.tensor([seq])).logits[0]
        heads = drafter._logits_many(model.model(torch.tensor([seq])).last_hidden_state[0])  # (K, T, V)
    q = target_probs(logits, sampled)
    for k in range(2):
        t = torch.arange(3, len(seq) - k - 1)  # head k at t drafts t + k + 2: q' after position t + k + 1
        top = heads[k, t].topk(3, dim=-1).indices
        want = q[t + k + 1].gather(1, top).mean(0)
        assert at_t["rank_accuracy"][k] == pytest.approx(want.tolist(), abs=1e-5)
        hits = (top == logits[t + k + 1].argmax(-1)[:, None]).double().mean(0)
        assert greedy["rank_accuracy"][k] == pytest.approx(hits.tolist(), abs=1e-9)
    assert at_t["rank_accuracy"][0][0] < greedy["rank_accuracy"][0][0]  # greedy hits overrate rank 0 at T > 0
