"""Text on the picture: node labels, edge labels, shape strings and edge widths.

Labels are DOT escape strings: lines joined with ``\\n`` and user text with its backslashes
doubled, so a stack-trace path can never turn into a graphviz escape. Shapes come from the fake
value export recorded in ``node.meta['val']``; a node without one is *marked* (``?``) rather than
guessed, because a missing shape after a transform usually means the transform forgot to
propagate metadata, which is exactly what a user looking at the graph wants to notice.
"""

from __future__ import annotations

import math
from typing import Any, Dict, Iterable, List, Optional

import torch
import torch.fx as fx

from ..pipeline.graph.utils import op_name
from .provenance import provenance_lines

MISSING = "?"
_DTYPE_SHORT = {
    torch.float32: "f32",
    torch.float16: "f16",
    torch.bfloat16: "bf16",
    torch.float64: "f64",
    torch.int64: "i64",
    torch.int32: "i32",
    torch.int16: "i16",
    torch.int8: "i8",
    torch.uint8: "u8",
    torch.bool: "b8",
}
# Used for the edge width only, when a symbolic dim carries no example value.
_UNKNOWN_DIM_HINT = 16


def esc(text: str) -> str:
    """Make arbitrary text safe inside a DOT escString (backslashes are escapes there)."""
    return str(text).replace("\\", "\\\\")


def join_lines(lines: Iterable[str]) -> str:
    return "\\n".join(esc(line) for line in lines if line)


def dtype_short(dtype: torch.dtype) -> str:
    return _DTYPE_SHORT.get(dtype, str(dtype).replace("torch.", ""))


def format_value(val: Any) -> Optional[str]:
    """``f32[s0,s1,64]`` for a tensor, ``sym s1`` for a SymInt, tuples element-wise; None if unknown."""
    if isinstance(val, torch.Tensor):
        return f"{dtype_short(val.dtype)}[{','.join(str(d) for d in val.shape)}]"
    if isinstance(val, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        return f"sym {val}"
    if isinstance(val, (int, float, bool)):
        return f"{type(val).__name__} {val}"
    if isinstance(val, (list, tuple)) and val:
        parts = [format_value(v) or MISSING for v in val[:3]]
        more = f",+{len(val) - 3}" if len(val) > 3 else ""
        return f"({', '.join(parts)}{more})"
    return None


def node_shape(node: fx.Node) -> Optional[str]:
    """Shape/dtype string of ``node``'s output, None when the node has no metadata for it."""
    return format_value(node.meta.get("val"))


def has_shape_meta(node: fx.Node) -> bool:
    """Output nodes carry no value of their own and are never flagged."""
    return node.op == "output" or node_shape(node) is not None


def _dim_hint(d: Any) -> int:
    if isinstance(d, int):
        return d
    hint = getattr(getattr(d, "node", None), "hint", None)
    try:
        return int(hint) if hint is not None else _UNKNOWN_DIM_HINT
    except (TypeError, ValueError):
        return _UNKNOWN_DIM_HINT


def numel_hint(val: Any) -> int:
    """Number of elements of a (fake) value, symbolic dims at their example size."""
    if isinstance(val, torch.Tensor):
        return math.prod(_dim_hint(d) for d in val.shape)
    if isinstance(val, (list, tuple)):
        return sum(numel_hint(v) for v in val)
    return 1


def penwidth(numel: int) -> str:
    """Edge pen width on a log scale: 1 for a scalar, about 1 more per decade of elements."""
    return f"{1.0 + 0.6 * math.log10(max(numel, 1)):.2f}"


def short_op(node: fx.Node) -> str:
    """Op name for a label: overload kept (``aten.linear.default``); placeholders by their role."""
    if node.op == "placeholder":
        return "input"
    if node.op == "get_attr":
        return "param"
    return op_name(node)


def node_label(node: fx.Node, show_provenance: bool = False, prefix: str = "") -> str:
    """Name, op and output shape (``?`` when missing), plus provenance lines on demand."""
    lines: List[str] = [prefix + node.name]
    if node.op == "get_attr":
        lines.append(str(node.target))
    elif node.op != "output":
        lines.append(short_op(node))
    if node.op != "output":
        lines.append(node_shape(node) or MISSING)
    if node.meta.get("sharding"):  # what this rank holds (sharding_transform_executor)
        lines.append("shard: " + node.meta["sharding"])
    if show_provenance:
        lines.extend(provenance_lines(node))
    return join_lines(lines)


def node_tooltip(node: fx.Node) -> str:
    """Hover text: op, shape and provenance (always, even when not in the label)."""
    return join_lines(
        [f"{node.name}: {op_name(node)}", node_shape(node) or "no shape metadata", *provenance_lines(node)]
    )


def edge_attrs(src: fx.Node) -> Dict[str, str]:
    """Label (the tensor flowing) and width (log of its element count) for an edge out of ``src``."""
    val = src.meta.get("val")
    text = format_value(val)
    return {"label": esc(text) if text else "", "penwidth": penwidth(numel_hint(val))}
