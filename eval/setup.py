"""An evaluation's set-up: the methods and their :class:`Settings` (checked), what it returns
(:class:`EvalResult`), the learned drafter loaded (:func:`load_drafter`) and resolved once to its family and
evaluator (:func:`bind_learned`), and its draft vocabulary (:func:`resolve_draft_vocab`)."""

from __future__ import annotations

import warnings
from dataclasses import asdict, dataclass, field

import torch

from spectrain.heads.errors import SpectrainError
from spectrain.heads.families import family_of
from spectrain.heads.formats import import_drafter, recorded_verifier
from spectrain.heads.verifier import Verifier, match_verifier
from spectrain.heads.vocab import load_ranking

from .accept import Sampling
from .drafters import check_min_match
from .families import BoundDrafter, bind, check_min_confidence_value, learned_methods


OTHER_METHODS = ("ngram", "hybrid", "draft-model", "truncated", "none")  # besides one per drafter family


def methods() -> tuple[str, ...]:
    """Every ``method``: each registered drafter family's (its name), then the others."""
    return learned_methods() + OTHER_METHODS


@dataclass(frozen=True)
class Settings:
    """How to draft and decode (:func:`evaluate_drafter`'s keyword arguments, checked)."""

    method: str
    k: int = 4
    tree: str | None = None
    dynamic_tree: tuple[int, int, int] | None = None
    lookup: int = 0
    min_confidence: float = 0.0
    draft_layers: int = 1
    min_match: int = 2
    min_match_sampled: int = 4
    max_new_tokens: int = 128
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    compile: bool = False
    seed: int = 0

    @property
    def sampling(self) -> Sampling:
        return Sampling(self.temperature, self.top_p, self.top_k)

    @property
    def auto_nodes(self) -> int | None:
        """N of ``tree="auto:N"`` (the best N-node tree from measured rank accuracies); None for other trees."""
        return int(self.tree[5:]) if self.tree and self.tree.startswith("auto:") else None

    def check(self) -> None:
        if self.method not in methods():
            raise SpectrainError(f"method must be one of {', '.join(methods())}, got {self.method!r}")
        if self.k < 0:
            raise SpectrainError(f"k must be >= 0, got {self.k}")
        if self.max_new_tokens < 1:
            raise SpectrainError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.method == "hybrid":
            check_min_match(self.min_match, self.min_match_sampled)
        if not isinstance(self.lookup, int) or self.lookup < 0:
            raise SpectrainError(f"--lookup must be an integer >= 0 (0: k), got {self.lookup!r}")
        if self.lookup and self.method != "hybrid":
            raise SpectrainError(f"--lookup is the hybrid's lookup length; --method {self.method} has no lookup")
        check_min_confidence_value(self.min_confidence)
        if self.min_confidence and self.method not in learned_methods() + ("hybrid",):
            raise SpectrainError(f"--min_confidence cuts a learned drafter's chain; --method {self.method} has none")
        if self.min_confidence and (not self.k or self.tree or self.dynamic_tree):
            raise SpectrainError("--min_confidence cuts chains: give --k > 0 and no --tree / --dynamic_tree (evaluate "
                                 "trees in a run of their own)")
        if self.tree and self.tree.startswith("auto:") and not (self.tree[5:].isdigit() and int(self.tree[5:]) > 0):
            raise SpectrainError(f"--tree auto:N takes a node count N >= 1, got {self.tree!r}")


@dataclass
class EvalResult:
    """What :func:`evaluate_drafter` measured.

    ``results``: per setting (``"ar"``, ``"chain-4"``, ``"tree-32"``, ``"dynamic-6x8-64"``) τ, α by depth, the
    accept-length histogram, tokens/s, ms per token, speedup over AR (measured and ideal) and whether every T = 0
    output equals AR's; ``per_prompt``: per setting, every turn's tokens and rounds; ``costs``: verify / draft
    milliseconds per round; ``planner``: expected speedups by chain length (and tree size, for rank-tree
    families); ``calibration``: what the family's calibration measured on AR's outputs (rank accuracies, ...)."""

    method: str
    device: str
    dtype: str
    batch_invariant: bool
    sampling: dict
    draft_vocab: int | None
    num_prompts: int
    max_new_tokens: int
    chat_template: bool
    results: dict[str, dict]
    per_prompt: dict[str, list[dict]]
    costs: dict | None = None
    planner: dict | None = None
    calibration: dict | None = None
    hf_generate: dict | None = None
    compile: dict | None = None
    eval_seconds: float = 0.0
    decoder: str = "llama"
    extra: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        return asdict(self)


def load_drafter(path: str, verifier: Verifier, method: str | None = None, allow_mismatch: bool = False,
                 fmt: str | None = None):
    """Any drafter (a run dir or an export in any format) on the verifier's device and dtype, in eval mode.

    ``method`` (a family's name) refuses a drafter of another family. The drafter's recorded verifier is matched by
    signature, not by name (:func:`~spectrain.heads.verifier.match_verifier`: architecture, model type, vocabulary,
    width, depth, tokenizer, whichever both sides record): a differing field is refused unless ``allow_mismatch``;
    another name with an agreeing signature loads, with a warning (also kept as ``drafter.verifier_note``). Sizes
    are always checked. ``fmt`` names the directory's format where several registered formats claim it
    (``--drafter_format``); None: detected."""
    if not path:
        raise SpectrainError(f"--method {method} needs --drafter (a train_medusa / train_eagle run directory or "
                             "an export)")
    drafter = import_drafter(path, verifier_model=verifier.model, fmt=fmt)
    note = match_verifier(recorded_verifier(path, fmt), verifier, allow_mismatch, where=f"drafter {path}")
    if note:
        warnings.warn(note, stacklevel=2)
    drafter.verifier_note = note
    family = family_of(drafter)
    if method in learned_methods() and method != family.name:
        raise SpectrainError(f"{path} holds a drafter of the {family.label} family: use --method {family.name}")
    param = next(verifier.model.parameters())
    drafter.ranking = load_ranking(path)  # its training data's token counts (ranked draft heads), or None
    return drafter.to(param.device, param.dtype).eval()


def resolve_draft_vocab(learned, draft_vocab: int | None, vocab_size: int) -> tuple[torch.Tensor | None, int | None]:
    """The ranked draft vocabulary of ``learned`` (a learned module of any family, or None): ((N,) target ids or
    None for the drafter's own head, the N it drafts over; None without a learned drafter). ``draft_vocab``: None =
    the size it trained over (its ranking's default), 0 = full, N = the N most frequent of its training tokens."""
    if learned is None:
        refuse_draft_vocab(draft_vocab)
        return None, None
    return draft_vocab_of(bind(learned), draft_vocab, vocab_size)


def refuse_draft_vocab(draft_vocab: int | None) -> None:
    """``--draft_vocab`` without a learned drafter to draft over it: refused."""
    if draft_vocab:
        raise SpectrainError(f"--draft_vocab applies to a learned drafter ({', '.join(learned_methods() + ('hybrid',))})")


def draft_vocab_of(bound: BoundDrafter, draft_vocab: int | None, vocab_size: int) -> tuple[torch.Tensor | None, int]:
    """:func:`resolve_draft_vocab` for a bound drafter: a vocabulary fixed by its training (the family's
    :attr:`~.families.FamilyEvaluator.fixed_draft_vocab`), else the ranked one its ``vocab_ranking.json`` gives."""
    fixed = bound.evaluator.fixed_draft_vocab(bound.learned, draft_vocab)
    if fixed is not None:
        return None, fixed
    ranking = getattr(bound.learned, "ranking", None)
    if ranking is not None and ranking.vocab_size != vocab_size:
        raise SpectrainError(f"the drafter's vocab_ranking.json counts {ranking.vocab_size} tokens, the verifier "
                             f"has {vocab_size}: it belongs to another verifier")
    if draft_vocab is None:
        ids = ranking.ids() if ranking is not None else None
    elif draft_vocab == 0:
        ids = None
    else:
        if not isinstance(draft_vocab, int) or isinstance(draft_vocab, bool) or draft_vocab < 0:
            raise SpectrainError(f"--draft_vocab must be an integer >= 0 (0 = full), got {draft_vocab!r}")
        if draft_vocab > vocab_size:
            raise SpectrainError(f"--draft_vocab {draft_vocab} exceeds the verifier's vocabulary of {vocab_size}")
        if ranking is None:
            raise SpectrainError("--draft_vocab N needs the drafter's token counts (vocab_ranking.json beside its "
                                 "weights, written by training); this drafter has none: use --draft_vocab 0, or "
                                 "write one with spectrain-rank-vocab")
        ids = ranking.ids(draft_vocab)
    return ids, vocab_size if ids is None else ids.numel()


def bind_learned(method: str, drafter) -> BoundDrafter | None:
    """The learned drafter of ``method`` (a family's, or the hybrid's) resolved once to its family and evaluator;
    None for methods without one. A drafter of another family than ``method`` names is refused."""
    if drafter is None or method not in learned_methods() + ("hybrid",):
        return None
    bound = bind(drafter)  # an unregistered drafter: refused here
    if method != "hybrid" and bound.family.name != method:
        raise SpectrainError(f"method {method} got a {type(drafter).__name__}: use method {bound.family.name}")
    return bound


def learned_kind(method: str, learned) -> str:
    """The learned drafter's kind behind ``method`` (hybrid: the family of the drafter it was given)."""
    if method != "hybrid":
        return method
    return family_of(learned).name
