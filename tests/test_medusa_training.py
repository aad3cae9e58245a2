"""Medusa training semantics: label shift, the three targets, the loss mask, metrics, checkpoints."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from spectrain.train.medusa import MedusaModule


def module(verifier_factory, **kw) -> MedusaModule:
    kw.setdefault("num_heads", 3)
    kw.setdefault("verifier_dtype", "float32")  # compared against fp32 references below
    return MedusaModule(verifier=str(verifier_factory("llama", False)), **kw)


def batch_of(ids: torch.Tensor, loss_mask: torch.Tensor | None = None) -> dict:
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids),
            "loss_mask": torch.ones_like(ids) if loss_mask is None else loss_mask}


def perturb(m: MedusaModule) -> None:
    with torch.no_grad():
        for p in m.drafter.parameters():
            p.add_(torch.randn_like(p) * 0.05)


@pytest.mark.parametrize("target", ["ground_truth", "greedy", "soft"])
def test_head_k_is_trained_on_token_t_plus_k_plus_1(verifier_factory, target):
    torch.manual_seed(0)
    m = module(verifier_factory, target=target)
    perturb(m)
    ids = torch.randint(0, 300, (2, 24))
    mask = torch.ones_like(ids)
    mask[0, 10:14] = 0  # these tokens are not targets (e.g. a user turn)
    batch = batch_of(ids, mask)
    loss, parts = m.drafter_loss(batch, m.features(batch))
    with torch.no_grad():
        verifier_logits = m.verifier(ids).logits  # position s predicts token s+1
        head_logits = m.drafter(m.verifier.model(ids).last_hidden_state, m.verifier_lm_head)  # (K, B, T, V)
    T, expected_total = ids.shape[1], 0.0
    for k in range(3):  # 0-based k is head k+1: position t predicts token t+(k+1)+1
        n = T - (k + 1) - 1
        logits = head_logits[k][:, :n]
        target_mask = mask[:, k + 2:].bool()
        if target == "ground_truth":
            per_pos = F.cross_entropy(logits.transpose(1, 2), ids[:, k + 2:], reduction="none")
        elif target == "greedy":  # the verifier's argmax at position t+(k+1)
            per_pos = F.cross_entropy(logits.transpose(1, 2), verifier_logits[:, k + 1:T - 1].argmax(-1), reduction="none")
        else:
            q = verifier_logits[:, k + 1:T - 1].softmax(-1)
            per_pos = -(q * logits.log_softmax(-1)).sum(-1)
        expected = per_pos[target_mask].mean()
        torch.testing.assert_close(parts[f"head{k + 1}_loss"], expected, rtol=1e-5, atol=1e-5)
        expected_total += 0.8 ** k * expected
    torch.testing.assert_close(loss, expected_total, rtol=1e-5, atol=1e-5)


def test_heads_learn_the_shifted_token(verifier_factory):
    """On a cyclic sequence head k must learn token t+k+1 — not t+k or t+k+2."""
    torch.manual_seed(0)
    m = module(verifier_factory, target="ground_truth", num_heads=2)
    period = 7
    base = torch.arange(40) % period + 20
    opt = torch.optim.Adam(m.drafter.parameters(), lr=3e-2)
    for step in range(150):
        ids = torch.stack([base.roll(-int(s)) for s in torch.randint(0, period, (4,))])
        batch = batch_of(ids)
        loss, _ = m.drafter_loss(batch, m.features(batch))
        opt.zero_grad()
        loss.backward()
        opt.step()
    ids = base[None]
    with torch.no_grad():
        pred = m.drafter(m.verifier.model(ids).last_hidden_state, m.verifier_lm_head).argmax(-1)[:, 0]  # (K, T)
    for k in range(2):
        n = 40 - k - 2
        assert (pred[k, :n] == ids[0, k + 2:]).float().mean() > 0.95
        assert (pred[k, :n] == ids[0, k + 1:40 - 1]).float().mean() < 0.2


def test_validation_counts_match_brute_force(verifier_factory):
    torch.manual_seed(1)
    m = module(verifier_factory, num_heads=3)
    perturb(m)
    ids = torch.randint(0, 300, (3, 20))
    ids[0] = 42  # a constant row: heads (initialized from lm_head) agree with the verifier there, so chains grow
    batch = batch_of(ids)
    sums = {k: v.double() for k, v in m.validation_counts(batch, m.features(batch)).items()}
    metrics = m.val_metrics(sums)
    with torch.no_grad():
        greedy = m.verifier(ids).logits.argmax(-1)
        heads = m.drafter(m.verifier.model(ids).last_hidden_state, m.verifier_lm_head)
    T, K = 20, 3
    chain_lengths = []
    for b in range(3):
        for t in range(T - K - 1):
            length = 0
            for k in range(K):
                if heads[k, b, t].argmax() == greedy[b, t + k + 1]:
                    length += 1
                else:
                    break
            chain_lengths.append(length)
    assert max(chain_lengths) >= 2 and min(chain_lengths) == 0, "the case must cover long and empty chains"
    assert metrics["tau_pred"] == pytest.approx(1 + sum(chain_lengths) / len(chain_lengths))
    for k in range(K):
        n = T - k - 2
        top1 = (heads[k, :, :n].argmax(-1) == greedy[:, k + 1:k + 1 + n]).float().mean()
        top5 = (heads[k, :, :n].topk(5, -1).indices == greedy[:, k + 1:k + 1 + n, None]).any(-1).float().mean()
        truth = (heads[k, :, :n].argmax(-1) == ids[:, k + 2:]).float().mean()
        assert metrics[f"head{k + 1}_top1_ver"] == pytest.approx(float(top1))
        assert metrics[f"head{k + 1}_top5_ver"] == pytest.approx(float(top5))
        assert metrics[f"head{k + 1}_top1_gt"] == pytest.approx(float(truth))
        assert metrics[f"p_chain_{k + 1}"] == pytest.approx(sum(c > k for c in chain_lengths) / len(chain_lengths))


def test_optimizer_excludes_verifier(verifier_factory):
    m = module(verifier_factory)
    trainable = {id(p) for p in m.drafter.parameters()}
    assert all(not p.requires_grad for p in m.verifier.parameters())
    assert not trainable & {id(p) for p in m.verifier.parameters()}
    assert not m.verifier.training
