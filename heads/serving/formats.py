"""Serving-engine checkpoint formats, whichever family registered them: export, validate, detect, import.

The formats themselves (their layouts, engines and config keys) live beside each family's model, as
:class:`~.families.ServingFormat` records its family registers; :data:`FORMATS` is a live view of every registered
one. This module is what they share, and names no family: every family-specific part is a hook of the format's
record (its expected and optional tensors, its own checks, the files it writes beside the weights) or of the
family's (the verifier depth its run dirs record).

Beside the weights an export may carry ``vocab_ranking.json`` (the drafter's training token counts: our
evaluator's ranked heads), ``verifier_signature.json`` (:func:`recorded_verifier`: the verifier matched by
architecture, sizes, depth and tokenizer, not by name) and a format's own extras (SGLang's ``token_map.pt``,
:mod:`.token_map`, checked here whichever format wrote it).

Every export is checked against what the engine's loader expects *from the written config alone*
(:func:`validate_export`: every tensor name and shape, nothing missing, nothing extra), because vLLM
loads a drafter with a missing norm or silently dropped biases without a word.

A directory's format is detected, never guessed (:func:`detect_format`): our own run-dir format by its keys, else
every registered format is asked and exactly one must claim it; two claimants are an error naming both.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import torch
from safetensors import safe_open

from ..errors import SpectrainError
from ..families import family_for_method
from ..families import method_of as family_method
from ..io import atomic_dir, load_tensors, read_json, save_tensors, write_json
from .families import serving_format, serving_formats
from .registry import OUR_FORMAT
from .token_map import TOKEN_MAP_FILE, check_token_map
from ..verifier import SIGNATURE_FIELDS, load_verifier_signature, save_verifier_signature
from ..vocab import Ranking, save_ranking

class _FormatTable(Mapping):
    """A live view of the registered serving formats (:func:`~.families.serving_formats`): name -> one field."""

    def __init__(self, field: str):
        self._field = field

    def __getitem__(self, name: str):
        spec = serving_formats().get(name)
        if spec is None:
            raise KeyError(name)
        return getattr(spec, self._field)

    def __iter__(self):
        return iter(serving_formats())

    def __len__(self) -> int:
        return len(serving_formats())


FORMATS = _FormatTable("description")  # format -> engine and layout, every registered family's

METHOD_OF = _FormatTable("method")  # format -> the drafter method it holds

_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


def weights_file(fmt: str) -> str:
    return serving_format(fmt).weights_file


# -- what each engine expects, computed from a written config alone ---------------------------------------
def expected_tensors(fmt: str, config: dict) -> dict[str, tuple[int, ...]]:
    """Tensor name -> shape that ``fmt``'s engine loader reads for this ``config.json``.

    This is the engine's view (its config keys and its parameter names), not ours, so it catches an
    export whose config and weights disagree.
    """
    expected = serving_format(fmt).expected
    try:
        return expected(fmt, config)
    except KeyError as e:
        raise SpectrainError(f"{fmt} config.json lacks the key {e.args[0]!r} its engine reads") from None


def optional_tensors(fmt: str, config: dict) -> dict[str, tuple[int, ...]]:
    """Tensor name -> shape that ``fmt``'s engine accepts beside :func:`expected_tensors` but does not need."""
    optional = serving_format(fmt).optional
    if optional is None:
        return {}
    try:
        return optional(fmt, config)
    except KeyError as e:
        raise SpectrainError(f"{fmt} config.json lacks the key {e.args[0]!r} its engine reads") from None


def _header(path: Path) -> dict[str, tuple[tuple[int, ...], str]]:
    """Tensor name -> (shape, dtype) from a safetensors header, without loading the data."""
    if not path.is_file():
        raise SpectrainError(f"weights file not found: {path}")
    try:
        with safe_open(str(path), framework="pt") as f:
            return {k: (tuple(f.get_slice(k).get_shape()), f.get_slice(k).get_dtype()) for k in f.keys()}
    except Exception as e:  # safetensors raises several types for a corrupt header
        raise SpectrainError(f"{path} is not a readable safetensors file: {e}") from None


def validate_export(path: str | Path, fmt: str) -> dict[str, tuple[int, ...]]:
    """Check a written export the way its engine would read it; raise naming every difference.

    Returns the tensors the engine requires (name -> shape). Tensors it accepts but does not need (the frozen
    verifier embedding some checkpoints carry: the format's ``optional``) may be there, with the right shape; the
    format's own ``check`` then runs. A ``token_map.pt`` (SGLang's ``--speculative-token-map``) beside the weights
    is checked too (:func:`check_token_map`)."""
    path = Path(path)
    config = read_json(path / "config.json", f"{fmt} config")
    expected = expected_tensors(fmt, config)
    optional = optional_tensors(fmt, config)
    allowed = {**optional, **expected}
    found = _header(path / weights_file(fmt))
    missing = sorted(set(expected) - set(found))
    extra = sorted(set(found) - set(allowed))
    wrong = [f"{k} {found[k][0]} (expected {allowed[k]})" for k in sorted(set(allowed) & set(found))
             if found[k][0] != allowed[k]]
    problems = []
    if missing:
        problems.append(f"missing {missing}")
    if extra:
        problems.append(f"unexpected {extra}")
    if wrong:
        problems.append(f"wrong shapes {wrong}")
    check = serving_format(fmt).check
    if check is not None:
        problems += check(fmt, config, found, not problems)
    declared = (config.get("spectrain") or {}).get("token_map")
    if declared is not None or (path / TOKEN_MAP_FILE).exists():
        try:
            check_token_map(path, config, declared)
        except SpectrainError as err:
            problems.append(str(err))
    if problems:
        raise SpectrainError(f"{path} is not a valid {fmt} export: " + "; ".join(problems))
    return expected


# -- export ---------------------------------------------------------------------------------------------------
def method_of(drafter) -> str:
    """The method a drafter records (``config.method``); an unregistered drafter class is refused."""
    return family_method(drafter)


def check_format_for(drafter, fmt: str) -> str:
    """Raise unless ``fmt`` is a format for this drafter's method; returns the method."""
    if fmt not in FORMATS:
        raise SpectrainError(f"unknown export format {fmt!r}; expected one of {', '.join(sorted(FORMATS))}")
    have = method_of(drafter)
    if METHOD_OF[fmt] != have:
        ours = [f for f, m in METHOD_OF.items() if m == have]
        raise SpectrainError(f"format {fmt} holds {METHOD_OF[fmt]} drafters, but this run trained {have}; "
                             f"formats for {have}: {', '.join(ours) or 'none (only our own run-dir format)'}")
    return have


def export_tensors(drafter, fmt: str, verifier_lm_head: torch.nn.Module | None = None,
                   verifier_name: str = "", speculative_tokens: int | None = None,
                   notes: list[str] | None = None) -> tuple[dict, dict[str, torch.Tensor]]:
    """(config.json dict, tensors) of ``drafter`` in ``fmt``; ``notes`` collects what the user should know."""
    notes = notes if notes is not None else []
    check_format_for(drafter, fmt)
    return serving_format(fmt).export(drafter, fmt, verifier_lm_head, verifier_name, speculative_tokens, notes)


def export_drafter(drafter, fmt: str, out_dir: str | Path, verifier_lm_head=None, verifier_name: str = "",
                   force: bool = False, dtype: torch.dtype | None = None, speculative_tokens: int | None = None,
                   notes: list[str] | None = None, ranking: Ranking | None = None,
                   verifier_signature: dict | None = None) -> Path:
    """Write ``drafter`` in ``fmt`` to ``out_dir`` atomically, validated before it appears.

    Floating tensors are cast to ``dtype`` (default: as trained); integer and bool tensors keep their types.
    Refuses an existing ``out_dir`` unless ``force``; on any error nothing is left behind. ``ranking`` (the
    drafter's ``vocab_ranking.json``, :func:`~.vocab.load_ranking`) is copied beside the weights, and the format's
    ``extras`` may write more from it (SGLang's token map, :func:`write_token_map`); ``verifier_signature``
    (:func:`~.verifier.verifier_identity`) is written as ``verifier_signature.json``, so an import can match the
    verifier by what it is.
    """
    notes = notes if notes is not None else []
    config, tensors = export_tensors(drafter, fmt, verifier_lm_head, verifier_name, speculative_tokens, notes)
    extras = _export_extras(drafter, fmt, config, ranking, verifier_signature, notes)
    if dtype is not None:
        tensors = {k: v.to(dtype) if v.is_floating_point() else v for k, v in tensors.items()}
        config["torch_dtype"] = _DTYPE_NAMES[dtype]
    else:
        floating = {v.dtype for v in tensors.values() if v.is_floating_point()}
        config["torch_dtype"] = _DTYPE_NAMES.get(next(iter(floating)), "float32") if len(floating) == 1 else "float32"
    out_dir = Path(out_dir)
    with atomic_dir(out_dir, force=force) as tmp:
        save_tensors(tmp / weights_file(fmt), tensors, metadata={"format": "pt", "exported_by": "spectrain"})
        for write in extras:
            write(tmp)
        write_json(tmp / "config.json", config)
        validate_export(tmp, fmt)
    return out_dir


# -- what an export carries beside the weights: vocabulary ranking, verifier signature, the format's extras ----
def _export_extras(drafter, fmt: str, config: dict, ranking: Ranking | None, signature: dict | None,
                   notes: list[str]) -> list:
    """Writers (each ``fn(directory)``) of the files an export carries beside its weights, and what ``config``
    and ``notes`` say about them: the verifier's signature, the ranking, and the format's own ``extras``."""
    writers = []
    if signature:
        writers.append(lambda d: save_verifier_signature(d, signature, verifier_name_of(drafter)))
        config.setdefault("spectrain", {})["verifier_signature"] = {k: signature.get(k) for k in SIGNATURE_FIELDS}
        if "speculators_config" in config and signature.get("architecture"):  # any speculators layout
            config["speculators_config"]["verifier"]["architectures"] = [signature["architecture"]]
    if ranking is None:
        return writers
    if ranking.vocab_size != drafter.config.vocab_size:
        raise SpectrainError(f"the drafter's vocab_ranking.json counts {ranking.vocab_size} tokens, the drafter "
                             f"predicts over {drafter.config.vocab_size}: it belongs to another drafter")
    writers.append(lambda d: save_ranking(d, ranking.counts, ranking.default_size, ranking.source))
    extras = serving_format(fmt).extras
    if extras is not None:
        writers += extras(drafter, fmt, config, ranking, notes)
    return writers


def verifier_name_of(drafter) -> str:
    return getattr(drafter.config, "verifier", "") or ""


# -- import -----------------------------------------------------------------------------------------------------
def _claims(spec, config: dict) -> bool:
    """Whether ``spec``'s detect predicate claims ``config``; a predicate that raises on a config it does not
    expect (another format's keys) names its format rather than breaking every other format's detection."""
    try:
        return bool(spec.detect(config))
    except Exception as err:  # a plugin's predicate: any error, reported as that format's
        raise SpectrainError(f"format {spec.name!r}'s detect raised {type(err).__name__}: {err} (its predicate must "
                             "return False for a config it does not read)") from None


SAY_FORMAT = ("--drafter_format NAME (spectrain-eval, spectrain-export; spectrain-results --drafter_format "
              "DRAFTER=NAME; training: --model.init_from_format NAME; import_drafter(..., fmt=NAME))")


def input_format(fmt: str | None) -> str | None:
    """``fmt`` checked as the name of a drafter directory's format (None: to be detected): ``spectrain`` (a run
    directory) or a registered serving format; anything else is refused naming them."""
    if fmt is None or fmt == OUR_FORMAT or fmt in serving_formats():
        return fmt
    raise SpectrainError(f"unknown drafter format {fmt!r}; expected {OUR_FORMAT} (a run directory) or one of "
                         f"{', '.join(sorted(serving_formats()))}")


def detect_format(path: str | Path, fmt: str | None = None) -> str:
    """``spectrain`` (our own run/drafter directory) or the one registered format that claims ``path``'s
    config.json; ``fmt`` names the format instead (for a directory several formats claim).

    Every registered format is asked; none or several claiming it is an error naming them. A format's pickled
    weights (its reference toolkit's ``.pt``) without the safetensors file are refused with how to convert them."""
    path = Path(path)
    for spec in serving_formats().values():
        pickled = spec.pickled_weights
        if pickled and (path / pickled).is_file() and not (path / spec.weights_file).is_file():
            raise SpectrainError(f"{path}/{pickled} is a pickle; spectrain loads safetensors only — convert it "
                                 f"(safetensors.torch.save_file) to {spec.weights_file}")
    config = read_json(path / "config.json", "drafter config")
    ours = "method" in config and "format_version" in config  # import_drafter finds the family of its method
    if ours and fmt in (None, OUR_FORMAT):
        return OUR_FORMAT
    claims = [] if ours else [spec.name for spec in serving_formats().values() if _claims(spec, config)]
    if fmt is not None:  # one of the claimants, never a loader the directory is not in
        if input_format(fmt) in claims:
            return fmt
        held = "a spectrain run directory" if ours else \
            f"claimed by {', '.join(claims)}" if claims else "claimed by no registered format"
        raise SpectrainError(f"{path} is not in format {fmt} ({held})")
    if len(claims) == 1:
        return claims[0]
    if claims:
        raise SpectrainError(f"{path}/config.json is claimed by {len(claims)} formats ({', '.join(claims)}); "
                             f"spectrain does not guess: say which with {SAY_FORMAT}")
    if config.get("speculators_model_type"):
        raise SpectrainError(f"{path}: speculators model type {config['speculators_model_type']!r} is not "
                             f"supported (no registered format reads it; registered: {', '.join(FORMATS)})")
    raise SpectrainError(f"{path}/config.json is not a drafter format spectrain knows ({', '.join(FORMATS)})")


def import_drafter(path: str | Path, verifier_model=None, return_names: bool = False, fmt: str | None = None):
    """Load a drafter of any supported format (ours or an engine's) as its family's drafter module.

    ``verifier_model`` supplies what foreign checkpoints leave out (the verifier's depth, its shared
    ``lm_head``) and is checked for compatibility. With ``return_names`` also returns the set of tensor
    names read (every tensor of the file: unknown names are an error). ``fmt`` names the format where
    :func:`detect_format` cannot tell (several formats claim the directory).
    """
    path = Path(path)
    fmt = detect_format(path, fmt)
    if fmt == OUR_FORMAT:
        raw = read_json(path / "config.json", "drafter config")
        family = family_for_method(raw["method"], f"{path}/config.json")  # unknown: refused, never another family's
        drafter = family.from_pretrained(path, verifier_model)
        names = set(_header(path / "model.safetensors"))
        return (drafter, names) if return_names else drafter
    config = read_json(path / "config.json", f"{fmt} config")
    validate_export(path, fmt)  # the same strict check as on export: every name known, every shape right
    tensors = load_tensors(path / weights_file(fmt))
    names = set(tensors)
    ours = config.get("spectrain") or {}
    drafter = serving_format(fmt).load(fmt, config, tensors, ours, verifier_model, path)
    return (drafter, names) if return_names else drafter


def recorded_verifier(path: str | Path, fmt: str | None = None) -> dict:
    """What the drafter in ``path`` (a run dir or any export) records about its verifier: ``{"name": str,
    "signature": {field: value or None}}`` over :data:`~.verifier.SIGNATURE_FIELDS`.

    ``verifier_signature.json`` beside the weights (ours) gives every field; otherwise what the format's config
    holds: the sizes (vocabulary, width, and for ours the verifier's depth) and, from a speculators config, the
    verifier's architecture (``speculators_config.verifier.architectures``). Our run-dir format records the
    verifier's depth under its family's ``verifier_depth_key`` (none for a family that does not record it)."""
    path = Path(path)
    fmt = detect_format(path, fmt)
    config = read_json(path / "config.json", "drafter config")
    ours = config.get("spectrain") or {}
    signature = dict.fromkeys(SIGNATURE_FIELDS)
    if fmt == OUR_FORMAT:
        name = config.get("verifier", "")
        key = family_for_method(config.get("method"), f"{path}/config.json").verifier_depth_key
        depth = config.get(key) if key else None
        signature.update(vocab_size=config.get("vocab_size"), hidden_size=config.get("hidden_size"),
                         num_hidden_layers=depth)
    elif "speculators_config" in config:  # any speculators layout, whichever family
        layer = config.get("transformer_layer_config") or {}
        verifier = (config.get("speculators_config") or {}).get("verifier") or {}
        name = ours.get("verifier") or verifier.get("name_or_path") or ""
        signature.update(architecture=(verifier.get("architectures") or [None])[0], vocab_size=layer.get("vocab_size"),
                         hidden_size=config.get("target_hidden_size") or layer.get("hidden_size"),
                         num_hidden_layers=ours.get("verifier_num_hidden_layers"))
    else:
        name = ours.get("verifier") or config.get("base_model_name_or_path") or ""
        signature.update(vocab_size=config.get("vocab_size"),
                         hidden_size=config.get("target_hidden_size") or config.get("hidden_size"),
                         num_hidden_layers=ours.get("verifier_num_hidden_layers"))
    written = ours.get("verifier_signature") or {}
    signature.update({k: v for k, v in written.items() if k in signature and v is not None})
    stored = load_verifier_signature(path)
    if stored is not None:
        signature.update({k: v for k, v in stored.items() if v is not None})
    return {"name": name or "", "signature": signature}
