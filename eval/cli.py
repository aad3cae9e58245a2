"""``spectrain-eval``: speculative decoding with a trained drafter vs. our AR loop vs. HF ``generate()``.

A thin command line around :func:`spectrain.eval.evaluate.evaluate_drafter`: it parses the flags, loads the
verifier, prompts and drafter, calls the API, prints the tables and writes ``eval.json`` (last stdout line: its
path). Imports only torch, transformers and safetensors (matplotlib for the plots, when installed).
"""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

import torch

from spectrain.heads.errors import SpectrainError, run_command
from spectrain.heads.serving.registry import OUR_FORMAT
from spectrain.heads.serving.formats import input_format
from spectrain.heads.report import finish, format_table
from spectrain.heads.precision import resolve_dtype
from spectrain.heads.verifier import load_verifier

from .decode_dtype import cpu_record, decode_dtype
from .evaluate import EvalSettings, evaluate_drafter, load_drafter
from .families import families_with
from .lookahead import GUESSES, WINDOW
from .methods import EvalMethod, all_methods, method_named, methods
from .plots import write_plots
from .prompts import BUNDLED, load_prompts
from .settings import TreeKind


def families_that(wants) -> str:
    """The registered families whose evaluator ``wants`` (for ``--help``; a family without one is skipped)."""
    return ", ".join(f.name for f in families_with(wants))


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="spectrain-eval", description=__doc__,
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--verifier", default="bundled:tinyshakespeare", help="hub id, local dir or bundled:<name>")
    p.add_argument("--gguf_file", default=None, help="GGUF file inside --verifier")
    p.add_argument("--method", default=methods()[0], choices=methods(),
                   help="drafter kind (default: the first bundled family)")
    p.add_argument("--drafter", default=None, help="drafter directory: a train_medusa / train_eagle run dir, or "
                   "an export in any spectrain-export format (vLLM, SGLang, TensorRT-LLM, speculators); "
                   "--method hybrid takes either kind")
    p.add_argument("--drafter_format", default=None, metavar="NAME",
                   help=f"the format --drafter is in, where several registered formats claim its directory: "
                        f"{OUR_FORMAT} (a run directory) or a spectrain-export format; default: detected")
    p.add_argument("--min_match", type=int, default=2,
                   help="--method hybrid: a chain round drafts by prompt lookup when the context's last N or more "
                        "tokens occurred earlier (and by the learned drafter otherwise); trees always carry the "
                        "lookup's continuation as one more branch when there is such a match")
    p.add_argument("--min_match_sampled", type=int, default=4,
                   help="--method hybrid at --temperature > 0: the same for chain rounds (lookup drafts are "
                        "deterministic, accepted with probability q(c): only long matches pay)")
    p.add_argument("--lookup", type=int, default=0, metavar="N",
                   help="--method hybrid: tokens a lookup round drafts (a chain's lookup rounds and a tree's lookup "
                        "branch; default --k): lookup drafts cost nothing to make, so a chain's can be longer "
                        "than the learned drafter's, for a wider verify pass")
    p.add_argument("--min_confidence", type=float, default=0.0, metavar="P",
                   help="a chain verifies only the drafts its confidence head expects to survive: the longest "
                        "prefix whose predicted probability of being accepted whole is >= P (drafters with "
                        "a confidence head; also a hybrid's learned rounds); 0: every draft")
    p.add_argument("--draft_model", default=None, help="draft LM for --method draft-model (same tokenizer)")
    p.add_argument("--draft_layers", type=int, default=1, help="layers kept by --method truncated")
    p.add_argument("--lookahead_window", type=int, default=WINDOW, metavar="W",
                   help="--method lookahead: columns of the Jacobi window run in each verify pass (W)")
    p.add_argument("--lookahead_ngram", type=int, default=None, metavar="N",
                   help="--method lookahead: n-gram size, the window's N - 1 levels (default --k + 1: each round "
                        "verifies guesses of --k tokens, the paper's N - 1; a larger N's guesses are cut to --k)")
    p.add_argument("--lookahead_guesses", type=int, default=GUESSES, metavar="G",
                   help="--method lookahead: n-grams starting with the last token verified a round (G; at most G "
                        "kept per first token)")
    p.add_argument("--allow_verifier_mismatch", action="store_true",
                   help="accept a drafter whose recorded verifier name differs from --verifier (sizes must match)")
    p.add_argument("--k", type=int, default=4, help="chain length (drafts per round; --method lookahead: the "
                   "guessed tokens a round verifies, the paper's N - 1); 0 skips the chain")
    p.add_argument("--tree", default=None,
                   help="static tree: JSON list of rank paths (inline or file), or auto:N for the best N-node tree "
                        f"from measured per-head rank accuracies ({families_that(lambda e: e.rank_trees)})")
    p.add_argument("--dynamic_tree", default=None, metavar="DEPTH,TOPK,BUDGET",
                   help="also evaluate a dynamic tree: the drafter's own top-k expansion "
                        f"({', '.join(m.name for m in all_methods() if TreeKind.DYNAMIC in m.tree_kinds)})")
    p.add_argument("--prompts", default=BUNDLED, help="MT-bench/Alpaca turns jsonl, json, text file, or bundled")
    p.add_argument("--num_prompts", type=int, default=20)
    p.add_argument("--first_turns", action="store_true", help="ask each prompt's first turn only")
    p.add_argument("--spread", action="store_true",
                   help="take rows round-robin over their 'category' (MT-bench: 2 per category for 16), the "
                        "selection spectrain-results uses; with --first_turns, its MT-bench prompts")
    p.add_argument("--prompt_tokens", type=int, default=64, help="prompt length for bundled text prompts")
    p.add_argument("--max_new_tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top_p", type=float, default=1.0)
    p.add_argument("--top_k", type=int, default=0)
    p.add_argument("--chat_template", default="auto", choices=["auto", "on", "off"],
                   help="render prompts with the tokenizer's chat template (auto: on when it has one, off for "
                        "bundled text)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default="auto",
                   help="auto: bf16 where bf16 matrix multiplies are native (CUDA, CPUs with AMX / AVX512-BF16), "
                        "fp32 elsewhere (a rule: the same on every run). Or float32, bfloat16")
    p.add_argument("--batch_invariant", default="auto", choices=["auto", "on", "off"],
                   help="decode so that a token's numbers do not depend on how many tokens a forward runs beside it "
                        "(static attention span, fixed-size attention calls, no 1-row matmuls): bf16 chains then "
                        "equal bf16 AR token for token. auto: on in bf16/fp16 on a CPU, off on CUDA and in fp32")
    p.add_argument("--decoder", default="auto", choices=["auto", "llama", "layers"],
                   help="the verifier's forward over our KV cache: llama (our hand-written Llama / Mistral / Qwen2 / "
                        "Qwen3 layer), layers (the model's own decoder layers: any family whose layers take a cache "
                        "and a 4-D mask), auto (llama where it applies, else layers)")
    p.add_argument("--draft_vocab", type=int, default=None, metavar="N",
                   help="a learned drafter not trained over a fixed draft vocabulary: draft over the N most frequent tokens of the drafter's training data "
                        "(its vocab_ranking.json); 0 = the full vocabulary. Default: the vocabulary it trained over "
                        "(full when it records none). The verifier always verifies over the full vocabulary, so "
                        "outputs are unchanged; only the drafting cost and tau move")
    p.add_argument("--hf_generate", type=int, default=None, metavar="N",
                   help="prompts also decoded by HF generate(), interleaved with ours: every speedup is given "
                        "over our AR and over HF generate() (default: every prompt; 0: skip)")
    p.add_argument("--compile", action="store_true",
                   help="compile the verifier's forwards for every verify size this job uses (bucketed; CUDA graphs "
                        "on CUDA, Inductor elsewhere), warmed up before timing (the time is reported apart); on CUDA "
                        "HF generate() runs with its static cache compiled too, so the baselines are like for like")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="output directory (default runs/eval/<method>-<verifier>)")
    p.add_argument("--trust_remote_code", action="store_true")
    return p.parse_args(argv)




def named_values(specs: list[str], flag: str) -> dict[str, str]:
    """``["NAME=VALUE", ...]`` (a repeated flag) -> {NAME: VALUE}; a malformed spec or a NAME given twice is refused."""
    out = {}
    for spec in specs:
        name, sep, value = spec.partition("=")
        if not sep or not name or not value:
            raise SpectrainError(f"{flag} takes NAME=VALUE, got {spec!r}")
        if name in out:
            raise SpectrainError(f"{flag} names {name!r} twice")
        out[name] = value
    return out


def settings_from_args(args) -> EvalSettings:
    """Every flag that says how to draft, decode and measure, as the one :class:`EvalSettings` (checked as it is
    made, before anything loads). ``--chat_template auto``: on where the tokenizer has one, off for bundled text."""
    return EvalSettings(
        k=args.k, tree=args.tree, dynamic_tree=args.dynamic_tree, lookup=args.lookup,
        min_confidence=args.min_confidence, draft_layers=args.draft_layers,
        lookahead_window=args.lookahead_window, lookahead_ngram=args.lookahead_ngram,
        lookahead_guesses=args.lookahead_guesses, min_match=args.min_match,
        min_match_sampled=args.min_match_sampled, max_new_tokens=args.max_new_tokens, temperature=args.temperature,
        top_p=args.top_p, top_k=args.top_k,
        chat_template={"on": True, "off": False}.get(args.chat_template, False if args.prompts == BUNDLED else None),
        compile=args.compile, hf_generate=args.hf_generate, seed=args.seed,
        batch_invariant={"auto": None, "on": True, "off": False}[args.batch_invariant], draft_vocab=args.draft_vocab,
        decoder=args.decoder)


def checked(args) -> tuple[EvalMethod, EvalSettings]:
    """``--method`` and the settings the flags name, checked against each other before anything loads."""
    method, settings = method_named(args.method), settings_from_args(args)
    method.check(settings)
    return method, settings


def evaluate(args: argparse.Namespace, command: str | None = None) -> Path:
    """Load what the flags name, evaluate, write ``eval.json`` and the plots; returns the JSON's path."""
    method, settings = checked(args)  # before anything is loaded
    if args.drafter_format and not method.needs_drafter:
        raise SpectrainError(f"--drafter_format names the format of a learned --drafter: --method {args.method} "
                             "loads none")
    if args.drafter_format and not args.drafter:
        raise SpectrainError("--drafter_format names the format of --drafter: give --drafter")
    input_format(args.drafter_format)
    if args.dtype == "auto":
        dtype, dtype_choice = decode_dtype(args.device)
    else:
        dtype, dtype_choice = resolve_dtype(args.dtype, args.device), {"rule": "set by --dtype"}
    load = dict(gguf_file=args.gguf_file, device=args.device, trust_remote_code=args.trust_remote_code)
    verifier = load_verifier(args.verifier, dtype=dtype, **load)
    prompts = load_prompts(args.prompts, args.num_prompts, verifier.tokenizer, args.prompt_tokens,
                           first_turns=args.first_turns, spread=args.spread)
    drafter = None
    if method.needs_drafter:
        drafter = load_drafter(args.drafter, verifier, args.method, args.allow_verifier_mismatch, args.drafter_format)
    if method.needs_draft_model:
        drafter = load_draft_model(args.draft_model, verifier, args.device)
    result = evaluate_drafter(verifier, prompts, method, settings, drafter=drafter)
    out_dir = Path(args.out or f"runs/eval/{args.method}-{Path(args.verifier.replace(':', '-')).name}")
    out_dir.mkdir(parents=True, exist_ok=True)
    summary = {"command": command or "spectrain-eval", "verifier": args.verifier, "drafter": args.drafter,
               **({"drafter_format": args.drafter_format} if args.drafter_format else {}),
               "prompts": args.prompts, "dtype_choice": dtype_choice, "cpu": cpu_record(), **result.to_dict()}
    summary["plots"] = write_plots(summary, out_dir)
    return finish(summary, out_dir / "eval.json", tables=tables(summary))


def load_draft_model(path: str | None, verifier, device: str) -> torch.nn.Module:
    """``--draft_model`` in the verifier's dtype; its vocabulary must be the verifier's."""
    if not path:
        raise SpectrainError("--method draft-model needs --draft_model")
    model = load_verifier(path, dtype=next(verifier.model.parameters()).dtype, device=device).model
    if model.get_output_embeddings().weight.shape[0] != verifier.model.get_output_embeddings().weight.shape[0]:
        raise SpectrainError("the draft model's vocabulary differs from the verifier's")
    return model


def identity(r: dict, temperature: float) -> str:
    """The table's lossless column: "yes", "n/a" at T > 0, else identical turns out of all."""
    if temperature:
        return "n/a"
    return "yes" if r.get("identical_to_ar") else f"{r['identical_turns']}/{r['divergences']['turns']}"


def divergence_line(d: dict) -> str:
    """Where T = 0 outputs part from AR, in a line: near-ties or not, with both paths' own margins."""
    spread = d["spread"]
    unmeasured = sum(not c["replayed"] for c in d["cases"])
    beyond = d["diverged"] - unmeasured - d["near_ties"]
    verdict = ("all near-ties" if not beyond else f"{beyond} beyond rounding (the spread and 2 ulp): a decoding bug?")
    if unmeasured:
        verdict += f"; {unmeasured} not measured (a replay did not reproduce the records: another decoder made them)"
    return (f"{d['diverged']} of {d['turns']} turns part from AR ({d['inherited']} more only after an earlier turn "
            f"parted): {verdict} — largest own top-2 margin {d['max_margin']:.3f}, largest flip {d['max_flip']:.3f} "
            f"vs the paths' margin spread before parting {spread['max']:.3f} (p99 {spread['p99']:.3f}, "
            f"{spread['positions']} positions)")


def tables(summary: dict) -> list[str]:
    rows = []
    for name, r in summary["results"].items():
        rows.append([name, r.get("tree_size", 0), r["tau"], r["tokens_per_second"], r["decode_ms_per_token"],
                     r.get("speedup", 1.0), "-" if r.get("speedup_over_hf") is None else r["speedup_over_hf"],
                     "-" if r.get("ideal_speedup") is None else r["ideal_speedup"],
                     "-" if r.get("draft_over_verify") is None else round(r["draft_over_verify"], 3),
                     "-" if r.get("round_ms") is None else
                     "/".join(f"{r['round_ms'][p]:.2f}" for p in ("draft", "verify", "other")), r["distinct_4gram"],
                     "-" if name == "ar" else identity(r, summary["sampling"]["temperature"])])
    hf = summary["hf_generate"]
    title = (f"{summary['method']} on {summary['verifier']} — {summary['num_prompts']} prompts, "
             f"T={summary['sampling']['temperature']}, {summary['max_new_tokens']} new tokens, {summary['device']} {summary['dtype']}"
             + (" batch-invariant" if summary.get("batch_invariant") else "")
             + (f"; decoder: {summary['decoder']}" if summary.get("decoder") else "")
             + (f"; draft vocabulary {summary['draft_vocab']}" if summary.get("draft_vocab") else "")
             + (f"; HF generate(): {hf['tokens_per_second']:.1f} tok/s, interleaved on {hf['prompts']} prompts"
                if hf else ""))
    out = [format_table(["setting", "nodes", "tau", "tok/s", "ms/token", "speedup over AR", "over HF", "ideal",
                         "draft/verify",
                         "round ms: draft/verify/other", "distinct-4", "same as AR"], rows, title=title)]
    for name, r in summary["results"].items():
        if name == "ar":
            continue
        alpha = " ".join("-" if a is None else f"{a:.2f}" for a in r["alpha"])
        out.append(f"{name}: alpha by depth [{alpha}]  accept-length histogram {r['accept_histogram']}")
        if r.get("divergences", {}).get("diverged") or r.get("divergences", {}).get("inherited"):
            out.append(f"{name}: {divergence_line(r['divergences'])}")
    cal = summary["calibration"]
    if cal:
        out.append(format_table(["head", "top-1 vs verifier", "top-5", "KL(q||p)", "TV"],
                                [[k + 1, acc[0], sum(acc[:5]), kl, tv] for k, (acc, kl, tv) in
                                 enumerate(zip(cal["rank_accuracy"], cal["kl"], cal["tv"]))],
                                title="drafter quality on the AR outputs (teacher-forced)"))
    planner = summary["planner"] or {}
    rows = [["chain", r["n"], r["expected_tau"], r["expected_speedup"]] for r in planner.get("chains", [])]
    rows += [["tree", r["n"], r["expected_tau"], r["expected_speedup"]] for r in planner.get("trees", [])]
    if rows:
        best = [planner.get("best_chain"), planner.get("best_tree")]
        best = max((b for b in best if b), key=lambda r: r["expected_speedup"])
        out.append(format_table(["kind", "n", "expected tau", "expected speedup"], rows,
                                title=f"planner (measured alpha, rank accuracies and costs): best n = {best['n']}"))
    return out


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    run_command(evaluate, parse_args(argv), shlex.join(["spectrain-eval", *argv]))


if __name__ == "__main__":
    main()
