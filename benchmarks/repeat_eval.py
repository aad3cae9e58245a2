"""One ``spectrain-eval`` command run several times in a row, as a user who runs it again would (benchmark, not a
test): each run decodes AR and its drafter settings on the same prompts (its speedups are over its own AR); the
figure a page quotes is the median over the runs with its min and max, with the CPU named::

    python benchmarks/repeat_eval.py --repeats 3 --out docs/results/quickstart_eagle3_avx2.json -- \\
        --method eagle --drafter runs/eagle3-bundled-tinyshakespeare-tinyshakespeare --k 4

Everything after ``--`` is ``spectrain-eval``'s own flags (each run writes its ``eval.json`` under ``RUN_OUT/runN``
where ``--out RUN_OUT`` is given there, else under ``runs/repeat_eval/NAME/runN`` for ``--out …/NAME.json``, so the
runs' plots never land beside a committed summary; each records the command with its own ``--out``). Writes one JSON (its path is the last line
printed): ``command``, ``date``, ``cpu``, ``repeats``, ``settings`` (per setting: ``tau`` and identity of each run
— the same at T = 0 —, ``speedup`` median / min / max and each run's, AR tokens/s of each run) and ``runs`` (each
run's ``eval.json`` path and its summary rows).
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from pathlib import Path

from spectrain.eval.cli import evaluate, parse_args as eval_args
from spectrain.eval.decode_dtype import cpu_line, cpu_record
from spectrain.eval.repeats import summarize_runs
from spectrain.heads.errors import SpectrainError, run_command
from spectrain.heads.report import finish, format_table


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    """(this script's flags, spectrain-eval's: everything after ``--``); ``--help`` before any ``--`` prints help."""
    split = argv.index("--") if "--" in argv else len(argv)
    if split == len(argv) and not {"-h", "--help"} & set(argv):
        raise SpectrainError("usage: repeat_eval.py [--repeats N] [--out FILE] -- SPECTRAIN-EVAL FLAGS")
    p = argparse.ArgumentParser(prog="repeat_eval.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", default="runs/repeat_eval/repeat_eval.json")
    args = p.parse_args(argv[:split])
    if args.repeats < 1:
        raise SpectrainError(f"--repeats must be >= 1, got {args.repeats}")
    return args, argv[split + 1:]


def run(args: argparse.Namespace, eval_argv: list[str], command: str) -> Path:
    base = Path("runs") / "repeat_eval" / Path(args.out).stem
    evals, paths = [], []
    given = eval_args(eval_argv).out
    for i in range(args.repeats):
        run_out = str(Path(given or base) / f"run{i + 1}")
        argv_i = [*eval_argv, "--out", run_out]  # argparse: the last --out wins
        path = evaluate(eval_args(argv_i), shlex.join(["spectrain-eval", *argv_i]))
        paths.append(str(path))
        evals.append(json.loads(Path(path).read_text()))
    settings = summarize_runs(evals)
    cpu = cpu_record()
    summary = {"command": command, "date": time.strftime("%Y-%m-%d"), "cpu": cpu, "repeats": args.repeats,
               "eval_command": shlex.join(["spectrain-eval", *eval_argv]), "dtype": evals[0].get("dtype"),
               "dtype_choice": evals[0].get("dtype_choice"), "settings": settings,
               "runs": [{"eval_json": p, "results": e["results"]} for p, e in zip(paths, evals)]}
    table = format_table(["setting", "tau", "same as AR", "speedup over AR", "min", "max", "each run",
                          "over HF generate() (min-max)"],
                         [[name, " ".join(sorted({f"{v:.3f}" for v in s["tau"]})),
                           "n/a" if None in s["identical_to_ar"] else f"{sum(s['identical_to_ar'])}/{args.repeats} runs",
                           f"{s['speedup']:.3f}", f"{s['speedup_min']:.3f}", f"{s['speedup_max']:.3f}",
                           " ".join(f"{v:.3f}" for v in s["speedup_runs"]),
                           f"{s['speedup_over_hf']:.3f} ({s['speedup_over_hf_min']:.3f}-{s['speedup_over_hf_max']:.3f})"
                           if "speedup_over_hf" in s else "not timed"] for name, s in settings.items()],
                         title=f"{args.repeats} runs of {summary['eval_command']} ({summary['dtype']}, {cpu_line(cpu)})")
    return finish(summary, args.out, tables=[table])


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    command = shlex.join(["python", "benchmarks/repeat_eval.py", *argv])
    args, eval_argv = run_command(parse_args, argv)
    run_command(run, args, eval_argv, command)


if __name__ == "__main__":
    main()
