"""Fake values of new nodes, shared between nodes that compute the same thing on the same shapes.

A rewrite inserts the same few ops once per layer (30 ``torch_rope``/``torch_attention``/``rmsnorm``
nodes on smollm2), each on inputs of the same symbolic sizes. Running an op under a fake mode with
symbolic shapes costs ~1 ms (sympy on every size, and the mode's own dispatch cache rebuilds a hit
through ``empty_strided``); the answer depends only on the inputs' metadata. ``OutputMemo`` keeps
the first answer per (op, input description) and hands the same fake value to later nodes -- as the
stamped layers of an export share their values. Measured on smollm2's pipeline: 1.4 s of fake
propagation in all before, see ``docs/benchmarks.md`` for after.

Views are shared too: a fake value is metadata (sizes, strides, offset), and no pass reads a
value's base or storage -- the export cache's graphs share their views' values the same way.
Not shared (always run): in-place and ``out=`` ops, ops whose output has symbols its inputs lack
(data-dependent sizes: each node needs its own unbacked symbol), outputs carrying a constant, real
tensors among the arguments, and any argument this module cannot describe.
"""

from __future__ import annotations

import functools
import weakref
from typing import Any, Dict, Hashable, Optional, Tuple

import torch
from torch._subclasses.fake_tensor import FakeTensor

from ..graph.utils import size_expr, symbolic_fake_mode

_Key = Tuple[Any, ...]
_Unknown = object()  # an argument with no description: no sharing


def fake_call(mode: Any, target: Any, args: Any, kwargs: Any, cache: bool = True) -> Any:
    """``target(*args, **kwargs)`` on fake values under ``mode`` (``symbolic_fake_mode``), or the
    value an earlier call with equally described inputs got (``OutputMemo``)."""
    memo = OutputMemo.for_mode(mode)
    key = memo_key(target, args, kwargs)
    if key is not None and key in memo:
        return memo[key]
    with symbolic_fake_mode(mode, cache=cache):
        value = target(*args, **kwargs)
    if key is not None and shareable_output(value, args, kwargs):
        memo[key] = value
    return value


class OutputMemo:
    """Per-fake-mode memo (held weakly: it lives as long as the graph's fake mode)."""

    _by_mode: "weakref.WeakKeyDictionary[Any, Dict[_Key, Any]]" = weakref.WeakKeyDictionary()

    @classmethod
    def for_mode(cls, mode: Any) -> Dict[_Key, Any]:
        memo = cls._by_mode.get(mode)
        if memo is None:
            memo = cls._by_mode[mode] = {}
        return memo


def memo_key(target: Any, args: Any, kwargs: Any) -> Optional[_Key]:
    """A hashable description of a call, or None when it may not be shared."""
    if not _shareable_op(target):
        return None
    desc = _describe((args, kwargs))
    if desc is _Unknown:
        return None
    try:
        hash(desc)
    except TypeError:
        return None
    return (target, desc)


def shareable_output(value: Any, args: Any, kwargs: Any) -> bool:
    """Whether ``value`` (an op's fake output) may stand for later calls with equal descriptions:
    fake tensors (or tuples of them) without constants, whose symbols all occur in the inputs."""
    leaves = torch.utils._pytree.tree_leaves(value)
    if not leaves or not all(isinstance(v, FakeTensor) and v.constant is None for v in leaves):
        return False
    inputs = _symbols(torch.utils._pytree.tree_leaves((args, kwargs)))
    return _symbols(leaves) <= inputs


@functools.lru_cache(maxsize=None)  # a fact of the op's schema
def _shareable_op(target: Any) -> bool:
    if not isinstance(target, torch._ops.OpOverload):
        return False
    schema = target._schema
    if any(a.alias_info is not None and a.alias_info.is_write for a in schema.arguments):
        return False  # in-place and out= ops write an input
    nondeterministic_shape = (torch.Tag.dynamic_output_shape, torch.Tag.data_dependent_output)
    return not any(tag in target.tags for tag in nondeterministic_shape)


def _describe(x: Any) -> Hashable:
    if isinstance(x, torch.Tensor):
        if not isinstance(x, FakeTensor):
            return _Unknown  # a real tensor's values may matter to the fake mode (constants)
        return (
            "T",
            tuple(size_expr(s) for s in x.shape),
            tuple(size_expr(s) for s in x.stride()),
            size_expr(x.storage_offset()),
            x.dtype,
            str(x.device),
            x.requires_grad,
        )
    if isinstance(x, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        return ("S", type(x).__name__, x.node.expr)
    if isinstance(x, (list, tuple)):
        parts = tuple(_describe(y) for y in x)
        return _Unknown if any(p is _Unknown for p in parts) else (type(x).__name__, parts)
    if isinstance(x, dict):
        items = tuple((k, _describe(v)) for k, v in sorted(x.items()))
        return _Unknown if any(v is _Unknown for _, v in items) else ("D", items)
    if x is None or isinstance(
        x, (bool, int, float, str, torch.dtype, torch.device, torch.layout, torch.memory_format)
    ):
        return (type(x).__name__, x)
    return _Unknown


def _symbols(values: Any) -> set:
    out: set = set()
    for v in values:
        if isinstance(v, torch.Tensor):
            for s in (*v.shape, *v.stride(), v.storage_offset()):
                if isinstance(s, torch.SymInt):
                    out |= s.node.expr.free_symbols
        elif isinstance(v, (torch.SymInt, torch.SymFloat, torch.SymBool)):
            out |= v.node.expr.free_symbols
    return out
