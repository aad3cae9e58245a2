"""DFlash / DSpark drafters as llama.cpp ``dflash`` GGUF files (``--spec-type draft-dflash`` / ``draft-dspark``).

llama.cpp's converter (``conversion/qwen.py``: ``DSparkModel`` / ``DFlashModel``, Qwen3 layers) writes the same
file from a speculators export; this writes it with the ``gguf`` package, the tokenizer copied from the target GGUF
it is served beside. What llama.cpp computes from it (``src/models/dflash.cpp``, ``common/speculative.cpp``) is
spectrain's block drafter: the fused target layers through ``fc`` and ``enc.output_norm`` (our ``hidden_norm``),
every layer's k / v over the context (k-norm, NeoX RoPE at the target's positions), the block
``[anchor, MASK, ...]`` attended bidirectionally, the draft's final norm and the target's own embeddings and
``lm_head`` (not written: llama.cpp borrows the target's). Rows stay in HF order: llama.cpp runs this
architecture with NeoX RoPE, so nothing is permuted (unlike an EAGLE-3's q / k).

``dflash.target_layers`` are llama.cpp's capture ids: it reads the *input* of target layer id, i.e. the output of
layer id - 1, HF ``hidden_states[id]`` (:attr:`~.dflash.DFlashConfig.capture_ids`).

Served with ``--spec-draft-n-max`` equal to the drafter's drafts per block: the block is bidirectional, so a
shorter block gives every slot another state than the one trained.
"""

from __future__ import annotations

from pathlib import Path

import torch

from ..dflash import DFlashDrafter
from ..errors import SpectrainError
from .registry import GgufExport
from .llama_cpp import (DRAFT_GGUF_DTYPES, GGUFValue, _check_dtype, _encode, _gguf, decoder_keys, draft_metadata,
                        gguf_tensors, read_metadata, shape_problems, target_shape, tokenizer_metadata,
                        tokenizer_problems, write_draft_keys, write_gguf)

ARCH = "dflash"
# Target architectures whose llama.cpp graph exposes each layer's input (t_layer_inp), which draft-dflash
# captures (src/models/*.cpp); a llama.cpp target of another kind stops at GGML_ASSERT "layer input tensor is
# null". Gemma-4 is left out: llama.cpp scales the draft's embeddings by sqrt(h) there, spectrain does not.
TARGET_ARCHS = ("llama", "qwen3", "qwen3moe", "qwen35", "qwen35moe", "qwen3next", "lfm2")

_LAYER_NAMES = {  # our DFlashLayer's state keys -> llama.cpp's blk.N names
    "input_layernorm.weight": "attn_norm.weight", "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight", "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight", "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight", "post_attention_layernorm.weight": "ffn_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight", "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}
_HEAD_NAMES = {"fc.weight": "fc.weight", "hidden_norm.weight": "enc.output_norm.weight",
               "norm.weight": "output_norm.weight", "markov_head.markov_w1.weight": "markov_w1.weight",
               "markov_head.markov_w2.weight": "markov_w2.weight", "confidence_head.proj.weight": "conf_proj.weight",
               "confidence_head.proj.bias": "conf_proj.bias"}


def check_dflash_exportable(drafter) -> None:
    """Raise, naming the reason, unless llama.cpp's ``draft-dflash`` / ``draft-dspark`` drafts what ``drafter``
    drafts here."""
    if not isinstance(drafter, DFlashDrafter):
        raise SpectrainError(f"not a DFlash / DSpark drafter: {type(drafter).__name__}")
    c = drafter.config
    if c.confidence_head and not c.markov_rank:
        raise SpectrainError(
            "--format gguf: this DSpark has a confidence head without a Markov head; llama.cpp creates the "
            "confidence projection only beside a Markov head (the file would not load): export with "
            "--drop_confidence_head (its DFlash body drafts the same tokens)")
    if c.sample_from_anchor and not c.markov_rank:
        raise SpectrainError("--format gguf: sample_from_anchor without a Markov head; llama.cpp's draft-dflash "
                             "always drafts from slot 1")
    if c.verifier_layers - 1 in c.target_layer_ids:
        raise SpectrainError(
            f"--format gguf: the drafter reads the verifier's last layer ({c.verifier_layers - 1}), whose output HF "
            "gives after the final norm; llama.cpp captures layer inputs, before it: retrain with "
            "--model.target_layer_ids below it")


def dflash_gguf_tensors(drafter: DFlashDrafter) -> dict[str, torch.Tensor]:
    """llama.cpp's tensor name -> tensor (PyTorch layout, float32) of a DFlash / DSpark drafter."""
    check_dflash_exportable(drafter)
    out = {}
    for name, t in drafter.state_dict().items():
        parts = name.split(".", 2)
        if parts[0] == "layers":
            out[f"blk.{parts[1]}.{_LAYER_NAMES[parts[2]]}"] = t
        elif name in _HEAD_NAMES:
            out[_HEAD_NAMES[name]] = t
        else:
            raise SpectrainError(f"DFlash tensor {name} has no llama.cpp name")
    return {k: v.detach().cpu().float() for k, v in out.items()}


def dflash_gguf_metadata(drafter: DFlashDrafter) -> dict[str, tuple[str, object]]:
    """``dflash.*`` key -> (GGUF value type name, value), as llama.cpp's converter writes them."""
    c = drafter.config
    a = ARCH
    out = {
        **decoder_keys(a, c, blocks=c.num_hidden_layers),
        f"{a}.block_size": ("UINT32", c.block_size),
        f"{a}.target_layers": ("ARRAY_INT32", list(c.capture_ids)),
        f"{a}.sample_from_anchor": ("BOOL", bool(c.sample_from_anchor)),
        f"{a}.has_confidence_head": ("BOOL", bool(c.confidence_head)),
    }
    return out


def expected_dflash_tensors(meta: dict[str, GGUFValue]) -> dict[str, tuple[int, ...]]:
    """The tensors (name -> PyTorch-order shape) llama.cpp's dflash loader takes for a file's metadata, the Markov
    and confidence heads included where the file's ``markov_w1`` says there is one (``rank`` from its shape)."""
    a = ARCH

    def get(key):
        if key not in meta:
            raise SpectrainError(f"dflash GGUF lacks the key {key!r} llama.cpp's loader reads")
        return meta[key].value

    get(f"{a}.attention.layer_norm_rms_epsilon")
    h, ff, layers = get(f"{a}.embedding_length"), get(f"{a}.feed_forward_length"), get(f"{a}.block_count")
    heads, kv = get(f"{a}.attention.head_count"), get(f"{a}.attention.head_count_kv")
    d = meta[f"{a}.attention.key_length"].value if f"{a}.attention.key_length" in meta else h // heads
    shapes = {"fc.weight": (h, len(get(f"{a}.target_layers")) * h), "enc.output_norm.weight": (h,),
              "output_norm.weight": (h,)}
    for i in range(layers):
        p = f"blk.{i}."
        shapes.update({p + "attn_norm.weight": (h,), p + "attn_q.weight": (heads * d, h),
                       p + "attn_k.weight": (kv * d, h), p + "attn_v.weight": (kv * d, h),
                       p + "attn_output.weight": (h, heads * d), p + "attn_q_norm.weight": (d,),
                       p + "attn_k_norm.weight": (d,), p + "ffn_norm.weight": (h,), p + "ffn_gate.weight": (ff, h),
                       p + "ffn_up.weight": (ff, h), p + "ffn_down.weight": (h, ff)})
    return shapes


def validate_dflash_gguf(path: str | Path, target_gguf: str | Path | None = None) -> dict[str, tuple[int, ...]]:
    """Check a dflash GGUF the way llama.cpp's loader and draft-dflash read it; raise naming every problem."""
    meta = draft_metadata(path, ARCH)
    expected = expected_dflash_tensors(meta)
    found = gguf_tensors(path)
    if "tokenizer.ggml.tokens" not in meta:  # llama.cpp takes the vocabulary's size from it (no dflash.vocab_size)
        raise SpectrainError(f"{path} is not a valid dflash GGUF: no tokenizer (llama.cpp sizes the vocabulary by it "
                             "and checks it against the target's)")
    vocab = len(meta["tokenizer.ggml.tokens"].value)
    h = meta[f"{ARCH}.embedding_length"].value
    if "markov_w1.weight" in found:
        rank = found["markov_w1.weight"][0][1]
        expected.update({"markov_w1.weight": (vocab, rank), "markov_w2.weight": (vocab, rank)})
        if f"{ARCH}.has_confidence_head" in meta and meta[f"{ARCH}.has_confidence_head"].value:
            expected.update({"conf_proj.weight": (1, h + rank), "conf_proj.bias": (1,)})
    problems = shape_problems(expected, found)
    if "tokenizer.ggml.mask_token_id" not in meta:
        problems.append("no tokenizer.ggml.mask_token_id (the token that fills the block's draft slots)")
    elif not 0 <= meta["tokenizer.ggml.mask_token_id"].value < vocab:
        problems.append(f"mask token {meta['tokenizer.ggml.mask_token_id'].value} outside the vocabulary")
    layers = list(meta[f"{ARCH}.target_layers"].value)
    if not layers or layers != sorted(set(layers)) or min(layers) < 1:
        problems.append(f"{ARCH}.target_layers {layers}: capture ids must be ascending, distinct and >= 1")
    if target_gguf is not None and not problems:
        target = target_shape(target_gguf)
        if max(layers) >= target["layers"]:
            problems.append(f"target layers {layers} reach past the target's {target['layers']} layers")
        if h != target["hidden_size"] or (target["vocab_size"] is not None and vocab != target["vocab_size"]):
            problems.append(f"the draft is {h} wide over {vocab} tokens; the target {target['hidden_size']} over "
                            f"{target['vocab_size']}")
        problems += tokenizer_problems(meta, target_gguf, skip=("tokenizer.ggml.mask_token_id",))
    if problems:
        raise SpectrainError(f"{path} is not a valid dflash GGUF: " + "; ".join(problems))
    return expected


def check_dflash_target(drafter: DFlashDrafter, target_gguf: str | Path) -> None:
    """Raise unless ``target_gguf`` is this drafter's verifier in an architecture draft-dflash can capture from."""
    c = drafter.config
    arch = read_metadata(target_gguf)["general.architecture"].value
    target = target_shape(target_gguf)
    problems = []
    if arch not in TARGET_ARCHS:
        problems.append(f"its architecture {arch!r} does not expose layer inputs to llama.cpp's draft-dflash "
                        f"(served: {', '.join(TARGET_ARCHS)})")
    if target["layers"] != c.verifier_layers:
        problems.append(f"the drafter reads a {c.verifier_layers}-layer verifier, the target has {target['layers']}")
    if target["hidden_size"] != c.hidden_size:
        problems.append(f"the drafter is {c.hidden_size} wide, the target {target['hidden_size']}")
    if target["vocab_size"] is not None and target["vocab_size"] != c.vocab_size:
        problems.append(f"the drafter's vocabulary has {c.vocab_size} tokens, the target's {target['vocab_size']}")
    if problems:
        raise SpectrainError(f"target GGUF {target_gguf} cannot serve this drafter: " + "; ".join(problems))


def write_dflash_gguf(drafter: DFlashDrafter, out_path: str | Path, target_gguf: str | Path, dtype: str = "float32",
                      name: str = "", force: bool = False) -> Path:
    """Write a DFlash / DSpark drafter as a llama.cpp ``dflash`` GGUF beside ``target_gguf`` (its tokenizer copied,
    the mask token added, its depth, width, vocabulary and architecture checked); matrices in ``dtype``, norms in
    f32. Read back and validated before the rename; an existing file is kept unless ``force``."""
    gguf = _gguf()
    dtype = _check_dtype(dtype, DRAFT_GGUF_DTYPES)
    if Path(out_path).exists() and not force:
        raise SpectrainError(f"{out_path} already exists; pass --force to overwrite it")
    tensors = dflash_gguf_tensors(drafter)
    check_dflash_target(drafter, target_gguf)
    tokenizer = tokenizer_metadata(target_gguf)

    # the target's own mask token, if it has one, gives way to ours: it fills the block's draft slots
    tokenizer = {k: v for k, v in tokenizer.items() if k != "tokenizer.ggml.mask_token_id"}

    def fill(writer) -> None:
        write_draft_keys(writer, name or f"spectrain {drafter.config.method} for "
                                         f"{drafter.config.verifier or 'its verifier'}",
                         dtype, dflash_gguf_metadata(drafter), tokenizer)
        writer.add_mask_token_id(drafter.config.mask_token_id)
        for tname, t in tensors.items():
            data, raw = _encode(gguf, t.numpy(), dtype)
            writer.add_tensor(tname, data, raw_dtype=raw)

    return write_gguf(out_path, ARCH, fill, lambda tmp: validate_dflash_gguf(tmp, target_gguf), force=True)


def _write_for_export(drafter: DFlashDrafter, out, target, dtype: str, force: bool, verifier_name: str) -> str:
    """``spectrain-export --format gguf``: the file, and the llama-server flags that serve it."""
    c = drafter.config
    write_dflash_gguf(drafter, out, target, dtype=dtype, force=force,
                      name=verifier_name and f"spectrain {c.method} for {verifier_name}" or "")
    # the block is bidirectional: served with fewer slots than trained, every slot's state would differ
    return f"--spec-type draft-{c.method} --spec-draft-n-max {c.drafts} --spec-draft-p-min 0"


DFLASH_GGUF = GgufExport(check_target=check_dflash_target, write=_write_for_export, drafters=("DFlash", "DSpark"),
                         spec_types=("draft-dflash", "draft-dspark"), check_exportable=check_dflash_exportable)
