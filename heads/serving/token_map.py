"""SGLang's token map: ``--speculative-token-map``, a ``torch.save``d (N,) int64 tensor of hot token ids.

SGLang's draft head over a ranked vocabulary is the verifier ``lm_head``'s rows of these ids; an export that
carries one declares it in ``config.json``'s ``spectrain.token_map`` and ``validate_export`` checks it
(:func:`check_token_map`), whichever format wrote it.
"""

from __future__ import annotations

from pathlib import Path

import torch

from ..errors import SpectrainError
from ..io import atomic_path

TOKEN_MAP_FILE = "token_map.pt"  # SGLang: --speculative-token-map DIR/token_map.pt


def write_token_map(path: str | Path, ids: torch.Tensor) -> Path:
    """SGLang's ``--speculative-token-map`` file: ``torch.save`` of the (N,) int64 hot token ids, atomically.

    SGLang reads it with ``torch.load(path, weights_only=True)`` and ``torch.tensor(..., dtype=int64)``
    (``load_token_map`` in ``python/sglang/srt/speculative/``); its draft head is the verifier's ``lm_head``
    rows of these ids, in this order."""
    ids = torch.as_tensor(ids).to(torch.int64).flatten().contiguous()
    with atomic_path(path) as tmp:
        torch.save(ids, tmp)
    return Path(path)


def check_token_map(path: str | Path, config: dict, declared: dict | None = None) -> torch.Tensor:
    """Read and check the token map of the export in ``path``: a 1-D int64 tensor (or a list of ints) of
    distinct ids in the verifier's vocabulary (``config["vocab_size"]``), as many as ``declared["tokens"]``
    when the config declares it. Returns the (N,) int64 ids."""
    path = Path(path)
    file = path / str((declared or {}).get("file") or TOKEN_MAP_FILE)
    if not file.is_file():
        raise SpectrainError(f"token map {file} is missing (config.json declares one)")
    try:
        raw = torch.load(file, map_location="cpu", weights_only=True)
    except Exception as e:  # a truncated or foreign file: torch raises several types
        raise SpectrainError(f"token map {file} is not readable with torch.load(weights_only=True): "
                             f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}") from None
    if isinstance(raw, list) and all(isinstance(i, int) and not isinstance(i, bool) for i in raw):
        raw = torch.tensor(raw, dtype=torch.int64)
    if not isinstance(raw, torch.Tensor) or raw.dtype != torch.int64 or raw.ndim != 1 or raw.numel() == 0:
        what = (f"{raw.dtype} tensor of shape {tuple(raw.shape)}" if isinstance(raw, torch.Tensor)
                else type(raw).__name__)
        raise SpectrainError(f"token map {file} must hold a non-empty 1-D int64 tensor of token ids, got {what}")
    vocab = config.get("vocab_size")
    if vocab is not None and (int(raw.min()) < 0 or int(raw.max()) >= vocab):
        raise SpectrainError(f"token map {file} has ids outside the verifier's vocabulary [0, {vocab}): "
                             f"{int(raw.min())}..{int(raw.max())}")
    if raw.unique().numel() != raw.numel():
        raise SpectrainError(f"token map {file} repeats {raw.numel() - raw.unique().numel()} token ids")
    if declared is not None and declared.get("tokens") is not None and raw.numel() != declared["tokens"]:
        raise SpectrainError(f"token map {file} holds {raw.numel()} ids, config.json declares {declared['tokens']}")
    return raw

