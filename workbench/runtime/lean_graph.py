"""The copy of a finished graph the plain runner executes: the same ops, with fewer Python layers
per node.

A decode step of the plain graph runs its ``forward`` from Python, one call per node: smollm2's
final graph has 1,318 nodes, 151 ``reshape``, 90 ``view``, 62 ``sym_size``, 60 ``add`` and 30
``split_with_sizes`` among them. FX spells each as ``torch.ops.aten.<op>.<overload>(...)``, which
goes through ``OpOverload.__call__`` and the dispatcher's argument parsing: ~2.1 us for a view on
this CPU, against ~0.75 us for ``x.view(...)``, 0.8 vs 0.17 us for ``sym_size`` against
``x.size(d)``, 1.5 vs 0.8 us for ``add`` against ``a + b`` (timeit, torch 2.13). The copy calls the
Tensor methods and the operator instead; they reach the same ATen kernels with the same arguments,
so the results are bitwise the same.

The copy also reads each weight as one flat instance attribute instead of FX's
``getattr(self.model.layers, "0").self_attn...`` chain of ``nn.Module.__getattr__`` calls (424
weight reads a step on smollm2). Measured on smollm2 Q4_1 (``bench/lean_graph.py``, 5 alternated
rounds, 2026-11-27): the method calls alone +4.3 % decode (median per round); with the flat
weights +21 % and +26 % (two runs).

The pipeline's graph (what snapshots, renders and the cost model read) is not touched: the copy
shares its parameters, buffers and cache tensors and exists only inside the runner.
"""

from __future__ import annotations

import operator
from typing import Any, Dict, Optional, Tuple

import torch
import torch.fx as fx

aten = torch.ops.aten

# ATen op -> the Tensor method that calls it with the same positional arguments.
TENSOR_METHODS: Dict[object, str] = {
    aten.view.default: "view",
    aten.reshape.default: "reshape",
    aten.sym_size.int: "size",
    aten.split_with_sizes.default: "split_with_sizes",
}


def _lean_form(node: fx.Node) -> Optional[Tuple[str, Any]]:
    """``(op, target)`` the copy calls ``node`` with, or None to call it as it is."""
    if node.op != "call_function" or node.kwargs:
        return None
    method = TENSOR_METHODS.get(node.target)
    if method is not None:
        return "call_method", method
    if node.target is aten.add.Tensor and len(node.args) == 2 and all(isinstance(a, fx.Node) for a in node.args):
        return "call_function", operator.add
    return None


def lean_copy(module: torch.nn.Module) -> torch.nn.Module:
    """A GraphModule over a copy of ``module``'s graph with the ops above called as Tensor methods,
    ``aten.add.Tensor`` of two tensors as ``+`` and every tensor it reads as one flat instance
    attribute; ``module`` itself if it is not a GraphModule. The tensors are the same objects."""
    if not isinstance(module, fx.GraphModule):
        return module
    graph = fx.Graph()
    graph.output(graph.graph_copy(module.graph, {}))
    graph._codegen = module.graph._codegen  # the same input/output pytree specs
    attrs: Dict[str, Any] = {}  # target -> what it reads (GraphModule takes them from this dict)
    flat = []
    for node in graph.nodes:
        form = _lean_form(node)
        if form is not None:
            node.op, node.target = form
        elif node.op in ("get_attr", "call_module"):
            value = operator.attrgetter(node.target)(module)
            if node.op == "get_attr" and "." in node.target and isinstance(value, torch.Tensor):
                node.target = "_lean_" + node.target.replace(".", "_")
                flat.append(node.target)
            attrs[node.target] = value
    lean = fx.GraphModule(attrs, graph, class_name=f"Lean{type(module).__name__}")
    # FX reads ``layers.0.self_attn.q_proj.weight`` as ``getattr(self.model.layers, "0")...``: five
    # nn.Module.__getattr__ calls (Python) per weight and per step. A flat name found in the
    # instance dict is one lookup (a Parameter would be registered, and read through __getattr__).
    for name in flat:
        value = lean._parameters.pop(name, None)
        if value is not None:
            lean.__dict__[name] = value  # this copy only runs: it is never saved or moved
    return lean


def rewritten_nodes(module: torch.nn.Module) -> int:
    """How many nodes ``lean_copy`` calls differently (0 for a module that is not a graph)."""
    if not isinstance(module, fx.GraphModule):
        return 0
    return sum(1 for n in module.graph.nodes if _lean_form(n) is not None)


__all__ = ["TENSOR_METHODS", "lean_copy", "rewritten_nodes"]
