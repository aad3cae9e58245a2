"""Small verifiers of every family the evaluator decodes, trained from scratch on the bundled tinyshakespeare text:
what ``benchmarks/gpu_check.py`` races its drafters on, and ``benchmarks/architectures.py`` checks each family's
decoding with.

A family's verifier is its ``transformers`` config at shared sizes (:data:`SIZES`) plus what that family sets beyond
them (:data:`FAMILY_OPTIONS`: small experts, sliding windows that bind within a prompt, soft-capping, Granite's
multipliers), so every family-specific path of the decoder is exercised by a model small enough to train in
minutes.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

from spectrain.data.bundled import bundled_text_path, train_tokenizer
from spectrain.data.text import split_text
from spectrain.data.text import tokenize_lines
from spectrain.heads.errors import SpectrainError
from spectrain.heads.schedule import cosine_with_warmup

# What each family's verifier sets beyond the shared sizes (small experts, windows that bind within a prompt).
FAMILY_OPTIONS = {
    "llama": {}, "qwen2": {}, "qwen3": {}, "phi3": {}, "olmo2": {},
    "mistral": {"sliding_window": 64},
    "gemma2": {"sliding_window": 64, "final_logit_softcapping": 30.0, "attn_logit_softcapping": 50.0},
    "gemma3_text": {"sliding_window": 64, "final_logit_softcapping": 30.0},
    "granite": {"embedding_multiplier": 12.0, "residual_multiplier": 0.22, "attention_multiplier": 0.015,
                "logits_scaling": 4.0},
    "qwen3_moe": {"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": "inter/4"},
    "gpt_oss": {"num_local_experts": 8, "num_experts_per_tok": 2, "sliding_window": 64,
                "layer_types": "alternating", "rope_parameters": {"rope_type": "default", "rope_theta": 150000.0}},
}

SIZES = {  # the verifier: hidden, layers, heads, intermediate, steps, batch, block
    "full": (576, 8, 9, 1536, 1500, 64, 256),  # gpu_check.py on a GPU
    "small": (64, 2, 2, 128, 30, 8, 64),  # gpu_check.py --small: the same path at tiny sizes, on a CPU
    "cpu": (128, 4, 4, 256, 400, 16, 128),  # architectures.py: every family trained on a CPU
}


def batches(ids: torch.Tensor, batch: int, block: int, gen: torch.Generator, device):
    """Endless (batch, block + 1) windows of ``ids`` at random offsets: inputs and their next tokens."""
    offsets = torch.arange(block + 1)
    while True:
        starts = torch.randint(0, len(ids) - block - 1, (batch,), generator=gen)
        yield ids[starts[:, None] + offsets].to(device)


def autocast(device):
    """bf16 autocast on CUDA (the GPU check's training precision); fp32 elsewhere."""
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda")


def verifier_config(family: str, vocab_size: int, hidden: int, layers: int, heads: int, inter: int, tok):
    """The check's verifier: ``family``'s config at the shared sizes plus :data:`FAMILY_OPTIONS`."""
    from transformers import AutoConfig

    if family not in FAMILY_OPTIONS:
        raise SpectrainError(f"--family must be one of {', '.join(FAMILY_OPTIONS)}, not {family!r}")
    options = dict(FAMILY_OPTIONS[family])
    if options.get("moe_intermediate_size") == "inter/4":
        options["moe_intermediate_size"] = inter // 4
    if options.get("layer_types") == "alternating":
        options["layer_types"] = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)]
    if family.startswith("gemma"):
        options["query_pre_attn_scalar"] = hidden // heads
    return AutoConfig.for_model(family, vocab_size=vocab_size, hidden_size=hidden, intermediate_size=inter,
                                num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=heads,
                                head_dim=hidden // heads, max_position_embeddings=2048, tie_word_embeddings=True,
                                bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                                pad_token_id=tok.pad_token_id, **options)


def train_verifier(out: Path, size: str, device, log, family: str = "llama") -> tuple[Path, dict]:
    """A ``family`` verifier of :data:`SIZES` ``size`` trained from scratch on the bundled text's training split
    (a tokenizer of 2,048 tokens trained on it too), saved to ``out`` with its tokenizer. Returns ``out`` and a record:
    family, parameters, steps, held-out cross-entropy, training seconds."""
    from transformers import AutoModelForCausalLM

    hidden, layers, heads, inter, steps, batch, block = SIZES[size]
    train_text, val_text = split_text(bundled_text_path().read_text())
    tok = train_tokenizer(train_text, 2048)
    train_ids = torch.tensor(tokenize_lines(tok, train_text.splitlines(keepends=True)))
    val_ids = torch.tensor(tokenize_lines(tok, val_text.splitlines(keepends=True)))
    config = verifier_config(family, len(tok), hidden, layers, heads, inter, tok)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=2e-3, betas=(0.9, 0.95), weight_decay=0.1, fused=True)
    data = batches(train_ids, batch, block, torch.Generator().manual_seed(0), device)
    t0 = time.time()
    for step in range(steps):
        for g in opt.param_groups:
            g["lr"] = 2e-3 * cosine_with_warmup(step, 50, steps, 0.1)
        chunk = next(data)
        with autocast(device):
            logits = model(input_ids=chunk[:, :-1]).logits
        loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), chunk[:, 1:].flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if step % 250 == 0:
            log(f"verifier step {step}/{steps} loss {loss.item():.3f} ({time.time() - t0:.0f}s)")
    model.eval()
    with torch.no_grad(), autocast(device):
        n = (len(val_ids) - 1) // block
        x = val_ids[:n * block].view(n, block).to(device)
        y = val_ids[1:n * block + 1].view(n, block).to(device)
        val_ce = sum(float(torch.nn.functional.cross_entropy(model(input_ids=x[i:i + 32]).logits.float().flatten(0, 1),
                                                             y[i:i + 32].flatten(), reduction="sum"))
                     for i in range(0, n, 32)) / y.numel()
    model.save_pretrained(out)
    tok.save_pretrained(out)
    info = {"family": family, "parameters": sum(p.numel() for p in model.parameters()), "steps": steps,
            "val_cross_entropy": val_ce, "train_seconds": time.time() - t0}
    return out, info
