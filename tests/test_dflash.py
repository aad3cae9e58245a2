"""Block drafters (DFlash, DSpark's heads): one forward drafts the round; training and decoding see the same block.

The training path (every block of a row in one forward through the block mask) gives each block the same slot
states as the decoding path (the context cache up to the anchor, then the block alone), so the mask neither leaks
the future nor hides the past; T = 0 output equals AR; at T = 1 the emitted tokens follow the verifier's
distribution (χ², with a negative control); every loss trains; a trained run evaluates and reloads."""

from __future__ import annotations


import lightning as L
import pytest
import torch

from spectrain.eval.decode import generate
from spectrain.eval.dflash import ContextCache, DFlashChainDrafter, DFlashTreeDrafter
from spectrain.eval.drafters import Autoregressive, HybridDrafter
from spectrain.eval.static_model import StaticCausalLM
from spectrain.heads.dflash import DFlashConfig, DFlashDrafter, default_target_layers
from spectrain.heads.errors import SpectrainError
from spectrain.heads.families import family_of
from tests.eval_helpers import bigram_verifier
from tests.test_ranked_heads import p_values  # the round's first and second tokens, chi-square each

PROMPT = [3, 17, 42, 7]


def drafter_for(model, **kw) -> DFlashDrafter:
    torch.manual_seed(0)
    return DFlashDrafter(DFlashConfig.for_verifier(model, **{"num_layers": 2, "block_size": 5, **kw})).eval()


def _oracle_logits(drafter, state):
    """Slot logits following the bigram verifier's chain from the root, plus noise (many drafts accepted, some
    rejected). Only ``block_logits`` is replaced: the context cache is still filled and checked, and sampling, the
    ranked head's mapping, p and the tree growth are the drafter's own."""
    DFlashChainDrafter.block_logits(drafter, state)
    token, rows = state.tokens[state.length - 1], []
    g = torch.Generator().manual_seed(int(token) * 7 + state.length)
    for _ in range(drafter.k):
        row = (drafter.embed(token[None]) @ drafter._verifier_head.T)[0]
        logits = row if drafter.draft_ids is None else row[drafter.draft_ids]
        rows.append(logits + drafter.noise * torch.randn(logits.shape, generator=g))
        token = drafter._target(rows[-1].argmax())
    return torch.stack(rows).float()


class OracleBlock(DFlashChainDrafter):
    noise = 2.0
    block_logits = _oracle_logits


class OracleTree(DFlashTreeDrafter):
    noise = 2.0
    block_logits = _oracle_logits


def oracle(model, k: int, vocab=None, dynamic=None, min_confidence=0.0, **kw):
    drafter = (OracleTree(drafter_for(model, **kw), model, dynamic, vocab=vocab) if dynamic else
               OracleBlock(drafter_for(model, **kw), model, k, vocab=vocab, min_confidence=min_confidence))
    drafter._verifier_head = model.get_output_embeddings().weight
    return drafter


@pytest.fixture(scope="module")
def bigram():
    return bigram_verifier("llama", layers=4, mix=0.1)


def test_config_defaults_methods_and_refusals(bigram):
    model, _ = bigram
    config = DFlashConfig.for_verifier(model, num_layers=2, block_size=8)
    assert config.method == "dflash" and config.target_layer_ids == default_target_layers(4, 2) == [1, 2]
    assert config.capture_ids == (2, 3)  # layer i's output is HF hidden_states[i + 1]
    assert DFlashConfig.for_verifier(model, markov_rank=4).method == "dspark"
    assert DFlashConfig.for_verifier(model, confidence_head=True).method == "dspark"
    assert default_target_layers(30, 1) == [15]  # DFlash's rule; its configs: Qwen3-8B (36 layers), Qwen2.5-0.5B (24)
    assert default_target_layers(36, 5) == [1, 9, 17, 25, 33] and default_target_layers(24, 5) == [1, 6, 11, 16, 21]
    for bad, match in ((dict(target_layer_ids=[2, 1]), "ascending"), (dict(target_layer_ids=[4]), r"\[0, 3\]"),
                       (dict(block_size=1), "block_size"), (dict(mask_token_id=300), "outside the vocabulary")):
        with pytest.raises(SpectrainError, match=match):
            DFlashConfig.for_verifier(model, **bad)
    with pytest.raises(SpectrainError, match="1 to 4 tokens per round"):
        DFlashChainDrafter(drafter_for(model), model, 5)


def test_save_load_round_trip_and_family(bigram, tmp_path):
    model, _ = bigram
    drafter = drafter_for(model, markov_rank=4, confidence_head=True)
    drafter.save_pretrained(tmp_path)
    back = DFlashDrafter.from_pretrained(tmp_path, model)
    assert family_of(back).name == "dflash" and back.config == drafter.config
    assert all(torch.equal(a, b) for a, b in zip(back.state_dict().values(), drafter.state_dict().values()))
    deeper, _ = bigram_verifier("llama", layers=5)
    with pytest.raises(SpectrainError, match="5"):
        DFlashDrafter.from_pretrained(tmp_path, deeper)


@pytest.mark.parametrize("from_anchor", [False, True], ids=["dflash", "from-anchor"])
def test_the_training_blocks_equal_the_decoding_blocks(verifier_factory, from_anchor):
    """Slot states of two anchors from the one training forward (block mask) == the decoding path's, which sees only
    the context before the anchor (cache) and the block itself."""
    from spectrain.train.dflash import DFlashModule

    torch.manual_seed(0)
    module = DFlashModule(verifier=str(verifier_factory("llama", False, layers=4)), verifier_dtype="float32",
                          num_layers=2, block_size=4, markov_rank=4, warmup_steps=0, sample_from_anchor=from_anchor)
    drafter = module.drafter.eval()
    T = 20
    ids = torch.randint(0, 300, (1, T))
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "loss_mask": torch.ones_like(ids)}
    features = module.features(batch)
    anchors = torch.tensor([[5, 13]])
    import spectrain.train.dflash as dflash_train

    real = dflash_train.sample_anchors
    dflash_train.sample_anchors = lambda valid, count, generator=None: (anchors, torch.ones_like(anchors, dtype=torch.bool))
    try:
        with torch.no_grad():
            blocks = module.blocks(batch, features, 2, greedy_targets=True)
    finally:
        dflash_train.sample_anchors = real
    aux = torch.cat(features["layers"], -1)[0]
    for i, a in enumerate(anchors[0].tolist()):
        cache = ContextCache(2, drafter.config.num_kv_heads, 32, drafter.config.head_dim, torch.float32, "cpu")
        with torch.no_grad():
            cache.append(drafter.context_kv(drafter.context(aux[None, :a]), torch.arange(a)[None]))
            block = torch.tensor([ids[0, a].item()] + [drafter.config.mask_token_id] * 3)
            out = drafter.block_hidden(module.embed(block)[None], (a + torch.arange(4))[None], cache.view(), None)[0]
        drafts = 4 if from_anchor else 3  # slot j predicts the token j + 1 after the anchor (from_anchor) or j after
        torch.testing.assert_close(blocks["hidden"][0, i], out[4 - drafts:], atol=1e-5, rtol=1e-5)
        assert blocks["targets"][0, i].tolist() == features["greedy"][0, a:a + drafts].tolist()
        assert blocks["prev"][0, i, 0] == ids[0, a]  # slot 1's Markov input is the anchor


@pytest.mark.parametrize("kw", [{}, {"markov_rank": 6}, {"markov_rank": 6, "sample_from_anchor": True}],
                         ids=["dflash", "dspark", "dspark-from-anchor"])
@pytest.mark.parametrize("ranked", [False, True], ids=["full", "ranked"])
def test_greedy_block_drafts_equal_ar(bigram, kw, ranked):
    model, _ = bigram
    runner = StaticCausalLM(model, max_len=96)
    ar = generate(runner, Autoregressive(), PROMPT, 40).tokens
    vocab = torch.arange(0, 300, 2) if ranked else None
    drafted = oracle(model, 4, vocab, **kw)
    drafted.noise = 25.0  # against bigram logits of ~64 for the verifier's token: some drafts are wrong
    out = generate(runner, drafted, PROMPT, 40)
    assert out.tokens == ar
    assert max(out.accept_lengths) >= 2 and min(out.accept_lengths) < 4  # drafts accepted and rejected
    real = DFlashChainDrafter(drafter_for(model, **kw), model, 4, vocab=vocab)  # a random drafter, all its paths
    assert generate(runner, real, PROMPT, 40).tokens == ar
    tree = oracle(model, 4, vocab, dynamic=(4, 3, 10), **kw)  # the tree from the slots' top-k
    tree.noise = 25.0
    grown = generate(runner, tree, PROMPT, 40)
    assert grown.tokens == ar and max(grown.accept_lengths) >= 2
    assert sum(grown.accept_lengths) > sum(out.accept_lengths)  # more candidates, more accepted
    assert generate(runner, DFlashTreeDrafter(drafter_for(model, **kw), model, (4, 3, 10), vocab=vocab), PROMPT,
                    40).tokens == ar
    hybrid = HybridDrafter(oracle(model, 4, vocab, **kw), 4, merge=False)  # lookup rounds hold the features back
    repeating = PROMPT + ar[:12] + PROMPT  # the continuation is in the prompt: lookup rounds occur
    assert generate(runner, hybrid, repeating, 40).tokens == generate(runner, Autoregressive(), repeating, 40).tokens
    assert 0 < hybrid.lookup_rounds < hybrid.rounds




@pytest.fixture(scope="module")
def soft():
    model, _ = bigram_verifier("llama", layers=4, mix=0.3, seed=2)
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(0.1)
    return model


def _soft_vocab(model) -> torch.Tensor:
    from tests.test_ranked_heads import q_after

    likely = q_after(model, PROMPT).topk(8).indices.tolist()
    return torch.tensor(sorted(set(likely[::2]) | set(range(0, 300, 3))))


@pytest.mark.parametrize("kw,dynamic", [({}, None), ({"markov_rank": 6}, (2, 3, 5))],
                         ids=["dflash-chain", "dspark-tree"])
def test_sampled_block_drafts_follow_the_verifier_distribution(soft, kw, dynamic):
    drafter = oracle(soft, 2, _soft_vocab(soft), dynamic=dynamic, **kw)
    drafter.noise = 0.5
    p = p_values(soft, drafter)
    assert len(p) == 2 and min(p) > 1e-3  # the round's first and second tokens both tested; the control: < 1e-6


def _confident(drafter, scale: float = 8.0, bias: float = 0.0, markov: float = 1.0):
    """A confidence head whose predictions spread widely over the rounds (a random one sits near 0.5); ``markov``
    scales the columns reading the previous token's Markov row (0.02-sized), so the cut reads the earlier drafts."""
    with torch.no_grad():
        proj = drafter.drafter.confidence_head.proj
        proj.weight.mul_(scale / proj.weight.norm())
        proj.weight[:, drafter.config.hidden_size:] *= markov
        proj.bias.fill_(bias)
    return drafter


@pytest.mark.parametrize("kw,bias", [({"confidence_head": True}, 0.0),
                                     ({"confidence_head": True, "markov_rank": 6}, 1.0)],
                         ids=["confidence", "confidence+markov"])
def test_a_confidence_cut_verifies_the_predicted_prefix_losslessly(bigram, kw, bias):
    """Each round verifies exactly the longest prefix whose predicted whole-prefix acceptance (the product of the
    slots' sigmoid confidences, each read from its state and the token before it) is >= P, at least one draft;
    the output stays AR's; α counts only the depths a round drafted; P -> 0 verifies every draft."""
    model, _ = bigram
    runner = StaticCausalLM(model, max_len=96)
    ar = generate(runner, Autoregressive(), PROMPT, 40).tokens
    full = oracle(model, 4, **kw)
    full.noise = 25.0
    uncut = generate(runner, full, PROMPT, 40)
    cut = _confident(oracle(model, 4, min_confidence=0.3, **kw), bias=bias)
    cut.noise = 25.0
    seen = []
    real_cut = DFlashChainDrafter._cut

    def recording(self, proposal, states, state):
        prev = torch.cat([state.tokens[state.length - 1:state.length], proposal.tokens[:-1]])
        conf = torch.sigmoid(self.drafter.confidence(states, prev).float())
        expected = 1
        while expected < self.k and conf[:expected + 1].prod() >= 0.3:
            expected += 1
        out = real_cut(self, proposal, states, state)
        seen.append((expected, out.tokens.numel(), out.tokens.tolist() == proposal.tokens[:expected].tolist()))
        return out

    cut._cut = recording.__get__(cut)
    out = generate(runner, cut, PROMPT, 40)
    assert out.tokens == ar == uncut.tokens
    assert [n for _, n, _ in seen] == [e for e, _, _ in seen] == out.drafted_depths  # the rule, and verified so
    assert all(same for *_, same in seen)  # the verified drafts are the chain's first n
    assert len(set(out.drafted_depths)) >= 2 and min(out.drafted_depths) < 4  # cut in some rounds, not all alike
    assert all(a <= d for a, d in zip(out.accept_lengths, out.drafted_depths))
    everything = _confident(oracle(model, 4, min_confidence=1e-12, **kw), bias=bias)  # P -> 0: the whole chain
    everything.noise = 25.0
    again = generate(runner, everything, PROMPT, 40)
    assert again.accept_lengths == uncut.accept_lengths and set(again.drafted_depths) == {4}
    hybrid = HybridDrafter(_confident(oracle(model, 4, min_confidence=0.3, **kw), bias=bias), 4, merge=False)
    repeating = PROMPT + ar[:12] + PROMPT  # lookup rounds (4 deep) and cut learned rounds in one decode
    hybrid.learned.noise = 25.0
    mixed = generate(runner, hybrid, repeating, 40)
    assert mixed.tokens == generate(runner, Autoregressive(), repeating, 40).tokens
    assert 0 < hybrid.lookup_rounds < hybrid.rounds and min(mixed.drafted_depths) < 4


@pytest.mark.parametrize("kw,shape", [({}, {"bias": 4.0}), ({"markov_rank": 6}, {"bias": 4.0, "markov": 300.0})],
                         ids=["confidence", "confidence+markov"])
def test_a_confidence_cut_samples_the_verifier_distribution(soft, kw, shape):
    """At T = 1 with rounds cut to one draft or verifying both — with a Markov head the cut reads the first draft
    (its Markov row): a stopping rule over the earlier drafts — the round's tokens still follow q."""
    drafter = _confident(oracle(soft, 2, _soft_vocab(soft), min_confidence=0.5, confidence_head=True, **kw), **shape)
    drafter.noise = 0.5
    depths = []
    real = DFlashChainDrafter._cut

    def recording(self, *args):
        out = real(self, *args)
        depths.append(out.tokens.numel())
        return out

    drafter._cut = recording.__get__(drafter)
    p = p_values(soft, drafter)
    assert len(p) == 2 and min(p) > 1e-3  # the round's first and second tokens, chi-square each
    assert {1, 2} <= set(depths)  # rounds cut to one draft and rounds verifying both


def test_min_confidence_refusals(bigram, tiny_tokenizer, monkeypatch):
    from spectrain.eval import evaluate as evaluate_module
    from spectrain.eval.evaluate import EvalSettings, evaluate_drafter
    from spectrain.eval.methods import method_named
    from spectrain.eval.families import learned_drafter
    from spectrain.eval.tree import Tree
    from spectrain.heads.verifier import Verifier
    from tests.eval_helpers import oracle_eagle1

    model, _ = bigram
    with pytest.raises(SpectrainError, match="confidence head"):  # a drafter without one
        DFlashChainDrafter(drafter_for(model), model, 3, min_confidence=0.5)
    with pytest.raises(SpectrainError, match="cuts chains"):
        learned_drafter(drafter_for(model, confidence_head=True), model, Tree.chain(3), (3, 2, 4), min_confidence=0.5)
    with pytest.raises(SpectrainError, match="has none"):
        learned_drafter(oracle_eagle1(model, 0.0), model, Tree.chain(3), min_confidence=0.5)
    for bad in (1.0, -0.1, "0.5", True):
        with pytest.raises(SpectrainError, match="probability"):
            EvalSettings(k=3, min_confidence=bad)
        with pytest.raises(SpectrainError, match="probability"):
            DFlashChainDrafter(drafter_for(model, confidence_head=True), model, 3, min_confidence=bad)
    for settings in (dict(k=0), dict(k=3, dynamic_tree=(3, 2, 4))):  # chains only
        with pytest.raises(SpectrainError, match="cuts chains"):
            EvalSettings(min_confidence=0.5, **settings)
    for method in ("ngram", "none", "truncated"):
        with pytest.raises(SpectrainError, match=f"--method {method} has none"):
            method_named(method).check(EvalSettings(k=3, min_confidence=0.5))
    # A drafter without a head is refused before anything is decoded (AR included).
    monkeypatch.setattr(evaluate_module, "run_prompts", lambda *a, **k: pytest.fail("decoded before refusing"))
    with pytest.raises(SpectrainError, match="has none"):
        evaluate_drafter(Verifier(model, tiny_tokenizer, "bigram"), [["a b"]], drafter_for(model),
                         EvalSettings(k=3, min_confidence=0.5, chat_template=False))


def test_p_scattered_into_the_wrong_columns_is_detected(soft, monkeypatch):
    """Negative control: the slots' p put at ids 0..N-1 instead of the ranked ids."""
    monkeypatch.setattr(DFlashChainDrafter, "_full", lambda self, p: torch.nn.functional.pad(
        p, (0, self.vocab_size - p.shape[1])))
    drafter = oracle(soft, 2, _soft_vocab(soft))
    drafter.noise = 0.5
    assert min(p_values(soft, drafter)) < 1e-6


def _batches(n: int, vocab: int, seed: int) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (n, 24), generator=g)
    return [{"input_ids": row, "attention_mask": torch.ones_like(row), "loss_mask": torch.ones_like(row)} for row in ids]


@pytest.mark.parametrize("loss,kw", [("ce", {}), ("dpace", {}), ("lk_alpha", {}), ("lk_hybrid", {}),
                                     ("dspark", {"markov_rank": 4, "confidence_head": True})])
def test_every_loss_trains(loss, kw, verifier_factory):
    from spectrain.train.dflash import DFlashModule

    torch.manual_seed(0)
    module = DFlashModule(verifier=str(verifier_factory("llama", False, layers=4)), verifier_dtype="float32",
                          num_layers=1, block_size=4, anchors=6, loss=loss, lr=1e-2, warmup_steps=0, **kw)
    batch = torch.utils.data.default_collate(_batches(4, 300, seed=1))
    optimizer = torch.optim.AdamW(module.drafter.parameters(), lr=1e-2)
    losses = []
    for _ in range(12):
        torch.manual_seed(1)  # the same anchors every step: the loss on them must fall
        loss_value, parts = module.drafter_loss(batch, module.features(batch))
        optimizer.zero_grad()
        loss_value.backward()
        optimizer.step()
        losses.append(float(loss_value))
    assert losses[-1] < losses[0], losses
    assert all(torch.isfinite(v) for v in parts.values())
    if kw.get("confidence_head"):
        assert "confidence_bce" in parts and "tv" in parts


def test_a_trained_run_measures_tau_evaluates_and_reloads(verifier_factory, tmp_path):
    from dataclasses import replace

    from spectrain.eval.evaluate import EvalSettings, evaluate_drafter, load_drafter
    from spectrain.eval.families import learned_drafter
    from spectrain.eval.tree import Tree
    from spectrain.heads.verifier import load_verifier
    from spectrain.train.dflash import DFlashModule

    verifier_dir = str(verifier_factory("llama", False, layers=4))
    torch.manual_seed(0)
    module = DFlashModule(verifier=verifier_dir, verifier_dtype="float32", num_layers=1, block_size=4, anchors=6,
                          lr=1e-2, warmup_steps=0, measure_prompts=2, measure_k=3, measure_new_tokens=6)
    train = torch.utils.data.DataLoader(_batches(4, 300, seed=1) * 3, batch_size=4)
    val = torch.utils.data.DataLoader(_batches(4, 300, seed=2), batch_size=4)
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=3, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0)
    trainer.fit(module, train_dataloaders=train, val_dataloaders=val)
    metrics = module.last_val_metrics
    assert set(metrics) >= {"tau_measured", "tau_pred", "slot3_top1_ver"}
    run = module.export(tmp_path / "run", module.plain_drafter())
    verifier = load_verifier(verifier_dir, dtype=torch.float32)
    drafter = load_drafter(str(run), verifier, "dflash")
    assert isinstance(drafter, DFlashDrafter)
    # the τ validation logged is the exported drafter's: its prompts decoded again from the saved files
    chain = learned_drafter(drafter, verifier.model, Tree.chain(3))
    prompts = module.tau_meter.prompts
    runner = StaticCausalLM(verifier.model, max_len=max(len(p) for p in prompts) + 6 + 3 + 2)  # as TauMeter sizes it
    outs = [generate(runner, chain, prompt, 6, generator=torch.Generator().manual_seed(0)) for prompt in prompts]
    assert len(outs) == 2 and metrics["tau_measured"] == sum(sum(o.emitted_per_round) for o in outs) / sum(
        len(o.accept_lengths) for o in outs)
    # τ predicted from validation counts, by hand: slots 1-3 hit [1,1,0,1], [1,0,1,1], [1,1,1,0] at four anchors
    # lead with runs 3, 1, 0, 2 -> τ_pred = 1 + 6 / 4 = 2.5, and each slot's top-1 is 3 / 4
    hits = [torch.tensor([[1, 1, 0, 1]]).bool(), torch.tensor([[1, 0, 1, 1]]).bool(), torch.tensor([[1, 1, 1, 0]]).bool()]
    counts = module.chain_counts(hits, [torch.ones(1, 4, dtype=torch.bool)] * 3)
    assert (int(counts["chain_n"]), int(counts["chain_len"])) == (4, 6)
    sums = {**counts, **{f"n_{j}": torch.tensor(4) for j in range(3)}, **{f"top1_ver_{j}": torch.tensor(3) for j in range(3)}}
    assert module.val_metrics(sums) == {"slot1_top1_ver": 0.75, "slot2_top1_ver": 0.75, "slot3_top1_ver": 0.75,
                                        "tau_pred": 2.5}
    prompts = [["the king sat on the mat"], ["where is the river"]]
    settings = EvalSettings(k=3, max_new_tokens=12, hf_generate=0, costs=False, chat_template=False)
    result = evaluate_drafter(verifier, prompts, drafter, settings)
    assert result.results["chain-3"]["identical_to_ar"]
    # A hybrid chain whose lookup rounds draft past the block, costs and planner on: the planner prices the
    # drafter's own chains (up to k), the cost probe verifies k + 1 (not the lookup rounds' width).
    hybrid = evaluate_drafter(verifier, prompts, "hybrid", replace(settings, lookup=6, costs=True), drafter=drafter)
    assert hybrid.results["chain-3"]["identical_to_ar"] and hybrid.results["chain-3"]["tree_size"] == 6
    assert [row["n"] for row in hybrid.planner["chains"]] == [1, 2, 3]
    assert hybrid.costs["settings"]["chain-3"]["t_verify_ms"] > 0
    with pytest.raises(SpectrainError, match="4 deep but the drafter drafts at most 3 deep"):
        evaluate_drafter(verifier, prompts, "dflash", replace(settings, k=4, max_new_tokens=4), drafter=drafter)


def test_measure_k_beyond_the_block_is_refused(verifier_factory):
    from spectrain.train.dflash import DFlashModule

    with pytest.raises(SpectrainError, match="measure_k 5 exceeds what a block of 4 drafts"):
        DFlashModule(verifier=str(verifier_factory("llama", False, layers=4)), verifier_dtype="float32",
                     block_size=4, measure_prompts=2, measure_k=5)



def test_a_chain_deeper_than_the_block_is_refused_by_name(bigram):
    from spectrain.eval.families import check_chain_depth

    model, _ = bigram
    drafter = drafter_for(model, block_size=5)  # 4 drafts a round
    check_chain_depth("block", drafter, 4)
    with pytest.raises(SpectrainError, match="drafter 'block' drafts at most 4 tokens a round, not 5"):
        check_chain_depth("block", drafter, 5)


def test_block_mask_sees_exactly_the_context_before_its_anchor_and_its_own_block():
    from spectrain.train.dflash import block_mask

    anchors = torch.tensor([[2, 5]])
    attention = torch.tensor([[0, 1, 1, 1, 1, 1, 1]])  # position 0 is padding
    mask = block_mask(anchors, attention, 3)[0, 0]
    assert mask.shape == (6, 7 + 6)
    for q in range(6):
        i = q // 3
        for key in range(7):  # context: attended positions strictly before the anchor
            assert mask[q, key] == (key < anchors[0, i] and attention[0, key] == 1), (q, key)
        for key in range(6):  # the block's own slots, both directions; no other block
            assert mask[q, 7 + key] == (key // 3 == i), (q, key)


def _reference_block(drafter, aux, anchor_token, mask_id, embed, L):
    """DFlash's forward written out from its equations in float64 (z-lab's ``Qwen3DFlashAttention``): context
    ``hidden_norm(fc(aux[:L]))`` through each layer's k / v projections, k-norm, RoPE at 0..L-1; the block
    ``[anchor, MASK...]`` at L..L+B-1, pre-norm layers, full attention (every context position precedes the
    block), final norm. Returns the block's (B, h) final states."""
    c = drafter.config
    sd = {k: v.double() for k, v in drafter.state_dict().items()}
    eps, d, B = c.rms_norm_eps, c.head_dim, c.block_size

    def rms(x, w):
        return x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps) * w

    def rope(x, pos):  # x (heads, T, d)
        inv = c.rope_theta ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
        ang = pos.double()[:, None] * inv
        cos, sin = torch.cat([ang, ang], -1).cos(), torch.cat([ang, ang], -1).sin()
        x1, x2 = x[..., : d // 2], x[..., d // 2:]
        return x * cos + torch.cat([-x2, x1], -1) * sin

    ctx = rms(aux[:L].double() @ sd["fc.weight"].T, sd["hidden_norm.weight"])
    x = embed(torch.tensor([anchor_token] + [mask_id] * (B - 1))).double()
    qpos, kpos = torch.arange(L, L + B), torch.cat([torch.arange(L), torch.arange(L, L + B)])
    groups = c.num_heads // c.num_kv_heads
    for i in range(c.num_hidden_layers):
        p = f"layers.{i}."
        h = rms(x, sd[p + "input_layernorm.weight"])
        both = torch.cat([ctx, h])
        q = (h @ sd[p + "self_attn.q_proj.weight"].T).view(B, c.num_heads, d).transpose(0, 1)
        k = (both @ sd[p + "self_attn.k_proj.weight"].T).view(-1, c.num_kv_heads, d).transpose(0, 1)
        v = (both @ sd[p + "self_attn.v_proj.weight"].T).view(-1, c.num_kv_heads, d).transpose(0, 1)
        q = rope(rms(q, sd[p + "self_attn.q_norm.weight"]), qpos)
        k = rope(rms(k, sd[p + "self_attn.k_norm.weight"]), kpos).repeat_interleave(groups, 0)
        v = v.repeat_interleave(groups, 0)
        att = ((q @ k.transpose(1, 2)) / d ** 0.5).softmax(-1) @ v
        x = x + att.transpose(0, 1).reshape(B, -1) @ sd[p + "self_attn.o_proj.weight"].T
        h = rms(x, sd[p + "post_attention_layernorm.weight"])
        gate, up = h @ sd[p + "mlp.gate_proj.weight"].T, h @ sd[p + "mlp.up_proj.weight"].T
        x = x + (torch.nn.functional.silu(gate) * up) @ sd[p + "mlp.down_proj.weight"].T
    return rms(x, sd["norm.weight"])


def test_drafts_equal_a_reference_forward_of_the_same_weights(bigram):
    """The decoding drafter's block, after a real prefill through the verifier, equals the float64 reference."""
    model, _ = bigram
    drafter = drafter_for(model, block_size=5)
    with torch.no_grad():
        for p in drafter.parameters():  # away from the fresh init's ones and zeros
            p.add_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())))
    chain = DFlashChainDrafter(drafter, model, 4)
    runner = StaticCausalLM(model, max_len=64)
    seen = {}
    real = chain.block_logits

    def capture(state):
        seen["aux"], seen["length"] = state.new_features.clone(), state.length
        seen["root"] = int(state.tokens[state.length - 1])
        return real(state)

    chain.block_logits = capture
    generate(runner, chain, PROMPT + [11, 12], 2)  # the prefill, then one round: its features, one block
    L = seen["length"] - 1
    assert L == len(PROMPT) + 2 and seen["aux"].shape[0] == L
    with torch.no_grad():
        reference = _reference_block(drafter, seen["aux"], seen["root"], drafter.config.mask_token_id,
                                     model.get_input_embeddings(), L)
        ours = drafter.block_hidden(model.get_input_embeddings()(
            torch.tensor([seen["root"]] + [drafter.config.mask_token_id] * 4))[None], (L + torch.arange(5))[None],
            chain.cache.view(), None)[0]
        head = model.get_output_embeddings().weight.double()
    torch.testing.assert_close(ours.double(), reference, atol=1e-5, rtol=1e-4)
    assert (reference[1:] @ head.T).argmax(-1).tolist() == (ours[1:].double() @ head.T).argmax(-1).tolist()


def test_ce_loss_equals_a_hand_computed_case(verifier_factory, monkeypatch):
    """drafter_loss with two fixed anchors == cross-entropy of each slot's decoding-path logits against the
    verifier's greedy token, weighted exp(-(j - 1) / gamma), by hand."""
    import spectrain.train.dflash as dflash_train
    from spectrain.train.dflash import DFlashModule

    torch.manual_seed(0)
    module = DFlashModule(verifier=str(verifier_factory("llama", False, layers=4)), verifier_dtype="float32",
                          num_layers=1, block_size=4, position_decay=2.0, warmup_steps=0)
    drafter = module.drafter.eval()
    ids = torch.randint(0, 300, (1, 16), generator=torch.Generator().manual_seed(3))
    loss_mask = torch.ones_like(ids)
    loss_mask[0, 14:] = 0  # anchor 12 has one draft with a target (position 13); 14 and 15 are not targets
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "loss_mask": loss_mask}
    anchors = torch.tensor([[4, 12]])
    monkeypatch.setattr(dflash_train, "sample_anchors",
                        lambda valid, count, generator=None: (anchors, torch.ones_like(anchors, dtype=torch.bool)))
    features = module.features(batch)
    with torch.no_grad():
        loss, parts = module.drafter_loss(batch, features)
    aux, head = torch.cat(features["layers"], -1)[0], module.verifier_lm_head.weight
    terms, weights = [], []
    for a in anchors[0].tolist():
        cache = ContextCache(1, drafter.config.num_kv_heads, 32, drafter.config.head_dim, torch.float32, "cpu")
        with torch.no_grad():
            cache.append(drafter.context_kv(drafter.context(aux[None, :a]), torch.arange(a)[None]))
            block = torch.tensor([int(ids[0, a])] + [drafter.config.mask_token_id] * 3)
            out = drafter.block_hidden(module.embed(block)[None], (a + torch.arange(4))[None], cache.view(), None)[0]
        for j in (1, 2, 3):
            if a + j < 16 and loss_mask[0, a + j]:
                target = int(features["greedy"][0, a + j - 1])
                terms.append(torch.nn.functional.cross_entropy((out[j] @ head.T)[None], torch.tensor([target])))
                weights.append(float(torch.exp(torch.tensor(-(j - 1) / 2.0))))
    assert len(terms) == 4  # 3 + 1 drafts with a target
    expected = sum(t * w for t, w in zip(terms, weights)) / sum(weights)
    torch.testing.assert_close(loss, expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(parts["ce"], expected, atol=1e-5, rtol=1e-5)


def test_norm_init_from_the_verifier(verifier_factory):
    from spectrain.train.dflash import DFlashModule

    verifier = str(verifier_factory("llama", False, layers=4))
    module = DFlashModule(verifier=verifier, verifier_dtype="float32", block_size=4, norm_init="verifier")
    assert torch.equal(module.drafter.norm.weight, module.verifier.model.norm.weight)
    fresh = DFlashModule(verifier=verifier, verifier_dtype="float32", block_size=4)
    assert torch.equal(fresh.drafter.norm.weight, torch.ones_like(fresh.drafter.norm.weight))
    with pytest.raises(SpectrainError, match="norm_init must be default or verifier"):
        DFlashModule(verifier=verifier, verifier_dtype="float32", norm_init="zeros")
