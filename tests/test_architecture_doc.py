"""docs/architecture.md stays true: every ```python block runs as written, in order, in one namespace
(a recipe that stops working fails here); the package table names exactly the packages and top-level
modules of workbench/; the import table lists exactly what each unit imports, top layer first; the
sections other files point to exist."""

from __future__ import annotations

import re
from pathlib import Path

DOC = Path(__file__).resolve().parent.parent / "docs" / "architecture.md"


def test_every_python_block_of_the_architecture_page_runs():
    blocks = re.findall(r"```python\n(.*?)```", DOC.read_text(), re.S)
    assert len(blocks) >= 2
    namespace: dict = {}
    for block in blocks:
        exec(compile(block, str(DOC), "exec"), namespace)  # noqa: S102 - our own documentation


# --- the package table and the import table of docs/architecture.md, against the source tree --------

WORKBENCH = DOC.parent.parent / "workbench"


def _marked(name: str) -> str:
    """The text between ``<!-- name:start -->`` and ``<!-- name:end -->`` in the page."""
    m = re.search(rf"<!-- {name}:start -->\n(.*?)<!-- {name}:end -->", DOC.read_text(), re.S)
    assert m, f"docs/architecture.md has no <!-- {name}:start --> ... <!-- {name}:end --> block"
    return m.group(1)


def _first_column(block: str) -> list:
    return re.findall(r"^\| `([^`]+)` \|", block, re.M)


def test_the_package_table_names_every_package_and_top_level_module():
    """Both ways: each package of workbench/ (a directory with an __init__.py, at any depth) and each
    top-level module has a row, and each row names one that exists."""
    rows = _first_column(_marked("package-table"))
    assert len(rows) == len(set(rows)), f"rows named twice: {sorted({r for r in rows if rows.count(r) > 1})}"
    on_disk = {
        f"workbench/{p.parent.relative_to(WORKBENCH).as_posix()}/"
        for p in WORKBENCH.rglob("__init__.py")
        if p.parent != WORKBENCH
    }
    on_disk |= {f"workbench/{p.name}" for p in WORKBENCH.glob("*.py")}
    missing, stale = sorted(on_disk - set(rows)), sorted(set(rows) - on_disk)
    assert not missing and not stale, (
        "docs/architecture.md's package table is out of date: "
        + (f"add a row for {', '.join(missing)}; " if missing else "")
        + (f"remove the row for {', '.join(stale)} (not in the tree)" if stale else "")
    )


def _unit(module: str) -> str:
    """The unit of the import table a module belongs to: ``pipeline/``, ``api.py``, ``__init__.py``."""
    parts = module.split(".")
    if len(parts) == 1:
        return "__init__.py"
    return parts[1] + "/" if (WORKBENCH / parts[1]).is_dir() else parts[1] + ".py"


def _short(unit: str) -> str:
    return unit.rstrip("/").removesuffix(".py")


def test_the_import_table_is_what_the_source_imports():
    """Each unit's row lists exactly the units it imports (function-level imports included,
    ``TYPE_CHECKING`` ones not), and rows run from the top layer down: no unit imports one in an
    earlier row (no import goes up the layers)."""
    from test_architecture import _graph

    rows = {}
    for unit, deps in re.findall(r"^\| `([^`]+)` \|(.*)\|$", _marked("import-table"), re.M):
        rows[unit] = {d for d in re.findall(r"`([^`]+)`", deps)}
    actual: dict = {}
    for module, deps in _graph().items():
        actual.setdefault(_unit(module), set()).update(_short(_unit(d)) for d in deps if _unit(d) != _unit(module))
    assert set(rows) == set(actual), (
        f"import table units: add {sorted(set(actual) - set(rows))}, remove {sorted(set(rows) - set(actual))}"
    )
    wrong = {
        u: {"add": sorted(actual[u] - rows[u]), "remove": sorted(rows[u] - actual[u])}
        for u in rows
        if rows[u] != actual[u]
    }
    assert not wrong, f"docs/architecture.md's import table differs from the source: {wrong}"
    order = [_short(u) for u in rows]
    upward = sorted(f"{_short(u)} -> {d}" for u in rows for d in rows[u] if order.index(d) <= order.index(_short(u)))
    assert upward == [], f"imports that go up the layers: {upward}"


def test_the_sections_other_files_point_to_exist():
    """``docs/architecture.md, "<heading>"`` in tools/ and the package names a section of this page."""
    headings = set(re.findall(r"^#+ (.+)$", DOC.read_text(), re.M))
    sources = list((DOC.parent.parent / "tools").glob("*.py")) + list(WORKBENCH.rglob("*.py"))
    pointers = {(p.name, h) for p in sources for h in re.findall(r'docs/architecture\.md, "([^"]+)"', p.read_text())}
    assert pointers  # tools/matcher_engines.py points to "Why our own pattern matcher"
    assert {(f, h) for f, h in pointers if h not in headings} == set()
