"""``spectrain-rank-vocab``: give a drafter the token counts its ranked draft heads read.

Training writes ``vocab_ranking.json`` beside every drafter it exports (the loss-masked tokens of
its training rows). A drafter trained elsewhere, or before rankings were written, gets one here: the
loss-masked (assistant) tokens of the given data files, tokenized and rendered exactly as training renders
them (``DrafterDataModule``), counted and written into the drafter's directory (atomically). Then
``spectrain-eval --draft_vocab N`` drafts over the N most frequent of them.

    spectrain-rank-vocab DRAFTER_DIR --verifier bundled:smollm2 --data chats.json [more.json ...] --default_size 8192
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from spectrain.heads.errors import SpectrainError, run_command
from spectrain.heads.report import format_table
from spectrain.heads.vocab import RANKING_FILE, coverage, load_ranking, save_ranking, token_counts

from .datamodule import DrafterDataModule

COVERAGE_SIZES = (1024, 2048, 4096, 8192, 16384, 32768)


def count_tokens(paths: list[str], tokenizer: str, vocab_size: int, block_size: int = 640,
                 gguf_file: str | None = None) -> torch.Tensor:
    """(V,) loss-masked token counts of the training rows of every file in ``paths``, rendered as training
    renders them (chat template, assistant-only loss mask; text: every token)."""
    counts = torch.zeros(vocab_size, dtype=torch.int64)
    for path in paths:
        if not Path(path).exists():
            raise SpectrainError(f"--data {path}: no such file or directory")
        data = DrafterDataModule(path=path, tokenizer=tokenizer, gguf_file=gguf_file, block_size=block_size)
        data.setup("fit")
        counts += token_counts(data.vocab_rows(), vocab_size)
    return counts


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="spectrain-rank-vocab", description=__doc__.split("\n\n")[0])
    p.add_argument("drafter", help="the drafter's directory (a run dir or an export): vocab_ranking.json goes there")
    p.add_argument("--verifier", required=True, help="the verifier whose tokenizer and chat template to use")
    p.add_argument("--gguf_file", default=None)
    p.add_argument("--data", nargs="+", required=True, help="training data files (chat JSON/JSONL, text)")
    p.add_argument("--block_size", type=int, default=640, help="rows cut as training cuts them")
    p.add_argument("--default_size", type=int, default=8192,
                   help="the draft vocabulary spectrain-eval uses by default (0 = full)")
    p.add_argument("--source", default="", help="what the counts are of (recorded in the file)")
    p.add_argument("--force", action="store_true", help="replace an existing vocab_ranking.json")
    return p.parse_args(argv)


def rank_vocab(args: argparse.Namespace) -> Path:
    drafter = Path(args.drafter)
    if not (drafter / "config.json").is_file():
        raise SpectrainError(f"{drafter} is not a drafter directory (no config.json)")
    if load_ranking(drafter) is not None and not args.force:
        raise SpectrainError(f"{drafter / RANKING_FILE} exists; pass --force to replace it")
    if args.default_size < 0:
        raise SpectrainError(f"--default_size must be >= 0 (0 = full), got {args.default_size}")
    from spectrain.heads.verifier import load_verifier

    # The verifier's lm_head rows (a tokenizer may count fewer or more ids than the model has rows).
    vocab_size = load_verifier(args.verifier, gguf_file=args.gguf_file).model.get_output_embeddings().weight.shape[0]
    counts = count_tokens(args.data, args.verifier, vocab_size, args.block_size, args.gguf_file)
    if int(counts.sum()) == 0:
        raise SpectrainError("the data holds no loss-masked tokens to count")
    source = args.source or "loss-masked tokens of " + ", ".join(Path(p).name for p in args.data)
    path = save_ranking(drafter, counts, args.default_size, source)
    rows = [[n, round(coverage(counts, n), 4)] for n in COVERAGE_SIZES if n < vocab_size]
    print(format_table(["draft vocabulary", "coverage of counted tokens"], rows,
                       title=f"{int(counts.sum()):,} tokens counted, {int((counts > 0).sum()):,} distinct; "
                             f"default {args.default_size or 'full'}"))
    print(path.resolve(), flush=True)
    return path


def main(argv: list[str] | None = None) -> None:
    run_command(rank_vocab, parse_args(argv))


if __name__ == "__main__":
    main()
