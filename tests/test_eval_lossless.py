"""The evaluator is lossless: greedy identity, exact sampling distribution, exact KV rollback."""

from __future__ import annotations

import collections
import itertools

import pytest
import torch

from spectrain.eval import accept as accept_mod
from spectrain.eval.accept import Sampling, accept
from spectrain.eval.decode import generate
from spectrain.eval.drafters import Autoregressive, DynamicTreeDrafter, ModelDrafter, NgramDrafter, truncated_verifier
from spectrain.eval.medusa import MedusaDrafter
from spectrain.eval.static_model import StaticCausalLM
from spectrain.eval.tree import Tree
from tests.eval_helpers import bigram_verifier, noised_copy, oracle_medusa

K = 4
TREE = Tree.from_paths([[0], [1], [0, 0], [0, 1], [1, 0], [0, 0, 0], [0, 0, 0, 0]])


def prompts(n: int = 3, length: int = 10, vocab: int = 300):
    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, vocab, (length,), generator=g).tolist() for _ in range(n)]


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def verifier(request):
    model, perm = bigram_verifier(request.param)
    return model, perm


def hf_greedy(model, prompt, n):
    out = model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False)
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize("kind", ["medusa-chain", "medusa-tree", "draft-model", "truncated", "ngram", "dynamic-tree"])
def test_greedy_spec_equals_ar_and_hf_generate(verifier, kind):
    model, perm = verifier
    runner = StaticCausalLM(model, max_len=128)
    lm_head = model.get_output_embeddings()
    drafter = {
        "medusa-chain": lambda: MedusaDrafter(oracle_medusa(model, perm, K, noise=1.4), lm_head, Tree.chain(K)),
        "medusa-tree": lambda: MedusaDrafter(oracle_medusa(model, perm, K, noise=1.4), lm_head, TREE),
        "draft-model": lambda: ModelDrafter(noised_copy(model, 0.8), K, max_len=128),
        "truncated": lambda: ModelDrafter(truncated_verifier(model, 1), K, max_len=128),
        "ngram": lambda: NgramDrafter(K),
        "dynamic-tree": lambda: DynamicTreeDrafter(noised_copy(model, 0.8), depth=K, topk=2, budget=8, max_len=128),
    }[kind]()
    histogram = collections.Counter()
    for prompt in prompts():
        expected = hf_greedy(model, prompt, 60)
        assert generate(runner, Autoregressive(), prompt, 60).tokens == expected
        spec = generate(runner, drafter, prompt, 60)
        assert spec.tokens == expected
        assert sum(spec.emitted_per_round) + 1 == len(spec.tokens)  # +1: the prefill's token
        histogram.update(spec.accept_lengths)
    if kind in ("medusa-chain", "medusa-tree", "draft-model", "dynamic-tree"):
        assert set(histogram) == set(range(K + 1)), f"rejections, partial and full acceptance all occur: {histogram}"


def test_eos_stops_generation(verifier):
    model, perm = verifier
    runner = StaticCausalLM(model, max_len=128)
    prompt = prompts(1)[0]
    full = generate(runner, Autoregressive(), prompt, 30).tokens
    eos = full[7]
    first = full.index(eos)
    drafter = MedusaDrafter(oracle_medusa(model, perm, K, noise=0.0), model.get_output_embeddings(), Tree.chain(K))
    out = generate(runner, drafter, prompt, 30, eos_ids={eos})
    assert out.tokens == full[:first + 1] and out.stop == "eos"


def test_kv_rollback_equals_fresh_prefill(verifier):
    """After rounds with rejections, the committed cache equals running the verifier on the kept tokens."""
    model, perm = verifier
    runner = StaticCausalLM(model, max_len=128)
    prompt = prompts(1)[0]
    drafter = MedusaDrafter(oracle_medusa(model, perm, K, noise=1.4), model.get_output_embeddings(), TREE)
    out = generate(runner, drafter, prompt, 40)
    assert any(0 < a < K for a in out.accept_lengths), "the run must include partial rejections"
    # The cache holds prompt + all emitted tokens but the last (the next round's root).
    kept = prompt + out.tokens[:-1]
    assert runner.length == len(kept)
    fresh = StaticCausalLM(model, max_len=128)
    fresh.forward(torch.tensor(kept))
    n = len(kept)
    for ours, theirs in zip(runner.cache.k + runner.cache.v, fresh.cache.k + fresh.cache.v):
        torch.testing.assert_close(ours[:, :, :n], theirs[:, :, :n], rtol=1e-5, atol=1e-5)


# ------------------------------------------------------------------------------ exact sampling distribution

V, ROOT, DRAWS = 4, 0, 60_000


def toy_tables(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    q = torch.rand(V, V, generator=g) ** 2 + 0.05
    p = torch.rand(V, V, generator=g) ** 2 + 0.05
    return q / q.sum(-1, keepdim=True), p / p.sum(-1, keepdim=True)


def first_tokens_by_speculative_sampling(Q, P, k: int, draws: int, seed: int) -> torch.Tensor:
    """(draws, k+1) first k+1 tokens of batched speculative sampling with a chain of k sampled drafts."""
    g = torch.Generator().manual_seed(seed)
    out = torch.full((draws, k + 1), -1, dtype=torch.long)
    filled = torch.zeros(draws, dtype=torch.long)
    last = torch.full((draws,), ROOT, dtype=torch.long)
    tree = Tree.chain(k)
    rows = torch.arange(draws)
    while bool((filled < k + 1).any()):
        drafts, probs, prev = [], [], last
        for _ in range(k):
            p = P[prev]
            d = torch.multinomial(p, 1, generator=g)[:, 0]
            drafts.append(d)
            probs.append(p)
            prev = d
        drafts = torch.stack(drafts, 1)
        q = torch.stack([Q[last]] + [Q[drafts[:, i]] for i in range(k)], 1)
        verdict = accept(q, drafts, tree, torch.stack(probs, 1), generator=g)
        emitted = torch.cat([drafts, verdict.bonus[:, None]], 1)
        count = verdict.accept_length + 1
        emitted[rows, verdict.accept_length] = verdict.bonus
        for j in range(k + 1):
            take = (j < count) & (filled < k + 1)
            out[rows[take], filled[take]] = emitted[take, j]
            filled = filled + take.long()
        last = emitted[rows, verdict.accept_length]
    return out


def chi_square_p(samples: torch.Tensor, Q: torch.Tensor) -> float:
    from scipy.stats import chisquare

    k1 = samples.shape[1]
    counts = collections.Counter(map(tuple, samples.tolist()))
    observed, expected = [], []
    for seq in itertools.product(range(V), repeat=k1):
        prob, prev = 1.0, ROOT
        for t in seq:
            prob *= float(Q[prev, t])
            prev = t
        observed.append(counts.get(seq, 0))
        expected.append(prob)
    return float(chisquare(observed, rescaled(expected, observed)).pvalue)


def rescaled(probs, observed):
    """Expected counts summing exactly to the observed total (scipy checks the sums match)."""
    import numpy as np

    probs = np.asarray(probs, dtype=np.float64)
    return probs / probs.sum() * float(np.sum(observed))


def test_speculative_sampling_matches_the_verifier_distribution():
    Q, P = toy_tables()
    samples = first_tokens_by_speculative_sampling(Q, P, k=2, draws=DRAWS, seed=1)
    assert chi_square_p(samples, Q) > 0.05


def test_replacing_the_residual_by_q_is_detected(monkeypatch):
    """Negative control: the same test must fail for the classic bug of resampling from q on rejection."""
    monkeypatch.setattr(accept_mod, "residual_after_rejection", lambda q, p: q)
    Q, P = toy_tables()
    samples = first_tokens_by_speculative_sampling(Q, P, k=2, draws=DRAWS, seed=1)
    assert chi_square_p(samples, Q) < 1e-6


def test_tree_sampling_with_deterministic_siblings_matches_the_verifier():
    """Two candidate siblings at depth 1, one child below the first: the first two emitted tokens ~ Q."""
    Q, _ = toy_tables(seed=3)
    tree = Tree.from_paths([[0], [1], [0, 0]])
    g = torch.Generator().manual_seed(5)
    n = DRAWS
    drafts = torch.tensor([[1, 2, 3]]).expand(n, 3)  # node0 = 1, node1 = 2, node2 (child of node0) = 3
    q = torch.stack([Q[ROOT], Q[1], Q[2], Q[3]])[None].expand(n, 4, V)
    verdict = accept(q, drafts, tree, generator=g)
    first = torch.where(verdict.accept_length >= 1, drafts.gather(1, verdict.path[:, :1].clamp_min(0))[:, 0], verdict.bonus)
    from scipy.stats import chisquare

    observed = torch.bincount(first, minlength=V).tolist()
    assert chisquare(observed, rescaled(Q[ROOT].tolist(), observed)).pvalue > 0.05
    # Given token 1 was accepted, the next token (node2 = 3 or the bonus) follows Q[1].
    took_1 = verdict.accept_length >= 1
    took_1 &= verdict.path[:, 0] == 0
    second = torch.where(verdict.accept_length[took_1] == 2, torch.tensor(3), verdict.bonus[took_1])
    observed = torch.bincount(second, minlength=V).tolist()
    assert chisquare(observed, rescaled(Q[1].tolist(), observed)).pvalue > 0.05


# ------------------------------------------------------------------------------ hand-made accept cases


def one_hot_rows(*tokens: int, vocab: int = 8) -> torch.Tensor:
    return torch.nn.functional.one_hot(torch.tensor(tokens), vocab).float()[None]


def test_all_accepted_gives_the_bonus():
    verdict = accept(one_hot_rows(3, 5, 1, 7), torch.tensor([[3, 5, 1]]), Tree.chain(3))
    assert verdict.accept_length.tolist() == [3] and verdict.bonus.tolist() == [7]
    assert verdict.path.tolist() == [[0, 1, 2]]


def test_first_draft_rejected():
    verdict = accept(one_hot_rows(3, 5, 1, 7), torch.tensor([[4, 5, 1]]), Tree.chain(3))
    assert verdict.accept_length.tolist() == [0] and verdict.bonus.tolist() == [3]


def test_rejection_in_the_middle():
    verdict = accept(one_hot_rows(3, 5, 1, 7), torch.tensor([[3, 6, 1]]), Tree.chain(3))
    assert verdict.accept_length.tolist() == [1] and verdict.bonus.tolist() == [5]


def test_tree_second_sibling_matches():
    # root children: node0 (rank 0) = 2, node1 (rank 1) = 3; node2 = child of node1 = 6.
    tree = Tree.from_paths([[0], [1], [1, 0]])
    q = one_hot_rows(3, 0, 6, 4)  # root wants 3; node1 (token 3) wants 6; node2 wants 4 (bonus)
    verdict = accept(q, torch.tensor([[2, 3, 6]]), tree)
    assert verdict.accept_length.tolist() == [2] and verdict.path.tolist() == [[1, 2]]
    assert verdict.bonus.tolist() == [4]


def random_tree(rng: torch.Generator, max_nodes: int = 12, width: int = 3) -> Tree:
    paths = []
    while len(paths) < max_nodes:
        options = [()] + paths  # the root, or any node
        parent = options[int(torch.randint(len(options), (1,), generator=rng))]
        kids = sum(1 for p in paths if len(p) == len(parent) + 1 and tuple(p[:-1]) == tuple(parent))
        if kids < width:
            paths.append(tuple(parent) + (kids,))
    return Tree.from_paths([list(p) for p in paths])


@pytest.mark.parametrize("shape", ["chain", "tree", "empty"])
def test_greedy_fast_path_equals_the_general_rule(shape):
    """accept_greedy (argmax ids) gives the same path, accept length and bonus as accept() on one-hot q, on
    random trees and drafts biased to hit, and it draws no random numbers."""
    from spectrain.eval.accept import accept_greedy

    rng = torch.Generator().manual_seed(7)
    vocab, N = 5, 64
    for trial in range(20):
        tree = {"chain": Tree.chain(1 + trial % 6), "empty": Tree.chain(0)}.get(shape) or random_tree(rng)
        n = tree.size
        target = torch.randint(vocab, (N, n + 1), generator=rng)
        drafts = torch.randint(vocab, (N, n), generator=rng)
        if n:  # make most drafts the target after their parent, so long paths occur
            parent_col = (tree.parent + 1).clamp_min(0)
            hit = torch.rand(N, n, generator=rng) < 0.7
            drafts = torch.where(hit, target[:, parent_col], drafts)
        general = accept(torch.nn.functional.one_hot(target, vocab).float(), drafts, tree,
                         generator=torch.Generator().manual_seed(0))
        state = torch.get_rng_state()
        fast = accept_greedy(target, drafts, tree)
        assert torch.equal(torch.get_rng_state(), state)
        assert torch.equal(fast.accept_length, general.accept_length)
        assert torch.equal(fast.path, general.path) and torch.equal(fast.bonus, general.bonus)
        if shape == "tree":
            assert (general.accept_length >= 2).any()


def test_a_bonus_is_never_drawn_from_an_exhausted_residual(monkeypatch):
    """Candidates covering q's whole support are accepted with probability 1 in exact arithmetic; rounding can
    reject them all (forced here by u = 1). The bonus must then still come from q's support, not be token 0
    (what sampling an all-zero row gives)."""
    q = torch.zeros(1, 3, 8)
    q[0, 0, 5], q[0, 0, 6] = 0.75, 0.25  # the root's q: tokens 5 and 6 only
    q[0, 1:, 1] = 1.0
    tree = Tree.from_paths([[0], [1]])  # two siblings: 5 and 6, together q's support
    monkeypatch.setattr(torch, "rand", lambda *a, **k: torch.ones(*a[0] if isinstance(a[0], tuple) else a))
    verdict = accept(q, torch.tensor([[5, 6]]), tree, generator=torch.Generator().manual_seed(0))
    assert verdict.accept_length.tolist() == [0] and verdict.bonus.item() in (5, 6)
    # Sampled chain: q == p, so (q - p)+ is all zero after a (forced) rejection.
    p = q[:, 1:2].clone()
    p[0, 0] = q[0, 0]
    verdict = accept(q[:, :2], torch.tensor([[5]]), Tree.chain(1), p, generator=torch.Generator().manual_seed(0))
    assert verdict.accept_length.tolist() == [0] and verdict.bonus.item() in (5, 6)


@pytest.mark.parametrize("heads,kv_heads", [(6, 2), (4, 4), (8, 1)])
def test_grouped_attention_folds_groups_into_queries(heads, kv_heads):
    """GQA without repeating K/V: the head groups folded into the query rows give what SDPA's own GQA gives,
    through a tree mask (each query sees a different subset of the keys)."""
    import torch.nn.functional as F

    from spectrain.eval.attention import grouped_attention

    g = torch.Generator().manual_seed(0)
    n, span, d = 5, 12, 8
    q = torch.randn(1, heads, n, d, generator=g)
    keys, values = torch.randn(2, 1, kv_heads, span, d, generator=g)
    mask = torch.rand(1, 1, n, span, generator=g) < 0.6
    mask[..., 0] = True
    want = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=0.3,
                                          enable_gqa=heads != kv_heads)
    torch.testing.assert_close(grouped_attention(q, keys, values, mask, 0.3), want, rtol=1e-5, atol=1e-6)


def test_grouped_attention_takes_a_strided_attention_output(monkeypatch):
    """CUDA's memory-efficient SDPA kernel returns its output in a (B, L, H, D) layout (not contiguous in the
    head dimension); folding the groups back must not assume a contiguous result."""
    import torch.nn.functional as F

    from spectrain.eval import attention

    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 6, 5, 8, generator=g)
    keys, values = torch.randn(2, 1, 2, 12, 8, generator=g)
    mask = torch.ones(1, 1, 5, 12, dtype=torch.bool)
    want = attention.grouped_attention(q, keys, values, mask, 0.3)
    real = F.scaled_dot_product_attention
    monkeypatch.setattr(attention.F, "scaled_dot_product_attention",
                        lambda *a, **k: real(*a, **k).transpose(1, 2).contiguous().transpose(1, 2))
    torch.testing.assert_close(attention.grouped_attention(q, keys, values, mask, 0.3), want)


def test_malformed_tree_specs():
    from spectrain.heads.errors import SpectrainError

    with pytest.raises(SpectrainError, match="missing"):
        Tree.from_paths([[0, 1]])
    with pytest.raises(SpectrainError, match="non-negative"):
        Tree.from_paths([[-1]])
    with pytest.raises(SpectrainError, match="JSON"):
        Tree.load("[[0], [1")


@pytest.mark.parametrize("variant", ["eagle1", "eagle3"])
def test_greedy_eagle_chain_equals_ar(verifier, variant):
    from spectrain.eval.eagle import EagleChainDrafter
    from spectrain.heads.eagle import EagleDrafter

    model, _ = verifier
    torch.manual_seed(0)
    eagle = EagleDrafter.for_verifier(model, variant, draft_vocab_size=200 if variant == "eagle3" else None)
    runner = StaticCausalLM(model, max_len=128)
    drafter = EagleChainDrafter(eagle, model, K)
    for prompt in prompts(2):
        assert generate(runner, drafter, prompt, 40).tokens == hf_greedy(model, prompt, 40)
        sampled = generate(runner, drafter, prompt, 20, Sampling(temperature=1.0),
                           generator=torch.Generator().manual_seed(0))
        assert len(sampled.tokens) == 20


@pytest.mark.parametrize("variant", ["eagle1", "eagle3"])
@pytest.mark.parametrize("shape", ["static", "dynamic"])
def test_greedy_eagle_trees_equal_ar(verifier, variant, shape):
    from spectrain.eval.eagle import EagleTreeDrafter
    from spectrain.heads.eagle import EagleDrafter

    from tests.eval_helpers import oracle_eagle1

    model, _ = verifier
    torch.manual_seed(0)
    eagle = (oracle_eagle1(model, noise=0.8) if variant == "eagle1"
             else EagleDrafter.for_verifier(model, variant, draft_vocab_size=200))
    runner = StaticCausalLM(model, max_len=160)
    drafter = (EagleTreeDrafter(eagle, model, tree=TREE) if shape == "static"
               else EagleTreeDrafter(eagle, model, dynamic=(3, 2, 6)))
    for prompt in prompts(2):
        assert generate(runner, drafter, prompt, 30).tokens == hf_greedy(model, prompt, 30)


def test_eagle_tree_machinery_matches_the_chain(verifier):
    """A chain-shaped static tree must draft exactly what the chain drafter drafts (same masks and positions)."""
    from spectrain.eval.eagle import EagleChainDrafter, EagleTreeDrafter

    from tests.eval_helpers import oracle_eagle1

    model, _ = verifier
    eagle = oracle_eagle1(model, noise=0.8)
    runner = StaticCausalLM(model, max_len=160)
    seen = collections.Counter()
    for prompt in prompts(3):
        chain = generate(runner, EagleChainDrafter(eagle, model, K), prompt, 60)
        tree = generate(runner, EagleTreeDrafter(eagle, model, tree=Tree.chain(K)), prompt, 60)
        assert chain.accept_lengths == tree.accept_lengths
        assert chain.tokens == tree.tokens == hf_greedy(model, prompt, 60)
        seen.update(chain.accept_lengths)
    assert len(seen) >= 4, f"partial and full acceptance must both occur: {seen}"
    # A bushier static tree over the same drafter stays lossless.
    bushy = [generate(runner, EagleTreeDrafter(eagle, model, tree=TREE), p, 60) for p in prompts(3)]
    assert all(b.tokens == hf_greedy(model, p, 60) for b, p in zip(bushy, prompts(3)))
