"""EAGLE drafters (EAGLE-1 and EAGLE-3) trained on a frozen verifier."""

from __future__ import annotations

from pathlib import Path
from typing import Literal, Optional

import torch
import torch.nn.functional as F

from spectrain.heads.eagle import NORM_FLAGS, EagleDrafter, build_vocab_map
from spectrain.heads.errors import SpectrainError
from spectrain.heads.verifier import drafter_embedding
from spectrain.heads.vocab import token_counts

from .base import DrafterModule
from .fit import StepActivations
from .losses import projected_topk
from .strategies import unwrapped


class EagleModule(DrafterModule):
    """Train an EAGLE drafter: one decoder layer over the verifier's features.

    EAGLE-1: the input at position t is ``fc(cat(embed(x_{t+1}), f~_t))`` with the verifier's last hidden
    state f_t plus uniform noise, ``f~ = f + feature_noise * (U[0,1) - 0.5)`` (EAGLE's reference: width 0.2);
    loss = ``feature_loss_weight`` * SmoothL1(g_t, f_{t+1}) + ``ce_loss_weight`` * CE(lm_head(g_t), q_{t+1}),
    where q is the verifier's next-token distribution.
    EAGLE-3: fused verifier layers, own lm_head over a draft vocabulary (the most frequent loss-masked
    training tokens), training-time test over ``ttt_steps`` steps; loss = sum_i step_decay^i * CE_i against q
    restricted to the draft vocabulary. No feature loss.

    Args:
        variant: eagle1 or eagle3.
        draft_vocab_size: eagle3 draft vocabulary (default min(V, 32000)).
        aux_layer_ids: eagle3 HF ``hidden_states`` indices to fuse, ascending and distinct (others are refused, not
            sorted: ``fc``'s input columns follow their order); default [2, N//2, N-3], distinct for small N.
        ttt_steps: eagle3 training-time-test steps.
        feature_noise: width of the uniform noise on eagle1's input features.
        feature_loss_weight, ce_loss_weight: eagle1 loss weights.
        step_decay: eagle3 weight of step i is step_decay^i.
        val_steps: draft steps unrolled in validation (per-step top-1 and predicted tau).
        drop_outside_vocab: eagle3: positions whose verifier argmax lies outside the draft vocabulary leave the
            loss (as the EAGLE-3 and SpecForge trainers do: the drafter can never propose that token, so the
            position only pulls it toward a distribution renormalised without it). Counted:
            ``train/outside_vocab_frac``.
        layer_init: ``random``, ``verifier`` (the decoder layer starts as the verifier's last layer) or
            ``identity`` (zero ``o_proj`` / ``down_proj``); see :meth:`EagleDrafter.warm_start`.
        norm_init: eagle3: ``verifier`` starts the final norm from the verifier's final norm.
        norm_before_residual, norm_before_fc, norm_output: eagle3: vLLM speculators' variant (all three are its
            training default; all off is EAGLE-3 as published): the residual is the normed hidden input, one
            RMSNorm over the fused layers before ``fc``, later draft steps read the normed output of the one before.
        **kwargs: see :class:`DrafterModule` (verifier, optimizer, chunking).
    """

    def __init__(
        self,
        variant: Literal["eagle1", "eagle3"] = "eagle3",
        draft_vocab_size: Optional[int] = None,
        aux_layer_ids: Optional[list[int]] = None,
        ttt_steps: int = 7,
        feature_noise: float = 0.2,
        feature_loss_weight: float = 1.0,
        ce_loss_weight: float = 0.1,
        step_decay: float = 0.8,
        val_steps: int = 4,
        drop_outside_vocab: bool = True,
        layer_init: Literal["random", "verifier", "identity"] = "random",
        norm_init: Literal["default", "verifier"] = "default",
        norm_before_residual: bool = False,
        norm_before_fc: bool = False,
        norm_output: bool = False,
        **kwargs,
    ):
        if variant not in ("eagle1", "eagle3"):
            raise SpectrainError(f"model.variant must be eagle1 or eagle3, got {variant!r}")
        if ttt_steps < 1 or val_steps < 1:
            raise SpectrainError(f"model.ttt_steps and model.val_steps must be >= 1, got {ttt_steps}, {val_steps}")
        self.variant, self.method_name = variant, variant
        self.draft_vocab_size, self.aux_layer_ids = draft_vocab_size, aux_layer_ids
        self.ttt_steps, self.feature_noise, self.step_decay, self.val_steps = ttt_steps, feature_noise, step_decay, val_steps
        self.feature_loss_weight, self.ce_loss_weight = feature_loss_weight, ce_loss_weight
        self.drop_outside_vocab = drop_outside_vocab and variant == "eagle3"
        if norm_init == "verifier" and variant != "eagle3":
            raise SpectrainError("model.norm_init verifier is for eagle3 (eagle1 has no final norm of its own)")
        self.layer_init, self.norm_init = layer_init, norm_init
        self.norm_flags = {"norm_before_residual": norm_before_residual, "norm_before_fc": norm_before_fc,
                           "norm_output": norm_output}
        if variant != "eagle3" and any(self.norm_flags.values()):
            raise SpectrainError(f"model.{', model.'.join(k for k, v in self.norm_flags.items() if v)}: EAGLE-3 "
                                 "variant flags (speculators'); eagle1 has none")
        if variant == "eagle3" and kwargs.get("train_vocab_size") is not None:
            raise SpectrainError("eagle3 trains over its own draft vocabulary: set model.draft_vocab_size, not "
                                 "model.train_vocab_size")
        super().__init__(**kwargs)

    @classmethod
    def method_for(cls, init_args) -> str:
        return getattr(init_args, "variant", None) or "eagle3"

    added_init_args = {**DrafterModule.added_init_args, "layer_init": "random", "norm_init": "default",
                       "drop_outside_vocab": False}

    @classmethod
    def resume_ignores(cls, init_args: dict, saved: dict) -> tuple[str, ...]:
        """``drop_outside_vocab`` of an eagle1 config (an eagle3 option: eagle1 ignores it); ``aux_layer_ids`` when
        the saved run had the default fused layers (null): it may be resumed with them named explicitly (the
        default changed for small verifiers; the checkpoint's record of its layers is checked on load)."""
        ignored = ("drop_outside_vocab",) if init_args.get("variant") == "eagle1" else ()
        if "aux_layer_ids" in saved and saved["aux_layer_ids"] is None:
            ignored += ("aux_layer_ids",)
        return ignored

    @classmethod
    def fit_drafter(cls, init_args: dict, verifier) -> EagleDrafter:
        flags = {flag: bool(init_args.get(flag, False)) for flag in NORM_FLAGS}
        return EagleDrafter.for_verifier(verifier, init_args.get("variant") or "eagle3",
                                         init_args.get("draft_vocab_size"), init_args.get("aux_layer_ids"), **flags)

    @classmethod
    def fit_activations(cls, init_args: dict, drafter: EagleDrafter, verifier_config, batch_size: int,
                        block_size: int, element_bytes: int) -> StepActivations:
        """Per TTT step and position the layer keeps ~16h + 4I + 3 (heads + kv_heads) d activations (its input,
        both norms, q / k / v rotated, attention output, MLP's four I-wide tensors, the final norm and the loss's
        gathered states), later steps also their stacked own keys and values; backward holds one step's worth of
        gradients at a time (one more step); the fused input is kept once in fp32.
        Steps >= 1 recompute their attention in backward: one step's (T, T) scores peak at ~4 fp32 copies
        (scores, masked, with the own-key scores, softmax) whatever the depth. Logits: the loss's rows over
        every step x the draft vocabulary (eagle1: the training vocabulary)."""
        c = drafter.config
        steps = int(init_args.get("ttt_steps", 7)) if c.variant == "eagle3" else 1
        B, n, h = batch_size, block_size - 1, c.hidden_size
        positions = B * n
        per_step = 16 * h + 4 * c.intermediate_size + 3 * (c.num_heads + c.num_kv_heads) * c.head_dim
        own_keys = sum(2 * step * c.num_kv_heads * c.head_dim for step in range(1, steps))
        parts = {"ttt_layer": positions * (steps * per_step + own_keys) * element_bytes,
                 "backward_transient": positions * per_step * element_bytes,  # one step's gradients at a time
                 "fused_input": positions * (c.fused_width + h) * 4}
        if steps > 1:
            parts["ttt_attention_scores"] = 4 * B * c.num_heads * n * n * 4
        rows = sum(B * max(block_size - 2 - i, 0) for i in range(steps))
        vocab = c.draft_vocab_size if c.variant == "eagle3" else (init_args.get("train_vocab_size") or c.vocab_size)
        return StepActivations(parts, rows, vocab, captured_layers=tuple(c.aux_layer_ids or ()))

    def build_drafter(self) -> EagleDrafter:
        drafter = EagleDrafter.for_verifier(self.verifier, self.variant, self.draft_vocab_size, self.aux_layer_ids,
                                            verifier_name=self.verifier_name, **self.norm_flags)
        drafter.warm_start(self.verifier, self.layer_init, self.norm_init)
        return drafter

    def load_initial_drafter(self, path: str) -> None:
        """:meth:`DrafterModule.load_initial_drafter`, refusing a drafter of another norm variant: two of the flags
        have no tensor of their own, so the state dicts alone would match and the weights mean something else."""
        from spectrain.heads.serving.formats import import_drafter

        source = import_drafter(path, verifier_model=self.verifier, fmt=self.init_from_format)
        theirs = {flag: bool(getattr(source.config, flag, False)) for flag in self.norm_flags}
        if theirs != self.norm_flags:
            differ = [flag for flag in self.norm_flags if theirs[flag] != self.norm_flags[flag]]
            raise SpectrainError(f"model.init_from {path} is an EAGLE drafter with "
                                 f"{', '.join(f'{f}={theirs[f]}' for f in differ)}; this run has the opposite: pass "
                                 + " ".join(f"--model.{f} {str(theirs[f]).lower()}" for f in differ))
        super().load_initial_drafter(path)

    def needs_greedy(self, training: bool) -> bool:
        return not training or self.drop_outside_vocab

    def feature_layer_ids(self) -> tuple[int, ...]:
        return tuple(self.drafter.config.aux_layer_ids or ()) if self.variant == "eagle3" else ()

    @property
    def embed(self):
        return drafter_embedding(self.verifier)

    # -- eagle3 draft vocabulary: counted over the loss-masked training tokens -----------------------------------
    def setup(self, stage: str) -> None:
        super().setup(stage)
        if self.variant != "eagle3" or getattr(self, "_vocab_ready", False) or self.init_from:
            return  # an init_from drafter keeps its own d2t/t2d (its lm_head rows are ordered by them)
        data = getattr(self.trainer, "datamodule", None) if self._trainer is not None else None
        if data is not None and getattr(data, "train_set", None) is not None:
            self.set_vocab_from(data.vocab_rows() if hasattr(data, "vocab_rows") else data.train_set)

    def set_vocab_from(self, rows) -> None:
        """Build d2t/t2d from token frequencies of loss-masked tokens in ``rows`` and warm-start the lm_head."""
        counts = token_counts(rows, self.drafter.config.vocab_size)
        d2t, t2d = build_vocab_map(counts, self.drafter.config.draft_vocab_size)
        self.drafter.set_vocab_map(d2t.to(self.drafter.d2t.device), t2d.to(self.drafter.t2d.device))
        self.drafter.init_lm_head_from(self.verifier_lm_head)
        self._vocab_ready = True

    def draft_rows(self) -> torch.Tensor:
        """Verifier vocabulary ids of the draft vocabulary, in draft-id order (D,)."""
        return self.drafter.draft_to_target(torch.arange(self.drafter.config.draft_vocab_size, device=self.device))

    # -- losses ---------------------------------------------------------------------------------------------------
    def _inputs(self, batch: dict, features: dict):
        """Aligned drafter inputs: token x_{t+1} with the verifier's features at t, for t in 0..T-2."""
        ids = batch["input_ids"][:, 1:]
        if self.variant == "eagle3":
            return ids, torch.cat(features["layers"], -1)[:, :-1].float()
        return ids, features["hidden"][:, :-1].float()

    def drafter_loss(self, batch: dict, features) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        hidden = features["hidden"]
        T = hidden.shape[1]
        target_mask = (batch["loss_mask"] * batch["attention_mask"]).bool()
        ids, feats = self._inputs(batch, features)
        if self.variant == "eagle1":
            noisy = feats + self.feature_noise * (torch.rand_like(feats) - 0.5)
            # g_t predicts f_{t+1}; the loss already runs as the drafter's forward (DrafterModule.step_loss)
            out, _ = unwrapped(self.drafter).forward(ids, noisy, self.embed)
            rows = target_mask[:, 2:].reshape(-1).nonzero().squeeze(1)  # q_{t+1} predicts token t+2
            pred = out[:, :T - 2].reshape(-1, out.shape[-1])[rows]
            true = hidden[:, 1:T - 1].reshape(-1, hidden.shape[-1])[rows].float()
            feature_loss = F.smooth_l1_loss(pred, true) if rows.numel() else pred.sum() * 0
            weight, bias = self.frozen_rows(self.verifier_lm_head, self.train_rows)
            ce = self.distribution_loss(pred, weight, bias,
                                        self.teacher(features, 1, rows, self.train_rows, self.to_train_row),
                                        self.recompute_loss(rows.numel(), weight.shape[0]))
            loss = self.feature_loss_weight * feature_loss + self.ce_loss_weight * ce
            return loss, {"feature_loss": feature_loss.detach(), "ce": ce.detach()}
        outs = self.drafter.ttt_hidden(ids, feats, self.embed, steps=self.ttt_steps)
        parts: dict[str, torch.Tensor] = {}
        d2t = self.drafter.d2t  # the draft rows change only when set_vocab_map() writes d2t
        version = ("d2t", d2t.data_ptr(), d2t._version)
        draft_rows = self.draft_rows()
        to_draft = (self.drafter.target_to_draft(torch.arange(self.drafter.config.vocab_size, device=ids.device),
                                                 ignore_index=-1) if "topk_ids" in features else None)
        if self.drop_outside_vocab:  # the verifier's argmax at t+1+i must be a draft token for step i's row t
            inside = self.drafter.t2d[features["greedy"]]
            kept = [target_mask[:, 2 + i:] & inside[:, 1 + i:T - 1] for i in range(len(outs)) if T - 2 - i > 0]
            total_rows = sum((target_mask[:, 2 + i:].sum() for i in range(len(kept))), target_mask.new_zeros(()))
            parts["outside_vocab_frac"] = 1.0 - sum((k.sum() for k in kept), total_rows.new_zeros(())) / total_rows.clamp_min(1)
        else:
            kept = [target_mask[:, 2 + i:] for i in range(len(outs)) if T - 2 - i > 0]
        counts = torch.stack([mask.sum() for mask in kept]).tolist() if kept else []  # one host sync for all steps
        steps = [(i, torch.nonzero_static(mask.reshape(-1), size=n).squeeze(1))
                 for i, (mask, n) in enumerate(zip(kept, counts))]
        recompute = self.recompute_loss(sum(r.numel() for _, r in steps), self.drafter.config.draft_vocab_size)
        total = hidden.new_zeros((), dtype=torch.float32)
        for i, rows in steps:  # step i at t predicts q_{t+1+i}, i.e. token t+2+i
            n = T - 2 - i
            states = self.drafter.norm(outs[i][:, :n]).reshape(-1, outs[i].shape[-1])[rows]
            teacher = self.teacher(features, 1 + i, rows, draft_rows, to_draft, version)
            ce = self.distribution_loss(states, self.drafter.lm_head.weight, None, teacher, recompute)
            parts[f"step{i + 1}_ce"] = ce.detach()
            total = total + self.step_decay ** i * ce
        return total, parts

    # -- validation: per-step agreement with the verifier's greedy token and the joint chain ----------------------
    @torch.no_grad()
    def validation_counts(self, batch: dict, features) -> dict[str, torch.Tensor]:
        greedy, T = features["greedy"], batch["input_ids"].shape[1]
        valid = (batch["loss_mask"] * batch["attention_mask"]).bool()
        ids, feats = self._inputs(batch, features)
        outs = self.drafter.ttt_hidden(ids, feats, self.embed, steps=self.val_steps)
        counts, hits, masks = {}, [], []
        for i, out in enumerate(outs):
            n = T - 2 - i
            if n <= 0:
                break
            hit = self._top1(out[:, :n]) == greedy[:, 1 + i:T - 1]
            mask = valid[:, 2 + i:]
            counts[f"n_{i}"], counts[f"top1_ver_{i}"] = mask.sum(), (hit & mask).sum()
            if i == 0:  # how many of the verifier's next tokens the projected vocabulary holds at all
                target = greedy[:, 1:T - 1]
                inside = (self.drafter.t2d[target] if self.variant == "eagle3"
                          else None if self.to_train_row is None else self.to_train_row[target] >= 0)
                if inside is not None:
                    counts["in_vocab_0"] = (inside & mask).sum()
            hits.append(hit)
            masks.append(mask)
        return {**counts, **self.chain_counts(hits, masks)}

    # -- EAGLE-3's fused layers: init_from and resumed checkpoints must fuse this run's -----------------------------
    def ranked_default_size(self) -> Optional[int]:
        """EAGLE-3 drafts over its own trained draft vocabulary: no ranking for ranked heads."""
        return None if self.variant == "eagle3" else super().ranked_default_size()

    def fused_layers(self) -> list[int]:
        """The verifier layers an EAGLE-3 drafter fuses ([] for EAGLE-1): a drafter on others is refused."""
        return list(self.drafter.config.aux_layer_ids or [])

    def check_initial_drafter(self, source: EagleDrafter, path: str) -> None:
        fused = list(source.config.aux_layer_ids or [])
        if fused != self.fused_layers():  # same fc shape, other layers: the weights would mean something else
            raise SpectrainError(f"model.init_from {path} fuses verifier layers {fused}, this run's "
                                 f"{self.fused_layers()}: pass --model.aux_layer_ids '{fused}'")

    def checkpoint_record(self) -> dict:
        return {"aux_layer_ids": self.fused_layers()}

    def check_checkpoint(self, saved: dict) -> None:
        ids, saved_ids = self.fused_layers(), saved.get("aux_layer_ids")
        layers = self.verifier.config.num_hidden_layers
        if ids and saved_ids is None and layers < 7 and self.aux_layer_ids is None:
            # saved before checkpoints recorded it, by a run on the old small-verifier default (min(3, N) ids
            # spread evenly over [1, N], N included)
            count = min(3, layers)
            saved_ids = [1] if count == 1 else sorted({1 + (k * (layers - 1)) // (count - 1) for k in range(count)})
        if ids and saved_ids is not None and list(saved_ids) != ids:
            raise SpectrainError(f"the checkpoint's drafter fuses verifier layers {list(saved_ids)}, this run's "
                                 f"{ids}: pass --model.aux_layer_ids '{list(saved_ids)}' to resume it")

    def _top1(self, out: torch.Tensor) -> torch.Tensor:
        """(B, n, h) drafter outputs -> (B, n) verifier-vocabulary token ids of the drafter's argmax."""
        if self.variant == "eagle3":
            draft = projected_topk(self.drafter.norm(out), self.drafter.lm_head.weight, k=1,
                                   chunk_size=self.topk_chunk_size)[..., 0]
            return self.drafter.draft_to_target(draft)
        head = self.verifier_lm_head
        return projected_topk(out, head.weight, head.bias, k=1, chunk_size=self.topk_chunk_size)[..., 0]

    def val_metrics(self, sums: dict[str, torch.Tensor]) -> dict[str, float]:
        out = {f"step{i + 1}_top1_ver": float(sums[f"top1_ver_{i}"]) / max(float(sums[f"n_{i}"]), 1.0)
               for i in range(self.val_steps) if f"n_{i}" in sums}
        out["tau_pred"] = 1.0 + float(sums["chain_len"]) / max(float(sums["chain_n"]), 1.0)
        if "in_vocab_0" in sums:
            name = "draft_vocab_coverage" if self.variant == "eagle3" else "train_vocab_coverage"
            out[name] = float(sums["in_vocab_0"]) / max(float(sums["n_0"]), 1.0)
        return out

    def summary_rows(self, metrics: dict) -> tuple[list[str], list[list]]:
        return (["draft step", "top1 vs verifier"],
                [[i + 1, metrics.get(f"step{i + 1}_top1_ver")] for i in range(self.val_steps)])

    def export(self, out_dir: str | Path, drafter: EagleDrafter, extra: dict | None = None) -> Path:
        """Write ``drafter`` (:meth:`plain_drafter`) in our format: ``config.json`` holds the :class:`EagleConfig`
        fields only, so ``extra`` (the trained step count, which Medusa's config records) is not written; the run's
        ``summary.json`` has the steps."""
        return drafter.save_pretrained(out_dir)
