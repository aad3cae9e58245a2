"""Ranked draft heads, measured: τ, drafting cost and speedup of Medusa / EAGLE-1 / DFlash drafters over draft
vocabularies of several sizes, every speedup over AR decoded in the same run (benchmark, not a test).

AR decoded before each drafter call (``--ar_each``, the default; its records are that call's reference: speedup
and the lossless check — ``--ar_each false``: one AR pass first for every call), then per drafter and draft
vocabulary one :func:`evaluate_drafter` call (a chain of k — ``--k_of NAME=K[,K...]`` for another length per
drafter, or several — and a tree: Medusa's best N-node tree, the dynamic tree of the families that grow one (EAGLE,
DFlash: its depth must fit the block)), plus the hybrid (prompt lookup + the drafter) where asked; AR is decoded once
more at the end so the drift of the machine over the run is on record. ``--interleave`` goes prompt by prompt
instead: AR on a prompt, then every drafter setting on it, each setting's turns pooled and its speedup taken
against the pooled AR — the machine's drift (±15 % within minutes on shared cores) then reaches every side alike::

    python benchmarks/draft_heads.py --prompts mt_bench.jsonl --drafter eagle1=pretrained/smollm2-eagle1 \\
        --drafter medusa=runs/d24/medusa --draft_vocabs 0,16384,8192,4096 --hybrid eagle1=0,8192 \\
        [--num_prompts 16] [--k 5] [--dynamic_tree 6,8,64] [--medusa_tree auto:64] [--out docs/results/draft_heads.json]

Prints a table and writes the JSON (its path is the last line printed): rows with ``drafter``, ``draft_vocab``,
``setting``, ``tau``, ``draft_over_verify`` (a round's drafting / its verify pass, both timed in the rounds),
``round_ms`` (draft / verify / the rest of a round), ``speedup`` (over AR decoded right before that drafter's
call: ``--ar_each``, the default, so the machine's drift over a long run does not enter the ratios; ``--ar_each
false``: over the run's first AR), ``ideal_speedup`` (τ × AR's ms per token / a round's draft + verify),
``identical_turns``, ``alpha`` (α by depth) and ``mean_drafted_depth`` (a chain's drafts per round).
``--min_confidence NAME=P`` adds NAME's chain cut per round by its confidence head (DSpark's; rows ``NAME-confP``).
"""

from __future__ import annotations

import argparse
import shlex
import sys
import time
from dataclasses import replace

import torch

from spectrain.eval.cli import named_values
from spectrain.eval.settings import parse_dynamic_tree
from spectrain.eval.decode_dtype import cpu_line, cpu_record, decode_dtype
from spectrain.eval.evaluate import EvalSettings, evaluate_drafter, load_drafter
from spectrain.eval.runs import in_loop_costs, summarize
from spectrain.eval.prompts import load_prompts
from spectrain.eval.repeats import check_repeats, merge_repeats
from spectrain.eval.results import RowCall, drafter_formats
from spectrain.heads.errors import SpectrainError, run_command
from spectrain.eval.families import check_chain_depth, check_confidence, evaluator_of
from spectrain.heads.families import family_of
from spectrain.heads.report import finish, format_table
from spectrain.heads.verifier import load_verifier


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="draft_heads.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--verifier", default="bundled:smollm2")
    p.add_argument("--drafter", action="append", required=True, metavar="NAME=PATH",
                   help="a drafter of any registered family (repeat)")
    p.add_argument("--drafter_format", action="append", default=[], metavar="NAME=FORMAT",
                   help="the serving format of --drafter NAME's directory, where several formats claim it")
    p.add_argument("--prompts", required=True, help="MT-bench-style jsonl ({'turns': [...], 'category': ...})")
    p.add_argument("--num_prompts", type=int, default=16)
    p.add_argument("--draft_vocabs", default="0,16384,8192,4096",
                   help="draft vocabulary sizes (0 = full; a drafter trained with a draft vocabulary of its own "
                        "always drafts over that)")
    p.add_argument("--hybrid", action="append", default=[], metavar="NAME=N[,N...]",
                   help="also prompt lookup + drafter NAME at these draft vocabularies")
    p.add_argument("--lookups", default="0", metavar="L[,L...]",
                   help="the hybrid's lookup-round lengths to try (0 = --k): each is a row of its own")
    p.add_argument("--k", type=int, default=5)
    p.add_argument("--k_of", action="append", default=[], metavar="NAME=K[,K...]",
                   help="other chain lengths for drafter NAME (a block drafter's whole block, say): the first is "
                        "its main length (its tree, hybrid and --min_confidence rows use it), each further one "
                        "adds a chain row of its own")
    p.add_argument("--min_confidence", action="append", default=[], metavar="NAME=P[,P...]",
                   help="also NAME's chain cut per round by its confidence head at each P (rows 'NAME-confP')")
    p.add_argument("--dynamic_tree", default="6,8,64",
                   help="the tree of a family that grows dynamic trees: depth,topk,nodes")
    p.add_argument("--rank_tree", "--medusa_tree", dest="rank_tree", default="auto:64",
                   help="the tree of a family that builds trees from rank accuracies: auto:N (--medusa_tree: the "
                        "same, as the recorded commands spell it)")
    p.add_argument("--max_new_tokens", type=int, default=128)
    p.add_argument("--ar_each", type=lambda v: {"true": True, "false": False}[v.lower()], default=True,
                   metavar="true|false", help="decode AR again before every drafter call (its speedups' reference)")
    p.add_argument("--interleave", action="store_true",
                   help="prompt by prompt: AR, then every drafter setting on that prompt (each setting's turns "
                        "pooled, its speedup over the pooled AR): the machine's drift reaches every side alike")
    p.add_argument("--repeats", type=int, default=1,
                   help="with --interleave: the whole interleaved pass this many times; each row's speedup is the "
                        "median over the passes, with its min and max")
    p.add_argument("--dtype", choices=["auto", "bfloat16", "float32"], default="auto",
                   help="decoding dtype; auto: bf16 where bf16 is native (AMX / AVX512-BF16), fp32 elsewhere")
    p.add_argument("--out", default="runs/bench/draft_heads.json")
    args = p.parse_args(argv)
    try:
        check_repeats(args.repeats, args.interleave)
    except SpectrainError as why:
        p.error(str(why))
    return args


def settings_from_args(args) -> EvalSettings:
    """What every call decodes with: ``--max_new_tokens``, no HF timing (each job sets its chain, tree, draft
    vocabulary and lookup by ``replace``)."""
    return EvalSettings(max_new_tokens=args.max_new_tokens, hf_generate=0)


def sizes(spec: str, what: str) -> list[int]:
    try:
        out = [int(x) for x in spec.split(",")]
    except ValueError:
        raise SpectrainError(f"{what} takes comma-separated integers, got {spec!r}") from None
    if min(out) < 0:
        raise SpectrainError(f"{what}: sizes must be >= 0, got {spec!r}")
    return out


def row(label: str, draft_vocab, setting: str, r: dict, ar_tokens_per_second: float, identical: str) -> dict:
    """One table row from a setting's summary (printed as it is made)."""
    print(f"{label} V={draft_vocab} {setting}: tau {r['tau']:.3f}, draft/verify {r['draft_over_verify']:.3f}, "
          f"speedup {r['speedup']:.3f}", flush=True)
    return {"drafter": label, "draft_vocab": draft_vocab, "setting": setting, "tau": r["tau"], "alpha": r["alpha"],
            "mean_drafted_depth": r.get("mean_drafted_depth"),
            "draft_over_verify": r["draft_over_verify"], "round_ms": r["round_ms"], "speedup": r["speedup"],
            "ideal_speedup": r["ideal_speedup"], "tokens_per_second": r["tokens_per_second"],
            "ar_tokens_per_second": ar_tokens_per_second, "identical_turns": identical}


def interleaved(verifier, prompts: list[list[str]], jobs: list[tuple[str, str, RowCall]], common: EvalSettings,
                offset: int = 0):
    """Prompt by prompt: AR on it, then every job on it, each job first in turn (``--interleave``), so a drift of
    the machine's speed — ±15 % within minutes on shared cores — reaches AR and every drafter alike. Each setting's
    turns are pooled over the prompts (:func:`summarize`, as one call would) and its speedup taken against the
    pooled AR. ``offset`` turns the order again (a repeat's). Returns (rows, calls, the pooled AR summary)."""
    ar_records, pooled = [], {}  # pooled[(label, draft vocab, setting)] = {"records", "depth", "identical", ...}
    for i, prompt in enumerate(prompts):
        ar = evaluate_drafter(verifier, [prompt], "none", common).per_prompt["ar"]
        ar_records += ar
        first = (i + offset) % len(jobs)
        for label, _, call in jobs[first:] + jobs[:first]:  # each job first in turn
            result = evaluate_drafter(verifier, [prompt], call.method, replace(call.settings, costs=False),
                                      drafter=call.drafter, reference=ar)
            for setting, r in result.results.items():
                if setting == "ar":
                    continue
                entry = pooled.setdefault((label, result.draft_vocab, setting), {
                    "records": [], "depth": len(r["alpha"]), "identical": 0, "turns": 0,
                    "draft_vocab": result.draft_vocab, "lookup_rounds": 0.0, "divergences": []})
                entry["records"] += result.per_prompt[setting]
                entry["lookup_rounds"] += r.get("lookup_round_fraction", 0.0) * r["verifier_forwards"]
                entry["identical"] += r["identical_turns"]
                entry["turns"] += r["divergences"]["turns"]
                entry["divergences"].append({"prompt": i, **r["divergences"]})  # each parting's margins
        print(f"prompt {i + 1}/{len(prompts)} done", flush=True)
    ar_summary = summarize(ar_records, 0)
    rows, calls = [], []
    for (label, _, setting), entry in pooled.items():
        r = summarize(entry["records"], entry["depth"])
        r["speedup"] = ar_summary["decode_ms_per_token"] / max(r["decode_ms_per_token"], 1e-9)
        r.update(in_loop_costs(r, ar_summary))
        if label.startswith("hybrid"):
            r["lookup_round_fraction"] = round(entry["lookup_rounds"] / max(r["verifier_forwards"], 1), 4)
        rows.append(row(label, entry["draft_vocab"], setting, r, ar_summary["tokens_per_second"],
                        f"{entry['identical']}/{entry['turns']}"))
        divergences = entry["divergences"]
        measured = [c for d in divergences for c in d["cases"] if c["replayed"]]
        pooled_divergences = {"turns": entry["turns"], "diverged": sum(d["diverged"] for d in divergences),
                              "near_ties": sum(d["near_ties"] for d in divergences),
                              "max_margin": max((max(c["margin_verify"], c["margin_ar"]) for c in measured),
                                                default=0.0),
                              "per_prompt": divergences}
        calls.append({"drafter": label, "setting": setting, "draft_vocab": entry["draft_vocab"], "results": {
            "ar": ar_summary, setting: {**r, "identical_turns": entry["identical"],
                                        "divergences": pooled_divergences}}})
    return rows, calls, ar_summary


def confidence_levels(spec: str) -> list[float]:
    try:
        out = [float(x) for x in spec.split(",")]
    except ValueError:
        raise SpectrainError(f"--min_confidence takes NAME=P[,P...], probabilities, got {spec!r}") from None
    if not all(0 < p < 1 for p in out):
        raise SpectrainError(f"--min_confidence levels must lie in (0, 1), got {spec!r}")
    return out


def chain_lengths(spec: str) -> list[int]:
    """``--k_of NAME=K[,K...]``: distinct chain lengths >= 1, the main one first."""
    lengths = sizes(spec, "--k_of")
    if min(lengths) < 1 or len(set(lengths)) != len(lengths):
        raise SpectrainError(f"--k_of takes distinct chain lengths >= 1, got {spec!r}")
    return lengths


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    run_command(run, parse_args(argv), shlex.join(["python", "benchmarks/draft_heads.py", *argv]))


def run(args: argparse.Namespace, command: str):
    vocabs = sizes(args.draft_vocabs, "--draft_vocabs")
    paths = named_values(args.drafter, "--drafter")
    hybrids = {name: sizes(v, "--hybrid") for name, v in named_values(args.hybrid, "--hybrid").items()}
    confidences = {name: confidence_levels(v)
                   for name, v in named_values(args.min_confidence, "--min_confidence").items()}
    formats = drafter_formats(args.drafter_format, paths)  # every drafter's format settled before any decoding
    lookups = sizes(args.lookups, "--lookups")
    chains = {name: chain_lengths(v) for name, v in named_values(args.k_of, "--k_of").items()}
    for flag, names in (("--hybrid", hybrids), ("--min_confidence", confidences), ("--k_of", chains)):
        if set(names) - set(paths):
            raise SpectrainError(f"{flag} names {sorted(set(names) - set(paths))}, not a --drafter")
    dtype, dtype_choice = (decode_dtype("cpu") if args.dtype == "auto" else
                           (getattr(torch, args.dtype), {"rule": "set by --dtype"}))
    verifier = load_verifier(args.verifier, dtype=dtype)
    prompts = load_prompts(args.prompts, args.num_prompts, verifier.tokenizer, first_turns=True, spread=True)
    common = settings_from_args(args)
    warm = evaluate_drafter(verifier, prompts[:2], "none", replace(common, max_new_tokens=16))  # untimed
    jobs = []  # (label, drafter path, its evaluate_drafter call)
    for name, path in paths.items():
        drafter = load_drafter(path, verifier, fmt=formats.get(name))
        method = family_of(drafter).name
        evaluator = evaluator_of(family_of(drafter))
        lengths = chains.get(name, [args.k])
        check_chain_depth(name, drafter, max(lengths))  # before anything is decoded
        tree = (dict(tree=args.rank_tree) if evaluator.rank_trees else
                dict(dynamic_tree=parse_dynamic_tree(args.dynamic_tree)) if evaluator.dynamic_trees else {})  # else chains
        # a drafter trained with its own draft vocabulary drafts over it: no --draft_vocabs
        fixed = evaluator.fixed_draft_vocab(drafter, None) is not None
        own, hybrid_vocabs = (([None], [None] if hybrids.get(name) else []) if fixed else
                              (vocabs, hybrids.get(name, [])))
        k = lengths[0]
        for how, n, lookup in [(method, n, 0) for n in own] + [("hybrid", n, lookup) for n in hybrid_vocabs
                                                                for lookup in lookups]:
            label = name if how != "hybrid" else f"hybrid-{name}" + (f"-lookup{lookup}" if lookup else "")
            jobs.append((label, path, RowCall(how, drafter, replace(common, k=k, draft_vocab=n, lookup=lookup,
                                                                    **tree))))
        for other in lengths[1:]:  # further chain lengths: the drafter alone, chains only, at each vocabulary
            jobs += [(name, path, RowCall(method, drafter, replace(common, k=other, draft_vocab=n))) for n in own]
        if confidences.get(name):
            check_confidence(drafter)  # before any job runs
        for level in confidences.get(name, []):  # the chain alone, at its default draft head
            jobs.append((f"{name}-conf{level:g}", path, RowCall(method, drafter,
                                                                replace(common, k=k, min_confidence=level))))
    if args.interleave:  # AR of every prompt decoded beside its drafters (pooled); no separate AR passes
        rows, calls, ar_summary = merge_repeats([interleaved(verifier, prompts, jobs, common, offset=r)
                                                 for r in range(args.repeats)])
        ar_end = None
    else:
        ar = evaluate_drafter(verifier, prompts, "none", common)
        reference, ar_summary = ar.per_prompt["ar"], ar.results["ar"]
        rows, calls = [], []
        for label, path, call in jobs:
            if args.ar_each:  # AR again, just before: this call's speedups and lossless check are against it
                reference = evaluate_drafter(verifier, prompts, "none", common).per_prompt["ar"]
            result = evaluate_drafter(verifier, prompts, call.method, call.settings, drafter=call.drafter,
                                      reference=reference)
            calls.append({"drafter": label, "path": path, "draft_vocab": result.draft_vocab,
                          "results": result.results, "costs": result.costs, "planner": result.planner})
            for setting, r in result.results.items():
                if setting != "ar":
                    rows.append(row(label, result.draft_vocab, setting, r, result.results["ar"]["tokens_per_second"],
                                    f"{r['identical_turns']}/{r['divergences']['turns']}"))
        ar_end = evaluate_drafter(verifier, prompts, "none", common).results["ar"]
    summary = {"command": command, "date": time.strftime("%Y-%m-%d"), "verifier": args.verifier,
               "drafters": paths, **({"drafter_formats": formats} if formats else {}), "prompts": args.prompts,
               "num_prompts": len(prompts),
               "ar_each": args.ar_each and not args.interleave, "interleave": args.interleave,
               "max_new_tokens": args.max_new_tokens, "dtype": str(dtype).removeprefix("torch."),
               "dtype_choice": dtype_choice, "repeats": args.repeats, "cpu": cpu_record(), "device": "cpu",
               "threads": torch.get_num_threads(), "batch_invariant": warm.batch_invariant,
               "ar": {"tokens_per_second": ar_summary["tokens_per_second"],
                      "decode_ms_per_token": ar_summary["decode_ms_per_token"],
                      "tokens_per_second_at_end": ar_end and ar_end["tokens_per_second"]},
               "rows": rows, "calls": calls}
    table = format_table(["drafter", "draft vocab", "setting", "tau", "draft/verify", "speedup", "ideal", "same as AR"],
                         [[r["drafter"], r["draft_vocab"], r["setting"], r["tau"], r["draft_over_verify"],
                           f"{r['speedup']:.3f}" + (f" ({r['speedup_min']:.3f}-{r['speedup_max']:.3f})"
                                                     if "speedup_min" in r else ""),
                           r["ideal_speedup"], r["identical_turns"]] for r in rows],
                         title=f"ranked draft heads: {len(prompts)} prompts x {args.max_new_tokens} tokens, "
                               f"{summary['dtype']}, {cpu_line(summary['cpu'])}"
                               + (f", speedup median (min-max) of {args.repeats} interleaved passes" if args.repeats > 1
                                  else "") + "; AR "
                               f"{ar_summary['tokens_per_second']:.1f} tok/s " + (
                                   "(pooled over the prompts, interleaved)" if ar_end is None else
                                   f"(at the end: {ar_end['tokens_per_second']:.1f})"))
    return finish(summary, args.out, tables=[table])


if __name__ == "__main__":
    main()
