"""The layering, checked from the source: no import cycles, and each layer imports only downwards.

Every ``import`` / ``from ... import`` in ``workbench/`` counts, function-level ones included (a
lazy import is still a dependency). Layers, bottom up: ``errors`` / ``_compat`` / ``ops`` /
``models``, then ``runtime``, ``pipeline``, ``viz``, then ``api`` / ``widgets`` / ``cli``.
"""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Dict, List, Set

ROOT = Path(__file__).resolve().parent.parent / "workbench"


def _module_name(path: Path) -> str:
    rel = path.relative_to(ROOT.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _modules() -> Dict[str, Path]:
    return {_module_name(p): p for p in ROOT.rglob("*.py")}


def _imports(name: str, path: Path, known: Set[str]) -> Set[str]:
    """The workbench modules ``name`` imports (resolved to modules that exist)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out: Set[str] = set()
    tree = ast.parse(path.read_text())
    typing_only = {id(n) for block in ast.walk(tree) if isinstance(block, ast.If)
                   and isinstance(block.test, ast.Name) and block.test.id == "TYPE_CHECKING"
                   for n in ast.walk(block)}  # annotations only: not a dependency at run time
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            targets = [f"{mod}.{a.name}" if f"{mod}.{a.name}" in known else mod for a in node.names]
        else:
            continue
        for t in targets:
            while t and t not in known:  # `import workbench.x.y` -> the deepest module that exists
                t = t.rpartition(".")[0]
            if t.startswith("workbench") and t != name:
                out.add(t)
    return out


def _graph() -> Dict[str, Set[str]]:
    mods = _modules()
    return {name: _imports(name, path, set(mods)) for name, path in mods.items()}


def _cycles(graph: Dict[str, Set[str]]) -> List[List[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: Dict[str, int] = {}
    low: Dict[str, int] = {}
    stack: List[str] = []
    on: Set[str] = set()
    out: List[List[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in graph:
        if v not in index:
            visit(v)
    return out


def _package_edges(graph: Dict[str, Set[str]], src: str, dst: str) -> List[str]:
    def inside(m: str, pkg: str) -> bool:
        return m == pkg or m.startswith(pkg + ".")

    return sorted(f"{a} -> {b}" for a, deps in graph.items() if inside(a, src) for b in deps if inside(b, dst))


def test_the_import_graph_has_no_cycle():
    graph = _graph()
    assert len(graph) > 80  # the whole package was read
    # package __init__ files that only re-export their own submodules are part of the package, not
    # a second node of a cycle: drop the edges from a submodule back up to its own package face
    pruned = {a: {b for b in deps if not a.startswith(b + ".")} for a, deps in graph.items()}
    assert _cycles(pruned) == []


def test_pipeline_reaches_the_runtime_only_through_its_interface():
    graph = _graph()
    edges = _package_edges(graph, "workbench.pipeline", "workbench.runtime")
    assert edges and all(e.endswith("-> workbench.runtime.interface") for e in edges), edges


def test_each_layer_imports_only_downwards():
    graph = _graph()
    for low, high in [("workbench.ops", "workbench.pipeline"), ("workbench.ops", "workbench.runtime"),
                      ("workbench.runtime", "workbench.pipeline"), ("workbench.models", "workbench.pipeline"),
                      ("workbench.pipeline", "workbench.viz"), ("workbench.pipeline", "workbench.widgets"),
                      ("workbench.runtime", "workbench.widgets"), ("workbench.viz", "workbench.widgets"),
                      ("workbench.ops", "workbench.models")]:
        assert _package_edges(graph, low, high) == [], f"{low} must not import {high}"
    for name, deps in graph.items():
        if not name.startswith("workbench.widgets"):
            assert not any(d.startswith("workbench.widgets") for d in deps if name != "workbench.api"), name


# export_to_gm's own helper modules (patches applied while tracing, layer stamping): one family.
EXPORT_HELPERS = {"workbench.pipeline.transforms.export_patches", "workbench.pipeline.transforms.export_stamp"}


def test_transforms_import_no_other_transform_family():
    """Families share code through the framework helpers (matcher, graph_weights...), never by
    importing each other, so a key's behaviour lives in its own file."""
    graph = _graph()
    fam = "workbench.pipeline.transforms"
    bad = [f"{a} -> {b}" for a, deps in graph.items() if a.startswith(fam + ".")
           for b in deps if b.startswith(fam + ".") and b != a and b not in EXPORT_HELPERS]
    assert bad == [], bad
