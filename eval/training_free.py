"""The training-free methods, registered as the drafter families are (:func:`~.methods.register_method`): prompt
lookup (``ngram``), prompt lookup beside a learned drafter of any family (``hybrid``), a small causal LM
(``draft-model``), the verifier's first layers (``truncated``) and AR alone (``none``). Each is one
:class:`~.methods.EvalMethod` record: the kinds of setting it drafts, the inputs it needs, its builders."""

from __future__ import annotations

from spectrain.heads.errors import SpectrainError

from .drafters import (Autoregressive, Drafter, DynamicTreeDrafter, HybridDrafter, ModelDrafter, NgramDrafter,
                       truncated_verifier)
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


NGRAM = register_method(EvalMethod(
    name="ngram", build=_ngram, tree_kinds=(CHAIN,),
    description="prompt lookup: the tokens that followed the context's last n-gram earlier"))
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
