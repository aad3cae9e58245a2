"""Decoding with a block drafter (:mod:`spectrain.heads.dflash`): one drafter forward drafts the whole chain.

Each round: the verifier's fused features of the positions committed since the last round go through ``fc`` and
every layer's k / v projections into :class:`ContextCache` (preallocated buffers, one per layer and kind, written
at their positions: nothing is ever cropped, since the block's own keys never enter it); then the block
``[root, MASK x (B - 1)]`` at positions ``L .. L + B - 1`` runs once over the cached context (every context slot is
before the root, and the block is bidirectional: no mask), and slots 1..k give the k drafts (0..k - 1 with
``sample_from_anchor``). With DSpark's Markov
head, slot j's logits get the bias of the token chosen at slot j - 1 (k small steps after the one forward). With
DSpark's confidence head and ``min_confidence``, each round verifies only the drafts it expects to survive
(:meth:`DFlashChainDrafter._cut`).

At T > 0 each slot's distribution (temperature / top-k / top-p applied) is that draft's p, scattered back to the
full vocabulary when the head is ranked; acceptance is the loop's lossless rule.
"""

from __future__ import annotations

import torch
from torch import nn

from spectrain.heads.dflash import DFlashDrafter
from spectrain.heads.errors import SpectrainError
from spectrain.heads.verifier import drafter_embedding

from .accept import sample, target_probs
from .drafters import DraftState, Drafter, Proposal, check_draft_vocab, grow_dynamic_tree
from .family_evaluator import FamilyEvaluator, check_min_confidence_value, register_evaluator
from .tree import Tree


class ContextCache(nn.Module):
    """Every drafter layer's keys and values of the committed context: (1, kv_heads, max_len, d) buffers.

    ``length`` (host int) counts the positions written; a new prompt resets it. Buffers grow (reallocated) only
    when a longer decoder buffer comes along."""

    def __init__(self, layers: int, kv_heads: int, max_len: int, head_dim: int, dtype, device):
        super().__init__()
        shape = (1, kv_heads, max_len, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(layers)]
        self.max_len = max_len
        self.length = 0

    def append(self, kv: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Write each layer's (1, kv_heads, m, d) keys / values at positions ``length .. length + m - 1``."""
        m = kv[0][0].shape[2]
        if self.length + m > self.max_len:
            raise SpectrainError(f"DFlash context cache overflow: {self.length} + {m} > {self.max_len}")
        for buf_k, buf_v, (k, v) in zip(self.k, self.v, kv):
            buf_k[:, :, self.length:self.length + m] = k
            buf_v[:, :, self.length:self.length + m] = v
        self.length += m

    def view(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Each layer's filled part, (1, kv_heads, length, d) each (views, no copy)."""
        return [(k[:, :, :self.length], v[:, :, :self.length]) for k, v in zip(self.k, self.v)]


class DFlashChainDrafter(Drafter):
    """A chain of ``k`` <= ``config.drafts`` (B - 1, or B with ``sample_from_anchor``) drafts from one block-drafter
    forward per round.

    ``vocab`` (N,) target ids: the verifier ``lm_head``'s (and the Markov head's) rows at those ids, gathered once
    here; logits stay over N columns and tokens are mapped to target ids (None: all V rows).
    """

    name = "dflash"
    wants_features = True

    def __init__(self, drafter: DFlashDrafter, verifier_model, k: int, vocab: torch.Tensor | None = None,
                 min_confidence: float = 0.0):
        config = drafter.config
        if not 1 <= k <= config.drafts:
            raise SpectrainError(f"a block of {config.block_size} drafts 1 to {config.drafts} tokens per round, "
                                 f"not {k}")
        check_min_confidence(min_confidence, config)
        super().__init__(Tree.chain(k))
        self.min_confidence = float(min_confidence)
        # a cut round's verify structure, one per length (moved to the device in start)
        self._chains = [Tree.chain(n) for n in range(1, k)] if min_confidence else []
        self.drafter, self.k, self.config = drafter, k, config
        self.embed = drafter_embedding(verifier_model)
        lm_head = verifier_model.get_output_embeddings()
        self.vocab_size = config.vocab_size
        vocab = check_draft_vocab(vocab, self.vocab_size)
        device = lm_head.weight.device
        self.draft_ids = None if vocab is None else vocab.to(device)
        rows = self.draft_ids
        weight, bias = lm_head.weight, getattr(lm_head, "bias", None)
        if rows is not None:
            weight, bias = weight[rows], None if bias is None else bias[rows]
        self._head = (weight, bias)
        markov = drafter.markov_head.markov_w2.weight if config.markov_rank else None
        self._markov = markov if markov is None or rows is None else markov[rows]
        self.capture_layers = config.capture_ids
        self._mask_ids = torch.full((config.block_size - 1,), config.mask_token_id, dtype=torch.long, device=device)
        self._slots = torch.arange(config.block_size, device=device)
        self.cache: ContextCache | None = None
        self.slot_states: torch.Tensor | None = None  # the last round's (k, h) draft-slot states

    def start(self, state: DraftState, verifier) -> None:
        c, param = self.config, self.drafter.fc.weight
        size = state.tokens.numel()  # the decoder's buffer length: no position lies beyond it
        if self.cache is None or self.cache.max_len < size:
            self.cache = ContextCache(c.num_hidden_layers, c.num_kv_heads, size, c.head_dim, param.dtype, param.device)
        self.cache.length = 0
        if self.min_confidence and self._chains and self._chains[0].depth.device != param.device:
            self._chains = [chain.to(param.device) for chain in self._chains]

    def rewind(self, positions: int) -> None:
        """Forget the last ``positions`` cached context positions (the cost probe re-feeds one)."""
        self.cache.length -= positions

    def _target(self, ids: torch.Tensor) -> torch.Tensor:
        return ids if self.draft_ids is None else self.draft_ids[ids]

    def _full(self, p: torch.Tensor) -> torch.Tensor:
        """(n, N) draft probabilities -> (n, V), zero outside the draft vocabulary."""
        if self.draft_ids is None:
            return p
        return p.new_zeros(p.shape[0], self.vocab_size).index_copy(1, self.draft_ids, p)

    def block_logits(self, state: DraftState) -> torch.Tensor:
        """Extend the context cache with the new features, run the block once: (k, N) fp32 logits of the k draft
        slots (1..k; 0..k - 1 with ``sample_from_anchor``; Markov bias not included). Their (k, h) states after the
        final norm stay in ``slot_states`` for the confidence cut."""
        drafter, cache = self.drafter, self.cache
        new = state.new_features  # (m, len(target_layer_ids) * h): the positions right before the root
        start = state.length - 1 - new.shape[0]
        if start != cache.length:  # decoding hands over exactly the positions after the cached ones
            raise SpectrainError(f"DFlash context out of step: {cache.length} positions cached, {new.shape[0]} new "
                                 f"ones before the root at {state.length - 1}")
        positions = torch.arange(start, start + new.shape[0], device=new.device)[None]
        cache.append(drafter.context_kv(drafter.context(new[None]), positions))
        root = state.length - 1
        block = torch.cat([state.tokens[root:root + 1], self._mask_ids])
        hidden = drafter.block_hidden(self.embed(block)[None], (root + self._slots)[None], cache.view(), None)[0]
        first = self.config.first_draft_slot
        self.slot_states = hidden[first:first + self.k]
        weight, bias = self._head
        return torch.nn.functional.linear(self.slot_states.to(weight.dtype), weight, bias).float()

    @torch.no_grad()
    def propose(self, state: DraftState) -> Proposal:
        proposal = self._draft(self.block_logits(state), state)
        return self._cut(proposal, self.slot_states, state) if self.min_confidence else proposal

    def _cut(self, proposal: Proposal, states: torch.Tensor, state: DraftState) -> Proposal:
        """Verify only the drafts the confidence head expects to survive: the longest prefix whose predicted
        probability of being accepted whole, prod_{i <= n} sigmoid(c_i), is >= ``min_confidence`` (at least one
        draft). Slot j's confidence reads its state and the token before it (the root, then the drafts), as in
        training. Lossless at any temperature: whether draft n is verified depends on the context and the drafts
        before it, never on draft n itself (a stopping rule), and each verified draft is accepted by the same
        rule against its own p. The round's one extra host read: the verify pass's length."""
        tokens = proposal.tokens
        prev = torch.cat([state.tokens[state.length - 1:state.length], tokens[:-1]])
        survive = torch.sigmoid(self.drafter.confidence(states, prev).float()).cumprod(0)
        n = max(1, int((survive >= self.min_confidence).sum()))  # a prefix: the product never grows
        if n == self.k:
            return proposal
        probs = None if proposal.probs is None else proposal.probs[:n]
        return Proposal(tokens=tokens[:n], probs=probs, tree=self._chains[n - 1])

    def _draft(self, logits: torch.Tensor, state: DraftState) -> Proposal:
        """The k drafts (and, at T > 0, their (k, V) distributions) from the slots' (k, N) logits."""
        greedy = state.sampling.greedy
        if self._markov is None:  # every slot at once
            if greedy:
                return Proposal(tokens=self._target(logits.argmax(-1)))
            p = target_probs(logits, state.sampling)
            return Proposal(tokens=self._target(sample(p, state.generator)), probs=self._full(p))
        prev = state.tokens[state.length - 1:state.length]  # slot j's bias reads the token chosen at slot j - 1
        tokens, probs = [], []
        for j in range(self.k):
            bias = torch.nn.functional.linear(self.drafter.markov_head.markov_w1(prev), self._markov)
            row = logits[j:j + 1] + bias.float()
            if greedy:
                token = self._target(row.argmax(-1))
            else:
                p = target_probs(row, state.sampling)
                token = self._target(sample(p, state.generator))
                probs.append(p)
            tokens.append(token)
            prev = token
        return Proposal(tokens=torch.cat(tokens), probs=self._full(torch.cat(probs)) if probs else None)


class DFlashTreeDrafter(DFlashChainDrafter):
    """A tree from the block's per-slot distributions (DDTree's idea, arXiv 2604.12989), grown on the device.

    The same one forward per round; then EAGLE-2's best-first growth (:func:`~.drafters.grow_dynamic_tree`) with
    ``dynamic=(depth, topk, budget)``: the root's children are slot 1's ``topk`` best tokens and a node at depth d
    is expanded by slot d + 1's (plus, with a Markov head, the bias of the node's own token), scored by cumulative
    log-probability; the ``budget`` best nodes are verified. Drafts are deterministic (top-k), so acceptance is the
    multi-candidate rule at any temperature.
    """

    name = "dflash-tree"

    def __init__(self, drafter: DFlashDrafter, verifier_model, dynamic: tuple[int, int, int],
                 vocab: torch.Tensor | None = None):
        depth, topk, budget = dynamic
        if topk < 1 or budget < 1:
            raise SpectrainError(f"a dynamic tree needs topk and budget >= 1, got {topk}, {budget}")
        super().__init__(drafter, verifier_model, depth, vocab)
        self.topk, self.budget = topk, budget
        self.tree = Tree.from_paths([(0,) * d for d in range(1, min(depth, budget) + 1)])  # sizes the buffers

    @property
    def max_nodes(self) -> int:
        return self.budget

    def _bias(self, prev: torch.Tensor) -> torch.Tensor | float:
        """The Markov bias (n, N) of (n,) previous tokens (0 without a Markov head)."""
        if self._markov is None:
            return 0.0
        return torch.nn.functional.linear(self.drafter.markov_head.markov_w1(prev), self._markov).float()

    @torch.no_grad()
    def propose(self, state: DraftState) -> Proposal:
        logits = self.block_logits(state)  # (depth, N): slot d's logits, whatever its parent (but the Markov bias)
        topk = self.topk

        def expand(depth, tokens, parents, ancestors):  # the frontier's children come from slot depth + 1
            return torch.log_softmax(logits[depth].expand(topk, -1) + self._bias(tokens), -1)

        root = logits[:1] + self._bias(state.tokens[state.length - 1:state.length])
        return grow_dynamic_tree(torch.log_softmax(root[0], -1), self.k, topk, self.budget, expand,
                                 vocab=self.draft_ids)


def check_min_confidence(min_confidence: float, config) -> None:
    """``min_confidence``: 0 (verify every draft) or a probability in (0, 1) for a drafter with a confidence
    head."""
    check_min_confidence_value(min_confidence)
    if min_confidence and not config.confidence_head:
        raise SpectrainError("--min_confidence cuts each round by the drafter's confidence head, and this drafter "
                             "has none (train with --model.confidence_head true)")


def _dflash_drafter(drafter, model, tree, *, dynamic=None, vocab=None, min_confidence=0.0) -> Drafter:
    if dynamic is not None:
        if min_confidence:
            raise SpectrainError("--min_confidence cuts chains; a dynamic tree verifies its budget")
        return DFlashTreeDrafter(drafter, model, dynamic, vocab=vocab)
    return DFlashChainDrafter(drafter, model, tree.size, vocab=vocab, min_confidence=min_confidence)


DFLASH = FamilyEvaluator(build=_dflash_drafter, static_trees=False, dynamic_trees=True,
                         dynamic_tree_name="EAGLE-2 dynamic",  # the tree EAGLE-2 grows, over the block's slots
                         confidence=lambda drafter: drafter.config.confidence_head,
                         confidence_hint="DSpark's: train a dflash drafter with --model.confidence_head true",
                         max_depth=lambda drafter: drafter.config.drafts,
                         capture=lambda drafter: drafter.config.capture_ids)
register_evaluator("dflash", DFLASH)
