"""Render graphs and snapshots as ``graphviz.Digraph`` objects; write them as SVG separately.

Building the Digraph is pure and cheap (a DOT string); laying it out is ``dot``'s job and happens
only in ``to_svg``/``write_svg`` (or when a notebook displays the object). Three views share the
node/edge look of ``draw.py``:

* flat: every node one box (refused above ``max_nodes``, see ``select.py``);
* collapsed (``collapsed=True`` or ``expand=[k]``): one box per decoder layer (``collapse.py``);
* region (``region=[names]``, ``hops=N``): a flat render of a neighbourhood.

``snapshot_digraph`` is what ``Workbench(debug_visualize_dir=...)`` draws after every step
(``outputs.write_snapshot_render`` writes it as SVG, or as its Graphviz source when ``dot`` is
missing; ``write_snapshot_svg`` as SVG); it never refuses: a graph too large for a flat render is
drawn collapsed.
"""

from __future__ import annotations

from pathlib import Path
from typing import Dict, Iterable, List, Optional, Sequence, Union

import graphviz
import torch
import torch.fx as fx

from ..pipeline.graph.utils import graph_modules
from ..pipeline.snapshot import Snapshot
from .collapse import add_collapsed
from .draw import add_flat, new_digraph
from .select import DEFAULT_MAX_NODES, GraphTooLargeError, check_size, select_region

GraphLike = Union[torch.nn.Module, fx.GraphModule]


def _graphs(mod: GraphLike) -> List[fx.GraphModule]:
    gms = graph_modules(mod)
    if not gms:
        raise TypeError(f"{type(mod).__name__} holds no torch.fx graph to render (not exported yet?)")
    return gms


def render_graph(
    mod: GraphLike,
    *,
    collapsed: bool = False,
    expand: Sequence[int] = (),
    region: Optional[Iterable[str]] = None,
    hops: int = 0,
    max_nodes: Optional[int] = DEFAULT_MAX_NODES,
    show_provenance: bool = False,
    marks: Optional[Dict[str, str]] = None,
    title: Optional[str] = None,
) -> graphviz.Digraph:
    """A Digraph of ``mod``'s graph(s): flat, collapsed (``collapsed``/``expand``) or a region.

    ``marks`` maps node names to ``added``/``modified`` to highlight them (the diff view uses it).
    Raises ``GraphTooLargeError`` (with the ways out) when the view exceeds ``max_nodes``.
    """
    if region is not None and (collapsed or expand):
        raise ValueError("region= draws a flat neighbourhood; do not combine it with collapsed/expand")
    gms = _graphs(mod)
    dot = new_digraph(title)
    draw = dict(
        collapsed=collapsed or bool(expand),
        expand=expand,
        region=region,
        hops=hops,
        max_nodes=max_nodes,
        show_provenance=show_provenance,
        marks=marks,
    )
    if len(gms) == 1:
        _draw_one(dot, gms[0], "", **draw)
        return dot
    for i, gm in enumerate(gms):  # a wrapper holding several graphs: one cluster each
        with dot.subgraph(name=f"cluster_gm{i}") as sub:
            sub.attr(label=f"graph {i}", style="rounded")
            _draw_one(sub, gm, f"g{i}/", **draw)
    return dot


def _draw_one(dot, gm, prefix, *, collapsed, expand, region, hops, max_nodes, show_provenance, marks) -> None:
    if collapsed:
        add_collapsed(
            dot, gm, expand=expand, prefix=prefix, show_provenance=show_provenance, marks=marks, max_nodes=max_nodes
        )
        return
    if region is not None:
        chosen = select_region(gm, region, hops)
        nodes = [n for n in gm.graph.nodes if n in chosen]
        check_size(len(nodes), max_nodes, f"region ({hops} hops)")
    else:
        nodes = list(gm.graph.nodes)
        check_size(len(nodes), max_nodes)
    add_flat(dot, nodes, prefix=prefix, show_provenance=show_provenance, marks=marks)


def snapshot_title(snap: Snapshot) -> str:
    return (
        f"#{snap.index:02d} {snap.key} [{snap.stage.value}] {snap.status}: "
        f"{snap.num_nodes} nodes, {snap.info.num_matches} matches"
    )


def render_snapshot(snap: Snapshot, **kwargs) -> graphviz.Digraph:
    """``render_graph`` of a snapshot's graph, titled with its index, key, stage and status."""
    if snap.module is None:
        raise ValueError(f"snapshot {snap.key} kept no graph (the stepper ran with snapshots=False)")
    kwargs.setdefault("title", snapshot_title(snap))
    return render_graph(snap.module, **kwargs)


class DotMissingError(RuntimeError):
    """The graphviz ``dot`` binary is not on PATH: a picture cannot be laid out here (its source can).

    A class of its own so that the writers that can do without pictures (the report, the
    ``debug_visualize_dir`` renders) tell it from a real failure."""


def to_svg(dot: graphviz.Digraph) -> str:
    """Lay out with ``dot`` and return the SVG text (needs the graphviz system package)."""
    try:
        # quiet: dot's layout-quality warnings ("unable to reclaim box space") are not errors.
        return dot.pipe(format="svg", encoding="utf-8", quiet=True)
    except graphviz.ExecutableNotFound as e:
        raise DotMissingError(
            "the graphviz 'dot' binary is missing: install the Debian package 'graphviz' "
            "(`make system-deps`, or `apt-get install graphviz`)"
        ) from e


def write_svg(dot: graphviz.Digraph, path: Union[str, Path]) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(to_svg(dot), encoding="utf-8")
    return path


def snapshot_svg_name(snap: Snapshot) -> str:
    return f"{snap.index:02d}_{snap.key}.svg"


def snapshot_digraph(snap: Snapshot, **kwargs) -> graphviz.Digraph:
    """``render_snapshot``, but never refused: flat when it fits the limit, otherwise collapsed."""
    try:
        return render_snapshot(snap, **kwargs)
    except GraphTooLargeError:
        if kwargs.get("collapsed") or kwargs.get("expand") or kwargs.get("region") is not None:
            raise
        return render_snapshot(snap, **{**kwargs, "collapsed": True})


def write_snapshot_svg(snap: Snapshot, out_dir: Union[str, Path], **kwargs) -> Path:
    """Write ``out_dir/NN_<key>.svg``: flat when it fits the limit, otherwise collapsed."""
    return write_svg(snapshot_digraph(snap, **kwargs), Path(out_dir) / snapshot_svg_name(snap))
