"""Chat data for drafter training: load, normalise, render with a loss mask.

A drafter learns to predict what the verifier would say as the *assistant*, so
only assistant tokens are training targets. The pipeline is:

* :func:`load_records` reads a local ``.json`` / ``.jsonl`` file into dicts;
* :func:`to_messages` turns one record (ShareGPT, OpenAI ``messages``, Alpaca,
  MT-bench ``turns``, GSM8K ``question``/``answer``) into OpenAI-style ``[{"role", "content"}]`` messages;
* :func:`render_chat` renders messages with the tokenizer's own chat template
  and marks which tokens are assistant targets;
* :func:`tokenize_chat_file` does all three for a file and counts skipped rows and rows cut at the block size
  (:mod:`spectrain.data.truncation`).

Every error is a :class:`SpectrainError` whose message names the file (and the
row or line where one is known), so the command line can print it as is.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, NamedTuple

from spectrain.heads.errors import SpectrainError

from .truncation import Truncation

# Keys under which a top-level JSON object may hold its list of records
# (the shapes ``datasets`` exports and most hub dumps use).
LIST_KEYS = ("data", "train", "rows")

# ShareGPT speaker names in the wild, mapped onto OpenAI roles.
SHAREGPT_ROLES = {
    "human": "user", "user": "user",
    "gpt": "assistant", "assistant": "assistant", "chatgpt": "assistant", "bing": "assistant", "bard": "assistant",
    "system": "system",
}
OPENAI_ROLES = ("system", "user", "assistant")


# --------------------------------------------------------------------------- loading


def load_records(path: str) -> list[dict]:
    """Read chat records from a local ``.json`` or ``.jsonl`` file.

    ``.json`` holds a list of objects, or an object with that list under one of
    ``"data"``, ``"train"`` or ``"rows"``; ``.jsonl`` (or ``.ndjson``) holds one
    object per line, blank lines allowed.
    """
    p = Path(path)
    if not p.is_file():
        raise SpectrainError(f"chat data file not found: {path}")
    try:
        text = p.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise SpectrainError(f"chat data file {path} is not UTF-8 text: {e}") from None
    if not text.strip():
        raise SpectrainError(f"chat data file {path} is empty")
    suffix = p.suffix.lower()
    if suffix in (".jsonl", ".ndjson"):
        records = _parse_jsonl(text, path)
    elif suffix == ".json":
        records = _parse_json(text, path)
    else:
        raise SpectrainError(f"chat data file {path} must end in .json or .jsonl, not {p.suffix or '(no suffix)'!r}")
    if not records:
        raise SpectrainError(f"chat data file {path} is empty: it holds no records")
    return records


def _parse_json(text: str, path: str) -> list[dict]:
    """Records of a whole-file JSON document."""
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        # A JSONL file saved as .json fails with "Extra data" on line 2: say so.
        hint = "; if it holds one object per line, name it .jsonl" if e.msg == "Extra data" else ""
        raise SpectrainError(f"chat data file {path} is not valid JSON: {e}{hint}") from None
    if isinstance(obj, dict):
        key = next((k for k in LIST_KEYS if isinstance(obj.get(k), list)), None)
        if key is None:
            raise SpectrainError(f"chat data file {path} must hold a list of objects, or an object with that list "
                                 f"under one of {list(LIST_KEYS)}; its top-level keys are {sorted(obj)}")
        obj = obj[key]
    if not isinstance(obj, list):
        raise SpectrainError(f"chat data file {path} must hold a list of objects, not a JSON {type(obj).__name__}")
    for i, row in enumerate(obj):
        if not isinstance(row, dict):
            raise SpectrainError(f"chat data file {path}: record {i} is a JSON {type(row).__name__}, not an object")
    return obj


def _parse_jsonl(text: str, path: str) -> list[dict]:
    """Records of a one-object-per-line file; errors give the 1-based line number."""
    records = []
    # JSON lines end at "\n" only: str.splitlines() would also cut at U+2028, U+0085, \x1c... inside strings.
    for lineno, line in enumerate(text.split("\n"), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise SpectrainError(f"chat data file {path}, line {lineno}: not valid JSON: {e}") from None
        if not isinstance(row, dict):
            raise SpectrainError(f"chat data file {path}, line {lineno}: a JSON {type(row).__name__}, not an object")
        records.append(row)
    return records


# --------------------------------------------------------------------------- normalising


def to_messages(record: dict) -> list[dict] | None:
    """Normalise one record to OpenAI-style ``[{"role": ..., "content": str}]``.

    Returns ``None`` when the record has no assistant turn with non-empty
    content (nothing to train on); the caller counts those as skipped. Leading
    assistant turns and a trailing non-assistant turn are dropped: the first has
    no prompt to answer and no template can render the empty context before it,
    the second has nothing to learn after it.
    """
    messages = all_messages(record)
    while messages and messages[0]["role"] == "assistant":
        messages.pop(0)
    while messages and messages[-1]["role"] != "assistant":
        messages.pop()
    if not any(m["role"] == "assistant" and m["content"] for m in messages):
        return None
    return messages


def all_messages(record: Any) -> list[dict]:
    """All messages of a record in OpenAI form, whatever its source format."""
    if not isinstance(record, dict):
        raise SpectrainError(f"a chat record must be a JSON object, not a {type(record).__name__}")
    if "conversations" in record:
        return _from_sharegpt(record["conversations"])
    if "messages" in record:
        return _from_openai(record["messages"])
    if "instruction" in record:
        return _from_alpaca(record)
    if "turns" in record:
        return _from_turns(record["turns"])
    if "question" in record:
        return _from_question(record)
    raise SpectrainError("unrecognised chat record format: expected 'conversations' (ShareGPT), 'messages' (OpenAI), "
                         "'instruction'/'output' (Alpaca), 'turns' (MT-bench) or 'question'/'answer' (GSM8K); "
                         f"the record has keys {sorted(record)}")


def _from_sharegpt(turns: Any) -> list[dict]:
    """ShareGPT ``conversations``: ``{"from", "value"}`` (some dumps use ``role``/``content``)."""
    _require_list(turns, "conversations")
    out = []
    for i, turn in enumerate(turns):
        if not isinstance(turn, dict):
            raise SpectrainError(f"conversations[{i}] must be an object, not a {type(turn).__name__}")
        speaker = turn.get("from", turn.get("role"))
        role = SHAREGPT_ROLES.get(str(speaker).lower()) if isinstance(speaker, str) else None
        if role is None:
            raise SpectrainError(f"conversations[{i}] has unknown role {speaker!r}; known: {sorted(SHAREGPT_ROLES)}")
        out.append({"role": role, "content": _text(turn.get("value", turn.get("content")), f"conversations[{i}]")})
    return out


def _from_openai(messages: Any) -> list[dict]:
    """OpenAI ``messages``: ``{"role", "content"}``."""
    _require_list(messages, "messages")
    out = []
    for i, msg in enumerate(messages):
        if not isinstance(msg, dict):
            raise SpectrainError(f"messages[{i}] must be an object, not a {type(msg).__name__}")
        role = msg.get("role")
        if role not in OPENAI_ROLES:
            raise SpectrainError(f"messages[{i}] has unknown role {role!r}; known: {list(OPENAI_ROLES)}")
        out.append({"role": role, "content": _text(msg.get("content"), f"messages[{i}]")})
    return out


def _from_alpaca(record: dict) -> list[dict]:
    """Alpaca: ``instruction``, optional ``input`` (appended after a blank line), ``output``."""
    user = _text(record.get("instruction"), "instruction")
    extra = _text(record.get("input"), "input")
    if extra.strip():
        user = f"{user}\n\n{extra}"
    return [{"role": "user", "content": user}, {"role": "assistant", "content": _text(record.get("output"), "output")}]


def _from_question(record: dict) -> list[dict]:
    """GSM8K-style ``question`` and optional ``answer``."""
    messages = [{"role": "user", "content": _text(record.get("question"), "question")}]
    if record.get("answer") is not None:
        messages.append({"role": "assistant", "content": _text(record.get("answer"), "answer")})
    return messages


def _from_turns(turns: Any) -> list[dict]:
    """MT-bench ``turns``: user prompts only (evaluation data, so no assistant turn)."""
    _require_list(turns, "turns")
    return [{"role": "user", "content": _text(t, f"turns[{i}]")} for i, t in enumerate(turns)]


def _require_list(value: Any, key: str) -> None:
    if not isinstance(value, list):
        raise SpectrainError(f"'{key}' must be a list, not a {type(value).__name__}")


def _text(value: Any, where: str) -> str:
    """Message content as a string.

    ``None`` (e.g. an assistant message that only made tool calls) counts as
    empty; OpenAI content-part lists keep their text parts.
    """
    if value is None:
        return ""
    if isinstance(value, str):
        return value
    if isinstance(value, list) and all(isinstance(p, dict) for p in value):
        return "".join(p.get("text", "") for p in value if p.get("type", "text") == "text")
    raise SpectrainError(f"{where}: content must be a string, not a {type(value).__name__}")


# --------------------------------------------------------------------------- rendering


class RenderedChat(NamedTuple):
    """One conversation rendered and cut to ``max_length``, with what the cut took.

    ``row`` is ``{"input_ids": [...], "loss_mask": [...]}`` (at most ``max_length`` tokens); ``length`` the full
    render's tokens; ``loss_tokens`` its loss-masked tokens before the cut, ``kept_loss_tokens`` those in ``row``.
    """

    row: dict
    length: int
    loss_tokens: int
    kept_loss_tokens: int

    @property
    def cut(self) -> bool:
        return self.length > len(self.row["input_ids"])

    def count_into(self, truncation: Truncation) -> None:
        """Add this row to a :class:`~spectrain.data.truncation.Truncation` counter."""
        truncation.add(self.length, self.loss_tokens, self.kept_loss_tokens)


def render_chat(messages: list[dict], tokenizer, max_length: int) -> dict:
    """Render ``messages`` with the tokenizer's chat template and mark the assistant targets.

    Returns ``{"input_ids": [...], "loss_mask": [...]}``, equally long and at
    most ``max_length`` tokens (cut from the right). ``loss_mask[t] == 1`` means
    token ``t`` is a training target: it belongs to an assistant message's
    content or to the end-of-turn marker the template writes right after it
    (the model must learn to stop). Role headers, system and user text are 0.
    :func:`render_chat_measured` also says what the cut took.
    """
    return render_chat_measured(messages, tokenizer, max_length).row


def render_chat_measured(messages: list[dict], tokenizer, max_length: int) -> RenderedChat:
    """:func:`render_chat`'s row with the full render's length and loss tokens (one render, one tokenization)."""
    if max_length < 1:
        raise SpectrainError(f"max_length must be at least 1, got {max_length}")
    _check_tokenizer(tokenizer)
    if messages and messages[0].get("role") == "assistant":
        # Chat templates cannot render the empty conversation before it, so its
        # span is unknowable; to_messages drops such turns.
        raise SpectrainError("a conversation must not start with an assistant message")
    text = _apply_template(tokenizer, messages, add_generation_prompt=False)
    spans = assistant_char_spans(messages, tokenizer, text)
    enc = tokenizer(text, return_offsets_mapping=True, add_special_tokens=False)
    ids = list(enc["input_ids"])
    mask = _mask_from_offsets(enc["offset_mapping"], spans)  # the whole render's: what the cut drops is counted
    kept = mask[:max_length]
    return RenderedChat({"input_ids": ids[:max_length], "loss_mask": kept}, len(ids), sum(mask), sum(kept))


def assistant_char_spans(messages: list[dict], tokenizer, text: str) -> list[tuple[int, int]]:
    """Character spans of ``text`` (the full render) that the assistant writes.

    For assistant message ``i`` the span runs from the end of the render of
    ``messages[:i]`` with the generation prompt (so the role header is context)
    to the end of the render of ``messages[:i+1]``, less trailing whitespace (the
    newline templates put between turns is not something the model emits).
    """
    spans = []
    for i, msg in enumerate(messages):
        if msg.get("role") != "assistant":
            continue
        prefix = _apply_template(tokenizer, messages[:i], add_generation_prompt=True)
        full = _apply_template(tokenizer, messages[: i + 1], add_generation_prompt=False)
        if not (text.startswith(prefix) and text.startswith(full) and len(full) >= len(prefix)):
            raise SpectrainError(
                f"the chat template of {_tokenizer_name(tokenizer)} is not prefix-consistent: rendering the first "
                f"{i + 1} messages is not a prefix of rendering all {len(messages)} (e.g. it rewrites earlier turns), "
                "so assistant tokens cannot be located")
        end = max(len(prefix), len(full.rstrip()))
        if end > len(prefix):
            spans.append((len(prefix), end))
    return spans


def _mask_from_offsets(offsets: list[tuple[int, int]], spans: list[tuple[int, int]]) -> list[int]:
    """1 for each token whose character span overlaps an assistant span.

    Offsets and spans both increase along the text, so one pass suffices.
    """
    mask, j = [], 0
    for start, end in offsets:
        while j < len(spans) and spans[j][1] <= start:
            j += 1
        overlaps = j < len(spans) and start < spans[j][1] and end > spans[j][0]
        mask.append(int(overlaps))
    return mask


def _check_tokenizer(tokenizer) -> None:
    """Offsets need a fast tokenizer; rendering needs a chat template."""
    name = _tokenizer_name(tokenizer)
    if not getattr(tokenizer, "chat_template", None):
        raise SpectrainError(f"tokenizer of {name} has no chat template; chat data needs one to render "
                             "conversations (use a chat/instruct model's tokenizer or set tokenizer.chat_template)")
    if not getattr(tokenizer, "is_fast", False):
        raise SpectrainError(f"tokenizer of {name} is a slow (Python) tokenizer; chat data needs a fast one for "
                             "character offsets (load it with use_fast=True)")


def _apply_template(tokenizer, messages: list[dict], add_generation_prompt: bool) -> str:
    """The template's text for ``messages``; template errors become SpectrainError."""
    try:
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    except Exception as e:  # jinja's TemplateError, raise_exception() in templates, ValueError from transformers
        raise SpectrainError(f"the chat template of {_tokenizer_name(tokenizer)} failed on a conversation with roles "
                             f"{[m.get('role') for m in messages]}: {e}") from None
    if not isinstance(text, str):
        raise SpectrainError(f"the chat template of {_tokenizer_name(tokenizer)} did not render to text")
    return text


def _tokenizer_name(tokenizer) -> str:
    """Where the tokenizer came from, or its class for one built in memory."""
    return getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__


# --------------------------------------------------------------------------- files


@dataclass(frozen=True)
class ChatTokenized:
    """Tokenized rows of a chat file, how many rows gave nothing to train on, and what the block size cut.

    ``truncation`` counts every conversation with an assistant turn (those that lost every target to the cut,
    and so are also in ``skipped``, included). Unpacks as two values, ``rows, skipped = tokenize_chat_file(...)``
    (a tuple of three would not: callers written before the count read two).
    """

    rows: list[dict]
    skipped: int
    truncation: Truncation

    def __iter__(self) -> Iterator:
        return iter((self.rows, self.skipped))


def tokenize_chat_file(path: str, tokenizer, max_length: int) -> ChatTokenized:
    """Load, normalise and render every record of ``path``.

    A row is skipped when it has no non-empty assistant turn, or when truncation
    to ``max_length`` leaves no target token. Raises when every row is skipped.
    """
    records = load_records(path)
    rows, no_assistant, truncated = [], 0, 0
    truncation = Truncation(max_length)
    for i, record in enumerate(records):
        try:
            messages = to_messages(record)
            rendered = None if messages is None else render_chat_measured(messages, tokenizer, max_length)
        except SpectrainError as e:
            raise SpectrainError(f"chat data file {path}, record {i}: {e}") from None
        if rendered is None:
            no_assistant += 1
            continue
        rendered.count_into(truncation)
        if rendered.kept_loss_tokens == 0:
            truncated += 1
        else:
            rows.append(rendered.row)
    if not rows:
        raise SpectrainError(_nothing_usable(path, len(records), no_assistant, truncated, max_length))
    return ChatTokenized(rows, no_assistant + truncated, truncation)


def _nothing_usable(path: str, n: int, no_assistant: int, truncated: int, max_length: int) -> str:
    """Why a file gave no training rows, by cause."""
    if truncated == 0:
        return f"no usable conversations in {path}: all {n} rows lack an assistant turn"
    return (f"no usable conversations in {path}: {no_assistant} of {n} rows lack an assistant turn and {truncated} "
            f"lose every assistant token to truncation at max_length={max_length}")
