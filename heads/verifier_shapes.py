"""A verifier's shape from its config alone, offline: what the fit check (``--dry_run``) sizes a run by.

Lookup order (:func:`verifier_config`): a local directory's ``config.json``; a hub id already in the Hugging Face
cache (``local_files_only``: nothing is downloaded); the shape spectrain ships for that hub id
(``spectrain/configs/verifiers/<org>--<name>/config.json``, no weights); else a :class:`SpectrainError` naming all
three. ``bundled:<name>`` verifiers resolve to their cached directory (built on first use, as training does).
No weights are read anywhere here.
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path

import torch

from .errors import SpectrainError
from .verifier import BUNDLED_PREFIX, resolve_verifier

SHIPPED_PACKAGE = "spectrain.configs"
SHIPPED_FOLDER = "verifiers"


def shipped_shape_path(hub_id: str) -> Path | None:
    """The shipped ``config.json`` of hub id ``org/name`` (``verifiers/org--name/config.json``), or None."""
    path = resources.files(SHIPPED_PACKAGE).joinpath(SHIPPED_FOLDER, hub_id.replace("/", "--"), "config.json")
    return Path(str(path)) if path.is_file() else None


def shipped_hub_ids() -> list[str]:
    """Hub ids whose shape spectrain ships."""
    folder = resources.files(SHIPPED_PACKAGE).joinpath(SHIPPED_FOLDER)
    return sorted(p.name.replace("--", "/", 1) for p in folder.iterdir()
                  if p.is_dir() and p.joinpath("config.json").is_file())


def verifier_config(name: str, trust_remote_code: bool = False):
    """``(config, source)``: the verifier's HF ``PretrainedConfig`` and where it was read (a path, or
    ``hf-cache:<id>``)."""
    from transformers import AutoConfig

    if name.startswith(BUNDLED_PREFIX) or Path(name).expanduser().exists():
        directory = Path(resolve_verifier(name))
        if not (directory / "config.json").is_file():
            raise SpectrainError(f"verifier {name}: {directory} has no config.json (a GGUF verifier's shape is not "
                                 "read offline: convert it to an HF directory first)")
        return AutoConfig.from_pretrained(directory, trust_remote_code=trust_remote_code), str(directory)
    resolve_verifier(name)  # a missing local path is refused by name here
    try:
        config = AutoConfig.from_pretrained(name, local_files_only=True, trust_remote_code=trust_remote_code)
        return config, f"hf-cache:{name}"
    except (OSError, ValueError):
        pass
    shipped = shipped_shape_path(name)
    if shipped is None:
        raise SpectrainError(f"verifier {name!r}: no local directory, not in the Hugging Face cache and no shipped "
                             f"shape (spectrain ships {', '.join(shipped_hub_ids())}); download its config.json "
                             "(huggingface-cli download ID config.json) or pass a local model directory")
    return AutoConfig.from_pretrained(shipped.parent), f"shipped:{shipped}"


def config_dtype(config) -> torch.dtype:
    """The dtype the verifier's weights are published in (``dtype`` / ``torch_dtype``; fp32 when unset)."""
    value = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None) or "float32"
    return value if isinstance(value, torch.dtype) else getattr(torch, str(value).replace("torch.", ""))


def meta_verifier(config):
    """The verifier built on the ``meta`` device from its config (no memory, no weights): exact parameter counts
    and the ``config`` / ``get_output_embeddings()`` a drafter's ``for_verifier`` reads."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)
