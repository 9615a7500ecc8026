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

from .library import ops_with


def inline_table() -> Dict[object, Callable]:
    """Custom op overload -> the plain function it runs: every op that declares a ``reference``
    (``OpTraits``, at its ``define_op``)."""
    return {
        getattr(torch.ops.workbench, name).default: t.reference
        for name, t in ops_with(lambda t: t.reference is not None).items()
        if t.reference is not None
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
