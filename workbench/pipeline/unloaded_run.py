"""Running a graph from before ``weight_load`` on real weights without changing it: ``run_unloaded``.

The numerics probe and ``PipelineStepper.forward`` run graphs that still hold the meta tensors
export traced. ``run_unloaded`` serves each ``get_attr`` from the weight source
(``weights.WeightResolver``) and rewrites ``device=meta`` arguments as the nodes run, so the graph
is probed as it stands, before ``load_weights`` binds it for good.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Callable, Dict, List, Optional

import torch
import torch.fx as fx

from .graph.weights import fetch_attr
from .weight_placement import _on, _retarget
from .weights import WeightResolver


def _has_device(value: Any, device_type: str) -> bool:
    """Whether ``value`` (node arguments: nested tuples, lists, dicts) holds a ``torch.device`` of
    ``device_type`` anywhere."""
    stack = [value]
    while stack:
        v = stack.pop()
        if isinstance(v, (tuple, list)):
            stack.extend(v)
        elif isinstance(v, dict):
            stack.extend(v.values())
        elif isinstance(v, torch.device) and v.type == device_type:
            return True
    return False


def _run_bound(gm: fx.GraphModule, resolve: Callable[[str], torch.Tensor], device: torch.device, args) -> Any:
    """Runs a graph from before ``weight_load``: meta attributes come from ``resolve``, and
    ``device=meta`` arguments of ``call_function`` nodes become ``device``. The graph module is not
    modified.

    What ``fx.Interpreter(gm, garbage_collect_values=True).run`` does for these graphs (each value is
    dropped after its last use), in one plain loop: the interpreter's per-node dispatch and context
    managers cost ~20 us a node, ~25 ms per probe of a 1,400-node graph (~18 ms of it saved). Whether a node carries a meta device is checked
    on its own arguments (no tensors in them), and only such nodes' values are mapped, instead of
    mapping every call's materialized arguments. Same ops on the same values: bitwise-equal logits.
    """
    graph = gm.graph
    nodes = list(graph.nodes)
    index = {node: i for i, node in enumerate(nodes)}
    # last use: the values each node is the last reader of (freed right after it runs)
    free_after: Dict[int, List[int]] = {}
    seen: set = set()
    for i in range(len(nodes) - 1, -1, -1):
        for n in nodes[i]._input_nodes:
            if n not in seen:
                seen.add(n)
                free_after.setdefault(i, []).append(index[n])
    env: List[Any] = [None] * len(nodes)
    fetch = lambda n: env[index[n]]  # noqa: E731
    retarget = lambda a: _retarget(a, "meta", device)  # noqa: E731
    args_iter = iter(graph.process_inputs(*args))
    for i, node in enumerate(nodes):
        op, target = node.op, node.target
        try:
            if op == "call_function":
                a, k = fx.node.map_arg((node.args, node.kwargs), fetch)
                if _has_device((node.args, node.kwargs), "meta"):
                    a, k = fx.node.map_aggregate((a, k), retarget)
                value = target(*a, **k)
            elif op == "get_attr":
                value = fetch_attr(gm, target)
                if isinstance(value, torch.Tensor):
                    if value.is_meta:
                        value = resolve(target)
                    if not _on(value, device):
                        value = value.to(device)
            elif op == "placeholder":
                if target.startswith("*"):
                    value = list(args_iter)
                else:
                    try:
                        value = next(args_iter)
                    except StopIteration:
                        if not node.args:
                            raise RuntimeError(
                                f"Expected positional argument for parameter {target}, but one was not passed in!"
                            ) from None
                        value = node.args[0]
            elif op == "call_method":
                a, k = fx.node.map_arg((node.args, node.kwargs), fetch)
                value = getattr(a[0], target)(*a[1:], **k)
            elif op == "call_module":
                a, k = fx.node.map_arg((node.args, node.kwargs), fetch)
                value = fetch_attr(gm, target)(*a, **k)
            elif op == "output":
                return graph.process_outputs(fx.node.map_arg(node.args[0], fetch))
            else:
                raise RuntimeError(f"unknown node op {op!r}")
        except Exception as e:  # the interpreter's context: which node failed
            msg = f"While executing {node.format_node()}"
            msg = f"{e.args[0]}\n\n{msg}" if e.args else msg
            e.args = (msg,) + e.args[1:]
            if isinstance(e, KeyError):
                raise RuntimeError(*e.args) from e
            raise
        env[i] = value
        for j in free_after.get(i, ()):
            env[j] = None
    raise RuntimeError("graph has no output node")


def run_unloaded(gm: fx.GraphModule, source: Optional[Mapping], args, device: torch.device):
    """Run ``gm`` (holding meta tensors) on ``args`` with the real weights of ``source``."""
    resolver = WeightResolver(gm, source)
    with torch.no_grad():
        return _run_bound(gm, resolver, torch.device(device), args)


__all__ = ["run_unloaded"]
