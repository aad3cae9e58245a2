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
  an all-zero ``fc.bias`` (SGLang's ``fc`` has a bias and would otherwise start from uninitialized memory).
* ``eagle3`` — EAGLE-3 (``LlamaForCausalLMEagle3``; SpecForge's layout): ``fc.weight`` (h, n*h), ``midlayer.*``
  (q/k/v take 2h inputs, plus ``hidden_norm``), ``norm.weight``, ``lm_head.weight`` (D, h), ``d2t``, ``t2d``.
* ``speculators`` — vLLM ``speculators`` EAGLE-3: ``speculators_model_type: eagle3``,
  ``transformer_layer_config``, ``speculators_config``; weights ``fc``, ``layers.0.*``, ``norm``, ``lm_head``,
  ``d2t``, ``t2d``.

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

from pathlib import Path

import torch
from safetensors import safe_open

from .eagle import EagleConfig, EagleDrafter, check_aux_layer_order, check_vocab_map
from .errors import SpectrainError
from .io import atomic_dir, load_tensors, read_json, save_tensors, write_json
from .medusa import MedusaConfig, MedusaHeads, check_compatible

FORMATS = {
    "vllm-medusa": "vLLM Medusa (model_type medusa)",
    "medusa": "FasterDecoding Medusa / TensorRT-LLM (medusa_lm_head.safetensors)",
    "eagle": "EAGLE-1 for vLLM (fc + layers.0)",
    "eagle-sglang": "EAGLE-1 for SGLang (LlamaForCausalLMEagle, fc with a zero bias)",
    "eagle3": "EAGLE-3 for vLLM and SGLang (LlamaForCausalLMEagle3, midlayer)",
    "speculators": "EAGLE-3 in vLLM's speculators format",
}
METHOD_OF = {"vllm-medusa": "medusa", "medusa": "medusa", "eagle": "eagle1", "eagle-sglang": "eagle1",
             "eagle3": "eagle3", "speculators": "eagle3"}
WEIGHTS_FILE = {"medusa": "medusa_lm_head.safetensors"}  # every other format: model.safetensors
_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}
_LAYER_TENSORS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                  "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")


def weights_file(fmt: str) -> str:
    return WEIGHTS_FILE.get(fmt, "model.safetensors")


# -- what each engine expects, computed from a written config alone ---------------------------------------
def expected_tensors(fmt: str, config: dict) -> dict[str, tuple[int, ...]]:
    """Tensor name -> shape that ``fmt``'s engine loader reads for this ``config.json``.

    This is the engine's view (its config keys and its parameter names), not ours, so it catches an
    export whose config and weights disagree.
    """
    try:
        if fmt == "vllm-medusa":
            return _medusa_expected(config["num_heads"], config["num_hidden_layers"], config["hidden_size"],
                                    config["vocab_size"], "blocks.{k}.layers.{l}.",
                                    None if config.get("original_lm_head") else "lm_heads.{k}.weight",
                                    bias=bool(config.get("medusa_fc_bias", False)))
        if fmt == "medusa":
            L = config["medusa_num_layers"]
            return _medusa_expected(config["medusa_num_heads"], L, config["hidden_size"], config["vocab_size"],
                                    "{k}.{l}.linear.", "{k}." + str(L) + ".weight", bias=True)
        if fmt in ("eagle", "eagle-sglang"):
            out = _eagle_layer_expected(config, "layers.0.", 2 * config["hidden_size"], eagle3=False)
            if fmt == "eagle-sglang":
                out["fc.bias"] = (config["hidden_size"],)
            return out
        if fmt == "eagle3":
            return _eagle_layer_expected(config, "midlayer.", _aux_count(config) * _target_hidden(config),
                                         eagle3=True)
        if fmt == "speculators":
            layer = dict(config["transformer_layer_config"])
            layer["draft_vocab_size"] = config["draft_vocab_size"]
            layer["target_hidden_size"] = config.get("target_hidden_size")
            return _eagle_layer_expected(layer, "layers.0.", _aux_count(config) * _target_hidden(layer),
                                         eagle3=True)
    except KeyError as e:
        raise SpectrainError(f"{fmt} config.json lacks the key {e.args[0]!r} its engine reads") from None
    raise SpectrainError(f"unknown format {fmt!r}; expected one of {sorted(FORMATS)}")


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
    """Check a written export the way its engine would read it; raise naming every difference."""
    path = Path(path)
    config = read_json(path / "config.json", f"{fmt} config")
    expected = expected_tensors(fmt, config)
    found = _header(path / weights_file(fmt))
    missing = sorted(set(expected) - set(found))
    extra = sorted(set(found) - set(expected))
    wrong = [f"{k} {found[k][0]} (expected {expected[k]})" for k in sorted(set(expected) & set(found))
             if found[k][0] != expected[k]]
    problems = []
    if missing:
        problems.append(f"missing {missing}")
    if extra:
        problems.append(f"unexpected {extra}")
    if wrong:
        problems.append(f"wrong shapes {wrong}")
    if fmt in ("eagle3", "speculators") and not problems:
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
    if problems:
        raise SpectrainError(f"{path} is not a valid {fmt} export: " + "; ".join(problems))
    return expected


# -- export ---------------------------------------------------------------------------------------------------
def method_of(drafter) -> str:
    return "medusa" if isinstance(drafter, MedusaHeads) else drafter.config.variant


def check_format_for(drafter, fmt: str) -> str:
    """Raise unless ``fmt`` is a format for this drafter's method; returns the method."""
    if fmt not in FORMATS:
        raise SpectrainError(f"unknown export format {fmt!r}; expected one of {', '.join(sorted(FORMATS))}")
    have = method_of(drafter)
    if METHOD_OF[fmt] != have:
        raise SpectrainError(f"format {fmt} holds {METHOD_OF[fmt]} drafters, but this run trained {have}; "
                             f"formats for {have}: {', '.join(f for f, m in METHOD_OF.items() if m == have)}")
    return have
def export_tensors(drafter, fmt: str, verifier_lm_head: torch.nn.Module | None = None,
                   verifier_name: str = "", speculative_tokens: int | None = None,
                   notes: list[str] | None = None) -> tuple[dict, dict[str, torch.Tensor]]:
    """(config.json dict, tensors) of ``drafter`` in ``fmt``; ``notes`` collects what the user should know."""
    notes = notes if notes is not None else []
    method = check_format_for(drafter, fmt)
    if method == "medusa":
        return _export_medusa(drafter, fmt, verifier_lm_head, verifier_name, notes)
    return _export_eagle(drafter, fmt, verifier_name, speculative_tokens)


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


def _export_eagle(drafter: EagleDrafter, fmt, verifier_name, speculative_tokens):
    c = drafter.config
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
                      "target_hidden_size": c.hidden_size, "norm_before_residual": False,
                      "eagle_aux_hidden_state_layer_ids": aux,
                      "speculators_config": {
                          "algorithm": "eagle3", "default_proposal_method": "greedy",
                          "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": speculative_tokens or 3,
                                                "verifier_accept_k": 1, "accept_tolerance": 0.0}],
                          "verifier": {"name_or_path": verifier_name or c.verifier,
                                       "architectures": ["LlamaForCausalLM"]}},
                      "speculators_version": "0.3.0"}
    config["spectrain"] = ours
    return config, tensors


def export_drafter(drafter, fmt: str, out_dir: str | Path, verifier_lm_head=None, verifier_name: str = "",
                   force: bool = False, dtype: torch.dtype | None = None, speculative_tokens: int | None = None,
                   notes: list[str] | None = None) -> Path:
    """Write ``drafter`` in ``fmt`` to ``out_dir`` atomically, validated before it appears.

    Floating tensors are cast to ``dtype`` (default: as trained); ``d2t``/``t2d`` keep their integer/bool types.
    Refuses an existing ``out_dir`` unless ``force``; on any error nothing is left behind.
    """
    config, tensors = export_tensors(drafter, fmt, verifier_lm_head, verifier_name, speculative_tokens, notes)
    if dtype is not None:
        tensors = {k: v.to(dtype) if v.is_floating_point() else v for k, v in tensors.items()}
        config["torch_dtype"] = _DTYPE_NAMES[dtype]
    else:
        floating = {v.dtype for v in tensors.values() if v.is_floating_point()}
        config["torch_dtype"] = _DTYPE_NAMES.get(next(iter(floating)), "float32") if len(floating) == 1 else "float32"
    out_dir = Path(out_dir)
    with atomic_dir(out_dir, force=force) as tmp:
        save_tensors(tmp / weights_file(fmt), tensors, metadata={"format": "pt", "exported_by": "spectrain"})
        write_json(tmp / "config.json", config)
        validate_export(tmp, fmt)
    return out_dir


# -- import -----------------------------------------------------------------------------------------------------
def detect_format(path: str | Path) -> str:
    """``spectrain`` (our own run/drafter directory) or one of :data:`FORMATS`, from config.json."""
    path = Path(path)
    if (path / "medusa_lm_head.pt").is_file() and not (path / "medusa_lm_head.safetensors").is_file():
        raise SpectrainError(f"{path}/medusa_lm_head.pt is a pickle; spectrain loads safetensors only — convert it "
                             "(safetensors.torch.save_file) to medusa_lm_head.safetensors")
    config = read_json(path / "config.json", "drafter config")
    if config.get("method") in ("medusa", "eagle1", "eagle3") and "format_version" in config:
        return "spectrain"
    if config.get("speculators_model_type"):
        if config["speculators_model_type"] != "eagle3":
            raise SpectrainError(f"{path}: speculators model type {config['speculators_model_type']!r} is not "
                                 "supported (eagle3 only)")
        return "speculators"
    if "medusa_num_heads" in config:
        return "medusa"
    if config.get("model_type") == "medusa":
        return "vllm-medusa"
    archs = " ".join(config.get("architectures") or [])
    if "Eagle3" in archs or "eagle_aux_hidden_state_layer_ids" in config or "draft_vocab_size" in config:
        return "eagle3"
    if "LlamaForCausalLMEagle" in (config.get("architectures") or []):
        return "eagle-sglang"
    if config.get("model_type") == "llama" and config.get("num_hidden_layers") == 1:
        return "eagle"
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
        drafter = (MedusaHeads if raw["method"] == "medusa" else EagleDrafter).from_pretrained(path, verifier_model)
        names = set(_header(path / "model.safetensors"))
        return (drafter, names) if return_names else drafter
    config = read_json(path / "config.json", f"{fmt} config")
    validate_export(path, fmt)  # the same strict check as on export: every name known, every shape right
    tensors = load_tensors(path / weights_file(fmt))
    names = set(tensors)
    ours = config.get("spectrain") or {}
    if METHOD_OF[fmt] == "medusa":
        drafter = _import_medusa(fmt, config, tensors, ours, verifier_model, path)
    else:
        drafter = _import_eagle(fmt, config, tensors, ours, verifier_model, path)
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
    layer_cfg = config["transformer_layer_config"] if fmt == "speculators" else config
    variant = "eagle1" if fmt in ("eagle", "eagle-sglang") else "eagle3"
    if fmt == "eagle-sglang":
        if torch.count_nonzero(tensors.pop("fc.bias")):
            raise SpectrainError(f"{path}: fc.bias is not zero; spectrain's EAGLE fc has no bias")
    if layer_cfg.get("attention_bias") or layer_cfg.get("mlp_bias"):
        raise SpectrainError(f"{path}: the drafter layer has attention/MLP biases; spectrain's EAGLE layer has none")
    if variant == "eagle3" and (config.get("norm_before_residual", fmt == "speculators")
                                or config.get("norm_before_fc") or config.get("fc_norm") or config.get("norm_output")):
        raise SpectrainError(f"{path}: EAGLE-3 variant with norm_before_residual / norm_before_fc / fc_norm / "
                             "norm_output is not supported by spectrain's drafter")
    verifier_layers = ours.get("verifier_num_hidden_layers")
    if verifier_layers is None:
        if verifier_model is None:
            raise SpectrainError(f"{path} is a foreign {fmt} checkpoint: pass the verifier to import it")
        verifier_layers = verifier_model.config.num_hidden_layers
    h = layer_cfg["hidden_size"]
    if variant == "eagle3" and _target_hidden(config if fmt == "eagle3" else
                                              {**layer_cfg, "target_hidden_size": config.get("target_hidden_size")}) != h:
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
            "name_or_path", ""))
    if verifier_model is not None:
        check_compatible(ec.hidden_size, ec.vocab_size, verifier_model, str(path))
        if verifier_model.config.num_hidden_layers != ec.num_hidden_layers:
            raise SpectrainError(f"{path} was trained on a {ec.num_hidden_layers}-layer verifier, this one has "
                                 f"{verifier_model.config.num_hidden_layers}")
    drafter = EagleDrafter(ec)
    prefix = {"eagle": "layers.0.", "eagle-sglang": "layers.0.", "eagle3": "midlayer.", "speculators": "layers.0."}[fmt]
    state = {("layer." + k[len(prefix):] if k.startswith(prefix) else k): v for k, v in tensors.items()}
    if variant == "eagle3":
        check_vocab_map(state["d2t"], state["t2d"], ec.vocab_size, ec.draft_vocab_size)
    drafter.load_state_dict({k: v.float() if v.is_floating_point() else v for k, v in state.items()})
    return drafter
