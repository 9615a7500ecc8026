"""Drawing primitives shared by every view: a styled Digraph, one fx node, one fx edge.

The flat, collapsed and diff views differ only in *which* nodes they draw and how they group them;
how a node or an edge looks is decided here once, so the same node looks the same in every view.
A node id in the DOT source is the fx node name (plus a per-graph prefix when a module holds
several graphs), which makes SVG ``<title>`` elements searchable by node name.
"""

from __future__ import annotations

from typing import Dict, Iterable, Optional

import graphviz
import torch.fx as fx

from .labels import edge_attrs, esc, has_shape_meta, node_label, node_tooltip
from .style import ADDED_STYLE, GHOST_STYLE, MISSING_META_STYLE, MODIFIED_STYLE, node_style

MARK_STYLES = {"added": ADDED_STYLE, "modified": MODIFIED_STYLE}
MARK_PREFIX: Dict[Optional[str], str] = {"added": "+ ", "modified": "~ ", "removed": "- "}


def new_digraph(title: Optional[str] = None, name: str = "graph") -> graphviz.Digraph:
    dot = graphviz.Digraph(name=name, format="svg", engine="dot")
    dot.attr(
        "graph",
        rankdir="TB",
        fontname="Helvetica",
        fontsize="11",
        nodesep="0.2",
        ranksep="0.3",
        labelloc="t",
        labeljust="l",
        newrank="true",
    )
    dot.attr("node", fontname="Helvetica", fontsize="9", margin="0.08,0.03", height="0.3")
    dot.attr("edge", fontname="Helvetica", fontsize="7", fontcolor="#616161", arrowsize="0.5", color="#546e7a")
    if title:
        dot.attr("graph", label=esc(title))
    return dot


def add_fx_node(
    dot: graphviz.Digraph, node: fx.Node, nid: str, *, show_provenance: bool = False, mark: Optional[str] = None
) -> None:
    """One fx node: kind style, ``?`` + dashed border when shape metadata is missing, diff mark."""
    attrs: Dict[str, str] = dict(node_style(node))
    if not has_shape_meta(node):
        attrs.update(MISSING_META_STYLE)
    if mark == "removed":
        attrs.update(GHOST_STYLE)
    elif mark in MARK_STYLES:
        attrs.update(MARK_STYLES[mark])
    label = node_label(node, show_provenance, prefix=MARK_PREFIX.get(mark, ""))
    dot.node(nid, label=label, tooltip=node_tooltip(node), **attrs)


def add_fx_edge(dot: graphviz.Digraph, src: fx.Node, src_id: str, dst_id: str, *, ghost: bool = False) -> None:
    attrs = edge_attrs(src)
    if ghost:
        attrs.update(style="dashed", color="#bdbdbd")
    dot.edge(src_id, dst_id, **attrs)


def add_flat(
    dot: graphviz.Digraph,
    nodes: Iterable[fx.Node],
    *,
    prefix: str = "",
    show_provenance: bool = False,
    marks: Optional[Dict[str, str]] = None,
) -> None:
    """Draw ``nodes`` one box each, with the edges among them (in graph order)."""
    marks = marks or {}
    drawn = list(nodes)
    members = set(drawn)
    for node in drawn:
        add_fx_node(dot, node, prefix + node.name, show_provenance=show_provenance, mark=marks.get(node.name))
    for node in drawn:
        for src in node.all_input_nodes:
            if src in members:
                add_fx_edge(dot, src, prefix + src.name, prefix + node.name)
