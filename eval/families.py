"""How the evaluator drafts with each registered drafter family (:mod:`spectrain.heads.families`).

A family's record names its :class:`FamilyEvaluator` (``evaluator="spectrain.eval.families:EAGLE"``); the
evaluator, ``spectrain-eval``'s method list and ``spectrain-results`` read it through :func:`evaluator_of`
instead of switching on Medusa-or-EAGLE. A new family's evaluator may live anywhere (its own module, a test).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from spectrain.heads.errors import SpectrainError
from spectrain.heads.families import DrafterFamily, families, family_of, resolve

from .drafters import Drafter, EagleChainDrafter, EagleTreeDrafter, MedusaDrafter


def _unbounded(learned) -> int | None:
    return None


@dataclass(frozen=True)
class FamilyEvaluator:
    """The evaluator's side of a drafter family.

    Attributes:
        build: ``build(learned, model, tree, *, dynamic=None, vocab=None) -> Drafter``: the decoding drafter over
            the learned module ``learned`` for the verifier's HF ``model``: drafting ``tree`` (a chain or a static
            rank-path :class:`~.tree.Tree`), or with ``dynamic=(depth, topk, budget)`` an EAGLE-2 dynamic tree
            grown each round (``tree`` is then its depth chain); ``vocab`` (N,) target ids of a ranked draft
            vocabulary, or None for the drafter's own head.
        static_trees: it drafts static rank-path trees (else chains only).
        dynamic_trees: it grows dynamic trees (``--dynamic_tree``; the results table's tree rows).
        rank_trees: its heads' rank accuracies are measured on AR's outputs, so ``--tree auto:N`` builds the best
            N-node static tree from them (Medusa; the results table's tree rows when it grows no dynamic tree).
        max_depth: ``learned`` -> the deepest tree or chain it drafts (Medusa: its head count), None = unbounded.
        capture: ``learned`` -> the HF ``hidden_states`` ids its decoding drafter reads besides the last hidden
            state (EAGLE-3's fused layers, a block drafter's target layers; the verifier keeps them every forward).
        confidence: ``learned`` -> whether its chains can verify fewer drafts per round by a confidence head
            (DSpark's; ``build`` then takes ``min_confidence``).
    """

    build: Callable[..., Drafter]
    static_trees: bool = True
    dynamic_trees: bool = False
    rank_trees: bool = False
    max_depth: Callable[[Any], int | None] = _unbounded
    capture: Callable[[Any], tuple[int, ...]] = lambda learned: ()
    confidence: Callable[[Any], bool] = lambda learned: False


def evaluator_of(family: DrafterFamily) -> FamilyEvaluator:
    evaluator = resolve(family.evaluator) if family.evaluator is not None else None
    if not isinstance(evaluator, FamilyEvaluator):
        raise SpectrainError(f"drafter family {family.name} registered no evaluator (a FamilyEvaluator), so it "
                             "cannot be decoded")
    return evaluator


def learned_methods() -> tuple[str, ...]:
    """The evaluator methods of learned drafters: one per registered family (``medusa``, ``eagle``, ...)."""
    return tuple(f.name for f in families())


def learned_drafter(learned, model, tree, dynamic: tuple[int, int, int] | None = None, vocab=None,
                    min_confidence: float = 0.0) -> Drafter:
    """The decoding drafter over a learned module of any registered family (:attr:`FamilyEvaluator.build`);
    ``min_confidence`` > 0 cuts each round's chain by the drafter's confidence head (families that have one)."""
    family = family_of(learned)
    evaluator = evaluator_of(family)
    if dynamic is not None and not evaluator.dynamic_trees:
        raise SpectrainError(f"{family.label} drafters grow no dynamic trees")
    options = {}
    if min_confidence:  # only families with a confidence head take it
        check_confidence(learned)
        options["min_confidence"] = min_confidence
    return evaluator.build(learned, model, tree, dynamic=dynamic, vocab=vocab, **options)


def check_min_confidence_value(min_confidence) -> None:
    """``min_confidence`` is 0 (verify every draft) or a probability in (0, 1)."""
    if isinstance(min_confidence, bool) or not isinstance(min_confidence, (int, float)) or not 0 <= min_confidence < 1:
        raise SpectrainError(f"--min_confidence is a probability in [0, 1) (0: verify every draft), got "
                             f"{min_confidence!r}")


def check_confidence(learned) -> None:
    """Refuse ``min_confidence`` for a learned drafter without a confidence head (checked before anything runs)."""
    family = family_of(learned)
    if not evaluator_of(family).confidence(learned):
        raise SpectrainError(f"--min_confidence cuts each round by the drafter's confidence head (DSpark's: train a "
                             f"dflash drafter with --model.confidence_head true); this {family.label} drafter has "
                             "none")


# -- the bundled families ---------------------------------------------------------------------------------------
def check_chain_depth(name: str, learned, k: int) -> None:
    """Refuse a chain of ``k`` the drafter cannot draft (Medusa's heads, a block's slots), before anything is
    decoded; ``name`` labels the drafter in the message."""
    deepest = evaluator_of(family_of(learned)).max_depth(learned)
    if deepest is not None and k > deepest:
        raise SpectrainError(f"drafter {name!r} drafts at most {deepest} tokens a round, not {k}")


def _medusa_drafter(heads, model, tree, *, dynamic=None, vocab=None) -> Drafter:
    return MedusaDrafter(heads, model.get_output_embeddings(), tree, vocab=vocab)


def _eagle_drafter(drafter, model, tree, *, dynamic=None, vocab=None) -> Drafter:
    if dynamic is not None:
        return EagleTreeDrafter(drafter, model, dynamic=dynamic, vocab=vocab)
    if tree.is_chain:
        return EagleChainDrafter(drafter, model, tree.size, vocab=vocab)
    return EagleTreeDrafter(drafter, model, tree=tree, vocab=vocab)


MEDUSA = FamilyEvaluator(build=_medusa_drafter, rank_trees=True, max_depth=lambda heads: heads.config.num_heads)
EAGLE = FamilyEvaluator(build=_eagle_drafter, dynamic_trees=True,
                        capture=lambda d: tuple(d.config.aux_layer_ids or ()) if d.is_eagle3 else ())
