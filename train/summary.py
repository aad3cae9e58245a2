"""A finished run's ``summary.json`` (written last into the run directory: its presence marks the run finished)
and the tables the console shows of it."""

from __future__ import annotations

from spectrain.heads.report import format_table


def build_summary(cli, best: str, fit_seconds: float, wall_seconds: float) -> dict:
    """The summary of a trained run: ``cli`` the ``SpectrainCLI`` that trained it (its module, data, trainer and
    run directory), ``best`` the best checkpoint's path (or empty), this invocation's fit and wall seconds."""
    model, data, trainer = cli.model, cli.datamodule, cli.trainer
    metrics = model.last_val_metrics
    headers, rows = model.summary_rows(metrics)
    verifier_report = None
    if model.verifier_name.startswith("bundled:"):
        from spectrain.data.bundled import bundled_verifier_dir

        report_path = bundled_verifier_dir(model.verifier_name.split(":", 1)[1]) / "build_report.json"
        if report_path.is_file():
            import json

            verifier_report = json.loads(report_path.read_text())
    return {
        "method": model.method_name,
        "verifier": model.verifier_name,
        "verifier_report": verifier_report,
        "data": data.data_name,
        "data_format": data.resolved_format(),
        "skipped_rows": data.skipped,
        # Rows cut at block_size: what was counted, the counts, and the warning (None at or below 5 %).
        "truncation": {**data.truncation_entry(), "warning": data.truncation_warning()},
        "target": getattr(model, "target", None),
        "steps": trainer.global_step,
        "fit_seconds": round(fit_seconds, 1),
        "wall_seconds": round(wall_seconds, 1),
        "trained_tokens": model.trained_tokens,
        "train_seconds": round(model.train_seconds, 3),
        # Over the whole run (resumes and extensions included); fit_seconds / wall_seconds are this invocation's.
        "train_tokens_per_second": round(model.trained_tokens / max(model.train_seconds or fit_seconds, 1e-9), 1),
        "best_checkpoint": best or None,
        "drafter_dir": str(cli.run_dir.resolve()),
        "tau_pred": metrics.get("tau_pred"),
        "tau_measured": metrics.get("tau_measured"),
        "curve": model.curve,
        "per_position": {"columns": headers, "rows": rows},
        "val_metrics": metrics,
    }


def summary_tables(summary: dict) -> list[str]:
    """The per-position table and the run's facts, as the console shows them above the summary's path."""
    table = summary["per_position"]
    per_head = format_table(table["columns"], table["rows"],
                            title=f"{summary['method']} on {summary['verifier']} ({summary['data']}), held-out")
    tau = summary["tau_pred"]
    facts = format_table(["", "value"], [
        ["predicted tau (joint chain)", "n/a" if tau is None else f"{tau:.3f}"],
        *([["measured tau (lossless loop, chain, T=0)", f"{summary['tau_measured']:.3f}"]]
          if summary.get("tau_measured") is not None else []),
        *([["target", summary["target"]]] if summary["target"] else []), ["steps", summary["steps"]],
        ["train tokens/s", summary["train_tokens_per_second"]], ["wall seconds", summary["wall_seconds"]],
        ["rows cut at block_size", truncation_fact(summary["truncation"])],
    ])
    warning = summary["truncation"]["warning"]
    return [per_head, facts] + ([f"warning: {warning}"] if warning else [])


def truncation_fact(entry: dict) -> str:
    """The summary table's cell for the ``truncation`` entry: the counts, or why there are none."""
    if "rows" not in entry:
        return entry["counted"].split(":")[0]  # "none (packed text)" / "not recorded (older store)"
    return (f"{entry['rows_cut']} of {entry['rows']} ({100 * entry['row_fraction']:.1f} %), {entry['loss_tokens_cut']} "
            f"of {entry['loss_tokens']} loss tokens ({100 * entry['loss_token_fraction']:.1f} %)")
