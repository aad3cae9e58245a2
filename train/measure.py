"""Measured τ at validation: a few fixed validation prompts decoded by the real lossless speculative loop.

:class:`TauMeter` is owned by :class:`~.base.DrafterModule` (``model.measure_prompts`` / ``measure_k`` /
``measure_new_tokens``), which calls it from its validation hooks. The prompts are the first validation rows cut
before their first target token, the same on every rank and for any number of ranks; each rank decodes its share
and the counts are summed. The chain drafter comes from the drafter's family (:mod:`spectrain.eval.families`), so
any registered family is measured alike, through ``eval/decode.generate`` and ``eval/static_model``
(train/ imports eval/ for this only, lazily).
"""

from __future__ import annotations

import warnings
from typing import Optional

import torch

from spectrain.data.loader import is_map_style
from spectrain.heads.errors import SpectrainError


class TauMeter:
    """Measured τ (tokens per verifier forward, bonus included, pooled) and α₁ of a chain of ``k`` drafts, T = 0,
    ``new_tokens`` per prompt, on ``num_prompts`` validation prompts (0: off)."""

    def __init__(self, num_prompts: int, k: int, new_tokens: int):
        if num_prompts < 0 or k < 1 or new_tokens < 1:
            raise SpectrainError(f"model.measure_prompts must be >= 0 and measure_k / measure_new_tokens >= 1, got "
                                 f"{num_prompts}, {k}, {new_tokens}")
        self.num_prompts, self.k, self.new_tokens = num_prompts, k, new_tokens
        self.prompts: list[list[int]] = []  # the same on every rank; each decodes its share of them
        self.own: list[list[int]] = []  # this rank's, from its validation batches (bare dataloaders)
        self.scanned = False  # the datamodule's validation set was searched once: never again
        self.from_batches = False  # no datamodule validation set: prompts come from the validation batches
        self.warned_sharded = False

    @property
    def on(self) -> bool:
        return self.num_prompts > 0

    def check_decoder(self, verifier) -> None:
        """At fit start: fail now, not at the first validation, if our decoder cannot run this verifier."""
        if self.on:
            from spectrain.eval.static_model import StaticCausalLM

            StaticCausalLM(verifier, max_len=8, device=verifier.get_output_embeddings().weight.device)

    def epoch_start(self, datamodule) -> None:
        """At each validation's start: the prompts from the datamodule's validation set (searched once)."""
        self.from_batches = datamodule is None or getattr(datamodule, "val_set", None) is None
        if self.on and not self.from_batches and not self.scanned:
            self.prompts = measure_prompts_from(datamodule.val_set, self.num_prompts)
            self.scanned = True  # a set with fewer usable prompts is not scanned again each validation

    def collect(self, batch: dict) -> None:
        """A validation batch's prompts (:func:`row_prompt`), up to ``num_prompts``, when they come from the
        batches; rows without targets (a rank's padding, :class:`~spectrain.data.loader.RankShare`) give none."""
        if not self.from_batches or len(self.own) >= self.num_prompts:
            return
        for ids, loss, valid in zip(batch["input_ids"], batch["loss_mask"], batch["attention_mask"].bool()):
            if not bool(loss[valid].any()):
                continue
            prompt = row_prompt(ids[valid], loss[valid])
            if prompt is not None and len(self.own) < self.num_prompts:
                self.own.append(prompt)

    def gather(self, world: int) -> None:
        """At each validation's end, on every rank (a collective when prompts come from the batches)."""
        if self.from_batches:
            self.prompts = merge_rank_prompts(self.own, world, self.num_prompts)

    def metrics(self, module) -> dict[str, float]:
        """``tau_measured`` / ``alpha1_measured`` of ``module`` (a DrafterModule) — none while a strategy shards
        the verifier (our decoder runs its layers directly), with a warning once. The same branch on every rank."""
        if not self.prompts:
            return {}
        if module.verifier_is_sharded():
            if not self.warned_sharded:
                warnings.warn("measured tau is skipped while the verifier is sharded (FSDP); predicted tau and the "
                              "validation counts are still computed. Measure the exported drafter with spectrain-eval")
                self.warned_sharded = True
            return {}
        return self.measure(module)

    @torch.no_grad()
    def measure(self, module) -> dict[str, float]:
        """Decode this rank's share of the prompts with the module's drafter (a copy in the verifier's dtype) and
        pool the counts over ranks (a collective when ``world > 1``). The training RNG streams are untouched."""
        from spectrain.eval.decode import generate
        from spectrain.eval.families import evaluator_of, learned_drafter
        from spectrain.eval.static_model import StaticCausalLM
        from spectrain.eval.tree import Tree
        from spectrain.heads.families import family_of

        param = module.verifier_lm_head.weight
        drafter = module.plain_drafter().to(param.device, param.dtype).eval()
        depth = evaluator_of(family_of(drafter)).max_depth(drafter)
        chain = learned_drafter(drafter, module.verifier, Tree.chain(self.k if depth is None else min(self.k, depth)))
        longest = max(len(p) for p in self.prompts)
        runner = StaticCausalLM(module.verifier, max_len=longest + self.new_tokens + self.k + 2, device=param.device)
        counts = torch.zeros(3, dtype=torch.long)  # emitted, rounds, rounds with the first draft accepted
        generator = torch.Generator(device=param.device).manual_seed(0)
        world = module.trainer.world_size if module._trainer is not None else 1
        for prompt in self.prompts[module.global_rank::world]:  # each rank its share, pooled below
            out = generate(runner, chain, prompt, self.new_tokens, generator=generator)
            counts += torch.tensor([sum(out.emitted_per_round), len(out.accept_lengths),
                                    sum(a >= 1 for a in out.accept_lengths)])
        if world > 1:
            counts = module.trainer.strategy.reduce(counts.to(module.device), reduce_op="sum").cpu()
        emitted, rounds, first = counts.tolist()
        return {"tau_measured": emitted / max(rounds, 1), "alpha1_measured": first / max(rounds, 1)}


def row_prompt(ids: torch.Tensor, loss_mask: torch.Tensor) -> Optional[list[int]]:
    """A validation row's prompt for measured tau: the tokens before its first target; for text (every token a
    target) the row's first half, at most 64 tokens. ``None`` when that leaves fewer than 2 tokens."""
    target = loss_mask.bool()
    first = int(target.int().argmax()) if bool(target.any()) else 0
    if first < 2:
        first = min(64, ids.shape[0] // 2)
    return ids[:first].tolist() if first >= 2 else None


def merge_rank_prompts(own: list[list[int]], world: int, n: int) -> list[list[int]]:
    """Every rank's prompts (each from its own validation rows) as one list, the same on every rank: rank 0's
    first, rank 1's first, ..., rank 0's second, ... (the order of the rows the ranks were dealt), at most ``n``.
    A collective when ``world > 1``."""
    if world == 1:
        return own[:n]
    ranks: list = [None] * world
    torch.distributed.all_gather_object(ranks, own)
    merged = [tuple(r[i]) for i in range(max(map(len, ranks))) for r in ranks if i < len(r)]
    # Loaders that are not sharded by rank give every rank the same rows: each prompt once.
    return [list(p) for p in dict.fromkeys(merged)][:n]


def measure_prompts_from(val_set, n: int) -> list[list[int]]:
    """The first ``n`` prompts of the validation set in its own order — the same on every rank and for any number
    of ranks (each rank then decodes its share of them). Map-style sets are read by index; streams (an
    ``IterableDataset``) from their start."""
    prompts: list[list[int]] = []
    if n <= 0:
        return prompts  # (a stream would otherwise be read to its end)
    rows = (val_set[i] for i in range(len(val_set))) if is_map_style(val_set) else iter(val_set)
    for row in rows:
        ids = torch.as_tensor(row["input_ids"])
        loss = torch.as_tensor(row["loss_mask"]) if "loss_mask" in row else torch.ones_like(ids)
        prompt = row_prompt(ids, loss)
        if prompt is not None:
            prompts.append(prompt)
        if len(prompts) == n:
            break
    return prompts
