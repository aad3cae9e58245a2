"""The verdicts of the real-engine checks: one drafter's row judged from what the engine did and what our evaluator
measured (``benchmarks/engine_check.py``: :func:`vllm_verdict`; ``benchmarks/llama_cpp_check.py``:
:func:`llama_cpp_verdict`).

Each verdict returns (ok, a note for the table, what the drafter's record gains), and each can fail: a control
off its predicted count, a mistaken export the engine read as the right one, τ outside the band, an engine output
that parts from its own plain greedy output (except at a measured near-tie).
"""

from __future__ import annotations

from spectrain.eval.engine_controls import predicted_acceptance
from spectrain.heads.dflash import DFlashConfig


# -- vLLM ----------------------------------------------------------------------------------------------------------
def block_fields(config: DFlashConfig) -> dict:
    """What a block drafter was trained with and the engine must read: 0-based target layers, the mask token."""
    return {"target_layer_ids": list(config.target_layer_ids), "mask_token_id": config.mask_token_id}


def engine_fields(draft_config: dict | None) -> dict | None:
    """The same fields as the engine resolved them (vLLM's ``dflash_config``), or None when it did not say."""
    resolved = (draft_config or {}).get("dflash_config")
    if not isinstance(resolved, dict) or "target_layer_ids" not in resolved:
        return None
    return {"target_layer_ids": list(resolved["target_layer_ids"]), "mask_token_id": resolved.get("mask_token_id")}


def field_diff(resolved: dict, expected: dict) -> str:
    """'engine mask_token_id 1, trained 0' for each field that differs."""
    return ", ".join(f"engine {k} {resolved.get(k)}, trained {v}" for k, v in expected.items() if resolved.get(k) != v)


def vllm_verdict(info: dict, r: dict, ours: dict, greedy: list[list[int]], tolerance: float, token: int,
                 k: int) -> tuple[bool, str, dict]:
    """One drafter's verdict from vLLM's run ``r`` and our evaluator's ``ours``: (ok, a note for the table, what
    the record gains). Every row needs vLLM's speculative outputs equal to its ``greedy`` ones; a drafter needs τ
    within ``tolerance`` (``tau_same_count``: both sides as 1 + accepted / rounds, reported beside it); a block
    drafter needs the engine to resolve its own target layers and mask token (``info["expected"]``), a mistaken
    export (``info["must_differ"]``) needs the engine's resolution to differ from the drafter's or, where the
    engine resolves nothing to read (P-EAGLE's placeholder token and state), its accepted tokens at the
    placeholder depths (positions 1..) to differ from what the engine accepted there with the right export
    (``info["reference_per_pos"]``; τ alone moves by the few tokens those depths accept), a parallel drafter
    (``info["parallel"]``) its accepted tokens at every position within ``tolerance`` of ours (at least one token
    apart allowed: the evidence that the engine drafts the placeholders as we do), and a control
    (``info["control_token"]``) its accepted tokens equal to the count predicted from ``greedy``. Every row
    records vLLM's and our accepted tokens per draft position."""
    identical = sum(a == b for a, b in zip(r["token_ids"], greedy))
    tau_vllm = r["mean_acceptance_length"]
    rel = abs(tau_vllm - ours["tau"]) / ours["tau"] if tau_vllm else None
    same_count = 1 + ours["accepted"] / max(ours["rounds"], 1)
    found = {"tau_vllm": tau_vllm, "relative_difference": rel, "identical_prompts": identical, "prompts": len(greedy),
             "tau_same_count_ours": same_count,
             "relative_difference_same_count": abs(tau_vllm - same_count) / same_count if tau_vllm else None,
             "counters": r["counters"], "accepted_per_pos": r["accepted_per_pos"],
             "accepted_per_pos_ours": ours.get("accepted_per_pos"),
             "per_pos_equal": ours.get("accepted_per_pos") == list(r["accepted_per_pos"] or []),
             "per_pos_within": per_pos_within(list(r["accepted_per_pos"] or []), ours.get("accepted_per_pos"),
                                              tolerance),
             "generate_seconds": r["generate_seconds"]}
    within = rel is not None and rel <= tolerance
    ok, notes = identical == len(greedy), []
    if "expected" in info:  # the layers and mask token the engine resolved, read from the engine itself
        resolved = engine_fields(r.get("draft_config"))
        found.update(engine_resolved=resolved, fields_match=resolved == info["expected"])
        if resolved is None:
            ok = False
            notes.append("the engine did not say what it resolved")
        elif "must_differ" in info:
            caught = resolved != info["expected"]
            ok = ok and caught
            notes.append((f"caught: {field_diff(resolved, info['expected'])}" if caught else
                          f"NOT caught: the engine resolved the drafter's own fields from the wrong {info['must_differ']}")
                         + f"; tau alone {'would catch it' if not within else 'would not'}")
        elif resolved != info["expected"]:
            ok = False
            notes.append(field_diff(resolved, info["expected"]))
    elif "must_differ" in info:  # nothing resolved to read: the placeholder depths' acceptance must move
        reference, found_pos = info.get("reference_per_pos"), list(r["accepted_per_pos"] or [])
        comparable = bool(reference) and len(found_pos) == len(reference) == k
        caught = comparable and found_pos[1:] != list(reference[1:])
        found.update(reference_per_pos=reference, caught=caught)
        ok = ok and caught
        if not comparable:
            notes.append(f"NOT judged: accepted per position {found_pos or 'not reported'} against the right "
                         f"export's {reference or 'missing run'} (k = {k})")
        else:
            notes.append((f"caught: accepted per position {found_pos} vs {reference} with the right export" if caught
                          else f"NOT caught: accepted per position {found_pos}, as with the right export")
                         + f"; tau alone {'would catch it' if not within else 'would not'}")
    if info.get("parallel") and not found["per_pos_within"]:
        ok = False
        notes.append(f"accepted per position {r['accepted_per_pos']} vs ours {ours.get('accepted_per_pos')}")
    if "must_differ" not in info:
        ok = ok and within
    if "control_token" in info:
        predicted = predicted_acceptance(greedy, token, k)
        hit = predicted["num_accepted_tokens"] == r["counters"].get("num_accepted_tokens")
        found.update(predicted=predicted, prediction_matches=hit)
        ok = ok and hit
        notes.insert(0, f"accepted {r['counters'].get('num_accepted_tokens')} vs predicted "
                        f"{predicted['num_accepted_tokens']}")
    return ok, f" ({'; '.join(notes)})" if notes else "", found


def per_pos_within(engine: list[int], ours: list[int] | None, tolerance: float) -> bool:
    """Accepted tokens at every draft position within ``tolerance`` of ours (one token apart always allowed); False
    when either side did not report them or their lengths differ."""
    if not ours or len(engine) != len(ours):
        return False
    return all(abs(a - b) <= max(1.0, tolerance * b) for a, b in zip(engine, ours))


# -- llama.cpp -----------------------------------------------------------------------------------------------------
def llama_cpp_verdict(info: dict, plain: list[list[int]], spec: list[list[int]], counts: list[dict], ours: dict,
                      tolerance: float, token: int, k: int, parted: list[dict] | None = None,
                      near_tie: float | None = None) -> tuple[bool, str, dict]:
    """One drafter's verdict: (ok, a note for the table, what the record gains).

    ``plain`` / ``spec``: llama.cpp's greedy outputs without and with the draft, per prompt; ``counts``: per prompt
    :func:`~spectrain.eval.llama_cpp_server.rounds_and_tau`; ``ours``: our evaluator's ``tau`` / ``accepted`` /
    ``rounds`` (and ``ar_tokens``). Every row needs spec == plain on every prompt and, where
    ``info["expected_layers"]`` is set, the target layers llama.cpp's loader resolved (``info["engine_layers"]``,
    read from its log) equal to them (an integrity check: they echo the file). A drafter needs
    |τ_llama.cpp − τ_ours| ≤ ``tolerance`` · τ_ours; a mistaken export (``info["must_differ"]``) needs the opposite,
    τ outside the tolerance: the resolved layers of a file that says the wrong layers are the wrong layers, so they
    prove nothing about the convention; a control (``info["control_token"]``) needs llama.cpp's accepted count equal
    to the count predicted from what it emitted (``spec``: a draft of ``k`` copies of the token accepts exactly its
    leading runs there), and ours equal to the one predicted from our own output; a layer probe
    (``info["probe_predicted"]``: accepted per prompt predicted by our forward on llama.cpp's own text,
    :mod:`~spectrain.eval.layer_probe`) needs llama.cpp's per-prompt counts equal to it, and its shifted twin needs
    them to differ. ``info["informational"]``: a mistaken export reported, not judged (a trained drafter's shifted
    layers, which τ cannot tell apart; the probes decide). A prompt whose ``spec`` parts from ``plain`` passes only
    as a measured near-tie: ``parted`` (:func:`~spectrain.eval.engine_compare.partings`) has its first parting with
    llama.cpp's own plain-path margin between the two tokens at most ``near_tie`` (nats; None: no parting may pass;
    the check passes max(``--near_tie``, 2 · the run's measured ``kernel_spread``) capped at ``--near_tie_max``),
    and a row whose ``info["kernel_spread"]`` exceeds ``info["near_tie_max"]`` fails: its paths disagree by more
    than kernels do."""
    identical = sum(a == b for a, b in zip(spec, plain))
    generated = sum(c["generated"] for c in counts)
    rounds = sum(c["rounds"] for c in counts)
    accepted = sum(c["accepted"] for c in counts)
    tau = (generated - len(counts)) / rounds if rounds else None
    rel = abs(tau - ours["tau"]) / ours["tau"] if tau is not None and ours.get("tau") else None
    found = {"tau_llama_cpp": tau, "relative_difference": rel, "identical_prompts": identical, "prompts": len(plain),
             "accepted_llama_cpp": accepted, "rounds_llama_cpp": rounds,
             "drafted_llama_cpp": sum(c["drafted"] for c in counts), "per_prompt": counts}
    within = rel is not None and rel <= tolerance
    parted = parted or []
    ties = [q for q in parted if near_tie is not None and q.get("plain_margin") is not None
            and q["plain_margin"] <= near_tie]
    found.update(partings=parted, near_ties=len(ties))
    ok, notes = identical + len(ties) == len(plain) and len(plain) > 0, []
    if identical != len(plain):
        notes.append(f"spec != plain on {len(plain) - identical} prompts"
                     + (f", {len(ties)} a measured near-tie" if ties else ""))
    spread, limit = info.get("kernel_spread"), info.get("near_tie_max")
    if spread is not None and limit is not None and spread > limit:
        ok = False
        notes.append(f"llama.cpp's plain and speculative paths differ by {spread:.4f} nats on one token: more than "
                     f"kernel noise ({limit})")
    layers_differ = False
    if "expected_layers" in info:
        found["engine_layers"] = info.get("engine_layers")
        layers_differ = info.get("engine_layers") != info["expected_layers"]
        if layers_differ and "must_differ" not in info:
            ok = False
            notes.append(f"llama.cpp resolved target layers {info.get('engine_layers')}, the drafter's are "
                         f"{info['expected_layers']}")
    if "probe_predicted" in info:  # a layer probe: exact accepted counts per prompt, in place of the τ band
        per_prompt = [c["accepted"] for c in counts]
        same = per_prompt == info["probe_predicted"]
        found.update(accepted_per_prompt=per_prompt, prediction_matches=same)
        if "must_differ" in info:
            ok = ok and not same
            notes.append(f"{'caught' if not same else 'NOT caught'}: accepted {per_prompt} vs {info['probe_predicted']}"
                         " predicted from the named layers")
        else:
            ok = ok and same
            notes.insert(0, f"accepted {per_prompt} vs predicted {info['probe_predicted']}")
    elif "must_differ" in info:  # caught only by what the engine measures: the resolved layers echo the file
        if not info.get("informational"):
            ok = ok and not within
        notes.append(f"{'caught' if not within else 'NOT caught'} by tau"
                     + (f": {tau:.3f} vs {ours['tau']:.3f}" if tau is not None else ": no rounds")
                     + ("; llama.cpp read the file's shifted layers" if layers_differ else "")
                     + ("; informational: the layer probes decide this mistake" if info.get("informational") else ""))
    else:
        ok = ok and within
    if "control_token" in info:
        predicted = predicted_acceptance(spec, token, k)["num_accepted_tokens"]
        predicted_ours = predicted_acceptance(ours["ar_tokens"], token, k)["num_accepted_tokens"]
        hit = predicted == accepted and predicted_ours == ours["accepted"]
        found.update(predicted_accepted=predicted, predicted_accepted_ours=predicted_ours, prediction_matches=hit)
        ok = ok and hit
        notes.insert(0, f"accepted {accepted} vs predicted {predicted}; ours {ours['accepted']} vs {predicted_ours}")
    return ok, f" ({'; '.join(notes)})" if notes else "", found
