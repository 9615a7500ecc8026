"""How a node looks: its kind, its colour, its graphviz attributes.

Op colours come from a stable hash of the op name (md5, not Python's salted ``hash``), so the same
op has the same colour in every snapshot, every process and every report: two renders of
consecutive snapshots can be compared by eye. Canonical ``workbench`` ops, backend ops
(``triton_*``, ``flashinfer_*``) and cached-attention ops get fixed colours of their own so that
the pipeline's progress -- more canonical, then backend, then cached ops -- shows at a glance.
"""

from __future__ import annotations

import colorsys
import hashlib
from typing import Dict

import torch.fx as fx

from ..pipeline.graph.utils import op_name

CANONICAL_NAMESPACE = "workbench"
BACKEND_PREFIXES = ("triton_", "flashinfer_")

# kind -> (fillcolor, shape). call_function colours are hashed per op instead.
KIND_STYLE: Dict[str, Dict[str, str]] = {
    "placeholder": {"fillcolor": "#a5d6a7", "shape": "invhouse"},
    "get_attr": {"fillcolor": "#eceff1", "shape": "note"},
    "output": {"fillcolor": "#ef9a9a", "shape": "house"},
    "canonical": {"fillcolor": "#ffca28", "shape": "box", "penwidth": "2", "color": "#e65100"},
    "backend": {"fillcolor": "#ba68c8", "shape": "box", "penwidth": "2", "color": "#4a148c"},
    "cached": {"fillcolor": "#29b6f6", "shape": "box", "penwidth": "2", "color": "#01579b"},
    "call_function": {"shape": "box"},
    "call_method": {"shape": "box"},
    "call_module": {"shape": "box3d"},
    "group": {"fillcolor": "#fff8e1", "shape": "box3d", "penwidth": "2", "color": "#795548"},
}

# Diff marks, layered on top of the kind style.
ADDED_STYLE = {"color": "#2e7d32", "penwidth": "4"}
MODIFIED_STYLE = {"color": "#ef6c00", "penwidth": "4"}
GHOST_STYLE = {"style": "dashed", "color": "#9e9e9e", "fontcolor": "#9e9e9e", "fillcolor": "#ffffff", "shape": "box"}
MISSING_META_STYLE = {"style": "filled,dashed", "color": "#d32f2f"}


def stable_hash(text: str) -> int:
    return int.from_bytes(hashlib.md5(text.encode()).digest()[:4], "little")


def base_op(op: str) -> str:
    """Op name without the overload: ``aten.add.Tensor`` -> ``aten.add``."""
    return op.rsplit(".", 1)[0] if op.count(".") >= 2 else op


def op_color(op: str) -> str:
    """A light fill colour for ``op``, identical across runs (hue from md5 of the op name).

    The overload suffix is dropped first, so ``aten.add.Tensor`` and ``aten.add.Scalar`` match.
    """
    h = stable_hash(base_op(op))
    hue = (h % 360) / 360.0
    sat = 0.35 + ((h >> 9) % 20) / 100.0
    r, g, b = colorsys.hls_to_rgb(hue, 0.82, sat)
    return f"#{int(r * 255):02x}{int(g * 255):02x}{int(b * 255):02x}"


def op_kind(op: str) -> str:
    """``canonical`` / ``backend`` / ``cached`` for workbench ops, else ``call_function``."""
    namespace, _, rest = op.partition(".")
    if namespace != CANONICAL_NAMESPACE:
        return "call_function"
    name = rest.split(".", 1)[0]
    if "cached" in name:
        return "cached"
    if name.startswith(BACKEND_PREFIXES):
        return "backend"
    return "canonical"


def node_kind(node: fx.Node) -> str:
    if node.op == "call_function":
        return op_kind(op_name(node))
    return node.op


# Border of a node the sharding stage cut (node.meta["sharding"] starts with the kind).
SHARD_BORDER = {
    "column": "#1565c0",
    "row": "#2e7d32",
    "column+row": "#00838f",
    "vocab": "#6a1b9a",
    "expert": "#ef6c00",
    "all_reduce": "#c62828",
    "all_gather": "#c62828",
}


def shard_kind(node: fx.Node) -> str:
    """The sharding kind written on ``node`` (``""`` when the sharding stage left it whole)."""
    label = node.meta.get("sharding") or ""
    return label.split(" ", 1)[0]


def node_style(node: fx.Node) -> Dict[str, str]:
    """Graphviz attributes (fill, shape, border) for ``node`` by its kind; nodes the sharding stage
    cut get a thick border in the colour of their split (``SHARD_BORDER``)."""
    kind = node_kind(node)
    attrs = {"style": "filled", **KIND_STYLE.get(kind, {})}
    if "fillcolor" not in attrs:
        attrs["fillcolor"] = op_color(op_name(node))
    border = SHARD_BORDER.get(shard_kind(node))
    if border:
        attrs.update(color=border, penwidth="3", style="filled,bold")
    return attrs
