"""spectrain-distill's replies from our local loop, llama-server (1 and N slots) and vLLM's CPU build, interleaved.

The same prompts and caps (``--data``, ``--limit``, ``--max_new_tokens``, T = 0) through (a) the local batched loop
(fp32), (b) ``llama-server`` serving an f32 GGUF of the verifier (``spectrain-verifier-gguf VERIFIER --out F``) with
``-np SLOTS`` for each ``--slots`` (default 1 and 8; ``--in_flight`` = slots), (c) vLLM's CPU build when
``--vllm_python`` names the python of its venv (docs/export.md), ``--repeats`` times in turn so the machine's drift
reaches every side alike. Reported: generated tokens/s of each (median, min-max), how many replies equal the local
loop's, and for every reply that parts, both paths' top-2 margins at the first differing token (the local verifier's
from its logits; the engine's from its returned log-probabilities), judged against the *kernel spread*: the largest
margin at which the engine's own 1-slot and N-slot replies part (batching changes its kernels, not its model). Then
the served-verifier check against every engine serving the verifier (each must pass) and, with ``--mismatch_gguf F`` (a Q4 file or another
model), against a wrong one (must be caught). Table printed, JSON written, its path the last line.

Not run in tests (needs a llama.cpp build; the CPU cores are the measurement); its logic lives in
``spectrain.data.engine`` (``first_parting``, ``kernel_spread``, ``Parting.near_tie``) and the runs'
in ``spectrain.data.distill_compare``, tested in ``tests/test_distill_server.py``.
"""

from __future__ import annotations

import argparse
import shlex
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path

from spectrain.data import distill as distill_mod
from spectrain.data.distill_compare import (Comparison, check_against, distill_args, margins_at_parting, prompt_ids,
                                            replies_of, self_parting, timed_distill)
from spectrain.data.engine import NEAR_TIE, Endpoint, kernel_spread
from spectrain.eval.decode_dtype import cpu_line, cpu_record
from spectrain.eval.llama_cpp_server import LlamaServer, binary_version, find_binary
from spectrain.eval.vllm_engine import vllm_server
from spectrain.heads.errors import SpectrainError, run_command
from spectrain.heads.report import finish, format_table, median_range


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--verifier", default="bundled:smollm2")
    p.add_argument("--data", nargs="+", default=["example_data/alpaca_en_demo.json"])
    p.add_argument("--limit", type=int, default=32)
    p.add_argument("--max_new_tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--batch_size", type=int, default=32, help="the local loop's batch (all --limit prompts at once: "
                   "its fastest setting on a CPU)")
    p.add_argument("--slots", type=int, nargs="+", default=[1, 8], help="llama-server -np values (the first is the "
                   "1-slot reference of the kernel spread)")
    p.add_argument("--llama_cpp", default=None, help="llama.cpp bin dir or source tree (spectrain.eval.llama_cpp_server)")
    p.add_argument("--threads", type=int, default=None, help="llama-server -t (default: its own)")
    p.add_argument("--vllm_python", default=None, help="python of a venv with vLLM's CPU build")
    p.add_argument("--mismatch_gguf", default=None, help="a GGUF that is not the verifier: the check must catch it")
    p.add_argument("--out", default="runs/bench/distill_engines")
    return p.parse_args(argv)


def comparison(args) -> Comparison:
    """What every run of this benchmark shares, from its flags."""
    return Comparison(args.verifier, tuple(args.data), args.limit, args.max_new_tokens, args.batch_size)


def run(args) -> Path:
    from spectrain.heads.verifier import load_verifier, resolve_verifier

    c = comparison(args)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    gguf = out / "verifier-f32.gguf"
    if not gguf.is_file():
        subprocess.run(["spectrain-verifier-gguf", args.verifier, "--out", str(gguf)], check=True)
    binary = find_binary("llama-server", args.llama_cpp)
    verifier = load_verifier(args.verifier, dtype="float32")
    tokenizer, stops = verifier.tokenizer, distill_mod.stop_ids(verifier.model, verifier.tokenizer)
    threads = ["-t", str(args.threads)] if args.threads else []
    servers = {f"llama-server -np {n}": LlamaServer(binary, gguf, ["-np", str(n), "-c", str(4096 * n), *threads],
                                                    out / f"llama-np{n}.log") for n in args.slots}
    slots = {f"llama-server -np {n}": n for n in args.slots}
    procs = []
    if args.vllm_python:
        procs.append(vllm_server(args.vllm_python, resolve_verifier(args.verifier), out / "vllm.log"))
        slots["vllm"] = 8
    for s in servers.values():
        s.__enter__()
    urls = {name: f"http://127.0.0.1:{s.port}" for name, s in servers.items()}
    urls.update({"vllm": p.url for p in procs})
    speeds: dict[str, list[float]] = {name: [] for name in ["local loop", *urls]}
    try:
        for r in range(args.repeats):  # interleaved: every side once per repeat
            speeds["local loop"].append(timed_distill(distill_args(c, out / f"local-{r}.jsonl")))
            for name, url in urls.items():
                speeds[name].append(timed_distill(distill_args(c, out / f"{name.replace(' ', '_')}-{r}.jsonl", url,
                                                               slots[name], skip_verifier_check=True)))
        local = replies_of(out / "local-0.jsonl")
        records = {}
        one_slot = f"llama-server -np {args.slots[0]}"
        for name, url in urls.items():
            endpoint = Endpoint(url)
            endpoint.resolve_model(None)
            theirs = replies_of(out / f"{name.replace(' ', '_')}-0.jsonl")
            parted = [key for key in local if theirs.get(key) != local[key]]
            partings = []
            for cid, _ in parted:
                prompt = prompt_ids(c, tokenizer, cid)
                p = margins_at_parting(endpoint, verifier.model, tokenizer, prompt, args.max_new_tokens, stops)
                if p:
                    partings.append((cid, p))
            records[name] = {"equal": len(local) - len(parted), "replies": len(local), "partings": partings}
        reference = Endpoint(urls[one_slot])
        reference.resolve_model(None)
        one = replies_of(out / f"{one_slot.replace(' ', '_')}-0.jsonl")
        self_partings = []
        for name in (n for n in servers if n != one_slot):
            many = replies_of(out / f"{name.replace(' ', '_')}-0.jsonl")
            for cid, turn in (key for key in one if many.get(key) != one[key]):
                self_partings.append(self_parting(reference, prompt_ids(c, tokenizer, cid), many[(cid, turn)],
                                                  tokenizer, args.max_new_tokens, stops))
        spread_bound = max(kernel_spread(self_partings), NEAR_TIE["float32"])
        for record in records.values():
            record["partings"] = [{"conversation": cid, **asdict(p), "verdict": "near-tie" if p.near_tie(spread_bound)
                                   else "MODEL DIFFERS"} for cid, p in record["partings"]]
        # The check against every engine serving the verifier (each must pass), then a mismatched file (caught).
        checks = {f"verifier, {name}": check_against(c, url, out) for name, url in urls.items()}
        if args.mismatch_gguf:
            try:
                # --no-repack: this llama.cpp build (11434) dies at load on quantized files when it repacks their
                # weights for the CPU's AMX / AVX-512 kernels (Q4_0, Q4_1 segfault, Q4_K_M illegal instruction on
                # an AMX Xeon under KVM); the plain layout serves the same weights.
                with LlamaServer(binary, Path(args.mismatch_gguf), ["-np", "1", "--no-repack"],
                                 out / "mismatch.log") as wrong:
                    checks["mismatched file"] = check_against(c, f"http://127.0.0.1:{wrong.port}", out)
            except SpectrainError as e:  # a file this llama.cpp cannot serve: said, the measurements above kept
                checks["mismatched file"] = {"outcome": "not served", "message": str(e)[:500]}
    finally:
        for s in servers.values():
            s.__exit__(None, None, None)
        for p in procs:
            p.terminate()
    rows = [[name, median_range(v)["median"], f"{median_range(v)['min']}-{median_range(v)['max']}",
             f"{records[name]['equal']}/{records[name]['replies']}" if name in records else "reference",
             sum(p["verdict"] != "near-tie" for p in records.get(name, {}).get("partings", []))]
            for name, v in speeds.items()]
    table = format_table(["path", "tokens/s median", "min-max", "replies = local loop", "partings beyond spread"],
                         rows, title=f"distillation engines, {args.verifier}, T = 0, {args.repeats} repeats "
                                     f"(kernel spread bound {spread_bound:.4f}); {cpu_line(cpu_record())}")
    checks_table = format_table(["served-verifier check", "outcome"], [[k, v["outcome"]] for k, v in checks.items()])
    summary = {"command": "python benchmarks/distill_engines.py " + shlex.join(sys.argv[1:]),
               "date": time.strftime("%Y-%m-%d"), "cpu": cpu_record(), "verifier": args.verifier, "data": args.data,
               "limit": args.limit, "max_new_tokens": args.max_new_tokens, "repeats": args.repeats,
               "local_batch_size": args.batch_size, "slots": args.slots, "llama_server": binary_version(binary), "speeds": {k: median_range(v) for k, v in
               speeds.items()}, "replies": records, "self_partings": [p and asdict(p) for p in self_partings],
               "kernel_spread": kernel_spread(self_partings), "kernel_spread_bound": spread_bound, "checks": checks,
               "ok": all(v["outcome"] == "passed" for k, v in checks.items() if k.startswith("verifier, "))
               and checks.get("mismatched file", {}).get("outcome", "caught") == "caught"}
    return finish(summary, out / "distill_engines.json", [table, checks_table])


def main(argv=None) -> None:
    run_command(run, parse_args(argv))


if __name__ == "__main__":
    main()
