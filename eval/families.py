"""How the evaluator drafts with each registered drafter family (:mod:`spectrain.heads.families`).

A family's record names its :class:`FamilyEvaluator` by dotted path (``evaluator="package.module:NAME"``); the
evaluator, ``spectrain-eval``'s method list and ``spectrain-results`` read it through :func:`evaluator_of`, and
one evaluation resolves it once into a :class:`BoundDrafter`. Each bundled family's evaluator lives in its own
eval file beside its drafters; a new family's may live anywhere (its own module, a test, another package).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Callable

import torch

from spectrain.heads.errors import SpectrainError
from spectrain.heads.families import DrafterFamily, families, family_of, resolve

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


def evaluator_of(family: DrafterFamily) -> FamilyEvaluator:
    evaluator = resolve(family.evaluator) if family.evaluator is not None else None
    if not isinstance(evaluator, FamilyEvaluator):
        raise SpectrainError(f"drafter family {family.name} registered no evaluator (a FamilyEvaluator), so it "
                             "cannot be decoded")
    return evaluator


def learned_methods() -> tuple[str, ...]:
    """The evaluator methods of learned drafters: one per registered family, in registration order."""
    return tuple(f.name for f in families())


@dataclass(frozen=True)
class BoundDrafter:
    """A learned drafter resolved once, for one evaluation, to its family and evaluator (and, once chosen, its
    draft vocabulary): what every later step asks instead of looking the family up again.

    Attributes:
        learned: the learned module (any registered family's).
        family: its :class:`~spectrain.heads.families.DrafterFamily`.
        evaluator: the family's :class:`FamilyEvaluator`.
        vocab: (N,) target ids of its ranked draft vocabulary, or None for its own head.
        vocab_size: the N it drafts over (None until chosen: :meth:`with_vocab`).
    """

    learned: Any
    family: DrafterFamily
    evaluator: FamilyEvaluator
    vocab: torch.Tensor | None = None
    vocab_size: int | None = None

    def with_vocab(self, vocab: torch.Tensor | None, vocab_size: int | None) -> "BoundDrafter":
        return replace(self, vocab=vocab, vocab_size=vocab_size)

    @property
    def capture(self) -> tuple[int, ...]:
        """HF ``hidden_states`` ids its decoding drafter reads besides the last hidden state."""
        return self.evaluator.capture(self.learned)

    @property
    def max_depth(self) -> int | None:
        return self.evaluator.max_depth(self.learned)

    def check_confidence(self) -> None:
        """Refuse ``min_confidence`` for a drafter without a confidence head (checked before anything runs)."""
        if not self.evaluator.confidence(self.learned):
            hints = "; ".join(e.confidence_hint for e in _evaluators() if e.confidence_hint)
            raise SpectrainError("--min_confidence cuts each round by the drafter's confidence head"
                                 f"{f' ({hints})' if hints else ''}; this {self.family.label} drafter has none")

    def drafter(self, model, tree, dynamic: tuple[int, int, int] | None = None, min_confidence: float = 0.0) -> Drafter:
        """The decoding drafter (:attr:`FamilyEvaluator.build`) for the verifier's HF ``model`` over its draft
        vocabulary; ``min_confidence`` > 0 cuts each round's chain by its confidence head (families that have one)."""
        if dynamic is not None and not self.evaluator.dynamic_trees:
            raise SpectrainError(f"{self.family.label} drafters grow no dynamic trees")
        options = {}
        if min_confidence:  # only families with a confidence head take it
            self.check_confidence()
            options["min_confidence"] = min_confidence
        return self.evaluator.build(self.learned, model, tree, dynamic=dynamic, vocab=self.vocab, **options)


def bind(learned) -> BoundDrafter:
    """``learned``'s family and evaluator, looked up once (an unregistered drafter: a :class:`SpectrainError`)."""
    family = family_of(learned)
    return BoundDrafter(learned, family, evaluator_of(family))


def families_with(test: Callable[[FamilyEvaluator], bool]) -> list[DrafterFamily]:
    """The registered families whose evaluator passes ``test`` (a family registered without one is skipped): what
    a message lists as the drafters that can do something."""
    found = [(f, resolve(f.evaluator)) for f in families() if f.evaluator is not None]
    return [f for f, e in found if isinstance(e, FamilyEvaluator) and test(e)]


def _evaluators() -> list[FamilyEvaluator]:
    """The registered families' evaluators (a family registered without one is skipped)."""
    return [evaluator_of(f) for f in families_with(lambda e: True)]


def learned_drafter(learned, model, tree, dynamic: tuple[int, int, int] | None = None, vocab=None,
                    min_confidence: float = 0.0) -> Drafter:
    """The decoding drafter over a learned module of any registered family (:meth:`BoundDrafter.drafter`);
    ``vocab`` (N,) target ids of a ranked draft vocabulary, or None for its own head."""
    return bind(learned).with_vocab(vocab, None).drafter(model, tree, dynamic, min_confidence)


def check_min_confidence_value(min_confidence) -> None:
    """``min_confidence`` is 0 (verify every draft) or a probability in (0, 1)."""
    if isinstance(min_confidence, bool) or not isinstance(min_confidence, (int, float)) or not 0 <= min_confidence < 1:
        raise SpectrainError(f"--min_confidence is a probability in [0, 1) (0: verify every draft), got "
                             f"{min_confidence!r}")


def check_confidence(learned) -> None:
    """Refuse ``min_confidence`` for a learned drafter without a confidence head (checked before anything runs)."""
    bind(learned).check_confidence()


def check_chain_depth(name: str, learned, k: int) -> None:
    """Refuse a chain of ``k`` the drafter cannot draft (a head count, a block's slots), before anything is
    decoded; ``name`` labels the drafter in the message."""
    deepest = bind(learned).max_depth
    if deepest is not None and k > deepest:
        raise SpectrainError(f"drafter {name!r} drafts at most {deepest} tokens a round, not {k}")
