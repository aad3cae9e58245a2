"""Acceptance-targeted LK losses (arXiv 2602.23881) as every family's option: the formulas, and each family trains
with them (the loss on a fixed batch falls); a hard-target Medusa run is refused (LK compares distributions)."""

from __future__ import annotations

import pytest
import torch

from spectrain.heads.errors import SpectrainError
from spectrain.train.losses import acceptance_loss, projected_token_loss, teacher_distribution


def test_lk_formulas():
    q = torch.tensor([[0.5, 0.3, 0.2], [0.1, 0.1, 0.8]])
    p = torch.tensor([[0.5, 0.3, 0.2], [0.6, 0.3, 0.1]])
    loss, alpha = acceptance_loss(p.log(), q, "lk_alpha")
    torch.testing.assert_close(alpha, torch.tensor([1.0, 0.3]))
    torch.testing.assert_close(loss, -alpha.log())
    loss, alpha = acceptance_loss(p.log(), q, "lk_hybrid", eta=3.0)
    lam = torch.exp(-3.0 * alpha)
    kl = (q * (q.log() - p.log())).sum(-1)
    torch.testing.assert_close(loss, lam * kl + (1 - lam) * (1 - alpha))
    assert loss[0].abs() < 1e-6  # p = q: nothing to learn
    with pytest.raises(ValueError):
        acceptance_loss(p.log(), q, "kl")


def test_token_loss_reads_dense_and_sparse_teachers():
    torch.manual_seed(0)
    states, weight = torch.randn(5, 8), torch.randn(6, 8)
    teacher_states, teacher_weight = torch.randn(5, 8), torch.randn(6, 8)
    dense = {"teacher_states": teacher_states, "teacher_weight": teacher_weight, "teacher_bias": None}
    q = teacher_distribution(dense, 6)
    torch.testing.assert_close(q, (teacher_states @ teacher_weight.T).softmax(-1))
    ids, probs = q.topk(6).indices, q.topk(6).values
    sparse = {"sparse_ids": torch.cat([ids, torch.full((5, 1), -1)], 1),
              "sparse_probs": torch.cat([probs, torch.zeros(5, 1)], 1)}
    torch.testing.assert_close(teacher_distribution(sparse, 6), q)
    for kind in ("lk_alpha", "lk_hybrid"):
        torch.testing.assert_close(projected_token_loss(states, weight, None, dense, kind),
                                   projected_token_loss(states, weight, None, sparse, kind))
    ce = projected_token_loss(states, weight, None, dense, "ce", chunk_size=None, recompute=False)
    torch.testing.assert_close(ce, -(q * (states @ weight.T).log_softmax(-1)).sum(-1).mean())


def _batch(vocab: int = 300):
    ids = torch.randint(0, vocab, (4, 24), generator=torch.Generator().manual_seed(1))
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "loss_mask": torch.ones_like(ids)}


@pytest.mark.parametrize("family,kw", [
    ("eagle", {"variant": "eagle1"}), ("eagle", {"variant": "eagle3", "ttt_steps": 2}),
    ("medusa", {"num_heads": 2, "target": "soft"})], ids=["eagle1", "eagle3", "medusa-soft"])
@pytest.mark.parametrize("token_loss", ["lk_alpha", "lk_hybrid"])
def test_every_family_trains_with_an_lk_loss(verifier_factory, family, kw, token_loss):
    from spectrain.train.eagle import EagleModule
    from spectrain.train.medusa import MedusaModule

    cls = EagleModule if family == "eagle" else MedusaModule
    torch.manual_seed(0)
    module = cls(verifier=str(verifier_factory("llama", False)), verifier_dtype="float32", warmup_steps=0,
                 token_loss=token_loss, **kw)
    if kw.get("variant") == "eagle3":
        rows = _batch()
        module.set_vocab_from([{"input_ids": rows["input_ids"][i], "loss_mask": rows["loss_mask"][i]} for i in range(4)])
    batch = _batch()
    optimizer = torch.optim.AdamW(module.drafter.parameters(), lr=1e-2)
    losses = []
    for _ in range(10):
        torch.manual_seed(1)  # the same feature noise each step
        loss, _ = module.drafter_loss(batch, module.features(batch, greedy=True))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0], losses


def test_lk_needs_a_distribution_to_compare(verifier_factory):
    from spectrain.train.dflash import DFlashModule
    from spectrain.train.medusa import MedusaModule

    verifier = str(verifier_factory("llama", False))
    with pytest.raises(SpectrainError, match="needs model.target soft"):
        MedusaModule(verifier=verifier, verifier_dtype="float32", target="greedy", token_loss="lk_alpha")
    with pytest.raises(SpectrainError, match="model.token_loss must be one of"):
        MedusaModule(verifier=verifier, verifier_dtype="float32", target="soft", token_loss="kl")
    with pytest.raises(SpectrainError, match="block drafter's loss is model.loss"):
        DFlashModule(verifier=verifier, verifier_dtype="float32", token_loss="lk_alpha")
