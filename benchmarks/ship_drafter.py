"""Ship a trained drafter under ``pretrained/``: bf16 weights in a serving layout, a model card, the recipe.

    python benchmarks/ship_drafter.py RUN_DIR --name NAME --format speculators \\
        --verifier_name HuggingFaceTB/SmolLM2-135M-Instruct --data "..." --command "train_eagle ..." \\
        [--eval EVAL_JSON ...] [--out pretrained] [--force]

writes ``pretrained/NAME/``: the weights in ``--format`` (a layout both spectrain and the serving engine load:
``speculators`` / ``eagle3`` for EAGLE-3, ``eagle`` for EAGLE-1, ``medusa`` for Medusa), ``card.json`` (the
facts a test and a reader need: verifier, data, tokens, steps, measured tau, the training command),
``README.md`` (the card for people) and ``train_config.yaml`` (the run's resolved recipe). The directory is
built beside the target and renamed into place (``heads.io.atomic_dir``); an existing one is kept unless ``--force``. Prints a table and
the card's path last.
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

import torch

from spectrain.heads.errors import SpectrainError, run_command
from spectrain.heads.formats import check_format_for, export_drafter, import_drafter, method_of, weights_file
from spectrain.heads.io import atomic_dir, read_json, write_json
from spectrain.heads.report import finish, format_table


def eval_rows(paths: list[str], row_name: str | None) -> list[dict]:
    """One row per setting quoted in the card: every setting of each ``spectrain-eval`` JSON, or the rows named
    ``row_name`` of a ``spectrain-results`` JSON."""
    rows = []
    for path in paths:
        e = read_json(path)
        if isinstance(e, dict) and isinstance(e.get("rows"), list):  # spectrain-results
            if not row_name:
                raise SpectrainError(f"--eval {path} is a spectrain-results table: pass --results_row NAME")
            for r in e["rows"]:
                if r["drafter"] == row_name:
                    rows.append({"prompts": f"{r['set']} ({r['prompts']})", "setting": r["setting"],
                                 "temperature": r["temperature"], "dtype": e["settings"].get("dtype", "?"),
                                 "tau": round(r["tau"], 3), "alpha": [None if a is None else round(a, 3)
                                                                      for a in r["alpha"]],
                                 "command": e["command"]})
            continue
        if not isinstance(e, dict) or not isinstance(e.get("results"), dict) or "sampling" not in e:
            raise SpectrainError(f"--eval {path}: neither a spectrain-eval nor a spectrain-results JSON")
        for name, r in e["results"].items():
            if name == "ar":
                continue
            rows.append({"prompts": f"{Path(e['prompts']).name} ({e['num_prompts']})", "setting": name,
                         "temperature": e["sampling"]["temperature"], "dtype": e["dtype"],
                         "tau": round(r["tau"], 3), "alpha": [None if a is None else round(a, 3) for a in r["alpha"]],
                         "command": e["command"]})
    return rows


def fmt(value, spec: str = ".3f") -> str:
    return "n/a" if value is None else format(value, spec)


def card_text(card: dict) -> str:
    measured = "\n".join(f"| {r['prompts']} | {r['setting']} | {r['temperature']:g} | {r['dtype']} | {r['tau']:.3f} |"
                         for r in card["eval"])
    return f"""# {card['name']}

{card['method']} drafter for **{card['verifier_hub_id']}** (spectrain verifier `{card['verifier']}`), {card['dtype']},
{card['format']} layout ({card['size_mb']:.1f} MB).

- Verifier: `{card['verifier']}` — {card['verifier_note']}
- Data: {card['data']}
- Trained: {card['steps']:,} steps, {card['trained_tokens']:,} tokens, {card['train_seconds'] / 60:.0f} min of training
  ({card['precision']}, {card['machine']}); held-out τ predicted {fmt(card['tau_pred'])}, measured
  {fmt(card['tau_measured'])} ({card['measured_on']}).
- Command: `{card['command']}` (recipe: `train_config.yaml`; data steps: docs/smollm2.md).

## Use

```bash
spectrain-eval --verifier {card['verifier']} --method {'medusa' if card['method'] == 'medusa' else 'eagle'} \\
    --drafter pretrained/{card['name']} --prompts PROMPTS.jsonl --num_prompts 8
```

## Measured (spectrain's lossless loop, T = 0 unless stated)

| prompts | setting | T | dtype | τ |
|---|---|---|---|---|
{measured or '| – | – | – | – | – |'}
"""


def main_(args) -> Path:
    run_dir = Path(args.run_dir)
    summary_path = run_dir / "summary.json"
    if not summary_path.is_file():
        raise SpectrainError(f"{run_dir}: no summary.json (not a finished training run)")
    summary = read_json(summary_path)
    if Path(args.name).name != args.name or args.name in ("", ".", ".."):
        raise SpectrainError(f"--name must be one directory name, got {args.name!r}")
    if not (run_dir / "config.yaml").is_file():
        raise SpectrainError(f"{run_dir}: no config.yaml (not a train_medusa / train_eagle run directory)")
    target = Path(args.out) / args.name
    if target.exists() and not args.force:
        raise SpectrainError(f"{target} exists; pass --force to replace it")
    import yaml

    config = yaml.safe_load((run_dir / "config.yaml").read_text()) or {}
    drafter = import_drafter(run_dir)
    check_format_for(drafter, args.format)
    with atomic_dir(target, force=args.force) as tmp:
        # The export replaces the (empty) staging directory in place; the card files join it there.
        export_drafter(drafter, args.format, tmp, verifier_name=args.verifier_name, force=True,
                       dtype=torch.bfloat16, speculative_tokens=args.speculative_tokens)
        shutil.copy(run_dir / "config.yaml", tmp / "train_config.yaml")
        card = {"name": args.name, "method": method_of(drafter), "format": args.format, "dtype": "bfloat16",
                "verifier": summary["verifier"], "verifier_hub_id": args.verifier_name,
                "verifier_note": args.verifier_note, "data": args.data,
                "precision": (config.get("trainer") or {}).get("precision"), "machine": args.machine,
                "steps": summary["steps"], "trained_tokens": summary["trained_tokens"],
                "train_seconds": summary.get("train_seconds") or summary["fit_seconds"],
                "tau_pred": summary["tau_pred"], "tau_measured": summary.get("tau_measured"),
                "measured_on": args.measured_on, "curve": summary.get("curve"),
                "command": args.command, "eval": eval_rows(args.eval, args.results_row),
                "size_mb": (tmp / weights_file(args.format)).stat().st_size / 2 ** 20}
        write_json(tmp / "card.json", card)
        (tmp / "README.md").write_text(card_text(card))
    table = format_table(["", "value"], [["drafter", target], ["format", args.format],
                                         ["size MB", f"{card['size_mb']:.1f}"], ["tokens", card["trained_tokens"]],
                                         ["tau measured", fmt(card["tau_measured"])]], title="shipped")
    return finish(card, target / "card.json", [table])


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("run_dir")
    p.add_argument("--name", required=True)
    p.add_argument("--format", required=True, help="serving layout: speculators, eagle3, eagle, medusa, ...")
    p.add_argument("--verifier_name", required=True, help="the verifier's hub id written into the export")
    p.add_argument("--verifier_note", default="", help="how the training verifier relates to the hub model")
    p.add_argument("--data", required=True, help="what it was trained on, in words")
    p.add_argument("--command", required=True, help="the command that trained it")
    p.add_argument("--measured_on", default="16 held-out prompts, chain 5, T = 0, 64 new tokens",
                   help="what the run's measured tau was measured on")
    p.add_argument("--machine", default="2 CPU cores", help="where it trained, in words")
    p.add_argument("--speculative_tokens", type=int, default=None)
    p.add_argument("--eval", nargs="*", default=[], help="spectrain-eval / spectrain-results JSONs to quote in the card")
    p.add_argument("--results_row", default=None, help="this drafter's row name in a spectrain-results JSON")
    p.add_argument("--out", default="pretrained")
    p.add_argument("--force", action="store_true")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> Path:
    return run_command(main_, parse_args(argv))


if __name__ == "__main__":
    main()
