"""Drafter families: a fourth family defined here, registered by one call per layer (its drafter, its serving
formats, its evaluator; its training module is the recipe's class), runs train -> evaluate -> export -> import with no
library edits; every layer's bundled halves are the bundled families'; and a drafter, method or layer of no registered family is an error everywhere
(import, the results table, FSDP's units), never another family's path."""

from __future__ import annotations

import collections
import copy

from dataclasses import asdict, dataclass
from pathlib import Path
from types import SimpleNamespace

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from spectrain.eval.drafters import Drafter, Proposal
from spectrain.eval.family_evaluator import FamilyEvaluator, register_evaluator, unregister_evaluator
from spectrain.heads.errors import SpectrainError
from spectrain.heads.families import DrafterFamily, family_for_method, family_of, register_family, unregister_family
from spectrain.heads.serving.registry import FamilyServing, ServingFormat, register_serving, unregister_serving
from spectrain.heads.io import load_tensors, read_json, save_tensors, write_json
from spectrain.train.base import DrafterModule


# -- the toy family: a "bigram head", one linear map from the verifier's last hidden state at t to token t+2 -------
@dataclass
class BigramConfig:
    hidden_size: int
    vocab_size: int
    verifier: str = ""
    method: str = "bigram"
    format_version: int = 1


class BigramHead(nn.Module):
    """``proj`` (V, H): the verifier's last hidden state h_t (which predicts x_{t+1}) -> logits of x_{t+2}."""

    def __init__(self, config: BigramConfig):
        super().__init__()
        self.config = config
        self.proj = nn.Linear(config.hidden_size, config.vocab_size)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """(..., H) -> (..., V)."""
        return self.proj(hidden.to(self.proj.weight.dtype))

    def save_pretrained(self, out_dir) -> Path:
        out_dir = Path(out_dir)
        save_tensors(out_dir / "model.safetensors", self.state_dict())
        write_json(out_dir / "config.json", asdict(self.config))
        return out_dir

    @classmethod
    def from_pretrained(cls, path, verifier_model=None) -> "BigramHead":
        head = cls(BigramConfig(**read_json(Path(path) / "config.json", "bigram config")))
        head.load_state_dict(load_tensors(Path(path) / "model.safetensors"))
        return head


class BigramModule(DrafterModule):
    """Training: CE of the head's logits at t against x_{t+2} over loss-masked targets."""

    method_name = "bigram"

    def build_drafter(self) -> BigramHead:
        vocab, hidden = self.verifier_lm_head.weight.shape
        return BigramHead(BigramConfig(hidden, vocab, verifier=self.verifier_name))

    def drafter_loss(self, batch, features):
        hidden, ids = features["hidden"], batch["input_ids"]
        mask = (batch["loss_mask"] * batch["attention_mask"])[:, 2:].bool()
        logits = self.drafter.logits(hidden[:, :-2])
        loss = F.cross_entropy(logits[mask].float(), ids[:, 2:][mask])
        return loss, {"ce": loss.detach()}

    @torch.no_grad()
    def validation_counts(self, batch, features):
        hidden, greedy = features["hidden"], features["greedy"]  # greedy[:, t]: the verifier's token t+1
        mask = (batch["loss_mask"] * batch["attention_mask"])[:, 2:].bool()
        hit = self.drafter.logits(hidden[:, :-2]).argmax(-1) == greedy[:, 1:-1]
        return {"n": mask.sum(), "hits": (hit & mask).sum()}

    def val_metrics(self, sums):
        top1 = float(sums["hits"]) / max(float(sums["n"]), 1.0)
        return {"top1_ver": top1, "tau_pred": 1.0 + top1}

    def summary_rows(self, metrics):
        return ["head", "top1 vs verifier"], [[1, metrics.get("top1_ver")]]

    def export(self, out_dir, drafter, extra=None):
        return drafter.save_pretrained(out_dir)


class BigramDrafter(Drafter):
    """Decoding: one draft per round, the head's argmax over the verifier's hidden state of the root."""

    name = "bigram"

    def __init__(self, head: BigramHead, model, tree, vocab=None):
        super().__init__(tree)
        weight = model.get_output_embeddings().weight
        self.head = head.to(weight.device, weight.dtype)

    def propose(self, state):
        if self.tree.size == 0:
            return Proposal(tokens=state.tokens.new_zeros(0))
        return Proposal(tokens=self.head.logits(state.hidden).argmax(-1).reshape(1))


def _export_flat(head, fmt, verifier_lm_head, verifier_name, speculative_tokens, notes):
    c = head.config
    config = {"architectures": ["BigramHead"], "bigram_hidden": c.hidden_size, "vocab_size": c.vocab_size,
              "base_model": verifier_name or c.verifier}
    return config, {"head.weight": head.proj.weight.detach(), "head.bias": head.proj.bias.detach()}


def _load_flat(fmt, config, tensors, ours, verifier_model, path):
    head = BigramHead(BigramConfig(config["bigram_hidden"], config["vocab_size"], verifier=config["base_model"]))
    head.load_state_dict({"proj.weight": tensors["head.weight"], "proj.bias": tensors["head.bias"]})
    return head


BIGRAM = DrafterFamily(
    name="bigram", methods=("bigram",), drafter_class=BigramHead, config_class=BigramConfig, label="bigram head")
BIGRAM_SERVING = FamilyServing("bigram", formats=(
    ServingFormat("bigram-flat", "a toy engine's flat layout", "bigram", detect=lambda c: "bigram_hidden" in c,
                  export=_export_flat, load=_load_flat,
                  expected=lambda fmt, c: {"head.weight": (c["vocab_size"], c["bigram_hidden"]),
                                           "head.bias": (c["vocab_size"],)}),))
BIGRAM_EVALUATOR = FamilyEvaluator(build=lambda head, model, tree, dynamic=None, vocab=None: BigramDrafter(
    head, model, tree, vocab), static_trees=False, max_depth=lambda head: 1)


@pytest.fixture
def bigram_family():
    register_family(BIGRAM)  # one registration line per layer
    register_serving(BIGRAM_SERVING)
    register_evaluator("bigram", BIGRAM_EVALUATOR)
    yield BIGRAM
    unregister_family(BIGRAM.name)
    unregister_serving(BIGRAM.name)
    unregister_evaluator(BIGRAM.name)


def test_every_layer_loads_the_bundled_families_halves():
    """Each layer's lookup imports its bundled halves by name (``from . import dflash, eagle, medusa``): the same
    names as heads/families.py's BUNDLED_FAMILIES, and each registers under its family's name."""
    import ast
    import importlib

    from spectrain.eval.family_evaluator import registered_evaluator
    from spectrain.heads.families import BUNDLED_FAMILIES, families
    from spectrain.heads.serving.registry import registered_serving

    bundled = {module.rpartition(".")[2] for module in BUNDLED_FAMILIES}
    for lookup in ("spectrain.eval.families", "spectrain.heads.serving.families"):
        source = Path(importlib.import_module(lookup).__file__).read_text()
        imported = {alias.name for node in ast.walk(ast.parse(source))
                    if isinstance(node, ast.ImportFrom) and node.level == 1 and node.module is None
                    for alias in node.names}
        assert imported == bundled, lookup
    for family in families():
        assert registered_evaluator(family.name) is not None and registered_serving(family.name) is not None


def _batches(n: int, vocab: int, seed: int) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (n, 24), generator=g)
    return [{"input_ids": row, "attention_mask": torch.ones_like(row), "loss_mask": torch.ones_like(row)} for row in ids]


def train_a_few_steps(module_class, verifier_dir: str, measure_k: int) -> DrafterModule:
    """``module_class`` trained 3 Lightning steps on random rows (validation measures tau with chains of
    ``measure_k``); asserts that the steps ran and its loss fell."""
    torch.manual_seed(0)
    module = module_class(verifier=verifier_dir, verifier_dtype="float32", lr=2e-2, warmup_steps=0,
                          measure_prompts=2, measure_k=measure_k, measure_new_tokens=6)
    vocab = module.verifier_lm_head.weight.shape[0]
    train = torch.utils.data.DataLoader(_batches(4, vocab, seed=1) * 3, batch_size=4)
    val = torch.utils.data.DataLoader(_batches(4, vocab, seed=2), batch_size=4)
    probe = next(iter(train))
    with torch.no_grad():
        before = float(module.drafter_loss(probe, module.features(probe))[0])
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=3, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0)
    trainer.fit(module, train_dataloaders=train, val_dataloaders=val)
    assert trainer.global_step == 3
    with torch.no_grad():
        assert float(module.drafter_loss(probe, module.features(probe))[0]) < before  # it trained
    return module


def test_a_family_registered_in_a_test_trains_evaluates_exports_and_imports(bigram_family, verifier_factory, tmp_path):
    from spectrain.eval.cli import parse_args
    from spectrain.eval.evaluate import EvalSettings, evaluate_drafter, load_drafter
    from spectrain.heads.serving.formats import FORMATS, check_format_for, detect_format, export_drafter, import_drafter
    from spectrain.heads.verifier import load_verifier

    verifier_dir = str(verifier_factory("llama", False))
    # train: Lightning, a few steps; measured tau at validation decodes through the family's evaluator
    module = train_a_few_steps(BigramModule, verifier_dir, measure_k=3)
    assert module.family is BIGRAM
    metrics = module.last_val_metrics
    assert set(metrics) >= {"tau_measured", "alpha1_measured", "tau_pred"}
    run = module.export(tmp_path / "run", module.plain_drafter())

    # evaluate: the registered method; T = 0 output equals AR
    verifier = load_verifier(verifier_dir, dtype=torch.float32)
    head = load_drafter(str(run), verifier, "bigram")
    assert isinstance(head, BigramHead) and parse_args(["--method", "bigram"]).method == "bigram"
    prompts = [["the king sat on the mat"], ["where is the river"]]
    settings = EvalSettings(k=1, max_new_tokens=12, hf_generate=0, costs=False, chat_template=False)
    result = evaluate_drafter(verifier, prompts, "bigram", settings, drafter=head)
    assert result.method == "bigram" and result.results["chain-1"]["identical_to_ar"]
    # A control whose acceptance is known: the head rigged to propose AR's most frequent token every round. By
    # hand over AR's outputs (the first token is the prefill's), a round at position p accepts iff out[p] is it.
    outputs = [t["tokens"] for r in result.per_prompt["ar"] for t in r["turns"]]
    token = collections.Counter(x for out in outputs for x in out[1:]).most_common(1)[0][0]
    rounds = accepted = emitted = 0
    for out in outputs:
        p = 1
        while p < len(out):
            hit = out[p] == token  # accepted: out[p] is emitted as the draft, out[p + 1] as the bonus (if room)
            rounds, accepted, emitted, p = rounds + 1, accepted + hit, emitted + min(1 + hit, len(out) - p), p + 1 + hit
    constant = copy.deepcopy(head)
    with torch.no_grad():
        constant.proj.weight.zero_()
        constant.proj.bias.copy_(torch.nn.functional.one_hot(torch.tensor(token), head.proj.bias.numel()).float())
    rigged = evaluate_drafter(verifier, prompts, constant, settings).results["chain-1"]
    assert accepted > 0 and rigged["identical_to_ar"] and rigged["verifier_forwards"] == rounds
    assert rigged["tau"] == pytest.approx(emitted / rounds)
    with pytest.raises(SpectrainError, match="2 deep but the drafter drafts at most 1 deep"):
        evaluate_drafter(verifier, prompts, head, EvalSettings(k=2, max_new_tokens=4, hf_generate=0, costs=False,
                                                               chat_template=False))
    with pytest.raises(SpectrainError, match="drafts chains only"):
        evaluate_drafter(verifier, prompts, head, EvalSettings(k=0, tree="[[0], [1]]", max_new_tokens=4,
                                                               hf_generate=0, costs=False, chat_template=False))

    # export -> import: the family's serving format, and our own run-dir format
    assert FORMATS["bigram-flat"] == "a toy engine's flat layout" and check_format_for(head, "bigram-flat") == "bigram"
    out = export_drafter(head, "bigram-flat", tmp_path / "export")
    assert detect_format(out) == "bigram-flat"
    for path in (out, run):
        back = import_drafter(path, verifier_model=verifier.model)
        assert type(back) is BigramHead
        assert all(torch.equal(a, b.to(a.dtype)) for a, b in zip(back.state_dict().values(),
                                                                  module.drafter.state_dict().values()))
    save_tensors(out / "model.safetensors", {"head.weight": torch.zeros(3, 3)})  # checked by the format's `expected`
    with pytest.raises(SpectrainError, match="not a valid bigram-flat export"):
        import_drafter(out)


def test_registration_refuses_a_taken_name_or_method(bigram_family):
    with pytest.raises(SpectrainError, match="method 'eagle3' already registered"):
        register_family(DrafterFamily(name="eagle-x", methods=("eagle3",), drafter_class=nn.Linear,
                                      config_class=dict))
    with pytest.raises(SpectrainError, match="family 'bigram' already registered"):
        register_family(DrafterFamily(name="bigram", methods=("bigram2",), drafter_class=nn.Linear,
                                      config_class=dict))
    assert register_family(BIGRAM) is BIGRAM  # the same record again: a no-op
    assert family_for_method("bigram") is BIGRAM and family_for_method("eagle1").name == "eagle"


@pytest.mark.parametrize("name,whose", [("spectrain", "our own run-dir format's"),
                                        ("gguf", "spectrain-export's llama.cpp file's")])
def test_a_format_may_not_take_a_reserved_name(name, whose):
    from spectrain.heads.serving.families import serving_formats

    taken = ServingFormat(name, "a layout under a reserved name", "reserved-probe", detect=lambda c: False,
                          export=None, load=None, expected=None)
    with pytest.raises(SpectrainError, match=f"format name '{name}' is {whose}"):
        register_serving(FamilyServing("reserved-probe", formats=(taken,)))
    assert "eagle" in serving_formats() and name not in serving_formats()


def test_the_confidence_message_names_each_method_once():
    from spectrain.heads.serving.cli import _dropping

    assert _dropping() == ["DFlash", "DSpark"]
    family = register_family(DrafterFamily(name="blocky", methods=("blocky-a", "blocky-b"), drafter_class=nn.Linear,
                                           config_class=dict))
    register_serving(FamilyServing("blocky", without_confidence_head=lambda d: d))
    try:
        assert _dropping() == ["DFlash", "DSpark", "blocky"]  # two methods, one default label: named once
    finally:
        unregister_family(family.name)
        unregister_serving(family.name)


def test_a_family_records_no_verifier_depth_unless_it_says_where():
    """A plugin's run-dir config.json may hold its own num_hidden_layers (its depth, as DFlash's does): read as the
    verifier's only where the family names the key."""
    plain = DrafterFamily(name="depthless", methods=("depthless",), drafter_class=nn.Linear, config_class=dict)
    assert plain.verifier_depth_key is None and plain.method_labels == ("depthless",)
    assert [family_for_method(m).verifier_depth_key for m in ("medusa", "eagle3", "dflash")] == \
        [None, "num_hidden_layers", "verifier_layers"]
    with pytest.raises(SpectrainError, match="1 method_labels for 2 methods"):
        DrafterFamily(name="x", methods=("x1", "x2"), drafter_class=nn.Linear, config_class=dict,
                      method_labels=("X",))


# -- the three silent mis-routes, now errors ----------------------------------------------------------------------
def test_import_of_an_unknown_method_is_refused_not_loaded_as_eagle(tmp_path):
    """Our run-dir format with a method no family registered (a plugin's, say): before, any non-Medusa directory
    was handed to EagleDrafter.from_pretrained."""
    from spectrain.heads.serving.formats import detect_format, import_drafter

    save_tensors(tmp_path / "model.safetensors", {"proj.weight": torch.zeros(4, 4)})
    write_json(tmp_path / "config.json", {"method": "blockdraft", "format_version": 1, "hidden_size": 4})
    assert detect_format(tmp_path) == "spectrain"
    with pytest.raises(SpectrainError, match="method 'blockdraft' belongs to no registered drafter family"):
        import_drafter(tmp_path)


def test_the_bigram_run_dir_is_refused_once_its_family_is_gone(tmp_path, bigram_family):
    from spectrain.heads.serving.formats import import_drafter

    BigramHead(BigramConfig(4, 10)).save_pretrained(tmp_path)
    assert type(import_drafter(tmp_path)) is BigramHead
    unregister_family("bigram")
    with pytest.raises(SpectrainError, match="'bigram' belongs to no registered drafter family"):
        import_drafter(tmp_path)


def _row_ctx(drafter):
    from spectrain.eval.results import settings_from_args

    from spectrain.eval.results import parse_args

    args = parse_args([])  # every flag at its default, then the row's own
    vars(args).update(k=1, tree_nodes=8, tree_depth=2, tree_topk=2, max_new_tokens=8, seed=0)
    return SimpleNamespace(args=args, drafter=lambda name, path: drafter, settings=settings_from_args(args, 64))


def test_results_label_an_unregistered_drafter_an_error_not_eagle(bigram_family):
    """spectrain-results labelled every drafter that was not MedusaHeads 'eagle' (and decoded it as EAGLE)."""
    from spectrain.eval.results import row_options

    chain = {"drafter": "d", "setting": "chain-1", "temperature": 0.0}
    with pytest.raises(SpectrainError, match="Linear is not the drafter of a registered drafter family"):
        row_options(_row_ctx(nn.Linear(2, 2)), chain, "")
    head = BigramHead(BigramConfig(4, 10))
    call, definition = row_options(_row_ctx(head), chain, "")
    assert call.method == "bigram" and call.drafter is head and definition["tree"] == "chain"
    s = call.settings
    assert (s.k, s.max_len, s.costs, s.chat_template, s.hf_generate) == (1, 64, False, True, 0)
    assert row_options(_row_ctx(head), {**chain, "drafter": "hybrid-d"}, "")[0].method == "hybrid"
    sampled, _ = row_options(_row_ctx(head), {**chain, "drafter": "ngram", "temperature": 1.0}, "")
    assert sampled.method == "ngram" and sampled.settings.temperature == 1.0  # a sampled row decodes sampled
    with pytest.raises(SpectrainError, match="bigram head drafters grow neither"):
        row_options(_row_ctx(head), {**chain, "setting": "tree-8"}, "")


class ToyDecoderLayer(nn.Module):
    def __init__(self, h: int):
        super().__init__()
        self.mlp = nn.Linear(h, h)


class BlockDrafter(nn.Module):
    """A drafter with decoder layers of its own, as the next issue's block drafters have."""

    def __init__(self, h: int):
        super().__init__()
        self.layers = nn.ModuleList(ToyDecoderLayer(h) for _ in range(2))
        self.norm = nn.LayerNorm(h)


class Root(nn.Module):
    def __init__(self, drafter: nn.Module):
        super().__init__()
        from tests.conftest import make_verifier

        self.verifier = make_verifier("llama", False, 64, layers=3).requires_grad_(False)
        self.drafter = drafter


def test_fsdp_refuses_a_decoder_layer_of_an_unregistered_drafter():
    """FSDP's policy took every ``*DecoderLayer`` not named ``Eagle*`` for a verifier layer, and (never wrapping a
    drafter it did not know) descended into an unknown drafter: its layers became frozen-verifier units and its
    other weights fell into the root unit with the verifier's embeddings. Now verifier layers are transformers'
    ``*DecoderLayer`` classes, each registered family's drafter class is one unit, and any other decoder
    layer is refused."""
    from spectrain.train.strategies import fsdp_units

    root = Root(BlockDrafter(32))
    with pytest.raises(SpectrainError, match="ToyDecoderLayer .* outside the verifier and outside every registered"):
        fsdp_units(root)
    block = DrafterFamily(name="block", methods=("block",), drafter_class=BlockDrafter, config_class=dict)
    register_family(block)
    try:
        units = fsdp_units(root)
    finally:
        unregister_family("block")
    assert [type(u).__name__ for u in units] == ["Root"] + ["LlamaDecoderLayer"] * 3 + ["BlockDrafter"]
    owner = {}  # each parameter belongs to the innermost unit holding it: none mixes frozen and trainable
    for unit in units:
        for p in unit.parameters():
            owner[id(p)] = id(unit)
    for unit in units:
        assert len({p.requires_grad for p in unit.parameters() if owner[id(p)] == id(unit)}) <= 1, type(unit).__name__


def test_an_unregistered_drafter_is_refused_by_training_and_evaluation():
    from spectrain.eval.methods import bind_learned
    from spectrain.heads.serving.formats import method_of

    for call in (lambda: family_of(nn.Linear(2, 2)), lambda: method_of(nn.Linear(2, 2)),
                 lambda: bind_learned("hybrid", nn.Linear(2, 2))):
        with pytest.raises(SpectrainError, match="not the drafter of a registered drafter family"):
            call()
