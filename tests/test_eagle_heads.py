"""EAGLE-1 / EAGLE-3 drafters: shapes, no verifier weights, vocabulary map, config checks, causality,
Llama-layer equivalence, KV cache, training-time test vs a naive reference, export/reload."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from spectrain.heads.eagle import (EagleConfig, EagleDecoderLayer, EagleDrafter, build_vocab_map, causal_mask,
                                   default_aux_layers, rotary_cos_sin, ttt_mask)
from spectrain.heads.errors import SpectrainError
from spectrain.heads.io import save_tensors
from spectrain.heads.verifier import verifier_features
from tests.conftest import make_verifier

VOCAB = 512  # large next to hidden=32, so a drafter's size is dominated by what it must not hold
ARCHS = [("llama", 8), ("qwen3", 2)]  # 8 layers: EAGLE-3's [2, N//2, N-3]; 2 layers: the small-N fallback
VARIANTS = ["eagle1", "eagle3"]


@pytest.fixture(scope="module")
def verifiers():
    cache = {}

    def get(arch: str = "llama", layers: int = 8, hidden: int = 32):
        key = (arch, layers, hidden)
        if key not in cache:
            cache[key] = make_verifier(arch, False, VOCAB, hidden=hidden, layers=layers).requires_grad_(False)
        return cache[key]

    return get


def make_drafter(verifier, variant: str, draft_vocab_size: int = 64, seed: int = 0) -> EagleDrafter:
    """A drafter with a frequency-based vocabulary map and every weight (norms too) randomized."""
    torch.manual_seed(seed)
    counts = torch.randint(0, 1000, (VOCAB,)) if variant == "eagle3" else None
    drafter = EagleDrafter.for_verifier(verifier, variant, draft_vocab_size=draft_vocab_size if variant == "eagle3"
                                        else None, token_counts=counts)
    with torch.no_grad():
        for p in drafter.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    return drafter.eval()


def features_for(drafter: EagleDrafter, verifier, input_ids: torch.Tensor) -> torch.Tensor:
    """(B, T) verifier input -> the drafter's feature input: last hidden (eagle1) or concatenated aux (eagle3)."""
    last, aux = verifier_features(verifier, input_ids, layer_ids=tuple(drafter.config.aux_layer_ids))
    return torch.cat(aux, -1) if drafter.is_eagle3 else last


def sample_batch(verifier, drafter, B=2, T=6, seed=1):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (B, T), generator=g)
    return ids, features_for(drafter, verifier, ids)


# -- shapes and what the state dict holds -------------------------------------------------------------------
@pytest.mark.parametrize("arch,layers", ARCHS)
@pytest.mark.parametrize("variant", VARIANTS)
def test_shapes(verifiers, arch, layers, variant):
    verifier = verifiers(arch, layers)
    drafter = make_drafter(verifier, variant)
    cfg = drafter.config
    ids, feats = sample_batch(verifier, drafter)
    embed, lm_head = verifier.get_input_embeddings(), verifier.get_output_embeddings()
    hidden, (k, v) = drafter(ids, feats, embed)
    assert hidden.shape == (2, 6, 32)
    assert k.shape == v.shape == (2, cfg.num_kv_heads, 6, cfg.head_dim)
    logits = drafter.logits(hidden, lm_head)
    assert logits.shape == (2, 6, 64 if variant == "eagle3" else VOCAB)
    if variant == "eagle3":
        assert cfg.aux_layer_ids == default_aux_layers(layers)
        assert drafter.fc.weight.shape == (32, len(cfg.aux_layer_ids) * 32)
        assert drafter.layer.self_attn.q_proj.weight.shape[1] == 64, "EAGLE-3 attention reads cat(embed, hidden)"
    else:
        assert drafter.fc.weight.shape == (32, 64)
        assert isinstance(drafter.layer.input_layernorm, torch.nn.Identity)
        with pytest.raises(SpectrainError, match="verifier's lm_head"):
            drafter.logits(hidden)


@pytest.mark.parametrize("variant", VARIANTS)
def test_state_dict_holds_no_verifier_tensors(verifiers, variant):
    verifier = verifiers()
    drafter = make_drafter(verifier, variant)
    state = drafter.state_dict()
    tops = {name.split(".")[0] for name in state}
    assert tops == ({"fc", "layer", "norm", "lm_head", "d2t", "t2d"} if variant == "eagle3" else {"fc", "layer"})
    assert not any("embed" in name for name in state)
    assert all(t.shape != (VOCAB, 32) for t in state.values()), "no copy of the verifier's embeddings or lm_head"
    drafter_numel = sum(t.numel() for t in state.values())
    verifier_numel = sum(p.numel() for p in verifier.parameters())
    assert drafter_numel < 0.25 * verifier_numel


# -- draft vocabulary -----------------------------------------------------------------------------------------
def test_vocab_map_round_trip(verifiers):
    counts = torch.zeros(VOCAB, dtype=torch.long)
    counts[[7, 300, 3, 511, 42]] = torch.tensor([50, 40, 40, 40, 10])  # 300, 3, 511 tie
    counts[100:110] = 5
    d2t, t2d = build_vocab_map(counts, 4)
    # Ranking: 7 (50), then the tie 3, 300, 511 (40) by id, then 42 (10): the top 4, sorted by id.
    chosen = torch.tensor([3, 7, 300, 511])
    assert torch.equal(torch.arange(4) + d2t, chosen)
    assert torch.equal(t2d.nonzero().flatten(), chosen)
    d2t, t2d = build_vocab_map(counts, 3)  # the tie now decides: 511 loses to the lower ids
    assert torch.equal(t2d.nonzero().flatten(), torch.tensor([3, 7, 300]))

    drafter = make_drafter(verifiers(), "eagle3", draft_vocab_size=16)
    d2t, t2d = build_vocab_map(counts, 16)
    drafter.set_vocab_map(d2t, t2d)
    expected = sorted(sorted(range(VOCAB), key=lambda i: (-int(counts[i]), i))[:16])
    targets = drafter.draft_to_target(torch.arange(16))
    assert targets.tolist() == expected
    assert drafter.t2d.nonzero().flatten().tolist() == expected
    assert torch.equal(drafter.target_to_draft(targets), torch.arange(16))
    assert drafter.target_to_draft(torch.tensor([1, 200])).tolist() == [-100, -100]  # not among the 16
    with pytest.raises(SpectrainError, match="exceeds"):
        build_vocab_map(counts, VOCAB + 1)
    with pytest.raises(SpectrainError, match="t2d must mark"):
        drafter.set_vocab_map(d2t, ~t2d)


# -- configuration ----------------------------------------------------------------------------------------------
BASE = dict(variant="eagle3", hidden_size=32, vocab_size=100, num_hidden_layers=8, num_heads=4, num_kv_heads=2,
            head_dim=8, intermediate_size=64)


@pytest.mark.parametrize("change,message", [
    (dict(draft_vocab_size=101), "exceeds the verifier's vocabulary"),
    (dict(aux_layer_ids=[2, 4, 2]), r"\[2, 4, 2\] repeat layer \[2\].*--model.aux_layer_ids '\[2, 4\]'"),
    # refused, not sorted: fc's input columns follow the ids' order (one rule: check_aux_layer_order)
    (dict(aux_layer_ids=[5, 2, 4]), r"\[5, 2, 4\] are not ascending.*--model.aux_layer_ids '\[2, 4, 5\]'"),
    (dict(aux_layer_ids=[4, 2, 4]), r"repeat layer \[4\] and are not ascending.*'\[2, 4\]'"),
    (dict(aux_layer_ids=[0, 4, 5]), "outside"),
    (dict(aux_layer_ids=[2, 4, 9]), "outside"),
    (dict(aux_layer_ids=[]), "at least one"),
    (dict(hidden_size=0), "hidden_size"),
    (dict(num_kv_heads=-1), "num_kv_heads"),
    (dict(intermediate_size=0), "intermediate_size"),
    (dict(variant="eagle2"), "variant"),
    (dict(variant="eagle1", aux_layer_ids=[2]), "eagle1 reads only"),
    (dict(variant="eagle1", draft_vocab_size=50), "must equal"),
])
def test_config_validation(change, message):
    EagleConfig(**BASE)  # the base is valid
    with pytest.raises(SpectrainError, match=message):
        EagleConfig(**{**BASE, **change})


def test_config_defaults():
    cfg = EagleConfig(**{**BASE, "vocab_size": 40000})
    assert cfg.draft_vocab_size == 32000 and cfg.aux_layer_ids == [2, 4, 5] and cfg.method == "eagle3"
    assert EagleConfig(**{**BASE, "variant": "eagle1"}).draft_vocab_size == 100
    for n in range(1, 40):
        ids = default_aux_layers(n)
        # distinct pre-norm layer inputs (hidden_states[n] is after the final norm: engines cannot capture it)
        assert len(ids) == len(set(ids)) == max(1, min(3, n - 1)) and all(1 <= i <= max(1, n - 1) for i in ids), (n, ids)
        if n >= 7:
            assert ids == [2, n // 2, n - 3]
        # what a run gets without --model.aux_layer_ids: ascending, so EagleConfig (and the engines) take it
        assert ids == sorted(set(ids)), (n, ids)
        assert EagleConfig(**{**BASE, "num_hidden_layers": n}).aux_layer_ids == ids


def test_recipes_name_no_unsorted_aux_layers():
    """What the recipes pass: every aux_layer_ids in configs/*.yaml is null (the ascending default) or ascending."""
    import inspect

    import yaml

    from spectrain.train.eagle import EagleModule

    assert inspect.signature(EagleModule).parameters["aux_layer_ids"].default is None
    recipes = sorted((Path(__file__).parents[1] / "configs").glob("*.yaml"))
    assert recipes
    for recipe in recipes:
        init = (yaml.safe_load(recipe.read_text()).get("model") or {}).get("init_args") or {}
        ids = init.get("aux_layer_ids")
        assert ids is None or ids == sorted(set(ids)), (recipe.name, ids)


def test_training_refuses_unsorted_aux_layers(verifier_factory):
    """Training no longer keeps an order the engines and the evaluator would not: the run stops before it starts."""
    from spectrain.train.eagle import EagleModule

    verifier_dir = verifier_factory("llama", False, layers=8)
    with pytest.raises(SpectrainError, match=r"\[5, 2, 4\] are not ascending.*--model.aux_layer_ids '\[2, 4, 5\]'"):
        EagleModule(variant="eagle3", verifier=str(verifier_dir), aux_layer_ids=[5, 2, 4])
    assert EagleModule(variant="eagle3", verifier=str(verifier_dir)).drafter.config.aux_layer_ids == [2, 4, 5]


def test_unsorted_aux_layers_on_disk_are_refused_by_name(tmp_path, verifiers):
    """An older checkpoint (or a hand-edited config) with layers out of order fails with the path and the fix, and
    the evaluator's drafter applies the same rule to a config changed after it was built."""
    from spectrain.eval.eagle import EagleChainDrafter
    from spectrain.heads.serving.formats import import_drafter

    verifier = verifiers()
    drafter = make_drafter(verifier, "eagle3")
    assert drafter.config.aux_layer_ids == [2, 4, 5]
    drafter.save_pretrained(tmp_path / "old")
    config = json.loads((tmp_path / "old" / "config.json").read_text())
    config["aux_layer_ids"] = [5, 2, 4]  # same fc width: without the rule this would load and run, silently wrong
    (tmp_path / "old" / "config.json").write_text(json.dumps(config))
    expected = r"old/config.json: EAGLE-3 aux_layer_ids \[5, 2, 4\] are not ascending.*'\[2, 4, 5\]'"
    with pytest.raises(SpectrainError, match=expected):
        EagleDrafter.from_pretrained(tmp_path / "old")
    with pytest.raises(SpectrainError, match=expected):  # the evaluator's and --init_from's loader
        import_drafter(tmp_path / "old", verifier_model=verifier)
    EagleChainDrafter(drafter, verifier, 3)
    drafter.config.aux_layer_ids = [5, 2, 4]
    with pytest.raises(SpectrainError, match=r"aux_layer_ids \[5, 2, 4\] are not ascending.*'\[2, 4, 5\]'"):
        EagleChainDrafter(drafter, verifier, 3)


# -- attention: causality, Llama equivalence, cache -------------------------------------------------------------
@pytest.mark.parametrize("variant", VARIANTS)
def test_later_tokens_do_not_change_earlier_outputs(verifiers, variant):
    verifier = verifiers("qwen3", 2)
    drafter = make_drafter(verifier, variant)
    embed = verifier.get_input_embeddings()
    ids, feats = sample_batch(verifier, drafter)
    ids2, feats2 = ids.clone(), feats.clone()
    ids2[:, -1] = (ids2[:, -1] + 1) % VOCAB
    feats2[:, -1] += 1.0
    out, _ = drafter(ids, feats, embed)
    out2, _ = drafter(ids2, feats2, embed)
    assert torch.equal(out[:, :-1], out2[:, :-1])
    assert not torch.allclose(out[:, -1], out2[:, -1])


def test_eagle1_layer_equals_llama_layer_without_input_norm(verifiers):
    """Our layer, with a Llama layer's weights, computes that layer (EAGLE-1 drops only the input norm)."""
    verifier = verifiers("llama", 2)
    hf_layer = verifier.model.layers[0]
    layer = EagleDecoderLayer(EagleConfig.for_verifier(verifier, "eagle1"))
    layer.load_state_dict({k: v for k, v in hf_layer.state_dict().items() if not k.startswith("input_layernorm")})
    ids = torch.randint(0, VOCAB, (2, 6))
    x = verifier.model.embed_tokens(ids)
    saved = hf_layer.input_layernorm
    try:
        hf_layer.input_layernorm = torch.nn.Identity()
        _, hidden = verifier_features(verifier, ids, layer_ids=(1,))  # hidden_states[1] = layer 0's output
    finally:
        hf_layer.input_layernorm = saved
    cos, sin = rotary_cos_sin(torch.arange(6).expand(2, 6), layer.self_attn.head_dim, 10000.0)
    out, _, _ = layer(x, cos, sin, causal_mask(6, 6)[None, None])
    torch.testing.assert_close(out, hidden[0], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("variant", VARIANTS)
def test_kv_cache_continuation_equals_full_forward(verifiers, variant):
    verifier = verifiers()
    drafter = make_drafter(verifier, variant)
    embed = verifier.get_input_embeddings()
    ids, feats = sample_batch(verifier, drafter, T=7)
    full, (k, v) = drafter(ids, feats, embed)
    head, kv = drafter(ids[:, :4], feats[:, :4], embed)
    tail, _ = drafter(ids[:, 4:], feats[:, 4:], embed, past_kv=kv)
    torch.testing.assert_close(torch.cat((head, tail), 1), full, rtol=1e-5, atol=1e-5)


# -- training-time test ------------------------------------------------------------------------------------------
def test_ttt_mask():
    m = ttt_mask(3, 2)
    assert m.shape == (3, 9)
    assert torch.equal(m[:, :3], torch.tril(torch.ones(3, 3, dtype=torch.bool)))
    assert torch.equal(m[:, 3:6], torch.eye(3, dtype=torch.bool)) and torch.equal(m[:, 6:], torch.eye(3, dtype=torch.bool))


def _rope(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """(B, T, heads, d) rotated at (T,) positions, written out in the half-split form."""
    d = x.shape[-1]
    angle = positions[:, None].double() * theta ** (-torch.arange(0, d, 2).double() / d)  # (T, d/2)
    cos, sin = angle.cos()[None, :, None].to(x.dtype), angle.sin()[None, :, None].to(x.dtype)
    x1, x2 = x[..., : d // 2], x[..., d // 2:]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), -1)


def ttt_reference(drafter: EagleDrafter, input_ids, aux, embed, steps: int) -> list[torch.Tensor]:
    """TTT spelled out: each query position gathers its allowed keys (step-0 keys <= t, then its own at steps 1..i)."""
    cfg, layer = drafter.config, drafter.layer
    attn = layer.self_attn
    B, T = input_ids.shape
    H, d, group = cfg.num_heads, cfg.head_dim, cfg.num_heads // cfg.num_kv_heads
    hidden = drafter.fc(aux)
    keys, values, logits = [], [], []
    for i in range(steps):
        ids = torch.zeros_like(input_ids)
        ids[:, :T - i] = input_ids[:, i:]
        attn_in = torch.cat((layer.input_layernorm(embed(ids)), layer.hidden_norm(hidden)), -1)
        pos = torch.arange(T) + i
        q = _rope(attn.q_proj(attn_in).view(B, T, H, d), pos, cfg.rope_theta)
        keys.append(_rope(attn.k_proj(attn_in).view(B, T, -1, d), pos, cfg.rope_theta))
        values.append(attn.v_proj(attn_in).view(B, T, -1, d))
        rows = []
        for t in range(T):
            ks = torch.cat([keys[0][:, :t + 1]] + [keys[j][:, t:t + 1] for j in range(1, i + 1)], 1)
            vs = torch.cat([values[0][:, :t + 1]] + [values[j][:, t:t + 1] for j in range(1, i + 1)], 1)
            ks, vs = ks.repeat_interleave(group, 2), vs.repeat_interleave(group, 2)  # (B, n, H, d)
            p = torch.softmax(torch.einsum("bhd,bnhd->bhn", q[:, t], ks) / d ** 0.5, -1)
            rows.append(torch.einsum("bhn,bnhd->bhd", p, vs).reshape(B, H * d))
        x = hidden + attn.o_proj(torch.stack(rows, 1))
        hidden = x + layer.mlp(layer.post_attention_layernorm(x))
        logits.append(drafter.lm_head(drafter.norm(hidden)))
    return logits


@pytest.mark.parametrize("arch,layers", ARCHS)
def test_ttt_forward_matches_naive_reference(verifiers, arch, layers):
    verifier = verifiers(arch, layers)
    drafter = make_drafter(verifier, "eagle3")
    embed = verifier.get_input_embeddings()
    ids, aux = sample_batch(verifier, drafter, T=5)
    with torch.no_grad():
        got = drafter.ttt_forward(ids, aux, embed, steps=3)
        want = ttt_reference(drafter, ids, aux, embed, steps=3)
        step0, _ = drafter(ids, aux, embed)
    assert len(got) == 3 and all(g.shape == (2, 5, 64) for g in got)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got[0], drafter.logits(step0), rtol=0, atol=0)
    eagle1 = make_drafter(verifier, "eagle1")  # eagle1 unrolls too, but predicts through the verifier's lm_head
    features = torch.randn(2, 5, verifier.config.hidden_size)
    with torch.no_grad():
        unrolled = eagle1.ttt_hidden(ids, features, embed, steps=2)
        single, _ = eagle1(ids, features, embed)
    torch.testing.assert_close(unrolled[0], single, rtol=0, atol=0)
    with pytest.raises(SpectrainError, match="lm_head"):
        eagle1.ttt_forward(ids, features, embed, steps=2)


# -- export / reload ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("arch,layers", ARCHS)
@pytest.mark.parametrize("variant", VARIANTS)
def test_save_load_identical_logits(tmp_path, verifiers, arch, layers, variant):
    verifier = verifiers(arch, layers)
    drafter = make_drafter(verifier, variant)
    drafter.save_pretrained(tmp_path / "eagle")
    assert sorted(p.name for p in (tmp_path / "eagle").iterdir()) == ["config.json", "model.safetensors"]
    again = EagleDrafter.from_pretrained(tmp_path / "eagle", verifier_model=verifier)
    assert again.config == drafter.config
    ids, feats = sample_batch(verifier, drafter)
    embed, lm_head = verifier.get_input_embeddings(), verifier.get_output_embeddings()
    with torch.no_grad():
        want = drafter.logits(drafter(ids, feats, embed)[0], lm_head)
        got = again.logits(again(ids, feats, embed)[0], lm_head)
    assert torch.equal(got, want)
    if variant == "eagle3":
        assert torch.equal(again.d2t, drafter.d2t) and torch.equal(again.t2d, drafter.t2d)


def test_load_refuses_other_verifier_and_stray_tensors(tmp_path, verifiers):
    verifier = verifiers()
    drafter = make_drafter(verifier, "eagle3")
    drafter.save_pretrained(tmp_path / "eagle")
    with pytest.raises(SpectrainError, match="hidden size 32.*verifier's is 48"):
        EagleDrafter.from_pretrained(tmp_path / "eagle", verifier_model=verifiers("llama", 8, hidden=48))
    with pytest.raises(SpectrainError, match="8-layer verifier, but this verifier has 2"):
        EagleDrafter.from_pretrained(tmp_path / "eagle", verifier_model=verifiers("llama", 2))
    save_tensors(tmp_path / "eagle" / "model.safetensors",
                 {**drafter.state_dict(), "embed_tokens.weight": verifier.get_input_embeddings().weight})
    with pytest.raises(SpectrainError, match="unexpected .*embed_tokens"):
        EagleDrafter.from_pretrained(tmp_path / "eagle")


@pytest.mark.parametrize("arch,layers", ARCHS)
def test_ttt_diagonal_attention_equals_the_masked_attention_with_gradients(verifiers, arch, layers):
    """forward_ttt (step-0 causal block + one own-key score per later step) == one SDPA over all steps' keys
    under ttt_mask, in outputs and in gradients (GQA verifiers included)."""
    from spectrain.heads.eagle import _shift_left

    verifier = verifiers(arch, layers)
    drafter = make_drafter(verifier, "eagle3")
    embed = verifier.get_input_embeddings()
    ids, aux = sample_batch(verifier, drafter, T=6)

    def masked(steps):  # the reference: every earlier step's keys concatenated, ttt_mask over them
        B, T = ids.shape
        base = torch.arange(T).expand(B, T)
        hidden, keys, values, outs = drafter.fuse(aux), [], [], []
        for step in range(steps):
            past = (torch.cat(keys, 2), torch.cat(values, 2)) if keys else None
            hidden, (k, v) = drafter.forward_hidden(_shift_left(ids, step, 0), hidden, embed, position_ids=base + step,
                                                    attn_mask=ttt_mask(T, step)[None, None], past_kv=past)
            keys.append(k)
            values.append(v)
            outs.append(hidden)
        return outs

    results = []
    for run in (lambda: drafter.ttt_hidden(ids, aux, embed, steps=4), lambda: masked(4)):
        drafter.zero_grad()
        outs = run()
        sum((o * torch.randn(o.shape, generator=torch.Generator().manual_seed(i))).sum()
            for i, o in enumerate(outs)).backward()
        results.append(([o.detach() for o in outs],
                        {n: p.grad.clone() for n, p in drafter.named_parameters() if p.grad is not None}))
    (got, got_grads), (want, want_grads) = results
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)
    for name in want_grads:
        torch.testing.assert_close(got_grads[name], want_grads[name], rtol=1e-4, atol=1e-5)
