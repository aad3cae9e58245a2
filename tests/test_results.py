"""spectrain-results: every row measured once, lossless at T=0, resumable after a kill, stale rows redone."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

import spectrain.eval.results as results_mod
from spectrain.eval.results import load_set, parse_args, results
from spectrain.heads.eagle import EagleDrafter
from spectrain.heads.errors import SpectrainError
from spectrain.heads.medusa import MedusaHeads
from spectrain.heads.verifier import load_verifier


@pytest.fixture(scope="module")
def setup(tmp_path_factory, verifier_factory):
    root = tmp_path_factory.mktemp("results")
    verifier_dir = verifier_factory("llama", False)
    model = load_verifier(str(verifier_dir)).model
    MedusaHeads.for_verifier(model, num_heads=3, verifier_name=str(verifier_dir)).save_pretrained(root / "medusa")
    EagleDrafter.for_verifier(model, "eagle1", verifier_name=str(verifier_dir)).save_pretrained(root / "eagle1")
    cats = ["writing", "math", "coding"]
    (root / "mt.jsonl").write_text("\n".join(json.dumps({"question_id": i, "category": cats[i // 2],
                                                         "turns": [f"tell me of the king {i}", "and then?"]})
                                             for i in range(6)))
    (root / "alpaca.jsonl").write_text("\n".join(json.dumps({"instruction": f"name a river {i}", "input": ""})
                                                 for i in range(3)))
    (root / "gsm8k.jsonl").write_text("\n".join(json.dumps({"question": f"what is {i} plus {i}?", "answer": "#### 2"})
                                                for i in range(3)))
    return root, verifier_dir


def argv(setup, out, *extra):
    root, verifier_dir = setup
    return ["--verifier", str(verifier_dir), "--drafter", f"medusa={root / 'medusa'}", "--drafter",
            f"eagle1={root / 'eagle1'}", "--sampled", "eagle1", "--mt_bench", str(root / "mt.jsonl"),
            "--alpaca", str(root / "alpaca.jsonl"), "--gsm8k", str(root / "gsm8k.jsonl"), "--num_prompts", "3", "gsm8k=2",
            "--max_new_tokens", "10", "--k", "3", "--tree_nodes", "6", "--tree_depth", "3", "--tree_topk", "2",
            "--device", "cpu", "--out", str(out), *extra]


def rows_of(out):
    return {p.name: json.loads(p.read_text()) for p in (out / "rows").glob("*.json")}


def test_mt_bench_prompts_are_spread_over_categories(setup):
    root = setup[0]
    picked = load_set("mt_bench", str(root / "mt.jsonl"), 3)
    assert [p["category"] for p in picked] == ["writing", "math", "coding"]  # not the first three rows
    assert [p["prompt"] for p in picked] == ["tell me of the king 0", "tell me of the king 2", "tell me of the king 4"]
    assert len(load_set("mt_bench", str(root / "mt.jsonl"), 80)) == 6


@pytest.mark.integration
def test_end_to_end_then_kill_and_resume(setup, tmp_path, monkeypatch):
    straight = tmp_path / "straight"
    proc = subprocess.run([sys.executable, "-m", "spectrain.eval.results", *argv(setup, straight)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads(open(proc.stdout.strip().splitlines()[-1]).read())
    keys = [r["key"] for r in summary["rows"]]
    # medusa: mt chain + tree, alpaca, gsm8k; eagle1: the same plus its sampled chain.
    assert len(keys) == len(set(keys)) == 9
    for r in summary["rows"]:
        assert r["prompts"] == (2 if r["set"] == "gsm8k" else 3) and sum(r["accept_histogram"]) == r["verifier_forwards"] > 0
        if r["temperature"] == 0:
            assert r["identical_to_greedy"] == r["prompts"], r["key"]  # lossless: every T=0 output is the greedy one
        if r["set"] == "mt_bench":
            assert set(r["per_category_tau"]) == {"writing", "math", "coding"}
    tree_rows = [r for r in summary["rows"] if r["setting"] == "tree-6"]
    assert {r["tree"].split(",")[0] for r in tree_rows} == {"static", "EAGLE-2 dynamic"}
    assert "tau on" in proc.stdout and "published figures" in proc.stdout

    # Kill after two rows (the third raises mid-measurement), then rerun: nothing lost, nothing doubled.
    out = tmp_path / "resumed"
    real, calls = results_mod.measure_row, []

    def crashing(*a, **kw):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt("killed")
        return real(*a, **kw)

    monkeypatch.setattr(results_mod, "measure_row", crashing)
    with pytest.raises(KeyboardInterrupt):
        results(parse_args(argv(setup, out)), log=lambda *_: None)
    assert len(rows_of(out)) == 1 + 2  # the MT-bench greedy reference and two finished rows (references are lazy)
    monkeypatch.setattr(results_mod, "measure_row", real)
    measured = []
    monkeypatch.setattr(results_mod, "measure_row", lambda *a, **kw: measured.append(1) or real(*a, **kw))
    results(parse_args(argv(setup, out)), log=lambda *_: None)
    assert len(measured) == 9 - 2  # only the missing rows were measured
    a, b = rows_of(straight), rows_of(out)
    assert sorted(a) == sorted(b)
    for name in a:
        for field in ("tau", "alpha", "accept_histogram", "identical_to_greedy", "outputs"):
            if field in a[name]:
                assert a[name][field] == b[name][field], (name, field)

    # A third run measures nothing; other settings are refused and leave the rows alone.
    measured.clear()
    results(parse_args(argv(setup, out)), log=lambda *_: None)
    assert not measured
    with pytest.raises(SpectrainError, match="other settings.*max_new_tokens"):
        results(parse_args(argv(setup, out, "--max_new_tokens", "11")), log=lambda *_: None)
    assert sorted(rows_of(out)) == sorted(a)


def test_retrained_drafter_rows_are_redone(setup, tmp_path, monkeypatch):
    root, verifier_dir = setup
    model = load_verifier(str(verifier_dir)).model
    heads_dir = tmp_path / "medusa"
    MedusaHeads.for_verifier(model, num_heads=3, verifier_name=str(verifier_dir)).save_pretrained(heads_dir)
    args = ["--verifier", str(verifier_dir), "--drafter", f"m={heads_dir}", "--mt_bench", str(root / "mt.jsonl"),
            "--alpaca", "", "--gsm8k", "", "--num_prompts", "2", "--max_new_tokens", "6", "--k", "3",
            "--tree_nodes", "0", "--device", "cpu", "--out", str(tmp_path / "out")]
    results(parse_args(args), log=lambda *_: None)
    torch_seeded = MedusaHeads.for_verifier(model, num_heads=3, verifier_name=str(verifier_dir))
    for p in torch_seeded.parameters():
        p.data.normal_()
    torch_seeded.save_pretrained(heads_dir)  # "retrained" in place
    measured = []
    real = results_mod.measure_row
    monkeypatch.setattr(results_mod, "measure_row", lambda *a, **kw: measured.append(1) or real(*a, **kw))
    results(parse_args(args), log=lambda *_: None)
    assert measured == [1]


@pytest.mark.parametrize("extra, message", [
    (["--drafter", "bad"], "NAME=PATH"),
    (["--drafter", "x=/no/such/dir"], "not found"),
    (["--sampled", "nobody"], "--sampled names no --drafter"),
    (["--k", "5"], "needs 5"),  # 3 Medusa heads cannot draft a chain of 5
    (["--num_prompts", "sharegpt=3"], "unknown set"),
    (["--num_prompts", "0"], ">= 1"),
])
def test_bad_input(setup, tmp_path, extra, message):
    with pytest.raises(SpectrainError, match=message):
        results(parse_args(argv(setup, tmp_path / "bad") + extra), log=lambda *_: None)


def test_a_run_over_fewer_sets_shares_rows(setup, tmp_path, monkeypatch):
    """MT-bench first (say, while other drafters still train), the rest later: no row is measured twice."""
    out = tmp_path / "out"
    only_mt = argv(setup, out, "--alpaca", "", "--gsm8k", "")
    results(parse_args(only_mt), log=lambda *_: None)
    assert len([k for k in rows_of(out) if not k.startswith("greedy")]) == 5  # mt chain+tree (x2) + eagle1 T=1
    measured = []
    real = results_mod.measure_row
    monkeypatch.setattr(results_mod, "measure_row", lambda *a, **kw: measured.append(a[1]["key"]) or real(*a, **kw))
    summary = json.loads(results(parse_args(argv(setup, out)), log=lambda *_: None).read_text())
    assert sorted(measured) == sorted(k for k in (r["key"] for r in summary["rows"]) if "mt_bench" not in k)
    assert len(summary["rows"]) == 9
    root = setup[0]
    (tmp_path / "mt2.jsonl").write_text((root / "mt.jsonl").read_text().replace("king", "queen"))
    with pytest.raises(SpectrainError, match="mt_bench prompts"):  # other MT-bench prompts: refused
        results(parse_args(argv(setup, out, "--mt_bench", str(tmp_path / "mt2.jsonl"))), log=lambda *_: None)


def test_prompt_lookup_and_hybrid_rows(setup, tmp_path):
    """Rows named 'ngram' (chain only) and 'hybrid-NAME' (chain, tree within the same node budget, sampled),
    all lossless at T = 0; a drafter may not take a reserved name."""
    out = tmp_path / "hyb"
    args = argv(setup, out, "--alpaca", "", "--gsm8k", "", "--ngram", "--hybrid", "medusa", "--hybrid", "eagle1",
                "--sampled", "hybrid-eagle1", "--sampled", "ngram", "--min_match", "1")
    summary = json.loads(results(parse_args(args), log=lambda *_: None).read_text())
    rows = {(r["drafter"], r["setting"], r["temperature"]): r for r in summary["rows"]}
    assert ("ngram", "chain-3", 0.0) in rows and ("ngram", "chain-3", 1.0) in rows
    assert not any(d == "ngram" and s.startswith("tree") for d, s, _ in rows)
    for name in ("hybrid-medusa", "hybrid-eagle1"):
        assert rows[(name, "tree-6", 0.0)]["nodes"] == 6 and "lookup branch" in rows[(name, "tree-6", 0.0)]["tree"]
        assert 0.0 < rows[(name, "chain-3", 0.0)]["lookup_round_fraction"] < 1.0  # both kinds of round ran
    assert ("hybrid-eagle1", "chain-3", 1.0) in rows
    for r in summary["rows"]:
        if r["temperature"] == 0:
            assert r["identical_to_greedy"] == r["prompts"], r["key"]
    assert rows[("ngram", "chain-3", 0.0)]["training"]["method"].startswith("prompt lookup")
    root = setup[0]
    with pytest.raises(SpectrainError, match="reserved"):
        results(parse_args(argv(setup, tmp_path / "bad", "--drafter", f"ngram={root / 'medusa'}")), log=lambda *_: None)
    with pytest.raises(SpectrainError, match="no --drafter of that name"):
        results(parse_args(argv(setup, tmp_path / "bad", "--hybrid", "nobody")), log=lambda *_: None)


def test_spectrain_eval_can_pick_the_results_tables_mt_bench_prompts(tmp_path):
    """`spectrain-eval --first_turns --spread --num_prompts N` asks exactly the MT-bench prompts the results
    table measured (first turns, round-robin over categories), so its numbers can be reproduced one by one."""
    from spectrain.eval.prompts import load_prompts
    from spectrain.eval.results import load_set

    rows = [{"category": c, "turns": [f"{c} question {i}", f"{c} follow-up {i}"]}
            for c in ("writing", "roleplay", "math") for i in range(3)]
    path = tmp_path / "mt.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows))
    picked = load_prompts(str(path), 4, first_turns=True, spread=True)
    assert picked == [[p["prompt"]] for p in load_set("mt_bench", str(path), 4)]
    assert picked == [["writing question 0"], ["roleplay question 0"], ["math question 0"], ["writing question 1"]]
    assert load_prompts(str(path), 2) == [rows[0]["turns"], rows[1]["turns"]]  # default: file order, every turn
