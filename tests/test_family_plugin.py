"""A drafter family from another installed package: its distribution declares a ``spectrain.families`` entry point,
and the family reaches training, ``spectrain-eval``, ``evaluate_drafter``, ``spectrain-export`` and import with no
file of spectrain's changed. The package is simulated as a real one: a module and a ``*.dist-info`` with
``entry_points.txt`` on ``sys.path``, found by ``importlib.metadata`` as pip would have installed it. The toy family
("mtp": one linear head from the verifier's last hidden state to the token after next) reuses the bigram pieces of
``tests/test_families.py`` under its own method, drafter class, serving format, training module and evaluator."""

from __future__ import annotations

import json
import sys
import textwrap

import pytest
import torch
from torch import nn

from spectrain.heads import families as registry
from spectrain.heads.errors import SpectrainError
from spectrain.heads.families import RESERVED_METHODS, DrafterFamily, family_for_method, register_family
from tests.test_families import train_a_few_steps

PLUGIN = '''
"""A toy drafter family shipped by another package."""
from dataclasses import asdict, dataclass

from spectrain.eval.family_evaluator import FamilyEvaluator, register_evaluator
from spectrain.heads.families import DrafterFamily
from spectrain.heads.serving.registry import FamilyServing, ServingFormat, register_serving
from tests.test_families import (BIGRAM_SERVING, BigramConfig, BigramDrafter, BigramHead, BigramModule, _export_flat,
                                 _load_flat)


@dataclass
class MtpConfig(BigramConfig):
    method: str = "mtp"


class MtpHead(BigramHead):
    pass


class MtpModule(BigramModule):
    method_name = "mtp"

    def build_drafter(self):
        vocab, hidden = self.verifier_lm_head.weight.shape
        return MtpHead(MtpConfig(hidden, vocab, verifier=self.verifier_name))


def export_flat(head, fmt, *args):
    config, tensors = _export_flat(head, fmt, *args)
    return {**config, "architectures": ["ToyMtpHead"]}, tensors


def load_flat(*args):
    bigram = _load_flat(*args)
    head = MtpHead(MtpConfig(**{**asdict(bigram.config), "method": "mtp"}))
    head.load_state_dict(bigram.state_dict())
    return head


FAMILY = DrafterFamily(name="mtp", methods=("mtp",), drafter_class=MtpHead, config_class=MtpConfig, label="toy MTP")
# its other halves, registered when the entry point's module is imported
register_serving(FamilyServing("mtp", formats=(
    ServingFormat("toy-mtp", "a toy engine's MTP layout", "mtp", detect=lambda c: c.get("architectures") == ["ToyMtpHead"],
                  export=export_flat, load=load_flat, expected=BIGRAM_SERVING.formats[0].expected),)))
register_evaluator("mtp", FamilyEvaluator(build=lambda head, model, tree, dynamic=None, vocab=None: BigramDrafter(
    head, model, tree, vocab), static_trees=False, max_depth=lambda head: 1))
'''


def install(site, entry_point: str) -> None:
    """Write the package (``toy_mtp``, ``toy_mtp_module``) and its distribution's metadata, declaring
    ``entry_point``, into ``site`` (a ``sys.path`` folder)."""
    info = site / "toy_mtp-0.1.dist-info"
    info.mkdir(parents=True)
    (site / "toy_mtp.py").write_text(textwrap.dedent(PLUGIN))
    # the other way a package may declare it: a module that registers its family when imported
    (site / "toy_mtp_module.py").write_text("from spectrain.heads.families import register_family\n"
                                            "from toy_mtp import FAMILY\n\nregister_family(FAMILY)\n")
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: toy-mtp\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(f"[spectrain.families]\n{entry_point}\n")


@pytest.fixture
def installed(tmp_path, monkeypatch):
    """Installs the toy package, has the registry read the entry points again, and removes the family after."""
    def install_with(entry_point: str):
        site = tmp_path / "site"
        install(site, entry_point)
        monkeypatch.syspath_prepend(str(site))
        monkeypatch.setattr(registry, "_loaded", False)  # as in a fresh process with the package installed
    yield install_with
    from spectrain.eval.family_evaluator import unregister_evaluator
    from spectrain.heads.serving.registry import unregister_serving

    registry.unregister_family("mtp")
    unregister_serving("mtp")
    unregister_evaluator("mtp")
    for module in ("toy_mtp", "toy_mtp_module"):
        sys.modules.pop(module, None)


@pytest.mark.parametrize("entry_point", ["mtp = toy_mtp:FAMILY", "mtp = toy_mtp_module"])
def test_an_installed_family_trains_evaluates_exports_and_imports(installed, verifier_factory, tmp_path, entry_point):
    from spectrain.eval.cli import parse_args as eval_args
    from spectrain.eval.evaluate import EvalSettings, evaluate_drafter, load_drafter
    from spectrain.heads.serving.cli import parse_args as export_args
    from spectrain.heads.serving.cli import run as export_run
    from spectrain.heads.serving.formats import FORMATS, detect_format, import_drafter
    from spectrain.heads.verifier import load_verifier

    with pytest.raises(SpectrainError, match="method 'mtp' belongs to no registered drafter family"):
        family_for_method("mtp")  # the control: not installed, not there
    installed(entry_point)
    family = family_for_method("mtp")  # found through the entry point alone
    assert family.label == "toy MTP" and [f.name for f in registry.families()][:3] == ["medusa", "eagle", "dflash"]

    # train: a few Lightning steps on a tiny random verifier; measured tau decodes through the family's evaluator
    verifier_dir = str(verifier_factory("llama", False))
    module = train_a_few_steps(sys.modules["toy_mtp"].MtpModule, verifier_dir, measure_k=1)
    assert module.family is family
    assert "tau_measured" in module.last_val_metrics
    run = module.export(tmp_path / "run", module.plain_drafter())
    assert json.loads((run / "config.json").read_text())["method"] == "mtp"

    # evaluate: spectrain-eval offers the method; T = 0 output equals AR
    assert eval_args(["--method", "mtp"]).method == "mtp"
    verifier = load_verifier(verifier_dir, dtype=torch.float32)
    head = load_drafter(str(run), verifier, "mtp")
    assert type(head).__name__ == "MtpHead"
    result = evaluate_drafter(verifier, [["the king sat on the mat"]], head,
                              EvalSettings(k=1, max_new_tokens=10, hf_generate=0, costs=False, chat_template=False))
    assert result.method == "mtp" and result.results["chain-1"]["identical_to_ar"]

    # export through spectrain-export (its --format choices include the package's format), then import it back
    assert FORMATS["toy-mtp"] == "a toy engine's MTP layout"
    out = tmp_path / "export"
    export_run(export_args([str(run), "--format", "toy-mtp", "--out", str(out)]))
    assert detect_format(out) == "toy-mtp"
    back = import_drafter(out, verifier_model=verifier.model)
    assert type(back) is type(head)
    assert all(torch.equal(a, b) for a, b in zip(back.state_dict().values(), head.state_dict().values()))


def test_a_broken_entry_point_is_named_not_skipped(installed):
    installed("mtp = toy_mtp:NO_SUCH_FAMILY")
    with pytest.raises(SpectrainError, match=r"spectrain.families entry point 'mtp' \(toy_mtp:NO_SUCH_FAMILY\) does "
                                             "not load"):
        registry.families()
    with pytest.raises(SpectrainError, match="does not load"):  # asked again: the same error, not a silent table
        registry.families()


@pytest.mark.parametrize("name,methods", [("ngram", ("ngram-head",)), ("lookup", ("hybrid",)), ("ar", ("ar1",))])
def test_the_evaluators_own_method_names_are_refused(name, methods):
    with pytest.raises(SpectrainError, match="the evaluator's own method .*reserved: ar, ngram, lookahead, hybrid"):
        register_family(DrafterFamily(name=name, methods=methods, drafter_class=nn.Linear, config_class=dict))
    assert name not in [f.name for f in registry.families()]


def test_the_reserved_names_cover_the_evaluators_other_methods():
    from spectrain.eval.methods import methods

    others = set(methods()) - {f.name for f in registry.families()}
    assert others and others <= set(RESERVED_METHODS)


def test_an_installed_family_trains_and_evaluates_through_the_commands(installed, verifier_factory, text_file,
                                                                         tmp_path, capsys, monkeypatch):
    """The user's path, no Python of theirs beyond the package: a recipe YAML naming the package's module
    (``model.class_path``) given to ``spectrain-train --config``, then ``spectrain-eval --method mtp`` on the run
    dir."""
    from spectrain.eval.cli import main as eval_main
    from spectrain.train.cli import spectrain_train, train

    installed("mtp = toy_mtp:FAMILY")
    verifier_dir = str(verifier_factory("llama", False))
    recipe = tmp_path / "mtp.yaml"
    recipe.write_text(textwrap.dedent(f"""\
        model:
          class_path: toy_mtp.MtpModule
          init_args:
            verifier: {verifier_dir}
            verifier_dtype: float32
            lr: 0.02
            warmup_steps: 0
            measure_prompts: 1
            measure_k: 1
            measure_new_tokens: 6
        data:
          path: {text_file}
          block_size: 64
          batch_size: 4
        trainer:
          max_steps: 2
          precision: 32-true
        """))
    run_dir = tmp_path / "run"
    monkeypatch.setattr(sys, "argv", ["spectrain-train", "--run_dir", str(run_dir)])
    with pytest.raises(SystemExit) as refused:  # no default recipe: said so, not a parser dump about "model"
        spectrain_train()
    assert refused.value.code == 2 and "give --config RECIPE.yaml" in capsys.readouterr().err
    assert not run_dir.exists()
    summary = json.loads(train(None, args=["--config", str(recipe), "--run_dir", str(run_dir), "--logger",
                                           "none"]).read_text())
    assert summary["steps"] == 2 and json.loads((run_dir / "config.json").read_text())["method"] == "mtp"
    eval_main(["--verifier", verifier_dir, "--method", "mtp", "--drafter", str(run_dir), "--k", "1",
               "--num_prompts", "2", "--max_new_tokens", "8", "--hf_generate", "0", "--dtype", "float32",
               "--out", str(tmp_path / "eval")])
    result = json.loads(open(capsys.readouterr().out.strip().splitlines()[-1]).read())
    assert result["method"] == "mtp" and result["results"]["chain-1"]["identical_to_ar"]
    assert result["results"]["chain-1"]["tau"] >= 1.0
