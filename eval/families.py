"""How the evaluator drafts with each registered drafter family (:mod:`spectrain.heads.families`).

Each family registers its :class:`~.family_evaluator.FamilyEvaluator` under its name (the bundled ones in their
eval files, imported here; a plugin's with its family); the evaluator, ``spectrain-eval``'s method list and
``spectrain-results`` read it through :func:`evaluator_of`, and one evaluation resolves it once into a
:class:`BoundDrafter`.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Callable

import torch

from spectrain.heads.errors import SpectrainError
from spectrain.heads.families import DrafterFamily, families, family_of

from . import dflash, eagle, medusa, peagle  # noqa: F401  the bundled families' evaluators (BUNDLED_FAMILIES)
from .drafters import Drafter
from .family_evaluator import FamilyEvaluator, registered_evaluator


def evaluator_of(family: DrafterFamily) -> FamilyEvaluator:
    families()  # the installed packages' families, and the evaluators their modules register
    evaluator = registered_evaluator(family.name)
    if evaluator is None:
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
    found = [(f, registered_evaluator(f.name)) for f in families()]
    return [f for f, e in found if e is not None and test(e)]


def _evaluators() -> list[FamilyEvaluator]:
    """The registered families' evaluators (a family registered without one is skipped)."""
    return [evaluator_of(f) for f in families_with(lambda e: True)]


def learned_drafter(learned, model, tree, dynamic: tuple[int, int, int] | None = None, vocab=None,
                    min_confidence: float = 0.0) -> Drafter:
    """The decoding drafter over a learned module of any registered family (:meth:`BoundDrafter.drafter`);
    ``vocab`` (N,) target ids of a ranked draft vocabulary, or None for its own head."""
    return bind(learned).with_vocab(vocab, None).drafter(model, tree, dynamic, min_confidence)


def check_confidence(learned) -> None:
    """Refuse ``min_confidence`` for a learned drafter without a confidence head (checked before anything runs)."""
    bind(learned).check_confidence()


def check_chain_depth(name: str, learned, k: int) -> None:
    """Refuse a chain of ``k`` the drafter cannot draft (a head count, a block's slots), before anything is
    decoded; ``name`` labels the drafter in the message."""
    deepest = bind(learned).max_depth
    if deepest is not None and k > deepest:
        raise SpectrainError(f"drafter {name!r} drafts at most {deepest} tokens a round, not {k}")
