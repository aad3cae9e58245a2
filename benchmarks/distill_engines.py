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

Not run in tests (needs a llama.cpp build; the CPU cores are the measurement); its pure logic is tested in
``tests/test_distill_server.py``.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # sibling scripts, also when a test loads this one

from llama_cpp_server import LlamaServer, binary_version, find_binary, free_port  # noqa: E402

from spectrain.data import distill as distill_mod  # noqa: E402
from spectrain.data.engine import NEAR_TIE, Endpoint, first_parting, local_greedy  # noqa: E402
from spectrain.eval.decode_dtype import cpu_line, cpu_record  # noqa: E402
from spectrain.heads.errors import SpectrainError, run_command  # noqa: E402
from spectrain.heads.report import finish, format_table  # noqa: E402


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
    p.add_argument("--llama_cpp", default=None, help="llama.cpp bin dir or source tree (benchmarks/llama_cpp_server.py)")
    p.add_argument("--threads", type=int, default=None, help="llama-server -t (default: its own)")
    p.add_argument("--vllm_python", default=None, help="python of a venv with vLLM's CPU build")
    p.add_argument("--mismatch_gguf", default=None, help="a GGUF that is not the verifier: the check must catch it")
    p.add_argument("--out", default="runs/bench/distill_engines")
    return p.parse_args(argv)


# --------------------------------------------------------------------------- pure logic (tested)


def spread(values: list[float]) -> dict:
    """Median, min and max of repeated measurements."""
    return {"median": round(statistics.median(values), 2), "min": round(min(values), 2),
            "max": round(max(values), 2), "runs": [round(v, 2) for v in values]}


def kernel_spread(partings: list[dict]) -> float:
    """The largest margin at which an engine's own 1-slot and N-slot replies part (0 when they never do): how far
    its batching moves a logit margin, so a parting from our loop within it is kernel noise, not another model."""
    return max((max(m for m in (p["local_margin"], p["served_margin"]) if m is not None) for p in partings
                if p["local_margin"] is not None or p["served_margin"] is not None), default=0.0)


def judge(parting: dict, bound: float) -> str:
    """``near-tie`` when both known margins are at most ``bound`` (the larger of the kernel spread and the dtype's
    near-tie bound), ``MODEL DIFFERS`` otherwise."""
    margins = [m for m in (parting["local_margin"], parting["served_margin"]) if m is not None]
    return "near-tie" if parting["local_margin"] is not None and all(m <= bound for m in margins) else "MODEL DIFFERS"


def replies_of(path: Path) -> dict:
    """{(conversation id, turn): reply text} of a distill output."""
    rows = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    return {(r["id"], k): t["value"] for r in rows
            for k, t in enumerate(x for x in r["conversations"] if x["from"] == "gpt")}


# --------------------------------------------------------------------------- runs


def distill_args(args, out: Path, server: str | None = None, in_flight: int = 1, extra=()) -> list[str]:
    """spectrain-distill's arguments for one timed run; an earlier run's output is removed first (it would resume)."""
    for stale in (out, out.with_name(out.name + ".meta.json"), out.with_name(out.name + ".summary.json")):
        stale.unlink(missing_ok=True)
    argv = ["--verifier", args.verifier, "--data", *args.data, "--limit", str(args.limit), "--max_turns", "1",
            "--max_new_tokens", str(args.max_new_tokens), "--dtype", "float32", "--device", "cpu", "--out", str(out),
            "--batch_size", str(args.batch_size)]
    return argv + (["--server", server, "--in_flight", str(in_flight)] if server else []) + list(extra)


def timed_distill(argv: list[str]) -> float:
    """Generated tokens/s of one spectrain-distill run (its summary's own count and seconds)."""
    summary = json.loads(distill_mod.run(distill_mod.parse_args(argv)).read_text())
    return summary["generated_tokens"] / max(summary["seconds"], 1e-9)


def margins_at_parting(endpoint: Endpoint, model, tokenizer, prompt: list[int], n: int, stops: list[int]) -> dict | None:
    """Both paths' top-2 margins at the first token where the engine's greedy reply leaves the local one."""
    mine = local_greedy(model, prompt, n, stops)
    served = endpoint.complete(prompt, n, 0.0, None, top_logprobs=2)
    from spectrain.data.engine import cut_at_stop

    ids = served.token_ids if served.token_ids is not None else tokenizer(served.text, add_special_tokens=False)["input_ids"]
    p = first_parting(mine.ids, mine.margins, cut_at_stop(ids, stops)[:n], served.margin)
    return None if p is None else {"position": p.position, "local_id": p.local_id, "served_id": p.served_id,
                                   "local_margin": p.local_margin, "served_margin": p.served_margin}


def self_parting(reference: Endpoint, prompt: list[int], other_reply: str, tokenizer, n: int, stops: list[int]) -> dict:
    """The 1-slot engine's margin where its greedy reply leaves its own N-slot reply (re-tokenized)."""
    from spectrain.data.engine import cut_at_stop

    served = reference.complete(prompt, n, 0.0, None, top_logprobs=2)
    ids = cut_at_stop(served.token_ids, stops) if served.token_ids is not None else tokenizer(
        served.text, add_special_tokens=False)["input_ids"]
    p = first_parting(ids, [], tokenizer(other_reply, add_special_tokens=False)["input_ids"], served.margin)
    return {"local_margin": None, "served_margin": None if p is None else p.served_margin}


def vllm_server(args, model_dir: str, log: Path) -> subprocess.Popen:
    port = free_port()
    proc = subprocess.Popen([args.vllm_python, "-m", "vllm.entrypoints.openai.api_server", "--model", model_dir,
                             "--dtype", "float32", "--host", "127.0.0.1", "--port", str(port)],
                            stdout=open(log, "w"), stderr=subprocess.STDOUT,
                            env={**os.environ, "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "2")})
    proc.url = f"http://127.0.0.1:{port}"
    for _ in range(600):
        try:
            urllib.request.urlopen(proc.url + "/health", timeout=5)
            return proc
        except OSError:
            if proc.poll() is not None:
                raise SpectrainError(f"vLLM exited while starting; log {log}")
            time.sleep(1)
    proc.terminate()
    raise SpectrainError(f"vLLM did not start in 600 s; log {log}")


def run(args) -> Path:
    from spectrain.heads.verifier import load_verifier, resolve_verifier

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
        procs.append(vllm_server(args, resolve_verifier(args.verifier), out / "vllm.log"))
        slots["vllm"] = 8
    for s in servers.values():
        s.__enter__()
    urls = {name: f"http://127.0.0.1:{s.port}" for name, s in servers.items()}
    urls.update({"vllm": p.url for p in procs})
    speeds: dict[str, list[float]] = {name: [] for name in ["local loop", *urls]}
    try:
        for r in range(args.repeats):  # interleaved: every side once per repeat
            speeds["local loop"].append(timed_distill(distill_args(args, out / f"local-{r}.jsonl")))
            for name, url in urls.items():
                speeds[name].append(timed_distill(distill_args(args, out / f"{name.replace(' ', '_')}-{r}.jsonl", url,
                                                               slots[name], ["--skip_verifier_check"])))
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
                prompt = prompt_ids(args, tokenizer, cid)
                p = margins_at_parting(endpoint, verifier.model, tokenizer, prompt, args.max_new_tokens, stops)
                if p:
                    partings.append({"conversation": cid, **p})
            records[name] = {"equal": len(local) - len(parted), "replies": len(local), "partings": partings}
        reference = Endpoint(urls[one_slot])
        reference.resolve_model(None)
        one = replies_of(out / f"{one_slot.replace(' ', '_')}-0.jsonl")
        self_partings = []
        for name in (n for n in servers if n != one_slot):
            many = replies_of(out / f"{name.replace(' ', '_')}-0.jsonl")
            for cid, turn in (key for key in one if many.get(key) != one[key]):
                self_partings.append(self_parting(reference, prompt_ids(args, tokenizer, cid), many[(cid, turn)],
                                                  tokenizer, args.max_new_tokens, stops))
        spread_bound = max(kernel_spread(self_partings), NEAR_TIE["float32"])
        for record in records.values():
            for p in record["partings"]:
                p["verdict"] = judge(p, spread_bound)
        # The check against every engine serving the verifier (each must pass), then a mismatched file (caught).
        checks = {f"verifier, {name}": check_against(args, url) for name, url in urls.items()}
        if args.mismatch_gguf:
            try:
                # --no-repack: this llama.cpp build (11434) dies at load on quantized files when it repacks their
                # weights for the CPU's AMX / AVX-512 kernels (Q4_0, Q4_1 segfault, Q4_K_M illegal instruction on
                # an AMX Xeon under KVM); the plain layout serves the same weights.
                with LlamaServer(binary, Path(args.mismatch_gguf), ["-np", "1", "--no-repack"],
                                 out / "mismatch.log") as wrong:
                    checks["mismatched file"] = check_against(args, f"http://127.0.0.1:{wrong.port}")
            except SpectrainError as e:  # a file this llama.cpp cannot serve: said, the measurements above kept
                checks["mismatched file"] = {"outcome": "not served", "message": str(e)[:500]}
    finally:
        for s in servers.values():
            s.__exit__(None, None, None)
        for p in procs:
            p.terminate()
    rows = [[name, spread(v)["median"], f"{spread(v)['min']}-{spread(v)['max']}",
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
               "local_batch_size": args.batch_size, "slots": args.slots, "llama_server": binary_version(binary), "speeds": {k: spread(v) for k, v in
               speeds.items()}, "replies": records, "self_partings": self_partings,
               "kernel_spread": kernel_spread(self_partings), "kernel_spread_bound": spread_bound, "checks": checks,
               "ok": all(v["outcome"] == "passed" for k, v in checks.items() if k.startswith("verifier, "))
               and checks.get("mismatched file", {}).get("outcome", "caught") == "caught"}
    return finish(summary, out / "distill_engines.json", [table, checks_table])


def prompt_ids(args, tokenizer, cid: int) -> list[int]:
    """The first turn's prompt of conversation ``cid`` rendered as spectrain-distill renders it."""
    from spectrain.data.chat import load_records

    records = [r for path in args.data for r in load_records(path)[:args.limit]]
    system, users = distill_mod.prompts_of(records[cid], 1)
    history = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": users[0]}]
    text = tokenizer.apply_chat_template(history, add_generation_prompt=True, tokenize=False)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def check_against(args, url: str) -> dict:
    """The served-verifier check of spectrain-distill against one endpoint: passed, or caught with its message."""
    probe = Path(args.out) / f"check-{url.rsplit(':', 1)[1]}.jsonl"
    try:
        distill_mod.run(distill_mod.parse_args(distill_args(args, probe, url, 1) + ["--limit", "1"]))
        return {"outcome": "passed"}
    except SpectrainError as e:
        return {"outcome": "caught", "message": str(e)}


def main(argv=None) -> None:
    run_command(run, parse_args(argv))


if __name__ == "__main__":
    main()
