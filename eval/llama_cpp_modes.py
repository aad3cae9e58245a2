"""Our draft's modes in ``llama-server`` (``benchmarks/llama_cpp_speed.py``): the settings a run times, their names
(``eagle3-k4-q8_0-p0.6-t1``, read back by :func:`mode_of` from a result file), the server flags of each, and the
draft GGUFs they serve.

A mode is our draft at one draft length, draft dtype, ``--spec-draft-p-min`` and draft thread count; the plain and
n-gram modes (llama.cpp's own, training-free) are named as llama.cpp names them. The draft is of any family that
writes a llama.cpp file (``spectrain-export --format gguf``, its family's ``GgufExport``), served with the
``--spec-type`` that family names; a block drafter drafts its whole block in every mode.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass
from pathlib import Path

from spectrain.eval.llama_cpp_slots import NO_BACKEND_SAMPLING
from spectrain.heads.errors import SpectrainError
from spectrain.heads.serving.cli import target_gguf_for
from spectrain.heads.serving.formats import import_drafter, method_of
from spectrain.heads.serving.gguf import gguf_export_of, gguf_exports, write_draft_gguf
from spectrain.heads.serving.llama_cpp import read_metadata

NGRAM_MODES = ("ngram-simple", "ngram-mod", "ngram-map-k")
# ngram-mod keeps one hash pool across all requests of a server: with repeats, the second repeat would draft the
# first repeat's output of the same prompt. Such a mode gets a fresh server for every request.
CROSS_REQUEST_STATE = ("ngram-mod",)
DRAFT_DTYPES = {"f32": "float32", "f16": "float16", "bf16": "bfloat16", "q8_0": "q8_0"}


@dataclass(frozen=True)
class DraftMode:
    """One setting of our draft in llama-server: the draft (its ``--spec-type`` less ``draft-``: ``eagle3``), draft
    length, the draft GGUF's dtype, p-min, threads."""
    draft: str
    k: int
    dtype: str = "f32"
    p_min: float | None = None  # None: --p_min
    threads: int | None = None  # None: --threads

    @property
    def name(self) -> str:
        """The mode's name in results (``eagle3-k4-q8_0-p0.6-t1``: only the settings that differ from the run's)."""
        return f"{self.draft}-k" + "-".join([str(self.k)] + ([self.dtype] if self.dtype != "f32" else []) +
                                            ([f"p{fixed(self.p_min)}"] if self.p_min is not None else []) +
                                            ([f"t{self.threads}"] if self.threads is not None else []))

    @property
    def spec_type(self) -> str:
        """llama-server's ``--spec-type`` for this draft."""
        return f"draft-{self.draft}"


def fixed(value: float) -> str:
    """``0.5`` -> ``0.5``, ``1e-05`` -> ``0.00001``: a number in a mode's name, read back by :func:`mode_of`."""
    return f"{value:.6f}".rstrip("0").rstrip(".") or "0"


@dataclass(frozen=True)
class Draft:
    """Our draft as llama-server serves it: its ``--spec-type``, its GGUF per dtype, and the block it drafts whole
    each round where its family's writer pins ``--spec-draft-n-max`` (a block drafter; None: any length)."""
    spec_type: str
    files: dict[str, Path]
    block: int | None = None

    @property
    def name(self) -> str:
        """The draft as its modes are named (``eagle3``, ``dflash``)."""
        return self.spec_type.removeprefix("draft-")


MODE_NAME = re.compile(r"^(?P<draft>[a-z0-9_]+(?:-[a-z0-9_]+)*?)-(?P<setting>k\d.*)$")


def mode_of(name: str) -> DraftMode | None:
    """A result's mode name -> its :class:`DraftMode` (``eagle3-k4-p0.5``), None for plain and n-gram modes."""
    match = MODE_NAME.match(name)
    if match is None or name in NGRAM_MODES:
        return None
    return parse_draft_mode(match["setting"].replace("-", ":"), match["draft"])


def run_p_min(command: str) -> float:
    """A run's ``--p_min``, as it recorded its command (0 where it passed none)."""
    words = shlex.split(command or "")
    return float(words[words.index("--p_min") + 1]) if "--p_min" in words else 0.0


def parse_draft_mode(text: str, draft: str) -> DraftMode:
    """``k4``, ``k1:q8_0``, ``k6:p0.8``, ``k1:f16:t1`` (or a bare draft length, ``4``) of the draft ``draft`` ->
    :class:`DraftMode`."""
    parts = [x for x in text.strip().split(":") if x]
    fields: dict = {"draft": draft}
    try:
        if not parts:
            raise ValueError
        head = parts[0][1:] if parts[0].startswith("k") else parts[0]
        fields["k"] = int(head)
        for part in parts[1:]:
            if part in DRAFT_DTYPES:
                fields["dtype"] = part
            elif part.startswith("p"):
                fields["p_min"] = float(part[1:])
            elif part.startswith("t"):
                fields["threads"] = int(part[1:])
            else:
                raise ValueError
    except ValueError:
        raise SpectrainError(f"draft mode {text!r}: want kN[:DTYPE][:pP][:tT], DTYPE one of "
                             f"{', '.join(DRAFT_DTYPES)} (e.g. k1:q8_0, k4:p0.6, k1:t1)") from None
    mode = DraftMode(**fields)
    if mode.k < 1 or (mode.threads is not None and mode.threads < 1) or not 0 <= (mode.p_min or 0) <= 1:
        raise SpectrainError(f"draft mode {text!r}: draft length and threads must be >= 1, p-min in [0, 1]")
    return mode


@dataclass(frozen=True)
class ModeRequest:
    """The modes a run asks for (``llama_cpp_speed.py``'s flags): ``lengths`` (``--draft_lengths``, f32 drafts; None:
    1…6, or a block drafter's block), ``extra`` (``--draft_modes``: ``kN[:DTYPE][:pP][:tT]`` items), and what a mode
    without its own setting takes: ``p_min`` (``--p_min``), ``threads`` (``--threads``); ``ngram``: llama.cpp's
    n-gram modes to run beside ours (comma list, '' for none)."""
    lengths: str | None = None
    extra: str = ""
    p_min: float = 0.0
    threads: int = 2
    ngram: str = ",".join(NGRAM_MODES)


def draft_modes(request: ModeRequest, draft: str, block: int | None = None) -> list[DraftMode]:
    """``request.lengths`` (f32 drafts; default 1…6, or ``block``) then ``request.extra``, each once, in that order,
    of the draft ``draft``. A draft of a ``block`` (a block drafter: its writer pins the length) drafts that many
    tokens in every mode: served with fewer slots than trained, every slot's state would differ."""
    lengths = request.lengths if request.lengths is not None else str(block or "1,2,3,4,5,6")
    items = [x for x in lengths.split(",") if x.strip()] + request.extra.replace(",", " ").split()
    out: list[DraftMode] = []
    for item in items:
        mode = parse_draft_mode(item, draft)
        if block is not None and mode.k != block:
            raise SpectrainError(f"draft mode {item!r}: this drafter drafts its whole block of {block} tokens every "
                                 f"round (its family serves it with --spec-draft-n-max {block}): draft length {block}")
        if mode not in out:
            out.append(mode)
    return out


def mode_flags(request: ModeRequest, draft: Draft) -> dict[str, list[str]]:
    """mode name -> llama-server flags beyond the common ones: ``plain``, each of our draft modes, the n-gram modes."""
    out = {"plain": []}
    for mode in draft_modes(request, draft.name, draft.block):
        threads = str(mode.threads or request.threads)
        out[mode.name] = ["-md", str(draft.files[mode.dtype]), "--spec-type", mode.spec_type, "--spec-draft-n-max",
                          str(mode.k), "--spec-draft-n-min", "0", "--spec-draft-p-min",
                          str(request.p_min if mode.p_min is None else mode.p_min), "-td", threads, "-tbd", threads]
    for name in [x for x in request.ngram.split(",") if x.strip()]:
        if name not in NGRAM_MODES:
            raise SpectrainError(f"--ngram: unknown mode {name!r}; one of {', '.join(NGRAM_MODES)}")
        out[name] = ["--spec-type", name]
    return out


def draft_sampling(flags_by_mode: dict[str, list[str]], backend: str) -> dict[str, list[str]]:
    """Each mode's server flags with our draft sampled on the CPU (``backend="off"``: the flag on our draft modes
    alone; plain and the n-gram modes have no draft model) or as llama.cpp samples it by default (``"on"``)."""
    if backend not in ("on", "off"):
        raise SpectrainError(f"--draft_backend_sampling must be on or off, got {backend!r}")
    if backend == "on":
        return dict(flags_by_mode)
    return {m: [*flags, NO_BACKEND_SAMPLING] if mode_of(m) else list(flags) for m, flags in flags_by_mode.items()}


def spec_type_of_gguf(path: str, spec_type: str | None) -> str:
    """The ``--spec-type`` of a draft ``.gguf``: ``spec_type`` if given, else ``draft-`` + its
    ``general.architecture`` where the family writing that architecture serves it with that one type alone."""
    arch = read_metadata(path).get("general.architecture")
    guess = f"draft-{arch.value if arch else None}"
    export = next((e for e in gguf_exports() if guess in e.spec_types), None)
    if spec_type is None and export is not None and len(export.spec_types) == 1:
        return guess
    served = [t for e in gguf_exports() for t in e.spec_types]
    if spec_type in served:
        return spec_type
    if spec_type is not None:
        raise SpectrainError(f"--spec_type {spec_type}: not a draft type a registered family serves "
                             f"({', '.join(served)})")
    raise SpectrainError(f"--drafter {path}: its architecture does not say how llama.cpp serves it "
                         f"({' or '.join(export.spec_types) if export else 'no registered draft type'}): pass "
                         "--spec_type")


def draft_files(request: ModeRequest, drafter: str, out: Path, verifier: str, drafter_format: str | None = None,
                spec_type: str | None = None) -> Draft:
    """Our draft: the draft GGUF of every dtype a mode of ``request`` asks for (written from ``drafter``, a run dir or
    export, by its family's writer, as ``spectrain-export --format gguf`` writes it, with ``verifier``'s GGUF as the
    target's tokenizer), the ``--spec-type`` that serves it and the block its writer pins. A ``.gguf`` drafter is
    served as it is (f32 modes only), with ``spec_type`` or the type its architecture names."""
    if drafter.endswith(".gguf"):
        spec_type = spec_type_of_gguf(drafter, spec_type)
        wanted = sorted({m.dtype for m in draft_modes(request, spec_type.removeprefix("draft-"))})
        if wanted not in ([], ["f32"]):
            raise SpectrainError("--drafter is a .gguf: draft modes of another dtype need the drafter's directory")
        return Draft(spec_type, {"f32": Path(drafter)})
    if spec_type:
        raise SpectrainError("--spec_type goes with a .gguf --drafter; a drafter directory is served as its family "
                             "names")
    model = import_drafter(drafter, fmt=drafter_format)
    try:
        gguf_export_of(model)  # llama.cpp serves it as trained, or the reason
    except SpectrainError as why:
        raise SpectrainError(f"--drafter: {why}") from None
    target, method = target_gguf_for(verifier), method_of(model)
    wanted = sorted({m.dtype for m in draft_modes(request, method)}) or ["f32"]
    files: dict[str, Path] = {}
    spec_type, block = None, None  # from the family's writer, below
    for d in wanted:
        path = out / (f"draft-{method}.gguf" if d == "f32" else f"draft-{method}-{d}.gguf")
        serve = shlex.split(write_draft_gguf(model, path, target, DRAFT_DTYPES[d], force=True))
        files[d] = path
        if spec_type is None:  # the writer's flags: how its family serves the file, checked before the next dtype
            spec_type = serve[serve.index("--spec-type") + 1]
            if "--spec-draft-n-max" in serve:  # a block drafter drafts its whole block
                block = int(serve[serve.index("--spec-draft-n-max") + 1])
            draft_modes(request, spec_type.removeprefix("draft-"), block)
    return Draft(spec_type, files, block)
