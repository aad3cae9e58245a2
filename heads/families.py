"""The drafter families: one :class:`DrafterFamily` record per family, registered by one call.

A family's drafter is one module (``heads/<family>.py``): its ``nn.Module`` with ``config``, ``save_pretrained`` and
``from_pretrained``, ending with the one registration line::

    register_family(DrafterFamily(name="mtp", methods=("mtp",), drafter_class=MtpHead, ...))

Each layer above registers its own half of the family under the same name, in a module of its own that imports
this one (never the other way, so ``heads/`` imports neither ``train/`` nor ``eval/``):

- serving formats and the llama.cpp file: ``heads/serving/<family>.py`` -> :func:`~.serving.registry.register_serving`;
- the evaluator's drafting: ``eval/<family>.py`` -> :func:`spectrain.eval.family_evaluator.register_evaluator`;
- training: the recipe's ``model.class_path`` names the family's ``DrafterModule`` (``train/<family>.py``).

The bundled families are :data:`BUNDLED_FAMILIES`; each layer's lookup imports its bundled halves by those names
(``tests/test_families.py`` holds every layer's list to this one). A family in another installed package is found
through the ``spectrain.families`` entry-point group (:func:`families`): the module the entry point names registers
its family and whatever halves it has, so it reaches every CLI, the evaluator, export and import with no file of
spectrain's changed. A drafter or method no family registered is a :class:`SpectrainError` everywhere, never
another family's path.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass

from .errors import SpectrainError


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
        verifier_depth_key: the key of our run-dir ``config.json`` that records the verifier's depth (what
            ``recorded_verifier`` reads), or None (the default) when the drafter does not record it.
    """

    name: str
    methods: tuple[str, ...]
    drafter_class: type
    config_class: type
    label: str = ""
    method_labels: tuple[str, ...] = ()
    verifier_depth_key: str | None = None

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

    def from_pretrained(self, path, verifier_model=None):
        """A drafter of this family from our run-dir format."""
        return self.drafter_class.from_pretrained(path, verifier_model)


_FAMILIES: dict[str, DrafterFamily] = {}

# The bundled families, imported (each registers itself) before any entry point's, in this order: the CLIs list them so.
BUNDLED_FAMILIES = ("spectrain.heads.medusa", "spectrain.heads.eagle", "spectrain.heads.dflash",
                    "spectrain.heads.peagle")
ENTRY_POINT_GROUP = "spectrain.families"  # an installed package's families (pyproject [project.entry-points])
# The evaluator's methods that are no learned drafter (AR, prompt lookup, ...; registered in eval/training_free.py):
# no family may take these names, or `spectrain-eval --method` would mean two things.
RESERVED_METHODS = ("ar", "ngram", "lookahead", "hybrid", "draft-model", "truncated", "none")
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


def resolve_class_path(class_path: str):
    """The class a recipe's ``model.class_path`` (``package.module.Class``) names, imported now."""
    module, _, name = class_path.rpartition(".")
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError, ValueError) as err:
        raise SpectrainError(f"cannot import {class_path}: {err}") from None


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
