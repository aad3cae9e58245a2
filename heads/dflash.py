"""Block drafters: DFlash (one drafter forward drafts a whole block) and DSpark's two heads on top of it.

DFlash (arXiv 2602.06036): a few Qwen3-style decoder layers (q/k RMSNorm) at the verifier's width, with no
embedding or ``lm_head`` of their own (the verifier's, frozen). The verifier's hidden states at a few layers are
concatenated and fused, ``ctx_t = hidden_norm(fc(cat(h^l_t)))``, and in **every** drafter layer the context
features go through that layer's own k / v projections (k-norm, RoPE at their positions) and are prepended to the
block's keys and values ("KV injection"); queries come only from the block. The block is the verifier's embedding
of ``[anchor, MASK, ..., MASK]`` (``block_size`` tokens at positions ``a .. a + B - 1``; the anchor is the last
committed token, whose own features the verifier has not computed yet); attention inside the block is
bidirectional and the block sees the context strictly before the anchor. Slot j (1 <= j < B) predicts the token
j after the anchor: one forward drafts B - 1 tokens (``sample_from_anchor``, DSpark's layout: slot j predicts the
token j + 1 after it, B drafts).

DSpark (arXiv 2607.05147) adds, behind flags: a low-rank Markov logit bias ``W2(W1[x_{j-1}])`` over the draft
vocabulary (the previous slot's token, rank ``markov_rank``; zero-initialised, so training starts as DFlash),
and a confidence head predicting each slot's acceptance given the slots before it were accepted.

``target_layer_ids`` follow DFlash's (and vLLM's speculators config's) convention: 0-based decoder layers whose
*outputs* are read, i.e. HF ``hidden_states[i + 1]`` (:meth:`DFlashConfig.capture_ids`): the shift of one that
vLLM #40727 is about, done in one place.

The family registers itself at the end of this module (``--method dflash``; methods ``dflash`` and ``dspark``).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from .compatibility import check_compatible
from .errors import SpectrainError
from .families import DrafterFamily, register_family
from .io import checked_state, read_drafter_config, save_drafter_dir
from .layers import RMSNorm, SwiGLU, apply_rotary, rotary_cos_sin
from .verifier import drafter_shape, max_context, verifier_rope

FORMAT_VERSION = 1
METHODS = ("dflash", "dspark")


def default_target_layers(verifier_layers: int, count: int) -> list[int]:
    """DFlash's choice of ``count`` verifier layers (0-based, outputs read): evenly from layer 1 to N - 3 (one
    layer: the middle one); verifiers too shallow for that get ``count`` consecutive layers ending at N - 2."""
    if verifier_layers < 2:
        return [0]
    count = max(1, min(count, verifier_layers - 1))
    if count == 1:
        return [min(verifier_layers // 2, verifier_layers - 2)]
    start, end = 1, verifier_layers - 3
    if end - start + 1 < count:
        start, end = verifier_layers - 1 - count, verifier_layers - 2
    return [int(round(start + i * (end - start) / (count - 1))) for i in range(count)]


def _require_int(name: str, value, minimum: int = 1) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise SpectrainError(f"DFlash {name} must be an integer >= {minimum}, got {value!r}")


@dataclass
class DFlashConfig:
    """Shape of a block drafter and the verifier it drafts for.

    ``num_hidden_layers`` is the drafter's own depth; ``verifier_layers`` the verifier's (to range-check
    ``target_layer_ids``, default :func:`default_target_layers` with as many layers as the drafter has).
    ``mask_token_id``: the token id filling slots 1.. of a block (its embedding is the verifier's; any id works as
    long as training and serving agree: default the tokenizer's unk / pad id, else the last id).
    ``markov_rank`` > 0 adds DSpark's Markov head, ``confidence_head`` its acceptance predictor; either makes the
    method ``dspark``.
    """

    hidden_size: int = 0
    vocab_size: int = 0
    num_hidden_layers: int = 1
    num_heads: int = 0
    num_kv_heads: int = 0
    head_dim: int = 0
    intermediate_size: int = 0
    verifier_layers: int = 0
    target_layer_ids: list[int] | None = None
    block_size: int = 8
    mask_token_id: int = 0
    markov_rank: int = 0
    confidence_head: bool = False
    sample_from_anchor: bool = False
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    max_position_embeddings: int = 2048
    verifier: str = ""
    method: str = ""
    format_version: int = FORMAT_VERSION

    def __post_init__(self):
        for key in ("hidden_size", "vocab_size", "num_hidden_layers", "num_heads", "num_kv_heads", "head_dim",
                    "intermediate_size", "verifier_layers", "max_position_embeddings"):
            _require_int(key, getattr(self, key))
        _require_int("block_size", self.block_size, 2)
        _require_int("markov_rank", self.markov_rank, 0)
        _require_int("mask_token_id", self.mask_token_id, 0)
        if self.mask_token_id >= self.vocab_size:
            raise SpectrainError(f"DFlash mask_token_id {self.mask_token_id} is outside the vocabulary of "
                                 f"{self.vocab_size}")
        if self.head_dim % 2 or self.num_heads % self.num_kv_heads:
            raise SpectrainError(f"DFlash needs an even head_dim and num_heads a multiple of num_kv_heads, got "
                                 f"{self.head_dim}, {self.num_heads}, {self.num_kv_heads}")
        for flag in ("confidence_head", "sample_from_anchor"):
            if not isinstance(getattr(self, flag), bool):
                raise SpectrainError(f"DFlash {flag} must be true or false, got {getattr(self, flag)!r}")
        if self.target_layer_ids is None:
            self.target_layer_ids = default_target_layers(self.verifier_layers, self.num_hidden_layers)
        ids = list(self.target_layer_ids)
        bad = [i for i in ids if not isinstance(i, int) or isinstance(i, bool) or not 0 <= i < self.verifier_layers]
        if not ids or bad or ids != sorted(set(ids)):
            raise SpectrainError(f"DFlash target_layer_ids {ids} must be ascending, distinct decoder layers in "
                                 f"[0, {self.verifier_layers - 1}] (0-based; the layer's output is read)")
        self.target_layer_ids = ids
        method = "dspark" if (self.markov_rank or self.confidence_head) else "dflash"
        if self.method and self.method != method:
            raise SpectrainError(f"DFlash config says method {self.method!r} but its heads make it {method!r} "
                                 "(dspark = a Markov head or a confidence head)")
        self.method = method

    @property
    def drafts(self) -> int:
        """Tokens one block drafts: B - 1 (slot j predicts the token j after the anchor), or B with
        ``sample_from_anchor`` (DSpark's layout: slot j predicts the token j + 1 after it, the anchor's slot too)."""
        return self.block_size - 1 + int(self.sample_from_anchor)

    @property
    def first_draft_slot(self) -> int:
        """The block slot holding the first draft: 1, or 0 with ``sample_from_anchor``."""
        return 0 if self.sample_from_anchor else 1

    @property
    def capture_ids(self) -> tuple[int, ...]:
        """The HF ``hidden_states`` indices of ``target_layer_ids`` (layer i's output is ``hidden_states[i + 1]``)."""
        return tuple(i + 1 for i in self.target_layer_ids)

    @classmethod
    def for_verifier(cls, verifier_model, num_layers: int = 1, block_size: int = 8,
                     target_layer_ids: list[int] | None = None, mask_token_id: int | None = None,
                     markov_rank: int = 0, confidence_head: bool = False, sample_from_anchor: bool = False,
                     verifier_name: str = "", tokenizer=None) -> "DFlashConfig":
        """A config whose layers are shaped like ``verifier_model``'s (an HF causal LM)."""
        vc = verifier_model.config
        vocab, hidden = verifier_model.get_output_embeddings().weight.shape
        theta, _ = verifier_rope(vc)
        if mask_token_id is None:
            mask_token_id = default_mask_token(tokenizer, vocab)
        return cls(hidden_size=hidden, vocab_size=vocab, num_hidden_layers=num_layers, **drafter_shape(vc),
                   verifier_layers=vc.num_hidden_layers,
                   target_layer_ids=list(target_layer_ids) if target_layer_ids is not None else None,
                   block_size=block_size, mask_token_id=mask_token_id, markov_rank=markov_rank,
                   confidence_head=confidence_head, sample_from_anchor=sample_from_anchor, rope_theta=theta,
                   max_position_embeddings=max_context(vc), verifier=verifier_name)


def default_mask_token(tokenizer, vocab_size: int) -> int:
    """The id filling a block's draft slots: the tokenizer's unk, then pad token (ids a reply rarely needs; a
    chat model's pad is often its end-of-turn token, so unk comes first), else the last id of the vocabulary."""
    for name in ("unk_token_id", "pad_token_id"):
        value = getattr(tokenizer, name, None) if tokenizer is not None else None
        if isinstance(value, int) and 0 <= value < vocab_size:
            return value
    return vocab_size - 1


def attend(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """(B, heads, Q, d) queries over (B, kv_heads, S, d) keys / values through a (B|1, 1, Q, S) bool mask (None:
    every key visible) -> (B, heads, Q, d)."""
    return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, enable_gqa=q.shape[1] != keys.shape[1])


class DFlashAttention(nn.Module):
    """Qwen3-style attention (q / k RMSNorm per head, no biases, GQA) whose keys and values are the context
    features' (projected by this layer) followed by the block's own."""

    def __init__(self, config: DFlashConfig):
        super().__init__()
        h, d = config.hidden_size, config.head_dim
        self.head_dim = d
        self.q_proj = nn.Linear(h, config.num_heads * d, bias=False)
        self.k_proj = nn.Linear(h, config.num_kv_heads * d, bias=False)
        self.v_proj = nn.Linear(h, config.num_kv_heads * d, bias=False)
        self.o_proj = nn.Linear(config.num_heads * d, h, bias=False)
        self.q_norm = RMSNorm(d, config.rms_norm_eps)
        self.k_norm = RMSNorm(d, config.rms_norm_eps)

    def _heads(self, proj: nn.Linear, x: torch.Tensor) -> torch.Tensor:
        """(B, T, h) -> (B, T, heads, d)."""
        return proj(x).view(x.shape[0], x.shape[1], -1, self.head_dim)

    def key_values(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(B, T, h) -> k (rotated by (B, 1, T, d) tables) and v, each (B, kv_heads, T, d): what a context
        position or a block slot contributes to this layer's keys and values."""
        k = apply_rotary(self.k_norm(self._heads(self.k_proj, x)).transpose(1, 2), cos, sin)
        return k, self._heads(self.v_proj, x).transpose(1, 2)

    def forward(self, x, cos, sin, context_k, context_v, mask):
        """x (B, Q, h) the block rows; context_k / context_v (B, kv_heads, C, d) this layer's context keys and values
        (rotated); mask (B|1, 1, Q, C + Q) bool or None (all visible). Returns (B, Q, h)."""
        q = apply_rotary(self.q_norm(self._heads(self.q_proj, x)).transpose(1, 2), cos, sin)
        k, v = self.key_values(x, cos, sin)
        out = attend(q, torch.cat([context_k, k], 2), torch.cat([context_v, v], 2), mask)
        return self.o_proj(out.transpose(1, 2).reshape(x.shape[0], x.shape[1], -1))


class DFlashLayer(nn.Module):
    """A pre-norm decoder layer (HF Qwen3 names) whose attention also reads the injected context K/V. The context
    features enter this layer's k / v projections as they are (fused and normed once, by ``hidden_norm``)."""

    def __init__(self, config: DFlashConfig):
        super().__init__()
        h, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = RMSNorm(h, eps)
        self.self_attn = DFlashAttention(config)
        self.post_attention_layernorm = RMSNorm(h, eps)
        self.mlp = SwiGLU(h, config.intermediate_size)

    def forward(self, x, cos, sin, context_k, context_v, mask):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, context_k, context_v, mask)
        return x + self.mlp(self.post_attention_layernorm(x))


class MarkovHead(nn.Module):
    """DSpark's low-rank Markov logit bias: ``markov_w2(markov_w1[x_prev])``, (V, r) and (r -> V); ``markov_w2``
    starts at zero, so a drafter starts as plain DFlash."""

    def __init__(self, vocab_size: int, rank: int):
        super().__init__()
        self.markov_w1 = nn.Embedding(vocab_size, rank)
        self.markov_w2 = nn.Linear(rank, vocab_size, bias=False)
        nn.init.normal_(self.markov_w1.weight, std=0.02)
        nn.init.zeros_(self.markov_w2.weight)


class ConfidenceHead(nn.Module):
    """DSpark's acceptance predictor: one linear map to a logit."""

    def __init__(self, width: int):
        super().__init__()
        self.proj = nn.Linear(width, 1)


class DFlashDrafter(nn.Module):
    """``fc`` + ``hidden_norm`` over the fused target layers, ``num_hidden_layers`` :class:`DFlashLayer`, a final
    ``norm``; optionally DSpark's ``markov_head`` (:class:`MarkovHead`) and ``confidence_head``
    (:class:`ConfidenceHead`, (h + r) -> 1).

    The vocabulary projection is the verifier's ``lm_head`` (passed in, frozen), over all rows or a ranked subset.
    """

    def __init__(self, config: DFlashConfig):
        super().__init__()
        self.config = config
        h = config.hidden_size
        self.fc = nn.Linear(len(config.target_layer_ids) * h, h, bias=False)
        self.hidden_norm = RMSNorm(h, config.rms_norm_eps)
        self.layers = nn.ModuleList(DFlashLayer(config) for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(h, config.rms_norm_eps)
        if config.markov_rank:  # module names as speculators' DSpark checkpoints have them
            self.markov_head = MarkovHead(config.vocab_size, config.markov_rank)
        if config.confidence_head:  # reads the slot's state and, with a Markov head, the previous token's W1 row
            self.confidence_head = ConfidenceHead(h + config.markov_rank)

    @torch.no_grad()
    def init_norm_from(self, verifier_model) -> None:
        """Start the final ``norm`` from the verifier's final norm (an HF causal LM's ``model.norm``)."""
        norm = getattr(getattr(verifier_model, "model", None), "norm", None)
        weight = getattr(norm, "weight", None)
        if weight is None or weight.shape != self.norm.weight.shape:
            raise SpectrainError("the verifier has no final norm of the drafter's width to start from")
        self.norm.weight.copy_(weight.to(self.norm.weight.dtype))

    # -- pieces --------------------------------------------------------------------------------------------------
    def rope(self, positions: torch.Tensor, dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """(B, T) positions -> cos, sin (B, 1, T, d)."""
        return rotary_cos_sin(positions, self.config.head_dim, self.config.rope_theta, dtype)

    def context(self, target_hidden: torch.Tensor) -> torch.Tensor:
        """(B, T, len(target_layer_ids) * h) concatenated verifier layers -> (B, T, h) context features."""
        return self.hidden_norm(self.fc(target_hidden.to(self.fc.weight.dtype)))

    def context_kv(self, context: torch.Tensor, positions: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Every layer's keys and values of (B, T, h) context features at (B, T) positions: [(k, v)] per layer,
        each (B, kv_heads, T, d), k rotated."""
        cos, sin = self.rope(positions, context.dtype)
        return [layer.self_attn.key_values(context, cos, sin) for layer in self.layers]

    def block_hidden(self, block_embeds: torch.Tensor, positions: torch.Tensor,
                     context_kv: list[tuple[torch.Tensor, torch.Tensor]], mask: torch.Tensor | None) -> torch.Tensor:
        """The block rows through the layers: block_embeds (B, Q, h) (the verifier's embeddings of anchors and
        mask tokens), positions (B, Q), ``context_kv`` from :meth:`context_kv` (C positions), mask
        (B|1, 1, Q, C + Q) or None. Returns (B, Q, h) after the final norm."""
        x = block_embeds.to(self.fc.weight.dtype)
        cos, sin = self.rope(positions, x.dtype)
        for layer, (k, v) in zip(self.layers, context_kv):
            x = layer(x, cos, sin, k, v, mask)
        return self.norm(x)

    def logits(self, hidden: torch.Tensor, lm_head: nn.Module) -> torch.Tensor:
        """(..., h) -> (..., V) through the verifier's ``lm_head``."""
        return lm_head(hidden.to(lm_head.weight.dtype))

    def markov_bias(self, prev_ids: torch.Tensor, rows: torch.Tensor | None = None) -> torch.Tensor:
        """DSpark's Markov logit bias for (...,) previous-slot tokens -> (..., V) (or (..., N) over ``rows``)."""
        weight = self.markov_head.markov_w2.weight
        return F.linear(self.markov_head.markov_w1(prev_ids), weight if rows is None else weight[rows])

    def confidence(self, hidden: torch.Tensor, prev_ids: torch.Tensor) -> torch.Tensor:
        """(..., h) slot states, (...,) previous tokens -> (...,) logits of each slot's predicted acceptance."""
        x = hidden if not self.config.markov_rank else torch.cat(
            [hidden, self.markov_head.markov_w1(prev_ids).to(hidden.dtype)], -1)
        return self.confidence_head.proj(x.to(self.confidence_head.proj.weight.dtype)).squeeze(-1)

    # -- our checkpoint format ----------------------------------------------------------------------------------
    def save_pretrained(self, out_dir: str | Path) -> Path:
        """Write ``model.safetensors`` then ``config.json`` (config last marks completeness), each atomically."""
        return save_drafter_dir(out_dir, self.state_dict(), asdict(self.config))

    @classmethod
    def from_pretrained(cls, path: str | Path, verifier_model=None, device: str | torch.device = "cpu") -> "DFlashDrafter":
        path = Path(path)
        config = read_drafter_config(path, DFlashConfig, METHODS, "a DFlash one")
        if verifier_model is not None:
            check_verifier(config, verifier_model, str(path))
        drafter = cls(config)
        drafter.load_state_dict(checked_state(path / "model.safetensors", drafter.state_dict()))
        return drafter.to(device)


def check_verifier(config: DFlashConfig, verifier_model, where: str) -> None:
    """Raise if the block drafter in ``where`` cannot run on ``verifier_model`` (sizes, and the depth its target
    layer ids refer to)."""
    check_compatible(config.hidden_size, config.vocab_size, verifier_model, where)
    layers = verifier_model.config.num_hidden_layers
    if layers != config.verifier_layers:
        raise SpectrainError(f"drafter {where} reads layers {config.target_layer_ids} of a {config.verifier_layers}-"
                             f"layer verifier, but this verifier has {layers}: it belongs to another verifier")


def without_confidence_head(drafter: DFlashDrafter) -> DFlashDrafter:
    """The DFlash body of a DSpark drafter whose only DSpark part is its confidence head: the same weights less that
    head, drafting exactly the same tokens (the head predicts acceptance and never changes a draft), for engines that
    serve DFlash but not DSpark (vLLM 0.32's CPU runner). A Markov head shapes the drafts, so it is refused."""
    if not isinstance(drafter, DFlashDrafter):
        raise SpectrainError(f"only a block drafter (DFlash / DSpark) has a confidence head to drop, not a "
                             f"{type(drafter).__name__}")
    c = drafter.config
    if not c.confidence_head:
        raise SpectrainError("the drafter has no confidence head to drop")
    if c.markov_rank:
        raise SpectrainError(f"the drafter's Markov head (rank {c.markov_rank}) shapes its drafts: without it, it "
                             "would draft other tokens; export it whole (speculators-dspark)")
    if c.sample_from_anchor:
        raise SpectrainError("the drafter drafts from the anchor's slot (DSpark's layout); DFlash drafts from slot 1")
    body = DFlashDrafter(replace(c, confidence_head=False, method=""))
    body.load_state_dict({k: v for k, v in drafter.state_dict().items() if not k.startswith("confidence_head.")})
    weight = drafter.fc.weight
    body.to(weight.device, weight.dtype).train(drafter.training)
    for attr in ("ranking", "verifier_note"):  # what load_drafter attaches: the ranked head, the verifier's note
        if hasattr(drafter, attr):
            setattr(body, attr, getattr(drafter, attr))
    return body


register_family(DrafterFamily(
    name="dflash", methods=METHODS, drafter_class=DFlashDrafter, config_class=DFlashConfig, label="DFlash",
    method_labels=("DFlash", "DSpark"),
    verifier_depth_key="verifier_layers"))  # its own num_hidden_layers is the drafter's depth
