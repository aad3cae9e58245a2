"""An evaluation's set-up: what it returns (:class:`EvalResult`), the learned drafter loaded
(:func:`load_drafter`) and its draft vocabulary (:func:`resolve_draft_vocab`). The settings live in
:mod:`.settings`; the methods, and how a learned drafter is bound to one, in :mod:`.methods`."""

from __future__ import annotations

import warnings
from dataclasses import asdict, dataclass, field

import torch

from spectrain.heads.errors import SpectrainError
from spectrain.heads.families import family_of
from spectrain.heads.serving.formats import import_drafter, recorded_verifier
from spectrain.heads.verifier import Verifier, match_verifier
from spectrain.heads.vocab import load_ranking

from .families import BoundDrafter, bind
from .methods import all_methods, method_named


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
    expected = method_named(method).family if method is not None else None
    if expected is not None and expected != family.name:
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
        takers = ", ".join(m.name for m in all_methods() if m.needs_drafter)
        raise SpectrainError(f"--draft_vocab applies to a learned drafter ({takers})")


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
