"""Medusa heads trained on a frozen verifier."""

from __future__ import annotations

from pathlib import Path
from typing import Literal, Optional

import torch

from spectrain.heads.errors import SpectrainError
from spectrain.heads.medusa import MedusaHeads

from .base import DrafterModule
from .fit import StepActivations
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
        if target != "soft" and kwargs.get("token_loss", "ce") != "ce":
            raise SpectrainError(f"model.token_loss {kwargs['token_loss']} compares the heads' distributions with the "
                                 "verifier's: it needs model.target soft")
        self.num_heads, self.num_layers, self.shared_lm_head = num_heads, num_layers, shared_lm_head
        self.target, self.loss_decay = target, loss_decay
        super().__init__(**kwargs)

    @classmethod
    def fit_drafter(cls, init_args: dict, verifier) -> MedusaHeads:
        return MedusaHeads.for_verifier(verifier, init_args.get("num_heads", 4), init_args.get("num_layers", 1),
                                        init_args.get("shared_lm_head", False))

    @classmethod
    def fit_activations(cls, init_args: dict, drafter: MedusaHeads, verifier_config, batch_size: int,
                        block_size: int, element_bytes: int) -> StepActivations:
        """Per head and position: each ResBlock keeps its input and SiLU pre- and post-activation (3h), the head's
        gathered states (h); the fp32 copy of the last hidden state once. Logits: every head's rows x the
        training vocabulary."""
        c = drafter.config
        heads, positions, h = c.num_heads, batch_size * block_size, c.hidden_size
        parts = {"heads": heads * positions * (3 * c.num_layers + 1) * h * element_bytes,
                 "hidden_fp32": positions * h * 4}
        rows = sum(batch_size * max(block_size - k - 2, 0) for k in range(heads))
        return StepActivations(parts, rows, init_args.get("train_vocab_size") or c.vocab_size)

    def build_drafter(self) -> MedusaHeads:
        return MedusaHeads.for_verifier(self.verifier, self.num_heads, self.num_layers, self.shared_lm_head,
                                        verifier_name=self.verifier_name)

    def no_decay_params(self) -> tuple[torch.Tensor, ...]:
        # With a training vocabulary the other rows of each own lm_head get no gradient: decay alone would shrink them.
        if self.train_vocab_size and self.drafter.lm_heads is not None:
            return tuple(p for head in self.drafter.lm_heads for p in head.parameters())
        return ()

    def needs_greedy(self, training: bool) -> bool:
        return not training or self.target == "greedy"

    def _head_targets(self, k: int, batch: dict, features: dict) -> Optional[torch.Tensor]:
        """(B, T-k-2) hard targets of head k (0-based) at positions t = 0..T-k-3, or None for soft targets."""
        if self.target == "ground_truth":
            return batch["input_ids"][:, k + 2:]
        if self.target == "greedy":
            return features["greedy"][:, k + 1:-1]
        return None

    def head_projection(self, k: int) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """(weight, bias) head k's loss projects onto: its lm_head, restricted to the training vocabulary."""
        weight, bias = self.drafter.lm_head_params(k, self.verifier_lm_head)
        if self.train_rows is None:
            return weight, bias
        if self.drafter.lm_heads is None:  # the verifier's frozen lm_head: gathered once
            return self.frozen_rows(self.verifier_lm_head, self.train_rows)
        return weight[self.train_rows], None if bias is None else bias[self.train_rows]

    def drafter_loss(self, batch: dict, features) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        hidden = features["hidden"]
        T = hidden.shape[1]
        valid = (batch["loss_mask"] * batch["attention_mask"]).bool()
        to_row = self.to_train_row
        masks, all_targets = [], []  # per head: rows with a target, and the hard targets (projected) or None
        dropped = valid.new_zeros((), dtype=torch.long)
        for k in range(self.num_heads):
            mask = valid[:, k + 2:]
            targets = self._head_targets(k, batch, features)
            if targets is not None and to_row is not None:
                targets = to_row[targets]
                inside = targets >= 0
                dropped = dropped + (mask & ~inside).sum()
                mask = mask & inside
            masks.append(mask.reshape(-1))
            all_targets.append(targets)
        counts = torch.stack([m.sum() for m in masks]).tolist()  # the step's one host sync: every head's row count
        plan = []  # per head: (row index into B*(T-k-2), hard targets mapped to projected rows or None)
        for mask, targets, count in zip(masks, all_targets, counts):
            rows = torch.nonzero_static(mask, size=count).squeeze(1)
            plan.append((rows, None if targets is None else targets.reshape(-1)[rows]))
        kept = sum(counts)
        vocab = self.verifier_lm_head.weight.shape[0] if self.train_rows is None else self.train_rows.shape[0]
        recompute = self.recompute_loss(kept, vocab)
        total = hidden.new_zeros((), dtype=torch.float32)
        parts = {}
        for k, (state, (rows, targets)) in enumerate(zip(self.drafter.head_states(hidden.float()), plan)):
            weight, bias = self.head_projection(k)
            flat = state[:, :T - k - 2].reshape(-1, state.shape[-1])[rows]
            common = dict(chunk_size=self.loss_chunk_size, recompute=recompute)
            if targets is not None:
                loss = projected_cross_entropy(flat, weight, bias, target_ids=targets, **common)
            else:  # q at position t+k+1, over the same rows as the head's projection
                loss = self.distribution_loss(flat, weight, bias,
                                              self.teacher(features, k + 1, rows, self.train_rows, to_row), recompute)
            parts[f"head{k + 1}_loss"] = loss.detach()
            total = total + self.loss_decay ** k * loss
        if to_row is not None and self.target != "soft":
            parts["dropped_frac"] = dropped.float() / (dropped + kept).clamp_min(1).float()
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
            if self.to_train_row is not None:  # targets the training vocabulary covers (the rest trained nothing)
                counts[f"in_train_vocab_{k}"] = ((self.to_train_row[verifier_tok] >= 0) & mask).sum()
            hits.append(hit_ver[..., 0])
            masks.append(mask)
        return {**counts, **self.chain_counts(hits, masks)}

    def val_metrics(self, sums: dict[str, torch.Tensor]) -> dict[str, float]:
        out: dict[str, float] = {}
        for k in range(self.num_heads):
            n = max(float(sums[f"n_{k}"]), 1.0)
            for name in ("top1_gt", "top5_gt", "top1_ver", "top5_ver"):
                out[f"head{k + 1}_{name}"] = float(sums[f"{name}_{k}"]) / n
        if "in_train_vocab_0" in sums:
            out["train_vocab_coverage"] = float(sums["in_train_vocab_0"]) / max(float(sums["n_0"]), 1.0)
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

    def export(self, out_dir: str | Path, drafter: MedusaHeads, extra: dict | None = None) -> Path:
        """Write ``drafter`` (:meth:`plain_drafter`) in our format."""
        return drafter.save_pretrained(out_dir, extra=extra)
