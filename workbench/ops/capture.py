"""Which nodes of a graph a CUDA graph cannot capture, and why.

A CUDA graph records kernel launches once and replays them on fixed addresses: an op that reads a
device value on the host (``.item()``, ``.tolist()``, ``nonzero``, a data-dependent output size)
synchronises with the device, which capture forbids ("operation not permitted when stream is
capturing"), and even where it would not fail, the replay keeps the value seen at capture. So
capture is a property of every op in the graph, not of the attention backend alone:

* ``workbench::`` ops declare it where they are defined: ``host_sync_tags(name, why)`` puts
  ``torch.Tag.cudagraph_unsafe`` (PyTorch's own tag for this) on the op and records why;
* ATen ops that read values on the host are listed here (``_HOST_SYNC_ATEN``), and any node whose
  output size depends on data (an unbacked symbol in its fake value) is one too;
* ops of other libraries (``transformers::grouped_mm_fallback`` reads its offsets with
  ``tolist()``) are not known to be capturable and count as blockers.

``capture_blockers(module)`` walks every node of every graph in ``module``; ``compile_model``
resolves ``auto`` to CUDA graphs only when it is empty and refuses a CUDA-graph backend otherwise,
naming the nodes.
"""

from __future__ import annotations

import operator
from types import MappingProxyType
from typing import Dict, Mapping, Tuple

import torch
import torch.fx as fx

HOST_SYNC_TAG = torch.Tag.cudagraph_unsafe
# qualified op name ("workbench::torch_moe") -> why it cannot be captured; filled once per op
# where the op is defined (like the op registration itself), read through ``host_sync_reasons()``
_REASONS: Dict[str, str] = {}

aten = torch.ops.aten
# ATen ops that read tensor values on the host (or whose output size does)
_HOST_SYNC_ATEN = {
    "_local_scalar_dense": "reads a tensor value on the host (.item())",
    "item": "reads a tensor value on the host (.item())",
    "nonzero": "output size depends on the data (nonzero)",
    "masked_select": "output size depends on the data (masked_select)",
    "unique": "output size depends on the data (unique)",
    "_unique": "output size depends on the data (unique)",
    "_unique2": "output size depends on the data (unique)",
    "unique_consecutive": "output size depends on the data (unique_consecutive)",
    "unique_dim": "output size depends on the data (unique)",
    "equal": "compares tensors on the host (torch.equal)",
    "is_nonzero": "reads a tensor value on the host (bool(tensor))",
    "_assert_scalar": "checks a data-dependent value on the host",
}
# namespaces whose ops are known: ATen/prims by the table above, workbench by its tags
_KNOWN_NAMESPACES = ("aten", "prims", "workbench")
# Python callables a graph may hold that never touch a tensor's values
_PLAIN_CALLABLES = (
    operator.getitem,
    operator.add,
    operator.sub,
    operator.mul,
    operator.floordiv,
    operator.truediv,
    operator.mod,
    operator.neg,
    operator.pow,
)


def host_sync_tags(qualname: str, why: str) -> Tuple[torch.Tag, ...]:
    """The ``tags=`` of an op that reads device values on the host: ``torch.Tag.cudagraph_unsafe``,
    with ``why`` recorded for the message that names it. Call once, where the op is defined."""
    if _REASONS.get(qualname, why) != why:
        raise ValueError(f"{qualname}: host-sync reason declared twice")
    _REASONS[qualname] = why
    return (HOST_SYNC_TAG,)


def host_sync_reasons() -> Mapping[str, str]:
    """Every declared op that cannot be captured, and why (read-only)."""
    return MappingProxyType(_REASONS)


def _unbacked(value) -> bool:
    from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols

    try:
        return bool(free_unbacked_symbols(value))
    except Exception:  # noqa: BLE001 - a value the helper cannot walk has no symbols we care about
        return False


def node_blocker(node: fx.Node) -> str | None:
    """Why a CUDA graph cannot capture ``node`` (None: it can)."""
    if node.op != "call_function":
        return None
    target = node.target
    if isinstance(target, torch._ops.HigherOrderOperator):
        if target.name().startswith("auto_functionalized") and node.args:
            target = node.args[0]  # a mutating op, functionalized: judge the op it wraps
        else:
            return f"{target.name()}: a higher-order op, not known to be capturable"
    if isinstance(target, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
        qualname = target.name() if isinstance(target, torch._ops.OpOverload) else target._qualified_op_name
        namespace, _, base = qualname.partition("::")
        base = base.split(".", 1)[0]
        tags = getattr(target, "tags", ())
        if HOST_SYNC_TAG in tags:
            return f"{qualname}: {_REASONS.get(qualname, 'tagged cudagraph_unsafe')}"
        if namespace == "aten" and base in _HOST_SYNC_ATEN:
            return f"aten.{base}: {_HOST_SYNC_ATEN[base]}"
        if namespace not in _KNOWN_NAMESPACES:
            return f"{qualname}: an op of another library, not known to be capturable (it may read values on the host)"
    elif target not in _PLAIN_CALLABLES and getattr(target, "__module__", "") not in ("math", "_operator"):
        return f"{getattr(target, '__name__', target)}: a Python function, not known to be capturable"
    if _unbacked(node.meta.get("val")):
        return f"{node.target}: its output size depends on the data"
    return None


def capture_blockers(module: torch.nn.Module) -> Dict[str, str]:
    """Node name -> why a CUDA graph cannot capture it, over every graph in ``module`` (empty: the
    whole forward can be captured)."""
    graphs = [m for m in module.modules() if isinstance(m, fx.GraphModule)]
    if not graphs:  # an eager module (transformers mode): nothing to check it by
        return {type(module).__name__: "not an exported graph: its ops cannot be checked for host reads"}
    found: Dict[str, str] = {}
    for m in graphs:
        for node in m.graph.nodes:
            why = node_blocker(node)
            if why is not None:
                found[node.name] = why
    return found


def summarize_blockers(blockers: Mapping[str, str], limit: int = 3) -> str:
    """``"2 node(s): torch_moe_fused (workbench::torch_moe_fused: ...); ..."`` -- reasons grouped so a
    30-layer model names each cause once."""
    by_why: Dict[str, list] = {}
    for name, why in blockers.items():
        by_why.setdefault(why, []).append(name)
    parts = [
        f"{why} (node{'s' if len(names) > 1 else ''} {', '.join(names[:2])}"
        f"{f' and {len(names) - 2} more' if len(names) > 2 else ''})"
        for why, names in list(by_why.items())[:limit]
    ]
    more = f"; +{len(by_why) - limit} more cause(s)" if len(by_why) > limit else ""
    return f"{len(blockers)} node(s): " + "; ".join(parts) + more


__all__ = [
    "HOST_SYNC_TAG",
    "host_sync_tags",
    "host_sync_reasons",
    "node_blocker",
    "capture_blockers",
    "summarize_blockers",
]
