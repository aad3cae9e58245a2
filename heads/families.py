"""The drafter families: one :class:`DrafterFamily` record per family, registered by one call.

A family (Medusa, EAGLE, ...) is one module — its ``nn.Module`` drafter with ``config``, ``save_pretrained`` and
``from_pretrained`` — that ends with the one registration line::

    register_family(DrafterFamily(name="medusa", methods=("medusa",), drafter_class=MedusaHeads, ...))

Everything that used to switch on Medusa-or-EAGLE asks this table instead: importing a run dir or an export
(``heads/formats.py``), the serving formats and their detection, the evaluator's drafters (``eval/``), the results
table's label, FSDP's drafter units (``train/strategies.py``) and measured τ at validation. A drafter, method
or format no family registered is a :class:`SpectrainError` everywhere, never another family's path.

``heads/`` imports neither ``train/`` nor ``eval/``: the training module and the evaluator are named here by
dotted path (``"package.module:attribute"``) and imported by whoever uses them (:func:`resolve`); a family
defined outside the package (a test, a plugin) may pass the objects themselves.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Any

from .errors import SpectrainError

Ref = Any  # an object, or a "package.module:attribute" string naming one (imported on first use)


@dataclass(frozen=True)
class ServingFormat:
    """One checkpoint layout a serving engine (or a peer toolkit) loads, and how to write and read it.

    Attributes:
        name: the ``spectrain-export --format`` name (``"vllm-medusa"``).
        description: the engine and layout, for ``--help`` and summaries.
        method: the drafter method it holds (one of its family's ``methods``: ``"eagle3"``).
        detect: ``config.json`` dict -> whether a directory holds this format (:func:`detect_format` asks every
            registered format in registration order; the first that says yes wins).
        export: ``(drafter, fmt, verifier_lm_head, verifier_name, speculative_tokens, notes)`` ->
            ``(config.json dict, {tensor name: tensor})``; ``notes`` (a list) collects what the user should know.
        load: ``(fmt, config, tensors, ours, verifier_model, path)`` -> the drafter module; ``ours`` is the
            ``"spectrain"`` block our exports add to ``config.json`` ({} in a foreign checkpoint).
        expected: ``(fmt, config)`` -> {tensor name: shape} the engine's loader reads for that ``config.json``
            (the strict check every export and import passes: nothing missing, nothing extra).
        weights_file: the safetensors file inside the directory.
    """

    name: str
    description: str
    method: str
    detect: Ref
    export: Ref
    load: Ref
    expected: Ref
    weights_file: str = "model.safetensors"


@dataclass(frozen=True)
class DrafterFamily:
    """What the rest of spectrain needs to know about one drafter family.

    Attributes:
        name: the family, as ``spectrain-eval --method`` / ``evaluate_drafter(method=...)`` and the results table
            name it (``"medusa"``, ``"eagle"``).
        methods: the methods its drafters record (``config.method``, ``config.json``'s ``"method"``, a training
            run's ``method_name``): ``("eagle1", "eagle3")``. Unique over all families.
        drafter_class: its ``nn.Module``: ``.config`` (with ``.method`` and ``.verifier``),
            ``save_pretrained(dir)`` and ``from_pretrained(dir, verifier_model)`` (our run-dir format:
            ``model.safetensors`` + ``config.json``).
        config_class: its config dataclass (``drafter_class(config)`` builds an untrained drafter).
        label: how tables and messages name the family (default ``name``).
        formats: the serving formats it exports and imports: a tuple of :class:`ServingFormat`, or the dotted
            path of one (the bundled families' live in ``heads/formats.py``, beside the code they call).
        train_module: its training ``LightningModule`` (a ``DrafterModule`` subclass), by dotted path.
        evaluator: its :class:`spectrain.eval.families.FamilyEvaluator` (how the evaluator drafts with it), by
            dotted path.
        fsdp_units: the module classes FSDP wraps as drafter units (each one whole unit, never split; default
            ``(drafter_class,)``).
    """

    name: str
    methods: tuple[str, ...]
    drafter_class: type
    config_class: type
    label: str = ""
    formats: Ref = ()
    train_module: Ref = None
    evaluator: Ref = None
    fsdp_units: tuple[type, ...] = field(default=())

    def __post_init__(self):
        object.__setattr__(self, "methods", tuple(self.methods))
        object.__setattr__(self, "label", self.label or self.name)
        object.__setattr__(self, "fsdp_units", tuple(self.fsdp_units) or (self.drafter_class,))
        if not self.name or not self.methods:
            raise SpectrainError(f"a drafter family needs a name and at least one method, got {self.name!r} "
                                 f"{self.methods!r}")

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


def register_family(family: DrafterFamily) -> DrafterFamily:
    """Add ``family`` to the table (the one line a family module ends with); returns it.

    Its name and methods must be new (registering the same record again is a no-op); format names are checked
    when the formats are first read (:func:`serving_formats`)."""
    if _FAMILIES.get(family.name) == family:
        return family
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
    """Every registered family, in registration order (Medusa and EAGLE are registered on import)."""
    _builtin()
    return tuple(_FAMILIES.values())


def family_named(name: str) -> DrafterFamily:
    """The family called ``name`` (an evaluator ``method``)."""
    for family in families():
        if family.name == name:
            return family
    raise SpectrainError(f"no drafter family {name!r}; registered: {', '.join(f.name for f in families())}")


def family_for_method(method: str, where: str = "") -> DrafterFamily:
    """The family whose drafters record ``method`` (``"eagle3"`` -> EAGLE); ``where`` names what recorded it."""
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


def _builtin() -> None:
    """Import the bundled family modules, which register themselves (once; cheap afterwards)."""
    from . import medusa, eagle, dflash  # noqa: F401  (registration order: the CLI lists them so)
