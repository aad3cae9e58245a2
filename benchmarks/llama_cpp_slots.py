"""Acceptance at two slots in llama.cpp (benchmark, not a test): does a drafter accept on each prompt what it accepts
alone when the server's other slot decodes a different prompt at the same time?

    python benchmarks/llama_cpp_slots.py --llama_cpp LLAMA_CPP_DIR --drafter pretrained/smollm2-eagle3 \\
        --prompts mt_bench.jsonl --num_prompts 5 --max_new_tokens 96 --k 2 \\
        [--patched alloc=DIR] [--trace DIR] [--probe_slot 1]

One ``llama-server`` (``-np 2``, the f32 target our drafters were trained on, T = 0, ``--spec-draft-n-max K
--spec-draft-p-min 0``) per configuration; each decodes every prompt alone, then every neighbouring pair of
different prompts in both start orders, then each prompt beside itself (``spectrain.eval.llama_cpp_slots``).
Configurations: the pinned build with the draft's backend sampling on (llama.cpp's default) and off
(``--no-spec-draft-backend-sampling``, our serving advice), and each ``--patched NAME=DIR`` (a copy of
``build/bin`` built with a patch from docs/upstream/, loading its own libraries). Per prompt and configuration:
accepted/drafted alone, beside other prompts, beside itself; the verdict: every pairing within ``--tolerance``
(10 %) of the solo count, and every output equal to plain greedy decoding's.

``--probe_slot S``: a layer probe (``spectrain.eval.layer_probe``: its first draft is the sign of one coordinate
of the fused layer in aux slot S) through the same schedule at draft 1; its accepted count per prompt is
predicted exactly from *its own* sequence's features, so a probe that misses the prediction beside another
prompt drafts from something else than its own features.

``--trace DIR``: a build with docs/upstream/llama-cpp-speculative-trace.patch, run with ``SPEC_TRACE`` set; the
JSON then says whose feature rows each slot's draft encoded (equal to the solo run's) and in how many draft steps
of two slots on different prompts the two candidate lists were identical (``trace_summary``).
"""

from __future__ import annotations

import argparse
import shlex
import sys
import time
from pathlib import Path

from spectrain.eval.decode_dtype import cpu_record
from spectrain.eval.engine_compare import f32_target, first_turns, generation_eos, strip_eos
from spectrain.eval.layer_probe import choose_probe, default_probe_layers, layer_probe, probe_prediction
from spectrain.eval.llama_cpp_server import LLAMA_CPP_VERSION, LlamaServer, binary_version, find_binary
from spectrain.eval.llama_cpp_slots import NO_BACKEND_SAMPLING, run_schedule, slot_rows, trace_summary
from spectrain.eval.runs import encode_turn
from spectrain.heads.errors import SpectrainError, run_command
from spectrain.heads.report import finish, format_table
from spectrain.heads.serving.cli import target_gguf_for
from spectrain.heads.serving.eagle_gguf import write_eagle3_gguf
from spectrain.heads.serving.formats import import_drafter
from spectrain.heads.serving.gguf import write_draft_gguf
from spectrain.heads.verifier import load_verifier, resolve_verifier


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python benchmarks/llama_cpp_slots.py", description=__doc__.split("\n")[0])
    p.add_argument("--llama_cpp", default=None, help="the pinned build: a directory with llama-server (or a "
                                                     "llama.cpp tree with build/bin)")
    p.add_argument("--patched", action="append", default=[], metavar="NAME=DIR",
                   help="a patched build (a copy of build/bin), run with the draft's backend sampling on")
    p.add_argument("--trace", default=None, metavar="DIR", help="a build with the trace patch (SPEC_TRACE)")
    p.add_argument("--verifier", default="bundled:smollm2")
    p.add_argument("--drafter", required=True, help="an EAGLE-3 drafter directory (written as its GGUF here)")
    p.add_argument("--prompts", required=True, help="MT-bench / Alpaca jsonl (the first turn of each row is used)")
    p.add_argument("--num_prompts", type=int, default=5)
    p.add_argument("--max_new_tokens", type=int, default=96)
    p.add_argument("--k", type=int, default=2, help="draft length (--spec-draft-n-max)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--probe_slot", type=int, default=None, help="also run a layer probe reading this aux slot")
    p.add_argument("--tolerance", type=float, default=0.10)
    p.add_argument("--out", default="runs/llama_cpp_slots")
    return p.parse_args(argv)


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else list(argv)
    run_command(run, parse_args(argv), shlex.join(["python", "benchmarks/llama_cpp_slots.py", *argv]))


def without_tokens(counts: dict) -> dict:
    return {key: v for key, v in counts.items() if key != "tokens"}


def builds(args) -> list[tuple[str, Path, list[str]]]:
    """(name, llama-server, extra flags) of every configuration, the pinned build's two first."""
    pinned = find_binary("llama-server", args.llama_cpp)
    out = [("pinned", pinned, []), ("pinned, draft backend sampling off", pinned, [NO_BACKEND_SAMPLING])]
    for spec in args.patched:
        if "=" not in spec:
            raise SpectrainError(f"--patched expects NAME=DIR, got {spec!r}")
        name, path = spec.split("=", 1)
        out.append((f"patched: {name}", find_binary("llama-server", path), []))
    return out


def run(args, command: str = "") -> Path:
    start = time.time()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    configs = builds(args)
    loaded = load_verifier(resolve_verifier(args.verifier), dtype="float32")
    verifier, tokenizer = loaded.model, loaded.tokenizer
    eos = generation_eos(verifier)
    source = target_gguf_for(args.verifier)
    target = f32_target(args.verifier, source, out)
    prompts = first_turns(args.prompts, args.num_prompts, out / "prompts.json", tokenizer)
    prompt_ids = [encode_turn(tokenizer, [{"role": "user", "content": p[0]}], tokenizer.chat_template is not None)
                  for p in prompts]  # as our evaluator renders a first turn
    drafter = import_drafter(args.drafter, verifier_model=verifier)
    gguf = out / "gguf" / "drafter.gguf"
    serve = shlex.split(write_draft_gguf(drafter, gguf, source, force=True))
    common = ["-t", str(args.threads), "-tb", str(args.threads), "-c", "4096", "-np", "2", "--seed", "0",
              "-ctk", "f32", "-ctv", "f32"]
    draft_common = ["-td", str(args.threads), "-tbd", str(args.threads), "-ctkd", "f32", "-ctvd", "f32"]
    spec = ["--spec-type", serve[serve.index("--spec-type") + 1], "--spec-draft-n-min", "0",
            "--spec-draft-p-min", "0"]

    with LlamaServer(configs[0][1], target, common, out / "logs" / "plain.log") as s:
        plain = [strip_eos(s.complete(ids, args.max_new_tokens)["tokens"], eos) for ids in prompt_ids]

    drafts = [("eagle3", gguf, args.k, None)]
    if args.probe_slot is not None:  # predicted from its own features on the plain text (outputs are unchanged)
        choice = choose_probe(verifier, default_probe_layers(verifier), args.probe_slot, list(zip(prompt_ids, plain)))
        probe = layer_probe(verifier, args.probe_slot, choice["dim"], choice["positive"], choice["negative"])
        probe_gguf = write_eagle3_gguf(probe, out / "gguf" / "probe.gguf", source, force=True)
        predicted = probe_prediction(probe, verifier, prompt_ids, plain)
        drafts.append(("probe", probe_gguf, 1, {"choice": choice, **predicted}))
    # (label, server, flags, draft file, k, probe, env, must pass): the pinned build with the draft's backend
    # sampling on is the configuration found wanting (recorded, not required); every other must pass
    runs = [(f"{draft} · {name}", binary, extra, path, k, probe_info, {}, name != "pinned")
            for name, binary, extra in configs for draft, path, k, probe_info in drafts]
    if args.trace:
        runs.append(("eagle3 · trace build", find_binary("llama-server", args.trace), [], gguf, args.k, None,
                     {"SPEC_TRACE": str((out / "trace.txt").resolve())}, False))
        (out / "trace.txt").unlink(missing_ok=True)

    records, rows, ok_all = [], [], True
    for number, (label, binary, extra, path, k, probe_info, env, must_pass) in enumerate(runs):
        flags = common + draft_common + ["-md", str(path), *spec, "--spec-draft-n-max", str(k), *extra]
        log = out / "logs" / f"config{number}.log"
        with LlamaServer(binary, target, flags, log, env=env) as s:
            schedule = run_schedule(s, prompt_ids, args.max_new_tokens)
        for part in [schedule["solo"]] + [p["counts"] for p in schedule["pairs"]]:
            for counts in part:
                counts["tokens"] = strip_eos(counts["tokens"], eos)
        expected = probe_info["accepted_per_prompt"] if probe_info else None
        verdict = slot_rows(schedule, args.tolerance, expected)
        unchanged = sum(c["tokens"] == plain[i] for i, c in enumerate(schedule["solo"]))
        counts = {"solo": [without_tokens(c) for c in schedule["solo"]],  # the verdict compared the tokens
                  "pairs": [{**p, "counts": [without_tokens(c) for c in p["counts"]]} for p in schedule["pairs"]]}
        record = {"config": label, "binary": str(binary), "version": binary_version(binary), "flags": flags,
                  "log": str(log), "k": k, "must_pass": must_pass, **verdict,
                  "solo_equal_to_plain": f"{unchanged}/{len(plain)}", "schedule": counts}
        if probe_info:
            record["probe"] = {key: v for key, v in probe_info.items() if key != "tau"}
        if env.get("SPEC_TRACE"):
            record["trace"] = trace_summary(Path(env["SPEC_TRACE"]).read_text(), prompt_ids, plain)
        passed = verdict["ok"] and verdict["identical"] == verdict["pairings"] and unchanged == len(plain)
        record["ok"] = passed
        ok_all &= passed or not must_pass
        records.append(record)
        for i, r in enumerate(verdict["prompts"]):
            rows.append([label if i == 0 else "", i, r["solo"] if not expected else f"{r['solo']} (predicted "
                         f"{expected[i]})", " ".join(r["with_others"]), " ".join(r["with_itself"]),
                         "-" if r["worst_ratio"] is None else f"{r['worst_ratio']:.2f}", "ok" if r["ok"] else "OFF"])
    table = format_table(["configuration", "prompt", "alone", "beside other prompts", "beside itself",
                          "worst ratio", f"within {args.tolerance:.0%}"], rows,
                         title=f"llama.cpp at 2 slots: {args.verifier} f32, {len(prompt_ids)} prompts, "
                               f"{args.max_new_tokens} new tokens, draft {args.k} (probe 1), p-min 0, T=0, "
                               f"{args.threads} threads; accepted/drafted per request")
    summary = {"command": command, "date": time.strftime("%Y-%m-%d"), "llama_cpp": LLAMA_CPP_VERSION,
               "cpu": cpu_record(), "verifier": args.verifier, "drafter": args.drafter, "prompts": args.prompts,
               "num_prompts": len(prompt_ids), "max_new_tokens": args.max_new_tokens, "k": args.k,
               "threads": args.threads, "tolerance": args.tolerance, "configs": records, "all_ok": ok_all,
               "seconds": round(time.time() - start, 1)}
    path = finish(summary, out / "llama_cpp_slots.json", [table])
    if not ok_all:
        print("llama.cpp slots: a configuration expected to pass did not (see the last column)", file=sys.stderr)
        raise SystemExit(1)
    return path


if __name__ == "__main__":
    main()
