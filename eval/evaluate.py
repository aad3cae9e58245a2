"""The evaluation API: one typed function that decodes prompts with a drafter through our lossless speculative
loop, beside plain autoregressive decoding of the same prompts, and returns what it measured.

``spectrain-eval`` and ``spectrain-results`` are thin command lines around :func:`evaluate_drafter`; the checks in
``benchmarks/`` call it directly::

    verifier = load_verifier("bundled:tinyshakespeare", dtype=torch.float32)
    drafter = load_drafter("runs/heads", verifier)
    result = evaluate_drafter(verifier, [["To be, or not"]], method=family_of(drafter).name, drafter=drafter, k=4)
    result.results["chain-4"]["tau"]

It walks one evaluation in order; its steps live beside it, one job each: set-up (:mod:`.setup`), methods and trees
(:mod:`.methods`), runs and summaries (:mod:`.runs`), the planner (:mod:`.planner`). Their public names are
re-exported here, where callers have always imported them from. Imports only torch and transformers (and
safetensors through the drafter loaders).
"""

from __future__ import annotations

import time
from dataclasses import asdict

import torch

from spectrain.heads.errors import SpectrainError
from spectrain.heads.verifier import Verifier, max_context

from .costs import draft_cost, probe_state, verify_cost
from .drafters import Autoregressive, HybridDrafter
from .methods import build_drafter, build_hybrid, dynamic_name, lookup_length, make_trees, verify_sizes  # noqa: F401
from .planner import PLANNER_TREES, plan_speedups
from .runs import (divergences, encode_turn, eos_ids, hf_generate_speed, identical_turns, in_loop_costs,  # noqa: F401
                   run_prompts, summarize, turn_record, ulp)
from .setup import (OTHER_METHODS, EvalResult, Settings, bind_learned, draft_vocab_of, learned_kind,  # noqa: F401
                    load_drafter, methods, refuse_draft_vocab, resolve_draft_vocab)
from .families import learned_methods
from .static_model import StaticCausalLM
from .tree import Tree, expected_accept_length


def evaluate_drafter(verifier: Verifier, prompts: list[list[str]], *, method: str | None = None, drafter=None,
                     draft_model: torch.nn.Module | None = None, k: int = 4, tree: str | None = None,
                     dynamic_tree: tuple[int, int, int] | None = None, lookup: int = 0, min_confidence: float = 0.0,
                     draft_layers: int = 1,
                     min_match: int = 2, min_match_sampled: int = 4, max_new_tokens: int = 128,
                     temperature: float = 0.0, top_p: float = 1.0, top_k: int = 0, chat_template: bool | None = None,
                     compile: bool = False, hf_generate: int = 3, costs: bool = True,
                     reference: list[dict] | None = None, max_len: int | None = None, seed: int = 0,
                     batch_invariant: bool | None = None, draft_vocab: int | None = None,
                     decoder: str = "auto") -> EvalResult:
    """Decode ``prompts`` with AR and with every drafting setting the arguments name; measure τ, α, speed.

    Args:
        verifier: the loaded verifier (:func:`spectrain.heads.verifier.load_verifier`); its device and dtype are
            the run's.
        prompts: per prompt its user turns (later turns see the earlier answers, as MT-bench does).
        method: a drafter family's name (:func:`methods`; None: the first bundled family's) | ``ngram`` | ``hybrid`` (prompt lookup + ``drafter``)
            | ``draft-model`` | ``truncated`` (the verifier's first ``draft_layers`` layers) | ``none`` (AR only).
        drafter: the learned drafter (:func:`load_drafter`) for a family's method or hybrid.
        draft_model: a causal LM with the verifier's vocabulary, for ``draft-model``.
        k: chain length (drafts per round); 0 skips the chain.
        tree: a static tree as JSON rank paths (inline or a file), or ``auto:N`` for the best N-node tree from
            the heads' rank accuracies measured on AR's outputs (families with a calibration).
        dynamic_tree: ``(depth, topk, budget)`` of a dynamic tree grown each round (families that grow them,
            draft-model, truncated, hybrid).
        lookup: the tokens a hybrid's lookup round drafts: a chain's lookup rounds (default ``k``) and a tree's
            lookup branch (default ``k``, else the tree's depth).
        min_confidence: a chain (alone or a hybrid's learned rounds) verifies only the drafts its confidence head
            expects to survive, the longest prefix with predicted whole-prefix acceptance >= this (drafters with a
            confidence head; 0: every draft).
        min_match, min_match_sampled: a hybrid's lookup threshold at T = 0 and at T > 0.
        temperature, top_p, top_k: decoding (T = 0: greedy, where every output must equal AR's).
        chat_template: render turns with the tokenizer's chat template (None: when it has one).
        compile: compile one graph per verify size, warmed up before anything is timed.
        hf_generate: prompts also timed with HF ``generate()`` (0: skip).
        costs: probe verify / draft costs in isolation (``EvalResult.costs``) and run the planner (without them
            a rank-tree drafter is calibrated only when ``tree`` is ``auto:N``); every setting's own costs and ideal
            speedup come from its rounds either way.
        reference: AR records of these prompts from an earlier call (``result.per_prompt["ar"]``): reused
            instead of decoding AR again.
        max_len: KV-cache positions (default: what the longest prompt's turns need).
        seed: the sampling generator's seed, the same for every setting.
        batch_invariant: decode so that each token's numbers do not depend on the forward's width
            (:class:`~.static_model.StaticCausalLM`); then low-precision chains equal AR token for token.
            None: on in bf16 / fp16 on a CPU, off on CUDA and in fp32.
        draft_vocab: draft over the N most frequent tokens of the drafter's training data (its
            ``vocab_ranking.json``; not for a drafter whose draft vocabulary was fixed by its training); 0 = the full
            vocabulary; None = the vocabulary it trained over (full when it records none). Verification is always
            over the full vocabulary.
        decoder: the verifier's forward — ``llama`` (our hand-written Llama-family layer), ``layers`` (the
            model's own decoder layers over our cache: any family) or ``auto`` (``llama`` where it applies).
    """
    method = methods()[0] if method is None else method
    if method == "none":  # AR only: no chain, no costs to probe, nothing to plan
        k, costs = 0, False
    s = Settings(method=method, k=k, tree=tree, dynamic_tree=tuple(dynamic_tree) if dynamic_tree else None,
                 lookup=lookup, min_confidence=min_confidence, draft_layers=draft_layers, min_match=min_match,
                 min_match_sampled=min_match_sampled,
                 max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, top_k=top_k, compile=compile,
                 seed=seed)
    s.check()
    if (method in learned_methods() or method == "hybrid") and drafter is None:
        raise SpectrainError(f"method {method} needs a drafter")
    if method == "draft-model" and draft_model is None:
        raise SpectrainError("method draft-model needs a draft_model")
    if not prompts or not all(isinstance(p, (list, tuple)) and p and all(isinstance(t, str) for t in p)
                              for p in prompts):
        raise SpectrainError("prompts must be a non-empty list of prompts, each a non-empty list of user turns (str)")
    bound = bind_learned(method, drafter)  # the family and its evaluator, once (another family's drafter: refused)
    if s.min_confidence:  # before anything is decoded (only learned drafters take it: checked)
        bound.check_confidence()
    if reference is not None and [len(r["turns"]) for r in reference] != [len(p) for p in prompts]:
        raise SpectrainError("reference holds AR records of other prompts (turn counts differ)")
    model, tokenizer = verifier.model, verifier.tokenizer
    param = next(model.parameters())
    device, sampling = param.device, s.sampling
    torch.manual_seed(seed)
    context = max_context(verifier.config)
    if max_new_tokens >= context:
        raise SpectrainError(f"--max_new_tokens {max_new_tokens} is beyond the verifier's context of {context}")
    has_template = bool(getattr(tokenizer, "chat_template", None))
    use_template = has_template if chat_template is None else chat_template
    if use_template and not has_template:
        raise SpectrainError("chat template on, but the verifier's tokenizer has no chat template")
    if bound is None:
        refuse_draft_vocab(draft_vocab)
    else:
        bound = bound.with_vocab(*draft_vocab_of(bound, draft_vocab, model.get_output_embeddings().weight.shape[0]))
    vocab_size = bound.vocab_size if bound is not None else None
    if max_len is None:
        longest = max(len(encode_turn(tokenizer, [{"role": "user", "content": t}], use_template))
                      for p in prompts for t in p)
        widest = max(verify_sizes(s))  # the widest verify pass (a hybrid's lookup rounds included)
        max_len = min(context, max(len(p) for p in prompts) * (longest + max_new_tokens + 16) + max(80, widest))
    # Verifier layers the drafter reads besides the last hidden state (fused layers, a block drafter's targets).
    captured = bound.capture if bound is not None else ()
    rank_trees = bound is not None and bound.evaluator.rank_trees
    runner = StaticCausalLM(model, max_len=max_len, device=device, static=True if compile else None,
                            batch_invariant=batch_invariant, path=decoder)
    compile_seconds = None
    if compile:  # every size compiled and warmed up here, before anything is timed
        runner.capture = captured  # kept by every drafter's run: one set of graphs
        planner_sizes = list(range(2, k + 2)) + ([1 + n for n in PLANNER_TREES] if rank_trees else [])
        compile_seconds = runner.compile(verify_sizes(s) + (planner_sizes if costs else []))

    t0 = time.time()
    ar_records = reference if reference is not None else run_prompts(runner, Autoregressive(), prompts, tokenizer,
                                                                     use_template, s)
    results = {"ar": summarize(ar_records, 0)}
    per_prompt = {"ar": ar_records}
    calibration = None
    if rank_trees and (costs or s.auto_nodes):  # rank accuracies measured on AR's outputs (the family's probe)
        seqs = [t["sequence"] for r in ar_records for t in r["turns"]]
        starts = [t["prompt_tokens"] for r in ar_records for t in r["turns"]]
        calibration = bound.evaluator.calibrate(drafter, runner, seqs, starts, temperature=max(temperature, 1.0),
                                                decoding=sampling)
    trees = make_trees(s, bound, calibration)

    if costs:
        probe_prompt = encode_turn(tokenizer, [{"role": "user", "content": prompts[0][0]}], use_template)
        state = probe_state(runner, probe_prompt, sampling, captured)
        t_decode = verify_cost(runner, Tree.chain(0), len(probe_prompt))
        cost_table = {"context_tokens": len(probe_prompt), "t_decode_ms": 1000 * t_decode, "settings": {}}
    t_verify, t_draft = {}, {}
    for name, shape_tree in trees.items():
        spec = build_drafter(s, shape_tree, runner, bound, draft_model, name)
        records = run_prompts(runner, spec, prompts, tokenizer, use_template, s)
        # A hybrid's lookup branch reaches its own depth whatever the learned tree's depth.
        summary = summarize(records, max(shape_tree.max_depth, lookup_length(s, shape_tree)))
        same = identical_turns(ar_records, records)
        summary.update(tree_size=spec.max_nodes, tree_paths=[list(p) for p in shape_tree.paths], draft_vocab=vocab_size,
                       speedup=results["ar"]["decode_ms_per_token"] / max(summary["decode_ms_per_token"], 1e-9),
                       identical_turns=same,
                       identical_to_ar=sampling.greedy and same == sum(len(r["turns"]) for r in records))
        if s.min_confidence:  # chains only (checked): a cut chain's rounds verify fewer than k drafts
            summary["min_confidence"] = s.min_confidence
        if isinstance(spec, HybridDrafter):
            summary["lookup_round_fraction"] = round(spec.lookup_rounds / max(spec.rounds, 1), 4)
        if sampling.greedy:
            summary["divergences"] = divergences(runner, spec, ar_records, records, s, eos_ids(tokenizer))
        if calibration is not None and not shape_tree.is_chain:
            summary["expected_accept_length"] = expected_accept_length(shape_tree.paths, calibration["rank_accuracy"])
        summary.update(in_loop_costs(summary, results["ar"]))
        if costs and not s.min_confidence:  # isolated probes at one context length: what the planner prices
            # settings not run with (not for a cut chain: its verify width changes every round)
            # A hybrid chain's own rounds verify k + 1 (its lookup rounds bring their own length); a merged or
            # dynamic tree verifies its whole budget.
            own_chain = isinstance(spec, HybridDrafter) and not spec.merge
            verified = shape_tree if spec.max_nodes == shape_tree.size or own_chain else Tree.chain(spec.max_nodes)
            tv, td = verify_cost(runner, verified, len(probe_prompt)), draft_cost(spec, state)
            cost_table["settings"][name] = {"t_verify_ms": 1000 * tv, "t_draft_ms": 1000 * td,
                                            "draft_over_verify": td / max(tv, 1e-12),
                                            "ideal_speedup": summary["tau"] * t_decode / max(tv + td, 1e-12)}
            if shape_tree.is_chain and not name.startswith("dynamic"):
                t_verify[shape_tree.size], t_draft[shape_tree.size] = tv, td
        results[name] = summary
        per_prompt[name] = records
    planner = None
    if costs and not s.min_confidence:  # a cut chain's α counts only the rounds its head extended: not a chain's
        planner = plan_speedups(s, results, trees, runner, bound, draft_model, calibration, state, t_decode,
                                t_verify, t_draft, len(probe_prompt))
    hf = hf_generate_speed(model, tokenizer, prompts, use_template, s, hf_generate)
    return EvalResult(
        method=method, device=str(device), dtype=str(param.dtype).replace("torch.", ""), sampling=asdict(sampling),
        batch_invariant=runner.batch_invariant, draft_vocab=vocab_size,
        num_prompts=len(prompts), max_new_tokens=max_new_tokens, chat_template=use_template, results=results,
        per_prompt=per_prompt, costs=cost_table if costs else None, planner=planner, calibration=calibration,
        hf_generate=hf, compile=None if compile_seconds is None else {"seconds": compile_seconds,
                                                                       "buckets": list(runner.buckets)},
        eval_seconds=time.time() - t0, decoder=runner.path)
