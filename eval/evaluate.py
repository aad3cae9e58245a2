"""The evaluation API: one typed function that decodes prompts with a drafter through our lossless speculative
loop, beside plain autoregressive decoding of the same prompts, and returns what it measured.

``spectrain-eval`` and ``spectrain-results`` are thin command lines around :func:`evaluate_drafter`; the checks in
``benchmarks/`` call it directly::

    verifier = load_verifier("bundled:tinyshakespeare", dtype=torch.float32)
    drafter = load_drafter("runs/heads", verifier)
    result = evaluate_drafter(verifier, [["To be, or not"]], drafter, EvalSettings(k=4))
    result.results["chain-4"]["tau"]

It walks one evaluation in order; its steps live beside it, one job each: the settings (:mod:`.settings`), the
methods and their shapes (:mod:`.methods`, the training-free ones in :mod:`.training_free`), set-up
(:mod:`.setup`), runs and summaries (:mod:`.runs`), the planner (:mod:`.planner`); import their names from them.
This module's public surface is :data:`__all__`: the function, its settings, its result and the drafter loader.
Imports only torch and transformers (and safetensors through the drafter loaders).
"""

from __future__ import annotations

import time
from contextlib import nullcontext
from dataclasses import asdict

import torch

from spectrain.heads.errors import SpectrainError
from spectrain.heads.verifier import Verifier, max_context

from .costs import draft_cost, probe_state, verify_cost
from .drafters import Autoregressive, HybridDrafter
from .methods import DraftInputs, EvalMethod, bind_learned, make_trees, resolve_method
from .planner import PLANNER_TREES, plan_speedups
from .runs import (HF_GENERATE, HFGenerate, divergences, encode_turn, eos_ids, identical_turns, in_loop_costs,
                   run_prompts, speed_on, speedup_over, summarize)
from .settings import EvalSettings, TreeKind
from .setup import EvalResult, draft_vocab_of, load_drafter, refuse_draft_vocab
from .static_model import StaticCausalLM
from .tree import Tree, expected_accept_length

__all__ = ["EvalResult", "EvalSettings", "evaluate_drafter", "load_drafter"]


def evaluate_drafter(verifier: Verifier, prompts: list[list[str]],
                     drafter_or_method: EvalMethod | str | torch.nn.Module, settings: EvalSettings | None = None,
                     *, drafter: torch.nn.Module | None = None, reference: list[dict] | None = None) -> EvalResult:
    """Decode ``prompts`` with AR and with every drafting setting ``settings`` names; measure τ, α, speed.

    Args:
        verifier: the loaded verifier (:func:`spectrain.heads.verifier.load_verifier`); its device and dtype are
            the run's.
        prompts: per prompt its user turns (later turns see the earlier answers, as MT-bench does): a list of
            lists of str.
        drafter_or_method: what drafts: a learned drafter (:func:`load_drafter`; its family's method, the family
            found from it), or a method (:func:`methods`: a name or an :class:`EvalMethod`) — a family's name,
            ``ngram`` (prompt lookup), ``hybrid`` (prompt lookup + ``drafter``), ``draft-model`` (``drafter``: a small causal LM),
            ``truncated`` (the verifier's first ``settings.draft_layers`` layers) or ``none`` (AR only).
        settings: every decoding and measurement knob (:class:`EvalSettings`, checked when made; None: its
            defaults, a chain of 4 at T = 0): ``k`` → setting ``chain-k``, ``tree`` → ``tree-N``, ``dynamic_tree``
            → ``dynamic-DxT-B``. The method refuses what it does not draft (:meth:`EvalMethod.check`).
        drafter: what a method given by name drafts with: its learned drafter (a family's, ``hybrid``) or, for
            ``draft-model``, a causal LM with the verifier's vocabulary.
        reference: AR records of these prompts from an earlier call (``result.per_prompt["ar"]``, one dict per
            prompt with its ``turns``): reused instead of decoding AR again.

    Returns:
        An :class:`EvalResult`: per setting τ, α by depth, the accept-length histogram, speed and identity to AR,
        the per-prompt records (each turn's token ids), costs, planner and calibration.
    """
    s = EvalSettings() if settings is None else settings
    if not isinstance(s, EvalSettings):
        raise SpectrainError(f"settings must be an EvalSettings, got {type(s).__name__}")
    method, learned = resolve_method(drafter_or_method, drafter)
    # draft-model's drafter is a causal LM, no learned drafter of a family
    learned, draft_model = (None, learned) if method.needs_draft_model else (learned, None)
    bound = bind_learned(method, learned)  # the family and its evaluator, once (another family's drafter: refused)
    s = method.check(s, bound)  # what the method (and its drafter's family) drafts
    if method.needs_draft_model and not callable(getattr(draft_model, "get_output_embeddings", None)):
        raise SpectrainError(f"method {method.name} needs a drafter: a causal LM with the verifier's vocabulary"
                             f"{'' if draft_model is None else f', got a {type(draft_model).__name__}'}")
    if not prompts or not all(isinstance(p, (list, tuple)) and p and all(isinstance(t, str) for t in p)
                              for p in prompts):
        raise SpectrainError("prompts must be a non-empty list of prompts, each a non-empty list of user turns (str)")
    if s.min_confidence:  # before anything is decoded (only learned drafters take it: checked)
        bound.check_confidence()
    if reference is not None and [len(r["turns"]) for r in reference] != [len(p) for p in prompts]:
        raise SpectrainError("reference holds AR records of other prompts (turn counts differ)")
    model, tokenizer = verifier.model, verifier.tokenizer
    param = next(model.parameters())
    device, sampling = param.device, s.sampling
    torch.manual_seed(s.seed)
    context = max_context(verifier.config)
    if s.max_new_tokens >= context:
        raise SpectrainError(f"--max_new_tokens {s.max_new_tokens} is beyond the verifier's context of {context}")
    has_template = bool(getattr(tokenizer, "chat_template", None))
    use_template = has_template if s.chat_template is None else s.chat_template
    if use_template and not has_template:
        raise SpectrainError("chat template on, but the verifier's tokenizer has no chat template")
    if bound is None:
        refuse_draft_vocab(s.draft_vocab)
    else:
        bound = bound.with_vocab(*draft_vocab_of(bound, s.draft_vocab, model.get_output_embeddings().weight.shape[0]))
    vocab_size = bound.vocab_size if bound is not None else None
    max_len = s.max_len
    if max_len is None:
        longest = max(len(encode_turn(tokenizer, [{"role": "user", "content": t}], use_template))
                      for p in prompts for t in p)
        widest = max(method.verify_sizes(s))  # the widest verify pass (a hybrid's lookup rounds included)
        max_len = min(context, max(len(p) for p in prompts) * (longest + s.max_new_tokens + 16) + max(80, widest))
    # Verifier layers the drafter reads besides the last hidden state (fused layers, a block drafter's targets).
    captured = bound.capture if bound is not None else ()
    rank_trees = bound is not None and bound.evaluator.rank_trees
    runner = StaticCausalLM(model, max_len=max_len, device=device, static=True if s.compile else None,
                            batch_invariant=s.batch_invariant, path=s.decoder)
    compile_seconds = None
    if s.compile:  # every size compiled and warmed up here, before anything is timed
        runner.capture = captured  # kept by every drafter's run: one set of graphs
        planner_sizes = list(range(2, s.k + 2)) + ([1 + n for n in PLANNER_TREES] if rank_trees else [])
        compile_seconds = runner.compile(method.verify_sizes(s) + (planner_sizes if s.costs else []))
    inputs = DraftInputs(runner, bound, draft_model)

    t0 = time.time()
    hf_prompts = len(prompts) if s.hf_generate is None else min(s.hf_generate, len(prompts))
    hf = HFGenerate(model, tokenizer, s, hf_prompts) if hf_prompts else None
    with hf or nullcontext():
        records, shapes, specs, calibration = _decode(runner, method, s, bound, learned, inputs, prompts, tokenizer,
                                                      use_template, reference, hf)
    ar_records = records["ar"]
    hf_speed = speed_on(records[HF_GENERATE], hf_prompts) if hf else None
    results = {"ar": summarize(ar_records, 0)}
    per_prompt = {"ar": ar_records}

    if s.costs:
        probe_prompt = encode_turn(tokenizer, [{"role": "user", "content": prompts[0][0]}], use_template)
        state = probe_state(runner, probe_prompt, sampling, captured)
        t_decode = verify_cost(runner, Tree.chain(0), len(probe_prompt))
        cost_table = {"context_tokens": len(probe_prompt), "t_decode_ms": 1000 * t_decode, "settings": {}}
    t_verify, t_draft = {}, {}
    for shape in shapes:
        name, shape_tree, spec = shape.name, shape.tree, specs[shape.name]
        # A hybrid's lookup branch reaches its own depth whatever the learned tree's depth.
        summary = summarize(records[name], max(shape_tree.max_depth, method.lookup_length(s, shape_tree)))
        same = identical_turns(ar_records, records[name])
        summary.update(tree_size=spec.max_nodes, tree_paths=[list(p) for p in shape_tree.paths], draft_vocab=vocab_size,
                       speedup=results["ar"]["decode_ms_per_token"] / max(summary["decode_ms_per_token"], 1e-9),
                       identical_turns=same,
                       identical_to_ar=sampling.greedy and same == sum(len(r["turns"]) for r in records[name]))
        if s.min_confidence:  # chains only (checked): a cut chain's rounds verify fewer than k drafts
            summary["min_confidence"] = s.min_confidence
        if isinstance(spec, HybridDrafter):
            summary["lookup_round_fraction"] = round(spec.lookup_rounds / max(spec.rounds, 1), 4)
        if sampling.greedy:
            summary["divergences"] = divergences(runner, spec, ar_records, records[name], s, eos_ids(tokenizer))
        if calibration is not None and not shape_tree.is_chain:
            summary["expected_accept_length"] = expected_accept_length(shape_tree.paths, calibration["rank_accuracy"])
        summary.update(in_loop_costs(summary, results["ar"]))
        if s.costs and not s.min_confidence:  # isolated probes at one context length: what the planner prices
            # settings not run with (not for a cut chain: its verify width changes every round)
            # A hybrid chain's own rounds verify k + 1 (its lookup rounds bring their own length); a merged or
            # dynamic tree verifies its whole budget.
            own_chain = isinstance(spec, HybridDrafter) and not spec.merge
            verified = shape_tree if spec.max_nodes == shape_tree.size or own_chain else Tree.chain(spec.max_nodes)
            tv, td = verify_cost(runner, verified, len(probe_prompt)), draft_cost(spec, state)
            cost_table["settings"][name] = {"t_verify_ms": 1000 * tv, "t_draft_ms": 1000 * td,
                                            "draft_over_verify": td / max(tv, 1e-12),
                                            "ideal_speedup": summary["tau"] * t_decode / max(tv + td, 1e-12)}
            if shape_tree.is_chain and shape.kind is not TreeKind.DYNAMIC:
                t_verify[shape_tree.size], t_draft[shape_tree.size] = tv, td
        results[name] = summary
        per_prompt[name] = records[name]
    for name, summary in results.items():  # every speed over both baselines: our AR (``speedup``) and HF's
        summary["speedup_over_hf"] = None if hf is None else speedup_over(hf_speed, records[name])
    planner = None
    if s.costs and not s.min_confidence:  # a cut chain's α counts only the rounds its head extended: not a chain's
        planner = plan_speedups(s, method, results, shapes, inputs, calibration, state, t_decode, t_verify, t_draft,
                                len(probe_prompt))
    return EvalResult(
        method=method.name, device=str(device), dtype=str(param.dtype).replace("torch.", ""),
        sampling=asdict(sampling), batch_invariant=runner.batch_invariant, draft_vocab=vocab_size,
        num_prompts=len(prompts), max_new_tokens=s.max_new_tokens, chat_template=use_template, results=results,
        per_prompt=per_prompt, costs=cost_table if s.costs else None, planner=planner, calibration=calibration,
        hf_generate=hf_speed, compile=None if compile_seconds is None else {"seconds": compile_seconds,
                                                                       "buckets": list(runner.buckets)},
        eval_seconds=time.time() - t0, decoder=runner.path)


def _decode(runner: StaticCausalLM, method: EvalMethod, s: EvalSettings, bound, learned, inputs: DraftInputs,
            prompts: list[list[str]], tokenizer, use_template: bool, reference: list[dict] | None,
            hf: HFGenerate | None) -> tuple[dict, list, dict, dict | None]:
    """Every timed run, interleaved prompt by prompt (:func:`~.runs.run_prompts`): AR (unless ``reference``), HF
    ``generate()`` and every setting's drafter. A family that calibrates its trees on AR's outputs gets AR (and HF)
    over every prompt first, then the settings. Returns the records by name (``ar``, ``hf_generate``, each
    setting), the shapes, their drafters and the calibration."""
    ar = {} if reference is not None else {"ar": Autoregressive()}
    calibration = None
    first: dict = {}
    if bound is not None and bound.evaluator.rank_trees and (s.costs or s.auto_nodes):
        first = run_prompts(runner, ar, prompts, tokenizer, use_template, s, hf if ar else None) if ar else {}
        ar_records = reference if reference is not None else first["ar"]
        seqs = [t["sequence"] for r in ar_records for t in r["turns"]]
        starts = [t["prompt_tokens"] for r in ar_records for t in r["turns"]]
        calibration = bound.evaluator.calibrate(learned, runner, seqs, starts, temperature=max(s.temperature, 1.0),
                                                decoding=s.sampling)
        hf, ar = (None if ar else hf), {}  # HF ran beside AR, where AR ran
    shapes = make_trees(s, bound, calibration)
    specs = {shape.name: method.drafter(s, shape, inputs) for shape in shapes}
    records = {**first, **run_prompts(runner, {**ar, **specs}, prompts, tokenizer, use_template, s, hf)}
    if reference is not None:
        records["ar"] = reference
    return records, shapes, specs, calibration
