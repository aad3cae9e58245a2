"""What the llama.cpp tests share: the tiny verifier's shape, a target GGUF with a target's metadata, seeded EAGLE-3
and DFlash drafters, and readers of written tensors."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from spectrain.heads.eagle import EagleDrafter, build_vocab_map

VOCAB, LAYERS = 200, 6


def tiny_target_gguf(path: Path, layers: int = LAYERS, hidden: int = 32, vocab: int = VOCAB, salt: str = "") -> Path:
    """A llama GGUF with the metadata a target has (architecture, depth, width, tokenizer) and one tensor."""
    import gguf

    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(layers)
    writer.add_embedding_length(hidden)
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list([f"t{i}{salt}" for i in range(vocab)])
    writer.add_token_types([1] * vocab)
    writer.add_bos_token_id(1)
    writer.add_tensor("token_embd.weight", np.arange(vocab * hidden, dtype=np.float32).reshape(vocab, hidden))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def eagle3(verifier, seed: int = 0, **kw) -> EagleDrafter:
    torch.manual_seed(seed)
    drafter = EagleDrafter.for_verifier(verifier, "eagle3", draft_vocab_size=64, aux_layer_ids=kw.pop("aux", None),
                                        verifier_name="v", **kw)
    counts = torch.randint(0, 1000, (VOCAB,))
    drafter.set_vocab_map(*build_vocab_map(counts, 64))
    with torch.no_grad():
        for p in drafter.parameters():
            p.normal_(0, 0.2)
    return drafter


def as_torch(entry) -> torch.Tensor:
    shape, _, data = entry
    return torch.from_numpy(np.array(data)).reshape(shape)


def unpermute(w: torch.Tensor, heads: int) -> torch.Tensor:
    """The inverse of llama_cpp._permute: llama.cpp's pairwise row order back to HF's rotate-half order."""
    return w.reshape(heads, w.shape[0] // heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def dflash(verifier, **kw):
    from spectrain.heads.dflash import DFlashConfig, DFlashDrafter

    torch.manual_seed(0)
    drafter = DFlashDrafter(DFlashConfig.for_verifier(verifier, num_layers=2, block_size=4, mask_token_id=3,
                                                      target_layer_ids=[1, 3], verifier_name="v", **kw))
    with torch.no_grad():
        for p in drafter.parameters():
            p.normal_()
    return drafter
