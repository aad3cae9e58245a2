"""P-EAGLE (parallel drafting): one drafter forward drafts the round; training and decoding see the same rows.

The training pass (every position's depth-0 row and many chains' placeholders, through the chain mask, which is
speculators' flat-sequence mask) gives each chain the logits the decoding pass gives (the drafter's cache of the
context up to the anchor, then the placeholders, causally), over one round or several; a few steps lower the loss;
T = 0 output equals AR; at T = 1 the emitted tokens follow the verifier's distribution (χ², with a negative
control); an EAGLE-3 drafter warm-starts it; the speculators P-EAGLE export round-trips, is claimed by its format
alone and a mistaken one is refused naming the problem."""

from __future__ import annotations

import json
from dataclasses import asdict

import pytest
import torch
from safetensors.torch import load_file, save_file

from spectrain.eval.decode import generate
from spectrain.eval.drafters import Autoregressive, DraftState
from spectrain.eval.peagle import PEagleChainDrafter
from spectrain.eval.static_model import StaticCausalLM
from spectrain.heads.eagle import EagleDrafter
from spectrain.heads.errors import SpectrainError
from spectrain.heads.families import family_of
from spectrain.heads.peagle import PEagleConfig, PEagleDrafter
from spectrain.heads.serving.families import serving_formats
from spectrain.heads.serving.formats import detect_format, export_drafter, import_drafter, validate_export
from spectrain.heads.vocab import build_vocab_map
from tests.conftest import make_verifier
from tests.eval_helpers import bigram_verifier
from tests.test_ranked_heads import SAMPLING, p_values

PROMPT = [3, 17, 42, 7]


@pytest.fixture(scope="module")
def verifier():
    return make_verifier("llama", False, 200, hidden=32, layers=8)


def drafter_for(model, seed: int = 0, **kw) -> PEagleDrafter:
    torch.manual_seed(seed)
    drafter = PEagleDrafter.for_verifier(model, **{"num_layers": 2, "num_depths": 4, "draft_vocab_size": 100,
                                                   "verifier_name": "v", **kw})
    counts = torch.arange(drafter.config.vocab_size, 0, -1).float()  # a map that is not the identity
    counts[::3] += 1000
    drafter.set_vocab_map(*build_vocab_map(counts, drafter.config.draft_vocab_size))
    return drafter.eval()


def test_config_defaults_family_and_refusals(verifier):
    c = PEagleConfig.for_verifier(verifier)
    assert (c.method, c.num_layers, c.num_depths, c.embedding, c.variant) == ("peagle", 1, 8, "verifier", "eagle3")
    assert c.aux_layer_ids == [2, 4, 5] and c.mask_token_id == 199  # no tokenizer: the last id
    drafter = PEagleDrafter(c)
    assert family_of(drafter).name == "peagle" and family_of(drafter).label == "P-EAGLE"
    assert tuple(drafter.mask_hidden.shape) == (1, 1, 3 * 32) and "embed_tokens.weight" not in drafter.state_dict()
    for bad, match in ((dict(num_layers=0), "num_layers"), (dict(mask_token_id=200), "outside the vocabulary"),
                       (dict(embedding="tied"), "embedding"), (dict(norm_output=True), "norm_output"),
                       (dict(aux_layer_ids=[5, 2]), "ascending")):
        with pytest.raises(SpectrainError, match=match):
            PEagleConfig.for_verifier(verifier, **bad)
    with pytest.raises(SpectrainError, match="1 to 4 tokens per round, not 5"):
        PEagleChainDrafter(drafter_for(verifier), verifier, 5)
    with pytest.raises(SpectrainError, match="draft vocabulary it was trained with"):
        PEagleChainDrafter(drafter_for(verifier), verifier, 2, vocab=torch.arange(50))


@pytest.mark.parametrize("embedding", ["verifier", "own"])
def test_save_load_round_trip(verifier, tmp_path, embedding):
    drafter = drafter_for(verifier, embedding=embedding, norm_before_fc=True)
    assert ("embed_tokens.weight" in drafter.state_dict()) == (embedding == "own")
    drafter.save_pretrained(tmp_path)
    back = PEagleDrafter.from_pretrained(tmp_path, verifier)
    assert back.config == drafter.config
    assert all(torch.equal(a, b) for a, b in zip(back.state_dict().values(), drafter.state_dict().values()))
    with pytest.raises(SpectrainError, match="10"):  # other fused layers' ids on a deeper verifier
        PEagleDrafter.from_pretrained(tmp_path, make_verifier("llama", False, 200, hidden=32, layers=10))


def _state(ids: torch.Tensor, feats: torch.Tensor, start: int, end: int) -> DraftState:
    """The decoder's hand-over after positions start..end-1 were committed: their features, each with the token after
    it; the root is ids[end]."""
    return DraftState(tokens=ids, length=end + 1, hidden=feats[end - 1], sampling=SAMPLING,
                      new_features=feats[start:end], new_tokens=ids[start + 1:end + 1])


@pytest.mark.parametrize("kw", [{}, {"embedding": "own", "norm_before_residual": True, "norm_before_fc": True}],
                         ids=["verifier-embedding", "own-embedding+norms"])
def test_the_training_rows_equal_the_decoding_drafts(verifier_factory, kw, monkeypatch):
    """Logits of two chains from the one training pass (depth-0 rows + placeholders through the chain mask) == the
    decoding drafter's round at each anchor: its cache of positions <= a (filled over two rounds), then the
    placeholders, causally."""
    import spectrain.train.peagle as peagle_train
    from spectrain.train.peagle import PEagleModule

    torch.manual_seed(0)
    module = PEagleModule(verifier=str(verifier_factory("llama", False, layers=8)), verifier_dtype="float32",
                          num_layers=2, num_depths=4, draft_vocab_size=64, warmup_steps=0, **kw)
    drafter = module.drafter.eval()
    with torch.no_grad():
        drafter.mask_hidden.mul_(3.0)  # placeholders far from any real input: a leak would show
    T = 24
    ids = torch.randint(0, 300, (1, T))
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "loss_mask": torch.ones_like(ids)}
    features = module.features(batch)
    anchors = torch.tensor([[6, 15]])
    monkeypatch.setattr(peagle_train, "sample_anchors",
                        lambda valid, count, generator=None: (anchors, torch.ones_like(anchors, dtype=torch.bool)))
    with torch.no_grad():
        run = module.chains(batch, features, 2)
        train_logits = drafter.logits(torch.cat([run["out0"][0, anchors[0], None], run["outm"][0]], 1))
    feats = torch.cat(features["layers"], -1)[0]
    chain = PEagleChainDrafter(drafter, module.verifier, 4)
    for i, a in enumerate(anchors[0].tolist()):
        state = _state(ids[0], feats, 0, a - 2)
        chain.start(state, None)
        with torch.no_grad():
            chain.slot_logits(state)  # a first round: positions 0..a-3
            decoded = chain.slot_logits(_state(ids[0], feats, a - 2, a + 1))  # the rest, up to the anchor
        torch.testing.assert_close(decoded, train_logits[i], atol=1e-5, rtol=1e-5)
    assert run["valid"].all() and run["target_at"][0, 0].tolist() == [7, 8, 9, 10]


def test_the_chain_mask_is_the_references_flat_mask():
    """speculators' ``create_peagle_mask_mod`` over the flat sequence [depth-0 rows | chains]: a row (anchor a,
    depth d) sees (a', d') iff d' == 0 and a' <= a, or a' == a and d' <= d. The two streams' masks (causal for
    depth 0, ``chain_mask`` for the placeholders) are its two row blocks."""
    from spectrain.train.peagle import chain_mask

    T, K = 12, 4
    anchors = torch.tensor([[3, 9, 0]])
    rows = [(t, 0) for t in range(T)] + [(a, d) for a in anchors[0].tolist() for d in range(1, K)]
    flat = torch.tensor([[(dk == 0 and ak <= aq) or (ak == aq and dk <= dq) for ak, dk in rows] for aq, dq in rows])
    causal = torch.tril(torch.ones(T, T, dtype=torch.bool))
    assert torch.equal(flat[:T], torch.cat([causal, torch.zeros(T, len(rows) - T, dtype=torch.bool)], 1))
    assert torch.equal(flat[T:], chain_mask(anchors, torch.ones(1, T), K)[0, 0])
    attended = torch.ones(1, T)
    attended[0, 2] = 0  # a masked-out context position is never seen
    assert not chain_mask(anchors, attended, K)[0, 0, :, 2].any()


def test_a_few_steps_lower_the_loss_and_measure_tau(verifier_factory, tmp_path):
    """Lightning steps (the loss falls; measured tau decodes through the evaluator), then the run dir evaluates with
    --method peagle (T = 0 identical to AR) and reloads."""
    from spectrain.eval.cli import parse_args
    from spectrain.eval.evaluate import EvalSettings, evaluate_drafter, load_drafter
    from spectrain.heads.verifier import load_verifier
    from spectrain.train.peagle import PEagleModule
    from tests.test_families import train_a_few_steps

    verifier_dir = str(verifier_factory("llama", False, layers=8))
    module = train_a_few_steps(PEagleModule, verifier_dir, measure_k=3)
    metrics = module.last_val_metrics
    assert {"tau_measured", "tau_pred", "step1_top1_ver", "step8_top1_ver", "draft_vocab_coverage"} <= set(metrics)
    run = module.export(tmp_path / "run", module.plain_drafter())
    verifier = load_verifier(verifier_dir, dtype=torch.float32)
    drafter = load_drafter(str(run), verifier, "peagle")
    assert isinstance(drafter, PEagleDrafter) and parse_args(["--method", "peagle"]).method == "peagle"
    settings = EvalSettings(k=5, max_new_tokens=12, hf_generate=0, costs=False, chat_template=False)
    result = evaluate_drafter(verifier, [["the king sat on the mat"], ["where is the river"]], "peagle", settings,
                              drafter=drafter)
    assert result.results["chain-5"]["identical_to_ar"]
    with pytest.raises(SpectrainError, match="exceeds the 8 depths"):
        PEagleModule(verifier=verifier_dir, verifier_dtype="float32", measure_prompts=1, measure_k=9)


def _batch(vocab: int, T: int = 20, B: int = 2, seed: int = 3) -> dict:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (B, T), generator=g)
    loss_mask = torch.ones_like(ids)
    loss_mask[:, :5] = 0  # a prompt
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "loss_mask": loss_mask}


def test_the_loss_weighs_depths_and_keeps_chain_rows_only(verifier_factory):
    """Depth d's loss covers exactly the chains whose depths 1..d have targets, weighted max(r^d, r_min)."""
    from spectrain.train.peagle import PEagleModule, depth_weight

    module = PEagleModule(verifier=str(verifier_factory("llama", False, layers=8)), verifier_dtype="float32",
                          num_depths=4, anchors=6, draft_vocab_size=64, drop_outside_vocab=False, warmup_steps=0)
    batch = _batch(module.verifier_lm_head.weight.shape[0])
    features = module.features(batch)
    with torch.no_grad():
        loss, parts = module.drafter_loss(batch, features)
    assert set(parts) == {"depth0_ce", "depth1_ce", "depth2_ce", "depth3_ce"}
    weights = [depth_weight(d, "cod", 0.7, 0.2) for d in range(4)]
    assert weights == pytest.approx([1.0, 0.7, 0.49, 0.343])
    assert float(loss) == pytest.approx(sum(w * float(parts[f"depth{d}_ce"]) for d, w in enumerate(weights))
                                        / sum(weights), rel=1e-5)
    run = module.chains(batch, features, 6)
    T, a = 20, run["anchors"]
    for d in range(1, 4):  # depth d has a target iff a + 2 + d is inside the row (every token after 5 is a target)
        assert torch.equal(run["valid"][..., d], a + 2 + d <= T - 1)
    assert (a >= 2).all()  # the depth-1 target a + 3 lies past the prompt


def test_warm_start_from_an_eagle3_drafter(verifier_factory, tmp_path):
    """init_from an EAGLE-3 run dir copies fc, the layer, norm, lm_head and the vocabulary map; depth 0 is then
    EAGLE-3's first draft exactly. Other fused layers or another draft vocabulary are refused by name."""
    from spectrain.heads.verifier import drafter_embedding, load_verifier
    from spectrain.train.peagle import PEagleModule

    verifier_dir = str(verifier_factory("llama", False, layers=8))
    model = load_verifier(verifier_dir, dtype=torch.float32).model
    torch.manual_seed(1)
    eagle = EagleDrafter.for_verifier(model, "eagle3", draft_vocab_size=64, norm_before_residual=True,
                                      norm_output=True).eval()
    counts = torch.rand(model.config.vocab_size)
    eagle.set_vocab_map(*build_vocab_map(counts, 64))
    eagle.save_pretrained(tmp_path / "eagle3")
    module = PEagleModule(verifier=verifier_dir, verifier_dtype="float32", draft_vocab_size=64, num_depths=4,
                          norm_before_residual=True, init_from=str(tmp_path / "eagle3"))
    ours, theirs = module.drafter.state_dict(), eagle.state_dict()
    for name, value in theirs.items():
        assert torch.equal(ours[name.replace("layer.", "layers.0.", 1) if name.startswith("layer.") else name], value)
    ids = torch.randint(0, 300, (1, 16))
    feats = torch.cat(module.features({"input_ids": ids, "attention_mask": torch.ones_like(ids),
                                       "loss_mask": torch.ones_like(ids)})["layers"], -1)
    embed = drafter_embedding(module.verifier)
    with torch.no_grad():
        expected = eagle.ttt_forward(ids, feats, embed, steps=1)[0]
        out, _ = module.drafter.eval()(ids, feats, embed, torch.arange(16)[None])
        torch.testing.assert_close(module.drafter.logits(out), expected, atol=1e-5, rtol=1e-5)
    with pytest.raises(SpectrainError, match="draft_vocab_size 64, this P-EAGLE 32: pass --model.draft_vocab_size 64"):
        PEagleModule(verifier=verifier_dir, verifier_dtype="float32", draft_vocab_size=32,
                     norm_before_residual=True, init_from=str(tmp_path / "eagle3"))
    with pytest.raises(SpectrainError, match="norm_before_residual True.*pass --model.norm_before_residual true"):
        PEagleModule(verifier=verifier_dir, verifier_dtype="float32", draft_vocab_size=64,
                     init_from=str(tmp_path / "eagle3"))


def _logits(drafter: PEagleDrafter, model, k: int = 4) -> torch.Tensor:
    """A round's (k, D) logits after PROMPT-like context on ``model``: what a decode would draft."""
    runner = StaticCausalLM(model, max_len=32)
    runner.capture = tuple(drafter.config.aux_layer_ids)
    tokens = torch.zeros(32, dtype=torch.long)
    tokens[:6] = torch.tensor([3, 17, 42, 7, 9, 11])
    runner.forward(tokens[:5])
    state = DraftState(tokens=tokens, length=6, hidden=None, sampling=SAMPLING, new_features=runner.aux,
                       new_tokens=tokens[1:6])
    chain = PEagleChainDrafter(drafter, model, k)
    chain.start(state, None)
    with torch.no_grad():
        return chain.slot_logits(state)


@pytest.mark.parametrize("kw", [{}, {"embedding": "own", "norm_before_fc": True, "num_layers": 3}],
                         ids=["1-frozen-embedding", "3-own-embedding"])
def test_export_validates_is_claimed_alone_and_imports_identically(verifier, tmp_path, kw):
    drafter = drafter_for(verifier, seed=2, **{"num_layers": 1, **kw})
    out = export_drafter(drafter, "speculators-peagle", tmp_path / "x", speculative_tokens=3)
    config = json.loads((out / "config.json").read_text())
    assert (config["speculators_model_type"], config["architectures"]) == ("peagle", ["PEagleSpeculator"])
    assert config["mask_token_id"] == 199
    assert config["transformer_layer_config"]["num_hidden_layers"] == drafter.config.num_layers
    assert config["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 3
    assert set(validate_export(out, "speculators-peagle")) == set(drafter.state_dict())  # nothing optional written
    assert [s.name for s in serving_formats().values() if s.detect(config)] == ["speculators-peagle"]
    assert detect_format(out) == "speculators-peagle"
    back = import_drafter(out, verifier_model=verifier)
    assert type(back) is PEagleDrafter
    assert {**asdict(back.config), "rope_scaling": None} == {**asdict(drafter.config), "rope_scaling": None}
    torch.testing.assert_close(_logits(back.eval(), verifier), _logits(drafter, verifier), atol=0, rtol=0)
    with pytest.raises(SpectrainError, match="trained for 4 depths"):
        export_drafter(drafter, "speculators-peagle", tmp_path / "y", speculative_tokens=5)


def _edit(out, config_edit=None, drop=()):
    if config_edit:
        config = json.loads((out / "config.json").read_text())
        config_edit(config)
        (out / "config.json").write_text(json.dumps(config))
    if drop:
        tensors = load_file(out / "model.safetensors")
        save_file({k: v for k, v in tensors.items() if k not in drop}, out / "model.safetensors")


@pytest.mark.parametrize("config_edit,drop,message", [
    (None, ("mask_hidden",), r"missing \['mask_hidden'\]"),
    (lambda c: c.pop("mask_token_id"), (), "mask_token_id is missing"),
    (lambda c: c.update(mask_token_id=5), (), "mask_token_id 5 but the drafter was trained with 199"),
    (lambda c: c.update(mask_token_id=200), (), "mask_token_id 200 is outside the vocabulary of 200"),
    (lambda c: c["speculators_config"]["proposal_methods"][0].update(speculative_tokens=6), (),
     "speculative_tokens 6 exceeds the 4 depths"),
    (lambda c: c.update(fc_norm=True), (), "fc_norm"),
    (lambda c: c.update(embed_requires_grad=True), (), r"missing \['embed_tokens.weight'\]"),
    (lambda c: c["transformer_layer_config"].update(num_hidden_layers=3), (), r"missing \['layers.2"),
    (lambda c: c["speculators_config"]["verifier"].update(name_or_path=""), (), "name_or_path is missing"),
], ids=["no-mask-hidden", "no-mask-token", "other-mask-token", "mask-token-outside", "k-beyond-depths", "fc-norm",
        "trained-embedding-missing", "layer-count", "no-verifier-name"])
def test_a_mistaken_export_is_refused_naming_the_problem(verifier, tmp_path, config_edit, drop, message):
    out = export_drafter(drafter_for(verifier), "speculators-peagle", tmp_path / "x")
    _edit(out, config_edit, drop)
    with pytest.raises(SpectrainError, match=message):
        validate_export(out, "speculators-peagle")
    with pytest.raises(SpectrainError, match="not a valid speculators-peagle export"):
        import_drafter(out, verifier_model=verifier)


def test_a_foreign_checkpoint_as_speculators_ships_it(verifier, tmp_path):
    """speculators saves its trained embedding and no ``spectrain`` record, and omits norm_before_residual (false for
    P-EAGLE): imported with its own table; qwen3 draft layers (its default draft_arch) are refused with the reason."""
    drafter = drafter_for(verifier, seed=4, num_layers=1)
    out = export_drafter(drafter, "speculators-peagle", tmp_path / "x")
    table = verifier.get_input_embeddings().weight.detach() + 0.01

    def foreign(c):
        for key in ("spectrain", "norm_before_residual"):
            c.pop(key)
        c["embed_requires_grad"] = True

    _edit(out, foreign)
    tensors = load_file(out / "model.safetensors")
    save_file({**tensors, "embed_tokens.weight": table.contiguous()}, out / "model.safetensors")
    back = import_drafter(out, verifier_model=verifier)
    assert back.config.embedding == "own" and not back.config.norm_before_residual
    assert torch.equal(back.embed_tokens.weight, table) and back.config.num_depths == 4
    with pytest.raises(SpectrainError, match="pass the verifier"):
        import_drafter(out)
    _edit(out, lambda c: c["transformer_layer_config"].update(model_type="qwen3"))
    save_file({**tensors, "embed_tokens.weight": table.contiguous(),
               **{f"layers.0.self_attn.{n}_norm.weight": torch.ones(8) for n in "qk"}}, out / "model.safetensors")
    validate_export(out, "speculators-peagle")  # the engine's view: a qwen3 layer with its q / k norms
    with pytest.raises(SpectrainError, match="qwen3"):
        import_drafter(out, verifier_model=verifier)


def test_no_gguf_for_p_eagle(verifier):
    from spectrain.heads.serving.gguf import check_gguf_exportable

    with pytest.raises(SpectrainError, match="no loader for P-EAGLE drafts"):
        check_gguf_exportable(drafter_for(verifier))


# -- decoding: lossless at T = 0 and T > 0 ------------------------------------------------------------------------
class OracleChain(PEagleChainDrafter):
    """Slot logits following the bigram verifier's chain from the root plus noise (many drafts accepted, some
    rejected). Only ``slot_logits`` is replaced: the drafter's cache is still filled and checked, and sampling, the
    draft vocabulary's mapping and p are the drafter's own."""

    noise = 2.0

    def slot_logits(self, state):
        PEagleChainDrafter.slot_logits(self, state)  # the drafter's own pass still fills and checks its cache
        token, rows = state.tokens[state.length - 1], []
        g = torch.Generator().manual_seed(int(token) * 7 + state.length)
        for _ in range(self.k):
            embedded = self._verifier.get_input_embeddings()(token[None])
            row = (embedded @ self._verifier.get_output_embeddings().weight.T)[0]
            rows.append(row[self.draft_ids] + self.noise * torch.randn(self.draft_ids.numel(), generator=g))
            token = self.draft_ids[rows[-1].argmax()]
        return torch.stack(rows).float()


def oracle(model, k: int, noise: float, **kw) -> OracleChain:
    drafter = OracleChain(drafter_for(model, **{"draft_vocab_size": 240, **kw}), model, k)
    drafter._verifier, drafter.noise = model, noise
    return drafter


@pytest.fixture(scope="module")
def bigram():
    return bigram_verifier("llama", layers=8, mix=0.1)


@pytest.mark.parametrize("kw", [{}, {"embedding": "own", "num_layers": 3, "norm_before_residual": True}],
                         ids=["1-layer", "3-layers-own-embedding"])
def test_greedy_chains_equal_ar(bigram, kw):
    model, _ = bigram
    runner = StaticCausalLM(model, max_len=96)
    ar = generate(runner, Autoregressive(), PROMPT, 40).tokens
    drafted = generate(runner, oracle(model, 4, 25.0, **kw), PROMPT, 40)
    assert drafted.tokens == ar
    assert max(drafted.accept_lengths) >= 2 and min(drafted.accept_lengths) < 4  # drafts accepted and rejected
    for k in (1, 3, 4):  # a random drafter, every path of the loop
        assert generate(runner, PEagleChainDrafter(drafter_for(model, **kw), model, k), PROMPT, 40).tokens == ar


@pytest.fixture(scope="module")
def soft():
    """The bigram verifier with a 10x smaller lm_head: soft next-token distributions."""
    model = bigram_verifier("llama", layers=8, mix=0.3, seed=2)[0]
    model.get_output_embeddings().weight.data.mul_(0.1)
    return model


def test_sampled_chains_follow_the_verifier_distribution(soft):
    p = p_values(soft, oracle(soft, 2, 0.5))
    assert len(p) == 2 and min(p) > 1e-3  # the round's first and second tokens both tested


class WrongDepthP(OracleChain):
    """Each draft sampled from its own depth's distribution, but depth 0's reported as every draft's p."""

    def propose(self, state):
        proposal = super().propose(state)
        if proposal.probs is not None:
            proposal.probs = proposal.probs[:1].expand_as(proposal.probs).clone()
        return proposal


def test_reporting_another_depths_p_is_detected(soft):
    drafter = WrongDepthP(drafter_for(soft, draft_vocab_size=240), soft, 2)
    drafter._verifier, drafter.noise = soft, 0.5
    assert min(p_values(soft, drafter)) < 1e-4  # (the lossless drafter: > 1e-3; seeded draws, 2.4e-5 here)


def test_engine_check_control_and_mistaken_exports(verifier, tmp_path):
    """The vLLM check's P-EAGLE control drafts its token at every depth of the parallel pass through d2t alone,
    read back from its speculators export (the layout vLLM gets): with another d2t it drafts another token. The two
    mistaken exports change only the placeholder token or the placeholder state, and move the placeholder depths'
    logits, not the first depth's."""
    from spectrain.eval.engine_controls import mistaken_export, peagle_control

    token = 50
    control = peagle_control(verifier, token, 3, draft_vocab=100)
    back = import_drafter(export_drafter(control, "speculators-peagle", tmp_path / "control", verifier_name="v"),
                          verifier_model=verifier).eval()
    logits = _logits(back, verifier, k=3)
    assert back.draft_to_target(logits.argmax(-1)).tolist() == [token] * 3
    with torch.no_grad():
        back.d2t[0] += 1  # draft id 0 now maps to the next target id
    assert back.draft_to_target(_logits(back, verifier, k=3).argmax(-1)).tolist() != [token] * 3

    drafter = drafter_for(verifier, seed=4, num_layers=1, num_depths=3)
    export = export_drafter(drafter, "speculators-peagle", tmp_path / "right", verifier_name="v")
    right = _logits(import_drafter(export, verifier_model=verifier).eval(), verifier, k=3)
    base = json.loads((export / "config.json").read_text())
    for mistake in ("mask", "mask_hidden"):
        wrong_dir = mistaken_export(export, tmp_path / mistake, mistake, 200)
        config = json.loads((wrong_dir / "config.json").read_text())
        assert {k for k in base if base[k] != config[k]} == ({"mask_token_id"} if mistake == "mask" else set())
        tensors, good = load_file(str(wrong_dir / "model.safetensors")), load_file(str(export / "model.safetensors"))
        assert {k for k in good if not torch.equal(good[k], tensors[k])} == (
            {"mask_hidden"} if mistake == "mask_hidden" else set())
        config_ok = {**config, "spectrain": {**config["spectrain"], "mask_token_id": config["mask_token_id"]}}
        (wrong_dir / "config.json").write_text(json.dumps(config_ok))  # our record agrees, so ours imports it
        wrong = _logits(import_drafter(wrong_dir, verifier_model=verifier).eval(), verifier, k=3)
        torch.testing.assert_close(wrong[0], right[0], atol=0, rtol=0)  # depth 0 reads no placeholder
        assert not torch.allclose(wrong[1:], right[1:])


def test_engine_check_verdict_on_placeholder_depths():
    """A P-EAGLE mistaken export has nothing the engine resolves to read: it is caught only when the engine's
    accepted tokens at the placeholder depths (positions 1..) differ from what it accepted with the right export;
    per-position acceptance is recorded beside ours on every row."""
    from spectrain.eval.engine_verdicts import vllm_verdict as judge

    greedy = [[5, 7, 7, 9]]
    ours = {"tau": 1.4, "accepted": 40, "rounds": 100, "accepted_per_pos": [35, 5, 0]}

    def run(per_pos, outputs=greedy):
        return {"token_ids": outputs, "mean_acceptance_length": 1 + sum(per_pos) / 100,
                "counters": {"num_accepted_tokens": sum(per_pos), "num_drafts": 100},
                "accepted_per_pos": per_pos, "generate_seconds": 1.0}

    ok, _, found = judge({}, run([35, 5, 0]), ours, greedy, 0.1, 7, 3)
    assert ok and found["per_pos_equal"] and found["accepted_per_pos_ours"] == [35, 5, 0]
    assert not judge({}, run([35, 4, 1]), ours, greedy, 0.1, 7, 3)[2]["per_pos_equal"]
    parallel = {"parallel": True}  # a P-EAGLE drafter: every position within the tolerance (one token allowed)
    assert judge(parallel, run([36, 4, 1]), ours, greedy, 0.1, 7, 3)[0]
    ok, note, _ = judge(parallel, run([38, 2, 0]), ours, greedy, 0.1, 7, 3)  # τ inside the band, depth 1 not
    assert not ok and "accepted per position [38, 2, 0] vs ours [35, 5, 0]" in note
    assert not judge(parallel, run([35, 5]), ours, greedy, 0.1, 7, 3)[0]  # positions missing
    wrong = {"must_differ": "mask", "of": "peagle", "reference_per_pos": [35, 5, 0]}
    ok, note, found = judge(wrong, run([35, 1, 0]), ours, greedy, 0.1, 7, 3)
    assert ok and found["caught"] and "caught" in note and "would not" in note  # τ moved by 4 %: inside the band
    ok, note, _ = judge(wrong, run([35, 5, 0]), ours, greedy, 0.1, 7, 3)
    assert not ok and "NOT caught" in note
    ok, note, _ = judge({**wrong, "reference_per_pos": None}, run([35, 1, 0]), ours, greedy, 0.1, 7, 3)
    assert not ok and "NOT judged" in note and "missing run" in note  # the right export's run failed
    ok, note, _ = judge(wrong, run([]), ours, greedy, 0.1, 7, 3)  # the engine reported no positions
    assert not ok and "NOT judged" in note
    assert not judge(wrong, run([35, 1, 0], outputs=[[5, 7, 7, 8]]), ours, greedy, 0.1, 7, 3)[0]  # outputs differ
