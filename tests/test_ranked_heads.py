"""Ranked draft heads: Medusa and EAGLE-1 drafting over the N most frequent tokens, verified over all V.

Greedy outputs equal AR's, drafts never leave the ranked rows, a ranking of every id drafts exactly what the
full head drafts, and at T = 1 the emitted tokens follow the verifier's distribution (χ², with a negative
control that scatters the drafter's p into the wrong columns)."""

from __future__ import annotations

import collections

import pytest
import torch

from spectrain.eval import drafters as drafters_mod
from spectrain.eval.accept import Sampling, target_probs
from spectrain.eval.decode import generate
from spectrain.eval.drafters import HybridDrafter
from spectrain.eval.eagle import EagleChainDrafter, EagleTreeDrafter
from spectrain.eval.medusa import MedusaDrafter
from spectrain.eval.evaluate import EvalSettings, evaluate_drafter
from spectrain.eval.setup import resolve_draft_vocab
from spectrain.eval.static_model import StaticCausalLM
from spectrain.eval.tree import Tree
from spectrain.heads.errors import SpectrainError
from spectrain.heads.verifier import Verifier
from spectrain.heads.vocab import Ranking, load_ranking, save_ranking
from tests.eval_helpers import bigram_verifier, oracle_eagle1, oracle_medusa

K = 3
TREE = Tree.from_paths([[0], [1], [0, 0], [0, 1], [1, 0], [0, 0, 0]])


def ranked(vocab: int, n: int, seed: int = 3) -> torch.Tensor:
    """n distinct ascending ids out of ``vocab``."""
    return torch.randperm(vocab, generator=torch.Generator().manual_seed(seed))[:n].sort().values


def prompts(n: int, vocab: int = 300) -> list[list[int]]:
    g = torch.Generator().manual_seed(5)
    return [torch.randint(0, vocab, (6,), generator=g).tolist() for _ in range(n)]


def make(kind: str, model, perm, vocab):
    lm_head = model.get_output_embeddings()
    if kind == "medusa-chain":
        return MedusaDrafter(oracle_medusa(model, perm, K, noise=1.0), lm_head, Tree.chain(K), vocab=vocab)
    if kind == "medusa-tree":
        return MedusaDrafter(oracle_medusa(model, perm, TREE.max_depth, noise=1.0), lm_head, TREE, vocab=vocab)
    if kind == "eagle1-chain":
        return EagleChainDrafter(oracle_eagle1(model, noise=1.0), model, K, vocab=vocab)
    if kind == "eagle1-tree":
        return EagleTreeDrafter(oracle_eagle1(model, noise=1.0), model, tree=TREE, vocab=vocab)
    if kind == "eagle1-dynamic":
        return EagleTreeDrafter(oracle_eagle1(model, noise=1.0), model, dynamic=(3, 2, 6), vocab=vocab)
    if kind == "hybrid-eagle1":
        return HybridDrafter(EagleChainDrafter(oracle_eagle1(model, noise=1.0), model, K, vocab=vocab), K, merge=False)
    raise AssertionError(kind)


KINDS = ["medusa-chain", "medusa-tree", "eagle1-chain", "eagle1-tree", "eagle1-dynamic", "hybrid-eagle1"]


@pytest.fixture(scope="module")
def bigram():
    return bigram_verifier("llama", mix=0.1)


class Recording:
    """Wraps a drafter, keeping every proposal's tokens."""

    def __init__(self, inner):
        self.inner, self.drafted = inner, []

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def propose(self, state):
        proposal = self.inner.propose(state)
        self.drafted.extend(proposal.tokens.tolist())
        return proposal


@pytest.mark.parametrize("kind", KINDS)
def test_greedy_ranked_heads_equal_ar_and_draft_only_ranked_ids(bigram, kind):
    model, perm = bigram
    vocab = ranked(300, 200)
    runner = StaticCausalLM(model, max_len=128)
    accepted = 0
    for prompt in prompts(4):
        ar = generate(runner, drafters_mod.Autoregressive(), prompt, 40).tokens
        spec = make(kind, model, perm, vocab)
        recorder = Recording(spec) if kind != "hybrid-eagle1" else Recording(spec.learned)
        if kind == "hybrid-eagle1":
            spec.learned = recorder  # the hybrid's learned drafter, recorded
        out = generate(runner, spec if kind == "hybrid-eagle1" else recorder, prompt, 40)
        assert out.tokens == ar
        accepted += sum(out.accept_lengths)
        assert recorder.drafted and set(recorder.drafted) <= set(vocab.tolist())  # never outside the ranked rows
    assert accepted > 0  # the ranked drafts are accepted at times: the rows hold the right tokens


@pytest.mark.parametrize("kind", ["medusa-chain", "medusa-tree", "eagle1-chain", "eagle1-tree", "eagle1-dynamic"])
def test_a_ranking_of_every_id_drafts_what_the_full_head_drafts(bigram, kind):
    """The gathered rows, the index maps and the trees' token mapping: vocab = all V ids changes nothing."""
    model, perm = bigram
    runner = StaticCausalLM(model, max_len=128)
    for prompt in prompts(2):
        full = Recording(make(kind, model, perm, None))
        every = Recording(make(kind, model, perm, torch.arange(300)))
        generate(runner, full, prompt, 30)
        generate(runner, every, prompt, 30)
        assert full.drafted == every.drafted


def test_a_ranked_head_never_drafts_a_token_outside_it_even_when_the_verifier_wants_it(bigram):
    """Rows without the verifier's greedy tokens: drafts are still the ranked ids, outputs still AR's."""
    model, perm = bigram
    runner = StaticCausalLM(model, max_len=128)
    prompt = prompts(1)[0]
    ar = generate(runner, drafters_mod.Autoregressive(), prompt, 30).tokens
    outside = sorted(set(range(300)) - set(ar))[:50]  # none of AR's tokens
    spec = Recording(make("eagle1-chain", model, perm, torch.tensor(outside)))
    out = generate(runner, spec, prompt, 30)
    assert out.tokens == ar and sum(out.accept_lengths) == 0
    assert set(spec.drafted) <= set(outside)


def test_bad_draft_vocabularies_are_refused(bigram):
    model, perm = bigram
    for bad, match in ((torch.tensor([5, 3]), "ascending"), (torch.tensor([1, 300]), "below 300"),
                       (torch.tensor([1.0, 2.0]), "int64")):
        with pytest.raises(SpectrainError, match=match):
            make("medusa-chain", model, perm, bad)
    from spectrain.heads.eagle import EagleDrafter

    eagle3 = EagleDrafter.for_verifier(model, "eagle3", draft_vocab_size=64)
    with pytest.raises(SpectrainError, match="EAGLE-3"):
        EagleChainDrafter(eagle3, model, K, vocab=torch.arange(10))


def test_resolve_draft_vocab(tmp_path, bigram):
    model, perm = bigram
    heads = oracle_medusa(model, perm, K, noise=1.0)
    counts = torch.zeros(300, dtype=torch.int64)
    counts[torch.tensor([7, 3, 250, 11])] = torch.tensor([5, 9, 9, 1])
    save_ranking(tmp_path, counts, default_size=2, source="test")
    heads.ranking = load_ranking(tmp_path)
    assert resolve_draft_vocab(heads, None, 300)[0].tolist() == [3, 250]  # the trained-over default (ties: lower id)
    assert resolve_draft_vocab(heads, 3, 300)[0].tolist() == [3, 7, 250]
    assert resolve_draft_vocab(heads, 0, 300) == (None, 300)
    with pytest.raises(SpectrainError, match="exceeds"):
        resolve_draft_vocab(heads, 301, 300)
    with pytest.raises(SpectrainError, match="another verifier"):
        resolve_draft_vocab(heads, None, 299)
    heads.ranking = None
    assert resolve_draft_vocab(heads, None, 300) == (None, 300)
    with pytest.raises(SpectrainError, match="vocab_ranking.json"):
        resolve_draft_vocab(heads, 100, 300)
    with pytest.raises(SpectrainError, match="applies to a learned drafter"):
        resolve_draft_vocab(None, 100, 300)


def test_ranking_file_round_trip_and_corruption(tmp_path):
    counts = torch.tensor([0, 4, 4, 1, 0, 9])
    save_ranking(tmp_path, counts, default_size=3, source="x")
    r = load_ranking(tmp_path)
    assert r.counts.tolist() == counts.tolist() and r.default_size == 3 and r.ids().tolist() == [1, 2, 5]
    assert Ranking(counts, 0).ids() is None and Ranking(counts, 0).ids(6) is None
    (tmp_path / "vocab_ranking.json").write_text('{"format": 1, "vocab_size": 6, "ids": [9], "counts": [1]}')
    with pytest.raises(SpectrainError, match="outside the vocabulary"):
        load_ranking(tmp_path)
    (tmp_path / "vocab_ranking.json").write_text('{"format": 1}')
    with pytest.raises(SpectrainError, match="not a vocabulary ranking"):
        load_ranking(tmp_path)


def test_evaluate_drafter_reports_draft_vocab_and_draft_cost(tiny_tokenizer, tmp_path):
    model, perm = bigram_verifier(vocab=320)
    heads = oracle_medusa(model, perm, K, noise=1.0)
    save_ranking(tmp_path, torch.arange(320), default_size=120)  # the 120 most frequent: ids 200..319
    heads.ranking = load_ranking(tmp_path)
    verifier = Verifier(model, tiny_tokenizer, "bigram")
    result = evaluate_drafter(verifier, [["hello there"], ["the cat"]], heads,
                              EvalSettings(k=K, max_new_tokens=24, chat_template=False, hf_generate=0))
    chain, cost = result.results[f"chain-{K}"], result.costs["settings"][f"chain-{K}"]
    assert result.draft_vocab == 120 and chain["draft_vocab"] == 120 and chain["identical_to_ar"]
    rounds = chain["round_ms"]  # the rounds' own drafting over their verify passes; isolated probes kept apart
    assert chain["draft_over_verify"] == pytest.approx(rounds["draft"] / rounds["verify"]) and rounds["draft"] > 0
    assert cost["t_draft_ms"] > 0 and cost["draft_over_verify"] == pytest.approx(cost["t_draft_ms"] / cost["t_verify_ms"])
    full = evaluate_drafter(verifier, [["hello there"]], "medusa", drafter=heads, settings=EvalSettings(
        k=K, max_new_tokens=8, chat_template=False, hf_generate=0, costs=False, draft_vocab=0))
    assert full.draft_vocab == 320


# -- T = 1: the emitted tokens follow the verifier's distribution ---------------------------------------------
SAMPLING = Sampling(temperature=1.0)
PROMPT = [3, 17, 42, 7]
DRAWS = 1500


@pytest.fixture(scope="module")
def soft():
    """A bigram verifier whose q is spread over a few tokens at T = 1 (lm_head scaled down)."""
    model, perm = bigram_verifier("llama", mix=0.3, seed=2)
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(0.1)
    return model, perm


def q_after(model, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return target_probs(model(torch.tensor([tokens])).logits[0, -1], SAMPLING)


def chi_square_p(observed: collections.Counter, q: torch.Tensor) -> float:
    from scipy.stats import chisquare

    keep = q > 1e-3  # the rest pooled into one bin
    support = keep.nonzero()[:, 0].tolist()
    counts = [observed[t] for t in support] + [sum(observed.values()) - sum(observed[t] for t in support)]
    expected = torch.cat([q[keep], q[~keep].sum()[None]]).double()
    expected = expected / expected.sum() * sum(observed.values())
    return float(chisquare(counts, expected.tolist()).pvalue)


def p_values(model, drafter) -> list[float]:
    """χ² p of the round's first token given the most frequent prefill token, and of its second given the most
    frequent pair."""
    runner = StaticCausalLM(model, max_len=32)
    g = torch.Generator().manual_seed(0)
    draws = [tuple(generate(runner, drafter, PROMPT, 3, SAMPLING, generator=g).tokens[:3]) for _ in range(DRAWS)]
    first = collections.Counter(d[0] for d in draws).most_common(1)[0][0]
    seconds = collections.Counter(d[1] for d in draws if d[0] == first)
    second = seconds.most_common(1)[0][0]
    thirds = collections.Counter(d[2] for d in draws if d[:2] == (first, second))
    out = [chi_square_p(seconds, q_after(model, PROMPT + [first]))]
    if sum(thirds.values()) >= 150:  # enough draws for the third token's test
        out.append(chi_square_p(thirds, q_after(model, PROMPT + [first, second])))
    return out


def soft_vocab(model) -> torch.Tensor:
    """Half of the tokens the verifier is likely to emit after PROMPT and after its likely continuations, plus
    unrelated ids: accepted drafts, rejected drafts and tokens the drafter cannot propose all occur."""
    q = q_after(model, PROMPT)
    likely = q.topk(8).indices.tolist()
    return torch.tensor(sorted(set(likely[::2]) | set(range(0, 300, 3))))


@pytest.mark.parametrize("kind", ["eagle1-chain", "medusa-tree"])
def test_ranked_heads_sample_the_verifier_distribution(soft, kind):
    model, perm = soft
    p = p_values(model, make(kind, model, perm, soft_vocab(model)))
    assert len(p) == 2 and min(p) > 0.01  # the round's first and second tokens both tested


def test_p_scattered_into_the_wrong_columns_is_detected(soft, monkeypatch):
    """Negative control: the ranked chain's p put at ids 0..N-1 instead of its ids (the index map dropped)."""
    model, perm = soft
    monkeypatch.setattr(EagleChainDrafter, "_full",
                        lambda self, p: p.new_zeros(self.vocab_size).index_copy(0, torch.arange(p.numel()), p))
    assert min(p_values(model, make("eagle1-chain", model, perm, soft_vocab(model)))) < 1e-6
