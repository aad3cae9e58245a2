"""The evaluator's methods, one registry: everything :func:`~.evaluate.evaluate_drafter` decodes with is an
:class:`EvalMethod` — each registered drafter family's own (made from its
:class:`~.families.FamilyEvaluator` by :func:`learned_method`) and the training-free ones, registered like the
families (:func:`register_method`; the bundled ones in :mod:`.training_free`). A method record says which kinds of
setting it drafts (:class:`~.settings.TreeKind`), which inputs it needs, what it adds to the verify passes, and
builds each setting's drafter; nothing else asks a method's name. Also the settings' shapes (:func:`make_trees`)."""

from __future__ import annotations

import importlib
from dataclasses import dataclass, replace
from typing import Any, Callable

from spectrain.heads.errors import SpectrainError
from spectrain.heads.families import DrafterFamily, families, family_of

from .drafters import Drafter
from .families import BoundDrafter, bind, evaluator_of, families_with, learned_methods
from .settings import DraftShape, EvalSettings, TreeKind
from .static_model import StaticCausalLM
from .tree import Tree, build_tree

CHAIN, STATIC, DYNAMIC = TreeKind.CHAIN, TreeKind.STATIC, TreeKind.DYNAMIC
KIND_NAMES = {CHAIN: "chains", STATIC: "static trees", DYNAMIC: "dynamic trees"}


@dataclass(frozen=True)
class DraftInputs:
    """What a method's builders draft from: the verifier's ``runner`` (its HF model and KV-cache length), the
    learned drafter resolved to its family with its draft vocabulary (``bound``; None for methods without one)
    and the draft-model method's causal LM (``draft_model``)."""

    runner: StaticCausalLM
    bound: BoundDrafter | None = None
    draft_model: Any = None


Builder = Callable[[EvalSettings, DraftShape, DraftInputs], Drafter]


@dataclass(frozen=True)
class EvalMethod:
    """One evaluator method: what it drafts and how (the evaluator's side of a training-free method, or a
    drafter family's, as :class:`~.families.FamilyEvaluator` is for a family).

    Attributes:
        name: the ``spectrain-eval --method`` name (a family's: the family's name).
        build: ``build(settings, shape, inputs) -> Drafter`` for a chain or a static tree (``shape.kind``).
        grow: the same for a dynamic tree (``shape.dynamic`` = (depth, topk, budget)); None: it grows none.
        tree_kinds: the kinds of setting it drafts; settings asking another are refused (:meth:`check`). Empty:
            AR alone (its settings' chain and cost probes are dropped).
        needs_drafter: it drafts with a learned drafter (a family's own method, or beside prompt lookup); the
            kinds it drafts are then also its drafter's family's (:meth:`kinds`).
        needs_draft_model: it drafts with a causal LM of the verifier's vocabulary (``draft_model=``).
        lookup: prompt lookup beside a learned drafter: it takes ``lookup`` (its lookup rounds' and branch's
            length) and its lookup branch widens a static tree's verify pass (:meth:`verify_sizes`).
        confidence: its chains can be cut by a learned drafter's confidence head (``min_confidence``).
        family: the drafter family whose own method it is (its drafters only), None for the others.
        description: one line for ``--help`` and messages.
    """

    name: str
    build: Builder
    grow: Builder | None = None
    tree_kinds: tuple[TreeKind, ...] = (CHAIN,)
    needs_drafter: bool = False
    needs_draft_model: bool = False
    lookup: bool = False
    confidence: bool = False
    family: str | None = None
    description: str = ""

    def __post_init__(self):
        object.__setattr__(self, "tree_kinds", tuple(TreeKind(k) for k in self.tree_kinds))
        if not self.name:
            raise SpectrainError("an evaluator method needs a name")
        if (DYNAMIC in self.tree_kinds) != (self.grow is not None):
            raise SpectrainError(f"method {self.name}: a method that drafts dynamic trees (tree_kinds) gives grow, "
                                 "and only such a method")

    def kinds(self, bound: BoundDrafter | None = None) -> tuple[TreeKind, ...]:
        """The kinds it drafts; with its learned drafter (``bound``), those that drafter's family drafts too."""
        if bound is None:
            return self.tree_kinds
        evaluator = bound.evaluator
        theirs = {CHAIN, *((STATIC,) if evaluator.static_trees else ()),
                  *((DYNAMIC,) if evaluator.dynamic_trees else ())}
        return tuple(k for k in self.tree_kinds if k in theirs)

    def check(self, s: EvalSettings, bound: BoundDrafter | None = None) -> EvalSettings:
        """``s`` as this method decodes it (AR alone: no chain, no cost probes), or a :class:`SpectrainError`
        where it asks what the method does not have: a lookup, a confidence cut, a kind of tree it does not
        draft (with ``bound``: nor its learned drafter), or nothing to decode."""
        if s.lookup and not self.lookup:
            takers = ", ".join(m.name for m in training_free_methods() if m.lookup)
            raise SpectrainError(f"--lookup is the lookup length of prompt lookup beside a learned drafter "
                                 f"({takers}); --method {self.name} has no lookup")
        if s.min_confidence and not self.confidence:
            raise SpectrainError(f"--min_confidence cuts a learned drafter's chain; --method {self.name} has none")
        if not self.tree_kinds:  # AR alone: no chain, no costs to probe, nothing to plan
            s = replace(s, k=0, costs=False)
        kinds = self.kinds(bound)
        for kind in s.tree_kinds:
            if kind not in kinds:
                raise SpectrainError(self._refusal(kind, kinds, bound))
        if self.tree_kinds and not s.tree_kinds:
            raise SpectrainError("nothing to evaluate: give --k > 0 and/or --tree")
        return s

    def _refusal(self, kind: TreeKind, kinds: tuple[TreeKind, ...], bound: BoundDrafter | None) -> str:
        who = f"--method {self.name}"
        if bound is not None and self.family is None:
            who += f" with a {bound.family.label} drafter"
        if not kinds:
            return f"{who} decodes AR alone (no drafts): drop {kind.flag}"
        if kind is DYNAMIC:
            return (f"{who} grows no dynamic trees: --dynamic_tree needs a drafter that drafts autoregressively "
                    f"({growers()})")
        drafts = "chains only" if kinds == (CHAIN,) else " and ".join(KIND_NAMES[k] for k in kinds) + " only"
        return f"{who} drafts {drafts}; drop {kind.flag}"

    def lookup_length(self, s: EvalSettings, tree: Tree | None = None) -> int:
        """Its lookup branch (:func:`lookup_length`); 0 for a method without prompt lookup."""
        return lookup_length(s, tree) if self.lookup else 0

    def verify_sizes(self, s: EvalSettings) -> list[int]:
        """Every verifier forward size it decodes ``s`` with: AR's 1, and 1 + each chain, tree or dynamic-tree
        budget (a lookup method's static tree gains its lookup branch, its chains' lookup rounds bring their own
        length; a dynamic budget already holds the branch)."""
        if not self.tree_kinds:
            return [1]
        sizes, lookup = [s.k], self.lookup_length(s)
        if self.lookup and s.k and lookup != s.k:
            sizes.append(lookup)
        if s.auto_nodes:
            sizes.append(s.auto_nodes + lookup)
        elif s.tree:
            sizes.append(Tree.load(s.tree).size + lookup)
        if s.dynamic_tree:
            sizes.append(s.dynamic_tree[2])
        if s.min_confidence:  # a cut chain verifies any length up to k
            sizes += list(range(1, s.k))
        return [1] + sorted({1 + n for n in sizes})

    def drafter(self, s: EvalSettings, shape: DraftShape, inputs: DraftInputs) -> Drafter:
        """The drafter of one setting: grown each round for a dynamic tree, else built for the chain or tree."""
        if shape.kind not in self.kinds(inputs.bound):
            raise SpectrainError(self._refusal(shape.kind, self.kinds(inputs.bound), inputs.bound))
        return (self.grow if shape.kind is DYNAMIC else self.build)(s, shape, inputs)


def lookup_length(s: EvalSettings, tree: Tree | None = None) -> int:
    """A lookup method's lookup branch: ``lookup``, else ``k``, else as deep as the setting's tree (``tree``, once
    built; before that a static tree's depth, a dynamic tree's, or for ``auto:N`` the bound N)."""
    if s.lookup or s.k:
        return s.lookup or s.k
    if tree is not None:
        return tree.max_depth
    if s.auto_nodes:
        return s.auto_nodes  # a depth bound: sizes only bucket the compile
    if s.tree:
        return Tree.load(s.tree).max_depth
    return s.dynamic_tree[0] if s.dynamic_tree else 0


# -------------------------------------------------------------------------------------------- learned families


def _learned_chain(s: EvalSettings, shape: DraftShape, inputs: DraftInputs) -> Drafter:
    """The family's own drafter of a chain or a static tree; chains may be cut by its confidence head."""
    return inputs.bound.drafter(inputs.runner.model, shape.tree, min_confidence=s.min_confidence)


def _learned_tree(s: EvalSettings, shape: DraftShape, inputs: DraftInputs) -> Drafter:
    return inputs.bound.drafter(inputs.runner.model, shape.tree, shape.dynamic)


def learned_method(family: DrafterFamily) -> EvalMethod:
    """A drafter family's own method, from its evaluator's flags: chains, static trees where it drafts them,
    dynamic trees where it grows them."""
    evaluator = evaluator_of(family)
    kinds = (CHAIN,) + ((STATIC,) if evaluator.static_trees else ()) + ((DYNAMIC,) if evaluator.dynamic_trees else ())
    return EvalMethod(name=family.name, build=_learned_chain, grow=_learned_tree if evaluator.dynamic_trees else None,
                      tree_kinds=kinds, needs_drafter=True, confidence=True, family=family.name,
                      description=f"a {family.label} drafter")


# -------------------------------------------------------------------------------------------- the registry

_METHODS: dict[str, EvalMethod] = {}
BUNDLED_METHODS = ("spectrain.eval.training_free",)  # imported (each registers its methods) on first use
_loaded = False


def register_method(method: EvalMethod) -> EvalMethod:
    """Add a training-free method to the registry (the line its module ends with); returns it. Its name must be
    new: no other method's and no drafter family's (registering the same record again is a no-op)."""
    if _METHODS.get(method.name) == method:
        return method
    if method.family is not None:
        raise SpectrainError(f"method {method.name}: a drafter family's method comes from its family record "
                             "(register_family), not register_method")
    if method.name in _METHODS or method.name in learned_methods():
        raise SpectrainError(f"cannot register method {method.name!r}: a method or drafter family of that name is "
                             "already registered")
    _METHODS[method.name] = method
    return method


def unregister_method(name: str) -> None:
    """Remove a training-free method (tests that register one of their own)."""
    _METHODS.pop(name, None)


def training_free_methods() -> tuple[EvalMethod, ...]:
    """The registered training-free methods, in registration order (the bundled ones first)."""
    global _loaded
    if not _loaded:
        _loaded = True
        for module in BUNDLED_METHODS:
            importlib.import_module(module)
    return tuple(_METHODS.values())


def methods() -> tuple[str, ...]:
    """Every method's name: each registered drafter family's, then the training-free ones."""
    return learned_methods() + tuple(m.name for m in training_free_methods())


def all_methods() -> tuple[EvalMethod, ...]:
    """Every method that can decode: each family's with an evaluator, then the training-free ones."""
    return tuple(learned_method(f) for f in families_with(lambda e: True)) + training_free_methods()


def method_named(name: str) -> EvalMethod:
    """The method called ``name``: a training-free method's or a drafter family's."""
    free = {m.name: m for m in training_free_methods()}
    family = next((f for f in families() if f.name == name), None)
    if family is not None and name in free:
        raise SpectrainError(f"method {name!r} is both a drafter family and a training-free method")
    if family is not None:
        return learned_method(family)
    if name in free:
        return free[name]
    raise SpectrainError(f"method must be one of {', '.join(methods())}, got {name!r}")


def resolve_method(drafter_or_method, drafter=None) -> tuple[EvalMethod, Any]:
    """(the method, its learned drafter or None) for :func:`~.evaluate.evaluate_drafter`'s ``drafter_or_method``:
    an :class:`EvalMethod`, a method's name, or a learned drafter (its family's method; then ``drafter`` is None)."""
    if isinstance(drafter_or_method, EvalMethod):
        return drafter_or_method, drafter
    if isinstance(drafter_or_method, str):
        return method_named(drafter_or_method), drafter
    if drafter_or_method is None:
        raise SpectrainError(f"evaluate_drafter needs a learned drafter or a method ({', '.join(methods())})")
    if drafter is not None:
        raise SpectrainError("a learned drafter given twice: as drafter_or_method and as drafter=")
    return learned_method(family_of(drafter_or_method)), drafter_or_method


def bind_learned(method: EvalMethod | str, drafter) -> BoundDrafter | None:
    """The learned drafter ``method`` drafts with, resolved once to its family and evaluator; None for methods
    without one. Missing where the method needs one, given where it takes none, or of another family than a
    family's method: refused."""
    method = method_named(method) if isinstance(method, str) else method
    if not method.needs_drafter:
        if drafter is not None:
            raise SpectrainError(f"method {method.name} takes no learned drafter")
        return None
    if drafter is None:
        raise SpectrainError(f"method {method.name} needs a drafter")
    bound = bind(drafter)  # an unregistered drafter: refused here
    if method.family is not None and bound.family.name != method.family:
        raise SpectrainError(f"method {method.name} got a {type(drafter).__name__}: use method {bound.family.name}")
    return bound


def growers() -> str:
    """What grows dynamic trees, for messages: the families that do, the methods that need no learned drafter,
    and those that take one (with such a family's drafter)."""
    grown = [f.name for f in families_with(lambda e: e.dynamic_trees)]
    free = [m for m in training_free_methods() if DYNAMIC in m.tree_kinds]
    paired = [f"or {m.name} with a {' or '.join(grown)} drafter" for m in free if m.needs_drafter]
    return ", ".join(grown + [m.name for m in free if not m.needs_drafter] + paired)


def dynamic_name(dynamic_tree: tuple[int, int, int]) -> str:
    depth, topk, budget = dynamic_tree
    return f"dynamic-{depth}x{topk}-{budget}"


def make_trees(s: EvalSettings, bound: BoundDrafter | None, calibration: dict | None) -> list[DraftShape]:
    """The settings' shapes, in decoding order: a chain of k, a static tree (``auto:N``: from ``calibration``'s
    rank accuracies), a dynamic tree (its depth chain sizes the metrics); ``bound``: the learned drafter, whose
    depth bounds them (None for methods without one). What a method drafts was checked (:meth:`EvalMethod.check`)."""
    shapes = []
    if s.k > 0:
        shapes.append(DraftShape.chain(s.k))
    if s.auto_nodes:
        if calibration is None:
            ranked = " / ".join(f.label for f in families_with(lambda e: e.rank_trees))
            raise SpectrainError(f"--tree auto:N needs measured rank accuracies ({ranked} drafters)")
        tree = build_tree(calibration["rank_accuracy"], s.auto_nodes)
        shapes.append(DraftShape(f"tree-{s.auto_nodes}", STATIC, tree))
    elif s.tree:
        tree = Tree.load(s.tree)
        shapes.append(DraftShape(f"tree-{tree.size}", STATIC, tree))
    if s.dynamic_tree:
        shapes.append(DraftShape(dynamic_name(s.dynamic_tree), DYNAMIC, Tree.chain(s.dynamic_tree[0]), s.dynamic_tree))
    depth = bound.max_depth if bound is not None else None
    for shape in shapes:
        if depth is not None and shape.tree.max_depth > depth:
            raise SpectrainError(f"{shape.name} is {shape.tree.max_depth} deep but the drafter drafts at most "
                                 f"{depth} deep")
    return shapes
