"""The serving half of every drafter family: the checkpoint layouts engines load (:class:`ServingFormat`) and the
llama.cpp file (:class:`GgufExport`), registered under the family's name by its serving module
(``heads/serving/<family>.py``, or a plugin's) with :func:`register_serving`. Looked up through
:mod:`.families`, which loads the bundled ones."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from ..errors import SpectrainError
from ..vocab import Ranking

OUR_FORMAT = "spectrain"  # our own run-dir format's name (detect_format); no serving format may take it
GGUF_FORMAT = "gguf"  # spectrain-export's llama.cpp file (a family's GgufExport writes it); no serving format either
RESERVED_FORMATS = {OUR_FORMAT: "our own run-dir format's", GGUF_FORMAT: "spectrain-export's llama.cpp file's"}


@dataclass(frozen=True)
class ServingFormat:
    """One checkpoint layout a serving engine (or a peer toolkit) loads, and how to write and read it.

    Attributes:
        name: the ``spectrain-export --format`` name.
        description: the engine and layout, for ``--help`` and summaries.
        method: the drafter method it holds (one of its family's ``methods``).
        detect: ``config.json`` dict -> whether a directory holds this format. ``detect_format`` asks every
            registered format and exactly one must say yes (two are an error naming both), so a predicate should
            rest on exact keys (``speculators_model_type``, ``architectures``) and refuse its own family's other
            layouts, never guess from shapes.
        export: ``(drafter, fmt, verifier_lm_head, verifier_name, speculative_tokens, notes)`` ->
            ``(config.json dict, {tensor name: tensor})``; ``notes`` (a list) collects what the user should know.
        load: ``(fmt, config, tensors, ours, verifier_model, path)`` -> the drafter module; ``ours`` is the
            ``"spectrain"`` block our exports add to ``config.json`` ({} in a foreign checkpoint).
        expected: ``(fmt, config)`` -> {tensor name: shape} the engine's loader reads for that ``config.json``
            (the strict check every export and import passes: nothing missing, nothing extra).
        weights_file: the safetensors file inside the directory.
        optional: ``(fmt, config)`` -> {tensor name: shape} the engine accepts but does not need (allowed by
            ``validate_export`` when their shape is right), or None.
        check: ``(fmt, config, found, clean)`` -> [problem, ...]: the format's own checks of a written export
            beyond names and shapes; ``found`` is {tensor name: (shape, safetensors dtype)}, ``clean`` whether
            the names and shapes passed. None: no more checks.
        extras: ``(drafter, fmt, config, ranking, notes)`` -> [writer(directory), ...]: files a format writes
            beside the weights for a drafter with a vocabulary ranking (``ranking``: :class:`~.vocab.Ranking`);
            it may add to ``config`` and ``notes``. None: nothing.
        pickled_weights: the pickle the reference toolkit ships instead of ``weights_file`` (refused on import,
            with how to convert it), or "".
    """

    name: str
    description: str
    method: str
    detect: Callable
    export: Callable
    load: Callable
    expected: Callable
    weights_file: str = "model.safetensors"
    optional: Callable | None = None
    check: Callable | None = None
    extras: Callable | None = None
    pickled_weights: str = ""


@dataclass(frozen=True)
class GgufExport:
    """How ``spectrain-export --format gguf`` writes a family's drafter as one llama.cpp file.

    Attributes:
        check_target: ``(drafter, target_gguf)`` -> None; raises unless the target GGUF (the verifier the draft is
            served beside) fits the drafter.
        write: ``(drafter, out, target_gguf, dtype, force, verifier_name)`` -> the ``llama-server`` flags that
            serve the written file (``"--spec-type draft-NAME"``).
        drafters: how ``--help`` names the drafters it writes, one per llama.cpp architecture.
        spec_types: the ``--spec-type`` of each of them, in the same order.
        check_exportable: ``(drafter)`` -> None; raises, naming the reason, unless llama.cpp can serve the drafter
            exactly as trained (asked before anything is written). None: every drafter of the family can be.
    """

    check_target: Callable
    write: Callable
    drafters: tuple[str, ...] = ()
    spec_types: tuple[str, ...] = ()
    check_exportable: Callable | None = None


@dataclass(frozen=True)
class FamilyServing:
    """What ``spectrain-export`` writes and reads for one drafter family.

    Attributes:
        family: the family's name (its :class:`~spectrain.heads.families.DrafterFamily`'s).
        formats: the serving formats it exports and imports.
        gguf: its :class:`GgufExport` (``spectrain-export --format gguf``), or None.
        without_confidence_head: ``drafter`` -> the drafter less a confidence head that never changes its drafts
            (``spectrain-export --drop_confidence_head``), or None.
        exports_need_verifier_head: ``drafter`` -> whether writing it needs the verifier's ``lm_head`` (heads
            that project through it; ``spectrain-export`` then loads the verifier), or None (never).
    """

    family: str
    formats: tuple[ServingFormat, ...] = ()
    gguf: GgufExport | None = None
    without_confidence_head: Callable | None = None
    exports_need_verifier_head: Callable | None = None

    def __post_init__(self):
        object.__setattr__(self, "formats", tuple(self.formats))


_SERVING: dict[str, FamilyServing] = {}


def register_serving(serving: FamilyServing) -> FamilyServing:
    """Register a family's serving half (the line its serving module ends with); returns it. The same record again is
    a no-op; another record for a family already served is refused. Format names are checked when read
    (:func:`~.families.serving_formats`), against every registered family's."""
    held = _SERVING.get(serving.family)
    if held is not None and held != serving:
        raise SpectrainError(f"family {serving.family!r}'s serving formats are already registered")
    for spec in serving.formats:
        if spec.name in RESERVED_FORMATS:
            raise SpectrainError(f"family {serving.family}: format name {spec.name!r} is {RESERVED_FORMATS[spec.name]}")
    _SERVING[serving.family] = serving
    return serving


def unregister_serving(family: str) -> None:
    """Remove a family's serving half (tests that register one of their own)."""
    _SERVING.pop(family, None)


def registered_serving(family: str) -> FamilyServing | None:
    """The serving half registered for ``family`` (bundled ones only once :mod:`.families` is imported)."""
    return _SERVING.get(family)


def full_head_note(engines: str, hint: str = ""):
    """An ``extras`` hook for a format whose engines serve the full head: a ranked drafter's export notes that its
    ranked head is spectrain-eval's (``engines``: "vLLM serves"; ``hint``: appended to the note)."""

    def note(drafter, fmt: str, config: dict, ranking: Ranking, notes: list[str]) -> list:
        ids = ranking.ids()  # the drafter's default ranked head; None = it trained over the full vocabulary
        if ids is not None:
            notes.append(f"{fmt}: {engines} this export's full head over all {drafter.config.vocab_size} tokens; the "
                         f"ranked {ids.numel()}-token head is spectrain-eval's (vocab_ranking.json is copied beside "
                         "the weights)" + hint)
        return []

    return note
