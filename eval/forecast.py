"""``spectrain-plan``: a speedup forecast for the engine a user serves with, from a drafter's measured acceptance
(α by depth, an ``eval.json``) and the engine's measured costs (a :class:`CostProfile`).

A round of a chain of k drafts costs the target's forward over k + 1 new tokens, the drafting (k draft steps when
drafting is sequential, one draft forward when it is parallel, as P-EAGLE / DFlash draft) and the round's
overhead: what the engine does besides the two (our loop's ``other``; in llama.cpp the draft's feature encoding
and KV catch-up, k + 1 logit rows and their sampling, attention at the served depth where ``llama-bench`` times
depth 0). Expected τ is the product form, 1 + Σ_j Π_{i≤j} α_i; the expected speedup τ × t_AR / round, t_AR the
engine's own plain decoding per token; break-even τ = round / t_AR; the all-accepted ceiling (k + 1) t_AR / round.

Costs are priced from what was measured (:func:`forward_cost`, :func:`draft_cost`, :func:`overhead_cost`): the
one-token forward apart (another kernel: matrix-vector), forwards over n ≥ 2 tokens by the least-squares line
through the measured ones (flat below the smallest; ``model="points"``: linear interpolation between them), the
overhead interpolated between the chain lengths whose rounds were timed. Readers (:func:`profiles_of`) build
profiles from our loop's ``eval.json`` and speed files, from ``benchmarks/llama_cpp_speed.py`` results with
forward costs (llama.cpp), or from a profile JSON (:data:`PROFILE_FORMAT`, any engine: vLLM's CPU runner has
no committed cost measurement). :func:`check_rows` sets each measured setting of a result file beside the
forecast from the α (or τ) and costs the same file records (``benchmarks/forecast_check.py``).
"""

from __future__ import annotations

import argparse
import shlex
import statistics
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

from spectrain.heads.errors import SpectrainError, run_command
from spectrain.heads.io import read_json
from spectrain.heads.report import finish, format_table

from .costs import plan
from .metrics import expected_tau

ENGINES = ("spectrain", "llama.cpp", "vllm")  # "spectrain": our own loop (spectrain-eval)
DRAFTING = ("sequential", "parallel")
FORWARD_MODELS = ("line", "points")
PROFILE_FORMAT = "spectrain-cost-profile"
VLLM_UNMEASURED = ("vLLM's CPU runner's costs are unmeasured: no committed result times its forward over n tokens "
                   "or a draft step (the vLLM checks record τ and whole-generation seconds); write a cost profile "
                   f'JSON ("format": "{PROFILE_FORMAT}") from your own timings and pass it as --costs')


@dataclass(frozen=True)
class CostProfile:
    """An engine's measured costs, in ms, for one target and one drafter.

    Attributes:
        engine: one of :data:`ENGINES` (or another engine's name, in a profile JSON).
        name: which profile of its source (``f32:q8_0``: llama.cpp's f32 target with a Q8_0 draft).
        ar_ms: plain decoding per token, as the engine serves it.
        forward_ms: n -> the target's forward over n new tokens.
        draft_ms: k -> drafting per round at chain length k, as measured.
        round_ms: k -> a whole speculative round at chain length k (what prices the overhead).
        drafting: how ``draft_ms`` was drafted: ``sequential`` (k steps) or ``parallel`` (one forward).
        forward_in_rounds: ``forward_ms[k + 1]`` was timed in the rounds of chain k (our loop), not apart.
        slot_ms: P -> plain decoding's step with P slots busy (one token for each of P sequences), measured
            (llama.cpp: ``llama_cpp_speed.py --parallel``'s busy plain rows; 1 = that measurement at one slot).
        cpu, dtype, context: where and at what context depth the costs were measured.
        source: the file read.
        notes: what the reader assumed.
    """
    engine: str
    name: str
    ar_ms: float
    forward_ms: dict[int, float]
    draft_ms: dict[int, float] = field(default_factory=dict)
    round_ms: dict[int, float] = field(default_factory=dict)
    drafting: str = "sequential"
    forward_in_rounds: bool = False
    slot_ms: dict[int, float] = field(default_factory=dict)
    cpu: str = "not recorded"
    dtype: str | None = None
    context: str = "not recorded"
    source: str = ""
    notes: tuple[str, ...] = ()

    def __post_init__(self):
        if self.drafting not in DRAFTING:
            raise SpectrainError(f"profile {self.name}: drafting must be one of {', '.join(DRAFTING)}, "
                                 f"got {self.drafting!r}")
        if not self.ar_ms or self.ar_ms <= 0 or not self.forward_ms:
            raise SpectrainError(f"profile {self.name} ({self.source or 'given'}) needs ar_ms > 0 and forward_ms")
        if not any(n >= 2 for n in self.forward_ms):
            raise SpectrainError(f"profile {self.name} ({self.source or 'given'}) has no forward over 2 or more "
                                 "tokens: a verify pass cannot be priced")
        bad = {n: v for n, v in self.slot_ms.items() if not (isinstance(n, int) and n >= 1 and v > 0)}
        if bad:
            raise SpectrainError(f"profile {self.name} ({self.source or 'given'}): slot_ms needs slot counts >= 1 "
                                 f"with steps > 0 ms, got {bad}")

    def to_dict(self) -> dict:
        """The profile as :data:`PROFILE_FORMAT` JSON (read back by :func:`profile_from_dict`)."""
        return {"format": PROFILE_FORMAT, "engine": self.engine, "name": self.name, "cpu": self.cpu,
                "dtype": self.dtype, "context": self.context, "ar_ms": self.ar_ms,
                "forward_ms": {str(n): v for n, v in sorted(self.forward_ms.items())},
                "draft_ms": {str(k): v for k, v in sorted(self.draft_ms.items())}, "drafting": self.drafting,
                "round_ms": {str(k): v for k, v in sorted(self.round_ms.items())},
                "forward_in_rounds": self.forward_in_rounds,
                "slot_ms": {str(n): v for n, v in sorted(self.slot_ms.items())},
                "source": self.source, "notes": list(self.notes)}


def profile_from_dict(d: dict, source: str = "") -> CostProfile:
    """A :data:`PROFILE_FORMAT` record -> :class:`CostProfile` (its keys checked, each missing one named)."""
    try:
        def ints(key):
            return {int(k): float(v) for k, v in (d.get(key) or {}).items()}
        return CostProfile(engine=str(d["engine"]), name=str(d.get("name", d["engine"])), ar_ms=float(d["ar_ms"]),
                           forward_ms=ints("forward_ms"), draft_ms=ints("draft_ms"), round_ms=ints("round_ms"),
                           drafting=d.get("drafting", "sequential"),
                           forward_in_rounds=bool(d.get("forward_in_rounds", False)), slot_ms=ints("slot_ms"),
                           cpu=str(d.get("cpu") or "not recorded"), dtype=d.get("dtype"),
                           context=str(d.get("context") or "not recorded"), source=source or d.get("source", ""),
                           notes=tuple(d.get("notes", ())))
    except KeyError as err:
        raise SpectrainError(f"cost profile {source or ''} lacks {err}") from None
    except (TypeError, ValueError) as err:
        raise SpectrainError(f"cost profile {source or ''} is malformed: {err}") from None


# ------------------------------------------------------------------------------------------------ pricing


def _line(points: dict[int, float]) -> tuple[float, float]:
    """Least-squares (intercept, slope) through ``points``, the slope at least 0 (a cost does not fall as work
    grows; a falling fit is noise); one point: flat through it."""
    xs = sorted(points)
    mean_x, mean_y = sum(xs) / len(xs), sum(points.values()) / len(xs)
    sxx = sum((x - mean_x) ** 2 for x in xs)
    slope = max(sum((x - mean_x) * (points[x] - mean_y) for x in xs) / sxx, 0.0) if sxx else 0.0
    return mean_y - slope * mean_x, slope


def _interpolate(points: dict[int, float], x: float) -> tuple[float, str]:
    """``points`` at ``x``: measured, linear between the measured neighbours, or the least-squares line outside."""
    if x in points:
        return points[x], "measured"
    below, above = [p for p in points if p < x], [p for p in points if p > x]
    if below and above:
        lo, hi = max(below), min(above)
        return points[lo] + (points[hi] - points[lo]) * (x - lo) / (hi - lo), "interpolated"
    a, b = _line(points)
    return max(a + b * x, 0.0), "extrapolated"


def forward_cost(p: CostProfile, n: int, model: str = "line") -> tuple[float, str]:
    """ms of the target's forward over ``n`` new tokens, and how it was priced.

    n = 1 is the measured one-token forward (else the AR step). n ≥ 2 runs the matrix-matrix path, whose cost is
    not on a line through the one-token one (measured: fp32 on an AVX2 CPU, 94 ms for one token and 179–181 for
    three and six): ``line`` prices it by the least-squares line through the measured n ≥ 2 (llama-bench's points
    scatter by up to ±3 ms), ``points`` by interpolating them; below the smallest measured n ≥ 2 both hold its
    cost."""
    if model not in FORWARD_MODELS:
        raise SpectrainError(f"forward model must be one of {', '.join(FORWARD_MODELS)}, got {model!r}")
    if n == 1:
        return (p.forward_ms[1], "measured") if 1 in p.forward_ms else (p.ar_ms, "the AR step")
    multi = {m: v for m, v in p.forward_ms.items() if m >= 2}
    low = min(multi)
    if model == "points":
        return (multi[low], f"held at n = {low}") if n < low else _interpolate(multi, n)
    a, b = _line(multi)
    if n < low:
        return a + b * low, f"held at n = {low}"
    how = "measured" if len(multi) == 1 else ("line" if n <= max(multi) else "line, extrapolated")
    return a + b * n, how


def draft_cost(p: CostProfile, k: int, drafting: str) -> tuple[float, str]:
    """ms of drafting a chain of ``k`` (``sequential``: k steps; ``parallel``: one forward), and how it was priced:
    measured where the profile drafted so at k, else per step (Σ draft / Σ k) or per forward (their mean); the
    other kind than was measured is assumed to cost the same per forward as a step."""
    if drafting not in DRAFTING:
        raise SpectrainError(f"drafting must be one of {', '.join(DRAFTING)}, got {drafting!r}")
    if not p.draft_ms:
        return 0.0, "not measured (0)"
    if drafting == p.drafting and k in p.draft_ms:
        return p.draft_ms[k], "measured"
    unit = (sum(p.draft_ms.values()) / sum(p.draft_ms) if p.drafting == "sequential"
            else statistics.mean(p.draft_ms.values()))
    if drafting == "sequential":
        return k * unit, ("k × the measured step" if p.drafting == drafting
                          else "k × the measured draft forward (assumed: a step costs a forward)")
    return unit, ("the measured draft forward" if p.drafting == drafting
                  else "one measured draft step (assumed: a draft forward costs a step)")


def overhead_cost(p: CostProfile, k: int, model: str = "line") -> tuple[float, str]:
    """ms per round besides the target's forward and the drafting: each timed round less both, priced at its
    chain length (interpolated between lengths, the least-squares line outside them); 0 where no round was timed."""
    rest = {j: r - p.draft_ms.get(j, 0.0) - forward_cost(p, j + 1, model)[0] for j, r in p.round_ms.items()}
    if not rest:
        return 0.0, "not measured (0)"
    value, how = _interpolate(rest, k)
    return (value if how == "measured" else max(value, 0.0)), how


def slot_width(p: CostProfile, slots: int, model: str = "line") -> float:
    """How much a forward over one token per slot costs against one token alone: forward(slots) / forward(1)
    (1 at one slot). It prices a draft step that drafts for every slot at once (assumed to grow as the target's
    forward does) and, where plain decoding at ``slots`` was not measured, the AR step and the overhead."""
    return 1.0 if slots == 1 else forward_cost(p, slots, model)[0] / forward_cost(p, 1, model)[0]


def slot_clock(p: CostProfile) -> float:
    """``ar_ms`` / ``slot_ms[1]``: the busy-slot measurement times decoding otherwise than the one-slot profile
    (llama.cpp: P copies' decode time against pooled rounds, a few % apart), so its steps are read on the
    profile's clock before they meet its one-slot costs."""
    return p.ar_ms / p.slot_ms[1]


def slot_excess(p: CostProfile, slots: int, model: str = "line") -> float | None:
    """ms that P busy slots add to a step beyond the target's forward over P tokens: plain decoding's measured
    step from 1 to P slots (on the profile's clock, :func:`slot_clock`) less ``llama-bench``'s forward from 1 to P
    tokens (one sequence at depth 0). It is the work of P sequences a one-sequence forward leaves out — attention
    over P contexts at the served depth, P rows sampled — and a round at P pays it as plain decoding does. None
    where plain decoding at ``slots`` (or at one slot) was not measured."""
    if slots not in p.slot_ms or 1 not in p.slot_ms:
        return None
    return ((p.slot_ms[slots] - p.slot_ms[1]) * slot_clock(p)
            - (forward_cost(p, slots, model)[0] - forward_cost(p, 1, model)[0]))


def price(p: CostProfile, k: int, drafting: str, model: str = "line", slots: int = 1) -> dict:
    """One round of a chain of ``k`` with ``slots`` sequences decoded together (llama-server's ``-np``; each round
    verifies every slot's k + 1 tokens in one forward and drafts every slot in one batch per step): its parts,
    total, break-even τ and all-accepted ceiling against plain decoding at the same slots (``ar_ms`` is then the
    AR step over one token per slot), and how each part was priced. At several slots the draft grows as the
    target's forward (:func:`slot_width`, assumed). Where plain decoding at ``slots`` was measured
    (``p.slot_ms``), that step (on the profile's clock, :func:`slot_clock`) is the AR step, and the round pays the
    one-slot overhead plus the P slots' :func:`slot_excess`; where it was not, the AR step and the overhead are one
    slot's × :func:`slot_width` (assumed; up to 28 % low against llama.cpp's busy slots on Q4_1,
    docs/results/forecast_check.json)."""
    if slots < 1:
        raise SpectrainError(f"slots must be >= 1, got {slots}")
    width = slot_width(p, slots, model)
    (fwd, fwd_how), (dft, dft_how), (rest, rest_how) = (forward_cost(p, slots * (k + 1), model),
                                                        draft_cost(p, k, drafting), overhead_cost(p, k, model))
    excess = slot_excess(p, slots, model) if slots > 1 else None
    priced = {"forward": fwd_how, "draft": dft_how, "overhead": rest_how}
    if slots > 1:
        grows = f"× {width:.3f} (forward({slots}) / forward(1): assumed)"
        priced["draft"] = f"{dft_how}, {grows}"
        if excess is None:
            priced.update(overhead=f"{rest_how}, {grows}", ar=f"ar_ms {grows}")
        else:
            priced.update(overhead=f"{rest_how} + {excess:.2f} ms of {slots} busy slots (measured plain decoding)",
                          ar=f"measured plain decoding at {slots} slots × {slot_clock(p):.3f} (the profile's clock)")
    if excess is not None and rest + excess < 0:  # the slots' measured work cannot make a round cheaper
        priced["overhead"] += f" = {rest + excess:.2f}, held at 0"
    dft, rest, ar_ms = ((dft * width, rest * width, p.ar_ms * width) if excess is None else
                        (dft * width, max(rest + excess, 0.0), p.slot_ms[slots] * slot_clock(p)))
    total = fwd + dft + rest
    return {"k": k, "drafting": drafting, "slots": slots, "ar_ms": ar_ms, "forward_ms": fwd, "draft_ms": dft,
            "overhead_ms": rest, "round_ms": total, "break_even_tau": total / ar_ms,
            "ceiling_speedup": (k + 1) * ar_ms / total, "priced": priced}


def held_out(p: CostProfile, k: int) -> CostProfile:
    """``p`` without what the rounds of chain ``k`` measured (their draft, round and, where the forward was timed
    in them, the forward over k + 1): what a forecast of chain k has from the other chain lengths alone."""
    draft = {j: v for j, v in p.draft_ms.items() if j != k}
    forward = {n: v for n, v in p.forward_ms.items() if not (p.forward_in_rounds and n == k + 1)}
    return replace(p, draft_ms=draft, round_ms={j: v for j, v in p.round_ms.items() if j != k}, forward_ms=forward,
                   drafting=infer_drafting(draft) or "sequential")


def infer_drafting(draft_ms: dict[int, float]) -> str | None:
    """``sequential`` where the draft per round grows with the chain length at least as the square root of its
    ratio (k steps grow as k), ``parallel`` where it grows less (one forward); None from one length."""
    if len(draft_ms) < 2:
        return None
    lo, hi = min(draft_ms), max(draft_ms)
    return "sequential" if draft_ms[hi] >= draft_ms[lo] * (hi / lo) ** 0.5 else "parallel"


# ------------------------------------------------------------------------------------------------ the forecast


def measured_alpha(alpha: list[float | None]) -> list[float]:
    """α up to the first depth no round reached (None)."""
    out = []
    for a in alpha:
        if a is None:
            break
        out.append(float(a))
    return out


def forecast(alpha: list[float | None], p: CostProfile, max_k: int | None = None, model: str = "line",
             slots: int = 1) -> dict:
    """Every chain length up to α's measured depth (or ``max_k``), drafted sequentially and in parallel, with
    ``slots`` sequences decoded together: expected τ and speedup over plain decoding at the same slots (the
    planner's :func:`~.costs.plan`), the round's priced parts, break-even τ, the ceiling; the best setting and
    whether any pays (speedup > 1)."""
    alpha = measured_alpha(alpha)
    depth = min(len(alpha), max_k) if max_k else len(alpha)
    if depth < 1:
        raise SpectrainError("the acceptance profile has no measured α (no draft was ever verified)")
    rows = []
    for drafting in DRAFTING:
        priced = {k: price(p, k, drafting, model, slots) for k in range(1, depth + 1)}
        planned = plan(alpha[:depth], priced[1]["ar_ms"],
                       {k: r["forward_ms"] + r["overhead_ms"] for k, r in priced.items()},
                       {k: r["draft_ms"] for k, r in priced.items()})
        rows += [{**priced[r["n"]], "expected_tau": r["expected_tau"], "expected_speedup": r["expected_speedup"]}
                 for r in planned]
    best = max(rows, key=lambda r: r["expected_speedup"])
    pays = best["expected_speedup"] > 1.0
    verdict = (f"best: chain {best['k']}, {best['drafting']} drafting, {best['expected_speedup']:.3f}x" if pays else
               f"speculation does not pay here: the best setting (chain {best['k']}, {best['drafting']}) forecasts "
               f"{best['expected_speedup']:.3f}x, and it would need tau {best['break_even_tau']:.3f} to break even")
    notes = pricing_notes(p, depth, model)
    if slots > 1:
        if slot_excess(p, slots, model) is None:
            notes.append(f"{slots} slots: each round verifies {slots} × (k + 1) tokens in one forward; plain "
                         f"decoding at {slots} slots was not measured, so the AR step, the draft and the overhead "
                         f"are priced as one slot's × forward({slots}) / forward(1) (assumed; up to 28 % low against "
                         "llama.cpp's busy slots on Q4_1, docs/results/forecast_check.json)")
        else:
            notes.append(f"{slots} slots: each round verifies {slots} × (k + 1) tokens in one forward; the AR step "
                         f"is plain decoding measured at {slots} busy slots, and the round pays what those slots add "
                         "beyond llama-bench's forward there; the draft grows as forward("
                         f"{slots}) / forward(1) (assumed)")
    return {"rows": rows, "best": best, "pays": pays, "verdict": verdict, "slots": slots, "notes": notes}


def pricing_notes(p: CostProfile, depth: int, model: str) -> list[str]:
    """What the forecast priced rather than read: forwards and overheads at lengths not measured, assumptions."""
    notes = list(p.notes)
    unmeasured = [n for n in range(2, depth + 2) if n not in p.forward_ms]
    if unmeasured:
        multi = sorted(n for n in p.forward_ms if n >= 2)
        rule = ("the least-squares line through" if model == "line" else "linear interpolation between")
        notes.append(f"forward over n tokens not measured for n = {', '.join(map(str, unmeasured))}: priced by {rule} "
                     f"the measured n = {', '.join(map(str, multi))} (held at n = {multi[0]} below it)")
    if model == "line" and len([n for n in p.forward_ms if n >= 2]) > 2:
        notes.append("measured forwards over 2+ tokens are read off their least-squares line (--forward points: "
                     "as measured)")
    other = "parallel" if p.drafting == "sequential" else "sequential"
    notes.append(f"{other} drafting is not what was measured: "
                 + ("one draft forward priced as one measured draft step (assumed)" if other == "parallel"
                    else "each draft step priced as the measured draft forward (assumed)"))
    if not p.round_ms:
        notes.append("no speculative round was timed: the overhead per round (outside forward and draft) is 0 here, "
                     "so these speedups are upper bounds")
    else:
        missing = [k for k in range(1, depth + 1) if k not in p.round_ms]
        if missing:
            notes.append(f"overhead per round not measured for chain {', '.join(map(str, missing))}: interpolated "
                         f"between chain {', '.join(map(str, sorted(p.round_ms)))} (the line outside them)")
    return notes


# ------------------------------------------------------------------------------------------------ readers


def _groups(record: dict) -> list[tuple[str, dict, dict[str, dict], dict[str, tuple]]]:
    """Every decode of our loop a result file records: (name, AR's result, {setting: result}, {setting: (its
    pass's speedup, median, min, max)}); an eval.json (one), ``repeat_eval.py`` (a run each), ``draft_heads.py``
    (a drafter × draft vocabulary each, its first pass: the pass its costs come from)."""
    if isinstance(record.get("results"), dict) and "ar" in record["results"]:
        settings = {s: r for s, r in record["results"].items() if s != "ar"}
        return [("ours", record["results"]["ar"], settings,
                 {s: (r.get("speedup"),) * 2 + (None, None) for s, r in settings.items()})]
    if isinstance(record.get("runs"), list) and record["runs"] and "results" in record["runs"][0]:
        summary, out = record.get("settings") or {}, []
        for i, run in enumerate(record["runs"]):
            settings = {s: r for s, r in run["results"].items() if s != "ar"}
            out.append((f"run{i + 1}", run["results"]["ar"], settings, {
                s: (r.get("speedup"), *(summary.get(s, {}).get(key) for key in ("speedup", "speedup_min",
                                                                                  "speedup_max")))
                for s, r in settings.items()}))
        return out
    if isinstance(record.get("calls"), list) and isinstance(record.get("rows"), list):
        rows = {(r["drafter"], r["draft_vocab"], r["setting"]): r for r in record["rows"]}
        grouped: dict[str, list] = {}
        for call in record["calls"]:
            grouped.setdefault(f"{call['drafter']}@{call['draft_vocab']}", []).append(call)
        out = []
        for name, calls in grouped.items():
            settings, measured = {}, {}
            for call in calls:
                for s, r in call["results"].items():
                    if s == "ar":
                        continue
                    row = rows.get((call["drafter"], call["draft_vocab"], s), {})
                    settings[s] = r
                    measured[s] = ((row.get("speedup_repeats") or [r.get("speedup")])[0], row.get("speedup"),
                                   row.get("speedup_min"), row.get("speedup_max"))
            out.append((name, calls[0]["results"]["ar"], settings, measured))
        return out
    return []


def _fixed_chain(name: str, result: dict) -> int | None:
    """A chain setting's length where every round drafted all of it, else None (trees, cut chains)."""
    if not name.startswith("chain-"):
        return None
    k = int(name.split("-")[1])
    depth = result.get("mean_drafted_depth")
    return k if depth is None or abs(depth - k) < 1e-9 else None


def _cpu(record: dict) -> str:
    cpu = record.get("cpu")
    if not isinstance(cpu, dict):
        return "not recorded"
    from .decode_dtype import cpu_line
    return cpu_line({**cpu, "cpus": cpu.get("cpus") or cpu.get("cores"),
                     "bf16_native": cpu.get("bf16_native", cpu.get("avx512_bf16") or cpu.get("amx_bf16")),
                     "threads": cpu.get("threads") or record.get("threads") or "?"})


def _loop_profile(record: dict, source: str, name: str, ar: dict, settings: dict[str, dict],
                  drafting: str | None) -> CostProfile:
    """Our loop's costs in one decode's rounds: AR's per token and verify pass (the one-token forward), each fixed
    chain's verify pass (forward over k + 1), draft and whole round."""
    forward, draft, rounds = {}, {}, {}
    if ar.get("round_ms") is None or ar.get("decode_ms_per_token") is None:
        raise SpectrainError(f"{source}: AR's result records no round_ms / decode_ms_per_token (in-loop costs): "
                             "re-run spectrain-eval")
    forward[1] = ar["round_ms"]["verify"]
    for s, r in settings.items():
        k = _fixed_chain(s, r)
        if k is None or r.get("round_ms") is None:
            continue
        parts = r["round_ms"]
        forward[k + 1], draft[k], rounds[k] = parts["verify"], parts["draft"], sum(parts.values())
    if not rounds:
        raise SpectrainError(f"{source} ({name}): no chain setting with in-loop round costs (round_ms)")
    inferred = infer_drafting(draft)
    notes = () if drafting or inferred else (
        f"{name}: drafting taken as sequential (one chain length measured; --drafting parallel for a one-forward "
        "drafter)",)
    return CostProfile(engine="spectrain", name=name, ar_ms=ar["decode_ms_per_token"], forward_ms=forward,
                       draft_ms=draft, round_ms=rounds, drafting=drafting or inferred or "sequential",
                       forward_in_rounds=True, cpu=_cpu(record), dtype=record.get("dtype"),
                       context="the decoded turns (prompt + reply so far), timed in the loop's own rounds",
                       source=source, notes=notes)


def _llama_cpp_profiles(record: dict, source: str, drafting: str | None) -> dict[str, CostProfile]:
    """One profile per target × draft variant (dtype, threads) of a ``llama_cpp_speed.py`` result: plain decoding
    per token, ``llama-bench``'s forwards, llama.cpp's draft timer and each fixed-length mode's round."""
    from .llama_cpp_modes import mode_of
    out = {}
    for target, t in record["targets"].items():
        if not t.get("forward_costs"):
            raise SpectrainError(f"{source}: target {target} has no forward_costs (llama-bench): a result written "
                                 "before llama_cpp_speed.py timed rounds; re-run it")
        variants: dict[str, dict] = {}
        for mode_name, m in t["modes"].items():
            mode = mode_of(mode_name)
            if mode is None or mode.p_min is not None or m.get("draft_ms_per_round") is None:
                continue
            suffix = "".join([f":{mode.dtype}" if mode.dtype != "f32" else "",
                              f":t{mode.threads}" if mode.threads else ""])
            v = variants.setdefault(target + suffix, {"draft": {}, "round": {}})
            v["draft"][mode.k], v["round"][mode.k] = m["draft_ms_per_round"], m["ms_per_round_pooled"]
        for name, v in variants.items():
            busy = {int(P): rows["plain"]["busy"] for P, rows in (t.get("parallel") or {}).items()
                    if "busy" in rows.get("plain", {})}
            out[name] = CostProfile(
                engine="llama.cpp", name=name, ar_ms=t["modes"]["plain"]["ms_per_round_pooled"],
                forward_ms={int(n): ms for n, ms in t["forward_costs"]["forward_ms"].items()}, draft_ms=v["draft"],
                round_ms=v["round"], drafting=drafting or infer_drafting(v["draft"]) or "sequential",
                slot_ms={P: 1000.0 * P / b["tok_per_s_median"] for P, b in busy.items()},
                cpu=_cpu(record), dtype=target,
                context="forwards by llama-bench -p n at depth 0; rounds at the served context", source=source)
    return out


def profiles_of(record: dict, source: str, drafting: str | None = None) -> dict[str, CostProfile]:
    """Every cost profile a file holds, by name: a profile JSON or ``spectrain-plan`` output, a llama.cpp speed
    result with forward costs, or our loop's result files (eval.json, ``repeat_eval.py``, ``draft_heads.py``).
    ``drafting``: how the measured drafter drafted (default: inferred from several chain lengths, else
    sequential)."""
    if record.get("format") == PROFILE_FORMAT:
        profile = profile_from_dict(record, source)
        return {profile.name: profile}
    if isinstance(record.get("profile"), dict) and record["profile"].get("format") == PROFILE_FORMAT:
        profile = profile_from_dict(record["profile"], source)
        return {profile.name: profile}
    if isinstance(record.get("targets"), dict):
        return _llama_cpp_profiles(record, source, drafting)
    if "vllm_greedy_equals_our_ar" in record or any("tau_vllm" in d for d in record.get("drafters") or []
                                                     if isinstance(d, dict)):
        raise SpectrainError(f"{source}: {VLLM_UNMEASURED}")
    groups = _groups(record)
    if not groups:
        raise SpectrainError(f"{source} holds no engine costs: give an eval.json, a repeat_eval.py / draft_heads.py "
                             f"result, a llama_cpp_speed.py result with forward costs, or a {PROFILE_FORMAT} JSON")
    timed = [(name, ar, settings) for name, ar, settings, _ in groups
             if any(_fixed_chain(s, r) and r.get("round_ms") for s, r in settings.items())]
    if not timed:  # the first group's error names what is missing
        return {groups[0][0]: _loop_profile(record, source, groups[0][0], groups[0][1], groups[0][2], drafting)}
    return {name: _loop_profile(record, source, name, ar, settings, drafting) for name, ar, settings in timed}


def acceptance_of(record: dict, source: str) -> dict[str, dict]:
    """Every setting with α by depth in a result file of our loop: ``run2/chain-4``, ``eagle1@8192/chain-5`` (a
    plain eval.json: ``chain-4``) -> {alpha, tau, group}."""
    out = {}
    for group, _, settings, _ in _groups(record):
        for s, r in settings.items():
            if measured_alpha(r.get("alpha") or []):
                out[s if group == "ours" else f"{group}/{s}"] = {"alpha": r["alpha"], "tau": r.get("tau"),
                                                                 "group": group, "setting": s}
    if not out:
        raise SpectrainError(f"{source} records no α by depth (results[SETTING]['alpha']): give an eval.json written "
                             "by spectrain-eval with a drafter, or a repeat_eval.py / draft_heads.py result")
    return out


# ------------------------------------------------------------------------------------------------ the check


def _row(file: str, profile: str, setting: str, k: int | None, tau: float | None, measured: tuple,
         forecast_: float | None, held: float | None = None, note: str = "") -> dict:
    """One row of :func:`check_rows`; ``measured``: (the costs' pass, median, min, max) speedups."""
    same, median, lo, hi = measured
    return {"file": file, "profile": profile, "setting": setting, "k": k, "tau": tau, "measured_speedup": same,
            "median_speedup": median, "min_speedup": lo, "max_speedup": hi, "forecast_speedup": forecast_,
            "error": None if forecast_ is None or not same else forecast_ / same - 1,
            "held_out_speedup": held, "held_out_error": None if held is None or not same else held / same - 1,
            "held_out_error_vs_median": None if held is None or not median else held / median - 1,
            "note": note}


def _slot_rows(file: str, target: str, profiles: dict, name: str, slots: int, m: dict, model: str) -> list[dict]:
    """A llama.cpp mode at ``slots`` slots against its forecast: the busy measurement (every slot decoding to the
    end, decode time alone) where the file has one; the wall clock of P clients (prefill and the idle slots of the
    tail in it) judged only where it has not, and reported beside the busy row where it has."""
    from .llama_cpp_modes import mode_of

    mode, busy = mode_of(name), m.get("busy")
    out = []
    for what, r in (("busy", busy), ("wall clock", m)) if busy else (("wall clock", m),):
        setting = f"{name} at {slots} slots" + (", busy" if what == "busy" else "")
        measured = (r["speedup_median"], r["speedup_median"], r["speedup_min"], r["speedup_max"])
        if mode is None or mode.p_min is not None or not r.get("drafted"):
            out.append({**_row(file, target, setting, None, None, measured, None,
                               note="not forecast: no fixed chain (n-gram lookup or p-min)"), "slots": slots})
            continue
        if busy and what == "wall clock":
            out.append({**_row(file, target, setting, mode.k, None, measured, None,
                               note="not forecast: wall clock of P clients, prefill and idle slots in it (the busy "
                                    "row is the forecast's)"), "slots": slots})
            continue
        rounds = r["drafted"] / mode.k  # p-min 0: every round drafts k
        tau = (r["accepted"] + rounds) / rounds
        p = profiles[target + mode.name.split(f"-k{mode.k}", 1)[1].replace("-", ":")]
        priced = price(p, mode.k, p.drafting, model, slots)
        row = {**_row(file, p.name, setting, mode.k, tau, measured, tau * priced["ar_ms"] / priced["round_ms"],
                      note="τ as accepted/drafted at these slots; measured: " + (
                          "decode time, every slot busy" if what == "busy" else
                          "wall clock, prefill and idle slots in it")), "slots": slots}
        if p.slot_ms and slots > 1:  # the pricing without plain decoding measured at P, beside it
            old = price(replace(p, slot_ms={}), mode.k, p.drafting, model, slots)
            row["assumed_width_speedup"] = tau * old["ar_ms"] / old["round_ms"]
            row["assumed_width_error"] = row["assumed_width_speedup"] / measured[0] - 1 if measured[0] else None
        out.append(row)
    return out


def check_rows(record: dict, file: str, model: str = "line") -> list[dict]:
    """Each measured setting of a result file beside its forecast from the α (or τ) and costs the same file
    records: ``forecast_speedup`` priced with every cost the file has (the setting's own round included),
    ``held_out_speedup`` from the other chain lengths of the same profile alone (and, in our loop, the α of the
    deepest other chain); ``error`` = forecast / measured − 1, measured in the pass the costs come from."""
    rows = []
    if isinstance(record.get("targets"), dict):  # llama.cpp: τ per mode (no α by depth), costs pooled over repeats
        from .llama_cpp_modes import mode_of
        profiles = _llama_cpp_profiles(record, file, None)
        for target, t in record["targets"].items():
            for name, m in t["modes"].items():
                mode, measured = mode_of(name), (m["speedup_median"], m["speedup_median"], m["speedup_min"],
                                                 m["speedup_max"])
                if name == "plain":
                    continue
                if mode is None or mode.p_min is not None:
                    why = ("n-gram lookup, drafts of several lengths" if mode is None
                           else "p-min cuts drafts: rounds of several lengths")
                    rows.append(_row(file, target, name, None, m["tau"], measured, None, note=f"not forecast: {why}"))
                    continue
                suffix = name.split(f"-k{mode.k}", 1)[1].replace("-", ":")
                p = profiles[target + suffix]
                own = m["tau"] * p.ar_ms / price(p, mode.k, p.drafting, model)["round_ms"]
                others = held_out(p, mode.k)
                held = (m["tau"] * p.ar_ms / price(others, mode.k, others.drafting, model)["round_ms"]
                        if others.round_ms else None)
                bare = m["tau"] * p.ar_ms / price(replace(p, round_ms={}), mode.k, p.drafting, model)["round_ms"]
                row = _row(file, p.name, name, mode.k, m["tau"], measured, own, held,
                           "" if held else "only chain length of its draft variant")
                rows.append({**row, "no_overhead_error": bare / measured[0] - 1})  # the round's overhead left out
            for slots, modes in (t.get("parallel") or {}).items():  # P slots, all busy: τ as measured at P
                for name, m in modes.items():
                    if name == "plain":
                        continue
                    rows.extend(_slot_rows(file, target, profiles, name, int(slots), m, model))
        return rows
    for group, ar, settings, measured in _groups(record):
        chains = {_fixed_chain(s, r): r for s, r in settings.items() if _fixed_chain(s, r) and r.get("round_ms")}
        p = _loop_profile(record, file, group, ar, settings, None) if chains else None
        ar_ms = ar.get("decode_ms_per_token") or 0.0
        for s, r in settings.items():
            alpha = measured_alpha(r.get("alpha") or [])
            if not alpha or r.get("round_ms") is None:
                continue
            k, tau = _fixed_chain(s, r), expected_tau(alpha, len(alpha))
            if k is None or p is None:  # a tree or cut chain: its own round's costs
                cut = (r.get("mean_drafted_depth") or len(alpha)) < len(alpha) - 1e-9 and r.get("accept_histogram")
                if cut:  # α pools the rounds that drafted each depth: its product overstates τ of cut rounds
                    hist = r["accept_histogram"]
                    tau = 1 + sum(i * h for i, h in enumerate(hist)) / sum(hist)
                own = tau * ar_ms / sum(r["round_ms"].values())
                rows.append(_row(file, group, s, None, tau, measured[s], own, note="its own round" + (
                    "; tau from its accept lengths (cut rounds)" if cut else "")))
                continue
            own = expected_tau(alpha, k) * p.ar_ms / price(p, k, p.drafting, model)["round_ms"]
            deeper = [c for j, c in chains.items() if j != k and len(measured_alpha(c["alpha"])) >= k]
            held, note = None, "no other chain as deep"
            if deeper:
                others = held_out(p, k)
                source = max(deeper, key=lambda c: len(measured_alpha(c["alpha"])))
                held = (expected_tau(measured_alpha(source["alpha"]), k) * p.ar_ms /
                        price(others, k, others.drafting, model)["round_ms"])
                note = f"held out: {others.drafting} drafting"
            rows.append(_row(file, group, s, k, expected_tau(alpha, k), measured[s], own, held, note))
    if not rows:
        raise SpectrainError(f"{file} holds no measured setting with α and in-loop costs to check")
    return rows


# ------------------------------------------------------------------------------------------------ the command


def forecast_table(result: dict, title: str) -> str:
    """The forecast's rows as a printed table."""
    return format_table(
        ["drafting", "k", "E[tau]", "forward ms", "draft ms", "overhead ms", "round ms", "break-even tau",
         "ceiling", "speedup"],
        [[r["drafting"], r["k"], r["expected_tau"], f"{r['forward_ms']:.2f}", f"{r['draft_ms']:.2f}",
          f"{r['overhead_ms']:.2f}", f"{r['round_ms']:.2f}", r["break_even_tau"], f"{r['ceiling_speedup']:.3f}x",
          f"{r['expected_speedup']:.3f}x" + (" *" if r is result["best"] else "")] for r in result["rows"]],
        title=title)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="spectrain-plan", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("acceptance", help="the drafter's measured α by depth: an eval.json (spectrain-eval), or a "
                                      "repeat_eval.py / draft_heads.py result")
    p.add_argument("--setting", default=None, help="which setting's α (default: the file's first fixed chain)")
    p.add_argument("--costs", default=None, help="the engine's costs: an eval.json or our loop's speed file, a "
                                                 "llama_cpp_speed.py result with forward costs, or a cost profile "
                                                 "JSON (default: the acceptance file's own, our loop)")
    p.add_argument("--profile", default=None, help="which profile of --costs (llama.cpp: TARGET[:DRAFT_DTYPE][:tN])")
    p.add_argument("--engine", default=None, help=f"the engine the costs must be from: {', '.join(ENGINES)}")
    p.add_argument("--drafting", default="auto", choices=("auto", *DRAFTING),
                   help="how the measured drafter drafted (auto: inferred from several chain lengths, else sequential)")
    p.add_argument("--max_k", type=int, default=None, help="longest chain to forecast (default: α's measured depth)")
    p.add_argument("--forward", default="line", choices=FORWARD_MODELS,
                   help="forwards over 2+ tokens: their least-squares line (default) or the measured points")
    p.add_argument("--slots", type=int, default=1, help="sequences decoded together (llama-server's -np with every "
                                                        "slot busy): speedup over plain decoding at as many slots")
    p.add_argument("--out", default="runs/plan/forecast.json")
    return p.parse_args(argv)


def _pick(choices: dict, name: str | None, what: str, source: str, default: str | None = None):
    if name is None:
        name = default if default in choices else next(iter(choices))
    if name not in choices:
        raise SpectrainError(f"{source} has no {what} {name!r}; it has: {', '.join(choices)}")
    return name, choices[name]


def run(args: argparse.Namespace, command: str) -> Path:
    """Read the acceptance and the costs, forecast, print the table, write the JSON (its path the last line)."""
    if args.engine is not None and args.engine not in ENGINES:
        raise SpectrainError(f"unknown engine {args.engine!r}: one of {', '.join(ENGINES)}")
    if args.max_k is not None and args.max_k < 1:
        raise SpectrainError(f"--max_k must be >= 1, got {args.max_k}")
    if args.slots < 1:
        raise SpectrainError(f"--slots must be >= 1, got {args.slots}")
    accepted = acceptance_of(read_json(args.acceptance, "acceptance file"), args.acceptance)
    chains = [s for s, a in accepted.items() if _fixed_chain(a["setting"], {}) is not None]
    setting, acc = _pick(accepted, args.setting, "setting with α", args.acceptance, (chains or [None])[0])
    costs_file = args.costs or args.acceptance
    drafting = None if args.drafting == "auto" else args.drafting
    profiles = profiles_of(read_json(costs_file, "costs file"), costs_file, drafting)
    same_file = args.costs is None or Path(args.costs).resolve() == Path(args.acceptance).resolve()
    if same_file and args.profile is None and acc["group"] not in profiles:
        raise SpectrainError(f"{costs_file} has no fixed chain of {acc['group']} with in-loop costs: name another "
                             f"drafter's costs with --profile ({', '.join(profiles)}) or give --costs")
    name, profile = _pick(profiles, args.profile, "cost profile", costs_file, acc["group"] if same_file else None)
    if args.engine and profile.engine != args.engine:
        raise SpectrainError(VLLM_UNMEASURED if args.engine == "vllm" else
                             f"{costs_file} holds {profile.engine} costs, not {args.engine}")
    result = forecast(acc["alpha"], profile, args.max_k, args.forward, args.slots)
    others = [p for p in profiles if p != name]
    if others:
        result["notes"].append(f"other profiles in {costs_file}: {', '.join(others)} (--profile)")
    summary = {"command": command, "date": time.strftime("%Y-%m-%d"),
               "acceptance": {"file": args.acceptance, "setting": setting, "alpha": acc["alpha"],
                              "tau_measured": acc["tau"]},
               "costs": costs_file, "forward_model": args.forward, "profile": profile.to_dict(), **result}
    title = (f"{profile.engine} ({profile.name}; {profile.cpu}; {profile.dtype or 'dtype not recorded'}), "
             f"alpha of {setting} in {args.acceptance}; AR {profile.ar_ms:.2f} ms/token"
             + (f"; {args.slots} slots (AR step {result['rows'][0]['ar_ms']:.2f} ms)" if args.slots > 1 else ""))
    lines = [result["verdict"], *(f"note: {n}" for n in result["notes"])]
    return finish(summary, args.out, [forecast_table(result, title), "\n".join(lines)])


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    run_command(run, parse_args(argv), shlex.join(["spectrain-plan", *argv]))


if __name__ == "__main__":
    main()
