"""The sharding plan: per layer, how each attention, MLP, MoE and LM-head region is split over the
ranks, what this rank keeps of every weight, and where the collectives go.

``detect_sharding`` builds it from the canonical graph (``sharding/detect.py``);
``sharding_transform_executor`` applies it (``sharding/apply.py``). It names nodes and graph
attributes by string, never holds ``fx.Node`` objects, so snapshots can keep it as it was.

Kinds of split, per node:

===========  ===================================================================================
column       output features ``[n0, n1)``: weight rows, bias rows (Q/K/V by heads, gate/up)
row          input features ``[k0, k1)``: weight columns; an all-reduce follows (O, down)
vocab        the LM head's rows ``[r*V/W, (r+1)*V/W)``; an all-gather of the logits follows
expert       experts ``[e0, e1)`` of a MoE; tokens routed elsewhere skip them; an all-reduce follows
replicated   every rank holds and computes the whole node (with the reason)
===========  ===================================================================================
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

Range = Tuple[int, int]


def split_evenly(n: int, parts: int, align: int = 1) -> List[Range]:
    """``[0, n)`` in ``parts`` contiguous ranges whose sizes differ by at most ``align`` and whose
    boundaries are multiples of ``align`` (n itself need not be). Empty ranges are possible only
    when ``n < parts * align``; callers check ``min size > 0``."""
    units = -(-n // align)
    base, extra = divmod(units, parts)
    out, start = [], 0
    for r in range(parts):
        stop = min(n, start + (base + (r < extra)) * align)
        out.append((start, stop))
        start = stop
    return out


def width(ranges: Sequence[Range]) -> int:
    """Elements covered by ``ranges`` (what a cut keeps along its dim)."""
    return sum(b - a for a, b in ranges)


def fmt_range(r: Range) -> str:
    return f"{r[0]}-{r[1] - 1}" if r[1] - r[0] > 1 else f"{r[0]}"


@dataclass(frozen=True)
class TensorCut:
    """What this rank keeps of one graph tensor: ``ranges`` along ``dim`` (concatenated in order),
    or zeros of that shape (``zero``: a row-parallel bias on ranks > 0)."""

    arg_index: Union[int, str]  # position of the get_attr in the node's args, or its keyword
    target: str  # the graph attribute the node reads now
    dim: int
    ranges: Tuple[Range, ...]
    zero: bool = False


@dataclass(frozen=True)
class NodeCut:
    node: str
    kind: str  # column | row | vocab | expert
    tensors: Tuple[TensorCut, ...]


@dataclass(frozen=True)
class Region:
    """One shardable unit (a layer's attention, MLP, MoE, or the LM head) and what happens to it."""

    kind: str  # mha | mlp | moe | lm_head | embedding | <op name> (unsupported mixers)
    layer: Optional[int]
    nodes: Tuple[str, ...]  # every node of the region, for the render
    shard: bool
    how: str  # what is split how, or why the region stays replicated
    per_rank: Tuple[str, ...] = ()  # what each rank holds, in rank order
    cuts: Tuple[NodeCut, ...] = ()  # this rank's cuts
    shape_fixes: Tuple[Tuple[str, int, int], ...] = ()  # (view/reshape node, index in its shape, local value)
    collective: Optional[Tuple[str, str]] = None  # (after node, "all_reduce" | "all_gather")
    local_experts: Optional[Tuple[str, int, int]] = None  # (MoE node, first expert, local count)
    expert_lists: Optional[Tuple[str, Range]] = None  # (torch_moe node, local expert range)
    global_bytes: int = 0  # bytes of the region's weights, whole
    local_bytes: int = 0  # bytes this rank keeps


@dataclass(frozen=True)
class ShardingPlan:
    world_size: int
    rank: int
    group_name: str
    regions: Tuple[Region, ...]
    applied: bool = False  # sharding_transform_executor rewrote the graph by it

    @property
    def sharded(self) -> Tuple[Region, ...]:
        return tuple(r for r in self.regions if r.shard)

    def counts(self) -> Dict[str, int]:
        out: Dict[str, int] = {}
        for r in self.sharded:
            out[r.kind] = out.get(r.kind, 0) + 1
        return out

    def replicated_reasons(self) -> Dict[str, str]:
        """Why regions stay whole, one example per kind of reason."""
        out: Dict[str, str] = {}
        for r in self.regions:
            if not r.shard:
                out.setdefault(f"{r.kind}: {r.how}", f"layer {r.layer}" if r.layer is not None else "")
        return out

    def bytes(self) -> Tuple[int, int]:
        """(whole, this rank's) bytes of the sharded regions' weights."""
        return sum(r.global_bytes for r in self.sharded), sum(r.local_bytes for r in self.sharded)

    def rows(self) -> List[Dict[str, Any]]:
        """The plan as table rows (plain values: picklable, DataFrame-ready), one per region."""
        rows = []
        for r in self.regions:
            row: Dict[str, Any] = {
                "layer": r.layer,
                "region": r.kind,
                "split": "sharded" if r.shard else "replicated",
                "how": r.how,
            }
            for rank, held in enumerate(r.per_rank or ("whole",) * self.world_size):
                row[f"rank {rank}"] = held
            row["weight bytes"] = r.global_bytes
            row[f"bytes on rank {self.rank}"] = r.local_bytes if r.shard else r.global_bytes
            rows.append(row)
        return rows

    def table(self):
        import pandas as pd

        return pd.DataFrame(self.rows())

    def summary(self) -> Dict[str, Any]:
        whole, local = self.bytes()
        return {
            "world_size": self.world_size,
            "rank": self.rank,
            "sharded": self.counts(),
            "replicated": len(self.regions) - len(self.sharded),
            "sharded_weight_bytes": whole,
            "sharded_weight_bytes_this_rank": local,
            "replicated_because": self.replicated_reasons(),
        }

    def with_applied(self) -> "ShardingPlan":
        return dataclasses.replace(self, applied=True)


__all__ = ["ShardingPlan", "Region", "NodeCut", "TensorCut", "split_evenly", "fmt_range", "width", "Range"]
