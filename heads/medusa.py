"""Medusa heads: K extra LM heads over the verifier's last hidden state.

Head k (1-based) at position t predicts token t+k+1 (the verifier itself
predicts t+1). Each head is ``num_layers`` ResBlocks followed by an LM head that
starts as a copy of the verifier's ``lm_head`` — or, with ``shared_lm_head``,
reuses the verifier's frozen ``lm_head`` (vLLM's ``original_lm_head``), which
saves K x vocab x hidden parameters for large vocabularies.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from torch import nn

from .compatibility import check_compatible
from .errors import SpectrainError
from .families import DrafterFamily, register_family
from .io import checked_state, read_drafter_config, save_drafter_dir

FORMAT_VERSION = 1


class ResBlock(nn.Module):
    """``x + SiLU(Linear(x))`` with the weight zero-initialized, so a new head starts as the verifier's head."""

    def __init__(self, hidden_size: int):
        super().__init__()
        self.linear = nn.Linear(hidden_size, hidden_size, bias=True)
        nn.init.zeros_(self.linear.weight)
        self.act = nn.SiLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.act(self.linear(x))


@dataclass
class MedusaConfig:
    """Shape of a set of Medusa heads and the verifier they were trained for."""

    num_heads: int = 4
    num_layers: int = 1
    hidden_size: int = 0
    vocab_size: int = 0
    shared_lm_head: bool = False
    lm_head_bias: bool = False
    verifier: str = ""
    method: str = "medusa"
    format_version: int = FORMAT_VERSION
    extra: dict = field(default_factory=dict)

    def __post_init__(self):
        for key, minimum in (("num_heads", 1), ("num_layers", 0), ("hidden_size", 1), ("vocab_size", 1)):
            value = getattr(self, key)
            if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
                raise SpectrainError(f"Medusa {key} must be an integer >= {minimum}, got {value!r}")


class MedusaHeads(nn.Module):
    """K Medusa heads.

    ``blocks[k]`` is head k's ResBlock stack (distinct modules per head and layer);
    ``lm_heads[k]`` its vocabulary projection, absent with ``shared_lm_head``.
    """

    def __init__(self, config: MedusaConfig):
        super().__init__()
        self.config = config
        h = config.hidden_size
        self.blocks = nn.ModuleList(
            nn.Sequential(*(ResBlock(h) for _ in range(config.num_layers))) for _ in range(config.num_heads)
        )
        if config.shared_lm_head:
            self.lm_heads = None
        else:
            self.lm_heads = nn.ModuleList(
                nn.Linear(h, config.vocab_size, bias=config.lm_head_bias) for _ in range(config.num_heads)
            )

    @classmethod
    def for_verifier(cls, verifier_model, num_heads: int = 4, num_layers: int = 1, shared_lm_head: bool = False,
                     verifier_name: str = "") -> "MedusaHeads":
        """Heads shaped for ``verifier_model``, LM heads initialized from its ``lm_head``."""
        lm_head = verifier_model.get_output_embeddings()
        config = MedusaConfig(
            num_heads=num_heads, num_layers=num_layers, hidden_size=lm_head.weight.shape[1],
            vocab_size=lm_head.weight.shape[0], shared_lm_head=shared_lm_head,
            lm_head_bias=getattr(lm_head, "bias", None) is not None, verifier=verifier_name,
        )
        heads = cls(config).to(dtype=torch.float32)
        heads.init_lm_heads_from(lm_head)
        return heads

    @torch.no_grad()
    def init_lm_heads_from(self, lm_head: nn.Linear) -> None:
        if self.lm_heads is None:
            return
        for head in self.lm_heads:
            head.weight.copy_(lm_head.weight)
            if head.bias is not None:
                head.bias.copy_(lm_head.bias)

    def head_states(self, hidden: torch.Tensor) -> list[torch.Tensor]:
        """(..., H) verifier last hidden states -> K tensors (..., H), the input of each LM head."""
        return [block(hidden) for block in self.blocks]

    def lm_head_params(self, k: int, verifier_lm_head: nn.Module | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(weight (V, H), bias (V,) or None) of head k's vocabulary projection (0-based k)."""
        head = verifier_lm_head if self.lm_heads is None else self.lm_heads[k]
        if head is None:
            raise SpectrainError("these Medusa heads share the verifier's lm_head: pass it as verifier_lm_head")
        return head.weight, head.bias

    def forward(self, hidden: torch.Tensor, verifier_lm_head: nn.Module | None = None) -> torch.Tensor:
        """(..., H) -> logits (K, ..., V). Materialises every head's logits: use for decoding, not training."""
        out = []
        for k, state in enumerate(self.head_states(hidden)):
            weight, bias = self.lm_head_params(k, verifier_lm_head)
            out.append(nn.functional.linear(state.to(weight.dtype), weight, bias))
        return torch.stack(out)

    # -- our checkpoint format: model.safetensors + config.json, trainable weights only ----------------------
    def save_pretrained(self, out_dir: str | Path, extra: dict | None = None) -> Path:
        """Write ``model.safetensors`` then ``config.json`` (no verifier weights), each atomically.

        ``config.json`` is written last, so a directory with it holds a complete drafter.
        """
        out_dir = Path(out_dir)
        config = asdict(self.config)
        if extra:
            config["extra"] = {**config.get("extra", {}), **extra}
        return save_drafter_dir(out_dir, self.state_dict(), config)

    @classmethod
    def from_pretrained(cls, path: str | Path, verifier_model=None, device: str | torch.device = "cpu") -> "MedusaHeads":
        """Load heads saved by :meth:`save_pretrained`; check them against ``verifier_model`` when given."""
        path = Path(path)
        config = read_drafter_config(path, MedusaConfig, ("medusa",), "Medusa heads")
        if verifier_model is not None:
            check_compatible(config.hidden_size, config.vocab_size, verifier_model, str(path))
        heads = cls(config)
        heads.load_state_dict(checked_state(path / "model.safetensors", heads.state_dict()))
        return heads.to(device)


register_family(DrafterFamily(
    name="medusa", methods=("medusa",), drafter_class=MedusaHeads, config_class=MedusaConfig, label="Medusa",
    verifier_depth_key=None))  # Medusa heads do not record the verifier's depth
