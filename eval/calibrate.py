"""Drafter-quality diagnostics measured teacher-forced on real outputs.

For Medusa heads: per depth k and rank r, how often head k's rank-r token is
the verifier's greedy token (at T > 0: the mean q' it gets; the tree builder's input), and the mean KL(q||p)
and total-variation distance between the verifier's distribution q at t+k and
head k's distribution p at t (at T > 0 the acceptance rate of a sampled draft
is 1 - TV).
"""

from __future__ import annotations

from dataclasses import asdict

import torch

from .accept import Sampling, target_probs
from .drafters import MedusaDrafter
from .static_model import StaticCausalLM


@torch.no_grad()
def medusa_diagnostics(runner: StaticCausalLM, drafter: MedusaDrafter, sequences: list[list[int]],
                       start_positions: list[int], max_rank: int = 10, temperature: float = 1.0,
                       decoding: Sampling = Sampling()) -> dict:
    """Rank accuracies (K, max_rank), KL and TV per depth over positions t >= start in each sequence.

    Rank accuracy of head k, rank r: how often the verifier emits that candidate there, under ``decoding`` (what
    the tree planner multiplies along paths). Greedy: the candidate is the verifier's argmax. Sampled: the mean of
    q'(candidate) — a deterministic candidate is accepted with exactly the probability that q' emits it, so the
    greedy hit rate would overrate top ranks at T > 0. KL and TV compare the heads with q at ``temperature``.
    """
    K = drafter.heads.config.num_heads
    hits = torch.zeros(K, max_rank, dtype=torch.float64)
    kl = torch.zeros(K, dtype=torch.float64)
    tv = torch.zeros(K, dtype=torch.float64)
    count = torch.zeros(K, dtype=torch.float64)
    sampling = Sampling(temperature=temperature)
    for seq, start in zip(sequences, start_positions):
        if len(seq) > runner.max_len:
            seq = seq[:runner.max_len]
        runner.reset()
        hidden = runner.forward(torch.tensor(seq, device=runner.device))  # (T, H)
        logits = runner.logits(hidden)
        greedy = logits.argmax(-1)
        q = target_probs(logits, sampling)
        emitted = q if decoding == sampling else target_probs(logits, decoding)
        head_logits = drafter._logits_many(hidden)  # (K, T, V)
        T = len(seq)
        for k in range(K):
            t = torch.arange(max(start - 1, 0), T - k - 1, device=hidden.device)  # head k at t drafts t+k+2
            if t.numel() == 0:
                continue
            top = head_logits[k, t].topk(max_rank, dim=-1).indices
            if decoding.greedy:
                hits[k] += (top == greedy[t + k + 1][:, None]).double().sum(0).cpu()
            else:
                hits[k] += emitted[t + k + 1].gather(1, top).double().sum(0).cpu()
            p = target_probs(head_logits[k, t], sampling)
            qk = q[t + k + 1]
            kl[k] += (qk * (qk.clamp_min(1e-30).log() - p.clamp_min(1e-30).log())).sum(-1).double().sum().cpu()
            tv[k] += (0.5 * (qk - p).abs().sum(-1)).double().sum().cpu()
            count[k] += t.numel()
    runner.reset()
    n = count.clamp_min(1)
    return {
        "rank_accuracy": (hits / n[:, None]).tolist(),
        "kl": (kl / n).tolist(),
        "tv": (tv / n).tolist(),
        "positions": count.tolist(),
        "temperature": temperature,
        "rank_accuracy_under": asdict(decoding),
    }
