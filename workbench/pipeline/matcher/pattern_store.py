"""Traced pattern graphs kept on disk as JSON, so a new process matches without re-tracing.

``traced_pattern`` is a ``torch.export`` of the pattern's ``search`` function: 20-90 ms each, and
~0.5 s for the first in a process (export's own set-up); smollm2's run traces 10 patterns, 0.9 s in
all, every run. The matcher reads only the graph's structure -- each node's op, target, arguments
and the ``pattern_input`` name of each placeholder -- so that is what is kept:
``$WORKBENCH_CACHE_DIR/patterns/graphs/<key>.json``. The key is ``pattern_key`` (the pattern's name,
source, closure, literals, example shapes, torch version) and the workbench's source hash (a
helper ``search`` calls may change without ``search`` itself changing).

JSON, not pickle: reading an entry resolves op names under ``torch.ops`` and ``operator.getitem``
and nothing else, so a tampered file cannot run code. It could make a pattern match something else,
so entries are read only from a directory nobody else can write (``cache_dir.untrusted``). A graph
with anything else in it (a Python function target, a tensor constant) is not kept; it is traced
every time as before.
"""

from __future__ import annotations

import hashlib
import json
import math
import operator
from typing import Any, Dict, Optional

import torch.fx as fx

from ...cache_dir import KeyedFiles
from ..graph.json_values import TAGS as LEAF_TAGS
from ..graph.json_values import decode_leaf, encode_leaf
from ..probe_cache import workbench_source_hash
from .anchors import op_from_name, op_name, pattern_key

_FORMAT = 3
_GETITEM = "operator.getitem"
_SCALARS = (bool, int, float, str, type(None))


class _Unstorable(Exception):
    """A value this format has no spelling for: the graph is traced every time."""


class PatternGraphStore:
    """Read and write traced pattern graphs (made per pattern a process traces or reads: the
    in-process ``traced_pattern`` cache keeps the graph after that)."""

    MAX_BYTES = 8 << 20  # ~100 patterns of 2-20 KiB each

    def __init__(self) -> None:
        self.files = KeyedFiles(
            "patterns/graphs", ".json", self.MAX_BYTES, trusted="each decides what a pattern matches"
        )

    @staticmethod
    def key(pattern: Any) -> Optional[str]:
        base = pattern_key(pattern)
        if base is None:
            return None
        return hashlib.sha256(f"{_FORMAT}\0{base}\0{workbench_source_hash()}".encode()).hexdigest()[:32]

    def get(self, pattern: Any) -> Optional[fx.Graph]:
        key = self.key(pattern)
        data = self.files.read(key) if key is not None else None
        if data is None:
            return None
        try:
            graph = graph_from_json(json.loads(data))
        except (ValueError, KeyError, TypeError, IndexError, AttributeError, RuntimeError):
            return None  # unreadable or naming an op that is gone: traced again (and rewritten)
        self.files.used(key)  # type: ignore[arg-type]
        return graph

    def put(self, pattern: Any, graph: fx.Graph) -> None:
        key = self.key(pattern)
        if key is None:
            return
        try:
            data = json.dumps(graph_to_json(graph), separators=(",", ":"))
        except _Unstorable:
            return
        self.files.write(key, data.encode())


def graph_to_json(graph: fx.Graph) -> Dict[str, Any]:
    """The structure of a traced pattern graph; raises ``_Unstorable``."""
    nodes = []
    for node in graph.nodes:
        if node.op not in ("placeholder", "call_function", "output"):
            raise _Unstorable(node.op)
        entry: Dict[str, Any] = {"name": node.name, "op": node.op}
        if node.op == "placeholder":
            entry["input"] = node.meta.get("pattern_input")
        elif node.op == "call_function":
            entry["target"] = _target_name(node.target)
        entry["args"] = _encode(node.args)
        entry["kwargs"] = {k: _encode(v) for k, v in node.kwargs.items()}
        nodes.append(entry)
    return {"format": _FORMAT, "nodes": nodes}


def graph_from_json(data: Dict[str, Any]) -> fx.Graph:
    if data.get("format") != _FORMAT:
        raise ValueError("another format")
    graph = fx.Graph()
    env: Dict[str, fx.Node] = {}
    for entry in data["nodes"]:
        args = _decode(entry["args"], env)
        kwargs = {k: _decode(v, env) for k, v in entry["kwargs"].items()}
        if entry["op"] == "placeholder":
            node = graph.placeholder(entry["name"])
            if entry.get("input") is not None:
                node.meta["pattern_input"] = entry["input"]
        elif entry["op"] == "call_function":
            node = graph.create_node("call_function", _target(entry["target"]), tuple(args), kwargs, entry["name"])
        elif entry["op"] == "output":
            node = graph.output(args[0])
        else:
            raise ValueError(f"node op {entry['op']!r}")
        env[entry["name"]] = node
    graph.lint()
    return graph


def _target_name(target: Any) -> str:
    if target is operator.getitem:
        return _GETITEM
    name = op_name(target)
    if name is None:
        raise _Unstorable(repr(target))
    return name


def _target(name: str) -> Any:
    if name == _GETITEM:
        return operator.getitem
    op = op_from_name(name)
    if op is None:
        raise ValueError(f"no op {name}")
    return op


def _encode(x: Any) -> Any:
    if isinstance(x, fx.Node):
        return {"node": x.name}
    if isinstance(x, _SCALARS) and not (isinstance(x, float) and not math.isfinite(x)):
        return x
    if isinstance(x, list):  # fx's immutable_list included
        return {"list": [_encode(y) for y in x]}
    if type(x) is tuple:
        return {"tuple": [_encode(y) for y in x]}
    encoded = encode_leaf(x)
    if encoded is None:
        raise _Unstorable(type(x).__name__)
    return encoded


def _decode(x: Any, env: Dict[str, fx.Node]) -> Any:
    if not isinstance(x, dict):
        return x
    ((kind, value),) = x.items()
    if kind == "node":
        return env[value]
    if kind == "list":
        return [_decode(y, env) for y in value]
    if kind == "tuple":
        return tuple(_decode(y, env) for y in value)
    if kind in LEAF_TAGS:
        return decode_leaf(kind, value)
    raise ValueError(f"unknown value kind {kind!r}")
