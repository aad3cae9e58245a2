"""Verifiers and drafters with known behaviour for the evaluator's tests."""

from __future__ import annotations

import copy

import torch

from spectrain.heads.medusa import MedusaHeads


def bigram_verifier(arch: str = "llama", vocab: int = 300, hidden: int = 32, layers: int = 2, mix: float = 0.05,
                    seed: int = 0):
    """A verifier whose greedy next token is (mostly) a fixed permutation pi of the current token.

    Embeddings are random unit-ish vectors; lm_head row y is a scaled copy of the embedding of pi^-1(y);
    attention and MLP outputs are scaled by ``mix`` so context still matters a little (and the KV cache is
    exercised) without destroying the permutation.
    """
    from tests.conftest import make_verifier

    model = make_verifier(arch, False, vocab, hidden=hidden, layers=layers, seed=seed)
    g = torch.Generator().manual_seed(seed)
    perm = torch.randperm(vocab, generator=g)
    with torch.no_grad():
        emb = torch.randn(vocab, hidden, generator=g)
        emb = emb / emb.norm(dim=-1, keepdim=True) * hidden ** 0.5
        model.get_input_embeddings().weight.copy_(emb)
        inverse = torch.empty_like(perm)
        inverse[perm] = torch.arange(vocab)
        model.get_output_embeddings().weight.copy_(emb[inverse] * 2.0)
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.mul_(mix)
            layer.mlp.down_proj.weight.mul_(mix)
    model.generation_config.eos_token_id = None  # compare raw greedy streams; EOS handling is tested apart
    model.generation_config.pad_token_id = 0
    return model.eval(), perm


def oracle_medusa(model, perm: torch.Tensor, num_heads: int, noise: float, seed: int = 0) -> MedusaHeads:
    """Medusa heads that predict the bigram verifier's greedy future (plus noise)."""
    heads = MedusaHeads.for_verifier(model, num_heads=num_heads, num_layers=1)
    emb = model.get_input_embeddings().weight
    g = torch.Generator().manual_seed(seed)
    vocab = perm.numel()
    with torch.no_grad():
        for k in range(num_heads):
            target = torch.arange(vocab)
            for _ in range(k + 2):  # head k (0-based) at t drafts token t+k+2 = pi^(k+2)(x_t)
                target = perm[target]
            inverse = torch.empty_like(target)
            inverse[target] = torch.arange(vocab)
            weight = emb[inverse] * 2.0
            heads.lm_heads[k].weight.copy_(weight + noise * torch.randn(weight.shape, generator=g) * weight.std())
            heads.blocks[k][0].linear.bias.zero_()
    return heads


def noised_copy(model, noise: float, seed: int = 0):
    """A draft model: the verifier with Gaussian noise of relative size ``noise`` on every weight."""
    draft = copy.deepcopy(model)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in draft.parameters():
            p.add_(torch.randn(p.shape, generator=g) * noise * p.std().clamp_min(1e-3))
    return draft


def oracle_eagle1(model, noise: float, seed: int = 1):
    """An EAGLE-1 drafter that (noise aside) passes the input token's embedding through, so the bigram
    verifier's lm_head reads off its greedy next token: drafts that are often, not always, accepted."""
    from spectrain.heads.eagle import EagleDrafter

    torch.manual_seed(seed)
    eagle = EagleDrafter.for_verifier(model, "eagle1")
    h = model.config.hidden_size
    with torch.no_grad():
        eagle.layer.mlp.down_proj.weight.mul_(0.01)
        eagle.layer.self_attn.o_proj.weight.mul_(0.01)
        eagle.fc.weight.copy_(torch.cat([torch.eye(h), torch.zeros(h, h)], 1) + noise * torch.randn(h, 2 * h) / h ** 0.5)
    return eagle
