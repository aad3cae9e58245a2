"""Readable tables and the JSON-summary contract every result-producing command follows."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

from .io import write_json


def format_table(headers: Sequence[str], rows: Sequence[Sequence[Any]], title: str | None = None) -> str:
    """A plain fixed-width table (floats to 3 decimals), readable in any terminal or log."""

    def cell(v):
        return f"{v:.3f}" if isinstance(v, float) else str(v)

    cells = [[cell(v) for v in row] for row in rows]
    widths = [max(len(str(h)), *(len(r[i]) for r in cells)) if cells else len(str(h)) for i, h in enumerate(headers)]
    line = "  ".join("-" * w for w in widths)
    out = [title] if title else []
    out += ["  ".join(str(h).ljust(w) for h, w in zip(headers, widths)), line]
    out += ["  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths))) for r in cells]
    return "\n".join(out)


def median_range(values: Sequence[float], digits: int = 2) -> dict:
    """Repeated measurements as the benchmarks report them: median, min, max and every run, rounded."""
    import statistics

    return {"median": round(statistics.median(values), digits), "min": round(min(values), digits),
            "max": round(max(values), digits), "runs": [round(v, digits) for v in values]}


def finish(summary: dict, path: str | Path, tables: Sequence[str] = ()) -> Path:
    """Write the JSON summary atomically, print the tables, and print its path as the last stdout line."""
    path = write_json(path, summary)
    for table in tables:
        print(table)
        print()
    print(Path(path).resolve(), flush=True)
    return path
