"""What a ``benchmarks/llama_cpp_speed.py`` run measured, summarized: per mode its speedup over plain decoding in
each repeat (median and min–max), τ, acceptance and ms per round; where a round's time goes (llama.cpp's own
draft timer, the target's forward by ``llama-bench``); and the round's cost against plain decoding
(:func:`round_costs`), also added to an existing result file (:func:`resummarize`, ``--resummarize``).
"""

from __future__ import annotations

import json
import statistics
import subprocess
from pathlib import Path

from spectrain.eval.llama_cpp_modes import mode_of, run_p_min
from spectrain.eval.llama_cpp_server import rounds_and_tau
from spectrain.heads.errors import SpectrainError
from spectrain.heads.io import read_json
from spectrain.heads.report import finish, format_table


def summarize(runs: dict[str, list[list[dict]]], plain: list[list[int]]) -> dict[str, dict]:
    """Per mode, from ``runs[mode][repeat][prompt]`` (completions + their ``tokens_eos_stripped``): speedup over
    plain per repeat (pooled tok/s ratio), its median and range, τ, acceptance, ms per round, identity."""
    out = {}
    base = runs["plain"]
    for mode, reps in runs.items():
        speeds, ratios = [], []
        for rep, rep_plain in zip(reps, base):
            tok = sum(r["timings"]["predicted_n"] for r in rep)
            ms = sum(r["timings"]["predicted_ms"] for r in rep)
            tok_p = sum(r["timings"]["predicted_n"] for r in rep_plain)
            ms_p = sum(r["timings"]["predicted_ms"] for r in rep_plain)
            speeds.append(1000 * tok / ms)
            ratios.append((tok / ms) / (tok_p / ms_p))
        counts = [rounds_and_tau(r) for r in reps[0]]
        generated, rounds = sum(c["generated"] for c in counts), sum(c["rounds"] for c in counts)
        ms_round = statistics.median(sum(r["timings"]["predicted_ms"] for r in rep) /
                                     max(sum(rounds_and_tau(r)["rounds"] for r in rep), 1) for rep in reps)
        rounds_all = sum(rounds_and_tau(r)["rounds"] for rep in reps for r in rep)
        ms_all = sum(r["timings"]["predicted_ms"] for rep in reps for r in rep)
        identical = sum(all(r["tokens_eos_stripped"] == p for r in (rep[i] for rep in reps))
                        for i, p in enumerate(plain))
        out[mode] = {"tok_per_s": speeds, "tok_per_s_median": statistics.median(speeds),
                     "speedup": ratios, "speedup_median": statistics.median(ratios),
                     "speedup_min": min(ratios), "speedup_max": max(ratios),
                     "win": min(ratios) > 1.0, "tau": (generated - len(counts)) / rounds if rounds else None,
                     "drafted": sum(c["drafted"] for c in counts), "accepted": sum(c["accepted"] for c in counts),
                     "ms_per_round_median": ms_round, "rounds_all_repeats": rounds_all,
                     "ms_per_round_pooled": ms_all / rounds_all if rounds_all else None,
                     "identical_prompts": identical, "prompts": len(plain)}
    return out


def forward_costs(bench: Path, target: Path, threads: int, sizes: list[int], repeats: int = 5) -> dict:
    """The target's own forward cost by batch size, from ``llama-bench`` (nothing else running): ms of one forward
    over n new tokens (``-p n``: what a verify pass of n = drafts + 1 tokens computes) and ms per token of plain
    generation (``-n 16``), each the mean of ``repeats`` runs with its standard deviation."""
    cmd = [str(bench), "-m", str(target), "-p", ",".join(map(str, sizes)), "-n", "16", "-t", str(threads),
           "-r", str(repeats), "-o", "json"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    if proc.returncode:
        raise SpectrainError(f"llama-bench failed: {proc.stderr[-800:]}")
    rows = json.loads(proc.stdout)
    out = {"command": cmd, "forward_ms": {}, "forward_ms_std": {}}
    for r in rows:
        if r["n_gen"]:
            out["generate_ms_per_token"] = r["avg_ns"] / 1e6 / r["n_gen"]
        else:
            out["forward_ms"][str(r["n_prompt"])] = r["avg_ns"] / 1e6
            out["forward_ms_std"][str(r["n_prompt"])] = r["stddev_ns"] / 1e6
    return out


def round_split(mode: dict, drafting: dict | None) -> dict:
    """A mode's round split from llama.cpp's own draft timer: draft ms per round and the rest of the round."""
    if not drafting:
        return {}
    rounds = mode["rounds_all_repeats"]
    per_round = drafting["draft_ms"] / rounds if rounds else None
    return {"draft_calls": drafting["calls"], "draft_ms": round(drafting["draft_ms"], 3),
            "draft_ms_per_round": per_round, "rest_ms_per_round":
                None if per_round is None else mode["ms_per_round_pooled"] - per_round}


def round_costs(modes: dict[str, dict], costs: dict, p_min: float = 0.0) -> dict[str, dict]:
    """Per draft mode of fixed length (no p-min): its round against plain decoding, from measured numbers only.

    ``break_even_tau`` = ms per round / plain's ms per token (the τ a round needs to cost no more than plain
    decoding of as many tokens); ``ceiling_speedup`` = (k + 1) × plain's ms per token / ms per round (every draft
    accepted, at this round cost); the round's split: llama.cpp's draft timer, the target's forward over k + 1
    tokens (``llama-bench``, ``costs``), and the rest (the draft's feature encoding and KV catch-up, which run
    outside llama.cpp's draft timer, the server's own work per round, and attention at the context's depth,
    which ``llama-bench -p`` times at depth 0). ``p_min``: the run's ``--p_min`` (modes drafting under one are
    left out, as are those with their own)."""
    plain = modes["plain"]["ms_per_round_pooled"]
    out = {}
    for name, m in modes.items():
        mode = mode_of(name)
        if mode is None or m.get("draft_ms_per_round") is None:
            continue
        if (p_min if mode.p_min is None else mode.p_min):  # drafts stop early: rounds of several lengths
            continue
        verify = costs["forward_ms"].get(str(mode.k + 1))
        ms = m["ms_per_round_pooled"]
        out[name] = {"k": mode.k, "ms_per_round": ms, "plain_ms_per_token": plain,
                     "break_even_tau": ms / plain, "ceiling_speedup": (mode.k + 1) * plain / ms,
                     "draft_ms": m["draft_ms_per_round"], "verify_ms_llama_bench": verify,
                     "other_ms": None if verify is None else ms - m["draft_ms_per_round"] - verify}
    return out


def round_cost_table(name: str, rows: dict[str, dict]) -> str:
    """:func:`round_costs`' rows of target ``name`` as a printed table."""
    return format_table(["mode", "ms/round", "plain ms/token", "break-even tau", "ceiling (all accepted)",
                         "draft ms", "verify ms (llama-bench)", "rest ms"],
                        [[m, f"{r['ms_per_round']:.2f}", f"{r['plain_ms_per_token']:.2f}", f"{r['break_even_tau']:.3f}",
                          f"{r['ceiling_speedup']:.3f}", f"{r['draft_ms']:.2f}",
                          "-" if r["verify_ms_llama_bench"] is None else f"{r['verify_ms_llama_bench']:.2f}",
                          "-" if r["other_ms"] is None else f"{r['other_ms']:.2f}"] for m, r in rows.items()],
                        title=f"target {name}: a round against plain decoding")


def resummarize(path: str) -> Path:
    """``--resummarize FILE``: add :func:`round_costs` to every target of an existing result file (from its own
    measured fields; nothing re-run), print them, write the file back atomically."""
    path = Path(path)
    record = read_json(path, "llama_cpp_speed result")
    tables = []
    try:
        for name, target in record["targets"].items():
            target["round_costs"] = round_costs(target["modes"], target["forward_costs"],
                                                run_p_min(record.get("command", "")))
            tables.append(round_cost_table(name, target["round_costs"]))
    except KeyError as err:
        raise SpectrainError(f"{path} lacks {err}: not a llama_cpp_speed.py result with forward costs") from None
    return finish(record, path, tables)


def busy_speed(groups: list[list[dict]]) -> dict:
    """Aggregate decode speed of prompts each sent as P copies at once: generated tokens over the summed decode
    time, a prompt's decode time the longest of its copies' ``predicted_ms`` (its slots are busy until then)."""
    decode_ms = sum(max(float(r["timings"].get("predicted_ms", 0.0)) for r in g) for g in groups)
    tokens = sum(int(r["timings"].get("predicted_n", len(r["tokens"]))) for g in groups for r in g)
    if decode_ms <= 0:
        raise SpectrainError("llama-server reported no decode time (timings.predicted_ms)")
    return {"tok_per_s": 1000.0 * tokens / decode_ms, "decode_ms": decode_ms, "tokens": tokens}


def slot_table(par: dict, part: str | None, title: str) -> str:
    """The parallel phase's table: per slot count and mode, the wall-clock figures (``part`` None) or the busy
    ones (``part="busy"``)."""
    rows = []
    for p, rows_p in par.items():
        for m, r in rows_p.items():
            x = r[part] if part else r
            same = (f"{x['all_copies_identical_to_single_slot_plain']}/{r['prompts']}" if part else
                    f"{x['identical_to_single_slot_plain']}/{x['prompts']}")
            rows.append([p, m, f"{x['tok_per_s_median']:.1f}", f"{x['speedup_median']:.3f}",
                         f"{x['speedup_min']:.3f}-{x['speedup_max']:.3f}",
                         f"{x['accepted']}/{x['drafted']}" if x["drafted"] else "-", same])
    return format_table(["slots", "mode", f"{part or 'aggregate'} tok/s", "vs plain", "range", "accepted/drafted",
                         "copies same as 1-slot plain" if part else "same as 1-slot plain"], rows, title=title)


def slot_speeds(speeds: list[float], plain: list[float], counts: list[dict]) -> dict:
    """One mode's figures at P slots: tokens/s per repeat and their median, its ratio to plain decoding's in the
    same repeat (median, min, max, a win only when every repeat is above 1), and the drafts accepted / drafted
    over ``counts`` (:func:`~spectrain.eval.llama_cpp_server.rounds_and_tau` per completion)."""
    ratios = [a / b for a, b in zip(speeds, plain)]
    return {"tok_per_s": speeds, "tok_per_s_median": statistics.median(speeds), "speedup": ratios,
            "speedup_median": statistics.median(ratios), "speedup_min": min(ratios), "speedup_max": max(ratios),
            "win": min(ratios) > 1.0, "accepted": sum(c["accepted"] for c in counts),
            "drafted": sum(c["drafted"] for c in counts)}
