"""τ of several trained drafters on the same prompts at several temperatures: acceptance only, no timing (a
benchmark, not a test).

Training's measured τ (``--model.measure_prompts``) is a greedy chain; the acceptance-targeted losses (LK, DSpark's
TV) aim at the probability that a *sampled* draft is accepted, so a loss comparison needs T > 0 too. Every drafter
decodes a chain of ``--k`` drafts (``--k_of NAME=K``: a block drafter's whole block) through the lossless loop on
the same prompts, with the same sampling seed per temperature::

    python benchmarks/sampled_tau.py ce=runs/eagle1-ce lk=runs/eagle1-lk_hybrid --verifier bundled:tinyshakespeare \\
        [--prompts bundled:tinyshakespeare] [--temperatures 0,1] [--num_prompts 20] [--max_new_tokens 64] [--k 4]
        [--json runs/bench/sampled_tau.json]

Prints a table and writes the JSON (its path is the last line printed): rows with ``drafter``, ``temperature``,
``k``, ``draft_vocab`` (the drafter's own default), ``tau``, ``alpha`` (α by depth), ``verifier_forwards`` and, at
T = 0, ``identical_turns``.
"""

from __future__ import annotations

import argparse
import shlex
import sys
import time
from dataclasses import replace

from spectrain.eval.cli import named_values
from spectrain.eval.evaluate import EvalSettings, evaluate_drafter, load_drafter
from spectrain.eval.families import check_chain_depth
from spectrain.eval.prompts import load_prompts
from spectrain.heads.errors import SpectrainError, run_command
from spectrain.heads.report import finish, format_table
from spectrain.heads.verifier import load_verifier


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="sampled_tau.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("drafters", nargs="+", metavar="NAME=RUN_DIR")
    p.add_argument("--verifier", default="bundled:tinyshakespeare")
    p.add_argument("--prompts", default="bundled:tinyshakespeare")
    p.add_argument("--temperatures", default="0,1", help="comma-separated; 0 = greedy")
    p.add_argument("--num_prompts", type=int, default=20)
    p.add_argument("--max_new_tokens", type=int, default=64)
    p.add_argument("--k", type=int, default=4)
    p.add_argument("--k_of", action="append", default=[], metavar="NAME=K",
                   help="NAME's chain length instead of --k (a block drafter's whole block, say)")
    p.add_argument("--dtype", default="float32", help="the verifier's dtype (counts only: fp32 by default)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default="runs/bench/sampled_tau.json")
    return p.parse_args(argv)


def temperatures(spec: str) -> list[float]:
    try:
        out = [float(t) for t in spec.split(",")]
    except ValueError:
        raise SpectrainError(f"--temperatures takes comma-separated numbers, got {spec!r}") from None
    if not all(0 <= t < float("inf") for t in out) or len(set(out)) != len(out):
        raise SpectrainError(f"--temperatures takes distinct finite numbers >= 0, got {spec!r}")
    return out


def chain_length(name: str, spec: str) -> int:
    try:
        k = int(spec)
    except ValueError:
        raise SpectrainError(f"--k_of {name}={spec}: K must be an integer") from None
    if k < 1:
        raise SpectrainError(f"--k_of {name}={spec}: K must be >= 1")
    return k


def run(args: argparse.Namespace, command: str):
    runs = named_values(args.drafters, "drafters")
    chains = {name: chain_length(name, k) for name, k in named_values(args.k_of, "--k_of").items()}
    if set(chains) - set(runs):
        raise SpectrainError(f"--k_of names {sorted(set(chains) - set(runs))}, not a drafter")
    if min(args.k, args.num_prompts, args.max_new_tokens) < 1:
        raise SpectrainError("--k, --num_prompts and --max_new_tokens must be >= 1")
    temps = temperatures(args.temperatures)
    verifier = load_verifier(args.verifier, dtype=args.dtype)
    prompts = load_prompts(args.prompts, args.num_prompts, verifier.tokenizer)
    drafters = {name: load_drafter(path, verifier) for name, path in runs.items()}  # every path checked first
    for name, drafter in drafters.items():  # and every chain, before anything is decoded
        check_chain_depth(name, drafter, chains.get(name, args.k))
    common = EvalSettings(max_new_tokens=args.max_new_tokens, seed=args.seed, hf_generate=0, costs=False)
    rows = []
    for temperature in temps:
        reference = None  # AR is decoded by the first drafter's call, then reused: the T = 0 identity reference
        for name, drafter in drafters.items():
            k = chains.get(name, args.k)
            settings = replace(common, k=k, temperature=temperature)
            result = evaluate_drafter(verifier, prompts, drafter, settings, reference=reference)
            reference = result.per_prompt["ar"]
            r = result.results[f"chain-{k}"]
            rows.append({"drafter": name, "path": runs[name], "temperature": temperature, "k": k,
                         "draft_vocab": result.draft_vocab, "tau": r["tau"],
                         "alpha": r["alpha"], "verifier_forwards": r["verifier_forwards"],
                         "identical_turns": (f"{r['identical_turns']}/{r['divergences']['turns']}"
                                             if temperature == 0 else None)})
            print(f"{name} T={temperature:g} chain {k}: tau {r['tau']:.3f}", flush=True)
    table = format_table(["drafter", "T", "k", "tau", "alpha by depth", "same as AR"],
                         [[r["drafter"], r["temperature"], r["k"], r["tau"],
                           " ".join(f"{a:.2f}" for a in r["alpha"] if a is not None), r["identical_turns"] or "-"]
                          for r in rows],
                         title=f"tau on {len(prompts)} prompts x {args.max_new_tokens} tokens ({args.dtype})")
    summary = {"command": command, "date": time.strftime("%Y-%m-%d"), "verifier": args.verifier,
               "prompts": args.prompts, "num_prompts": len(prompts), "max_new_tokens": args.max_new_tokens,
               "dtype": args.dtype, "seed": args.seed, "rows": rows}
    return finish(summary, args.json, tables=[table])


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    run_command(run, parse_args(argv), shlex.join(["python", "benchmarks/sampled_tau.py", *argv]))


if __name__ == "__main__":
    main()
