"""``spectrain-distill``'s output, shared by its local loop and its served path: the ShareGPT rows, the settings
they were made with (``OUT.meta.json``, the resume key), what is already written (a torn last line dropped), the
conversations still to do, and the loop filter every reply passes."""

from __future__ import annotations

import json
import os
from pathlib import Path

from spectrain.heads.errors import SpectrainError
from spectrain.heads.io import write_json

ROLE_TO_SHAREGPT = {"user": "human", "assistant": "gpt", "system": "system"}


def prompts_of(record: dict, max_turns: int) -> tuple[str | None, list[str]]:
    """(system prompt or None, the first ``max_turns`` user turns) of any supported chat record."""
    system, pairs = turns_of(record, max_turns)
    return system, [user for user, _ in pairs]


def turns_of(record: dict, max_turns: int) -> tuple[str | None, list[tuple[str, str]]]:
    """(system prompt or None, the first ``max_turns`` (user turn, the dataset's reply to it or "") pairs)."""
    from .chat import all_messages

    messages = all_messages(record)
    system = messages[0]["content"] if messages and messages[0]["role"] == "system" else None
    pairs = []
    for i, m in enumerate(messages):
        if m["role"] == "user" and m["content"].strip():
            nxt = messages[i + 1] if i + 1 < len(messages) else None
            pairs.append((m["content"], nxt["content"] if nxt and nxt["role"] == "assistant" else ""))
    return system, pairs[:max_turns]


def prompt_length(tokenizer, history: list[dict]) -> int:
    """Tokens of the chat-templated prompt the verifier would answer."""
    text = tokenizer.apply_chat_template(history, add_generation_prompt=True, tokenize=False)
    return len(tokenizer(text, add_special_tokens=False)["input_ids"])


def original_replies(tokenizer, replies: list[str], max_new_tokens: int) -> list[str]:
    """The dataset's own replies cut at ``max_new_tokens`` verifier tokens (the raw twin of a distilled set)."""
    out = []
    for reply in replies:
        ids = tokenizer(reply, add_special_tokens=False)["input_ids"]
        out.append(reply if len(ids) <= max_new_tokens else tokenizer.decode(ids[:max_new_tokens]).strip())
    return out


def looping(ids: list[int], min_repeats: int = 3, min_span: int = 24, max_period: int = 64) -> bool:
    """Whether a reply (token ids) ends in a verbatim loop: its last ``p`` tokens repeat at least ``min_repeats``
    times back to back for some period ``p <= max_period``, covering at least ``min_span`` tokens (so a short
    run such as a row of dashes does not count)."""
    n = len(ids)
    for p in range(1, min(max_period, n // min_repeats) + 1):
        tail, r = ids[n - p:], 1
        while (r + 1) * p <= n and ids[n - (r + 1) * p:n - r * p] == tail:
            r += 1
        if r >= min_repeats and r * p >= min_span:
            return True
    return False


def distinct_n(replies: list[list[int]], n: int = 4) -> float:
    """Distinct n-grams / all n-grams over the replies (token ids): 1.0 never repeats, loops push it to 0."""
    grams = [tuple(ids[i:i + n]) for ids in replies for i in range(len(ids) - n + 1)]
    return len(set(grams)) / len(grams) if grams else 0.0


def read_done(out: Path) -> set[int]:
    """Ids already written; truncates a torn last line (a crash mid-write) so appends stay valid JSONL."""
    if not out.is_file():
        return set()
    data = out.read_bytes()
    keep = data if data.endswith(b"\n") or not data else data[:data.rfind(b"\n") + 1]
    if len(keep) != len(data):
        with open(out, "r+b") as f:
            f.truncate(len(keep))
    done = set()
    for i, line in enumerate(keep.decode("utf-8").split("\n"), 1):
        if line.strip():
            try:
                done.add(int(json.loads(line)["id"]))
            except (json.JSONDecodeError, KeyError, ValueError):
                raise SpectrainError(f"{out}, line {i}: not a spectrain-distill row; use another --out") from None
    return done


META_RECORDS = ("served_runs",)  # kept in OUT.meta.json beside the settings, not part of the resume key


def prepare_output(out: Path, settings: dict, served_run: dict | None = None) -> set[int]:
    """Check ``out`` against its ``.meta.json`` (other settings refused), write the settings (and, for a served run,
    append ``served_run`` to its ``served_runs``: which endpoints answered, the check's outcome) and return the ids
    already written. The endpoints are not part of the resume key: a rerun with other servers resumes."""
    meta_path = out.with_name(out.name + ".meta.json")
    old = {}
    if meta_path.is_file():
        old = json.loads(meta_path.read_text())
        if {k: v for k, v in old.items() if k not in META_RECORDS} != settings:
            raise SpectrainError(f"{out} was generated with other settings ({meta_path}); use another --out")
    elif out.is_file() and out.stat().st_size:
        raise SpectrainError(f"{out} exists without {meta_path.name}: not a spectrain-distill output; use another --out")
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = dict(settings)
    if served_run is not None or old.get("served_runs"):
        meta["served_runs"] = old.get("served_runs", []) + ([served_run] if served_run is not None else [])
    write_json(meta_path, meta)
    return read_done(out)


def conversations_todo(records: list[dict], settings: dict, done: set[int]) -> tuple[list[tuple], int]:
    """(the (id, system prompt, [(user turn, dataset reply)]) not yet in the output, how many have no user turn)."""
    original = settings.get("responses") == "original"
    todo, skipped = [], 0
    for i, record in enumerate(records):
        system, pairs = turns_of(record, settings["max_turns"])
        if original and any(not reply.strip() for _, reply in pairs):
            pairs = pairs[:next(k for k, (_, reply) in enumerate(pairs) if not reply.strip())]
        if not pairs:
            skipped += 1
        elif i not in done:
            todo.append((i, system, pairs))
    return todo, skipped


def row_of(i: int, history: list[dict], looped: bool, settings: dict) -> dict:
    """One output row: the conversation as ShareGPT turns and the settings it was generated with."""
    row = {"id": i, "conversations": [{"from": ROLE_TO_SHAREGPT[m["role"]], "value": m["content"]} for m in history],
           "generation": settings}
    if looped:
        row["stopped_by_loop"] = True
    return row


def append_rows(f, rows: list[dict]) -> None:
    """Whole rows appended and synced: a row is on disk whole or (a torn last line) dropped on resume."""
    f.write("".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows))
    f.flush()
    os.fsync(f.fileno())
