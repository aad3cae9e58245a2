"""``--dtype auto`` for decoding: a rule, not a race, so the same command gives the same numbers on every run.

bf16 where bf16 matrix multiplies are native (a bf16-capable CUDA device, a CPU with AMX / AVX512-BF16), fp32
elsewhere — the rule training uses (:func:`spectrain.heads.precision.resolve_dtype`). On the AMX development CPU
bf16 measured faster than fp32 at every verify width we run (1, 6 and 65 tokens on SmolLM2-135M; docs/LOG.md).
An earlier ``auto`` timed one forward in each dtype per job and kept the faster; on shared cores that race
flipped between runs of the same command, and with it τ and the lossless check.
"""

from __future__ import annotations

import os
import platform
import subprocess

import torch

from spectrain.heads.precision import bf16_is_native


def decode_dtype(device: str | torch.device) -> tuple[torch.dtype, dict]:
    """The decoding dtype ``auto`` stands for on ``device``, and a record of why (for ``eval.json``)."""
    device = torch.device(device)
    if bf16_is_native(device):
        where = "CUDA device" if device.type == "cuda" else "CPU (AMX / AVX512-BF16)"
        return torch.bfloat16, {"rule": f"bf16: native bf16 matrix multiplies on this {where}"}
    return torch.float32, {"rule": f"fp32: no native bf16 on this {device.type}"}


def cpu_record() -> dict:
    """The CPU a speed figure was measured on: model, logical CPUs, torch's threads, the vector extensions that
    decide the dtype (AVX2, AVX-512, AVX512-BF16, AMX-BF16) and whether bf16 is native (``lscpu``; on a machine
    without it only the architecture and threads are known)."""
    info = {"machine": platform.machine(), "model": platform.processor() or None, "cpus": None,
            "threads": torch.get_num_threads(), "bf16_native": bf16_is_native("cpu")}
    try:
        text = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=30,
                              env={**os.environ, "LC_ALL": "C"}).stdout  # English field names
    except (OSError, subprocess.SubprocessError):
        return info
    fields = {k.strip(): v.strip() for k, v in (line.split(":", 1) for line in text.splitlines() if ":" in line)}
    flags = set(fields.get("Flags", "").split())
    info.update(model=fields.get("Model name") or info["model"], cpus=int(fields.get("CPU(s)", "0") or 0) or None,
                family=fields.get("CPU family"), model_id=fields.get("Model"),
                avx2="avx2" in flags, avx512f="avx512f" in flags, avx512_bf16="avx512_bf16" in flags,
                amx_bf16="amx_bf16" in flags)
    return info


def cpu_line(cpu: dict) -> str:
    """One line naming a CPU record: 'AMD EPYC, 2 CPUs (AVX2; bf16 emulated), 2 threads'."""
    ext = [name for key, name in (("amx_bf16", "AMX-BF16"), ("avx512_bf16", "AVX512-BF16"), ("avx512f", "AVX-512"),
                                  ("avx2", "AVX2")) if cpu.get(key)]
    bf16 = "bf16 native" if cpu.get("bf16_native") else "bf16 emulated"
    ids = f" (family {cpu['family']}, model {cpu['model_id']})" if cpu.get("family") else ""
    return (f"{cpu.get('model') or cpu.get('machine')}{ids}, {cpu.get('cpus') or '?'} CPUs "
            f"({', '.join(ext + [bf16])}), {cpu.get('threads')} threads")
