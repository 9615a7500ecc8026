"""Which nodes of an exported graph write into memory another node reads.

Export's training IR keeps in-place ops: ``m = zeros(s, s); m[:, 1::2] = True`` is a ``zeros``
node, a ``slice`` view of it and a ``fill_`` into that view -- and the ``fill_`` is nobody's input.
A rewrite that follows only ``all_input_nodes`` therefore sees ``m`` as all zeros, and a
replacement placed right after ``zeros`` reads it before the write. These helpers let the matcher
and the mask classifier see the writes: a node's storage root (through view ops), and the in-place
ops that write into a root.
"""

from __future__ import annotations

import functools
from typing import Any, Iterable, List, Tuple

import torch
import torch.fx as fx


def is_view(node: fx.Node) -> bool:
    """``node`` returns an alias of its first tensor argument (``slice``, ``view``, ``select``,
    ``transpose``, ...) without writing to it."""
    return node.op == "call_function" and _is_view_op(node.target)


@functools.lru_cache(maxsize=None)
def _is_view_op(target: Any) -> bool:
    if not isinstance(target, torch._ops.OpOverload) or not target._schema.returns:
        return False
    alias = target._schema.returns[0].alias_info
    return alias is not None and not alias.is_write


@functools.lru_cache(maxsize=None)  # a fact of the op's schema; asked for every node of a graph
def _written_positions(target: Any) -> Tuple[Tuple[int, str], ...]:
    if not isinstance(target, torch._ops.OpOverload):
        return ()
    return tuple(
        (i, arg.name)
        for i, arg in enumerate(target._schema.arguments)
        if arg.alias_info is not None and arg.alias_info.is_write
    )


def written_arguments(node: fx.Node) -> List[fx.Node]:
    """The graph nodes ``node`` writes into (the ``self`` of ``fill_``, ``index_put_``, ``copy_``,
    ``out=`` arguments ...): empty for functional ops."""
    if node.op != "call_function":
        return []
    written = []
    for i, name in _written_positions(node.target):
        value = node.args[i] if i < len(node.args) else node.kwargs.get(name)
        if isinstance(value, fx.Node):
            written.append(value)
    return written


def storage_root(node: fx.Node) -> fx.Node:
    """The node whose memory ``node`` is a view of (``node`` itself when it is not a view)."""
    while is_view(node) and node.args and isinstance(node.args[0], fx.Node):
        node = node.args[0]
    return node


def writes_into(root: fx.Node) -> List[fx.Node]:
    """The in-place nodes writing into ``root``'s memory, directly or through views of it, in graph
    order. Follows ``root``'s users (and its views' users) only: no walk over the whole graph."""
    found, stack, seen = [], [root], {root}
    while stack:
        node = stack.pop()
        for user in node.users:
            if any(t is node for t in written_arguments(user)):
                found.append(user)
            if is_view(user) and user.args and user.args[0] is node and user not in seen:
                seen.add(user)
                stack.append(user)
    return sorted(set(found))


def writes_between(start: fx.Node, stop: fx.Node, nodes: Iterable[fx.Node]) -> bool:
    """Whether a node after ``start`` and before ``stop`` (graph order) writes into the memory of
    one of ``nodes``. Walks only that stretch: matchers call it once per match."""
    if start is stop:
        return False
    roots = {storage_root(n) for n in nodes}
    node = start.next
    while node is not stop and node.op != "root":
        if any(storage_root(t) in roots for t in written_arguments(node)):
            return True
        node = node.next
    return False


__all__ = ["is_view", "written_arguments", "storage_root", "writes_into", "writes_between"]
