"""Lookahead decoding (``--method lookahead``): the window's layout, the pool and the trie; the window never reaches
the tree's rows; T = 0 output identical to AR; T > 0 tokens distributed as the verifier's; the pool filled and
its guesses accepted on repetitive text; bad W / N / G refused by flag; ``spectrain-eval --method lookahead``."""

from __future__ import annotations

import collections
import json
import subprocess
import sys

import pytest
import torch

from spectrain.eval.decode import Trace, generate, verify_mask_rows, with_probe_rows
from spectrain.eval.drafters import Autoregressive, Probe
from spectrain.eval.lookahead import (LookaheadDrafter, NgramPool, guess_tree, jacobi_step, window_layout,
                                      window_ngrams)
from spectrain.eval.settings import EvalSettings
from spectrain.eval.static_model import StaticCausalLM
from spectrain.eval.tree import Tree
from spectrain.heads.errors import SpectrainError
from tests.eval_helpers import bigram_verifier
from tests.test_generate_distribution import SAMPLING, conditional_p_values, draw


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def verifier(request):
    return bigram_verifier(request.param)[0]


def repeated_prompts(n: int = 3):
    g = torch.Generator().manual_seed(0)
    return [(torch.randint(0, 300, (8,), generator=g).tolist() * 2)[:13] for _ in range(n)]


def random_prompts(n: int = 3):
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, 300, (10,), generator=g).tolist() for _ in range(n)]


# ------------------------------------------------------------------------------ layout, pool, trie


def test_window_layout_is_the_papers_strands():
    """W = 3, N = 4: level 0 holds columns 1, 2 (the root is column 0), levels 1 and 2 columns 0..2; node (l, i)
    sits at i + l and sees the first level up to column i and its own column's levels 1..l."""
    layout = window_layout(3, 4)
    names = [(0, 1), (0, 2)] + [(level, col) for level in (1, 2) for col in range(3)]
    assert layout.depth.tolist() == [col + level for level, col in names]
    for r, (level, col) in enumerate(names):
        seen = {names[c] for c in layout.mask[r].nonzero()[:, 0].tolist()}
        want = {(0, j) for j in range(1, col + 1)} | {(up, col) for up in range(1, level + 1)}
        assert seen == want, (level, col)
    assert layout.read.tolist() == [1 + names.index((2, col)) for col in range(3)]  # the last level, after the root
    assert not layout.mask.triu(1).any()  # earlier nodes only: a wide forward may run in consecutive parts
    assert window_layout(3, 2).read.tolist() == [0, 1, 2]  # N = 2: the last level is the first, its column 0 the root


def test_window_ngrams_and_the_jacobi_step():
    levels = [[11, 12], [20, 21, 22], [30, 31, 32]]  # W = 3, N = 4
    outputs = [40, 41, 42]
    assert window_ngrams(levels, 9, outputs) == [(9, 20, 30, 40), (11, 21, 31, 41), (12, 22, 32, 42)]
    assert jacobi_step(levels, outputs) == [[21, 22], [30, 31, 32], [40, 41, 42]]
    assert jacobi_step([[11, 12]], outputs) == [[41, 42]]  # N = 2


def test_pool_keeps_the_newest_g_per_first_token():
    pool = NgramPool(2)
    for rest in [(1, 2), (3, 4), (1, 2), (5, 6)]:
        pool.add(7, rest)
    assert pool.after(7) == [(5, 6), (1, 2)] and pool.after(8) == [] and len(pool) == 2


def test_guess_tree_merges_shared_prefixes_into_a_tree():
    tokens, tree = guess_tree([(5, 6, 7), (5, 8, 9), (4, 6, 7), (5, 6, 7)])
    expected = Tree.from_paths([[0], [1], [0, 0], [0, 1], [1, 0], [0, 0, 0], [0, 1, 0], [1, 0, 0]])
    assert tree.paths == expected.paths and tokens == [5, 4, 6, 8, 6, 7, 9, 7]
    for field in ("parent", "depth", "rank", "ancestors", "children"):
        assert torch.equal(getattr(tree, field), getattr(expected, field)), field
    tokens, empty = guess_tree([])
    assert tokens == [] and empty.size == 0 and empty.is_chain


# ------------------------------------------------------------------------------ the window never reaches the tree


def test_the_window_does_not_change_the_trees_rows(verifier):
    """The tree's rows of a forward with the window beside it equal those of the tree alone (fp32): no tree node
    sees a window node, whatever the positions they share."""
    runner = StaticCausalLM(verifier, max_len=64)
    prompt = repeated_prompts(1)[0]
    tokens, tree = guess_tree([(5, 6, 7), (5, 8, 9), (4, 6, 7)])
    layout = window_layout(4, 4)
    probe = Probe(torch.arange(100, 100 + layout.depth.numel()), layout.depth, layout.mask, layout.read)
    rows = verify_mask_rows(tree)
    ids = torch.tensor([prompt[-1]] + tokens)
    positions = len(prompt) - 1 + torch.cat([torch.zeros(1, dtype=torch.long), tree.depth])
    outs = []
    for with_window in (False, True):
        runner.reset()
        runner.forward(torch.tensor(prompt[:-1]))
        runner.commit(len(prompt) - 1)
        if with_window:
            out = runner.forward(torch.cat([ids, probe.tokens]),
                                 positions=torch.cat([positions, positions[0] + probe.depth]),
                                 mask=runner.tree_mask(with_probe_rows(rows, probe)))
        else:
            out = runner.forward(ids, positions=positions, mask=runner.tree_mask(rows))
        outs.append(out[:ids.numel()])
    torch.testing.assert_close(outs[0], outs[1], rtol=1e-5, atol=1e-5)


# ------------------------------------------------------------------------------ lossless


@pytest.mark.parametrize("wng", [(5, 4, 5), (3, 2, 3), (4, 3, 2), (1, 2, 1), (5, 4, 5, 2)])
def test_greedy_lookahead_equals_ar(verifier, wng):
    """Tokens equal AR's, and so does the logits row that chose each (its top 2, fp32): the window run in the
    same forwards moves none of the numbers acceptance reads."""
    runner = StaticCausalLM(verifier, max_len=160)
    drafter = LookaheadDrafter(*wng)
    for prompt in repeated_prompts() + random_prompts(2):
        ar = generate(runner, Autoregressive(), prompt, 50, trace=Trace())
        out = generate(runner, drafter, prompt, 50, trace=Trace())
        assert out.tokens == ar.tokens, wng
        # fp32: within 1.5e-5 of AR's; a window leaking into the tree's rows moves them by more than 1e-3
        torch.testing.assert_close(out.trace.top_values, ar.trace.top_values, rtol=0, atol=1e-4)
        assert sum(out.emitted_per_round) + 1 == len(out.tokens)  # τ counts emitted tokens, prefill excluded
        assert max(out.accept_lengths) <= (wng[3] if len(wng) > 3 else wng[1] - 1)  # guesses cut to depth


def test_the_pool_fills_and_its_guesses_are_accepted_on_repetitive_text():
    """The bigram verifier's greedy text walks a cycle of its permutation (9, 11 and 14 tokens long for these
    starts); a prompt that goes round it once or more repeats what follows. A bigram model's Jacobi strands are
    true n-grams of the permutation, but keyed by the window's tokens, which here lie on the text's own cycle:
    the pool fills, rounds verify guesses and accept them — τ (emitted tokens per verifier forward) well above 1,
    up to the full N - 1 guessed tokens a round. (From tokens off the cycle a bigram model's window never
    reaches the text: only a model that attends to the strand's context converges, as real LMs do.)"""
    model, perm = bigram_verifier("llama")
    runner = StaticCausalLM(model, max_len=160)
    drafter = LookaheadDrafter(5, 4, 5)
    emitted = rounds = 0
    for start in (43, 32, 11):
        prompt = [start]
        for _ in range(14):
            prompt.append(int(perm[prompt[-1]]))
        out = generate(runner, drafter, prompt, 60)
        assert out.tokens == generate(runner, Autoregressive(), prompt, 60).tokens
        emitted, rounds = emitted + sum(out.emitted_per_round), rounds + len(out.emitted_per_round)
        assert max(out.accept_lengths) == 3
        assert len(drafter.pool) > 0
    assert drafter.stats["guess_rounds"] > drafter.stats["rounds"] / 2
    assert emitted / rounds > 2.0, emitted / rounds


class RankedGuesses(LookaheadDrafter):
    """Lookahead whose pool also gets, every round, three guesses made of the verifier's own top tokens after the
    context: candidates that q' gives real mass, so at T > 0 every depth and both siblings are accepted and
    rejected. Still a function of the history alone (what losslessness asks of deterministic drafts)."""

    def __init__(self, model):
        super().__init__(window=3, ngram=3, guesses=3)
        self.model, self.cache = model, {}

    def ranked(self, context: tuple[int, ...]) -> list[int]:
        if context not in self.cache:
            with torch.no_grad():
                self.cache[context] = self.model(torch.tensor([context])).logits[0, -1].topk(2).indices.tolist()
        return self.cache[context]

    def propose(self, state):
        context = tuple(state.history)
        first, second = self.ranked(context)
        for a, b in ((first, 0), (second, 0), (first, 1)):
            self.pool.add(state.history[-1], (a, self.ranked(context + (a,))[b]))
        return super().propose(state)


def test_sampled_lookahead_follows_the_verifier_distribution():
    """T > 0 through the whole loop (the window run beside the guesses every round): token 2 given token 1 and
    token 3 given tokens 1, 2 follow the verifier's own q' (χ², as tests/test_generate_distribution.py)."""
    model, _ = bigram_verifier("llama", mix=0.3)
    drafter = RankedGuesses(model)
    runner = StaticCausalLM(model, max_len=32)
    lengths = collections.Counter()
    for seed in range(200):
        lengths.update(generate(runner, drafter, [3, 17, 42, 7], 5, SAMPLING,
                                generator=torch.Generator().manual_seed(seed)).accept_lengths[:1])
    assert set(lengths) == {0, 1, 2}, lengths
    assert min(conditional_p_values(model, draw(model, drafter))) > 0.01


# ------------------------------------------------------------------------------ settings and the command line


@pytest.mark.parametrize("field,value,flag", [
    ("lookahead_window", 0, "--lookahead_window must be an integer >= 1"),
    ("lookahead_ngram", 1, "--lookahead_ngram must be an integer >= 2"),
    ("lookahead_guesses", 0, "--lookahead_guesses must be an integer >= 1"),
    ("lookahead_window", 2.5, "--lookahead_window must be an integer"),
    ("lookahead_ngram", True, "--lookahead_ngram must be an integer"),
])
def test_bad_window_ngram_or_guesses_are_refused_by_flag(field, value, flag):
    with pytest.raises(SpectrainError, match=flag):
        EvalSettings(**{field: value})
    with pytest.raises(SpectrainError, match=flag):
        LookaheadDrafter(**{field.removeprefix("lookahead_"): value})


def test_the_method_drafts_its_guesses_chain_only():
    """Its setting is the chain of k: guesses of k tokens, N = k + 1 unless --lookahead_ngram is larger (its
    guesses then cut to k); no cost probes or planner (they price a chain drafter's rounds)."""
    from spectrain.eval.methods import method_named

    method = method_named("lookahead")
    s = method.check(EvalSettings(k=2))
    assert (s.k, s.lookahead_n, s.costs) == (2, 3, False)
    assert method.verify_sizes(EvalSettings()) == [1, 60, 120]  # AR, root + window, + 15 guesses of 4
    assert method.verify_sizes(EvalSettings(k=2, lookahead_ngram=5)) == [1, 60, 90]  # 15 guesses of 2
    with pytest.raises(SpectrainError, match="--k 6 asks for 6: give --k between 1 and 4, or --lookahead_ngram 7"):
        method.check(EvalSettings(k=6, lookahead_ngram=5))
    with pytest.raises(SpectrainError, match="nothing to evaluate"):
        method.check(EvalSettings(k=0))
    with pytest.raises(SpectrainError, match="chains only; drop --tree"):
        method.check(EvalSettings(tree="[[0], [1]]"))
    with pytest.raises(SpectrainError, match="has no lookup"):
        method.check(EvalSettings(lookup=3))


@pytest.fixture(scope="module")
def cli_setup(tmp_path_factory, verifier_factory):
    root = tmp_path_factory.mktemp("lookahead-eval")
    prompts = root / "prompts.jsonl"
    prompts.write_text("\n".join(json.dumps({"turns": [f"the king {i} the king {i} the king", "and the queen?"]})
                                 for i in range(2)))
    return root, verifier_factory("llama", False), prompts


def cli_args(cli_setup, *extra) -> list[str]:
    root, verifier_dir, prompts = cli_setup
    return ["--verifier", str(verifier_dir), "--method", "lookahead", "--prompts", str(prompts), "--max_new_tokens",
            "16", "--hf_generate", "0", "--lookahead_window", "4", "--k", "2", "--lookahead_guesses", "4", "--out",
            str(root / "out"), *extra]


def test_spectrain_eval_method_lookahead_end_to_end(cli_setup, capsys):
    from spectrain.eval.cli import main

    main(cli_args(cli_setup))
    path = capsys.readouterr().out.strip().splitlines()[-1]
    summary = json.loads(open(path).read())
    assert summary["method"] == "lookahead" and set(summary["results"]) == {"ar", "chain-2"}
    r = summary["results"]["chain-2"]
    assert r["identical_to_ar"] is True and len(r["alpha"]) == 2
    assert r["tree_size"] == 4 * 2 + 4 * 2 - 1  # G guesses of N - 1, and the W x (N - 1) window less the root
    turns = [t for p in summary["per_prompt"]["chain-2"] for t in p["turns"]]
    rounds = [e for t in turns for e in t["emitted_per_round"]]
    assert r["tau"] == pytest.approx(sum(rounds) / len(rounds)) and r["round_ms"]["verify"] > 0
    assert summary["planner"] is None and summary["costs"] is None
    main(cli_args(cli_setup, "--temperature", "1.0"))  # sampled: runs, no identity claim
    sampled = json.loads(open(capsys.readouterr().out.strip().splitlines()[-1]).read())["results"]["chain-2"]
    assert sampled["identical_to_ar"] is False and sampled["tau"] >= 1.0


@pytest.mark.parametrize("extra,message", [
    (["--lookahead_window", "0"], "--lookahead_window must be an integer >= 1, got 0"),
    (["--lookahead_guesses", "-3"], "--lookahead_guesses must be an integer >= 1, got -3"),
    (["--lookahead_ngram", "3", "--k", "7"], "--k 7 asks for 7"),
    (["--dynamic_tree", "3,2,8"], "grows no dynamic trees"),
])
def test_bad_lookahead_flags_are_refused(cli_setup, extra, message):
    from spectrain.eval.cli import evaluate, parse_args

    with pytest.raises(SpectrainError, match=message):
        evaluate(parse_args(cli_args(cli_setup, *extra)))


@pytest.mark.integration
def test_a_bad_flag_exits_2_without_a_traceback(cli_setup):
    proc = subprocess.run([sys.executable, "-m", "spectrain.eval.cli", *cli_args(cli_setup, "--lookahead_ngram", "1")],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert "error: --lookahead_ngram must be an integer >= 2, got 1" in proc.stderr


def test_spectrain_results_lookahead_rows(cli_setup, tmp_path):
    """``spectrain-results --lookahead``: a row per prompt set named 'lookahead' (its chain of N - 1, no tree),
    sampled on request, lossless at T = 0; its rows keyed by W, N, G; 'lookahead' is no --drafter name."""
    from spectrain.eval.results import parse_args, results

    root, verifier_dir, _ = cli_setup
    mt = tmp_path / "mt.jsonl"
    mt.write_text("\n".join(json.dumps({"question_id": i, "category": "writing", "turns": [f"the king {i} the king"]})
                            for i in range(2)))
    argv = ["--verifier", str(verifier_dir), "--lookahead", "--lookahead_window", "3", "--lookahead_ngram", "4",
            "--lookahead_guesses", "3", "--sampled", "lookahead", "--mt_bench", str(mt), "--num_prompts", "2",
            "--max_new_tokens", "10", "--k", "5", "--device", "cpu", "--out", str(tmp_path / "out")]
    summary = json.loads(results(parse_args(argv), log=lambda *_: None).read_text())
    rows = {(r["drafter"], r["setting"], r["temperature"]): r for r in summary["rows"]}
    assert set(rows) == {("lookahead", "chain-3", 0.0), ("lookahead", "chain-3", 1.0)}
    greedy = rows[("lookahead", "chain-3", 0.0)]
    assert greedy["identical_to_greedy"] == 2 and greedy["nodes"] == 3 * 3 + 3 * 3 - 1 and greedy["window"] == 3
    assert greedy["training"]["method"].startswith("lookahead decoding") and len(greedy["alpha"]) == 3
    assert greedy["fingerprint"] == "lookahead-w3n4g3"
    with pytest.raises(SpectrainError, match="reserved"):
        results(parse_args(argv + ["--drafter", f"lookahead={root}"]), log=lambda *_: None)
    with pytest.raises(SpectrainError, match="--lookahead_guesses must be an integer >= 1"):
        results(parse_args(argv + ["--lookahead_guesses", "0"]), log=lambda *_: None)
