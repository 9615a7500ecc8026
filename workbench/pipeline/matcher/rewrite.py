"""Recording a replacement into the model graph: provenance, inherited metadata, fake values,
and the ``TransformInfo`` every pattern transform returns."""

from __future__ import annotations

import functools
import heapq
import operator
from typing import Any, List, Mapping, Optional, Sequence

import torch
import torch.fx as fx
from torch._guards import detect_fake_mode
from torch._subclasses.fake_tensor import FakeTensor
from torch.fx.experimental.symbolic_shapes import statically_known_true

from ..interface import rewrite_info
from ..snapshot import REPLACES_KEY
from .aliasing import is_view
from .fake_values import fake_call

# Meta keys copied from the match's anchor to replacement nodes (viz groups nodes by module).
_INHERITED_META = ("nn_module_stack", "stack_trace", "source_fn_stack", "torch_fn")


def annotate_new_nodes(
    gm: fx.GraphModule, nodes: Sequence[fx.Node], replaced: Sequence[str], anchor: Optional[fx.Node]
) -> None:
    """Provenance, inherited module metadata and fake values for nodes a transform created."""
    for node in nodes:
        node.meta[REPLACES_KEY] = list(replaced)
        if anchor is not None:
            for key in _INHERITED_META:
                if key in anchor.meta and key not in node.meta:
                    node.meta[key] = anchor.meta[key]
    propagate_fake_values(gm, nodes)


def inserted_between(prev: fx.Node, stop: fx.Node) -> List[fx.Node]:
    """The nodes after ``prev`` and before ``stop``: what ``graph.inserting_before(stop)`` added,
    when ``prev`` was ``stop.prev`` before inserting (no scan of the whole graph per rewrite)."""
    out, node = [], prev.next
    while node is not stop:
        out.append(node)
        node = node.next
    return out


def propagate_fake_values(gm: fx.GraphModule, nodes: Sequence[fx.Node]) -> bool:
    """Set ``meta['val']`` on ``nodes`` (in order) by running them on their inputs' fake values.

    Returns False (leaving later nodes without values) when an input has no fake value; the
    transform's ``run_shape_prop`` flag then repairs the metadata.
    """
    for node in nodes:
        if node.op != "call_function":
            continue
        if any(a.meta.get("val") is None for a in node.all_input_nodes):
            return False
        args, kwargs = fx.node.map_arg((node.args, node.kwargs), lambda a: a.meta["val"])
        flat = [v for v in torch.utils._pytree.tree_leaves((args, kwargs))]
        mode = detect_fake_mode(flat)
        if node.target is operator.getitem:
            node.meta["val"] = args[0][args[1]]
            continue
        if mode is None:
            if any(isinstance(v, torch.Tensor) and not isinstance(v, FakeTensor) for v in flat):
                return False
            node.meta["val"] = node.target(*args, **kwargs)
            continue
        node.meta["val"] = fake_call(mode, node.target, args, kwargs, cache=_cache_pays(node.target))
    return True


@functools.lru_cache(maxsize=None)  # per op: a fact of its schema
def _cache_pays(target: Any) -> bool:
    """Whether the fake mode's dispatch cache saves time on ``target`` with symbolic shapes.

    Not for view ops (a cache hit rebuilds the aliasing output through ``set_``, with sympy on every
    size: a transpose or split costs 2-5x its meta function) nor for our custom ops (their fake
    functions are one ``empty_like``; hashing the symbolic arguments costs more). It does for
    elementwise and composite ops (``mul``, ``silu``, ``reshape``), whose meta functions do
    symbolic stride arithmetic a hit skips. Measured on smollm2's pipeline: its transforms ~0.4 s
    less in all (fuse_gemms, match_*_layout, insert_cached_attention), every value identical."""
    if not isinstance(target, torch._ops.OpOverload):
        return True
    view = any(r.alias_info is not None for r in target._schema.returns)
    composite = torch._C._dispatch_has_kernel_for_dispatch_key(target.name(), "CompositeImplicitAutograd")
    return not ((view and not composite) or target.namespace != "aten")


def repropagate_users(
    gm: fx.GraphModule, roots: Sequence[fx.Node], known: Optional[Mapping[fx.Node, Any]] = None
) -> bool:
    """Re-derive ``meta['val']`` downstream of ``roots`` (nodes whose values a rewrite changed, e.g.
    in strides) in graph order, stopping wherever a recomputed value equals the recorded one.

    A local alternative to a whole-graph shape propagation (~1 s on a 30-layer model): a fused GEMM
    changes the strides of the split outputs and of the views reading them, and nothing past the next
    copying op. ``known``: values the caller already derived from the new inputs for some of these
    nodes (taken as they are instead of running the op again). Returns False when a value cannot be
    derived (the caller then reports stale shapes).
    """
    index = {n: i for i, n in enumerate(gm.graph.nodes)}
    heap = [(index[u], u.name, u) for r in roots for u in r.users]
    heapq.heapify(heap)
    seen = set()
    known = known or {}
    while heap:
        _, _, node = heapq.heappop(heap)
        if node in seen or node.op != "call_function":
            continue
        seen.add(node)
        old = node.meta.get("val")
        if node in known:
            node.meta["val"] = known[node]
        elif not _propagate_keeping_views_valid(gm, node):
            return False
        if _same_value(old, node.meta.get("val")):
            continue
        for user in node.users:
            heapq.heappush(heap, (index[user], user.name, user))
    return True


def _propagate_keeping_views_valid(gm: fx.GraphModule, node: fx.Node) -> bool:
    """``propagate_fake_values`` of one node; a ``view`` its new input's strides no longer allow
    becomes a ``reshape`` (the same values: a view where the strides allow it, else a copy).

    Export drops a ``.contiguous()`` that was a no-op when traced: CPU SDPA returns its [b, n, s, d]
    output laid out as [b, s, n, d], so ``o.transpose(1, 2).contiguous().view(b, s, -1)`` is
    recorded as ``transpose -> view``. A rewrite that returns another layout (``torch_attention``'s
    contiguous output, a layout change, a cancelled transpose pair) leaves that ``view`` on memory
    it cannot view: a run-time error, found here at rewrite time instead."""
    try:
        return propagate_fake_values(gm, [node])
    except Exception:  # noqa: BLE001 - the fake view's stride complaint (RuntimeError or a guard)
        if node.target is not torch.ops.aten.view.default:
            raise
    node.target = torch.ops.aten.reshape.default
    return propagate_fake_values(gm, [node])


def refresh_after_rewrite(gm: fx.GraphModule, pairs: Sequence[tuple]) -> bool:
    """After ``old`` nodes were replaced by ``new`` ones (``pairs`` of (old value, new node)):
    re-derive the fake values downstream of every ``new`` whose value differs from the ``old`` one
    in shape or strides (views it broke become reshapes). Free where nothing changed. Returns False
    when a value cannot be derived."""
    changed = [
        new
        for old, new in pairs
        if isinstance(new, fx.Node) and _reaches_view(new) and not _same_value(old, new.meta.get("val"))
    ]
    return repropagate_users(gm, changed) if changed else True


def _reaches_view(node: fx.Node, depth: int = 4) -> bool:
    """Whether a ``view`` reads ``node``'s memory layout within ``depth`` steps through ops whose
    output strides follow their input's (views, pointwise ops). Only such a view can break when a
    rewrite changes strides; everywhere else the fake values' strides are not worth re-deriving
    (~6 ms per symbolic fake op: 0.5 s a pipeline for a transposed attention output per layer)."""
    frontier = [node]
    for _ in range(depth):
        nxt = []
        for n in frontier:
            for u in n.users:
                if u.target is torch.ops.aten.view.default:
                    return True
                if is_view(u) or (u.op == "call_function" and _is_pointwise(u.target)):
                    nxt.append(u)
        frontier = nxt
    return False


@functools.lru_cache(maxsize=None)
def _is_pointwise(target: Any) -> bool:
    return isinstance(target, torch._ops.OpOverload) and torch.Tag.pointwise in target.tags


def _same_value(a: Any, b: Any) -> bool:
    """Same fake value for metadata purposes: dtype, device, sizes and strides (symbolic ones
    provably equal); containers element-wise; other values by equality."""
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return (
            a.dtype == b.dtype
            and a.device == b.device
            and same_shape(a.shape, b.shape)
            and same_shape(a.stride(), b.stride())
        )
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same_value(x, y) for x, y in zip(a, b))
    if isinstance(a, (int, torch.SymInt)) and isinstance(b, (int, torch.SymInt)):
        return same_size(a, b)
    try:
        return bool(a == b)
    except Exception:  # noqa: BLE001 - incomparable values are "changed"
        return False


def erase_dead(graph: fx.Graph, nodes: Sequence[fx.Node]) -> None:
    """Erase ``nodes`` that are now unused (users first), leaving any still-used ones."""
    pending = [n for n in nodes if not n._erased]
    changed = True
    while changed:
        changed = False
        for node in list(pending):
            if not node.users:
                graph.erase_node(node)
                pending.remove(node)
                changed = True


def same_size(a: Any, b: Any) -> bool:
    """Whether two (possibly symbolic) sizes are provably equal."""
    try:
        return bool(statically_known_true(a == b))
    except Exception:  # noqa: BLE001 - unknown relation means "not provably equal"
        return False


def same_shape(a: Sequence[Any], b: Sequence[Any]) -> bool:
    return len(a) == len(b) and all(same_size(x, y) for x, y in zip(a, b))


def match_info(gm: fx.GraphModule, counts: Mapping[str, int], **details: Any):
    """The TransformInfo of a pattern transform: matches per pattern (``interface.rewrite_info``)."""
    return rewrite_info(gm, sum(counts.values()), {"matches": dict(counts), **details})


__all__ = [
    "annotate_new_nodes",
    "inserted_between",
    "propagate_fake_values",
    "refresh_after_rewrite",
    "erase_dead",
    "same_size",
    "same_shape",
    "match_info",
]
