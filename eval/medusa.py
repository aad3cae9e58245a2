"""How the evaluator drafts with Medusa heads: :class:`MedusaDrafter` (every depth in one pass, a node at depth d
and rank r takes head d's r-th most likely token), the heads' calibration on the verifier's own outputs
(:func:`medusa_diagnostics`: the rank accuracies ``--tree auto:N`` and the planner build trees from) and the family's
:class:`~.families.FamilyEvaluator` (``MEDUSA``, named by ``heads/medusa.py``'s registration).

Calibration, teacher-forced on real outputs: per depth k and rank r, how often head k's rank-r token is the
verifier's greedy token (at T > 0: the mean q' it gets; the tree builder's input), and the mean KL(q||p) and
total-variation distance between the verifier's distribution q at t+k and head k's distribution p at t (at T > 0 the
acceptance rate of a sampled draft is 1 - TV).
"""

from __future__ import annotations

from dataclasses import asdict

import torch

from spectrain.heads.errors import SpectrainError
from spectrain.heads.medusa import MedusaHeads

from .accept import Sampling, target_probs
from .drafters import DraftState, Drafter, Proposal, check_draft_vocab
from .family_evaluator import FamilyEvaluator, register_evaluator
from .static_model import StaticCausalLM
from .tree import Tree


class MedusaDrafter(Drafter):
    """Medusa heads: node at depth d with rank r takes head d's r-th most likely token.

    ``vocab`` (N,) target ids: every head drafts over those N rows only (their weights gathered once, here),
    so a round costs K x N x H multiply-accumulates instead of K x V x H; the verifier still checks the full
    vocabulary, so outputs are unchanged (a token outside the rows is never drafted, it is only not proposed).
    """

    name = "medusa"

    def __init__(self, heads: MedusaHeads, verifier_lm_head, tree: Tree, vocab: torch.Tensor | None = None):
        if tree.max_depth > heads.config.num_heads:
            raise SpectrainError(f"the tree is {tree.max_depth} deep but there are only {heads.config.num_heads} "
                                 "Medusa heads")
        super().__init__(tree)
        weight = verifier_lm_head.weight
        self.heads, self.lm_head = heads.to(weight.device, weight.dtype), verifier_lm_head
        self.max_rank = int(tree.rank.max()) + 1 if tree.size else 1
        self._index: tuple[torch.Tensor, torch.Tensor] | None = None  # (head, rank) per node, on the device
        vocab = check_draft_vocab(vocab, weight.shape[0])
        self.vocab = None if vocab is None else vocab.to(weight.device)
        self._ranked = None if vocab is None else self._gather(self.vocab)

    def _gather(self, vocab: torch.Tensor):
        """The heads' vocabulary rows at ``vocab``: one (N, H) weight when every head shares the verifier's
        ``lm_head``, else (K, N, H); biases (N,) / (K, N) or None. Frozen: copied once per drafter."""
        params = [self.heads.lm_head_params(k, self.lm_head) for k in range(self.heads.config.num_heads)]
        if self.heads.lm_heads is None:
            weight, bias = params[0]
            return weight[vocab], None if bias is None else bias[vocab]
        weights = torch.stack([w[vocab] for w, _ in params])
        biases = None if params[0][1] is None else torch.stack([b[vocab] for _, b in params])
        return weights, biases

    def _logits_many(self, hidden: torch.Tensor) -> torch.Tensor:
        """(..., H) -> (K, ..., V) fp32 head logits over the full vocabulary (calibration)."""
        return self.heads(hidden.to(self.lm_head.weight.dtype), self.lm_head).float()

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """(H,) -> (K, N) head logits over the draft vocabulary (N = V without one)."""
        if self._ranked is None:
            return self._logits_many(hidden[None])[:, 0]
        weight, bias = self._ranked
        states = torch.cat(self.heads.head_states(hidden[None].to(weight.dtype)))  # (K, H)
        if weight.dim() == 2:  # a shared head: all K heads in one (K, H) x (H, N) product
            return torch.nn.functional.linear(states, weight, bias).float()
        logits = torch.bmm(weight, states[:, :, None])[:, :, 0]  # (K, N)
        return (logits if bias is None else logits + bias).float()

    def propose(self, state: DraftState) -> Proposal:
        if self.tree.size == 0:
            return Proposal(tokens=state.tokens.new_zeros(0))
        logits = self._logits(state.hidden)  # (K, N)
        top = logits.topk(self.max_rank, dim=-1).indices  # (K, R)
        if self.vocab is not None:
            top = self.vocab[top]
        if self._index is None or self._index[0].device != top.device:  # once: no host-to-device copy per round
            self._index = (self.tree.depth.to(top.device) - 1, self.tree.rank.to(top.device))
        return Proposal(tokens=top[self._index])


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


def _medusa_drafter(heads, model, tree, *, dynamic=None, vocab=None) -> Drafter:
    return MedusaDrafter(heads, model.get_output_embeddings(), tree, vocab=vocab)


def _calibrate(heads, runner: StaticCausalLM, sequences: list[list[int]], start_positions: list[int], *,
               temperature: float, decoding: Sampling) -> dict:
    """The heads' rank accuracies on the verifier's outputs, every head's full vocabulary (:func:`medusa_diagnostics`)."""
    probe = MedusaDrafter(heads, runner.model.get_output_embeddings(), Tree.chain(heads.config.num_heads))
    return medusa_diagnostics(runner, probe, sequences, start_positions, temperature=temperature, decoding=decoding)


MEDUSA = FamilyEvaluator(build=_medusa_drafter, calibrate=_calibrate, max_depth=lambda heads: heads.config.num_heads,
                         published=({"method": "Medusa-1", "tau": 2.3, "verifier": "Vicuna-7B", "bench": "Spec-Bench",
                                     "drafting": "~60-node static tree"},))
register_evaluator("medusa", MEDUSA)
