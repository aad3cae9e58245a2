"""``spectrain-results``: the results table — trained drafters on real prompt sets, one resumable row at a time.

For every ``--drafter NAME=PATH`` (a ``train_medusa`` / ``train_eagle`` run or any export) it measures, with the
real speculative loop of :mod:`.decode` on the verifier:

* MT-bench first turns (stratified over its 8 categories when fewer than 80 are asked for), T = 0: a chain of
  ``--k`` drafts and the best tree of ``<= --tree_nodes`` draft nodes (Medusa: the tree built from the head's
  rank accuracies measured on the verifier's own outputs; EAGLE: an EAGLE-2 dynamic tree with that budget);
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
import shutil
import sys
import time
from pathlib import Path

import torch

from spectrain.heads.errors import SpectrainError, run_command
from spectrain.heads.io import read_json, write_json
from spectrain.heads.medusa import MedusaHeads
from spectrain.heads.report import finish, format_table
from spectrain.heads.verifier import load_verifier, max_context, resolve_dtype

from . import metrics
from .accept import Sampling
from .calibrate import medusa_diagnostics
from .cli import encode_turn, load_drafter, run_prompts, summarize
from .drafters import (Drafter, EagleChainDrafter, EagleTreeDrafter, HybridDrafter, MedusaDrafter, NgramDrafter,
                       check_min_match)
from .prompts import spread_over_categories
from .static_model import StaticCausalLM
from .tree import Tree, build_tree

SHARED = Path("../shared/data")
PROMPT_SETS = ("mt_bench", "alpaca", "gsm8k")

# Published figures for the side-by-side; their setting differs from ours and the table says how.
PUBLISHED = [
    {"method": "Medusa-1", "tau": 2.3, "verifier": "Vicuna-7B", "bench": "Spec-Bench", "drafting": "~60-node static tree"},
    {"method": "EAGLE-2", "tau": 4.8, "verifier": "Vicuna-13B", "bench": "MT-bench", "drafting": "~60-node dynamic tree"},
    {"method": "EAGLE-3", "tau": 6.6, "verifier": "Vicuna-13B", "bench": "MT-bench", "drafting": "~60-node dynamic tree"},
    {"method": "EAGLE-3", "tau": 6.1, "verifier": "Llama-3.1-8B", "bench": "MT-bench", "drafting": "~60-node dynamic tree"},
]


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="spectrain-results", description=__doc__.split("\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--verifier", default="bundled:smollm2", help="hub id, local dir or bundled:<name>")
    p.add_argument("--drafter", action="append", default=[], metavar="NAME=PATH",
                   help="a drafter to evaluate (repeatable): run dir or export; NAME labels its rows")
    p.add_argument("--ngram", action="store_true",
                   help="also measure prompt lookup (training-free; rows named 'ngram': the chain, no tree)")
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
                        "'ngram' or 'hybrid-NAME')")
    p.add_argument("--mt_bench", default=str(SHARED / "prompts/mt_bench.jsonl"), help="MT-bench jsonl ('' skips)")
    p.add_argument("--alpaca", default=str(SHARED / "prompts/alpaca_80.jsonl"), help="Alpaca-80 jsonl ('' skips)")
    p.add_argument("--gsm8k", default=str(SHARED / "gsm8k_train.jsonl"), help="GSM8K jsonl ('' skips)")
    p.add_argument("--num_prompts", nargs="+", default=["80"], metavar="N|SET=N",
                   help="prompts per set (MT-bench: spread over categories); SET=N sets one set's count")
    p.add_argument("--max_new_tokens", type=int, default=128)
    p.add_argument("--k", type=int, default=5, help="chain length")
    p.add_argument("--tree_nodes", type=int, default=64, help="draft-node budget of the tree rows (0 skips them)")
    p.add_argument("--tree_depth", type=int, default=6, help="EAGLE dynamic tree: depth")
    p.add_argument("--tree_topk", type=int, default=8, help="EAGLE dynamic tree: children expanded per node")
    p.add_argument("--sampled_temperature", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default="auto",
                   help="auto (bf16 on CUDA and on CPUs with native bf16 matmuls, fp32 elsewhere; by capability, not "
                        "measured as in spectrain-eval, so resumed rows keep one dtype), float32 or bfloat16")
    p.add_argument("--out", default="runs/results")
    p.add_argument("--force", action="store_true", help="discard the rows of an existing --out with other settings")
    return p.parse_args(argv)


# -------------------------------------------------------------------------------------------- prompts


def _jsonl(path: str) -> list[dict]:
    from spectrain.data.chat import load_records  # JSON/JSONL with named errors

    return load_records(path)


def load_set(name: str, path: str, n: int) -> list[dict]:
    """``[{"prompt": str, "category": str}]`` — MT-bench first turns (round-robin over categories in file order
    when ``n`` < all), Alpaca-80 instructions (+ input), or GSM8K questions."""
    rows = _jsonl(path)
    if name == "mt_bench":
        for i, r in enumerate(rows):
            if not isinstance(r.get("turns"), list) or not r["turns"]:
                raise SpectrainError(f"{path}, record {i}: MT-bench rows need a non-empty 'turns' list")
        return [{"prompt": rows[i]["turns"][0], "category": rows[i].get("category") or "none"}
                for i in spread_over_categories([r.get("category") for r in rows])[:n]]
    out = []
    for i, r in enumerate(rows[:n]):
        if name == "alpaca":
            if not r.get("instruction") and not r.get("turns"):
                raise SpectrainError(f"{path}, record {i}: Alpaca rows need 'instruction' (or 'turns')")
            text = r["turns"][0] if r.get("turns") else r["instruction"] + (f"\n\n{r['input']}" if r.get("input") else "")
        else:
            if not isinstance(r.get("question"), str):
                raise SpectrainError(f"{path}, record {i}: GSM8K rows need a 'question' string")
            text = r["question"]
        out.append({"prompt": text, "category": r.get("category") or name})
    return out


# -------------------------------------------------------------------------------------------- drafters


def fingerprint(path: str) -> str:
    """SHA-256 over the drafter's weight files: a retrained drafter in the same directory invalidates its rows."""
    digest = hashlib.sha256()
    files = sorted(Path(path).glob("*.safetensors")) if Path(path).is_dir() else [Path(path)]
    if not files:
        raise SpectrainError(f"drafter {path}: no .safetensors weights found")
    for f in files:
        digest.update(f.name.encode())
        with open(f, "rb") as fh:
            for block in iter(lambda: fh.read(1 << 22), b""):
                digest.update(block)
    return digest.hexdigest()[:16]


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
        if name == "ngram" or name.startswith("hybrid-"):
            raise SpectrainError(f"--drafter name {name!r} is reserved for the --ngram / --hybrid rows")
        if name in drafters:
            raise SpectrainError(f"--drafter name {name!r} given twice")
        if not Path(path).exists():
            raise SpectrainError(f"--drafter {name}: {path} not found")
        drafters[name] = path
    return drafters


# -------------------------------------------------------------------------------------------- rows


def plan_rows(args, drafters: dict[str, str], sets: dict[str, list[dict]]) -> list[dict]:
    """Every row to measure, in the order the table reads."""
    unknown = sorted(set(args.sampled) - set(drafters))
    if unknown:
        raise SpectrainError(f"--sampled names no --drafter: {unknown}")
    rows = []  # set by set, so a partial run already has whole sets
    if "mt_bench" in sets:
        for name in drafters:
            rows.append({"drafter": name, "set": "mt_bench", "setting": f"chain-{args.k}", "temperature": 0.0})
            if args.tree_nodes and name != "ngram":
                rows.append({"drafter": name, "set": "mt_bench", "setting": f"tree-{args.tree_nodes}",
                             "temperature": 0.0})
            if name in args.sampled:
                rows.append({"drafter": name, "set": "mt_bench", "setting": f"chain-{args.k}",
                             "temperature": args.sampled_temperature})
    for other in ("alpaca", "gsm8k"):
        if other in sets:
            rows.extend({"drafter": name, "set": other, "setting": f"chain-{args.k}", "temperature": 0.0}
                        for name in drafters)
    for r in rows:
        r["key"] = f"{r['drafter']}__{r['set']}__{r['setting']}__T{r['temperature']:g}"
    return rows


class Context:
    """The verifier, its static-cache runner, the prompt sets and the loaded drafters (loaded once, on demand)."""

    def __init__(self, args, sets: dict[str, list[dict]]):
        self.args = args
        self.dtype = resolve_dtype(args.dtype, args.device)
        self.verifier = load_verifier(args.verifier, dtype=self.dtype, device=args.device)
        self.tokenizer = self.verifier.tokenizer
        if not getattr(self.tokenizer, "chat_template", None):
            raise SpectrainError(f"verifier {args.verifier} has no chat template: the prompt sets are chat prompts")
        self.eos = {self.tokenizer.eos_token_id} if self.tokenizer.eos_token_id is not None else set()
        self.prompts = {name: [[p["prompt"]] for p in prompts] for name, prompts in sets.items()}
        context = max_context(self.verifier.config)
        longest = max(len(encode_turn(self.tokenizer, [{"role": "user", "content": turns[0]}], True))
                      for prompts in self.prompts.values() for turns in prompts)
        max_len = longest + args.max_new_tokens + max(args.tree_nodes, args.k) + 2
        if max_len > context:
            raise SpectrainError(f"the longest prompt ({longest} tokens) + --max_new_tokens {args.max_new_tokens} "
                                 f"exceeds the verifier's context of {context}")
        self.runner = StaticCausalLM(self.verifier.model, max_len=max_len, device=args.device)
        self._heads: dict[str, object] = {}

    def heads(self, name: str, path: str):
        if name not in self._heads:
            self._heads[name] = load_drafter(path, self.verifier, self.args.verifier, False)
        return self._heads[name]

    def run(self, drafter: Drafter, set_name: str, sampling: Sampling) -> list[dict]:
        """One generation per prompt of the set (records as :func:`.cli.run_prompts` makes them)."""
        return run_prompts(self.runner, drafter, self.prompts[set_name], self.tokenizer, True, self.args, sampling,
                           self.eos)

    def sample_outputs(self, records: list[dict]) -> list[str]:
        """The first two outputs as text, for reading the table against what was generated."""
        return [self.tokenizer.decode(t["tokens"], skip_special_tokens=True) for r in records[:2] for t in r["turns"]]


def build(ctx: Context, row: dict, path: str, reference: list[dict]) -> tuple[Drafter, dict]:
    """The row's drafter and what defines it (the tree, and for Medusa the rank accuracies it came from)."""
    args = ctx.args
    if row["drafter"] == "ngram":
        return NgramDrafter(args.k), {"tree": "chain", "nodes": args.k}
    if row["drafter"].startswith("hybrid-"):
        reserve = args.k if row["setting"].startswith("tree") else 0  # the lookup branch's nodes
        learned, definition = build_learned(ctx, {**row, "drafter": row["drafter"][len("hybrid-"):]}, path,
                                            reference, args.tree_nodes - reserve)
        merge = not row["setting"].startswith("chain")
        definition = {**definition, "nodes": definition["nodes"] + reserve, "min_match": args.min_match,
                      "min_match_sampled": args.min_match_sampled,
                      "depth": max(definition.get("depth", args.k), args.k),
                      "tree": ("chain: prompt lookup when it matches, else " if not merge else
                               "the learned tree + the lookup branch; learned: ") + definition["tree"]}
        return HybridDrafter(learned, args.k, merge=merge, min_match=args.min_match,
                             min_match_sampled=args.min_match_sampled), definition
    return build_learned(ctx, row, path, reference, args.tree_nodes)


def build_learned(ctx: Context, row: dict, path: str, reference: list[dict],
                  tree_nodes: int) -> tuple[Drafter, dict]:
    """A trained drafter's chain or tree of ``tree_nodes`` draft nodes."""
    args, heads = ctx.args, ctx.heads(row["drafter"], path)
    model = ctx.verifier.model
    medusa = isinstance(heads, MedusaHeads)
    depth_needed = args.k if row["setting"].startswith("chain") else 1
    if medusa and heads.config.num_heads < depth_needed:
        raise SpectrainError(f"drafter {row['drafter']} has {heads.config.num_heads} Medusa heads; a chain of "
                             f"{args.k} needs {args.k} (train with --model.num_heads {args.k} or lower --k)")
    if row["setting"].startswith("chain"):
        drafter = (MedusaDrafter(heads, model.get_output_embeddings(), Tree.chain(args.k)) if medusa
                   else EagleChainDrafter(heads, model, args.k))
        return drafter, {"tree": "chain", "nodes": args.k}
    if medusa:  # Medusa's tree: the most likely rank paths from the heads' measured rank accuracies
        probe = MedusaDrafter(heads, model.get_output_embeddings(), Tree.chain(heads.config.num_heads))
        seqs = [t["sequence"] for r in reference for t in r["turns"]]
        starts = [t["prompt_tokens"] for r in reference for t in r["turns"]]
        calibration = medusa_diagnostics(ctx.runner, probe, seqs, starts)
        tree = build_tree(calibration["rank_accuracy"], tree_nodes)
        return (MedusaDrafter(heads, model.get_output_embeddings(), tree),
                {"tree": "static, from rank accuracies on the verifier's greedy outputs of this set",
                 "nodes": tree.size, "depth": tree.max_depth, "rank_accuracy": calibration["rank_accuracy"]})
    dynamic = (args.tree_depth, args.tree_topk, tree_nodes)
    return (EagleTreeDrafter(heads, model, dynamic=dynamic),
            {"tree": "EAGLE-2 dynamic", "nodes": tree_nodes, "depth": args.tree_depth, "topk": args.tree_topk})


def per_category(records: list[dict], prompts: list[dict]) -> dict[str, float]:
    groups: dict[str, list[list[int]]] = {}
    for r, p in zip(records, prompts):
        groups.setdefault(p["category"], []).extend(t["emitted_per_round"] for t in r["turns"])
    return {cat: metrics.tau(rounds) for cat, rounds in groups.items()}


def measure_row(ctx: Context, row: dict, path: str, reference: list[dict], prompts: list[dict]) -> dict:
    sampling = Sampling(temperature=row["temperature"])
    drafter, definition = build(ctx, row, path, reference)
    t0 = time.time()
    records = ctx.run(drafter, row["set"], sampling)
    summary = summarize(records, definition.get("depth", drafter.tree.max_depth))
    identical = None
    if sampling.greedy:
        identical = sum(a["tokens"] == b["tokens"] for ra, rb in zip(reference, records)
                        for a, b in zip(ra["turns"], rb["turns"]))
    if isinstance(drafter, HybridDrafter):
        definition["lookup_round_fraction"] = round(drafter.lookup_rounds / max(drafter.rounds, 1), 4)
    return {**row, **definition, "tau": summary["tau"], "alpha": summary["alpha"],
            "accept_histogram": summary["accept_histogram"], "verifier_forwards": summary["verifier_forwards"],
            "new_tokens": summary["new_tokens"], "tokens_per_second": summary["tokens_per_second"],
            "identical_to_greedy": identical, "prompts": len(records), "per_category_tau": per_category(records, prompts),
            "seconds": round(time.time() - t0, 1),
            "outputs": ctx.sample_outputs(records)}


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


def results(args, log=print) -> Path:
    counts = prompt_counts(args.num_prompts)
    for key in ("max_new_tokens", "k"):
        if getattr(args, key) < 1:
            raise SpectrainError(f"--{key} must be >= 1, got {getattr(args, key)}")
    if args.tree_nodes < 0 or args.tree_depth < 1 or args.tree_topk < 1:
        raise SpectrainError("--tree_nodes must be >= 0 and --tree_depth / --tree_topk >= 1")
    if args.sampled_temperature <= 0:
        raise SpectrainError(f"--sampled_temperature must be > 0, got {args.sampled_temperature}")
    drafters = parse_drafters(args.drafter)
    learned = dict(drafters)
    for name in args.hybrid:
        if name not in learned:
            raise SpectrainError(f"--hybrid {name}: no --drafter of that name")
        drafters[f"hybrid-{name}"] = learned[name]
    if args.ngram:
        drafters["ngram"] = ""
    if not drafters:
        raise SpectrainError("nothing to measure: give --drafter NAME=PATH and/or --ngram")
    check_min_match(args.min_match, args.min_match_sampled)
    if args.hybrid and args.tree_nodes and args.tree_nodes <= args.k:
        raise SpectrainError(f"--tree_nodes {args.tree_nodes} leaves no room beside the hybrid's lookup branch of "
                             f"--k {args.k}")
    sets = {name: load_set(name, getattr(args, name), counts[name]) for name in PROMPT_SETS if getattr(args, name)}
    if not sets:
        raise SpectrainError("no prompt sets: give --mt_bench, --alpaca and/or --gsm8k")
    rows = plan_rows(args, drafters, sets)
    out = Path(args.out)
    settings = settings_of(args, sets)
    rows_dir = open_out(out, settings, args.force)
    prints = {name: ("ngram-max3" if name == "ngram" else fingerprint(path) + (
        f"-hybrid-m{args.min_match}s{args.min_match_sampled}" if name.startswith("hybrid-") else ""))
              for name, path in drafters.items()}
    ctx = Context(args, sets)
    t0 = time.time()

    references = {}

    def reference(name: str) -> dict:
        """Plain greedy decoding of a set (measured once): the lossless reference and the AR speed."""
        if name not in references:
            path = rows_dir / f"greedy__{name}.json"
            ref = cached(path, "greedy")
            if ref is None:
                start = time.time()
                records = ctx.run(Drafter(), name, Sampling())
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
                          training=training_info(path_) if path_ else {"method": "prompt lookup (training-free)"})
            write_json(path, result)  # atomic: a kill leaves the row whole or absent
            log(f"results: row {i}/{len(rows)} {row['key']}: tau {result['tau']:.3f} ({result['seconds']} s)")
        done.append(result)
    summary = {"command": "spectrain-results " + " ".join(sys.argv[1:]),
               "settings": {**settings["common"], "num_prompts": {k: v["prompts"] for k, v in settings["sets"].items()},
                            "prompt_sets": settings["sets"]},
               "rows": done,
               "greedy": {k: {x: reference(k)[x] for x in ("tokens_per_second", "new_tokens", "seconds", "outputs")}
                          for k in sets},
               "published": PUBLISHED, "seconds_this_run": round(time.time() - t0, 1)}
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


def main(argv=None) -> None:
    run_command(results, parse_args(argv))


if __name__ == "__main__":
    main()
