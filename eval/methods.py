"""An evaluation's methods and trees: the settings it decodes (:func:`make_trees`: chains, static trees, dynamic
trees), the verify widths they need (:func:`verify_sizes`) and each setting's drafter (:func:`build_drafter`: the
learned drafter's family builds its own, the others are built here)."""

from __future__ import annotations

from spectrain.heads.errors import SpectrainError

from .drafters import (Autoregressive, Drafter, DynamicTreeDrafter, HybridDrafter, ModelDrafter, NgramDrafter,
                       truncated_verifier)
from .families import BoundDrafter, families_with
from .setup import Settings
from .static_model import StaticCausalLM
from .tree import Tree, build_tree


def lookup_length(s: Settings, tree: Tree | None = None) -> int:
    """A hybrid's lookup branch (0 for other methods): ``lookup``, else ``k``, else as deep as the setting's tree
    (``tree``, once built; before that a static tree's depth, a dynamic tree's, or for ``auto:N`` the bound N)."""
    if s.method != "hybrid":
        return 0
    if s.lookup or s.k:
        return s.lookup or s.k
    if tree is not None:
        return tree.max_depth
    if s.auto_nodes:
        return s.auto_nodes  # a depth bound: sizes only bucket the compile
    if s.tree:
        return Tree.load(s.tree).max_depth
    return s.dynamic_tree[0] if s.dynamic_tree else 0


def verify_sizes(s: Settings) -> list[int]:
    """Every verifier forward size the job decodes with: AR's 1, and 1 + each chain, tree or dynamic-tree budget
    (a hybrid's static tree gains its lookup branch; a dynamic budget already holds it)."""
    if s.method == "none":
        return [1]
    sizes, lookup = [s.k], lookup_length(s)
    if s.method == "hybrid" and s.k and lookup != s.k:  # a chain's lookup rounds bring their own length
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


def dynamic_name(dynamic_tree: tuple[int, int, int]) -> str:
    depth, topk, budget = dynamic_tree
    return f"dynamic-{depth}x{topk}-{budget}"


def make_trees(s: Settings, bound: BoundDrafter | None, calibration: dict | None) -> dict[str, Tree]:
    """The job's settings by name: a chain of k, a static tree, a dynamic tree (its depth sizes the metrics);
    ``bound``: the learned drafter (:func:`~.setup.bind_learned`), None for methods without one."""
    evaluator = bound.evaluator if bound is not None else None
    trees = {}
    if s.k > 0:
        trees[f"chain-{s.k}"] = Tree.chain(s.k)
    if s.tree:
        if s.auto_nodes:
            if calibration is None:
                ranked = " / ".join(f.label for f in families_with(lambda e: e.rank_trees))
                raise SpectrainError(f"--tree auto:N needs measured rank accuracies ({ranked} drafters)")
            trees[f"tree-{s.auto_nodes}"] = build_tree(calibration["rank_accuracy"], s.auto_nodes)
        else:
            tree = Tree.load(s.tree)
            trees[f"tree-{tree.size}"] = tree
    if s.dynamic_tree:
        if s.method not in ("draft-model", "truncated") and not (evaluator and evaluator.dynamic_trees):
            growing = [f.name for f in families_with(lambda e: e.dynamic_trees)]
            raise SpectrainError(f"--dynamic_tree needs a drafter that drafts autoregressively "
                                 f"({', '.join(growing)}, draft-model, truncated, or hybrid with a "
                                 f"{' or '.join(growing)} drafter)")
        trees[dynamic_name(s.dynamic_tree)] = Tree.chain(s.dynamic_tree[0])
    if s.method != "none" and not trees:
        raise SpectrainError("nothing to evaluate: give --k > 0 and/or --tree")
    depth = bound.max_depth if bound is not None else None
    for name, tree in trees.items():
        if depth is not None and tree.max_depth > depth:
            raise SpectrainError(f"{name} is {tree.max_depth} deep but the drafter drafts at most {depth} deep")
        static = not tree.is_chain and not name.startswith("dynamic")
        if static and (s.method in ("ngram", "draft-model", "truncated") or (evaluator and not evaluator.static_trees)):
            raise SpectrainError(f"--method {s.method} drafts chains only; drop --tree")
    return trees


def build_drafter(s: Settings, tree: Tree, runner: StaticCausalLM, bound: BoundDrafter | None, draft_model,
                  name: str = "") -> Drafter:
    """The drafter of one setting for the verifier ``runner`` decodes (``bound``: the learned drafter with its
    draft vocabulary, None for methods without one; ``draft_model``: the draft-model method's LM)."""
    model, max_len = runner.model, runner.max_len
    if s.method == "hybrid":
        return build_hybrid(s, tree, model, bound, name)
    if bound is not None:  # the family's own drafter (its evaluator); chains may be cut by confidence
        if name.startswith("dynamic"):
            return bound.drafter(model, tree, s.dynamic_tree)
        return bound.drafter(model, tree, min_confidence=s.min_confidence)
    if name.startswith("dynamic"):
        small = truncated_verifier(model, s.draft_layers) if s.method == "truncated" else draft_model
        return DynamicTreeDrafter(small, *s.dynamic_tree, max_len)
    if s.method == "ngram":
        return NgramDrafter(tree.size)
    if s.method == "truncated":
        return ModelDrafter(truncated_verifier(model, s.draft_layers), tree.size, max_len)
    if s.method == "draft-model":
        return ModelDrafter(draft_model, tree.size, max_len)
    return Autoregressive()


def build_hybrid(s: Settings, tree: Tree, model, bound: BoundDrafter, name: str) -> HybridDrafter:
    """Prompt lookup + the learned drafter: a chain switches per round; a tree gains the lookup branch (a dynamic
    tree's budget keeps room for it, so the whole tree stays within the dynamic tree's budget)."""
    k = lookup_length(s, tree)
    options = dict(min_match=s.min_match, min_match_sampled=s.min_match_sampled)
    if name.startswith("dynamic"):
        depth, topk, budget = s.dynamic_tree
        if budget <= k:
            raise SpectrainError(f"--dynamic_tree budget {budget} leaves no room beside the lookup branch of {k}")
        inner = bound.drafter(model, tree, (depth, topk, budget - k))
        return HybridDrafter(inner, k, merge=True, **options)
    inner = bound.drafter(model, tree, min_confidence=s.min_confidence if tree.is_chain else 0.0)
    if tree.is_chain:  # lookup rounds draft ``lookup`` tokens (default: the chain's k)
        return HybridDrafter(inner, tree.size, merge=False, lookup=s.lookup or None, **options)
    return HybridDrafter(inner, k, merge=True, **options)
