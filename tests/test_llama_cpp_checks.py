"""The llama.cpp benchmarks' verdicts and pieces (benchmarks/llama_cpp_check.py, llama_cpp_speed.py; in
eval/engine_controls.py, engine_compare.py, engine_verdicts.py, layer_probe.py, llama_cpp_server.py,
llama_cpp_modes.py, llama_cpp_timing.py): controls, probes, verdicts, modes, timers and round costs, without a
llama.cpp build."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")

from spectrain.eval import layer_probe as probe_mod  # noqa: E402
from spectrain.eval import llama_cpp_server as server  # noqa: E402
from spectrain.eval.engine_compare import path_spread  # noqa: E402
from spectrain.eval.engine_controls import eagle3_control, mistaken_gguf  # noqa: E402
from spectrain.eval.engine_verdicts import llama_cpp_verdict  # noqa: E402
from spectrain.eval.llama_cpp_modes import (NGRAM_MODES, Draft, ModeRequest, draft_files, draft_modes,  # noqa: E402
                                            mode_flags, mode_of, parse_draft_mode)
from spectrain.eval.llama_cpp_timing import resummarize, round_costs, round_split, summarize  # noqa: E402
from spectrain.heads.errors import SpectrainError  # noqa: E402
from spectrain.heads.serving import eagle_gguf, llama_cpp  # noqa: E402

from spectrain.heads.eagle import EagleDrafter  # noqa: E402

from .conftest import make_verifier  # noqa: E402
from .gguf_helpers import LAYERS, VOCAB, dflash, eagle3, tiny_target_gguf  # noqa: E402


@pytest.fixture(scope="module")
def verifier():
    return make_verifier("llama", False, VOCAB, layers=LAYERS)

def test_control_proposes_its_token_at_every_step(verifier):
    token = 17
    drafter = eagle3_control(verifier, token, draft_vocab=64)
    ids = torch.randint(0, VOCAB, (2, 12))
    features = torch.randn(2, 12, drafter.config.fused_width) * 3
    embed = verifier.get_input_embeddings()
    hidden, _ = drafter(ids, features, embed)
    for _ in range(3):  # the first step and the steps fed back their own pre-norm output
        logits = drafter.logits(hidden)
        assert (logits.argmax(-1) == 0).all() and (logits[..., 0] > 1.0).all()  # a margin, not a tie
        assert (drafter.draft_to_target(logits.argmax(-1)) == token).all()
        hidden, _ = drafter.forward_hidden(ids, hidden, embed)


def test_vllm_control_proposes_its_token_through_a_zero_head(verifier):
    """The vLLM check's EAGLE-3 control (``scale=None``): only its lm_head is zeroed, every draft logit is 0 and
    the argmax's first index, draft id 0, is the token through d2t."""
    token = 17
    drafter = eagle3_control(verifier, token, draft_vocab=64, scale=None)
    ids = torch.randint(0, VOCAB, (2, 12))
    hidden, _ = drafter(ids, torch.randn(2, 12, drafter.config.fused_width), verifier.get_input_embeddings())
    logits = drafter.logits(hidden)
    assert (logits == 0).all() and (drafter.draft_to_target(logits.argmax(-1)) == token).all()
    with pytest.raises(SpectrainError, match="too close to the end"):
        eagle3_control(verifier, VOCAB - 10, draft_vocab=64, scale=None)


def test_mistaken_ggufs_carry_exactly_one_mistake(tmp_path, verifier):
    good = eagle_gguf.write_eagle3_gguf(eagle3(verifier), tmp_path / "g.gguf", tiny_target_gguf(tmp_path / "t.gguf"))
    layers = mistaken_gguf(good, tmp_path / "l.gguf", "layers", LAYERS)
    d2t = mistaken_gguf(good, tmp_path / "d.gguf", "d2t", LAYERS)
    g, l_, d = (llama_cpp.gguf_tensors(p) for p in (good, layers, d2t))
    ids = llama_cpp.read_metadata(good)["eagle3.target_layers"].value
    shift = 1 if max(ids) + 1 < LAYERS else -1  # ids stay inside the target
    assert llama_cpp.read_metadata(layers)["eagle3.target_layers"].value == [i + shift for i in ids]
    assert np.array_equal(np.array(d["d2t"][2]), np.roll(np.array(g["d2t"][2]), -1))
    assert all(np.array_equal(np.array(l_[k][2]), np.array(g[k][2])) for k in g)
    assert all(np.array_equal(np.array(d[k][2]), np.array(g[k][2])) for k in g if k != "d2t")


def test_layer_probe_drafts_by_the_sign_of_one_coordinate_of_one_layer(verifier):
    drafter = probe_mod.layer_probe(verifier, 1, 5, positive=11, negative=42, draft_vocab=64)
    layers = list(drafter.config.aux_layer_ids)
    ids = torch.randint(0, VOCAB, (20,)).tolist()
    drafts, margins = probe_mod.first_drafts(drafter, verifier, ids)
    coordinate = probe_mod.aux_states(verifier, ids, [layers[1]])[:, 5]  # (T,) the probed coordinate
    expected = torch.where(coordinate[:-2] > 0, 11, 42)  # position j is drafted from the features at j - 2
    assert torch.equal(drafts[2:], expected) and (drafts[:2] == -1).all()
    # sqrt(h) over every other draft token where |x| is well above the norm's eps, less only near x = 0
    assert (margins[2:] > 0).all() and margins[2:].median() > 0.5 * verifier.config.hidden_size ** 0.5
    shifted = probe_mod.shifted_layers(layers, LAYERS)
    assert shifted == [i + 1 for i in layers] or shifted == [i - 1 for i in layers]
    moved = probe_mod.aux_states(verifier, ids, [shifted[1]])[:, 5]
    assert not torch.equal(coordinate.sign(), moved.sign())  # the neighbouring layer's signs differ somewhere


def test_layer_probe_prediction_and_choice(verifier):
    # output [5, 7, 9, 7] after a 2-token prompt; drafts by absolute position (prompt 0-1, output 2-5)
    drafts = [torch.tensor([-1, -1, -1, 7, 3, 7])]
    # p=1: draft 7 at position 3, output 7: accepted, bonus 9; p=3: draft 7 at position 5 = 7: accepted
    assert probe_mod.predicted_acceptance([[5, 7, 9, 7]], [[1, 2]], drafts) == [{"accepted": 2, "rounds": 2}]
    drafts = [torch.tensor([-1, -1, -1, 3, 9, 3])]  # p=1 rejected, p=2 accepted (9), then p=4 ends
    assert probe_mod.predicted_acceptance([[5, 7, 9, 7]], [[1, 2]], drafts) == [{"accepted": 1, "rounds": 2}]
    torch.manual_seed(0)
    sequences = [(torch.randint(0, VOCAB, (6,)).tolist(), [int(x) for x in torch.randint(0, 3, (40,))])
                 for _ in range(3)]
    layers = [1, 3, 4]
    choice = probe_mod.choose_probe(verifier, layers, 0, sequences)
    assert {choice["positive"], choice["negative"]} <= {0, 1, 2} and choice["positive"] != choice["negative"]
    assert choice["positions_told_apart_named_layer"] > choice["positions_told_apart_shifted_layer"]
    # the probe built from that choice tells the two tokens apart as often as the choice counted
    drafter = probe_mod.layer_probe(verifier, 0, choice["dim"], choice["positive"], choice["negative"],
                                    draft_vocab=64, aux_layer_ids=layers)
    told = 0
    for prompt, out in sequences:
        d, _ = probe_mod.first_drafts(drafter, verifier, prompt + out)
        told += sum(int(d[len(prompt) + p]) == out[p] for p in range(1, len(out))
                    if out[p] in (choice["positive"], choice["negative"]))
    assert told == choice["positions_told_apart_named_layer"]


def test_kernel_spread_is_measured_where_both_paths_scored_the_same_context():
    def run(tokens, probs):
        return {"tokens": tokens, "probs": [{"top_logprobs": [{"id": i, "logprob": v} for i, v in p.items()]}
                                             for p in probs]}
    plain = run([5, 6, 7, 8], [{5: -0.1, 1: -3.0}, {6: -0.2}, {7: -0.5, 9: -0.5015}, {8: -0.1}])
    # the speculative path: position 1 an accepted draft (no probabilities), parts at position 2 (9 over 7)
    spec = run([5, 6, 9, 8], [{5: -0.1004, 1: -3.0}, {}, {9: -0.5001, 7: -0.5009}, {8: -5.0}])
    # after the parting the contexts differ (position 3's -5.0 is not counted)
    assert path_spread([plain], [spec], set()) == pytest.approx(0.0014)  # token 9 at the parting
    assert path_spread([plain], [run([5, 6, 7, 8], [{}, {}, {}, {}])], set()) is None


def test_probe_verdicts():
    plain = [[5, 6, 7, 8]] * 2
    counts = [_counts(21, 10), _counts(21, 4)]
    ours = {"tau": 2.0, "accepted": 14, "rounds": 20, "ar_tokens": plain}
    probe = {"probe_predicted": [10, 4], "expected_layers": [1, 2, 3], "engine_layers": [1, 2, 3]}
    assert llama_cpp_verdict(probe, plain, plain, counts, ours, 0.05, 9, 1)[0]
    assert not llama_cpp_verdict({**probe, "probe_predicted": [10, 5]}, plain, plain, counts, ours, 0.05, 9, 1)[0]
    assert not llama_cpp_verdict({**probe, "probe_predicted": [4, 10]}, plain, plain, counts, ours, 0.05, 9, 1)[0]
    twin = {**probe, "must_differ": "layers", "engine_layers": [2, 3, 4]}
    assert not llama_cpp_verdict(twin, plain, plain, counts, ours, 0.05, 9, 1)[0]  # the same counts: NOT caught
    assert llama_cpp_verdict({**twin, "probe_predicted": [11, 4]}, plain, plain, counts, ours, 0.05, 9, 1)[0]
    # a trained drafter's shifted layers: reported, not judged, once the probes decide that mistake
    informational = {"must_differ": "layers", "informational": True}
    ok, note, _ = llama_cpp_verdict(informational, plain, plain, counts, {**ours, "tau": 40 / 26}, 0.05, 9, 4)
    assert ok and "NOT caught by tau" in note and "informational" in note


def _counts(generated, accepted):
    return {"generated": generated, "accepted": accepted, "rounds": generated - 1 - accepted, "drafted": 4 * 10}


def test_check_verdicts():
    plain = [[5, 6, 7, 8]] * 2
    ours = {"tau": 2.0, "accepted": 10, "rounds": 10, "ar_tokens": plain}
    counts = [_counts(21, 10), _counts(21, 10)]  # (42 - 2 prefill tokens) / 20 rounds = 2.0
    ok, _, found = llama_cpp_verdict({"expected_layers": [1, 2, 3], "engine_layers": [1, 2, 3]}, plain, plain, counts, ours,
                               0.05, 9, 4)
    assert ok and found["tau_llama_cpp"] == pytest.approx(2.0) and found["relative_difference"] == 0
    assert not llama_cpp_verdict({}, plain, [[5, 6, 7, 9], [5, 6, 7, 8]], counts, ours, 0.05, 9, 4)[0]  # spec != plain
    slow = [_counts(21, 5), _counts(21, 5)]  # 40 / 30 rounds = 1.333: 33% below ours
    assert not llama_cpp_verdict({}, plain, plain, slow, ours, 0.05, 9, 4)[0]
    assert llama_cpp_verdict({"must_differ": "d2t"}, plain, plain, slow, ours, 0.05, 9, 4)[0]  # caught by tau
    missed = llama_cpp_verdict({"must_differ": "layers", "expected_layers": [1, 2, 3], "engine_layers": [1, 2, 3]},
                         plain, plain, counts, ours, 0.05, 9, 4)
    assert not missed[0] and "NOT caught" in missed[1]
    echoed = llama_cpp_verdict({"must_differ": "layers", "expected_layers": [1, 2, 3], "engine_layers": [2, 3, 4]},
                         plain, plain, counts, ours, 0.05, 9, 4)
    assert not echoed[0] and "NOT caught by tau" in echoed[1]  # the file's own layers read back prove nothing
    assert not llama_cpp_verdict({"expected_layers": [1, 2, 3], "engine_layers": [2, 3, 4]}, plain, plain, counts, ours,
                           0.05, 9, 4)[0]
    # a control proposing token 7 with k = 2 over [5, 6, 7, 8] (p from 1): rounds at 6 (0), 7 (1 accepted, then 8)
    control_plain = [[5, 6, 7, 8]]
    control = {"tau": 1.5, "accepted": 1, "rounds": 2, "ar_tokens": control_plain}  # (4 - 1) / 2
    right = [{"generated": 4, "accepted": 1, "rounds": 2, "drafted": 4}]
    assert llama_cpp_verdict({"control_token": 7}, control_plain, control_plain, right, control, 0.05, 7, 2)[0]
    parted = [[5, 6, 9, 8], [5, 6, 7, 8]]  # prompt 0 parts at position 2
    tie = [{"prompt": 0, "position": 2, "plain_margin": 2e-4}]
    assert not llama_cpp_verdict({}, plain, parted, counts, ours, 0.05, 9, 4)[0]  # no margins: a parting fails
    assert llama_cpp_verdict({}, plain, parted, counts, ours, 0.05, 9, 4, tie, 1e-3)[0]  # a measured near-tie passes
    assert not llama_cpp_verdict({}, plain, parted, counts, ours, 0.05, 9, 4, [{**tie[0], "plain_margin": 0.5}], 1e-3)[0]
    assert not llama_cpp_verdict({}, plain, parted, counts, ours, 0.05, 9, 4, [{**tie[0], "plain_margin": None}], 1e-3)[0]
    noisy = {"kernel_spread": 2e-4, "near_tie_max": 0.01}
    assert llama_cpp_verdict(noisy, plain, plain, counts, ours, 0.05, 9, 4)[0]
    assert not llama_cpp_verdict({**noisy, "kernel_spread": 0.5}, plain, plain, counts, ours, 0.05, 9, 4)[0]
    wrong = [{"generated": 4, "accepted": 0, "rounds": 3, "drafted": 6}]
    assert not llama_cpp_verdict({"control_token": 7}, control_plain, control_plain, wrong, control, 0.5, 7, 2)[0]


def test_rounds_from_llama_cpp_counters():
    done = server.rounds_and_tau({"tokens": list(range(11)), "timings": {"draft_n": 12, "draft_n_accepted": 4}})
    assert done == {"generated": 11, "drafted": 12, "accepted": 4, "rounds": 6}  # 1 prefill token + 6 rounds emit 10


def test_speed_summary_pools_each_repeat_against_plain():
    def r(n, ms, acc=0, drafted=0, tokens=(1, 2)):
        return {"timings": {"predicted_n": n, "predicted_ms": ms, "draft_n_accepted": acc, "draft_n": drafted},
                "tokens": list(range(n)), "tokens_eos_stripped": list(tokens)}

    runs = {"plain": [[r(10, 100), r(10, 100)], [r(10, 200), r(10, 200)]],
            "fast": [[r(10, 50, 4, 8), r(10, 50, 4, 8)], [r(10, 80, 4, 8), r(10, 120, 4, 8, tokens=(1, 3))]]}
    s = summarize(runs, [[1, 2], [1, 2]])
    assert s["fast"]["speedup"] == pytest.approx([2.0, 2.0])  # 20/100 vs 20/200, 20/200 vs 20/400
    assert s["fast"]["tau"] == pytest.approx(18 / 10)  # (20 - 2) / (2 * (10 - 1 - 4))
    assert s["fast"]["identical_prompts"] == 1 and s["plain"]["identical_prompts"] == 2
    assert s["fast"]["win"] and not s["plain"]["win"]


def test_draft_modes_parse_and_name_their_settings():
    m = parse_draft_mode("k4:q8_0:p0.6:t1", "eagle3")
    assert (m.k, m.dtype, m.p_min, m.threads, m.name) == (4, "q8_0", 0.6, 1, "eagle3-k4-q8_0-p0.6-t1")
    assert parse_draft_mode("3", "eagle3").name == "eagle3-k3"
    assert parse_draft_mode("k1:f16", "dflash").name == "dflash-k1-f16"
    tiny = parse_draft_mode("k1:p0.00001", "eagle3")  # a p-min named in fixed point, read back
    assert tiny.name == "eagle3-k1-p0.00001" and mode_of(tiny.name) == tiny
    for bad in ("", "kx", "k1:q4", "k0", "k2:p1.5", "k1:t0"):
        with pytest.raises(SpectrainError, match="draft mode"):
            parse_draft_mode(bad, "eagle3")
    # a result's mode names back to their settings (the recorded eagle3-* rows among them); plain and n-gram: none
    assert mode_of("eagle3-k4-q8_0-p0.6-t1") == m and mode_of("dflash-k1-f16").draft == "dflash"
    assert [mode_of(x) for x in ("plain", "ngram-map-k", "ngram-simple")] == [None, None, None]
    request = ModeRequest(lengths="1,2", extra="k1:q8_0, k2 k1:q8_0")  # --draft_lengths 1,2 --draft_modes '...'
    assert [m.name for m in draft_modes(request, "eagle3")] == ["eagle3-k1", "eagle3-k2", "eagle3-k1-q8_0"]
    flags = mode_flags(request, Draft("draft-eagle3", {"f32": Path("a.gguf"), "q8_0": Path("b.gguf")}))
    assert flags["eagle3-k1-q8_0"][:2] == ["-md", "b.gguf"] and "--spec-draft-n-max" in flags["eagle3-k2"]
    assert flags["eagle3-k2"][flags["eagle3-k2"].index("--spec-type") + 1] == "draft-eagle3"


def test_speed_drafts_any_family_that_writes_a_llama_cpp_file(tmp_path, verifier):
    """llama_cpp_speed.py writes the draft as the family's GGUF writer does and serves it with the family's
    --spec-type: a DFlash run dir gives dflash-* modes of its whole block (the writer pins it) and nothing else; a
    .gguf names its own type where its architecture says it, else --spec_type is asked for."""
    target = tiny_target_gguf(tmp_path / "t.gguf")
    run = tmp_path / "dflash"
    dflash(verifier).save_pretrained(run)

    def files(drafter, out, lengths=None, extra="", spec_type=None):
        """draft_files as llama_cpp_speed.py calls it for --drafter, --draft_lengths, --draft_modes, --spec_type."""
        return draft_files(ModeRequest(lengths, extra), str(drafter), out, str(target), spec_type=spec_type)

    draft = files(run, tmp_path / "out", extra="k3:q8_0")
    assert (draft.spec_type, draft.name, draft.block, sorted(draft.files)) == (
        "draft-dflash", "dflash", 3, ["f32", "q8_0"])
    assert llama_cpp.read_metadata(draft.files["q8_0"])["general.architecture"].value == "dflash"
    flags = mode_flags(ModeRequest(extra="k3:q8_0"), draft)  # default lengths: the block
    assert list(flags) == ["plain", "dflash-k3", "dflash-k3-q8_0", *NGRAM_MODES]
    assert flags["dflash-k3"][flags["dflash-k3"].index("--spec-type") + 1] == "draft-dflash"
    for extra in ({"lengths": "1,3"}, {"extra": "k2:q8_0"}):  # fewer slots than trained
        with pytest.raises(SpectrainError, match="whole block of 3 tokens"):
            files(run, tmp_path / "refused", **extra)
        assert not (tmp_path / "refused" / "draft-dflash-q8_0.gguf").exists()  # refused before that dtype's write
    with pytest.raises(SpectrainError, match="draft-dflash or draft-dspark"):  # one architecture, two draft types
        files(draft.files["f32"], tmp_path / "out")
    written = files(draft.files["f32"], tmp_path / "out", lengths="3", spec_type="draft-dflash")
    assert written.spec_type == "draft-dflash" and written.files == {"f32": draft.files["f32"]}
    with pytest.raises(SpectrainError, match="--spec_type draft-x: not a draft type"):
        files(draft.files["f32"], tmp_path / "out", spec_type="draft-x")
    eagle3_dir = tmp_path / "eagle3"
    eagle3(verifier).save_pretrained(eagle3_dir)
    e3 = files(eagle3_dir, tmp_path / "out", lengths="1,2")
    assert (e3.spec_type, e3.block, list(e3.files)) == ("draft-eagle3", None, ["f32"])
    assert files(e3.files["f32"], tmp_path / "out").spec_type == "draft-eagle3"  # by its arch
    eagle1 = tmp_path / "eagle1"
    EagleDrafter.for_verifier(verifier, "eagle1", verifier_name="v").save_pretrained(eagle1)
    with pytest.raises(SpectrainError, match="^--drafter: .*EAGLE-1"):
        files(eagle1, tmp_path / "out")


STATS = ("0.27.852 I spec common_specu: statistics     draft-eagle3: #calls(b,g,a) =    1    {g}    {g}, #gen drafts = "
         "{g}, #acc drafts = 13, #gen tokens = 446, #acc tokens = 13, #mean acc len = 1.12, #acc rate/pos = (0.115), "
         "dur(b,g,a) = 0.005, {ms}, 0.212 ms")


def test_draft_timer_is_read_from_the_log_without_the_warm_up():
    log = "\n".join(["noise", STATS.format(g=3, ms="30.000"), "slot print_timing", STATS.format(g=13, ms="52.500"),
                     STATS.format(g=23, ms="90.000")])
    assert [x["calls_draft"] for x in server.spec_statistics(log)] == [3, 13, 23]
    assert server.draft_time(log) == {"impl": "draft-eagle3", "calls": 20, "draft_ms": 60.0, "accept_ms": 0.0}
    assert server.draft_time("no statistics here") is None and server.draft_time(STATS.format(g=3, ms="1.0")) is None
    split = round_split({"rounds_all_repeats": 20, "ms_per_round_pooled": 10.0}, server.draft_time(log))
    assert split["draft_ms_per_round"] == pytest.approx(3.0) and split["rest_ms_per_round"] == pytest.approx(7.0)
    assert round_split({"rounds_all_repeats": 20, "ms_per_round_pooled": 10.0}, None) == {}


def test_resolved_layers_are_read_from_the_loaders_log(tmp_path):
    log = tmp_path / "server.log"
    log.write_text("load: something\nEAGLE3 extract_layers = [2, 15, 27]\n")
    assert server.resolved_layers(log) == [2, 15, 27]
    log.write_text("DFlash extract_layers = [1,3]\n")
    assert server.resolved_layers(log) == [1, 3]
    log.write_text("no draft here\n")
    assert server.resolved_layers(log) is None


def test_round_costs_against_plain_by_hand(tmp_path, capsys):
    modes = {"plain": {"ms_per_round_pooled": 10.0},
             "eagle3-k1": {"ms_per_round_pooled": 16.0, "draft_ms_per_round": 1.5},
             "eagle3-k3-q8_0": {"ms_per_round_pooled": 24.0, "draft_ms_per_round": 2.0},
             "eagle3-k4-p0.5": {"ms_per_round_pooled": 20.0, "draft_ms_per_round": 2.0},  # variable length: left out
             "ngram-map-k": {"ms_per_round_pooled": 10.5, "draft_ms_per_round": 0.1}}
    costs = {"forward_ms": {"1": 7.0, "2": 11.0}}
    rows = round_costs(modes, costs)
    assert set(rows) == {"eagle3-k1", "eagle3-k3-q8_0"}
    assert rows["eagle3-k1"] == {"k": 1, "ms_per_round": 16.0, "plain_ms_per_token": 10.0, "break_even_tau": 1.6,
                                 "ceiling_speedup": 1.25, "draft_ms": 1.5, "verify_ms_llama_bench": 11.0,
                                 "other_ms": 3.5}
    assert rows["eagle3-k3-q8_0"]["ceiling_speedup"] == pytest.approx(40 / 24)
    assert rows["eagle3-k3-q8_0"]["other_ms"] is None  # no 4-token forward timed
    assert round_costs(modes, costs, p_min=0.3) == {}  # the run's own p-min: every round's length varies
    result = tmp_path / "r.json"  # llama_cpp_speed.py --resummarize FILE
    result.write_text(json.dumps({"targets": {"q4_1": {"modes": modes, "forward_costs": costs}}}))
    resummarize(str(result))
    assert capsys.readouterr().out.strip().splitlines()[-1] == str(result.resolve())
    assert json.loads(result.read_text())["targets"]["q4_1"]["round_costs"]["eagle3-k1"]["other_ms"] == 3.5
    result.write_text(json.dumps({"targets": {"q4_1": {"modes": modes}}}))
    with pytest.raises(SpectrainError, match="forward costs"):
        resummarize(str(result))
