"""The hand-written Llama-family decoder layer (Llama, Mistral, Qwen2, Qwen3) of
:class:`~spectrain.eval.static_model.StaticCausalLM`: the weights as its forward uses them, and one layer's forward.

On a CPU, where a decode step is a run of small matmuls whose fixed costs count, the weights are copied once per
decoder when the copies fit :data:`COPY_BUDGET`: q / k / v fused into one matrix and gate / up into another (one
matmul where there were three and two), and every matrix (the output head too) prepacked for oneDNN's
inner-product kernel (``torch.ops.mkldnn``), which otherwise reorders a weight on every call (measured on a 2-core
AVX512-BF16 EPYC, SmolLM2-135M's AR step, each idea alone in one interleaved run: packing 1.42x in bf16 and 1.91x
in fp32, fusing 1.07x in bf16; the whole loop against HF ``generate()``: docs/results/ar_vs_hf_epyc_avx512.json).
Packed rows equal each other however many run together (2 to 128 rows, bf16 and fp32, measured on that CPU;
``tests/test_batch_invariant.py`` and ``tests/test_decoder_weights.py`` hold it on every CPU the suite runs on),
as batch-invariant decoding needs. Past the budget, and on CUDA, the module's own weights run as they are: the
copies would cost memory for a fixed cost that is small beside a large matmul.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from spectrain.eval.attention import AttentionPart, attend
from spectrain.heads.layers import apply_rotary

COPY_BUDGET = 2 << 30  # bytes of fused / packed weight copies a decoder may make (SmolLM2-360M's bf16: 0.7 GiB)
PACKED_DTYPES = (torch.bfloat16, torch.float32)  # what oneDNN's packed inner product takes on every x86 CPU

# (weight, bias or None, output widths): one matmul whose output splits into those widths
Projection = tuple[torch.Tensor, torch.Tensor | None, list[int]]


@dataclass
class LayerWeights:
    """One decoder layer's weights as :func:`layer_forward` uses them (norms: (weight, eps))."""

    input_norm: tuple[torch.Tensor, float]
    post_norm: tuple[torch.Tensor, float]
    qkv: list[Projection]  # one fused projection, or q, k, v apart
    o: Projection
    gate_up: list[Projection]  # one fused projection, or gate, up apart
    down: Projection
    act: Callable
    q_norm: tuple[torch.Tensor, float] | None = None  # Qwen3 normalizes each head before RoPE
    k_norm: tuple[torch.Tensor, float] | None = None


@dataclass
class DecoderWeights:
    """Every layer's weights, the output head's (weight, bias) and the matmul that takes them."""

    layers: list[LayerWeights]
    head: tuple[torch.Tensor, torch.Tensor | None]
    linear: Callable  # (x, weight, bias) -> x @ weight.T + bias
    copied: bool  # fused and (where oneDNN takes the dtype) packed copies


def packed_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``F.linear`` over a weight packed by :func:`pack`."""
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


def pack(weight: torch.Tensor) -> torch.Tensor:
    """A (out, in) weight in oneDNN's blocked layout for 2-row calls (:func:`packed_linear` takes any row count)."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), 2)


def can_pack(device: torch.device, dtype: torch.dtype) -> bool:
    return device.type == "cpu" and dtype in PACKED_DTYPES and torch.backends.mkldnn.is_available()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The Llama family's RMSNorm op for op (HF's ``LlamaRMSNorm``): statistics in fp32, scaled in x's dtype."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def decoder_weights(inner, lm_head, device: torch.device, copy: bool | None = None) -> DecoderWeights:
    """The weights of ``inner``'s layers and of ``lm_head``: fused and packed copies on a CPU when they fit
    :data:`COPY_BUDGET` (``copy``: None decides so; False keeps the module's weights, as a compiled forward needs)."""
    weight = lm_head.weight
    size = weight.numel() * weight.element_size() + sum(
        p.numel() * p.element_size() for layer in inner.layers for m in (layer.self_attn, layer.mlp)
        for p in m.parameters() if p.dim() == 2)
    if copy is None:
        copy = device.type == "cpu" and size <= COPY_BUDGET
    packed = copy and can_pack(device, weight.dtype)
    keep = pack if packed else (lambda w: w)
    layers = [_layer_weights(layer, copy, keep) for layer in inner.layers]
    return DecoderWeights(layers, (keep(weight), lm_head.bias), packed_linear if packed else F.linear, copy)


def _layer_weights(layer, fuse: bool, keep: Callable) -> LayerWeights:
    attn, mlp = layer.self_attn, layer.mlp
    norm = lambda m: (m.weight, m.variance_epsilon)  # noqa: E731
    return LayerWeights(
        input_norm=norm(layer.input_layernorm), post_norm=norm(layer.post_attention_layernorm),
        qkv=_projections([attn.q_proj, attn.k_proj, attn.v_proj], fuse, keep),
        o=_projections([attn.o_proj], fuse, keep)[0],
        gate_up=_projections([mlp.gate_proj, mlp.up_proj], fuse, keep),
        down=_projections([mlp.down_proj], fuse, keep)[0],
        act=mlp.act_fn, q_norm=norm(attn.q_norm) if hasattr(attn, "q_norm") else None,
        k_norm=norm(attn.k_norm) if hasattr(attn, "k_norm") else None)


def _projections(linears, fuse: bool, keep: Callable) -> list[Projection]:
    """``linears`` (sharing an input) as one projection (fused: their weights and biases stacked, then kept) or
    one each."""
    widths = [m.weight.shape[0] for m in linears]
    if not fuse:
        return [(m.weight, m.bias, [w]) for m, w in zip(linears, widths)]
    weight = torch.cat([m.weight.detach() for m in linears]) if len(linears) > 1 else linears[0].weight.detach()
    biases = [m.bias for m in linears]
    bias = None if biases[0] is None else torch.cat([b.detach() for b in biases])
    return [(keep(weight), bias, widths)]


def project(linear: Callable, h: torch.Tensor, projections: list[Projection]) -> list[torch.Tensor]:
    """Each projection's output, split into its widths: [q, k, v] or [gate, up] however they are stored."""
    return [y for weight, bias, widths in projections for y in linear(h, weight, bias).split(widths, -1)]


def layer_forward(weights: DecoderWeights, i: int, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                  cache_k: torch.Tensor, cache_v: torch.Tensor, slots: torch.Tensor, plan: list[AttentionPart],
                  head_dim: int, scaling: float) -> torch.Tensor:
    """Decoder layer i on (1, n, H) x: its K/V written into the (1, kv_heads, width, d) cache buffers at ``slots``,
    attention through ``plan`` (:func:`~spectrain.eval.attention.plan_attention`), then the MLP."""
    w, linear, n = weights.layers[i], weights.linear, x.shape[1]
    q, k, v = (y.view(1, n, -1, head_dim) for y in project(linear, rms_norm(x, *w.input_norm), w.qkv))
    if w.q_norm is not None:
        q, k = rms_norm(q, *w.q_norm), rms_norm(k, *w.k_norm)
    q, k, v = apply_rotary(q.transpose(1, 2), cos, sin), apply_rotary(k.transpose(1, 2), cos, sin), v.transpose(1, 2)
    cache_k.index_copy_(2, slots, k)
    cache_v.index_copy_(2, slots, v)
    out = attend(plan, q, cache_k, cache_v, scaling)
    x = x + linear(out.transpose(1, 2).reshape(1, n, -1), *w.o[:2])
    gate, up = project(linear, rms_norm(x, *w.post_norm), w.gate_up)
    return x + linear(w.act(gate) * up, *w.down[:2])
