"""P-EAGLE drafters (parallel drafting, arXiv 2602.01469): one drafter forward proposes a round's K drafts.

The drafter is EAGLE-3's (:mod:`.eagle`) — ``fc`` over the verifier's fused layers, a first decoder layer reading
``cat(input_layernorm(embed), hidden_norm(g))``, a final ``norm`` and an own ``lm_head`` over a draft vocabulary
(``d2t`` / ``t2d``) — plus ``num_layers - 1`` plain Llama layers and one learned state, ``mask_hidden``
(1, 1, len(aux) * h), at ``fc``'s input width (speculators' ``PEagleDraftModel``, whose names every tensor keeps).

A round reads the positions committed since the last one, each ``(x_{t+1}, f_t)`` as in EAGLE-3, then K - 1
placeholder slots: the token ``mask_token_id`` with the hidden input ``fc(input_norm?(mask_hidden))``
(:meth:`PEagleDrafter.mask_state`) at the next K - 1 positions. One causal pass gives K logits rows: the last
committed row drafts depth 0 (EAGLE-3's first draft), placeholder j drafts depth j. A placeholder never reads a
token drafted earlier in the round, so each depth's distribution is a function of the context alone (vLLM's
``parallel_drafting`` runs exactly this pass: ``llm_base_proposer.py`` in vLLM 0.32).

Training (:mod:`spectrain.train.peagle`) runs the same attention pattern over many chains at once: every
position's depth-0 row (causal), and per sampled anchor a the placeholders of depths 1..K-1 at positions
a + 1 .. a + K - 1, each attending to the depth-0 rows at positions <= a and to its own chain's earlier
placeholders (speculators' ``create_peagle_mask_mod``), through :meth:`PEagleDrafter.chain_forward`.

Embeddings: ``embedding="verifier"`` (default) embeds with the verifier's frozen table (passed in, never saved);
``"own"`` trains a (V, h) ``embed_tokens`` of the drafter's own, started from the verifier's, as speculators and
SpecForge do. A 1-layer P-EAGLE is an EAGLE-3 plus ``mask_hidden``: :meth:`PEagleDrafter.init_from_eagle3` copies
an EAGLE-3 drafter's weights into it (the warm start ``model.init_from`` runs).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from torch import nn

from .eagle import EagleConfig, EagleDecoderLayer, EagleDrafter, EmbedLike, _check_verifier, _embed
from .dflash import default_mask_token
from .errors import SpectrainError
from .families import DrafterFamily, register_family
from .io import checked_state, read_drafter_config, save_drafter_dir
from .layers import Attention, RMSNorm, SwiGLU, rotary_cos_sin
from .vocab import build_vocab_map, check_vocab_map

METHOD = "peagle"
EMBEDDINGS = ("verifier", "own")


@dataclass
class PEagleConfig(EagleConfig):
    """An :class:`~.eagle.EagleConfig` (eagle3 variant: sizes, ``aux_layer_ids``, draft vocabulary, speculators'
    ``norm_before_residual`` / ``norm_before_fc``; ``num_hidden_layers`` is the *verifier's* depth) plus P-EAGLE's
    own fields.

    Attributes:
        num_layers: the drafter's decoder layers (layer 0 EAGLE-3's fused one, the others plain Llama layers).
        num_depths: K, the depths trained: a round drafts up to K tokens.
        mask_token_id: the token of the placeholder slots (its embedding: the verifier's, or ``embed_tokens``).
        embedding: ``verifier`` (the verifier's frozen table) or ``own`` (a trained table in the drafter).
    """

    num_layers: int = 1
    num_depths: int = 8
    mask_token_id: int = 0
    embedding: str = "verifier"

    def __post_init__(self):
        method, self.method = self.method, ""
        if self.variant != "eagle3":
            raise SpectrainError(f"P-EAGLE's first layer is EAGLE-3's; variant must be eagle3, got {self.variant!r}")
        super().__post_init__()
        if method not in ("", METHOD):
            raise SpectrainError(f"P-EAGLE config says method {method!r}")
        self.method = METHOD
        for key in ("num_layers", "num_depths"):
            value = getattr(self, key)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise SpectrainError(f"P-EAGLE {key} must be an integer >= 1, got {value!r}")
        if (not isinstance(self.mask_token_id, int) or isinstance(self.mask_token_id, bool)
                or not 0 <= self.mask_token_id < self.vocab_size):
            raise SpectrainError(f"P-EAGLE mask_token_id {self.mask_token_id!r} is outside the vocabulary of "
                                 f"{self.vocab_size}")
        if self.embedding not in EMBEDDINGS:
            raise SpectrainError(f"P-EAGLE embedding must be one of {EMBEDDINGS}, got {self.embedding!r}")
        if self.norm_output:
            raise SpectrainError("norm_output changes what EAGLE-3's later autoregressive steps read; P-EAGLE has no "
                                 "such steps (one pass drafts every depth)")

    @classmethod
    def for_verifier(cls, verifier_model, num_layers: int = 1, num_depths: int = 8,
                     draft_vocab_size: int | None = None, aux_layer_ids: list[int] | None = None,
                     mask_token_id: int | None = None, tokenizer=None, embedding: str = "verifier",
                     verifier_name: str = "", **norm_flags: bool) -> "PEagleConfig":
        """A config shaped by ``verifier_model`` (an HF causal LM), as :meth:`EagleConfig.for_verifier`. The mask
        token defaults to the tokenizer's ``mask_token_id``, else its unk / pad id, else the last id (never an
        added token: with the verifier's frozen embedding its row must exist)."""
        base = EagleConfig.for_verifier(verifier_model, "eagle3", draft_vocab_size, aux_layer_ids, verifier_name,
                                        **norm_flags)
        if mask_token_id is None:
            own = getattr(tokenizer, "mask_token_id", None) if tokenizer is not None else None
            mask_token_id = own if isinstance(own, int) and 0 <= own < base.vocab_size else default_mask_token(
                tokenizer, base.vocab_size)
        return cls(**{**asdict(base), "method": ""}, num_layers=num_layers, num_depths=num_depths,
                   mask_token_id=mask_token_id, embedding=embedding)


class PEagleLayer(nn.Module):
    """Decoder layers 1.. : a plain pre-norm Llama layer (vLLM's ``llama_eagle3.py`` layers after the first), with
    :class:`~.eagle.EagleDecoderLayer`'s signature."""

    def __init__(self, config: PEagleConfig):
        super().__init__()
        h, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = RMSNorm(h, eps)
        self.self_attn = Attention(h, h, config.num_heads, config.num_kv_heads, config.head_dim)
        self.post_attention_layernorm = RMSNorm(h, eps)
        self.mlp = SwiGLU(h, config.intermediate_size)

    def forward(self, x, cos, sin, mask, past_k=None, past_v=None):
        """x (B, T, h); returns (out (B, T, h), k, v) with this call's k, v (B, kv_heads, T, d)."""
        attn_out, k, v = self.self_attn(self.input_layernorm(x), cos, sin, mask, past_k, past_v)
        x = x + attn_out
        return x + self.mlp(self.post_attention_layernorm(x)), k, v


class PEagleDrafter(nn.Module):
    """``fc`` (+ ``input_norm``), ``layers`` (0: :class:`~.eagle.EagleDecoderLayer`, then :class:`PEagleLayer`),
    ``norm``, ``lm_head`` (D, h), ``d2t`` / ``t2d``, ``mask_hidden`` (1, 1, len(aux) * h) and, with
    ``embedding="own"``, ``embed_tokens`` (V, h): speculators' and vLLM's tensor names, so the serving layout is the
    state dict itself. The draft vocabulary and ``fuse`` / ``logits`` are EAGLE-3's (the same methods)."""

    is_eagle3 = True  # EAGLE-3's draft vocabulary, fc and head (the methods borrowed below read it)
    _require_eagle3 = EagleDrafter._require_eagle3
    set_vocab_map = EagleDrafter.set_vocab_map
    draft_to_target = EagleDrafter.draft_to_target
    target_to_draft = EagleDrafter.target_to_draft
    init_lm_head_from = EagleDrafter.init_lm_head_from
    fuse = EagleDrafter.fuse
    logits = EagleDrafter.logits

    def __init__(self, config: PEagleConfig):
        super().__init__()
        self.config = config
        h, eps = config.hidden_size, config.rms_norm_eps
        if config.norm_before_fc:
            self.input_norm = RMSNorm(config.fused_width, eps)
        self.fc = nn.Linear(config.fused_width, h, bias=False)
        self.layers = nn.ModuleList([EagleDecoderLayer(config)] +
                                    [PEagleLayer(config) for _ in range(config.num_layers - 1)])
        self.norm = RMSNorm(h, eps)
        self.lm_head = nn.Linear(h, config.draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(config.draft_vocab_size, dtype=torch.int64))
        self.register_buffer("t2d", torch.arange(config.vocab_size) < config.draft_vocab_size)
        self.mask_hidden = nn.Parameter(torch.randn(1, 1, config.fused_width))  # the references' init
        if config.embedding == "own":
            self.embed_tokens = nn.Embedding(config.vocab_size, h)

    @classmethod
    def for_verifier(cls, verifier_model, token_counts: torch.Tensor | None = None, **kwargs) -> "PEagleDrafter":
        """A float32 drafter shaped for ``verifier_model`` (``kwargs``: :meth:`PEagleConfig.for_verifier`'s); its
        vocabulary map from ``token_counts`` (V,); an own embedding starts as the verifier's."""
        drafter = cls(PEagleConfig.for_verifier(verifier_model, **kwargs)).to(dtype=torch.float32)
        if token_counts is not None:
            drafter.set_vocab_map(*build_vocab_map(token_counts, drafter.config.draft_vocab_size))
        if drafter.config.embedding == "own":
            with torch.no_grad():
                drafter.embed_tokens.weight.copy_(verifier_model.get_input_embeddings().weight.float())
        return drafter

    # -- inputs -------------------------------------------------------------------------------------------------
    def embedding(self, verifier_embed: EmbedLike) -> EmbedLike:
        """The table the drafter embeds with: its own ``embed_tokens``, or ``verifier_embed`` (the verifier's)."""
        return self.embed_tokens if self.config.embedding == "own" else verifier_embed

    def mask_state(self) -> torch.Tensor:
        """(h,) the placeholder slots' hidden input, ``fc(input_norm?(mask_hidden))`` (vLLM's
        ``combine_hidden_states(mask_hidden)``)."""
        return self.fuse(self.mask_hidden)[0, 0]

    # -- forward --------------------------------------------------------------------------------------------
    def _layer_inputs(self, input_ids, hidden, embed: EmbedLike, position_ids):
        dtype = self.fc.weight.dtype
        x = torch.cat((_embed(embed, input_ids).to(dtype), hidden.to(dtype)), -1)
        cos, sin = rotary_cos_sin(position_ids, self.config.head_dim, self.config.rope_theta, dtype)
        return x, cos, sin

    def forward_layers(self, input_ids, hidden, embed: EmbedLike, position_ids, attn_mask=None, past=None):
        """Every layer over h-wide (already fused) hidden inputs.

        Args:
            input_ids: (B, T) tokens (``mask_token_id`` at placeholders); hidden: (B, T, h) fused states
                (:meth:`fuse`; :meth:`mask_state` at placeholders); embed: the table (:meth:`embedding`).
            position_ids: (B, T) rotary positions; attn_mask: (B|1, 1, T, P + T) bool, or None (causal).
            past: None or one (k, v) per layer, each (B, kv_heads, P, d).
        Returns:
            out (B, T, h) before the final norm, and this call's (k, v) per layer.
        """
        x, cos, sin = self._layer_inputs(input_ids, hidden, embed, position_ids)
        kv = []
        for i, layer in enumerate(self.layers):
            past_k, past_v = past[i] if past is not None else (None, None)
            x, k, v = layer(x, cos, sin, attn_mask, past_k, past_v)
            kv.append((k, v))
        return x, kv

    def forward(self, input_ids, features, embed: EmbedLike, position_ids, attn_mask=None, past=None):
        """:meth:`forward_layers` over (B, T, len(aux) * h) raw concatenated verifier states."""
        return self.forward_layers(input_ids, self.fuse(features), embed, position_ids, attn_mask, past)

    def chain_forward(self, ids, hidden, chain_ids, chain_hidden, chain_positions, chain_mask, embed: EmbedLike):
        """The training pass: depth-0 rows of every position and placeholder rows of many chains, two streams.

        Args:
            ids, hidden: (B, T) tokens and (B, T, h) fused states of the depth-0 rows, at positions 0..T-1 (causal).
            chain_ids, chain_hidden, chain_positions: (B, M), (B, M, h), (B, M): the placeholder rows.
            chain_mask: (B|1, 1, M, T + M) bool over [the depth-0 rows' keys | the placeholders' keys].
        Returns:
            (B, T, h) and (B, M, h) outputs before the final norm. Per layer the depth-0 stream is a plain causal
            pass and the placeholders attend to its keys and to their own through ``chain_mask``: the flat
            sequence's mask of the references, without a (T + M)^2 one.
        """
        B, T = ids.shape
        x0, cos0, sin0 = self._layer_inputs(ids, hidden, embed, torch.arange(T, device=ids.device).expand(B, T))
        xm, cosm, sinm = self._layer_inputs(chain_ids, chain_hidden, embed, chain_positions)
        for layer in self.layers:
            x0, k0, v0 = layer(x0, cos0, sin0, None)
            xm, _, _ = layer(xm, cosm, sinm, chain_mask, k0, v0)
        return x0, xm

    # -- warm start ---------------------------------------------------------------------------------------------
    @torch.no_grad()
    def init_from_eagle3(self, source: EagleDrafter, where: str = "the EAGLE-3 drafter") -> None:
        """Copy an EAGLE-3 drafter into layer 0 and the rest (``fc``, ``input_norm``, ``norm``, ``lm_head``, the
        vocabulary map); ``mask_hidden``, layers 1.. and an own embedding keep their init. Its fused layers, draft
        vocabulary, ``norm_before_residual`` / ``norm_before_fc`` and shapes must be this drafter's
        (``norm_output`` only shapes EAGLE-3's later steps, which P-EAGLE does not run)."""
        theirs, ours = source.config, self.config
        if not getattr(source, "is_eagle3", False):
            raise SpectrainError(f"{where} is an EAGLE-1 drafter; P-EAGLE warm-starts from EAGLE-3 only")
        for key in ("aux_layer_ids", "draft_vocab_size", "norm_before_residual", "norm_before_fc", "hidden_size",
                    "vocab_size", "num_heads", "num_kv_heads", "head_dim", "intermediate_size"):
            value = getattr(theirs, key)
            if value != getattr(ours, key):
                hint = (f"pass --model.{key} {str(value).lower() if isinstance(value, bool) else value}"
                        if key in ("aux_layer_ids", "draft_vocab_size", "norm_before_residual", "norm_before_fc")
                        else "it was trained for another verifier")
                raise SpectrainError(f"{where} has {key} {value}, this P-EAGLE {getattr(ours, key)}: {hint}")
        state = {("layers.0." + k[len("layer."):] if k.startswith("layer.") else k): v
                 for k, v in source.state_dict().items()}
        mine = self.state_dict()
        self.load_state_dict({**mine, **{k: v.to(mine[k].dtype) for k, v in state.items()}})

    # -- our checkpoint format ----------------------------------------------------------------------------------
    def save_pretrained(self, out_dir: str | Path) -> Path:
        """Write ``model.safetensors`` then ``config.json`` (config last marks completeness), each atomically."""
        return save_drafter_dir(out_dir, self.state_dict(), asdict(self.config))

    @classmethod
    def from_pretrained(cls, path: str | Path, verifier_model=None,
                        device: str | torch.device = "cpu") -> "PEagleDrafter":
        path = Path(path)
        config = read_drafter_config(path, PEagleConfig, (METHOD,), "a P-EAGLE one")
        if verifier_model is not None:
            _check_verifier(config, verifier_model, str(path))
        drafter = cls(config)
        state = checked_state(path / "model.safetensors", drafter.state_dict())
        check_vocab_map(state["d2t"], state["t2d"], config.vocab_size, config.draft_vocab_size)
        drafter.load_state_dict(state)
        return drafter.to(device)


register_family(DrafterFamily(
    name=METHOD, methods=(METHOD,), drafter_class=PEagleDrafter, config_class=PEagleConfig, label="P-EAGLE",
    verifier_depth_key="num_hidden_layers"))  # the verifier's (EagleConfig's field): the aux-layer range
