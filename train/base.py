"""The one LightningModule every drafter trains with.

It owns the frozen verifier (outside the optimizer, never checkpointed) and composes the shared machinery:
precision (the verifier in the run's compute dtype, loaded natively so its fp32 RoPE tables stay fp32), the
verifier's features, the training vocabulary and the teacher (``teacher.py``), the loss's recompute-or-keep
decision, the optimizer (``optim.py``) and schedule, per-rank placement (``ranks.py``), validation counts summed
across ranks (``validation.py``), the clock and the learning curve, and checkpoints without the verifier, with
every rank's RNG streams (``checkpoint_state.py``).

A drafter subclass implements ``build_drafter`` (the drafter module, built from the loaded verifier),
``drafter_loss`` (a batch's loss and parts to log), ``validation_counts`` and ``val_metrics`` (counts summed over
the validation set and ranks, then metrics, ``tau_pred`` among them), ``summary_rows`` (the summary's per-head /
per-step table) and ``export`` (the final drafter written into the run directory, called by ``train/cli.py``), and
sets ``method_name``; its drafter's family must be registered (:mod:`spectrain.heads.families`: measured τ,
:class:`~.measure.TauMeter`, decodes with the family's evaluator). It may override ``feature_layer_ids`` (verifier
layers it reads besides the last hidden state; default none), ``needs_greedy`` (whether training steps read the
verifier's greedy ids; default validation only), ``no_decay_params`` (weights kept out of weight decay),
``check_initial_drafter`` / ``checkpoint_record`` / ``check_checkpoint`` (family-specific checks of ``init_from``
and of a resumed checkpoint), ``added_init_args`` / ``resume_ignores`` (its ``__init__`` arguments that a resumed
run's config may lack or change: ``run_dir.py``) and ``setup`` (calling this one first).
"""

from __future__ import annotations

import copy
import time
import warnings
from typing import Literal, Optional

import lightning as L
import torch

from spectrain.heads.errors import SpectrainError
from spectrain.heads.families import family_of
from spectrain.heads.host_memory import keep_freed_memory
from spectrain.heads.schedule import cosine_with_warmup
from spectrain.heads.precision import cast_module, resolve_dtype
from spectrain.heads.verifier import (LogitTransform, load_verifier, max_context, save_verifier_signature,
                                      verifier_identity, verifier_signature)
from spectrain.heads.vocab import save_ranking

from .checkpoint_state import (check_method_and_names, check_same_drafter, check_shapes,
                               drafter_state, gathered_rng_state, rank_rng_state, restore_rank_rng,
                               without_verifier)
from .losses import TOKEN_LOSSES, default_memory_budget, logits_bytes, projected_token_loss
from .measure import TauMeter
from .optim import build_optimizer
from .ranks import ddp_ignored_names, local_device
from .strategies import decay_names, drafter_class, full_state_dict, inside_forward, is_sharded, unwrapped
from .teacher import FrozenRows, batch_features, dense_targets, sparse_targets, training_vocabulary
from .validation import chain_counts, reduce_sums

__all__ = ["DrafterModule"]

# The frozen verifier stays in eval mode on purpose; Lightning would warn about it on every fit.
warnings.filterwarnings("ignore", message=r".*module\(s\) in eval mode at the start of training.*")


class DrafterModule(L.LightningModule):
    """Base for drafters trained on a frozen verifier.

    Args:
        verifier: HF hub id, local model directory, or ``bundled:<name>`` (``tinyshakespeare``, ``smollm2``).
        verifier_gguf_file: GGUF file name inside ``verifier`` (the weights are dequantized on load).
        verifier_dtype: ``auto`` (bf16 where the device multiplies bf16 natively: CUDA, CPUs with AMX or
            AVX512-BF16; fp32 elsewhere), ``float32`` or ``bfloat16``. The CLIs set it from the run's precision.
        verifier_device: where the verifier's weights are loaded: ``auto`` = straight onto this rank's GPU where
            CUDA is available (no whole copy in host memory per rank), ``cpu`` = on the host, for a strategy that
            shards it from there (the CLIs set ``cpu`` under FSDP, where a whole copy per GPU may not fit).
        trust_remote_code: allow the verifier's own modelling code; off unless you trust it.
        lr: peak learning rate of AdamW.
        weight_decay: AdamW weight decay.
        warmup_steps: linear warmup steps before the cosine decay.
        min_lr_ratio: the cosine decays to ``lr * min_lr_ratio``.
        loss_chunk_size: rows per chunk of the vocabulary projection when the loss recomputes it in backward;
            null never chunks (the reference path).
        loss_recompute: ``auto`` projects all rows at once and keeps the logits for backward when they fit
            ``loss_memory_budget_gb`` (no recompute), else chunks under activation checkpointing; ``always`` /
            ``never`` force either.
        loss_memory_budget_gb: memory the loss may keep for backward; default a quarter of what is available
            when training starts (host memory on CPU, free device memory on CUDA).
        train_vocab_size: drafters that project onto the verifier's ``lm_head``: project the loss onto the N most
            frequent loss-masked tokens of the training data only (the verifier's own rows; exports keep the full
            vocabulary). Hard targets outside it are dropped from the loss (counted: ``train/dropped_frac``); soft
            targets are the verifier's distribution renormalised over it. null: the whole vocabulary.
        measure_prompts: at every validation, also decode this many fixed prompts (the first validation rows cut
            before their first target token) with our lossless speculative loop — a chain of ``measure_k`` drafts,
            T = 0, ``measure_new_tokens`` tokens each — and log the measured tau (``val/tau_measured``) beside the
            predicted one (:class:`~.measure.TauMeter`). 0: off.
        measure_k, measure_new_tokens: see ``measure_prompts``.
        token_loss: the loss of the drafter's token distributions against the verifier's: ``ce`` (cross-entropy),
            or an acceptance-targeted LK loss (arXiv 2602.23881): ``lk_alpha`` = -log sum min(p, q), ``lk_hybrid`` =
            lam * KL(q || p) + (1 - lam)(1 - alpha) with lam = exp(-lk_eta * alpha) detached. LK needs the verifier's
            distribution (a drafter with hard targets must take soft ones); its logits are kept whole (use a
            ``train_vocab_size``).
        lk_eta: eta of ``lk_hybrid``.
        init_from: start from a trained drafter instead of a fresh one: a spectrain run directory or an
            export in any ``spectrain-export`` format (vLLM, SGLang, TensorRT-LLM, speculators); its shape
            must match this run's (heads, layers, draft vocabulary), and a drafter with its own draft vocabulary
            keeps its map to the verifier's.
        init_from_format: the format ``init_from`` is in, where several registered formats claim its directory
            (``spectrain`` or a ``spectrain-export`` format); None: detected.
    """

    def __init__(
        self,
        verifier: str = "bundled:tinyshakespeare",
        verifier_gguf_file: Optional[str] = None,
        verifier_dtype: str = "auto",
        verifier_device: Literal["auto", "cpu"] = "auto",
        trust_remote_code: bool = False,
        lr: float = 1e-3,
        weight_decay: float = 0.0,
        warmup_steps: int = 20,
        min_lr_ratio: float = 0.1,
        loss_chunk_size: Optional[int] = 256,
        loss_recompute: Literal["auto", "always", "never"] = "auto",
        loss_memory_budget_gb: Optional[float] = None,
        train_vocab_size: Optional[int] = None,
        measure_prompts: int = 0,
        measure_k: int = 5,
        measure_new_tokens: int = 64,
        init_from: Optional[str] = None,
        init_from_format: Optional[str] = None,
        token_loss: Literal["ce", "lk_alpha", "lk_hybrid"] = "ce",
        lk_eta: float = 3.0,
    ):
        super().__init__()
        if token_loss not in TOKEN_LOSSES:
            raise SpectrainError(f"model.token_loss must be one of {', '.join(TOKEN_LOSSES)}, got {token_loss!r}")
        if not lk_eta > 0:
            raise SpectrainError(f"model.lk_eta must be > 0, got {lk_eta}")
        self.token_loss, self.lk_eta = token_loss, lk_eta
        if lr <= 0:
            raise SpectrainError(f"model.lr must be > 0, got {lr}")
        if loss_chunk_size is not None and loss_chunk_size < 1:
            raise SpectrainError(f"model.loss_chunk_size must be >= 1 (or null for no chunking), got {loss_chunk_size}")
        self.verifier_name = verifier
        self.verifier_dtype = verifier_dtype
        self.lr, self.weight_decay, self.warmup_steps, self.min_lr_ratio = lr, weight_decay, warmup_steps, min_lr_ratio
        if loss_recompute not in ("auto", "always", "never"):
            raise SpectrainError(f"model.loss_recompute must be auto, always or never, got {loss_recompute!r}")
        if loss_memory_budget_gb is not None and loss_memory_budget_gb <= 0:
            raise SpectrainError(f"model.loss_memory_budget_gb must be > 0, got {loss_memory_budget_gb}")
        if train_vocab_size is not None and train_vocab_size < 1:
            raise SpectrainError(f"model.train_vocab_size must be >= 1 (or null for the whole vocabulary), "
                                 f"got {train_vocab_size}")
        self.tau_meter = TauMeter(measure_prompts, measure_k, measure_new_tokens)
        self.curve: list[dict] = []  # one entry per validation: the learning curve in the run's summary
        self.loss_chunk_size, self.loss_recompute = loss_chunk_size, loss_recompute
        self.loss_memory_budget_gb = loss_memory_budget_gb
        self._loss_budget: Optional[int] = None
        # Loaded directly in the compute dtype (not cast later: a native bf16 load keeps HF's fp32 rotary tables,
        # and no fp32 copy of a large verifier is ever made) and onto the device this rank will train on (no
        # whole copy in host memory per rank; the strategy's move to that device is then a no-op).
        if verifier_device not in ("auto", "cpu"):
            raise SpectrainError(f"model.verifier_device must be auto or cpu, got {verifier_device!r}")
        self.verifier_device = local_device()  # where it trains: its dtype is chosen for this device
        loaded = load_verifier(verifier, gguf_file=verifier_gguf_file,
                               dtype=resolve_dtype(verifier_dtype, self.verifier_device),
                               device=self.verifier_device if verifier_device == "auto" else "cpu",
                               trust_remote_code=trust_remote_code)
        self.verifier = loaded.model
        self.tokenizer = loaded.tokenizer
        self.drafter = self.build_drafter()
        self.family = family_of(self.drafter)  # a drafter of no registered family is refused here
        self._decaying = decay_names(self.drafter)  # before any strategy wraps (and flattens) it
        vocab = self.verifier_lm_head.weight.shape[0]
        if train_vocab_size is not None and train_vocab_size > vocab:
            raise SpectrainError(f"model.train_vocab_size {train_vocab_size} exceeds the verifier's vocabulary of {vocab}")
        self.train_vocab_size = train_vocab_size
        # (N,) vocabulary ids of the training vocabulary and the (V,) map back (-1 outside); set in setup().
        self.register_buffer("train_rows", None, persistent=False)
        self.register_buffer("to_train_row", None, persistent=False)
        self._frozen_rows = FrozenRows()
        self.init_from, self.init_from_format = init_from, init_from_format
        if init_from_format and not init_from:
            raise SpectrainError("model.init_from_format names the format of model.init_from: give model.init_from")
        if init_from:
            self.load_initial_drafter(init_from)
        # The checkpoint holds only the drafter, so loading it must not demand verifier keys.
        self.strict_loading = False
        self._val_sums: dict[str, torch.Tensor] = {}
        self.last_val_metrics: dict[str, float] = {}
        self.trained_tokens = 0  # over all ranks; this rank's tokens since the last sum wait in _tokens_pending
        self._tokens_pending: Optional[torch.Tensor] = None  # on the device: no host sync per step
        self._rank_seeded = False
        # Seconds spent training (optimizer steps, data, periodic resume checkpoints), validation excluded, summed
        # over resumes: the wall-clock axis on which drafters are compared at equal compute.
        self.train_seconds = 0.0
        self._clock: Optional[float] = None

    def load_initial_drafter(self, path: str) -> None:
        """Copy the weights of the drafter in ``path`` (any importable format) into ``self.drafter``."""
        from spectrain.heads.serving.formats import import_drafter

        source = import_drafter(path, verifier_model=self.verifier, fmt=self.init_from_format)
        check_same_drafter(source, self.drafter, path)
        self.check_initial_drafter(source, path)
        ours = self.drafter.state_dict()
        self.drafter.load_state_dict({k: v.to(ours[k].dtype) for k, v in source.state_dict().items()})

    def check_initial_drafter(self, source: torch.nn.Module, path: str) -> None:
        """Raise if ``source`` (``init_from``: same class, method, tensor names and shapes as this run's drafter)
        still means something else to this run (e.g. other fused verifier layers behind the same input shape)."""

    def checkpoint_record(self) -> dict:
        """What a checkpoint records about the drafter besides its weights, for :meth:`check_checkpoint`."""
        return {}

    def check_checkpoint(self, saved: dict) -> None:
        """Raise if a checkpoint (its ``"spectrain"`` record, :meth:`checkpoint_record` among it) cannot resume this
        run although its weights have the right names (called before the shapes are compared)."""

    # -- subclass interface ---------------------------------------------------------------------------------
    @classmethod
    def method_for(cls, init_args) -> str:
        """The method a recipe's ``init_args`` train, before the module is built (it names the run directory)."""
        return cls.method_name

    # ``__init__`` arguments added after runs were saved, with the value that reproduces a config saved without
    # them: a resumed run's config is compared with the saved one without them while they hold that value
    # (``run_dir.py``). A subclass adds its own to these.
    added_init_args: dict = {"verifier_device": "auto", "init_from_format": None}

    @classmethod
    def resume_ignores(cls, init_args: dict, saved: dict) -> tuple[str, ...]:
        """``__init__`` arguments left out when a run is resumed and its config compared with the saved one:
        those ``init_args`` (a config's, the saved one's or the resumed one's, as a dict) make meaningless, or
        whose saved value (``saved``: the saved config's) stood for a default that changed since. None here."""
        return ()

    # -- the fit check (train/fit.py: ``--dry_run``): each family estimates its own step --------------------------
    @classmethod
    def fit_drafter(cls, init_args: dict, verifier) -> torch.nn.Module:
        """The drafter a recipe's ``init_args`` build for ``verifier`` (an HF causal LM on the ``meta`` device; the
        caller builds under ``torch.device("meta")``): its parameter counts size the run."""
        raise SpectrainError(f"{cls.__qualname__} gives no fit estimate: it must define fit_drafter and "
                             "fit_activations (train/fit.py)")

    @classmethod
    def fit_activations(cls, init_args: dict, drafter: torch.nn.Module, verifier_config, batch_size: int,
                        block_size: int, element_bytes: int):
        """A :class:`~.fit.StepActivations`: bytes one training step of ``batch_size`` rows of ``block_size``
        tokens keeps for backward or peaks at, activations of ``element_bytes`` each, plus its logits' shape."""
        raise SpectrainError(f"{cls.__qualname__} gives no fit estimate: it must define fit_drafter and "
                             "fit_activations (train/fit.py)")

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

    def export(self, out_dir, drafter: torch.nn.Module, extra: Optional[dict] = None):
        """Write ``drafter`` (:meth:`plain_drafter`; the best checkpoint's weights where there is one) into ``out_dir``
        in our format; ``extra``: run facts (``trained_steps``) the format may record. Returns ``out_dir``."""
        raise NotImplementedError

    def write_run_records(self, out_dir) -> None:
        """Beside the exported drafter: the verifier's signature (``verifier_signature.json``: imports match the
        verifier by it, not by name) and, where the training vocabulary was counted, ``vocab_ranking.json`` (the
        token counts ranked draft heads read; its default size the vocabulary the loss projected onto)."""
        save_verifier_signature(out_dir, verifier_identity(self.verifier, self.tokenizer), self.verifier_name)
        counts = getattr(self, "vocab_counts", None)
        if counts is not None and self.ranked_default_size() is not None:
            save_ranking(out_dir, counts, self.ranked_default_size(),
                         source="loss-masked tokens of the training rows")

    def ranked_default_size(self) -> Optional[int]:
        """The draft vocabulary a ranked head defaults to (None: this drafter writes no ranking)."""
        return self.train_vocab_size or 0

    chain_counts = staticmethod(chain_counts)  # joint chain statistics (validation.py), for val counts

    def no_decay_params(self) -> tuple[torch.Tensor, ...]:
        """Weights that must not decay: e.g. lm_head rows a training vocabulary leaves without gradients."""
        return ()

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

    def needs_greedy(self, training: bool) -> bool:
        """Whether a step reads the verifier's greedy tokens (validation always does)."""
        return not training

    @torch.no_grad()
    def features(self, batch: dict, greedy: bool = True) -> dict[str, torch.Tensor]:
        """Verifier features of a batch: last hidden (B, T, H), extra layers, and (B, T) greedy next tokens.

        The greedy tokens cost a projection onto the whole vocabulary: they are computed only when ``greedy``
        asks for them and the batch (from a store) does not carry them already. A store's top-k teacher
        (``topk_ids``, ``topk_logprobs``, (B, T, k)) is passed through.
        """
        self.verifier.eval()
        return batch_features(self.verifier, batch, self.feature_layer_ids(), getattr(self, "_store_layers", None),
                              greedy, self.topk_chunk_size)

    # -- training vocabulary and loss memory -------------------------------------------------------------------
    def set_train_vocab(self, rows) -> None:
        """Choose the training vocabulary: the ``train_vocab_size`` most frequent loss-masked tokens of ``rows``
        (the counts are kept: the export writes them as the drafter's ``vocab_ranking.json``)."""
        self.vocab_counts, top, to_row = training_vocabulary(rows, self.verifier_lm_head.weight.shape[0],
                                                             self.train_vocab_size)
        device = self.verifier_lm_head.weight.device
        self.train_rows, self.to_train_row = top.to(device), to_row.to(device)
        self._frozen_rows.clear()

    def frozen_rows(self, head: torch.nn.Module, rows: Optional[torch.Tensor],
                    version: object = None) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """(weight, bias) of a frozen projection restricted to ``rows`` (all if None), made once and kept
        (:class:`~.teacher.FrozenRows`; ``version`` identifies a row set rebuilt per call)."""
        return self._frozen_rows.get(head, rows, version)

    def teacher(self, features: dict, start: int, rows: torch.Tensor, projected: Optional[torch.Tensor],
                to_projected: Optional[torch.Tensor], version: object = None) -> dict[str, torch.Tensor]:
        """The soft target of a loss: :func:`projected_cross_entropy`'s teacher arguments for the verifier's
        next-token distributions at positions ``start .. T-2`` (flattened, then ``rows`` (N,) of them).

        From a store with top-k: the sparse teacher mapped into the projected rows (``to_projected``: (V,) ->
        row or -1), no projection at all. Otherwise the dense teacher: the last hidden states through the
        verifier's ``lm_head`` restricted to ``projected`` (vocabulary ids, or None for all; ``version`` as in
        :meth:`frozen_rows`).
        """
        if "topk_ids" in features:
            return sparse_targets(features, start, rows, to_projected)
        weight, bias = self.frozen_rows(self.verifier_lm_head, projected, version)
        # q as the verifier's head computes it (soft-cap, scale)
        return dense_targets(features["hidden"], start, rows, weight, bias, LogitTransform.of(self.verifier.config))

    def distribution_loss(self, states: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                          teacher: dict, recompute: bool) -> torch.Tensor:
        """The mean ``token_loss`` of (N, H) drafter states projected by (weight, bias) against a :meth:`teacher`."""
        return projected_token_loss(states, weight, bias, teacher, self.token_loss, self.lk_eta,
                                    chunk_size=self.loss_chunk_size, recompute=recompute)

    def recompute_loss(self, rows: int, vocab: int) -> bool:
        """Whether the loss should chunk and recompute its projection of ``rows`` x ``vocab`` logits in backward."""
        if self.loss_recompute != "auto":
            return self.loss_recompute == "always"
        if self._loss_budget is None:
            self._loss_budget = (int(self.loss_memory_budget_gb * 2**30) if self.loss_memory_budget_gb
                                 else default_memory_budget(self.device))
        return logits_bytes(rows, vocab) > self._loss_budget

    def setup(self, stage: str) -> None:
        data = getattr(self.trainer, "datamodule", None) if self._trainer is not None else None
        if data is not None and getattr(data, "store_meta", None) is not None:
            self.use_store(data.store_meta)
        if self.train_vocab_size and self.train_rows is None and data is not None and data.train_set is not None:
            self.set_train_vocab(data.vocab_rows() if hasattr(data, "vocab_rows") else data.train_set)
        world, rank = self.world_size, self.global_rank
        if stage == "fit" and world > 1 and not self._rank_seeded:
            # One random stream per rank (a family's input noise): seed_everything gave every rank the same seed.
            # The drafter is already built, and DDP starts every rank from rank 0's weights. A resumed run then
            # restores each rank's own saved stream (on_load_checkpoint runs after setup).
            torch.manual_seed(torch.initial_seed() + rank)
            self._rank_seeded = True
        # DDP broadcasts every parameter and buffer from rank 0 at the start and buffers before every forward;
        # the frozen verifier is loaded alike on every rank and the buffers are fixed tables: sync the drafter only.
        self._ddp_params_and_buffers_to_ignore = ddp_ignored_names(self)

    def use_store(self, meta: dict) -> None:
        """Check an offline store against this verifier and drafter before training on it."""
        if meta["signature"] != verifier_signature(self.verifier.config):
            raise SpectrainError(f"the hidden-state store was made with another verifier ({meta['verifier']}, "
                                 f"{meta['signature']})")
        missing = [i for i in self.feature_layer_ids() if i not in meta["layer_ids"]]
        if missing:
            raise SpectrainError(f"the hidden-state store holds layers {meta['layer_ids']}, but the drafter needs "
                                 f"{list(self.feature_layer_ids())}")
        self._store_layers = tuple(meta["layer_ids"])

    def on_fit_start(self) -> None:
        self.tau_meter.check_decoder(self.verifier)
        if self.device.type == "cpu":
            keep_freed_memory()  # else every step re-faults its vocabulary-sized buffers (host_memory.py)
        dtype = resolve_dtype(self.verifier_dtype, self.device)
        if self.verifier_lm_head.weight.dtype != dtype:  # trained on another device than the one loaded for
            cast_module(self.verifier, dtype)
            self._frozen_rows.clear()

    def teardown(self, stage: str) -> None:
        self._frozen_rows.clear()  # cached row subsets are not moved by .to()/.cpu(): never keep one past a stage

    # -- steps ----------------------------------------------------------------------------------------------------
    def step_loss(self, batch: dict) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The verifier's features, then the drafter's loss run as the drafter's forward (:func:`inside_forward`:
        under FSDP its weights are whole only there)."""
        features = self.features(batch, greedy=self.needs_greedy(training=True))
        return inside_forward(self.drafter, lambda: self.drafter_loss(batch, features))

    def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
        loss, parts = self.step_loss(batch)
        tokens = batch["attention_mask"].sum()
        self._tokens_pending = tokens if self._tokens_pending is None else self._tokens_pending + tokens
        self.log("train/loss", loss, prog_bar=True, batch_size=batch["input_ids"].shape[0])
        self.log_dict({f"train/{k}": v for k, v in parts.items()}, batch_size=batch["input_ids"].shape[0])
        return loss

    def on_train_start(self) -> None:
        self._clock = time.perf_counter()  # after any sanity check; also on a mid-epoch resume

    def on_train_batch_end(self, outputs, batch, batch_idx: int) -> None:
        now = time.perf_counter()
        if self._clock is not None:
            self.train_seconds += now - self._clock
        self._clock = now

    def plain_drafter(self) -> torch.nn.Module:
        """A copy of the drafter as a plain module with its whole weights, for decoding and export. Under FSDP
        the weights are gathered from the shards (a collective: every rank calls it) into a drafter built from
        its config, not from the (sharded) verifier."""
        if not is_sharded(self.drafter):
            return copy.deepcopy(self.drafter)
        state = full_state_dict(self.drafter)
        inner = unwrapped(self.drafter)
        with torch.random.fork_rng(devices=[]):  # a fresh module draws its init: leave the training streams alone
            drafter = drafter_class(inner)(inner.config)
        drafter.load_state_dict(state)
        return drafter

    def sync_trained_tokens(self) -> None:
        """Add every rank's tokens since the last call to ``trained_tokens`` (a collective: all ranks call it, at
        validation and checkpoint time, so training steps never wait on the host)."""
        pending = self._tokens_pending if self._tokens_pending is not None else torch.zeros((), dtype=torch.long,
                                                                                           device=self.device)
        if self._trainer is not None:
            pending = self.trainer.strategy.reduce(pending, reduce_op="sum")
        self.trained_tokens += int(pending)
        self._tokens_pending = None

    def on_validation_epoch_start(self) -> None:
        self._val_sums = {}
        self.sync_trained_tokens()
        self.tau_meter.epoch_start(getattr(self.trainer, "datamodule", None))

    def on_train_end(self) -> None:
        self.sync_trained_tokens()

    def validation_step(self, batch: dict, batch_idx: int) -> None:
        self.tau_meter.collect(batch)  # bare dataloaders, no datamodule: this rank's first rows
        features = self.features(batch)
        for key, value in inside_forward(self.drafter, lambda: self.validation_counts(batch, features)).items():
            value = value.detach().double()
            self._val_sums[key] = self._val_sums[key] + value if key in self._val_sums else value

    def on_validation_epoch_end(self) -> None:
        # Every branch below is taken alike on every rank (what decides it is gathered first): a rank that skipped
        # a collective the others entered would hang them.
        world = self.trainer.world_size
        self.tau_meter.gather(world)
        sums = reduce_sums(self._val_sums, self.trainer.strategy, world, self.device)
        if not sums:
            return
        metrics = self.val_metrics(sums)
        metrics.update(self.tau_meter.metrics(self))  # measured tau (none while the verifier is sharded)
        self.last_val_metrics = metrics
        if self.trainer.state.fn == "fit" and not self.trainer.sanity_checking:  # the learning curve (the final
            # validate() scores the best checkpoint; sanity checks see a few batches only)
            self.curve.append({"step": self.global_step, "trained_tokens": self.trained_tokens,
                               "train_seconds": round(self.train_seconds, 3), **metrics})
        self.log_dict({f"val/{k}": v for k, v in metrics.items()}, sync_dist=False)

    def on_validation_end(self) -> None:
        # Runs after the checkpoint callbacks: neither the validation nor its checkpoint writes count as training.
        if self.trainer.state.fn == "fit":
            self._clock = time.perf_counter()

    # -- optimizer ------------------------------------------------------------------------------------------------
    def configure_optimizers(self):
        scaling = self._trainer is not None and getattr(self.trainer.precision_plugin, "scaler", None) is not None
        optimizer = build_optimizer(self.drafter, self.lr, self.weight_decay, loss_scaling=scaling,
                                    no_decay=self.no_decay_params(), decaying=self._decaying)
        estimated = self.trainer.estimated_stepping_batches
        if estimated == float("inf"):
            raise SpectrainError("the cosine learning-rate schedule needs a finite length: set --trainer.max_steps (or "
                                 "max_epochs); --trainer.max_time alone can only stop a run early")
        total = max(1, int(estimated))
        schedule = torch.optim.lr_scheduler.LambdaLR(
            optimizer, lambda step: cosine_with_warmup(step, self.warmup_steps, total, self.min_lr_ratio))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}

    def configure_gradient_clipping(self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None) -> None:
        """Clip the drafter's gradients ourselves unless a loss scaler or a sharded strategy is in play.

        Lightning's mixed-precision plugin refuses to clip for any optimizer that *could* unscale internally
        (fused AdamW), even under bf16 where nothing is scaled; bf16 gradients need no unscaling, so clipping
        them here is exact. fp16 (a scaler; the optimizer is then unfused) and FSDP keep Lightning's path.
        """
        if not gradient_clip_val:
            return
        plugin = self.trainer.precision_plugin
        if getattr(plugin, "scaler", None) is not None:
            return self.clip_gradients(optimizer, gradient_clip_val, gradient_clip_algorithm)
        root = self.trainer.strategy.model
        if is_sharded(self.drafter) and gradient_clip_algorithm != "value" and hasattr(root, "clip_grad_norm_"):
            # FSDP1: the norm over every rank's shards (a collective on the root); Lightning's FSDP precision
            # plugin refuses norm clipping. FSDP2's DTensor gradients take the plain call below.
            return root.clip_grad_norm_(gradient_clip_val)
        params = [p for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
        if gradient_clip_algorithm == "value":
            torch.nn.utils.clip_grad_value_(params, gradient_clip_val)
        else:
            torch.nn.utils.clip_grad_norm_(params, gradient_clip_val)

    # -- checkpoints: trainable weights + resume state, never the verifier ----------------------------------------
    def on_save_checkpoint(self, checkpoint: dict) -> None:
        self.sync_trained_tokens()  # every rank saves (Lightning writes on rank 0 only)
        checkpoint["state_dict"] = without_verifier(checkpoint["state_dict"])
        checkpoint["spectrain"] = {"verifier": self.verifier_name, "method": self.method_name,
                                   "trained_tokens": self.trained_tokens, "train_seconds": self.train_seconds,
                                   "curve": self.curve, **self.checkpoint_record()}
        # The RNG streams the loss draws from (a family's input noise), so a resumed run draws the same numbers:
        # every rank's own (CPU, and its own device's on CUDA), gathered into rank 0's checkpoint.
        checkpoint["rng"] = gathered_rng_state(rank_rng_state(self.rng_device()), self.world_size)

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        saved = checkpoint.get("spectrain", {})
        weights = checkpoint.get("state_dict")  # absent under FSDP: its strategy has loaded them already
        own = self.drafter.state_dict() if weights is not None else {}
        check_method_and_names(saved, own, weights, self.method_name)
        self.check_checkpoint(saved)
        check_shapes(own, weights)
        self.trained_tokens = int(saved.get("trained_tokens", 0))
        self.train_seconds = float(saved.get("train_seconds", 0.0))
        self.curve = list(saved.get("curve", []))
        self._tokens_pending = None
        self.restore_rng(checkpoint.get("rng") or {})

    def restore_rng(self, rng: dict) -> None:
        """This rank's saved streams; a run resumed on another number of ranks keeps its fresh per-rank seeds."""
        restore_rank_rng(rng, self.world_size, self.global_rank, self.rng_device())

    @property
    def world_size(self) -> int:
        """Ranks of the run (1 outside a trainer)."""
        return self.trainer.world_size if self._trainer is not None else 1

    def verifier_is_sharded(self) -> bool:
        """Whether a strategy sharded the verifier's layers (FSDP): outside their forward they hold shards only."""
        return any(is_sharded(m) for m in self.verifier.modules())

    def rng_device(self):
        """The device this rank trains on. Not ``self.device``: Lightning restores a checkpoint (and so calls
        :meth:`restore_rng`) before the strategy moves the module onto that device."""
        return self.trainer.strategy.root_device if self._trainer is not None else self.device

    def drafter_state_from_checkpoint(self, path: str) -> dict[str, torch.Tensor]:
        """The drafter's weights from a Lightning checkpoint of this module (loaded with weights_only)."""
        return drafter_state(path)

    method_name = "drafter"

