"""Block drafters (DFlash, DSpark) in serving layouts: vLLM's speculators exports validate and import back, the
confidence head dropped for engines that serve DFlash alone, and the engine check's DFlash control and mistaken
exports."""

from __future__ import annotations

import pytest
import torch

from spectrain.eval.decode import generate
from spectrain.eval.dflash import DFlashChainDrafter
from spectrain.eval.static_model import StaticCausalLM
from spectrain.heads.errors import SpectrainError
from tests.eval_helpers import bigram_verifier
from tests.test_dflash import PROMPT, drafter_for


@pytest.fixture(scope="module")
def bigram():
    return bigram_verifier("llama", layers=4, mix=0.1)


@pytest.mark.parametrize("kw,fmt", [({}, "speculators-dflash"),
                                    ({"markov_rank": 4, "confidence_head": True, "sample_from_anchor": True},
                                     "speculators-dspark")], ids=["dflash", "dspark"])
def test_speculators_export_validates_and_imports_back(bigram, tmp_path, kw, fmt):
    from spectrain.heads.serving.formats import detect_format, export_drafter, import_drafter, recorded_verifier
    from spectrain.heads.io import read_json

    model, _ = bigram
    drafter = drafter_for(model, **kw)
    out = export_drafter(drafter, fmt, tmp_path / "export", verifier_lm_head=model.get_output_embeddings(),
                         verifier_name="tiny-bigram")
    config = read_json(out / "config.json", "config")
    assert detect_format(out) == fmt and config["speculators_model_type"] == fmt.split("-")[1]
    assert config["aux_hidden_state_layer_ids"] == [i + 1 for i in drafter.config.target_layer_ids]  # vLLM's ids
    assert config["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == drafter.config.drafts
    back = import_drafter(out, verifier_model=model)
    assert back.config.verifier == "tiny-bigram"  # the name it was exported for
    back.config.verifier = drafter.config.verifier
    assert back.config == drafter.config
    assert all(torch.equal(a, b) for a, b in zip(back.state_dict().values(), drafter.state_dict().values()))
    assert recorded_verifier(out)["signature"]["num_hidden_layers"] == 4
    from safetensors.torch import load_file, save_file

    tensors = load_file(out / "model.safetensors")
    tensors.pop("norm.weight")
    save_file(tensors, out / "model.safetensors")
    with pytest.raises(SpectrainError, match="norm.weight"):
        import_drafter(out, verifier_model=model)


def test_dropping_the_confidence_head_keeps_every_draft_and_exports_dflash(bigram, tmp_path, capsys):
    """A DSpark drafter with only a confidence head serves as DFlash (vLLM's CPU runner has no DSpark): its body
    drafts exactly the same blocks, greedy and sampled, and spectrain-export --drop_confidence_head writes
    speculators-dflash."""
    from spectrain.eval.accept import Sampling
    from spectrain.heads.dflash import without_confidence_head
    from spectrain.heads.serving.cli import main as export_main
    from spectrain.heads.serving.formats import detect_format, import_drafter

    model, _ = bigram
    drafter = drafter_for(model, confidence_head=True)
    with torch.no_grad():
        for p in drafter.parameters():  # away from the fresh init's ones and zeros
            p.add_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())))
    drafter.ranking = "the ranked head load_drafter attached"
    body = without_confidence_head(drafter)
    assert body.config.method == "dflash" and not hasattr(body, "confidence_head")
    assert body.ranking == drafter.ranking and not body.training
    runner = StaticCausalLM(model, max_len=96)
    for sampling in (Sampling(), Sampling(temperature=1.0)):
        blocks, outputs = {}, {}
        for name, d in (("dspark", drafter), ("body", body)):
            chain = DFlashChainDrafter(d, model, 4)
            real, seen = chain.block_logits, blocks.setdefault(name, [])
            chain.block_logits = lambda state, real=real, seen=seen: seen.append(real(state)) or seen[-1]
            out = generate(runner, chain, PROMPT, 24, sampling, generator=torch.Generator().manual_seed(3))
            outputs[name] = (out.tokens, out.accept_lengths)
        assert len(blocks["body"]) == len(blocks["dspark"]) > 3
        assert all(torch.equal(a, b) for a, b in zip(blocks["body"], blocks["dspark"]))
        assert outputs["body"] == outputs["dspark"]
    # Control: the comparison above runs without a confidence cut, where DSpark drafts as its body does; with the
    # cut (the one thing the dropped head did) the same decoding drafts other chains, so it can tell them apart.
    drafted = {}
    for name, chain in (("body", DFlashChainDrafter(body, model, 4)),
                        ("cut", DFlashChainDrafter(drafter, model, 4, min_confidence=0.5))):
        real, seen = chain.propose, drafted.setdefault(name, [])
        chain.propose = lambda state, real=real, seen=seen: seen.append(real(state)) or seen[-1]
        generate(runner, chain, PROMPT, 24, Sampling())
    lengths = {name: [len(p.tokens) for p in proposals] for name, proposals in drafted.items()}
    assert set(lengths["body"]) == {4} and lengths["cut"] != lengths["body"], lengths
    in_bf16 = without_confidence_head(drafter_for(model, confidence_head=True).to(torch.bfloat16))
    assert in_bf16.fc.weight.dtype == torch.bfloat16  # the drafter's own dtype, not a fresh fp32 module
    drafter.save_pretrained(tmp_path / "run")
    drafter_for(model).save_pretrained(tmp_path / "plain")
    for run, flags, problem in (("run", [], "holds dflash drafters"), ("plain", ["--drop_confidence_head"],
                                                                     "no confidence head")):
        with pytest.raises(SystemExit) as refused:  # the whole DSpark drafter; a drafter without the head
            export_main([str(tmp_path / run), "--format", "speculators-dflash", *flags, "--out", str(tmp_path / "no")])
        assert refused.value.code == 2 and not (tmp_path / "no").exists()
        assert problem in capsys.readouterr().err
    export_main([str(tmp_path / "run"), "--format", "speculators-dflash", "--drop_confidence_head",
                 "--out", str(tmp_path / "body")])
    assert detect_format(tmp_path / "body") == "speculators-dflash"
    back = import_drafter(tmp_path / "body", verifier_model=model)
    assert back.config.method == "dflash"
    assert back.state_dict().keys() == body.state_dict().keys()
    assert all(torch.equal(back.state_dict()[k], v) for k, v in body.state_dict().items())
    for kw, problem in (({"markov_rank": 4, "confidence_head": True}, "Markov head"),
                        ({"confidence_head": True, "sample_from_anchor": True}, "anchor's slot"),
                        ({}, "no confidence head")):
        with pytest.raises(SpectrainError, match=problem):
            without_confidence_head(drafter_for(model, **kw))
    with pytest.raises(SpectrainError, match="only a block drafter"):
        without_confidence_head(torch.nn.Linear(2, 2))
    from spectrain.heads.serving.cli import without_confidence_head as dropped_by_the_cli
    from spectrain.heads.medusa import MedusaHeads

    with pytest.raises(SpectrainError, match=r"only a block drafter \(DFlash / DSpark\) has a confidence head to "
                                             "drop, not a MedusaHeads"):  # the family's methods, named as before
        dropped_by_the_cli(MedusaHeads.for_verifier(model, num_heads=1))


def test_a_from_anchor_drafter_without_dspark_heads_has_no_engine_layout(bigram, tmp_path):
    from spectrain.heads.serving.formats import export_drafter

    model, _ = bigram
    with pytest.raises(SpectrainError, match="sample_from_anchor is DSpark's layout"):
        export_drafter(drafter_for(model, sample_from_anchor=True), "speculators-dflash", tmp_path / "x")


def test_engine_check_dflash_control_drafts_its_token_through_the_mask_slots_only(bigram, tmp_path):
    """The engine check's DFlash control proposes its token in every slot, read back from its speculators export
    (the layout vLLM gets); filled with another mask token it proposes something else. Its two mistaken exports
    differ from the right one in exactly the field they break."""
    from spectrain.eval.engine_controls import dflash_control, mistaken_export
    from spectrain.heads.serving.formats import export_drafter, import_drafter
    from spectrain.heads.io import read_json

    model, _ = bigram
    head = model.get_output_embeddings().weight.float()
    token = next(t for t in range(head.shape[0]) if int((head @ head[t]).argmax()) == t)
    control = dflash_control(model, None, token, drafts=4)
    export = export_drafter(control, "speculators-dflash", tmp_path / "control",
                            verifier_lm_head=model.get_output_embeddings(), verifier_name="v")

    def proposals(drafter) -> list[list[int]]:
        chain, seen = DFlashChainDrafter(drafter.eval(), model, 4), []
        real = chain.propose

        def record(state):
            proposal = real(state)
            seen.append(proposal.tokens.tolist())
            return proposal

        chain.propose = record
        generate(StaticCausalLM(model, max_len=64), chain, PROMPT, 12)
        return seen

    loaded = import_drafter(export, verifier_model=model)
    drafted = proposals(loaded)
    assert drafted and all(p == [token] * 4 for p in drafted)
    loaded.config.mask_token_id = (loaded.config.mask_token_id + 1) % head.shape[0]
    assert any(p != [token] * 4 for p in proposals(loaded))
    right = read_json(export / "config.json", "config")
    for mistake, field in (("layers", "aux_hidden_state_layer_ids"), ("mask", "mask_token_id")):
        wrong = read_json(mistaken_export(export, tmp_path / mistake, mistake, head.shape[0])
                          / "config.json", "config")
        assert {k for k in right if right[k] != wrong[k]} == {field}


def test_engine_check_verdicts_can_fail():
    """The vLLM check's verdict (engine_verdicts.vllm_verdict) on made-up engine runs: a block drafter passes only
    with identical outputs, τ in the band and the engine resolving its own layers and mask token; a mistaken export
    passes only when the engine resolved something else; a control only at its predicted count."""
    from spectrain.eval.engine_controls import predicted_acceptance
    from spectrain.eval.engine_verdicts import vllm_verdict as judge
    expected = {"target_layer_ids": [1, 3], "mask_token_id": 0}
    greedy = [[5, 7, 7, 9], [7, 7, 7, 2]]
    ours = {"tau": 2.0, "accepted": 10, "rounds": 10}

    def run(tau=2.05, outputs=greedy, layers=(1, 3), mask=0, accepted=10, config=True):
        return {"token_ids": outputs, "mean_acceptance_length": tau, "counters": {"num_accepted_tokens": accepted},
                "accepted_per_pos": [], "generate_seconds": 1.0, "draft_config": {"dflash_config": {
                    "target_layer_ids": list(layers), "mask_token_id": mask}} if config else None}

    block = {"expected": expected}
    assert judge(block, run(), ours, greedy, 0.1, 7, 3)[0]
    assert not judge(block, run(tau=2.5), ours, greedy, 0.1, 7, 3)[0]
    assert not judge(block, run(outputs=[[5, 7, 7, 9], [7, 7, 7, 3]]), ours, greedy, 0.1, 7, 3)[0]
    ok, note, found = judge(block, run(layers=(0, 2)), ours, greedy, 0.1, 7, 3)
    assert not ok and "engine target_layer_ids [0, 2], trained [1, 3]" in note and found["fields_match"] is False
    assert not judge(block, run(config=False), ours, greedy, 0.1, 7, 3)[0]
    wrong = {"expected": expected, "must_differ": "layers"}
    ok, note, _ = judge(wrong, run(layers=(0, 2)), ours, greedy, 0.1, 7, 3)
    assert ok and note.startswith(" (caught") and "would not" in note  # τ 2.05 is inside the band
    ok, note, _ = judge(wrong, run(), ours, greedy, 0.1, 7, 3)
    assert not ok and "NOT caught" in note
    control = {"control_token": 7, "expected": expected}
    # by hand: each output's one round (after the prefill token) sees 7, 7 then another token: 2 + 2 accepted
    predicted = 4
    assert predicted_acceptance(greedy, 7, 3) == {"num_drafts": 2, "num_accepted_tokens": predicted}
    # and rounds that accept a whole chain: [5 | 7 7 (1) | 7 7 (7) | (2)] at k = 2 is 3 rounds, 2 + 2 + 0
    assert predicted_acceptance([[5, 7, 7, 1, 7, 7, 7, 2]], 7, 2) == {"num_drafts": 3, "num_accepted_tokens": 4}
    assert judge(control, run(accepted=predicted), ours, greedy, 0.1, 7, 3)[0]
    assert not judge(control, run(accepted=predicted + 1), ours, greedy, 0.1, 7, 3)[0]
