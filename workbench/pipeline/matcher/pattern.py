"""``Pattern``: one rewrite written as two eager functions, and its traced graph (``traced_pattern``).

``search`` is written the way model code computes something (the RMSNorm chain, rotate-half RoPE,
...) and ``replace`` computes the same with a canonical ``torch.ops.workbench`` op. ``search`` is
traced with ``torch.export`` -- the same tracer that made the model graph -- so the pattern is spelled
in exactly the ops the model graph uses (``aten.to.dtype`` casts, ``aten.linear``, ...). No
hand-written node lists. The traced graph is kept per pattern in the process and on disk
(``pattern_store``); ``engine.PatternMatcher`` matches it against a model graph.
"""

from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Dict, Iterator, List, Mapping, Optional, Tuple

import torch
import torch.fx as fx

from .pattern_store import PatternGraphStore
from .trace import export_graph_module

if TYPE_CHECKING:
    from .engine import Match

aten = torch.ops.aten

# ``ignore`` entry for patterns that contain dropout: in eval mode (``F.dropout(w, p,
# training=False)``, exported as ``aten.dropout(w, p, False)``) it is the identity whatever ``p``,
# so a pattern traced with p=0.0 accepts any. The ``train`` flag is still compared: training-mode
# dropout never matches.
EVAL_DROPOUT = ((aten.dropout.default, "p"),)


@dataclass(frozen=True, eq=False)  # identity hash: patterns are module constants, traced once
class Pattern:
    """One rewrite: ``search`` (model spelling) -> ``replace`` (canonical op)."""

    name: str
    search: Callable[..., Any]
    replace: Callable[..., Any]
    # Builds example tensors for tracing ``search`` (one per positional parameter).
    example_inputs: Callable[[], Tuple[torch.Tensor, ...]]
    # Keyword args of ``search`` -> sentinel values used when tracing; bound as wildcards.
    literals: Mapping[str, Any] = field(default_factory=dict)
    # (op, argument name) pairs whose values are not compared; ``check`` validates them.
    ignore: Tuple[Tuple[Any, str], ...] = ()
    # Ops whose matched nodes may also feed nodes outside the match; they then stay in the graph.
    # (Export spells an fp32 ``x.to(torch.float32)`` as a node that *aliases* x, so the residual
    # branch reads the RMSNorm's first cast.)
    shareable: Tuple[Any, ...] = ()
    # Match -> None to reject, or extra keyword arguments for ``replace``.
    check: Optional[Callable[["Match"], Optional[Dict[str, Any]]]] = None
    # Names of the positional inputs of ``search``; default: read from its signature.
    inputs: Optional[Tuple[str, ...]] = None

    @property
    def input_names(self) -> List[str]:
        if self.inputs is not None:
            return list(self.inputs)
        params = inspect.signature(self.search).parameters.values()
        return [p.name for p in params if p.name not in self.literals]


@functools.lru_cache(maxsize=None)
def traced_pattern(pattern: Pattern) -> fx.Graph:
    """The ATen graph of ``pattern.search`` on its example inputs (cached per pattern in the
    process, and on disk as its structure: ``pattern_store``)."""
    store = PatternGraphStore()
    stored = store.get(pattern)
    if stored is not None:
        return stored
    graph = _trace(pattern)
    store.put(pattern, graph)
    return graph


def _trace(pattern: Pattern) -> fx.Graph:
    gm = export_graph_module(pattern.search, pattern.example_inputs(), kwargs=pattern.literals)
    names = pattern.input_names
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    if len(placeholders) != len(names):
        raise ValueError(f"pattern {pattern.name}: {len(names)} inputs but traced {len(placeholders)}")
    for node, name in zip(placeholders, names):
        node.meta["pattern_input"] = name
    seen = {repr(v) for n in gm.graph.nodes for v in _flat_literals((n.args, n.kwargs))}
    for key, sentinel in pattern.literals.items():
        if repr(sentinel) not in seen:
            raise ValueError(f"pattern {pattern.name}: literal {key}={sentinel!r} not in the trace")
    return gm.graph


def _flat_literals(x: Any) -> Iterator[Any]:
    if isinstance(x, (list, tuple)):
        for y in x:
            yield from _flat_literals(y)
    elif isinstance(x, dict):
        for y in x.values():
            yield from _flat_literals(y)
    elif not isinstance(x, fx.Node):
        yield x


__all__ = ["EVAL_DROPOUT", "Pattern", "traced_pattern"]
