"""P-EAGLE's serving format (registered for the ``peagle`` family): vLLM's speculators P-EAGLE layout.

* ``speculators-peagle`` — ``PEagleSpeculator`` (``speculators_model_type: peagle``), what speculators' P-EAGLE
  trainer saves and vLLM (0.32 read) serves with ``vllm serve EXPORT``: its ``update_peagle`` turns the config into
  ``{"method": "eagle3", "parallel_drafting": true}`` over ``Eagle3LlamaForCausalLM`` with ``num_hidden_layers``
  draft layers, reads ``mask_token_id`` (required: the placeholder slots' token, vLLM's ``pard_token``),
  ``norm_before_residual`` (false when absent, unlike EAGLE-3's reader), ``norm_before_fc``,
  ``eagle_aux_hidden_state_layer_ids`` and ``speculators_config.proposal_methods[0].speculative_tokens`` (K).
  Tensors: EAGLE-3's (``fc``, ``layers.0.*`` with ``hidden_norm``, ``norm``, ``lm_head``, ``d2t`` / ``t2d``, none
  for a full draft vocabulary), plain Llama ``layers.i.*`` for the later layers, ``mask_hidden`` (1, 1, n * h; vLLM
  copies ``fc(mask_hidden)`` into every placeholder slot), ``input_norm`` with ``norm_before_fc``, and
  ``embed_tokens`` when the embedding was trained (``embed_requires_grad``; vLLM then keeps the drafter's own).

vLLM does not copy ``fc_norm`` for P-EAGLE, so a config with it is refused (it would be served without its norms).
speculators trains Qwen3 draft layers by default (``draft_arch: qwen3``): their q / k norms are the engine's view of
such a config, but spectrain's layers are Llama's, so the import refuses them. llama.cpp cannot serve P-EAGLE: no
``--spec-type`` runs a parallel EAGLE pass (``draft-eagle3`` drafts autoregressively with one layer, ``draft-dflash``
is DFlash's graph): no GGUF writer.
"""

from __future__ import annotations

import torch

from ..eagle import _check_verifier
from ..errors import SpectrainError
from ..peagle import METHOD, PEagleConfig, PEagleDrafter
from ..vocab import check_vocab_map
from .dflash import SPECULATORS_VERSION
from .eagle import (_aux_count, _check_eagle3, _check_eagle_exportable, _eagle_layer_expected, _import_aux_ids,
                    _llama_config, _target_hidden, _warn_sliding_window)
from .registry import FamilyServing, ServingFormat, register_serving

FORMAT = "speculators-peagle"


def _export(drafter: PEagleDrafter, fmt, verifier_lm_head, verifier_name, speculative_tokens, notes):
    """(config.json, tensors): the state dict as it is (its names are speculators'), the config as
    ``PEagleSpeculatorConfig`` writes it, plus our ``spectrain`` record (the trained depths, the embedding)."""
    c = drafter.config
    _check_eagle_exportable(c, fmt)
    tokens = speculative_tokens or c.num_depths
    if not 1 <= tokens <= c.num_depths:
        raise SpectrainError(f"--speculative_tokens {tokens}: this P-EAGLE was trained for {c.num_depths} depths; "
                             f"vLLM would run placeholders it never trained beyond them (1 to {c.num_depths})")
    if not (verifier_name or c.verifier):
        raise SpectrainError(f"{fmt}: the drafter records no verifier, and vLLM needs one "
                             "(speculators_config.verifier.name_or_path): pass --verifier_name")
    aux = list(c.aux_layer_ids)
    config = {
        "architectures": ["PEagleSpeculator"], "speculators_model_type": METHOD,
        "transformer_layer_config": {**_llama_config(c, None), "num_hidden_layers": c.num_layers},
        "draft_vocab_size": c.draft_vocab_size, "target_hidden_size": c.hidden_size,
        # update_peagle copies these two (norm_before_residual: false when absent); fc_norm it never copies
        "norm_before_residual": c.norm_before_residual, "norm_before_fc": c.norm_before_fc,
        "fc_norm": False, "norm_output": False, "embed_requires_grad": c.embedding == "own",
        "eagle_aux_hidden_state_layer_ids": aux, "mask_token_id": c.mask_token_id,
        "speculators_config": {
            "algorithm": METHOD, "default_proposal_method": "greedy",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": tokens, "verifier_accept_k": 1,
                                  "accept_tolerance": 0.0}],
            "verifier": {"name_or_path": verifier_name or c.verifier, "architectures": ["LlamaForCausalLM"]}},
        "speculators_version": SPECULATORS_VERSION,
        "spectrain": {"method": METHOD, "verifier": c.verifier, "verifier_num_hidden_layers": c.num_hidden_layers,
                      "aux_layer_ids": aux, "num_depths": c.num_depths, "mask_token_id": c.mask_token_id,
                      "embedding": c.embedding}}
    notes.append(f"{fmt}: vllm serve EXPORT runs it with parallel drafting (one pass drafts {tokens} tokens)"
                 + ("" if c.embedding == "own" else "; the verifier's embed_tokens is shared by the engine"))
    return config, {k: v.detach() for k, v in drafter.state_dict().items()}


def _layer_config(config: dict) -> dict:
    return config["transformer_layer_config"]


def _expected(fmt: str, config: dict) -> dict[str, tuple[int, ...]]:
    """What vLLM's ``Eagle3LlamaForCausalLM`` (``Eagle3Qwen3ForCausalLM`` for a qwen3 layer config) loads with
    parallel drafting for this config."""
    layer = {**_layer_config(config), "draft_vocab_size": config["draft_vocab_size"]}
    h, ht, V = layer["hidden_size"], _target_hidden({**layer, **config}), layer["vocab_size"]
    heads = layer["num_attention_heads"]
    d = layer.get("head_dim") or h // heads
    width = _aux_count(config) * ht
    out = _eagle_layer_expected(layer, "layers.0.", width, eagle3=True)
    for i in range(1, int(layer.get("num_hidden_layers", 1))):
        plain = _eagle_layer_expected(layer, f"layers.{i}.", width, eagle3=False)
        plain.pop("fc.weight")
        out.update(plain)
        out[f"layers.{i}.input_layernorm.weight"] = (h,)
    if layer.get("model_type") == "qwen3":  # speculators' default draft_arch: q / k norms in every layer
        for i in range(int(layer.get("num_hidden_layers", 1))):
            out.update({f"layers.{i}.self_attn.q_norm.weight": (d,), f"layers.{i}.self_attn.k_norm.weight": (d,)})
    out["mask_hidden"] = (1, 1, width)
    if config.get("norm_before_fc"):
        out["input_norm.weight"] = (width,)
    if config["draft_vocab_size"] in (None, V):
        out.pop("d2t")
        out.pop("t2d")
    if config.get("embed_requires_grad"):  # a trained table: vLLM keeps the drafter's own, so it must be there
        out["embed_tokens.weight"] = (V, h)
    return out


def _optional(fmt: str, config: dict) -> dict[str, tuple[int, ...]]:
    """A frozen copy of the verifier's embedding (speculators saves it), a full draft vocabulary's map."""
    layer = _layer_config(config)
    V = layer["vocab_size"]
    out = {"embed_tokens.weight": (V, layer["hidden_size"])}
    if config["draft_vocab_size"] in (None, V):
        out.update({"d2t": (V,), "t2d": (V,)})
    return out


def _check(fmt: str, config: dict, found: dict, clean: bool) -> list[str]:
    """Beyond names and shapes: what vLLM's speculators reader requires (``mask_token_id``, K, the verifier's name,
    a llama / qwen3 layer, no ``fc_norm``), EAGLE-3's map and aux-order checks, and our record's agreement."""
    problems = _check_eagle3(fmt, config, found, clean)
    layer, ours = _layer_config(config), config.get("spectrain") or {}
    V = layer.get("vocab_size")
    mask = config.get("mask_token_id")
    if mask is None:
        problems.append("mask_token_id is missing: vLLM's update_peagle reads it as the placeholder slots' token "
                        "(pard_token) and fails without it")
    elif not isinstance(mask, int) or isinstance(mask, bool) or not 0 <= mask < V:
        problems.append(f"mask_token_id {mask!r} is outside the vocabulary of {V}")
    elif "mask_token_id" in ours and ours["mask_token_id"] != mask:
        problems.append(f"mask_token_id {mask} but the drafter was trained with {ours['mask_token_id']} "
                        "(spectrain.mask_token_id): its placeholders would embed another token")
    methods = (config.get("speculators_config") or {}).get("proposal_methods") or [{}]
    tokens = methods[0].get("speculative_tokens")
    if not isinstance(tokens, int) or tokens < 1:
        problems.append(f"speculators_config.proposal_methods[0].speculative_tokens must be an integer >= 1 (vLLM's "
                        f"K), got {tokens!r}")
    elif ours.get("num_depths") and tokens > ours["num_depths"]:
        problems.append(f"speculative_tokens {tokens} exceeds the {ours['num_depths']} depths the drafter trained")
    if not ((config.get("speculators_config") or {}).get("verifier") or {}).get("name_or_path"):
        problems.append("speculators_config.verifier.name_or_path is missing (vLLM requires it)")
    if layer.get("model_type") not in ("llama", "qwen3"):
        problems.append(f"transformer_layer_config.model_type {layer.get('model_type')!r}: vLLM serves P-EAGLE with "
                        "llama or qwen3 draft layers only")
    if config.get("fc_norm"):
        problems.append("fc_norm: vLLM's update_peagle does not copy it, so the drafter would be served without "
                        "its per-layer norms")
    return problems


def _import(fmt, config, tensors, ours, verifier_model, path) -> PEagleDrafter:
    """A P-EAGLE drafter from a (validated) speculators P-EAGLE checkpoint, ours or a foreign one: Llama draft
    layers, full attention (a sliding window warns), no ``fc_norm``; a shipped ``embed_tokens`` that differs from
    the verifier's is the drafter's own (speculators and SpecForge train it)."""
    layer = _layer_config(config)
    if layer.get("model_type") != "llama":
        raise SpectrainError(f"{path}: the draft layers are {layer.get('model_type')!r} (speculators' P-EAGLE "
                             "default draft_arch is qwen3: q / k norms spectrain's Llama layers lack)")
    if layer.get("attention_bias") or layer.get("mlp_bias"):
        raise SpectrainError(f"{path}: the draft layers have attention/MLP biases; spectrain's have none")
    _warn_sliding_window(layer, path)
    depth = ours.get("verifier_num_hidden_layers") or (
        verifier_model.config.num_hidden_layers if verifier_model is not None else None)
    if depth is None:
        raise SpectrainError(f"{path} is a foreign {fmt} checkpoint: pass the verifier to import it")
    h = layer["hidden_size"]
    if _target_hidden({**layer, **config}) != h:
        raise SpectrainError(f"{path}: target_hidden_size differs from the drafter's width; spectrain's drafters run "
                             "at the verifier's")
    rope = layer.get("rope_scaling") or layer.get("rope_parameters") or {}
    if (rope.get("rope_type") or rope.get("type") or "default") != "default":
        raise SpectrainError(f"{path}: rope scaling {rope} is not supported by spectrain's drafter (default RoPE)")
    tensors = dict(tensors)
    table = tensors.pop("embed_tokens.weight", None)
    embedding = ours.get("embedding") or ("own" if config.get("embed_requires_grad") else "verifier")
    if table is not None and verifier_model is not None and ours.get("embedding") is None:
        theirs = verifier_model.get_input_embeddings().weight.detach().cpu()
        same = theirs.shape == table.shape and torch.equal(theirs.to(table.dtype).to(theirs.dtype),
                                                           table.to(theirs.dtype))
        embedding = "verifier" if same else "own"  # a copy of the verifier's, or a trained table
    elif table is not None and ours.get("embedding") is None and verifier_model is None:
        embedding = "own"  # drafts as shipped
    methods = config["speculators_config"]["proposal_methods"]
    try:
        c = PEagleConfig(
            hidden_size=h, vocab_size=layer["vocab_size"], draft_vocab_size=config.get("draft_vocab_size")
            or layer["vocab_size"], aux_layer_ids=_import_aux_ids(config, depth), num_hidden_layers=int(depth),
            num_heads=layer["num_attention_heads"],
            num_kv_heads=layer.get("num_key_value_heads") or layer["num_attention_heads"],
            head_dim=layer.get("head_dim") or h // layer["num_attention_heads"],
            intermediate_size=layer["intermediate_size"], rms_norm_eps=float(layer.get("rms_norm_eps", 1e-6)),
            rope_theta=float(layer.get("rope_theta") or rope.get("rope_theta") or 10000.0),
            max_position_embeddings=layer.get("max_position_embeddings", 2048),
            norm_before_residual=bool(config.get("norm_before_residual", False)),
            norm_before_fc=bool(config.get("norm_before_fc", False)), num_layers=int(layer["num_hidden_layers"]),
            num_depths=int(ours.get("num_depths") or methods[0]["speculative_tokens"]),
            mask_token_id=config["mask_token_id"], embedding=embedding,
            verifier=ours.get("verifier") or config["speculators_config"]["verifier"]["name_or_path"])
    except SpectrainError as err:
        raise SpectrainError(f"{path}: {err}") from None
    if verifier_model is not None:
        _check_verifier(c, verifier_model, str(path))
    drafter = PEagleDrafter(c)
    state = {k: v.float() if v.is_floating_point() else v for k, v in tensors.items()}
    state["mask_hidden"] = state["mask_hidden"].reshape(1, 1, -1)
    if "d2t" not in state:  # a full draft vocabulary: the identity map
        state["d2t"] = torch.zeros(c.draft_vocab_size, dtype=torch.int64)
        state["t2d"] = torch.ones(c.vocab_size, dtype=torch.bool)
    check_vocab_map(state["d2t"], state["t2d"], c.vocab_size, c.draft_vocab_size)
    if embedding == "own":
        state["embed_tokens.weight"] = table.float()
    drafter.load_state_dict(state)
    return drafter


PEAGLE_FORMATS = (
    ServingFormat(FORMAT, "P-EAGLE in vLLM's speculators format (PEagleSpeculator; parallel drafting)", METHOD,
                  detect=lambda config: config.get("speculators_model_type") == METHOD, export=_export,
                  load=_import, expected=_expected, optional=_optional, check=_check),
)

register_serving(FamilyServing(METHOD, formats=PEAGLE_FORMATS))  # no GGUF: no llama.cpp --spec-type serves it
