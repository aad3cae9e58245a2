"""``spectrain-plan`` (spectrain.eval.forecast): a speedup forecast from α by depth and an engine's cost profile.
Hand-computed profiles with known answers (break-even τ, the all-accepted ceiling, "does not pay", interpolation,
a setting's own round priced back to itself), each committed profile format read, the committed check reproduced,
and the command end to end (its last stdout line the JSON's path; bad input: ``error: …``, exit 2). No decoding."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from spectrain.eval.forecast import (CostProfile, acceptance_of, check_rows, draft_cost, forecast, forward_cost,
                                     held_out, infer_drafting, main, overhead_cost, price, profile_from_dict,
                                     profiles_of)
from spectrain.heads.errors import SpectrainError

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "docs" / "results"


def load(name: str) -> dict:
    return json.loads((RESULTS / f"{name}.json").read_text())


def toy(**kw) -> CostProfile:
    """AR 10 ms/token; forwards 12 ms over 2 tokens and 16 over 4 (a line of 2 ms a token); a draft step 1 ms."""
    fields = dict(engine="toy", name="toy", ar_ms=10.0, forward_ms={1: 10.0, 2: 12.0, 4: 16.0}, draft_ms={1: 1.0})
    return CostProfile(**{**fields, **kw})


def test_hand_computed_speedups_break_even_and_ceiling():
    result = forecast([0.5, 0.5, 0.5], toy())
    rows = {(r["drafting"], r["k"]): r for r in result["rows"]}
    k1, k2, k3 = rows["sequential", 1], rows["sequential", 2], rows["sequential", 3]
    # chain 1: forward over 2 (12) + one step (1) = 13 ms; tau 1.5 -> 1.5 * 10 / 13
    assert k1["round_ms"] == pytest.approx(13.0) and k1["expected_tau"] == pytest.approx(1.5)
    assert k1["expected_speedup"] == pytest.approx(15 / 13)
    assert k1["break_even_tau"] == pytest.approx(1.3) and k1["ceiling_speedup"] == pytest.approx(20 / 13)
    # chain 2: forward over 3 not measured: 14 on the line; two steps; tau 1.75
    assert k2["forward_ms"] == pytest.approx(14.0) and k2["priced"]["forward"] == "line"
    assert k2["expected_speedup"] == pytest.approx(17.5 / 16) and k2["ceiling_speedup"] == pytest.approx(30 / 16)
    assert k3["expected_speedup"] == pytest.approx(18.75 / 19)
    # parallel: one draft forward, priced as one step (assumed) -> chain 2 costs 15 and is the best setting
    par = rows["parallel", 2]
    assert par["draft_ms"] == pytest.approx(1.0) and "assumed" in par["priced"]["draft"]
    assert result["best"] is par and result["pays"] and result["verdict"].startswith("best: chain 2, parallel")
    assert any("n = 3" in n for n in result["notes"])  # the unmeasured forward is said


def test_speculation_does_not_pay_and_says_so():
    result = forecast([0.1, 0.05], toy())
    assert not result["pays"]
    assert result["verdict"].startswith("speculation does not pay here")
    assert max(r["expected_speedup"] for r in result["rows"]) < 1.0
    assert result["best"]["expected_speedup"] == pytest.approx(1.1 * 10 / 13)  # chain 1: the best of a bad lot


def test_overhead_comes_from_timed_rounds_and_prices_a_measured_round_back_to_itself():
    p = toy(draft_ms={1: 1.0, 2: 2.2, 3: 3.0}, round_ms={1: 15.0, 2: 19.0, 3: 23.0},
            forward_ms={1: 10.0, 2: 12.0, 3: 15.0, 4: 16.0})
    for k, measured in p.round_ms.items():  # every timed round is priced at what it measured, whatever the line
        assert price(p, k, "sequential")["round_ms"] == pytest.approx(measured)
        assert price(p, k, "sequential", "points")["round_ms"] == pytest.approx(measured)
    # the overhead at 2 with the forwards as measured: 19 - 2.2 - 12... over 3 tokens = 15 -> 1.8
    assert overhead_cost(p, 2, "points") == (pytest.approx(19.0 - 2.2 - 15.0), "measured")
    # held out: chain 2's draft and round dropped; its overhead interpolated between chains 1 and 3
    out = held_out(p, 2)
    assert 2 not in out.round_ms and 2 not in out.draft_ms and out.forward_ms == p.forward_ms  # forwards apart
    rest1, rest3 = overhead_cost(out, 1)[0], overhead_cost(out, 3)[0]
    assert overhead_cost(out, 2) == (pytest.approx((rest1 + rest3) / 2), "interpolated")
    assert draft_cost(out, 2, "sequential") == (pytest.approx(2 * 4.0 / 4), "k × the measured step")
    # no timed round: no overhead, and the notes say the speedups are upper bounds
    assert overhead_cost(toy(), 3) == (0.0, "not measured (0)")
    assert any("upper bounds" in n for n in forecast([0.5], toy())["notes"])


def test_forward_pricing_rules():
    p = toy(forward_ms={1: 94.0, 6: 179.0})  # one-token forward apart: a 3-token verify is held at the 6-token one
    assert forward_cost(p, 1) == (94.0, "measured")
    assert forward_cost(p, 3) == (179.0, "held at n = 6")
    noisy = toy(forward_ms={1: 20.0, 2: 24.0, 3: 29.0, 4: 28.0, 5: 26.0, 7: 32.0})
    assert forward_cost(noisy, 4, "points") == (28.0, "measured")
    line4 = forward_cost(noisy, 4)[0]
    assert 26.0 < line4 < 29.0  # the least-squares line, not the scattered point
    assert forward_cost(noisy, 6, "points") == (pytest.approx(29.0), "interpolated")
    falling = toy(forward_ms={1: 5.0, 3: 9.0, 6: 7.0})  # a fit that falls is noise: flat at the mean
    assert forward_cost(falling, 10) == (pytest.approx(8.0), "line, extrapolated")
    with pytest.raises(SpectrainError, match="forward model"):
        forward_cost(p, 2, "cubic")
    with pytest.raises(SpectrainError, match="no forward over 2 or more"):
        toy(forward_ms={1: 10.0})


def test_drafting_is_inferred_from_how_the_draft_grows():
    assert infer_drafting({1: 1.9, 6: 10.4}) == "sequential"  # llama.cpp's EAGLE-3 draft timer
    assert infer_drafting({1: 4.19, 2: 4.14, 3: 4.08, 7: 4.42}) == "parallel"  # a block drafter's one forward
    assert infer_drafting({5: 9.0}) is None
    par = toy(draft_ms={1: 4.0, 7: 4.4}, drafting="parallel")
    assert draft_cost(par, 3, "parallel") == (pytest.approx(4.2), "the measured draft forward")
    assert draft_cost(par, 3, "sequential")[0] == pytest.approx(12.6)


def test_profile_json_round_trips_and_names_what_is_missing():
    p = toy(round_ms={1: 15.0}, notes=("measured by hand",))
    assert profile_from_dict(json.loads(json.dumps(p.to_dict()))) == p
    assert profiles_of(p.to_dict(), "p.json") == {"toy": replace(p, source="p.json")}
    with pytest.raises(SpectrainError, match="lacks 'ar_ms'"):
        profile_from_dict({"engine": "vllm", "forward_ms": {"2": 1.0}}, "mine.json")
    with pytest.raises(SpectrainError, match="drafting must be"):
        toy(drafting="sideways")


def test_reads_our_loops_eval_json():
    record = load("quickstart_eagle3")
    (name, p), = profiles_of(record, "quickstart_eagle3.json").items()
    ar, chain = record["results"]["ar"], record["results"]["chain-4"]
    assert name == "ours" and p.engine == "spectrain" and p.forward_in_rounds
    assert p.ar_ms == ar["decode_ms_per_token"] and p.forward_ms == {1: ar["round_ms"]["verify"],
                                                                     5: chain["round_ms"]["verify"]}
    assert p.draft_ms == {4: chain["round_ms"]["draft"]} and p.drafting == "sequential"
    assert p.round_ms[4] == pytest.approx(sum(chain["round_ms"].values()))
    assert acceptance_of(record, "q")["chain-4"]["alpha"] == chain["alpha"]


def test_reads_repeat_eval_and_draft_heads_files():
    runs = profiles_of(load("quickstart_eagle3_amx"), "amx")
    assert list(runs) == ["run1", "run2", "run3"]
    assert set(acceptance_of(load("quickstart_eagle3_amx"), "amx")) == {"run1/chain-4", "run2/chain-4", "run3/chain-4"}
    speed = profiles_of(load("speed_bf16"), "speed_bf16")
    assert set(speed) == {"eagle1@8192", "hybrid-eagle1@8192", "eagle3@8192"}
    assert set(speed["eagle1@8192"].draft_ms) == {2, 5} and speed["eagle1@8192"].drafting == "sequential"
    assert "Xeon" in speed["eagle1@8192"].cpu and speed["eagle1@8192"].dtype == "bfloat16"
    short = profiles_of(load("short_chains"), "short_chains")
    assert short["dflash@8192"].drafting == "parallel" and short["eagle1@8192"].drafting == "sequential"


def test_reads_llama_cpp_rounds_and_prices_each_round_back():
    record = load("llama_cpp_rounds_smollm2")
    profiles = profiles_of(record, "rounds")
    assert set(profiles) == {"f32", "f32:q8_0", "f32:f16", "f32:t1", "q4_1", "q4_1:q8_0", "q4_1:f16", "q4_1:t1"}
    f32, modes = profiles["f32"], record["targets"]["f32"]["modes"]
    assert f32.engine == "llama.cpp" and f32.ar_ms == modes["plain"]["ms_per_round_pooled"]
    assert f32.forward_ms[7] == record["targets"]["f32"]["forward_costs"]["forward_ms"]["7"]
    assert set(f32.round_ms) == {1, 2, 3, 4, 6} and f32.drafting == "sequential"
    assert price(f32, 4, "sequential")["round_ms"] == pytest.approx(modes["eagle3-k4"]["ms_per_round_pooled"])
    assert "2 CPUs" in f32.cpu and "2 threads" in f32.cpu


def test_results_without_costs_are_refused_with_the_reason():
    with pytest.raises(SpectrainError, match="no forward_costs"):
        profiles_of(load("llama_cpp_speed_smollm2"), "speed")
    with pytest.raises(SpectrainError, match="unmeasured"):
        profiles_of(load("engine_check_smollm2_controls"), "vllm")
    with pytest.raises(SpectrainError, match="holds no engine costs"):
        profiles_of(load("distill_engines_amx"), "distill")
    with pytest.raises(SpectrainError, match="no α by depth"):
        acceptance_of(load("llama_cpp_rounds_smollm2"), "rounds")


def test_the_committed_check_is_what_the_library_computes():
    committed = load("forecast_check")
    rows = [r for f in committed["files"] for r in check_rows(json.loads((ROOT / f).read_text()), Path(f).stem)]
    assert len(rows) == len(committed["rows"])
    for got, saved in zip(rows, committed["rows"]):
        assert (got["file"], got["setting"]) == (saved["file"], saved["setting"])
        for key in ("forecast_speedup", "held_out_speedup", "measured_speedup"):
            assert got[key] == pytest.approx(saved[key]) if saved[key] is not None else got[key] is None
    forecast_rows = [r for r in rows if r["error"] is not None and "slots" not in r]
    assert forecast_rows and all(abs(r["error"]) <= committed["tolerance"] for r in forecast_rows)
    slotted = [r for r in rows if r["error"] is not None and "slots" in r]  # llama.cpp's parallel slots, apart
    assert {r["slots"] for r in slotted} == {1, 2, 4}
    busy = [r for r in slotted if r["setting"].endswith(", busy")]
    assert busy and committed["summary"]["parallel_slots_busy"]["settings"] == len(busy)
    assert committed["summary"]["parallel_slots"]["settings"] == len(slotted) - len(busy)


def test_slots_price_every_sequence_in_one_forward():
    p = toy(round_ms={1: 16.0})  # one slot, chain 1: forward over 2 (12) + draft 1 + overhead 3
    one, two = price(p, 1, "sequential"), price(p, 1, "sequential", slots=2)
    assert one["round_ms"] == pytest.approx(16.0) and one["slots"] == 1 and one["ar_ms"] == pytest.approx(10.0)
    width = 12.0 / 10.0  # forward(2) / forward(1)
    assert two["forward_ms"] == pytest.approx(16.0)  # 2 slots x 2 tokens: the forward over 4
    assert two["draft_ms"] == pytest.approx(1.0 * width) and two["overhead_ms"] == pytest.approx(3.0 * width)
    assert two["ar_ms"] == pytest.approx(10.0 * width) and "assumed" in two["priced"]["draft"]
    assert two["ceiling_speedup"] == pytest.approx(2 * 12.0 / (16.0 + 4 * width))
    result = forecast([0.5], p, slots=2)
    assert result["slots"] == 2 and any("2 slots" in n for n in result["notes"])
    with pytest.raises(SpectrainError, match="slots must be >= 1"):
        price(p, 1, "sequential", slots=0)


def test_the_command_end_to_end(tmp_path, capsys):
    out = tmp_path / "plan.json"
    main([str(RESULTS / "speed_bf16.json"), "--setting", "eagle1@8192/chain-5", "--costs",
          str(RESULTS / "llama_cpp_rounds_smollm2.json"), "--profile", "q4_1", "--out", str(out)])
    printed = capsys.readouterr().out.strip().splitlines()
    assert printed[-1] == str(out.resolve())
    summary = json.loads(out.read_text())
    assert summary["command"].startswith("spectrain-plan ") and summary["profile"]["engine"] == "llama.cpp"
    assert not summary["pays"] and any(line.startswith("speculation does not pay here") for line in printed)
    assert {r["drafting"] for r in summary["rows"]} == {"sequential", "parallel"}
    assert [r["k"] for r in summary["rows"]] == [1, 2, 3, 4, 5] * 2
    # the output's profile is a cost profile itself
    again = tmp_path / "again.json"
    main([str(RESULTS / "speed_bf16.json"), "--setting", "eagle1@8192/chain-5", "--costs", str(out),
          "--out", str(again)])
    assert json.loads(again.read_text())["rows"] == summary["rows"]


@pytest.mark.parametrize("argv, message", [
    (["missing.json"], "acceptance file not found"),
    (["{no_alpha}"], "no α by depth"),
    (["{quickstart}", "--engine", "tensorrt"], "unknown engine 'tensorrt'"),
    (["{quickstart}", "--engine", "vllm"], "unmeasured"),
    (["{quickstart}", "--setting", "chain-9"], "no setting with α 'chain-9'"),
    (["{quickstart}", "--costs", "{rounds}", "--profile", "f64"], "no cost profile 'f64'"),
])
def test_bad_input_is_an_error_with_exit_2(tmp_path, capsys, argv, message):
    no_alpha = tmp_path / "eval.json"
    no_alpha.write_text(json.dumps({"results": {"ar": {"alpha": [], "round_ms": {"verify": 1.0}},
                                                "chain-4": {"alpha": [None, None]}}}))
    paths = {"no_alpha": no_alpha, "quickstart": RESULTS / "quickstart_eagle3.json",
             "rounds": RESULTS / "llama_cpp_rounds_smollm2.json"}
    with pytest.raises(SystemExit) as exit_:
        main([a.format(**paths) for a in argv] + ["--out", str(tmp_path / "out.json")])
    assert exit_.value.code == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "out.json").exists()


@pytest.mark.integration  # a subprocess
def test_the_installed_script_prints_no_traceback(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "spectrain.eval.forecast", str(tmp_path / "nothing.json")],
                          capture_output=True, text=True)
    assert proc.returncode == 2 and proc.stderr.startswith("error: ") and "Traceback" not in proc.stderr


def test_measured_plain_decoding_at_p_slots_prices_the_round():
    """With plain decoding measured at P busy slots (slot_ms), that is the AR step at P, and the round pays the
    one-slot overhead plus what P slots add beyond the one-sequence forward (slot_excess); the draft still grows
    as forward(P) / forward(1). The profile JSON carries slot_ms."""
    from spectrain.eval.forecast import profile_from_dict, slot_excess

    p = toy(round_ms={1: 16.0}, slot_ms={1: 12.5, 2: 17.5})  # forward(1) 10, forward(2) 12; ar_ms 10
    clock = 10.0 / 12.5  # the busy measurement read on the profile's clock
    assert slot_excess(p, 2) == pytest.approx((17.5 - 12.5) * clock - (12.0 - 10.0))
    assert slot_excess(p, 4) is None and slot_excess(toy(slot_ms={2: 14.0}), 2) is None
    two = price(p, 1, "sequential", slots=2)
    width = 12.0 / 10.0
    assert two["ar_ms"] == pytest.approx(17.5 * clock) and two["forward_ms"] == pytest.approx(16.0)
    assert two["draft_ms"] == pytest.approx(1.0 * width) and two["overhead_ms"] == pytest.approx(3.0 + 2.0)
    assert two["priced"]["ar"].startswith("measured plain decoding at 2 slots")
    assert price(p, 1, "sequential", slots=4)["priced"]["ar"].startswith("ar_ms ×")  # not measured at 4: assumed
    assert any("measured at 2 busy slots" in n for n in forecast([0.5], p, slots=2)["notes"])
    assert profile_from_dict(p.to_dict()).slot_ms == {1: 12.5, 2: 17.5}
    with pytest.raises(SpectrainError, match="slot_ms needs slot counts >= 1 with steps > 0 ms"):
        toy(slot_ms={1: 0.0, 2: 14.0})
    cheap = toy(round_ms={1: 16.0}, slot_ms={1: 12.5, 2: 12.5})  # plain decoding no slower at 2 than at 1
    held = price(cheap, 1, "sequential", slots=2)  # the excess (-2 ms) would take the overhead (3 ms) to 1: kept
    assert held["overhead_ms"] == pytest.approx(1.0) and "held at 0" not in held["priced"]["overhead"]
    flat = toy(round_ms={1: 12.5}, slot_ms={1: 12.5, 2: 12.5})  # overhead -0.5 measured, -2.5 with the excess
    low = price(flat, 1, "sequential", slots=2)
    assert low["overhead_ms"] == 0.0 and low["priced"]["overhead"].endswith("held at 0")


def test_a_busy_file_gives_its_profiles_plain_decoding_at_each_slot_count():
    for name in ("llama_cpp_slots_busy_smollm2", "llama_cpp_slots_busy_f32_smollm2"):
        record = load(name)
        target = next(iter(record["targets"]))
        busy = {int(P): rows["plain"]["busy"]["tok_per_s_median"]
                for P, rows in record["targets"][target]["parallel"].items()}
        for profile in profiles_of(record, name).values():
            assert profile.slot_ms == {P: pytest.approx(1000.0 * P / v) for P, v in busy.items()}
    assert profiles_of(load("llama_cpp_rounds_smollm2"), "rounds")["q4_1"].slot_ms == {}  # no busy rows there


def test_busy_slots_are_what_the_slot_forecast_is_judged_against():
    """A slot measurement with a busy part (every slot decoding to the end): the busy row is forecast and judged,
    the wall-clock row beside it is reported, not forecast; a file without a busy part judges the wall clock."""
    from spectrain.eval.forecast import _slot_rows

    p = toy(round_ms={1: 16.0}, name="t")
    wall = {"speedup_median": 0.6, "speedup_min": 0.5, "speedup_max": 0.7, "accepted": 30, "drafted": 100}
    busy = {**wall, "speedup_median": 0.9, "speedup_min": 0.85, "speedup_max": 0.95, "accepted": 50}
    both = _slot_rows("f", "t", {"t": p}, "eagle3-k1", 2, {**wall, "busy": busy}, "line")
    assert [r["setting"] for r in both] == ["eagle3-k1 at 2 slots, busy", "eagle3-k1 at 2 slots"]
    judged, shown = both
    priced = price(p, 1, "sequential", slots=2)
    assert judged["tau"] == pytest.approx(1.5) and judged["forecast_speedup"] == pytest.approx(
        1.5 * priced["ar_ms"] / priced["round_ms"])
    assert judged["error"] == pytest.approx(judged["forecast_speedup"] / 0.9 - 1) and judged["slots"] == 2
    assert shown["error"] is None and "busy row" in shown["note"]
    assert "assumed_width_speedup" not in judged  # no plain decoding measured at P: nothing to set beside it
    measured = _slot_rows("f", "t", {"t": replace(p, slot_ms={1: 10.5, 2: 14.0})}, "eagle3-k1", 2,
                          {**wall, "busy": busy}, "line")[0]
    assert measured["assumed_width_speedup"] == pytest.approx(judged["forecast_speedup"])  # the older pricing
    assert measured["forecast_speedup"] != pytest.approx(judged["forecast_speedup"])
    (old,) = _slot_rows("f", "t", {"t": p}, "eagle3-k1", 2, wall, "line")
    assert old["tau"] == pytest.approx(1.3) and old["error"] == pytest.approx(old["forecast_speedup"] / 0.6 - 1)


def test_draft_sampling_flag_and_slot_table():
    from spectrain.eval import llama_cpp_modes, llama_cpp_timing

    flags = {"plain": [], "eagle3-k1": ["-md", "d.gguf"], "ngram-map-k": ["--spec-type", "ngram-map-k"]}
    off = llama_cpp_modes.draft_sampling(flags, "off")
    assert off == {"plain": [], "eagle3-k1": ["-md", "d.gguf", "--no-spec-draft-backend-sampling"],
                   "ngram-map-k": ["--spec-type", "ngram-map-k"]}  # our draft modes only
    assert llama_cpp_modes.draft_sampling(flags, "on") == flags and flags["eagle3-k1"] == ["-md", "d.gguf"]
    with pytest.raises(SpectrainError, match="on or off"):
        llama_cpp_modes.draft_sampling(flags, "maybe")
    par = load("llama_cpp_slots_busy_smollm2")["targets"]["q4_1"]["parallel"]
    busy = llama_cpp_timing.slot_table(par, "busy", "t").splitlines()
    assert busy[1].split()[:4] == ["slots", "mode", "busy", "tok/s"]
    assert busy[4].split()[:3] == ["1", "eagle3-k1", "82.5"] and busy[4].split()[-2:] == ["210/548", "6/6"]
    wall = llama_cpp_timing.slot_table(par, None, "t").splitlines()
    row = llama_cpp_timing.slot_speeds([90.0, 110.0, 100.0], [100.0, 100.0, 100.0],
                                       [{"accepted": 3, "drafted": 8}, {"accepted": 1, "drafted": 4}])
    assert (row["speedup_median"], row["speedup_min"], row["win"], row["accepted"], row["drafted"]) == (
        pytest.approx(1.0), pytest.approx(0.9), False, 4, 12)
    assert wall[1].split()[2] == "aggregate" and wall[4].split()[:3] == ["1", "eagle3-k1", "78.6"]


def test_busy_speed_takes_each_prompts_longest_copy():
    from spectrain.eval.llama_cpp_timing import busy_speed

    copy = lambda n, ms: {"tokens": [0] * n, "timings": {"predicted_n": n, "predicted_ms": ms}}  # noqa: E731
    speed = busy_speed([[copy(100, 900.0), copy(100, 1000.0)], [copy(50, 500.0), copy(50, 500.0)]])
    assert speed["decode_ms"] == pytest.approx(1500.0) and speed["tokens"] == 300
    assert speed["tok_per_s"] == pytest.approx(200.0)
    with pytest.raises(SpectrainError, match="no decode time"):
        busy_speed([[{"tokens": [1], "timings": {}}]])
