"""How the evaluator drafts with EAGLE-1 / EAGLE-3 drafters: :class:`EagleChainDrafter` (a chain drafted
autoregressively with the drafter's own KV cache), :class:`EagleTreeDrafter` (a static rank-path tree or an EAGLE-2
dynamic tree grown each round) and the family's :class:`~.families.FamilyEvaluator` (``EAGLE``, named by
``heads/eagle.py``'s registration): an EAGLE-3 drafter reads fused verifier layers and drafts over the draft
vocabulary it was trained with.
"""

from __future__ import annotations

import torch

from spectrain.heads.eagle import check_aux_layer_order  # the one layer-order rule (EagleConfig's)
from spectrain.heads.errors import SpectrainError
from spectrain.heads.verifier import drafter_embedding

from .accept import sample, target_probs
from .drafters import DraftState, Drafter, Proposal, check_draft_vocab, grow_dynamic_tree
from .family_evaluator import FamilyEvaluator, register_evaluator
from .tree import Tree


def trained_draft_vocab(drafter, requested) -> int | None:
    """An EAGLE-3 drafter's draft vocabulary size (it drafts over the one it was trained with, so a ``requested``
    ``--draft_vocab`` is refused); None for EAGLE-1, whose ranked draft vocabulary is the caller's to choose."""
    if not drafter.is_eagle3:
        return None
    if requested is not None:
        raise SpectrainError("an EAGLE-3 drafter drafts over the draft vocabulary it was trained with "
                             f"({drafter.config.draft_vocab_size} tokens): --draft_vocab is for Medusa, EAGLE-1 and "
                             "DFlash")
    return drafter.config.draft_vocab_size


class EagleChainDrafter(Drafter):
    """An EAGLE-1 or EAGLE-3 drafter drafting a chain autoregressively with its own KV cache.

    The cache holds one entry per committed position t: the drafter's pass over (x_{t+1}, features_t). Draft
    steps feed the drafter's own output back (EAGLE-1: as the next feature; EAGLE-3: as the hidden input), and
    their cache entries are dropped after the round: the verifier's true features replace them.

    Draft steps score the drafter's own vocabulary (N columns, column i = target id ``draft_ids[i]``): EAGLE-3's
    trained draft vocabulary, or for EAGLE-1 the verifier ``lm_head``'s rows at ``vocab`` (N,) target ids,
    gathered once here (None: all V rows). Tokens are mapped to target ids; sampled drafts' p is scattered into
    the full vocabulary (zero outside the N rows), so acceptance stays lossless.
    """

    name = "eagle"
    wants_features = True

    def __init__(self, drafter, verifier_model, k: int, vocab: torch.Tensor | None = None):
        super().__init__(Tree.chain(k))
        self.drafter, self.k = drafter, k
        self.embed = drafter_embedding(verifier_model)
        self.lm_head = verifier_model.get_output_embeddings()
        self.vocab_size = drafter.config.vocab_size
        vocab = check_draft_vocab(vocab, self.vocab_size)
        if vocab is not None:
            trained_draft_vocab(drafter, requested=vocab)
        device = self.lm_head.weight.device
        if drafter.is_eagle3:
            self.draft_ids = drafter.draft_to_target(torch.arange(drafter.config.draft_vocab_size, device=device))
            self._head = None
        elif vocab is not None:
            self.draft_ids = vocab.to(device)
            bias = getattr(self.lm_head, "bias", None)
            self._head = (self.lm_head.weight[self.draft_ids], None if bias is None else bias[self.draft_ids])
        else:
            self.draft_ids, self._head = None, None
        aux = tuple(check_aux_layer_order(drafter.config.aux_layer_ids or (), "the EAGLE-3 drafter's aux_layer_ids"))
        self.capture_layers = aux if drafter.is_eagle3 else ()
        self.past = None

    def start(self, state: DraftState, verifier) -> None:
        self.past = None

    def _logits(self, out: torch.Tensor) -> torch.Tensor:
        """(n, h) -> (n, N) fp32 logits over the drafter's own vocabulary (``draft_ids``; all V when None)."""
        if self._head is None:
            return self.drafter.logits(out, self.lm_head).float()
        weight, bias = self._head
        return torch.nn.functional.linear(out.to(weight.dtype), weight, bias).float()

    def _target(self, ids: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary columns -> the verifier's token ids."""
        return ids if self.draft_ids is None else self.draft_ids[ids]

    def _full(self, p: torch.Tensor) -> torch.Tensor:
        """(N,) draft probabilities -> (V,), zero outside the draft vocabulary."""
        if self.draft_ids is None:
            return p
        return p.new_zeros(self.vocab_size).index_copy(0, self.draft_ids, p)

    def _step(self, ids, features, hidden_input: bool):
        past_len = 0 if self.past is None else self.past[0].shape[2]
        positions = (past_len + torch.arange(ids.shape[0], device=ids.device))[None]
        fn = self.drafter.forward_hidden if hidden_input else self.drafter.forward
        out, (k, v) = fn(ids[None], features[None], self.embed, position_ids=positions, past_kv=self.past)
        self.past = (k, v) if self.past is None else (torch.cat([self.past[0], k], 2), torch.cat([self.past[1], v], 2))
        return out[0]

    @torch.no_grad()
    def propose(self, state: DraftState) -> Proposal:
        out = self._step(state.new_tokens, state.new_features, hidden_input=False)
        committed = self.past
        tokens, probs = [], []
        last = out[-1:]
        for i in range(self.k):
            logits = self._logits(last)[0]  # (N,)
            if state.sampling.greedy:
                token = self._target(logits.argmax())
            else:
                p = target_probs(logits, state.sampling)
                token = self._target(sample(p[None], state.generator)[0])
                probs.append(self._full(p))
            tokens.append(token)
            if i + 1 < self.k:
                last = self._step(token[None], last, hidden_input=True)
        self.past = committed  # drop the draft steps' entries
        return Proposal(tokens=torch.stack(tokens), probs=torch.stack(probs) if probs else None)


class EagleTreeDrafter(EagleChainDrafter):
    """EAGLE drafting a tree: a static rank-path tree, or (``dynamic=(depth, topk, budget)``) an EAGLE-2 tree.

    Each depth runs the drafter once on the whole frontier: every node reads its parent's output as hidden
    input, sits at position ``base + depth - 1`` and attends to the committed cache plus its own ancestors
    (scratch K/V appended after the cache and dropped after the round).
    """

    name = "eagle-tree"

    def __init__(self, drafter, verifier_model, tree: Tree | None = None, dynamic: tuple[int, int, int] | None = None,
                 vocab: torch.Tensor | None = None):
        if (tree is None) == (dynamic is None):
            raise SpectrainError("give either a static tree or dynamic=(depth, topk, budget)")
        depth = tree.max_depth if tree is not None else dynamic[0]
        super().__init__(drafter, verifier_model, depth, vocab=vocab)
        self.static, self.dynamic = tree, dynamic
        self.tree = tree if tree is not None else Tree.chain(min(dynamic[0], dynamic[2]))

    @property
    def max_nodes(self) -> int:
        return self.static.size if self.static is not None else self.dynamic[2]

    def _run_frontier(self, tokens, parent_out, depth: int, base: int, mask: torch.Tensor, scratch):
        """One drafter pass over m frontier nodes at ``depth``: each sees the (m, past + m) ``mask`` row over the
        committed cache, the scratch entries of earlier depths and this pass. Returns their outputs (m, h),
        log-probs (m, N) over the draft vocabulary and the scratch K/V with theirs appended."""
        k_all, v_all = scratch
        positions = torch.full((1, tokens.shape[0]), base + depth - 1, device=tokens.device)
        out, (k, v) = self.drafter.forward_hidden(tokens[None], parent_out[None], self.embed, position_ids=positions,
                                                  attn_mask=mask[None, None], past_kv=(k_all, v_all))
        scratch = (torch.cat([k_all, k], 2), torch.cat([v_all, v], 2))
        return out[0], torch.log_softmax(self._logits(out[0]), -1), scratch

    @staticmethod
    def _slots_mask(ancestor_slots: list[list[int]], base: int, past: int, device) -> torch.Tensor:
        """(m, past + m): the committed cache, each node's ancestors' scratch slots, and itself."""
        m = len(ancestor_slots)
        mask = torch.zeros(m, past + m, dtype=torch.bool, device=device)
        mask[:, :base] = True
        for j, slots in enumerate(ancestor_slots):
            mask[j, slots] = True
            mask[j, past + j] = True
        return mask

    @torch.no_grad()
    def propose(self, state: DraftState) -> Proposal:
        out = self._step(state.new_tokens, state.new_features, hidden_input=False)
        committed = self.past
        base = committed[0].shape[2]
        root_logp = torch.log_softmax(self._logits(out[-1:]), -1)[0]
        if self.static is not None:
            tokens = self._static(root_logp, out[-1], base)
            self.past = committed
            return Proposal(tokens=tokens)
        proposal = self._dynamic(root_logp, out[-1], base)
        self.past = committed
        return proposal

    def _static(self, root_logp, root_out, base):
        tree = self.static  # its tensors stay on the host: read there, never synced from the device
        max_rank = int(tree.rank.max()) + 1
        tokens = torch.zeros(tree.size, dtype=torch.long, device=root_logp.device)
        slot = {}
        parent_top = {-1: self._target(root_logp.topk(max_rank).indices)}
        parent_out = {-1: root_out}
        scratch = self.past
        for depth in range(1, tree.max_depth + 1):
            nodes = [i for i, p in enumerate(self.static.paths) if len(p) == depth]
            for i in nodes:
                tokens[i] = parent_top[int(self.static_parent(i))][self.static.paths[i][-1]]
            expand = [i for i in nodes if any(len(q) == depth + 1 and q[:-1] == self.static.paths[i] for q in self.static.paths)]
            if not expand:
                break
            anc = [[slot[a] for a in self._ancestors(i) if a in slot] for i in expand]
            start = scratch[0].shape[2]
            out, logp, scratch = self._run_frontier(
                tokens[expand], torch.stack([parent_out[int(self.static_parent(i))] for i in expand]), depth, base,
                self._slots_mask(anc, base, start, tokens.device), scratch)
            for j, i in enumerate(expand):
                slot[i] = start + j
                parent_out[i] = out[j]
                parent_top[i] = self._target(logp[j].topk(max_rank).indices)
        return tokens

    def static_parent(self, i: int) -> int:
        return int(self.static.parent[i])

    def _ancestors(self, i: int) -> list[int]:
        out = []
        while i >= 0:
            i = self.static_parent(i)
            if i >= 0:
                out.append(i)
        return out

    def _dynamic(self, root_logp, root_out, base) -> Proposal:
        """EAGLE-2 (:func:`grow_dynamic_tree`): each pass feeds a frontier node its parent's output as hidden
        input; scratch K/V of earlier passes are appended after the committed cache."""
        depth_cap, topk, budget = self.dynamic
        own = torch.eye(topk, dtype=torch.bool, device=root_out.device)
        committed = torch.ones(topk, base, dtype=torch.bool, device=root_out.device)
        run = {"out": root_out.expand(topk, -1), "scratch": self.past}

        def expand(depth, tokens, parents, ancestors):
            parent_out = run["out"] if parents is None else run["out"][parents]
            mask = torch.cat([committed, ancestors, own], 1)
            run["out"], logp, run["scratch"] = self._run_frontier(tokens, parent_out, depth, base, mask, run["scratch"])
            return logp

        return grow_dynamic_tree(root_logp, depth_cap, topk, budget, expand, vocab=self.draft_ids)


def _eagle_drafter(drafter, model, tree, *, dynamic=None, vocab=None) -> Drafter:
    if dynamic is not None:
        return EagleTreeDrafter(drafter, model, dynamic=dynamic, vocab=vocab)
    if tree.is_chain:
        return EagleChainDrafter(drafter, model, tree.size, vocab=vocab)
    return EagleTreeDrafter(drafter, model, tree=tree, vocab=vocab)


EAGLE = FamilyEvaluator(build=_eagle_drafter, dynamic_trees=True,
                        dynamic_tree_name="EAGLE-2 dynamic",  # EAGLE-2's tree (Li et al., 2024)
                        fixed_draft_vocab=trained_draft_vocab,
                        capture=lambda d: tuple(d.config.aux_layer_ids or ()) if d.is_eagle3 else (),
                        published=tuple({"method": method, "tau": tau, "verifier": verifier, "bench": "MT-bench",
                                         "drafting": "~60-node dynamic tree"}
                                        for method, tau, verifier in (("EAGLE-2", 4.8, "Vicuna-13B"),
                                                                      ("EAGLE-3", 6.6, "Vicuna-13B"),
                                                                      ("EAGLE-3", 6.1, "Llama-3.1-8B"))))
register_evaluator("eagle", EAGLE)
