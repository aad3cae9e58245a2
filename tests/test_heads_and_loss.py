"""Medusa heads: structure, init from lm_head, export/reload, chunked loss == unchunked loss."""

from __future__ import annotations

import pytest
import torch

from spectrain.heads.errors import SpectrainError
from spectrain.heads.medusa import MedusaHeads
from spectrain.heads.verifier import load_verifier
from spectrain.train.losses import projected_cross_entropy, projected_topk

ARCHS = [("llama", False), ("llama", True), ("qwen3", False), ("qwen2", True)]


@pytest.mark.parametrize("arch,tied", ARCHS)
def test_heads_distinct_and_initialized_from_lm_head(verifier_factory, arch, tied):
    verifier = load_verifier(str(verifier_factory(arch, tied))).model
    heads = MedusaHeads.for_verifier(verifier, num_heads=3, num_layers=2)
    blocks = [block for head in heads.blocks for block in head]
    assert len({id(b) for b in blocks}) == 6, "every head and layer must own its ResBlock"
    assert len({id(b.linear.weight) for b in blocks}) == 6
    assert len({id(h.weight) for h in heads.lm_heads}) == 3
    lm_head = verifier.get_output_embeddings().weight
    for head in heads.lm_heads:
        assert torch.equal(head.weight, lm_head)
        assert head.weight.data_ptr() != lm_head.data_ptr(), "a copy, not the verifier's tensor"
    for block in blocks:
        assert torch.count_nonzero(block.linear.weight) == 0
    # Training one head's ResBlock must not move any other head.
    with torch.no_grad():
        heads.blocks[0][0].linear.weight.add_(1.0)
    assert all(torch.count_nonzero(b.linear.weight) == 0 for b in blocks[1:])


@pytest.mark.parametrize("arch,tied", ARCHS)
@pytest.mark.parametrize("shared", [False, True])
def test_export_reload_identical_logits(tmp_path, verifier_factory, arch, tied, shared):
    verifier = load_verifier(str(verifier_factory(arch, tied))).model
    heads = MedusaHeads.for_verifier(verifier, num_heads=3, num_layers=1, shared_lm_head=shared)
    with torch.no_grad():
        for p in heads.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    heads.save_pretrained(tmp_path / "heads")
    again = MedusaHeads.from_pretrained(tmp_path / "heads", verifier_model=verifier)
    hidden = torch.randn(2, 5, verifier.config.hidden_size)
    lm_head = verifier.get_output_embeddings()
    assert torch.equal(heads(hidden, lm_head), again(hidden, lm_head))
    assert heads(hidden, lm_head).shape == (3, 2, 5, verifier.config.vocab_size)
    if shared:
        assert again.lm_heads is None  # nothing of the verifier's head is stored


def test_reload_onto_other_verifier_is_refused(tmp_path, verifier_factory):
    small = load_verifier(str(verifier_factory("llama", False))).model
    MedusaHeads.for_verifier(small, num_heads=2).save_pretrained(tmp_path / "heads")
    wider = load_verifier(str(verifier_factory("llama", False, hidden=48))).model
    with pytest.raises(SpectrainError, match="hidden size 32.*verifier's is 48"):
        MedusaHeads.from_pretrained(tmp_path / "heads", verifier_model=wider)
    bigger_vocab = load_verifier(str(verifier_factory("llama", False, vocab_size_extra=64))).model
    with pytest.raises(SpectrainError, match="vocabulary of"):
        MedusaHeads.from_pretrained(tmp_path / "heads", verifier_model=bigger_vocab)


def test_reload_rejects_mismatched_weights(tmp_path, verifier_factory):
    verifier = load_verifier(str(verifier_factory("llama", False))).model
    MedusaHeads.for_verifier(verifier, num_heads=2).save_pretrained(tmp_path / "a")
    MedusaHeads.for_verifier(verifier, num_heads=3).save_pretrained(tmp_path / "b")
    (tmp_path / "b" / "model.safetensors").replace(tmp_path / "a" / "model.safetensors")
    with pytest.raises(SpectrainError, match="does not match its config"):
        MedusaHeads.from_pretrained(tmp_path / "a")


def _targets(kind: str, n: int, h: int, v: int, dtype=torch.float64) -> dict:
    if kind == "soft":
        return {"teacher_states": torch.randn(n, h, dtype=dtype), "teacher_weight": torch.randn(v, h, dtype=dtype)}
    if kind == "sparse":  # a top-3 teacher, one row teaching nothing, one id missing (-1)
        ids = torch.randint(0, v, (n, 3))
        ids[1, 2] = -1
        probs = torch.rand(n, 3, dtype=dtype).masked_fill(ids < 0, 0)
        probs[4] = 0
        return {"sparse_ids": ids, "sparse_probs": probs / probs.sum(-1, keepdim=True).clamp_min(1e-9)}
    return {"target_ids": torch.randint(0, v, (n,))}


@pytest.mark.parametrize("kind", ["hard", "soft", "sparse"])
def test_chunked_loss_gradients_equal_unchunked(kind):
    torch.manual_seed(0)
    n, h, v = 37, 16, 101
    states = torch.randn(n, h, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(v, h, dtype=torch.float64, requires_grad=True)
    bias = torch.randn(v, dtype=torch.float64, requires_grad=True)
    kwargs = _targets(kind, n, h, v)
    results = []
    for chunk in (None, 5, 16, 1000):
        loss = projected_cross_entropy(states, weight, bias, chunk_size=chunk, **kwargs)
        grads = torch.autograd.grad(loss, (states, weight, bias))
        results.append((loss.detach(), grads))
    ref_loss, ref_grads = results[0]
    for loss, grads in results[1:]:
        torch.testing.assert_close(loss, ref_loss, rtol=1e-12, atol=1e-12)
        for g, r in zip(grads, ref_grads):
            torch.testing.assert_close(g, r, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("kind", ["hard", "soft", "sparse"])
def test_chunked_loss_under_autocast_casts_the_weight_once_per_pass(kind):
    """Under bf16 autocast (Lightning's runs without a cast cache) the chunked loss casts the fp32 weight once in
    forward and once in backward — not once per chunk twice — with the gradients of the unchunked path."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Casts(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func in (torch.ops.aten._to_copy.default, torch.ops.aten.to.dtype) and \
                    args[0].data_ptr() == weight.data_ptr():  # a copy of the weight itself
                self.n += 1
            return func(*args, **(kwargs or {}))

    torch.manual_seed(0)
    n, h, v = 40, 16, 101
    states = torch.randn(n, h, requires_grad=True)
    weight = torch.randn(v, h, requires_grad=True)
    kwargs = _targets(kind, n, h, v, torch.float32)
    if kind == "soft":
        kwargs["teacher_weight"] = kwargs["teacher_weight"].bfloat16()  # the frozen verifier head, bf16 already
    results = []
    for chunk, recompute in ((None, False), (8, True)):
        with Casts() as casts:
            with torch.autocast("cpu", dtype=torch.bfloat16, cache_enabled=False):
                loss = projected_cross_entropy(states, weight, chunk_size=chunk, recompute=recompute, **kwargs)
            grads = torch.autograd.grad(loss, (states, weight))
        results.append((loss, grads, casts.n))
    (ref_loss, ref_grads, _), (loss, grads, count) = results
    assert count == 2  # forward and backward; the old per-chunk checkpoint path cast it 2 x 5 times
    torch.testing.assert_close(loss, ref_loss, rtol=1e-3, atol=1e-3)
    for g, r in zip(grads, ref_grads):
        assert g.dtype == r.dtype == torch.float32
        torch.testing.assert_close(g, r, rtol=2e-2, atol=2e-3)


def test_chunked_topk_matches_full():
    torch.manual_seed(1)
    states, weight = torch.randn(3, 7, 8), torch.randn(50, 8)
    full = (states @ weight.T).topk(5, dim=-1).indices
    assert torch.equal(projected_topk(states, weight, k=5, chunk_size=4), full)
