"""A small declarative pattern matcher over exported ATen graphs: ``PatternMatcher`` finds the
matches of ``Pattern``s (``pattern.py``) and ``replace_match`` rewrites them.

Matching walks the traced pattern backwards from its output(s):

* pattern placeholders bind to any graph node (consistently: a placeholder used twice must meet
  the same node twice);
* ``literals`` are keyword arguments of ``search`` traced with sentinel values; a sentinel in the
  traced graph matches any literal in the model graph and is bound under its name (e.g. ``eps``);
* ``ignore`` lists ``(op, argument name)`` pairs whose values may differ (shapes in reshapes, slice
  bounds): ``check`` must then validate them, usually from ``meta['val']`` shapes;
* ``aten.add.Tensor`` / ``aten.mul.Tensor`` match in either argument order;
* a match is only used if its inner nodes feed nothing outside the match (else the replaced
  computation would have to stay anyway).

``replace`` is called with ``torch.fx.Proxy`` objects for the bound inputs, so it records its ops
straight into the model graph; each new node gets ``meta['val']`` (the graph's fake mode),
the replaced nodes' names in ``meta['wb_replaces']`` and the anchor's module-stack metadata.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, Dict, Iterator, List, Optional, Sequence, Tuple

import torch
import torch.fx as fx

from ...ops.library import MISSING, schema_arguments
from ..interface import Transform, TransformInfo
from .aliasing import writes_between
from .anchors import PatternOpsCache
from .pattern import Pattern, traced_pattern
from .rewrite import annotate_new_nodes, erase_dead, inserted_between, match_info, refresh_after_rewrite

if TYPE_CHECKING:
    from ..context import PipelineContext

aten = torch.ops.aten

COMMUTATIVE = {aten.add.Tensor, aten.mul.Tensor}


def named_args(node: fx.Node) -> List[Tuple[str, Any]]:
    """``node``'s arguments as (name, value) for every schema argument, defaults filled in.

    Makes ``mean(x, [-1], True)`` and ``mean(x, [-1], keepdim=True)`` compare equal.
    """
    if isinstance(node.target, torch._ops.OpOverload):
        return [(arg.name, None if value is MISSING else value) for arg, value in schema_arguments(node)]
    return [(str(i), a) for i, a in enumerate(node.args)] + sorted(node.kwargs.items())


@dataclass
class _State:
    nodes: Dict[fx.Node, fx.Node] = field(default_factory=dict)  # pattern node -> graph node
    inputs: Dict[str, Any] = field(default_factory=dict)  # pattern input name -> graph node
    literals: Dict[str, Any] = field(default_factory=dict)

    def copy(self) -> "_State":
        return _State(dict(self.nodes), dict(self.inputs), dict(self.literals))


@dataclass
class Match:
    """A found occurrence of a pattern: what ``check`` and ``replace`` get to see."""

    pattern: Pattern
    gm: fx.GraphModule
    inputs: Dict[str, fx.Node]  # pattern input name -> graph node
    literals: Dict[str, Any]  # literal name -> value found in the graph
    nodes: Dict[fx.Node, fx.Node]  # pattern node -> graph node
    outputs: List[fx.Node]  # graph nodes computing the pattern's outputs

    def val(self, name: str) -> Any:
        """``meta['val']`` (fake tensor) of a bound input."""
        node = self.inputs[name]
        return node.meta.get("val") if isinstance(node, fx.Node) else node

    def matched(self, target: Any) -> List[fx.Node]:
        """Graph nodes matched to pattern nodes calling ``target`` (in pattern order)."""
        return [g for p, g in self.nodes.items() if p.target == target]

    @property
    def graph_nodes(self) -> List[fx.Node]:
        return list(self.nodes.values())


def replace_match(match: Match) -> bool:
    """Record ``pattern.replace`` into the graph and reroute the outputs' users to it.

    Returns False (graph untouched) if the replacement cannot be placed. It goes where the match's
    first output was computed (or right after the last input, if that comes later), which must come
    before every user of the outputs. Placing it there, not right after the inputs, keeps the reads
    after the in-place writes that came before them (``m[:, 1::2] = True`` into a mask); a match
    whose inputs are written between its first node and that place is not replaced at all (the
    original nodes read the memory before the write, the replacement would read it after).
    """
    gm, graph = match.gm, match.gm.graph
    order = {n: i for i, n in enumerate(graph.nodes)}
    input_nodes = [n for n in match.inputs.values() if isinstance(n, fx.Node)]
    last = max(input_nodes, key=order.__getitem__) if input_nodes else next(iter(graph.nodes))
    first_output = min(match.outputs, key=order.__getitem__)
    at = first_output if order[first_output] > order[last] else last.next
    first_user = min((order[u] for o in match.outputs for u in o.users), default=len(order))
    if order[at] > first_user or order[last] >= first_user:
        return False
    if writes_between(min(match.graph_nodes, key=order.__getitem__), at, input_nodes):
        return False
    tracer = fx.proxy.GraphAppendingTracer(graph)
    args = [fx.Proxy(match.inputs[name], tracer) for name in match.pattern.input_names]
    prev = at.prev
    with graph.inserting_before(at):
        result = match.pattern.replace(*args, **match.literals)
    results = list(result) if isinstance(result, (list, tuple)) else [result]
    if len(results) != len(match.outputs):
        raise ValueError(f"pattern {match.pattern.name}: replace returned {len(results)} outputs")
    new_nodes = inserted_between(prev, at)
    pairs = []
    for old, new in zip(match.outputs, results):
        new = new.node if isinstance(new, fx.Proxy) else new
        old.replace_all_uses_with(new)
        pairs.append((old.meta.get("val"), new))
    names = {n: n.name for n in match.graph_nodes}
    erase_dead(graph, match.graph_nodes)
    replaced = [name for n, name in names.items() if n._erased]  # shared nodes stay: not replaced
    annotate_new_nodes(gm, new_nodes, replaced, anchor=match.outputs[0])
    refresh_after_rewrite(gm, pairs)  # e.g. a contiguous output where the old one was strided
    return True


class PatternMatcher:
    """Applies an ordered list of patterns to a graph; created per transform call."""

    def __init__(self, patterns: Sequence[Pattern] = ()):
        self.patterns: List[Pattern] = list(patterns)

    def register(self, pattern: Pattern) -> None:
        self.patterns.append(pattern)

    # -- public API ------------------------------------------------------------------------
    def apply(self, gm: fx.GraphModule) -> Dict[str, int]:
        """Replace every match of every pattern (in order); returns matches per pattern name."""
        counts: Dict[str, int] = {}
        known_ops = PatternOpsCache()
        for pattern in self.patterns:
            n = 0
            known = known_ops.ops(pattern)
            if known is not None:
                present = {x.target for x in gm.graph.nodes if x.op == "call_function"}
                if not all(op in present for op in known):
                    counts[pattern.name] = 0  # one of its ops is not in the graph: no match, no trace
                    continue
            traced = traced_pattern(pattern)
            anchor_target = _outputs(traced)[0].target
            known_ops.remember(pattern, _pattern_ops(traced, anchor_target))
            for node in [x for x in gm.graph.nodes if x.target == anchor_target]:
                if node._erased or node.op != "call_function":
                    continue
                match = self.match_at(gm, pattern, node)
                if match is not None and replace_match(match):
                    n += 1
            counts[pattern.name] = n
        return counts

    def match_at(self, gm: fx.GraphModule, pattern: Pattern, node: fx.Node) -> Optional[Match]:
        """The first valid match of ``pattern`` whose first output is ``node``, if any."""
        graph = traced_pattern(pattern)
        outs = _outputs(graph)
        by_target: Dict[Any, List[fx.Node]] = {}
        for state in self._node(pattern, outs[0], node, _State()):
            for full in self._more_outputs(pattern, gm, outs[1:], state, by_target):
                match = Match(
                    pattern, gm, dict(full.inputs), dict(full.literals), dict(full.nodes), [full.nodes[o] for o in outs]
                )
                if not _self_contained(match):
                    continue
                extras = pattern.check(match) if pattern.check else {}
                if extras is None:
                    continue
                match.literals.update(extras)
                return match
        return None

    # -- backtracking search ---------------------------------------------------------------
    def _more_outputs(self, pattern, gm, outs, state, by_target) -> Iterator[_State]:
        if not outs:
            yield state
            return
        out, rest = outs[0], outs[1:]
        if out in state.nodes:
            yield from self._more_outputs(pattern, gm, rest, state, by_target)
            return
        if out.target not in by_target:
            by_target[out.target] = [n for n in gm.graph.nodes if n.target == out.target]
        for cand in by_target[out.target]:
            if cand._erased:
                continue
            for s in self._node(pattern, out, cand, state):
                yield from self._more_outputs(pattern, gm, rest, s, by_target)

    def _node(self, pattern: Pattern, p: fx.Node, g: Any, st: _State) -> Iterator[_State]:
        if p.op == "placeholder":
            name = p.meta["pattern_input"]
            if name in st.inputs:
                if st.inputs[name] is g:
                    yield st
                return
            if isinstance(g, fx.Node) and g not in st.nodes.values():
                st = st.copy()
                st.inputs[name] = g
                yield st
            return
        if p.op == "get_attr":  # constants captured by the pattern: rare, require the same op
            return
        if not isinstance(g, fx.Node) or g.op != "call_function" or g.target != p.target:
            return
        if p in st.nodes:
            if st.nodes[p] is g:
                yield st
            return
        if g in st.nodes.values() or g in st.inputs.values():
            return
        st = st.copy()
        st.nodes[p] = g
        p_args, g_args = named_args(p), named_args(g)
        if len(p_args) != len(g_args):
            return
        ignored = {name for op, name in pattern.ignore if op == p.target}
        # Sentinels only count where the pattern passed a value: a filled-in default (add's
        # alpha=1) must not be mistaken for a literal sentinel that happens to equal it.
        explicit = {name for name, _ in p_args[: len(p.args)]} | set(p.kwargs)
        pairs = [(pv, gv, name in explicit) for (name, pv), (_, gv) in zip(p_args, g_args) if name not in ignored]
        orders = [pairs]
        if p.target in COMMUTATIVE and len(pairs) >= 2 and not ignored:
            (a, ga, wa), (b, gb, wb_) = pairs[0], pairs[1]
            orders.append([(a, gb, wa), (b, ga, wb_)] + pairs[2:])
        for order in orders:
            yield from self._values(pattern, order, st)

    def _values(self, pattern, pairs, st) -> Iterator[_State]:
        if not pairs:
            yield st
            return
        (pv, gv, wild), rest = pairs[0], pairs[1:]
        for s in self._value(pattern, pv, gv, st, wild):
            yield from self._values(pattern, rest, s)

    def _value(self, pattern, pv, gv, st, wild=True) -> Iterator[_State]:
        if isinstance(pv, fx.Node):
            yield from self._node(pattern, pv, gv, st)
        elif isinstance(pv, (list, tuple)):
            if isinstance(gv, (list, tuple)) and len(pv) == len(gv):
                yield from self._values(pattern, [(a, b, wild) for a, b in zip(pv, gv)], st)
        else:
            name = _sentinel_name(pattern, pv) if wild else None
            if name is not None:
                if isinstance(gv, fx.Node):
                    return
                if name in st.literals:
                    if _same_literal(st.literals[name], gv):
                        yield st
                    return
                st = st.copy()
                st.literals[name] = gv
                yield st
            elif _same_literal(pv, gv):
                yield st


def _sentinel_name(pattern: Pattern, value: Any) -> Optional[str]:
    for key, sentinel in pattern.literals.items():
        if _same_literal(sentinel, value):
            return key
    return None


def _same_literal(a: Any, b: Any) -> bool:
    """Equal literals of the same type (``1`` and ``1.0`` trace to different overloads)."""
    if isinstance(a, fx.Node) or isinstance(b, fx.Node):
        return a is b
    if type(a) is not type(b):
        return False
    try:
        return bool(a == b)
    except Exception:  # noqa: BLE001 - incomparable values are different values
        return False


def _pattern_ops(graph: fx.Graph, anchor: Any) -> List[Any]:
    """The distinct ATen/custom ops of ``graph``'s call_function nodes, ``anchor`` first (empty when
    the anchor is not such an op: nothing is remembered then). A graph without one of them cannot
    match: pattern nodes match only nodes of the same target."""
    if not isinstance(anchor, torch._ops.OpOverload):
        return []
    ops = [anchor]
    for node in graph.nodes:
        if node.op == "call_function" and isinstance(node.target, torch._ops.OpOverload) and node.target not in ops:
            ops.append(node.target)
    return ops


def _outputs(graph: fx.Graph) -> List[fx.Node]:
    out = next(n for n in graph.nodes if n.op == "output").args[0]
    outs = list(out) if isinstance(out, (list, tuple)) else [out]
    return outs


def _self_contained(match: Match) -> bool:
    """Inner nodes (all but outputs and ``shareable`` ones) may only be used inside the match."""
    inside = set(match.nodes.values())
    inner = inside - set(match.outputs)
    shareable = set(match.pattern.shareable)
    return all(u in inside for n in inner if n.target not in shareable for u in n.users)


class PatternTransform(Transform):
    """A transform that rewrites the matches of a fixed set of patterns (``patterns``) and reports
    the matches per pattern."""

    patterns: ClassVar[Sequence[Pattern]] = ()

    def active_patterns(self) -> Sequence[Pattern]:
        """The patterns this run matches: ``patterns``, unless a transform decides at run time."""
        return self.patterns

    def _apply(self, gm: fx.GraphModule, ctx: "PipelineContext") -> Tuple[torch.nn.Module, TransformInfo]:
        return match_info(gm, PatternMatcher(self.active_patterns()).apply(gm))


__all__ = ["PatternMatcher", "PatternTransform", "Match", "named_args", "COMMUTATIVE", "replace_match"]
