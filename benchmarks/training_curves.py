"""Learning curves and sweep tables from finished training runs.

Every ``train_medusa`` / ``train_eagle`` run's ``summary.json`` holds its learning curve: one entry per validation
with the tokens trained, predicted tau, the drafter's per-step top-1 agreement with the verifier and — with
``--model.measure_prompts N`` — tau measured by the lossless speculative loop. This script puts runs side by side:

    python benchmarks/training_curves.py NAME=RUN_DIR [NAME=RUN_DIR ...] [--png curves.png] [--json out.json]
        [--budget TOKENS | --seconds S]

prints one row per run (at ``--budget`` trained tokens or ``--seconds`` of training — the last validation at or
before it — or at the end), writes the JSON (its path is the last line printed) and, with ``--png``, plots
measured tau (or predicted tau where none was measured) against tokens trained and against training time
(validation excluded: equal wall clock for drafters of different cost).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from spectrain.heads.errors import SpectrainError, run_command
from spectrain.heads.report import finish, format_table


def load_run(spec: str) -> tuple[str, dict]:
    name, sep, path = spec.partition("=")
    if not sep or not name or not path:
        raise SpectrainError(f"runs are given as NAME=RUN_DIR, got {spec!r}")
    summary = Path(path) / "summary.json"
    if not summary.is_file():
        raise SpectrainError(f"{path}: no summary.json (not a finished training run)")
    s = json.loads(summary.read_text())
    if not s.get("curve"):
        raise SpectrainError(f"{path}: its summary has no learning curve (trained before curves were recorded)")
    return name, s


def point_at(curve: list[dict], budget: float | None, key: str = "trained_tokens", run: str = "") -> dict:
    """The last validation at or before ``budget`` of ``key`` (trained_tokens or train_seconds); the last one
    without a budget."""
    if budget is None:
        return curve[-1]
    if any(key not in c for c in curve):
        raise SpectrainError(f"run {run!r}: its curve has no {key} (trained before it was recorded)")
    before = [c for c in curve if c[key] <= budget]
    if not before:
        raise SpectrainError(f"run {run!r}: no validation at or before {budget} {key} (first at {curve[0][key]})")
    return before[-1]


def main_(args) -> Path:
    if args.budget is not None and args.seconds is not None:
        raise SpectrainError("--budget (tokens) and --seconds: pass one of them")
    budget, key = (args.seconds, "train_seconds") if args.seconds is not None else (args.budget, "trained_tokens")
    runs = dict(load_run(spec) for spec in args.runs)
    rows, table = [], []
    for name, s in runs.items():
        p = point_at(s["curve"], budget, key, name)
        row = {"run": name, "method": s["method"], "data": s["data"], "step": p["step"],
               "trained_tokens": p["trained_tokens"], "train_seconds": p.get("train_seconds"),
               "tau_pred": p.get("tau_pred"),
               "tau_measured": p.get("tau_measured"), "alpha1_measured": p.get("alpha1_measured"),
               "step1_top1": next((p[metric] for metric in ("step1_top1_ver", "head1_top1_ver", "slot1_top1_ver")
                                   if metric in p), None),
               "tokens_per_second": s.get("train_tokens_per_second"), "curve": s["curve"]}
        rows.append(row)
        fmt = lambda v: "-" if v is None else f"{v:.3f}"  # noqa: E731
        minutes = "-" if row["train_seconds"] is None else f"{row['train_seconds'] / 60:.1f}"
        table.append([name, s["method"], row["step"], row["trained_tokens"], minutes, fmt(row["step1_top1"]),
                      fmt(row["tau_pred"]), fmt(row["tau_measured"]), row["tokens_per_second"]])
    at = "" if budget is None else (f" at <= {budget} tokens" if key == "trained_tokens" else f" at <= {budget} s")
    tables = [format_table(["run", "method", "step", "tokens", "train min", "step-1 top-1", "tau pred",
                            "tau measured", "tok/s"], table, title="training runs" + at)]
    if args.png:
        plot(rows, Path(args.png))
    out = Path(args.json) if args.json else Path("runs/training_curves.json")
    return finish({"command": "python benchmarks/training_curves.py " + " ".join(sys.argv[1:]), "budget": args.budget,
                   "seconds": args.seconds,
                   "runs": rows, "png": args.png}, out, tables)


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    timed = all("train_seconds" in c for row in rows for c in row["curve"])
    fig, axes = plt.subplots(1, 2 if timed else 1, figsize=(12 if timed else 7, 4.2), squeeze=False)
    x_axes = [("trained_tokens", 1e6, "tokens trained (millions)")] + \
        ([("train_seconds", 60, "training time, validation excluded (minutes)")] if timed else [])
    for ax, (x_key, scale, label) in zip(axes[0], x_axes):
        for row in rows:
            measured = all("tau_measured" in c for c in row["curve"])
            key = "tau_measured" if measured else "tau_pred"
            ax.plot([c[x_key] / scale for c in row["curve"]], [c[key] for c in row["curve"]], marker="o",
                    ms=3, label=f"{row['run']} ({'measured' if measured else 'predicted'})")
        ax.set_xlabel(label)
        ax.set_ylabel("tau (chain, T = 0)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp.png")
    fig.savefig(tmp, dpi=120)
    tmp.replace(path)
    plt.close(fig)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("runs", nargs="+", metavar="NAME=RUN_DIR")
    p.add_argument("--budget", type=int, default=None, help="compare at this many trained tokens")
    p.add_argument("--seconds", type=float, default=None,
                   help="compare at this many seconds of training (validation excluded): equal wall clock")
    p.add_argument("--png", default=None, help="write the learning curves here")
    p.add_argument("--json", default=None, help="summary JSON (default runs/training_curves.json)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> Path:
    return run_command(main_, parse_args(argv))


if __name__ == "__main__":
    main()
