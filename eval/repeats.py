"""The benchmark protocol's repeats: a speed figure is the median of several passes with its min and max, never one
pass (on shared cores the machine's speed drifts by ±15 % within minutes).

:func:`merge_repeats`: ``benchmarks/draft_heads.py --interleave --repeats N``'s passes, rows matched by setting (not
by position: each pass starts its rotation of settings elsewhere), the worst pass's identity kept.
:func:`summarize_runs`: ``benchmarks/repeat_eval.py``'s runs of one ``spectrain-eval`` command.
"""

from __future__ import annotations

import statistics

from spectrain.heads.errors import SpectrainError


def check_repeats(repeats: int, interleave: bool) -> None:
    """At least one pass, and more than one only when interleaved: the repeats are passes of the interleaved
    protocol (AR beside every setting, prompt by prompt); the other protocol decodes AR before each drafter call
    and makes one pass."""
    if repeats < 1 or (repeats > 1 and not interleave):
        raise SpectrainError("--repeats must be >= 1, and more than 1 only with --interleave")


def merge_repeats(passes: list[tuple[list[dict], list[dict], dict]]) -> tuple[list[dict], list[dict], dict]:
    """The interleaved passes of ``--repeats`` as one result, rows matched by (drafter, draft vocab, setting): each
    row the first pass's, its ``speedup`` the median over the passes with ``speedup_min`` / ``speedup_max`` and
    every pass's value in ``speedup_repeats``; τ and identity of every pass kept (``tau_repeats``,
    ``identical_repeats``; at T = 0 they are the same in every pass unless a pass parted: then
    ``identical_turns`` is the worst pass's). The AR summary is the first pass's, with every pass's tokens/s;
    calls are the first pass's."""
    rows, calls, ar = passes[0]
    by_key = [{(r["drafter"], r["draft_vocab"], r["setting"]): r for r in rows_p} for rows_p, _, _ in passes]
    for row_ in rows:
        key = (row_["drafter"], row_["draft_vocab"], row_["setting"])
        if any(key not in keyed for keyed in by_key):
            raise SpectrainError(f"the repeats produced different rows: {key} is missing from one")
        same = [keyed[key] for keyed in by_key]
        speedups = [s["speedup"] for s in same]
        identical = [s["identical_turns"] for s in same]
        row_.update(speedup=statistics.median(speedups), speedup_min=min(speedups), speedup_max=max(speedups),
                    speedup_repeats=speedups, tau_repeats=[s["tau"] for s in same], identical_repeats=identical,
                    identical_turns=min(identical, key=lambda v: int(v.split("/")[0])))
    ar = {**ar, "tokens_per_second_repeats": [a["tokens_per_second"] for _, _, a in passes]}
    return rows, calls, ar


def summarize_runs(evals: list[dict]) -> dict:
    """Per setting of the runs' ``results`` (AR left out): each run's τ, identity and speedup over our AR; the
    speedup's median, min and max; where every run timed HF ``generate()`` beside them, the same of the speedup over
    it (``speedup_over_hf``) and of our AR's (``ar_over_hf_runs``)."""
    settings = {}
    for name in evals[0]["results"]:
        if name == "ar":
            continue
        rows = [e["results"][name] for e in evals]
        speedups = [r["speedup"] for r in rows]
        settings[name] = {"tau": [r["tau"] for r in rows], "identical_to_ar": [r["identical_to_ar"] for r in rows],
                          "speedup": statistics.median(speedups), "speedup_min": min(speedups),
                          "speedup_max": max(speedups), "speedup_runs": speedups,
                          "ar_tokens_per_second": [e["results"]["ar"]["tokens_per_second"] for e in evals]}
        over_hf = [r.get("speedup_over_hf") for r in rows]
        if None not in over_hf:
            settings[name].update(speedup_over_hf=statistics.median(over_hf), speedup_over_hf_min=min(over_hf),
                                  speedup_over_hf_max=max(over_hf), speedup_over_hf_runs=over_hf,
                                  ar_over_hf_runs=[e["results"]["ar"]["speedup_over_hf"] for e in evals])
    return settings
