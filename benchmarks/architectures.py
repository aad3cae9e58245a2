"""Every verifier family the evaluator decodes, measured in one run (benchmark, not a test).

For each ``--family`` (default: all of ``spectrain.data.family_verifiers.FAMILY_OPTIONS``) a small verifier of that
family is trained on the bundled tinyshakespeare text (``family_verifiers.train_verifier``, size ``cpu``), then:

* logits: our decoder (the path ``auto`` picks: the family's own layers unless it is Llama-family) against the
  model's own forward on the same held-out tokens (a prefill, then one token at a time past every sliding window),
  fp32, max |difference|;
* a drafter trained briefly on the same text (``--recipe``, any recipe under ``configs/``, by default EAGLE-1's;
  ``--steps``);
* ``evaluate_drafter`` in fp32 on held-out prompts (the method: the trained drafter's family): chain ``--k`` and,
  where its family grows one, a dynamic tree; τ and whether every output equals AR's::

    python benchmarks/architectures.py [--family gemma2 --family phi3 ...] [--steps 150] \\
        [--out docs/results/architectures.json]

Prints a table and writes the JSON (its path is the last line printed).
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from pathlib import Path

import torch

from spectrain.data.bundled import bundled_text_path
from spectrain.data.text import split_text
from spectrain.data.family_verifiers import FAMILY_OPTIONS, SIZES, train_verifier
from spectrain.eval.evaluate import EvalSettings, evaluate_drafter, load_drafter
from spectrain.eval.families import evaluator_of
from spectrain.eval.prompts import load_prompts
from spectrain.eval.static_model import StaticCausalLM
from spectrain.heads.errors import run_command
from spectrain.heads.families import family_of
from spectrain.heads.report import finish, format_table
from spectrain.heads.verifier import load_verifier
from spectrain.train.cli import train


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="architectures.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--family", action="append", default=None, choices=sorted(FAMILY_OPTIONS))
    p.add_argument("--recipe", default="eagle1_tinyshakespeare.yaml", help="the drafter's recipe (configs/)")
    p.add_argument("--steps", type=int, default=150, help="the drafter's training steps per verifier family")
    p.add_argument("--num_prompts", type=int, default=8)
    p.add_argument("--max_new_tokens", type=int, default=64)
    p.add_argument("--k", type=int, default=4)
    p.add_argument("--dynamic_tree", default="4,2,8", help="depth,topk,budget")
    p.add_argument("--work", default="runs/bench/architectures", help="verifiers and drafters (reused if there)")
    p.add_argument("--out", default="runs/bench/architectures.json")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    run_command(run, parse_args(argv), shlex.join(["python", "benchmarks/architectures.py", *argv]))


def logits_diff(model, tokens: list[int], prefill: int) -> tuple[float, str]:
    """Max |our decoder's logits - the model's own| over a prefill of ``prefill`` tokens and 1-token steps, and
    the path our decoder took."""
    runner = StaticCausalLM(model, max_len=len(tokens) + 1)
    hidden = [runner.forward(torch.tensor(tokens[:prefill]))]
    runner.commit(prefill)
    for t in tokens[prefill:]:
        hidden.append(runner.forward(torch.tensor([t])))
        runner.commit(1)
    with torch.no_grad():
        own = model(torch.tensor([tokens])).logits[0]
        return float((runner.logits(torch.cat(hidden)) - own).abs().max()), runner.path


def measure(family: str, args, work: Path, log) -> dict:
    t0 = time.time()
    verifier_dir = work / family / "verifier"
    if (verifier_dir / "config.json").exists():
        info = json.loads((work / family / "verifier_info.json").read_text())
    else:
        _, info = train_verifier(verifier_dir, "cpu", torch.device("cpu"), log, family)
        (work / family / "verifier_info.json").write_text(json.dumps(info))
    verifier = load_verifier(str(verifier_dir), dtype=torch.float32)
    _, val_text = split_text(bundled_text_path().read_text())
    held_out = verifier.tokenizer(val_text[:4000])["input_ids"][:160]
    diff, path = logits_diff(verifier.model, held_out, 64)
    run = work / family / Path(args.recipe).stem  # one run dir per recipe
    if not (run / "summary.json").exists():
        train(args.recipe, args=[
            "--model.verifier", str(verifier_dir), "--data.path", str(bundled_text_path()),
            "--trainer.max_steps", str(args.steps), "--trainer.val_check_interval", str(args.steps),
            "--trainer.limit_val_batches", "4", "--trainer.precision", "32-true", "--model.measure_prompts", "0",
            "--run_dir", str(run), "--logger", "none"])
    prompts = load_prompts("bundled:tinyshakespeare", args.num_prompts, verifier.tokenizer, prompt_tokens=64)
    depth, topk, budget = (int(x) for x in args.dynamic_tree.split(","))
    drafter = load_drafter(str(run), verifier)
    drafter_family = family_of(drafter)
    grows = evaluator_of(drafter_family).dynamic_trees  # else chains only: its tree columns are None
    settings = EvalSettings(k=args.k, dynamic_tree=(depth, topk, budget) if grows else None,
                            max_new_tokens=args.max_new_tokens, chat_template=False, hf_generate=0, costs=False)
    result = evaluate_drafter(verifier, prompts, drafter, settings)
    chain = result.results[f"chain-{args.k}"]
    tree = result.results[f"dynamic-{depth}x{topk}-{budget}"] if grows else {"tau": None, "identical_to_ar": None}
    row = {"family": family, "decoder": result.decoder, "logits_path": path, "logits_max_abs_diff": diff,
           "verifier_parameters": info["parameters"], "verifier_val_cross_entropy": info["val_cross_entropy"],
           "recipe": args.recipe, "drafter_steps": args.steps, "tau_chain": chain["tau"], "tau_tree": tree["tau"],
           "chain_identical": chain["identical_to_ar"], "tree_identical": tree["identical_to_ar"],
           "ar_tokens_per_second": result.results["ar"]["tokens_per_second"], "seconds": time.time() - t0}
    log(f"{family}: decoder {row['decoder']}, logits diff {diff:.2e}, tau chain {chain['tau']:.3f} / tree "
        f"{'-' if tree['tau'] is None else format(tree['tau'], '.3f')}, identical {row['chain_identical']} / "
        f"{row['tree_identical']}")
    return row


def run(args: argparse.Namespace, command: str):
    work = Path(args.work)
    families = args.family or list(FAMILY_OPTIONS)

    def log(msg):
        print(msg, flush=True)

    rows = [measure(family, args, work, log) for family in families]
    summary = {"command": command, "date": time.strftime("%Y-%m-%d"), "device": "cpu", "dtype": "float32",
               "threads": torch.get_num_threads(), "sizes": dict(zip(
                   ("hidden", "layers", "heads", "intermediate", "steps", "batch", "block"), SIZES["cpu"])),
               "family_options": {f: FAMILY_OPTIONS[f] for f in families},
               "prompts": f"bundled:tinyshakespeare held-out, {args.num_prompts} x 64 tokens",
               "max_new_tokens": args.max_new_tokens, "k": args.k, "dynamic_tree": args.dynamic_tree, "rows": rows}
    table = format_table(["family", "decoder", "logits |diff|", "tau chain", "tau tree", "chain = AR", "tree = AR"],
                         [[r["family"], r["decoder"], f"{r['logits_max_abs_diff']:.1e}", r["tau_chain"], r["tau_tree"],
                           r["chain_identical"], r["tree_identical"]] for r in rows],
                         title=f"verifier families, fp32 on the CPU: {args.recipe} after {args.steps} steps, chain "
                               f"{args.k} and dynamic tree {args.dynamic_tree}, {args.num_prompts} held-out prompts")
    return finish(summary, args.out, tables=[table])


if __name__ == "__main__":
    main()
