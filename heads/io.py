"""Atomic, safetensors-only file I/O shared by training, evaluation and export.

Everything spectrain writes goes to a temporary sibling first and is renamed
into place, so a crash never leaves a half-written file that looks complete.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from .errors import SpectrainError


def sha256_files(*paths: str | os.PathLike, extra: bytes = b"", names: bool = False) -> str:
    """Hex SHA-256 over the files' bytes in order (each preceded by its file name when ``names``), then
    ``extra``: the one file hasher (store checksums, tokenization cache keys, drafter fingerprints)."""
    digest = hashlib.sha256()
    for path in paths:
        if names:
            digest.update(Path(path).name.encode())
        with open(path, "rb") as f:
            for block in iter(lambda: f.read(1 << 22), b""):
                digest.update(block)
    digest.update(extra)
    return digest.hexdigest()


@contextmanager
def atomic_path(path: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary path beside ``path``; rename it onto ``path`` on success."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    tmp = Path(tmp)
    try:
        yield tmp
        os.chmod(tmp, 0o666 & ~_umask())  # mkstemp creates 0600; give the file normal permissions
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


@contextmanager
def atomic_dir(path: str | os.PathLike, force: bool = False) -> Iterator[Path]:
    """Yield a temporary directory beside ``path``; it replaces ``path`` on success.

    Refuses to replace an existing ``path`` unless ``force``; on failure nothing
    is left behind.
    """
    path = Path(path)
    if path.exists() and not force:
        raise SpectrainError(f"{path} already exists; pass --force to overwrite it")
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent))
    tmp.chmod(0o777 & ~_umask())  # mkdtemp's private 0700 would otherwise become the result's mode
    try:
        yield tmp
        if path.exists():
            old = path.with_name(f".{path.name}.old")
            shutil.rmtree(old, ignore_errors=True)
            os.replace(path, old)
            os.replace(tmp, path)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, path)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def cache_root() -> Path:
    """Where spectrain caches what it builds (bundled verifiers, tokenized data): ``$SPECTRAIN_CACHE`` or
    ``~/.cache/spectrain``."""
    return Path(os.environ.get("SPECTRAIN_CACHE", Path.home() / ".cache" / "spectrain")).expanduser()


def write_json(path: str | os.PathLike, obj: Any) -> Path:
    """Write ``obj`` as indented JSON, atomically."""
    with atomic_path(path) as tmp:
        tmp.write_text(json.dumps(obj, indent=2, default=str) + "\n")
    return Path(path)


def read_json(path: str | os.PathLike, what: str = "JSON file") -> Any:
    """Read JSON with an error that names the file when it is missing or malformed."""
    path = Path(path)
    if not path.is_file():
        raise SpectrainError(f"{what} not found: {path}")
    try:
        return json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise SpectrainError(f"{what} {path} is not valid JSON: {e}") from None


def save_tensors(path: str | os.PathLike, tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None = None) -> Path:
    """Save contiguous CPU copies of ``tensors`` as safetensors, atomically."""
    tensors = {k: v.detach().to("cpu").contiguous() for k, v in tensors.items()}
    with atomic_path(path) as tmp:
        save_file(tensors, str(tmp), metadata=metadata)
    return Path(path)


def load_tensors(path: str | os.PathLike, device: str | torch.device = "cpu") -> dict[str, torch.Tensor]:
    """Load a safetensors file; refuse anything else (no pickles)."""
    path = Path(path)
    if not path.is_file():
        raise SpectrainError(f"weights file not found: {path}")
    try:
        return load_file(str(path), device=str(device))
    except (SafetensorError, OSError, ValueError) as e:
        raise SpectrainError(f"{path} is not a readable safetensors file: {e}") from None


def checked_state(path: str | os.PathLike, expected: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The tensors of the safetensors file ``path``, refused unless their names and shapes are ``expected``'s (a
    module's ``state_dict()``): missing, unexpected and mis-shaped names are given in the message."""
    state = load_tensors(path)
    if set(state) != set(expected):
        missing, extra = sorted(set(expected) - set(state)), sorted(set(state) - set(expected))
        raise SpectrainError(f"{path} does not match its config: missing {missing[:4]}, unexpected {extra[:4]}")
    wrong = [k for k, v in state.items() if v.shape != expected[k].shape]
    if wrong:
        raise SpectrainError(f"{path} has tensors of the wrong shape for its config: {wrong[:4]}")
    return state


def save_drafter_dir(out_dir: str | os.PathLike, state: dict[str, torch.Tensor], config: dict) -> Path:
    """A drafter in our run-dir format: ``model.safetensors`` (``config["method"]`` in its metadata) then
    ``config.json``, each atomically; the config is written last, so a directory with it holds a complete drafter."""
    out_dir = Path(out_dir)
    save_tensors(out_dir / "model.safetensors", state, metadata={"format": "pt", "method": config["method"]})
    write_json(out_dir / "config.json", config)
    return out_dir


def read_drafter_config(path: str | os.PathLike, config_cls, methods, kind: str):
    """The ``config_cls`` of a drafter :func:`save_drafter_dir` wrote at ``path``: refused unless its method is one
    of ``methods`` (``kind`` names what was expected), and with the path when the config itself is refused."""
    path = Path(path)
    if not (path / "config.json").is_file():
        raise SpectrainError(f"not a spectrain drafter directory (no config.json): {path}")
    raw = read_json(path / "config.json", "drafter config")
    if raw.get("method") not in methods:
        raise SpectrainError(f"{path} holds a {raw.get('method')!r} drafter, not {kind}")
    try:
        return config_cls(**{k: v for k, v in raw.items() if k in config_cls.__dataclass_fields__})
    except SpectrainError as err:
        raise SpectrainError(f"{path}/config.json: {err}") from None
