"""The pieces of ``benchmarks/train_throughput.py`` that tests check: which drafter methods it times
(:func:`timed_methods`, from the family table and the recipes) and its FLOP counter (:func:`flop_counter`, attention on the CPU
included).

The benchmark times this tree against an older revision, each side in a subprocess importing its own
``spectrain``; the FLOP counter must be the same instrument on both sides, so the benchmark copies this file into
the old tree. Hence nothing of ``spectrain`` (nor torch) is imported at module level here: only inside the
functions, on the side that calls them.
"""

from __future__ import annotations

from pathlib import Path


def flop_counter():
    """torch's FLOP counter (every matmul and attention a step dispatches, backward and recompute included), with
    the CPU attention kernel counted too: torch registers formulas for the GPU kernels only."""
    import torch
    from torch.utils.flop_counter import FlopCounterMode, flop_registry, register_flop_formula

    aten = torch.ops.aten
    forward = getattr(aten, "_scaled_dot_product_flash_attention_for_cpu", None)
    if forward is not None and forward not in flop_registry:
        def attention(query, key, value, *args, out_shape=None, **kwargs) -> int:
            """Q K^T and P V: query (B, h, Sq, d), key (B, h', Sk, d), value (B, h', Sk, dv)."""
            b, h, s_q, d = query
            return 2 * b * h * s_q * key[-2] * (d + value[-1])

        def attention_backward(grad_out, query, key, value, *args, out_shape=None, **kwargs) -> int:
            return 2 * attention(query, key, value)  # dQ, dK, dV and dP: four products of a forward's two

        register_flop_formula(forward)(attention)
        register_flop_formula(aten._scaled_dot_product_flash_attention_for_cpu_backward)(attention_backward)
    return FlopCounterMode(display=False)


def timed_methods(old_src: Path, wanted: str | None, new_src: Path) -> dict[str, str]:
    """The drafter methods to time, each with its training module as ``"package.module:Class"`` (its SmolLM2
    recipe's ``model.class_path``): every registered method with a SmolLM2 recipe in both trees (``new_src``,
    ``old_src``: each a source tree holding ``configs/``), in registration order, or those of ``wanted``
    (``M,M``). Both sides import the module by the new tree's path, the old side from its own tree."""
    import yaml

    from spectrain.heads.errors import SpectrainError
    from spectrain.heads.families import families, family_for_method

    def recipe(tree: Path, method: str) -> Path:
        return tree / "configs" / f"{method}_smollm2.yaml"

    methods = ([m.strip() for m in wanted.split(",") if m.strip()] if wanted
               else [m for f in families() for m in f.methods
                     if recipe(new_src, m).is_file() and recipe(old_src, m).is_file()])
    modules = {}
    for method in methods:
        family_for_method(method, "--methods")  # a registered method, or the error naming the known ones
        missing = [side for side, tree in (("new", new_src), ("old", old_src)) if not recipe(tree, method).is_file()]
        if missing:
            raise SpectrainError(f"--methods: {method} has no SmolLM2 recipe (configs/{method}_smollm2.yaml) in the "
                                 f"{' and '.join(missing)} tree")
        model = (yaml.safe_load(recipe(new_src, method).read_text()) or {}).get("model") or {}
        class_path = model.get("class_path") if isinstance(model, dict) else None
        if not isinstance(class_path, str) or "." not in class_path:
            raise SpectrainError(f"--methods: {recipe(new_src, method)} names no model.class_path")
        module, _, name = class_path.rpartition(".")
        modules[method] = f"{module}:{name}"
    if not modules:
        raise SpectrainError("no drafter method has a SmolLM2 recipe in both trees: nothing to time")
    return modules
