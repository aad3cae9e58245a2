"""The benchmark protocol's repeats (spectrain.eval.repeats, for benchmarks/draft_heads.py and repeat_eval.py): every
speed figure is the median of several passes with its min and max, rows matched by setting (not by position: each
pass starts its rotation of settings elsewhere), and the worst pass's identity kept. Hand-computed cases; no
decoding."""

from __future__ import annotations

import pytest

from spectrain.eval.repeats import check_repeats, merge_repeats, summarize_runs
from spectrain.heads.errors import SpectrainError


def _rows(order, speedups, identical):
    return [{"drafter": d, "draft_vocab": 8192, "setting": s, "speedup": v, "tau": 1.5, "identical_turns": i}
            for (d, s), v, i in zip(order, speedups, identical)]


def test_draft_heads_repeats_are_matched_by_setting_and_give_median_and_range():
    order = [("eagle1", "chain-5"), ("hybrid-eagle1", "chain-5"), ("eagle1", "chain-2")]
    rotated = order[1:] + order[:1]  # the second pass pooled its settings in another order
    passes = [(_rows(order, [1.0, 2.0, 3.0], ["6/6"] * 3), ["calls"], {"tokens_per_second": 10.0}),
              (_rows(rotated, [2.4, 3.3, 1.2], ["6/6", "6/6", "5/6"]), [], {"tokens_per_second": 11.0}),
              (_rows(order, [0.9, 1.8, 2.7], ["6/6"] * 3), [], {"tokens_per_second": 9.0})]
    rows, calls, ar = merge_repeats(passes)
    got = {(r["drafter"], r["setting"]): (r["speedup"], r["speedup_min"], r["speedup_max"], r["identical_turns"])
           for r in rows}
    # eagle1 chain-5: passes 1.0, 1.2 (the rotated pass's last row), 0.9 -> median 1.0, range 0.9-1.2; it parted
    # from AR in the second pass, so the row says 5/6
    assert got == {("eagle1", "chain-5"): (1.0, 0.9, 1.2, "5/6"), ("hybrid-eagle1", "chain-5"): (2.0, 1.8, 2.4, "6/6"),
                   ("eagle1", "chain-2"): (3.0, 2.7, 3.3, "6/6")}
    assert calls == ["calls"] and ar["tokens_per_second_repeats"] == [10.0, 11.0, 9.0]
    with pytest.raises(Exception, match="different rows"):
        merge_repeats([passes[0], (passes[1][0][:2], [], {"tokens_per_second": 1.0})])


def test_draft_heads_refuses_repeats_without_interleaving():
    """draft_heads.py's flags are checked by check_repeats (its parser exits 2 with the message)."""
    for repeats, interleave in ((3, False), (0, True)):
        with pytest.raises(SpectrainError, match="only with --interleave"):
            check_repeats(repeats, interleave)
    check_repeats(3, True)
    check_repeats(1, False)


def test_repeat_eval_summarizes_each_setting_by_hand():
    evals = [{"results": {"ar": {"tokens_per_second": t}, "chain-4": {"speedup": s, "tau": 2.5, "identical_to_ar": True}}}
             for t, s in ((100.0, 1.10), (90.0, 0.95), (95.0, 1.30))]
    assert summarize_runs(evals) == {"chain-4": {
        "tau": [2.5] * 3, "identical_to_ar": [True] * 3, "speedup": 1.10, "speedup_min": 0.95, "speedup_max": 1.30,
        "speedup_runs": [1.10, 0.95, 1.30], "ar_tokens_per_second": [100.0, 90.0, 95.0]}}
    for e, (ar, chain) in zip(evals, ((1.2, 1.3), (1.1, 1.0), (1.25, 1.6))):  # HF generate() timed beside them
        e["results"]["ar"]["speedup_over_hf"], e["results"]["chain-4"]["speedup_over_hf"] = ar, chain
    hf = summarize_runs(evals)["chain-4"]
    assert (hf["speedup_over_hf"], hf["speedup_over_hf_min"], hf["speedup_over_hf_max"]) == (1.3, 1.0, 1.6)
    assert hf["speedup_over_hf_runs"] == [1.3, 1.0, 1.6] and hf["ar_over_hf_runs"] == [1.2, 1.1, 1.25]
