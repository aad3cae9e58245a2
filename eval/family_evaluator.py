"""The evaluator's half of a drafter family: :class:`FamilyEvaluator` (how the evaluator drafts with the family's
learned module), registered under the family's name by its eval module (``eval/<family>.py``, or a plugin's) with
:func:`register_evaluator`. Looked up through :mod:`.families`, which loads the bundled ones."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from spectrain.heads.errors import SpectrainError

from .drafters import Drafter


def _unbounded(learned) -> int | None:
    return None


@dataclass(frozen=True)
class FamilyEvaluator:
    """The evaluator's side of a drafter family.

    Attributes:
        build: ``build(learned, model, tree, *, dynamic=None, vocab=None) -> Drafter``: the decoding drafter over
            the learned module ``learned`` for the verifier's HF ``model``: drafting ``tree`` (a chain or a static
            rank-path :class:`~.tree.Tree`), or with ``dynamic=(depth, topk, budget)`` a dynamic tree
            grown each round (``tree`` is then its depth chain); ``vocab`` (N,) target ids of a ranked draft
            vocabulary, or None for the drafter's own head.
        static_trees: it drafts static rank-path trees (else chains only).
        dynamic_trees: it grows dynamic trees (``--dynamic_tree``; the results table's tree rows).
        dynamic_tree_name: how the results table's rows name the dynamic tree it grows (their ``tree``).
        calibrate: ``calibrate(learned, runner, sequences, starts, *, temperature, decoding) -> dict`` for a
            drafter whose heads draft every depth at once by rank: its rank accuracies measured teacher-forced on
            AR's outputs (``"rank_accuracy"`` (depth, rank), beside whatever else it measures), so ``--tree auto:N``
            builds the best N-node static tree from them, the planner prices trees of every size and the results
            table's tree rows use them when it grows no dynamic tree. None: no rank trees.
        max_depth: ``learned`` -> the deepest tree or chain it drafts (a head count, a block's slots), None =
            unbounded.
        capture: ``learned`` -> the HF ``hidden_states`` ids its decoding drafter reads besides the last hidden
            state (fused layers, a block drafter's target layers; the verifier keeps them every forward).
        confidence: ``learned`` -> whether its chains can verify fewer drafts per round by a confidence head
            (``build`` then takes ``min_confidence``).
        confidence_hint: how a drafter of the family gets a confidence head (named when one without is asked for
            ``--min_confidence``); empty for families that have none.
        fixed_draft_vocab: ``(learned, requested) -> N or None``: the size of a draft vocabulary the drafter was
            trained with and always drafts over (refusing a ``requested`` ``--draft_vocab`` with its own message);
            None: a ranked draft vocabulary from its ``vocab_ranking.json`` applies.
        published: figures the family's papers report (``method``, ``tau``, ``verifier``, ``bench``,
            ``drafting``), shown beside ours by ``spectrain-results`` (their setting differs and the table says so).
    """

    build: Callable[..., Drafter]
    static_trees: bool = True
    dynamic_trees: bool = False
    dynamic_tree_name: str = "dynamic"
    calibrate: Callable[..., dict] | None = None
    max_depth: Callable[[Any], int | None] = _unbounded
    capture: Callable[[Any], tuple[int, ...]] = lambda learned: ()
    confidence: Callable[[Any], bool] = lambda learned: False
    confidence_hint: str = ""
    fixed_draft_vocab: Callable[[Any, int | None], int | None] = lambda learned, requested: None
    published: tuple[dict, ...] = ()

    @property
    def rank_trees(self) -> bool:
        """Its heads' rank accuracies are measured (:attr:`calibrate`), so static trees are built from them."""
        return self.calibrate is not None


_EVALUATORS: dict[str, FamilyEvaluator] = {}


def register_evaluator(family: str, evaluator: FamilyEvaluator) -> FamilyEvaluator:
    """Register ``family``'s evaluator (the line its eval module ends with); returns it. The same evaluator again is a
    no-op; another one for a family that has one is refused."""
    if not isinstance(evaluator, FamilyEvaluator):
        raise SpectrainError(f"drafter family {family}: its evaluator must be a FamilyEvaluator, got "
                             f"{type(evaluator).__name__}")
    held = _EVALUATORS.get(family)
    if held is not None and held is not evaluator:
        raise SpectrainError(f"drafter family {family!r}'s evaluator is already registered")
    _EVALUATORS[family] = evaluator
    return evaluator


def unregister_evaluator(family: str) -> None:
    """Remove a family's evaluator (tests that register one of their own)."""
    _EVALUATORS.pop(family, None)


def registered_evaluator(family: str) -> FamilyEvaluator | None:
    """The evaluator registered for ``family`` (bundled ones only once :mod:`.families` is imported)."""
    return _EVALUATORS.get(family)


def check_min_confidence_value(min_confidence) -> None:
    """``min_confidence`` is 0 (verify every draft) or a probability in (0, 1)."""
    if isinstance(min_confidence, bool) or not isinstance(min_confidence, (int, float)) or not 0 <= min_confidence < 1:
        raise SpectrainError(f"--min_confidence is a probability in [0, 1) (0: verify every draft), got "
                             f"{min_confidence!r}")
