"""Pictures of the sharding stage: one sharded layer of a rank's graph, and the plan as a table.

The plan (``ctx.sharding``, kept in every snapshot's context from ``detect_sharding`` on) names
the nodes of each region; the render draws one layer's regions flat -- projections, the per-head
ops between them, the attention or MLP op and the collectives inserted after them -- with the
split of every cut node on its label and border (``style.SHARD_BORDER``).
"""

from __future__ import annotations

from typing import Any, List, Optional

import graphviz

from ..pipeline.snapshot import Snapshot
from .render import render_graph


def plan_of(snap: Snapshot) -> Any:
    """The sharding plan recorded with ``snap`` (None when the run was not sharded)."""
    return getattr(snap.context, "sharding", None) if snap.context is not None else None


def sharded_layer_nodes(plan: Any, layer: Optional[int] = None) -> List[str]:
    """Names of the nodes of ``layer``'s sharded regions (default: the first layer with any)."""
    regions = [r for r in plan.sharded if r.layer is not None]
    if not regions:
        return []
    layer = regions[0].layer if layer is None else layer
    names: List[str] = []
    for r in regions:
        if r.layer == layer:
            names += list(r.nodes)
            if r.collective is not None:
                names.append(r.collective[0])
    return names


def render_sharded_layer(snap: Snapshot, layer: Optional[int] = None, hops: int = 1) -> graphviz.Digraph:
    """One layer of ``snap``'s graph after ``sharding_transform_executor``: its cut nodes with what
    this rank holds, and the all-reduce after each row-parallel op (``hops`` of context)."""
    plan = plan_of(snap)
    if plan is None or not plan.applied:
        raise ValueError(
            f"snapshot {snap.key} holds no applied sharding plan: render the snapshot of "
            "sharding_transform_executor (or a later one) of a sharded run"
        )
    if layer is None:
        layer = next((r.layer for r in plan.sharded if r.layer is not None), None)
    names = set(sharded_layer_nodes(plan, layer))
    if not names:
        raise ValueError("the plan shards no layer (only the LM head, or nothing): nothing to draw")
    assert snap.graph is not None  # a snapshot with an applied plan kept its graph
    graph_names = {n.name for n in snap.graph.nodes}
    region = [n for n in names if n in graph_names]
    title = f"rank {plan.rank} of {plan.world_size}: layer {layer} after {snap.key}"
    return render_graph(snap.module, region=region, hops=hops, title=title)


__all__ = ["plan_of", "render_sharded_layer", "sharded_layer_nodes"]
