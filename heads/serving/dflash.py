"""DFlash's and DSpark's serving formats (registered by ``heads/dflash.py``): vLLM's speculators layout.

* ``speculators-dflash`` — ``DFlashSpeculator`` (``speculators_model_type: dflash``); ``speculators-dspark`` —
  ``DSparkSpeculator`` with the Markov and confidence heads. The body's tensors under our names (they are
  speculators'), no ``embed_tokens`` / ``lm_head`` (the engine shares the verifier's), ``aux_hidden_state_layer_ids``
  in vLLM's capture ids (= ``target_layer_ids + 1``).
"""

from __future__ import annotations

from ..errors import SpectrainError
from .registry import FamilyServing, ServingFormat, register_serving
from ..dflash import DFlashConfig, DFlashDrafter, check_verifier, without_confidence_head
from .dflash_gguf import DFLASH_GGUF

SPECULATORS_VERSION = "0.9.0"


def _export_speculators(drafter: DFlashDrafter, fmt, verifier_lm_head, verifier_name, speculative_tokens, notes):
    """(config.json, tensors) of vLLM's speculators DFlash / DSpark layout: the body's tensors under our names (they
    are speculators'), no ``embed_tokens`` / ``lm_head`` (vLLM shares the verifier's), ``aux_hidden_state_layer_ids``
    in vLLM's capture ids (= target_layer_ids + 1, :attr:`DFlashConfig.capture_ids`)."""
    c = drafter.config
    dspark = c.method == "dspark"
    if c.sample_from_anchor and not dspark:
        raise SpectrainError("vLLM's DFlash speculator drafts from slot 1; sample_from_anchor is DSpark's layout, "
                             "served with its heads (train with --model.markov_rank or --model.confidence_head)")
    if c.verifier_layers - 1 in c.target_layer_ids:
        raise SpectrainError(f"the drafter reads the verifier's last layer ({c.verifier_layers - 1}), whose output HF "
                             "gives after the final norm; engines capture layer outputs before it: retrain with "
                             "--model.target_layer_ids below it")
    tokens = speculative_tokens or c.drafts
    if tokens != c.drafts:  # vLLM then queries fewer slots: a bidirectional block's states would all differ
        raise SpectrainError(f"--speculative_tokens {tokens}: a block of {c.block_size} was trained (and decodes here) "
                             f"with all {c.drafts} draft slots; vLLM would run {tokens}")
    config = {
        "architectures": ["DSparkSpeculator" if dspark else "DFlashSpeculator"],
        "speculators_model_type": c.method, "speculators_version": SPECULATORS_VERSION,
        "speculators_config": {
            "algorithm": c.method,
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": tokens, "verifier_accept_k": 1,
                                  "accept_tolerance": 0.0}],
            "default_proposal_method": "greedy",
            "verifier": {"name_or_path": verifier_name or c.verifier, "architectures": ["LlamaForCausalLM"]}},
        "transformer_layer_config": {
            "model_type": "qwen3", "hidden_size": c.hidden_size, "intermediate_size": c.intermediate_size,
            "num_hidden_layers": c.num_hidden_layers, "num_attention_heads": c.num_heads,
            "num_key_value_heads": c.num_kv_heads, "head_dim": c.head_dim, "hidden_act": "silu",
            "rms_norm_eps": c.rms_norm_eps, "rope_theta": c.rope_theta,
            "max_position_embeddings": c.max_position_embeddings, "attention_bias": False,
            "vocab_size": c.vocab_size, "tie_word_embeddings": False,
            "layer_types": ["full_attention"] * c.num_hidden_layers, "use_sliding_window": False,
            "sliding_window": None},
        "draft_vocab_size": c.vocab_size, "block_size": c.block_size, "target_hidden_size": None,
        "aux_hidden_state_layer_ids": list(c.capture_ids), "mask_token_id": c.mask_token_id,
        "sliding_window_non_causal": False, "sample_from_anchor": c.sample_from_anchor, "torch_dtype": "bfloat16",
        "spectrain": {"verifier": verifier_name or c.verifier, "verifier_num_hidden_layers": c.verifier_layers},
    }
    if dspark:
        config.update(markov_rank=c.markov_rank, markov_head_type="vanilla", enable_confidence_head=c.confidence_head,
                      confidence_head_with_markov=bool(c.markov_rank and c.confidence_head))
    notes.append(f"{fmt}: the verifier's embed_tokens and lm_head are shared by the engine (not written); it drafts "
                 "over the full vocabulary")
    return config, {k: v.detach() for k, v in drafter.state_dict().items()}


def _speculators_config(config: dict, verifier_model) -> DFlashConfig:
    layer = config.get("transformer_layer_config") or {}
    ours = config.get("spectrain") or {}
    depth = ours.get("verifier_num_hidden_layers") or (
        verifier_model.config.num_hidden_layers if verifier_model is not None else None)
    if depth is None:
        raise SpectrainError("a speculators DFlash checkpoint does not record the verifier's depth: load it with the "
                             "verifier (--verifier)")
    if config.get("target_hidden_size") not in (None, layer.get("hidden_size")):
        raise SpectrainError(f"target_hidden_size {config['target_hidden_size']} differs from the drafter's width: "
                             "spectrain's block drafters run at the verifier's width")
    if config.get("sliding_window_non_causal") or layer.get("use_sliding_window"):
        raise SpectrainError("sliding-window DFlash drafters are not supported")
    rope = layer.get("rope_parameters") or layer.get("rope_scaling") or {}
    if rope.get("rope_type", rope.get("type", "default")) not in ("default", None):
        raise SpectrainError(f"rope scaling {rope.get('rope_type', rope.get('type'))!r} is not supported: spectrain's "
                             "block drafters use default RoPE")
    if config.get("markov_head_type", "vanilla") != "vanilla":
        raise SpectrainError(f"DSpark markov_head_type {config['markov_head_type']!r} is not supported (only vanilla)")
    if int(config.get("draft_vocab_size") or layer.get("vocab_size", 0)) != int(layer.get("vocab_size", 0)):
        raise SpectrainError("a DFlash checkpoint with its own draft vocabulary (d2t) is not supported: spectrain's "
                             "block drafters use the verifier's lm_head")
    try:
        return DFlashConfig(
            hidden_size=layer["hidden_size"], vocab_size=layer["vocab_size"],
            num_hidden_layers=layer["num_hidden_layers"], num_heads=layer["num_attention_heads"],
            num_kv_heads=layer.get("num_key_value_heads") or layer["num_attention_heads"],
            head_dim=layer.get("head_dim") or layer["hidden_size"] // layer["num_attention_heads"],
            intermediate_size=layer["intermediate_size"], verifier_layers=int(depth),
            target_layer_ids=[int(i) - 1 for i in config["aux_hidden_state_layer_ids"]],
            block_size=config["block_size"], mask_token_id=config["mask_token_id"],
            markov_rank=int(config.get("markov_rank") or 0) if config.get("speculators_model_type") == "dspark" else 0,
            confidence_head=bool(config.get("enable_confidence_head", False)),
            # speculators' defaults: DSpark samples from the anchor's slot, DFlash does not
            sample_from_anchor=bool(config.get("sample_from_anchor", config.get("speculators_model_type") == "dspark")),
            rms_norm_eps=float(layer.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope.get("rope_theta") or layer.get("rope_theta") or 10000.0),
            max_position_embeddings=layer.get("max_position_embeddings", 2048),
            verifier=ours.get("verifier") or config["speculators_config"]["verifier"]["name_or_path"])
    except KeyError as err:
        raise SpectrainError(f"speculators DFlash config.json lacks {err}") from None


def _import_speculators(fmt, config, tensors, ours, verifier_model, path) -> DFlashDrafter:
    c = _speculators_config(config, verifier_model)
    if c.confidence_head and c.markov_rank and not config.get("confidence_head_with_markov", True):
        raise SpectrainError(f"{path}: a confidence head without the Markov input is not supported")
    drafter = DFlashDrafter(c)
    frozen = {"embed_tokens.weight", "lm_head.weight", "verifier_lm_head.weight", "verifier_norm.weight"}
    drafter.load_state_dict({k: v for k, v in tensors.items() if k not in frozen})
    if verifier_model is not None:
        check_verifier(c, verifier_model, str(path))
    return drafter


def _speculators_expected(fmt, config) -> dict[str, tuple[int, ...]]:
    """Every tensor vLLM's DFlash / DSpark loader reads for this config (the verifier's embed_tokens / lm_head are
    optional there and not written by us)."""
    layer = config["transformer_layer_config"]
    h, heads = layer["hidden_size"], layer["num_attention_heads"]
    kv, d = layer.get("num_key_value_heads") or heads, layer.get("head_dim") or h // heads
    inter, V = layer["intermediate_size"], layer["vocab_size"]
    out = {"fc.weight": (h, len(config["aux_hidden_state_layer_ids"]) * h), "hidden_norm.weight": (h,),
           "norm.weight": (h,)}
    for i in range(layer["num_hidden_layers"]):
        p = f"layers.{i}."
        out.update({p + "self_attn.q_proj.weight": (heads * d, h), p + "self_attn.k_proj.weight": (kv * d, h),
                    p + "self_attn.v_proj.weight": (kv * d, h), p + "self_attn.o_proj.weight": (h, heads * d),
                    p + "self_attn.q_norm.weight": (d,), p + "self_attn.k_norm.weight": (d,),
                    p + "mlp.gate_proj.weight": (inter, h), p + "mlp.up_proj.weight": (inter, h),
                    p + "mlp.down_proj.weight": (h, inter), p + "input_layernorm.weight": (h,),
                    p + "post_attention_layernorm.weight": (h,)})
    if config.get("speculators_model_type") == "dspark":
        rank = int(config.get("markov_rank") or 0)
        if rank:
            out.update({"markov_head.markov_w1.weight": (V, rank), "markov_head.markov_w2.weight": (V, rank)})
        if config.get("enable_confidence_head"):
            out.update({"confidence_head.proj.weight": (1, h + rank), "confidence_head.proj.bias": (1,)})
    return out


def _is_speculators(method: str):
    return lambda config: config.get("speculators_model_type") == method


DFLASH_FORMATS = tuple(
    ServingFormat(f"speculators-{method}", f"{label} in vLLM's speculators format ({architecture})", method,
                  detect=_is_speculators(method), export=_export_speculators, load=_import_speculators,
                  expected=_speculators_expected)
    for method, label, architecture in (("dflash", "DFlash", "DFlashSpeculator"),
                                        ("dspark", "DSpark", "DSparkSpeculator")))

register_serving(FamilyServing("dflash", formats=DFLASH_FORMATS, gguf=DFLASH_GGUF,
                               without_confidence_head=without_confidence_head))
