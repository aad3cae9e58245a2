"""``spectrain-plan``'s forecast checked against what was measured (benchmark, not a test): for every setting of
the committed llama.cpp rounds file and of our loop's repeated speed files, the speedup forecast from the α (or,
in llama.cpp, τ) and the costs the same file records, beside the measured one::

    python benchmarks/forecast_check.py --out docs/results/forecast_check.json

Per setting (``spectrain.eval.forecast.check_rows``): ``forecast_speedup`` prices the round with every cost the
file has (the setting's own round included: it checks the formula, the readers and the α → τ step);
``held_out_speedup`` prices it from the profile's other chain lengths alone (their draft per step or per
forward, their overhead interpolated, llama-bench's forwards or our loop's other verify passes), the real forecast
(in our loop with the α of the deepest other chain); ``held_out_points_*`` the same with the forwards as measured
(``--forward points``) rather than their line. Errors are forecast / measured − 1, measured in the pass the costs
come from (llama.cpp: costs pooled over the repeats, against the median over them). llama.cpp's parallel slots
(``--parallel``: P sequences per forward) are forecast from τ as measured at P slots and the one-slot costs
with the AR step at P as plain decoding measured there (``--parallel``'s busy rows), the round paying what P
busy slots add beyond llama-bench's forward, and the draft × forward(P) / forward(1); each such row also gives
the older pricing's forecast (everything × forward(P) / forward(1): ``assumed_width_*``). They are summarized
apart: ``parallel_slots_busy`` (every slot decoding, decode time: what the price models) and ``parallel_slots``
(a file's wall clock of P clients, plain decoding at P unmeasured, so priced × forward(P) / forward(1)). Writes
one JSON (its path the last line printed): ``command``, ``date``, ``tolerance``, ``files``, ``rows``,
``summary``.
"""

from __future__ import annotations

import argparse
import shlex
import sys
import time
from pathlib import Path

from spectrain.eval.forecast import check_rows
from spectrain.heads.errors import run_command
from spectrain.heads.io import read_json
from spectrain.heads.report import finish, format_table

FILES = ("llama_cpp_rounds_smollm2", "llama_cpp_slots_busy_smollm2", "llama_cpp_slots_busy_f32_smollm2",
         "quickstart_eagle3_amx", "quickstart_eagle3_avx2", "quickstart_eagle3_avx512", "speed_avx2", "speed_bf16",
         "draft_heads_eagle1_amx", "draft_heads_eagle1_avx2", "short_chains", "short_chains_rerun")


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="forecast_check.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--results", default="docs/results", help="the folder of the result files")
    p.add_argument("--files", default=",".join(FILES), help="result files (names without .json) to check")
    p.add_argument("--tolerance", type=float, default=0.10, help="|forecast / measured - 1| a setting must keep")
    p.add_argument("--out", default="runs/bench/forecast_check.json")
    return p.parse_args(argv)


def pct(v: float | None) -> str:
    return "-" if v is None else f"{100 * v:+.1f} %"


def num(v: float | None) -> str:
    return "-" if v is None else f"{v:.3f}"


def check(args: argparse.Namespace, command: str) -> Path:
    rows = []
    for name in [f for f in args.files.split(",") if f]:
        record = read_json(Path(args.results) / f"{name}.json", "result file")
        points = check_rows(record, name, "points")
        for row, alt in zip(check_rows(record, name, "line"), points):
            rows.append({**row, "held_out_points_speedup": alt["held_out_speedup"],
                         "held_out_points_error": alt["held_out_error"]})
    forecast = [r for r in rows if r["error"] is not None and "slots" not in r]
    slotted = [r for r in rows if r["error"] is not None and "slots" in r]  # llama.cpp's parallel slots
    busy = [r for r in slotted if r["setting"].endswith(", busy")]  # every slot decoding: what the price models
    wall = [r for r in slotted if not r["setting"].endswith(", busy")]  # files without a busy measurement
    held = [r for r in rows if r["held_out_error"] is not None]
    within = lambda rs, key: sum(abs(r[key]) <= args.tolerance for r in rs)  # noqa: E731
    summary = {"forecast": {"settings": len(forecast), "within_tolerance": within(forecast, "error"),
                            "max_abs_error": max(abs(r["error"]) for r in forecast)},
               "held_out": {"settings": len(held), "within_tolerance": within(held, "held_out_error"),
                            "max_abs_error": max(abs(r["held_out_error"]) for r in held),
                            "misses": [f"{r['file']} {r['profile']} {r['setting']}" for r in held
                                       if abs(r["held_out_error"]) > args.tolerance]},
               "held_out_points": {"within_tolerance": within(held, "held_out_points_error"),
                                   "max_abs_error": max(abs(r["held_out_points_error"]) for r in held)},
               "no_overhead": {"min_error": min(bare := [r["no_overhead_error"] for r in rows
                                                          if r.get("no_overhead_error") is not None]),
                               "max_error": max(bare)},
               "parallel_slots": {"settings": len(wall), "within_tolerance": within(wall, "error"),
                                  "measured": "wall clock of P clients (prefill and idle slots in it), plain "
                                              "decoding at P not measured: the AR step and overhead × forward(P) / "
                                              "forward(1)",
                                  "errors": {f"{r['file']} {r['profile']} {r['setting']}": r["error"] for r in wall}},
               "parallel_slots_busy": {"settings": len(busy), "within_tolerance": within(busy, "error"),
                                       "max_abs_error": max((abs(r["error"]) for r in busy), default=None),
                                       "several_slots": len(multi := [r for r in busy if r["slots"] > 1]),
                                       "several_slots_within_tolerance": within(multi, "error"),
                                       "several_slots_assumed_width_within_tolerance": within(
                                           multi, "assumed_width_error"),
                                       "assumed_width_errors": {f"{r['file']} {r['profile']} {r['setting']}":
                                                                r["assumed_width_error"] for r in multi},
                                       "measured": "decode time with every slot busy; plain decoding at P measured",
                                       "errors": {f"{r['file']} {r['profile']} {r['setting']}": r["error"]
                                                  for r in busy}},
               "not_forecast": len(rows) - len(forecast) - len(slotted),
               "per_file": {f: {"settings": len(fr := [r for r in forecast if r["file"] == f]),
                                "max_abs_error": max((abs(r["error"]) for r in fr), default=None),
                                "held_out": len(hr := [r for r in held if r["file"] == f]),
                                "held_out_max_abs_error": max((abs(r["held_out_error"]) for r in hr), default=None)}
                            for f in dict.fromkeys(r["file"] for r in rows)}}
    table = format_table(
        ["file", "profile", "setting", "tau", "measured", "median (min-max)", "forecast", "error", "held out",
         "error", "points", "note"],
        [[r["file"], r["profile"], r["setting"], num(r["tau"]), num(r["measured_speedup"]),
          "-" if r["min_speedup"] is None else
          f"{num(r['median_speedup'])} ({num(r['min_speedup'])}-{num(r['max_speedup'])})",
          num(r["forecast_speedup"]), pct(r["error"]), num(r["held_out_speedup"]), pct(r["held_out_error"]),
          pct(r["held_out_points_error"]), r["note"]] for r in rows],
        title="forecast vs measured speedup, per setting")
    lines = [f"forecast from the file's own costs: {summary['forecast']['within_tolerance']} of "
             f"{len(forecast)} settings within {args.tolerance:.0%} (worst {summary['forecast']['max_abs_error']:.1%})",
             f"held out (from the other chain lengths): {summary['held_out']['within_tolerance']} of {len(held)} "
             f"within {args.tolerance:.0%} (worst {summary['held_out']['max_abs_error']:.1%}); forwards as measured "
             f"instead of their line: {summary['held_out_points']['within_tolerance']} of {len(held)} (worst "
             f"{summary['held_out_points']['max_abs_error']:.1%})",
             *(f"held-out miss: {m}" for m in summary["held_out"]["misses"]),
             f"parallel slots, busy (llama.cpp, every slot decoding; plain at P measured): {within(busy, 'error')} "
             f"of {len(busy)} within {args.tolerance:.0%}"
             + (f" (worst {max(abs(r['error']) for r in busy):.1%})" if busy else ""),
             f"parallel slots, wall clock (prefill and idle slots in it; plain at P not measured): "
             f"{within(wall, 'error')} of {len(wall)} within {args.tolerance:.0%}"
             + (f" (worst {max(abs(r['error']) for r in wall):.1%})" if wall else "")]
    record = {"command": command, "date": time.strftime("%Y-%m-%d"), "tolerance": args.tolerance,
              "forward_model": "line", "files": [f"{args.results}/{f}.json" for f in args.files.split(",") if f],
              "summary": summary, "rows": rows}
    return finish(record, args.out, [table, "\n".join(lines)])


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    run_command(check, parse_args(argv), "python benchmarks/forecast_check.py " + shlex.join(argv))


if __name__ == "__main__":
    main()
