"""bf16 lossless check, old vs new in one run: speculative vs AR outputs with batch-invariant decoding off (the
old loop) and on (the default in bf16 on a CPU), the divergences measured where they happen (benchmark, not a test).

For each mode, one :func:`evaluate_drafter` call on the same prompts: AR, a chain and (where its family grows
one) a dynamic tree of the given drafter, of any family. Per setting: turns identical to AR, and at every divergence both paths' own logits (the
verify pass's and the AR step's top-2 margins, each token's logit in the other path, the flip) beside the
spread of the two paths' margins at the positions before it; tokens/s of AR and of each setting, measured in the
same call::

    python benchmarks/bf16_identity.py --prompts mt_bench.jsonl [--drafter pretrained/smollm2-eagle1]
        [--num_prompts 16] [--k 5] [--dynamic_tree 6,8,64] [--max_new_tokens 128] [--out docs/results/bf16_identity.json]

Prints a table and writes the JSON (its path is the last line printed).
"""

from __future__ import annotations

import argparse
import shlex
import sys
import time
from dataclasses import replace

import torch

from spectrain.eval.cli import divergence_line
from spectrain.eval.settings import parse_dynamic_tree
from spectrain.eval.evaluate import EvalSettings, evaluate_drafter, load_drafter
from spectrain.eval.families import evaluator_of
from spectrain.eval.prompts import load_prompts
from spectrain.heads.errors import run_command
from spectrain.heads.families import family_of
from spectrain.heads.report import finish, format_table
from spectrain.heads.verifier import load_verifier


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="bf16_identity.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--verifier", default="bundled:smollm2")
    p.add_argument("--drafter", default="pretrained/smollm2-eagle1")
    p.add_argument("--prompts", required=True, help="MT-bench-style jsonl ({'turns': [...], 'category': ...})")
    p.add_argument("--num_prompts", type=int, default=16)
    p.add_argument("--k", type=int, default=5)
    p.add_argument("--drafter_format", default=None, help="the serving format --drafter is in, where several claim it")
    p.add_argument("--dynamic_tree", default="6,8,64", help="depth,topk,nodes (a family that grows dynamic trees)")
    p.add_argument("--max_new_tokens", type=int, default=128)
    p.add_argument("--out", default="runs/bench/bf16_identity.json")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    run_command(run, parse_args(argv), shlex.join(["python", "benchmarks/bf16_identity.py", *argv]))


def run(args: argparse.Namespace, command: str):
    verifier = load_verifier(args.verifier, dtype=torch.bfloat16)
    prompts = load_prompts(args.prompts, args.num_prompts, verifier.tokenizer, first_turns=True, spread=True)
    drafter = load_drafter(args.drafter, verifier, fmt=args.drafter_format)
    family = family_of(drafter)
    tree = parse_dynamic_tree(args.dynamic_tree) if evaluator_of(family).dynamic_trees else None  # else the chain alone
    settings = EvalSettings(k=args.k, dynamic_tree=tree, max_new_tokens=args.max_new_tokens, hf_generate=0, costs=False)
    modes, rows, lines = {}, [], []
    for name, invariant in (("old: batch_invariant off", False), ("new: batch_invariant on", True)):
        result = evaluate_drafter(verifier, prompts, drafter, replace(settings, batch_invariant=invariant))
        modes[name] = {"batch_invariant": invariant, "results": result.results}
        for setting, r in result.results.items():
            d = r.get("divergences")
            rows.append([name, setting, r["tau"], r["tokens_per_second"], r.get("speedup", 1.0),
                         "-" if d is None else f"{r['identical_turns']}/{d['turns']}",
                         "-" if not d or not d["diverged"] else f"{d['max_margin']:.3f}",
                         "-" if not d or not d["diverged"] else f"{d['max_flip']:.3f}",
                         "-" if not d or not d["diverged"] else f"{d['spread']['max']:.3f}"])
            if d and (d["diverged"] or d["inherited"]):
                lines.append(f"{name}, {setting}: {divergence_line(d)}")
    summary = {"command": command, "date": time.strftime("%Y-%m-%d"), "verifier": args.verifier,
               "drafter": args.drafter, "prompts": args.prompts, "num_prompts": len(prompts),
               "max_new_tokens": args.max_new_tokens, "dtype": "bfloat16", "device": "cpu",
               "threads": torch.get_num_threads(), "modes": modes}
    table = format_table(["mode", "setting", "tau", "tok/s", "speedup", "same as AR", "max margin", "max flip",
                          "spread max"], rows,
                         title=f"bf16 speculative vs AR, {len(prompts)} prompts x {args.max_new_tokens} tokens")
    return finish(summary, args.out, tables=[table, *lines])


if __name__ == "__main__":
    main()
