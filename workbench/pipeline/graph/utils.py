"""Small graph helpers shared by the framework and the transforms.

Kept free of transform logic: cleanup (dead code, lint, recompile), shape propagation with the
graph's own fake mode, and op histograms. Graph copies live in ``graph/copy.py``.
"""

from __future__ import annotations

import collections
import contextlib
from typing import Any, Dict, Iterator, List, Optional

import torch
import torch.fx as fx
from torch._dispatch.python import enable_python_dispatcher
from torch._guards import detect_fake_mode
from torch.fx.experimental.symbolic_shapes import statically_known_true
from torch.fx.passes.fake_tensor_prop import FakeTensorProp


def graph_modules(mod: torch.nn.Module) -> List[fx.GraphModule]:
    """Top-level graph modules in ``mod``: itself if it is one, else its outermost GraphModules."""
    if isinstance(mod, fx.GraphModule):
        return [mod]
    found: List[fx.GraphModule] = []
    skip_prefixes: List[str] = []
    for name, sub in mod.named_modules():
        if any(name.startswith(p) for p in skip_prefixes):
            continue
        if isinstance(sub, fx.GraphModule):
            found.append(sub)
            skip_prefixes.append(name + ".")
    return found


def lazy_graph_module(root, graph: fx.Graph, class_name: str = "GraphModule") -> fx.GraphModule:
    """``fx.GraphModule(root, graph, class_name)`` whose ``recompile()`` only marks the Python code
    stale; the code is generated when the module is next called (or ``.code`` is read).

    Every rewrite recompiles its graph (codegen + ``compile`` of ~2,500 lines for a 30-layer model,
    ~0.1-0.2 s), most transforms twice (their change, then the clean-up), and every snapshot builds
    a module; nothing runs the code in between. This is torch's own ``_LazyGraphModule`` (what
    Inductor's pattern passes use); with a torch that lacks it the module is an eager one."""
    try:
        from torch.fx._lazy_graph_module import _LazyGraphModule
    except ImportError:  # pragma: no cover
        return fx.GraphModule(root, graph, class_name=class_name)
    return _LazyGraphModule(root, graph, class_name=class_name)


def canonicalize_graph(gm: fx.GraphModule) -> None:
    """Dead-code elimination, lint and recompile: the 'clean graph' the flags talk about.

    ``eliminate_dead_code`` keeps impure nodes (asserts, in-place ops), so guards survive.
    """
    gm.graph.eliminate_dead_code()
    gm.graph.lint()
    gm.delete_all_unused_submodules()
    gm.recompile()


def size_expr(s: Any) -> Any:
    """A size, stride or offset as a hashable value: the sympy expression of a SymInt, else the int."""
    return s.node.expr if isinstance(s, torch.SymInt) else int(s)


def placeholder_values(gm: fx.GraphModule) -> List[Any]:
    return [n.meta.get("val") for n in gm.graph.nodes if n.op == "placeholder"]


@contextlib.contextmanager
def symbolic_fake_mode(mode, cache: bool = True) -> Iterator[None]:
    """Enter a graph's fake mode so that ops on its symbolic-shaped values work on every torch.

    The Python dispatcher routes composite ops (``aten.linear`` -> matmul ...) through their
    SymInt-aware decompositions, as export itself does. Without it torch 2.11 runs the C++
    composites, which call ``numel()`` on symbolic sizes ("Cannot call numel() on tensor with
    symbolic sizes/strides"); torch 2.13 takes the symbolic path either way. Every place that
    evaluates graph ops on fake values goes through here.

    ``cache=False`` turns the fake mode's dispatch cache off inside (restored on exit): rebuilding a
    cached output with symbolic sizes (``empty_strided`` + ``set_``, sympy on every size) costs
    more than running the op's meta function -- ~5x for the views and splits of a rewrite, whose
    repeated layers hit the cache -- while whole-graph passes over many new values (moving every
    value to the load device) gain from it.
    """
    old = getattr(mode, "cache_enabled", None)
    if not cache and old is not None:
        mode.cache_enabled = False
    try:
        with mode, enable_python_dispatcher():
            yield
    finally:
        if old is not None:
            mode.cache_enabled = old


def run_shape_prop(gm: fx.GraphModule) -> None:
    """Re-derive ``node.meta['val']`` for every node with the graph's own fake mode.

    Placeholders keep the (symbolic) fake values export gave them, so dynamic dims stay symbolic.
    Parameters reached through ``get_attr`` are real tensors; the fake mode converts them.
    """
    inputs = placeholder_values(gm)
    if any(v is None for v in inputs):
        raise RuntimeError(
            "shape propagation needs meta['val'] on every placeholder (the graph did not come from "
            "torch.export, or a transform added an input without metadata)"
        )
    fake_mode = detect_fake_mode(inputs)
    if fake_mode is None:
        raise RuntimeError("no fake mode found on the graph inputs; cannot propagate shapes")
    with symbolic_fake_mode(fake_mode):
        fake_mode.allow_non_fake_inputs = True
        FakeTensorProp(gm, mode=fake_mode).propagate_dont_convert_inputs(*inputs)


# Export's runtime checks on inputs: scalar asserts and range constraints on input dims.
INPUT_ASSERT_OPS = frozenset(
    {
        torch.ops.aten._assert_scalar.default,
        torch.ops.aten.sym_constrain_range_for_size.default,
        torch.ops.aten.sym_constrain_range.default,
    }
)


def remove_tensor_metadata_asserts(gm: fx.GraphModule) -> int:
    """Erase ``aten._assert_tensor_metadata`` nodes export adds around ``.to()`` calls.

    They check nothing the graph can violate, and as extra users of a node they get in the way of
    pattern matching. Returns how many were removed.
    """
    nodes = [n for n in gm.graph.nodes if n.target is torch.ops.aten._assert_tensor_metadata.default]
    for node in nodes:
        gm.graph.erase_node(node)
    return len(nodes)


def remove_input_checks(gm: fx.GraphModule) -> int:
    """Erase export's input checks: the ``_guards_fn`` call, input asserts and the pre-hook
    ``ExportedProgram.module()`` installs. Returns how many were removed."""
    n = 0
    for node in list(gm.graph.nodes):
        if (node.op == "call_module" and node.target == "_guards_fn") or (
            node.op == "call_function" and node.target in INPUT_ASSERT_OPS
        ):
            gm.graph.erase_node(node)
            n += 1
    for key, hook in list(gm._forward_pre_hooks.items()):
        if getattr(hook, "__name__", "") == "_check_input_constraints_pre_hook":
            del gm._forward_pre_hooks[key]
            n += 1
    if hasattr(gm, "_guards_fn") and not any(
        nd.op == "call_module" and nd.target == "_guards_fn" for nd in gm.graph.nodes
    ):
        delattr(gm, "_guards_fn")
    return n


def value_of(arg: Any) -> Any:
    """A python/sym value for ``arg``: constants as they are, fx nodes by their recorded value."""
    if isinstance(arg, fx.Node):
        return arg.meta.get("val")
    return arg


def known_ge(a: Any, b: Any) -> bool:
    if a is None or b is None:
        return False
    try:
        return bool(statically_known_true(a >= b))
    except Exception:  # noqa: BLE001 - unknown symbolic relation means "not provable"
        return False


def is_noop_slice(node: fx.Node) -> bool:
    """``aten.slice(x, dim, start, end, step)`` that keeps every element of ``dim``."""
    if node.op != "call_function" or node.target is not torch.ops.aten.slice.Tensor:
        return False
    x = tensor_meta(node.args[0])
    if x is None:
        return False
    dim = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0)
    start = node.args[2] if len(node.args) > 2 else node.kwargs.get("start", None)
    end = node.args[3] if len(node.args) > 3 else node.kwargs.get("end", None)
    step = node.args[4] if len(node.args) > 4 else node.kwargs.get("step", 1)
    if step != 1 or start not in (None, 0):
        return False
    if end is None or (isinstance(end, int) and end >= 2**62):  # export spells ":" as INT64_MAX
        return True
    return known_ge(value_of(end), x.shape[dim])


def remove_noop_slices(gm: fx.GraphModule) -> int:
    """Erase every ``is_noop_slice`` node (its users read the input instead); returns how many."""
    nodes = [n for n in gm.graph.nodes if is_noop_slice(n)]
    for node in nodes:
        node.replace_all_uses_with(node.args[0])
        gm.graph.erase_node(node)
    return len(nodes)


def call_nodes(gm: fx.GraphModule, *targets: Any) -> List[fx.Node]:
    """The ``call_function`` nodes of ``gm`` calling one of ``targets``, in graph order (a list, so
    a caller may rewrite the graph while it walks them)."""
    return [n for n in gm.graph.nodes if n.op == "call_function" and n.target in targets]


def op_name(node: fx.Node) -> str:
    """Readable op name: ``aten.linear.default``, ``workbench.torch_rmsnorm``, ``getitem``..."""
    if node.op in ("call_function", "call_method"):
        t = node.target
        if isinstance(t, torch._ops.OpOverload):
            return f"{t.namespace}.{t._schema.name.split('::')[-1]}.{t._overloadname}"
        if isinstance(t, torch._ops.OpOverloadPacket):
            return f"{t._qualified_op_name.replace('::', '.')}"
        return getattr(t, "__name__", str(t))
    if node.op == "call_module":
        return f"module:{node.target}"
    return node.op


def op_histogram(mod: torch.nn.Module) -> Dict[str, int]:
    """Count of ``call_function``/``call_method``/``call_module`` nodes per op."""
    counter: collections.Counter = collections.Counter()
    for gm in graph_modules(mod):
        for node in gm.graph.nodes:
            if node.op not in ("placeholder", "output", "get_attr"):
                counter[op_name(node)] += 1
    return dict(counter.most_common())


def num_nodes(mod: torch.nn.Module) -> int:
    return sum(len(gm.graph.nodes) for gm in graph_modules(mod))


def tensor_meta(node: Any) -> Optional[torch.Tensor]:
    """The fake value recorded on ``node`` if it is a tensor, else None."""
    if isinstance(node, fx.Node):
        val = node.meta.get("val")
        if isinstance(val, torch.Tensor):
            return val
    return None


def require_tensor_meta(node: Any) -> torch.Tensor:
    """``tensor_meta``, or an error saying how to get it (shape propagation)."""
    v = tensor_meta(node)
    if v is None:
        raise RuntimeError(f"{node} has no fake value; run shape propagation first (requires_shape_prop)")
    return v
