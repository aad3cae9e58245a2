"""Plain text -> fixed-length token blocks, tokenization cached by ``datasets``."""

from __future__ import annotations

from pathlib import Path

from spectrain.heads.errors import SpectrainError

VAL_FRACTION = 0.1  # the held-out share of a text file's lines (the bundled text's too)


def split_text(text: str, val_fraction: float = VAL_FRACTION) -> tuple[str, str]:
    """Contiguous split: the last ``val_fraction`` of the lines is held out.

    Splitting on a line boundary keeps the two halves identical whether the text
    is read whole (here) or line by line (``datasets`` in the data module).
    """
    if not 0.0 < val_fraction < 1.0:
        raise SpectrainError(f"val_fraction must be in (0, 1), got {val_fraction}")
    lines = text.splitlines(keepends=True)
    cut = split_index(len(lines), val_fraction)
    return "".join(lines[:cut]), "".join(lines[cut:])


def split_index(num_lines: int, val_fraction: float = VAL_FRACTION) -> int:
    """Index of the first held-out line."""
    return num_lines - max(1, int(round(num_lines * val_fraction)))


def check_text_file(path: str | Path) -> Path:
    path = Path(path).expanduser()
    if not path.is_file():
        raise SpectrainError(f"text data file not found: {path}")
    if path.stat().st_size == 0:
        raise SpectrainError(f"text data file is empty: {path}")
    try:
        with open(path, encoding="utf-8") as f:
            while f.read(1 << 20):
                pass
    except UnicodeDecodeError as e:
        raise SpectrainError(f"text data file {path} is not UTF-8 text ({e.reason} at byte {e.start})") from None
    return path


def tokenize_lines(tokenizer, lines: list[str]) -> list[int]:
    """Token ids of ``lines`` (each keeps its newline), tokenized line by line and concatenated.

    Line-by-line is how the data module tokenizes (one ``datasets`` row per line),
    so the bundled verifier is trained on exactly the token stream drafters see.
    """
    ids: list[int] = []
    for row in tokenizer(lines, add_special_tokens=False)["input_ids"]:
        ids.extend(row)
    return ids


def text_blocks(path: str | Path, tokenizer, block_size: int, val_fraction: float = VAL_FRACTION):
    """Train and validation ``datasets.Dataset`` of ``input_ids`` blocks of ``block_size`` tokens.

    The split is contiguous: the last ``val_fraction`` of the lines is held out
    (the same split :func:`split_text` gives).
    """
    import datasets

    path = check_text_file(path)
    lines = datasets.load_dataset("text", data_files=str(path), split="train", keep_linebreaks=True)
    if len(lines) < 2:
        raise SpectrainError(f"text data file {path} has {len(lines)} line(s); need at least 2 to hold one out")
    cut = split_index(len(lines), val_fraction)
    splits = {"train": lines.select(range(cut)), "validation": lines.select(range(cut, len(lines)))}

    def tokenize(batch):
        return {"ids": tokenizer(batch["text"], add_special_tokens=False)["input_ids"]}

    def group(batch):
        flat = [t for row in batch["ids"] for t in row]
        n = len(flat) // block_size * block_size
        return {"input_ids": [flat[i:i + block_size] for i in range(0, n, block_size)]}

    out = {}
    for name, ds in splits.items():
        ds = ds.map(tokenize, batched=True, remove_columns=["text"], desc=f"tokenizing {path.name} ({name})")
        # One batch for the whole split so no tokens are lost at batch boundaries.
        ds = ds.map(group, batched=True, batch_size=len(ds), remove_columns=["ids"], desc=f"blocks of {block_size}")
        if len(ds) == 0:
            raise SpectrainError(f"the {name} split of {path} has fewer than block_size={block_size} tokens")
        out[name] = ds
    return out["train"], out["validation"]
