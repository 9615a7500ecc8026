"""What changed between two snapshots: nodes added, removed, replaced, modified; op-count deltas.

Nodes are matched by identity, not position: ``(graph, node name, wb_created_by)``. The name alone
is not enough, because FX frees the names of erased nodes when a graph is copied, so a later
transform may create a *new* ``add_3``; its ``wb_created_by`` then differs from the old one's. A
node present on both sides whose op changed (a backend swapped in place) is ``modified``.

Change kinds in the table:

* ``added`` -- new node; ``replacement`` -- new node that says (``wb_replaces``) which nodes it
  replaced, e.g. one fused RMSNorm per norm site;
* ``removed`` -- gone; ``replaced`` -- gone and named by a replacement (see ``replaced_by``);
* ``modified`` -- same node, different op.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

import pandas as pd
import torch
import torch.fx as fx

from ..pipeline.graph.utils import graph_modules, op_histogram, op_name
from ..pipeline.snapshot import Snapshot
from .labels import node_shape
from .provenance import created_by, module_path, replaces, source_location

COLUMNS = [
    "change",
    "name",
    "op",
    "target",
    "shape",
    "source_module",
    "created_by",
    "replaces",
    "replaced_by",
    "source_line",
]
NEW_CHANGES = ("added", "replacement", "modified")
GONE_CHANGES = ("removed", "replaced")

Key = Tuple[str, Optional[str]]


def qualified_nodes(mod: torch.nn.Module) -> Dict[str, fx.Node]:
    """Every node of every graph in ``mod`` by a unique id (the name; ``g<i>/name`` for several)."""
    gms = graph_modules(mod)
    out: Dict[str, fx.Node] = {}
    for i, gm in enumerate(gms):
        prefix = f"g{i}/" if len(gms) > 1 else ""
        for node in gm.graph.nodes:
            out[prefix + node.name] = node
    return out


def node_key(qid: str, node: fx.Node) -> Key:
    return (qid, created_by(node))


def target_text(node: fx.Node) -> str:
    if node.op in ("call_function", "call_method", "call_module"):
        return op_name(node)
    return str(node.target)


def _row(change: str, qid: str, node: fx.Node, replaced_by: str = "") -> Dict[str, object]:
    return {
        "change": change,
        "name": qid,
        "op": node.op,
        "target": target_text(node),
        "shape": node_shape(node) or ("" if node.op == "output" else "?"),
        "source_module": module_path(node) or "",
        "created_by": created_by(node) or "",
        "replaces": ", ".join(replaces(node)),
        "replaced_by": replaced_by,
        "source_line": source_location(node) or "",
    }


@dataclass(frozen=True)
class GraphDiff:
    """The node table and op-count deltas between two graphs, plus the graphs themselves."""

    before_label: str
    after_label: str
    nodes: pd.DataFrame  # one row per changed node, COLUMNS
    op_delta: pd.DataFrame  # op, before, after, delta (only ops whose count changed)
    before: torch.nn.Module
    after: torch.nn.Module

    def names(self, *changes: str) -> List[str]:
        """Node ids whose change is one of ``changes`` (all changed nodes if none given)."""
        df = self.nodes if not changes else self.nodes[self.nodes["change"].isin(changes)]
        return list(df["name"])

    @property
    def empty(self) -> bool:
        return self.nodes.empty

    def summary(self) -> str:
        counts = self.nodes["change"].value_counts().to_dict()
        parts = [
            f"{counts[c]} {c}" for c in ("added", "replacement", "modified", "replaced", "removed") if counts.get(c)
        ]
        return f"{self.before_label} -> {self.after_label}: " + (", ".join(parts) or "no graph changes")

    def _repr_html_(self) -> str:
        return f"<p><b>{self.summary()}</b></p>" + self.op_delta.to_html(index=False) + self.nodes.to_html(index=False)


def op_count_delta(before: Dict[str, int], after: Dict[str, int]) -> pd.DataFrame:
    """Per-op counts before/after and their difference, only for ops whose count changed."""
    rows = [
        {
            "op": op,
            "before": before.get(op, 0),
            "after": after.get(op, 0),
            "delta": after.get(op, 0) - before.get(op, 0),
        }
        for op in sorted(set(before) | set(after))
        if before.get(op, 0) != after.get(op, 0)
    ]
    df = pd.DataFrame(rows, columns=["op", "before", "after", "delta"])
    return df.sort_values(
        ["delta", "op"], key=lambda s: s.abs() if s.name == "delta" else s, ascending=[False, True]
    ).reset_index(drop=True)


def diff_graphs(
    before: torch.nn.Module,
    after: torch.nn.Module,
    *,
    before_label: str = "before",
    after_label: str = "after",
    before_hist: Optional[Dict[str, int]] = None,
    after_hist: Optional[Dict[str, int]] = None,
) -> GraphDiff:
    """Diff two graph modules (see the module docstring for the change kinds)."""
    old, new = qualified_nodes(before), qualified_nodes(after)
    old_keys = {node_key(q, n): q for q, n in old.items()}
    new_keys = {node_key(q, n): q for q, n in new.items()}
    replaced_by: Dict[str, str] = {}
    for key, q in new_keys.items():
        if key not in old_keys:
            prefix = q.rpartition("/")[0] + "/" if "/" in q else ""
            for name in replaces(new[q]):
                replaced_by.setdefault(prefix + name, q)

    gone, came = [], []
    for key, q in old_keys.items():
        if key not in new_keys:
            by = replaced_by.get(q, "")
            gone.append(_row("replaced" if by else "removed", q, old[q], by))
    for key, q in new_keys.items():
        node = new[q]
        if key not in old_keys:
            came.append(_row("replacement" if replaces(node) else "added", q, node))
        elif op_name(old[old_keys[key]]) != op_name(node):
            came.append(_row("modified", q, node))
    table = pd.DataFrame(gone + came, columns=COLUMNS)
    delta = op_count_delta(
        before_hist if before_hist is not None else op_histogram(before),
        after_hist if after_hist is not None else op_histogram(after),
    )
    return GraphDiff(before_label, after_label, table, delta, before, after)


def diff_snapshots(before: Snapshot, after: Snapshot) -> GraphDiff:
    """Diff the graphs of two snapshots (any two, not only neighbours)."""
    for snap in (before, after):
        if snap.module is None:
            raise ValueError(f"snapshot {snap.key} kept no graph (stepper ran with snapshots=False)")
    assert before.module is not None and after.module is not None  # checked above
    return diff_graphs(
        before.module,
        after.module,
        before_label=f"#{before.index:02d} {before.key}",
        after_label=f"#{after.index:02d} {after.key}",
        before_hist=before.op_histogram,
        after_hist=after.op_histogram,
    )
