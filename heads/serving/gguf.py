"""Which drafters llama.cpp takes, and writing one: each family's :class:`~.registry.GgufExport` (its writer, its
target check and ``check_exportable``: why llama.cpp cannot serve a drafter as trained), asked by
``spectrain-export --format gguf``, the model card and the llama.cpp checks."""

from __future__ import annotations

from pathlib import Path

from ..errors import SpectrainError
from ..families import family_for_method, family_of
from .families import gguf_exports, serving_of
from .registry import GgufExport


def listed(names: list[str], last: str = "and") -> str:
    """``"a, b and c"`` (``last``: the word before the last name)."""
    return ", ".join(names[:-1]) + f" {last} " + names[-1] if len(names) > 1 else "".join(names)


def check_gguf_exportable(drafter) -> None:
    """Raise, naming the reason, unless llama.cpp can serve ``drafter`` exactly as trained: its drafter family writes
    a llama.cpp file (:attr:`~.registry.FamilyServing.gguf`) and that record's ``check_exportable`` passes it."""
    family = family_of(drafter)
    export = serving_of(family).gguf
    if export is None:
        method = getattr(getattr(drafter, "config", None), "method", type(drafter).__name__)
        drafters = listed([name for export in gguf_exports() for name in export.drafters])
        raise SpectrainError(f"--format gguf writes {drafters} drafters for llama.cpp; this drafter is {method}: "
                             f"llama.cpp has no loader for {family.label} drafts")
    if export.check_exportable is not None:
        export.check_exportable(drafter)


def gguf_export_of(drafter) -> GgufExport:
    """The drafter family's :class:`~.registry.GgufExport`; raises, naming the drafters llama.cpp takes, when its
    family writes no llama.cpp file or the family's ``check_exportable`` refuses this drafter."""
    check_gguf_exportable(drafter)
    return serving_of(family_of(drafter)).gguf


def spec_type_of(method: str) -> str | None:
    """The ``llama-server --spec-type`` that serves a drafter recording ``method`` (its family's
    :class:`~.registry.GgufExport` names one per drafter label), or None when its family writes no llama.cpp
    file."""
    family = family_for_method(method)
    export = serving_of(family).gguf
    if export is None:
        return None
    label = family.method_labels[family.methods.index(method)]
    return export.spec_types[export.drafters.index(label)] if label in export.drafters else None


def write_draft_gguf(drafter, out: str | Path, target_gguf: str | Path, dtype: str = "float32", force: bool = False,
                     verifier_name: str = "") -> str:
    """Write ``drafter`` as the llama.cpp file its family writes (what ``spectrain-export --format gguf`` writes):
    the drafter and the target GGUF are checked first (the family's ``check_target``, whatever its writer checks
    itself), the file is validated before its rename. Returns the ``llama-server`` flags that serve it
    (``"--spec-type draft-NAME ..."``)."""
    export = gguf_export_of(drafter)
    export.check_target(drafter, Path(target_gguf))
    return export.write(drafter, Path(out), Path(target_gguf), dtype, force, verifier_name)
