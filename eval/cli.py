"""``spectrain-eval``: speculative decoding with a trained drafter vs. our AR loop vs. HF ``generate()``.

Imports only torch, transformers and safetensors (matplotlib for the plots, when installed).
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import asdict
from pathlib import Path

import torch

from spectrain.heads.errors import SpectrainError, run_command
from spectrain.heads.formats import import_drafter
from spectrain.heads.medusa import MedusaHeads
from spectrain.heads.report import finish, format_table
from spectrain.heads.verifier import load_verifier, max_context, resolve_dtype

from . import metrics
from .accept import Sampling
from .calibrate import medusa_diagnostics
from .costs import draft_cost, plan, probe_state, verify_cost
from .decode import generate
from .decode_dtype import decode_dtype
from .drafters import (Drafter, DynamicTreeDrafter, EagleChainDrafter, EagleTreeDrafter, HybridDrafter, MedusaDrafter,
                       ModelDrafter, NgramDrafter, check_min_match, truncated_verifier)
from .prompts import BUNDLED, load_prompts
from .static_model import StaticCausalLM
from .tree import Tree, build_tree, expected_accept_length

METHODS = ("medusa", "eagle", "ngram", "hybrid", "draft-model", "truncated", "none")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="spectrain-eval", description=__doc__,
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--verifier", default="bundled:tinyshakespeare", help="hub id, local dir or bundled:<name>")
    p.add_argument("--gguf_file", default=None, help="GGUF file inside --verifier")
    p.add_argument("--method", default="medusa", choices=METHODS, help="drafter kind")
    p.add_argument("--drafter", default=None, help="drafter directory: a train_medusa / train_eagle run dir, or "
                   "an export in any spectrain-export format (vLLM, SGLang, TensorRT-LLM, speculators); "
                   "--method hybrid takes either kind")
    p.add_argument("--min_match", type=int, default=2,
                   help="--method hybrid: a chain round drafts by prompt lookup when the context's last N or more "
                        "tokens occurred earlier (and by the learned drafter otherwise); trees always carry the "
                        "lookup's continuation as one more branch when there is such a match")
    p.add_argument("--min_match_sampled", type=int, default=4,
                   help="--method hybrid at --temperature > 0: the same for chain rounds (lookup drafts are "
                        "deterministic, accepted with probability q(c): only long matches pay)")
    p.add_argument("--draft_model", default=None, help="draft LM for --method draft-model (same tokenizer)")
    p.add_argument("--draft_layers", type=int, default=1, help="layers kept by --method truncated")
    p.add_argument("--allow_verifier_mismatch", action="store_true",
                   help="accept a drafter whose recorded verifier name differs from --verifier (sizes must match)")
    p.add_argument("--k", type=int, default=4, help="chain length (drafts per round); 0 skips the chain")
    p.add_argument("--tree", default=None,
                   help="static tree: JSON list of rank paths (inline or file), or auto:N for the best N-node tree "
                        "from measured per-head rank accuracies (Medusa)")
    p.add_argument("--dynamic_tree", default=None, metavar="DEPTH,TOPK,BUDGET",
                   help="also evaluate an EAGLE-2-style dynamic tree (draft-model / truncated methods)")
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
                   help="auto: bf16 on CUDA; on CPUs with native bf16 (AMX / AVX512-BF16) whichever of fp32 / bf16 "
                        "measures faster for this job's verify width (1 without drafts); fp32 elsewhere. Or float32, "
                        "bfloat16")
    p.add_argument("--hf_generate", type=int, default=3, help="prompts timed with HF generate() (0: skip)")
    p.add_argument("--compile", action="store_true",
                   help="compile the verifier's forwards for every verify size this job uses (bucketed; CUDA graphs "
                        "on CUDA, Inductor elsewhere), warmed up before timing (the time is reported apart); on CUDA "
                        "HF generate() runs with its static cache compiled too, so the baselines are like for like")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="output directory (default runs/eval/<method>-<verifier>)")
    p.add_argument("--trust_remote_code", action="store_true")
    return p.parse_args(argv)


# -------------------------------------------------------------------------------------------- setup


def load_drafter(path: str, verifier, verifier_name: str, allow_mismatch: bool):
    """Any drafter (a run dir or an export in any format) on the verifier's device and dtype, in eval mode."""
    drafter = import_drafter(path, verifier_model=verifier.model)
    check_recorded_verifier(path, drafter.config.verifier, verifier_name, allow_mismatch)
    param = next(verifier.model.parameters())
    return drafter.to(param.device, param.dtype).eval()


def load_medusa(path: str, verifier, verifier_name: str, allow_mismatch: bool) -> MedusaHeads:
    if not path:
        raise SpectrainError("--method medusa needs --drafter (a train_medusa run directory)")
    heads = load_drafter(path, verifier, verifier_name, allow_mismatch)
    if not isinstance(heads, MedusaHeads):
        raise SpectrainError(f"{path} holds an {heads.config.variant} drafter: use --method eagle")
    return heads


def check_recorded_verifier(path: str, recorded: str, verifier_name: str, allow_mismatch: bool) -> None:
    """Sizes are checked on load; the recorded name catches same-shaped drafters of another model."""
    if recorded and recorded != verifier_name and not allow_mismatch:
        raise SpectrainError(f"drafter {path} was trained for verifier {recorded!r}, not {verifier_name!r}; "
                             "pass --allow_verifier_mismatch if they are the same model")


def load_learned(path: str, verifier, verifier_name: str, allow_mismatch: bool):
    if not path:
        raise SpectrainError("--method hybrid needs --drafter (a train_medusa or train_eagle run directory or export)")
    return load_drafter(path, verifier, verifier_name, allow_mismatch)


def learned_kind(method: str, heads) -> str:
    """The learned drafter's kind behind ``--method`` (hybrid: whichever ``--drafter`` holds)."""
    if method != "hybrid":
        return method
    return "medusa" if isinstance(heads, MedusaHeads) else "eagle"


def load_eagle(path: str, verifier, verifier_name: str, allow_mismatch: bool):
    if not path:
        raise SpectrainError("--method eagle needs --drafter (a train_eagle run directory)")
    drafter = load_drafter(path, verifier, verifier_name, allow_mismatch)
    if isinstance(drafter, MedusaHeads):
        raise SpectrainError(f"{path} holds Medusa heads: use --method medusa")
    return drafter


def encode_turn(tokenizer, history: list[dict], use_template: bool) -> list[int]:
    if use_template:
        return tokenizer.apply_chat_template(history, add_generation_prompt=True, tokenize=True, return_dict=False)
    return tokenizer("\n".join(m["content"] for m in history), add_special_tokens=False)["input_ids"]


def verify_width(args) -> int:
    """Tokens in this job's widest verifier forward: 1 + its largest chain, tree or dynamic-tree budget."""
    return max(verify_sizes(args))


PLANNER_TREES = (4, 8, 16, 32, 64)  # the Medusa planner's tree sizes


def verify_sizes(args) -> list[int]:
    """Every verifier forward size this job decodes with: AR's 1, and 1 + each chain, tree or dynamic-tree
    budget."""
    if args.method == "none":
        return [1]
    sizes = [args.k]
    lookup = args.k if args.method == "hybrid" else 0  # a hybrid static tree gains the lookup branch
    if args.method == "hybrid" and not args.k and args.tree and not args.tree.startswith("auto:"):
        lookup = Tree.load(args.tree).max_depth  # as deep as the tree when --k is 0 (build_hybrid)
    if args.tree and args.tree.startswith("auto:") and args.tree[5:].isdigit():
        sizes.append(int(args.tree[5:]) + lookup)
    elif args.tree:
        sizes.append(Tree.load(args.tree).size + lookup)
    if args.dynamic_tree and args.dynamic_tree.count(",") == 2 and args.dynamic_tree.rsplit(",", 1)[1].isdigit():
        sizes.append(int(args.dynamic_tree.rsplit(",", 1)[1]))
    return [1] + [1 + s for s in sizes]


def make_trees(args, drafter_heads, calibration) -> dict[str, Tree]:
    trees = {}
    if args.k > 0:
        trees[f"chain-{args.k}"] = Tree.chain(args.k)
    if args.tree:
        if args.tree.startswith("auto:"):
            if calibration is None:
                raise SpectrainError("--tree auto:N needs measured rank accuracies (Medusa drafters)")
            size = int(args.tree.split(":", 1)[1])
            trees[f"tree-{size}"] = build_tree(calibration["rank_accuracy"], size)
        else:
            tree = Tree.load(args.tree)
            trees[f"tree-{tree.size}"] = tree
    if args.dynamic_tree:
        if learned_kind(args.method, drafter_heads) not in ("draft-model", "truncated", "eagle"):
            raise SpectrainError("--dynamic_tree needs a drafter that drafts autoregressively (eagle, draft-model, "
                                 "truncated, or hybrid with an EAGLE drafter)")
        try:
            depth, topk, budget = (int(x) for x in args.dynamic_tree.split(","))
        except ValueError:
            raise SpectrainError(f"--dynamic_tree takes DEPTH,TOPK,BUDGET, got {args.dynamic_tree!r}") from None
        trees[f"dynamic-{depth}x{topk}-{budget}"] = Tree.chain(depth)  # depth sizes the metrics
    if args.method != "none" and not trees:
        raise SpectrainError("nothing to evaluate: give --k > 0 and/or --tree")
    for name, tree in trees.items():
        if learned_kind(args.method, drafter_heads) == "medusa" and tree.max_depth > drafter_heads.config.num_heads:
            raise SpectrainError(f"{name} is {tree.max_depth} deep but the drafter has "
                                 f"{drafter_heads.config.num_heads} heads")
        if args.method in ("ngram", "draft-model", "truncated") and not tree.is_chain and not name.startswith("dynamic"):
            raise SpectrainError(f"--method {args.method} drafts chains only; drop --tree")
    return trees


def draft_model(args, verifier, loaded: dict):
    """``--draft_model`` in the verifier's dtype, loaded once per job (``loaded`` keeps it across settings)."""
    if not args.draft_model:
        raise SpectrainError(f"--method {args.method} needs --draft_model")
    if args.draft_model not in loaded:
        model = load_verifier(args.draft_model, dtype=next(verifier.model.parameters()).dtype, device=args.device).model
        if model.get_output_embeddings().weight.shape[0] != verifier.model.get_output_embeddings().weight.shape[0]:
            raise SpectrainError("the draft model's vocabulary differs from the verifier's")
        loaded[args.draft_model] = model
    return loaded[args.draft_model]


def build_drafter(args, tree: Tree, verifier, heads, max_len: int, name: str = "",
                  loaded: dict | None = None) -> Drafter:
    """The drafter of one setting; ``loaded`` caches a ``--draft_model`` across the job's settings."""
    loaded = {} if loaded is None else loaded
    if args.method == "hybrid":
        return build_hybrid(args, tree, verifier, heads, name)
    if name.startswith("dynamic"):
        depth, topk, budget = (int(x) for x in args.dynamic_tree.split(","))
        if args.method == "eagle":
            return EagleTreeDrafter(heads, verifier.model, dynamic=(depth, topk, budget))
        model = (truncated_verifier(verifier.model, args.draft_layers) if args.method == "truncated"
                 else draft_model(args, verifier, loaded))
        return DynamicTreeDrafter(model, depth, topk, budget, max_len)
    if args.method == "medusa":
        return MedusaDrafter(heads, verifier.model.get_output_embeddings(), tree)
    if args.method == "eagle":
        return (EagleChainDrafter(heads, verifier.model, tree.size) if tree.is_chain
                else EagleTreeDrafter(heads, verifier.model, tree=tree))
    if args.method == "ngram":
        return NgramDrafter(tree.size)
    if args.method == "truncated":
        return ModelDrafter(truncated_verifier(verifier.model, args.draft_layers), tree.size, max_len)
    if args.method == "draft-model":
        return ModelDrafter(draft_model(args, verifier, loaded), tree.size, max_len)
    return Drafter()


def build_hybrid(args, tree: Tree, verifier, heads, name: str) -> HybridDrafter:
    """Prompt lookup + the learned drafter: a chain switches per round; a tree gains the lookup branch (a dynamic
    tree's budget keeps room for it, so the whole tree stays within --dynamic_tree's budget)."""
    k = args.k if args.k > 0 else tree.max_depth
    if name.startswith("dynamic"):
        depth, topk, budget = (int(x) for x in args.dynamic_tree.split(","))
        if budget <= k:
            raise SpectrainError(f"--dynamic_tree budget {budget} leaves no room beside the lookup branch of {k}")
        learned = EagleTreeDrafter(heads, verifier.model, dynamic=(depth, topk, budget - k))
        return HybridDrafter(learned, k, merge=True, min_match=args.min_match,
                             min_match_sampled=args.min_match_sampled)
    if isinstance(heads, MedusaHeads):
        learned = MedusaDrafter(heads, verifier.model.get_output_embeddings(), tree)
    else:
        learned = (EagleChainDrafter(heads, verifier.model, tree.size) if tree.is_chain
                   else EagleTreeDrafter(heads, verifier.model, tree=tree))
    return HybridDrafter(learned, k if not tree.is_chain else tree.size, merge=not tree.is_chain,
                         min_match=args.min_match, min_match_sampled=args.min_match_sampled)


# -------------------------------------------------------------------------------------------- runs


def run_prompts(runner, drafter, prompts, tokenizer, use_template, args, sampling, eos) -> list[dict]:
    """Generate every turn of every prompt (later turns see the earlier answers, as MT-bench does)."""
    generator = torch.Generator(device=runner.device).manual_seed(args.seed)
    records = []
    for i, turns in enumerate(prompts):
        history, record = [], {"prompt": i, "turns": []}
        for turn in turns:
            history.append({"role": "user", "content": turn})
            ids = encode_turn(tokenizer, history, use_template)
            if len(ids) + args.max_new_tokens + drafter.max_nodes + 1 > runner.max_len:
                raise SpectrainError(f"prompt {i}: {len(ids)} prompt tokens + max_new_tokens {args.max_new_tokens} "
                                     f"exceed the verifier's context of {runner.max_len}")
            gen = generate(runner, drafter, ids, args.max_new_tokens, sampling, eos, generator)
            answer = tokenizer.decode(gen.tokens, skip_special_tokens=True)
            history.append({"role": "assistant", "content": answer})
            record["turns"].append(turn_record(ids, gen))
        records.append(record)
    return records


def turn_record(ids: list[int], gen) -> dict:
    """One generated turn as the summaries read it."""
    return {"prompt_tokens": len(ids), "new_tokens": len(gen.tokens), "stop": gen.stop,
            "accept_lengths": gen.accept_lengths, "emitted_per_round": gen.emitted_per_round,
            "prefill_seconds": gen.prefill_seconds, "decode_seconds": gen.decode_seconds,
            "tokens": gen.tokens, "sequence": ids + gen.tokens}


def summarize(records: list[dict], depth: int) -> dict:
    turns = [t for r in records for t in r["turns"]]
    accept = [a for t in turns for a in t["accept_lengths"]]
    new_tokens = sum(t["new_tokens"] for t in turns)
    decode = sum(t["decode_seconds"] for t in turns)
    total = decode + sum(t["prefill_seconds"] for t in turns)
    # Decode throughput counts the tokens made by verify rounds (the prefill's token is timed with the prefill).
    decode_tokens = sum(sum(t["emitted_per_round"]) for t in turns)
    return {
        "tau": metrics.tau([t["emitted_per_round"] for t in turns]),
        "alpha": metrics.alphas(accept, depth),
        "accept_histogram": metrics.histogram(accept, depth),
        "verifier_forwards": len(accept),
        "new_tokens": new_tokens,
        "wall_seconds": total,
        "tokens_per_second": new_tokens / max(total, 1e-9),
        "decode_ms_per_token": 1000 * decode / max(decode_tokens, 1),
        "distinct_4gram": metrics.distinct_ngram_ratio([t["tokens"] for t in turns]),
    }


@torch.no_grad()
def divergences(runner: StaticCausalLM, ar_records: list[dict], spec_records: list[dict]) -> dict:
    """Where greedy spec and AR outputs differ (near-ties flip in low precision) and the verifier's top-1 vs
    top-2 logit margin at the first differing token (teacher-forced on the AR sequence)."""
    cases, turns = [], 0
    for ra, rs in zip(ar_records, spec_records):
        for ta, ts in zip(ra["turns"], rs["turns"]):
            turns += 1
            first = next((i for i, (a, b) in enumerate(zip(ta["tokens"], ts["tokens"])) if a != b), None)
            if first is None:
                continue
            seq = ta["sequence"][:ta["prompt_tokens"] + first]
            runner.reset()
            logits = runner.logits(runner.forward(torch.tensor(seq, device=runner.device))[-1])
            runner.reset()
            top2 = logits.topk(2).values
            cases.append({"prompt": ra["prompt"], "token_index": first, "margin": float(top2[0] - top2[1])})
    return {"turns": turns, "diverged": len(cases), "cases": cases}


def hf_generate_speed(model, tokenizer, prompts, use_template, args, n: int) -> dict | None:
    """HF ``generate()`` tokens/s on the first n prompts (greedy or sampled as configured, warm-up excluded)."""
    if n <= 0:
        return None
    ids = [encode_turn(tokenizer, [{"role": "user", "content": p[0]}], use_template) for p in prompts[:n]]
    kwargs = dict(max_new_tokens=args.max_new_tokens, do_sample=args.temperature > 0, pad_token_id=tokenizer.pad_token_id)
    if args.temperature > 0:
        kwargs.update(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k or None)
    device = next(model.parameters()).device
    compiled = args.compile and device.type == "cuda"
    if compiled:  # HF's fast path: static cache + compiled forward
        kwargs["cache_implementation"] = "static"
        model.forward = torch.compile(model.forward, mode="reduce-overhead", fullgraph=True)
    # Warm-up (and compilation) excluded: compiled, every prompt length is a prefill shape of its own.
    for x in (ids if compiled else ids[:1]):
        for _ in range(2 if compiled else 1):
            model.generate(torch.tensor([x], device=device), **kwargs)
    tokens, seconds = 0, 0.0
    for x in ids:
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = model.generate(torch.tensor([x], device=device), **kwargs)
        if device.type == "cuda":
            torch.cuda.synchronize()
        seconds += time.perf_counter() - t0
        tokens += out.shape[1] - len(x)
    return {"prompts": len(ids), "new_tokens": tokens, "tokens_per_second": tokens / max(seconds, 1e-9)}


def evaluate(args) -> Path:
    if args.method == "hybrid":
        check_min_match(args.min_match, args.min_match_sampled)
    sampling = Sampling(args.temperature, args.top_p, args.top_k)
    torch.manual_seed(args.seed)
    dtype = resolve_dtype(args.dtype, args.device)
    verifier = load_verifier(args.verifier, gguf_file=args.gguf_file, dtype=dtype, device=args.device,
                             trust_remote_code=args.trust_remote_code)
    dtype_choice = {"reason": "set by --dtype"}
    if args.dtype == "auto":
        dtype, dtype_choice = decode_dtype(verifier.model, args.device, verify_width(args))
        if dtype != next(verifier.model.parameters()).dtype:  # reload natively rather than cast what was loaded
            del verifier
            verifier = load_verifier(args.verifier, gguf_file=args.gguf_file, dtype=dtype, device=args.device,
                                     trust_remote_code=args.trust_remote_code)
    tokenizer = verifier.tokenizer
    context = max_context(verifier.config)
    if args.max_new_tokens < 1:
        raise SpectrainError(f"--max_new_tokens must be >= 1, got {args.max_new_tokens}")
    if args.max_new_tokens >= context:
        raise SpectrainError(f"--max_new_tokens {args.max_new_tokens} is beyond the verifier's context of {context}")
    prompts = load_prompts(args.prompts, args.num_prompts, tokenizer, args.prompt_tokens, first_turns=args.first_turns,
                           spread=args.spread)
    use_template = {"on": True, "off": False}.get(args.chat_template,
                                                  bool(getattr(tokenizer, "chat_template", None)) and args.prompts != BUNDLED)
    if use_template and not getattr(tokenizer, "chat_template", None):
        raise SpectrainError("--chat_template on, but the verifier's tokenizer has no chat template")
    heads = {"medusa": load_medusa, "eagle": load_eagle, "hybrid": load_learned}.get(args.method, lambda *a: None)(
        args.drafter, verifier, args.verifier, args.allow_verifier_mismatch)
    kind = learned_kind(args.method, heads)
    eos = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
    longest = max(len(encode_turn(tokenizer, [{"role": "user", "content": t}], use_template)) for p in prompts for t in p)
    turns = max(len(p) for p in prompts)
    max_len = min(context, turns * (longest + args.max_new_tokens + 16) + 80)
    eagle3_layers = tuple(heads.config.aux_layer_ids) if kind == "eagle" and heads.is_eagle3 else ()
    runner = StaticCausalLM(verifier.model, max_len=max_len, device=args.device, static=True if args.compile else None)
    compile_seconds = None
    if args.compile:  # every size compiled and warmed up here, before anything is timed
        runner.capture = eagle3_layers  # kept by every drafter's run: one set of graphs
        planner = list(range(2, args.k + 2)) + ([1 + n for n in PLANNER_TREES] if kind == "medusa" else [])
        compile_seconds = runner.compile(verify_sizes(args) + planner)

    t0 = time.time()
    ar_records = run_prompts(runner, Drafter(), prompts, tokenizer, use_template, args, sampling, eos)
    results = {"ar": summarize(ar_records, 0)}
    per_prompt = {"ar": ar_records}

    calibration = None
    if kind == "medusa":
        probe = MedusaDrafter(heads, verifier.model.get_output_embeddings(), Tree.chain(heads.config.num_heads))
        seqs = [t["sequence"] for r in ar_records for t in r["turns"]]
        starts = [t["prompt_tokens"] for r in ar_records for t in r["turns"]]
        calibration = medusa_diagnostics(runner, probe, seqs, starts, temperature=max(args.temperature, 1.0),
                                         decoding=sampling)
    trees = make_trees(args, heads, calibration)

    probe_prompt = encode_turn(tokenizer, [{"role": "user", "content": prompts[0][0]}], use_template)
    state = probe_state(runner, probe_prompt, sampling, eagle3_layers)
    t_decode = verify_cost(runner, Tree.chain(0), len(probe_prompt))
    costs = {"context_tokens": len(probe_prompt), "t_decode_ms": 1000 * t_decode, "settings": {}}
    t_verify, t_draft = {}, {}
    loaded: dict = {}  # a --draft_model, loaded once for every setting
    for name, tree in trees.items():
        drafter = build_drafter(args, tree, verifier, heads, max_len, name, loaded)
        records = run_prompts(runner, drafter, prompts, tokenizer, use_template, args, sampling, eos)
        # A hybrid's lookup branch reaches k deep whatever the learned tree's depth.
        summary = summarize(records, max(tree.max_depth, args.k) if args.method == "hybrid" else tree.max_depth)
        shape = tree if drafter.max_nodes == tree.size else Tree.chain(drafter.max_nodes)  # same tokens to verify
        tv, td = verify_cost(runner, shape, len(probe_prompt)), draft_cost(drafter, state)
        summary.update(tree_size=drafter.max_nodes, tree_paths=[list(p) for p in tree.paths],
                       speedup=results["ar"]["decode_ms_per_token"] / max(summary["decode_ms_per_token"], 1e-9),
                       ideal_speedup=summary["tau"] * t_decode / (tv + td),
                       identical_to_ar=sampling.greedy and all(
                           a["tokens"] == b["tokens"] for ra, rb in zip(ar_records, records)
                           for a, b in zip(ra["turns"], rb["turns"])))
        summary["speedup_vs_ideal"] = summary["speedup"] / max(summary["ideal_speedup"], 1e-9)
        if sampling.greedy:
            summary["divergences"] = divergences(runner, ar_records, records)
        if calibration is not None and not tree.is_chain:
            summary["expected_accept_length"] = expected_accept_length(tree.paths, calibration["rank_accuracy"])
        costs["settings"][name] = {"t_verify_ms": 1000 * tv, "t_draft_ms": 1000 * td}
        if tree.is_chain and not name.startswith("dynamic"):
            t_verify[tree.size], t_draft[tree.size] = tv, td
        results[name] = summary
        per_prompt[name] = records
    # Planner: expected speedup for every chain length up to the measured depth.
    chain = next((results[n] for n in trees if n.startswith("chain")), None)
    planner = None
    if chain is not None:
        depth = len(chain["alpha"])
        for n in range(1, depth + 1):
            if n not in t_verify:
                t_verify[n] = verify_cost(runner, Tree.chain(n), len(probe_prompt))
                t_draft[n] = draft_cost(build_drafter(args, Tree.chain(n), verifier, heads, max_len, loaded=loaded),
                                        state) \
                    if kind != "medusa" else t_draft.get(depth, 0.0)
        planner = {"chains": plan(chain["alpha"], t_decode, t_verify, t_draft)}
        planner["best_chain"] = max(planner["chains"], key=lambda r: r["expected_speedup"], default=None)
        planner["measured_chain"] = {"n": args.k, "speedup": chain["speedup"]}
    if calibration is not None:  # trees of every size from the measured rank accuracies
        planner = planner or {}
        planner["trees"] = []
        for size in PLANNER_TREES:
            tree = build_tree(calibration["rank_accuracy"], size)
            cost = verify_cost(runner, tree, len(probe_prompt)) + t_draft.get(args.k, 0.0)
            tau_n = 1 + expected_accept_length(tree.paths, calibration["rank_accuracy"])
            planner["trees"].append({"n": size, "expected_tau": tau_n, "expected_speedup": tau_n * t_decode / cost})
        planner["best_tree"] = max(planner["trees"], key=lambda r: r["expected_speedup"])
    hf = hf_generate_speed(verifier.model, tokenizer, prompts, use_template, args, args.hf_generate)

    out_dir = Path(args.out or f"runs/eval/{args.method}-{Path(args.verifier.replace(':', '-')).name}")
    out_dir.mkdir(parents=True, exist_ok=True)
    summary = {
        "command": "spectrain-eval " + " ".join(sys.argv[1:]),
        "verifier": args.verifier, "method": args.method, "drafter": args.drafter, "device": args.device,
        "dtype": str(dtype).replace("torch.", ""), "dtype_choice": dtype_choice, "sampling": asdict(sampling), "prompts": args.prompts,
        "num_prompts": len(prompts), "max_new_tokens": args.max_new_tokens, "chat_template": use_template,
        "results": results, "costs": costs, "planner": planner, "hf_generate": hf, "calibration": calibration,
        "compile": None if compile_seconds is None else {"seconds": compile_seconds, "buckets": list(runner.buckets)},
        "eval_seconds": time.time() - t0, "per_prompt": per_prompt,
    }
    plots = write_plots(summary, out_dir)
    summary["plots"] = plots
    return finish(summary, out_dir / "eval.json", tables=tables(summary))


def tables(summary: dict) -> list[str]:
    rows = []
    for name, r in summary["results"].items():
        rows.append([name, r.get("tree_size", 0), r["tau"], r["tokens_per_second"], r["decode_ms_per_token"],
                     r.get("speedup", 1.0), r.get("ideal_speedup", 1.0), r["distinct_4gram"],
                     "-" if name == "ar" else ("yes" if r.get("identical_to_ar") else "n/a" if summary["sampling"]["temperature"] else "NO")])
    hf = summary["hf_generate"]
    title = (f"{summary['method']} on {summary['verifier']} — {summary['num_prompts']} prompts, "
             f"T={summary['sampling']['temperature']}, {summary['max_new_tokens']} new tokens, {summary['device']} {summary['dtype']}"
             + (f"; HF generate(): {hf['tokens_per_second']:.1f} tok/s" if hf else ""))
    out = [format_table(["setting", "nodes", "tau", "tok/s", "ms/token", "speedup", "ideal", "distinct-4",
                         "same as AR"], rows, title=title)]
    for name, r in summary["results"].items():
        if name == "ar":
            continue
        alpha = " ".join("-" if a is None else f"{a:.2f}" for a in r["alpha"])
        out.append(f"{name}: alpha by depth [{alpha}]  accept-length histogram {r['accept_histogram']}")
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


def write_plots(summary: dict, out_dir: Path) -> list[str]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    paths = []
    settings = {k: v for k, v in summary["results"].items() if k != "ar"}
    if not settings:
        return paths
    fig, ax = plt.subplots(figsize=(5, 3.5))
    for name, r in settings.items():
        ax.plot(range(1, len(r["alpha"]) + 1), [a if a is not None else float("nan") for a in r["alpha"]], "o-", label=name)
    ax.set(xlabel="draft depth k", ylabel="alpha_k", ylim=(0, 1), title="acceptance by position")
    ax.set_xticks(range(1, max(len(r["alpha"]) for r in settings.values()) + 1))
    ax.legend()
    fig.tight_layout()
    fig.savefig(out_dir / "alpha.png", dpi=120)
    paths.append(str(out_dir / "alpha.png"))
    fig, ax = plt.subplots(figsize=(5, 3.5))
    width = 0.8 / len(settings)
    for i, (name, r) in enumerate(settings.items()):
        hist = r["accept_histogram"]
        total = max(sum(hist), 1)
        ax.bar([a + i * width for a in range(len(hist))], [h / total for h in hist], width=width, label=name)
    ax.set(xlabel="accepted drafts per round", ylabel="fraction of rounds", title="accept-length histogram")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out_dir / "accept_hist.png", dpi=120)
    paths.append(str(out_dir / "accept_hist.png"))
    cal, chain = summary.get("calibration"), next((r for k, r in settings.items() if k.startswith("chain")), None)
    if cal and chain:
        fig, ax = plt.subplots(figsize=(5, 3.5))
        for k, (kl, a) in enumerate(zip(cal["kl"], chain["alpha"])):
            if a is not None:
                ax.scatter(kl, a)
                ax.annotate(f"k={k + 1}", (kl, a))
        ax.set(xlabel="KL(q || p) of head k", ylabel="alpha_k", title="acceptance vs drafter KL")
        fig.tight_layout()
        fig.savefig(out_dir / "alpha_vs_kl.png", dpi=120)
        paths.append(str(out_dir / "alpha_vs_kl.png"))
    planner = summary.get("planner") or {}
    if planner.get("chains"):
        fig, ax = plt.subplots(figsize=(5, 3.5))
        ax.plot([r["n"] for r in planner["chains"]], [r["expected_speedup"] for r in planner["chains"]], "o-",
                label="expected (planner)")
        measured = planner["measured_chain"]
        ax.scatter([measured["n"]], [measured["speedup"]], color="red", zorder=3, label="measured")
        ax.set(xlabel="chain length N", ylabel="speedup over AR", title="expected vs measured speedup")
        ax.legend()
        fig.tight_layout()
        fig.savefig(out_dir / "speedup_vs_n.png", dpi=120)
        paths.append(str(out_dir / "speedup_vs_n.png"))
    plt.close("all")
    return paths


def main(argv=None) -> None:
    run_command(evaluate, parse_args(argv))


if __name__ == "__main__":
    main()
