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
from dataclasses import dataclass
from pathlib import Path

import torch

from spectrain.heads.errors import SpectrainError, run_command
from spectrain.heads.report import finish, format_table

from .distill_rows import (append_rows, conversations_todo, distinct_n, looping, original_replies,
                           prepare_output, prompt_length, row_of)

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
    done = prepare_output(out, settings)
    todo, skipped = conversations_todo(records, settings, done)
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
            append_rows(f, [row_of(i, history, loop, settings)
                            for (i, _, _), history, loop in zip(batch, histories, looped)])
            written += len(batch)
            log(f"distill: {len(done) + written}/{len(records) - skipped} conversations, " + (
                f"{tokens} reply tokens written (the dataset's own)" if original else
                f"{tokens / max(time.time() - t0, 1e-9):.1f} generated tokens/s"))
    return {"already_done": len(done), "written": written, "skipped_without_user_turn": skipped,
            "generated_tokens": tokens, "loops_dropped": loops, "prompt_too_long": too_long, "seconds": round(time.time() - t0, 1)}


# --------------------------------------------------------------------------- replies from serving engines


@dataclass
class ServedAsk:
    """How replies are asked of the endpoints: the verifier's tokenizer renders every prompt with its own chat
    template (``api == "completions"``: sent as token ids, or as text with ``prompt_format == "text"``); with
    ``api == "chat completions"`` the engine renders the messages itself (checked against ours first)."""

    tokenizer: object
    stops: list[int]
    api: str
    prompt_format: str

    def prompt(self, history: list[dict]) -> list[int] | str:
        text = self.tokenizer.apply_chat_template(history, add_generation_prompt=True, tokenize=False)
        return self.tokenizer(text, add_special_tokens=False)["input_ids"] if self.prompt_format == "ids" else text

    def ask(self, endpoint, history: list[dict], max_new_tokens: int, temperature: float, seed: int | None,
            top_logprobs: int = 0):
        if self.api == "chat completions":
            return endpoint.chat(history, max_new_tokens, temperature, seed, top_logprobs)
        return endpoint.complete(self.prompt(history), max_new_tokens, temperature, seed, top_logprobs)

    def reply(self, endpoint, history: list[dict], settings: dict, seed: int | None) -> tuple[str, list[int]]:
        """(the reply text as the local loop writes it, its token ids): from the engine's ids where it returns
        them (decoded here exactly as the local loop decodes), else its text and that text re-tokenized."""
        from .engine import cut_at_stop

        max_new = settings["max_new_tokens"]
        completion = self.ask(endpoint, history, max_new, settings["temperature"], seed)
        if completion.token_ids is not None:
            ids = cut_at_stop(completion.token_ids, self.stops)[:max_new]
            return self.tokenizer.decode(ids, skip_special_tokens=True).strip(), ids
        reply = completion.text.strip()
        return reply, self.tokenizer(reply, add_special_tokens=False)["input_ids"]


REFUSALS_TO_STOP = 8  # refused first requests (at least a pool's worth, no fewer than answered) that stop a run


@dataclass
class Conversation:
    """One finished conversation of a served run: its row and what it counted."""

    row: dict
    tokens: int = 0
    looped: bool = False
    prompt_too_long: bool = False
    refused: str | None = None  # the engine's 4xx message for the turn it refused
    refused_turn: int | None = None
    refused_by: str | None = None  # the endpoint's URL


def converse(endpoint, item: tuple, ask: ServedAsk, settings: dict) -> Conversation:
    """One conversation's turns in order on one endpoint (each turn sees the earlier replies), the loop filter and
    the prompt cap as the local loop applies them. Seeds: ``seed + id * 1000 + turn`` per conversation turn."""
    from .engine import RequestRefused

    i, system, pairs = item
    history = [{"role": "system", "content": system}] if system else []
    result = Conversation(row={})
    max_prompt = settings.get("max_prompt_tokens")
    for turn, (user, _) in enumerate(pairs):
        history.append({"role": "user", "content": user})
        if max_prompt and prompt_length(ask.tokenizer, history) > max_prompt:
            history.pop()
            result.prompt_too_long = turn == 0
            break
        try:
            reply, ids = ask.reply(endpoint, history, settings, settings["seed"] + i * 1000 + turn)
        except RequestRefused as e:  # this conversation's request (e.g. past the engine's context): the others go on
            history.pop()
            result.refused, result.refused_turn, result.refused_by = f"HTTP {e.code}: {e.message}", turn, endpoint.url
            break
        if looping(ids):
            history.pop()
            result.looped = True
            break
        history.append({"role": "assistant", "content": reply})
        result.tokens += len(ids)
    result.row = row_of(i, history, result.looped, settings)
    return result


def distill_served(endpoints: list, ask: ServedAsk, records: list[dict], out: Path, settings: dict,
                   served_run: dict, in_flight: int, log=print) -> dict:
    """:func:`distill` with the replies from OpenAI-compatible endpoints: ``in_flight`` conversations per endpoint
    from one shared queue, each conversation one unit of work on one endpoint, rows appended whole (and synced) by
    this thread as conversations finish; an endpoint that goes down is dropped and its conversations requeued.

    A request the engine refuses (4xx) ends that conversation only: refused at its first turn it is counted and not
    written (a rerun asks again), at a later turn its earlier turns are written. When refusals are the rule (at
    least :data:`REFUSALS_TO_STOP` and a full pool's worth, and no fewer than the conversations answered), the run
    stops with the engine's message: that is a setting the engine rejects, not a conversation."""
    from .engine import run_pool

    done = prepare_output(out, settings, served_run)
    todo, skipped = conversations_todo(records, settings, done)
    counts = {"written": 0, "generated_tokens": 0, "loops_dropped": 0, "prompt_too_long": 0, "refused": 0,
              "turns_refused": 0}
    refusals: dict[str, int] = {}
    pool_size = in_flight * len(endpoints)
    t0 = time.time()
    with open(out, "a", encoding="utf-8") as f:
        def write(item: tuple, conversation: Conversation) -> None:
            if conversation.refused:
                refusals[conversation.refused] = refusals.get(conversation.refused, 0) + 1
                if conversation.refused_turn == 0:
                    counts["refused"] += 1
                    # refusals come back at once while an answer holds its slot for its whole generation: judged
                    # only after a full pool's worth of conversations (every slot once) has been refused
                    if counts["refused"] >= max(REFUSALS_TO_STOP, pool_size) and counts["refused"] >= counts["written"]:
                        raise SpectrainError(
                            f"the engine refused {counts['refused']} conversations' first request (answered: "
                            f"{counts['written']}); {conversation.refused_by} said: {conversation.refused}. Everything answered so far "
                            "is on disk: mend the setting it names and rerun the same command to resume")
                    return
                counts["turns_refused"] += 1
            append_rows(f, [conversation.row])
            counts["written"] += 1
            counts["generated_tokens"] += conversation.tokens
            counts["loops_dropped"] += conversation.looped
            counts["prompt_too_long"] += conversation.prompt_too_long
            if counts["written"] % 50 == 0 or counts["written"] + counts["refused"] == len(todo):
                log(f"distill: {len(done) + counts['written']}/{len(records) - skipped} conversations, "
                    f"{counts['generated_tokens'] / max(time.time() - t0, 1e-9):.1f} generated tokens/s")

        pool = run_pool(endpoints, in_flight, todo, lambda endpoint, item: converse(endpoint, item, ask, settings),
                        write, log)
    return {"already_done": len(done), **counts, "skipped_without_user_turn": skipped,
            "seconds": round(time.time() - t0, 1), "finished_by_endpoint": pool.finished,
            "dropped_endpoints": pool.dropped, "refusals": refusals}


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
                   "matmuls, fp32 elsewhere), float32 or bfloat16; with --server the engine's dtype, in which the local "
                   "verifier answers the served-verifier check")
    p.add_argument("--block_size", type=int, default=None,
                   help="the training block size the output is for: the summary counts conversations whose full "
                        "rendered chat is longer (training would cut them) and their assistant tokens lost")
    s = p.add_argument_group("replies from OpenAI-compatible serving engines (vLLM, SGLang, llama-server, TGI)")
    s.add_argument("--server", action="append", metavar="URL", default=None,
                   help="an endpoint (http://host:port); repeat for several sharing one queue of conversations")
    s.add_argument("--in_flight", type=int, default=8, help="conversations in flight per endpoint")
    s.add_argument("--served_model", default=None, help="the model name to ask for (default: the one /v1/models lists)")
    s.add_argument("--api_key", default=None, help="sent as a Bearer token (default: $OPENAI_API_KEY if set)")
    s.add_argument("--prompt_format", choices=["ids", "text"], default="ids",
                   help="how a prompt rendered with the verifier's chat template is sent to /v1/completions: token ids "
                        "(vLLM, SGLang, llama-server) or its text (TGI, which takes no ids)")
    s.add_argument("--chat_completions", action="store_true",
                   help="ask /v1/chat/completions instead (the engine renders the chat), after checking through the "
                        "engine's /tokenize that its template renders the same ids as ours")
    s.add_argument("--skip_verifier_check", action="store_true",
                   help="do not compare the served model with the verifier (its weights are then not loaded locally, "
                        "only its tokenizer); recorded in the output's metadata")
    s.add_argument("--near_tie", type=float, default=None,
                   help="the check's near-tie bound on top-1 minus top-2 margins (default by --dtype: bf16 0.5, "
                        "fp16 0.0625, fp32 0.02)")
    s.add_argument("--check_tokens", type=int, default=32, help="greedy tokens per probe of the check")
    s.add_argument("--request_timeout", type=float, default=600.0, help="seconds per request")
    s.add_argument("--retries", type=int, default=3,
                   help="retries of a request that fails by connection, timeout or 5xx before its endpoint is dropped")
    s.add_argument("--retry_backoff", type=float, default=1.0, help="seconds before the first retry, doubling")
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
    from .chat import load_records

    if args.report:
        return report(args)
    if not args.data or not args.out:
        raise SpectrainError("--data and --out are required (or --report FILE ... to read finished files)")

    for key in ("max_turns", "max_new_tokens", "batch_size", "max_prompt_tokens", "block_size", "in_flight",
                "check_tokens"):
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
    out = Path(args.out)
    if args.server:
        counts, tokenizer, served = run_served(args, records, settings, out)
    else:
        from spectrain.heads.precision import resolve_dtype
        from spectrain.heads.verifier import load_verifier

        verifier = load_verifier(args.verifier, gguf_file=args.gguf_file, device=args.device,
                                 dtype=resolve_dtype(args.dtype, args.device))
        counts, tokenizer, served = distill(verifier, records, out, settings, args.batch_size), verifier.tokenizer, None
    rows = [json.loads(line) for line in out.read_text(encoding="utf-8").split("\n") if line.strip()]
    ids = [r["id"] for r in rows]
    summary = {**counts, "rows": len(rows), "unique_ids": len(set(ids)), "out": str(out.resolve()), **settings}
    lines = [["rows in output", len(rows)], ["written this run", counts["written"]],
             ["already there", counts["already_done"]],
             ["conversations stopped by the loop filter", counts["loops_dropped"]],
             ["conversations skipped: prompt too long", counts["prompt_too_long"]],
             ["reply tokens written", counts["generated_tokens"]] if args.responses == "original"
             else ["generated tokens/s", round(counts["generated_tokens"] / max(counts["seconds"], 1e-9), 1)]]
    tables = []
    if served is not None:
        summary["served"] = served
        lines += [[f"conversations finished on {url} (answered or refused)", n]
                  for url, n in counts["finished_by_endpoint"].items()]
        lines += [[f"dropped {url}", why] for url, why in counts["dropped_endpoints"].items()]
        lines += [["conversations refused by the engine (not written)", counts["refused"]],
                  ["conversations cut at a refused later turn", counts["turns_refused"]]]
        lines += [[f"refusal x{n}", message[:100]] for message, n in counts["refusals"].items()]
        lines.append(["served-verifier check", check_line(served["verifier_check"])])
    if args.block_size:
        truncation = count_truncation(rows, tokenizer, args.block_size)
        summary["truncation"] = truncation.record()
        warning = truncation.warning(f"distilled conversations at --block_size {args.block_size}")
        summary["truncation_warning"] = warning
        lines += [[f"conversations longer than block_size={args.block_size}", f"{truncation.rows_cut} of {truncation.rows}"],
                  ["assistant tokens training would cut", f"{truncation.loss_tokens_cut} of {truncation.loss_tokens}"]]
        if warning:
            print(f"warning: {warning}")
    title = (f"raw twin (the dataset's replies, cut at {args.max_new_tokens} tokens of {args.verifier}'s tokenizer; "
             f"nothing generated) -> {out}" if args.responses == "original"
             else f"self-distillation with {args.verifier}" + (f" served by {len(args.server)} endpoint(s)"
                                                              if args.server else "") + f" -> {out}")
    tables.insert(0, format_table(["", "value"], lines, title=title))
    return finish(summary, out.with_name(out.name + ".summary.json"), tables)


def count_truncation(rows: list[dict], tokenizer, block_size: int):
    """The output's conversations rendered as training renders them, against ``block_size``: rows cut and the
    assistant (loss) tokens the cut loses (rows without a kept reply are not trained on and not counted)."""
    from .chat import render_chat_measured, to_messages
    from .truncation import Truncation

    truncation = Truncation(block_size)
    for row in rows:
        messages = to_messages(row)
        if messages is not None:
            render_chat_measured(messages, tokenizer, block_size).count_into(truncation)
    return truncation


def check_line(check: dict) -> str:
    """The served-verifier check in one table cell."""
    if check.get("skipped"):
        return "skipped (--skip_verifier_check)"
    ties = sum(len(e["near_ties"]) for e in check["endpoints"].values())
    return f"passed ({check['probes']} probes per endpoint, {ties} near-tie parting(s) allowed)"


def tokenizer_stops(verifier: str, tokenizer) -> list[int]:
    """:func:`stop_ids` without the model's weights: the tokenizer's EOS and the ``generation_config.json`` beside
    the verifier where it has one (said when it has none)."""
    from transformers import GenerationConfig

    from spectrain.heads.verifier import resolve_verifier

    try:
        config = GenerationConfig.from_pretrained(resolve_verifier(verifier))
    except (OSError, ValueError):
        print(f"distill: {verifier} has no generation_config.json: replies end at the tokenizer's EOS only")
        config = None
    return stop_ids(type("Model", (), {"generation_config": config})(), tokenizer)


def run_served(args, records: list[dict], settings: dict, out: Path) -> tuple[dict, object, dict]:
    """``--server``: endpoints resolved, the served-verifier check (unless skipped), then :func:`distill_served`.
    Returns (counts, the verifier's tokenizer, the served record kept in the metadata and the summary)."""
    from spectrain.heads.precision import resolve_dtype
    from spectrain.heads.verifier import load_tokenizer, load_verifier

    from .engine import NEAR_TIE, Endpoint

    if args.responses == "original":
        raise SpectrainError("--responses original writes the dataset's own replies: there is nothing to ask --server")
    if args.retries < 0 or args.request_timeout <= 0:
        raise SpectrainError("--retries must be >= 0 and --request_timeout > 0")
    api_key = args.api_key or os.environ.get("OPENAI_API_KEY")
    endpoints = [Endpoint(url, api_key, args.request_timeout, args.retries, args.retry_backoff)
                 for url in dict.fromkeys(args.server)]
    for endpoint in endpoints:
        endpoint.resolve_model(args.served_model)
    api = "chat completions" if args.chat_completions else "completions"
    settings["generator"] = {"api": api} if args.chat_completions else {
        "api": api, "prompt": "token ids" if args.prompt_format == "ids" else "text"}
    dtype = resolve_dtype(args.dtype, args.device)
    near_tie = args.near_tie if args.near_tie is not None else NEAR_TIE[str(dtype).removeprefix("torch.")]
    model = None
    if args.skip_verifier_check:  # a 70B verifier need not be loaded here: its tokenizer renders the prompts
        tokenizer = load_tokenizer(args.verifier, gguf_file=args.gguf_file)
        stops = tokenizer_stops(args.verifier, tokenizer)
    else:
        verifier = load_verifier(args.verifier, gguf_file=args.gguf_file, device=args.device, dtype=dtype)
        model, tokenizer = verifier.model, verifier.tokenizer
        stops = stop_ids(model, tokenizer)
    if not getattr(tokenizer, "chat_template", None):
        raise SpectrainError(f"verifier {args.verifier} has no chat template: self-distillation needs one")
    ask = ServedAsk(tokenizer, stops, api, args.prompt_format)
    served = {"endpoints": [e.url for e in endpoints], "models": {e.url: e.model for e in endpoints}, "api": api,
              "prompt": None if args.chat_completions else args.prompt_format, "in_flight": args.in_flight}
    if args.chat_completions:
        served["chat_template_check"] = check_chat_templates(endpoints, tokenizer)
    if model is None:
        served["verifier_check"] = {"skipped": True, "why": "--skip_verifier_check: the served model was not "
                                    "compared with the verifier"}
    else:
        served["verifier_check"] = check_served_verifier(endpoints, ask, model, str(dtype).removeprefix("torch."),
                                                         near_tie, args.check_tokens)
        del verifier, model  # loaded for the check only
    counts = distill_served(endpoints, ask, records, out, settings, served, args.in_flight)
    served.update(finished_by_endpoint=counts["finished_by_endpoint"], dropped_endpoints=counts["dropped_endpoints"])
    return counts, tokenizer, served


def check_served_verifier(endpoints: list, ask: ServedAsk, model, dtype: str, near_tie: float,
                          max_new_tokens: int) -> dict:
    """Every endpoint's greedy continuations of the fixed probes against the local verifier's (see
    :func:`spectrain.data.engine.check_endpoint`); a parting that is not a near-tie is a SpectrainError."""
    from .engine import PROBES, check_endpoint, local_greedy

    histories = [[{"role": "user", "content": probe}] for probe in PROBES]
    tokenizer = ask.tokenizer
    local = [local_greedy(model, tokenizer(tokenizer.apply_chat_template(h, add_generation_prompt=True, tokenize=False),
                                           add_special_tokens=False)["input_ids"], max_new_tokens, ask.stops)
             for h in histories]

    def generate(endpoint, k: int):
        return ask.ask(endpoint, histories[k], max_new_tokens, 0.0, None, top_logprobs=2)

    return {"probes": len(PROBES), "tokens": max_new_tokens, "dtype": dtype, "near_tie": near_tie,
            "endpoints": {e.url: check_endpoint(e, generate, tokenizer, local, ask.stops, near_tie, max_new_tokens)
                          for e in endpoints}}


def check_chat_templates(endpoints: list, tokenizer) -> dict:
    """``--chat_completions``: each engine's own rendering of a probe conversation (through its ``/tokenize``) must
    be the ids our chat template gives, else a SpectrainError naming the first differing position."""
    probe = [{"role": "system", "content": "You are a helpful assistant."},
             {"role": "user", "content": "What is the capital of France?"},
             {"role": "assistant", "content": "Paris."}, {"role": "user", "content": "And of Spain?"}]
    ours = tokenizer(tokenizer.apply_chat_template(probe, add_generation_prompt=True, tokenize=False),
                     add_special_tokens=False)["input_ids"]
    record = {}
    for endpoint in endpoints:
        rendered = endpoint.rendered_chat(probe)
        if rendered is None:
            raise SpectrainError(f"{endpoint.url} has no /tokenize that renders a chat (vLLM's /tokenize with "
                                 "messages, llama-server's /apply-template), so its chat template cannot be checked "
                                 "against the verifier's: drop --chat_completions (prompts are then rendered here "
                                 "and sent to /v1/completions)")
        theirs, how = rendered
        if theirs != ours:
            j = next((k for k, (a, b) in enumerate(zip(ours, theirs)) if a != b), min(len(ours), len(theirs)))

            def token(ids: list[int]) -> str:
                return f"{ids[j]} {tokenizer.decode([ids[j]])!r}" if j < len(ids) else "<end>"

            raise SpectrainError(f"{endpoint.url} renders a chat with another template than the verifier's: its ids "
                                 f"({how}) part from ours at token {j} of {len(ours)}: ours {token(ours)}, the "
                                 f"engine's {token(theirs)}; drop --chat_completions (prompts are then rendered here) "
                                 "or serve the verifier's template")
        record[endpoint.url] = {"equal": True, "tokens": len(ours), "how": how}
    return record


def main(argv=None) -> None:
    run_command(run, parse_args(argv))


if __name__ == "__main__":
    main()
