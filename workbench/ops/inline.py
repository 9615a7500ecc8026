"""Canonical ops as plain functions, for compilers that should see inside them.

The canonical ops are opaque custom ops on purpose: pattern matching, fusion backends, renders and
diffs name them. ``torch.compile`` however cannot fuse across an opaque op, so the compile stage
hands Inductor a *copy* of the graph in which the torch-backend canonical ops call their reference
implementations directly (same code, so the same numerics up to Inductor's own fusion). Ops with
side effects or host logic (cached attention) stay opaque.
"""

from __future__ import annotations

from typing import Callable, Dict

import torch
import torch.fx as fx

from .mlp.cpu_linear_wxt import linear_wxt
from .mlp.torch_silu_mul import silu_and_mul_reference
from .normalization.torch_norms import rmsnorm_reference
from .rope.torch_rope import rope_explicit_reference


def inline_table() -> Dict[object, Callable]:
    """Custom op overload -> the plain function it runs."""
    ops = torch.ops.workbench
    return {
        ops.torch_rmsnorm.default: rmsnorm_reference,
        ops.torch_silu_and_mul.default: silu_and_mul_reference,
        ops.torch_rope_with_explicit_cos_sin.default: rope_explicit_reference,
        ops.cpu_linear_wxt.default: linear_wxt,
    }


def inline_canonical_ops(gm: fx.GraphModule) -> Dict[str, int]:
    """Point every inlinable canonical op node of ``gm`` (in place) at its reference function.

    Returns {op name: nodes rewritten}. Use on a copy: the result no longer names the ops.
    """
    table = inline_table()
    counts: Dict[str, int] = {}
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target in table:
            name = str(node.target)
            node.target = table[node.target]
            counts[name] = counts.get(name, 0) + 1
    if counts:
        gm.recompile()
    return counts


__all__ = ["inline_table", "inline_canonical_ops"]
