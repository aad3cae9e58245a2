"""Whether a drafter's sizes fit a verifier: the one check every family runs when it loads beside a verifier."""

from __future__ import annotations

from .errors import SpectrainError


def check_compatible(hidden_size: int, vocab_size: int, verifier_model, where: str) -> None:
    """Raise if a drafter with these sizes (width ``hidden_size``, vocabulary ``vocab_size``) cannot run on
    ``verifier_model``, whose ``lm_head`` weight is (V, h)."""
    weight = verifier_model.get_output_embeddings().weight
    if weight.shape[1] != hidden_size:
        raise SpectrainError(f"drafter {where} was trained for hidden size {hidden_size}, but the verifier's is "
                             f"{weight.shape[1]}: it belongs to another verifier")
    if weight.shape[0] != vocab_size:
        raise SpectrainError(f"drafter {where} was trained for a vocabulary of {vocab_size}, but the verifier's is "
                             f"{weight.shape[0]}: it belongs to another verifier")
