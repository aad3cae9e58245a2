"""Our side of a real-engine comparison (``benchmarks/engine_check.py``, ``llama_cpp_check.py``,
``llama_cpp_speed.py``): the prompts, our evaluator's τ on the very prompt ids the engine gets, and where an
engine's two decoding paths part.

The engine and our loop must decode the same token ids: :func:`our_tau` records the ids our evaluator rendered
(chat template included), and the engine is handed those, so a difference in τ is the engine's, not the prompts'.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from spectrain.heads.families import family_for_method
from spectrain.heads.io import write_json


def first_turns(path: str, n: int, out: Path, tokenizer) -> list[list[str]]:
    """The first turn of the first ``n`` rows (``bundled:tinyshakespeare``: held-out pieces), also written to
    ``out``, a record of what was asked."""
    from spectrain.eval.prompts import load_prompts

    prompts = load_prompts(path, limit=n, first_turns=True, tokenizer=tokenizer)
    out.parent.mkdir(parents=True, exist_ok=True)
    write_json(out, prompts)
    return prompts


def our_tau(verifier, method: str, drafter_dir: Path, prompts: list[list[str]], out: Path, k: int,
            max_new_tokens: int) -> dict:
    """τ of a chain of ``k`` by our evaluator (fp32, T = 0, the chat template where the tokenizer has one — the
    prompt ids the engine gets are these —, the full draft vocabulary as the engine drafts, or the drafter's own
    where its family's evaluator says it was trained with one), cached in ``out/eval.json`` (a rerun with the same
    drafter and settings reuses it).

    Returns ``tau``, ``alpha``, ``identical_to_ar``, ``rounds``, ``accepted`` and ``accepted_per_pos`` (draft
    position i accepted in how many rounds; counted as an engine counts them), ``prompt_ids`` (what to hand the
    engine) and ``ar_tokens`` (our greedy output per prompt)."""
    from spectrain.eval.evaluate import EvalSettings, evaluate_drafter, load_drafter
    from spectrain.eval.families import evaluator_of

    family = family_for_method(method)
    kind = family.name
    drafter = load_drafter(str(drafter_dir), verifier, kind, allow_mismatch=True)
    draft_vocab = None if evaluator_of(family).fixed_draft_vocab(drafter, None) is not None else 0
    key = {"drafter": str(drafter_dir), "max_new_tokens": max_new_tokens, "num_prompts": len(prompts),
           "k": k, "draft_head": "own" if draft_vocab is None else "full"}  # (the result's draft_vocab is the N)
    cached = out / "eval.json"
    summary = json.loads(cached.read_text()) if cached.is_file() else None
    if not (summary and all(summary.get(key_) == v for key_, v in key.items())):  # else: resume, reuse this row
        settings = EvalSettings(k=k, hf_generate=0, max_new_tokens=max_new_tokens, draft_vocab=draft_vocab)
        result = evaluate_drafter(verifier, prompts, drafter, settings)
        summary = {**key, **result.to_dict()}
        write_json(cached, summary)
    chain = summary["results"][f"chain-{k}"]
    ar = summary["per_prompt"]["ar"]
    histogram = chain["accept_histogram"]  # rounds by accept length: our drafts and accepted tokens, as engines count
    return {"tau": chain["tau"], "alpha": chain["alpha"], "identical_to_ar": chain["identical_to_ar"],
            "rounds": sum(histogram),
            "accepted": sum(i * n for i, n in enumerate(histogram)),
            "accepted_per_pos": [sum(histogram[i + 1:]) for i in range(k)],
            "prompt_ids": [r["turns"][0]["sequence"][:r["turns"][0]["prompt_tokens"]] for r in ar],
            "ar_tokens": [r["turns"][0]["tokens"] for r in ar]}


def generation_eos(model) -> set[int]:
    """The token ids that end a generation for ``model`` (its ``generation_config``: one id or a list)."""
    eos_id = model.generation_config.eos_token_id
    return {eos_id} if isinstance(eos_id, int) else set(eos_id or [])


def f32_target(verifier: str, source: Path, out: Path) -> Path:
    """``out/target-f32.gguf``: the verifier's GGUF ``source`` re-encoded as f32, written once (``bundled:smollm2``
    through bf16: the very weights our drafters train and our loop decodes with)."""
    from spectrain.heads.serving.llama_cpp import write_verifier_gguf

    target = out / "target-f32.gguf"
    if not target.is_file():
        write_verifier_gguf(source, target, "float32", through="bfloat16" if verifier == "bundled:smollm2" else None)
    return target


def strip_eos(tokens: list[int], eos: set[int]) -> list[int]:
    """``tokens`` without a final end-of-sequence token (engines differ in whether they return it)."""
    return tokens[:-1] if tokens and tokens[-1] in eos else tokens


def partings(plain_runs: list[dict], spec_runs: list[dict], prompt_ids: list[list[int]], verifier,
             eos: set[int]) -> list[dict]:
    """Where llama.cpp's speculative output first parts from its plain greedy output, per prompt that parts: the
    two tokens, llama.cpp's margin between them in each path (log-probabilities; the speculative path has none
    when its token was an accepted draft) and our fp32 verifier's logit margin on the same context."""
    out = []
    for i, (p, s) in enumerate(zip(plain_runs, spec_runs)):
        a, b = strip_eos(p["tokens"], eos), strip_eos(s["tokens"], eos)
        pos = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), None)
        if pos is None:
            continue

        def margin(run, first, second):
            top = {t["id"]: t["logprob"] for t in (run["probs"][pos]["top_logprobs"] if pos < len(run["probs"]) else [])}
            return top[first] - top[second] if first in top and second in top else None

        with torch.no_grad():
            logits = verifier(torch.tensor([prompt_ids[i] + a[:pos]])).logits[0, -1].float()
        out.append({"prompt": i, "position": pos, "plain_token": a[pos], "spec_token": b[pos],
                    "plain_margin": margin(p, a[pos], b[pos]), "spec_margin": margin(s, b[pos], a[pos]),
                    "ours_fp32_margin": float(logits[a[pos]] - logits[b[pos]]),
                    "ours_fp32_argmax": int(logits.argmax())})
    return out


def path_spread(plain_runs: list[dict], spec_runs: list[dict], eos: set[int]) -> float | None:
    """How far llama.cpp's two paths disagree in this run: the largest difference between the plain (1-row) and
    the speculative (batched verify) path's log-probability of the same token at the same position, over every
    position both paths scored with the same context (up to and including a prompt's first parting; accepted
    drafts carry no probabilities). None: no position was scored by both. (Distillation's spread between an
    engine's 1-slot and N-slot replies is :func:`spectrain.data.engine.kernel_spread`.)"""
    spread = None
    for p, s in zip(plain_runs, spec_runs):
        a, b = strip_eos(p["tokens"], eos), strip_eos(s["tokens"], eos)
        stop = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)) - 1)
        for j in range(min(stop + 1, len(p["probs"]), len(s["probs"]))):
            plain = {t["id"]: t["logprob"] for t in p["probs"][j].get("top_logprobs") or []}
            spec = {t["id"]: t["logprob"] for t in s["probs"][j].get("top_logprobs") or []}
            for token in plain.keys() & spec.keys():
                d = abs(plain[token] - spec[token])
                spread = d if spread is None else max(spread, d)
    return spread
