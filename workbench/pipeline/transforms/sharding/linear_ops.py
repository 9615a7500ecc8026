"""How each linear-like op of a graph is cut for tensor parallelism: which arguments are weights and
how their dims follow the output and input features.

A *column* split keeps rows ``[n0, n1)`` of every weight-like tensor (the output features, dim 0,
bias included). A *row* split keeps input features ``[k0, k1)``: dim 1 of the weight, scaled by how
many stored elements one input feature takes (a packed int4 ``qweight [N, K/2]`` holds half a byte
per feature; per-group ``scales [N, K/g]`` one element per ``g`` features), so ``k0, k1`` must be
multiples of ``align`` (the quantization group). A row-parallel linear's bias is added once: rank 0
keeps it, the others get zeros, and the all-reduce sums the partial products.

Ops not listed here are never split: the region around them stays replicated, with the reason.
"""

from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction
from typing import Callable, Dict, Optional, Tuple

import torch
import torch.fx as fx

wb = torch.ops.workbench


@dataclass(frozen=True)
class WeightArg:
    index: int  # position in node.args
    name: str
    per_feature: Callable[[fx.Node], Fraction]  # stored elements along dim 1 per input feature


@dataclass(frozen=True)
class LinearOp:
    """One linear-like op: its weight-like arguments, bias position and row-split alignment."""

    weights: Tuple[WeightArg, ...]
    bias_index: Optional[int]
    align: Callable[[fx.Node], int]  # input-feature boundaries of a row split are multiples of this

    def arg(self, node: fx.Node, index: int):
        return node.args[index] if len(node.args) > index else None

    def bias(self, node: fx.Node) -> Optional[fx.Node]:
        if self.bias_index is None:
            return None
        b = self.arg(node, self.bias_index)
        return b if b is not None else node.kwargs.get("bias")


def _one(node: fx.Node) -> Fraction:
    return Fraction(1)


def _group_size(node: fx.Node, index: int) -> int:
    return int(node.args[index])


def _linear_table() -> Dict[object, LinearOp]:
    plain = LinearOp((WeightArg(1, "weight", _one),), 2, lambda n: 1)
    int4 = LinearOp(
        (
            WeightArg(1, "qweight", lambda n: Fraction(1, 2)),
            WeightArg(2, "scales", lambda n: Fraction(1, _group_size(n, 4))),
            WeightArg(3, "offsets", lambda n: Fraction(1, _group_size(n, 4))),
        ),
        5,
        lambda n: _group_size(n, 4),
    )
    int8 = LinearOp(
        (WeightArg(1, "qweight", _one), WeightArg(2, "scales", lambda n: Fraction(1, _group_size(n, 3)))),
        4,
        lambda n: _group_size(n, 3),
    )
    return {
        torch.ops.aten.linear.default: plain,
        wb.torch_linear_simple.default: plain,
        wb.torch_int4_linear.default: int4,
        wb.torch_int8_linear.default: int8,
    }


LINEAR_OPS: Dict[object, LinearOp] = _linear_table()


def linear_op(node: fx.Node) -> Optional[LinearOp]:
    """The rule for ``node`` if it is a linear the sharder can split (weights read by get_attr)."""
    if node.op != "call_function" or node.target not in LINEAR_OPS:
        return None
    rule = LINEAR_OPS[node.target]
    if not all(
        isinstance(rule.arg(node, w.index), fx.Node) and rule.arg(node, w.index).op == "get_attr" for w in rule.weights
    ):
        return None
    bias = rule.bias(node)
    if bias is not None and (not isinstance(bias, fx.Node) or bias.op != "get_attr"):
        return None
    return rule


def features(node: fx.Node) -> Tuple[int, int]:
    """(in_features, out_features) of a linear node, from its fake values."""
    x, out = node.args[0].meta.get("val"), node.meta.get("val")
    if x is None or out is None:
        raise RuntimeError(f"{node.name} has no fake value: run shape propagation before detect_sharding")
    return int(x.shape[-1]), int(out.shape[-1])


__all__ = ["LINEAR_OPS", "LinearOp", "WeightArg", "linear_op", "features"]
