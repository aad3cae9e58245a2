"""benchmarks/train_throughput.py takes its drafters from the family table, not from method names: every
registered method with a SmolLM2 recipe in both trees, each through the training module its recipe names; and its FLOP
count (torch's counter) includes attention on the CPU (both in spectrain.train.throughput)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from spectrain.heads.errors import SpectrainError
from spectrain.heads.families import DrafterFamily, families, register_family, unregister_family
from spectrain.train.base import DrafterModule
from spectrain.train.throughput import flop_counter, timed_methods


class ToyModule(DrafterModule):
    method_name = "toydraft"


MODULES = {"medusa": "spectrain.train.medusa.MedusaModule", "eagle1": "spectrain.train.eagle.EagleModule",
           "eagle3": "spectrain.train.eagle.EagleModule", "dflash": "spectrain.train.dflash.DFlashModule",
           "toydraft": f"{__name__}.ToyModule"}


def recipes(root: Path, *methods: str) -> Path:
    (root / "configs").mkdir(parents=True)
    for method in methods:
        (root / "configs" / f"{method}_smollm2.yaml").write_text(f"model:\n  class_path: {MODULES[method]}\n")
    return root


def test_timed_methods_come_from_the_family_table(tmp_path):
    new = recipes(tmp_path / "new", "medusa", "eagle3", "dflash", "toydraft")
    old = recipes(tmp_path / "old", "medusa", "eagle1", "eagle3", "toydraft")
    toy = DrafterFamily(name="toy-family", methods=("toydraft",), drafter_class=nn.Linear, config_class=dict)
    families()  # the bundled families first: the order below is registration order
    register_family(toy)
    try:
        methods = timed_methods(old, None, new)
        # registration order; a method lacking a recipe in either tree (eagle1: new, dflash: old) is not timed
        assert list(methods) == ["medusa", "eagle3", "toydraft"]
        assert methods["medusa"] == "spectrain.train.medusa:MedusaModule"
        assert methods["eagle3"] == "spectrain.train.eagle:EagleModule"
        assert methods["toydraft"] == f"{__name__}:ToyModule"
        assert list(timed_methods(old, "toydraft, medusa", new)) == ["toydraft", "medusa"]
        with pytest.raises(SpectrainError, match="dflash has no SmolLM2 recipe.*in the old tree"):
            timed_methods(old, "dflash", new)
        with pytest.raises(SpectrainError, match="'nosuch' belongs to no registered drafter family"):
            timed_methods(old, "nosuch", new)
        (new / "configs" / "toydraft_smollm2.yaml").write_text("model: {}\n")
        with pytest.raises(SpectrainError, match="toydraft_smollm2.yaml names no model.class_path"):
            timed_methods(old, "toydraft", new)
    finally:
        unregister_family(toy.name)
    with pytest.raises(SpectrainError, match="nothing to time"):
        timed_methods(recipes(tmp_path / "empty"), None, new)


def test_flop_counter_counts_cpu_attention():
    q, k, v = (torch.randn(1, 2, 8, 4, requires_grad=True) for _ in range(3))
    with flop_counter() as counter:
        torch.nn.functional.scaled_dot_product_attention(q, k, v).sum().backward()
    forward = 2 * 1 * 2 * 8 * 8 * (4 + 4)  # Q K^T and P V
    assert counter.get_total_flops() == 3 * forward  # forward + a backward of twice its products


def test_the_throughput_module_imports_nothing_of_spectrain_at_load():
    """benchmarks/train_throughput.py copies spectrain/train/throughput.py into the old tree it times (the same FLOP
    counter on both sides), where it must load whatever that tree holds: its module level imports the standard
    library only."""
    import ast

    import spectrain.train.throughput as throughput

    tree = ast.parse(Path(throughput.__file__).read_text())
    top = [n for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom))]
    names = {alias.name for n in top if isinstance(n, ast.Import) for alias in n.names}
    names |= {n.module for n in top if isinstance(n, ast.ImportFrom)}
    assert names <= {"__future__", "pathlib"}, names
