"""The training-free methods, registered as the drafter families are (:func:`~.methods.register_method`): prompt
lookup (``ngram``), lookahead decoding (``lookahead``), prompt lookup beside a learned drafter of any family
(``hybrid``), a small causal LM (``draft-model``), the verifier's first layers (``truncated``) and AR alone
(``none``). Each is one :class:`~.methods.EvalMethod` record: the kinds of setting it drafts, the inputs it needs,
its builders."""

from __future__ import annotations

from dataclasses import replace

from spectrain.heads.errors import SpectrainError

from .drafters import (Autoregressive, Drafter, DynamicTreeDrafter, HybridDrafter, ModelDrafter, NgramDrafter,
                       truncated_verifier)
from .lookahead import LookaheadDrafter, check_lookahead, forward_rows, window_nodes
from .methods import DraftInputs, EvalMethod, lookup_length, register_method
from .settings import DraftShape, EvalSettings, TreeKind

CHAIN, STATIC, DYNAMIC = TreeKind.CHAIN, TreeKind.STATIC, TreeKind.DYNAMIC


def _ngram(s: EvalSettings, shape: DraftShape, inputs: DraftInputs) -> Drafter:
    return NgramDrafter(shape.tree.size)


def _hybrid(s: EvalSettings, shape: DraftShape, inputs: DraftInputs) -> HybridDrafter:
    """Prompt lookup + the learned drafter: a chain switches per round (its lookup rounds draft ``lookup``
    tokens, default the chain's k); a static tree gains the lookup branch."""
    options = dict(min_match=s.min_match, min_match_sampled=s.min_match_sampled)
    tree = shape.tree
    inner = inputs.bound.drafter(inputs.runner.model, tree, min_confidence=s.min_confidence if tree.is_chain else 0.0)
    if tree.is_chain:
        return HybridDrafter(inner, tree.size, merge=False, lookup=s.lookup or None, **options)
    return HybridDrafter(inner, lookup_length(s, tree), merge=True, **options)


def _hybrid_grown(s: EvalSettings, shape: DraftShape, inputs: DraftInputs) -> HybridDrafter:
    """A dynamic tree whose budget keeps room for the lookup branch, so the whole tree stays within it."""
    k = lookup_length(s, shape.tree)
    depth, topk, budget = shape.dynamic
    if budget <= k:
        raise SpectrainError(f"--dynamic_tree budget {budget} leaves no room beside the lookup branch of {k}")
    inner = inputs.bound.drafter(inputs.runner.model, shape.tree, (depth, topk, budget - k))
    return HybridDrafter(inner, k, merge=True, min_match=s.min_match, min_match_sampled=s.min_match_sampled)


def _draft_model(s: EvalSettings, shape: DraftShape, inputs: DraftInputs) -> Drafter:
    return ModelDrafter(inputs.draft_model, shape.tree.size, inputs.runner.max_len)


def _draft_model_grown(s: EvalSettings, shape: DraftShape, inputs: DraftInputs) -> Drafter:
    return DynamicTreeDrafter(inputs.draft_model, *shape.dynamic, inputs.runner.max_len)


def _truncated(s: EvalSettings, shape: DraftShape, inputs: DraftInputs) -> Drafter:
    small = truncated_verifier(inputs.runner.model, s.draft_layers)
    return ModelDrafter(small, shape.tree.size, inputs.runner.max_len)


def _truncated_grown(s: EvalSettings, shape: DraftShape, inputs: DraftInputs) -> Drafter:
    small = truncated_verifier(inputs.runner.model, s.draft_layers)
    return DynamicTreeDrafter(small, *shape.dynamic, inputs.runner.max_len)


def _autoregressive(s: EvalSettings, shape: DraftShape, inputs: DraftInputs) -> Drafter:
    return Autoregressive()


def _lookahead(s: EvalSettings, shape: DraftShape, inputs: DraftInputs) -> Drafter:
    """Guesses of the chain's k tokens (n-grams of N = k + 1 unless --lookahead_ngram says more)."""
    return LookaheadDrafter(s.lookahead_window, s.lookahead_n, s.lookahead_guesses, depth=shape.tree.size,
                            seed=s.seed)


class LookaheadMethod(EvalMethod):
    """Lookahead decoding's record. Its setting is the chain of ``k``: each round verifies guesses of k tokens
    and accepts at most k of them, the depth α is measured to (the paper's N is k + 1 unless
    ``lookahead_ngram`` is larger); its verify passes carry the Jacobi window beside the guesses' trie
    (:meth:`verify_sizes`); and it declines the cost probes and planner, which price a chain drafter's rounds (its
    rounds' own draft / verify times are measured and reported as for every setting)."""

    def check(self, s: EvalSettings, bound=None) -> EvalSettings:
        s = super().check(s, bound)  # chains only, something to decode
        check_lookahead(s.lookahead_window, s.lookahead_n, s.lookahead_guesses, s.k)
        return replace(s, costs=False)

    def verify_sizes(self, s: EvalSettings) -> list[int]:
        """AR's 1, a round whose root has no guesses (the root and the window) and the widest round (the fullest
        trie too): compiled sizes between them pad up to the next."""
        w, n, g = s.lookahead_window, s.lookahead_n, s.lookahead_guesses
        return sorted({1, 1 + window_nodes(w, n), forward_rows(w, n, g, s.k)})


NGRAM = register_method(EvalMethod(
    name="ngram", build=_ngram, tree_kinds=(CHAIN,),
    description="prompt lookup: the tokens that followed the context's last n-gram earlier"))
LOOKAHEAD = register_method(LookaheadMethod(
    name="lookahead", build=_lookahead, tree_kinds=(CHAIN,),
    description="lookahead decoding (Fu et al. 2024): a Jacobi window in the verifier's own forward fills an n-gram "
                "pool; up to G pool n-grams that start with the last token are verified each round"))
HYBRID = register_method(EvalMethod(
    name="hybrid", build=_hybrid, grow=_hybrid_grown, tree_kinds=(CHAIN, STATIC, DYNAMIC), needs_drafter=True,
    lookup=True, confidence=True,
    description="prompt lookup + a learned drafter of any family (its trees: the learned tree + the lookup branch)"))
DRAFT_MODEL = register_method(EvalMethod(
    name="draft-model", build=_draft_model, grow=_draft_model_grown, tree_kinds=(CHAIN, DYNAMIC),
    needs_draft_model=True, description="a small causal LM with the verifier's vocabulary"))
TRUNCATED = register_method(EvalMethod(
    name="truncated", build=_truncated, grow=_truncated_grown, tree_kinds=(CHAIN, DYNAMIC),
    description="the verifier's first draft_layers layers"))
NONE = register_method(EvalMethod(name="none", build=_autoregressive, tree_kinds=(), description="AR alone"))
