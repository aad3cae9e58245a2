"""The verifier (or a draft model) run over its HF weights with a preallocated KV cache.

HF's own cache classes differ between transformers releases and cannot drop the
rejected entries of a tree. This module runs the same weights with our own
forward (Llama, Mistral, Qwen2 and Qwen3 decoder layers) so that:

* K/V live in buffers allocated once (layers x kv_heads x max_len x head_dim);
* a forward writes its n new tokens at cache slots ``length .. length+n-1`` and
  attends through an explicit (n, max_len) boolean mask, so trees are verified
  with tree masks and depth-based positions;
* rollback is setting ``length``; accepted tree nodes are compacted with one
  ``index_copy_`` — nothing is reallocated;
* on CUDA every shape is static (attention spans ``max_len``), which is what a
  CUDA graph needs; on CPU attention spans only the filled part.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from spectrain.heads.errors import SpectrainError

SUPPORTED = ("llama", "mistral", "qwen2", "qwen3")


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class KVCache(nn.Module):
    """Preallocated keys and values for every layer: (layers, 1, kv_heads, max_len, head_dim)."""

    def __init__(self, num_layers: int, kv_heads: int, max_len: int, head_dim: int, dtype, device):
        super().__init__()
        shape = (num_layers, 1, kv_heads, max_len, head_dim)
        self.register_buffer("k", torch.zeros(shape, dtype=dtype, device=device), persistent=False)
        self.register_buffer("v", torch.zeros(shape, dtype=dtype, device=device), persistent=False)
        self.max_len = max_len

    def compact(self, src_slots: torch.Tensor, dst_start: int) -> None:
        """Move entries at ``src_slots`` (ascending) to ``dst_start, dst_start+1, ...``."""
        dst = torch.arange(dst_start, dst_start + src_slots.numel(), device=src_slots.device)
        for buf in (self.k, self.v):
            buf.index_copy_(3, dst, buf.index_select(3, src_slots))


class StaticCausalLM:
    """Forward of an HF Llama-family causal LM over a :class:`KVCache`.

    ``length`` counts the committed tokens in the cache (host int: it changes
    once per decode round, after the round's single host sync).
    """

    def __init__(self, model, max_len: int, device: torch.device | str | None = None):
        config = model.config
        if config.model_type not in SUPPORTED:
            raise SpectrainError(f"the static-cache decoder supports {', '.join(SUPPORTED)} models, "
                                 f"not {config.model_type!r}")
        window = getattr(config, "sliding_window", None)
        if window and getattr(config, "use_sliding_window", True) and window < max_len:
            raise SpectrainError(f"{config.model_type} uses a sliding window of {window} tokens, shorter than the "
                                 f"{max_len} tokens this run needs")
        limit = getattr(config, "max_position_embeddings", None)
        if limit and max_len > limit:
            raise SpectrainError(f"prompt + new tokens + draft need {max_len} positions but the model's context "
                                 f"is {limit}")
        self.model = model
        self.inner = model.model
        self.lm_head = model.get_output_embeddings()
        param = next(model.parameters())
        self.device = torch.device(device) if device is not None else param.device
        self.dtype = param.dtype
        attn = self.inner.layers[0].self_attn
        self.head_dim = attn.head_dim
        self.scaling = attn.scaling
        self.kv_heads = config.num_key_value_heads
        self.static = self.device.type == "cuda"
        self.cache = KVCache(len(self.inner.layers), self.kv_heads, max_len, self.head_dim, self.dtype, self.device)
        self.max_len = max_len
        self.length = 0
        # HF hidden_states indices to keep from each forward in ``aux`` (n, len * H), for EAGLE-3 drafters.
        self.capture: tuple[int, ...] = ()
        self.aux: torch.Tensor | None = None

    # -- masks ------------------------------------------------------------------------------------------------
    def chain_mask(self, n: int) -> torch.Tensor:
        """(n, max_len): query i sees every committed slot and the new slots up to itself."""
        slots = torch.arange(self.max_len, device=self.device)
        return slots[None, :] <= self.length + torch.arange(n, device=self.device)[:, None]

    def tree_mask(self, ancestors: torch.Tensor) -> torch.Tensor:
        """(n, max_len) from an (n, n) ancestor-or-self matrix over the new tokens."""
        n = ancestors.shape[0]
        mask = torch.zeros(n, self.max_len, dtype=torch.bool, device=self.device)
        mask[:, :self.length] = True
        mask[:, self.length:self.length + n] = ancestors
        return mask

    # -- forward ----------------------------------------------------------------------------------------------
    @torch.no_grad()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor | None = None,
                mask: torch.Tensor | None = None) -> torch.Tensor:
        """Run n new tokens; write their K/V at slots ``length..length+n-1`` (``length`` is not advanced).

        Args:
            input_ids: (n,) token ids.
            positions: (n,) rotary positions (tree: ``length + depth``); default ``length + arange(n)``.
            mask: (n, max_len) bool, True = may attend; default causal over the chain.
        Returns:
            (n, H) final hidden states (after the final norm).
        """
        n = input_ids.shape[0]
        if self.length + n > self.max_len:
            raise SpectrainError(f"KV cache overflow: {self.length} + {n} tokens > max_len {self.max_len}")
        slots = torch.arange(self.length, self.length + n, device=self.device)
        if positions is None:
            positions = slots
        if mask is None:
            mask = self.chain_mask(n)
        if self.static:
            return self._run(input_ids, positions, mask, slots)
        span = self.length + n  # CPU: attend over the filled part only
        return self._run_eager(input_ids, positions, mask[:, :span], slots, span)

    def _run_eager(self, input_ids, positions, mask, slots, span):
        """The forward as a pure function of tensors (CUDA: ``span == max_len``, so shapes depend on n only)."""
        x = self.inner.embed_tokens(input_ids)[None]  # (1, n, H)
        cos, sin = self.inner.rotary_emb(x, positions[None])
        cos, sin = cos[:, None], sin[:, None]  # (1, 1, n, d)
        mask = mask[None, None]
        captured = []
        last = len(self.inner.layers)
        for i, layer in enumerate(self.inner.layers):
            x = self._layer(i, layer, x, cos, sin, slots, mask, span)
            if i + 1 in self.capture and i + 1 < last:  # HF hidden_states[i+1]: the output of layer i
                captured.append(x[0])
        out = self.inner.norm(x)[0]
        if self.capture:  # hidden_states[N] is the final (normed) state in HF's convention
            captured += [out] if last in self.capture else []
            self.aux = torch.cat(captured, -1)
        return out

    def _run(self, input_ids, positions, mask, slots):
        return self._graph(input_ids, positions, mask, slots)

    def compile(self) -> "StaticCausalLM":
        """CUDA: capture the forward with ``torch.compile(mode="reduce-overhead")`` (CUDA graphs, one per n).

        Every input is a tensor and every shape depends only on n, so each verify size is captured once.
        """
        self._compiled = torch.compile(lambda ids, pos, mask, slots: self._run_eager(ids, pos, mask, slots, self.max_len),
                                       mode="reduce-overhead", dynamic=False, fullgraph=False)
        return self

    def _graph(self, input_ids, positions, mask, slots):
        fn = getattr(self, "_compiled", None)
        if fn is None:
            return self._run_eager(input_ids, positions, mask, slots, self.max_len)
        return fn(input_ids, positions, mask, slots).clone()  # clone: graph outputs are overwritten by the next replay

    def _layer(self, i, layer, x, cos, sin, slots, mask, span):
        """One decoder layer: attention over the cache through ``mask`` (1, 1, n, span), then the MLP."""
        attn = layer.self_attn
        h = layer.input_layernorm(x)
        shape = (1, x.shape[1], -1, self.head_dim)
        q = attn.q_proj(h).view(shape)
        k = attn.k_proj(h).view(shape)
        v = attn.v_proj(h).view(shape).transpose(1, 2)
        if hasattr(attn, "q_norm"):  # Qwen3 normalizes each head before RoPE
            q, k = attn.q_norm(q), attn.k_norm(k)
        q, k = q.transpose(1, 2), k.transpose(1, 2)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        self.cache.k[i].index_copy_(2, slots, k.to(self.dtype))
        self.cache.v[i].index_copy_(2, slots, v.to(self.dtype))
        keys, values = self.cache.k[i][:, :, :span], self.cache.v[i][:, :, :span]
        out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=self.scaling,
                                             enable_gqa=q.shape[1] != keys.shape[1])
        x = x + attn.o_proj(out.transpose(1, 2).reshape(1, x.shape[1], -1))
        return x + layer.mlp(layer.post_attention_layernorm(x))

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """(..., H) -> (..., V) in fp32."""
        return self.lm_head(hidden).float()

    # -- cache bookkeeping ------------------------------------------------------------------------------------------
    def commit(self, n: int, src_slots: torch.Tensor | None = None) -> None:
        """Keep n of the tokens just run: the first n (chain), or those at ``src_slots`` (tree, compacted)."""
        if src_slots is not None:
            self.cache.compact(src_slots, self.length)
        self.length += n

    def reset(self) -> None:
        self.length = 0
