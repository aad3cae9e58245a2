"""Medusa heads trained on a frozen verifier."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import torch

from spectrain.heads.errors import SpectrainError
from spectrain.heads.medusa import MedusaHeads

from .base import DrafterModule
from .losses import projected_cross_entropy, projected_topk

Target = Literal["ground_truth", "greedy", "soft"]


class MedusaModule(DrafterModule):
    """Train K Medusa heads; loss = sum_k decay^(k-1) * CE_k over loss-masked positions.

    Args:
        num_heads: K, the number of heads; head k at position t predicts token t+k+1.
        num_layers: ResBlocks per head.
        shared_lm_head: reuse the verifier's frozen ``lm_head`` for every head instead of a trainable copy each.
        target: what head k learns at position t: ``ground_truth`` (token t+k+1 of the data), ``greedy``
            (the verifier's argmax at position t+k: hard self-distillation), or ``soft`` (the verifier's full
            distribution at t+k, as in Medusa-2/Hydra++).
        loss_decay: lambda in the head weights lambda^(k-1).
        **kwargs: see :class:`DrafterModule` (verifier, optimizer, chunking).
    """

    method_name = "medusa"

    def __init__(
        self,
        num_heads: int = 4,
        num_layers: int = 1,
        shared_lm_head: bool = False,
        target: Target = "greedy",
        loss_decay: float = 0.8,
        **kwargs,
    ):
        if num_heads < 1:
            raise SpectrainError(f"model.num_heads must be >= 1, got {num_heads}")
        if num_layers < 0:
            raise SpectrainError(f"model.num_layers must be >= 0, got {num_layers}")
        if target not in ("ground_truth", "greedy", "soft"):
            raise SpectrainError(f"model.target must be ground_truth, greedy or soft, got {target!r}")
        self.num_heads, self.num_layers, self.shared_lm_head = num_heads, num_layers, shared_lm_head
        self.target, self.loss_decay = target, loss_decay
        super().__init__(**kwargs)

    def build_drafter(self) -> MedusaHeads:
        return MedusaHeads.for_verifier(self.verifier, self.num_heads, self.num_layers, self.shared_lm_head,
                                        verifier_name=self.verifier_name)

    def _head_rows(self, k: int, batch: dict) -> tuple[slice, torch.Tensor]:
        """Positions t where head k (0-based, predicts t+k+2) has a target, as a row index into (B*T')."""
        T = batch["input_ids"].shape[1]
        positions = slice(0, T - k - 2)  # t + k + 2 <= T - 1
        target_mask = (batch["loss_mask"] * batch["attention_mask"])[:, k + 2:].bool()
        return positions, target_mask.reshape(-1).nonzero().squeeze(1)

    def drafter_loss(self, batch: dict, features) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        hidden = features["hidden"]
        states = self.drafter.head_states(hidden.float())
        total = hidden.new_zeros((), dtype=torch.float32)
        parts = {}
        for k, state in enumerate(states):
            positions, rows = self._head_rows(k, batch)
            weight, bias = self.drafter.lm_head_params(k, self.verifier_lm_head)
            flat = state[:, positions].reshape(-1, state.shape[-1])[rows]
            if self.target == "soft":
                teacher = hidden[:, k + 1:hidden.shape[1] - 1].reshape(-1, hidden.shape[-1])[rows]
                head = self.verifier_lm_head
                loss = projected_cross_entropy(flat, weight, bias, teacher_states=teacher, teacher_weight=head.weight,
                                               teacher_bias=head.bias, chunk_size=self.loss_chunk_size)
            else:
                source = batch["input_ids"][:, k + 2:] if self.target == "ground_truth" else features["greedy"][:, k + 1:-1]
                loss = projected_cross_entropy(flat, weight, bias, target_ids=source.reshape(-1)[rows],
                                               chunk_size=self.loss_chunk_size)
            parts[f"head{k + 1}_loss"] = loss.detach()
            total = total + self.loss_decay ** k * loss
        return total, parts

    @torch.no_grad()
    def validation_counts(self, batch: dict, features) -> dict[str, torch.Tensor]:
        """Per head: top-1/top-5 hits vs the data and vs the verifier's greedy token; joint chain lengths."""
        hidden, greedy, ids = features["hidden"], features["greedy"], batch["input_ids"]
        T = ids.shape[1]
        valid_target = (batch["loss_mask"] * batch["attention_mask"]).bool()
        counts: dict[str, torch.Tensor] = {}
        hits, masks = [], []
        for k, state in enumerate(self.drafter.head_states(hidden.float())):
            weight, bias = self.drafter.lm_head_params(k, self.verifier_lm_head)
            top5 = projected_topk(state[:, :T - k - 2], weight, bias, k=5, chunk_size=self.topk_chunk_size)
            mask = valid_target[:, k + 2:]
            truth, verifier_tok = ids[:, k + 2:], greedy[:, k + 1:-1]
            hit_gt, hit_ver = top5 == truth[..., None], top5 == verifier_tok[..., None]
            counts[f"n_{k}"] = mask.sum()
            counts[f"top1_gt_{k}"] = (hit_gt[..., 0] & mask).sum()
            counts[f"top5_gt_{k}"] = (hit_gt.any(-1) & mask).sum()
            counts[f"top1_ver_{k}"] = (hit_ver[..., 0] & mask).sum()
            counts[f"top5_ver_{k}"] = (hit_ver.any(-1) & mask).sum()
            hits.append(hit_ver[..., 0])
            masks.append(mask)
        return {**counts, **self.chain_counts(hits, masks)}

    def val_metrics(self, sums: dict[str, torch.Tensor]) -> dict[str, float]:
        out: dict[str, float] = {}
        for k in range(self.num_heads):
            n = max(float(sums[f"n_{k}"]), 1.0)
            for name in ("top1_gt", "top5_gt", "top1_ver", "top5_ver"):
                out[f"head{k + 1}_{name}"] = float(sums[f"{name}_{k}"]) / n
        if float(sums["chain_n"]) > 0:
            n = max(float(sums["chain_n"]), 1.0)
            out["tau_pred"] = 1.0 + float(sums["chain_len"]) / n
            for j in range(self.num_heads):
                out[f"p_chain_{j + 1}"] = float(sums[f"chain_ge_{j}"]) / n
        return out

    def summary_rows(self, metrics: dict) -> tuple[list[str], list[list]]:
        names = ("top1_ver", "top5_ver", "top1_gt", "top5_gt")
        return (["head", "top1 vs verifier", "top5 vs verifier", "top1 vs data", "top5 vs data"],
                [[k + 1, *(metrics.get(f"head{k + 1}_{n}") for n in names)] for k in range(self.num_heads)])

    def export(self, out_dir: str | Path, state: dict[str, torch.Tensor] | None = None, extra: dict | None = None) -> Path:
        """Write the heads (optionally with ``state`` loaded, e.g. the best checkpoint) in our format."""
        heads = self.build_drafter()
        heads.load_state_dict(state if state is not None else self.drafter.state_dict())
        return heads.save_pretrained(out_dir, extra=extra)
