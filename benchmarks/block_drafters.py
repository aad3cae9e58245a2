"""Block drafters beside the other learned drafters: τ, α by slot, drafting cost and speedup over AR, all in one
run on one verifier (benchmark, not a test).

AR decodes the prompts first (every setting's reference: speedup and the lossless check) and again at the end (the
machine's drift on record); between them each ``--drafter`` runs its chain (``--k``, or ``--k_of NAME=K``) and,
where its family grows trees, ``--dynamic_tree``; each at its default draft head (a ranked one where the drafter
has a ranking). ``--export_check NAME=FORMAT`` also exports that drafter to FORMAT, loads the export back and
decodes its chain again: the same τ and tokens are the check::

    python benchmarks/block_drafters.py --verifier bundled:smollm2 --prompts mt_bench.jsonl \\
        --drafter eagle1=pretrained/smollm2-eagle1 --drafter dflash=RUN --k_of dflash=7 \\
        [--num_prompts 16] [--k 5] [--dynamic_tree 6,4,16] [--dtype bfloat16] [--out docs/results/block_drafters.json]

``--prompts bundled:tinyshakespeare`` takes the bundled verifier's held-out text. Prints a table and writes the
JSON (its path is the last line printed): rows with ``drafter``, ``setting``, ``tau``, ``alpha``,
``draft_over_verify``, ``speedup`` (over the run's AR), ``identical_turns``.
"""

from __future__ import annotations

import argparse
import shlex
import sys
import tempfile
import time
from dataclasses import replace

import torch

from spectrain.eval.cli import named_values
from spectrain.eval.settings import parse_dynamic_tree
from spectrain.eval.evaluate import EvalSettings, evaluate_drafter, load_drafter
from spectrain.eval.families import evaluator_of
from spectrain.eval.prompts import load_prompts
from spectrain.heads.errors import SpectrainError, run_command
from spectrain.heads.families import family_of
from spectrain.heads.serving.formats import export_drafter
from spectrain.heads.report import finish, format_table
from spectrain.heads.verifier import load_verifier

DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="block_drafters.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--verifier", default="bundled:smollm2")
    p.add_argument("--drafter", action="append", required=True, metavar="NAME=PATH", help="a drafter (repeat)")
    p.add_argument("--prompts", required=True, help="MT-bench-style jsonl, or bundled:tinyshakespeare")
    p.add_argument("--num_prompts", type=int, default=16)
    p.add_argument("--k", type=int, default=5)
    p.add_argument("--k_of", action="append", default=[], metavar="NAME=K", help="another chain length for NAME")
    p.add_argument("--dynamic_tree", default="6,4,16", help="the tree of families that grow one ('' for none)")
    p.add_argument("--export_check", action="append", default=[], metavar="NAME=FORMAT")
    p.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES))
    p.add_argument("--max_new_tokens", type=int, default=128)
    p.add_argument("--out", default="runs/bench/block_drafters.json")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    run_command(run, parse_args(argv), shlex.join(["python", "benchmarks/block_drafters.py", *argv]))


def settings_from_args(args) -> EvalSettings:
    """What every call decodes with (a drafter's own chain length and its dynamic tree are set per call)."""
    return EvalSettings(k=args.k, max_new_tokens=args.max_new_tokens, hf_generate=0)


def rows_of(label: str, result, path: str) -> list[dict]:
    out = []
    for setting, r in result.results.items():
        if setting == "ar":
            continue
        out.append({"drafter": label, "path": path, "setting": setting, "draft_vocab": result.draft_vocab,
                    "tau": r["tau"], "alpha": r["alpha"], "draft_over_verify": r["draft_over_verify"],
                    "speedup": r["speedup"], "ideal_speedup": r["ideal_speedup"],
                    "tokens_per_second": r["tokens_per_second"],
                    "identical_turns": f"{r['identical_turns']}/{r['divergences']['turns']}"
                    if "divergences" in r else r["identical_turns"]})
        print(f"{label} {setting}: tau {r['tau']:.3f}, draft/verify {r['draft_over_verify']:.3f}, "
              f"speedup {r['speedup']:.3f}", flush=True)
    return out


def run(args: argparse.Namespace, command: str):
    paths = named_values(args.drafter, "--drafter")
    chains = {name: int(k) for name, k in named_values(args.k_of, "--k_of").items()}
    exports = named_values(args.export_check, "--export_check")
    unknown = sorted((set(chains) | set(exports)) - set(paths))
    if unknown:
        raise SpectrainError(f"--k_of / --export_check name {unknown}, not a --drafter")
    verifier = load_verifier(args.verifier, dtype=DTYPES[args.dtype])
    bundled = args.prompts.startswith("bundled:")
    prompts = load_prompts(args.prompts, args.num_prompts, verifier.tokenizer, first_turns=not bundled,
                           spread=not bundled)
    common = settings_from_args(args)
    evaluate_drafter(verifier, prompts[:2], "none", replace(common, max_new_tokens=16))  # warm-up, untimed
    ar = evaluate_drafter(verifier, prompts, "none", common)
    reference, ar_summary = ar.per_prompt["ar"], ar.results["ar"]
    rows, calls = [], []
    tree = parse_dynamic_tree(args.dynamic_tree) if args.dynamic_tree else None
    for name, path in paths.items():
        drafter = load_drafter(path, verifier)
        family = family_of(drafter)
        grows = tree is not None and evaluator_of(family).dynamic_trees
        settings = replace(common, k=chains.get(name, args.k), dynamic_tree=tree if grows else None)
        result = evaluate_drafter(verifier, prompts, drafter, settings, reference=reference)
        calls.append({"drafter": name, "path": path, "results": result.results, "costs": result.costs})
        rows += rows_of(name, result, path)
        if name in exports:  # the export, loaded back, decodes the same chain
            with tempfile.TemporaryDirectory() as tmp:
                out = export_drafter(drafter, exports[name], f"{tmp}/export",
                                     verifier_lm_head=verifier.model.get_output_embeddings(),
                                     verifier_name=args.verifier)
                again = load_drafter(str(out), verifier)
                back = evaluate_drafter(verifier, prompts, again, replace(settings, dynamic_tree=None),
                                        reference=reference)
            rows += rows_of(f"{name} via {exports[name]}", back, path)
            setting = f"chain-{settings.k}"
            rows[-1]["same_tokens_as_run_dir"] = all(
                a["tokens"] == b["tokens"] for x, y in zip(result.per_prompt[setting], back.per_prompt[setting])
                for a, b in zip(x["turns"], y["turns"]))
    ar_end = evaluate_drafter(verifier, prompts, "none", common).results["ar"]
    summary = {"command": command, "date": time.strftime("%Y-%m-%d"), "verifier": args.verifier,
               "drafters": paths, "prompts": args.prompts, "num_prompts": len(prompts),
               "max_new_tokens": args.max_new_tokens, "dtype": args.dtype, "device": "cpu",
               "threads": torch.get_num_threads(), "batch_invariant": ar.batch_invariant,
               "ar": {"tokens_per_second": ar_summary["tokens_per_second"],
                      "decode_ms_per_token": ar_summary["decode_ms_per_token"],
                      "tokens_per_second_at_end": ar_end["tokens_per_second"]},
               "rows": rows, "calls": calls}
    table = format_table(["drafter", "setting", "tau", "alpha by depth", "draft/verify", "speedup", "same as AR"],
                         [[r["drafter"], r["setting"], r["tau"], " ".join(f"{a:.2f}" for a in r["alpha"] if a is not None),
                           r["draft_over_verify"], r["speedup"], r["identical_turns"]] for r in rows],
                         title=f"{args.verifier}, {len(prompts)} prompts x {args.max_new_tokens} tokens, {args.dtype}; "
                               f"AR {ar_summary['tokens_per_second']:.1f} tok/s (at the end: "
                               f"{ar_end['tokens_per_second']:.1f})")
    return finish(summary, args.out, tables=[table])


if __name__ == "__main__":
    main()
