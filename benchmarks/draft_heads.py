"""Ranked draft heads, measured: τ, drafting cost and speedup of Medusa / EAGLE-1 / DFlash drafters over draft
vocabularies of several sizes, every speedup over AR decoded in the same run (benchmark, not a test).

AR decoded before each drafter call (``--ar_each``, the default; its records are that call's reference: speedup
and the lossless check — ``--ar_each false``: one AR pass first for every call), then per drafter and draft vocabulary one :func:`evaluate_drafter` call (a chain of k — ``--k_of NAME=K`` for another
length per drafter — and a tree: Medusa's best N-node tree, the dynamic tree of the families that grow one (EAGLE,
DFlash: its depth must fit the block)), plus the hybrid (prompt lookup + the drafter) where asked; AR is decoded once
more at the end so the drift of the machine over the run is on record::

    python benchmarks/draft_heads.py --prompts mt_bench.jsonl --drafter eagle1=pretrained/smollm2-eagle1 \\
        --drafter medusa=runs/d24/medusa --draft_vocabs 0,16384,8192,4096 --hybrid eagle1=0,8192 \\
        [--num_prompts 16] [--k 5] [--dynamic_tree 6,8,64] [--medusa_tree auto:64] [--out docs/results/draft_heads.json]

Prints a table and writes the JSON (its path is the last line printed): rows with ``drafter``, ``draft_vocab``,
``setting``, ``tau``, ``draft_over_verify`` (a round's drafting / its verify pass, both timed in the rounds),
``round_ms`` (draft / verify / the rest of a round), ``speedup`` (over AR decoded right before that drafter's
call: ``--ar_each``, the default, so the machine's drift over a long run does not enter the ratios; ``--ar_each
false``: over the run's first AR), ``ideal_speedup`` (τ × AR's ms per token / a round's draft + verify),
``identical_turns``.
"""

from __future__ import annotations

import argparse
import shlex
import sys
import time

import torch

from spectrain.eval.cli import dynamic_tree
from spectrain.eval.evaluate import evaluate_drafter, load_drafter
from spectrain.eval.prompts import load_prompts
from spectrain.heads.errors import SpectrainError, run_command
from spectrain.eval.families import evaluator_of
from spectrain.heads.families import family_of
from spectrain.heads.report import finish, format_table
from spectrain.heads.verifier import load_verifier


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="draft_heads.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--verifier", default="bundled:smollm2")
    p.add_argument("--drafter", action="append", required=True, metavar="NAME=PATH",
                   help="a drafter of any registered family (Medusa, EAGLE-1, DFlash; repeat)")
    p.add_argument("--prompts", required=True, help="MT-bench-style jsonl ({'turns': [...], 'category': ...})")
    p.add_argument("--num_prompts", type=int, default=16)
    p.add_argument("--draft_vocabs", default="0,16384,8192,4096", help="draft vocabulary sizes (0 = full)")
    p.add_argument("--hybrid", action="append", default=[], metavar="NAME=N[,N...]",
                   help="also prompt lookup + drafter NAME at these draft vocabularies")
    p.add_argument("--k", type=int, default=5)
    p.add_argument("--k_of", action="append", default=[], metavar="NAME=K",
                   help="another chain length for drafter NAME (a block drafter's whole block, say)")
    p.add_argument("--dynamic_tree", default="6,8,64", help="EAGLE's tree")
    p.add_argument("--medusa_tree", default="auto:64", help="Medusa's tree")
    p.add_argument("--max_new_tokens", type=int, default=128)
    p.add_argument("--ar_each", type=lambda v: {"true": True, "false": False}[v.lower()], default=True,
                   metavar="true|false", help="decode AR again before every drafter call (its speedups' reference)")
    p.add_argument("--out", default="runs/bench/draft_heads.json")
    return p.parse_args(argv)


def sizes(spec: str, what: str) -> list[int]:
    try:
        out = [int(x) for x in spec.split(",")]
    except ValueError:
        raise SpectrainError(f"{what} takes comma-separated integers, got {spec!r}") from None
    if min(out) < 0:
        raise SpectrainError(f"{what}: sizes must be >= 0, got {spec!r}")
    return out


def pairs(specs: list[str], what: str) -> dict[str, str]:
    out = {}
    for spec in specs:
        name, sep, value = spec.partition("=")
        if not sep or not name or not value:
            raise SpectrainError(f"{what} takes NAME=VALUE, got {spec!r}")
        out[name] = value
    return out


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    run_command(run, parse_args(argv), shlex.join(["python", "benchmarks/draft_heads.py", *argv]))


def run(args: argparse.Namespace, command: str):
    vocabs = sizes(args.draft_vocabs, "--draft_vocabs")
    paths = pairs(args.drafter, "--drafter")
    hybrids = {name: sizes(v, "--hybrid") for name, v in pairs(args.hybrid, "--hybrid").items()}
    if set(hybrids) - set(paths):
        raise SpectrainError(f"--hybrid names {sorted(set(hybrids) - set(paths))}, not a --drafter")
    verifier = load_verifier(args.verifier, dtype=torch.bfloat16)
    prompts = load_prompts(args.prompts, args.num_prompts, verifier.tokenizer, first_turns=True, spread=True)
    common = dict(max_new_tokens=args.max_new_tokens, hf_generate=0)
    evaluate_drafter(verifier, prompts[:2], method="none", max_new_tokens=16, hf_generate=0)  # warm-up, untimed
    ar = evaluate_drafter(verifier, prompts, method="none", **common)
    reference, ar_summary = ar.per_prompt["ar"], ar.results["ar"]
    rows, calls = [], []
    chains = {name: int(k) for name, k in pairs(args.k_of, "--k_of").items()}
    for name, path in paths.items():
        drafter = load_drafter(path, verifier)
        method = family_of(drafter).name
        evaluator = evaluator_of(family_of(drafter))
        tree = (dict(tree=args.medusa_tree) if evaluator.rank_trees else
                dict(dynamic_tree=dynamic_tree(args.dynamic_tree)) if evaluator.dynamic_trees else {})  # else chains
        jobs = [(method, n) for n in vocabs] + [("hybrid", n) for n in hybrids.get(name, [])]
        for how, n in jobs:
            if args.ar_each:  # AR again, just before: this call's speedups and lossless check are against it
                reference = evaluate_drafter(verifier, prompts, method="none", **common).per_prompt["ar"]
            result = evaluate_drafter(verifier, prompts, method=how, drafter=drafter, k=chains.get(name, args.k),
                                      draft_vocab=n, reference=reference, **tree, **common)
            label = name if how != "hybrid" else f"hybrid-{name}"
            calls.append({"drafter": label, "path": path, "draft_vocab": result.draft_vocab,
                          "results": result.results, "costs": result.costs, "planner": result.planner})
            for setting, r in result.results.items():
                if setting == "ar":
                    continue
                rows.append({"drafter": label, "draft_vocab": result.draft_vocab, "setting": setting,
                             "tau": r["tau"], "draft_over_verify": r["draft_over_verify"], "round_ms": r["round_ms"],
                             "speedup": r["speedup"], "ideal_speedup": r["ideal_speedup"],
                             "tokens_per_second": r["tokens_per_second"],
                             "ar_tokens_per_second": result.results["ar"]["tokens_per_second"],
                             "identical_turns": f"{r['identical_turns']}/{r['divergences']['turns']}"})
                print(f"{label} V={result.draft_vocab} {setting}: tau {r['tau']:.3f}, draft/verify "
                      f"{r['draft_over_verify']:.3f}, speedup {r['speedup']:.3f}", flush=True)
    ar_end = evaluate_drafter(verifier, prompts, method="none", **common).results["ar"]
    summary = {"command": command, "date": time.strftime("%Y-%m-%d"), "verifier": args.verifier,
               "drafters": paths, "prompts": args.prompts, "num_prompts": len(prompts), "ar_each": args.ar_each,
               "max_new_tokens": args.max_new_tokens, "dtype": "bfloat16", "device": "cpu",
               "threads": torch.get_num_threads(), "batch_invariant": ar.batch_invariant,
               "ar": {"tokens_per_second": ar_summary["tokens_per_second"],
                      "decode_ms_per_token": ar_summary["decode_ms_per_token"],
                      "tokens_per_second_at_end": ar_end["tokens_per_second"]},
               "rows": rows, "calls": calls}
    table = format_table(["drafter", "draft vocab", "setting", "tau", "draft/verify", "speedup", "ideal", "same as AR"],
                         [[r["drafter"], r["draft_vocab"], r["setting"], r["tau"], r["draft_over_verify"],
                           r["speedup"], r["ideal_speedup"], r["identical_turns"]] for r in rows],
                         title=f"ranked draft heads: {len(prompts)} prompts x {args.max_new_tokens} tokens, bf16; AR "
                               f"{ar_summary['tokens_per_second']:.1f} tok/s (at the end: "
                               f"{ar_end['tokens_per_second']:.1f})")
    return finish(summary, args.out, tables=[table])


if __name__ == "__main__":
    main()
