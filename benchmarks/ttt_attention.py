"""EAGLE-3 training-time-test attention at long context: memory peak and speed, scores kept vs recomputed.

TTT steps >= 1 attend over step 0's causal keys plus one own key per later step (``ttt_attention``). Kept for
backward, each step's (T, T) scores, their masked copy and fp32 probabilities cost ~6 x heads x T^2 bytes per
sequence; ``EagleAttention.recompute_ttt`` (the default) recomputes them in backward instead. This benchmark
runs one drafter attention layer through step 0 and ``--steps`` - 1 TTT steps, forward and backward, under
bf16 autocast (bf16-mixed training), each setting in a fresh process (peak RSS is per process), alternating:

    python benchmarks/ttt_attention.py [--seq 2048] [--heads 32] [--kv_heads 8] [--head_dim 128] [--steps 4]
        [--repeats 2] [--out runs/bench/ttt_attention.json]

Prints a table and writes the JSON (its path is the last line printed).
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time

import torch

from spectrain.heads.errors import SpectrainError, run_command
from spectrain.heads.report import finish, format_table


def one(args) -> dict:
    """Runs in a child process: build the layer, time ``--iters`` forward+backward passes, report peak RSS."""
    from spectrain.heads.eagle import EagleAttention, EagleConfig, rotary_cos_sin

    torch.manual_seed(0)
    hidden = args.heads * args.head_dim
    config = EagleConfig(hidden_size=hidden, num_heads=args.heads, num_kv_heads=args.kv_heads,
                         head_dim=args.head_dim, intermediate_size=4 * hidden, vocab_size=1024, num_hidden_layers=1)
    attention = EagleAttention(hidden, config)
    EagleAttention.recompute_ttt = args.recompute
    x = torch.randn(1, args.seq, hidden, requires_grad=True)
    positions = torch.arange(args.seq)[None]
    cos, sin = rotary_cos_sin(positions, args.head_dim, 1e4)
    base_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss

    def step() -> None:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out, k, v = attention(x, cos, sin, None)
            cache, total = [(k, v)], out.float().pow(2).mean()
            for _ in range(args.steps - 1):
                out, k, v = attention.forward_ttt(out, cos, sin, cache)
                cache.append((k, v))
                total = total + out.float().pow(2).mean()
        total.backward()

    step()  # warm-up (allocator, kernels)
    t0 = time.perf_counter()
    for _ in range(args.iters):
        step()
    seconds = (time.perf_counter() - t0) / args.iters
    peak_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return {"recompute": args.recompute, "seconds_per_step": seconds, "tokens_per_second": args.seq / seconds,
            "peak_rss_gib": peak_kib / 2**20, "peak_over_start_gib": (peak_kib - base_kib) / 2**20}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python benchmarks/ttt_attention.py", description=__doc__.split("\n")[0])
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv_heads", type=int, default=8, help="fewer than --heads: grouped-query attention")
    p.add_argument("--head_dim", type=int, default=128)
    p.add_argument("--steps", type=int, default=4, help="TTT steps, step 0 included")
    p.add_argument("--iters", type=int, default=2, help="timed forward+backward passes per process")
    p.add_argument("--repeats", type=int, default=2, help="processes per setting (alternating)")
    p.add_argument("--out", default="runs/bench/ttt_attention.json")
    p.add_argument("--child", choices=("kept", "recomputed"), help=argparse.SUPPRESS)
    return p.parse_args(argv)


def bench(args) -> str:
    if args.heads % args.kv_heads or min(args.seq, args.steps, args.iters, args.repeats) < 1:
        raise SpectrainError("--heads must be a multiple of --kv_heads; --seq/--steps/--iters/--repeats >= 1")
    common = [f"--seq={args.seq}", f"--heads={args.heads}", f"--kv_heads={args.kv_heads}",
              f"--head_dim={args.head_dim}", f"--steps={args.steps}", f"--iters={args.iters}"]
    runs = []
    for repeat in range(args.repeats):
        for setting in ("kept", "recomputed"):
            proc = subprocess.run([sys.executable, __file__, *common, "--child", setting], capture_output=True,
                                  text=True)
            if proc.returncode != 0:
                raise SpectrainError(f"the {setting} run failed: {proc.stderr.strip()[-2000:]}")
            runs.append({"setting": setting, "repeat": repeat, **json.loads(proc.stdout.strip().splitlines()[-1])})
    rows = []
    for setting in ("kept", "recomputed"):
        mine = [r for r in runs if r["setting"] == setting]
        rows.append({"setting": setting, "tokens_per_second": max(r["tokens_per_second"] for r in mine),
                     "peak_over_start_gib": max(r["peak_over_start_gib"] for r in mine)})
    kept, recomputed = rows
    summary = {"command": "python benchmarks/ttt_attention.py " + " ".join(sys.argv[1:]),
               "shape": {"batch": 1, "seq": args.seq, "heads": args.heads, "kv_heads": args.kv_heads,
                         "head_dim": args.head_dim, "ttt_steps": args.steps, "precision": "bf16 autocast"},
               "torch": torch.__version__, "threads": torch.get_num_threads(), "rows": rows, "runs": runs,
               "memory_ratio": recomputed["peak_over_start_gib"] / kept["peak_over_start_gib"],
               "speed_ratio": recomputed["tokens_per_second"] / kept["tokens_per_second"]}
    table = format_table(["TTT scores", "tokens/s (best)", "peak memory over start (GiB, worst)"],
                         [[r["setting"], round(r["tokens_per_second"], 1), round(r["peak_over_start_gib"], 2)]
                          for r in rows],
                         title=f"EAGLE TTT attention, T = {args.seq}, {args.heads} heads / {args.kv_heads} KV heads, "
                               f"{args.steps} steps, forward + backward")
    return finish(summary, args.out, tables=[table])


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.child:
        args.recompute = args.child == "recomputed"
        print(json.dumps(one(args)))
        return
    run_command(bench, args)


if __name__ == "__main__":
    main()
