"""The ops a pattern is made of, remembered on disk, so a pattern with an op the graph lacks is
skipped without tracing it.

``PatternMatcher`` finds matches by walking back from the nodes whose target is the traced
pattern's output op (its anchor), and a pattern node only matches a graph node with the same
target: a pattern one of whose ops is absent from the graph cannot match. Tracing a pattern is a
``torch.export`` of a small function: ~30-110 ms each, ~40 patterns, paid again by every new
process (``workbench run``), most of them for patterns the model cannot match (MoE patterns on a
dense model: their anchor, a ``view``, is everywhere, but their ``bmm``/``grouped_mm`` is not).
The op set of a pattern is a fact of its code, so it is kept in
``$WORKBENCH_CACHE_DIR/patterns/ops.json`` (the anchor first) under a key of everything the trace
depends on (the pattern's name, the source, closure values and defaults of ``search``, its
literals, the example inputs' shapes and dtypes, the torch version). When the key is known and one
of its ops is not in the graph, the pattern is not traced; otherwise it is traced as before.
"""

from __future__ import annotations

import functools
import hashlib
import inspect
import json
from typing import Any, Dict, List, Optional, Sequence

import torch

from ...cache_dir import cache_root, write_atomically

_FILE = ("patterns", "ops.json")


@functools.lru_cache(maxsize=None)  # per pattern object, like pattern.traced_pattern: they are module constants
def pattern_key(pattern: Any) -> Optional[str]:
    """A key of everything ``pattern``'s trace depends on, or None when its source is unavailable."""
    fn = pattern.search
    try:
        source = inspect.getsource(fn)
    except (OSError, TypeError):
        return None
    closure = [repr(c.cell_contents) for c in (getattr(fn, "__closure__", None) or ())]
    examples = [
        (tuple(t.shape), str(t.dtype)) if isinstance(t, torch.Tensor) else repr(t) for t in pattern.example_inputs()
    ]
    parts = [
        pattern.name,
        source,
        repr(closure),
        repr(getattr(fn, "__defaults__", None)),
        repr(sorted((k, repr(v)) for k, v in pattern.literals.items())),
        repr(examples),
        torch.__version__,
    ]
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:24]


def op_name(target: Any) -> Optional[str]:
    """``ns::name.overload`` of an OpOverload, else None (other anchors are not remembered)."""
    if isinstance(target, torch._ops.OpOverload):
        return f"{target.namespace}::{target._opname}.{target._overloadname}"
    return None


def op_from_name(name: str) -> Optional[Any]:
    ns, _, rest = name.partition("::")
    opname, _, overload = rest.rpartition(".")
    try:
        return getattr(getattr(getattr(torch.ops, ns), opname), overload)
    except (AttributeError, RuntimeError):
        return None


class PatternOpsCache:
    """The on-disk table (read once per instance; every new entry is written through)."""

    def __init__(self):
        root = cache_root()
        self.path = root.joinpath(*_FILE) if root is not None else None
        self._table: Optional[Dict[str, List[str]]] = None

    def _load(self) -> Dict[str, List[str]]:
        if self._table is None:
            self._table = {}
            if self.path is not None and self.path.is_file():
                try:
                    table = json.loads(self.path.read_text())
                    self._table = {k: v for k, v in table.items() if isinstance(v, list) and v}
                except (OSError, ValueError, AttributeError):
                    self._table = {}
        return self._table

    def ops(self, pattern: Any) -> Optional[List[Any]]:
        """The remembered ops of ``pattern`` (its anchor first), or None if unknown or if one of them
        no longer exists (an extension not loaded): then the pattern is traced."""
        key = pattern_key(pattern)
        names = self._load().get(key) if key is not None else None
        if not names:
            return None
        ops = [op_from_name(n) for n in names]
        return None if any(op is None for op in ops) else ops

    def remember(self, pattern: Any, targets: Sequence[Any]) -> None:
        """Store the OpOverload targets of ``pattern``'s traced graph, ``targets[0]`` its anchor."""
        key = pattern_key(pattern)
        names = [op_name(t) for t in targets]
        table = self._load()
        if key is None or not names or any(n is None for n in names) or table.get(key) == names:
            return
        table[key] = names  # type: ignore[assignment]
        if self.path is None:
            return
        try:  # atomic replace: concurrent processes see a whole file
            write_atomically(self.path, json.dumps(table, indent=0, sort_keys=True).encode())
        except OSError:
            pass  # a read-only cache only costs the traces


__all__ = ["PatternOpsCache", "pattern_key"]
