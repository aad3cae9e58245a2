"""Ship a trained drafter under ``pretrained/``: bf16 weights in a serving layout, a model card, the recipe.

    python benchmarks/ship_drafter.py RUN_DIR --name NAME --format speculators \\
        --verifier_name HuggingFaceTB/SmolLM2-135M-Instruct --data "..." --command "train_eagle ..." \\
        [--eval EVAL_JSON ...] [--out pretrained] [--force]
    python benchmarks/ship_drafter.py pretrained/NAME --refresh [--eval RESULTS_JSON --results_row ROW] \\
        [--speed DRAFT_HEADS_JSON] [--llama_cpp_check CHECK_JSON --llama_cpp_speed SPEED_JSON]

writes ``pretrained/NAME/``: the weights in ``--format`` (a serving layout of the drafter's family that both
spectrain and the serving engine load: ``spectrain-export --help`` lists them), ``card.json`` (the facts a test
and a reader need: verifier, data, tokens, steps, measured tau, the training command), ``README.md`` (the card for
people), ``train_config.yaml`` (the run's resolved recipe) and, where the drafter's family writes a llama.cpp file
for it, the q8_0 GGUF llama.cpp serves (``NAME-q8_0.gguf``, exactly what ``spectrain-export --format gguf
--dtype q8_0`` writes; a drafter llama.cpp cannot serve as trained gets the reason on its card instead). The
directory is built beside the target and renamed into place (``heads.io.atomic_dir``); an existing one is kept
unless ``--force``. Prints a table and the card's path last.

The card itself (its facts from committed files, README.md rendered from card.json, ``--refresh``) is
``spectrain.eval.model_card``'s (tested); this script ships a run.
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

import torch

from spectrain.eval.model_card import (card_text, eval_rows, fmt, llama_cpp_facts, refresh_card, ship_gguf,
                                       speed_facts)
from spectrain.heads.errors import SpectrainError, run_command
from spectrain.heads.serving.formats import FORMATS, check_format_for, export_drafter, import_drafter, method_of, weights_file
from spectrain.heads.io import atomic_dir, read_json, write_json
from spectrain.heads.report import finish, format_table


def main_(args) -> Path:
    """Ship ``args.run_dir`` as ``args.out/args.name`` (or ``--refresh`` a shipped card)."""
    if args.refresh:
        return refresh_card(Path(args.run_dir), args.eval, args.results_row, args.speed, args.reach,
                            args.llama_cpp_check, args.llama_cpp_speed)
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
        if args.llama_cpp_check or args.llama_cpp_speed:
            card["llama_cpp"] = llama_cpp_facts(args.llama_cpp_check, args.llama_cpp_speed, args.name)
        if args.speed:
            card["speed"] = [speed_facts(path, target) for path in args.speed]
        gguf = ship_gguf(tmp, card)
        if gguf is not None:
            card["gguf"] = gguf
        write_json(tmp / "card.json", card)
        (tmp / "README.md").write_text(card_text(card, tmp))
    table = format_table(["", "value"], [["drafter", target], ["format", args.format],
                                         ["size MB", f"{card['size_mb']:.1f}"], ["tokens", card["trained_tokens"]],
                                         ["tau measured", fmt(card["tau_measured"])]], title="shipped")
    return finish(card, target / "card.json", [table])


def parse_args(argv=None) -> argparse.Namespace:
    """The flags; shipping (not ``--refresh``) requires --name, --format, --verifier_name, --data, --command."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("run_dir")
    p.add_argument("--refresh", action="store_true",
                   help="RUN_DIR is a shipped drafter (pretrained/NAME): re-render its card, add --llama_cpp_* figures")
    p.add_argument("--speed", action="append", default=[],
                   help="a committed draft_heads.py --repeats 3 --interleave JSON timing this drafter (repeat: one "
                        "per CPU class, each rendered as its own table)")
    p.add_argument("--reach", default=None, metavar="PRETRAINED_DIR",
                   help="--refresh: say what this card's learning curve would need to reach that card's tau")
    p.add_argument("--llama_cpp_check", default=None, help="a committed llama_cpp_check.py JSON (cards of drafters "
                                                            "llama.cpp serves)")
    p.add_argument("--llama_cpp_speed", default=None, help="a committed llama_cpp_speed.py JSON (cards of drafters "
                                                            "llama.cpp serves)")
    p.add_argument("--name")
    p.add_argument("--format", help=f"serving layout, one of the drafter family's: {', '.join(FORMATS)}")
    p.add_argument("--verifier_name", help="the verifier's hub id written into the export")
    p.add_argument("--verifier_note", default="", help="how the training verifier relates to the hub model")
    p.add_argument("--data", help="what it was trained on, in words")
    p.add_argument("--command", help="the command that trained it")
    p.add_argument("--measured_on", default="16 held-out prompts, chain 5, T = 0, 64 new tokens",
                   help="what the run's measured tau was measured on")
    p.add_argument("--machine", default="2 CPU cores", help="where it trained, in words")
    p.add_argument("--speculative_tokens", type=int, default=None)
    p.add_argument("--eval", nargs="*", default=[], help="spectrain-eval / spectrain-results JSONs to quote in the card")
    p.add_argument("--results_row", default=None, help="this drafter's row name in a spectrain-results JSON")
    p.add_argument("--out", default="pretrained")
    p.add_argument("--force", action="store_true")
    args = p.parse_args(argv)
    missing = [f"--{k}" for k in ("name", "format", "verifier_name", "data", "command") if getattr(args, k) is None]
    if missing and not args.refresh:
        p.error(f"the following arguments are required: {', '.join(missing)}")
    return args


def main(argv: list[str] | None = None) -> Path:
    return run_command(main_, parse_args(argv))


if __name__ == "__main__":
    main()
