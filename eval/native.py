"""Decoding over the verifier's own decoder layers: any HF causal LM whose layers take a cache and a 4-D mask.

:class:`~spectrain.eval.static_model.StaticCausalLM` hand-writes the Llama-family layer (Llama, Mistral, Qwen2,
Qwen3). Every other family — Gemma 2/3 (embedding scale, sliding layers, soft-capping), Phi-3 (fused projections),
Qwen3-MoE and GPT-OSS (experts; GPT-OSS's attention sinks), OLMo 2 (post-norms, q/k norms over all heads),
Granite (multipliers) — runs through the model's own inner forward, which applies whatever the family defines, with
three pieces of ours in the places the layers leave open:

* the cache: :class:`LayerCache` speaks HF's ``Cache`` interface (``update(key, value, layer_idx, ...)``): it writes
  the round's K/V into our preallocated buffers at the round's slots and returns the span to attend — so trees,
  rollback (``length``), compaction and static shapes work exactly as on the hand-written path;
* the mask: a 4-D tensor, which transformers passes to every layer as given (its mask builders return a 4-D mask
  unchanged). It holds, per (query, slot), the query's position minus the slot's position where the query may
  attend and :data:`FAR` where it may not (:func:`distance_mask`): one tensor serves full and sliding layers;
* the attention function (:func:`attention`, registered with transformers' ``AttentionInterface`` as
  ``spectrain`` and, batch-invariant, ``spectrain-rows16``): the layer hands it its own scaling, its sliding window
  (the argument every family passes for flash attention), Gemma 2's logit soft-capping and GPT-OSS's sinks; it turns
  distances into the layer's mask (``distance < window``, HF's ``q - k < W``) and runs
  :func:`~spectrain.eval.attention.grouped_attention` (or the explicit math a soft-cap or sinks need).

The model's attention implementation is switched to ours only while our forward runs (:meth:`LayerPath.active`), so
the same model object still runs HF's ``generate()`` and training as loaded.
"""

from __future__ import annotations

import inspect
from contextlib import contextmanager

import torch

from spectrain.eval.attention import grouped_attention
from spectrain.heads.errors import SpectrainError

FAR = 1 << 30  # the distance of a slot a query may not attend: past every window
SERVED_LAYER_TYPES = ("full_attention", "sliding_attention")
NAME = "spectrain"
# What layers pass the attention function besides what it handles, known to change nothing here; any other
# argument that is set (a position bias, sparse indices, sinks under another name) is refused, never ignored.
PASSED_THROUGH = {"position_ids", "output_hidden_states", "output_attentions", "use_cache", "cache_position",
                  "is_causal", "cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k"}


def distance_mask(mask: torch.Tensor, positions: torch.Tensor, slot_positions: torch.Tensor) -> torch.Tensor:
    """(n, span) bool mask + the round's (n,) rotary positions + (span,) the position of the token in each cache
    slot (the round's own written in already) -> (1, 1, n, span) int32: query i's position minus slot j's where the
    mask allows it, :data:`FAR` elsewhere. A tree node's window thus counts tokens along its own path."""
    distance = (positions[:, None] - slot_positions[None, :mask.shape[-1]]).to(torch.int32)
    return distance.masked_fill(~mask, FAR)[None, None]


def expected_window(config, layer_idx: int) -> int | None:
    """The window HF's masks give layer ``layer_idx`` (its ``layer_types``, else every layer when the config slides):
    what the attention applies to a layer that passes none itself."""
    window = getattr(config, "sliding_window", None)
    types = getattr(config, "layer_types", None)
    if not window:
        return None
    if types and config.model_type != "mistral":  # Mistral's layers slide whatever layer_types say
        return window if types[layer_idx] == "sliding_attention" else None
    return window if getattr(config, "use_sliding_window", True) is not False else None


def attention(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask: torch.Tensor,
              scaling: float | None = None, dropout: float = 0.0, softcap: float | None = None,
              sliding_window: int | None = None, s_aux: torch.Tensor | None = None, rows: int | None = None,
              **kwargs) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature over our cache and :func:`distance_mask`.

    Args:
        query: (1, heads, n, d); key, value: (1, kv_heads, span, d) (what :class:`LayerCache` returned).
        attention_mask: (1, 1, n, span) int32 distances (:data:`FAR` = masked).
        scaling: the layer's score scale; softcap: Gemma 2's ``tanh`` cap on scores; sliding_window: the layer's
        window (keys with distance < window), None for full attention; s_aux: GPT-OSS's per-head sink logits (heads,).
        rows: batch-invariant attention in calls of this many query rows (``grouped_attention``).
    Returns:
        ((1, n, heads, d), None), the layout transformers' functions return.
    """
    if dropout:
        raise SpectrainError("decoding runs attention without dropout")
    unknown = sorted(k for k, v in kwargs.items() if v is not None and k not in PASSED_THROUGH)
    if unknown:
        raise SpectrainError(f"cannot decode {module.config.model_type!r}: its attention layers pass {unknown}, "
                             "which spectrain's attention function does not implement")
    if sliding_window is None:  # a layer whose window only HF's mask applies (Qwen2-MoE): the same window here
        sliding_window = expected_window(module.config, module.layer_idx)
    mask = attention_mask < (sliding_window if sliding_window else FAR)
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    if softcap is None and s_aux is None:
        return grouped_attention(query, key, value, mask, scale, rows).transpose(1, 2), None
    return _explicit_attention(query, key, value, mask, scale, softcap, s_aux, rows).transpose(1, 2), None


def _explicit_attention(query, key, value, mask, scale, softcap, s_aux, rows):
    """Scores written out (fp32) for what SDPA cannot take: a soft-cap on the scores, sink logits in the softmax.
    ``rows``: the query rows in calls of that many (batch-invariant), as :func:`grouped_attention` does."""
    heads, kv_heads, n = query.shape[1], key.shape[1], query.shape[2]
    groups = heads // kv_heads
    keys, values = key.repeat_interleave(groups, 1), value.repeat_interleave(groups, 1)
    step = rows or 256  # fp32 scores of (heads, step, span) at a time (a long prefill would hold them all)
    chunks = [slice(i, i + step) for i in range(0, n, step)]
    outs = []
    for rows_of in chunks:
        q = query[:, :, rows_of]
        if rows is not None and q.shape[2] < rows:  # the last call padded to ``rows`` rows (cut below)
            q = torch.cat([q, q.new_zeros(1, heads, rows - q.shape[2], q.shape[3])], 2)
        scores = (q.float() @ keys.float().transpose(-1, -2)) * scale
        if softcap is not None:
            scores = softcap * torch.tanh(scores / softcap)
        m = mask[:, :, rows_of]
        if m.shape[2] < scores.shape[2]:
            m = torch.cat([m, m[:, :, :1].expand(1, 1, scores.shape[2] - m.shape[2], -1)], 2)
        scores = scores.masked_fill(~m, float("-inf"))
        if s_aux is not None:  # a sink column in the softmax, dropped after it (GPT-OSS)
            sink = s_aux.float().view(1, heads, 1, 1).expand(1, heads, scores.shape[2], 1)
            probs = torch.cat([scores, sink], -1).softmax(-1)[..., :-1]
        else:
            probs = scores.softmax(-1)
        outs.append((probs @ values.float())[:, :, :min(rows_of.stop, n) - rows_of.start].to(query.dtype))
    return torch.cat(outs, 2)


def _register() -> None:
    from transformers.modeling_utils import AttentionInterface

    AttentionInterface.register(NAME, attention)
    AttentionInterface.register(f"{NAME}-rows16", lambda *a, **k: attention(*a, rows=16, **k))
    try:  # the mask builders look our name up before they see the 4-D mask and return it as given
        from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

        for name in (NAME, f"{NAME}-rows16"):
            ALL_MASK_ATTENTION_FUNCTIONS.register(name, sdpa_mask)
    except ImportError:  # transformers without mask interfaces: nothing looks the name up
        pass


def implementation_name(rows: int | None) -> str:
    if rows not in (None, 16):
        raise SpectrainError(f"batch-invariant attention runs 16-row calls, not {rows}")
    return NAME if rows is None else f"{NAME}-rows16"


class LayerCache:
    """HF's ``Cache`` interface over our :class:`~spectrain.eval.static_model.KVCache` buffers.

    The attention layers call ``update(key, value, layer_idx, ...)`` with the round's (1, kv_heads, n, d) K/V; they
    land at ``slots`` (set for each forward by :meth:`LayerPath.forward`) and the first ``span`` slots are returned.
    """

    is_compileable = True

    def __init__(self, buffers):
        self.buffers = buffers
        self.is_sliding = [False] * len(buffers.k)  # every layer keeps every slot; windows live in the mask
        self.slots: torch.Tensor | None = None
        self.span = buffers.max_len

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        k, v = self.buffers.k[layer_idx], self.buffers.v[layer_idx]
        k.index_copy_(2, self.slots, key_states.to(k.dtype))
        v.index_copy_(2, self.slots, value_states.to(v.dtype))
        return k[:, :, :self.span], v[:, :, :self.span]

    def get_seq_length(self, layer_idx: int = 0) -> int:
        """0: read only to default positions and masks, and both are always given here (a host int that changed
        every round would recompile a compiled forward)."""
        return 0

    def __len__(self) -> int:
        return len(self.buffers.k)


def unserved_reason(model) -> str | None:
    """Why the verifier's own layers cannot run through our cache and masks, or None when they can."""
    config = model.config
    inner = model.get_decoder() if hasattr(model, "get_decoder") else getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    if inner is None or layers is None:
        return f"{type(model).__name__} has no decoder with a list of layers (model.model.layers)"
    types = getattr(config, "layer_types", None) or ()
    other = sorted(set(types) - set(SERVED_LAYER_TYPES))
    if other:
        return (f"its layers of type {', '.join(other)} keep a state other than keys and values; the decoder serves "
                f"{' and '.join(SERVED_LAYER_TYPES)} layers")
    attn = getattr(layers[0], "self_attn", None)
    if attn is None or not hasattr(attn, "layer_idx"):
        return f"{type(layers[0]).__name__} has no self_attn with a layer_idx (the cache is addressed by layer)"
    if cache_keyword(inner) is None:
        return f"{type(inner).__name__}.forward takes no cache (past_key_values / cache)"
    if not any(hasattr(config, k) for k in ("num_key_value_heads", "num_attention_heads")):
        return "its config names no attention heads (num_attention_heads / num_key_value_heads)"
    return None


def cache_keyword(inner) -> str | None:
    """The name the inner model's forward takes its cache by: ``cache`` (transformers >= 5.24) or
    ``past_key_values``."""
    params = inspect.signature(inner.forward).parameters
    return next((k for k in ("cache", "past_key_values") if k in params), None)


class LayerPath:
    """The forward of :class:`~spectrain.eval.static_model.StaticCausalLM` through the model's own inner forward."""

    def __init__(self, model, buffers, rows: int | None):
        reason = unserved_reason(model)
        if reason is not None:
            raise SpectrainError(f"cannot decode {model.config.model_type!r}: {reason}")
        _register()
        self.inner = model.get_decoder() if hasattr(model, "get_decoder") else model.model
        self.cache = LayerCache(buffers)
        self.keyword = cache_keyword(self.inner)
        self.implementation = implementation_name(rows)
        # Every config object an attention layer reads its implementation from (a text sub-config, usually one).
        configs = {id(m.config): m.config for m in self.inner.modules() if hasattr(m, "config")}
        self.configs = list(configs.values()) or [self.inner.config]
        self._probe()

    def _probe(self) -> None:
        """One 2-token forward, eagerly, before anything is compiled: every layer's attention arguments are checked
        (an unknown one refused by name here, not inside a trace) and transformers' hidden-state hooks are installed
        outside any trace. Writes slots 0-1 only; nothing is committed."""
        device = self.cache.buffers.k[0].device
        slots = torch.arange(2, device=device)
        mask = torch.zeros(2, self.cache.buffers.max_len, dtype=torch.bool, device=device)
        mask[:, :2] = torch.tril(torch.ones(2, 2, dtype=torch.bool, device=device))
        with self.active(), torch.no_grad():
            self.forward(torch.zeros(2, dtype=torch.long, device=device), slots, mask, slots,
                         self.cache.buffers.max_len, capture=(1,))

    @contextmanager
    def active(self):
        """Our attention function on every layer while the block runs (entered outside any compiled region)."""
        saved = [c._attn_implementation for c in self.configs]
        for c in self.configs:
            c._attn_implementation = self.implementation
        try:
            yield
        finally:
            for c, name in zip(self.configs, saved):
                c._attn_implementation = name

    def forward(self, input_ids, positions, mask, slots, span, capture: tuple[int, ...]):
        """(n,) ids at (n,) positions written at (n,) slots, attending through the (n, span) mask ->
        ((n, H) final hidden states, (n, len(capture) * H) captured HF ``hidden_states`` or None). Runs inside
        :meth:`active`."""
        self.cache.slots, self.cache.span = slots, span
        slot_positions = self.cache.buffers.positions
        slot_positions.index_copy_(0, slots, positions)  # compacted with the K/V (KVCache.compact)
        try:
            out = self.inner(input_ids=input_ids[None], position_ids=positions[None],
                             attention_mask=distance_mask(mask, positions, slot_positions), use_cache=True,
                             output_hidden_states=bool(capture), return_dict=True, **{self.keyword: self.cache})
        except AttributeError as e:  # a layer that keeps another state asks the cache for it
            if getattr(e, "obj", None) is not self.cache:
                raise
            raise SpectrainError(f"cannot decode {self.inner.config.model_type!r}: its layers ask the cache for "
                                 f"{e.name!r}, a state other than keys and values") from None
        last = out.last_hidden_state[0]
        if not capture:
            return last, None
        states = out.hidden_states  # [0] the embeddings, [i + 1] layer i's output, [-1] the final (normed) state
        return last, torch.cat([states[i][0] for i in capture], -1)
