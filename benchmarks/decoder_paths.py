"""The verifier's two forwards over our KV cache, side by side in one run (benchmark, not a test): the hand-written
Llama-family layer (``--decoder llama``) and the model's own decoder layers (``--decoder layers``, any family).

Both decode the same prompts, AR and a learned drafter's chain, alternating ``llama, layers, llama, layers, ...``
(``--repeats`` pairs) so the machine's drift falls on both alike. Reported per path: AR and chain tokens/s (mean
over the repeats), τ, the lossless check; across paths: whether AR's and the chain's tokens are identical, and the
largest logit difference of one prefill::

    python benchmarks/decoder_paths.py --verifier bundled:smollm2 --prompts mt_bench.jsonl \\
        --drafter pretrained/smollm2-eagle1 [--num_prompts 8] [--k 5] [--repeats 2] [--dtype bfloat16] \\
        [--out docs/results/decoder_paths.json]

Prints a table and writes the JSON (its path is the last line printed).
"""

from __future__ import annotations

import argparse
import shlex
import statistics
import sys
import time
from dataclasses import replace

import torch

from spectrain.eval.evaluate import EvalSettings, evaluate_drafter, load_drafter
from spectrain.eval.runs import encode_turn
from spectrain.eval.prompts import load_prompts
from spectrain.eval.static_model import StaticCausalLM
from spectrain.heads.errors import run_command
from spectrain.heads.families import family_of
from spectrain.heads.report import finish, format_table
from spectrain.heads.verifier import load_verifier

DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}
PATHS = ("llama", "layers")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="decoder_paths.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--verifier", default="bundled:smollm2")
    p.add_argument("--prompts", required=True, help="MT-bench-style jsonl, or bundled:tinyshakespeare")
    p.add_argument("--drafter", required=True, help="a learned drafter (run dir or export) decoded as a chain")
    p.add_argument("--num_prompts", type=int, default=8)
    p.add_argument("--k", type=int, default=5)
    p.add_argument("--repeats", type=int, default=2, help="llama / layers pairs, alternated")
    p.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES))
    p.add_argument("--max_new_tokens", type=int, default=128)
    p.add_argument("--out", default="runs/bench/decoder_paths.json")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    run_command(run, parse_args(argv), shlex.join(["python", "benchmarks/decoder_paths.py", *argv]))


def settings_from_args(args, decoder: str) -> EvalSettings:
    """What every call decodes with: the drafter's chain of --k through the verifier's ``decoder`` path."""
    return EvalSettings(k=args.k, max_new_tokens=args.max_new_tokens, hf_generate=0, costs=False, decoder=decoder)


def turn_tokens(per_prompt: list[dict]) -> list[list[int]]:
    return [turn["tokens"] for prompt in per_prompt for turn in prompt["turns"]]


def prefill_logits(verifier, text: str, path: str) -> torch.Tensor:
    ids = encode_turn(verifier.tokenizer, [{"role": "user", "content": text}], True)
    runner = StaticCausalLM(verifier.model, max_len=len(ids) + 2, path=path)
    return runner.logits(runner.forward(torch.tensor(ids, device=runner.device)))


def run(args: argparse.Namespace, command: str):
    verifier = load_verifier(args.verifier, dtype=DTYPES[args.dtype])
    bundled = args.prompts.startswith("bundled:")
    prompts = load_prompts(args.prompts, args.num_prompts, verifier.tokenizer, first_turns=not bundled,
                           spread=not bundled)
    drafter = load_drafter(args.drafter, verifier)
    method = family_of(drafter).name
    chain = f"chain-{args.k}"
    settings = {path: settings_from_args(args, path) for path in PATHS}
    for path in PATHS:  # warm-up, untimed
        evaluate_drafter(verifier, prompts[:1], drafter, replace(settings[path], max_new_tokens=16))
    calls = {path: [] for path in PATHS}
    for _ in range(args.repeats):
        for path in PATHS:
            result = evaluate_drafter(verifier, prompts, drafter, settings[path])
            assert result.decoder == path
            calls[path].append(result)
            print(f"{path}: AR {result.results['ar']['tokens_per_second']:.2f} tok/s, {chain} "
                  f"{result.results[chain]['tokens_per_second']:.2f} tok/s", flush=True)
    first = {path: calls[path][0] for path in PATHS}
    same = {setting: all(turn_tokens(first["llama"].per_prompt[setting]) == turn_tokens(r.per_prompt[setting])
                         for rs in calls.values() for r in rs)
            for setting in ("ar", chain)}
    with torch.no_grad():
        logits = {path: prefill_logits(verifier, prompts[0][0], path) for path in PATHS}
    rows = []
    for path in PATHS:
        rs = calls[path]
        rows.append({"decoder": path,
                     "ar_tokens_per_second": statistics.mean(r.results["ar"]["tokens_per_second"] for r in rs),
                     "chain_tokens_per_second": statistics.mean(r.results[chain]["tokens_per_second"] for r in rs),
                     "ar_runs": [r.results["ar"]["tokens_per_second"] for r in rs],
                     "chain_runs": [r.results[chain]["tokens_per_second"] for r in rs],
                     "tau": rs[0].results[chain]["tau"], "speedup": statistics.mean(r.results[chain]["speedup"]
                                                                                   for r in rs),
                     "identical_to_ar": all(r.results[chain]["identical_to_ar"] for r in rs)})
    summary = {"command": command, "date": time.strftime("%Y-%m-%d"), "verifier": args.verifier,
               "drafter": args.drafter, "method": method, "prompts": args.prompts, "num_prompts": len(prompts),
               "max_new_tokens": args.max_new_tokens, "k": args.k, "dtype": args.dtype, "device": "cpu",
               "threads": torch.get_num_threads(), "repeats": args.repeats,
               "batch_invariant": first["llama"].batch_invariant, "rows": rows,
               "same_tokens_across_paths": same,
               "prefill_logits_max_abs_diff": float((logits["llama"] - logits["layers"]).abs().max()),
               "layers_over_llama": {
                   "ar": rows[1]["ar_tokens_per_second"] / rows[0]["ar_tokens_per_second"],
                   "chain": rows[1]["chain_tokens_per_second"] / rows[0]["chain_tokens_per_second"]}}
    table = format_table(["decoder", "AR tok/s", f"{chain} tok/s", "tau", "speedup", "same as AR"],
                         [[r["decoder"], r["ar_tokens_per_second"], r["chain_tokens_per_second"], r["tau"],
                           r["speedup"], r["identical_to_ar"]] for r in rows],
                         title=f"{args.verifier}, {len(prompts)} prompts x {args.max_new_tokens} tokens, {args.dtype}, "
                               f"{args.repeats} alternating repeats; tokens identical across paths: AR "
                               f"{same['ar']}, {chain} {same[chain]}; prefill logits max |diff| "
                               f"{summary['prefill_logits_max_abs_diff']:.3g}")
    return finish(summary, args.out, tables=[table])


if __name__ == "__main__":
    main()
