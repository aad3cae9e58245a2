"""benchmarks/train_throughput.py takes its drafters from the family table, not from method names: every
registered method with a SmolLM2 recipe in both trees, each through its family's training module; and its FLOP
count (torch's counter) includes attention on the CPU."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from spectrain.heads.errors import SpectrainError
from spectrain.heads.families import DrafterFamily, families, register_family, unregister_family
from spectrain.train.base import DrafterModule

from .scripts import load_script

bench = load_script("train_throughput")


class ToyModule(DrafterModule):
    method_name = "toydraft"


def recipes(root: Path, *methods: str) -> Path:
    (root / "configs").mkdir(parents=True)
    for method in methods:
        (root / "configs" / f"{method}_smollm2.yaml").write_text("model: {}\n")
    return root


def test_timed_methods_come_from_the_family_table(tmp_path, monkeypatch):
    new = recipes(tmp_path / "new", "medusa", "eagle3", "dflash", "toydraft")
    old = recipes(tmp_path / "old", "medusa", "eagle1", "eagle3", "toydraft")
    monkeypatch.setattr(bench, "REPO", new)
    toy = DrafterFamily(name="toy-family", methods=("toydraft",), drafter_class=nn.Linear, config_class=dict,
                        train_module=ToyModule)  # a family from outside: its module passed as the object
    families()  # the bundled families first: the order below is registration order
    register_family(toy)
    try:
        methods = bench.timed_methods(old, None)
        # registration order; a method lacking a recipe in either tree (eagle1: new, dflash: old) is not timed
        assert list(methods) == ["medusa", "eagle3", "toydraft"]
        assert methods["medusa"] == "spectrain.train.medusa:MedusaModule"
        assert methods["eagle3"] == "spectrain.train.eagle:EagleModule"
        assert methods["toydraft"] == f"{__name__}:ToyModule"
        assert list(bench.timed_methods(old, "toydraft, medusa")) == ["toydraft", "medusa"]
        with pytest.raises(SpectrainError, match="dflash has no SmolLM2 recipe.*in the old tree"):
            bench.timed_methods(old, "dflash")
        with pytest.raises(SpectrainError, match="'nosuch' belongs to no registered drafter family"):
            bench.timed_methods(old, "nosuch")
    finally:
        unregister_family(toy.name)
    with pytest.raises(SpectrainError, match="nothing to time"):
        bench.timed_methods(recipes(tmp_path / "empty"), None)


def test_flop_counter_counts_cpu_attention():
    q, k, v = (torch.randn(1, 2, 8, 4, requires_grad=True) for _ in range(3))
    with bench.flop_counter() as counter:
        torch.nn.functional.scaled_dot_product_attention(q, k, v).sum().backward()
    forward = 2 * 1 * 2 * 8 * 8 * (4 + 4)  # Q K^T and P V
    assert counter.get_total_flops() == 3 * forward  # forward + a backward of twice its products
