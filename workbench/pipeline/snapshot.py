"""Snapshot: what the step-through driver records after every transform.

A snapshot is immutable once recorded. Its ``module`` is a graph copy that shares parameter
storage with the live model, so any snapshot can be resumed from without re-exporting, at the cost
of the graph structure only (no weights are copied).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, FrozenSet, List, Optional, Sequence, TypeVar

import torch

from .context import ContextState
from .graph.copy import GraphCopy
from .interface import PhaseTimes, Stages, TransformConfig, TransformInfo
from .memory import MemoryStats
from .numerics import Numerics

PROVENANCE_KEY = "wb_created_by"  # node.meta: key of the transform that created the node
REPLACES_KEY = "wb_replaces"  # node.meta: names of the nodes a transform replaced with this one


_S = TypeVar("_S")


def transform_index(keys: Sequence[str], key: str) -> int:
    """Where transform ``key`` stands in a pipeline of ``keys`` (KeyError naming them if absent)."""
    try:
        return list(keys).index(key)
    except ValueError:
        raise KeyError(f"'{key}' is not in this pipeline; its transforms are: {', '.join(keys)}") from None


def snapshot_of(keys: Sequence[str], snapshots: Sequence[_S], key: str) -> _S:
    """The snapshot of transform ``key``, given the snapshots of the transforms run so far."""
    i = transform_index(keys, key)
    if i >= len(snapshots):
        raise KeyError(f"'{key}' has not run yet (pipeline position {len(snapshots)})")
    return snapshots[i]


@dataclass(frozen=True)
class Snapshot:
    index: int  # position in the pipeline
    key: str
    stage: Stages
    config: TransformConfig
    info: TransformInfo
    times: PhaseTimes
    mem_before: MemoryStats
    mem_after: MemoryStats
    mem_warning: Optional[str]
    num_nodes: int
    op_histogram: Dict[str, int]
    graph_copy: Optional[GraphCopy]  # None only when snapshots are off (snapshots=False)
    node_names: FrozenSet[str]
    added_nodes: List[str]  # created by this transform (provenance)
    removed_nodes: List[str]  # present before, gone after
    numerics: Optional[Numerics] = None
    context: Optional[ContextState] = None  # the context's mutable part as it was after the step

    @property
    def module(self) -> Optional[torch.nn.Module]:
        """The graph after this transform, as a GraphModule sharing parameter storage (read it;
        to continue transforming use ``graph_copy.materialize()``)."""
        return None if self.graph_copy is None else self.graph_copy.module

    @property
    def graph(self) -> Optional[torch.fx.Graph]:
        """The frozen graph, without building a module."""
        return None if self.graph_copy is None else self.graph_copy.graph

    @property
    def status(self) -> str:
        if not self.info.skipped:
            return "done"
        return "failed" if (self.info.skip_reason or "").startswith("error") else "skipped"

    @property
    def mem_delta(self) -> int:
        """Change of tracked bytes (CUDA allocated on a GPU; params+buffers+caches on CPU)."""
        if self.mem_before.cuda_allocated is not None and self.mem_after.cuda_allocated is not None:
            return self.mem_after.cuda_allocated - self.mem_before.cuda_allocated
        return self.mem_after.tracked_bytes - self.mem_before.tracked_bytes

    def row(self, prev_nodes: int) -> Dict[str, Any]:
        """One row of the pipeline table."""
        n = self.numerics
        return {
            "#": self.index,
            "stage": self.stage.value,
            "transform": self.key,
            "status": self.status,
            "matches": self.info.num_matches,
            "time_s": round(self.times.total, 4),
            "nodes": self.num_nodes,
            "d_nodes": self.num_nodes - prev_nodes,
            "d_mem_MiB": round(self.mem_delta / 2**20, 3),
            "mem_warning": self.mem_warning or "",
            "max_abs": None if n is None or not n.ok else n.max_abs,
            "rmse_ratio": None if n is None or not n.ok else n.rmse_ratio,
            "top1": None if n is None or not n.ok else n.top1_agreement,
            "note": self.info.skip_reason
            or self.info.details.get("warning", "")
            or (n.error if n is not None and not n.ok else "")
            or self.info.details.get("summary", ""),
        }
