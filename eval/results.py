"""``spectrain-results``: the results table — trained drafters on real prompt sets, one resumable row at a time.

For every ``--drafter NAME=PATH`` (a ``train_medusa`` / ``train_eagle`` run or any export) it measures, with the
real speculative loop of :mod:`.decode` on the verifier:

* MT-bench first turns (stratified over its 8 categories when fewer than 80 are asked for), T = 0: a chain of
  ``--k`` drafts and the best tree of ``<= --tree_nodes`` draft nodes (a family that calibrates rank trees: the tree
  built from the heads' rank accuracies measured on the verifier's own outputs; one that grows dynamic trees: a
  dynamic tree with that budget);
* the same chain at T = ``--sampled_temperature`` for the drafters named by ``--sampled`` (rejection sampling);
* the chain at T = 0 on Alpaca-80 and on GSM8K questions used as prompts;

and reports τ (pooled), α by position, τ per MT-bench category, whether every T = 0 output equals the verifier's
greedy output (plain AR decoding of the same prompts, run once per prompt set), and each drafter's training data,
steps and wall time (from its run's ``summary.json``).

Resumable per row: each finished row is written atomically to ``OUT/rows/<row>.json`` with the settings and the
drafter's weights fingerprint; a rerun skips rows that match and redoes only missing or stale ones, so a killed
run loses at most the row in flight and never doubles one. Other settings on an existing ``OUT`` are refused
(``--force`` starts over).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import shlex
import shutil
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any, NamedTuple

import torch

from spectrain.heads.errors import SpectrainError, run_command
from spectrain.heads.families import family_of
from spectrain.heads.serving.registry import OUR_FORMAT
from spectrain.heads.io import read_json, sha256_files, write_json
from spectrain.heads.serving.formats import detect_format
from spectrain.heads.report import finish, format_table
from spectrain.heads.precision import resolve_dtype
from spectrain.heads.verifier import load_verifier, max_context

from . import metrics
from .cli import named_values
from .drafters import check_min_match
from .evaluate import EvalResult, EvalSettings, evaluate_drafter, load_drafter
from .lookahead import GUESSES, NGRAM, WINDOW, check_lookahead, forward_rows
from .families import evaluator_of, families_with
from .prompts import prompt_rows
from .runs import encode_turn, summarize
from .static_model import default_batch_invariant

PROMPT_SETS = ("mt_bench", "alpaca", "gsm8k")
TRAINING_FREE = {"ngram": "prompt lookup (training-free)", "lookahead": "lookahead decoding (training-free)"}


def published() -> list[dict]:
    """Figures the registered families' papers report, for the side-by-side (their setting differs from ours and
    the table says how)."""
    return [dict(row) for family in families_with(lambda e: bool(e.published))
            for row in evaluator_of(family).published]


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="spectrain-results", description=__doc__.split("\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--verifier", default="bundled:smollm2", help="hub id, local dir or bundled:<name>")
    p.add_argument("--drafter", action="append", default=[], metavar="NAME=PATH",
                   help="a drafter to evaluate (repeatable): run dir or export; NAME labels its rows")
    p.add_argument("--drafter_format", action="append", default=[], metavar="NAME=FORMAT",
                   help=f"the format of --drafter NAME's directory, where several registered formats claim it "
                        f"(repeatable): {OUR_FORMAT} (a run directory) or a spectrain-export format; default: detected")
    p.add_argument("--ngram", action="store_true",
                   help="also measure prompt lookup (training-free; rows named 'ngram': the chain, no tree)")
    p.add_argument("--lookahead", action="store_true",
                   help="also measure lookahead decoding (training-free; rows named 'lookahead': guesses of N - 1 "
                        "tokens, so the chain of N - 1, no tree)")
    p.add_argument("--lookahead_window", type=int, default=WINDOW, metavar="W", help="lookahead's Jacobi window")
    p.add_argument("--lookahead_ngram", type=int, default=NGRAM, metavar="N", help="lookahead's n-gram size")
    p.add_argument("--lookahead_guesses", type=int, default=GUESSES, metavar="G",
                   help="lookahead's n-grams verified a round")
    p.add_argument("--hybrid", action="append", default=[], metavar="NAME",
                   help="also measure prompt lookup + the --drafter NAME in one drafter (rows 'hybrid-NAME'; "
                        "repeatable); its trees hold the lookup branch within the same --tree_nodes budget")
    p.add_argument("--min_match", type=int, default=2,
                   help="hybrid chain rounds draft by lookup when the context's last N+ tokens occurred earlier")
    p.add_argument("--min_match_sampled", type=int, default=4,
                   help="the same for the hybrid's --sampled rows (lookup drafts are deterministic: accepted with "
                        "probability q(c), so only long matches pay)")
    p.add_argument("--sampled", action="append", default=[], metavar="NAME",
                   help="also measure this row's chain at --sampled_temperature (repeatable; a --drafter name, "
                        "'ngram', 'lookahead' or 'hybrid-NAME')")
    p.add_argument("--mt_bench", default="", help="MT-bench questions jsonl ('turns', 'category'; skipped when empty)")
    p.add_argument("--alpaca", default="", help="Alpaca-80 jsonl ('instruction', 'input'; skipped when empty)")
    p.add_argument("--gsm8k", default="", help="GSM8K jsonl ('question'; skipped when empty)")
    p.add_argument("--num_prompts", nargs="+", default=["80"], metavar="N|SET=N",
                   help="prompts per set (MT-bench: spread over categories); SET=N sets one set's count")
    p.add_argument("--max_new_tokens", type=int, default=128)
    p.add_argument("--k", type=int, default=5, help="chain length")
    p.add_argument("--tree_nodes", type=int, default=64, help="draft-node budget of the tree rows (0 skips them)")
    p.add_argument("--tree_depth", type=int, default=6, help="dynamic trees: depth")
    p.add_argument("--tree_topk", type=int, default=8, help="dynamic trees: children expanded per node")
    p.add_argument("--sampled_temperature", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default="auto",
                   help="auto (bf16 on CUDA and on CPUs with native bf16 matmuls, fp32 elsewhere: the rule "
                        "spectrain-eval uses, so resumed rows keep one dtype), float32 or bfloat16")
    p.add_argument("--out", default="runs/results")
    p.add_argument("--force", action="store_true", help="discard the rows of an existing --out with other settings")
    return p.parse_args(argv)


# -------------------------------------------------------------------------------------------- prompts


def load_set(name: str, path: str, n: int) -> list[dict]:
    """``[{"prompt": str, "category": str}]``: the first turns of the first ``n`` records (MT-bench: round-robin
    over its categories in file order, so any ``n`` covers them evenly) — Alpaca-80 instructions (+ input),
    GSM8K questions."""
    if not Path(path).is_file():
        raise SpectrainError(f"--{name} {path}: file not found")
    rows = prompt_rows(path, spread=name == "mt_bench")[:n]
    return [{"prompt": turns[0], "category": category or ("none" if name == "mt_bench" else name)}
            for turns, category in rows]


# -------------------------------------------------------------------------------------------- drafters


def fingerprint(path: str) -> str:
    """SHA-256 over the drafter's weight files: a retrained drafter in the same directory invalidates its rows."""
    files = sorted(Path(path).glob("*.safetensors")) if Path(path).is_dir() else [Path(path)]
    if not files:
        raise SpectrainError(f"drafter {path}: no .safetensors weights found")
    return sha256_files(*files, names=True)[:16]


def training_info(path: str) -> dict:
    """Training data, steps, tokens and wall time from a run's ``summary.json`` (exports: unknown)."""
    summary = Path(path) / "summary.json"
    if not summary.is_file():
        return {}
    s = json.loads(summary.read_text())
    info = {k: s.get(k) for k in ("method", "data", "steps", "trained_tokens", "wall_seconds", "tau_pred")}
    # The run records its data path as given: relative to where training ran (usually the run dir's parent).
    candidates = (base / str(s.get("data")) / "train" / "metadata.json" for base in (Path.cwd(), Path(path).resolve().parent))
    store = next((c for c in candidates if c.is_file()), None)
    if s.get("data_format") == "store" and store is not None:  # name the corpus behind the hidden-state store
        meta = json.loads(store.read_text())
        info.update(store=info["data"], data=meta.get("data"), store_rows=meta.get("rows"))
    return info


def prompt_counts(specs: list[str]) -> dict[str, int]:
    """``["16"]`` -> 16 for every set; ``["16", "gsm8k=8"]`` -> 16, but 8 for GSM8K."""
    counts, default = {}, None
    for spec in specs:
        name, sep, value = spec.rpartition("=")
        if sep and name not in PROMPT_SETS:
            raise SpectrainError(f"--num_prompts {spec!r}: unknown set {name!r}; sets: {', '.join(PROMPT_SETS)}")
        try:
            n = int(value)
        except ValueError:
            raise SpectrainError(f"--num_prompts takes N or SET=N, got {spec!r}") from None
        if n < 1:
            raise SpectrainError(f"--num_prompts must be >= 1, got {spec!r}")
        if sep:
            counts[name] = n
        else:
            default = n
    return {name: counts.get(name, default if default is not None else 80) for name in PROMPT_SETS}


def parse_drafters(specs: list[str]) -> dict[str, str]:
    drafters = {}
    for spec in specs:
        name, sep, path = spec.partition("=")
        if not sep or not name or not path:
            raise SpectrainError(f"--drafter takes NAME=PATH, got {spec!r}")
        if "__" in name or "/" in name:
            raise SpectrainError(f"--drafter name {name!r} may not contain '__' or '/'")
        if name in TRAINING_FREE or name.startswith("hybrid-"):
            raise SpectrainError(f"--drafter name {name!r} is reserved for the --ngram / --lookahead / --hybrid rows")
        if name in drafters:
            raise SpectrainError(f"--drafter name {name!r} given twice")
        if not Path(path).exists():
            raise SpectrainError(f"--drafter {name}: {path} not found")
        drafters[name] = path
    return drafters


def drafter_formats(specs: list[str], drafters: dict[str, str]) -> dict[str, str]:
    """``--drafter_format NAME=FORMAT`` -> {drafter name: its directory's format}, each a --drafter's. Every
    drafter's format is settled here, before anything is measured: a directory several formats claim without
    a --drafter_format, or one not in the format named, is refused now, not after the greedy references."""
    formats = named_values(specs, "--drafter_format")
    for name, fmt in formats.items():
        if name not in drafters:
            raise SpectrainError(f"--drafter_format {name}={fmt}: no --drafter of that name")
    for name, path in drafters.items():
        detect_format(path, formats.get(name))
    return formats


# -------------------------------------------------------------------------------------------- rows


def rows_key(args, name: str, path: str, formats: dict[str, str]) -> str:
    """What a drafter's cached rows are keyed by: its weights' fingerprint, a hybrid's lookup settings, and the
    format it was read in where ``--drafter_format`` named one (the same weights through another format's loader
    are new rows); prompt lookup alone has no weights."""
    if name == "ngram":
        return "ngram-max3"
    if name == "lookahead":
        return f"lookahead-w{args.lookahead_window}n{args.lookahead_ngram}g{args.lookahead_guesses}"
    learned = name.removeprefix("hybrid-")
    hybrid = f"-hybrid-m{args.min_match}s{args.min_match_sampled}" if name != learned else ""
    return fingerprint(path) + hybrid + (f"-as-{formats[learned]}" if learned in formats else "")


def plan_rows(args, drafters: dict[str, str], sets: dict[str, list[dict]]) -> list[dict]:
    """Every row to measure, in the order the table reads."""
    unknown = sorted(set(args.sampled) - set(drafters))
    if unknown:
        raise SpectrainError(f"--sampled names no --drafter: {unknown}")
    rows = []  # set by set, so a partial run already has whole sets

    def chain(name: str) -> str:  # lookahead's guesses are N - 1 tokens long: its chain
        return f"chain-{args.lookahead_ngram - 1 if name == 'lookahead' else args.k}"

    if "mt_bench" in sets:
        for name in drafters:
            rows.append({"drafter": name, "set": "mt_bench", "setting": chain(name), "temperature": 0.0})
            if args.tree_nodes and name not in TRAINING_FREE:
                rows.append({"drafter": name, "set": "mt_bench", "setting": f"tree-{args.tree_nodes}",
                             "temperature": 0.0})
            if name in args.sampled:
                rows.append({"drafter": name, "set": "mt_bench", "setting": chain(name),
                             "temperature": args.sampled_temperature})
    for other in ("alpaca", "gsm8k"):
        if other in sets:
            rows.extend({"drafter": name, "set": other, "setting": chain(name), "temperature": 0.0}
                        for name in drafters)
    for r in rows:
        r["key"] = f"{r['drafter']}__{r['set']}__{r['setting']}__T{r['temperature']:g}"
    return rows


class RowCall(NamedTuple):
    """One :func:`~.evaluate.evaluate_drafter` call: the method's name, its learned drafter (or None) and the
    settings."""

    method: str
    drafter: Any
    settings: EvalSettings


def settings_from_args(args, max_len: int) -> EvalSettings:
    """What every row and greedy reference decodes with, from the flags (the one place): the chat template, one
    KV-cache size for every row, no cost probes, no HF timing; each row varies it (:func:`row_options`)."""
    return EvalSettings(k=args.k, max_new_tokens=args.max_new_tokens, seed=args.seed, min_match=args.min_match,
                        min_match_sampled=args.min_match_sampled, lookahead_window=args.lookahead_window,
                        lookahead_ngram=args.lookahead_ngram, lookahead_guesses=args.lookahead_guesses,
                        chat_template=True, hf_generate=0, costs=False, max_len=max_len)


class Context:
    """The verifier, the prompt sets, the settings and the loaded drafters (loaded once, on demand)."""

    def __init__(self, args, sets: dict[str, list[dict]], formats: dict[str, str] | None = None):
        self.args = args
        self.formats = formats or {}  # drafter name -> its directory's format, where --drafter_format names one
        self.verifier = load_verifier(args.verifier, dtype=resolve_dtype(args.dtype, args.device), device=args.device)
        self.tokenizer = self.verifier.tokenizer
        if not getattr(self.tokenizer, "chat_template", None):
            raise SpectrainError(f"verifier {args.verifier} has no chat template: the prompt sets are chat prompts")
        self.prompts = {name: [[p["prompt"]] for p in prompts] for name, prompts in sets.items()}
        context = max_context(self.verifier.config)
        longest = max(len(encode_turn(self.tokenizer, [{"role": "user", "content": turns[0]}], True))
                      for prompts in self.prompts.values() for turns in prompts)
        widest = forward_rows(args.lookahead_window, args.lookahead_ngram, args.lookahead_guesses) - 1 \
            if args.lookahead else 0  # lookahead's window runs beside its guesses
        self.max_len = longest + args.max_new_tokens + max(args.tree_nodes, args.k, widest) + 2
        if self.max_len > context:
            raise SpectrainError(f"the longest prompt ({longest} tokens) + --max_new_tokens {args.max_new_tokens} "
                                 f"exceeds the verifier's context of {context}")
        self.settings = settings_from_args(args, self.max_len)
        self._drafters: dict[str, object] = {}

    def drafter(self, name: str, path: str):
        """The trained drafter named ``name`` (loaded on first use)."""
        if name not in self._drafters:
            self._drafters[name] = load_drafter(path, self.verifier, fmt=self.formats.get(name))
        return self._drafters[name]

    def evaluate(self, set_name: str, call: RowCall, reference: list[dict] | None = None) -> EvalResult:
        """One setting on one prompt set through :func:`.evaluate.evaluate_drafter`."""
        return evaluate_drafter(self.verifier, self.prompts[set_name], call.method, call.settings,
                                drafter=call.drafter, reference=reference)

    def sample_outputs(self, records: list[dict]) -> list[str]:
        """The first two outputs as text, for reading the table against what was generated."""
        return [self.tokenizer.decode(t["tokens"], skip_special_tokens=True) for r in records[:2] for t in r["turns"]]


def row_options(ctx: Context, row: dict, path: str) -> tuple[RowCall, dict]:
    """The row's :func:`evaluate_drafter` call (the context's settings, varied for the row) and what defines its
    drafter (for the table and the JSON)."""
    args = ctx.args
    name, chain = row["drafter"], row["setting"].startswith("chain")
    base = replace(ctx.settings, temperature=row["temperature"])
    if name == "ngram":
        return RowCall("ngram", None, replace(base, k=args.k)), {"tree": "chain", "nodes": args.k}
    if name == "lookahead":  # its method sets the chain to N - 1
        w, n, g = args.lookahead_window, args.lookahead_ngram, args.lookahead_guesses
        return RowCall("lookahead", None, replace(base, k=n - 1)), {
            "tree": f"lookahead: up to {g} guesses of {n - 1} tokens + a {w} x {n - 1} Jacobi window",
            "nodes": forward_rows(w, n, g) - 1, "window": w, "ngram": n, "guesses": g}
    hybrid = name.startswith("hybrid-")
    learned = ctx.drafter(name[len("hybrid-"):] if hybrid else name, path)
    family = family_of(learned)  # a drafter of no registered family is refused, never labelled another's
    evaluator = evaluator_of(family)
    depth = evaluator.max_depth(learned)
    if chain and depth is not None and depth < args.k:
        raise SpectrainError(f"drafter {name} ({family.label}) drafts at most {depth} tokens a round; a chain of "
                             f"{args.k} needs {args.k}: lower --k (or train it deeper)")
    if not chain and not (evaluator.dynamic_trees or evaluator.rank_trees):
        raise SpectrainError(f"drafter {name}: {family.label} drafters grow neither dynamic trees nor trees from "
                             "rank accuracies, so they have no tree rows: pass --tree_nodes 0")
    if chain:
        settings = replace(base, k=args.k)
        definition = {"tree": "chain", "nodes": args.k}
    else:
        reserve = args.k if hybrid else 0  # the lookup branch's nodes, within the same budget
        if evaluator.dynamic_trees:  # a dynamic tree with the node budget
            settings = replace(base, k=0, lookup=reserve,
                               dynamic_tree=(args.tree_depth, args.tree_topk, args.tree_nodes))
            definition = {"tree": evaluator.dynamic_tree_name, "nodes": args.tree_nodes, "depth": args.tree_depth,
                          "topk": args.tree_topk}
        else:  # rank trees: the most likely rank paths from the heads' rank accuracies on this set
            settings = replace(base, k=0, lookup=reserve, tree=f"auto:{args.tree_nodes - reserve}")
            definition = {"tree": "static, from rank accuracies on the verifier's greedy outputs of this set",
                          "nodes": args.tree_nodes}
    if hybrid:
        definition = {**definition, "min_match": args.min_match, "min_match_sampled": args.min_match_sampled,
                      "tree": ("chain: prompt lookup when it matches, else " if chain else
                               "the learned tree + the lookup branch; learned: ") + definition["tree"]}
    return RowCall("hybrid" if hybrid else family.name, learned, settings), definition


def per_category(records: list[dict], prompts: list[dict]) -> dict[str, float]:
    groups: dict[str, list[list[int]]] = {}
    for r, p in zip(records, prompts):
        groups.setdefault(p["category"], []).extend(t["emitted_per_round"] for t in r["turns"])
    return {cat: metrics.tau(rounds) for cat, rounds in groups.items()}


def measure_row(ctx: Context, row: dict, path: str, reference: list[dict], prompts: list[dict]) -> dict:
    call, definition = row_options(ctx, row, path)
    t0 = time.time()
    result = ctx.evaluate(row["set"], call, reference)
    setting = next(name for name in result.results if name != "ar")
    summary, records = result.results[setting], result.per_prompt[setting]
    depth = len(summary["alpha"])
    if result.calibration is not None:
        definition["rank_accuracy"] = result.calibration["rank_accuracy"]
    if not row["setting"].startswith("chain") or definition.get("min_match"):
        definition["depth"] = depth
    if "lookup_round_fraction" in summary:
        definition["lookup_round_fraction"] = summary["lookup_round_fraction"]
    return {**row, **definition, "tau": summary["tau"], "alpha": summary["alpha"],
            "accept_histogram": summary["accept_histogram"], "verifier_forwards": summary["verifier_forwards"],
            "new_tokens": summary["new_tokens"], "tokens_per_second": summary["tokens_per_second"],
            "identical_to_greedy": summary["identical_turns"] if row["temperature"] == 0 else None,
            "prompts": len(records), "per_category_tau": per_category(records, prompts),
            "seconds": round(time.time() - t0, 1), "outputs": ctx.sample_outputs(records)}


# -------------------------------------------------------------------------------------------- driver


def settings_of(args, sets: dict[str, list[dict]]) -> dict:
    """What the rows depend on: settings common to every row, and per prompt set its file, size and content hash
    (so a run over fewer sets shares the rows of the sets it has)."""
    common = {"verifier": args.verifier, "max_new_tokens": args.max_new_tokens, "k": args.k,
              "tree_nodes": args.tree_nodes, "tree_depth": args.tree_depth, "tree_topk": args.tree_topk,
              "sampled_temperature": args.sampled_temperature, "seed": args.seed,
              "dtype": str(resolve_dtype(args.dtype, args.device)).replace("torch.", ""),  # what auto meant here
              "device": args.device}
    per_set = {name: {"file": Path(getattr(args, name)).name, "prompts": len(prompts),
                      "sha256": hashlib.sha256(json.dumps(prompts, sort_keys=True).encode()).hexdigest()[:16]}
               for name, prompts in sets.items()}
    return {"common": common, "sets": per_set}


def open_out(out: Path, settings: dict, force: bool) -> Path:
    """The rows directory of ``out``, after checking (or, with ``force``, resetting) its settings.

    The common settings must match, and so must every prompt set both runs have; new sets are added."""
    rows_dir, settings_path = out / "rows", out / "settings.json"
    merged = settings
    if settings_path.is_file():
        old = read_json(settings_path, "results settings")
        if not isinstance(old, dict) or set(old) != {"common", "sets"}:
            old = {"common": old, "sets": {}}  # unrecognised: treated as different settings below
        changed = sorted(k for k in set(old["common"]) | set(settings["common"])
                         if old["common"].get(k) != settings["common"].get(k))
        changed += sorted(f"{name} prompts" for name in set(old["sets"]) & set(settings["sets"])
                          if old["sets"][name] != settings["sets"][name])
        if changed and not force:
            raise SpectrainError(f"{out} holds rows measured with other settings ({', '.join(changed)}); "
                                 "use another --out, or --force to discard them")
        if changed:
            shutil.rmtree(rows_dir, ignore_errors=True)
        else:
            merged = {"common": settings["common"], "sets": {**old["sets"], **settings["sets"]}}
    rows_dir.mkdir(parents=True, exist_ok=True)
    write_json(settings_path, merged)
    return rows_dir


def cached(path: Path, fingerprint_: str | None) -> dict | None:
    if not path.is_file():
        return None
    try:
        row = json.loads(path.read_text())
    except json.JSONDecodeError:
        return None  # written atomically, so only a hand-edited file gets here: measure again
    return row if row.get("fingerprint") == fingerprint_ else None


def results(args: argparse.Namespace, command: str = "spectrain-results", log=print) -> Path:
    counts = prompt_counts(args.num_prompts)
    for key in ("max_new_tokens", "k"):
        if getattr(args, key) < 1:
            raise SpectrainError(f"--{key} must be >= 1, got {getattr(args, key)}")
    if args.tree_nodes < 0 or args.tree_depth < 1 or args.tree_topk < 1:
        raise SpectrainError("--tree_nodes must be >= 0 and --tree_depth / --tree_topk >= 1")
    if args.sampled_temperature <= 0:
        raise SpectrainError(f"--sampled_temperature must be > 0, got {args.sampled_temperature}")
    drafters = parse_drafters(args.drafter)
    formats = drafter_formats(args.drafter_format, drafters)
    learned = dict(drafters)
    for name in args.hybrid:
        if name not in learned:
            raise SpectrainError(f"--hybrid {name}: no --drafter of that name")
        drafters[f"hybrid-{name}"] = learned[name]
    if args.ngram:
        drafters["ngram"] = ""
    if args.lookahead:
        check_lookahead(args.lookahead_window, args.lookahead_ngram, args.lookahead_guesses)
        drafters["lookahead"] = ""
    if not drafters:
        raise SpectrainError("nothing to measure: give --drafter NAME=PATH, --ngram and/or --lookahead")
    check_min_match(args.min_match, args.min_match_sampled)
    if args.hybrid and args.tree_nodes and args.tree_nodes <= args.k:
        raise SpectrainError(f"--tree_nodes {args.tree_nodes} leaves no room beside the hybrid's lookup branch of "
                             f"--k {args.k}")
    sets = {name: load_set(name, getattr(args, name), counts[name]) for name in PROMPT_SETS if getattr(args, name)}
    if not sets:
        raise SpectrainError("no prompt sets: give --mt_bench, --alpaca and/or --gsm8k")
    rows = plan_rows(args, drafters, sets)
    out = Path(args.out)
    ctx = Context(args, sets, formats)
    settings = settings_of(args, sets)
    # Batch-invariant numbers depend on the decoder's buffer width (the attention span): rows and references
    # made with another width or mode are not this run's.
    settings["common"].update(max_len=ctx.max_len, batch_invariant=default_batch_invariant(
        args.device, resolve_dtype(args.dtype, args.device)))
    rows_dir = open_out(out, settings, args.force)
    prints = {name: rows_key(args, name, path, formats) for name, path in drafters.items()}
    t0 = time.time()

    references = {}

    def reference(name: str) -> dict:
        """Plain greedy decoding of a set (measured once): the lossless reference and the AR speed."""
        if name not in references:
            path = rows_dir / f"greedy__{name}.json"
            ref = cached(path, "greedy")
            if ref is None:
                start = time.time()
                records = ctx.evaluate(name, RowCall("none", None, ctx.settings)).per_prompt["ar"]
                s = summarize(records, 0)
                ref = {"fingerprint": "greedy", "set": name, "tokens_per_second": s["tokens_per_second"],
                       "new_tokens": s["new_tokens"], "seconds": round(time.time() - start, 1), "records": records,
                       "outputs": ctx.sample_outputs(records)}
                write_json(path, ref)
                log(f"results: greedy reference on {name}: {s['new_tokens']} tokens, {s['tokens_per_second']:.1f} tok/s")
            references[name] = ref
        return references[name]

    done = []
    for i, row in enumerate(rows, 1):
        path = rows_dir / f"{row['key']}.json"
        result = cached(path, prints[row["drafter"]])
        if result is None:
            result = measure_row(ctx, row, drafters[row["drafter"]], reference(row["set"])["records"], sets[row["set"]])
            path_ = drafters[row["drafter"]]
            result.update(fingerprint=prints[row["drafter"]], drafter_path=str(Path(path_).resolve()) if path_ else None,
                          training=training_info(path_) if path_ else {"method": TRAINING_FREE[row["drafter"]]})
            write_json(path, result)  # atomic: a kill leaves the row whole or absent
            log(f"results: row {i}/{len(rows)} {row['key']}: tau {result['tau']:.3f} ({result['seconds']} s)")
        done.append(result)
    summary = {"command": command, "date": time.strftime("%Y-%m-%d"),
               "settings": {**settings["common"], "num_prompts": {k: v["prompts"] for k, v in settings["sets"].items()},
                            "prompt_sets": settings["sets"]},
               "rows": done,
               "greedy": {k: {x: reference(k)[x] for x in ("tokens_per_second", "new_tokens", "seconds", "outputs")}
                          for k in sets},
               "published": published(), "seconds_this_run": round(time.time() - t0, 1)}
    return finish(summary, out / "results.json", tables=tables(summary))


# -------------------------------------------------------------------------------------------- tables


def tables(summary: dict) -> list[str]:
    s = summary["settings"]
    rows = summary["rows"]
    out = []
    head = ["drafter", "set", "setting", "T", "tau", "alpha by position", "same as greedy", "tok/s"]
    body = []
    for r in rows:
        alpha = " ".join("-" if a is None else f"{a:.2f}" for a in r["alpha"])
        same = "n/a" if r["identical_to_greedy"] is None else f"{r['identical_to_greedy']}/{r['prompts']}"
        body.append([r["drafter"], r["set"], f"{r['setting']} ({r['nodes']} nodes)" if "tree" in r["setting"]
                     else r["setting"], r["temperature"], r["tau"], alpha, same, r["tokens_per_second"]])
    out.append(format_table(head, body, title=f"tau on {s['verifier']}: {s['num_prompts']} prompts, "
                                              f"{s['max_new_tokens']} new tokens, {s['device']}"))
    train = {}
    for r in rows:
        train.setdefault(r["drafter"], r.get("training") or {})
    out.append(format_table(["drafter", "method", "training data", "steps", "tokens", "wall (min)"],
                            [[name, t.get("method", "-"), Path(str(t.get("data", "-"))).name +
                              (f" (store, {t['store_rows']} rows)" if t.get("store") else ""), t.get("steps", "-"),
                              t.get("trained_tokens", "-"),
                              round(t["wall_seconds"] / 60, 1) if t.get("wall_seconds") else "-"]
                             for name, t in train.items()], title="drafters"))
    cats = [r for r in rows if r["set"] == "mt_bench" and r["setting"].startswith("chain") and r["temperature"] == 0]
    if cats:
        names = list(cats[0]["per_category_tau"])
        out.append(format_table(["drafter", *names], [[r["drafter"], *(r["per_category_tau"].get(c, math.nan)
                                                                       for c in names)] for r in cats],
                                title=f"MT-bench tau per category ({cats[0]['setting']}, T=0)"))
    out.append(format_table(["published", "tau", "verifier", "benchmark", "drafting"],
                            [[p["method"], p["tau"], p["verifier"], p["bench"], p["drafting"]]
                             for p in summary["published"]],
                            title="published figures (7-13B verifiers, ~60-node trees; not our setting)"))
    return out


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    run_command(results, parse_args(argv), shlex.join(["spectrain-results", *argv]))


if __name__ == "__main__":
    main()
