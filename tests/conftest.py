"""Tiny random-config verifiers built in-process (no network, no ../shared)."""

from __future__ import annotations

import os
import random
import shutil
import tempfile
from pathlib import Path

import pytest
import torch

WORDS = ("the a cat dog sat on mat ran fast slow river hill tree bird sings quietly under over green blue house "
         "what is where why how king queen lord speak thou thee thy good night day love").split()


_CACHES: list[Path] = []


def pytest_configure(config):
    """Every cache a test run writes goes to a temporary directory, set before any test module is imported (HF
    libraries read their cache paths at import) and inherited by the tests' subprocesses: ``SPECTRAIN_CACHE``
    (bundled verifiers, built once per run there; tokenized data) and ``HF_HOME`` / ``HF_DATASETS_CACHE``. The
    user's caches are never written. ``SPECTRAIN_TEST_CACHE=DIR`` keeps them in DIR across runs instead."""
    kept = os.environ.get("SPECTRAIN_TEST_CACHE")
    root = Path(kept) if kept else Path(tempfile.mkdtemp(prefix="spectrain-test-cache-"))
    if not kept:
        _CACHES.append(root)
    os.environ["SPECTRAIN_CACHE"] = str(root / "spectrain")
    os.environ["HF_HOME"] = str(root / "hf")
    os.environ["HF_DATASETS_CACHE"] = str(root / "hf" / "datasets")


def pytest_unconfigure(config):
    for root in _CACHES:
        shutil.rmtree(root, ignore_errors=True)


def sample_text(n_lines: int = 400, seed: int = 0) -> str:
    rng = random.Random(seed)
    return "\n".join(" ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 14))) + rng.choice(".?!,")
                     for _ in range(n_lines)) + "\n"


@pytest.fixture(scope="session")
def tiny_tokenizer():
    from spectrain.data.bundled import train_tokenizer

    return train_tokenizer(sample_text(), vocab_size=320)


def make_verifier(arch: str, tied: bool, vocab_size: int, hidden: int = 32, layers: int = 2, max_pos: int = 256,
                  seed: int = 0):
    """A random-weight causal LM of the given family (llama | qwen2 | qwen3)."""
    from transformers import (LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM, Qwen3Config,
                              Qwen3ForCausalLM)

    families = {"llama": (LlamaConfig, LlamaForCausalLM), "qwen2": (Qwen2Config, Qwen2ForCausalLM),
                "qwen3": (Qwen3Config, Qwen3ForCausalLM)}
    config_cls, model_cls = families[arch]
    extra = {"head_dim": hidden // 4} if arch == "qwen3" else {}
    config = config_cls(vocab_size=vocab_size, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=max_pos,
                        tie_word_embeddings=tied, **extra)
    torch.manual_seed(seed)
    model = model_cls(config).eval()
    with torch.no_grad():  # larger logits than the default init, so argmaxes are not near-ties
        model.get_output_embeddings().weight.mul_(8.0)
    return model


@pytest.fixture(scope="session")
def verifier_factory(tmp_path_factory, tiny_tokenizer):
    """``verifier_factory(arch="llama", tied=False, vocab_size_extra=0, **kw) -> Path``: a saved model + tokenizer.

    ``vocab_size_extra`` pads the model's vocabulary beyond the tokenizer's (as many real models do).
    """
    cache: dict = {}

    def build(arch: str = "llama", tied: bool = False, vocab_size_extra: int = 0, **kw) -> Path:
        key = (arch, tied, vocab_size_extra, tuple(sorted(kw.items())))
        if key not in cache:
            out = tmp_path_factory.mktemp(f"verifier-{arch}-{'tied' if tied else 'untied'}")
            make_verifier(arch, tied, len(tiny_tokenizer) + vocab_size_extra, **kw).save_pretrained(out)
            tiny_tokenizer.save_pretrained(out)
            cache[key] = out
        return cache[key]

    return build


@pytest.fixture(scope="session")
def text_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("data") / "corpus.txt"
    path.write_text(sample_text(600, seed=1))
    return path


@pytest.fixture(autouse=True)
def _offline(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    torch.set_num_threads(min(2, os.cpu_count() or 1))
