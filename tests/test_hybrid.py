"""The hybrid drafter (prompt lookup + a learned drafter): lossless at T = 0 and T > 0, both kinds of round used."""

from __future__ import annotations

import itertools

import pytest
import torch

from spectrain.eval.accept import Sampling
from spectrain.eval.decode import generate
from spectrain.eval.drafters import HybridDrafter, NgramDrafter, merge_branch, prompt_lookup
from spectrain.eval.eagle import EagleChainDrafter, EagleTreeDrafter
from spectrain.eval.medusa import MedusaDrafter
from spectrain.eval.static_model import StaticCausalLM
from spectrain.eval.tree import Tree
from spectrain.heads.errors import SpectrainError
from tests.eval_helpers import bigram_verifier, oracle_eagle1, oracle_medusa

K = 4


def test_prompt_lookup_takes_the_longest_latest_match():
    ctx = [5, 6, 7, 1, 9, 6, 7, 2, 3, 5, 6, 7]
    assert prompt_lookup(ctx, 3, max_ngram=3) == (3, [1, 9, 6])  # "5 6 7" occurred at the start
    assert prompt_lookup([1, 2, 3, 2], 4, max_ngram=3) == (1, [3, 2, 2, 2])  # short continuation: last token repeated
    assert prompt_lookup([1, 2, 3], 2, max_ngram=3) == (0, [])


def test_merge_branch_shares_prefixes_and_adds_the_rest():
    tree = Tree.from_paths([[0], [1], [0, 0]])  # node tokens: (0,)=10, (1,)=11, (0, 0)=12
    tokens, merged = merge_branch([10, 11, 12], tree, [10, 13, 14])
    by_path = dict(zip(merged.paths, tokens))
    assert by_path == {(0,): 10, (1,): 11, (0, 0): 12, (0, 1): 13, (0, 1, 0): 14}
    tokens, merged = merge_branch([10, 11, 12], tree, [15])
    assert dict(zip(merged.paths, tokens))[(2,)] == 15 and merged.size == 4


@pytest.fixture(scope="module")
def bigram():
    return bigram_verifier("llama")


def repeated_prompts():
    g = torch.Generator().manual_seed(0)
    return [(torch.randint(0, 300, (8,), generator=g).tolist() * 2)[:13] for _ in range(3)]


def hf_greedy(model, prompt, n):
    return model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False)[0, len(prompt):].tolist()


@pytest.mark.parametrize("kind", ["eagle-chain", "medusa-chain", "medusa-tree", "eagle-tree", "eagle-dynamic"])
def test_greedy_hybrid_equals_ar_and_uses_both_drafters(bigram, kind):
    model, perm = bigram
    runner = StaticCausalLM(model, max_len=160)
    lm_head = model.get_output_embeddings()
    tree = Tree.from_paths([[0], [1], [0, 0], [0, 1], [0, 0, 0]])
    learned = {
        "eagle-chain": lambda: EagleChainDrafter(oracle_eagle1(model, noise=1.5), model, K),
        "medusa-chain": lambda: MedusaDrafter(oracle_medusa(model, perm, K, noise=1.6), lm_head, Tree.chain(K)),
        "medusa-tree": lambda: MedusaDrafter(oracle_medusa(model, perm, K, noise=1.6), lm_head, tree),
        "eagle-tree": lambda: EagleTreeDrafter(oracle_eagle1(model, noise=1.5), model, tree=tree),
        "eagle-dynamic": lambda: EagleTreeDrafter(oracle_eagle1(model, noise=1.5), model, dynamic=(3, 2, 6)),
    }[kind]()
    hybrid = HybridDrafter(learned, K, merge="chain" not in kind)
    for prompt in repeated_prompts():
        out = generate(runner, hybrid, prompt, 40)
        assert out.tokens == hf_greedy(model, prompt, 40)
        assert sum(out.emitted_per_round) + 1 == len(out.tokens)
    assert 0 < hybrid.lookup_rounds < hybrid.rounds, "both lookup and learned rounds must occur"


def test_hybrid_is_at_least_as_good_as_lookup_on_repetitive_text(bigram):
    """A chain hybrid falls back on the learned drafter only where lookup has no long match: on a prompt that
    repeats, it accepts at least as much as lookup alone over the same greedy stream."""
    model, _ = bigram
    runner = StaticCausalLM(model, max_len=160)
    eagle = EagleChainDrafter(oracle_eagle1(model, noise=0.5), model, K)
    hybrid = HybridDrafter(eagle, K, merge=False)
    lookup = sum(sum(generate(runner, NgramDrafter(K), p, 40).accept_lengths) for p in repeated_prompts())
    rounds_lookup = sum(len(generate(runner, NgramDrafter(K), p, 40).accept_lengths) for p in repeated_prompts())
    rounds_hybrid = sum(len(generate(runner, hybrid, p, 40).accept_lengths) for p in repeated_prompts())
    assert lookup > 0 and rounds_hybrid <= rounds_lookup


def test_longer_lookup_rounds_stay_lossless_and_accept_more(bigram):
    """A chain hybrid whose lookup rounds draft 3K tokens (its EAGLE rounds K): the same greedy tokens as AR, lookup
    rounds that accept more than K, and fewer verify rounds than with lookup rounds of K on repeating text."""
    model, _ = bigram
    runner = StaticCausalLM(model, max_len=160)
    eagle = EagleChainDrafter(oracle_eagle1(model, noise=0.5), model, K)
    long = HybridDrafter(eagle, K, merge=False, lookup=3 * K)
    assert long.max_nodes == 3 * K
    rounds = {}
    for name, hybrid in (("k", HybridDrafter(eagle, K, merge=False)), ("3k", long)):
        rounds[name] = 0
        for prompt in repeated_prompts():
            out = generate(runner, hybrid, prompt, 48)
            assert out.tokens == hf_greedy(model, prompt, 48)
            rounds[name] += len(out.accept_lengths)
            if name == "3k":
                assert max(out.accept_lengths) > K, "a lookup round of 3K accepts past K on repeating text"
    assert rounds["3k"] < rounds["k"]
    with pytest.raises(SpectrainError, match="lookup length must be >= 1"):
        HybridDrafter(eagle, K, merge=False, lookup=0)
    with pytest.raises(SpectrainError, match="lookup branch is its k"):
        HybridDrafter(EagleTreeDrafter(oracle_eagle1(model, noise=0.5), model, tree=Tree.chain(2)), K, merge=True,
                      lookup=8)


def test_lookup_length_sizes_the_verify_passes_and_is_checked():
    from spectrain.eval.evaluate import EvalSettings
    from spectrain.eval.methods import method_named

    hybrid = method_named("hybrid")
    assert hybrid.verify_sizes(EvalSettings(k=5, lookup=10)) == [1, 6, 11]
    assert hybrid.verify_sizes(EvalSettings(k=5)) == [1, 6]
    with pytest.raises(SpectrainError, match="--lookup must be an integer >= 0"):
        EvalSettings(lookup=-1)
    with pytest.raises(SpectrainError, match="--method eagle has no lookup"):
        method_named("eagle").check(EvalSettings(lookup=8))


def test_bad_hybrid_settings_are_refused(bigram):
    model, _ = bigram
    eagle = EagleChainDrafter(oracle_eagle1(model, noise=0.5), model, K)
    with pytest.raises(SpectrainError, match="min_match"):
        HybridDrafter(eagle, K, merge=False, min_match=0)
    with pytest.raises(SpectrainError, match="chain of 3"):
        HybridDrafter(eagle, 3, merge=False)
    with pytest.raises(SpectrainError, match="learned drafter"):
        HybridDrafter(NgramDrafter(K), K, merge=False)


def test_sampled_chain_rounds_need_the_longer_match(bigram):
    """At T > 0 lookup drafts are deterministic (accepted with probability q(c)), so a chain round drafts by lookup
    only for a match of ``min_match_sampled`` tokens, found by looking up n-grams that long; T = 0 keeps
    ``min_match``."""
    from spectrain.eval.drafters import DraftState

    model, perm = bigram
    medusa = MedusaDrafter(oracle_medusa(model, perm, K, noise=1.6), model.get_output_embeddings(), Tree.chain(K))
    hybrid = HybridDrafter(medusa, K, merge=False, min_match=2, min_match_sampled=4)
    three = [7, 8, 9, 50, 51, 52, 53, 7, 8, 9]  # the last 3 tokens occurred before, the last 4 did not
    four = [6, 7, 8, 9, 50, 51, 52, 53, 6, 7, 8, 9]

    def drafted_by_lookup(history: list[int], sampling: Sampling) -> bool:
        before = hybrid.lookup_rounds
        tokens = hybrid.propose(DraftState(tokens=torch.tensor(history + [0] * 8), length=len(history),
                                           hidden=torch.randn(model.config.hidden_size), sampling=sampling,
                                           history=history)).tokens.tolist()
        assert not (hybrid.lookup_rounds > before) or tokens == [50, 51, 52, 53]
        return hybrid.lookup_rounds > before

    assert drafted_by_lookup(three, Sampling()) and drafted_by_lookup(four, Sampling())
    assert not drafted_by_lookup(three, Sampling(temperature=1.0))
    assert drafted_by_lookup(four, Sampling(temperature=1.0))
    with pytest.raises(SpectrainError, match="min_match_sampled"):
        HybridDrafter(medusa, K, merge=False, min_match_sampled=9)


class RecordingEagle(EagleChainDrafter):
    """Checks the feature hand-over: after every learned round its cache holds exactly the committed positions."""

    seen: list

    def propose(self, state):
        proposal = super().propose(state)
        assert self.past[0].shape[2] == state.length - 1, (self.past[0].shape[2], state.length)
        self.seen.append((state.length, proposal.tokens.tolist()))
        return proposal


@pytest.mark.parametrize("merge", [False, True])
def test_lookup_rounds_hand_their_features_to_the_next_learned_round(bigram, merge):
    """Lossless output alone cannot show it (any drafter is lossless): the learned drafter's cache must cover
    every committed position, and what it drafts after lookup rounds must equal what the same drafter drafts
    when fed the whole stream at once."""
    from spectrain.eval.drafters import DraftState

    model, _ = bigram
    runner = StaticCausalLM(model, max_len=160)
    eagle = oracle_eagle1(model, noise=1.5)
    recording = RecordingEagle(eagle, model, K)
    hybrid = HybridDrafter(recording, K, merge=merge, min_match=3)
    checked = 0
    for prompt in repeated_prompts():
        recording.seen = []
        stream = prompt + generate(runner, hybrid, prompt, 40).tokens
        checked += len(recording.seen)
        for length, tokens in recording.seen[1:]:  # rounds after the first: lookup rounds may lie in between
            ids = torch.tensor(stream[:length])
            hidden = StaticCausalLM(model, max_len=160).forward(ids[:-1])
            state = DraftState(tokens=torch.tensor(stream + [0] * 8), length=length, hidden=hidden[-1],
                               sampling=Sampling(), history=stream[:length], new_features=hidden, new_tokens=ids[1:])
            assert EagleChainDrafter(eagle, model, K).propose(state).tokens.tolist() == tokens
    assert hybrid.lookup_rounds > 0 and checked > 3


# ------------------------------------------------------------------------------ T > 0: the verifier's distribution

VOCAB, DRAWS = 5, 3000


def exact_pair_distribution(model, prompt: list[int], temperature: float) -> torch.Tensor:
    """(V, V) exact P(x2, x3) of the 2nd and 3rd sampled tokens after ``prompt`` (x1 summed out)."""
    seqs = torch.tensor([prompt + list(s) for s in itertools.product(range(VOCAB), repeat=3)])
    with torch.no_grad():
        logp = torch.log_softmax(model(seqs).logits[:, -4:-1].double() / temperature, -1)  # predicts x1, x2, x3
    n = len(prompt)
    joint = (logp[:, 0].gather(1, seqs[:, n:n + 1]) + logp[:, 1].gather(1, seqs[:, n + 1:n + 2]) +
             logp[:, 2].gather(1, seqs[:, n + 2:n + 3])).exp()[:, 0]
    return joint.view(VOCAB, VOCAB, VOCAB).sum(0).float()


@pytest.mark.parametrize("merge", [False, True])
def test_sampled_hybrid_matches_the_verifier_distribution(merge):
    """Rejection sampling with lookup rounds (deterministic drafts) and EAGLE rounds (sampled chain drafts, or a
    top-k tree with the lookup branch merged in): the 2nd and 3rd emitted tokens follow the verifier's own
    joint distribution (chi-square over all V^2 pairs)."""
    from scipy.stats import chisquare

    from tests.conftest import make_verifier

    model = make_verifier("llama", False, VOCAB, hidden=32, layers=2)
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(0.15)  # undo most of the helper's sharpening: a spread q
    eagle = oracle_eagle1(model, noise=0.5)
    learned = (EagleTreeDrafter(eagle, model, tree=Tree.from_paths([[0], [1], [0, 0]])) if merge
               else EagleChainDrafter(eagle, model, 3))
    hybrid = HybridDrafter(learned, 3, merge=merge, min_match_sampled=2)  # short matches: many lookup rounds
    prompt = [1, 2, 3, 1, 2, 3, 1, 2]
    runner = StaticCausalLM(model, max_len=40)
    g = torch.Generator().manual_seed(0)
    sampling = Sampling(temperature=1.0)
    counts = torch.zeros(VOCAB, VOCAB)
    for _ in range(DRAWS):
        out = generate(runner, hybrid, prompt, 3, sampling, generator=g).tokens
        counts[out[1], out[2]] += 1
    assert 0 < hybrid.lookup_rounds < hybrid.rounds
    expected = exact_pair_distribution(model, prompt, 1.0)
    expected = expected / expected.sum() * DRAWS
    assert chisquare(counts.flatten().tolist(), expected.flatten().tolist()).pvalue > 0.01
