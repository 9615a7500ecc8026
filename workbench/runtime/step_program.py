"""A finished graph run from C++: the plain runner's step with no Python per node.

The plain runner executes the pipeline's graph through its generated Python ``forward``: one
interpreted call per node, each paying Python's call, the op's argument parsing and the
dispatcher. smollm2's decode step is 1,318 nodes (120 int4 linears and 30 attentions among 150
``reshape``, 90 ``view``, 62 ``sym_size``, 150 ``getitem``), so the step's host time is mostly
Python. ``StepProgram`` (``ops/cpu_kernels/step_program.cpp``) holds the same graph as a list of
dispatcher calls over numbered value slots and runs it in one call from Python: the same
operators, the same arguments, the same order -- bitwise the same results, as the tests check
against the graph. On smollm2 Q4_1 (2 cores, ``bench/lean_graph.py``, 2026-11-27) it decodes at
1.74x the graph's ``forward`` and 1.23x the lean Python copy.

A graph is taken when every node is an ATen or ``workbench::`` operator call (``OpOverload``), a
``getitem`` of a multi-result op, a ``sym_size`` or a weight read; its arguments constants, results
of other nodes, lists of ints some of them results (``reshape(x, [s, 1, 576])``) or lists of
tensors. Anything else (a Python function, a module call, arithmetic on sizes) makes ``build``
return ``(None, why)``, and the runner keeps the lean Python copy (``lean_graph.py``).

The program is built from the graph and the module's tensors as they are when it is built (like
the lean copy): a runner is built per finished module, and a re-run pipeline builds a new one.
"""

from __future__ import annotations

import operator
from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.fx as fx
from torch.utils import _pytree as pytree

from ..ops.library import MISSING, schema_arguments
from .sequence_info import module_input_names

# the IValue codes of the enums TorchScript passes as ints (c10/core/MemoryFormat.h, Layout.h)
_MEMORY_FORMATS = {
    torch.contiguous_format: 0,
    torch.preserve_format: 1,
    torch.channels_last: 2,
    torch.channels_last_3d: 3,
}
_LAYOUTS = {torch.strided: 0}


class Unsupported(Exception):
    """A node the step program cannot express; the message says which and why."""


def _constant(value: Any) -> Any:
    """A Python argument as the IValue the schema expects."""
    if isinstance(value, torch.memory_format):
        return _MEMORY_FORMATS[value]
    if isinstance(value, torch.layout):
        if value not in _LAYOUTS:
            raise Unsupported(f"layout {value}")
        return _LAYOUTS[value]
    if isinstance(value, (list, tuple)):
        return [_constant(v) for v in value]
    if value is None or isinstance(value, (bool, int, float, str, torch.Tensor, torch.dtype, torch.device)):
        return value
    raise Unsupported(f"a constant of type {type(value).__name__}")


class _Builder:
    def __init__(self, module: fx.GraphModule):
        self.module = module
        self.slot: Dict[fx.Node, int] = {}  # node -> the slot holding its value
        self.weights: Dict[fx.Node, Any] = {}  # get_attr node -> the tensor it reads
        self.next_slot = 0

    def new_slot(self, node: fx.Node) -> int:
        self.slot[node] = s = self.next_slot
        self.next_slot += 1
        return s

    def add_arg(self, prog: Any, value: Any, type_: torch._C.Type) -> None:
        if isinstance(value, fx.Node):
            if value in self.weights and value not in self.slot:
                prog.add_const(self.weights[value])
            else:
                prog.add_slot(self.slot[value])
            return
        if isinstance(value, (list, tuple)) and any(isinstance(v, fx.Node) for v in value):
            text = str(type_)
            if "Tensor" in text:
                slots = []
                for v in value:
                    if v is None:
                        slots.append(-1)
                    elif isinstance(v, fx.Node):
                        slots.append(self.slot[v])  # a weight in a list has a preset slot
                    else:
                        raise Unsupported(f"a tensor list holding a {type(v).__name__} ({v!r})")
                prog.add_tensor_list(slots, "Optional[Tensor]" in text)
            elif "int" in text.lower():
                entries, patches = [], []
                for i, v in enumerate(value):
                    if isinstance(v, fx.Node):
                        entries.append(0)
                        patches += [i, self.slot[v]]
                    else:
                        entries.append(int(v))
                prog.add_int_list(entries, patches)
            else:
                raise Unsupported(f"a list argument of type {text} holding node results")
            return
        prog.add_const(_constant(value))

    @staticmethod
    def schema_args(node: fx.Node) -> List[Tuple[Any, Any]]:
        """(value, type) for every schema argument, defaults filled in (a boxed call takes them all)."""
        out = []
        for arg, value in schema_arguments(node):
            if value is MISSING:
                raise Unsupported(f"{node.name}: argument {arg.name} of {node.target} not given")
            out.append((value, arg.type))
        return out


def build(module: torch.nn.Module) -> Tuple[Optional["StepProgramFn"], str]:
    """The step program of ``module``'s graph, or ``(None, why)`` when it cannot be one (not a
    graph, the CPU kernels library not loaded, a node it cannot express)."""
    if not isinstance(module, fx.GraphModule):
        return None, f"{type(module).__name__} is not a graph"
    from ..ops import cpu_kernels

    why = cpu_kernels.load_step_program()
    if why is not None:
        return None, why
    try:
        return StepProgramFn(module), ""
    except Unsupported as e:
        return None, str(e)
    except RuntimeError as e:  # refused by the C++ builder (an argument its schema does not take)
        return None, f"the step program refused {str(e).splitlines()[0]}"


class StepProgramFn:
    """Callable like the module (positional graph inputs), running its graph as a ``StepProgram``."""

    def __init__(self, module: fx.GraphModule):
        b = _Builder(module)
        graph = module.graph
        nodes = list(graph.nodes)
        order = {n: i for i, n in enumerate(nodes)}
        inputs: List[int] = []
        multi: Dict[fx.Node, List[int]] = {}  # node of several results -> their slots
        calls: List[Tuple[str, fx.Node, Any]] = []  # (kind, node, detail)
        for node in nodes:
            if node.op == "placeholder":
                inputs.append(b.new_slot(node))
            elif node.op == "get_attr":
                b.weights[node] = weight = operator.attrgetter(node.target)(module)
                if not isinstance(weight, torch.Tensor):
                    raise Unsupported(f"{node.name}: reads a {type(weight).__name__}, not a tensor")
            elif node.op == "call_function":
                calls.append(self._plan(b, node, multi))
            elif node.op == "output":
                leaves, self.out_tree = pytree.tree_flatten(node.args[0])
                if not all(isinstance(v, fx.Node) and v in b.slot for v in leaves):
                    raise Unsupported("the graph's output holds something other than node results")
                outputs = [b.slot[v] for v in leaves]
            else:
                raise Unsupported(f"{node.name}: {node.op} {node.target}")
        for _kind, node, _ in calls:  # a weight read inside a list argument gets a slot, preset each run
            for arg in (*node.args, *node.kwargs.values()):
                if isinstance(arg, (list, tuple)):
                    for v in arg:
                        if isinstance(v, fx.Node) and v in b.weights and v not in b.slot:
                            b.new_slot(v)
        self.graph = graph  # its codegen flattens the inputs and rebuilds the outputs, as forward does
        self.input_names = module_input_names(module)  # what it takes, for callers that ask a module
        # a slot is freed after its last reader (as the FX forward sets names to None); outputs are kept
        last: Dict[int, int] = {}  # slot -> index of its last reader (getitems of one result share a slot)
        for node, s in b.slot.items():
            if s >= 0:
                last[s] = max(last.get(s, -1), max((order[u] for u in node.users), default=order[node]))
        frees_at: Dict[int, List[int]] = {}
        for s, at in last.items():
            if s not in outputs:
                frees_at.setdefault(at, []).append(s)
        prog = torch.classes.workbench.StepProgram(b.next_slot)
        for node, weight in b.weights.items():
            if node in b.slot:
                prog.preset_slot(b.slot[node], weight)
        for kind, node, detail in calls:
            frees = frees_at.get(order[node], [])
            if kind == "alias":  # reads only its multi-result source, which has no slot of its own
                continue
            if kind == "call":
                for value, type_ in b.schema_args(node):
                    b.add_arg(prog, value, type_)
                name, overload = detail
                prog.add_call(node.name, name, overload, self._outs(b, node, multi), frees)
            elif kind == "getitem":
                src, index = node.args
                prog.add_getitem(b.slot[src], int(index), b.slot[node], frees)
            else:  # size
                src, dim = node.args
                prog.add_size(b.slot[src], int(dim), b.slot[node], frees)
        prog.set_io(inputs, outputs)
        self.program = prog
        self.num_calls = int(prog.size())  # instructions run a step (weight reads and aliases are none)

    @staticmethod
    def _outs(b: _Builder, node: fx.Node, multi: Dict[fx.Node, List[int]]) -> List[int]:
        return multi.get(node, [b.slot[node]])

    @staticmethod
    def _plan(b: _Builder, node: fx.Node, multi: Dict[fx.Node, List[int]]) -> Tuple[str, fx.Node, Any]:
        target = node.target
        if target is operator.getitem:
            src, index = node.args
            if src in multi:  # one of an op's several results: it has its own slot already
                b.slot[node] = multi[src][index]
                return "alias", node, None
            b.new_slot(node)
            return "getitem", node, None
        if target is torch.ops.aten.sym_size.int:
            b.new_slot(node)
            return "size", node, None
        if not isinstance(target, torch._ops.OpOverload):
            raise Unsupported(f"{node.name}: calls {getattr(target, '__name__', target)}, not an operator")
        returns = target._schema.returns
        if len(returns) == 1:
            b.new_slot(node)
        else:
            b.slot[node] = -1  # never read itself: only through getitem
            multi[node] = [b.next_slot + i for i in range(len(returns))]
            b.next_slot += len(returns)
        name = target._schema.name
        return "call", node, (name, target._overloadname if target._overloadname != "default" else "")

    def __call__(self, *args: Any) -> Any:
        outs = self.program.run(list(self.graph.process_inputs(*args)))
        return self.graph.process_outputs(pytree.tree_unflatten(outs, self.out_tree))


__all__ = ["StepProgramFn", "Unsupported", "build"]
