"""An evaluation's settings: :class:`EvalSettings`, every decoding and measurement knob of
:func:`~.evaluate.evaluate_drafter` in one frozen record, checked once when it is made (variants:
``dataclasses.replace``, checked again); the kinds of setting it decodes (:class:`TreeKind`) and one decoded
setting, :class:`DraftShape`. Which method drafts which kind is the method registry's (:mod:`.methods`)."""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from spectrain.heads.errors import SpectrainError

from .accept import Sampling
from .drafters import check_min_match
from .family_evaluator import check_min_confidence_value
from .lookahead import GUESSES, WINDOW, check_lookahead
from .static_model import PATHS
from .tree import Tree


class TreeKind(str, Enum):
    """The kinds of setting an evaluation decodes: a chain of ``k`` drafts, a static tree (rank paths or
    ``auto:N``), a dynamic tree grown each round."""

    CHAIN = "chain"
    STATIC = "static"
    DYNAMIC = "dynamic"

    @property
    def flag(self) -> str:
        """The setting (and ``spectrain-eval`` flag) that asks for it."""
        return {"chain": "--k", "static": "--tree", "dynamic": "--dynamic_tree"}[self.value]


@dataclass(frozen=True)
class DraftShape:
    """One setting an evaluation decodes: its results name (``chain-4``, ``tree-32``, ``dynamic-6x8-64``), its
    kind, its tree (a dynamic tree: the chain of its depth, which sizes its metrics) and, for a dynamic tree,
    ``(depth, topk, budget)``."""

    name: str
    kind: TreeKind
    tree: Tree
    dynamic: tuple[int, int, int] | None = None

    @classmethod
    def chain(cls, k: int) -> "DraftShape":
        return cls(f"chain-{k}", TreeKind.CHAIN, Tree.chain(k))


def parse_dynamic_tree(spec) -> tuple[int, int, int] | None:
    """``"DEPTH,TOPK,BUDGET"`` (or three integers) -> a tuple, each >= 1; None or "" -> None."""
    if spec is None or spec == "":
        return None
    parts = spec.split(",") if isinstance(spec, str) else spec
    try:
        if len(parts) != 3 or any(isinstance(x, bool) or not isinstance(x, (int, str)) for x in parts):
            raise ValueError
        values = tuple(int(x) for x in parts)
    except (TypeError, ValueError):
        raise SpectrainError(f"--dynamic_tree takes DEPTH,TOPK,BUDGET, got {spec!r}") from None
    if min(values) < 1:
        raise SpectrainError(f"--dynamic_tree values must be >= 1, got {spec!r}")
    return values


def _integer(name: str, value, low: int | None = None, note: str = "") -> None:
    if isinstance(value, bool) or not isinstance(value, int) or (low is not None and value < low):
        raise SpectrainError(f"{name} must be an integer{'' if low is None else f' >= {low}'}{note}, got {value!r}")


def _optional_bool(name: str, value, none: str = "") -> None:
    if not (isinstance(value, bool) or (none and value is None)):
        raise SpectrainError(f"{name} must be True or False{f' or None ({none})' if none else ''}, got {value!r}")


@dataclass(frozen=True)
class EvalSettings:
    """How to draft, decode and measure: every knob of :func:`~.evaluate.evaluate_drafter`, checked when made.

    Attributes:
        k: chain length (drafts per round); 0 skips the chain.
        tree: a static tree as JSON rank paths (inline or a file), or ``auto:N`` for the best N-node tree from
            the heads' rank accuracies measured on AR's outputs (families with a calibration).
        dynamic_tree: ``(depth, topk, budget)`` of a dynamic tree grown each round (``"D,T,B"`` is read too).
        lookup: the tokens a hybrid's lookup round drafts: a chain's lookup rounds (default ``k``) and a tree's
            lookup branch (default ``k``, else the tree's depth); methods without prompt lookup refuse it.
        min_confidence: a chain verifies only the drafts its confidence head expects to survive, the longest
            prefix with predicted whole-prefix acceptance >= this (drafters with a confidence head; 0: every
            draft; chains only).
        draft_layers: the verifier layers ``truncated`` keeps.
        lookahead_window, lookahead_ngram, lookahead_guesses: ``lookahead``'s W (Jacobi window columns), N (n-gram
            size, the window's N - 1 levels; None: k + 1, so its guesses are the chain's k tokens; a larger N's
            guesses are cut to k) and G (guesses verified a round).
        min_match, min_match_sampled: a hybrid's lookup threshold at T = 0 and at T > 0.
        max_new_tokens: tokens generated per turn.
        temperature, top_p, top_k: decoding (T = 0: greedy, where every output must equal AR's).
        chat_template: render turns with the tokenizer's chat template (None: when it has one).
        compile: compile one graph per verify size, warmed up before anything is timed.
        hf_generate: prompts also decoded by HF ``generate()``, interleaved with ours (None: every prompt; 0: skip).
        costs: probe verify / draft costs in isolation and run the planner (without them a rank-tree drafter is
            calibrated only when ``tree`` is ``auto:N``).
        max_len: KV-cache positions (None: what the longest prompt's turns need).
        seed: the sampling generator's seed, the same for every setting.
        batch_invariant: each token's numbers independent of the forward's width (None: on in bf16 / fp16 on a
            CPU, off on CUDA and in fp32).
        draft_vocab: a learned drafter's draft vocabulary: the N most frequent tokens of its training data, 0 =
            full, None = the one it trained over.
        decoder: the verifier's forward: ``llama``, ``layers`` or ``auto``.
    """

    k: int = 4
    tree: str | None = None
    dynamic_tree: tuple[int, int, int] | None = None
    lookup: int = 0
    min_confidence: float = 0.0
    draft_layers: int = 1
    lookahead_window: int = WINDOW
    lookahead_ngram: int | None = None
    lookahead_guesses: int = GUESSES
    min_match: int = 2
    min_match_sampled: int = 4
    max_new_tokens: int = 128
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    chat_template: bool | None = None
    compile: bool = False
    hf_generate: int | None = None
    costs: bool = True
    max_len: int | None = None
    seed: int = 0
    batch_invariant: bool | None = None
    draft_vocab: int | None = None
    decoder: str = "auto"

    def __post_init__(self):
        object.__setattr__(self, "dynamic_tree", parse_dynamic_tree(self.dynamic_tree))
        self.check()

    def check(self) -> None:
        """Every value in range, each refusal naming its setting (what a method drafts:
        :meth:`~.methods.EvalMethod.check`)."""
        _integer("k", self.k, 0)
        _integer("max_new_tokens", self.max_new_tokens, 1)
        if not isinstance(self.lookup, int) or isinstance(self.lookup, bool) or self.lookup < 0:
            raise SpectrainError(f"--lookup must be an integer >= 0 (0: k), got {self.lookup!r}")
        _integer("draft_layers", self.draft_layers, 1)
        check_lookahead(self.lookahead_window, 2 if self.lookahead_ngram is None else self.lookahead_ngram,
                        self.lookahead_guesses)  # N against k: the lookahead method's check
        for name in ("min_match", "min_match_sampled"):
            _integer(name, getattr(self, name))
        check_min_match(self.min_match, self.min_match_sampled)
        check_min_confidence_value(self.min_confidence)
        if self.min_confidence and (not self.k or self.tree or self.dynamic_tree):
            raise SpectrainError("--min_confidence cuts chains: give --k > 0 and no --tree / --dynamic_tree (evaluate "
                                 "trees in a run of their own)")
        if self.tree is not None and (not isinstance(self.tree, str) or not self.tree):
            raise SpectrainError(f"tree must be JSON rank paths, a file of them or auto:N, got {self.tree!r}")
        if self.tree and self.tree.startswith("auto:") and not (self.tree[5:].isdigit() and int(self.tree[5:]) > 0):
            raise SpectrainError(f"--tree auto:N takes a node count N >= 1, got {self.tree!r}")
        for name in ("temperature", "top_p"):
            if isinstance(getattr(self, name), bool) or not isinstance(getattr(self, name), (int, float)):
                raise SpectrainError(f"{name} must be a number, got {getattr(self, name)!r}")
        _integer("top_k", self.top_k, 0)
        Sampling(self.temperature, self.top_p, self.top_k)  # temperature >= 0, top_p in (0, 1]
        _optional_bool("chat_template", self.chat_template, "when the tokenizer has one")
        _optional_bool("compile", self.compile)
        _optional_bool("costs", self.costs)
        _optional_bool("batch_invariant", self.batch_invariant, "by device and dtype")
        if self.hf_generate is not None:
            _integer("hf_generate", self.hf_generate, 0, " (0: skip; None: every prompt)")
        if self.max_len is not None:
            _integer("max_len", self.max_len, 1, " (None: what the prompts need)")
        _integer("seed", self.seed)
        if self.draft_vocab is not None:
            _integer("--draft_vocab", self.draft_vocab, 0, " (0 = full)")
        if self.decoder not in PATHS:
            raise SpectrainError(f"decoder must be one of {', '.join(PATHS)}, got {self.decoder!r}")

    @property
    def sampling(self) -> Sampling:
        return Sampling(self.temperature, self.top_p, self.top_k)

    @property
    def lookahead_n(self) -> int:
        """``lookahead``'s N: ``lookahead_ngram``, else k + 1 (its guesses the chain's k tokens)."""
        return self.lookahead_ngram if self.lookahead_ngram is not None else self.k + 1

    @property
    def auto_nodes(self) -> int | None:
        """N of ``tree="auto:N"`` (the best N-node tree from measured rank accuracies); None for other trees."""
        return int(self.tree[5:]) if self.tree and self.tree.startswith("auto:") else None

    @property
    def tree_kinds(self) -> tuple[TreeKind, ...]:
        """The kinds of setting these settings ask for, in the order they are decoded."""
        return tuple(kind for kind, asked in ((TreeKind.CHAIN, self.k > 0), (TreeKind.STATIC, bool(self.tree)),
                                              (TreeKind.DYNAMIC, self.dynamic_tree is not None)) if asked)
