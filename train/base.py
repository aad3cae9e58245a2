"""The one LightningModule every drafter trains with.

It owns the frozen verifier (outside the optimizer, never checkpointed) and the
shared machinery: optimizer and schedule, validation counters reduced across
ranks, checkpoint filtering. A drafter subclass provides four things:
``build_drafter``, ``drafter_loss``, ``validation_counts`` and ``val_metrics``.
"""

from __future__ import annotations

import warnings
from typing import Optional

import lightning as L
import torch

from spectrain.heads.errors import SpectrainError
from spectrain.heads.schedule import cosine_with_warmup
from spectrain.heads.verifier import load_verifier, max_context, resolve_dtype, verifier_features

from .losses import projected_topk

VERIFIER_PREFIX = "verifier."
# The frozen verifier stays in eval mode on purpose; Lightning would warn about it on every fit.
warnings.filterwarnings("ignore", message=r".*module\(s\) in eval mode at the start of training.*")


def build_optimizer(drafter: torch.nn.Module, lr: float, weight_decay: float) -> torch.optim.AdamW:
    """AdamW over the drafter's trainable weights (no decay on biases and norms).

    Fused where possible: the unfused CPU AdamW allocates W-sized temporaries per parameter, which is the peak
    of the whole step for per-head lm_heads over a large vocabulary (see train/bench_memory.py); fused is faster too.
    """
    params = [p for p in drafter.parameters() if p.requires_grad]
    groups = [{"params": [p for p in params if p.ndim >= 2], "weight_decay": weight_decay},
              {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}]
    fused = all(p.device.type in ("cpu", "cuda") and p.dtype == torch.float32 for p in params)
    return torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95), fused=fused or None)


class DrafterModule(L.LightningModule):
    """Base for drafters trained on a frozen verifier.

    Args:
        verifier: HF hub id, local model directory, or ``bundled:tinyshakespeare``.
        verifier_gguf_file: GGUF file name inside ``verifier`` (the weights are dequantized on load).
        verifier_dtype: ``auto`` (bf16 on CUDA, fp32 on CPU), ``float32`` or ``bfloat16``.
        trust_remote_code: allow the verifier's own modelling code; off unless you trust it.
        lr: peak learning rate of AdamW.
        weight_decay: AdamW weight decay.
        warmup_steps: linear warmup steps before the cosine decay.
        min_lr_ratio: the cosine decays to ``lr * min_lr_ratio``.
        loss_chunk_size: rows per chunk of the vocabulary projection in the loss (bounds peak memory);
            null projects all rows at once and keeps their logits for backward (the reference path).
        init_from: start from a trained drafter instead of a fresh one: a spectrain run directory or an
            export in any ``spectrain-export`` format (vLLM, SGLang, TensorRT-LLM, speculators); its shape
            must match this run's (heads, layers, draft vocabulary), and an EAGLE-3 keeps its d2t/t2d.
    """

    def __init__(
        self,
        verifier: str = "bundled:tinyshakespeare",
        verifier_gguf_file: Optional[str] = None,
        verifier_dtype: str = "auto",
        trust_remote_code: bool = False,
        lr: float = 1e-3,
        weight_decay: float = 0.0,
        warmup_steps: int = 20,
        min_lr_ratio: float = 0.1,
        loss_chunk_size: Optional[int] = 256,
        init_from: Optional[str] = None,
    ):
        super().__init__()
        if lr <= 0:
            raise SpectrainError(f"model.lr must be > 0, got {lr}")
        if loss_chunk_size is not None and loss_chunk_size < 1:
            raise SpectrainError(f"model.loss_chunk_size must be >= 1 (or null for no chunking), got {loss_chunk_size}")
        self.verifier_name = verifier
        self.verifier_dtype = verifier_dtype
        self.lr, self.weight_decay, self.warmup_steps, self.min_lr_ratio = lr, weight_decay, warmup_steps, min_lr_ratio
        self.loss_chunk_size = loss_chunk_size
        loaded = load_verifier(verifier, gguf_file=verifier_gguf_file, dtype="float32",
                               trust_remote_code=trust_remote_code)
        self.verifier = loaded.model
        self.tokenizer = loaded.tokenizer
        self.drafter = self.build_drafter()
        self.init_from = init_from
        if init_from:
            self.load_initial_drafter(init_from)
        # The checkpoint holds only the drafter, so loading it must not demand verifier keys.
        self.strict_loading = False
        self._val_sums: dict[str, torch.Tensor] = {}
        self.last_val_metrics: dict[str, float] = {}
        self.trained_tokens = 0

    def load_initial_drafter(self, path: str) -> None:
        """Copy the weights of the drafter in ``path`` (any importable format) into ``self.drafter``."""
        from spectrain.heads.formats import import_drafter

        source = import_drafter(path, verifier_model=self.verifier)
        ours = self.drafter.state_dict()
        theirs = source.state_dict()
        if type(source) is not type(self.drafter) or set(theirs) != set(ours) or getattr(
                source.config, "variant", None) != getattr(self.drafter.config, "variant", None):
            raise SpectrainError(f"model.init_from {path} holds a drafter of another kind or shape than this run's "
                                 f"({type(source).__name__} {getattr(source.config, 'variant', '')} with "
                                 f"{len(theirs)} tensors vs {len(ours)}): match --model.* to it")
        wrong = [k for k in ours if ours[k].shape != theirs[k].shape]
        if wrong:
            raise SpectrainError(f"model.init_from {path}: tensor shapes differ from this run's drafter: {wrong[:4]}")
        self.drafter.load_state_dict({k: v.to(ours[k].dtype) for k, v in theirs.items()})

    # -- subclass interface ---------------------------------------------------------------------------------
    def build_drafter(self) -> torch.nn.Module:
        raise NotImplementedError

    def drafter_loss(self, batch: dict, features) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Scalar loss and per-part values to log, for one batch."""
        raise NotImplementedError

    def validation_counts(self, batch: dict, features) -> dict[str, torch.Tensor]:
        """Counts to be summed over the whole validation set (and across ranks)."""
        raise NotImplementedError

    def val_metrics(self, sums: dict[str, torch.Tensor]) -> dict[str, float]:
        """Turn the summed counts into metrics."""
        raise NotImplementedError

    def summary_rows(self, metrics: dict) -> tuple[list[str], list[list]]:
        """(column names, rows) of the per-head / per-step table in the summary."""
        raise NotImplementedError

    @staticmethod
    def chain_counts(hits: list[torch.Tensor], masks: list[torch.Tensor]) -> dict[str, torch.Tensor]:
        """Joint chain statistics: depth j is reached only if depths 1..j all match the verifier.

        Args:
            hits, masks: per depth j, (B, n_j) top-1 matches and target validity; n_j shrinks with depth.
        Returns:
            counts over the positions where every depth has a target: ``chain_n``, ``chain_len`` (sum of
            leading matches) and ``chain_ge_j`` (chains reaching past depth j).
        """
        n_pos = min(h.shape[1] for h in hits)
        chain_ok = torch.ones_like(hits[0][:, :n_pos])
        leading = torch.ones_like(chain_ok)
        length = torch.zeros_like(hits[0][:, :n_pos], dtype=torch.long)
        for hit, mask in zip(hits, masks):
            chain_ok &= mask[:, :n_pos]
            leading &= hit[:, :n_pos]
            length += leading.long()
        counts = {"chain_n": chain_ok.sum(), "chain_len": (length * chain_ok).sum()}
        for j in range(len(hits)):
            counts[f"chain_ge_{j}"] = ((length > j) & chain_ok).sum()
        return counts

    def feature_layer_ids(self) -> tuple[int, ...]:
        """HF ``hidden_states`` indices the drafter needs besides the last hidden state."""
        return ()

    # -- verifier ---------------------------------------------------------------------------------------------
    @property
    def verifier_lm_head(self) -> torch.nn.Module:
        return self.verifier.get_output_embeddings()

    @property
    def topk_chunk_size(self) -> int:
        return self.loss_chunk_size or 4096

    @property
    def verifier_context(self) -> int:
        return max_context(self.verifier.config)

    @torch.no_grad()
    def features(self, batch: dict) -> dict[str, torch.Tensor]:
        """Verifier features of a batch: last hidden (B, T, H), extra layers, greedy next tokens (B, T)."""
        self.verifier.eval()
        if "hidden" in batch:  # offline store: the verifier already ran (spectrain-extract)
            dtype = self.verifier_lm_head.weight.dtype
            last = batch["hidden"].to(dtype)
            width = last.shape[-1]
            stored = list(self._store_layers)
            layers = [batch["aux"][..., stored.index(i) * width:(stored.index(i) + 1) * width].to(dtype)
                      for i in self.feature_layer_ids()]
        else:
            last, layers = verifier_features(self.verifier, batch["input_ids"], batch.get("attention_mask"),
                                             self.feature_layer_ids())
        head = self.verifier_lm_head
        greedy = projected_topk(last, head.weight, head.bias, k=1, chunk_size=self.topk_chunk_size)[..., 0]
        return {"hidden": last, "layers": layers, "greedy": greedy}

    def setup(self, stage: str) -> None:
        data = getattr(self.trainer, "datamodule", None) if self._trainer is not None else None
        if data is not None and getattr(data, "store_meta", None) is not None:
            self.use_store(data.store_meta)

    def use_store(self, meta: dict) -> None:
        """Check an offline store against this verifier and drafter before training on it."""
        from spectrain.data.store import verifier_signature

        if meta["signature"] != verifier_signature(self.verifier.config):
            raise SpectrainError(f"the hidden-state store was made with another verifier ({meta['verifier']}, "
                                 f"{meta['signature']})")
        missing = [i for i in self.feature_layer_ids() if i not in meta["layer_ids"]]
        if missing:
            raise SpectrainError(f"the hidden-state store holds layers {meta['layer_ids']}, but the drafter needs "
                                 f"{list(self.feature_layer_ids())}")
        self._store_layers = tuple(meta["layer_ids"])

    def on_fit_start(self) -> None:
        dtype = resolve_dtype(self.verifier_dtype, self.device)
        self.verifier.to(dtype)

    # -- steps ----------------------------------------------------------------------------------------------------
    def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
        loss, parts = self.drafter_loss(batch, self.features(batch))
        self.trained_tokens += int(batch["attention_mask"].sum())
        self.log("train/loss", loss, prog_bar=True, batch_size=batch["input_ids"].shape[0])
        self.log_dict({f"train/{k}": v for k, v in parts.items()}, batch_size=batch["input_ids"].shape[0])
        return loss

    def on_validation_epoch_start(self) -> None:
        self._val_sums = {}

    def validation_step(self, batch: dict, batch_idx: int) -> None:
        for key, value in self.validation_counts(batch, self.features(batch)).items():
            value = value.detach().double()
            self._val_sums[key] = self._val_sums[key] + value if key in self._val_sums else value

    def on_validation_epoch_end(self) -> None:
        sums = {k: self.trainer.strategy.reduce(v, reduce_op="sum") for k, v in self._val_sums.items()}
        if not sums:
            return
        metrics = self.val_metrics(sums)
        self.last_val_metrics = metrics
        self.log_dict({f"val/{k}": v for k, v in metrics.items()}, sync_dist=False)

    # -- optimizer ------------------------------------------------------------------------------------------------
    def configure_optimizers(self):
        optimizer = build_optimizer(self.drafter, self.lr, self.weight_decay)
        total = max(1, int(self.trainer.estimated_stepping_batches))
        schedule = torch.optim.lr_scheduler.LambdaLR(
            optimizer, lambda step: cosine_with_warmup(step, self.warmup_steps, total, self.min_lr_ratio))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}

    # -- checkpoints: trainable weights + resume state, never the verifier ----------------------------------------
    def on_save_checkpoint(self, checkpoint: dict) -> None:
        checkpoint["state_dict"] = {k: v for k, v in checkpoint["state_dict"].items() if not k.startswith(VERIFIER_PREFIX)}
        checkpoint["spectrain"] = {"verifier": self.verifier_name, "method": self.method_name,
                                   "trained_tokens": self.trained_tokens}
        # The RNG streams the loss draws from (EAGLE-1's feature noise), so a resumed run draws the same numbers.
        checkpoint["rng"] = {"torch": torch.get_rng_state(),
                             **({"cuda": torch.cuda.get_rng_state_all()} if torch.cuda.is_available() else {})}

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        saved = checkpoint.get("spectrain", {})
        if saved.get("method", self.method_name) != self.method_name:
            raise SpectrainError(f"checkpoint is for {saved.get('method')!r}, not {self.method_name!r}")
        missing = [k for k in self.drafter.state_dict() if f"drafter.{k}" not in checkpoint["state_dict"]]
        if missing:
            raise SpectrainError(f"checkpoint lacks drafter weights {missing[:4]}: it is not a {self.method_name} checkpoint")
        self.trained_tokens = int(saved.get("trained_tokens", 0))
        rng = checkpoint.get("rng") or {}
        if "torch" in rng:
            torch.set_rng_state(rng["torch"])
        if "cuda" in rng and torch.cuda.is_available() and len(rng["cuda"]) == torch.cuda.device_count():
            torch.cuda.set_rng_state_all(rng["cuda"])

    def drafter_state_from_checkpoint(self, path: str) -> dict[str, torch.Tensor]:
        """The drafter's weights from a Lightning checkpoint of this module (loaded with weights_only)."""
        state = torch.load(path, map_location="cpu", weights_only=True)["state_dict"]
        return {k[len("drafter."):]: v for k, v in state.items() if k.startswith("drafter.")}

    method_name = "drafter"
