"""Decoding with a P-EAGLE drafter (:mod:`spectrain.heads.peagle`): one drafter forward drafts the round's chain.

Each round the positions committed since the last one (the verifier's fused features, each with the token after
it; the last pair is the root's) and k - 1 placeholder slots (``mask_token_id``, ``mask_state()``) at the next
positions go through the drafter once, causally, over its cache of the committed positions
(:class:`~.dflash.ContextCache`: one k / v buffer per layer); only the committed rows' keys and values are kept.
The root's row gives depth 0 and placeholder j depth j: k drafts. This is vLLM's ``parallel_drafting`` pass.

At T > 0 each draft is sampled from its own slot's distribution (temperature / top-k / top-p applied), which
depends on the context only, never on the round's earlier drafts; that distribution is the draft's p in the loop's
lossless acceptance, scattered back to the verifier's vocabulary from the draft vocabulary. Chains only: the
references (vLLM, speculators) draft chains with P-EAGLE.
"""

from __future__ import annotations

import torch

from spectrain.heads.eagle import check_aux_layer_order
from spectrain.heads.errors import SpectrainError
from spectrain.heads.verifier import drafter_embedding

from .accept import sample, target_probs
from .dflash import ContextCache
from .drafters import DraftState, Drafter, Proposal, check_draft_vocab
from .eagle import trained_draft_vocab
from .family_evaluator import FamilyEvaluator, register_evaluator
from .tree import Tree


class PEagleChainDrafter(Drafter):
    """A chain of ``k`` <= ``num_depths`` drafts from one P-EAGLE forward per round, over the drafter's trained
    draft vocabulary (a ``--draft_vocab`` is refused, as for EAGLE-3)."""

    name = "peagle"
    wants_features = True

    def __init__(self, drafter, verifier_model, k: int, vocab: torch.Tensor | None = None):
        c = drafter.config
        if not 1 <= k <= c.num_depths:
            raise SpectrainError(f"this P-EAGLE drafter was trained for {c.num_depths} depths: it drafts 1 to "
                                 f"{c.num_depths} tokens per round, not {k}")
        if check_draft_vocab(vocab, c.vocab_size) is not None:
            trained_draft_vocab(drafter, requested=vocab)  # refuses: it drafts over its trained vocabulary
        super().__init__(Tree.chain(k))
        self.drafter, self.k, self.config = drafter, k, c
        self.embed = drafter.embedding(drafter_embedding(verifier_model))
        self.vocab_size = c.vocab_size
        device = drafter.fc.weight.device
        self.draft_ids = drafter.draft_to_target(torch.arange(c.draft_vocab_size, device=device))
        self.capture_layers = tuple(check_aux_layer_order(c.aux_layer_ids, "the P-EAGLE drafter's aux_layer_ids"))
        self._mask_ids = torch.full((k - 1,), c.mask_token_id, dtype=torch.long, device=device)
        with torch.no_grad():
            self._mask_state = drafter.mask_state()[None].expand(k - 1, -1)  # (k - 1, h), computed once, as vLLM
        self.cache: ContextCache | None = None

    def start(self, state: DraftState, verifier) -> None:
        c, param = self.config, self.drafter.fc.weight
        size = state.tokens.numel()  # the decoder's buffer length: no committed position lies beyond it
        if self.cache is None or self.cache.max_len < size:
            self.cache = ContextCache(c.num_layers, c.num_kv_heads, size, c.head_dim, param.dtype, param.device)
        self.cache.length = 0

    def rewind(self, positions: int) -> None:
        """Forget the last ``positions`` cached positions (the cost probe re-feeds one)."""
        self.cache.length -= positions

    def slot_logits(self, state: DraftState) -> torch.Tensor:
        """Cache the new committed positions and run the round's one pass: (k, D) fp32 logits of depths 0..k-1."""
        cache, new = self.cache, state.new_features
        m = new.shape[0]
        if state.length - 1 - m != cache.length:  # decoding hands over exactly the positions after the cached ones
            raise SpectrainError(f"P-EAGLE context out of step: {cache.length} positions cached, {m} new ones before "
                                 f"the root at {state.length - 1}")
        ids = torch.cat([state.new_tokens, self._mask_ids])
        hidden = torch.cat([self.drafter.fuse(new[None])[0], self._mask_state.to(new.device)])
        positions = (cache.length + torch.arange(m + self.k - 1, device=ids.device))[None]
        out, kv = self.drafter.forward_layers(ids[None], hidden[None], self.embed, positions,
                                              past=cache.view() if cache.length else None)
        cache.append([(k[:, :, :m], v[:, :, :m]) for k, v in kv])  # the placeholders' entries are never kept
        return self.drafter.logits(out[0, m - 1:m - 1 + self.k]).float()

    @torch.no_grad()
    def propose(self, state: DraftState) -> Proposal:
        logits = self.slot_logits(state)
        if state.sampling.greedy:
            return Proposal(tokens=self.draft_ids[logits.argmax(-1)])
        p = target_probs(logits, state.sampling)  # each depth's own distribution: the context's alone
        full = p.new_zeros(p.shape[0], self.vocab_size).index_copy(1, self.draft_ids, p)
        return Proposal(tokens=self.draft_ids[sample(p, state.generator)], probs=full)


def _peagle_drafter(drafter, model, tree, *, dynamic=None, vocab=None) -> Drafter:
    if dynamic is not None or not tree.is_chain:
        raise SpectrainError("P-EAGLE drafts chains (vLLM's parallel drafting does; no reference grows trees from it)")
    return PEagleChainDrafter(drafter, model, tree.size, vocab=vocab)


PEAGLE = FamilyEvaluator(build=_peagle_drafter, static_trees=False, dynamic_trees=False,
                         max_depth=lambda drafter: drafter.config.num_depths,
                         capture=lambda drafter: tuple(drafter.config.aux_layer_ids),
                         fixed_draft_vocab=trained_draft_vocab)
register_evaluator("peagle", PEAGLE)
