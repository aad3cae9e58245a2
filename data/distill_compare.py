"""``spectrain-distill`` run the same way against several paths, for ``benchmarks/distill_engines.py``: the local
batched loop and serving engines (``--server``) on the same prompts and caps, their replies compared and, where an
engine's reply parts from the local one, both paths' margins at the first differing token.

What a parting means is judged in :mod:`spectrain.data.engine` (``first_parting``, ``kernel_spread``,
``Parting.near_tie``); this module makes the runs and reads them back.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from pathlib import Path

from spectrain.data import distill as distill_mod
from spectrain.data.distill_rows import prompts_of
from spectrain.data.engine import Endpoint, Parting, cut_at_stop, first_parting, local_greedy
from spectrain.heads.errors import SpectrainError


@dataclass(frozen=True)
class Comparison:
    """What every run of a comparison shares: the verifier, the data files and how many records of each
    (``limit``), the reply cap, and the local loop's batch. Every run is greedy (T = 0), fp32, on the CPU, one
    turn per conversation."""
    verifier: str
    data: tuple[str, ...]
    limit: int
    max_new_tokens: int
    batch_size: int


def distill_args(c: Comparison, out: Path, server: str | None = None, in_flight: int = 1,
                 **changes) -> argparse.Namespace:
    """spectrain-distill's settings for one timed run writing ``out`` (through ``server`` with ``in_flight``
    requests where given, else the local loop): its defaults with the comparison's values and ``changes``; an
    earlier run's output is removed first (it would resume)."""
    for stale in (out, out.with_name(out.name + ".meta.json"), out.with_name(out.name + ".summary.json")):
        stale.unlink(missing_ok=True)
    args = distill_mod.parse_args([])  # every flag at its default
    unknown = sorted(set(changes) - set(vars(args)))
    if unknown:
        raise SpectrainError(f"spectrain-distill has no setting {unknown}")
    vars(args).update(verifier=c.verifier, data=list(c.data), limit=c.limit, max_turns=1,
                      max_new_tokens=c.max_new_tokens, dtype="float32", device="cpu", out=str(out),
                      batch_size=c.batch_size, **({"server": [server], "in_flight": in_flight} if server else {}),
                      **changes)
    return args


def timed_distill(args: argparse.Namespace) -> float:
    """Generated tokens/s of one spectrain-distill run (its summary's own count and seconds)."""
    summary = json.loads(distill_mod.run(args).read_text())
    return summary["generated_tokens"] / max(summary["seconds"], 1e-9)


def replies_of(path: Path) -> dict:
    """{(conversation id, turn): reply text} of a distill output."""
    rows = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    return {(r["id"], k): t["value"] for r in rows
            for k, t in enumerate(x for x in r["conversations"] if x["from"] == "gpt")}


def prompt_ids(c: Comparison, tokenizer, cid: int) -> list[int]:
    """The first turn's prompt of conversation ``cid`` rendered as spectrain-distill renders it."""
    from spectrain.data.chat import load_records

    records = [r for path in c.data for r in load_records(path)[:c.limit]]
    system, users = prompts_of(records[cid], 1)
    history = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": users[0]}]
    text = tokenizer.apply_chat_template(history, add_generation_prompt=True, tokenize=False)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def margins_at_parting(endpoint: Endpoint, model, tokenizer, prompt: list[int], n: int,
                       stops: list[int]) -> Parting | None:
    """Both paths' top-2 margins at the first token where the engine's greedy reply leaves the local one."""
    mine = local_greedy(model, prompt, n, stops)
    served = endpoint.complete(prompt, n, 0.0, None, top_logprobs=2)
    ids = served.token_ids if served.token_ids is not None else tokenizer(served.text, add_special_tokens=False)["input_ids"]
    return first_parting(mine.ids, mine.margins, cut_at_stop(ids, stops)[:n], served.margin)


def self_parting(reference: Endpoint, prompt: list[int], other_reply: str, tokenizer, n: int,
                 stops: list[int]) -> Parting | None:
    """Where the 1-slot engine's greedy reply leaves its own N-slot reply (re-tokenized), with the 1-slot engine's
    margin there (``served_margin``; no local side)."""
    served = reference.complete(prompt, n, 0.0, None, top_logprobs=2)
    ids = cut_at_stop(served.token_ids, stops) if served.token_ids is not None else tokenizer(
        served.text, add_special_tokens=False)["input_ids"]
    return first_parting(ids, [], tokenizer(other_reply, add_special_tokens=False)["input_ids"], served.margin)


def check_against(c: Comparison, url: str, out_dir: Path) -> dict:
    """The served-verifier check of spectrain-distill against one endpoint (one record, its output under
    ``out_dir``): passed, or caught with its message."""
    probe = Path(out_dir) / f"check-{url.rsplit(':', 1)[1]}.jsonl"
    try:
        distill_mod.run(distill_args(c, probe, url, 1, limit=1))
        return {"outcome": "passed"}
    except SpectrainError as e:
        return {"outcome": "caught", "message": str(e)}
