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
    # For feature-based drafters: verifier features of the positions committed since the last round,
    # (m, F), and the token that follows each of them, (m,).
    new_features: torch.Tensor | None = None
    new_tokens: torch.Tensor | None = None
    # The verifier's greedy token after each row a proposal's Probe reads, on the host (None in rounds without one).
    probed: list[int] | None = None


@dataclass
class Probe:
    """Nodes a drafter runs in the verifier's forward for its own use (lookahead decoding's Jacobi window), after
    the tree's: they see the context, the root and (``mask``) each other, no tree node sees them, and they are
    never accepted. The decoder hands back the verifier's greedy token after each row of ``read`` in
    ``DraftState.probed`` (within the round's one host read) before ``advance``.

    Attributes:
        tokens: (m,) token ids.
        depth: (m,) positions after the root's.
        mask: (m, m) bool, mask[r, c]: probe node r attends to probe node c (itself included; earlier nodes only,
            as a wide batch-invariant forward runs in consecutive parts).
        read: (r,) rows of [root, probe nodes...] whose greedy token comes back (0: the root's).
    """

    tokens: torch.Tensor
    depth: torch.Tensor
    mask: torch.Tensor
    read: torch.Tensor


@dataclass
class Proposal:
    tokens: torch.Tensor  # (n,) one per tree node
    probs: torch.Tensor | None = None  # (n, V) for sampled chain drafts
    tree: Tree | None = None  # this round's tree, for drafters whose tree changes every round
    probe: Probe | None = None  # nodes run beside the tree for the drafter's own use, never accepted


class Drafter:
    """Base of every drafter: proposes a tree of candidate tokens each round (:class:`Autoregressive` proposes
    none)."""

    name = "base"
    wants_features = False  # feature-based drafters read the verifier's features of every committed position
    capture_layers: tuple[int, ...] = ()  # HF hidden_states indices the verifier must keep (fused layers)

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
    """Prompt lookup and a learned drafter (any family's) in one decoder.

    * ``merge=False`` (a chain): each round drafts the lookup's continuation (``lookup`` tokens, default ``k``)
      when the context's last ``min_match`` or more tokens occurred earlier, and the learned drafter's chain of
      ``k`` otherwise. A lookup chain costs nothing to draft, so a longer one adds τ for the price of a wider
      verify pass (which did not pay on a 2-core CPU: docs/evaluation.md); its rounds bring their own chain, so
      the verifier sees ``lookup + 1`` rows then. At T > 0 the
      match must be ``min_match_sampled`` tokens long (n-grams that long are looked up): a deterministic lookup
      token is accepted with probability q(c) while the learned drafter's sampled draft is accepted with
      min(1, q/p), so only long matches pay there (SmolLM2 and its shipped one-layer drafter, 16 MT-bench prompts, T = 1: accepted
      drafts per round by lookup vs by the learned drafter in contexts with such a match: 0.80 vs 1.13 for
      2-token matches, 0.97 vs 0.73 for 3, ~2.5 vs ~0.6 for 4 to 6, docs/smollm2.md §4);
    * ``merge=True`` (a tree): each round drafts the learned drafter's tree with the lookup's continuation merged
      in as one more branch (``max_nodes`` = the learned drafter's + ``k``).

    Lossless like the others: the choice depends only on the context, and each round's candidates are verified
    by the rule for their kind (deterministic lookup tokens and top-k nodes by the multi-candidate rule, sampled
    chain drafts against their p). A feature-based drafter reads the features of every committed position; those of
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
    """A dynamic tree, built on the device (no host read).

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
    """A dynamic tree from an autoregressive draft model.

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
