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


def _family(module: str) -> str:
    """``caches`` of ``workbench.pipeline.transforms.caches.attention`` ('' outside the families)."""
    prefix = "workbench.pipeline.transforms."
    return module[len(prefix):].split(".")[0] if module.startswith(prefix) else ""


def test_transforms_import_no_other_transform_family():
    """Families share code through the framework (interface, graph/, matcher/, weights), never by
    importing each other, so a key's behaviour lives in its own family package."""
    graph = _graph()
    bad = [f"{a} -> {b}" for a, deps in graph.items() if _family(a)
           for b in deps if _family(b) and _family(b) != _family(a)]
    assert bad == [], bad


def test_every_transform_lives_in_a_family_package():
    """Discovered, not listed: each registered key's class is defined in a family package, and the
    framework stays out of ``transforms/``."""
    from workbench.pipeline.interface import TRANSFORMS
    import workbench.pipeline.transforms  # noqa: F401  (discovers every family)

    assert len(list(TRANSFORMS)) >= 60
    # transforms that tests register (tests/sharding_faults.py) may share this process: only workbench's own
    homes = {key: cls.__module__ for key, cls in TRANSFORMS.items() if cls.__module__.startswith("workbench.")}
    assert all(_family(m) for m in homes.values()), {k: m for k, m in homes.items() if not _family(m)}
    flat = sorted(p.name for p in (ROOT / "pipeline" / "transforms").glob("*.py"))
    assert flat == ["__init__.py"], flat  # modules live in family packages
