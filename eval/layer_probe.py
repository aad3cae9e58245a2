"""A layer probe for EAGLE-3 exports: a drafter whose first draft at every position is decided by the sign of one
coordinate of one fused verifier layer, so an engine's accepted count at draft 1 is predicted exactly by our forward.

Why: a trained drafter fed the neighbouring layers' states (an off-by-one in the capture convention) accepts
nearly as much — the shipped EAGLE-3 under a file whose target layers are shifted by one moved τ by 3.2 % in
llama.cpp, inside any τ band. The probe makes the layer the only thing its drafts depend on:

    g = fc(aux)            fc's one nonzero weight copies aux slot ``slot``, coordinate ``dim`` into g_0
    attention = MLP = 0    the layer's output is its residual: g (or hidden_norm(g); the sign is the same)
    logits = lm_head(norm(g))   rows ±e_0: draft ``positive`` when g_0 > 0, ``negative`` when g_0 < 0, by
                                a margin of sqrt(h) over every other draft token (the final norm makes
                                |g_0| ≈ sqrt(h); less only where |g_0| nears the norm's eps)

The engine's accepted count per prompt is then a function of the text it emitted and of that one coordinate of
the layer our convention names (:func:`first_drafts`, :func:`predicted_acceptance`); a file that names other
layers drafts by another layer's signs, and the counts part from the prediction (:func:`choose_probe` picks the
coordinate where the named layer and its shifted neighbour disagree most on the engine's plain text;
:func:`probe_prediction` turns a probe's first drafts on the engine's own text into the row the check compares).
"""

from __future__ import annotations

from collections import Counter

import torch

from spectrain.heads.eagle import EagleDrafter, build_vocab_map
from spectrain.heads.errors import SpectrainError


def shifted_layers(ids: list[int], num_layers: int) -> list[int]:
    """The ids an off-by-one in the capture convention would write: every id + 1, or − 1 where + 1 would leave
    the target (the last layer's output is the final norm's input, which no engine captures)."""
    shift = 1 if max(ids) + 1 < num_layers else -1
    return [i + shift for i in ids]


def layer_probe(verifier, slot: int, dim: int, positive: int, negative: int, draft_vocab: int = 1024,
                aux_layer_ids: list[int] | None = None) -> EagleDrafter:
    """An EAGLE-3 drafter proposing verifier token ``positive`` where aux slot ``slot``'s coordinate ``dim`` is
    > 0 and ``negative`` where it is < 0 (see the module docstring)."""
    drafter = EagleDrafter.for_verifier(verifier, "eagle3", draft_vocab_size=draft_vocab,
                                        aux_layer_ids=aux_layer_ids, verifier_name="layer-probe")
    c = drafter.config
    if not 0 <= slot < len(c.aux_layer_ids) or not 0 <= dim < c.hidden_size:
        raise SpectrainError(f"layer probe: slot {slot} / dim {dim} outside {len(c.aux_layer_ids)} slots × "
                             f"{c.hidden_size} dims")
    if positive == negative:
        raise SpectrainError("layer probe: the two proposed tokens must differ")
    counts = torch.zeros(c.vocab_size, dtype=torch.long)
    counts[:draft_vocab] = 1  # a full draft vocabulary; the two proposed tokens ranked in first
    counts[positive] = counts[negative] = 2
    drafter.set_vocab_map(*build_vocab_map(counts, draft_vocab))
    rows = drafter.target_to_draft(torch.tensor([positive, negative]))
    with torch.no_grad():
        for p in drafter.parameters():
            p.zero_()
        for module in drafter.modules():  # every norm's weight 1: norms rescale, never flip a sign
            if module is not drafter and hasattr(module, "weight") and module.weight.dim() == 1:
                module.weight.fill_(1.0)
        drafter.fc.weight[0, slot * c.hidden_size + dim] = 1.0
        drafter.lm_head.weight[rows[0], 0] = 1.0
        drafter.lm_head.weight[rows[1], 0] = -1.0
    return drafter


@torch.no_grad()
def aux_states(verifier, ids: list[int], layers: list[int]) -> torch.Tensor:
    """(T, len(layers) * h): the verifier's HF ``hidden_states[i]`` for each i in ``layers`` over one sequence."""
    states = verifier(torch.tensor([ids]), output_hidden_states=True).hidden_states
    return torch.cat([states[i][0].float() for i in layers], dim=-1)


@torch.no_grad()
def first_drafts(drafter: EagleDrafter, verifier, ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Our drafter's first draft at every position of one sequence, by our own forward.

    Returns (drafts (T,), margins (T,)): ``drafts[j]`` is the token proposed for position j given ``ids[:j]``
    (j ≥ 2; EAGLE drafts x_{t+2} from the features at t and the token x_{t+1}; positions 0 and 1 are −1), and
    ``margins[j]`` its logit margin over the runner-up draft token."""
    aux = aux_states(verifier, ids, list(drafter.config.aux_layer_ids))
    tokens = torch.tensor([ids])
    hidden, _ = drafter(tokens[:, 1:], aux[None, :-1], verifier.get_input_embeddings())
    logits = drafter.logits(hidden)[0].float()
    top = logits.topk(2, dim=-1)
    drafts = torch.full((len(ids),), -1, dtype=torch.long)
    margins = torch.zeros(len(ids))
    drafts[2:] = drafter.draft_to_target(top.indices[:-1, 0])
    margins[2:] = (top.values[:-1, 0] - top.values[:-1, 1])
    return drafts, margins


def predicted_acceptance(outputs: list[list[int]], prompt_ids: list[list[int]], drafts: list[torch.Tensor]) -> list[dict]:
    """Per prompt, the accepted drafts and rounds of a draft-1 drafter that proposes ``drafts[i][j]`` for
    position j of prompt i's full sequence (prompt + output): round r verifies output position p (p = 1 after the
    prefill token), accepts it when it equals the draft and emits accepted + 1 tokens (as
    :func:`~spectrain.eval.engine_controls.predicted_acceptance` with a draft that depends on the
    position)."""
    out = []
    for tokens, prompt, proposed in zip(outputs, prompt_ids, drafts):
        n, p, accepted, rounds = len(tokens), 1, 0, 0
        while p < n:
            hit = int(tokens[p] == int(proposed[len(prompt) + p]))
            accepted += hit
            rounds += 1
            p += hit + 1
        out.append({"accepted": accepted, "rounds": rounds})
    return out


def choose_probe(verifier, layers: list[int], slot: int, sequences: list[tuple[list[int], list[int]]]) -> dict:
    """The probe's coordinate and tokens for aux slot ``slot``, from (prompt ids, output ids) pairs (an engine's
    plain greedy text): the two tokens emitted most, and the coordinate (and sign) whose sign best tells them
    apart at the layer ``layers[slot]`` *and* worst at the layer a shifted file would name, so the two files'
    acceptance differs most. Returns dim, positive, negative and the position counts behind the choice."""
    shifted = shifted_layers(layers, verifier.config.num_hidden_layers)
    follows = Counter(t for _, out in sequences for t in out[1:])
    if len(follows) < 2:
        raise SpectrainError("layer probe: the outputs hold fewer than two distinct tokens")
    (first, _), (second, _) = follows.most_common(2)
    own, other, sign = [], [], []
    for prompt, out in sequences:
        ids = prompt + out
        states = aux_states(verifier, ids, [layers[slot], shifted[slot]])
        h = states.shape[-1] // 2
        for p in range(1, len(out)):
            if out[p] in (first, second):
                t = len(prompt) + p - 2  # the features position that drafts output position p
                own.append(states[t, :h])
                other.append(states[t, h:])
                sign.append(1.0 if out[p] == first else -1.0)
    own, other, sign = torch.stack(own).sign(), torch.stack(other).sign(), torch.tensor(sign)[:, None]
    agree_own, agree_other = (own * sign).sum(0), (other * sign).sum(0)  # (h,): sign agreement, either polarity
    gain = torch.maximum(agree_own - agree_other, agree_other - agree_own)
    dim = int(gain.argmax())
    flip = bool(agree_own[dim] < agree_other[dim])  # the polarity under which the named layer agrees more
    positive, negative = (second, first) if flip else (first, second)
    m = len(sign)
    hits_own = int((m + (-1 if flip else 1) * agree_own[dim]) // 2)
    hits_other = int((m + (-1 if flip else 1) * agree_other[dim]) // 2)
    return {"slot": slot, "layer": layers[slot], "shifted_layer": shifted[slot], "dim": dim, "positive": positive,
            "negative": negative, "positions": m, "positions_told_apart_named_layer": hits_own,
            "positions_told_apart_shifted_layer": hits_other}


def default_probe_layers(verifier) -> list[int]:
    """The aux layers a probe reads: an EAGLE-3's default for this verifier (the shipped drafters' layers)."""
    return list(EagleDrafter.for_verifier(verifier, "eagle3", draft_vocab_size=8).config.aux_layer_ids)


def probe_prediction(probe: EagleDrafter, verifier, prompt_ids: list[list[int]], outputs: list[list[int]]) -> dict:
    """What a layer probe accepts at draft 1 on the text an engine emitted, by our forward, in the shape of
    :func:`~spectrain.eval.engine_compare.our_tau`'s row; ``min_margin``: the smallest logit margin of a first draft
    (> 0: no draft is a tie)."""
    drafted = [first_drafts(probe, verifier, p + o) for p, o in zip(prompt_ids, outputs)]
    per_prompt = predicted_acceptance(outputs, prompt_ids, [d for d, _ in drafted])
    accepted, rounds = sum(r["accepted"] for r in per_prompt), sum(r["rounds"] for r in per_prompt)
    margins = [float(m[len(p) + 1:len(p) + len(o)].min()) for (_, m), p, o in zip(drafted, prompt_ids, outputs)
               if len(o) > 1]
    return {"tau": sum(len(o) - 1 for o in outputs) / rounds if rounds else None, "alpha": None,
            "identical_to_ar": None, "accepted": accepted, "rounds": rounds,
            "accepted_per_prompt": [r["accepted"] for r in per_prompt], "min_margin": min(margins, default=None)}
