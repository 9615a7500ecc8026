"""Choosing what to draw: regions of a graph, k-hop neighbourhoods, and the size limit.

``dot`` layout time grows much faster than linearly with the node count, and a 2,000-node flat
graph can take minutes. So a flat render refuses to start above ``DEFAULT_MAX_NODES`` and the
error says how to get a useful picture instead (collapse the layers, open one, or pick a region).
"""

from __future__ import annotations

import difflib
from typing import Iterable, List, Optional, Set

import torch.fx as fx

DEFAULT_MAX_NODES = 400


class GraphTooLargeError(ValueError):
    """A render would exceed the node limit; the message lists the ways to draw less."""


def too_large(num: int, limit: int, what: str = "graph") -> GraphTooLargeError:
    return GraphTooLargeError(
        f"the {what} has {num} nodes, above the flat-render limit of {limit} (dot layout would take "
        f"minutes). Draw less instead:\n"
        f"  - collapsed=True: one box per decoder layer (render_snapshot(snap, collapsed=True));\n"
        f"  - expand=[k]: collapsed, with decoder layer k opened (render_snapshot(snap, expand=[3]));\n"
        f"  - region=[node names] (+ hops=N): only those nodes and their N-hop neighbourhood "
        f"(render_snapshot(snap, region=['linear_3'], hops=2));\n"
        f"  - or raise max_nodes= if you really want the whole flat graph."
    )


def check_size(num: int, limit: Optional[int], what: str = "graph") -> None:
    if limit is not None and num > limit:
        raise too_large(num, limit, what)


# A node used by more than this many others (rotary tables, the mask, symbolic sizes) is a hub:
# it joins a neighbourhood but is not expanded through, or two hops would reach every layer.
HUB_FANOUT = 8


def is_hub(node: fx.Node) -> bool:
    return node.op in ("placeholder", "get_attr") or len(node.users) > HUB_FANOUT


def neighbourhood(seeds: Iterable[fx.Node], hops: int) -> Set[fx.Node]:
    """``seeds`` plus every node within ``hops`` edges of them (inputs and users alike).

    Hubs (``is_hub``) are included when reached but the walk does not continue through them.
    """
    seeds = set(seeds)
    region = set(seeds)
    frontier = set(region)
    for _ in range(max(hops, 0)):
        nxt: Set[fx.Node] = set()
        for node in frontier:
            if is_hub(node) and node not in seeds:
                continue
            nxt.update(node.all_input_nodes)
            nxt.update(node.users)
        frontier = nxt - region
        if not frontier:
            break
        region |= frontier
    return region


def select_region(gm: fx.GraphModule, names: Iterable[str], hops: int = 0) -> Set[fx.Node]:
    """The nodes called ``names`` and their ``hops`` neighbourhood; unknown names raise with hints."""
    by_name = {n.name: n for n in gm.graph.nodes}
    names = [names] if isinstance(names, str) else list(names)
    missing: List[str] = [n for n in names if n not in by_name]
    if missing:
        hints = {m: difflib.get_close_matches(m, by_name, n=3) for m in missing}
        text = "; ".join(f"{m!r} (close: {', '.join(h) or 'none'})" for m, h in hints.items())
        raise KeyError(f"region names not in the graph: {text}")
    return neighbourhood((by_name[n] for n in names), hops)
