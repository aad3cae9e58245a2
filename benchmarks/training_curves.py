"""Learning curves and sweep tables from finished training runs.

Every ``train_medusa`` / ``train_eagle`` run's ``summary.json`` holds its learning curve: one entry per validation
with the tokens trained, predicted tau, the drafter's per-step top-1 agreement with the verifier and — with
``--model.measure_prompts N`` — tau measured by the lossless speculative loop. This script puts runs side by side:

    python benchmarks/training_curves.py NAME=RUN_DIR [NAME=RUN_DIR ...] [--png curves.png] [--json out.json]
        [--budget TOKENS]

prints one row per run (at ``--budget`` trained tokens — the last validation at or before it — or at the end),
writes the JSON (its path is the last line printed) and, with ``--png``, plots measured tau (or predicted tau
where none was measured) against tokens trained.
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


def point_at(curve: list[dict], budget: int | None) -> dict:
    """The last validation at or before ``budget`` trained tokens (the last one without a budget)."""
    if budget is None:
        return curve[-1]
    before = [c for c in curve if c["trained_tokens"] <= budget]
    if not before:
        raise SpectrainError(f"no validation at or before {budget} trained tokens (first at {curve[0]['trained_tokens']})")
    return before[-1]


def main_(args) -> Path:
    runs = dict(load_run(spec) for spec in args.runs)
    rows, table = [], []
    for name, s in runs.items():
        p = point_at(s["curve"], args.budget)
        row = {"run": name, "method": s["method"], "data": s["data"], "step": p["step"],
               "trained_tokens": p["trained_tokens"], "tau_pred": p.get("tau_pred"),
               "tau_measured": p.get("tau_measured"), "alpha1_measured": p.get("alpha1_measured"),
               "step1_top1": p.get("step1_top1_ver", p.get("head1_top1_ver")),
               "tokens_per_second": s.get("train_tokens_per_second"), "curve": s["curve"]}
        rows.append(row)
        fmt = lambda v: "-" if v is None else f"{v:.3f}"  # noqa: E731
        table.append([name, s["method"], row["step"], row["trained_tokens"], fmt(row["step1_top1"]),
                      fmt(row["tau_pred"]), fmt(row["tau_measured"]), row["tokens_per_second"]])
    tables = [format_table(["run", "method", "step", "tokens", "step-1 top-1", "tau pred", "tau measured", "tok/s"],
                           table, title="training runs" + (f" at <= {args.budget} tokens" if args.budget else ""))]
    if args.png:
        plot(rows, Path(args.png))
    out = Path(args.json) if args.json else Path("runs/training_curves.json")
    return finish({"command": "python benchmarks/training_curves.py " + " ".join(sys.argv[1:]), "budget": args.budget,
                   "runs": rows, "png": args.png}, out, tables)


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2))
    for row in rows:
        measured = all("tau_measured" in c for c in row["curve"])
        key = "tau_measured" if measured else "tau_pred"
        ax.plot([c["trained_tokens"] / 1e6 for c in row["curve"]], [c[key] for c in row["curve"]], marker="o",
                ms=3, label=f"{row['run']} ({'measured' if measured else 'predicted'})")
    ax.set_xlabel("tokens trained (millions)")
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
    p.add_argument("--png", default=None, help="write the learning curves here")
    p.add_argument("--json", default=None, help="summary JSON (default runs/training_curves.json)")
    return p.parse_args(argv)


if __name__ == "__main__":
    run_command(main_, parse_args())
