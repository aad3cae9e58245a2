"""Drafters behind one small interface.

Each round the decoder hands a drafter the :class:`DraftState` (context tokens,
the verifier's last hidden state, the root token = last emitted token, not yet
run by the verifier) and gets back a :class:`Proposal`: a token for every node
of the drafter's tree (a chain is a tree), plus the drafter's probabilities
when the drafts were sampled. After verification the drafter hears how many
drafts were accepted (``advance``) so it can roll its own state back.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from spectrain.heads.errors import SpectrainError
from spectrain.heads.medusa import MedusaHeads
from spectrain.heads.verifier import drafter_embedding

from .accept import Sampling, sample, target_probs
from .static_model import StaticCausalLM
from .tree import DeviceTree, Tree


@dataclass
class DraftState:
    """What a drafter may look at. ``tokens[:length]`` is the context, ``tokens[length-1]`` the root."""

    tokens: torch.Tensor  # (max_len,) on device
    length: int
    hidden: torch.Tensor  # (H,) verifier hidden state that produced the root
    sampling: Sampling
    generator: torch.Generator | None = None
    history: list[int] = field(default_factory=list)  # the same context on the host (kept by the decoder)
    # For feature-based drafters (EAGLE): verifier features of the positions committed since the last round,
    # (m, F), and the token that follows each of them, (m,).
    new_features: torch.Tensor | None = None
    new_tokens: torch.Tensor | None = None


@dataclass
class Proposal:
    tokens: torch.Tensor  # (n,) one per tree node
    probs: torch.Tensor | None = None  # (n, V) for sampled chain drafts
    tree: Tree | None = None  # this round's tree, for drafters whose tree changes every round


class Drafter:
    """Base of every drafter: proposes a tree of candidate tokens each round (:class:`Autoregressive` proposes
    none)."""

    name = "base"
    wants_features = False  # EAGLE drafters read the verifier's features of every committed position
    capture_layers: tuple[int, ...] = ()  # HF hidden_states indices the verifier must keep (EAGLE-3)

    def __init__(self, tree: Tree | None = None):
        self.tree = tree if tree is not None else Tree.chain(0)

    @property
    def max_nodes(self) -> int:
        """Most candidate nodes a round can propose (sizes the verify buffers)."""
        return self.tree.size

    def start(self, state: DraftState, verifier: StaticCausalLM) -> None:
        """Called after the verifier's prefill of a new prompt."""

    def propose(self, state: DraftState) -> Proposal:
        raise NotImplementedError

    def advance(self, accepted: int, state: DraftState) -> None:
        """``accepted`` drafts were kept; ``state`` is the context after the round (new root included)."""


class Autoregressive(Drafter):
    """No drafts: plain autoregressive decoding through the same loop (the baseline every speedup divides)."""

    name = "none"

    def propose(self, state: DraftState) -> Proposal:
        return Proposal(tokens=state.tokens.new_zeros(0))


def check_draft_vocab(vocab: torch.Tensor | None, vocab_size: int) -> torch.Tensor | None:
    """A ranked draft vocabulary: (N,) int64 target ids, ascending and distinct, within the verifier's
    ``vocab_size``; None = the full vocabulary."""
    if vocab is None:
        return None
    vocab = torch.as_tensor(vocab)
    if vocab.dim() != 1 or vocab.dtype != torch.int64 or vocab.numel() < 1:
        raise SpectrainError(f"a draft vocabulary is a 1-D int64 tensor of target ids, got {vocab.dtype} "
                             f"{tuple(vocab.shape)}")
    if int(vocab.min()) < 0 or int(vocab.max()) >= vocab_size or bool((vocab.diff() <= 0).any()):
        raise SpectrainError(f"draft vocabulary ids must be ascending, distinct and below {vocab_size}")
    return vocab


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


MAX_NGRAM = 3  # the longest suffix prompt lookup matches (vLLM's default prompt_lookup_max is 4; 3 measured here)


def prompt_lookup(context: list[int], k: int, max_ngram: int) -> tuple[int, list[int]]:
    """Prompt lookup over ``context`` (prompt and output so far): (n, the k tokens that followed the latest earlier
    occurrence of the context's last n tokens), for the longest n <= ``max_ngram`` that occurs; a continuation
    shorter than k repeats its last token. (0, []) when not even the last token occurred before."""
    for n in range(min(max_ngram, len(context) - 1), 0, -1):
        suffix = context[-n:]
        for start in range(len(context) - n - 1, -1, -1):
            if context[start:start + n] == suffix:
                follow = context[start + n:start + n + k]
                return n, follow + [follow[-1]] * (k - len(follow))
    return 0, []


class NgramDrafter(Drafter):
    """Prompt lookup (training-free): find the latest earlier occurrence of the context's last n-gram
    (n = max_ngram .. 1) and propose the tokens that followed it."""

    name = "ngram"

    def __init__(self, k: int, max_ngram: int = MAX_NGRAM):
        super().__init__(Tree.chain(k))
        self.k, self.max_ngram = k, max_ngram

    def propose(self, state: DraftState) -> Proposal:
        ctx = state.history or state.tokens[:state.length].tolist()
        _, follow = prompt_lookup(ctx, self.k, self.max_ngram)
        return Proposal(tokens=torch.tensor(follow or [ctx[-1]] * self.k, dtype=torch.long, device=state.tokens.device))


MAX_MATCH_SAMPLED = 8  # the longest match a sampled hybrid round may require (it looks up n-grams that long)


def check_min_match(min_match: int, min_match_sampled: int, max_ngram: int = MAX_NGRAM) -> None:
    """The hybrid's switch lengths, checked before anything loads (the CLIs' ``--min_match`` flags)."""
    if not 1 <= min_match <= max_ngram:
        raise SpectrainError(f"--min_match must be between 1 and {max_ngram} (the longest n-gram looked up), "
                             f"got {min_match}")
    if not 1 <= min_match_sampled <= MAX_MATCH_SAMPLED:
        raise SpectrainError(f"--min_match_sampled must be between 1 and {MAX_MATCH_SAMPLED}, got {min_match_sampled}")


def merge_branch(tokens: list[int], tree: Tree, branch: list[int]) -> tuple[list[int], Tree]:
    """Add the chain ``branch`` under the root of ``tree`` (one token per node, in ``tree.paths`` order): where a
    node already drafts the branch's next token the branch follows it, elsewhere new nodes rank after their
    siblings. Returns (tokens, tree) of the merged tree, in its path order."""
    paths, toks = list(tree.paths), list(tokens)
    children: dict[tuple, dict[int, tuple]] = {}
    for path, token in zip(paths, toks):
        children.setdefault(path[:-1], {}).setdefault(token, path)
    node: tuple = ()
    for token in branch:
        kids = children.setdefault(node, {})
        if token not in kids:
            kids[token] = node + (1 + max((p[-1] for p in kids.values()), default=-1),)
            paths.append(kids[token])
            toks.append(token)
        node = kids[token]
    merged = Tree.from_paths(paths)
    by_path = dict(zip(paths, toks))
    return [by_path[p] for p in merged.paths], merged


class HybridDrafter(Drafter):
    """Prompt lookup and a learned drafter (Medusa or EAGLE) in one decoder.

    * ``merge=False`` (a chain): each round drafts the lookup's continuation (``lookup`` tokens, default ``k``)
      when the context's last ``min_match`` or more tokens occurred earlier, and the learned drafter's chain of
      ``k`` otherwise. A lookup chain costs nothing to draft, so a longer one adds τ for the price of a wider
      verify pass (which did not pay on a 2-core CPU: docs/evaluation.md); its rounds bring their own chain, so
      the verifier sees ``lookup + 1`` rows then. At T > 0 the
      match must be ``min_match_sampled`` tokens long (n-grams that long are looked up): a deterministic lookup
      token is accepted with probability q(c) while the learned drafter's sampled draft is accepted with
      min(1, q/p), so only long matches pay there (SmolLM2 + EAGLE-1, 16 MT-bench prompts, T = 1: accepted
      drafts per round by lookup vs by the learned drafter in contexts with such a match: 0.80 vs 1.13 for
      2-token matches, 0.97 vs 0.73 for 3, ~2.5 vs ~0.6 for 4 to 6, docs/smollm2.md §4);
    * ``merge=True`` (a tree): each round drafts the learned drafter's tree with the lookup's continuation merged
      in as one more branch (``max_nodes`` = the learned drafter's + ``k``).

    Lossless like the others: the choice depends only on the context, and each round's candidates are verified
    by the rule for their kind (deterministic lookup tokens and top-k nodes by the multi-candidate rule, sampled
    chain drafts against their p). An EAGLE drafter reads the features of every committed position; those of
    rounds drafted by lookup are kept and handed to its next round, so it never runs on lookup rounds.
    """

    name = "hybrid"

    def __init__(self, learned: Drafter, k: int, merge: bool, max_ngram: int = MAX_NGRAM, min_match: int = 2,
                 min_match_sampled: int = 4, lookup: int | None = None):
        check_min_match(min_match, min_match_sampled, max_ngram)
        if lookup is not None and merge:
            raise SpectrainError(f"a hybrid tree's lookup branch is its k ({k}); a separate lookup length ({lookup}) "
                                 "is for chains")
        if lookup is not None and lookup < 1:
            raise SpectrainError(f"a hybrid chain's lookup length must be >= 1, got {lookup}")
        if not isinstance(learned, Drafter) or isinstance(learned, (HybridDrafter, Autoregressive, NgramDrafter)):
            raise SpectrainError(f"hybrid drafting takes a learned drafter (any registered family), not "
                                 f"{getattr(learned, 'name', type(learned).__name__)}")
        if not merge and learned.tree.size != k:
            raise SpectrainError(f"a hybrid chain of {k} needs a learned chain of {k}, got {learned.tree.size} nodes")
        super().__init__(learned.tree)
        self.learned, self.k, self.merge, self.max_ngram = learned, k, merge, max_ngram
        self.lookup = lookup or k  # tokens a lookup round drafts (a tree: the merged branch, k)
        # A chain's lookup rounds of another length than the learned chain bring their own chain (built once).
        self.lookup_tree = Tree.chain(self.lookup) if self.lookup != learned.tree.size and not merge else None
        self.min_match, self.min_match_sampled = min_match, min_match_sampled
        self.wants_features, self.capture_layers = learned.wants_features, learned.capture_layers
        self.pending: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.lookup_rounds = self.rounds = 0

    @property
    def max_nodes(self) -> int:
        return self.learned.max_nodes + self.k if self.merge else max(self.learned.max_nodes, self.lookup)

    def start(self, state: DraftState, verifier: StaticCausalLM) -> None:
        self.pending = []
        if self.lookup_tree is not None:
            self.lookup_tree = self.lookup_tree.to(verifier.device)
        self.learned.start(state, verifier)

    def propose(self, state: DraftState) -> Proposal:
        self.rounds += 1
        if self.wants_features:  # cloned: the verifier's output buffers may be reused by the next forward
            self.pending.append((state.new_features.clone(), state.new_tokens.clone()))
        greedy = state.sampling.greedy
        n, follow = prompt_lookup(state.history or state.tokens[:state.length].tolist(), self.lookup,
                                  self.max_ngram if greedy else max(self.max_ngram, self.min_match_sampled))
        found = n >= (self.min_match if greedy else self.min_match_sampled)
        if found and not self.merge:
            self.lookup_rounds += 1
            return Proposal(tokens=torch.tensor(follow, dtype=torch.long, device=state.tokens.device),
                            tree=self.lookup_tree)
        if self.wants_features:
            state.new_features = torch.cat([f for f, _ in self.pending])
            state.new_tokens = torch.cat([t for _, t in self.pending])
            self.pending = []
        proposal = self.learned.propose(state)
        if not (found and self.merge):
            return proposal
        self.lookup_rounds += 1
        tokens, tree = merge_branch(proposal.tokens.tolist(), proposal.tree or self.learned.tree, follow)
        return Proposal(tokens=torch.tensor(tokens, dtype=torch.long, device=state.tokens.device), tree=tree)

    def advance(self, accepted: int, state: DraftState) -> None:
        self.learned.advance(accepted, state)


class ModelDrafter(Drafter):
    """A small causal LM with the verifier's tokenizer drafts a chain autoregressively with its own KV cache."""

    name = "draft-model"

    def __init__(self, model, k: int, max_len: int):
        super().__init__(Tree.chain(k))
        self.k = k
        # The draft model's numbers never reach the output (the verifier checks them): no invariance to pay for.
        self.runner = StaticCausalLM(model, max_len=max_len + k + 1, batch_invariant=False)
        self.pending: torch.Tensor | None = None  # context tokens not yet in the draft cache

    def start(self, state: DraftState, verifier) -> None:
        self.runner.reset()
        self.pending = state.tokens[:state.length]

    def _step(self, tokens: torch.Tensor) -> torch.Tensor:
        hidden = self.runner.forward(tokens)
        self.runner.commit(tokens.numel())
        return self.runner.logits(hidden[-1])

    def propose(self, state: DraftState) -> Proposal:
        self._committed = self.runner.length
        logits = self._step(self.pending)
        tokens, probs = [], []
        for i in range(self.k):
            p = target_probs(logits, state.sampling)
            token = sample(p[None], state.generator)[0] if not state.sampling.greedy else logits.argmax()
            tokens.append(token)
            probs.append(p)
            if i + 1 < self.k:
                logits = self._step(token[None])
        self._last_draft = tokens[-1] if tokens else None
        tokens = torch.stack(tokens) if tokens else state.tokens.new_zeros(0)
        return Proposal(tokens=tokens, probs=None if state.sampling.greedy else torch.stack(probs))

    def advance(self, accepted: int, state: DraftState) -> None:
        # The draft cache holds pending + drafts 1..k-1; keep pending + the accepted drafts, re-feed the rest.
        keep = self._committed + self.pending.numel() + min(accepted, self.k - 1)
        self.runner.length = keep
        self.pending = state.tokens[keep:state.length]


def truncated_verifier(model, num_layers: int):
    """The classic draft-model baseline: the verifier's first ``num_layers`` layers + its norm and lm_head
    (weights shared, nothing copied)."""
    import copy

    n = model.config.num_hidden_layers
    if not 1 <= num_layers < n:
        raise SpectrainError(f"a truncated verifier needs 1 <= layers < {n}, got {num_layers}")
    config = copy.deepcopy(model.config)
    config.num_hidden_layers = num_layers
    if isinstance(getattr(config, "layer_types", None), list):
        config.layer_types = config.layer_types[:num_layers]
    param = next(model.parameters())
    draft = type(model)(config).to(dtype=param.dtype)
    state = {k: v for k, v in model.state_dict().items()
             if not k.startswith("model.layers.") or int(k.split(".")[2]) < num_layers}
    draft.load_state_dict(state, assign=True, strict=False)  # assign: share the verifier's tensors
    return draft.to(param.device).eval().requires_grad_(False)


def grow_dynamic_tree(root_logp: torch.Tensor, depth_cap: int, topk: int, budget: int, expand,
                      vocab: torch.Tensor | None = None) -> Proposal:
    """An EAGLE-2 dynamic tree, built on the device (no host read).

    The root's ``topk`` best tokens start it; at each of ``depth_cap - 1`` levels the ``topk`` best frontier
    nodes (by cumulative log-probability) are expanded by their ``topk`` best children in one drafter pass:
    ``expand(depth, tokens, parents, ancestors) -> (topk, V)`` log-probabilities, for frontier ``tokens`` (topk,)
    at ``depth``, ``parents`` their rows in the previous pass (None at depth 1), and ``ancestors`` (topk,
    (depth - 1) * topk) which earlier passes' rows each descends from. Then the ``budget`` best nodes are kept
    (ties: the shallower first; a child never scores above its parent, so the kept set is a tree).
    ``vocab`` (N,): the log-probabilities are over a ranked draft vocabulary, column i = target id vocab[i].
    """
    device = root_logp.device

    def target(ids):
        return ids if vocab is None else vocab[ids]

    top = root_logp.topk(topk)
    ranks = torch.arange(topk, device=device)
    tokens, scores = [target(top.indices)], [top.values]
    parents = [torch.full((topk,), -1, device=device)]
    depths = [torch.ones(topk, dtype=torch.long, device=device)]
    frontier, frontier_scores, frontier_tokens = ranks, top.values, tokens[0]  # pool ids, best first
    by_parent, seen = None, torch.zeros(topk, 0, dtype=torch.bool, device=device)
    own = torch.eye(topk, dtype=torch.bool, device=device)
    size = topk
    for depth in range(1, depth_cap):
        child = expand(depth, frontier_tokens, by_parent, seen).topk(topk)  # each frontier node's best children
        child_scores = (frontier_scores[:, None] + child.values).flatten()
        child_tokens = target(child.indices.flatten())
        tokens.append(child_tokens)
        scores.append(child_scores)
        parents.append(frontier.repeat_interleave(topk))
        depths.append(torch.full((topk * topk,), depth + 1, device=device))
        pick = child_scores.topk(topk).indices  # the next frontier, among this level's children
        by_parent = pick // topk
        frontier, frontier_scores, frontier_tokens = size + pick, child_scores[pick], child_tokens[pick]
        seen = torch.cat([seen, own], 1)[by_parent]  # a child descends from its parent's ancestors and its parent
        size += topk * topk
    tokens, scores, parent, depth = (torch.cat(x) for x in (tokens, scores, parents, depths))
    by_depth = torch.sort(depth, stable=True).indices
    kept = by_depth[torch.sort(-scores[by_depth], stable=True).indices][:min(budget, size)]
    kept = kept[torch.sort(depth[kept], stable=True).indices]  # depth order: parents before children
    index = torch.full((size,), -1, dtype=torch.long, device=device)
    index[kept] = torch.arange(kept.numel(), device=device)
    kept_parent = parent[kept]
    tree_parent = torch.where(kept_parent >= 0, index[kept_parent.clamp_min(0)], -1)
    tree = DeviceTree.from_parents(tree_parent, ranks.repeat(size // topk)[kept], depth[kept], topk, depth_cap)
    return Proposal(tokens=tokens[kept], tree=tree)


class DynamicTreeDrafter(ModelDrafter):
    """EAGLE-2-style dynamic tree from an autoregressive draft model.

    Each round: expand the ``topk`` best frontier nodes by their ``topk`` children for ``depth`` steps (one
    draft forward per depth for the whole frontier, through a tree mask over scratch cache slots), score
    every node by its cumulative log-probability, and keep the best ``budget`` nodes. A child never scores
    above its parent, so the kept set is closed under ancestors: a tree. Drafts are deterministic (top-k),
    so acceptance uses the multi-candidate rule at any temperature.
    """

    name = "draft-model-dynamic-tree"

    def __init__(self, model, depth: int, topk: int, budget: int, max_len: int):
        if depth < 1 or topk < 1 or budget < 1:
            raise SpectrainError(f"dynamic tree needs depth, topk and budget >= 1 (got {depth}, {topk}, {budget})")
        super().__init__(model, k=depth, max_len=max_len + depth * topk)
        self.depth, self.topk, self.budget = depth, topk, budget
        # Verify shapes are fixed by the budget; each proposal carries its own tree of exactly that size.
        self.tree = Tree.from_paths([(0,) * d for d in range(1, min(depth, budget) + 1)])

    @property
    def max_nodes(self) -> int:
        return self.budget

    def propose(self, state: DraftState) -> Proposal:
        runner = self.runner
        self._committed = runner.length
        hidden = runner.forward(self.pending)
        runner.commit(self.pending.numel())
        base = runner.length

        def expand(depth, tokens, parents, ancestors):  # the frontier at scratch slots base + (depth - 1) * topk ...
            start = base + (depth - 1) * self.topk
            mask = torch.zeros(self.topk, runner.width, dtype=torch.bool, device=runner.device)
            mask[:, :base] = True
            mask[:, base:start + self.topk] = torch.cat([ancestors, torch.eye(self.topk, dtype=torch.bool,
                                                                                device=runner.device)], 1)
            runner.length = start
            out = runner.forward(tokens, positions=torch.full((self.topk,), base + depth - 1, device=runner.device),
                                 mask=mask)
            return torch.log_softmax(runner.logits(out), -1)

        proposal = grow_dynamic_tree(torch.log_softmax(runner.logits(hidden[-1]), -1), self.depth, self.topk,
                                     self.budget, expand)
        runner.length = base  # the frontier's K/V were scratch: nothing of the tree stays in the draft cache
        return proposal

    def advance(self, accepted: int, state: DraftState) -> None:
        keep = self._committed + self.pending.numel()  # only the pending context was committed
        self.runner.length = keep
        self.pending = state.tokens[keep:state.length]


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
        if drafter.is_eagle3 and vocab is not None:
            raise SpectrainError("an EAGLE-3 drafter drafts over the draft vocabulary it was trained with "
                                 f"({drafter.config.draft_vocab_size} tokens): --draft_vocab is for Medusa, EAGLE-1 and DFlash")
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
        from spectrain.heads.eagle import check_aux_layer_order  # the one layer-order rule (EagleConfig's)

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
