"""Imports flow one way: heads/ is the base; data/, train/ and eval/ build on it; data/ imports neither train/
nor eval/; eval/ never imports train/ (evaluation runs with torch + transformers + safetensors only). No two
modules import each other, directly or around a circle, lazy imports included."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ALLOWED = {"heads": set(), "data": {"heads"}, "eval": {"heads", "data"}, "train": {"heads", "data", "eval"}}


def forbidden_imports(layer: str, source: str, filename: str = "<source>") -> list[str]:
    """``file:line layer -> spectrain.X`` for every import (top level or inside a function) that points against
    the layering."""
    found = []
    for node in ast.walk(ast.parse(source, filename)):
        if isinstance(node, ast.ImportFrom):
            if node.level == 1:
                names = [f"spectrain.{layer}.{node.module or ''}"]
            elif node.level > 1:
                names = [f"spectrain.{node.module or ''}"]
            else:
                names = [node.module or ""]
        elif isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        else:
            continue
        for name in names:
            parts = name.split(".")
            if parts[0] == "spectrain" and len(parts) > 1 and parts[1] in ALLOWED and parts[1] != layer \
                    and parts[1] not in ALLOWED[layer]:
                found.append(f"{filename}:{node.lineno} {layer} -> {name}")
    return found


def module_names() -> dict[str, Path]:
    """Every module of the four packages by its import name (``spectrain.data.store``)."""
    out = {}
    for layer in ALLOWED:
        for path in (ROOT / layer).rglob("*.py"):
            parts = path.relative_to(ROOT / layer).with_suffix("").parts
            out[".".join(("spectrain", layer) + parts).removesuffix(".__init__")] = path
    return out


def imported(module: str, source: str, known: set[str]) -> set[str]:
    """The modules of ``known`` that ``module``'s source imports, at top level or inside a function."""
    layer, found = module.split(".")[1], set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from its own package (level 1) or from spectrain (level 2)
                base = (f"spectrain.{layer}" if node.level == 1 else "spectrain") + (f".{base}" if base else "")
            names = [base] + [f"{base}.{alias.name}" for alias in node.names]
        elif isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        else:
            continue
        found |= {n for n in names if n in known and n != module}
    return found


def import_circles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The groups of modules that import each other around a circle (strongly connected, more than one)."""
    order, low, stack, circles = {}, {}, [], []

    def visit(v: str) -> None:
        order[v] = low[v] = len(order)
        stack.append(v)
        for w in edges[v]:
            if w not in order:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], order[w])
        if low[v] == order[v]:
            group = []
            while group[-1:] != [v]:
                group.append(stack.pop())
            if len(group) > 1:
                circles.append(sorted(group))

    for v in sorted(edges):
        if v not in order:
            visit(v)
    return circles


def test_no_import_circles():
    modules = module_names()
    edges = {m: imported(m, path.read_text(), set(modules)) for m, path in modules.items()}
    assert import_circles(edges) == []


def test_the_check_sees_an_import_circle():
    known = {"spectrain.data.a", "spectrain.data.b", "spectrain.data.c"}
    lazy = imported("spectrain.data.b", "def f():\n    from .c import x\n", known)
    edges = {"spectrain.data.a": imported("spectrain.data.a", "from . import b\n", known),
             "spectrain.data.b": lazy, "spectrain.data.c": imported("spectrain.data.c", "import spectrain.data.a\n", known)}
    assert import_circles(edges) == [["spectrain.data.a", "spectrain.data.b", "spectrain.data.c"]]
    edges["spectrain.data.c"] = set()
    assert import_circles(edges) == []


def test_no_import_points_against_the_layers():
    problems = []
    for layer in ALLOWED:
        for path in sorted((ROOT / layer).rglob("*.py")):
            problems += forbidden_imports(layer, path.read_text(), str(path.relative_to(ROOT)))
    assert not problems, "imports against the layering:\n" + "\n".join(problems)


def test_the_check_sees_a_forbidden_import():
    """The test above can fail: an upward import, even a lazy one inside a function, is reported."""
    lazy = "def f():\n    from spectrain.data.bundled import ensure_bundled_verifier\n"
    assert forbidden_imports("heads", lazy) == ["<source>:2 heads -> spectrain.data.bundled"]
    assert forbidden_imports("eval", "import spectrain.train.base\n") == ["<source>:1 eval -> spectrain.train.base"]
    assert forbidden_imports("data", "from ..train import cli\n") == ["<source>:1 data -> spectrain.train"]
    assert forbidden_imports("train", "from spectrain.eval.decode import generate\n") == []


def test_benchmarks_and_checks_live_outside_the_packages():
    names = ("bench_", "gpu_check", "engine_check", "vllm_runner")
    inside = [str(p.relative_to(ROOT)) for layer in ALLOWED for p in (ROOT / layer).rglob("*.py")
              if p.name.startswith(names)]
    assert not inside, inside
    assert all((ROOT / "benchmarks" / f"{n}.py").is_file() for n in ("bench_store", "bench_streaming", "bench_memory",
                                                                      "gpu_check", "engine_check", "vllm_runner"))


SPAWNS = ("subprocess.", "mp.spawn", "Popen(", "start_processes(")


def unmarked_spawning_tests(source: str) -> list[str]:
    """Test functions that start processes (directly or through a helper of their module) without the
    ``integration`` marker (module-level ``pytestmark`` counts)."""
    tree = ast.parse(source)
    if "pytestmark = pytest.mark.integration" in source:
        return []
    funcs = {n.name: n for n in tree.body if isinstance(n, ast.FunctionDef)}
    code = {name: ast.get_source_segment(source, n) for name, n in funcs.items()}
    spawning = {name for name, text in code.items() if any(s in text for s in SPAWNS)}
    grew = True
    while grew:  # helpers that call a spawning helper spawn too
        new = {name for name, text in code.items() if name not in spawning and any(f"{s}(" in text for s in spawning)}
        spawning |= new
        grew = bool(new)
    unmarked = [name for name in spawning if name.startswith("test_") and not any(
        "integration" in ast.get_source_segment(source, d) for d in funcs[name].decorator_list)]
    # Cases in module-level tables (dicts of lambdas) that call a spawning helper: the test that runs the table
    # must mark each such case (pytest.param(..., marks=pytest.mark.integration)); the case's key has to appear in
    # its integration-marking decorator or in a module-level collection that decorator names.
    assigned = {t.id: n for n in tree.body if isinstance(n, ast.Assign) for t in n.targets if isinstance(t, ast.Name)}
    for table, node in assigned.items():
        if not isinstance(node.value, ast.Dict):
            continue
        keys = {k.value for k, v in zip(node.value.keys, node.value.values) if isinstance(k, ast.Constant)
                and any(f"{name}(" in ast.get_source_segment(source, v) for name in spawning)}
        for name, f in funcs.items():
            if not keys or not name.startswith("test_") or f"{table}[" not in ast.get_source_segment(source, f):
                continue
            marking = [d for d in f.decorator_list if "integration" in ast.get_source_segment(source, d)]
            named = {n.id for d in marking for n in ast.walk(d) if isinstance(n, ast.Name)}
            marked = {c.value for d in marking for c in ast.walk(d) if isinstance(c, ast.Constant)}
            marked |= {c.value for n in named - {table} if n in assigned for c in ast.walk(assigned[n].value)
                       if isinstance(c, ast.Constant)}
            if keys - marked:
                unmarked.append(name)
    return sorted(set(unmarked))


def test_every_test_that_starts_processes_is_marked_integration():
    """The quick run (-m "not integration") stays quick: a test that trains in a subprocess or spawns ranks
    carries the marker."""
    problems = {p.name: unmarked_spawning_tests(p.read_text()) for p in sorted((ROOT / "tests").glob("test_*.py"))}
    assert not {k: v for k, v in problems.items() if v}
    sample = "import subprocess\ndef run():\n    subprocess.run(['x'])\ndef test_a():\n    run()\n"
    assert unmarked_spawning_tests(sample) == ["test_a"]  # the check can fail
    assert unmarked_spawning_tests(sample.replace("def test_a", "@pytest.mark.integration\ndef test_a")) == []
    table = ("import subprocess\ndef run():\n    subprocess.run(['x'])\nCASES = {'a': lambda: run()}\n"
             "@pytest.mark.parametrize('c', sorted(CASES))\ndef test_b(c):\n    CASES[c]()\n")
    assert unmarked_spawning_tests(table) == ["test_b"]  # a spawning case in a table is seen too
    marked = table.replace("sorted(CASES)", "[pytest.param(c, marks=pytest.mark.integration) if c in {'a'} else c "
                                            "for c in sorted(CASES)]")
    assert unmarked_spawning_tests(marked) == []
    assert unmarked_spawning_tests(marked.replace("{'a'}", "{'b'}")) == ["test_b"]  # the spawning case unmarked
