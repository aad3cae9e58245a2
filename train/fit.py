"""Will it fit? A training run's memory per device, estimated from the recipe and the verifier's config alone.

``spectrain-train --config RECIPE --dry_run [--device_memory GiB]`` (``train/cli.py``) calls :func:`fit_check`:
the verifier's shape is read offline (:func:`~spectrain.heads.verifier_shapes.verifier_config`), the verifier and
the drafter are built on the ``meta`` device (exact parameter counts, no memory), and the recipe's module class
estimates its own step through two hooks (:meth:`~.base.DrafterModule.fit_drafter`,
:meth:`~.base.DrafterModule.fit_activations`); this file names no drafter family.

Memory per device, in bytes (``e`` = 4 under 32-true, 2 under bf16 / fp16 precisions, for activations):

* verifier weights: its parameters x its dtype's size (``model.verifier_dtype``; auto follows the precision);
* drafter + optimizer: parameters x 4 (kept fp32: under bf16-mixed Lightning autocasts, the fp32 weights are the
  master weights) + trainable x 8 (AdamW's fp32 ``exp_avg`` and ``exp_avg_sq``), held between steps;
* the step: trainable x 4 (fp32 gradients, freed after each optimizer step) + the larger of the verifier's forward
  and the drafter's phase (the features it reads, B x T x H x (1 + captured layers), + activations + logits);
* verifier forward (online data): HF keeps every layer's output (``output_hidden_states``): (L + 1) x B x T x H
  in the verifier's dtype, plus one layer's MLP (3 x B x T x I); from a store: the stored features read back;
* activations: the family's (its hook), at the recipe's block size, batch and depth;
* loss logits: rows x vocabulary x 12 bytes when kept for backward (fp32 log-probabilities + two gradients), or one chunk's
  (``loss_chunk_size`` rows) when the loss recomputes them, as ``loss_recompute`` / ``loss_memory_budget_gb``
  decide (the budget defaults to a quarter of the device memory left after the weights).

The peak is weights + optimizer + step: the verifier's transient is gone before the drafter's phase starts. Checked against measured peak RSS on CPU (tests/test_fit_check.py).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import torch

from spectrain.heads.errors import SpectrainError
from spectrain.heads.report import finish, format_table
from spectrain.heads.verifier import max_context

GIB = 2 ** 30
# Per logit kept for backward: the fp32 log-probabilities saved, their gradient and the logits' gradient at the
# backward peak (train.losses.BYTES_PER_KEPT_LOGIT, 10, is the loss's own budget rule: what forward keeps)
BYTES_PER_LOGIT_KEPT = 12
ADAMW_STATE_BYTES = 8  # exp_avg + exp_avg_sq, fp32
GRAD_BYTES = 4  # fp32 gradients of fp32 weights


@dataclass
class StepActivations:
    """A family's estimate of one training step (its :meth:`~.base.DrafterModule.fit_activations`).

    ``parts``: named bytes kept for backward or peaking during the step (per device), logits excluded;
    ``logit_rows`` x ``logit_vocab``: the loss's vocabulary projection; ``chunkable``: whether the loss can
    recompute it chunk by chunk (else a step over the budget is refused); ``captured_layers``: HF hidden_states
    indices a store must hold besides the last hidden state (what the drafter reads).
    """

    parts: dict[str, int]
    logit_rows: int
    logit_vocab: int
    chunkable: bool = True
    captured_layers: tuple[int, ...] = ()
    notes: list[str] = field(default_factory=list)


def activation_bytes(precision: str) -> int:
    """Bytes per activation element under a Lightning precision."""
    return 2 if any(p in str(precision) for p in ("bf16", "16-mixed", "16-true")) else 4


def count_params(module: torch.nn.Module) -> tuple[int, int]:
    """(parameters, trainable parameters)."""
    params = list(module.parameters())
    return sum(p.numel() for p in params), sum(p.numel() for p in params if p.requires_grad)


def is_store(path: Optional[str]) -> bool:
    """Whether ``data.path`` is a hidden-state store (features read back, no verifier forward)."""
    return bool(path) and (Path(path) / "train" / "metadata.json").is_file()


@dataclass
class Recipe:
    """What the estimate reads of a parsed recipe."""

    module: type
    init_args: dict
    verifier_dtype: torch.dtype
    precision: str
    batch_size: int
    block_size: int
    accumulation: int
    devices: int
    data_path: Optional[str]
    store_dtype: torch.dtype = torch.bfloat16


def loss_logits(acts: StepActivations, init_args: dict, budget: Optional[int]) -> tuple[int, str]:
    """(bytes, how) of the loss's logits: kept whole or one recomputed chunk, as the module would decide."""
    kept = acts.logit_rows * acts.logit_vocab * BYTES_PER_LOGIT_KEPT
    mode = init_args.get("loss_recompute", "auto")
    chunk = init_args.get("loss_chunk_size")
    if init_args.get("loss_memory_budget_gb"):
        budget = int(init_args["loss_memory_budget_gb"] * GIB)
    recompute = mode == "always" or (mode == "auto" and budget is not None and kept > budget)
    if not recompute or not acts.chunkable or not chunk:
        if acts.chunkable or budget is None or kept <= budget or mode != "auto":
            return kept, "kept"
        return kept, "refused: over the loss budget"
    return min(chunk, acts.logit_rows) * acts.logit_vocab * (BYTES_PER_LOGIT_KEPT + 2), f"chunks of {chunk} rows"


def verifier_forward_bytes(config, recipe: Recipe, captured: tuple[int, ...]) -> int:
    """The verifier's features: online, every hidden state HF keeps plus one layer's MLP; from a store, the stored
    last hidden and captured layers read back (and cast to the verifier's dtype)."""
    B, T, H = recipe.batch_size, recipe.block_size, config.hidden_size
    width = recipe.verifier_dtype.itemsize
    if is_store(recipe.data_path):
        return B * T * H * (1 + len(captured)) * (recipe.store_dtype.itemsize + width)
    layers = config.num_hidden_layers
    return B * T * ((layers + 1) * H + 3 * config.intermediate_size) * width


def estimate(recipe: Recipe, config, verifier, drafter, device_memory: Optional[int] = None) -> dict:
    """Every figure of the fit check at ``recipe.block_size`` (bytes; see the module docstring)."""
    verifier_params = sum(p.numel() for p in verifier.parameters())
    weights = verifier_params * recipe.verifier_dtype.itemsize
    params, trainable = count_params(drafter)
    optimizer = params * 4 + trainable * ADAMW_STATE_BYTES
    acts = recipe.module.fit_activations(recipe.init_args, drafter, config, recipe.batch_size, recipe.block_size,
                                         activation_bytes(recipe.precision))
    budget = (device_memory - weights - optimizer) // 4 if device_memory else None
    logits, how = loss_logits(acts, recipe.init_args, budget)
    forward = verifier_forward_bytes(config, recipe, acts.captured_layers)
    features = (recipe.batch_size * recipe.block_size * config.hidden_size * (1 + len(acts.captured_layers))
                * recipe.verifier_dtype.itemsize)  # the last hidden and the captured layers, read by the drafter
    activations = sum(acts.parts.values())
    step = trainable * GRAD_BYTES + max(forward, features + activations + logits)
    total = weights + optimizer + step
    return {"block_size": recipe.block_size, "verifier_params": verifier_params, "verifier_weight_bytes": weights,
            "drafter_params": params, "drafter_trainable": trainable, "drafter_optimizer_bytes": optimizer,
            "verifier_forward_bytes": forward, "activation_bytes": activations, "activation_parts": acts.parts,
            "logit_rows": acts.logit_rows, "logit_vocab": acts.logit_vocab, "logits_bytes": logits,
            "logits": how, "feature_bytes": features, "gradient_bytes": trainable * GRAD_BYTES, "step_bytes": step,
            "total_bytes": total,
            "captured_layers": list(acts.captured_layers), "notes": acts.notes}


def largest_block(recipe: Recipe, config, verifier, drafter, device_memory: int) -> int:
    """The largest block size (a power-of-two step search, then bisection) whose estimate fits ``device_memory``
    and the verifier's context; 0 if not even 2 tokens fit."""
    from dataclasses import replace

    def fits(T: int) -> bool:
        figures = estimate(replace(recipe, block_size=T), config, verifier, drafter, device_memory)
        return figures["total_bytes"] <= device_memory and not figures["logits"].startswith("refused")

    ceiling = max_context(config)
    if not fits(2):
        return 0
    low, high = 2, 4
    while high <= ceiling and fits(high):
        low, high = high, high * 2
    high = min(high, ceiling + 1)
    while high - low > 1:
        mid = (low + high) // 2
        low, high = (mid, high) if fits(mid) else (low, mid)
    return low


def gib(n: int) -> str:
    return f"{n / GIB:,.2f} GiB"


def fit_check(recipe: Recipe, verifier_name: str, out: Path, device_memory_gib: Optional[float] = None,
              trust_remote_code: bool = False, command: Optional[str] = None) -> Path:
    """Estimate, print the table and write the JSON (last stdout line its path); nothing is trained or loaded.
    ``command``: the command line that asked, recorded in the JSON."""
    from spectrain.data.store import store_bytes_per_token
    from spectrain.heads.verifier_shapes import meta_verifier, verifier_config

    if device_memory_gib is not None and not device_memory_gib > 0:
        raise SpectrainError(f"--device_memory must be > 0 GiB, got {device_memory_gib}")
    config, source = verifier_config(verifier_name, trust_remote_code)
    if recipe.block_size > max_context(config):
        raise SpectrainError(f"data.block_size={recipe.block_size} exceeds the verifier's context of "
                             f"{max_context(config)} tokens")
    verifier = meta_verifier(config)
    with torch.device("meta"):
        drafter = recipe.module.fit_drafter(recipe.init_args, verifier)
    device_memory = int(device_memory_gib * GIB) if device_memory_gib else None
    figures = estimate(recipe, config, verifier, drafter, device_memory)
    per_token = store_bytes_per_token(config.hidden_size, len(figures["captured_layers"]), recipe.store_dtype)
    tokens = recipe.batch_size * recipe.block_size * recipe.accumulation * recipe.devices
    summary = {"command": command, "date": time.strftime("%Y-%m-%d"), "verifier": verifier_name,
               "verifier_config": source, "module": recipe.module.__qualname__,
               "precision": recipe.precision, "verifier_dtype": str(recipe.verifier_dtype).replace("torch.", ""),
               "batch_size": recipe.batch_size, "accumulate_grad_batches": recipe.accumulation,
               "devices": recipe.devices, "tokens_per_optimizer_step": tokens,
               "store_bytes_per_token": per_token, "store_bytes_per_million_tokens": per_token * 10 ** 6,
               "online": not is_store(recipe.data_path), **figures,
               "source": "estimated from the recipe and the verifier's config (train/fit.py), not measured"}
    if device_memory:
        summary.update(device_memory_bytes=device_memory, fits=figures["total_bytes"] <= device_memory
                       and not figures["logits"].startswith("refused"),
                       largest_block_size=largest_block(recipe, config, verifier, drafter, device_memory))
    summary["printed"] = printed_figures(summary)
    return finish(summary, out, tables=[fit_table(summary)])


def printed_figures(s: dict) -> dict:
    """The figures as the table prints them (GiB, millions of parameters, GB per million tokens), so a page that
    quotes them can be checked against the file."""
    return {"drafter_params_millions": round(s["drafter_params"] / 1e6, 1),
            **{f"{key.removesuffix('_bytes')}_gib": round(s[key] / GIB, 2)
               for key in ("verifier_weight_bytes", "drafter_optimizer_bytes", "gradient_bytes",
                           "verifier_forward_bytes", "activation_bytes", "logits_bytes", "total_bytes")},
            "store_gb_per_million_tokens": round(s["store_bytes_per_million_tokens"] / 1e9, 2)}


def fit_table(s: dict) -> str:
    rows = [["verifier", f"{s['verifier']} ({s['verifier_config']})"],
            ["drafter parameters", f"{s['drafter_params']:,} ({s['drafter_trainable']:,} trainable)"],
            ["verifier weights", f"{gib(s['verifier_weight_bytes'])} ({s['verifier_params']:,} x {s['verifier_dtype']})"],
            ["drafter + AdamW states (fp32)", gib(s["drafter_optimizer_bytes"])],
            ["gradients (fp32)", gib(s["gradient_bytes"])],
            ["verifier forward" + (" (online)" if s["online"] else " (store)"), gib(s["verifier_forward_bytes"])],
            [f"activations (block {s['block_size']})", gib(s["activation_bytes"])],
            [f"loss logits ({s['logits']})", f"{gib(s['logits_bytes'])} ({s['logit_rows']:,} x {s['logit_vocab']:,})"],
            ["peak per device", gib(s["total_bytes"])],
            ["tokens per optimizer step", f"{s['tokens_per_optimizer_step']:,} (batch x block x accumulation x devices)"],
            ["store per million tokens", f"{s['store_bytes_per_million_tokens'] / 1e9:,.2f} GB "
                                         f"(layers {s['captured_layers']} + last, bf16)"]]
    if "fits" in s:
        rows += [["device memory", gib(s["device_memory_bytes"])], ["fits", "yes" if s["fits"] else "NO"],
                 ["largest block size that fits", f"{s['largest_block_size']:,}"]]
    return format_table(["figure", "value"], rows, title=f"Will it fit? {s['module']} — estimated, not measured")
