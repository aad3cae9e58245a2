"""Evaluation prompts: MT-bench / Alpaca-80 ``turns`` jsonl, instruction records, plain text, or the
bundled held-out tinyshakespeare text. A prompt is a list of user turns."""

from __future__ import annotations

from pathlib import Path

from spectrain.heads.errors import SpectrainError

BUNDLED = "bundled:tinyshakespeare"


def load_prompts(spec: str, limit: int | None = None, tokenizer=None, prompt_tokens: int = 64,
                 first_turns: bool = False, spread: bool = False) -> list[list[str]]:
    """Prompts as lists of turns.

    ``bundled:tinyshakespeare`` cuts the held-out split into consecutive pieces of ``prompt_tokens`` tokens
    (needs ``tokenizer``); ``.jsonl``/``.json`` rows use ``turns``, ``instruction`` (+ ``input``), ``prompt`` or
    ``text``; any other file gives one prompt per blank-line-separated paragraph. ``spread``: rows taken
    round-robin over their ``category`` (MT-bench: 2 per category for 16), as ``spectrain-results`` picks them;
    ``first_turns``: each prompt's first turn only.
    """
    if spec == BUNDLED:
        return _bundled(limit or 20, tokenizer, prompt_tokens)
    path = Path(spec).expanduser()
    if not path.is_file():
        raise SpectrainError(f"prompts file not found: {path}")
    text = path.read_text(encoding="utf-8", errors="strict") if path.stat().st_size else ""
    if not text.strip():
        raise SpectrainError(f"prompts file is empty: {path}")
    if path.suffix in (".jsonl", ".json"):
        prompts = [turns for turns, _ in prompt_rows(path, spread)]
    else:
        prompts = [[p.strip()] for p in text.split("\n\n") if p.strip()]
    if not prompts:
        raise SpectrainError(f"no prompts in {path}")
    prompts = [p[:1] for p in prompts] if first_turns else prompts
    return prompts[:limit] if limit else prompts


def prompt_rows(path: str | Path, spread: bool = False) -> list[tuple[list[str], str | None]]:
    """Every record of a JSON / JSONL prompt file as (its turns, its ``category`` or None): the one reader of
    prompt records (``turns``, else ``instruction`` + ``input``, else ``prompt`` / ``question`` / ``text``).
    ``spread``: rows ordered round-robin over their categories."""
    from spectrain.data.chat import load_records  # JSON/JSONL reader with named errors

    path = Path(path)
    rows = load_records(str(path))
    out = [(_turns(row, path, i), row.get("category") if isinstance(row, dict) else None) for i, row in enumerate(rows)]
    return [out[i] for i in spread_over_categories([c for _, c in out])] if spread else out


def spread_over_categories(categories: list) -> list[int]:
    """Row indices ordered round-robin over their categories (in order of first appearance): the first row of
    each category, then the second of each, ... — any prefix covers the categories evenly."""
    by_category: dict = {}
    for i, category in enumerate(categories):
        by_category.setdefault(category or "none", []).append(i)
    depth = max((len(v) for v in by_category.values()), default=0)
    return [rows[d] for d in range(depth) for rows in by_category.values() if d < len(rows)]


def _turns(row, path: Path, i: int) -> list[str]:
    if isinstance(row, str):
        return [row]
    if not isinstance(row, dict):
        raise SpectrainError(f"{path}, record {i}: expected an object, got {type(row).__name__}")
    if isinstance(row.get("turns"), list) and row["turns"]:
        return [str(t) for t in row["turns"]]
    if row.get("instruction"):
        extra = row.get("input") or ""
        return [row["instruction"] + ("\n\n" + extra if extra else "")]
    for key in ("prompt", "question", "text"):
        if isinstance(row.get(key), str) and row[key].strip():
            return [row[key]]
    raise SpectrainError(f"{path}, record {i}: no prompt field (turns, instruction, prompt, question or text); "
                         f"keys: {sorted(row)}")


def _bundled(limit: int, tokenizer, prompt_tokens: int) -> list[list[str]]:
    from spectrain.data.bundled import bundled_text_path
    from spectrain.data.text import split_text

    if tokenizer is None:
        raise SpectrainError("bundled prompts need the verifier's tokenizer")
    _, held_out = split_text(bundled_text_path().read_text())
    ids = tokenizer(held_out, add_special_tokens=False)["input_ids"]
    stride = max(prompt_tokens, len(ids) // max(limit, 1))
    pieces = [ids[s:s + prompt_tokens] for s in range(0, len(ids) - prompt_tokens, stride)][:limit]
    return [[tokenizer.decode(p)] for p in pieces]
