"""EAGLE's serving formats (registered by ``heads/eagle.py``), with the engine loaders they were read from (vLLM 0.32,
SGLang):

* ``eagle`` — EAGLE-1 as vLLM loads it: a one-layer ``LlamaForCausalLM`` config (vLLM renames it
  ``EagleLlamaForCausalLM``); ``fc.weight`` (h, 2h), ``layers.0.*`` without ``input_layernorm``; embeddings and
  ``lm_head`` come from the verifier.
* ``eagle-sglang`` — EAGLE-1 as SGLang loads it: the same, with ``architectures: ["LlamaForCausalLMEagle"]`` and
  an all-zero ``fc.bias`` (SGLang's ``fc`` has a bias and would otherwise start from uninitialized memory). A
  drafter with a ranked vocabulary also gets ``token_map.pt``, SGLang's ``--speculative-token-map``
  (:mod:`.token_map`), declared in ``config.json``'s ``spectrain.token_map``. vLLM serves the full head of the
  EAGLE-1 exports.
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

Detection rests on exact keys where the layouts have them (``speculators_model_type``, ``architectures``, EAGLE-3's
``draft_vocab_size`` / aux ids); vLLM's EAGLE-1 has none, so ``eagle`` claims a one-layer Llama config that none of
the other three claims (and ``detect_format`` refuses it should another family's format claim it too).

Layer ids: ours are HF ``hidden_states`` indices. vLLM's ``eagle_aux_hidden_state_layer_ids`` use the
same numbering for ids < N (id k = output of decoder layer k, 1-based), but id N there is the last layer's
output *before* the final norm, while HF's ``hidden_states[N]`` is after it: a drafter trained on id N
cannot be exported (clear error). The engines capture their layers in ascending order, so ids must be ascending
and distinct (:func:`~.eagle.check_aux_layer_order`, EagleConfig's rule), checked again on export and by
``validate_export``.

The GGUF export for llama.cpp (``spectrain-export --format gguf``: EAGLE-3 only) is :data:`EAGLE_GGUF`, through
:mod:`.eagle_gguf`.
"""

from __future__ import annotations

import warnings

import torch

from ..compatibility import check_compatible
from ..eagle import EagleConfig, EagleDrafter, check_aux_layer_order, check_vocab_map
from ..errors import SpectrainError
from .eagle_gguf import check_eagle_exportable, check_eagle_target, write_for_export
from .registry import FamilyServing, GgufExport, ServingFormat, full_head_note, register_serving
from .token_map import TOKEN_MAP_FILE, write_token_map

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


def _check_eagle3(fmt: str, config: dict, found: dict, clean: bool) -> list[str]:
    """eagle3 / speculators beyond names and shapes: the vocabulary map's pair and types, the aux layers' order."""
    problems = []
    if clean and ("d2t" in found) != ("t2d" in found):
        problems.append("d2t and t2d come together or not at all")
    if clean and not problems and "d2t" in found:
        if found["d2t"][1] != "I64" or found["t2d"][1] != "BOOL":
            problems.append(f"d2t must be int64 and t2d bool, got {found['d2t'][1]} and {found['t2d'][1]}")
    nested = (config.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    try:  # the ids the engines read (vLLM's top-level, SGLang's nested): layers are captured in ascending order
        check_aux_layer_order(config.get("eagle_aux_hidden_state_layer_ids") or [], "eagle_aux_hidden_state_layer_ids")
        check_aux_layer_order(nested or [], "eagle_config.eagle_aux_hidden_state_layer_ids")
    except SpectrainError as err:
        problems.append(str(err))
    return problems


def _sglang_token_map(drafter, fmt: str, config: dict, ranking, notes: list[str]) -> list:
    """eagle-sglang's extras: a ranked EAGLE-1's draft vocabulary as SGLang's token map."""
    ids = ranking.ids()  # the drafter's default ranked head; None = it trained over the full vocabulary
    if ids is None:
        notes.append(f"{fmt}: the drafter trained over the full vocabulary: no token map (SGLang drafts over "
                     "all of it)")
        return []
    config.setdefault("spectrain", {})["token_map"] = {"file": TOKEN_MAP_FILE, "tokens": ids.numel(),
                                                       "source": ranking.source}
    notes.append(f"{fmt}: SGLang drafts over the {ids.numel()} most frequent training tokens with "
                 f"--speculative-token-map {{export}}/{TOKEN_MAP_FILE} (without it, the full head)")
    return [lambda d: write_token_map(d / TOKEN_MAP_FILE, ids)]


def _export_eagle_format(drafter, fmt, verifier_lm_head, verifier_name, speculative_tokens, notes):
    return _export_eagle(drafter, fmt, verifier_name, speculative_tokens, notes)


def _architectures(config: dict) -> list[str]:
    return list(config.get("architectures") or [])


def _is_speculators(c: dict) -> bool:
    return c.get("speculators_model_type") == "eagle3"


def _is_eagle3(c: dict) -> bool:
    """EAGLE-3's keys: its architecture, the fused layers' ids (ours at the top level, SGLang's in ``eagle_config``)
    or a draft vocabulary."""
    return not c.get("speculators_model_type") and (
        "Eagle3" in " ".join(_architectures(c)) or "eagle_aux_hidden_state_layer_ids" in c or "eagle_config" in c
        or "draft_vocab_size" in c)


def _is_eagle_sglang(c: dict) -> bool:
    """SGLang's EAGLE-1 architecture, less anything EAGLE-3's keys claim (an EAGLE-3 may carry the same name)."""
    return not c.get("speculators_model_type") and "LlamaForCausalLMEagle" in _architectures(c) and not _is_eagle3(c)


def _is_eagle_vllm(c: dict) -> bool:
    """vLLM's EAGLE-1 is a plain one-layer Llama config with no key of its own, so it is claimed only where
    nothing marks another layout: a plain Llama architecture (or none), no speculators type, no EAGLE-3 key,
    no Medusa key (a Medusa config may carry a Llama base's shape)."""
    return (c.get("model_type") == "llama" and c.get("num_hidden_layers") == 1
            and set(_architectures(c)) <= {"LlamaForCausalLM"} and not c.get("speculators_model_type")
            and "medusa_num_heads" not in c and not _is_eagle3(c))


EAGLE_FORMATS = (
    ServingFormat("speculators", "EAGLE-3 in vLLM's speculators format", "eagle3", detect=_is_speculators,
                  export=_export_eagle_format, load=_import_eagle, expected=_eagle_expected_tensors,
                  optional=_eagle_optional_tensors, check=_check_eagle3),
    ServingFormat("eagle3", "EAGLE-3 for vLLM and SGLang (LlamaForCausalLMEagle3, midlayer)", "eagle3",
                  detect=_is_eagle3, export=_export_eagle_format, load=_import_eagle,
                  expected=_eagle_expected_tensors, optional=_eagle_optional_tensors, check=_check_eagle3),
    ServingFormat("eagle-sglang", "EAGLE-1 for SGLang (LlamaForCausalLMEagle, fc with a zero bias)", "eagle1",
                  detect=_is_eagle_sglang, export=_export_eagle_format, load=_import_eagle,
                  expected=_eagle_expected_tensors, extras=_sglang_token_map),
    ServingFormat("eagle", "EAGLE-1 for vLLM (fc + layers.0)", "eagle1", detect=_is_eagle_vllm,
                  export=_export_eagle_format, load=_import_eagle, expected=_eagle_expected_tensors,
                  extras=full_head_note("vLLM serves", "; SGLang's token map: export --format eagle-sglang")),
)


# -- llama.cpp: one GGUF file (EAGLE-3 only; eagle_gguf.check_eagle_exportable says why not for EAGLE-1) ----------
EAGLE_GGUF = GgufExport(check_target=check_eagle_target, write=write_for_export, drafters=("EAGLE-3",),
                        spec_types=("draft-eagle3",), check_exportable=check_eagle_exportable)

register_serving(FamilyServing("eagle", formats=EAGLE_FORMATS, gguf=EAGLE_GGUF))
