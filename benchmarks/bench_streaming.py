"""Benchmark (not a test): train on a generated text corpus several times larger than the process may allocate.

    python benchmarks/bench_streaming.py --corpus_gb 4 --cap_gb 1.5 --steps 30

Writes a corpus of ``--corpus_gb`` GB of generated English-like text, then trains the recipe ``--recipe`` (any
under ``configs/``; by default Medusa's bundled one) with ``--data.streaming true`` on the bundled verifier in a
child process whose anonymous memory is capped at ``--cap_gb`` (``RLIMIT_DATA``: heap and anonymous
mappings, i.e. everything a materialized dataset would need). Reports the child's peak RSS, bytes it read
from disk, steps and tokens/s; prints a table, writes JSON, prints its path last.
"""

from __future__ import annotations

import argparse
import json
import random
import resource
import subprocess
import sys
import time
from pathlib import Path

from spectrain.heads.errors import run_command
from spectrain.heads.report import finish, format_table

WORDS = ("the king queen lord lady speak thou thee thy good night day love war peace crown sword heart fair sweet "
         "death life come go know make say see time hand eye man woman father mother son daughter house England "
         "France honour grace noble heaven earth blood tears joy grief").split()


def write_corpus(path: Path, gigabytes: float, seed: int = 0) -> int:
    """Lines of random words until the file holds ``gigabytes`` GB; a 16 MB chunk is generated then varied."""
    rng = random.Random(seed)
    target = int(gigabytes * 1e9)
    chunk_lines = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(5, 16))) + rng.choice(".,;!?") + "\n"
                   for _ in range(200_000)]
    written = 0
    with open(path, "w") as f:
        while written < target:
            rng.shuffle(chunk_lines)  # every 16 MB differs in order, so blocks never repeat exactly
            text = "".join(chunk_lines)
            f.write(text)
            written += len(text)
    return written


def main(argv: list[str] | None = None) -> None:
    """Bad input: ``error: ...`` on stderr and exit code 2 (no traceback)."""
    return run_command(_main, argv)


def _main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--corpus_gb", type=float, default=4.0)
    p.add_argument("--cap_gb", type=float, default=1.5)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--recipe", default="medusa_tinyshakespeare.yaml", help="the recipe trained (configs/)")
    p.add_argument("--workdir", default="runs/bench_streaming")
    p.add_argument("--keep_corpus", action="store_true")
    args = p.parse_args(argv)
    work = Path(args.workdir)
    work.mkdir(parents=True, exist_ok=True)
    corpus = work / "corpus.txt"
    t0 = time.time()
    size = write_corpus(corpus, args.corpus_gb)
    write_seconds = time.time() - t0
    cap = int(args.cap_gb * 2**30)

    def limit():
        resource.setrlimit(resource.RLIMIT_DATA, (cap, cap))

    script = ("import sys\n"
              "def rchar():\n"
              "    return int(open('/proc/self/io').read().split('rchar: ')[1].split()[0])\n"
              "from spectrain.heads.errors import run_command\n"
              "from spectrain.train.cli import train\n"
              "start = rchar()\n"
              "try:\n"
              "    run_command(train, sys.argv[1], sys.argv[2:])  # bad input: exit 2 with the error, as the CLIs\n"
              "finally:\n"
              "    print('RCHAR', rchar() - start, file=sys.stderr)\n")
    run_dir = work / "run"
    cmd = [sys.executable, "-c", script, args.recipe, "--data.path", str(corpus), "--data.streaming", "true",
           "--trainer.max_steps", str(args.steps), "--trainer.val_check_interval", str(args.steps),
           "--trainer.limit_val_batches", "5", "--run_dir", str(run_dir), "--force", "true", "--logger", "none"]
    t1 = time.time()
    proc = subprocess.run(cmd, capture_output=True, text=True, preexec_fn=limit)
    train_wall = time.time() - t1
    peak_rss = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024
    read = int(proc.stderr.split("RCHAR ")[1].split()[0]) if "RCHAR " in proc.stderr else None
    summary = {"corpus_bytes": size, "corpus_write_seconds": round(write_seconds, 1), "memory_cap_bytes": cap,
               "corpus_over_cap": round(size / cap, 2), "returncode": proc.returncode, "steps": args.steps,
               "peak_rss_bytes": peak_rss, "bytes_read_during_training": read, "train_wall_seconds": round(train_wall, 1)}
    if proc.returncode == 0:
        run = json.loads((run_dir / "summary.json").read_text())
        summary.update(train_tokens_per_second=run["train_tokens_per_second"], trained_tokens=run["trained_tokens"])
    else:
        summary["stderr_tail"] = proc.stderr[-2000:]
    if not args.keep_corpus:
        corpus.unlink()
    gib = 2**30
    table = format_table(["corpus", "memory cap (RLIMIT_DATA)", "corpus / cap", "peak RSS", "read while training",
                          "steps", "tokens/s", "exit"],
                         [[f"{size / gib:.2f} GiB", f"{cap / gib:.2f} GiB", f"{size / cap:.1f}x",
                           f"{peak_rss / gib:.2f} GiB", f"{(read or 0) / 2**20:.0f} MiB", args.steps,
                           summary.get("train_tokens_per_second", "-"), proc.returncode]],
                         title=f"streaming training ({args.recipe}, --data.streaming true, bundled verifier)")
    finish(summary, work / "bench_streaming.json", [table])


if __name__ == "__main__":
    main()
