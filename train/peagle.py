"""P-EAGLE drafters (:mod:`spectrain.heads.peagle`) trained on a frozen verifier: every depth of many chains at once.

Per row of T tokens (EAGLE-3's alignment: row t reads ``(x_{t+1}, f_t)``):

* **depth 0**, every position t: the drafter's causal pass, predicting the verifier's distribution at t + 1
  (token t + 2): EAGLE-3's first TTT step exactly;
* **chains**: ``anchors`` positions a are drawn at random among those whose depth-1 target (token a + 3) is
  loss-masked; depth d = 1..K-1 of anchor a is a placeholder (``mask_token_id``, ``mask_state()``) at position
  a + d, attending to the depth-0 rows at positions <= a and to its own chain's placeholders of depths <= d
  (speculators' ``create_peagle_mask_mod``), predicting the verifier's distribution at a + 1 + d (token a + 2 + d).
  Depth d trains only where depths 1..d all have loss-masked targets (the chain condition of speculators' COD).

Loss: the token loss (``token_loss``: CE against the verifier's distribution over the draft vocabulary, the same
gradient as speculators' KL) per depth, depth d weighted ``max(r^d, r_min)`` (w_0 = 1; ``down_sample_ratio`` r,
``down_sample_ratio_min`` r_min) and normalised by the weights' sum: in expectation the share each depth's rows have
in speculators' count-normalised COD loss (COD keeps ~n r^d rows of depth d; here every sampled chain has every
depth, which is what decoding runs). ``depth_weights: uniform`` weighs every depth alike. Positions whose verifier
argmax lies outside the draft vocabulary leave the loss (``drop_outside_vocab``, SpecForge's P-EAGLE rule).

Fixed chains per row instead of COD's ragged per-row sampling keep batches of B > 1 rows (the references train at
B = 1). Warm start: ``init_from`` an EAGLE-3 drafter (any importable format) copies it into layer 0 and the rest
(:meth:`~spectrain.heads.peagle.PEagleDrafter.init_from_eagle3`), a P-EAGLE drafter is loaded whole.
"""

from __future__ import annotations

from typing import Literal, Optional

import torch
import torch.nn.functional as F

from spectrain.heads.eagle import EagleDrafter
from spectrain.heads.errors import SpectrainError
from spectrain.heads.peagle import PEagleConfig, PEagleDrafter
from spectrain.heads.verifier import drafter_embedding

from .base import DrafterModule
from .dflash import sample_anchors
from .eagle import EagleModule
from .fit import StepActivations
from .strategies import unwrapped


def chain_mask(anchors: torch.Tensor, attended: torch.Tensor, depths: int) -> torch.Tensor:
    """(B, 1, n * (K - 1), T + n * (K - 1)) bool: placeholder (chain i, depth d) sees the attended depth-0 rows at
    positions <= anchors[:, i] and its own chain's placeholders of depths <= d; nothing of other chains.

    Args:
        anchors: (B, n) positions; attended: (B, T) the depth-0 rows' attention mask; depths: K.
    """
    B, n = anchors.shape
    T = attended.shape[1]
    per = depths - 1
    positions = torch.arange(T, device=anchors.device)
    context = (positions[None, None, :] <= anchors[:, :, None]) & attended.bool()[:, None, :]  # (B, n, T)
    context = context.repeat_interleave(per, dim=1)
    chain = torch.arange(n, device=anchors.device).repeat_interleave(per)
    depth = torch.arange(per, device=anchors.device).repeat(n)
    own = (chain[:, None] == chain[None, :]) & (depth[:, None] >= depth[None, :])
    return torch.cat([context, own.expand(B, -1, -1)], dim=2)[:, None]


def depth_weight(d: int, mode: str, ratio: float, ratio_min: float) -> float:
    """Depth d's loss weight: 1 for depth 0; ``max(ratio^d, ratio_min)`` (``cod``) or 1 (``uniform``) beyond."""
    return 1.0 if d == 0 or mode == "uniform" else max(ratio ** d, ratio_min)


class PEagleModule(EagleModule):
    """Train a P-EAGLE drafter (EAGLE-3's draft vocabulary, fused layers and their setup are :class:`EagleModule`'s,
    and so are the validation metrics: ``step{d + 1}_top1_ver`` is depth d's, the round's (d + 1)-th draft).

    Args:
        draft_vocab_size, aux_layer_ids, drop_outside_vocab, norm_before_residual, norm_before_fc: as EAGLE-3's
            (:class:`~.eagle.EagleModule`).
        num_layers: decoder layers (1: EAGLE-3's shape, so ``init_from`` an EAGLE-3 warm-starts it; speculators'
            example and the P-EAGLE checkpoints published use 4).
        num_depths: K, the depths trained (a round drafts up to K; speculators' default 8).
        mask_token_id: the placeholders' token (default: the tokenizer's mask, unk or pad token, else the last id).
        embedding: ``verifier`` (the verifier's frozen table) or ``own`` (a trained copy, as the references do).
        anchors, val_anchors: chains per row in a training / validation step.
        depth_weights: ``cod`` (``max(r^d, r_min)``) or ``uniform``.
        down_sample_ratio, down_sample_ratio_min: r and r_min of the ``cod`` weights (speculators' 0.7, 0.2).
        **kwargs: see :class:`~.base.DrafterModule` (verifier, optimizer, ``init_from``, measured tau).
    """

    def __init__(
        self,
        draft_vocab_size: Optional[int] = None,
        aux_layer_ids: Optional[list[int]] = None,
        num_layers: int = 1,
        num_depths: int = 8,
        mask_token_id: Optional[int] = None,
        embedding: Literal["verifier", "own"] = "verifier",
        anchors: int = 64,
        val_anchors: int = 64,
        depth_weights: Literal["cod", "uniform"] = "cod",
        down_sample_ratio: float = 0.7,
        down_sample_ratio_min: float = 0.2,
        drop_outside_vocab: bool = True,
        norm_before_residual: bool = False,
        norm_before_fc: bool = False,
        **kwargs,
    ):
        if num_depths < 2:
            raise SpectrainError(f"model.num_depths must be >= 2 (depth 0 alone is EAGLE-3), got {num_depths}")
        if anchors < 1 or val_anchors < 1:
            raise SpectrainError(f"model.anchors and model.val_anchors must be >= 1, got {anchors}, {val_anchors}")
        if depth_weights not in ("cod", "uniform"):
            raise SpectrainError(f"model.depth_weights must be cod or uniform, got {depth_weights!r}")
        if not 0 < down_sample_ratio <= 1 or not 0 <= down_sample_ratio_min <= 1:
            raise SpectrainError(f"model.down_sample_ratio must be in (0, 1] and model.down_sample_ratio_min in "
                                 f"[0, 1], got {down_sample_ratio}, {down_sample_ratio_min}")
        self.num_layers, self.num_depths, self.mask_token_id, self.embedding = (num_layers, num_depths, mask_token_id,
                                                                                embedding)
        self.anchors, self.val_anchors, self.depth_weights = anchors, val_anchors, depth_weights
        self.down_sample_ratio, self.down_sample_ratio_min = down_sample_ratio, down_sample_ratio_min
        super().__init__(variant="eagle3", draft_vocab_size=draft_vocab_size, aux_layer_ids=aux_layer_ids, ttt_steps=1,
                         feature_noise=0.0, feature_loss_weight=0.0, ce_loss_weight=0.0, step_decay=1.0,
                         val_steps=num_depths,
                         drop_outside_vocab=drop_outside_vocab, layer_init="random", norm_init="default",
                         norm_before_residual=norm_before_residual, norm_before_fc=norm_before_fc, norm_output=False,
                         **kwargs)
        self.method_name = "peagle"
        if self.tau_meter.on and self.tau_meter.k > num_depths:
            raise SpectrainError(f"model.measure_k {self.tau_meter.k} exceeds the {num_depths} depths trained "
                                 "(model.num_depths)")

    method_name = "peagle"
    added_init_args = DrafterModule.added_init_args

    @classmethod
    def method_for(cls, init_args) -> str:
        return "peagle"

    @staticmethod
    def _config(init_args: dict, verifier, tokenizer=None, verifier_name: str = "") -> PEagleConfig:
        return PEagleConfig.for_verifier(
            verifier, num_layers=init_args.get("num_layers", 1), num_depths=init_args.get("num_depths", 8),
            draft_vocab_size=init_args.get("draft_vocab_size"), aux_layer_ids=init_args.get("aux_layer_ids"),
            mask_token_id=init_args.get("mask_token_id"), tokenizer=tokenizer,
            embedding=init_args.get("embedding", "verifier"), verifier_name=verifier_name,
            norm_before_residual=bool(init_args.get("norm_before_residual", False)),
            norm_before_fc=bool(init_args.get("norm_before_fc", False)))

    @classmethod
    def fit_drafter(cls, init_args: dict, verifier) -> PEagleDrafter:
        return PEagleDrafter(cls._config(init_args, verifier))

    @classmethod
    def fit_activations(cls, init_args: dict, drafter: PEagleDrafter, verifier_config, batch_size: int,
                        block_size: int, element_bytes: int) -> StepActivations:
        """Per layer and row (B (T - 1) depth-0 rows, B n (K - 1) placeholder rows) EAGLE-3's ~16h + 4I +
        3 (heads + kv_heads) d kept activations (fewer after layer 0; counted alike); backward holds one layer's
        worth; the fused input once in fp32; the chain mask one byte per (placeholder, key) pair. Logits: every
        depth-0 row and placeholder x the draft vocabulary."""
        c = drafter.config
        B, T, h = batch_size, block_size - 1, c.hidden_size
        n = max(1, min(int(init_args.get("anchors", 64)), T - 1))
        M = n * (c.num_depths - 1)
        per_row = 16 * h + 4 * c.intermediate_size + 3 * (c.num_heads + c.num_kv_heads) * c.head_dim
        parts = {"layers": B * (T + M) * c.num_layers * per_row * element_bytes,
                 "backward_transient": B * (T + M) * per_row * element_bytes,
                 "fused_input": B * T * (c.fused_width + h) * 4, "chain_mask": B * M * (T + M)}
        return StepActivations(parts, B * (T - 1) + B * M, c.draft_vocab_size, captured_layers=tuple(c.aux_layer_ids))

    def build_drafter(self) -> PEagleDrafter:
        args = {"num_layers": self.num_layers, "num_depths": self.num_depths, "draft_vocab_size": self.draft_vocab_size,
                "aux_layer_ids": self.aux_layer_ids, "mask_token_id": self.mask_token_id, "embedding": self.embedding,
                **self.norm_flags}
        drafter = PEagleDrafter(self._config(args, self.verifier, self.tokenizer, self.verifier_name))
        if drafter.config.embedding == "own":  # starts as the verifier's table
            with torch.no_grad():
                drafter.embed_tokens.weight.copy_(self.verifier.get_input_embeddings().weight.float())
        return drafter

    @property
    def embed(self):
        return unwrapped(self.drafter).embedding(drafter_embedding(self.verifier))

    def load_initial_drafter(self, path: str) -> None:
        """An EAGLE-3 drafter warm-starts layer 0 and the rest (:meth:`PEagleDrafter.init_from_eagle3`); a P-EAGLE
        one is loaded whole (EAGLE's checks: the same norm variant, shapes and fused layers)."""
        from spectrain.heads.serving.formats import import_drafter

        source = import_drafter(path, verifier_model=self.verifier, fmt=self.init_from_format)
        if isinstance(source, EagleDrafter):
            self.drafter.init_from_eagle3(source, f"model.init_from {path}")
            return
        super().load_initial_drafter(path)

    def check_initial_drafter(self, source: PEagleDrafter, path: str) -> None:
        super().check_initial_drafter(source, path)
        if source.config.mask_token_id != self.drafter.config.mask_token_id:
            raise SpectrainError(f"model.init_from {path} has mask_token_id {source.config.mask_token_id}, this run "
                                 f"{self.drafter.config.mask_token_id}: pass --model.mask_token_id "
                                 f"{source.config.mask_token_id}")

    def checkpoint_record(self) -> dict:
        return {**super().checkpoint_record(), "mask_token_id": self.drafter.config.mask_token_id}

    def check_checkpoint(self, saved: dict) -> None:
        super().check_checkpoint(saved)
        if "mask_token_id" in saved and saved["mask_token_id"] != self.drafter.config.mask_token_id:
            raise SpectrainError(f"the checkpoint's drafter has mask_token_id {saved['mask_token_id']}, this run's "
                                 f"{self.drafter.config.mask_token_id}: pass --model.mask_token_id "
                                 f"{saved['mask_token_id']} to resume it")

    # -- the chains of a batch ----------------------------------------------------------------------------------
    def chains(self, batch: dict, features: dict, count: int, generator: torch.Generator | None = None) -> dict:
        """Draw anchors and run the batch's depth-0 rows and chains through the drafter in one pass.

        Returns a dict: ``out0`` (B, T - 1, h) depth-0 outputs, ``outm`` (B, n, K - 1, h) the placeholders'
        (depth 1..K-1), ``anchors`` (B, n), ``valid`` (B, n, K): depth d of chain i has a target (depth 0: the
        anchor's own target; depths >= 1 the chain condition), ``target_at`` (B, n, K) the position whose
        verifier distribution depth d predicts (a + 1 + d)."""
        drafter = unwrapped(self.drafter)
        K = drafter.config.num_depths
        ids, feats = self._inputs(batch, features)  # (B, T - 1): x_{t+1} with f_t
        B, T = batch["input_ids"].shape
        target = (batch["loss_mask"] * batch["attention_mask"]).bool()
        anchors, ok = sample_anchors(F.pad(target[:, 2:], (0, 2)), count, generator)  # target[a + 3] (depth 1)
        anchors = anchors.masked_fill(~ok, 0)  # a short row's padding chains: in range, never valid
        n = anchors.shape[1]
        at = anchors[:, :, None] + 1 + torch.arange(K, device=ids.device)  # (B, n, K): q at a + 1 + d
        has = (at + 1 <= T - 1) & target.gather(1, (at + 1).clamp_max(T - 1).view(B, -1)).view(B, n, K)
        chain = (has[..., 1:] & ok[..., None]).long().cumprod(-1).bool()
        valid = torch.cat([has[..., :1] & ok[..., None], chain], -1)
        positions = (anchors[:, :, None] + torch.arange(1, K, device=ids.device)).reshape(B, -1)
        M = positions.shape[1]
        out0, outm = drafter.chain_forward(
            ids, drafter.fuse(feats), torch.full((B, M), drafter.config.mask_token_id, device=ids.device),
            drafter.mask_state().expand(B, M, -1), positions,
            chain_mask(anchors, batch["attention_mask"][:, :T - 1], K), self.embed)
        return {"out0": out0, "outm": outm.view(B, n, K - 1, -1), "anchors": anchors, "valid": valid,
                "target_at": at.clamp_max(T - 2)}

    def drafter_loss(self, batch: dict, features) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        drafter = unwrapped(self.drafter)
        K, D = drafter.config.num_depths, drafter.config.draft_vocab_size
        run = self.chains(batch, features, self.anchors)
        B, T = batch["input_ids"].shape
        target = (batch["loss_mask"] * batch["attention_mask"]).bool()
        anchors, valid = run["anchors"], run["valid"]
        # depth 0: every position t < T - 2 (EAGLE-3's step 0); depth d: chain rows, flat b * (T - 2 - d) + a
        kept = [target[:, 2:]] + [valid[..., d] for d in range(1, K)]
        if self.drop_outside_vocab:  # the verifier's argmax at the predicted position must be a draft token
            inside = drafter.t2d[features["greedy"]]
            inside_at = [inside[:, 1:T - 1]] + [inside.gather(1, run["target_at"][..., d]) for d in range(1, K)]
            total = sum((k.sum() for k in kept), target.new_zeros((), dtype=torch.long))
            kept = [k & i for k, i in zip(kept, inside_at)]
            dropped = 1.0 - sum((k.sum() for k in kept), total.new_zeros(())) / total.clamp_min(1)
        counts = torch.stack([k.sum() for k in kept]).tolist()  # one host sync for every depth
        flat = [torch.nonzero_static(kept[0].reshape(-1), size=counts[0]).squeeze(1)]
        states = [run["out0"][:, :T - 2].reshape(-1, run["out0"].shape[-1])]
        for d in range(1, K):
            rows = kept[d].reshape(-1).nonzero().squeeze(1)
            flat.append(((torch.arange(B, device=anchors.device)[:, None] * (T - 2 - d) + anchors).reshape(-1))[rows])
            states.append(run["outm"][:, :, d - 1].reshape(-1, run["outm"].shape[-1])[rows])
        states[0] = states[0][flat[0]]
        d2t = drafter.d2t
        version = ("d2t", d2t.data_ptr(), d2t._version)
        draft_rows = self.draft_rows()
        to_draft = (drafter.target_to_draft(torch.arange(drafter.config.vocab_size, device=anchors.device),
                                            ignore_index=-1) if "topk_ids" in features else None)
        recompute = self.recompute_loss(sum(counts), D)
        parts: dict[str, torch.Tensor] = {}
        total_loss, weights = run["out0"].new_zeros((), dtype=torch.float32), 0.0
        for d, (rows, s, n) in enumerate(zip(flat, states, counts)):
            if not n:
                continue
            teacher = self.teacher(features, 1 + d, rows, draft_rows, to_draft, version)
            ce = self.distribution_loss(drafter.norm(s), drafter.lm_head.weight, None, teacher, recompute)
            parts[f"depth{d}_ce"] = ce.detach()
            w = depth_weight(d, self.depth_weights, self.down_sample_ratio, self.down_sample_ratio_min)
            total_loss, weights = total_loss + w * ce, weights + w
        if self.drop_outside_vocab:
            parts["outside_vocab_frac"] = dropped.detach()
        return total_loss / max(weights, 1e-9), parts

    # -- validation: per-depth agreement with the verifier's greedy token and the joint chain ----------------------
    @torch.no_grad()
    def validation_counts(self, batch: dict, features) -> dict[str, torch.Tensor]:
        # the same chains at every validation (a function of the batch), drawn apart from the training stream
        seed = int(batch["input_ids"].sum()) % (2 ** 31)
        generator = torch.Generator(device=batch["input_ids"].device).manual_seed(seed)
        run = self.chains(batch, features, self.val_anchors, generator)
        anchors, valid, at = run["anchors"], run["valid"], run["target_at"]
        greedy = features["greedy"]
        h = run["out0"].shape[-1]
        first = run["out0"].gather(1, anchors[..., None].expand(-1, -1, h))  # the anchors' depth-0 rows
        outs = torch.cat([first[:, :, None], run["outm"]], 2)  # (B, n, K, h)
        hit = self._top1(outs.flatten(1, 2)).view_as(valid) == greedy.gather(1, at.flatten(1)).view_as(valid)
        counts, hits, masks = {}, [], []
        for d in range(valid.shape[-1]):
            counts[f"n_{d}"], counts[f"top1_ver_{d}"] = valid[..., d].sum(), (hit[..., d] & valid[..., d]).sum()
            hits.append(hit[..., d])
            masks.append(valid[..., d])
        counts["in_vocab_0"] = (unwrapped(self.drafter).t2d[greedy.gather(1, at[..., 0])] & valid[..., 0]).sum()
        return {**counts, **self.chain_counts(hits, masks)}
