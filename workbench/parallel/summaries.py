"""What a rank sends back about each snapshot, and the merged view the parent user steps through.

A rank's ``Snapshot`` holds a graph copy sharing the rank's weights: it cannot cross a process
boundary cheaply, and the parent has no use for it (renders are made in the rank, see
``ShardedWorkbench.render``). ``rank_summary`` keeps everything else of the snapshot -- key, stage,
config, info, times, memory before/after, node count, op histogram, added/removed node names,
numerics -- as a ``Snapshot`` whose ``graph_copy`` and ``context`` are None, so the table and chart
code that reads snapshots reads these too.

``ShardedSnapshot`` is one pipeline position over every rank: rank 0's snapshot is the face (the
usual table columns), the others add per-rank memory and node-diff columns. The ranks run the same
pipeline, so key and stage agree; node counts and memory do not once the graph is sharded.
"""

from __future__ import annotations

import dataclasses
import pickle
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple

from ..pipeline.snapshot import Snapshot


def _picklable(value: Any) -> Any:
    """``value`` itself when it pickles, else its repr (a transform may put any object in its details)."""
    try:
        pickle.dumps(value)
        return value
    except Exception:  # noqa: BLE001 - anything unpicklable is shown as text instead
        return repr(value)


def rank_summary(snap: Snapshot) -> Snapshot:
    """``snap`` without its graph copy and context state: picklable, a few KB."""
    details = {k: _picklable(v) for k, v in snap.info.details.items()}
    return dataclasses.replace(
        snap, graph_copy=None, context=None, info=snap.info.model_copy(update={"details": details})
    )


@dataclass(frozen=True)
class ShardedSnapshot:
    """One pipeline position on every rank (``ranks[r]`` is rank r's summary).

    Reads like a ``Snapshot`` (attributes of rank 0), so ``workbench.run_summary.format_table`` and friends
    take it as is; ``per_rank()`` and the ``*_r<N>`` columns of ``row()`` show where ranks differ.
    """

    ranks: Tuple[Snapshot, ...]

    def __post_init__(self):
        keys = {(s.index, s.key) for s in self.ranks}
        if len(keys) != 1:
            raise ValueError(f"the ranks disagree about this pipeline position: {sorted(keys)}")

    # ---- rank 0's face
    def __getattr__(self, name: str) -> Any:
        # Only called for names not defined here: index, key, stage, config, info, times, status,
        # mem_before, mem_after, mem_delta, mem_warning, num_nodes, op_histogram, added_nodes,
        # removed_nodes, node_names, numerics, module (None), graph (None).
        if name == "ranks":  # not set yet (unpickling): no recursion through __getattr__
            raise AttributeError(name)
        return getattr(self.ranks[0], name)

    @property
    def world_size(self) -> int:
        return len(self.ranks)

    def per_rank(self) -> List[Dict[str, Any]]:
        """One dict per rank: nodes, the node diff of this step, memory before/after/delta."""
        return [
            {
                "rank": r,
                "nodes": s.num_nodes,
                "added_nodes": len(s.added_nodes),
                "removed_nodes": len(s.removed_nodes),
                "mem_before_MiB": round(s.mem_before.tracked_bytes / 2**20, 3),
                "mem_after_MiB": round(s.mem_after.tracked_bytes / 2**20, 3),
                "d_mem_MiB": round(s.mem_delta / 2**20, 3),
                "rss_MiB": round(s.mem_after.rss_bytes / 2**20, 1),
            }
            for r, s in enumerate(self.ranks)
        ]

    def row(self, prev_nodes: int) -> Dict[str, Any]:
        """Rank 0's table row plus, per rank r, ``mem_MiB_r<r>`` (tracked bytes after the step),
        ``d_mem_MiB_r<r>`` and ``nodes_r<r>``."""
        row = self.ranks[0].row(prev_nodes)
        for r, s in enumerate(self.ranks):
            row[f"nodes_r{r}"] = s.num_nodes
            row[f"mem_MiB_r{r}"] = round(s.mem_after.tracked_bytes / 2**20, 3)
            row[f"d_mem_MiB_r{r}"] = round(s.mem_delta / 2**20, 3)
        return row


class SnapshotMerger:
    """Collects per-rank summaries as the ranks stream them; a position is complete (and becomes a
    ``ShardedSnapshot``) once every rank has sent its summary for it."""

    def __init__(self, world_size: int):
        self.world_size = world_size
        self._pending: Dict[int, Dict[int, Snapshot]] = {}

    def add(self, rank: int, summary: Snapshot) -> Optional[ShardedSnapshot]:
        # A rank re-running a position (after a rewind) replaces what it sent for it before.
        for index in [i for i in self._pending if i >= summary.index]:
            self._pending[index].pop(rank, None)
        got = self._pending.setdefault(summary.index, {})
        got[rank] = summary
        if len(got) < self.world_size:
            return None
        del self._pending[summary.index]
        return ShardedSnapshot(tuple(got[r] for r in range(self.world_size)))

    def clear(self) -> None:
        self._pending.clear()


def sharded_table(snapshots: Sequence[ShardedSnapshot]):
    """The pipeline table of a sharded run as a pandas DataFrame (rank 0's columns + per-rank ones)."""
    import pandas as pd

    rows, prev = [], 0
    for s in snapshots:
        rows.append(s.row(prev))
        prev = s.num_nodes
    return pd.DataFrame(rows)


__all__ = ["rank_summary", "ShardedSnapshot", "SnapshotMerger", "sharded_table"]
