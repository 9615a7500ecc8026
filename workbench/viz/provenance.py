"""Provenance of graph nodes: which transform made a node, what it replaced, where it came from.

Everything here only *reads* ``node.meta``. The pipeline writes ``wb_created_by`` on every node
when a snapshot is recorded (export stamps the original nodes ``export_to_gm``), transforms that
rewrite a subgraph may leave ``wb_replaces``, and ``torch.export`` keeps ``nn_module_stack`` (the
HF module path) and ``stack_trace`` (the Python source line). Nodes that a transform created without
copying the export metadata have no module stack; ``module_path`` then falls back to what the
node's parameters say, so such nodes still land in the right decoder layer.
"""

from __future__ import annotations

import re
from typing import Any, Dict, List, Optional, Tuple

import torch.fx as fx

from ..pipeline.snapshot import PROVENANCE_KEY, REPLACES_KEY

# torch.export's own entry for nodes outside any module; not a real module path.
_EMPTY_STACK_MARKER = "_empty_nn_module_stack_from_metadata_hook"
_FRAME_RE = re.compile(r'File "([^"]+)", line (\d+), in (\S+)')


def created_by(node: fx.Node) -> Optional[str]:
    """Key of the transform that created ``node`` (None on a graph the pipeline never saw)."""
    return node.meta.get(PROVENANCE_KEY)


def replaces(node: fx.Node) -> List[str]:
    """Names of the nodes (of the previous graph) that ``node`` replaced, if the transform said."""
    value = node.meta.get(REPLACES_KEY) or []
    if isinstance(value, str):
        return [value]
    return [str(v) for v in value]


def module_stack(node: fx.Node) -> List[Tuple[str, str]]:
    """``[(module_path, module_type), ...]`` outermost first, as export recorded it."""
    stack = node.meta.get("nn_module_stack") or {}
    out = []
    for value in stack.values():
        if isinstance(value, tuple) and len(value) == 2:
            path, typ = value
            if path == _EMPTY_STACK_MARKER:
                continue
            out.append((str(path), typ if isinstance(typ, str) else getattr(typ, "__qualname__", str(typ))))
    return out


def module_path(node: fx.Node) -> Optional[str]:
    """The innermost HF module path of ``node`` (``model.model.layers.3.self_attn``).

    Order of evidence: the node's own module stack; for ``get_attr`` the owner of the attribute;
    for a node without a stack (made by a transform) the owner of the parameters it reads, e.g. a
    fused RMSNorm reading ``...layers.3.input_layernorm.weight``. None when nothing says.
    """
    stack = module_stack(node)
    if stack:
        return stack[-1][0]
    if node.op == "get_attr":
        return str(node.target).rpartition(".")[0]
    owners = [str(a.target).rpartition(".")[0] for a in node.all_input_nodes if a.op == "get_attr"]
    return owners[0] if owners else None


def module_type(node: fx.Node) -> Optional[str]:
    """Class name of the innermost module (``LlamaRMSNorm``), when recorded."""
    stack = module_stack(node)
    return stack[-1][1].rpartition(".")[2] if stack else None


def stack_trace(node: fx.Node) -> Optional[str]:
    return node.meta.get("stack_trace") or None


def source_location(node: fx.Node) -> Optional[str]:
    """The innermost frame of the stack trace as ``file.py:123 in fn``."""
    trace = stack_trace(node)
    if not trace:
        return None
    frames = _FRAME_RE.findall(trace)
    if not frames:
        return None
    path, line, fn = frames[-1]
    return f"{path.rsplit('/', 1)[-1]}:{line} in {fn}"


def short_module(path: Optional[str]) -> str:
    """Module path without the wrapper prefixes (``model.model.layers.3.mlp`` -> ``layers.3.mlp``)."""
    if not path:
        return ""
    parts = path.split(".")
    while len(parts) > 1 and parts[0] == "model":
        parts = parts[1:]
    return ".".join(parts)


def provenance(node: fx.Node) -> Dict[str, Any]:
    """Everything known about where ``node`` came from, as one flat dict (for tables)."""
    return {
        "created_by": created_by(node),
        "replaces": replaces(node),
        "source_module": module_path(node),
        "module_type": module_type(node),
        "source_line": source_location(node),
    }


def provenance_lines(node: fx.Node) -> List[str]:
    """Short human lines for labels and tooltips: ``by ...``, ``in ...``, ``replaces ...``, ``at ...``."""
    lines = []
    if created_by(node):
        lines.append(f"by {created_by(node)}")
    mod = short_module(module_path(node))
    if mod:
        lines.append(f"in {mod}")
    rep = replaces(node)
    if rep:
        shown = ", ".join(rep[:4]) + (f", +{len(rep) - 4}" if len(rep) > 4 else "")
        lines.append(f"replaces {shown}")
    loc = source_location(node)
    if loc:
        lines.append(f"at {loc}")
    return lines
