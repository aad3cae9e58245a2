"""Batched sampling for self-distillation: HF ``generate()`` vs spectrain-distill's own loop, in one run.

    python benchmarks/distill_speed.py [--verifier bundled:smollm2] [--batch 64] [--new_tokens 64] [--json PATH]

Both sample at T = 0.8 from the full distribution, same prompts, same dtype (auto), EOS ignored for the timing
(every row generates ``--new_tokens``). Prints a table; the last line is the JSON's path.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

from spectrain.data.distill import generate_batch
from spectrain.heads.errors import run_command
from spectrain.heads.report import finish, format_table
from spectrain.heads.precision import resolve_dtype
from spectrain.heads.verifier import load_verifier


def main_(args) -> Path:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    verifier = load_verifier(args.verifier, dtype=resolve_dtype("auto", device), device=device)
    model, tok = verifier.model, verifier.tokenizer
    tok.padding_side = "left"
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    prompts = [tok.apply_chat_template([{"role": "user", "content": f"Write a long story number {i} about a cat."}],
                                       add_generation_prompt=True, tokenize=False) for i in range(args.batch)]
    enc = tok(prompts, return_tensors="pt", padding=True, add_special_tokens=False).to(device)
    n = args.new_tokens

    def hf():
        model.generate(**enc, do_sample=True, temperature=0.8, top_k=0, top_p=1.0, max_new_tokens=n,
                       min_new_tokens=n, pad_token_id=tok.pad_token_id)

    def ours():
        generate_batch(model, enc["input_ids"], enc["attention_mask"], n, 0.8,
                       torch.Generator(device=device).manual_seed(0), [])  # no stop ids: all n tokens

    rows = {}
    with torch.no_grad():
        for name, fn in (("HF generate()", hf), ("spectrain-distill loop", ours)):
            fn()  # warm-up
            t0 = time.perf_counter()
            fn()
            rows[name] = args.batch * n / (time.perf_counter() - t0)
    table = format_table(["sampler", "tokens/s"], [[k, round(v, 1)] for k, v in rows.items()],
                         title=f"sampling {args.batch} x {n} tokens at T=0.8 on {args.verifier} ({device}, "
                               f"{next(model.parameters()).dtype})")
    out = Path(args.json)
    return finish({"command": "python benchmarks/distill_speed.py " + " ".join(sys.argv[1:]), "batch": args.batch,
                   "new_tokens": n, "tokens_per_second": rows,
                   "speedup": rows["spectrain-distill loop"] / rows["HF generate()"]}, out, [table])


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--verifier", default="bundled:smollm2")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--new_tokens", type=int, default=64)
    p.add_argument("--json", default="runs/bench/distill_speed.json")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> Path:
    return run_command(main_, parse_args(argv))


if __name__ == "__main__":
    main()
