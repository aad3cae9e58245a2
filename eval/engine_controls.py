"""The controls and mistaken exports of the real-engine checks (``benchmarks/engine_check.py`` for vLLM,
``benchmarks/llama_cpp_check.py`` for llama.cpp).

An engine can load a drafter and still read it otherwise than we do (vLLM loads an EAGLE-3 with a missing norm,
and drops Medusa biases without ``medusa_fc_bias``, without a word). Two kinds of drafters guard against that:

* *controls* with known acceptance: each proposes one token at every step only through the part of the file a
  silent misreading would lose (Medusa's biases, EAGLE-3's and P-EAGLE's d2t, DFlash's mask token embedding), so
  its accepted count follows from the engine's own greedy output (:func:`predicted_acceptance`) and is compared
  exactly;
* *mistaken exports*: a right export with one field wrong (target layers shifted by one, another mask token, a
  zeroed P-EAGLE ``mask_hidden``, a rolled d2t), which the check must catch.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import torch

from spectrain.eval.layer_probe import shifted_layers
from spectrain.heads.dflash import DFlashConfig, DFlashDrafter
from spectrain.heads.eagle import EagleDrafter, build_vocab_map
from spectrain.heads.serving.eagle_gguf import ARCH
from spectrain.heads.errors import SpectrainError
from spectrain.heads.io import read_json, write_json
from spectrain.heads.serving.llama_cpp import read_metadata, write_gguf
from spectrain.heads.medusa import MedusaHeads
from spectrain.heads.peagle import PEagleDrafter


# -- controls ------------------------------------------------------------------------------------------------------
def medusa_control(verifier, token: int, k: int) -> MedusaHeads:
    """Heads that propose ``token`` at every position, through the ResBlock biases alone.

    Block weight 0, bias 1000·e_0: the block's output is x + 1000·e_0; lm_head row ``token`` = e_0, every other
    row 0, so ``token`` scores x_0 + 1000 > 0 = every other logit. Without the biases (vLLM's silent drop when
    ``medusa_fc_bias`` is missing) the proposal would follow the sign of x_0 instead.
    """
    heads = MedusaHeads.for_verifier(verifier, num_heads=k, num_layers=1, verifier_name="control")
    with torch.no_grad():
        for k_ in range(k):
            block = heads.blocks[k_][0].linear
            block.weight.zero_()
            block.bias.zero_()
            block.bias[0] = 1000.0
            head = heads.lm_heads[k_].weight
            head.zero_()
            head[token, 0] = 1.0
    return heads


def eagle3_control(verifier, token: int, draft_vocab: int = 1024, scale: float | None = 1000.0) -> EagleDrafter:
    """An EAGLE-3 drafter that proposes ``token`` at every step through d2t alone: its head picks draft id 0, and
    d2t maps draft id 0 to ``token`` (draft ids are sorted by target id, and the map starts at ``token``).

    ``scale=None`` (the vLLM check's control): only the lm_head is zeroed, every draft logit is 0 and the argmax
    takes the first, draft id 0; the other weights stay as initialised (they change no logit).

    ``scale`` a number (the llama.cpp check's control): draft id 0 wins by a strictly positive margin, not a tie.
    fc = 0 and q = k = 0, so attention averages values read from the token embeddings; o_proj writes that average
    into hidden dim 1 only. The MLP's two live units have gate = up = ±e_1, so their output
    ``scale · (silu(n_1) n_1 + silu(−n_1)(−n_1)) = scale · n_1²`` (n = the post-attention norm's output, n_1² = h
    when dim 1 is the only one written) lands in hidden dim 0, which nothing else writes: h_0 > 0 at every step (a
    later step's residual, the previous h, keeps it positive). The head's only nonzero weight reads h_0 into draft
    id 0, every other draft logit is 0. The same file with a wrong d2t proposes another token, and a head read from
    the wrong tensor or without the final norm's weights proposes something else.
    """
    drafter = EagleDrafter.for_verifier(verifier, "eagle3", draft_vocab_size=draft_vocab, verifier_name="control")
    V = drafter.config.vocab_size
    if token + draft_vocab > V:
        raise SpectrainError(f"control token {token} too close to the end of the vocabulary")
    counts = torch.zeros(V, dtype=torch.long)
    counts[token:token + draft_vocab] = 1  # draft ids are sorted by target id: draft id 0 is `token`
    drafter.set_vocab_map(*build_vocab_map(counts, draft_vocab))
    with torch.no_grad():
        if scale is None:
            drafter.lm_head.weight.zero_()
        else:
            _positive_margin(drafter, scale)
    return drafter


def peagle_control(verifier, token: int, k: int, draft_vocab: int = 1024) -> PEagleDrafter:
    """A P-EAGLE drafter (one layer, ``k`` depths) that proposes ``token`` at every depth of its one parallel pass
    through d2t alone, as :func:`eagle3_control` (``scale=None``) does: a zero ``lm_head`` makes every draft logit
    0, the argmax takes draft id 0, and d2t maps it to ``token``. It checks the layout's map and the engine's
    counting; its deeper depths are tested only where ``token`` follows itself in the output (a comma does not),
    so the placeholder depths are checked by a trained drafter's per-position acceptance and the mistaken
    exports."""
    counts = torch.zeros(verifier.get_output_embeddings().weight.shape[0], dtype=torch.long)
    if token + draft_vocab > counts.numel():
        raise SpectrainError(f"control token {token} too close to the end of the vocabulary")
    counts[token:token + draft_vocab] = 1  # draft ids are sorted by target id: draft id 0 is `token`
    drafter = PEagleDrafter.for_verifier(verifier, token_counts=counts, num_layers=1, num_depths=k,
                                         draft_vocab_size=draft_vocab, verifier_name="control")
    with torch.no_grad():
        drafter.lm_head.weight.zero_()
    return drafter


def _positive_margin(drafter: EagleDrafter, scale: float) -> None:
    """The weights of :func:`eagle3_control`'s margin construction (its docstring says why each is set)."""
    layer = drafter.layer
    for p in drafter.parameters():
        p.zero_()
    for norm in (layer.input_layernorm, layer.hidden_norm, layer.post_attention_layernorm, drafter.norm):
        norm.weight.fill_(1.0)
    kv = layer.self_attn.v_proj.weight.shape[0]
    layer.self_attn.v_proj.weight[:, :kv] = torch.eye(kv)  # values: the first kv dims of the normed embedding
    layer.self_attn.o_proj.weight[1, :] = 1.0 / layer.self_attn.o_proj.weight.shape[1] ** 0.5
    layer.mlp.gate_proj.weight[0, 1] = layer.mlp.up_proj.weight[0, 1] = 1.0  # silu(n_1) n_1 = n_1² σ(n_1)
    layer.mlp.gate_proj.weight[1, 1] = layer.mlp.up_proj.weight[1, 1] = -1.0  # + n_1² σ(−n_1): n_1² in all
    layer.mlp.down_proj.weight[0, :2] = scale
    drafter.lm_head.weight[0, 0] = 1.0


def dflash_control(verifier, tokenizer, token: int, drafts: int, scale: float = 10.0) -> DFlashDrafter:
    """A block drafter that proposes ``token`` in every slot *through the mask token's embedding*.

    Its layers add nothing (``o_proj`` and ``down_proj`` zero), so a slot's state is the embedding e of what fills
    it and the final norm gives n = e / rms(e) * w. With w = scale * lm_head[token] / (e_mask / rms(e_mask)) the
    mask slots' logits are scale * lm_head @ lm_head[token] (over the entries where e_mask is not zero), whose
    argmax is ``token`` (checked here). An engine that filled the slots with another id would draft from another
    embedding.
    """
    config = DFlashConfig.for_verifier(verifier, num_layers=1, block_size=drafts + 1, tokenizer=tokenizer,
                                       verifier_name="control")
    drafter = DFlashDrafter(config)
    head = verifier.get_output_embeddings().weight.detach().float()
    embed = verifier.get_input_embeddings().weight.detach().float()[config.mask_token_id]
    normed = embed * torch.rsqrt(embed.pow(2).mean() + config.rms_norm_eps)
    live = normed.abs() > 1e-6  # entries the norm weight can reach (a quantized embedding may hold exact zeros)
    target = torch.where(live, head[token], torch.zeros_like(head[token]))
    if int((head @ target).argmax()) != token:
        raise SpectrainError(f"control token {token}'s lm_head row is not its own best match over the mask token's "
                             "nonzero embedding entries: pick another --control_token")
    with torch.no_grad():
        for layer in drafter.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        drafter.norm.weight.copy_(scale * target / torch.where(live, normed, torch.ones_like(normed)))
    return drafter


def predicted_acceptance(outputs: list[list[int]], token: int, k: int) -> dict:
    """Drafts and accepted tokens of a drafter that always proposes ``k`` copies of ``token``.

    Round r verifies positions p .. p+k-1 of the final output (p = 1 after the prefill token); it accepts the
    leading run of ``token`` there and emits accepted + 1 tokens.
    """
    drafts = accepted = 0
    for out in outputs:
        n, p = len(out), 1
        while p < n:
            run = 0
            while run < k and p + run < n and out[p + run] == token:
                run += 1
            drafts += 1
            accepted += run
            p += run + 1
    return {"num_drafts": drafts, "num_accepted_tokens": accepted}


# -- mistaken exports ----------------------------------------------------------------------------------------------
def mistaken_export(export: Path, out: Path, mistake: str, verifier_vocab: int) -> Path:
    """A copy of a block drafter's or a P-EAGLE drafter's speculators export with one mistake: ``layers`` writes
    the 0-based target layers as vLLM's capture ids (no shift of one, the mistake vLLM #40727 is about); ``mask``
    another mask token id (the placeholder slots' token); ``mask_hidden`` P-EAGLE's learned placeholder state
    zeroed (what an exporter that dropped or renamed it would leave the engine)."""
    if out.exists():
        shutil.rmtree(out)
    shutil.copytree(export, out)
    if mistake == "mask_hidden":
        from safetensors.torch import load_file, save_file

        tensors = load_file(str(out / "model.safetensors"))
        if "mask_hidden" not in tensors:
            raise SpectrainError(f"{export} has no mask_hidden tensor (not a P-EAGLE export)")
        tensors["mask_hidden"] = torch.zeros_like(tensors["mask_hidden"])
        save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
        return out
    config = read_json(out / "config.json", "speculators config")
    if mistake == "layers":
        ids = [i - 1 for i in config["aux_hidden_state_layer_ids"]]
        if min(ids) < 1:  # vLLM's loader refuses capture id 0 (the embedding): shift up instead
            ids = [i + 2 for i in ids]
        config["aux_hidden_state_layer_ids"] = ids
    else:
        config["mask_token_id"] = (config["mask_token_id"] + 1) % verifier_vocab
    write_json(out / "config.json", config)
    return out


def mistaken_gguf(good: Path, out: Path, mistake: str, target_layers: int) -> Path:
    """A copy of an eagle3 GGUF with one mistake: ``layers`` (every target layer id + 1, or − 1 where + 1 would
    leave the target) or ``d2t`` (the map rolled by one: draft id i proposes draft id i + 1's target token)."""
    import gguf

    reader = gguf.GGUFReader(str(good), "r")
    meta = read_metadata(good)

    def fill(writer) -> None:
        for key, v in meta.items():
            if key.startswith("GGUF.") or key == "general.architecture":
                continue
            value = v.value
            if mistake == "layers" and key == f"{ARCH}.target_layers":
                value = shifted_layers(list(value), target_layers)
            if v.vtype == gguf.GGUFValueType.ARRAY:
                writer.add_key_value(key, list(value), v.vtype, sub_type=v.item_type)
            else:
                writer.add_key_value(key, value, v.vtype)
        for t in reader.tensors:
            data = np.array(t.data)
            if mistake == "d2t" and t.name == "d2t":
                data = np.roll(data, -1)
            # F32 as is; I64 (d2t) and any packed type (stored as bytes: gguf derives the shape) as stored
            writer.add_tensor(t.name, data, raw_dtype=None if t.tensor_type.name == "F32" else t.tensor_type)

    return write_gguf(out, ARCH, fill, force=True)
