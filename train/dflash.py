"""Block drafters (DFlash, DSpark's heads) trained on a frozen verifier: every block of a row in one forward.

Per row, ``anchors`` positions a are drawn at random among those whose next token is a loss-masked target. The
block of anchor a is ``[x_a, MASK x (B - 1)]`` at positions ``a .. a + B - 1``; it attends to the row's context
features strictly before a and bidirectionally to its own B slots (one block mask over all the row's blocks), and
slot j (1 <= j < B) is trained toward the token at a + j: the verifier's greedy token there (``target: greedy``,
the default; what a lossless T = 0 chain must match) or the data's (``ground_truth``).

Cost per row: the verifier's forward over T tokens (or a store), ``fc`` and each layer's k / v projections over T
context positions, the drafter's layers over ``anchors * B`` block rows, and the vocabulary projection of
``anchors * (B - 1)`` rows onto the training vocabulary (``train_vocab_size`` rows of the verifier's ``lm_head``),
so compute scales as anchors x block x head rows, not with T.

Losses (``loss``), each over the slots' distributions p (drafter) and q (verifier, over the same rows), slot j
weighted ``exp(-(j - 1) / position_decay)`` (DFlash's decay: 7 for blocks of 16, 4 for 8):
``ce`` hard-label cross-entropy (DFlash); ``dpace`` the same weighted per slot by the drafter's own detached
probability of having reached it (D-PACE, arXiv 2605.18810: the product of the leading slots' target
probabilities); ``lk_alpha`` -log sum min(p, q) and ``lk_hybrid`` lam * KL(q || p) + (1 - lam)(1 - alpha) with
lam = exp(-eta * alpha) detached (LK losses, arXiv 2602.23881); ``dspark`` 0.1 CE + 0.9 TV(p, q) (DSpark). With a
confidence head, BCE of its prediction against the draft's acceptance probability sum min(p, q) (detached) is added.
The Markov head's previous token for draft j is the target of draft j - 1 (the anchor for the first): with the
default greedy targets that is the verifier's token, what a T = 0 chain has put there when draft j is reached
(the references feed the data's tokens). The drafts' logits are kept whole for backward (``loss_chunk_size`` and
``loss_recompute`` do not apply; a step whose logits exceed the loss memory budget is refused, naming the knobs).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Literal, Optional

import torch
import torch.nn.functional as F

from spectrain.heads.dflash import DFlashConfig, DFlashDrafter
from spectrain.heads.errors import SpectrainError
from spectrain.heads.verifier import LogitTransform, drafter_embedding

from .base import DrafterModule
from .fit import StepActivations
from .losses import acceptance_loss, projected_topk
from .strategies import unwrapped

LOSSES = ("ce", "dpace", "lk_alpha", "lk_hybrid", "dspark")
LK = ("lk_alpha", "lk_hybrid")
DFLASH_DECAY = {16: 7.0, 8: 4.0}  # the references' gamma per block size


def default_position_decay(block_size: int) -> float:
    """gamma as the references set it — 7 for blocks of 16 (SpecForge's DFlash recipe), 4 for 8 (speculators'
    default) — else 7 * B / 16."""
    return DFLASH_DECAY.get(block_size, 7.0 * block_size / 16)


def sample_anchors(valid: torch.Tensor, count: int, generator: torch.Generator | None = None):
    """``count`` distinct anchors per row: positions a >= 1 whose next token is a target (``valid[:, a + 1]``).

    Args:
        valid: (B, T) bool, the loss-masked (and attended) tokens.
    Returns:
        anchors (B, n) long and their validity (B, n) bool (rows with fewer eligible positions repeat padding
        anchors marked invalid), n = min(count, T - 2).
    """
    B, T = valid.shape
    n = max(1, min(count, T - 2))
    eligible = torch.zeros_like(valid)
    eligible[:, 1:T - 1] = valid[:, 2:]
    scores = torch.rand(B, T, device=valid.device, generator=generator).masked_fill(~eligible, -1.0)
    top = scores.topk(n, dim=1)
    return top.indices, top.values >= 0


def dpace_weights(ce: torch.Tensor, rows: torch.Tensor, shape, alpha: float) -> torch.Tensor:
    """D-PACE's detached per-draft weights (arXiv 2605.18810; speculators' ``dpace_loss_decay``).

    With q_k = exp(-CE_k) the drafter's probability of draft k's target, s_k = (1 - alpha) q_k + alpha (1 where
    draft k has no target) and P_k = prod_{i <= k} s_i within the block, draft k weighs
    w_k = sum_{j >= k} P_j [j has a target]: the acceptance-weighted value of every later draft it leads to.

    Args:
        ce: (R,) cross-entropies of the trained drafts at flat indices ``rows`` of a (B, n, D) layout ``shape``.
    Returns:
        (R,) weights.
    """
    mask = torch.zeros(math.prod(shape), dtype=torch.bool, device=ce.device)
    mask[rows] = True
    q = torch.zeros(math.prod(shape), dtype=torch.float32, device=ce.device)
    q[rows] = torch.exp(-ce.float())
    s = torch.where(mask, (1 - alpha) * q + alpha, torch.ones_like(q)).view(shape)
    reached = s.cumprod(-1) * mask.view(shape)
    return reached.flip(-1).cumsum(-1).flip(-1).reshape(-1)[rows]


def block_mask(anchors: torch.Tensor, attention_mask: torch.Tensor, block_size: int) -> torch.Tensor:
    """(B, 1, n * bs, T + n * bs) bool: block i's rows see context positions < anchors[:, i] that are attended,
    and all bs rows of block i (bidirectional), nothing of other blocks."""
    B, n = anchors.shape
    T = attention_mask.shape[1]
    positions = torch.arange(T, device=anchors.device)
    context = (positions[None, None, :] < anchors[:, :, None]) & attention_mask.bool()[:, None, :]  # (B, n, T)
    context = context.repeat_interleave(block_size, dim=1)  # (B, n * bs, T)
    block_of = torch.arange(n, device=anchors.device).repeat_interleave(block_size)
    own = (block_of[:, None] == block_of[None, :]).expand(B, -1, -1)
    return torch.cat([context, own], dim=2)[:, None]


class DFlashModule(DrafterModule):
    """Train a block drafter (DFlash; DSpark with ``markov_rank`` / ``confidence_head``).

    Args:
        num_layers: drafter decoder layers (DSpark: 2 beat DFlash's 5).
        block_size: B, the block (anchor + B - 1 drafts); a round drafts up to B - 1 tokens.
        target_layer_ids: 0-based verifier decoder layers whose outputs are fused (default: DFlash's spread, as
            many as ``num_layers``; :func:`~spectrain.heads.dflash.default_target_layers`).
        mask_token_id: the id filling draft slots (default: the tokenizer's unk / pad id).
        anchors: blocks per row per step.
        target: ``greedy`` (the verifier's argmax at a + j - 1) or ``ground_truth`` (the data's token a + j).
        loss: ``ce``, ``dpace``, ``lk_alpha``, ``lk_hybrid`` or ``dspark`` (module docstring).
        position_decay: gamma of the slot weights exp(-(j - 1) / gamma) (default :func:`default_position_decay`).
        dpace_alpha: D-PACE's floor alpha in s_k = (1 - alpha) q_k + alpha.
        markov_rank: DSpark's Markov head rank (0: none; DSpark uses 256).
        confidence_head: DSpark's acceptance predictor; ``confidence_weight`` its BCE weight.
        val_anchors: blocks per validation row.
        norm_init: ``default`` (ones) or ``verifier``: start the final norm from the verifier's final norm, whose
            scale the verifier's ``lm_head`` reads (SmolLM2's weights average 1.8; tried on SmolLM2 for 88 steps it
            did not train faster: docs/LOG.md).
        **kwargs: see :class:`DrafterModule` (verifier, optimizer, ``train_vocab_size``, measured tau).
    """

    def __init__(
        self,
        num_layers: int = 1,
        block_size: int = 8,
        target_layer_ids: Optional[list[int]] = None,
        mask_token_id: Optional[int] = None,
        anchors: int = 16,
        target: Literal["greedy", "ground_truth"] = "greedy",
        loss: Literal["ce", "dpace", "lk_alpha", "lk_hybrid", "dspark"] = "ce",
        position_decay: Optional[float] = None,
        dpace_alpha: float = 0.5,
        markov_rank: int = 0,
        confidence_head: bool = False,
        sample_from_anchor: bool = False,
        confidence_weight: float = 1.0,
        val_anchors: int = 32,
        norm_init: Literal["default", "verifier"] = "default",
        **kwargs,
    ):
        if loss not in LOSSES:
            raise SpectrainError(f"model.loss must be one of {', '.join(LOSSES)}, got {loss!r}")
        if target not in ("greedy", "ground_truth"):
            raise SpectrainError(f"model.target must be greedy or ground_truth, got {target!r}")
        if anchors < 1 or val_anchors < 1:
            raise SpectrainError(f"model.anchors and model.val_anchors must be >= 1, got {anchors}, {val_anchors}")
        if position_decay is not None and not position_decay > 0:
            raise SpectrainError(f"model.position_decay must be > 0, got {position_decay}")
        self.num_layers, self.block_size, self.target_layer_ids = num_layers, block_size, target_layer_ids
        self.mask_token_id, self.markov_rank, self.confidence_head = mask_token_id, markov_rank, confidence_head
        self.anchors, self.val_anchors, self.target, self.loss = anchors, val_anchors, target, loss
        self.position_decay = position_decay or default_position_decay(block_size)
        self.dpace_alpha, self.confidence_weight = dpace_alpha, confidence_weight
        self.sample_from_anchor = sample_from_anchor
        if norm_init not in ("default", "verifier"):
            raise SpectrainError(f"model.norm_init must be default or verifier, got {norm_init!r}")
        self.norm_init = norm_init
        self.method_name = "dspark" if (markov_rank or confidence_head) else "dflash"
        if kwargs.get("token_loss", "ce") != "ce":
            raise SpectrainError("a block drafter's loss is model.loss (ce, dpace, lk_alpha, lk_hybrid, dspark), not "
                                 "model.token_loss")
        super().__init__(**kwargs)
        drafts = self.drafter.config.drafts
        if self.tau_meter.on and self.tau_meter.k > drafts:
            raise SpectrainError(f"model.measure_k {self.tau_meter.k} exceeds what a block of {block_size} drafts "
                                 f"({drafts})")

    @classmethod
    def method_for(cls, init_args) -> str:
        heads = getattr(init_args, "markov_rank", 0) or getattr(init_args, "confidence_head", False)
        return "dspark" if heads else "dflash"

    @classmethod
    def fit_drafter(cls, init_args: dict, verifier) -> DFlashDrafter:
        return DFlashDrafter(DFlashConfig.for_verifier(
            verifier, init_args.get("num_layers", 1), init_args.get("block_size", 8), init_args.get("target_layer_ids"),
            init_args.get("mask_token_id"), init_args.get("markov_rank", 0), init_args.get("confidence_head", False),
            init_args.get("sample_from_anchor", False)))

    @classmethod
    def fit_activations(cls, init_args: dict, drafter: DFlashDrafter, verifier_config, batch_size: int,
                        block_size: int, element_bytes: int) -> StepActivations:
        """Anchors x block rows per row (Q = min(anchors, T - 2) x block) through every drafter layer, each keeping
        ~9h + 4I + 6 heads d + 5 kv_heads d per block row (input, both norms, q / k normed and rotated, attention
        output and its copy, the MLP's four I-wide tensors) and its keys / values over context + block (T + Q);
        backward holds one layer's worth of gradients at a time (one more layer); the context's fused input once in
        fp32 and each layer's context keys / values (~5 kv_heads d per position);
        the block mask (one byte per (Q, T + Q) pair). Logits: every draft slot x the training vocabulary, kept
        whole (a block drafter's loss does not chunk)."""
        c = drafter.config
        B, T, h, kv = batch_size, block_size, c.hidden_size, c.num_kv_heads * c.head_dim
        anchors = max(1, min(int(init_args.get("anchors", 16)), T - 2))
        Q = anchors * c.block_size
        layers = c.num_hidden_layers
        per_row = 9 * h + 4 * c.intermediate_size + 6 * c.num_heads * c.head_dim + 5 * kv
        parts = {"block_layers": B * Q * (layers * per_row + 3 * h) * element_bytes,
                 "backward_transient": B * Q * per_row * element_bytes,  # one layer's gradients at a time
                 "context": B * T * (len(c.target_layer_ids) * h * 4 + (3 * h + layers * 5 * kv) * element_bytes),
                 "attention_keys": B * layers * 2 * (T + Q) * kv * element_bytes,
                 "block_mask": B * Q * (T + Q)}
        vocab = init_args.get("train_vocab_size") or c.vocab_size
        return StepActivations(parts, B * anchors * c.drafts, vocab, chunkable=False,
                               captured_layers=c.capture_ids)

    def build_drafter(self) -> DFlashDrafter:
        config = DFlashConfig.for_verifier(self.verifier, self.num_layers, self.block_size, self.target_layer_ids,
                                           self.mask_token_id, self.markov_rank, self.confidence_head,
                                           self.sample_from_anchor, verifier_name=self.verifier_name,
                                           tokenizer=self.tokenizer)
        drafter = DFlashDrafter(config)
        if self.norm_init == "verifier":  # the verifier's lm_head reads states at its final norm's scale
            drafter.init_norm_from(self.verifier)
        return drafter

    def feature_layer_ids(self) -> tuple[int, ...]:
        return self.drafter.config.capture_ids

    def needs_greedy(self, training: bool) -> bool:
        return not training  # training steps project only the positions they read (_greedy_at)

    @torch.no_grad()
    def _greedy_at(self, features: dict, positions: torch.Tensor) -> torch.Tensor:
        """(B, m) the verifier's argmax next token after each of (B, m) positions: read from the features (a store,
        validation) or projected onto the whole vocabulary at those positions only (anchors x drafts rows, not T)."""
        if "greedy" in features:
            return features["greedy"].gather(1, positions)
        hidden = features["hidden"]
        states = hidden.gather(1, positions[..., None].expand(-1, -1, hidden.shape[-1]))
        head = self.verifier_lm_head
        return projected_topk(states, head.weight, head.bias, k=1, chunk_size=self.topk_chunk_size)[..., 0]

    @property
    def embed(self):
        return drafter_embedding(self.verifier)

    # -- the blocks of a batch --------------------------------------------------------------------------------------
    def blocks(self, batch: dict, features: dict, count: int, greedy_targets: bool,
               generator: torch.Generator | None = None):
        """Draw anchors and run every block of the batch through the drafter in one forward.

        Draft i (0 <= i < D, D = ``config.drafts``) of anchor a sits in block slot ``first_draft_slot + i`` and
        predicts the token at a + 1 + i. Returns a dict: ``hidden`` (B, n, D, h) the drafter's final states of
        the draft slots, ``targets`` (B, n, D) target ids, ``valid`` (B, n, D) which drafts have a target,
        ``teacher_at`` (B, n, D) the position whose verifier distribution is draft i's q (a + i), ``prev``
        (B, n, D) the token before each draft's target (the Markov head's input: the anchor, then the targets).
        """
        drafter = unwrapped(self.drafter)
        config = drafter.config
        bs, drafts, first = config.block_size, config.drafts, config.first_draft_slot
        ids, attn = batch["input_ids"], batch["attention_mask"]
        B, T = ids.shape
        valid_tok = (batch["loss_mask"] * attn).bool()
        anchors, anchor_ok = sample_anchors(valid_tok, count, generator)
        n = anchors.shape[1]
        target_pos = anchors[:, :, None] + torch.arange(1, drafts + 1, device=ids.device)  # (B, n, D)
        inside = target_pos < T
        target_pos = target_pos.clamp_max(T - 1)
        flat = target_pos.reshape(B, -1)
        source = self._greedy_at(features, flat - 1) if greedy_targets else ids.gather(1, flat)
        targets = source.view(B, n, drafts)
        valid = inside & valid_tok.gather(1, flat).view(B, n, drafts) & anchor_ok[..., None]
        block_ids = torch.full((B, n, bs), config.mask_token_id, dtype=torch.long, device=ids.device)
        block_ids[:, :, 0] = ids.gather(1, anchors)
        at = anchors[:, :, None] + torch.arange(bs, device=ids.device)  # (B, n, bs) positions of the block slots
        context = drafter.context(torch.cat(features["layers"], -1))
        kv = drafter.context_kv(context, torch.arange(T, device=ids.device).expand(B, T))
        out = drafter.block_hidden(self.embed(block_ids.view(B, n * bs)), at.view(B, n * bs), kv,
                                   block_mask(anchors, attn, bs))
        prev = torch.cat([block_ids[:, :, :1], targets[:, :, :-1]], 2)
        return {"hidden": out.view(B, n, bs, -1)[:, :, first:first + drafts], "targets": targets, "valid": valid,
                "teacher_at": target_pos - 1, "prev": prev}

    def slot_logits(self, hidden: torch.Tensor, prev: torch.Tensor) -> torch.Tensor:
        """(R, h) slot states and (R,) previous tokens -> (R, N) logits over the training vocabulary's rows
        (the verifier ``lm_head``'s, frozen; + the Markov bias when there is one)."""
        weight, bias = self.frozen_rows(self.verifier_lm_head, self.train_rows)
        logits = F.linear(hidden.to(weight.dtype), weight, bias).float()
        drafter = unwrapped(self.drafter)
        if drafter.config.markov_rank:
            logits = logits + drafter.markov_bias(prev, self.train_rows).float()
        return logits

    def _rows(self, blocks: dict):
        """The slots that train: valid, with a target inside the training vocabulary. Returns (rows (R,) flat
        indices, target columns (R,), slot index j - 1 (R,), outside fraction)."""
        valid, targets = blocks["valid"], blocks["targets"]
        columns = targets if self.to_train_row is None else self.to_train_row[targets]
        keep = valid & (columns >= 0)
        outside = 1.0 - keep.sum() / valid.sum().clamp_min(1)
        rows = keep.reshape(-1).nonzero().squeeze(1)
        slot = torch.arange(targets.shape[-1], device=targets.device).expand_as(targets).reshape(-1)[rows]
        return rows, columns.reshape(-1)[rows], slot, outside

    def drafter_loss(self, batch: dict, features) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        blocks = self.blocks(batch, features, self.anchors, self.target == "greedy")
        rows, columns, slot, outside = self._rows(blocks)
        vocab = self.verifier_lm_head.weight.shape[0] if self.train_rows is None else self.train_rows.shape[0]
        if self.loss_recompute == "auto" and self.recompute_loss(rows.numel(), vocab):  # logits kept whole
            raise SpectrainError(f"{rows.numel()} drafted slots x {vocab} vocabulary rows exceed the loss memory "
                                 "budget: set model.train_vocab_size, or fewer model.anchors, or a larger "
                                 "model.loss_memory_budget_gb")
        hidden = blocks["hidden"].reshape(-1, blocks["hidden"].shape[-1])[rows]
        prev = blocks["prev"].reshape(-1)[rows]
        logits = self.slot_logits(hidden, prev)
        logp = logits.log_softmax(-1)
        ce = -logp.gather(1, columns[:, None])[:, 0]
        if self.loss == "dpace":
            weight = dpace_weights(ce.detach(), rows, blocks["valid"].shape, self.dpace_alpha)
        else:
            weight = torch.exp(-slot.float() / self.position_decay)
        norm = weight.sum().clamp_min(1e-9)
        parts = {"ce": (ce * weight).sum() / norm, "outside_vocab_frac": outside}
        drafter = unwrapped(self.drafter)
        if self.loss in ("lk_alpha", "lk_hybrid", "dspark") or drafter.config.confidence_head:
            q = self._teacher(features, blocks, rows)
            lk, alpha = acceptance_loss(logp, q, "lk_alpha" if self.loss not in LK else self.loss, self.lk_eta)
            parts["alpha"] = (alpha.detach() * weight).sum() / norm  # each draft's acceptance probability
        if self.loss in ("ce", "dpace"):
            main = parts["ce"]
        elif self.loss == "dspark":
            parts["tv"] = ((1 - alpha) * weight).sum() / norm  # TV(p, q) = 1 - sum min(p, q)
            main = 0.1 * parts["ce"] + 0.9 * parts["tv"]
        else:
            main = (lk * weight).sum() / norm
        total = main
        if drafter.config.confidence_head:  # predicts each draft's acceptance (sum min(p, q), detached)
            conf = drafter.confidence(hidden, prev).float()
            bce = F.binary_cross_entropy_with_logits(conf, alpha.detach(), reduction="none")
            parts["confidence_bce"] = (bce * weight).sum() / norm
            total = total + self.confidence_weight * parts["confidence_bce"]
        return total, {k: v.detach() for k, v in parts.items()}

    @torch.no_grad()
    def _teacher(self, features: dict, blocks: dict, rows: torch.Tensor) -> torch.Tensor:
        """(R, N) the verifier's distributions q at each trained slot's position a + j - 1, over the training rows."""
        hidden = features["hidden"]
        B, T, H = hidden.shape
        at = blocks["teacher_at"].reshape(B, -1)
        states = hidden.gather(1, at[..., None].expand(-1, -1, H)).reshape(-1, H)[rows]
        weight, bias = self.frozen_rows(self.verifier_lm_head, self.train_rows)
        logits = LogitTransform.of(self.verifier.config)(F.linear(states.to(weight.dtype), weight, bias))
        return logits.float().softmax(-1)  # q as the verifier's head computes it (soft-cap, scaling)

    # -- validation: per-slot agreement with the verifier's greedy token, and the joint chain -----------------------
    @torch.no_grad()
    def validation_counts(self, batch: dict, features) -> dict[str, torch.Tensor]:
        # the same blocks at every validation (a function of the batch), drawn apart from the training stream
        seed = int(batch["input_ids"].sum()) % (2 ** 31)
        generator = torch.Generator(device=batch["input_ids"].device).manual_seed(seed)
        blocks = self.blocks(batch, features, self.val_anchors, greedy_targets=True, generator=generator)
        hidden, targets, valid = blocks["hidden"], blocks["targets"], blocks["valid"]
        B, n, slots, H = hidden.shape
        logits = self.slot_logits(hidden.reshape(-1, H), blocks["prev"].reshape(-1))
        top1 = logits.argmax(-1)
        top1 = (top1 if self.train_rows is None else self.train_rows[top1]).view(B, n, slots)
        hit = top1 == targets
        counts, hits, masks = {}, [], []
        for j in range(slots):
            counts[f"n_{j}"], counts[f"top1_ver_{j}"] = valid[..., j].sum(), (hit[..., j] & valid[..., j]).sum()
            hits.append(hit[..., j])
            masks.append(valid[..., j])
        if self.to_train_row is not None:
            counts["in_vocab_0"] = ((self.to_train_row[targets[..., 0]] >= 0) & valid[..., 0]).sum()
        return {**counts, **self.chain_counts(hits, masks)}

    def val_metrics(self, sums: dict[str, torch.Tensor]) -> dict[str, float]:
        slots = unwrapped(self.drafter).config.drafts
        out = {f"slot{j + 1}_top1_ver": float(sums[f"top1_ver_{j}"]) / max(float(sums[f"n_{j}"]), 1.0)
               for j in range(slots) if f"n_{j}" in sums}
        out["tau_pred"] = 1.0 + float(sums["chain_len"]) / max(float(sums["chain_n"]), 1.0)
        if "in_vocab_0" in sums:
            out["train_vocab_coverage"] = float(sums["in_vocab_0"]) / max(float(sums["n_0"]), 1.0)
        return out

    def summary_rows(self, metrics: dict) -> tuple[list[str], list[list]]:
        slots = unwrapped(self.drafter).config.drafts
        return (["draft", "top1 vs verifier"],
                [[j + 1, metrics.get(f"slot{j + 1}_top1_ver")] for j in range(slots)])

    # -- target layers: init_from and resumed checkpoints must read this run's --------------------------------------
    def check_initial_drafter(self, source: DFlashDrafter, path: str) -> None:
        theirs, ours = source.config, self.drafter.config
        for key in ("target_layer_ids", "block_size", "mask_token_id", "sample_from_anchor"):
            if getattr(theirs, key) != getattr(ours, key):
                raise SpectrainError(f"model.init_from {path} has {key} {getattr(theirs, key)}, this run "
                                     f"{getattr(ours, key)}: pass --model.{key} {getattr(theirs, key)}")

    def checkpoint_record(self) -> dict:
        c = self.drafter.config
        return {"target_layer_ids": list(c.target_layer_ids), "block_size": c.block_size,
                "mask_token_id": c.mask_token_id, "sample_from_anchor": c.sample_from_anchor}

    def check_checkpoint(self, saved: dict) -> None:
        ours = self.checkpoint_record()
        for key, value in ours.items():
            if key in saved and saved[key] != value:
                raise SpectrainError(f"the checkpoint's drafter has {key} {saved[key]}, this run's {value}: pass "
                                     f"--model.{key} {saved[key]} to resume it")

    def export(self, out_dir: str | Path, drafter: DFlashDrafter, extra: dict | None = None) -> Path:
        return drafter.save_pretrained(out_dir)
