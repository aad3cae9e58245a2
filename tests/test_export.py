"""Engine export formats: round trips, strict validation, bad inputs, the export CLI and --init_from."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

from spectrain.heads.eagle import EagleDrafter, build_vocab_map
from spectrain.heads.errors import SpectrainError
from spectrain.heads.serving.formats import (FORMATS, detect_format, export_drafter, import_drafter, validate_export,
                                     weights_file)
from spectrain.heads.medusa import MedusaHeads
from tests.conftest import make_verifier


@pytest.fixture(scope="module")
def verifier():
    """8 layers, so EAGLE-3's default layers [2, 4, 5] are all below N (exportable)."""
    return make_verifier("llama", False, 200, hidden=32, layers=8)


def randomize(module: torch.nn.Module, seed: int = 0) -> None:
    """Random values everywhere (zero-init ResBlocks and unit norms would hide mapping mistakes)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.1 + (1.0 if p.ndim == 1 else 0.0))


def make_medusa(verifier, shared: bool, layers: int = 2) -> MedusaHeads:
    heads = MedusaHeads.for_verifier(verifier, num_heads=3, num_layers=layers, shared_lm_head=shared, verifier_name="v")
    randomize(heads)
    return heads


def make_eagle(verifier, variant: str) -> EagleDrafter:
    drafter = EagleDrafter.for_verifier(verifier, variant, draft_vocab_size=64 if variant == "eagle3" else None,
                                        verifier_name="v")
    randomize(drafter, seed=1)
    if variant == "eagle3":
        counts = torch.randint(0, 1000, (drafter.config.vocab_size,), generator=torch.Generator().manual_seed(2))
        drafter.set_vocab_map(*build_vocab_map(counts, 64))
    return drafter


def outputs(drafter, verifier) -> list[torch.Tensor]:
    """Everything a drafter computes on fixed inputs: per-head logits, or 3 TTT steps of logits."""
    torch.manual_seed(3)
    h = verifier.config.hidden_size
    ids = torch.randint(0, 200, (2, 7))
    with torch.no_grad():
        if isinstance(drafter, MedusaHeads):
            return [drafter(torch.randn(2, 7, h), verifier.get_output_embeddings())]
        width = drafter.config.fused_width if drafter.is_eagle3 else h
        hidden = drafter.ttt_hidden(ids, torch.randn(2, 7, width), verifier.get_input_embeddings(), steps=3)
        out = [drafter.logits(x, verifier.get_output_embeddings()) for x in hidden]
        if drafter.is_eagle3:
            out.append(drafter.draft_to_target(torch.arange(64)))
        return out


CASES = [("vllm-medusa", "medusa-copies"), ("vllm-medusa", "medusa-shared"), ("medusa", "medusa-copies"),
         ("medusa", "medusa-shared"), ("eagle", "eagle1"), ("eagle-sglang", "eagle1"), ("eagle3", "eagle3"),
         ("speculators", "eagle3")]


def build(kind: str, verifier):
    if kind.startswith("medusa"):
        return make_medusa(verifier, shared=kind.endswith("shared"))
    return make_eagle(verifier, kind)


@pytest.mark.parametrize("fmt,kind", CASES)
def test_round_trip_identical_outputs_and_names(tmp_path, verifier, fmt, kind):
    drafter = build(kind, verifier)
    out = export_drafter(drafter, fmt, tmp_path / fmt, verifier_lm_head=verifier.get_output_embeddings())
    assert detect_format(out) == fmt
    written = set(load_file(str(out / weights_file(fmt))))
    back, read = import_drafter(out, verifier_model=verifier, return_names=True)
    assert read == written  # every written tensor is read, none is ignored
    assert type(back) is type(drafter)
    for a, b in zip(outputs(drafter, verifier), outputs(back, verifier)):
        assert torch.equal(a, b)
    if kind == "medusa-shared":
        assert back.config.shared_lm_head  # the written lm_head is the verifier's: shared again on import


def test_formats_cover_the_engines():
    assert set(FORMATS) == {"vllm-medusa", "medusa", "eagle", "eagle-sglang", "eagle3", "speculators",
                            "speculators-dflash", "speculators-dspark", "speculators-peagle"}


def test_exported_names_follow_the_engines(tmp_path, verifier):
    medusa = make_medusa(verifier, shared=True, layers=1)
    vllm = export_drafter(medusa, "vllm-medusa", tmp_path / "m", verifier_lm_head=verifier.get_output_embeddings())
    config = json.loads((vllm / "config.json").read_text())
    assert config["model_type"] == "medusa" and config["medusa_fc_bias"] is True and config["original_lm_head"] is True
    assert set(load_file(str(vllm / "model.safetensors"))) == {
        "lm_head.weight", *(f"blocks.{k}.layers.0.{p}" for k in range(3) for p in ("weight", "bias"))}
    notes: list[str] = []
    trt = export_drafter(medusa, "medusa", tmp_path / "t", verifier_lm_head=verifier.get_output_embeddings(), notes=notes)
    assert any("copied" in n for n in notes)  # shared head copied into each head, and the user is told
    assert set(load_file(str(trt / "medusa_lm_head.safetensors"))) == {
        *(f"{k}.0.linear.{p}" for k in range(3) for p in ("weight", "bias")), *(f"{k}.1.weight" for k in range(3))}
    assert json.loads((trt / "config.json").read_text())["medusa_num_heads"] == 3

    e3 = export_drafter(make_eagle(verifier, "eagle3"), "eagle3", tmp_path / "e3")
    config = json.loads((e3 / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle3"] and config["draft_vocab_size"] == 64
    assert config["eagle_aux_hidden_state_layer_ids"] == [2, 4, 5]  # vLLM: HF hidden_states indices
    assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 3, 4]  # SGLang adds 1
    tensors = load_file(str(e3 / "model.safetensors"))
    assert tensors["d2t"].dtype == torch.int64 and tensors["t2d"].dtype == torch.bool
    assert {"midlayer.hidden_norm.weight", "midlayer.input_layernorm.weight", "norm.weight", "lm_head.weight",
            "fc.weight"} <= set(tensors)
    spec = export_drafter(make_eagle(verifier, "eagle3"), "speculators", tmp_path / "s", verifier_name="org/model",
                          speculative_tokens=5)
    config = json.loads((spec / "config.json").read_text())
    assert config["speculators_model_type"] == "eagle3" and config["norm_before_residual"] is False
    assert config["speculators_config"]["verifier"]["name_or_path"] == "org/model"
    assert config["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 5
    assert "layers.0.hidden_norm.weight" in load_file(str(spec / "model.safetensors"))
    e1 = export_drafter(make_eagle(verifier, "eagle1"), "eagle", tmp_path / "e1")
    names = set(load_file(str(e1 / "model.safetensors")))
    assert "layers.0.input_layernorm.weight" not in names and "fc.bias" not in names
    sg = export_drafter(make_eagle(verifier, "eagle1"), "eagle-sglang", tmp_path / "sg")
    assert json.loads((sg / "config.json").read_text())["architectures"] == ["LlamaForCausalLMEagle"]
    assert torch.count_nonzero(load_file(str(sg / "model.safetensors"))["fc.bias"]) == 0


def _rewrite(path, fmt, edit):
    tensors = load_file(str(path / weights_file(fmt)))
    edit(tensors)
    save_file(tensors, str(path / weights_file(fmt)))


@pytest.mark.parametrize("fmt,kind,edit,message", [
    ("eagle3", "eagle3", lambda t: t.pop("norm.weight"), "missing ['norm.weight']"),
    ("eagle3", "eagle3", lambda t: t.update({"extra.weight": torch.zeros(1)}), "unexpected ['extra.weight']"),
    ("eagle3", "eagle3", lambda t: t.update({"d2t": t["d2t"].to(torch.int32)}), "d2t must be int64"),
    ("eagle", "eagle1", lambda t: t.update({"fc.weight": t["fc.weight"][:, :-1].contiguous()}), "wrong shapes"),
    ("vllm-medusa", "medusa-copies", lambda t: t.pop("blocks.1.layers.0.bias"), "missing"),
])
def test_validation_names_every_difference(tmp_path, verifier, fmt, kind, edit, message):
    out = export_drafter(build(kind, verifier), fmt, tmp_path / fmt, verifier_lm_head=verifier.get_output_embeddings())
    _rewrite(out, fmt, edit)
    with pytest.raises(SpectrainError, match=message.replace("[", r"\[").replace("]", r"\]")):
        validate_export(out, fmt)
    with pytest.raises(SpectrainError):
        import_drafter(out, verifier_model=verifier)


def test_medusa_biases_without_the_flag_are_refused(tmp_path, verifier):
    """vLLM drops ResBlock biases silently when medusa_fc_bias is absent: our validator must not."""
    out = export_drafter(make_medusa(verifier, False), "vllm-medusa", tmp_path / "m")
    config = json.loads((out / "config.json").read_text())
    del config["medusa_fc_bias"]
    (out / "config.json").write_text(json.dumps(config))
    with pytest.raises(SpectrainError, match="unexpected .*bias"):
        validate_export(out, "vllm-medusa")


def test_bad_exports_leave_nothing_behind(tmp_path, verifier):
    eagle1 = make_eagle(verifier, "eagle1")
    for fmt in ("eagle3", "speculators", "vllm-medusa"):
        with pytest.raises(SpectrainError, match="holds .* drafters, but this run trained eagle1"):
            export_drafter(eagle1, fmt, tmp_path / fmt)
    small = make_verifier("llama", False, 200, hidden=32, layers=6)
    assert EagleDrafter.for_verifier(small, "eagle3").config.aux_layer_ids == [1, 3, 5]  # the default exports
    last_layer = EagleDrafter.for_verifier(small, "eagle3", aux_layer_ids=[1, 3, 6])  # 6 is after the final norm
    with pytest.raises(SpectrainError, match=r"hidden_states\[6\].*retrain with --model.aux_layer_ids"):
        export_drafter(last_layer, "eagle3", tmp_path / "last")
    with pytest.raises(SpectrainError, match="pass --verifier"):
        export_drafter(make_medusa(verifier, True), "medusa", tmp_path / "noverifier")
    biased = MedusaHeads.for_verifier(make_verifier("qwen2", False, 200), num_heads=2)
    biased.config.lm_head_bias = True
    with pytest.raises(SpectrainError, match="lm_head biases"):
        export_drafter(biased, "vllm-medusa", tmp_path / "bias")
    assert list(tmp_path.iterdir()) == []  # no partial directories, no temp leftovers
    out = export_drafter(eagle1, "eagle", tmp_path / "e")
    before = (out / "model.safetensors").read_bytes()
    with pytest.raises(SpectrainError, match="already exists; pass --force"):
        export_drafter(make_eagle(verifier, "eagle1"), "eagle", out)
    assert (out / "model.safetensors").read_bytes() == before
    export_drafter(make_eagle(verifier, "eagle1"), "eagle", out, force=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["e"]


def test_unsorted_aux_layers_are_never_exported(tmp_path, verifier):
    """Engines capture the verifier's layers in ascending order: an EAGLE-3 config whose ids are out of order (EagleConfig
    refuses them; here edited after it was built) is refused before anything is written, and a written export whose
    ids were edited fails validation, so it is not imported either."""
    drafter = make_eagle(verifier, "eagle3")
    drafter.config.aux_layer_ids = [5, 2, 4]  # hand-made: past EagleConfig's own check
    for fmt in ("eagle3", "speculators"):
        with pytest.raises(SpectrainError, match=rf"exporting {fmt}\) \[5, 2, 4\] are not ascending.*'\[2, 4, 5\]'"):
            export_drafter(drafter, fmt, tmp_path / fmt)
    assert list(tmp_path.iterdir()) == []
    for key, ids in (("eagle_aux_hidden_state_layer_ids", [5, 2, 4]), ("eagle_config", [4, 1, 3])):
        out = export_drafter(make_eagle(verifier, "eagle3"), "eagle3", tmp_path / key)
        config = json.loads((out / "config.json").read_text())
        if key == "eagle_config":  # SGLang's ids (one less), the only ones a SpecForge checkpoint has
            del config["eagle_aux_hidden_state_layer_ids"]
            config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = ids
        else:
            config[key] = ids
        (out / "config.json").write_text(json.dumps(config))
        message = rf"not a valid eagle3 export: .*{key}.*\[{', '.join(map(str, ids))}\] are not ascending"
        with pytest.raises(SpectrainError, match=message):
            validate_export(out, "eagle3")
        with pytest.raises(SpectrainError, match=message):
            import_drafter(out, verifier_model=verifier)


def test_pickled_medusa_is_refused(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"medusa_num_heads": 2, "medusa_num_layers": 1}))
    (tmp_path / "medusa_lm_head.pt").write_bytes(b"\x80\x04pickle")
    with pytest.raises(SpectrainError, match="pickle; spectrain loads safetensors only"):
        import_drafter(tmp_path)


def test_foreign_eagle3_without_our_metadata(tmp_path, verifier):
    """A SpecForge-style checkpoint: only eagle_config's (SGLang) ids, no spectrain block, no draft map check."""
    drafter = make_eagle(verifier, "eagle3")
    out = export_drafter(drafter, "eagle3", tmp_path / "x")
    config = json.loads((out / "config.json").read_text())
    del config["spectrain"], config["eagle_aux_hidden_state_layer_ids"]
    (out / "config.json").write_text(json.dumps(config))
    with pytest.raises(SpectrainError, match="pass the verifier"):
        import_drafter(out)
    back = import_drafter(out, verifier_model=verifier)
    assert back.config.aux_layer_ids == [2, 4, 5]
    for a, b in zip(outputs(drafter, verifier), outputs(back, verifier)):
        assert torch.equal(a, b)


def run_cli(*args):
    return subprocess.run([sys.executable, "-m", "spectrain.heads.serving.cli", *map(str, args)],
                          capture_output=True, text=True, timeout=300)


@pytest.mark.integration
def test_export_cli(tmp_path, verifier):
    run_dir = tmp_path / "run"
    make_eagle(verifier, "eagle3").save_pretrained(run_dir)
    done = run_cli(run_dir, "--format", "eagle3", "--format", "speculators", "--dtype", "bfloat16")
    assert done.returncode == 0, done.stderr
    summary_path = done.stdout.strip().splitlines()[-1]
    summary = json.loads(open(summary_path).read())
    assert [e["format"] for e in summary["exports"]] == ["eagle3", "speculators"]
    tensors = load_file(str(run_dir / "export" / "eagle3" / "model.safetensors"))
    assert tensors["fc.weight"].dtype == torch.bfloat16 and tensors["d2t"].dtype == torch.int64
    bad = run_cli(run_dir, "--format", "eagle")
    assert bad.returncode == 2 and re.search(r"formats for eagle3: (eagle3, speculators|speculators, eagle3)\n",
                                             bad.stderr), bad.stderr  # the registry's order
    assert "Traceback" not in bad.stderr
    again = run_cli(run_dir, "--format", "eagle3")
    assert again.returncode == 2 and "already exists; pass --force" in again.stderr
    config = json.loads((run_dir / "config.json").read_text())  # an older run with its layers out of order
    (run_dir / "config.json").write_text(json.dumps({**config, "aux_layer_ids": [5, 2, 4]}))
    old = run_cli(run_dir, "--format", "speculators", "--force")
    assert old.returncode == 2 and "aux_layer_ids [5, 2, 4] are not ascending" in old.stderr, old.stderr
    assert "--model.aux_layer_ids '[2, 4, 5]'" in old.stderr and "Traceback" not in old.stderr


def test_evaluator_reads_exports_with_the_same_result(tmp_path, verifier_factory):
    """The evaluator loads an engine export and measures exactly what it measures on the run directory."""
    from spectrain.eval.cli import evaluate, parse_args
    from spectrain.heads.verifier import load_verifier

    verifier_dir = verifier_factory("llama", False, layers=8)
    model = load_verifier(str(verifier_dir)).model
    drafter = make_eagle(model, "eagle3")
    drafter.config.verifier = str(verifier_dir)
    drafter.save_pretrained(tmp_path / "run")
    export_drafter(drafter, "speculators", tmp_path / "spec")
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("\n".join(json.dumps({"turns": [f"the king and the queen {i}"]}) for i in range(2)))
    taus = []
    for path in ("run", "spec"):
        summary_path = evaluate(parse_args(["--verifier", str(verifier_dir), "--method", "eagle", "--drafter",
                                       str(tmp_path / path), "--prompts", str(prompts), "--max_new_tokens", "10",
                                       "--k", "3", "--out", str(tmp_path / f"out-{path}")]))
        summary = json.loads(open(summary_path).read())
        taus.append(summary["results"]["chain-3"]["tau"])
        assert summary["results"]["chain-3"]["identical_to_ar"] is True
    assert taus[0] == taus[1]


def test_init_from_export(tmp_path, verifier_factory):
    from spectrain.train.eagle import EagleModule
    from spectrain.train.medusa import MedusaModule

    verifier_dir = verifier_factory("llama", False, layers=8)
    source = EagleModule(variant="eagle1", verifier=str(verifier_dir))
    randomize(source.drafter)
    export_drafter(source.drafter, "eagle-sglang", tmp_path / "sg")
    module = EagleModule(variant="eagle1", verifier=str(verifier_dir), init_from=str(tmp_path / "sg"))
    for k, v in source.drafter.state_dict().items():
        assert torch.equal(module.drafter.state_dict()[k], v)
    with pytest.raises(SpectrainError, match="another kind or shape"):
        EagleModule(variant="eagle3", verifier=str(verifier_dir), init_from=str(tmp_path / "sg"))
    with pytest.raises(SpectrainError, match="another kind or shape"):
        MedusaModule(verifier=str(verifier_dir), init_from=str(tmp_path / "sg"))
