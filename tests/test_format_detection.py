"""Format detection asks every registered format and never guesses: each export (every bundled format, and the
references' configs as they ship) is claimed by exactly its own format, and a directory two formats claim is refused
with an error naming both and how to say which (``fmt=`` / ``--drafter_format``), which every CLI that reads a
drafter takes."""

from __future__ import annotations

import json

import pytest
from torch import nn

from spectrain.heads.dflash import DFlashConfig, DFlashDrafter
from spectrain.heads.eagle import EagleDrafter
from spectrain.heads.errors import SpectrainError
from spectrain.heads.families import DrafterFamily, register_family, unregister_family
from spectrain.heads.serving.families import serving_formats
from spectrain.heads.serving.registry import FamilyServing, ServingFormat, register_serving, unregister_serving
from spectrain.heads.serving.formats import detect_format, export_drafter, import_drafter, recorded_verifier
from spectrain.heads.medusa import MedusaHeads
from spectrain.heads.peagle import PEagleDrafter
from tests.conftest import make_verifier


@pytest.fixture(scope="module")
def verifier():
    return make_verifier("llama", False, 200, hidden=32, layers=8)


def claimants(config: dict) -> list[str]:
    """Every registered format whose ``detect`` says yes to ``config``."""
    return [spec.name for spec in serving_formats().values() if spec.detect(config)]


def _drafter(kind: str, verifier):
    if kind == "medusa":
        return MedusaHeads.for_verifier(verifier, num_heads=2, num_layers=1, verifier_name="v")
    if kind in ("eagle1", "eagle3"):
        return EagleDrafter.for_verifier(verifier, kind, verifier_name="v")
    if kind == "peagle":
        return PEagleDrafter.for_verifier(verifier, num_layers=2, verifier_name="v")
    return DFlashDrafter(DFlashConfig.for_verifier(verifier, block_size=4, verifier_name="v",
                                                   markov_rank=4 if kind == "dspark" else 0))


@pytest.mark.parametrize("fmt,kind", [("vllm-medusa", "medusa"), ("medusa", "medusa"), ("eagle", "eagle1"),
                                      ("eagle-sglang", "eagle1"), ("eagle3", "eagle3"), ("speculators", "eagle3"),
                                      ("speculators-dflash", "dflash"), ("speculators-dspark", "dspark"),
                                      ("speculators-peagle", "peagle")])
def test_each_export_is_claimed_by_its_format_alone(tmp_path, verifier, fmt, kind):
    out = export_drafter(_drafter(kind, verifier), fmt, tmp_path / fmt, verifier_lm_head=verifier.get_output_embeddings())
    assert claimants(json.loads((out / "config.json").read_text())) == [fmt]
    assert detect_format(out) == fmt


@pytest.mark.parametrize("config,fmt", [
    # vLLM's EAGLE-1 (yuhuili/EAGLE-llama2-chat-7B): a plain one-layer Llama config, no key of its own
    ({"architectures": ["LlamaForCausalLM"], "model_type": "llama", "num_hidden_layers": 1}, "eagle"),
    # SpecForge's EAGLE-3: its architecture and draft vocabulary, also a one-layer Llama
    ({"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "num_hidden_layers": 1,
      "draft_vocab_size": 32000}, "eagle3"),
    # an EAGLE-3 with only SGLang's aux-layer ids (a top-level key) and no architectures
    ({"model_type": "llama", "num_hidden_layers": 1, "eagle_aux_hidden_state_layer_ids": [1, 3, 5]}, "eagle3"),
    ({"architectures": ["LlamaForCausalLMEagle"], "model_type": "llama", "num_hidden_layers": 1}, "eagle-sglang"),
    ({"architectures": ["Eagle3Speculator"], "speculators_model_type": "eagle3", "draft_vocab_size": 64}, "speculators"),
    ({"architectures": ["DFlashSpeculator"], "speculators_model_type": "dflash", "draft_vocab_size": 64},
     "speculators-dflash"),
    # speculators' P-EAGLE (PEagleSpeculatorConfig): EAGLE-3's keys plus mask_token_id, under its own type
    ({"architectures": ["PEagleSpeculator"], "speculators_model_type": "peagle", "draft_vocab_size": 64,
      "eagle_aux_hidden_state_layer_ids": [1, 3, 5], "mask_token_id": 0}, "speculators-peagle"),
    ({"medusa_num_heads": 4, "medusa_num_layers": 1, "model_type": "medusa"}, "medusa"),
    ({"model_type": "medusa", "num_heads": 4}, "vllm-medusa"),
    # overlaps the shape rules must not claim twice: each its one format, or none
    ({"architectures": ["LlamaForCausalLM"], "model_type": "llama", "num_hidden_layers": 1, "medusa_num_heads": 4,
      "medusa_num_layers": 1}, "medusa"),
    ({"architectures": ["LlamaForCausalLMEagle"], "model_type": "llama", "num_hidden_layers": 1,
      "draft_vocab_size": 64}, "eagle3"),
    ({"architectures": ["LlamaForCausalLM"], "model_type": "llama", "num_hidden_layers": 1,
      "speculators_model_type": "mtp"}, None),
    ({"architectures": ["MtpForCausalLM"], "model_type": "llama", "num_hidden_layers": 1}, None),
])
def test_reference_configs_are_claimed_by_exact_keys(config, fmt):
    assert claimants(config) == ([fmt] if fmt else [])


@pytest.fixture
def one_layer_llama_family():
    """A toy family whose format, like an MTP head's, is a one-layer Llama config: it claims EAGLE-1's exports too."""
    fmt = ServingFormat("mtp-llama", "a toy one-layer Llama draft layout", "mtp-probe",
                        detect=lambda c: c.get("model_type") == "llama" and c.get("num_hidden_layers") == 1,
                        export=None, load=None, expected=None)
    family = register_family(DrafterFamily(name="mtp-probe", methods=("mtp-probe",), drafter_class=nn.Identity,
                                           config_class=dict))
    register_serving(FamilyServing(family.name, formats=(fmt,)))
    yield family
    unregister_family(family.name)
    unregister_serving(family.name)


def test_a_directory_two_formats_claim_is_refused_naming_both(tmp_path, verifier, one_layer_llama_family):
    drafter = _drafter("eagle1", verifier)
    unregister_family(one_layer_llama_family.name)
    out = export_drafter(drafter, "eagle", tmp_path / "eagle")
    assert detect_format(out) == "eagle"  # the control: alone, EAGLE-1 claims it
    register_family(one_layer_llama_family)
    for read in (detect_format, import_drafter, recorded_verifier):
        with pytest.raises(SpectrainError, match=r"claimed by 2 formats \(eagle, mtp-llama\); spectrain does not "
                                                 r"guess: say which with --drafter_format NAME"):
            read(out)
    # named, it loads as before: the same weights, and what it records about its verifier
    back = import_drafter(out, verifier_model=verifier, fmt="eagle")
    assert isinstance(back, EagleDrafter)
    assert all(a.equal(b) for a, b in zip(back.state_dict().values(), drafter.state_dict().values()))
    assert recorded_verifier(out, fmt="eagle")["signature"]["vocab_size"] == 200
    with pytest.raises(SpectrainError, match="unknown drafter format 'nope'; expected spectrain"):
        detect_format(out, fmt="nope")
    # a named format must be one that claims it: never another loader, nor our run-dir reader on an export
    for fmt, held in (("spectrain", r"claimed by eagle, mtp-llama"), ("medusa", r"claimed by eagle, mtp-llama")):
        with pytest.raises(SpectrainError, match=f"is not in format {fmt} \\({held}\\)"):
            import_drafter(out, fmt=fmt)
    drafter.save_pretrained(tmp_path / "run")
    assert detect_format(tmp_path / "run", fmt="spectrain") == "spectrain"
    with pytest.raises(SpectrainError, match=r"is not in format eagle \(a spectrain run directory\)"):
        detect_format(tmp_path / "run", fmt="eagle")


def test_no_claimant_names_the_known_formats(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "num_hidden_layers": 2}))
    with pytest.raises(SpectrainError, match="not a drafter format spectrain knows") as err:
        detect_format(tmp_path)
    assert all(name in str(err.value) for name in serving_formats())


def test_a_family_without_evaluator_or_with_a_raising_predicate_breaks_nothing_else(tmp_path):
    """A family registered with no evaluator leaves spectrain-eval's parser and spectrain-results' published
    figures as they were; a detect predicate that raises on another format's config is named, not a traceback."""
    from spectrain.eval.cli import parse_args
    from spectrain.eval.results import published

    before = published()
    fmt = ServingFormat("raises", "a predicate that reads a key others lack", "exportonly",
                        detect=lambda c: c["architectures"][0] == "Nope", export=None, load=None, expected=None)
    family = register_family(DrafterFamily(name="exportonly", methods=("exportonly",), drafter_class=nn.Identity,
                                           config_class=dict))
    register_serving(FamilyServing(family.name, formats=(fmt,)))
    try:
        assert parse_args(["--method", "ngram"]).method == "ngram" and published() == before
        (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
        with pytest.raises(SpectrainError, match="format 'raises''s detect raised KeyError"):
            detect_format(tmp_path)
    finally:
        unregister_family(family.name)
        unregister_serving(family.name)


def test_the_clis_read_an_ambiguous_drafter_in_the_format_named(tmp_path, verifier_factory, one_layer_llama_family,
                                                                 capsys):
    """spectrain-eval, spectrain-results and spectrain-export refuse a directory two formats claim (exit 2, the
    message naming --drafter_format) and read it with --drafter_format."""
    from spectrain.eval.cli import main as eval_main
    from spectrain.eval.results import parse_args as results_args
    from spectrain.eval.results import results
    from spectrain.heads.serving.cli import main as export_main
    from spectrain.heads.verifier import load_verifier

    verifier_dir = str(verifier_factory("llama", False))
    model = load_verifier(verifier_dir).model
    drafter = EagleDrafter.for_verifier(model, "eagle1", verifier_name=verifier_dir)
    out = export_drafter(drafter, "eagle", tmp_path / "eagle", verifier_lm_head=model.get_output_embeddings())
    evaluate = ["--verifier", verifier_dir, "--method", "eagle", "--drafter", str(out), "--num_prompts", "1",
                "--max_new_tokens", "6", "--k", "2", "--hf_generate", "0", "--dtype", "float32", "--out",
                str(tmp_path / "eval")]
    export = [str(out), "--format", "eagle-sglang", "--verifier", verifier_dir, "--out", str(tmp_path / "sglang")]
    with pytest.raises(SystemExit):  # a method that loads no learned drafter has no format to name
        eval_main([*evaluate[:2], "--method", "ngram", *evaluate[4:], "--drafter_format", "eagle"])
    assert "--method ngram loads none" in capsys.readouterr().err
    for main, argv in ((eval_main, evaluate), (export_main, export)):
        with pytest.raises(SystemExit) as exit_:
            main(argv)
        assert exit_.value.code == 2
        assert "claimed by 2 formats (eagle, mtp-llama)" in capsys.readouterr().err
        assert not (tmp_path / "sglang").exists()
    eval_main([*evaluate, "--drafter_format", "eagle"])
    summary = json.loads(open(capsys.readouterr().out.strip().splitlines()[-1]).read())
    assert summary["results"]["chain-2"]["identical_to_ar"] and summary["drafter_format"] == "eagle"
    export_main([*export, "--drafter_format", "eagle"])
    again = import_drafter(tmp_path / "sglang", verifier_model=model, fmt="eagle-sglang")
    assert all(a.equal(b) for a, b in zip(again.state_dict().values(), drafter.state_dict().values()))

    (tmp_path / "mt.jsonl").write_text(json.dumps({"category": "writing", "turns": ["tell me of the king"]}))
    table = ["--verifier", verifier_dir, "--drafter", f"e1={out}", "--mt_bench", str(tmp_path / "mt.jsonl"),
             "--num_prompts", "1", "--max_new_tokens", "6", "--k", "2", "--tree_nodes", "0", "--device", "cpu"]
    with pytest.raises(SpectrainError, match="claimed by 2 formats"):
        results(results_args([*table, "--out", str(tmp_path / "r0")]), log=lambda *_: None)
    assert not (tmp_path / "r0").exists()  # refused before any reference was decoded
    with pytest.raises(SpectrainError, match="--drafter_format e2=eagle: no --drafter of that name"):
        results(results_args([*table, "--drafter_format", "e2=eagle", "--out", str(tmp_path / "r1")]),
                log=lambda *_: None)
    path = results(results_args([*table, "--drafter_format", "e1=eagle", "--out", str(tmp_path / "r2")]),
                   log=lambda *_: None)
    rows = json.loads(path.read_text())["rows"]
    mine = [r for r in rows if r["drafter"] == "e1"]
    assert mine and all(r["identical_to_greedy"] == r["prompts"] for r in mine)
