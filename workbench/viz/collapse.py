"""The collapsed view of an LLM-sized graph: one box per decoder layer.

A node belongs to decoder layer ``k`` when its module path (``nn_module_stack``, or the owner of
the parameter it reads, see ``provenance.module_path``) contains ``layers.<k>``. A node with no
module information at all -- made by a transform that did not copy export's metadata -- inherits
the latest layer among its inputs, since a node cannot run before the layer that produced its
input. Layers listed in ``expand`` are drawn node by node inside a cluster (with one sub-cluster
per child module: attention, MLP, norms), so canonical ops show as the single boxes they are;
the others become one box summarising their ops. A graph input read by one layer only (its KV-cache
pages) belongs to that layer: listed in its box, drawn inside its cluster when expanded. Nodes
outside every layer (embedding, rotary tables, mask, final norm, LM head) are always drawn
individually.
"""

from __future__ import annotations

import collections
import re
from dataclasses import dataclass, field
from typing import Dict, Iterable, List, Optional, Sequence, Tuple

import graphviz
import torch.fx as fx

from ..pipeline.graph.utils import op_name
from .draw import MARK_STYLES, add_fx_edge, add_fx_node
from .labels import esc, format_value, join_lines, numel_hint, penwidth
from .provenance import module_path, module_stack
from .select import DEFAULT_MAX_NODES, check_size
from .style import KIND_STYLE, base_op, op_kind

LAYER_PATTERN = r"(?:^|\.)(?:layers|h|blocks|block)\.(\d+)(?=\.|$)"
SHARED_FANOUT = 3


def layer_of_path(path: Optional[str], pattern: str = LAYER_PATTERN) -> Optional[int]:
    """``model.model.layers.3.mlp`` -> 3 (the outermost layer index in the path), else None."""
    if not path:
        return None
    m = re.search(pattern, path)
    return int(m.group(1)) if m else None


def assign_layers(gm: fx.GraphModule, pattern: str = LAYER_PATTERN) -> Dict[fx.Node, Optional[int]]:
    """Decoder layer of every node (None: outside every layer). See the module docstring.

    A graph input read by one layer only (the KV pages, SSM state of that layer, added by the cache
    stage) belongs to that layer: drawn on its own it would sit in the top rank with an edge down
    to its layer, and 60 of them would widen the picture into a staircase of layer boxes."""
    layers: Dict[fx.Node, Optional[int]] = {}
    for node in gm.graph.nodes:
        path = module_path(node)
        if path is not None or node.op in ("placeholder", "output"):
            layers[node] = layer_of_path(path, pattern)
            continue
        known = [k for a in node.all_input_nodes if (k := layers.get(a)) is not None]
        layers[node] = max(known) if known else None
    for node in gm.graph.nodes:
        if node.op == "placeholder" and layers[node] is None and node.users:
            readers = {layers[u] for u in node.users}
            if len(readers) == 1 and None not in readers:
                layers[node] = readers.pop()
    return layers


def _child_module(path: Optional[str], layer: int, pattern: str) -> str:
    """The part of ``path`` right below ``layers.<layer>`` (``self_attn``), '' if none."""
    if not path:
        return ""
    m = re.search(pattern, path)
    if not m or int(m.group(1)) != layer:
        return ""
    rest = path[m.end() :].lstrip(".")
    return rest.split(".", 1)[0]


def _layer_type(nodes: Iterable[fx.Node], layer: int, pattern: str) -> str:
    for node in nodes:
        for path, typ in module_stack(node):
            m = re.search(pattern + "$", path)
            if m and int(m.group(1)) == layer:
                return typ.rpartition(".")[2]
    return ""


def op_summary(nodes: Iterable[fx.Node], max_ops: int = 6) -> List[str]:
    """``2x workbench.torch_rmsnorm``-style counts, canonical/backend ops first, then by count."""
    counts = collections.Counter(base_op(op_name(n)) for n in nodes if n.op == "call_function")
    ranked = sorted(counts.items(), key=lambda kv: (op_kind(kv[0]) == "call_function", -kv[1], kv[0]))
    parts = [f"{c}x {op.replace('aten.', '')}" for op, c in ranked[:max_ops]]
    lines = [", ".join(parts[i : i + 3]) for i in range(0, len(parts), 3)]
    if len(ranked) > max_ops:
        lines.append(f"+{len(ranked) - max_ops} more op kinds")
    return lines


@dataclass
class CollapsedGraph:
    """Which box every node is drawn in, computed once and shared by the draw and the tests."""

    gm: fx.GraphModule
    layers: Dict[fx.Node, Optional[int]]
    expand: Tuple[int, ...]
    prefix: str = ""
    members: Dict[int, List[fx.Node]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for node, layer in self.layers.items():
            if layer is not None:
                self.members.setdefault(layer, []).append(node)

    def box_id(self, node: fx.Node) -> str:
        layer = self.layers[node]
        if layer is None or layer in self.expand:
            return self.prefix + node.name
        return group_id(layer, self.prefix)

    def is_collapsed(self, node: fx.Node) -> bool:
        layer = self.layers[node]
        return layer is not None and layer not in self.expand

    def shared_inputs(self) -> Dict[fx.Node, List[int]]:
        """Drawn nodes feeding more than ``SHARED_FANOUT`` collapsed layers, with those layers.

        Rotary tables, the attention mask and symbolic sizes feed every layer; drawn as edges
        they would be 4-5 long edges per layer, which dominate dot's layout time and hide the
        layer chain. Each gets one edge to its first layer and is listed in the layer boxes.
        """
        fed: Dict[fx.Node, set] = {}
        for node in self.gm.graph.nodes:
            if not self.is_collapsed(node):
                continue
            for src in node.all_input_nodes:
                if not self.is_collapsed(src):
                    fed.setdefault(src, set()).add(self.layers[node])
        return {src: sorted(ls) for src, ls in fed.items() if len(ls) > SHARED_FANOUT}

    @property
    def num_boxes(self) -> int:
        collapsed = [k for k in self.members if k not in self.expand]
        return len(self.layers) - sum(len(self.members[k]) for k in collapsed) + len(collapsed)


def group_id(layer: int, prefix: str = "") -> str:
    """DOT id of a collapsed layer box; fx node names never contain a dot, so no clash."""
    return f"{prefix}layers.{layer}"


def add_collapsed(
    dot: graphviz.Digraph,
    gm: fx.GraphModule,
    *,
    expand: Sequence[int] = (),
    prefix: str = "",
    show_provenance: bool = False,
    marks: Optional[Dict[str, str]] = None,
    max_nodes: Optional[int] = DEFAULT_MAX_NODES,
    pattern: str = LAYER_PATTERN,
) -> CollapsedGraph:
    """Draw ``gm`` collapsed into ``dot``; returns the box assignment."""
    marks = marks or {}
    view = CollapsedGraph(gm, assign_layers(gm, pattern), tuple(expand), prefix)
    unknown = [k for k in view.expand if k not in view.members]
    if unknown:
        raise ValueError(
            f"expand={list(expand)}: no decoder layer {unknown} in this graph; its layers are {sorted(view.members)}"
        )
    check_size(view.num_boxes, max_nodes, "collapsed view")

    shared = view.shared_inputs()
    for layer in sorted(view.members):
        nodes = view.members[layer]
        if layer in view.expand:
            _add_expanded_layer(dot, view, layer, nodes, show_provenance, marks, pattern)
        else:
            side = [src.name for src, layers in shared.items() if layer in layers]
            _add_layer_box(dot, view, layer, nodes, marks, pattern, side)
    for node in gm.graph.nodes:
        if view.layers[node] is None:
            add_fx_node(dot, node, prefix + node.name, show_provenance=show_provenance, mark=marks.get(node.name))
    _add_edges(dot, view, shared)
    return view


def _add_layer_box(
    dot, view: CollapsedGraph, layer: int, nodes: List[fx.Node], marks: Dict[str, str], pattern: str, shared: List[str]
) -> None:
    ops = [n for n in nodes if n.op == "call_function"]
    params = sum(1 for n in nodes if n.op == "get_attr")
    typ = _layer_type(nodes, layer, pattern)
    inputs = [n.name for n in nodes if n.op == "placeholder"]
    lines = [f"layers.{layer}" + (f"  ({typ})" if typ else ""), f"{len(ops)} ops, {params} params", *op_summary(ops)]
    if inputs:  # its own graph inputs (cache pages, state), bundled here; expand the layer to see them
        lines.append(f"inputs: {', '.join(inputs[:4])}" + (f", +{len(inputs) - 4}" if len(inputs) > 4 else ""))
    if shared:
        more = f", +{len(shared) - 4}" if len(shared) > 4 else ""
        lines.append(f"shared inputs: {', '.join(shared[:4])}{more}")
    attrs = {"style": "filled", **KIND_STYLE["group"]}
    changed = collections.Counter(marks[n.name] for n in nodes if n.name in marks)
    if changed:
        lines.append(", ".join(f"{c} {m}" for m, c in sorted(changed.items())))
        attrs.update(MARK_STYLES["added" if "added" in changed else "modified"])
    # one dot "group" for every layer box: dot keeps edges within a group straight, so the layer chain
    # is a single column whatever the side inputs pull on it
    dot.node(
        group_id(layer, view.prefix),
        label=join_lines(lines),
        group=f"{view.prefix}layers",
        tooltip=esc(f"decoder layer {layer}: expand=[{layer}] to open it"),
        **attrs,
    )


def _add_expanded_layer(
    dot,
    view: CollapsedGraph,
    layer: int,
    nodes: List[fx.Node],
    show_provenance: bool,
    marks: Dict[str, str],
    pattern: str,
) -> None:
    typ = _layer_type(nodes, layer, pattern)
    by_child: Dict[str, List[fx.Node]] = collections.defaultdict(list)
    for node in nodes:
        by_child[_child_module(module_path(node), layer, pattern)].append(node)
    with dot.subgraph(name=f"cluster_{view.prefix}layer_{layer}") as sub:
        sub.attr(
            label=esc(f"layers.{layer}" + (f" ({typ})" if typ else "")), style="rounded", color="#795548", penwidth="2"
        )
        for child, child_nodes in by_child.items():
            if not child:
                _draw_nodes(sub, view, child_nodes, show_provenance, marks)
                continue
            with sub.subgraph(name=f"cluster_{view.prefix}layer_{layer}_{child}") as inner:
                inner.attr(label=esc(child), style="dashed,rounded", color="#a1887f")
                _draw_nodes(inner, view, child_nodes, show_provenance, marks)


def _draw_nodes(dot, view: CollapsedGraph, nodes: List[fx.Node], show_provenance: bool, marks: Dict[str, str]) -> None:
    for node in nodes:
        add_fx_node(dot, node, view.prefix + node.name, show_provenance=show_provenance, mark=marks.get(node.name))


def _add_edges(dot, view: CollapsedGraph, shared: Dict[fx.Node, List[int]]) -> None:
    """Node-to-node edges as usual; edges into or out of a collapsed box merged per box pair;
    a shared input gets a single edge, to the first layer it feeds."""
    merged: Dict[Tuple[str, str], List[fx.Node]] = {}
    for node in view.gm.graph.nodes:
        dst = view.box_id(node)
        for src in node.all_input_nodes:
            sid = view.box_id(src)
            if sid == dst:
                continue
            if src in shared and view.is_collapsed(node) and view.layers[node] != shared[src][0]:
                continue
            if sid == view.prefix + src.name and dst == view.prefix + node.name:
                add_fx_edge(dot, src, sid, dst)
            else:
                merged.setdefault((sid, dst), []).append(src)
    for (sid, dst), srcs in merged.items():
        unique = list(dict.fromkeys(srcs))
        biggest = max(unique, key=lambda n: numel_hint(n.meta.get("val")))
        text = format_value(biggest.meta.get("val")) or ""
        if len(unique) > 1:
            text += f" (+{len(unique) - 1})"
        fanout = [len(shared[n]) for n in unique if n in shared]
        if fanout:
            text += f" -> {max(fanout)} layers"
        dot.edge(sid, dst, label=esc(text), penwidth=penwidth(numel_hint(biggest.meta.get("val"))))
