"""One snapshot's fx graph as Model Explorer graphs.

Model Explorer draws a node inside nested, collapsible groups named by its ``namespace`` (a path
``a/b/c``). The namespace here is the node's HF module path with the decoder layer kept as one
component: ``model.model.layers.3.self_attn.q_proj`` -> ``layers.3/self_attn/q_proj``, so the top
level shows the embedding, one collapsed box per decoder layer (30 for SmolLM2-135M) and the final
norm / LM head, and opening a layer shows its attention, MLP and norms as groups of their own. Which
layer a node belongs to is ``collapse.assign_layers``'s answer, the one the Graphviz collapsed view
uses: a node a transform made without module metadata inherits the latest layer among its inputs,
and a graph input read by one layer only (its KV-cache pages) sits in that layer.

Each node carries its op, target, output shape/dtype (``f32[s0,s1,576]``), the transform that
created it, the nodes it replaced, its module and class and the source line export recorded.
Node ids are fx node names (unique within a graph), so a ``{node name: value}`` overlay (cost,
anything) paints them directly. A module with several graphs (after a piecewise split) gives one
Model Explorer graph per graph module, ``<label>/g<i>``, matching ``diff.qualified_nodes``'s
``g<i>/name`` ids.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any, Dict, List, Mapping, Optional, Tuple

import torch
import torch.fx as fx

from ...pipeline.graph.utils import graph_modules, op_name
from ...pipeline.snapshot import Snapshot
from ..collapse import LAYER_PATTERN, assign_layers
from ..labels import node_shape
from ..provenance import created_by, module_path, module_type, replaces, short_module, source_location
from .overlays import change_overlay, drift_overlay, value_overlay
from .require import require_model_explorer


@dataclass
class ExplorerGraph:
    """A snapshot converted: its graph collection and the node-data overlays painted on it.

    ``collection`` is a ``model_explorer.graph_builder.GraphCollection`` (``label`` and one ``Graph``
    per graph module); ``overlays`` maps an overlay's name (``changes``, ``numerics drift``, ``cost``)
    to a ``node_data_builder.ModelNodeData`` ({graph id: values by node id})."""

    label: str
    collection: Any
    overlays: Dict[str, Any] = field(default_factory=dict)
    graph_ids: Dict[str, fx.GraphModule] = field(default_factory=dict)  # Model Explorer graph id -> module

    def to_json(self) -> Dict[str, Any]:
        """The graph file Model Explorer's JSON adapter opens: ``{"label", "graphs": [...]}``.

        Written field by field (what ``dataclasses.asdict`` gives, without its recursive deep copy,
        which took half the time of a report's Model Explorer files) and without empty fields."""
        graphs = []
        for g in self.collection.graphs:
            out: Dict[str, Any] = {"id": g.id, "nodes": [_node_json(n) for n in g.nodes]}
            if g.groupNodeAttributes:
                out["groupNodeAttributes"] = g.groupNodeAttributes
            graphs.append(out)
        return {"label": self.collection.label, "graphs": graphs}

    def node_ids(self, graph_id: Optional[str] = None) -> List[str]:
        graphs = self.collection.graphs
        return [n.id for g in graphs if graph_id in (None, g.id) for n in g.nodes]

    def node(self, node_id: str, graph_id: Optional[str] = None) -> Any:
        for g in self.collection.graphs:
            if graph_id in (None, g.id):
                for n in g.nodes:
                    if n.id == node_id:
                        return n
        raise KeyError(f"no node {node_id!r} in {self.label}")

    def namespaces(self) -> List[str]:
        return sorted({n.namespace for g in self.collection.graphs for n in g.nodes})

    def overlay_json(self, name: str) -> str:
        return self.overlays[name].to_json_string()


def _kvs(items: List[Any]) -> List[Dict[str, Any]]:
    return [{"key": kv.key, "value": kv.value} for kv in items]


def _node_json(n: Any) -> Dict[str, Any]:
    out: Dict[str, Any] = {"id": n.id, "label": n.label, "namespace": n.namespace}
    if n.attrs:
        out["attrs"] = _kvs(n.attrs)
    if n.incomingEdges:
        out["incomingEdges"] = [
            {
                "sourceNodeId": e.sourceNodeId,
                "sourceNodeOutputId": e.sourceNodeOutputId,
                "targetNodeInputId": e.targetNodeInputId,
            }
            for e in n.incomingEdges
        ]
    if n.outputsMetadata:
        out["outputsMetadata"] = [{"id": m.id, "attrs": _kvs(m.attrs)} for m in n.outputsMetadata]
    return out


def snapshot_label(snap: Snapshot) -> str:
    return f"{snap.index:02d}_{snap.key}"


def namespace_of(path: Optional[str], layer: Optional[int], pattern: str = LAYER_PATTERN) -> str:
    """Model Explorer namespace of a node with module ``path`` in decoder ``layer`` (see the module
    docstring): ``layers.<k>`` stays one component; a node whose path says nothing about its layer
    (a transform's node without metadata) sits at the top of its layer."""
    short = short_module(path)
    m = re.search(pattern, short) if short else None
    if m is not None and (layer is None or int(m.group(1)) == layer):
        head = short[: m.start()].strip(".")
        word = m.group(0).strip(".")  # "layers.3"
        rest = short[m.end() :].strip(".")
        parts = ([*head.split(".")] if head else []) + [word] + (rest.split(".") if rest else [])
        return "/".join(parts)
    if layer is not None:
        return f"layers.{layer}"
    return short.replace(".", "/")


def node_label(node: fx.Node) -> str:
    """What the box says: the op without namespace and overload (``linear``, ``torch_attention``),
    the graph input's name, the parameter's last two path parts."""
    if node.op in ("call_function", "call_method"):
        name = op_name(node)
        parts = name.split(".")
        if len(parts) >= 3 and parts[0] in ("aten", "workbench", "prims", "_operator"):
            return parts[1]
        return parts[-1] if len(parts) == 2 else name
    if node.op == "get_attr":
        return ".".join(str(node.target).split(".")[-2:])
    if node.op == "placeholder":
        return f"input {node.name}"
    return node.op


def _arg_text(a: Any) -> str:
    if isinstance(a, fx.Node):
        return a.name
    if isinstance(a, (list, tuple)):
        inner = ", ".join(_arg_text(x) for x in a[:6]) + (", ..." if len(a) > 6 else "")
        return f"[{inner}]"
    if isinstance(a, torch.dtype):
        return str(a).replace("torch.", "")
    text = repr(a)
    return text if len(text) <= 60 else text[:57] + "..."


def node_attrs(node: fx.Node, shape: Optional[str] = None) -> List[Tuple[str, str]]:
    """The side panel's key/value rows for ``node`` (empty values left out); ``shape``: its
    ``node_shape`` when the caller has it already (formatting symbolic shapes is not free)."""
    target = op_name(node) if node.op in ("call_function", "call_method", "call_module") else str(node.target)
    shape = shape if shape is not None else node_shape(node)
    rows = [
        ("op", node.op),
        ("target", target),
        ("shape", shape or ("" if node.op == "output" else "?")),
        ("created_by", created_by(node) or ""),
        ("replaces", ", ".join(replaces(node))),
        ("source_module", module_path(node) or ""),
        ("module_type", module_type(node) or ""),
        ("source_line", source_location(node) or ""),
        ("args", ", ".join(_arg_text(a) for a in node.args) if node.op == "call_function" else ""),
    ]
    rows += [(f"kwarg {k}", _arg_text(v)) for k, v in node.kwargs.items()] if node.op == "call_function" else []
    return [(k, v) for k, v in rows if v != ""]


def graph_to_explorer(gm: fx.GraphModule, graph_id: str, pattern: str = LAYER_PATTERN) -> Any:
    """One fx graph as a ``graph_builder.Graph``: nodes with namespaces, attributes, edges."""
    gb = require_model_explorer().graph_builder
    layers = assign_layers(gm, pattern)
    spaces = {n: namespace_of(module_path(n), layers[n], pattern) for n in gm.graph.nodes}
    for node in gm.graph.nodes:
        # a parameter sits with the op that reads it first: a tied embedding owned by lm_head would
        # otherwise pull the embedding's edge up from the bottom of the graph
        if node.op == "get_attr" and node.users:
            spaces[node] = spaces[next(iter(node.users))]
    graph = gb.Graph(id=graph_id, nodes=[])
    for node in gm.graph.nodes:
        shape = node_shape(node)
        me_node = gb.GraphNode(
            id=node.name,
            label=node_label(node),
            namespace=spaces[node],
            attrs=[gb.KeyValue(key=k, value=v) for k, v in node_attrs(node, shape)],
        )
        if shape:  # shown on the node's outgoing edges
            me_node.outputsMetadata.append(gb.MetadataItem(id="0", attrs=[gb.KeyValue(key="shape", value=shape)]))
        for i, src in enumerate(node.all_input_nodes):
            me_node.incomingEdges.append(gb.IncomingEdge(sourceNodeId=src.name, targetNodeInputId=str(i)))
        graph.nodes.append(me_node)
    return graph


def to_model_explorer(
    snapshot: Snapshot,
    previous: Optional[Snapshot] = None,
    overlays: Optional[Mapping[str, Mapping[str, float]]] = None,
    *,
    numerics_by_key: Optional[Mapping[str, Any]] = None,
    label: Optional[str] = None,
    pattern: str = LAYER_PATTERN,
) -> ExplorerGraph:
    """``snapshot``'s graph as Model Explorer graphs, with its node-data overlays.

    * ``changes``: nodes this snapshot's transform added (1), replaced others with (1) or changed
      the op of (2) -- against ``previous`` when given (any earlier snapshot, ``diff_snapshots``'s
      rules), else from the snapshot's own record of the nodes it created;
    * ``numerics drift``: each node painted with the logits ``rmse_ratio`` the numerics probe
      measured right after the transform that created it (``numerics_by_key``: {transform key:
      ``Numerics``}, e.g. every snapshot's; by default this snapshot's own result, on its new
      nodes). The probe is graph-level, so this says which transform's nodes came with which
      drift; nodes of transforms that were not probed get no value;
    * ``overlays``: {overlay name: {node name: value}} painted as given, white to red (the hook the
      cost model uses: ``{"cost": {node name: seconds}}``). A name that is not a node of this graph
      is an error naming it, so a mismatched overlay is not silently half-painted.
    """
    require_model_explorer()
    gb = require_model_explorer().graph_builder
    if snapshot.module is None:
        raise ValueError(f"snapshot {snapshot.key} kept no graph (the stepper ran with snapshots=False)")
    label = re.sub(r"[^A-Za-z0-9_.-]+", "_", label or snapshot_label(snapshot))  # it names the graph file
    gms = graph_modules(snapshot.module)
    ids = {label if len(gms) == 1 else f"{label}/g{i}": gm for i, gm in enumerate(gms)}
    collection = gb.GraphCollection(
        label=label, graphs=[graph_to_explorer(gm, gid, pattern) for gid, gm in ids.items()]
    )
    out = ExplorerGraph(label=label, collection=collection, graph_ids=ids)

    changes = change_overlay(snapshot, previous, list(ids))
    if changes is not None:
        out.overlays["changes"] = changes
        _note_removed(collection, snapshot, previous, ids)
    numerics = dict(numerics_by_key or {})
    if not numerics and snapshot.numerics is not None:
        numerics = {snapshot.key: snapshot.numerics}
    drift = drift_overlay(ids, numerics)
    if drift is not None:
        out.overlays["numerics drift"] = drift
    for name, values in (overlays or {}).items():
        out.overlays[name] = value_overlay(ids, values, name)
    if "changes" in out.overlays:  # the web app shows the overlay loaded last: what this transform did
        out.overlays["changes"] = out.overlays.pop("changes")
    return out


def _note_removed(collection: Any, snapshot: Snapshot, previous: Optional[Snapshot], ids: Dict[str, Any]) -> None:
    """Removed nodes are not in this graph: list them in the group they were in (``replaces`` on the
    new nodes says which ones a fusion took), so a collapsed layer's side panel shows what went."""
    if previous is None or previous.module is None:
        names = list(snapshot.removed_nodes)
        old = {}
    else:
        old = {n.name: n for gm in graph_modules(previous.module) for n in gm.graph.nodes}
        names = [n for n in old if n not in snapshot.node_names]
    if not names or len(ids) != 1:
        return
    prev_layers: Dict[fx.Node, Optional[int]] = {}
    if previous is not None and previous.module is not None:
        for gm in graph_modules(previous.module):
            prev_layers.update(assign_layers(gm))
    by_group: Dict[str, List[str]] = {}
    for name in names:
        node = old.get(name)
        ns = namespace_of(module_path(node), prev_layers.get(node)) if node is not None else ""
        group = ns.split("/")[0] if ns else ""
        by_group.setdefault(group, []).append(name)
    attrs = {}
    for group, gone in by_group.items():
        if group:
            text = ", ".join(gone[:12]) + (f", +{len(gone) - 12}" if len(gone) > 12 else "")
            attrs[group] = {f"removed by {snapshot.key}": text}
    graph = collection.graphs[0]
    graph.groupNodeAttributes = attrs or None


def graphs_json_text(graph: ExplorerGraph) -> str:
    return json.dumps(graph.to_json())
