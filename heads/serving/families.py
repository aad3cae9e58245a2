"""Each drafter family's serving half, looked up: the bundled families' serving modules are imported here (each
registers itself, :func:`~.registry.register_serving`), a plugin's with its family (its entry point's module)."""

from __future__ import annotations

from ..errors import SpectrainError
from ..families import DrafterFamily, families, family_for_method
from . import dflash, eagle, medusa, peagle  # noqa: F401  the bundled families' serving halves (BUNDLED_FAMILIES)
from .registry import FamilyServing, GgufExport, ServingFormat, registered_serving


def serving_of(family: DrafterFamily) -> FamilyServing:
    """``family``'s serving half (an empty one when it registered none: no formats, no llama.cpp file)."""
    families()  # the installed packages' families, and the halves their modules register
    serving = registered_serving(family.name) or FamilyServing(family.name)
    foreign = [f.name for f in serving.formats if f.method not in family.methods]
    if foreign:
        raise SpectrainError(f"family {family.name}: formats {foreign} hold methods it does not have "
                             f"({', '.join(family.methods)})")
    return serving


def serving_formats() -> dict[str, ServingFormat]:
    """Every registered serving format by name, family by family (in registration order: detection's order)."""
    out: dict[str, ServingFormat] = {}
    for family in families():
        for spec in serving_of(family).formats:
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


def gguf_exports() -> list[GgufExport]:
    """The :class:`~.registry.GgufExport` of every registered drafter family that writes a llama.cpp file."""
    return [serving_of(f).gguf for f in families() if serving_of(f).gguf is not None]
