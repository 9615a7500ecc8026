"""Static decode graphs: Inductor code for decode steps of one batch size, called without Dynamo.

On CPU a ``torch.compile``d decode step of SmolLM2 spends ~0.65-0.75 ms a token outside its kernels,
in Dynamo: evaluating the frame, the guards on ~70 inputs and the Python around the C++ wrapper
(measured by calling both in alternation on the same inputs: 7.3 vs 6.6 ms a Q4_1 step, 19.5 vs 18.8
ms an fp32 one, bit-identical logits). A decode step of B sequences has the same input shapes every
time -- tokens [1, B], positions [1, B], the step metadata (views of ``SequenceInfo``'s fixed
buffers) and the caches -- and its int inputs have fixed values (``num_prefill`` is 0), so nothing
a guard would check can change while the shapes stay. This compiles the inlined graph once per
batch size with ``torch._inductor.compile`` on those concrete shapes, the ints baked in as
constants, and calls it directly. Steps whose shapes or ints differ (prefill, mixed steps, other
batch sizes) keep going through ``torch.compile``: ``lookup`` checks both on every call.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

import torch
import torch.fx as fx

Shapes = Tuple[Tuple[int, ...], ...]


@dataclass(frozen=True)
class StaticDecodeGraph:
    """One batch size's compiled step: ``fn(*tensor inputs)``; the ints it was compiled with are
    constants inside it."""

    fn: Callable[..., Any]
    baked_ints: Tuple[Tuple[int, int], ...]  # (input position, value)
    tensor_positions: Tuple[int, ...]  # the inputs passed on, in order
    rebuild: Callable[[Sequence[Any]], Any]  # Inductor's flat outputs -> what the module returns


class StaticDecodeGraphs:
    """The static decode graphs of a runner, keyed by the shapes of the step inputs that vary."""

    def __init__(self, key_positions: Sequence[int]):
        # positions of the inputs whose shapes differ between steps (tokens, positions, metadata);
        # the caches are the same tensors for the runner's life and are not looked at per call
        self.key_positions = tuple(key_positions)
        self.graphs: Dict[Shapes, StaticDecodeGraph] = {}
        self.calls = 0

    def key(self, inputs: Sequence[Any]) -> Shapes:
        return tuple(tuple(inputs[i].shape) for i in self.key_positions)

    def add(self, module: fx.GraphModule, inputs: List[Any], options: Mapping[str, Any]) -> None:
        """Compile ``module`` for exactly ``inputs`` (the inputs of one decode step)."""
        gm, baked, positions = _static_copy(module, inputs)
        with torch.no_grad():
            fn = torch._inductor.compile(gm, [inputs[i] for i in positions], options=dict(options))
        self.graphs[self.key(inputs)] = StaticDecodeGraph(fn, baked, positions, _rebuild(module))

    def lookup(self, inputs: Sequence[Any]) -> Optional[StaticDecodeGraph]:
        """The graph compiled for these inputs' shapes and ints, or None."""
        graph = self.graphs.get(self.key(inputs))
        if graph is None or any(inputs[i] != v for i, v in graph.baked_ints):
            return None
        return graph

    def __call__(self, graph: StaticDecodeGraph, inputs: Sequence[Any]) -> Any:
        self.calls += 1
        return graph.rebuild(graph.fn(*[inputs[i] for i in graph.tensor_positions]))

    def replay(self, *inputs: Any) -> Any:
        """Run the graph compiled for these inputs (the runner's ``fn(*inputs)`` contract)."""
        graph = self.lookup(inputs)
        if graph is None:
            raise KeyError("no static decode graph was compiled for these input shapes")
        return self(graph, inputs)


def _rebuild(module: fx.GraphModule) -> Callable[[Sequence[Any]], Any]:
    """Inductor's callable returns the graph's outputs as a flat sequence; the module returns them
    in its own structure: the out-spec of an exported graph's pytree convention (one tensor for
    the cached graphs), else what the output node holds."""
    spec = getattr(getattr(module.graph._codegen, "pytree_info", None), "out_spec", None)
    if spec is not None:
        return lambda flat: torch.utils._pytree.tree_unflatten(list(flat), spec)
    value = next(n for n in reversed(module.graph.nodes) if n.op == "output").args[0]
    if isinstance(value, fx.Node):
        return lambda flat: flat[0]
    return lambda flat: type(value)(flat) if isinstance(value, (tuple, list)) else flat


def _static_copy(module: fx.GraphModule, inputs: Sequence[Any]) -> Tuple[fx.GraphModule, Tuple, Tuple[int, ...]]:
    """A copy of ``module`` taking its tensor inputs positionally (no pytree calling convention),
    with every int input replaced by its value in ``inputs``."""
    graph = fx.Graph()
    graph.output(graph.graph_copy(module.graph, {}))
    graph._codegen = fx.graph.CodeGen()  # flat positional inputs: what Inductor's callable takes
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    if len(placeholders) != len(inputs):
        raise ValueError(f"the graph has {len(placeholders)} inputs, the step {len(inputs)}")
    baked, positions = [], []
    for i, (node, value) in enumerate(zip(placeholders, inputs)):
        if isinstance(value, torch.Tensor):
            positions.append(i)
            continue
        if not isinstance(value, int):
            raise TypeError(
                f"input {node.name} is a {type(value).__name__}; static decode graphs take tensors and ints"
            )
        for user in list(node.users):
            user.args = fx.node.map_arg(user.args, lambda a, n=node, v=value: v if a is n else a)
            user.kwargs = fx.node.map_arg(user.kwargs, lambda a, n=node, v=value: v if a is n else a)
        graph.erase_node(node)
        baked.append((i, value))
    gm = fx.GraphModule(module, graph)
    return gm, tuple(baked), tuple(positions)


__all__ = ["StaticDecodeGraph", "StaticDecodeGraphs"]
