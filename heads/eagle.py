"""EAGLE drafters: one Llama-style decoder layer over the verifier's features.

Two variants, both for Llama-family verifiers (llama, mistral, qwen2, qwen3):

* ``eagle1`` (EAGLE): the input at position t is ``fc(cat(embed(x_{t+1}), f_t))``, where ``f_t`` is the
  verifier's last hidden state (after its final norm). The layer has no input norm (EAGLE removes it:
  ``fc``'s output is the residual stream). The output is the predicted next feature, projected by the
  verifier's own frozen ``lm_head``.
* ``eagle3`` (EAGLE-3): ``fc`` fuses several of the verifier's hidden states (``aux_layer_ids``, HF
  ``hidden_states`` indices) into one h-wide state g. The layer's attention reads
  ``cat(input_norm(embed(x_{t+1})), hidden_norm(g))`` (2h wide) with g as the residual; the output
  goes through the drafter's ``norm`` and its own ``lm_head`` over a reduced draft vocabulary whose ids
  map to the verifier's through ``d2t`` (target id = i + d2t[i]); ``t2d`` marks target ids in it.
  vLLM speculators' variant (its training default) adds three norms, each a flag of :class:`EagleConfig`:
  ``norm_before_fc``, ``norm_before_residual``, ``norm_output``.

Alignment: ``input_ids[:, t]`` is the token *after* the position whose features are ``features[:, t]``
(x_{t+1} with f_t); the caller shifts, this module never does (except in :meth:`EagleDrafter.ttt_forward`).

The verifier's ``embed_tokens`` and ``lm_head`` are passed in at call time, never registered, so they
are not in the drafter's ``state_dict`` and never written into its checkpoint.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from .compatibility import check_compatible
from .errors import SpectrainError
from .families import DrafterFamily, register_family
from .io import checked_state, read_drafter_config, save_drafter_dir
from .layers import Attention, RMSNorm, SwiGLU, causal_mask, rotary_cos_sin
from .layers import spread_layers as default_aux_layers  # EAGLE-3's fused layers: the spread rule
from .verifier import drafter_shape, max_context, verifier_rope
from .vocab import build_vocab_map, check_vocab_map

FORMAT_VERSION = 1
VARIANTS = ("eagle1", "eagle3")
DEFAULT_DRAFT_VOCAB = 32000
NORM_FLAGS = ("norm_before_residual", "norm_before_fc", "norm_output")  # eagle3 variants (EagleConfig)

EmbedLike = nn.Module | Callable[[torch.Tensor], torch.Tensor] | torch.Tensor


# -- configuration ------------------------------------------------------------------------------------------
def check_aux_layer_order(ids, where: str = "EAGLE-3 aux_layer_ids") -> list[int]:
    """Raise unless ``ids`` are strictly ascending (sorted, no layer twice); returns them as a list.

    The one rule for EAGLE-3 layer order, used by :class:`EagleConfig`, the export and the evaluator. Serving
    engines capture the verifier's layers in ascending order and ``fc``'s input columns follow the order of the
    ids, so ids out of order are refused, never sorted: a drafter trained on [5, 1, 3] would be silently wrong
    on [1, 3, 5]. ``where`` names what holds the ids in the message.
    """
    ids = list(ids)
    fixed = sorted(set(ids))
    if ids == fixed:
        return ids
    repeated = sorted({i for i in ids if ids.count(i) > 1})
    problems = ([f"repeat layer{'s' if len(repeated) > 1 else ''} {repeated}"] if repeated else []) + (
        ["are not ascending"] if list(dict.fromkeys(ids)) != fixed else [])
    raise SpectrainError(
        f"{where} {ids} {' and '.join(problems)}: fc's input columns follow the ids' order and serving engines "
        f"capture the verifier's layers in ascending order, so ids are never reordered for you; train with "
        f"--model.aux_layer_ids '{fixed}' (a drafter already trained on {ids} cannot be reordered: retrain it)")


def _require_int(name: str, value, minimum: int = 1) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise SpectrainError(f"EAGLE {name} must be an integer >= {minimum}, got {value!r}")


@dataclass
class EagleConfig:
    """Shape of an EAGLE drafter and the verifier it was trained for.

    Sizes default to 0, which fails validation: build it with :meth:`for_verifier` or pass them all.
    ``draft_vocab_size`` (eagle3) defaults to min(vocab_size, 32000); for eagle1 it is the verifier's
    vocabulary. ``aux_layer_ids`` (eagle3) default to :func:`default_aux_layers` and must be ascending and
    distinct (:func:`check_aux_layer_order`: refused otherwise, never sorted); eagle1 has none.
    ``rope_scaling`` records the verifier's ``rope_scaling`` / ``rope_parameters`` for exporters; this
    module itself always uses default RoPE with ``rope_theta`` (the drafter is trained from scratch, so
    it only has to agree with itself).

    eagle3 variant flags (vLLM speculators' names and meaning, ``models/eagle3/core.py`` there; all False is
    EAGLE-3 as published and our default, all True speculators' training default): ``norm_before_residual``
    (the layer's residual is ``hidden_norm(g)``, not g), ``norm_before_fc`` (``input_norm``, one RMSNorm over
    the concatenated aux states, before ``fc``) and ``norm_output`` (each draft step after the first reads the
    *normed* output of the step before; the logits are ``lm_head(norm(out))`` either way).
    """

    variant: str = "eagle3"
    hidden_size: int = 0
    vocab_size: int = 0
    draft_vocab_size: int | None = None
    aux_layer_ids: list[int] | None = None
    num_hidden_layers: int = 0  # the verifier's, to range-check aux_layer_ids
    num_heads: int = 0
    num_kv_heads: int = 0
    head_dim: int = 0
    intermediate_size: int = 0
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    max_position_embeddings: int = 2048
    norm_before_residual: bool = False
    norm_before_fc: bool = False
    norm_output: bool = False
    verifier: str = ""
    method: str = ""
    format_version: int = FORMAT_VERSION

    def __post_init__(self):
        if self.variant not in VARIANTS:
            raise SpectrainError(f"EAGLE variant must be one of {VARIANTS}, got {self.variant!r}")
        if self.method and self.method != self.variant:
            raise SpectrainError(f"EAGLE config says method {self.method!r} but variant {self.variant!r}")
        self.method = self.variant
        for key in ("hidden_size", "vocab_size", "num_hidden_layers", "num_heads", "num_kv_heads", "head_dim",
                    "intermediate_size", "max_position_embeddings"):
            _require_int(key, getattr(self, key))
        if self.head_dim % 2:
            raise SpectrainError(f"EAGLE head_dim must be even for rotary embeddings, got {self.head_dim}")
        if self.num_heads % self.num_kv_heads:
            raise SpectrainError(f"EAGLE num_heads ({self.num_heads}) must be a multiple of num_kv_heads "
                                 f"({self.num_kv_heads})")
        if not self.rms_norm_eps > 0 or not self.rope_theta > 0:
            raise SpectrainError(f"EAGLE rms_norm_eps and rope_theta must be > 0, got {self.rms_norm_eps!r} and "
                                 f"{self.rope_theta!r}")
        self._init_draft_vocab()
        self._init_aux_layers()
        for flag in NORM_FLAGS:
            if not isinstance(getattr(self, flag), bool):
                raise SpectrainError(f"EAGLE {flag} must be true or false, got {getattr(self, flag)!r}")
        if self.variant == "eagle1" and self.norm_flags:
            raise SpectrainError(f"{', '.join(self.norm_flags)}: EAGLE-3 variant flags (speculators'); eagle1 "
                                 "drafters have none")

    @property
    def norm_flags(self) -> list[str]:
        """The eagle3 variant flags that are on (:data:`NORM_FLAGS` order); [] = EAGLE-3 as published."""
        return [flag for flag in NORM_FLAGS if getattr(self, flag)]

    def _init_draft_vocab(self) -> None:
        if self.draft_vocab_size is None:
            self.draft_vocab_size = (self.vocab_size if self.variant == "eagle1"
                                     else min(self.vocab_size, DEFAULT_DRAFT_VOCAB))
        _require_int("draft_vocab_size", self.draft_vocab_size)
        if self.draft_vocab_size > self.vocab_size:
            raise SpectrainError(f"EAGLE draft_vocab_size {self.draft_vocab_size} exceeds the verifier's vocabulary "
                                 f"of {self.vocab_size}")
        if self.variant == "eagle1" and self.draft_vocab_size != self.vocab_size:
            raise SpectrainError("eagle1 predicts through the verifier's lm_head: its draft_vocab_size must equal "
                                 f"vocab_size ({self.vocab_size}), got {self.draft_vocab_size}")

    def _init_aux_layers(self) -> None:
        if self.variant == "eagle1":
            if self.aux_layer_ids:
                raise SpectrainError(f"eagle1 reads only the verifier's last hidden state; aux_layer_ids "
                                     f"{self.aux_layer_ids} are for eagle3")
            self.aux_layer_ids = []
            return
        if self.aux_layer_ids is None:
            self.aux_layer_ids = default_aux_layers(self.num_hidden_layers)
        ids = list(self.aux_layer_ids)
        if not ids:
            raise SpectrainError("eagle3 needs at least one aux layer id")
        bad = [i for i in ids if not isinstance(i, int) or isinstance(i, bool) or not 1 <= i <= self.num_hidden_layers]
        if bad:
            raise SpectrainError(f"EAGLE aux_layer_ids {ids}: {bad} outside [1, {self.num_hidden_layers}] (HF "
                                 "hidden_states indices; 0 is the embeddings)")
        self.aux_layer_ids = check_aux_layer_order(ids)

    @property
    def fused_width(self) -> int:
        """Width of ``fc``'s input: 2h (embedding + feature) for eagle1, len(aux) * h for eagle3."""
        if self.variant == "eagle1":
            return 2 * self.hidden_size
        return len(self.aux_layer_ids) * self.hidden_size

    @classmethod
    def for_verifier(cls, verifier_model, variant: str = "eagle3", draft_vocab_size: int | None = None,
                     aux_layer_ids: list[int] | None = None, verifier_name: str = "",
                     **norm_flags: bool) -> "EagleConfig":
        """A config whose decoder layer is shaped like one of ``verifier_model``'s (HF causal LM);
        ``norm_flags``: any of :data:`NORM_FLAGS` (eagle3 variants)."""
        unknown = sorted(set(norm_flags) - set(NORM_FLAGS))
        if unknown:
            raise SpectrainError(f"unknown EAGLE options {unknown}; the variant flags are {list(NORM_FLAGS)}")
        vc = verifier_model.config
        vocab, hidden = verifier_model.get_output_embeddings().weight.shape
        theta, rope = verifier_rope(vc)
        return cls(
            variant=variant, hidden_size=hidden, vocab_size=vocab, draft_vocab_size=draft_vocab_size,
            aux_layer_ids=list(aux_layer_ids) if aux_layer_ids is not None else None,
            num_hidden_layers=vc.num_hidden_layers, **drafter_shape(vc), rope_theta=theta, rope_scaling=rope,
            max_position_embeddings=max_context(vc), verifier=verifier_name, **norm_flags,
        )


# -- the decoder layer --------------------------------------------------------------------------------------
class EagleAttention(Attention):
    """:class:`~spectrain.heads.layers.Attention` shaped by an :class:`EagleConfig`, plus EAGLE's TTT steps."""

    recompute_ttt = True  # TTT steps >= 1 recompute their scores in backward instead of keeping them

    def __init__(self, in_width: int, config: EagleConfig):
        super().__init__(in_width, config.hidden_size, config.num_heads, config.num_kv_heads, config.head_dim)

    def forward_ttt(self, x, cos, sin, ttt_cache: list[tuple[torch.Tensor, torch.Tensor]]):
        """A training-time-test step >= 1 without attending over every earlier step's whole sequence.

        Query t sees the step-0 keys at positions <= t and, from each later step (this one included), only the
        key at its own position t (:func:`ttt_mask`). Rather than one attention over all steps' keys with that
        mostly-False mask, the step-0 part is a (T, T) causal score block and each later step one score per
        position (an elementwise dot), softmaxed together: work and memory stay those of one causal attention
        whatever the step. ``ttt_cache``: [(k, v) of step 0, of step 1, ...], each (B, kv_heads, T, d), rotated.
        Returns (out (B, T, h), k, v) like :meth:`forward`.
        """
        q, k, v = self.qkv(x, cos, sin)
        (k0, v0), later = ttt_cache[0], ttt_cache[1:] + [(k, v)]
        own_keys = torch.stack([kj for kj, _ in later], -2)  # (B, kv, T, steps, d)
        own_values = torch.stack([vj for _, vj in later], -2)
        if self.recompute_ttt and torch.is_grad_enabled():
            # The (T, T) scores, their masked copy and fp32 probabilities of every step would otherwise be kept
            # for backward (~6 * heads * T^2 bytes per sequence and step); recomputing them costs one more
            # score pass (docs/benchmarks.md: EAGLE TTT attention).
            out = checkpoint(ttt_attention, q, k0, v0, own_keys, own_values, use_reentrant=False)
        else:
            out = ttt_attention(q, k0, v0, own_keys, own_values)
        B, T = x.shape[0], x.shape[1]
        return self.o_proj(out.transpose(1, 2).reshape(B, T, -1)), k, v


def ttt_attention(q: torch.Tensor, k0: torch.Tensor, v0: torch.Tensor, own_keys: torch.Tensor,
                  own_values: torch.Tensor) -> torch.Tensor:
    """Attention of a TTT step >= 1 (:meth:`EagleAttention.forward_ttt`): query t over the step-0 keys at
    positions <= t and each later step's key at position t, softmaxed together.

    Args:
        q: (B, heads, T, d) queries; k0, v0: (B, kv_heads, T, d) step 0's keys and values;
        own_keys, own_values: (B, kv_heads, T, steps, d) each later step's key / value at every position.
    Returns:
        (B, heads, T, d).
    """
    B, heads, T, d = q.shape
    kv = k0.shape[1]
    qg = q.view(B, kv, heads // kv, T, d)  # query head j reads kv head j // groups (SDPA's GQA layout)
    scale = d ** -0.5
    causal = torch.matmul(qg, k0[:, :, None].transpose(-1, -2)) * scale  # (B, kv, g, T, T)
    causal = causal.masked_fill(~causal_mask(T, T, q.device), float("-inf"))
    own = torch.matmul(own_keys[:, :, None], qg[..., None]).squeeze(-1) * scale  # (B, kv, g, T, steps)
    probs = torch.cat((causal, own), -1).softmax(-1, dtype=torch.float32).to(q.dtype)
    out = torch.matmul(probs[..., :T], v0[:, :, None]) + (probs[..., T:, None] * own_values[:, :, None]).sum(-2)
    return out.reshape(B, heads, T, d)


class EagleDecoderLayer(nn.Module):
    """A Llama decoder layer, with EAGLE's input changes (submodule names follow HF Llama's).

    eagle1: ``x`` is (B, T, h); no input norm (Identity), the residual is ``x``.
    eagle3: ``x`` is (B, T, 2h) = ``cat(embed, hidden)``; attention reads
    ``cat(input_layernorm(embed), hidden_norm(hidden))`` (q/k/v take 2h inputs); the residual is ``hidden``
    (``norm_before_residual``: ``hidden_norm(hidden)``, speculators' and vLLM's variant).
    Then, in both, ``x + mlp(post_attention_layernorm(x))``.
    """

    def __init__(self, config: EagleConfig):
        super().__init__()
        h, eps = config.hidden_size, config.rms_norm_eps
        self.hidden_size = h
        self.fused_input = config.variant == "eagle3"
        self.norm_before_residual = config.norm_before_residual
        if self.fused_input:
            self.input_layernorm = RMSNorm(h, eps)
            self.hidden_norm = RMSNorm(h, eps)
        else:
            self.input_layernorm = nn.Identity()  # EAGLE drops it: fc's output is already the residual stream
        self.self_attn = EagleAttention(2 * h if self.fused_input else h, config)
        self.post_attention_layernorm = RMSNorm(h, eps)
        self.mlp = SwiGLU(h, config.intermediate_size)

    def forward(self, x, cos, sin, mask, past_k=None, past_v=None, ttt_cache=None):
        """See the class docstring for ``x``; cos/sin (B, 1, T, d); mask (B|1, 1, T, S) bool.
        ``ttt_cache``: a training-time-test step >= 1 (:meth:`EagleAttention.forward_ttt`; mask and past unused).

        Returns (out (B, T, h), k, v) with k, v this call's (B, kv_heads, T, d).
        """
        if self.fused_input:
            embed, residual = x.split(self.hidden_size, dim=-1)
            normed = self.hidden_norm(residual)
            if self.norm_before_residual:
                residual = normed
            attn_in = torch.cat((self.input_layernorm(embed), normed), dim=-1)
        else:
            residual = attn_in = self.input_layernorm(x)
        if ttt_cache is not None:
            attn_out, k, v = self.self_attn.forward_ttt(attn_in, cos, sin, ttt_cache)
        else:
            attn_out, k, v = self.self_attn(attn_in, cos, sin, mask, past_k, past_v)
        x = residual + attn_out
        return x + self.mlp(self.post_attention_layernorm(x)), k, v


# -- TTT masks ----------------------------------------------------------------------------------------------------
def ttt_mask(T: int, step: int, device=None) -> torch.Tensor:
    """(T, T * (step + 1)) bool mask of training-time-test step ``step`` over keys ordered step-major.

    Query t sees the step-0 keys at positions <= t (causal) and, for each step 1..step, only that
    step's key at its own position t: later steps continue t's own draft chain, not other positions'.
    """
    blocks = [causal_mask(T, T, device)] + [torch.eye(T, dtype=torch.bool, device=device)] * step
    return torch.cat(blocks, dim=1)


def _embed(embed_tokens: EmbedLike, input_ids: torch.Tensor) -> torch.Tensor:
    """The verifier's embedding of (B, T) ids -> (B, T, h); a module/callable or its (V, h) weight."""
    if isinstance(embed_tokens, torch.Tensor):
        return F.embedding(input_ids, embed_tokens)
    return embed_tokens(input_ids)


def _shift_left(input_ids: torch.Tensor, shift: int, pad_id: int) -> torch.Tensor:
    """(B, T) -> (B, T): position t holds ``input_ids[:, t + shift]``; the last ``shift`` are ``pad_id``."""
    if shift == 0:
        return input_ids
    out = torch.full_like(input_ids, pad_id)
    out[:, :-shift] = input_ids[:, shift:]
    return out


# -- the drafter --------------------------------------------------------------------------------------------
class EagleDrafter(nn.Module):
    """An EAGLE-1 or EAGLE-3 drafter: ``fc`` + one :class:`EagleDecoderLayer` (+ eagle3's norm and lm_head).

    State dict: ``fc``, ``layer.*`` and, for eagle3, ``norm``, ``lm_head`` (D, h), ``d2t`` (D,) int64 and
    ``t2d`` (V,) bool (and ``input_norm`` (len(aux) * h,) with ``norm_before_fc``). The verifier's embeddings
    and lm_head are arguments, never attributes.
    """

    def __init__(self, config: EagleConfig):
        super().__init__()
        self.config = config
        h = config.hidden_size
        if config.norm_before_fc:  # speculators' name: one RMSNorm over all the concatenated aux states
            self.input_norm = RMSNorm(config.fused_width, config.rms_norm_eps)
        self.fc = nn.Linear(config.fused_width, h, bias=False)
        self.layer = EagleDecoderLayer(config)
        if config.variant == "eagle3":
            self.norm = RMSNorm(h, config.rms_norm_eps)
            self.lm_head = nn.Linear(h, config.draft_vocab_size, bias=False)
            # Identity map over the first D ids until set_vocab_map() installs the frequency-based one.
            self.register_buffer("d2t", torch.zeros(config.draft_vocab_size, dtype=torch.int64))
            self.register_buffer("t2d", torch.arange(config.vocab_size) < config.draft_vocab_size)

    @property
    def is_eagle3(self) -> bool:
        return self.config.variant == "eagle3"

    @classmethod
    def for_verifier(cls, verifier_model, variant: str = "eagle3", draft_vocab_size: int | None = None,
                     aux_layer_ids: list[int] | None = None, token_counts: torch.Tensor | None = None,
                     verifier_name: str = "", **norm_flags: bool) -> "EagleDrafter":
        """A float32 drafter shaped for ``verifier_model``; eagle3's vocabulary map from ``token_counts`` (V,);
        ``norm_flags``: eagle3 variant flags (:data:`NORM_FLAGS`)."""
        config = EagleConfig.for_verifier(verifier_model, variant, draft_vocab_size, aux_layer_ids, verifier_name,
                                          **norm_flags)
        drafter = cls(config).to(dtype=torch.float32)
        if token_counts is not None:
            drafter.set_vocab_map(*build_vocab_map(token_counts, config.draft_vocab_size))
        return drafter

    # -- draft vocabulary (eagle3) ------------------------------------------------------------------------
    def _require_eagle3(self, what: str) -> None:
        if not self.is_eagle3:
            raise SpectrainError(f"{what} is for eagle3 drafters; eagle1 predicts over the verifier's vocabulary")

    @torch.no_grad()
    def set_vocab_map(self, d2t: torch.Tensor, t2d: torch.Tensor) -> None:
        """Install a map from :func:`build_vocab_map` (validated)."""
        self._require_eagle3("a draft vocabulary map")
        check_vocab_map(d2t, t2d, self.config.vocab_size, self.config.draft_vocab_size)
        self.d2t.copy_(d2t)
        self.t2d.copy_(t2d)

    def draft_to_target(self, ids: torch.Tensor) -> torch.Tensor:
        """Draft ids (any shape) -> the verifier's token ids."""
        self._require_eagle3("draft_to_target")
        return ids + self.d2t[ids]

    def target_to_draft(self, ids: torch.Tensor, ignore_index: int = -100) -> torch.Tensor:
        """Verifier ids (any shape) -> draft ids; ``ignore_index`` where the token is not in the draft vocabulary.

        Draft ids are sorted by target id, so a target's draft id is the count of marked ids before it.
        """
        self._require_eagle3("target_to_draft")
        draft_index = torch.cumsum(self.t2d.to(torch.int64), 0) - 1
        return torch.where(self.t2d[ids], draft_index[ids], torch.full_like(ids, ignore_index))

    @torch.no_grad()
    def init_lm_head_from(self, verifier_lm_head: nn.Linear) -> None:
        """Start eagle3's ``lm_head`` from the verifier's rows of the draft tokens (optional warm start)."""
        self._require_eagle3("init_lm_head_from")
        rows = self.draft_to_target(torch.arange(self.config.draft_vocab_size, device=self.d2t.device))
        self.lm_head.weight.copy_(verifier_lm_head.weight[rows.to(verifier_lm_head.weight.device)])

    @torch.no_grad()
    def warm_start(self, verifier_model, layer: str = "random", norm: str = "default") -> None:
        """Start from the verifier instead of a random init (no reference trainer does; measured in the docs).

        ``layer``: ``random`` (the default init), ``verifier`` (the decoder layer starts as the verifier's last
        decoder layer; eagle3's q/k/v copy it on their fused-hidden half and keep a random embedding half, and
        ``hidden_norm`` takes the verifier layer's input norm) or ``identity`` (``o_proj`` and ``down_proj`` zero:
        the layer starts as the identity on its residual stream). ``norm``: ``verifier`` starts eagle3's final
        norm from the verifier's final norm.
        """
        if layer not in ("random", "verifier", "identity") or norm not in ("default", "verifier"):
            raise SpectrainError(f"warm start: layer must be random, verifier or identity and norm default or "
                                 f"verifier, got {layer!r}, {norm!r}")
        body = getattr(verifier_model, "model", None)
        if layer == "identity":
            self.layer.self_attn.o_proj.weight.zero_()
            self.layer.mlp.down_proj.weight.zero_()
        elif layer == "verifier":
            source = getattr(body, "layers", [None])[-1]
            names = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
                     "mlp.up_proj", "mlp.down_proj", "post_attention_layernorm", "input_layernorm")
            params = dict(source.named_parameters()) if source is not None else {}
            missing = [n for n in names if f"{n}.weight" not in params]
            if missing:
                raise SpectrainError(f"warm start from the verifier's last layer: it has no {missing} (a Llama-style "
                                     "decoder layer is needed)")
            extra = sorted(n for n in params if not n.endswith(".weight") or n.rsplit(".", 1)[0] not in names)
            if extra:  # e.g. Qwen2's q/k/v biases or Qwen3's q/k norms: the copy would not be that layer
                raise SpectrainError(f"warm start from the verifier's last layer: it has parameters the drafter's "
                                     f"layer lacks ({extra[:4]}); use --model.layer_init random or identity")
            h = self.config.hidden_size
            for name in names[:-1]:
                ours, theirs = self.layer.get_parameter(f"{name}.weight"), params[f"{name}.weight"]
                if name in names[:3] and self.layer.fused_input:
                    ours = ours[:, h:]  # the fused-hidden half; the embedding half keeps its random init
                if ours.shape != theirs.shape:
                    raise SpectrainError(f"warm start: the verifier's {name} is {tuple(theirs.shape)}, the drafter's "
                                         f"{tuple(ours.shape)}")
                ours.copy_(theirs.to(ours.dtype))
            if self.layer.fused_input:
                self.layer.hidden_norm.weight.copy_(params["input_layernorm.weight"].to(torch.float32))
        if norm == "verifier":
            self._require_eagle3("a final norm from the verifier")
            final = getattr(body, "norm", None)
            if final is None or getattr(final, "weight", None) is None:
                raise SpectrainError("warm start: the verifier has no final norm at model.norm")
            self.norm.weight.copy_(final.weight.to(self.norm.weight.dtype))

    # -- forward --------------------------------------------------------------------------------------------
    def fuse(self, aux: torch.Tensor) -> torch.Tensor:
        """eagle3: (B, T, len(aux_layer_ids) * h) concatenated verifier states -> (B, T, h)."""
        self._require_eagle3("fuse")
        if aux.shape[-1] != self.config.fused_width:
            raise SpectrainError(f"eagle3 expects the {len(self.config.aux_layer_ids)} aux hidden states "
                                 f"{self.config.aux_layer_ids} concatenated ({self.config.fused_width} wide), "
                                 f"got width {aux.shape[-1]}")
        aux = aux.to(self.fc.weight.dtype)
        if self.config.norm_before_fc:
            aux = self.input_norm(aux)
        return self.fc(aux)

    def forward(self, input_ids, features, embed_tokens: EmbedLike, position_ids=None, attn_mask=None,
                past_kv=None):
        """One drafter pass.

        Args:
            input_ids: (B, T) ids; ``input_ids[:, t]`` is the token after the position of ``features[:, t]``.
            features: eagle1: (B, T, h) verifier last hidden states; eagle3: (B, T, len(aux) * h) the raw
                concatenated aux states (``fc`` is applied here).
            embed_tokens: the verifier's frozen ``embed_tokens`` (module, callable or (V, h) weight).
            position_ids: (B, T) rotary positions; default ``past + arange(T)``.
            attn_mask: (B|1, 1, T, past + T) bool, True = may attend; default causal.
            past_kv: (k, v) cached keys/values, each (B, kv_heads, past, head_dim), or None.
        Returns:
            hidden (B, T, h) (eagle3: before the final norm) and this call's (k, v), each
            (B, kv_heads, T, head_dim), to append to a cache.
        """
        hidden = self.fuse(features) if self.is_eagle3 else features
        return self.forward_hidden(input_ids, hidden, embed_tokens, position_ids, attn_mask, past_kv, fed_back=False)

    def forward_hidden(self, input_ids, hidden, embed_tokens: EmbedLike, position_ids=None, attn_mask=None,
                       past_kv=None, ttt_cache=None, fed_back: bool = True):
        """:meth:`forward` with an h-wide hidden input: eagle1's features, or eagle3's fused state.

        eagle3 draft steps after the first feed the drafter's own previous output here (not fused aux): with
        ``norm_output`` its final norm is applied to that output first (speculators feed the normed state back;
        the returned output stays pre-norm, so :meth:`logits` is the same whichever variant). ``fed_back=False``:
        ``hidden`` is the fused state (:meth:`fuse`), taken as it is. Shapes as in :meth:`forward`, with
        ``hidden`` (B, T, h).
        """
        B, T = input_ids.shape
        if hidden.shape != (B, T, self.config.hidden_size):
            raise SpectrainError(f"expected hidden input of shape {(B, T, self.config.hidden_size)}, "
                                 f"got {tuple(hidden.shape)}")
        past_k, past_v = past_kv if past_kv is not None else (None, None)
        past = 0 if past_k is None else past_k.shape[2]
        device = input_ids.device
        if position_ids is None:
            position_ids = (past + torch.arange(T, device=device)).expand(B, T)
        if attn_mask is None and past:
            attn_mask = causal_mask(T, past + T, device)[None, None]
        if attn_mask is not None and (attn_mask.dtype != torch.bool or attn_mask.shape[-2:] != (T, past + T)):
            raise SpectrainError(f"attn_mask must be bool (B, 1, {T}, {past + T}), got {attn_mask.dtype} "
                                 f"{tuple(attn_mask.shape)}")
        dtype = self.fc.weight.dtype
        embeds = _embed(embed_tokens, input_ids).to(dtype)
        hidden = hidden.to(dtype)
        if fed_back and self.config.norm_output:
            hidden = self.norm(hidden)
        x = torch.cat((embeds, hidden), -1) if self.is_eagle3 else self.fc(torch.cat((embeds, hidden), -1))
        cos, sin = rotary_cos_sin(position_ids, self.config.head_dim, self.config.rope_theta, dtype)
        out, k, v = self.layer(x, cos, sin, attn_mask, past_k, past_v, ttt_cache=ttt_cache)
        return out, (k, v)

    def logits(self, hidden: torch.Tensor, verifier_lm_head: nn.Module | None = None) -> torch.Tensor:
        """(..., h) drafter output -> eagle3: (..., draft_vocab) via norm + own lm_head;
        eagle1: (..., V) via the verifier's ``lm_head`` (required)."""
        if self.is_eagle3:
            return self.lm_head(self.norm(hidden))
        if verifier_lm_head is None:
            raise SpectrainError("eagle1 drafters predict through the verifier's lm_head: pass it as verifier_lm_head")
        return verifier_lm_head(hidden.to(verifier_lm_head.weight.dtype))

    # -- EAGLE-3 training-time test -------------------------------------------------------------------------
    def ttt_hidden(self, input_ids, aux, embed_tokens: EmbedLike, steps: int = 1, pad_id: int = 0) -> list[torch.Tensor]:
        """Training-time test: ``steps`` chained draft steps over a whole (right-padded) sequence at once.

        Step 0 is the causal :meth:`forward`. At step i >= 1, position t reads the ground-truth token
        ``input_ids[:, t + i]`` (``pad_id`` past the end) and, as its hidden input, its own step-(i-1)
        output; it attends to the step-0 keys at positions <= t and to the keys of steps 1..i at position t
        (:func:`ttt_mask`). Rotary position at step i is t + i: the token position the step drafts at, as
        at decode time (and as SpecForge does). With ``norm_output`` the hidden input of step i >= 1 is the
        normed step-(i-1) output (:meth:`forward_hidden`).

        Args:
            input_ids: (B, T) aligned as in :meth:`forward`; aux: (B, T, len(aux) * h).
        Returns:
            ``steps`` hidden states (B, T, h), before the final norm (apply :meth:`logits` or a chunked loss).
        """
        _require_int("steps", steps)
        B, T = input_ids.shape
        base = torch.arange(T, device=input_ids.device).expand(B, T)
        # eagle1 unrolls the same way: its step-i input is its own predicted feature (validation, drafting).
        hidden = self.fuse(aux) if self.is_eagle3 else aux
        cache, outs = [], []
        for step in range(steps):  # step 0: causal attention; later steps: forward_ttt (same result as ttt_mask)
            hidden, kv = self.forward_hidden(_shift_left(input_ids, step, pad_id), hidden, embed_tokens,
                                             position_ids=base + step, ttt_cache=cache if step else None,
                                             fed_back=step > 0)
            cache.append(kv)
            outs.append(hidden)
        return outs

    def ttt_forward(self, input_ids, aux, embed_tokens: EmbedLike, steps: int = 1, pad_id: int = 0) -> list[torch.Tensor]:
        """:meth:`ttt_hidden` projected: ``steps`` logits tensors (B, T, draft_vocab)."""
        return [self.logits(h) for h in self.ttt_hidden(input_ids, aux, embed_tokens, steps, pad_id)]

    # -- our checkpoint format: model.safetensors + config.json, drafter weights only ------------------------
    def save_pretrained(self, out_dir: str | Path) -> Path:
        """Write ``model.safetensors`` then ``config.json``, each atomically; config last marks completeness."""
        return save_drafter_dir(out_dir, self.state_dict(), asdict(self.config))

    @classmethod
    def from_pretrained(cls, path: str | Path, verifier_model=None, device: str | torch.device = "cpu") -> "EagleDrafter":
        """Load a drafter saved by :meth:`save_pretrained`; check it against ``verifier_model`` when given (an older
        checkpoint's config — unsorted aux_layer_ids, say — is refused by name, with its path)."""
        path = Path(path)
        config = read_drafter_config(path, EagleConfig, VARIANTS, "an EAGLE one")
        if verifier_model is not None:
            _check_verifier(config, verifier_model, str(path))
        drafter = cls(config)
        state = checked_state(path / "model.safetensors", drafter.state_dict())
        if config.variant == "eagle3":
            check_vocab_map(state["d2t"], state["t2d"], config.vocab_size, config.draft_vocab_size)
        drafter.load_state_dict(state)
        return drafter.to(device)


def _check_verifier(config: EagleConfig, verifier_model, where: str) -> None:
    """Raise if the drafter in ``where`` cannot run on ``verifier_model``."""
    check_compatible(config.hidden_size, config.vocab_size, verifier_model, where)
    layers = verifier_model.config.num_hidden_layers
    # eagle3 reads the verifier's intermediate layers: the same ids in a deeper or shallower model are other layers.
    if config.variant == "eagle3" and layers != config.num_hidden_layers:
        raise SpectrainError(f"drafter {where} fuses layers {config.aux_layer_ids} of a {config.num_hidden_layers}-layer "
                             f"verifier, but this verifier has {layers}: it belongs to another verifier")


register_family(DrafterFamily(
    name="eagle", methods=VARIANTS, drafter_class=EagleDrafter, config_class=EagleConfig, label="EAGLE",
    method_labels=("EAGLE-1", "EAGLE-3"), verifier_depth_key="num_hidden_layers"))  # the verifier's: aux-layer range
