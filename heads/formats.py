"""Serving-engine checkpoint formats: export our drafters, import anyone's.

Formats (``FORMATS``), with the engine loaders they were read from (vLLM 0.32, SGLang, TensorRT-LLM):

* ``vllm-medusa`` — vLLM ``Medusa`` (``model_type: medusa``): ``blocks.{k}.layers.{l}.weight|bias``
  (``medusa_fc_bias: true``), ``lm_heads.{k}.weight`` or one ``lm_head.weight`` with ``original_lm_head``.
* ``medusa`` — FasterDecoding / TensorRT-LLM: ``config.json`` (``medusa_num_heads``, ``medusa_num_layers``,
  ``base_model_name_or_path``) and ``medusa_lm_head.safetensors`` with ``{k}.{l}.linear.weight|bias`` and
  ``{k}.{L}.weight`` (L = number of layers). vLLM reads this layout too.
* ``eagle`` — EAGLE-1 as vLLM loads it: a one-layer ``LlamaForCausalLM`` config (vLLM renames it
  ``EagleLlamaForCausalLM``); ``fc.weight`` (h, 2h), ``layers.0.*`` without ``input_layernorm``; embeddings and
  ``lm_head`` come from the verifier.
* ``eagle-sglang`` — EAGLE-1 as SGLang loads it: the same, with ``architectures: ["LlamaForCausalLMEagle"]`` and
  an all-zero ``fc.bias`` (SGLang's ``fc`` has a bias and would otherwise start from uninitialized memory). A
  drafter with a ranked vocabulary also gets ``token_map.pt``, SGLang's ``--speculative-token-map`` (a
  ``torch.save``d (N,) int64 tensor of hot token ids: its draft head is the verifier ``lm_head``'s rows of them),
  declared in ``config.json``'s ``spectrain.token_map`` and checked by :func:`validate_export`. vLLM and
  TensorRT-LLM serve the full head of the EAGLE-1 and Medusa exports.
* ``eagle3`` — EAGLE-3 (``LlamaForCausalLMEagle3``; SpecForge's layout): ``fc.weight`` (h, n*h), ``midlayer.*``
  (q/k/v take 2h inputs, plus ``hidden_norm``), ``norm.weight``, ``lm_head.weight`` (D, h), ``d2t``, ``t2d``
  (optional for D = V), optionally the frozen ``embed_tokens.weight`` (V, h). speculators' norm variant is
  refused here on export (SGLang's loader has none of its norms and skips unknown weights); on import
  ``norm_before_residual`` / ``norm_before_fc`` (``input_norm.weight``) are read as vLLM reads them, and a
  ``norm_output`` key is refused: SpecForge and vLLM give it opposite meanings.
* ``speculators`` — vLLM ``speculators`` EAGLE-3: ``speculators_model_type: eagle3``,
  ``transformer_layer_config``, ``speculators_config``; weights ``fc``, ``layers.0.*``, ``norm``, ``lm_head``,
  ``d2t``, ``t2d`` (none for D = V), ``input_norm`` with ``norm_before_fc``, optionally ``embed_tokens``. The norm
  variant (``norm_before_residual``, ``norm_before_fc``, ``norm_output``: speculators' training default, all on)
  round-trips; a draft layer trained with a sliding window imports with a warning (spectrain attends to all).

Beside the weights an export may carry ``vocab_ranking.json`` (the drafter's training token counts: our
evaluator's ranked heads) and ``verifier_signature.json`` (:func:`recorded_verifier`: the verifier matched by
architecture, sizes, depth and tokenizer, not by name).

Every export is checked against what the engine's loader expects *from the written config alone*
(:func:`validate_export`: every tensor name and shape, nothing missing, nothing extra), because vLLM
loads a drafter with a missing norm or silently dropped biases without a word.

Layer ids: ours are HF ``hidden_states`` indices. vLLM's ``eagle_aux_hidden_state_layer_ids`` use the
same numbering for ids < N (id k = output of decoder layer k, 1-based), but id N there is the last layer's
output *before* the final norm, while HF's ``hidden_states[N]`` is after it: a drafter trained on id N
cannot be exported (clear error). The engines capture their layers in ascending order, so ids must be ascending
and distinct (:func:`~.eagle.check_aux_layer_order`, EagleConfig's rule), checked again on export and by
:func:`validate_export`.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from pathlib import Path

import torch
from safetensors import safe_open

from .eagle import EagleConfig, EagleDrafter, check_aux_layer_order, check_vocab_map
from .errors import SpectrainError
from .families import ServingFormat, family_for_method, resolve, serving_format, serving_formats
from .families import method_of as family_method
from .io import atomic_dir, atomic_path, load_tensors, read_json, save_tensors, write_json
from .medusa import MedusaConfig, MedusaHeads, check_compatible
from .verifier import SIGNATURE_FIELDS, load_verifier_signature, save_verifier_signature
from .vocab import Ranking, save_ranking


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
_LAYER_TENSORS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                  "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")


def weights_file(fmt: str) -> str:
    return serving_format(fmt).weights_file


# -- what each engine expects, computed from a written config alone ---------------------------------------
def expected_tensors(fmt: str, config: dict) -> dict[str, tuple[int, ...]]:
    """Tensor name -> shape that ``fmt``'s engine loader reads for this ``config.json``.

    This is the engine's view (its config keys and its parameter names), not ours, so it catches an
    export whose config and weights disagree.
    """
    expected = resolve(serving_format(fmt).expected)
    try:
        return expected(fmt, config)
    except KeyError as e:
        raise SpectrainError(f"{fmt} config.json lacks the key {e.args[0]!r} its engine reads") from None


def _medusa_expected_tensors(fmt: str, config: dict) -> dict[str, tuple[int, ...]]:
    """vllm-medusa / medusa: :func:`expected_tensors`."""
    if fmt == "vllm-medusa":
        return _medusa_expected(config["num_heads"], config["num_hidden_layers"], config["hidden_size"],
                                config["vocab_size"], "blocks.{k}.layers.{l}.",
                                None if config.get("original_lm_head") else "lm_heads.{k}.weight",
                                bias=bool(config.get("medusa_fc_bias", False)))
    if fmt == "medusa":
        L = config["medusa_num_layers"]
        return _medusa_expected(config["medusa_num_heads"], L, config["hidden_size"], config["vocab_size"],
                                "{k}.{l}.linear.", "{k}." + str(L) + ".weight", bias=True)
    raise SpectrainError(f"{fmt} is not a Medusa format")


def _eagle_expected_tensors(fmt: str, config: dict) -> dict[str, tuple[int, ...]]:
    """eagle / eagle-sglang / eagle3 / speculators: :func:`expected_tensors`."""
    if fmt in ("eagle", "eagle-sglang"):
        out = _eagle_layer_expected(config, "layers.0.", 2 * config["hidden_size"], eagle3=False)
        if fmt == "eagle-sglang":
            out["fc.bias"] = (config["hidden_size"],)
        return out
    if fmt in ("eagle3", "speculators"):
        layer = _eagle3_layer_config(fmt, config)
        out = _eagle_layer_expected(layer, "midlayer." if fmt == "eagle3" else "layers.0.",
                                    _aux_count(config) * _target_hidden(layer), eagle3=True)
        flags = eagle3_norm_flags(fmt, config)
        if flags["norm_before_fc"]:  # vLLM / speculators: one RMSNorm over the concatenated aux states
            out["input_norm.weight"] = (_aux_count(config) * _target_hidden(layer),)
        if flags["fc_norm"]:  # one RMSNorm per aux state (the engines read them; spectrain's import refuses them)
            out.update({f"fc_norm.{i}.weight": (_target_hidden(layer),) for i in range(_aux_count(config))})
        if layer.get("draft_vocab_size") in (None, layer["vocab_size"]):
            # a full draft vocabulary needs no map: speculators writes none, vLLM and SGLang load without one
            out.pop("d2t")
            out.pop("t2d")
        return out
    raise SpectrainError(f"{fmt} is not an EAGLE format")


def _eagle_optional_tensors(fmt: str, config: dict) -> dict[str, tuple[int, ...]]:
    """Tensors an EAGLE-3 engine loader accepts but does not need: the frozen verifier embedding speculators and
    SpecForge checkpoints carry (vLLM loads it, SGLang skips it; spectrain uses the verifier's own), and a map of
    a full draft vocabulary."""
    if fmt not in ("eagle3", "speculators"):
        return {}
    layer = _eagle3_layer_config(fmt, config)
    V = layer["vocab_size"]
    out = {"embed_tokens.weight": (V, layer["hidden_size"])}
    if layer.get("draft_vocab_size") in (None, V):
        out.update({"d2t": (V,), "t2d": (V,)})
    return out


def _eagle3_layer_config(fmt: str, config: dict) -> dict:
    """The drafter layer's config of an eagle3 / speculators ``config.json``, with the draft vocabulary and the
    verifier width the engines read."""
    if fmt == "eagle3":
        return config
    layer = dict(config["transformer_layer_config"])
    layer["draft_vocab_size"] = config["draft_vocab_size"]
    layer["target_hidden_size"] = config.get("target_hidden_size")
    return layer


def eagle3_norm_flags(fmt: str, config: dict) -> dict:
    """The EAGLE-3 norm variant an engine reads from a ``config.json``: ``norm_before_residual``,
    ``norm_before_fc``, ``fc_norm``, ``norm_output`` (booleans; ``norm_output`` in the eagle3 format is the string
    ``"ambiguous"`` when the key is there at all, see :func:`_import_eagle`).

    speculators: the top-level keys, as vLLM's ``update_eagle3`` copies them (``norm_before_residual`` defaults
    to *true* there when absent). eagle3 (``LlamaForCausalLMEagle3``): vLLM's ``llama_eagle3.py`` reads
    ``norm_before_residual`` and ``fc_norm`` at the top level and ``norm_before_fc`` from ``eagle_config`` or the
    top level; ``norm_output`` means two different things there (SpecForge: true = the final norm before
    ``lm_head``, the standard; vLLM: true = the normed output is fed back)."""
    if fmt == "speculators":
        return {"norm_before_residual": bool(config.get("norm_before_residual", True)),
                "norm_before_fc": bool(config.get("norm_before_fc", False)),
                "fc_norm": bool(config.get("fc_norm", False)),
                "norm_output": bool(config.get("norm_output", False))}
    nested = config.get("eagle_config") or {}
    return {"norm_before_residual": bool(config.get("norm_before_residual", False)),
            "norm_before_fc": bool(nested.get("norm_before_fc", config.get("norm_before_fc", False))),
            "fc_norm": bool(config.get("fc_norm", False)),
            "norm_output": "ambiguous" if "norm_output" in config else False}


def _medusa_expected(K, L, h, V, block, lm_head, bias):
    out = {}
    for k in range(K):
        for l in range(L):
            prefix = block.format(k=k, l=l)
            out[prefix + "weight"] = (h, h)
            if bias:
                out[prefix + "bias"] = (h,)
        if lm_head is not None:
            out[lm_head.format(k=k)] = (V, h)
    if lm_head is None:
        out["lm_head.weight"] = (V, h)
    return out


def _target_hidden(config: dict) -> int:
    return config.get("target_hidden_size") or config["hidden_size"]


def _aux_count(config: dict) -> int:
    """How many verifier states ``fc`` fuses, as the engines count them (3 when the config names none)."""
    ids = config.get("eagle_aux_hidden_state_layer_ids") or (config.get("eagle_config") or {}).get(
        "eagle_aux_hidden_state_layer_ids")
    return len(ids) if ids else 3


def _import_aux_ids(config: dict, verifier_layers: int) -> list[int]:
    """Our HF hidden_states indices from an engine config: vLLM's top-level ids are the same numbers; SGLang's
    ``eagle_config`` ids are one less; with neither, both engines fuse [2, N//2, N-3]."""
    if config.get("eagle_aux_hidden_state_layer_ids"):
        return list(config["eagle_aux_hidden_state_layer_ids"])
    nested = (config.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    if nested:
        return [i + 1 for i in nested]
    if verifier_layers < 7:
        raise SpectrainError(f"the EAGLE-3 config names no aux layers and the verifier has {verifier_layers} < 7 "
                             "layers, where the engines' default [2, N//2, N-3] is not defined")
    return [2, verifier_layers // 2, verifier_layers - 3]


def _eagle_layer_expected(config: dict, prefix: str, fc_in: int, eagle3: bool) -> dict[str, tuple[int, ...]]:
    h, I = config["hidden_size"], config["intermediate_size"]
    heads, kv = config["num_attention_heads"], config.get("num_key_value_heads") or config["num_attention_heads"]
    d = config.get("head_dim") or h // heads
    attn_in = 2 * h if eagle3 else h
    shapes = {"self_attn.q_proj": (heads * d, attn_in), "self_attn.k_proj": (kv * d, attn_in),
              "self_attn.v_proj": (kv * d, attn_in), "self_attn.o_proj": (h, heads * d),
              "mlp.gate_proj": (I, h), "mlp.up_proj": (I, h), "mlp.down_proj": (h, I)}
    out = {"fc.weight": (h, fc_in)}
    out.update({f"{prefix}{name}.weight": shape for name, shape in shapes.items()})
    out[f"{prefix}post_attention_layernorm.weight"] = (h,)
    if eagle3:
        D = config.get("draft_vocab_size") or config["vocab_size"]
        out.update({f"{prefix}input_layernorm.weight": (h,), f"{prefix}hidden_norm.weight": (h,),
                    "norm.weight": (h,), "lm_head.weight": (D, h), "d2t": (D,), "t2d": (config["vocab_size"],)})
    return out


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
    ``embed_tokens.weight`` in an EAGLE-3 checkpoint) may be there, with the right shape. A ``token_map.pt``
    (SGLang's ``--speculative-token-map``) beside the weights is checked too (:func:`check_token_map`)."""
    path = Path(path)
    config = read_json(path / "config.json", f"{fmt} config")
    expected = expected_tensors(fmt, config)
    try:
        optional = _eagle_optional_tensors(fmt, config)
    except KeyError as e:
        raise SpectrainError(f"{fmt} config.json lacks the key {e.args[0]!r} its engine reads") from None
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
    if fmt in ("eagle3", "speculators") and not problems and ("d2t" in found) != ("t2d" in found):
        problems.append("d2t and t2d come together or not at all")
    if fmt in ("eagle3", "speculators") and not problems and "d2t" in found:
        if found["d2t"][1] != "I64" or found["t2d"][1] != "BOOL":
            problems.append(f"d2t must be int64 and t2d bool, got {found['d2t'][1]} and {found['t2d'][1]}")
    if fmt in ("eagle3", "speculators"):
        nested = (config.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
        try:  # the ids the engines read (vLLM's top-level, SGLang's nested): layers are captured in ascending order
            check_aux_layer_order(config.get("eagle_aux_hidden_state_layer_ids") or [], "eagle_aux_hidden_state_layer_ids")
            check_aux_layer_order(nested or [], "eagle_config.eagle_aux_hidden_state_layer_ids")
        except SpectrainError as err:
            problems.append(str(err))
    if fmt == "vllm-medusa" and config.get("truncated_vocab_size", config["vocab_size"]) != config["vocab_size"]:
        problems.append("truncated_vocab_size differs from vocab_size without a token_map")
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
    """The method a drafter records (``medusa``, ``eagle1``, ...); an unregistered drafter class is refused."""
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
    return resolve(serving_format(fmt).export)(drafter, fmt, verifier_lm_head, verifier_name, speculative_tokens, notes)


def _export_medusa(heads: MedusaHeads, fmt, verifier_lm_head, verifier_name, notes):
    c = heads.config
    if c.lm_head_bias:
        raise SpectrainError(f"these Medusa heads have lm_head biases (the verifier's lm_head has one); {fmt} "
                             "engines load bias-free heads only")
    state = heads.state_dict()
    shared = c.shared_lm_head
    if shared and verifier_lm_head is None:
        raise SpectrainError("these Medusa heads share the verifier's lm_head: the export needs the verifier "
                             "to write it (pass --verifier)")
    lm_weight = verifier_lm_head.weight.detach() if shared else None
    tensors = {}
    name = verifier_name or c.verifier
    if fmt == "vllm-medusa":
        for k in range(c.num_heads):
            for l in range(c.num_layers):
                for p in ("weight", "bias"):
                    tensors[f"blocks.{k}.layers.{l}.{p}"] = state[f"blocks.{k}.{l}.linear.{p}"]
            if not shared:
                tensors[f"lm_heads.{k}.weight"] = state[f"lm_heads.{k}.weight"]
        if shared:
            tensors["lm_head.weight"] = lm_weight
        config = {"architectures": ["MedusaModel"], "model_type": "medusa", "num_heads": c.num_heads,
                  "num_hidden_layers": c.num_layers, "hidden_size": c.hidden_size, "vocab_size": c.vocab_size,
                  "truncated_vocab_size": c.vocab_size, "medusa_fc_bias": True, "original_lm_head": shared,
                  "base_model_name_or_path": name}
    else:
        if shared:
            notes.append(f"{fmt}: FasterDecoding / TensorRT-LLM need one lm_head per head; the verifier's shared "
                         f"lm_head was copied into each of the {c.num_heads} heads")
        if c.num_layers > 1:
            notes.append(f"{fmt}: FasterDecoding builds its ResBlocks as one shared module per head; with "
                         f"{c.num_layers} distinct layers per head only TensorRT-LLM and vLLM load them exactly")
        for k in range(c.num_heads):
            for l in range(c.num_layers):
                for p in ("weight", "bias"):
                    tensors[f"{k}.{l}.linear.{p}"] = state[f"blocks.{k}.{l}.linear.{p}"]
            # .clone(): a copy per head (safetensors refuses tensors that share memory)
            tensors[f"{k}.{c.num_layers}.weight"] = lm_weight.clone() if shared else state[f"lm_heads.{k}.weight"]
        config = {"medusa_num_heads": c.num_heads, "medusa_num_layers": c.num_layers,
                  "base_model_name_or_path": name, "hidden_size": c.hidden_size, "vocab_size": c.vocab_size}
    config["spectrain"] = {"method": "medusa", "verifier": c.verifier, "shared_lm_head": shared}
    return config, tensors


def _check_eagle_exportable(c: EagleConfig, fmt: str) -> None:
    # EagleConfig refuses ids out of order; a config edited after it was built is checked again here, because
    # the engines capture their layers in ascending order whatever the config lists.
    check_aux_layer_order(c.aux_layer_ids or [], f"this EAGLE-3 drafter's aux_layer_ids (exporting {fmt})")
    if c.num_hidden_layers in (c.aux_layer_ids or []):
        raise SpectrainError(
            f"this EAGLE-3 drafter fuses hidden_states[{c.num_hidden_layers}] (the verifier's final, normed "
            f"output, layers {c.aux_layer_ids}); {fmt} engines capture layer outputs before the final norm, so "
            f"they cannot feed it: retrain with --model.aux_layer_ids below {c.num_hidden_layers}")


def _llama_config(c: EagleConfig, draft_vocab: int | None) -> dict:
    """The drafter's own one-layer Llama config (default RoPE with the verifier's theta, as trained)."""
    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": c.hidden_size,
           "intermediate_size": c.intermediate_size, "num_attention_heads": c.num_heads,
           "num_key_value_heads": c.num_kv_heads, "head_dim": c.head_dim, "num_hidden_layers": 1,
           "rms_norm_eps": c.rms_norm_eps, "rope_theta": c.rope_theta, "rope_scaling": None,
           "max_position_embeddings": c.max_position_embeddings, "vocab_size": c.vocab_size,
           "hidden_act": "silu", "attention_bias": False, "mlp_bias": False, "tie_word_embeddings": False,
           "bos_token_id": None, "eos_token_id": None, "pad_token_id": None}
    if draft_vocab is not None:
        cfg["draft_vocab_size"] = draft_vocab
    return cfg


def _export_eagle(drafter: EagleDrafter, fmt, verifier_name, speculative_tokens, notes: list[str] | None = None):
    c = drafter.config
    notes = notes if notes is not None else []
    if fmt == "eagle3" and c.norm_flags:
        # vLLM's llama_eagle3.py reads the three flags, but SGLang's LlamaForCausalLMEagle3 (its
        # python/sglang/srt/models/llama_eagle3.py) has none of these norms and skips weights it does not know:
        # it would load this drafter without them and draft something else, without a word.
        raise SpectrainError(
            f"this EAGLE-3 drafter has {', '.join(c.norm_flags)} on (speculators' norm variant), which the eagle3 "
            "format (LlamaForCausalLMEagle3) cannot carry to SGLang: its loader has no such norms and would "
            "silently draft without them; export --format speculators (vLLM reads the variant there)")
    state = drafter.state_dict()
    ours = {"method": c.variant, "verifier": c.verifier, "verifier_num_hidden_layers": c.num_hidden_layers,
            "aux_layer_ids": list(c.aux_layer_ids or [])}
    if fmt in ("eagle", "eagle-sglang"):
        tensors = {("layers.0." + k[len("layer."):] if k.startswith("layer.") else k): v for k, v in state.items()}
        config = _llama_config(c, None)
        if fmt == "eagle-sglang":
            config["architectures"] = ["LlamaForCausalLMEagle"]
            tensors["fc.bias"] = state["fc.weight"].new_zeros(c.hidden_size)
    else:
        _check_eagle_exportable(c, fmt)
        prefix = "midlayer." if fmt == "eagle3" else "layers.0."
        tensors = {(prefix + k[len("layer."):] if k.startswith("layer.") else k): v for k, v in state.items()}
        tensors["d2t"], tensors["t2d"] = state["d2t"].to(torch.int64), state["t2d"].to(torch.bool)
        aux = list(c.aux_layer_ids)
        if fmt == "eagle3":
            config = _llama_config(c, c.draft_vocab_size)
            config["architectures"] = ["LlamaForCausalLMEagle3"]
            # vLLM reads the top-level ids (id k = output of decoder layer k, 1-based = HF hidden_states[k]);
            # SGLang reads only eagle_config's and adds 1 (id k = output of layer k, 0-based): one less.
            config.update({"target_hidden_size": c.hidden_size, "norm_before_residual": False,
                           "eagle_aux_hidden_state_layer_ids": aux,
                           "eagle_config": {"eagle_aux_hidden_state_layer_ids": [i - 1 for i in aux],
                                            "use_aux_hidden_state": True}})
        else:
            layer = _llama_config(c, None)
            config = {"architectures": ["Eagle3Speculator"], "speculators_model_type": "eagle3",
                      "transformer_layer_config": layer, "draft_vocab_size": c.draft_vocab_size,
                      "target_hidden_size": c.hidden_size,
                      # vLLM's update_eagle3 copies these four (norm_before_residual: true when absent)
                      "norm_before_residual": c.norm_before_residual, "norm_before_fc": c.norm_before_fc,
                      "fc_norm": False, "norm_output": c.norm_output,
                      "eagle_aux_hidden_state_layer_ids": aux,
                      "speculators_config": {
                          "algorithm": "eagle3", "default_proposal_method": "greedy",
                          "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": speculative_tokens or 3,
                                                "verifier_accept_k": 1, "accept_tolerance": 0.0}],
                          "verifier": {"name_or_path": verifier_name or c.verifier,
                                       "architectures": ["LlamaForCausalLM"]}},
                      "speculators_version": "0.3.0"}
            if c.norm_before_fc or c.norm_output:
                notes.append(f"{fmt}: norm_before_fc / norm_output need a vLLM whose speculators config reader "
                             "(update_eagle3) copies them; older ones copy norm_before_residual alone and skip "
                             "input_norm.weight without a word")
    config["spectrain"] = ours
    return config, tensors


def export_drafter(drafter, fmt: str, out_dir: str | Path, verifier_lm_head=None, verifier_name: str = "",
                   force: bool = False, dtype: torch.dtype | None = None, speculative_tokens: int | None = None,
                   notes: list[str] | None = None, ranking: Ranking | None = None,
                   verifier_signature: dict | None = None) -> Path:
    """Write ``drafter`` in ``fmt`` to ``out_dir`` atomically, validated before it appears.

    Floating tensors are cast to ``dtype`` (default: as trained); ``d2t``/``t2d`` keep their integer/bool types.
    Refuses an existing ``out_dir`` unless ``force``; on any error nothing is left behind. ``ranking`` (the
    drafter's ``vocab_ranking.json``, :func:`~.vocab.load_ranking`) is copied beside the weights, and for
    ``eagle-sglang`` becomes SGLang's token map (:func:`write_token_map`); ``verifier_signature``
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


# -- what an export carries beside the weights: vocabulary ranking, SGLang token map, verifier signature ------
TOKEN_MAP_FILE = "token_map.pt"  # SGLang: --speculative-token-map DIR/token_map.pt


def _export_extras(drafter, fmt: str, config: dict, ranking: Ranking | None, signature: dict | None,
                   notes: list[str]) -> list:
    """Writers (each ``fn(directory)``) of the files an export carries beside its weights, and what ``config``
    and ``notes`` say about them."""
    writers = []
    method = method_of(drafter)
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
    ids = ranking.ids()  # the drafter's default ranked head; None = it trained over the full vocabulary
    if method == "eagle1" and fmt == "eagle-sglang":
        if ids is None:
            notes.append(f"{fmt}: the drafter trained over the full vocabulary: no token map (SGLang drafts over "
                         "all of it)")
        else:
            config.setdefault("spectrain", {})["token_map"] = {"file": TOKEN_MAP_FILE, "tokens": ids.numel(),
                                                               "source": ranking.source}
            writers.append(lambda d: write_token_map(d / TOKEN_MAP_FILE, ids))
            notes.append(f"{fmt}: SGLang drafts over the {ids.numel()} most frequent training tokens with "
                         f"--speculative-token-map {{export}}/{TOKEN_MAP_FILE} (without it, the full head)")
    elif ids is not None and method in ("eagle1", "medusa"):
        engines = {"eagle": "vLLM serves", "vllm-medusa": "vLLM serves"}.get(fmt, "TensorRT-LLM and vLLM serve")
        notes.append(f"{fmt}: {engines} this export's full head over all {drafter.config.vocab_size} tokens; the "
                     f"ranked {ids.numel()}-token head is spectrain-eval's (vocab_ranking.json is copied beside the "
                     "weights)" + ("; SGLang's token map: export --format eagle-sglang" if method == "eagle1" else ""))
    return writers


def verifier_name_of(drafter) -> str:
    return getattr(drafter.config, "verifier", "") or ""


def write_token_map(path: str | Path, ids: torch.Tensor) -> Path:
    """SGLang's ``--speculative-token-map`` file: ``torch.save`` of the (N,) int64 hot token ids, atomically.

    SGLang reads it with ``torch.load(path, weights_only=True)`` and ``torch.tensor(..., dtype=int64)``
    (``load_token_map`` in ``python/sglang/srt/speculative/``); its draft head is the verifier's ``lm_head``
    rows of these ids, in this order."""
    ids = torch.as_tensor(ids).to(torch.int64).flatten().contiguous()
    with atomic_path(path) as tmp:
        torch.save(ids, tmp)
    return Path(path)


def check_token_map(path: str | Path, config: dict, declared: dict | None = None) -> torch.Tensor:
    """Read and check the token map of the export in ``path``: a 1-D int64 tensor (or a list of ints) of
    distinct ids in the verifier's vocabulary (``config["vocab_size"]``), as many as ``declared["tokens"]``
    when the config declares it. Returns the (N,) int64 ids."""
    path = Path(path)
    file = path / str((declared or {}).get("file") or TOKEN_MAP_FILE)
    if not file.is_file():
        raise SpectrainError(f"token map {file} is missing (config.json declares one)")
    try:
        raw = torch.load(file, map_location="cpu", weights_only=True)
    except Exception as e:  # a truncated or foreign file: torch raises several types
        raise SpectrainError(f"token map {file} is not readable with torch.load(weights_only=True): "
                             f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}") from None
    if isinstance(raw, list) and all(isinstance(i, int) and not isinstance(i, bool) for i in raw):
        raw = torch.tensor(raw, dtype=torch.int64)
    if not isinstance(raw, torch.Tensor) or raw.dtype != torch.int64 or raw.ndim != 1 or raw.numel() == 0:
        what = (f"{raw.dtype} tensor of shape {tuple(raw.shape)}" if isinstance(raw, torch.Tensor)
                else type(raw).__name__)
        raise SpectrainError(f"token map {file} must hold a non-empty 1-D int64 tensor of token ids, got {what}")
    vocab = config.get("vocab_size")
    if vocab is not None and (int(raw.min()) < 0 or int(raw.max()) >= vocab):
        raise SpectrainError(f"token map {file} has ids outside the verifier's vocabulary [0, {vocab}): "
                             f"{int(raw.min())}..{int(raw.max())}")
    if raw.unique().numel() != raw.numel():
        raise SpectrainError(f"token map {file} repeats {raw.numel() - raw.unique().numel()} token ids")
    if declared is not None and declared.get("tokens") is not None and raw.numel() != declared["tokens"]:
        raise SpectrainError(f"token map {file} holds {raw.numel()} ids, config.json declares {declared['tokens']}")
    return raw


# -- import -----------------------------------------------------------------------------------------------------
def detect_format(path: str | Path) -> str:
    """``spectrain`` (our own run/drafter directory) or one of :data:`FORMATS`, from config.json."""
    path = Path(path)
    if (path / "medusa_lm_head.pt").is_file() and not (path / "medusa_lm_head.safetensors").is_file():
        raise SpectrainError(f"{path}/medusa_lm_head.pt is a pickle; spectrain loads safetensors only — convert it "
                             "(safetensors.torch.save_file) to medusa_lm_head.safetensors")
    config = read_json(path / "config.json", "drafter config")
    if "method" in config and "format_version" in config:  # ours; import_drafter finds the family of its method
        return "spectrain"
    for spec in serving_formats().values():  # every registered format, in registration order
        if resolve(spec.detect)(config):
            return spec.name
    if config.get("speculators_model_type"):
        raise SpectrainError(f"{path}: speculators model type {config['speculators_model_type']!r} is not "
                             "supported (no registered format reads it; the speculators format holds eagle3)")
    raise SpectrainError(f"{path}/config.json is not a drafter format spectrain knows ({', '.join(FORMATS)})")


def import_drafter(path: str | Path, verifier_model=None, return_names: bool = False):
    """Load a drafter of any supported format (ours or an engine's) as MedusaHeads / EagleDrafter.

    ``verifier_model`` supplies what foreign checkpoints leave out (the verifier's depth, its shared
    ``lm_head``) and is checked for compatibility. With ``return_names`` also returns the set of tensor
    names read (every tensor of the file: unknown names are an error).
    """
    path = Path(path)
    fmt = detect_format(path)
    if fmt == "spectrain":
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
    drafter = resolve(serving_format(fmt).load)(fmt, config, tensors, ours, verifier_model, path)
    return (drafter, names) if return_names else drafter


def _import_medusa(fmt, config, tensors, ours, verifier_model, path):
    if fmt == "vllm-medusa":
        K, L, shared_flag = config["num_heads"], config["num_hidden_layers"], bool(config.get("original_lm_head"))
        block = "blocks.{k}.layers.{l}."
        if not config.get("medusa_fc_bias", False):  # bias-free ResBlocks are ours with zero biases
            for k in range(K):
                for l in range(L):
                    w = tensors[block.format(k=k, l=l) + "weight"]
                    tensors[block.format(k=k, l=l) + "bias"] = w.new_zeros(w.shape[0])
        head_weight = (lambda k: tensors["lm_head.weight"]) if shared_flag else (lambda k: tensors[f"lm_heads.{k}.weight"])
    else:
        K, L, shared_flag = config["medusa_num_heads"], config["medusa_num_layers"], False
        block = "{k}.{l}.linear."
        head_weight = lambda k: tensors[f"{k}.{L}.weight"]  # noqa: E731
    h, V = config["hidden_size"], config["vocab_size"]
    verifier_head = verifier_model.get_output_embeddings().weight if verifier_model is not None else None
    if verifier_model is not None:
        check_compatible(h, V, verifier_model, str(path))
    # Heads whose lm_head is exactly the verifier's (ours exported shared, or vLLM original_lm_head) become shared again.
    shared = bool(ours.get("shared_lm_head")) or shared_flag
    if shared and verifier_head is not None and not all(
            torch.equal(head_weight(k).to(verifier_head.dtype), verifier_head.detach().cpu()) for k in range(K)):
        shared = False
    if shared and verifier_head is None:
        shared = False  # keep the written lm_head: without the verifier we cannot prove they are the same
    config_ours = MedusaConfig(num_heads=K, num_layers=L, hidden_size=h, vocab_size=V, shared_lm_head=shared,
                               verifier=ours.get("verifier") or config.get("base_model_name_or_path", ""))
    heads = MedusaHeads(config_ours)
    state = {}
    for k in range(K):
        for l in range(L):
            for p in ("weight", "bias"):
                state[f"blocks.{k}.{l}.linear.{p}"] = tensors[block.format(k=k, l=l) + p]
        if not shared:
            state[f"lm_heads.{k}.weight"] = head_weight(k)
    heads.load_state_dict({k: v.float() for k, v in state.items()})
    return heads


def _import_eagle(fmt, config, tensors, ours, verifier_model, path):
    """An EAGLE drafter from an engine checkpoint (already :func:`validate_export`-ed: names and shapes).

    What the references ship is read as they ship it: speculators' norm variant (the three flags,
    :func:`eagle3_norm_flags`), the frozen verifier ``embed_tokens.weight`` (checked for shape, then dropped:
    the drafter always embeds with the verifier's own), no ``d2t``/``t2d`` for a full draft vocabulary, and
    SpecForge's ``midlayer.*`` layout with only SGLang's ``eagle_config`` layer ids (or none)."""
    layer_cfg = config["transformer_layer_config"] if fmt == "speculators" else config
    variant = "eagle1" if fmt in ("eagle", "eagle-sglang") else "eagle3"
    if fmt == "eagle-sglang":
        if torch.count_nonzero(tensors.pop("fc.bias")):
            raise SpectrainError(f"{path}: fc.bias is not zero; spectrain's EAGLE fc has no bias")
    if layer_cfg.get("attention_bias") or layer_cfg.get("mlp_bias"):
        raise SpectrainError(f"{path}: the drafter layer has attention/MLP biases; spectrain's EAGLE layer has none")
    flags = {}
    if variant == "eagle3":
        flags = _import_norm_flags(fmt, config, path)
        if layer_cfg.get("num_hidden_layers", 1) != 1:
            raise SpectrainError(f"{path}: the drafter has {layer_cfg['num_hidden_layers']} decoder layers; "
                                 "spectrain's EAGLE-3 drafter has one")
        if layer_cfg.get("model_type", "llama") not in ("llama", "mistral"):
            raise SpectrainError(f"{path}: the drafter layer is a {layer_cfg['model_type']!r} decoder layer; "
                                 "spectrain's EAGLE-3 layer is Llama's (a Qwen3 draft layer has q/k norms)")
        _warn_sliding_window(layer_cfg, path)
    embedding = tensors.pop("embed_tokens.weight", None)  # validate_export checked its (V, h) shape
    verifier_layers = ours.get("verifier_num_hidden_layers")
    if verifier_layers is None:
        if verifier_model is None:
            raise SpectrainError(f"{path} is a foreign {fmt} checkpoint: pass the verifier to import it")
        verifier_layers = verifier_model.config.num_hidden_layers
    h = layer_cfg["hidden_size"]
    if variant == "eagle3" and _target_hidden(_eagle3_layer_config(fmt, config)) != h:
        raise SpectrainError(f"{path}: target_hidden_size differs from the drafter's hidden size; spectrain's "
                             "drafters run at the verifier's width")
    rope = layer_cfg.get("rope_scaling") or layer_cfg.get("rope_parameters") or {}
    if (rope.get("rope_type") or rope.get("type") or "default") != "default":
        raise SpectrainError(f"{path}: rope scaling {rope} is not supported by spectrain's drafter (default RoPE)")
    theta = layer_cfg.get("rope_theta") or rope.get("rope_theta") or 10000.0
    ec = EagleConfig(
        variant=variant, hidden_size=h, vocab_size=layer_cfg["vocab_size"] if fmt != "eagle3" else config["vocab_size"],
        draft_vocab_size=None if variant == "eagle1" else config.get("draft_vocab_size") or config["vocab_size"],
        aux_layer_ids=_import_aux_ids(config, verifier_layers) if variant == "eagle3" else None, num_hidden_layers=verifier_layers,
        num_heads=layer_cfg["num_attention_heads"],
        num_kv_heads=layer_cfg.get("num_key_value_heads") or layer_cfg["num_attention_heads"],
        head_dim=layer_cfg.get("head_dim") or h // layer_cfg["num_attention_heads"],
        intermediate_size=layer_cfg["intermediate_size"], rms_norm_eps=float(layer_cfg.get("rms_norm_eps", 1e-6)),
        rope_theta=float(theta), max_position_embeddings=layer_cfg.get("max_position_embeddings", 2048),
        verifier=ours.get("verifier") or ((config.get("speculators_config") or {}).get("verifier") or {}).get(
            "name_or_path", "") or "", **flags)
    if verifier_model is not None:
        check_compatible(ec.hidden_size, ec.vocab_size, verifier_model, str(path))
        if verifier_model.config.num_hidden_layers != ec.num_hidden_layers:
            raise SpectrainError(f"{path} was trained on a {ec.num_hidden_layers}-layer verifier, this one has "
                                 f"{verifier_model.config.num_hidden_layers}")
        if embedding is not None:
            _check_embedding(embedding, verifier_model, path)
    drafter = EagleDrafter(ec)
    prefix = {"eagle": "layers.0.", "eagle-sglang": "layers.0.", "eagle3": "midlayer.", "speculators": "layers.0."}[fmt]
    state = {("layer." + k[len(prefix):] if k.startswith(prefix) else k): v for k, v in tensors.items()}
    if variant == "eagle3":
        if "d2t" not in state:  # a full draft vocabulary (validate_export allows no map only then): the identity
            state["d2t"] = torch.zeros(ec.draft_vocab_size, dtype=torch.int64)
            state["t2d"] = torch.ones(ec.vocab_size, dtype=torch.bool)
        check_vocab_map(state["d2t"], state["t2d"], ec.vocab_size, ec.draft_vocab_size)
    drafter.load_state_dict({k: v.float() if v.is_floating_point() else v for k, v in state.items()})
    return drafter


def recorded_verifier(path: str | Path) -> dict:
    """What the drafter in ``path`` (a run dir or any export) records about its verifier: ``{"name": str,
    "signature": {field: value or None}}`` over :data:`~.verifier.SIGNATURE_FIELDS`.

    ``verifier_signature.json`` beside the weights (ours) gives every field; otherwise what the format's config
    holds: the sizes (vocabulary, width, and for ours the verifier's depth) and, from a speculators config, the
    verifier's architecture (``speculators_config.verifier.architectures``)."""
    path = Path(path)
    fmt = detect_format(path)
    config = read_json(path / "config.json", "drafter config")
    ours = config.get("spectrain") or {}
    signature = dict.fromkeys(SIGNATURE_FIELDS)
    if fmt == "spectrain":
        name = config.get("verifier", "")
        # the verifier's depth: DFlash records it as verifier_layers (its num_hidden_layers is its own), EAGLE as
        # num_hidden_layers, Medusa not at all
        depth = config.get("verifier_layers", None if config.get("method") == "medusa" else config.get("num_hidden_layers"))
        signature.update(vocab_size=config.get("vocab_size"), hidden_size=config.get("hidden_size"),
                         num_hidden_layers=depth)
    elif "speculators_config" in config:  # any speculators layout (EAGLE-3, DFlash, DSpark)
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


def _import_norm_flags(fmt: str, config: dict, path) -> dict:
    """EagleConfig's variant flags from an EAGLE-3 config (:func:`eagle3_norm_flags`), refusing what spectrain's
    drafter cannot compute exactly."""
    flags = eagle3_norm_flags(fmt, config)
    if flags["fc_norm"]:
        raise SpectrainError(f"{path}: fc_norm (one RMSNorm per fused verifier layer, fc_norm.*.weight) is not "
                             "supported by spectrain's EAGLE-3 drafter; its norm variants are norm_before_residual, "
                             "norm_before_fc and norm_output")
    if flags["norm_output"] == "ambiguous":
        # SpecForge (specforge/modeling/draft/llama3_eagle.py): norm_output true = lm_head(norm(out)), the standard,
        # false = lm_head(out) with no final norm; vLLM's llama_eagle3.py: true = the normed output is what the
        # next draft step reads. The same key, two drafters: spectrain does not guess which one this is.
        raise SpectrainError(
            f"{path}: config.json has norm_output={config['norm_output']!r}, which LlamaForCausalLMEagle3 readers "
            "read two ways (SpecForge: true = the final norm before lm_head, the standard EAGLE-3; vLLM: true = "
            "each draft step reads the normed output of the one before); remove the key if the drafter was trained "
            "by SpecForge with norm_output true, or write it in the speculators format if it was trained with "
            "speculators' norm_output")
    return {k: flags[k] for k in ("norm_before_residual", "norm_before_fc", "norm_output")}


def _warn_sliding_window(layer_cfg: dict, path) -> None:
    """speculators (since 0.7) trains its draft layer with a sliding window (2048 by default); spectrain's layer
    attends to the whole context: the drafts are the same while the context fits in the window."""
    kinds = layer_cfg.get("layer_types") or []
    window = layer_cfg.get("sliding_window")
    if window and ("sliding_attention" in kinds or layer_cfg.get("use_sliding_window")):
        warnings.warn(f"{path}: the drafter layer was trained with a {window}-token sliding window; spectrain's "
                      f"attends to the whole context, so drafts equal the checkpoint's only up to {window} tokens "
                      "of context", stacklevel=4)


def _check_embedding(embedding: torch.Tensor, verifier_model, path) -> None:
    """A checkpoint's frozen copy of the verifier embedding, against the verifier's own: equal up to the dtype it
    was stored in, or a warning (another verifier, another revision) — the drafter embeds with the verifier's."""
    ours = verifier_model.get_input_embeddings().weight.detach().cpu()
    theirs = embedding.to(ours.dtype)
    if ours.shape != theirs.shape:
        raise SpectrainError(f"{path}: embed_tokens.weight is {tuple(theirs.shape)}, the verifier's embedding "
                             f"{tuple(ours.shape)}")
    if not torch.equal(ours.to(embedding.dtype).to(ours.dtype), theirs):
        diff = float((ours - theirs).abs().max())
        warnings.warn(f"{path}: embed_tokens.weight differs from this verifier's embedding (max |diff| {diff:.3g}); "
                      "the drafter was trained on another verifier's embeddings, and spectrain embeds with this "
                      "verifier's", stacklevel=4)


# -- the bundled families' formats (named by heads/medusa.py and heads/eagle.py's registrations) ---------------
def _export_medusa_format(drafter, fmt, verifier_lm_head, verifier_name, speculative_tokens, notes):
    return _export_medusa(drafter, fmt, verifier_lm_head, verifier_name, notes)


def _export_eagle_format(drafter, fmt, verifier_lm_head, verifier_name, speculative_tokens, notes):
    return _export_eagle(drafter, fmt, verifier_name, speculative_tokens, notes)


def _architectures(config: dict) -> list[str]:
    return list(config.get("architectures") or [])


MEDUSA_FORMATS = (
    ServingFormat("vllm-medusa", "vLLM Medusa (model_type medusa)", "medusa",
                  detect=lambda c: c.get("model_type") == "medusa" and "medusa_num_heads" not in c,
                  export=_export_medusa_format, load=_import_medusa, expected=_medusa_expected_tensors),
    ServingFormat("medusa", "FasterDecoding Medusa / TensorRT-LLM (medusa_lm_head.safetensors)", "medusa",
                  detect=lambda c: "medusa_num_heads" in c, export=_export_medusa_format, load=_import_medusa,
                  expected=_medusa_expected_tensors, weights_file="medusa_lm_head.safetensors"),
)
# Detection runs in this order: a speculators or EAGLE-3 config also has what the EAGLE-1 checks look for.
EAGLE_FORMATS = (
    ServingFormat("speculators", "EAGLE-3 in vLLM's speculators format", "eagle3",
                  detect=lambda c: c.get("speculators_model_type") == "eagle3",
                  export=_export_eagle_format, load=_import_eagle, expected=_eagle_expected_tensors),
    ServingFormat("eagle3", "EAGLE-3 for vLLM and SGLang (LlamaForCausalLMEagle3, midlayer)", "eagle3",
                  detect=lambda c: not c.get("speculators_model_type") and (
                      "Eagle3" in " ".join(_architectures(c)) or "eagle_aux_hidden_state_layer_ids" in c
                      or "draft_vocab_size" in c),
                  export=_export_eagle_format, load=_import_eagle, expected=_eagle_expected_tensors),
    ServingFormat("eagle-sglang", "EAGLE-1 for SGLang (LlamaForCausalLMEagle, fc with a zero bias)", "eagle1",
                  detect=lambda c: "LlamaForCausalLMEagle" in _architectures(c),
                  export=_export_eagle_format, load=_import_eagle, expected=_eagle_expected_tensors),
    ServingFormat("eagle", "EAGLE-1 for vLLM (fc + layers.0)", "eagle1",
                  detect=lambda c: c.get("model_type") == "llama" and c.get("num_hidden_layers") == 1,
                  export=_export_eagle_format, load=_import_eagle, expected=_eagle_expected_tensors),
)
