"""The op a pattern's match ends at, remembered on disk, so an absent op skips the pattern's trace.

``PatternMatcher`` finds matches by walking back from the nodes whose target is the traced
pattern's output op (its anchor). Tracing a pattern is a ``torch.export`` of a small function:
~30-60 ms each, ~40 patterns, paid again by every new process (``workbench run``), most of them for
patterns whose anchor the model never uses (MoE patterns on a dense model, eager attention on an
SDPA one). The anchor of a pattern is a fact of its code, so it is kept in
``$WORKBENCH_CACHE_DIR/patterns/anchors.json`` under a key of everything the trace depends on
(the pattern's name, the source, closure values and defaults of ``search``, its literals, the
example inputs' shapes and dtypes, the torch version). When the key is known and its anchor op is
not in the graph, the pattern cannot match and is not traced; otherwise it is traced as before.
"""

from __future__ import annotations

import functools
import hashlib
import inspect
import json
import os
import tempfile
from typing import Any, Dict, Optional

import torch

from ...cache_dir import cache_root

_FILE = ("patterns", "anchors.json")


@functools.lru_cache(maxsize=None)  # per pattern object, like engine.traced_pattern: they are module constants
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


class AnchorCache:
    """The on-disk table (read once per instance; every new entry is written through)."""

    def __init__(self):
        root = cache_root()
        self.path = root.joinpath(*_FILE) if root is not None else None
        self._table: Optional[Dict[str, str]] = None

    def _load(self) -> Dict[str, str]:
        if self._table is None:
            self._table = {}
            if self.path is not None and self.path.is_file():
                try:
                    self._table = dict(json.loads(self.path.read_text()))
                except (OSError, ValueError):
                    self._table = {}
        return self._table

    def anchor(self, pattern: Any) -> Optional[Any]:
        """The remembered anchor op of ``pattern``, or None if unknown."""
        key = pattern_key(pattern)
        name = self._load().get(key) if key is not None else None
        return op_from_name(name) if name else None

    def remember(self, pattern: Any, target: Any) -> None:
        key, name = pattern_key(pattern), op_name(target)
        table = self._load()
        if key is None or name is None or table.get(key) == name or self.path is None:
            return
        table[key] = name
        try:  # atomic replace: concurrent processes see a whole file
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=self.path.parent, suffix=".tmp")
            with os.fdopen(fd, "w") as f:
                json.dump(table, f, indent=0, sort_keys=True)
            os.replace(tmp, self.path)
        except OSError:
            pass  # a read-only cache only costs the traces


__all__ = ["AnchorCache", "pattern_key"]
