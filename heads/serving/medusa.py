"""Medusa's serving formats (registered by ``heads/medusa.py``): export, import, expected tensors.

* ``vllm-medusa`` — vLLM ``Medusa`` (``model_type: medusa``): ``blocks.{k}.layers.{l}.weight|bias``
  (``medusa_fc_bias: true``), ``lm_heads.{k}.weight`` or one ``lm_head.weight`` with ``original_lm_head``.
* ``medusa`` — FasterDecoding / TensorRT-LLM: ``config.json`` (``medusa_num_heads``, ``medusa_num_layers``,
  ``base_model_name_or_path``) and ``medusa_lm_head.safetensors`` with ``{k}.{l}.linear.weight|bias`` and
  ``{k}.{L}.weight`` (L = number of layers). vLLM reads this layout too.

vLLM and TensorRT-LLM serve the full head of these exports: a drafter's ranked head stays spectrain-eval's.
"""

from __future__ import annotations

import torch

from ..compatibility import check_compatible
from ..errors import SpectrainError
from .registry import FamilyServing, ServingFormat, full_head_note, register_serving
from ..medusa import MedusaConfig, MedusaHeads

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


def _check_vllm_medusa(fmt: str, config: dict, found: dict, clean: bool) -> list[str]:
    """vLLM's Medusa reads a truncated vocabulary only with a token map, which spectrain does not write."""
    if config.get("truncated_vocab_size", config["vocab_size"]) != config["vocab_size"]:
        return ["truncated_vocab_size differs from vocab_size without a token_map"]
    return []


def _export_medusa_format(drafter, fmt, verifier_lm_head, verifier_name, speculative_tokens, notes):
    return _export_medusa(drafter, fmt, verifier_lm_head, verifier_name, notes)


MEDUSA_FORMATS = (
    ServingFormat("vllm-medusa", "vLLM Medusa (model_type medusa)", "medusa",
                  detect=lambda c: c.get("model_type") == "medusa" and "medusa_num_heads" not in c,
                  export=_export_medusa_format, load=_import_medusa, expected=_medusa_expected_tensors,
                  check=_check_vllm_medusa, extras=full_head_note("vLLM serves")),
    ServingFormat("medusa", "FasterDecoding Medusa / TensorRT-LLM (medusa_lm_head.safetensors)", "medusa",
                  detect=lambda c: "medusa_num_heads" in c, export=_export_medusa_format, load=_import_medusa,
                  expected=_medusa_expected_tensors, weights_file="medusa_lm_head.safetensors",
                  extras=full_head_note("TensorRT-LLM and vLLM serve"), pickled_weights="medusa_lm_head.pt"),
)


register_serving(FamilyServing("medusa", formats=MEDUSA_FORMATS,
                               # Medusa heads that project through the verifier's lm_head need it to be written
                               exports_need_verifier_head=lambda heads: heads.config.shared_lm_head))
