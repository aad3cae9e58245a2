"""Where a decode round's time goes, measured in the loop: the phase stamps, the in-loop ideal speedup and the
planner's pricing from the rounds that were decoded."""

from __future__ import annotations


import pytest
import torch

from spectrain.eval.accept import Sampling
from spectrain.eval.decode import RoundClock, generate
from spectrain.eval.drafters import Autoregressive
from spectrain.eval.evaluate import EvalSettings, evaluate_drafter
from spectrain.eval.static_model import StaticCausalLM
from spectrain.heads.verifier import load_verifier
from tests.eval_helpers import bigram_verifier

DRAFT, VERIFY, OTHER = 4.0, 6.0, 3.0  # seconds each phase is made to take per round, on a fake clock


class FakeClock:
    """The loop's ``time.perf_counter``: it moves only when a phase ``spend``s, so the test's totals are exact
    (no wall-clock bound, no sleeping)."""

    def __init__(self):
        self.now = 0.0

    def perf_counter(self) -> float:
        return self.now

    def spend(self, seconds: float) -> None:
        self.now += seconds


class SlowDrafter(Autoregressive):
    """AR through the loop, with a known cost in ``propose`` and in ``advance``."""

    def __init__(self, clock: FakeClock):
        super().__init__()
        self.clock = clock

    def propose(self, state):
        self.clock.spend(DRAFT)
        return super().propose(state)

    def advance(self, accepted, state):
        self.clock.spend(OTHER)
        super().advance(accepted, state)


def test_each_phase_is_timed_where_it_runs(monkeypatch):
    """A drafter that spends known seconds in propose and in advance, a verifier forward that spends its own (on
    a fake clock the loop reads): each phase holds exactly its own cost, and the phases add up to the decode
    time. A stamp in the wrong place moves a cost into another phase and fails this."""
    clock = FakeClock()
    monkeypatch.setattr("spectrain.eval.decode.time", clock)
    model, _ = bigram_verifier()
    runner = StaticCausalLM(model, max_len=64, device=torch.device("cpu"))
    forward = runner.forward

    def slow_forward(*args, **kwargs):
        clock.spend(VERIFY)
        return forward(*args, **kwargs)

    runner.forward = slow_forward
    gen = generate(runner, SlowDrafter(clock), [1, 2, 3], 13, Sampling())
    rounds = gen.verifier_forwards
    assert rounds == 12
    # The prefill is one verifier forward before the rounds; it is not a round's verify.
    assert gen.prefill_seconds == VERIFY
    assert gen.round_seconds == {"draft": 12 * 4.0, "verify": 12 * 6.0, "other": 12 * 3.0}
    assert gen.decode_seconds == 12 * (4.0 + 6.0 + 3.0)


def test_stamps_group_into_phases():
    """Four stamps a round (start, drafted, pass starts, verified) and one after the last: gaps 1, 2, 3, 4 are
    draft, other (the pass's preparation), verify, other; then 5, 6, 7, 8."""
    clock = RoundClock(torch.device("cpu"))
    clock.stamps = [0.0, 1.0, 3.0, 6.0, 10.0, 15.0, 21.0, 28.0, 36.0]
    assert clock.totals() == {"draft": 1.0 + 5.0, "verify": 3.0 + 7.0, "other": 2.0 + 4.0 + 6.0 + 8.0}
    clock.stamps = [5.0]  # a turn without rounds
    assert clock.totals() == {"draft": 0.0, "verify": 0.0, "other": 0.0}


def test_a_turn_without_rounds_reports_no_round_costs():
    """One new token comes from the prefill: no round, zero phases, and the summary says none were measured."""
    from spectrain.eval.runs import in_loop_costs, summarize, turn_record

    model, _ = bigram_verifier()
    runner = StaticCausalLM(model, max_len=64, device=torch.device("cpu"))
    gen = generate(runner, Autoregressive(), [1, 2, 3], 1, Sampling())
    assert gen.verifier_forwards == 0 and sum(gen.round_seconds.values()) == 0
    summary = summarize([{"prompt": 0, "turns": [turn_record([1, 2, 3], gen)]}], 0)
    assert summary["round_ms"] is None
    summary["speedup"] = 1.0
    assert in_loop_costs(summary, summary)["ideal_speedup"] is None


def test_in_loop_costs_on_a_hand_computed_round():
    """Pinned by hand: a round of 2 ms drafting + 8 ms verify + 1 ms other at τ 2.5, AR at 6 ms a token, a
    measured speedup of 1.2: draft/verify 2/8 = 0.25; ideal 2.5 × 6 / (2 + 8) = 1.5; measured / ideal 0.8."""
    from spectrain.eval.runs import in_loop_costs

    chain = {"round_ms": {"draft": 2.0, "verify": 8.0, "other": 1.0}, "tau": 2.5, "speedup": 1.2}
    ar = {"round_ms": {"draft": 0.0, "verify": 6.0, "other": 0.0}, "decode_ms_per_token": 6.0}
    assert in_loop_costs(chain, ar) == pytest.approx(
        {"draft_over_verify": 0.25, "ideal_speedup": 1.5, "speedup_vs_ideal": 0.8})


@pytest.mark.parametrize("method", ["ngram"])
def test_ideal_and_planner_come_from_the_rounds(verifier_factory, method):
    """speedup / ideal is the share of a round spent in the two passes; draft/verify is the rounds' own ratio;
    the planner prices the decoded chain at its own measured round (so its expected speedup there is the
    expected τ over that round), and AR's round at one token."""
    verifier = load_verifier(str(verifier_factory("llama", False)))
    prompts = [["the king and the king and the king"], ["a b a b a b a b"]]
    result = evaluate_drafter(verifier, prompts, method,
                              EvalSettings(k=3, max_new_tokens=24, hf_generate=0, chat_template=False))
    chain, ar = result.results["chain-3"], result.results["ar"]
    ms = chain["round_ms"]
    assert chain["draft_over_verify"] == pytest.approx(ms["draft"] / ms["verify"])
    passes = ms["draft"] + ms["verify"]
    assert chain["ideal_speedup"] == pytest.approx(chain["tau"] * ar["decode_ms_per_token"] / passes)
    # speedup / ideal = the two passes' share of the decode time (exactly, from the records), and the stamped
    # rounds cover that time (the loop's few lines outside them aside)
    turns = [t for r in result.per_prompt["chain-3"] for t in r["turns"]]
    decode_ms = 1000 * sum(t["decode_seconds"] for t in turns)
    assert chain["speedup_vs_ideal"] == pytest.approx(passes * chain["verifier_forwards"] / decode_ms)
    assert sum(ms.values()) * chain["verifier_forwards"] == pytest.approx(decode_ms, rel=0.1)
    planner = result.planner
    assert planner["priced_by"] == "in-loop rounds"
    at_k = next(r for r in planner["chains"] if r["n"] == 3)
    ar_verify = ar["round_ms"]["verify"]
    # the decoded chain's own round, its verify pass never priced below AR's (a 4-token pass on this tiny verifier
    # can time below AR's 1-token one)
    round_k = max(ms["verify"], ar_verify) + ms["draft"] + ms["other"]
    assert at_k["expected_speedup"] == pytest.approx(at_k["expected_tau"] * ar["decode_ms_per_token"] / round_k)
    # A chain of 1: AR's verify pass plus a third of the chain's extra (and the chain's rest of a round).
    at_1, priced = next(r for r in planner["chains"] if r["n"] == 1), planner["priced_ms"][1]
    assert priced["verify"] == pytest.approx(ar_verify + max(ms["verify"] - ar_verify, 0) / 3 + ms["other"])
    assert priced["draft"] >= 0 and planner["priced_ms"][3]["draft"] == pytest.approx(ms["draft"])
    assert at_1["expected_speedup"] == pytest.approx(at_1["expected_tau"] * ar["decode_ms_per_token"]
                                                     / (priced["verify"] + priced["draft"]))
    # The costs table keeps the isolated probes (what sizes not run are shaped by).
    assert result.costs["settings"]["chain-3"]["t_verify_ms"] > 0
