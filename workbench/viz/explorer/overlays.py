"""Node-data overlays: values painted on Model Explorer's nodes ({graph id: {node id: value}}).

Model Explorer colours a node by its value (a fixed colour per result, or a gradient from the
smallest to the largest value) and sums them per collapsed group, so a closed decoder layer shows
how many of its nodes a transform touched, or how much of the cost it holds.

* ``change_overlay``  -- what a transform did: 1 added (or a replacement that says which nodes it
  replaced: a fused GEMM), 2 op changed in place (a backend swap); -1 removed, painted on the
  previous snapshot's graph in a side-by-side diff (``removed_overlay``);
* ``drift_overlay``   -- the numerics probe's logits ``rmse_ratio`` after the transform that created
  each node;
* ``value_overlay``   -- any ``{node name: value}``: the hook the cost model paints through.
"""

from __future__ import annotations

import math
from typing import Any, Dict, Iterable, List, Mapping, Optional, Sequence

import torch.fx as fx

from ...pipeline.snapshot import Snapshot
from ..provenance import created_by, replaces
from .require import require_model_explorer

ADDED, MODIFIED, REMOVED = 1, 2, -1
CHANGE_COLORS = {ADDED: "#66bb6a", MODIFIED: "#ffa726", REMOVED: "#ef5350"}
GRADIENT = (("#ffffff", 0.0), ("#ffcdd2", 0.5), ("#d32f2f", 1.0))


def _split_qualified(qid: str, graph_ids: Sequence[str]) -> tuple:
    """``g1/add_3`` -> (second graph id, ``add_3``); a plain name belongs to the only graph."""
    if len(graph_ids) > 1 and "/" in qid:
        g, _, name = qid.partition("/")
        return graph_ids[int(g[1:])], name
    return graph_ids[0], qid


def _model_node_data(per_graph: Mapping[str, Mapping[str, Any]], name: str, gradient: bool = False) -> Any:
    ndb = require_model_explorer().node_data_builder
    graphs = {}
    for gid, results in per_graph.items():
        kw: Dict[str, Any] = {}
        if gradient:
            kw["gradient"] = [ndb.GradientItem(stop=stop, bgColor=color) for color, stop in GRADIENT]
        graphs[gid] = ndb.GraphNodeData(results=dict(results), name=name, **kw)
    return ndb.ModelNodeData(graphsData=graphs)


def _changes(snapshot: Snapshot, previous: Optional[Snapshot]) -> Dict[str, int]:
    """Qualified node id -> ADDED / MODIFIED for the nodes new or changed in ``snapshot``."""
    if previous is not None:
        from ..diff import NEW_CHANGES, diff_snapshots

        table = diff_snapshots(previous, snapshot).nodes
        return {
            str(r["name"]): MODIFIED if r["change"] == "modified" else ADDED
            for _, r in table.iterrows()
            if r["change"] in NEW_CHANGES
        }
    if snapshot.index == 0:  # export made every node: nothing stands out
        return {}
    return {name: ADDED for name in snapshot.added_nodes}


def change_overlay(snapshot: Snapshot, previous: Optional[Snapshot], graph_ids: Sequence[str]) -> Optional[Any]:
    """The ``changes`` overlay of ``snapshot`` (see the module docstring); None when nothing changed."""
    changes = _changes(snapshot, previous)
    if not changes:
        return None
    ndb = require_model_explorer().node_data_builder
    per_graph: Dict[str, Dict[str, Any]] = {gid: {} for gid in graph_ids}
    for qid, value in changes.items():
        gid, name = _split_qualified(qid, graph_ids)
        per_graph[gid][name] = ndb.NodeDataResult(value=value, bgColor=CHANGE_COLORS[value])
    return _model_node_data(per_graph, f"changes by {snapshot.key}")


def removed_overlay(previous: Snapshot, snapshot: Snapshot, graph_ids: Sequence[str]) -> Optional[Any]:
    """On ``previous``'s graph: the nodes that are gone in ``snapshot`` (-1, red)."""
    from ..diff import GONE_CHANGES, diff_snapshots

    table = diff_snapshots(previous, snapshot).nodes
    gone = [str(r["name"]) for _, r in table.iterrows() if r["change"] in GONE_CHANGES]
    if not gone:
        return None
    ndb = require_model_explorer().node_data_builder
    per_graph: Dict[str, Dict[str, Any]] = {gid: {} for gid in graph_ids}
    for qid in gone:
        gid, name = _split_qualified(qid, graph_ids)
        per_graph[gid][name] = ndb.NodeDataResult(value=REMOVED, bgColor=CHANGE_COLORS[REMOVED])
    return _model_node_data(per_graph, f"removed by {snapshot.key}")


def drift_overlay(graph_ids: Mapping[str, fx.GraphModule], numerics_by_key: Mapping[str, Any]) -> Optional[Any]:
    """Each node's value: the ``rmse_ratio`` probed after the transform that created it."""
    drift = {k: n.rmse_ratio for k, n in numerics_by_key.items() if n is not None and n.ok and n.rmse_ratio is not None}
    if not drift:
        return None
    per_graph: Dict[str, Dict[str, Any]] = {}
    ndb = require_model_explorer().node_data_builder
    for gid, gm in graph_ids.items():
        per_graph[gid] = {
            n.name: ndb.NodeDataResult(value=float(drift[k])) for n in gm.graph.nodes if (k := created_by(n)) in drift
        }
    if not any(per_graph.values()):
        return None
    return _model_node_data(per_graph, "numerics drift (rmse_ratio)", gradient=True)


def value_overlay(graph_ids: Mapping[str, fx.GraphModule], values: Mapping[str, float], name: str) -> Any:
    """``{node name: value}`` painted white (smallest) to red (largest). Names may be qualified
    (``g1/add_3``) on a multi-graph module. An unknown name or a non-finite value is an error."""
    ids = list(graph_ids)
    known = {gid: {n.name for n in gm.graph.nodes} for gid, gm in graph_ids.items()}
    ndb = require_model_explorer().node_data_builder
    per_graph: Dict[str, Dict[str, Any]] = {gid: {} for gid in ids}
    unknown: List[str] = []
    for qid, value in values.items():
        gid, node = _split_qualified(qid, ids)
        if node not in known[gid]:
            unknown.append(qid)
            continue
        v = float(value)
        if not math.isfinite(v):
            raise ValueError(f"overlay {name!r}: node {qid!r} has a non-finite value {value!r}")
        per_graph[gid][node] = ndb.NodeDataResult(value=v)
    if unknown:
        raise ValueError(f"overlay {name!r}: {len(unknown)} name(s) are not nodes of this graph: {_few(unknown)}")
    return _model_node_data(per_graph, name, gradient=True)


def fused_nodes(nodes: Iterable[fx.Node]) -> List[str]:
    """Names of the nodes that say which nodes they replaced (``wb_replaces``)."""
    return [n.name for n in nodes if replaces(n)]


def _few(names: Sequence[str], n: int = 5) -> str:
    return ", ".join(names[:n]) + (f", +{len(names) - n} more" if len(names) > n else "")
