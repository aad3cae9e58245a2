"""Benchmark: peak memory and training tokens/s of Medusa training on the CPU.

Run: ``python benchmarks/bench_memory.py [--steps N] [--out PATH]``.

A random-weight Llama verifier with a realistic vocabulary (hidden 1024, 2 layers,
vocabulary 128,256, untied embeddings) is built once and saved with a small
tokenizer into a temporary directory. Then each of four configurations,
{chunked loss (``loss_chunk_size=256``, the default), unchunked (``None``)} x {per-head
lm_head copies, shared verifier lm_head}, trains 3 Medusa heads (1 ResBlock
each, target ``greedy``, fp32, batch 2 x 512) for 1 warm-up + N timed steps in
a subprocess of its own, so its peak RSS is its own.

Measuring peak RSS: ``ru_maxrss`` of a freshly exec'ed child starts at the RSS
its parent had when it spawned it (Linux copies the old address space's
high-water mark into the process at ``exec``), so this orchestrator imports
neither torch nor the model, and the verifier is built in a subprocess too.
The verifier's weights are memory-mapped, so a child reads each weight once
before taking its baseline (else paging in the 0.5 GB lm_head would count as
training memory). It then resets its RSS high-water mark through
``/proc/self/clear_refs`` before each phase of each step (features, loss
forward, backward, optimizer) and reads ``ru_maxrss`` after it, which tells
where the peak happens: with per-head lm_head copies it is AdamW's step, not
the loss.

Not a test: it takes minutes (each fp32 step projects ~1K rows onto a 128K
vocabulary three times) and needs ~10 GB of memory.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import gc
import json
import os
import platform
import random
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

DEFAULT_OUT = "runs/bench/medusa_memory.json"
RESULT_TAG = "BENCH_RESULT "

# The verifier and the training setup under test.
VERIFIER = dict(vocab_size=128_256, hidden_size=1024, num_hidden_layers=2, num_attention_heads=16,
                num_key_value_heads=8, intermediate_size=2816, max_position_embeddings=2048,
                tie_word_embeddings=False, rms_norm_eps=1e-5)
TOKENIZER_VOCAB = 300
NUM_HEADS, NUM_LAYERS, TARGET = 3, 1, "greedy"
BATCH, SEQ = 2, 512
SEED, BATCH_SEED = 0, 1234

CONFIGS = {
    # name: (loss_chunk_size, shared_lm_head)
    "chunked/copies": (256, False),
    "unchunked/copies": (None, False),
    "chunked/shared": (256, True),
    "unchunked/shared": (None, True),
}
LOSS_RTOL = 1e-4
PHASES = ("features", "loss_forward", "backward", "optimizer")
KIB_PER_GIB = 1024 ** 2  # ru_maxrss and /proc report KiB


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# -- memory probes (KiB) -------------------------------------------------------------------------------------
def proc_status_kib(key: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return None


def maxrss_kib() -> int:
    import resource

    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)


def reset_peak_rss() -> bool:
    """Reset this process's RSS high-water mark (Linux >= 4.0); False where not allowed."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


# -- the verifier -----------------------------------------------------------------------------------------------
def generated_text(n_words: int = 20_000, seed: int = SEED) -> str:
    rng = random.Random(seed)
    syllables = ["ka", "lo", "mi", "ne", "ru", "sa", "to", "vi", "the", "and", "ing", "er", "on", "qu", "st"]
    words = ["".join(rng.choice(syllables) for _ in range(rng.randint(1, 3))) for _ in range(2_000)]
    lines, line = [], []
    for _ in range(n_words):
        line.append(rng.choice(words))
        if rng.random() < 0.08:
            lines.append(" ".join(line).capitalize() + rng.choice([".", "!", "?", ","]))
            line = []
    return "\n".join(lines) + "\n"


def build_verifier(out_dir: Path) -> None:
    """Seeded random-weight ``LlamaForCausalLM`` plus a small BPE tokenizer, saved as an HF model directory."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from spectrain.data.bundled import train_tokenizer

    t0 = time.perf_counter()
    torch.manual_seed(SEED)
    tokenizer = train_tokenizer(generated_text(), TOKENIZER_VOCAB)
    config = LlamaConfig(**VERIFIER, bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id)
    model = LlamaForCausalLM(config)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    n = sum(p.numel() for p in model.parameters())
    log(f"verifier: {n / 1e6:.1f}M parameters, vocabulary {config.vocab_size}, tokenizer {len(tokenizer)} tokens, "
        f"built in {time.perf_counter() - t0:.0f}s -> {out_dir}")


# -- one configuration (child process) ---------------------------------------------------------------------------
def run_one(name: str, verifier_dir: str, steps: int) -> dict:
    import torch

    from spectrain.train.optim import build_optimizer
    from spectrain.train.medusa import MedusaModule

    chunk, shared = CONFIGS[name]
    t0 = time.perf_counter()
    torch.manual_seed(SEED)  # same ResBlock init in every configuration
    module = MedusaModule(verifier=verifier_dir, num_heads=NUM_HEADS, num_layers=NUM_LAYERS, shared_lm_head=shared,
                          target=TARGET, loss_chunk_size=chunk, verifier_dtype="float32")
    module.train()
    # The optimizer DrafterModule.configure_optimizers uses (without the LR schedule, which costs no memory).
    opt = build_optimizer(module.drafter, module.lr, module.weight_decay)
    params = [p for p in module.drafter.parameters() if p.requires_grad]
    vocab = module.verifier_lm_head.weight.shape[0]
    gen = torch.Generator().manual_seed(BATCH_SEED)
    batch = {"input_ids": torch.randint(0, vocab, (BATCH, SEQ), generator=gen),
             "attention_mask": torch.ones(BATCH, SEQ, dtype=torch.long),
             "loss_mask": torch.ones(BATCH, SEQ, dtype=torch.long)}
    tokens_per_step = int(batch["attention_mask"].sum())
    load_s = time.perf_counter() - t0
    gc.collect()
    # The verifier's safetensors are memory-mapped: its pages (e.g. the 0.5 GB lm_head) become resident only when
    # first read, which would otherwise land in the first step and count as "training" memory. Read every weight
    # once so that the baseline holds the whole model in every configuration.
    lazy_rss = proc_status_kib("VmRSS")
    with torch.no_grad():
        for t in list(module.parameters()) + list(module.buffers()):
            if t.numel():
                t.sum()

    baseline = proc_status_kib("VmRSS")
    load_peak = maxrss_kib()
    hwm_reset = reset_peak_rss()
    log(f"[{name}] loaded in {load_s:.0f}s; RSS {baseline / KIB_PER_GIB:.2f} GiB (load peak {load_peak / KIB_PER_GIB:.2f} GiB); "
        f"{sum(p.numel() for p in params) / 1e6:.1f}M trainable; {torch.get_num_threads()} threads")

    # Peak RSS per phase of every step: the high-water mark is reset before each phase (where the kernel allows)
    # and read back with ru_maxrss after it, so the loss's peak is not hidden behind an earlier optimizer peak.
    # The run's peak is the largest of these readings.
    step_times, steps_log = [], []
    first_loss, first_parts = None, None
    for step in range(1 + steps):
        record = {"step": step}

        def mark(phase: str, t_phase: float) -> None:
            record[phase] = {"peak_kib": maxrss_kib(), "rss_kib": proc_status_kib("VmRSS"),
                             "seconds": round(time.perf_counter() - t_phase, 3)}
            if hwm_reset:
                reset_peak_rss()

        t = tp = time.perf_counter()
        features = module.features(batch)
        mark("features", tp)
        tp = time.perf_counter()
        loss, parts = module.drafter_loss(batch, features)
        mark("loss_forward", tp)
        tp = time.perf_counter()
        loss.backward()
        mark("backward", tp)
        tp = time.perf_counter()
        opt.step()
        opt.zero_grad()
        mark("optimizer", tp)
        dt = time.perf_counter() - t
        record["seconds"] = round(dt, 3)
        if step == 0:
            first_loss = float(loss.detach())
            first_parts = {k: float(v) for k, v in parts.items()}
        else:
            step_times.append(dt)
        steps_log.append(record)
        log(f"[{name}] {'warm-up' if step == 0 else f'step {step}'}: {dt:.1f}s  loss {float(loss.detach()):.4f}  "
            + "  ".join(f"{ph} {record[ph]['peak_kib'] / KIB_PER_GIB:.2f}" for ph in PHASES) + " GiB peak RSS")
        del features, loss, parts

    def step_name(i: int) -> str:
        return "warm-up" if i == 0 else f"step {i}"

    readings = [(r[ph]["peak_kib"], f"{step_name(r['step'])}/{ph}", ph) for r in steps_log for ph in PHASES]
    peak, peak_at, _ = max(readings, key=lambda x: x[0]) if readings else (maxrss_kib(), "-", "-")
    peak = max(peak, maxrss_kib())

    def phase_increase(which) -> int | None:
        if not hwm_reset or baseline is None:
            return None  # cumulative readings cannot be split by phase
        values = [k for k, _, ph in readings if ph in which]
        return max(values) - baseline if values else None

    sec = sum(step_times) / len(step_times) if step_times else steps_log[0]["seconds"]
    return {
        "config": name, "loss_chunk_size": chunk, "shared_lm_head": shared,
        "trainable_params": sum(p.numel() for p in params),
        "load_seconds": round(load_s, 1),
        "rss_after_load_before_touch_kib": lazy_rss,
        "baseline_rss_kib": baseline, "load_peak_rss_kib": load_peak, "peak_reset_per_phase": hwm_reset,
        "peak_rss_kib": peak,
        "peak_increase_kib": peak - baseline if baseline is not None else None,
        "peak_at": peak_at,
        "features_peak_increase_kib": phase_increase(("features",)),
        "loss_peak_increase_kib": phase_increase(("loss_forward", "backward")),
        "optimizer_peak_increase_kib": phase_increase(("optimizer",)),
        "first_loss": first_loss, "first_head_losses": first_parts,
        "warmup_seconds": steps_log[0]["seconds"], "timed_steps": len(step_times),
        "step_seconds": [round(s, 3) for s in step_times],
        "sec_per_step": round(sec, 3), "tokens_per_step": tokens_per_step,
        "tokens_per_sec": round(tokens_per_step / sec, 2),
        "steps": steps_log,
        "torch_version": torch.__version__, "torch_num_threads": torch.get_num_threads(),
    }


# -- orchestration (parent process: stdlib only until the end, so its RSS stays small) ----------------------------
def _spawn(args: list[str], timeout: float | None) -> subprocess.CompletedProcess:
    cmd = [sys.executable, str(Path(__file__).resolve()), *args]
    return subprocess.run(cmd, stdout=subprocess.PIPE, text=True, timeout=timeout)


def _machine(results: list[dict]) -> dict:
    cpu_model = ""
    try:
        cpu_model = next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name")), "")
    except OSError:
        pass
    mem_total = None
    try:
        mem_total = next((int(l.split()[1]) for l in open("/proc/meminfo") if l.startswith("MemTotal")), None)
    except OSError:
        pass
    ok = [r for r in results if "error" not in r]
    return {
        "torch_version": ok[0]["torch_version"] if ok else None,
        "torch_num_threads": ok[0]["torch_num_threads"] if ok else None,
        "cpu_count": os.cpu_count(),
        "cpu_affinity": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "cpu_model": cpu_model, "mem_total_gib": round(mem_total / KIB_PER_GIB, 1) if mem_total else None,
        "python": platform.python_version(), "platform": platform.platform(),
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
    }


def _loss_checks(results: list[dict]) -> list[dict]:
    by = {(r["loss_chunk_size"] is not None, r["shared_lm_head"]): r for r in results if "error" not in r}
    checks = []
    for shared in (False, True):
        a, b = by.get((True, shared)), by.get((False, shared))
        if a is None or b is None:
            continue
        rel = abs(a["first_loss"] - b["first_loss"]) / max(abs(b["first_loss"]), 1e-12)
        checks.append({"lm_head": "shared" if shared else "copies", "chunked": a["first_loss"],
                       "unchunked": b["first_loss"], "rel_diff": rel, "ok": rel <= LOSS_RTOL})
    return checks


def main(argv: list[str] | None = None) -> None:
    """Bad input: ``error: ...`` on stderr and exit code 2 (no traceback)."""
    from spectrain.heads.errors import run_command  # here: the sides this script compares import their own

    return run_command(_main, argv)


def _main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python benchmarks/bench_memory.py",
                                description="Peak memory and tokens/s of Medusa training on the CPU "
                                            "(chunked vs unchunked loss x per-head vs shared lm_head).")
    p.add_argument("--steps", type=int, default=3, help="timed steps per configuration, after 1 warm-up step")
    p.add_argument("--out", default=DEFAULT_OUT, help="JSON summary path")
    p.add_argument("--configs", default=",".join(CONFIGS), help=f"comma-separated subset of {list(CONFIGS)}")
    p.add_argument("--verifier-dir", help="reuse a verifier built by an earlier run (--keep-verifier)")
    p.add_argument("--keep-verifier", action="store_true", help="do not delete the generated verifier directory")
    p.add_argument("--timeout", type=float, default=1800, help="seconds allowed per configuration")
    p.add_argument("--one", help=argparse.SUPPRESS)  # internal: run one configuration in this process
    p.add_argument("--build-verifier", help=argparse.SUPPRESS)  # internal: build the verifier into this dir
    args = p.parse_args(argv)
    if args.steps < 0:
        p.error("--steps must be >= 0")

    if args.build_verifier:
        build_verifier(Path(args.build_verifier))
        return
    if args.one:
        if args.one not in CONFIGS or not args.verifier_dir:
            p.error(f"--one needs one of {list(CONFIGS)} and --verifier-dir")
        print(RESULT_TAG + json.dumps(run_one(args.one, args.verifier_dir, args.steps)), flush=True)
        return

    names = [n.strip() for n in args.configs.split(",") if n.strip()]
    unknown = [n for n in names if n not in CONFIGS]
    if unknown:
        p.error(f"unknown configs {unknown}; choose from {list(CONFIGS)}")

    t_start = time.perf_counter()
    tmp = None
    verifier_dir = args.verifier_dir
    if verifier_dir is None:
        tmp = tempfile.mkdtemp(prefix="spectrain-bench-verifier-")
        verifier_dir = tmp
        log(f"building the verifier in {tmp} ...")
        if _spawn(["--build-verifier", tmp], args.timeout).returncode != 0:
            shutil.rmtree(tmp, ignore_errors=True)
            sys.exit("error: building the verifier failed")
    results = []
    try:
        for name in names:
            log(f"== {name}")
            try:
                proc = _spawn(["--one", name, "--verifier-dir", verifier_dir, "--steps", str(args.steps)], args.timeout)
                lines = [l for l in proc.stdout.splitlines() if l.startswith(RESULT_TAG)]
                if proc.returncode != 0 or not lines:
                    results.append({"config": name, "error": f"exit status {proc.returncode}"})
                else:
                    results.append(json.loads(lines[-1][len(RESULT_TAG):]))
            except subprocess.TimeoutExpired:
                results.append({"config": name, "error": f"timed out after {args.timeout:.0f}s"})
    finally:
        if tmp is not None and not args.keep_verifier:
            shutil.rmtree(tmp, ignore_errors=True)
        elif tmp is not None:
            log(f"verifier kept in {tmp}")

    from spectrain.heads.report import finish, format_table  # imports torch: only now, after the children

    def gib(kib):
        return round(kib / KIB_PER_GIB, 3) if kib is not None else "-"

    rows = []
    for r in results:
        if "error" in r:
            rows.append([r["config"], *["-"] * 11, r["error"]])
            continue
        rows.append([r["config"], f"{r['trainable_params'] / 1e6:.1f}M", gib(r["baseline_rss_kib"]),
                     gib(r["peak_rss_kib"]), gib(r["peak_increase_kib"]), r["peak_at"],
                     gib(r["loss_peak_increase_kib"]), gib(r["optimizer_peak_increase_kib"]),
                     round(r["first_loss"], 5), round(r["sec_per_step"], 2), round(r["tokens_per_sec"], 1), ""])
    headers = ["config", "trainable", "base RSS GiB", "peak RSS GiB", "peak +GiB", "peak reached in",
               "loss fwd+bwd +GiB", "optimizer +GiB", "loss@1", "s/step", "tokens/s", "note"]
    title = (f"Medusa training memory on CPU: {NUM_HEADS} heads x {NUM_LAYERS} ResBlock, verifier hidden "
             f"{VERIFIER['hidden_size']} x {VERIFIER['num_hidden_layers']} layers, vocab {VERIFIER['vocab_size']:,}, "
             f"batch {BATCH}x{SEQ}, fp32, target {TARGET}, {args.steps} timed steps")
    table = format_table(headers, rows, title=title)

    checks = _loss_checks(results)
    for c in checks:
        if not c["ok"]:
            print(f"WARNING: chunked and unchunked first-step losses differ ({c['lm_head']} lm_head): "
                  f"{c['chunked']:.6f} vs {c['unchunked']:.6f} (rel {c['rel_diff']:.2e} > {LOSS_RTOL:g})")
    check_lines = "\n".join(f"loss check ({c['lm_head']} lm_head): chunked {c['chunked']:.6f} vs unchunked "
                            f"{c['unchunked']:.6f}, rel diff {c['rel_diff']:.2e} -> {'ok' if c['ok'] else 'MISMATCH'}"
                            for c in checks)
    summary = {
        "benchmark": "medusa_memory",
        "setup": {"verifier": VERIFIER, "tokenizer_vocab": TOKENIZER_VOCAB, "num_heads": NUM_HEADS,
                  "num_layers": NUM_LAYERS, "target": TARGET, "batch_size": BATCH, "seq_len": SEQ, "dtype": "float32",
                  "warmup_steps": 1, "timed_steps": args.steps, "seed": SEED,
                  "rss_note": "KiB. baseline = VmRSS after loading and reading every weight once, before the first step; "
                              "the RSS high-water mark is reset before each phase of each step "
                              "(peak_reset_per_phase) and read with ru_maxrss after it; peak = the largest reading; "
                              "*_peak_increase = largest reading of those phases minus baseline"},
        "configs": results,
        "loss_checks": checks,
        "machine": _machine(results),
        "total_seconds": round(time.perf_counter() - t_start, 1),
    }
    finish(summary, args.out, tables=[table + ("\n\n" + check_lines if check_lines else "")])


if __name__ == "__main__":
    main()
