"""The drafter families: one :class:`DrafterFamily` record per family, registered by one call.

A family is one module (or a few beside it: its serving formats) — its ``nn.Module`` drafter with ``config``,
``save_pretrained`` and ``from_pretrained`` — that ends with the one registration line::

    register_family(DrafterFamily(name="mtp", methods=("mtp",), drafter_class=MtpHead, ...))

The bundled families are imported from :data:`BUNDLED_FAMILIES`; a family in another installed package is found
through the ``spectrain.families`` entry-point group (:func:`families`), so it reaches every CLI, the evaluator,
export and import with no file of spectrain's changed.

Everything that would switch on a family asks this table instead: importing a run dir or an export
(``heads/formats.py``), the serving formats and their detection, the evaluator's drafters (``eval/``), the results
table's label, FSDP's drafter units (``train/strategies.py``) and measured τ at validation. A drafter, method
or format no family registered is a :class:`SpectrainError` everywhere, never another family's path.

``heads/`` imports neither ``train/`` nor ``eval/``: the training module and the evaluator are named here by
dotted path (``"package.module:attribute"``) and imported by whoever uses them (:func:`resolve`); a family
defined outside the package (a test, a plugin) may pass the objects themselves.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any

from .errors import SpectrainError

Ref = Any  # an object, or a "package.module:attribute" string naming one (imported on first use)


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
    detect: Ref
    export: Ref
    load: Ref
    expected: Ref
    weights_file: str = "model.safetensors"
    optional: Ref = None
    check: Ref = None
    extras: Ref = None
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

    check_target: Ref
    write: Ref
    drafters: tuple[str, ...] = ()
    spec_types: tuple[str, ...] = ()
    check_exportable: Ref = None


@dataclass(frozen=True)
class DrafterFamily:
    """What the rest of spectrain needs to know about one drafter family.

    Attributes:
        name: the family, as ``spectrain-eval --method`` / ``evaluate_drafter``'s method and the results table
            name it.
        methods: the methods its drafters record (``config.method``, ``config.json``'s ``"method"``, a training
            run's ``method_name``); one family may train several variants. Unique over all families.
        drafter_class: its ``nn.Module``: ``.config`` (with ``.method`` and ``.verifier``),
            ``save_pretrained(dir)`` and ``from_pretrained(dir, verifier_model)`` (our run-dir format:
            ``model.safetensors`` + ``config.json``).
        config_class: its config dataclass (``drafter_class(config)`` builds an untrained drafter).
        label: how tables and messages name the family (default ``name``).
        method_labels: how messages name each of its methods, in ``methods`` order (default: ``label`` for each).
        formats: the serving formats it exports and imports: a tuple of :class:`ServingFormat`, or the dotted
            path of one (each bundled family's live beside its model: ``heads/<family>_formats.py`` or its module).
        train_module: its training ``LightningModule`` (a ``DrafterModule`` subclass), by dotted path.
        evaluator: its :class:`spectrain.eval.families.FamilyEvaluator` (how the evaluator drafts with it), by
            dotted path.
        verifier_depth_key: the key of our run-dir ``config.json`` that records the verifier's depth (what
            ``recorded_verifier`` reads), or None (the default) when the drafter does not record it.
        gguf: its :class:`GgufExport` (``spectrain-export --format gguf``), or None.
        without_confidence_head: ``drafter`` -> the drafter less a confidence head that never changes its drafts
            (``spectrain-export --drop_confidence_head``), or None.
        exports_need_verifier_head: ``drafter`` -> whether writing it needs the verifier's ``lm_head`` (heads
            that project through it; ``spectrain-export`` then loads the verifier), or None (never).
    """

    name: str
    methods: tuple[str, ...]
    drafter_class: type
    config_class: type
    label: str = ""
    method_labels: tuple[str, ...] = ()
    formats: Ref = ()
    train_module: Ref = None
    evaluator: Ref = None
    verifier_depth_key: str | None = None
    gguf: Ref = None
    without_confidence_head: Ref = None
    exports_need_verifier_head: Ref = None

    def __post_init__(self):
        object.__setattr__(self, "methods", tuple(self.methods))
        object.__setattr__(self, "label", self.label or self.name)
        object.__setattr__(self, "method_labels", tuple(self.method_labels) or (self.label,) * len(self.methods))
        if not self.name or not self.methods:
            raise SpectrainError(f"a drafter family needs a name and at least one method, got {self.name!r} "
                                 f"{self.methods!r}")
        if len(self.method_labels) != len(self.methods):
            raise SpectrainError(f"family {self.name}: {len(self.method_labels)} method_labels for "
                                 f"{len(self.methods)} methods")

    def serving_formats(self) -> tuple[ServingFormat, ...]:
        """Its serving formats (imported on first use when named by dotted path)."""
        formats = tuple(resolve(self.formats))
        foreign = [f.name for f in formats if f.method not in self.methods]
        if foreign:
            raise SpectrainError(f"family {self.name}: formats {foreign} hold methods it does not have "
                                 f"({', '.join(self.methods)})")
        return formats

    def from_pretrained(self, path, verifier_model=None):
        """A drafter of this family from our run-dir format."""
        return self.drafter_class.from_pretrained(path, verifier_model)


_FAMILIES: dict[str, DrafterFamily] = {}

# The bundled families, imported (each registers itself) before any entry point's, in this order: the CLIs list them so.
BUNDLED_FAMILIES = ("spectrain.heads.medusa", "spectrain.heads.eagle", "spectrain.heads.dflash")
ENTRY_POINT_GROUP = "spectrain.families"  # an installed package's families (pyproject [project.entry-points])
# The evaluator's methods that are no learned drafter (AR, prompt lookup, ...; registered in eval/training_free.py):
# no family may take these names, or `spectrain-eval --method` would mean two things.
RESERVED_METHODS = ("ar", "ngram", "hybrid", "draft-model", "truncated", "none")
OUR_FORMAT = "spectrain"  # our own run-dir format's name (detect_format); no serving format may take it
GGUF_FORMAT = "gguf"  # spectrain-export's llama.cpp file (a family's GgufExport writes it); no serving format either
RESERVED_FORMATS = {OUR_FORMAT: "our own run-dir format's", GGUF_FORMAT: "spectrain-export's llama.cpp file's"}
_loaded = False


def register_family(family: DrafterFamily) -> DrafterFamily:
    """Add ``family`` to the table (the one line a family module ends with); returns it.

    Its name and methods must be new and none of :data:`RESERVED_METHODS` (registering the same record again is a
    no-op); format names are checked when the formats are first read (:func:`serving_formats`)."""
    if _FAMILIES.get(family.name) == family:
        return family
    reserved = sorted({family.name, *family.methods} & set(RESERVED_METHODS))
    if reserved:
        raise SpectrainError(f"cannot register drafter family {family.name!r}: {', '.join(map(repr, reserved))} "
                             f"{'is' if len(reserved) == 1 else 'are'} the evaluator's own method"
                             f"{'' if len(reserved) == 1 else 's'} (reserved: {', '.join(RESERVED_METHODS)})")
    methods = {m for f in _FAMILIES.values() for m in f.methods}
    clashes = ([f"family {family.name!r}"] if family.name in _FAMILIES else []) + [
        f"method {m!r}" for m in family.methods if m in methods]
    if clashes:
        raise SpectrainError(f"cannot register drafter family {family.name!r}: {', '.join(clashes)} already "
                             "registered")
    _FAMILIES[family.name] = family
    return family


def unregister_family(name: str) -> None:
    """Remove a family (tests that register one of their own)."""
    _FAMILIES.pop(name, None)


def families() -> tuple[DrafterFamily, ...]:
    """Every registered family, in registration order: the bundled ones, then those of installed packages'
    ``spectrain.families`` entry points, then any registered since (a test's)."""
    _load_families()
    # the bundled ones in their list's order, whichever module a caller happened to import first
    rank = {module: i for i, module in enumerate(BUNDLED_FAMILIES)}
    return tuple(sorted(_FAMILIES.values(), key=lambda f: rank.get(f.drafter_class.__module__, len(rank))))


def family_named(name: str) -> DrafterFamily:
    """The family called ``name`` (an evaluator ``method``)."""
    for family in families():
        if family.name == name:
            return family
    raise SpectrainError(f"no drafter family {name!r}; registered: {', '.join(f.name for f in families())}")


def family_for_method(method: str, where: str = "") -> DrafterFamily:
    """The family whose drafters record ``method``; ``where`` names what recorded it."""
    for family in families():
        if method in family.methods:
            return family
    known = ", ".join(m for f in families() for m in f.methods)
    raise SpectrainError(f"{where + ': ' if where else ''}drafter method {method!r} belongs to no registered "
                         f"drafter family (known: {known}); a new family registers itself with register_family()")


def family_of(drafter) -> DrafterFamily:
    """The family of a drafter module (an instance of its ``drafter_class``, or of a subclass: FSDP2's)."""
    for family in families():
        if isinstance(drafter, family.drafter_class):
            return family
    raise SpectrainError(f"{type(drafter).__name__} is not the drafter of a registered drafter family "
                         f"({', '.join(f.name for f in families())}); a new family registers itself with "
                         "register_family()")


def method_of(drafter) -> str:
    """The method a drafter module trains and records (``config.method``), checked against its family."""
    family = family_of(drafter)
    method = getattr(getattr(drafter, "config", None), "method", None)
    if method not in family.methods:
        raise SpectrainError(f"{type(drafter).__name__}'s config records method {method!r}, not one of family "
                             f"{family.name}'s ({', '.join(family.methods)})")
    return method


def serving_formats() -> dict[str, ServingFormat]:
    """Every registered serving format by name, family by family (in registration order: detection's order)."""
    out: dict[str, ServingFormat] = {}
    for family in families():
        for spec in family.serving_formats():
            if spec.name in RESERVED_FORMATS:
                raise SpectrainError(f"family {family.name}: format name {spec.name!r} is "
                                     f"{RESERVED_FORMATS[spec.name]}")
            if spec.name in out:
                raise SpectrainError(f"format {spec.name!r} is registered twice (family {family.name} and "
                                     f"{family_for_method(out[spec.name].method).name})")
            out[spec.name] = spec
    return out


def serving_format(name: str) -> ServingFormat:
    formats = serving_formats()
    if name not in formats:
        raise SpectrainError(f"unknown format {name!r}; expected one of {', '.join(sorted(formats))}")
    return formats[name]


def resolve(ref: Ref):
    """``ref`` itself, or the object a ``"package.module:attribute"`` string names (imported now)."""
    if not isinstance(ref, str):
        return ref
    module, sep, attribute = ref.partition(":")
    if not sep:
        raise SpectrainError(f"{ref!r} is not a 'package.module:attribute' path")
    try:
        return getattr(importlib.import_module(module), attribute)
    except (ImportError, AttributeError) as err:
        raise SpectrainError(f"cannot import {ref}: {err}") from None


def resolve_class_path(class_path: str):
    """The class a recipe's ``model.class_path`` (``package.module.Class``) names, imported now."""
    module, _, name = class_path.rpartition(".")
    return resolve(f"{module}:{name}")


def _load_families() -> None:
    """Import the bundled family modules (each registers itself), then load every ``spectrain.families`` entry point
    (once; cheap afterwards). An entry point names a module that registers its family on import, or a
    :class:`DrafterFamily` (registered here); one that fails to load is an error naming it, never skipped."""
    global _loaded
    if _loaded:
        return
    _loaded = True  # first: a family module that asks the table while it loads must not load it again
    try:
        for module in BUNDLED_FAMILIES:
            importlib.import_module(module)
        for point in _entry_points():
            try:
                loaded = point.load()
            except Exception as err:  # a broken plugin: name it rather than hide its families
                raise SpectrainError(f"the {ENTRY_POINT_GROUP} entry point {point.name!r} ({point.value}) does not "
                                     f"load: {type(err).__name__}: {err}") from None
            if isinstance(loaded, DrafterFamily):
                register_family(loaded)
    except BaseException:
        _loaded = False  # asked again, the same error again
        raise


def _entry_points():
    """The installed ``spectrain.families`` entry points, sorted by name (a stable order)."""
    from importlib.metadata import entry_points

    return sorted(entry_points(group=ENTRY_POINT_GROUP), key=lambda point: point.name)
