"""The picture of a diff: the later graph, new nodes highlighted, removed ones as grey ghosts.

Ghosts are drawn from the earlier graph with their old edges to whatever still exists, and a
dotted edge points from each replaced node to its replacement. On a large graph only the changed
neighbourhood is drawn: the changed nodes, the surviving nodes that touched a removed one, and
everything within ``hops`` edges of those.
"""

from __future__ import annotations

from typing import Dict, Optional, Set

import graphviz
import torch.fx as fx

from .diff import GONE_CHANGES, GraphDiff, node_key, qualified_nodes
from .draw import add_fx_edge, add_fx_node, new_digraph
from .select import DEFAULT_MAX_NODES, check_size, neighbourhood

# Below this many nodes (later graph + ghosts) the whole graph is drawn, not a neighbourhood.
FULL_GRAPH_BELOW = 120


def ghost_id(qid: str) -> str:
    return f"{qid} (removed)"


def render_diff(
    diff: GraphDiff,
    *,
    hops: int = 2,
    full_below: int = FULL_GRAPH_BELOW,
    max_nodes: Optional[int] = DEFAULT_MAX_NODES,
    show_provenance: bool = False,
) -> graphviz.Digraph:
    """A Digraph of ``diff.after`` with the changes marked (see the module docstring)."""
    old, new = qualified_nodes(diff.before), qualified_nodes(diff.after)
    new_by_key = {node_key(q, n): q for q, n in new.items()}
    table = diff.nodes
    marks: Dict[str, str] = {
        name: ("modified" if change == "modified" else "added")
        for name, change in zip(table["name"], table["change"])
        if change not in GONE_CHANGES
    }
    gone = table[table["change"].isin(GONE_CHANGES)]
    ghosts = {name: old[name] for name in gone["name"]}

    def survivor(node_qid: str) -> Optional[str]:
        """The later graph's id of an earlier-graph node, if that node still exists."""
        return new_by_key.get(node_key(node_qid, old[node_qid]))

    old_qid = {n: q for q, n in old.items()}
    if len(new) + len(ghosts) <= full_below:
        shown: Set[fx.Node] = set(new.values())
    else:
        seeds = {new[q] for q in marks}
        for ghost in ghosts.values():
            for other in [*ghost.all_input_nodes, *ghost.users]:
                q = survivor(old_qid[other])
                if q is not None:
                    seeds.add(new[q])
        shown = neighbourhood(seeds, hops)
    check_size(len(shown) + len(ghosts), max_nodes, f"diff view ({hops} hops)")

    dot = new_digraph(diff.summary())
    new_qid = {n: q for q, n in new.items()}
    ordered = [n for n in new.values() if n in shown]
    for node in ordered:
        add_fx_node(dot, node, new_qid[node], show_provenance=show_provenance, mark=marks.get(new_qid[node]))
    for node in ordered:
        for src in node.all_input_nodes:
            if src in shown:
                add_fx_edge(dot, src, new_qid[src], new_qid[node])
    replaced_by = dict(zip(gone["name"], gone["replaced_by"]))
    _add_ghosts(dot, ghosts, replaced_by, old_qid, survivor, {new_qid[n] for n in shown}, show_provenance)
    return dot


def _add_ghosts(dot, ghosts, replaced_by, old_qid, survivor, shown_ids, show_provenance) -> None:
    for qid, node in ghosts.items():
        add_fx_node(dot, node, ghost_id(qid), show_provenance=show_provenance, mark="removed")
    for qid, node in ghosts.items():
        for src in node.all_input_nodes:
            sq = old_qid[src]
            src_id = ghost_id(sq) if sq in ghosts else survivor(sq)
            if src_id is not None and (sq in ghosts or src_id in shown_ids):
                add_fx_edge(dot, src, src_id, ghost_id(qid), ghost=True)
        for user in node.users:
            uq = old_qid[user]
            if uq in ghosts:
                continue  # drawn as that ghost's input edge
            dst = survivor(uq)
            if dst is not None and dst in shown_ids:
                add_fx_edge(dot, node, ghost_id(qid), dst, ghost=True)
    last_replaced: Dict[str, str] = {}  # replacement -> the last node (graph order) it replaced
    for qid in ghosts:
        if replaced_by.get(qid):
            last_replaced[replaced_by[qid]] = qid
    for target, qid in last_replaced.items():
        if target in shown_ids:
            dot.edge(
                ghost_id(qid),
                target,
                label="replaced by",
                style="dotted",
                color="#2e7d32",
                fontcolor="#2e7d32",
                constraint="false",
            )
