"""What every sharding region is built from: the ops a region may pass through, the column / row
cuts of its linears, and the bytes a cut keeps on this rank.

``RegionCutter`` holds the detection's state (graph, world size, rank, chosen dims and layers, the
nodes claimed so far); the region finders (``detect_attention.py``, ``detect_mlp.py``) extend it and
``detect.Detector`` runs them in order. A region recognised but not splittable raises
``NotShardable``, whose message becomes the plan's reason.
"""

from __future__ import annotations

import re
from fractions import Fraction
from typing import Any, Dict, Iterable, List, Optional, Sequence, Set, Tuple

import torch
import torch.fx as fx

from .linear_ops import LinearOp, features
from .plan import NodeCut, Range, Region, TensorCut, width

aten = torch.ops.aten

# Ops between a projection and attention that act on each head alone (the head dim is untouched).
PASS_THROUGH = {
    aten.view.default,
    aten.reshape.default,
    aten._unsafe_view.default,
    aten.transpose.int,
    aten.permute.default,
    aten.contiguous.default,
    aten.clone.default,
    aten.to.dtype,
    aten._to_copy.default,
    aten.alias.default,
}
RESHAPES = {aten.view.default, aten.reshape.default, aten._unsafe_view.default}
# Element-wise ops an MLP may apply between its opening and closing linears.
ELEMENTWISE = {
    aten.silu.default,
    aten.gelu.default,
    aten.relu.default,
    aten.sigmoid.default,
    aten.tanh.default,
    aten.mul.Tensor,
    aten.add.Tensor,
    aten.sub.Tensor,
    aten.div.Tensor,
    aten.neg.default,
    aten.pow.Tensor_Scalar,
    aten.to.dtype,
    aten._to_copy.default,
    aten.clamp.default,
}
_LAYER = re.compile(r"layers[._](\d+)[._]")


class NotShardable(Exception):
    """A region the sharder recognised but cannot split; the message is the plan's reason."""


def is_call(node: object, *targets) -> bool:
    return isinstance(node, fx.Node) and node.op == "call_function" and node.target in targets


def layer_of(nodes: Iterable[fx.Node]) -> Optional[int]:
    for n in nodes:
        for a in [n, *n.all_input_nodes]:
            m = _LAYER.search(str(a.target) + "." if a.op == "get_attr" else "")
            if m:
                return int(m.group(1))
    return None


def tensor_nbytes(node: fx.Node) -> int:
    v = node.meta.get("val")
    return v.numel() * v.element_size() if isinstance(v, torch.Tensor) else 0


def _arg(node: fx.Node, index) -> fx.Node:
    """A node argument by position, or by keyword (``sinks``)."""
    return node.args[index] if isinstance(index, int) else node.kwargs[index]


class RegionCutter:
    """The state a detection shares (graph, ranks, selection, claimed nodes, regions found) and the
    cuts its regions are made of."""

    def __init__(
        self,
        gm: fx.GraphModule,
        world_size: int,
        rank: int,
        group_name: str,
        dims: Sequence[str] = ("tp", "ep"),
        layers: Optional[Sequence[str]] = None,
    ):
        self.gm, self.W, self.rank, self.group = gm, world_size, rank, group_name
        self.dims, self.layers = set(dims), set(layers) if layers is not None else None
        self.claimed: Set[fx.Node] = set()
        self.regions: List[Region] = []
        self.by_name: Dict[str, fx.Node] = {n.name: n for n in gm.graph.nodes}  # detection never edits the graph

    def wanted(self, kind: str) -> bool:
        dim = "ep" if kind == "moe" else "tp"
        return dim in self.dims and (self.layers is None or kind in self.layers)

    # ------------------------------------------------------------------ cuts
    def column(self, node: fx.Node, rule: Optional[LinearOp], rows: Sequence[Range], kind: str = "column") -> NodeCut:
        assert rule is not None  # callers pass linear_op(node) of a node known to be a linear
        tensors = [TensorCut(w.index, node.args[w.index].target, 0, tuple(rows)) for w in rule.weights]
        bias = rule.bias(node)
        if bias is not None:
            assert rule.bias_index is not None  # a bias is found only at bias_index
            tensors.append(TensorCut(rule.bias_index, bias.target, 0, tuple(rows)))
        return NodeCut(node.name, kind, tuple(tensors))

    def row(self, node: fx.Node, rule: Optional[LinearOp], cols: Sequence[Range]) -> NodeCut:
        assert rule is not None  # callers pass linear_op(node) of a node known to be a linear
        align = rule.align(node)
        tensors = []
        for w in rule.weights:
            f: Fraction = w.per_feature(node)
            for a, b in cols:
                if a % align or (b % align and b != features(node)[0]):
                    raise NotShardable(
                        f"{node.name}: input features {a}-{b} do not fall on its {align}-element quantization groups"
                    )
            tensors.append(
                TensorCut(w.index, node.args[w.index].target, 1, tuple((int(a * f), int(b * f)) for a, b in cols))
            )
        bias = rule.bias(node)
        if bias is not None:
            assert rule.bias_index is not None  # a bias is found only at bias_index
            n = features(node)[1]
            tensors.append(TensorCut(rule.bias_index, bias.target, 0, ((0, n),), zero=self.rank != 0))
        return NodeCut(node.name, "row", tuple(tensors))

    def _split(
        self,
        kind: str,
        layer: Optional[int],
        nodes: Sequence[fx.Node],
        how: str,
        per_rank: Tuple[str, ...],
        cuts: Sequence[NodeCut],
        collective: Tuple[str, str],
        **more: Any,
    ) -> Region:
        """The region of ``nodes`` split by ``cuts``, its bytes (whole, this rank's) counted from them."""
        whole, local = self.bytes_of(cuts, nodes)
        return Region(
            kind,
            layer,
            tuple(n.name for n in nodes),
            True,
            how,
            per_rank,
            tuple(cuts),
            collective=collective,
            global_bytes=whole,
            local_bytes=local,
            **more,
        )

    def bytes_of(self, cuts: Sequence[NodeCut], whole_nodes: Sequence[fx.Node]) -> Tuple[int, int]:
        """(whole, local) bytes of the get_attr tensors the cut nodes read."""
        by_name = {n.name: n for n in whole_nodes}
        whole = local = 0
        for cut in cuts:
            node = by_name[cut.node]
            for t in cut.tensors:
                v = _arg(node, t.arg_index).meta.get("val")
                if not isinstance(v, torch.Tensor):
                    continue
                whole += v.numel() * v.element_size()
                frac = width(t.ranges) / v.shape[t.dim]
                local += int(v.numel() * v.element_size() * frac)
        return whole, local

    def _check_private(self, nodes: Sequence[fx.Node], allowed_outside: Set[fx.Node]) -> None:
        inside = set(nodes)
        for n in nodes:
            if n in allowed_outside:
                continue
            outside = [u for u in n.users if u not in inside]
            if outside:
                raise NotShardable(f"{n.name} is also read outside the region (by {outside[0].name})")


__all__ = [
    "ELEMENTWISE",
    "PASS_THROUGH",
    "RESHAPES",
    "NotShardable",
    "RegionCutter",
    "is_call",
    "layer_of",
    "tensor_nbytes",
]
