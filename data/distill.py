"""``spectrain-distill``: regenerate the assistant turns of a chat dataset with the verifier (self-distillation).

Drafters accept more when they learn the verifier's own outputs rather than some other model's (the data
recipe of self-distillation). This takes prompts from ShareGPT / ``messages`` / Alpaca / MT-bench-style
files, keeps the user turns (the first ``--max_turns``), and has the verifier answer each one in turn — a
later turn sees the verifier's earlier answers — in batches (left-padded ``generate()``, similar prompt lengths together), greedy or sampled.
``--responses original`` writes the raw twin instead: the same conversations and turns with the dataset's own
replies cut at the same token cap, so raw and self-distilled training sets differ only in who wrote the replies.

Sampled distillation (``--temperature 0.8``, as the reference toolkits regenerate) avoids most of the repetition
loops that greedy decoding of a small verifier falls into; the loop filter (:func:`looping`) catches the rest: a
reply whose tail repeats itself verbatim ends its conversation there (that turn and later ones are not kept — a
later turn would be conditioned on the loop) and is counted. ``--report FILE ...`` prints the mix of finished
outputs (conversations, reply tokens, distinct-4 of the kept replies, loops dropped) without generating anything.

Output: ShareGPT-style JSONL, one row per source conversation: ``{"id", "conversations": [{"from": "human" |
"gpt" | "system", "value"}], "generation": {settings}}`` plus ``OUT.meta.json`` with the settings. Resumable:
rows are appended a batch at a time and synced; a rerun with the same settings reads what is there (a torn last
line from a crash is dropped), skips finished ids and continues — no row is lost or written twice. Other settings
on an existing output are refused.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch

from spectrain.heads.errors import SpectrainError, run_command
from spectrain.heads.io import write_json
from spectrain.heads.report import finish, format_table

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


@torch.no_grad()
def answer_batch(model, tokenizer, histories: list[list[dict]], max_new_tokens: int, temperature: float,
                 generator_seed: int) -> list[str]:
    """One generated assistant reply per chat history (batched, left-padded; greedy or sampled at
    ``temperature`` from the full distribution)."""
    prompts = [tokenizer.apply_chat_template(h, add_generation_prompt=True, tokenize=False) for h in histories]
    enc = tokenizer(prompts, return_tensors="pt", padding=True, add_special_tokens=False).to(model.device)
    generator = torch.Generator(device=model.device).manual_seed(generator_seed)
    rows = generate_batch(model, enc["input_ids"], enc["attention_mask"], max_new_tokens, temperature, generator,
                          stop_ids(model, tokenizer))
    return [tokenizer.decode(row, skip_special_tokens=True).strip() for row in rows]


def stop_ids(model, tokenizer) -> list[int]:
    """Every id that ends a reply: the tokenizer's EOS and the generation config's (often a list)."""
    ids = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    ids = [ids] if isinstance(ids, int) else list(ids or [])
    return sorted({i for i in ids + [tokenizer.eos_token_id] if i is not None})


def generate_batch(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, max_new_tokens: int,
                   temperature: float, generator: torch.Generator, stops: list[int]) -> list[list[int]]:
    """(B, T) left-padded prompts -> B lists of new token ids (up to and excluding the first stop id).

    Our own loop rather than ``generate()``: logits only at the last position (the prefill of a whole batch
    otherwise projects every position onto the vocabulary), and sampling by inverse CDF over the probabilities
    (one uniform per row; the cumulative sum in fp64 so no token's width rounds to zero) instead of a
    vocabulary-sized exponential draw per row and step — together ~2x the tokens per second of ``generate()``
    on a CPU, same distribution.
    """
    from transformers import DynamicCache

    batch = input_ids.shape[0]
    cache = DynamicCache()
    positions = (attention_mask.cumsum(-1) - 1).clamp_min(0)
    logits = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=positions, past_key_values=cache,
                   use_cache=True, logits_to_keep=1).logits[:, -1]
    done = torch.zeros(batch, dtype=torch.bool, device=input_ids.device)
    stop = torch.tensor(stops or [-1], device=input_ids.device)
    new = []
    for step in range(max_new_tokens):
        if temperature == 0:
            token = logits.argmax(-1)
        else:
            cdf = torch.softmax(logits.double() / temperature, -1).cumsum(-1)
            u = torch.rand(batch, 1, generator=generator, device=cdf.device) * cdf[:, -1:]
            token = torch.searchsorted(cdf, u)[:, 0].clamp_max(cdf.shape[-1] - 1)
        token = token.masked_fill(done, int(stop[0]) if stops else 0)
        new.append(token)
        done |= torch.isin(token, stop)
        if bool(done.all()) or step + 1 == max_new_tokens:
            break
        attention_mask = torch.cat([attention_mask, attention_mask.new_ones(batch, 1)], 1)
        positions = positions[:, -1:] + 1
        logits = model(input_ids=token[:, None], attention_mask=attention_mask, position_ids=positions,
                       past_key_values=cache, use_cache=True).logits[:, -1]
    out = torch.stack(new, 1).tolist()
    ends = set(stops)
    return [row[:next((i for i, t in enumerate(row) if t in ends), len(row))] for row in out]


def distill(verifier, records: list[dict], out: Path, settings: dict, batch_size: int, log=print) -> dict:
    """Generate for every record not yet in ``out``; returns counts."""
    model, tokenizer = verifier.model, verifier.tokenizer
    original = settings.get("responses") == "original"
    if not getattr(tokenizer, "chat_template", None):
        raise SpectrainError(f"verifier {settings['verifier']} has no chat template: self-distillation needs one")
    tokenizer.padding_side = "left"
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    meta_path = out.with_name(out.name + ".meta.json")
    if meta_path.is_file():
        old = json.loads(meta_path.read_text())
        if old != settings:
            raise SpectrainError(f"{out} was generated with other settings ({meta_path}); use another --out")
    elif out.is_file() and out.stat().st_size:
        raise SpectrainError(f"{out} exists without {meta_path.name}: not a spectrain-distill output; use another --out")
    out.parent.mkdir(parents=True, exist_ok=True)
    write_json(meta_path, settings)
    done = read_done(out)
    todo = []
    skipped = 0
    for i, record in enumerate(records):
        system, pairs = turns_of(record, settings["max_turns"])
        if original and any(not reply.strip() for _, reply in pairs):
            pairs = pairs[:next(k for k, (_, reply) in enumerate(pairs) if not reply.strip())]
        if not pairs:
            skipped += 1
        elif i not in done:
            todo.append((i, system, pairs))
    # Similar prompt lengths share a batch: left padding to the longest prompt is wasted compute.
    todo.sort(key=lambda item: (len(item[2][0][0]), item[0]))
    t0, tokens, written, loops, too_long = time.time(), 0, 0, 0, 0
    max_prompt = settings.get("max_prompt_tokens")
    with open(out, "a", encoding="utf-8") as f:
        for b in range(0, len(todo), batch_size):
            batch = todo[b:b + batch_size]
            histories = [([{"role": "system", "content": s}] if s else []) for _, s, _ in batch]
            stopped, looped = [False] * len(batch), [False] * len(batch)
            for turn in range(max(len(u) for _, _, u in batch)):
                active = [j for j, (_, _, u) in enumerate(batch) if turn < len(u) and not stopped[j]]
                for j in active:
                    histories[j].append({"role": "user", "content": batch[j][2][turn][0]})
                if max_prompt:  # a prompt past the training block would leave its reply untrained: not asked
                    for j in [j for j in active if prompt_length(tokenizer, histories[j]) > max_prompt]:
                        histories[j].pop()
                        stopped[j] = True
                        too_long += turn == 0
                        active.remove(j)
                if not active:
                    break
                if original:
                    replies = original_replies(tokenizer, [batch[j][2][turn][1] for j in active],
                                               settings["max_new_tokens"])
                else:
                    replies = answer_batch(model, tokenizer, [histories[j] for j in active],
                                           settings["max_new_tokens"], settings["temperature"],
                                           settings["seed"] + batch[0][0] * 1000 + turn)
                for j, reply in zip(active, replies):
                    ids = tokenizer(reply, add_special_tokens=False)["input_ids"]
                    if not original and looping(ids):
                        histories[j].pop()  # the user turn goes with the loop; later turns are not asked
                        stopped[j] = looped[j] = True
                        loops += 1
                        continue
                    histories[j].append({"role": "assistant", "content": reply})
                    tokens += len(ids)
            for (i, _, _), history, loop in zip(batch, histories, looped):
                row = {"id": i, "conversations": [{"from": ROLE_TO_SHAREGPT[m["role"]], "value": m["content"]}
                                                  for m in history], "generation": settings}
                if loop:
                    row["stopped_by_loop"] = True
                f.write(json.dumps(row, ensure_ascii=False) + "\n")
            f.flush()
            os.fsync(f.fileno())  # a batch is either on disk whole or (torn last line) dropped on resume
            written += len(batch)
            log(f"distill: {len(done) + written}/{len(records) - skipped} conversations, " + (
                f"{tokens} reply tokens written (the dataset's own)" if original else
                f"{tokens / max(time.time() - t0, 1e-9):.1f} generated tokens/s"))
    return {"already_done": len(done), "written": written, "skipped_without_user_turn": skipped,
            "generated_tokens": tokens, "loops_dropped": loops, "prompt_too_long": too_long, "seconds": round(time.time() - t0, 1)}


def mix(paths: list[str], tokenizer) -> list[dict]:
    """Per file (and all together): conversations with a kept reply, kept reply turns and tokens, distinct-4 of
    the kept replies, conversations the loop filter stopped."""
    from .chat import load_records, to_messages

    stats, every = [], []
    for path in paths:
        replies, conversations, loops = [], 0, 0
        for record in load_records(path):
            loops += bool(record.get("stopped_by_loop"))
            messages = to_messages(record)
            if messages is None:
                continue
            conversations += 1
            replies += [tokenizer(m["content"], add_special_tokens=False)["input_ids"] for m in messages
                        if m["role"] == "assistant" and m["content"]]
        every += replies
        stats.append({"data": str(path), "conversations": conversations, "replies": len(replies),
                      "reply_tokens": sum(map(len, replies)), "distinct4": round(distinct_n(replies), 4),
                      "stopped_by_loop": loops})
    if len(paths) > 1:
        stats.append({"data": "all", "conversations": sum(s["conversations"] for s in stats),
                      "replies": len(every), "reply_tokens": sum(map(len, every)),
                      "distinct4": round(distinct_n(every), 4), "stopped_by_loop": sum(s["stopped_by_loop"] for s in stats)})
    return stats


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="spectrain-distill", description=__doc__.split("\n")[0])
    p.add_argument("--verifier", default="bundled:smollm2")
    p.add_argument("--gguf_file", default=None)
    p.add_argument("--data", nargs="+", help="chat files (ShareGPT, messages, Alpaca, GSM8K, MT-bench turns)")
    p.add_argument("--report", nargs="+", metavar="FILE", default=None,
                   help="print the mix of finished chat files (conversations, reply tokens, distinct-4, loops) and exit")
    p.add_argument("--limit", type=int, nargs="+", default=None,
                   help="first N conversations of each --data file (one number per file, or one for all)")
    p.add_argument("--out", help="output .jsonl (ShareGPT rows); with --report: the summary JSON")
    p.add_argument("--max_turns", type=int, default=2, help="user turns kept per conversation")
    p.add_argument("--max_new_tokens", type=int, default=256)
    p.add_argument("--max_prompt_tokens", type=int, default=None,
                   help="skip a conversation whose first templated prompt is longer, and stop one before a later turn "
                        "that would be (set it to the training block size minus the reply cap: a longer prompt leaves "
                        "its reply cut off in training); default: no limit")
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    p.add_argument("--responses", default="verifier", choices=["verifier", "original"],
                   help="verifier: regenerate the replies (self-distillation); original: keep the dataset's replies "
                        "cut at --max_new_tokens tokens (the raw twin: same conversations, same turns, same cap)")
    p.add_argument("--batch_size", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default="auto", help="verifier dtype: auto (bf16 on CUDA and on CPUs with native bf16 "
                   "matmuls, fp32 elsewhere), float32 or bfloat16")
    return p.parse_args(argv)


def report(args) -> Path:
    """``--report``: the mix of finished files, as a table and JSON (``--out`` or next to the first file)."""
    from spectrain.heads.verifier import load_tokenizer

    stats = mix(args.report, load_tokenizer(args.verifier, gguf_file=args.gguf_file))
    table = format_table(["data", "conversations", "replies", "reply tokens", "distinct-4", "stopped by loop"],
                         [[Path(s["data"]).name, s["conversations"], s["replies"], s["reply_tokens"], s["distinct4"],
                           s["stopped_by_loop"]] for s in stats], title=f"chat data mix ({args.verifier} tokens)")
    out = Path(args.out) if args.out else Path(args.report[0]).with_suffix(".mix.json")
    return finish({"verifier": args.verifier, "mix": stats}, out, [table])


def run(args) -> Path:
    from spectrain.heads.verifier import load_verifier, resolve_dtype

    from .chat import load_records

    if args.report:
        return report(args)
    if not args.data or not args.out:
        raise SpectrainError("--data and --out are required (or --report FILE ... to read finished files)")

    for key in ("max_turns", "max_new_tokens", "batch_size", "max_prompt_tokens"):
        if getattr(args, key) is not None and getattr(args, key) < 1:
            raise SpectrainError(f"--{key} must be >= 1, got {getattr(args, key)}")
    if args.temperature < 0:
        raise SpectrainError(f"--temperature must be >= 0, got {args.temperature}")
    if args.device == "cpu":
        from spectrain.heads.host_memory import keep_freed_memory

        keep_freed_memory()  # batched generation allocates the same large buffers every step
    limits = args.limit or [None]
    if len(limits) not in (1, len(args.data)):
        raise SpectrainError(f"--limit takes one number or one per --data file ({len(args.data)}), got {len(limits)}")
    records = []
    for k, path in enumerate(args.data):
        rows = load_records(path)
        limit = limits[k] if len(limits) > 1 else limits[0]
        records += rows[:limit] if limit else rows
    if not records:
        raise SpectrainError("no conversations in --data")
    settings = {"verifier": args.verifier, "data": [str(Path(d).name) for d in args.data], "limit": args.limit,
                "max_turns": args.max_turns, "max_new_tokens": args.max_new_tokens, "temperature": args.temperature,
                "seed": args.seed}
    if args.max_prompt_tokens:  # only when set: outputs made before this option resume unchanged
        settings["max_prompt_tokens"] = args.max_prompt_tokens
    if args.responses == "original":  # nothing is generated: temperature and seed do not apply
        settings.update(responses="original", temperature=None, seed=None)
    verifier = load_verifier(args.verifier, gguf_file=args.gguf_file, device=args.device,
                             dtype=resolve_dtype(args.dtype, args.device))
    out = Path(args.out)
    counts = distill(verifier, records, out, settings, args.batch_size)
    rows = [json.loads(line) for line in out.read_text(encoding="utf-8").split("\n") if line.strip()]
    ids = [r["id"] for r in rows]
    summary = {**counts, "rows": len(rows), "unique_ids": len(set(ids)), "out": str(out.resolve()), **settings}
    table = format_table(["", "value"], [["rows in output", len(rows)], ["written this run", counts["written"]],
                                         ["already there", counts["already_done"]],
                                         ["conversations stopped by the loop filter", counts["loops_dropped"]],
                                         ["conversations skipped: prompt too long", counts["prompt_too_long"]],
                                         ["reply tokens written", counts["generated_tokens"]] if args.responses == "original"
                                         else ["generated tokens/s", round(counts["generated_tokens"] /
                                                                           max(counts["seconds"], 1e-9), 1)]],
                         title=(f"raw twin (the dataset's replies, cut at {args.max_new_tokens} tokens of {args.verifier}'s "
                                f"tokenizer; nothing generated) -> {out}" if args.responses == "original"
                                else f"self-distillation with {args.verifier} -> {out}"))
    return finish(summary, out.with_name(out.name + ".summary.json"), [table])


def main(argv=None) -> None:
    run_command(run, parse_args(argv))


if __name__ == "__main__":
    main()
