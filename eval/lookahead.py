"""Lookahead decoding (Fu et al. 2024, arXiv 2402.02057) as a drafter of the one lossless loop (:mod:`.decode`).

Each round the verifier's own forward runs two branches beside the root (the last emitted token, not yet run):

* the **verification branch**: up to G n-grams of the pool whose first token is the root, their N - 1 following
  tokens merged into a trie (:func:`guess_tree`): an ordinary candidate tree, verified and accepted by the loop's
  tree rule like any other drafter's;
* the **lookahead branch**: a 2-D Jacobi window of W columns x (N - 1) levels (:func:`window_layout`), run as the
  proposal's :class:`~.drafters.Probe` nodes. Column i is a strand hanging off the window's first level: node
  (level l, column i) sits at position root + i + l and sees the context, the root, the first level's columns
  1..i and its own column's levels 1..l — the mask the authors' README draws (4-grams, window 5) and their code
  and llama.cpp's ``llama-lookahead`` build. No tree node sees a window node, and window nodes are never accepted. The
  verifier's greedy token after each last-level node comes back in ``advance``: with its column above it, it is
  one new N-gram for the pool (:class:`NgramPool`), and the tokens become the window's new last level (one
  Jacobi step: every level moves up one, the first drops its first column, which the next root takes).

Lossless at any temperature: the guesses are point masses chosen from the history (the pool holds only earlier
rounds' outputs), verified by the multi-candidate rule with siblings distinct (the trie); the window's rows
never reach acceptance. The window's tokens are the verifier's argmax at T > 0 too, as in the authors' code:
they only choose what is guessed, never what is emitted.

Defaults W = 15, N = 5, G = 15: the configuration the authors' MT-bench script runs LLaMA-2-7B-chat with (their
``applications/run_mtbench.sh``; G = W, as in every configuration they publish) and llama.cpp's
``llama-lookahead`` hard-codes. A round verifies each guess's first ``depth`` tokens (the evaluator's ``k``; N - 1
unless asked for fewer).
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch

from spectrain.heads.errors import SpectrainError

from .drafters import Drafter, DraftState, Probe, Proposal
from .static_model import StaticCausalLM
from .tree import Tree

WINDOW, NGRAM, GUESSES = 15, 5, 15  # W, N, G: the authors' MT-bench run (LLaMA-2-7B-chat) and llama.cpp's example
FLAGS = {"window": "--lookahead_window", "ngram": "--lookahead_ngram", "guesses": "--lookahead_guesses"}


def check_lookahead(window, ngram, guesses, depth=None) -> None:
    """W >= 1 columns, N >= 2 (an n-gram is its first token + at least one guessed token), G >= 1 guesses, and
    ``depth`` (the guessed tokens verified; None: all N - 1) within the n-gram; each refusal names its flag."""
    for name, value, low in (("window", window, 1), ("ngram", ngram, 2), ("guesses", guesses, 1)):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise SpectrainError(f"{FLAGS[name]} must be an integer >= {low}, got {value!r}")
    if depth is not None and not 1 <= depth <= ngram - 1:
        raise SpectrainError(f"--method lookahead verifies up to N - 1 = {ngram - 1} guessed tokens a round "
                             f"(--lookahead_ngram {ngram}); --k {depth} asks for {depth}: give --k between 1 and "
                             f"{ngram - 1}, or --lookahead_ngram {depth + 1} or more")


def window_nodes(window: int, ngram: int) -> int:
    """Nodes of the lookahead branch: W columns x (N - 1) levels, less the first level's first column (the root)."""
    return window * (ngram - 1) - 1


def forward_rows(window: int, ngram: int, guesses: int, depth: int | None = None) -> int:
    """The widest verifier forward of a round: the root, the fullest trie (G guesses of ``depth`` tokens, default
    N - 1, no prefix shared) and the window: ``(W + G) (N - 1)`` with every guessed token verified."""
    return 1 + guesses * (depth or ngram - 1) + window_nodes(window, ngram)


@dataclass(frozen=True)
class WindowLayout:
    """Where the window's nodes sit (fixed by W and N), in probe order: the first level's columns 1..W-1, then
    each further level's columns 0..W-1.

    Attributes:
        depth: (m,) positions after the root: node (level l, column i) at i + l.
        mask: (m, m) bool, mask[r, c]: node r attends to node c (itself included).
        read: (W,) rows of [root, window nodes...] whose greedy token a round reads back: the last level's (for
            N = 2 the first level, whose column 0 is the root itself, row 0).
    """

    depth: torch.Tensor
    mask: torch.Tensor
    read: torch.Tensor

    def to(self, device) -> "WindowLayout":
        return WindowLayout(self.depth.to(device), self.mask.to(device), self.read.to(device))


def window_layout(window: int, ngram: int) -> WindowLayout:
    """The lookahead branch's positions, mask and read rows for a W x (N - 1) window (built once per drafter)."""
    def node(level: int, column: int) -> int:  # probe index of (level, column); (0, 0) is the root, no node
        return column - 1 if level == 0 else window - 1 + (level - 1) * window + column

    m, levels = window_nodes(window, ngram), ngram - 1
    depth = [0] * m
    mask = torch.zeros(m, m, dtype=torch.bool)
    for level in range(levels):
        for column in range(1 if level == 0 else 0, window):
            row = node(level, column)
            depth[row] = column + level
            # The strand under column i: the first level up to column i (a causal chain from the root) ...
            mask[row, [node(0, c) for c in range(1, column + 1)]] = True
            # ... then the column's own earlier levels: one token further per Jacobi step.
            mask[row, [node(up, column) for up in range(1, level + 1)]] = True
    last = levels - 1
    read = [0 if last == 0 and column == 0 else 1 + node(last, column) for column in range(window)]
    return WindowLayout(torch.tensor(depth, dtype=torch.long), mask, torch.tensor(read, dtype=torch.long))


class NgramPool:
    """The n-grams the lookahead branch found: per first token up to G continuations of N - 1 tokens, the least
    recently found dropped first (the authors' guess set; one found again moves to the newest place)."""

    def __init__(self, guesses: int):
        self.guesses = guesses
        self.by_first: dict[int, list[tuple[int, ...]]] = {}

    def add(self, first: int, rest: tuple[int, ...]) -> None:
        kept = self.by_first.setdefault(first, [])
        if rest in kept:
            kept.remove(rest)
        elif len(kept) == self.guesses:
            kept.pop(0)
        kept.append(rest)

    def after(self, token: int) -> list[tuple[int, ...]]:
        """The continuations of ``token``, newest first (tried first by the sibling rule at T > 0)."""
        return self.by_first.get(token, [])[::-1]

    def __len__(self) -> int:
        return sum(len(kept) for kept in self.by_first.values())


def guess_tree(guesses: list[tuple[int, ...]]) -> tuple[list[int], Tree]:
    """The guesses merged into a trie: a shared prefix is one node, verified once, and siblings are distinct
    tokens (what the multi-candidate rule needs). Returns (one token per node, the :class:`Tree`), nodes in
    (depth, rank path) order as :class:`Tree` keeps them; a node's rank is its place among its parent's children in
    the order the guesses came. Built from host lists with one tensor per field (no per-node tensor ops: this runs
    every round)."""
    token_of: dict[tuple[int, ...], int] = {}
    kids: dict[tuple[int, ...], dict[int, tuple[int, ...]]] = {(): {}}
    for guess in guesses:
        node: tuple[int, ...] = ()
        for token in guess:
            children = kids[node]
            if token not in children:
                children[token] = node + (len(children),)
                kids[children[token]] = {}
                token_of[children[token]] = token
            node = children[token]
    paths = sorted(token_of, key=lambda p: (len(p), p))
    index = {p: i for i, p in enumerate(paths)}
    parent = [index.get(p[:-1], -1) for p in paths]
    rows = [i for i, p in enumerate(paths) for _ in p]
    cols = [index[p[:d]] for p in paths for d in range(1, len(p) + 1)]
    ancestors = torch.zeros(len(paths), len(paths), dtype=torch.bool)
    ancestors[rows, cols] = True
    children = [[-1] * (max(len(c) for c in kids.values()) or 1) for _ in range(len(paths) + 1)]
    for i, p in enumerate(paths):
        children[parent[i] + 1][p[-1]] = i
    long = dict(dtype=torch.long)
    tree = Tree(tuple(paths), torch.tensor(parent, **long), torch.tensor([len(p) for p in paths], **long),
                torch.tensor([p[-1] for p in paths], **long), ancestors, torch.tensor(children, **long))
    return [token_of[p] for p in paths], tree


def initial_window(context: list[int], window: int, ngram: int, seed: int) -> list[list[int]]:
    """The window before any round: tokens drawn from the prompt (the authors' initialisation; seeded, so a
    prompt always starts the same). Level 0 holds columns 1..W-1 (the root is its column 0), levels 1..N-2 all W."""
    rng = random.Random(seed)
    return [[rng.choice(context) for _ in range(window - 1 if level == 0 else window)] for level in range(ngram - 1)]


def window_ngrams(levels: list[list[int]], root: int, outputs: list[int]) -> list[tuple[int, ...]]:
    """One N-gram per column: its first-level token (the root for column 0), the column's further levels and the
    verifier's token after the last one."""
    firsts = [root] + levels[0]
    return [(firsts[i], *(level[i] for level in levels[1:]), out) for i, out in enumerate(outputs)]


def jacobi_step(levels: list[list[int]], outputs: list[int]) -> list[list[int]]:
    """The next window: each level moves up one and the outputs become the last; the new first level drops its
    column 0, where the next root goes (one step a round, however many tokens were accepted, as the authors'
    default does)."""
    moved = levels[1:] + [list(outputs)]
    return [moved[0][1:]] + moved[1:]


class LookaheadDrafter(Drafter):
    """Lookahead decoding: a Jacobi window run in the verifier's own forward fills an n-gram pool; each round
    verifies up to G of the pool's n-grams that start with the root (see the module docstring).

    ``depth``: each guess's tokens verified (default all N - 1). ``stats``: rounds, rounds that had guesses, and
    the pool's size at the end of the last prompt.
    """

    name = "lookahead"

    def __init__(self, window: int = WINDOW, ngram: int = NGRAM, guesses: int = GUESSES, depth: int | None = None,
                 seed: int = 0):
        check_lookahead(window, ngram, guesses, depth)
        self.depth = depth or ngram - 1
        super().__init__(Tree.chain(self.depth))  # the deepest guess (each round brings its own trie): sizes α
        self.window, self.ngram, self.guesses, self.seed = window, ngram, guesses, seed
        self.layout = window_layout(window, ngram)
        self.pool = NgramPool(guesses)
        self.levels: list[list[int]] = []
        self.root = -1
        self.steps = 0  # Jacobi steps of this prompt's window
        self.rounds = self.guess_rounds = 0

    @property
    def max_nodes(self) -> int:
        return forward_rows(self.window, self.ngram, self.guesses, self.depth) - 1

    @property
    def stats(self) -> dict:
        return {"rounds": self.rounds, "guess_rounds": self.guess_rounds, "pool": len(self.pool)}

    def start(self, state: DraftState, verifier: StaticCausalLM | None) -> None:
        """A new prompt: an empty pool and a window drawn from the prompt."""
        context = state.history or state.tokens[:state.length].tolist()
        self.layout = self.layout.to(state.tokens.device)
        self.pool = NgramPool(self.guesses)
        self.levels = initial_window(context[:-1] or context, self.window, self.ngram, self.seed)
        self.steps = 0

    def propose(self, state: DraftState) -> Proposal:
        """The root's guesses as a trie, and the window as probe nodes: (n,) guess tokens, (m,) window tokens."""
        device = state.tokens.device
        self.root = state.history[-1] if state.history else int(state.tokens[state.length - 1])
        tokens, tree = guess_tree([guess[:self.depth] for guess in self.pool.after(self.root)])
        self.rounds += 1
        self.guess_rounds += bool(tokens)
        window = torch.tensor([t for level in self.levels for t in level], dtype=torch.long, device=device)
        return Proposal(tokens=torch.tensor(tokens, dtype=torch.long, device=device), tree=tree,
                        probe=Probe(window, self.layout.depth, self.layout.mask, self.layout.read))

    def advance(self, accepted: int, state: DraftState) -> None:
        """Read the window's outputs (``state.probed``: W greedy tokens, already on the host): new n-grams for
        the pool, then one Jacobi step."""
        if state.probed is None:
            raise SpectrainError("lookahead drafting needs a decoder that runs its window (Proposal.probe) and "
                                 "hands back its outputs (DraftState.probed)")
        outputs = list(state.probed)
        # The first N - 2 steps still hold tokens drawn from the prompt in some level: their columns are no
        # trajectory yet (the authors fill the window level by level over these steps before collecting).
        if self.steps >= self.ngram - 2:
            for first, *rest in window_ngrams(self.levels, self.root, outputs):
                self.pool.add(first, tuple(rest))
        self.levels = jacobi_step(self.levels, outputs)
        self.steps += 1
