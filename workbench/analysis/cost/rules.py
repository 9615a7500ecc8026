"""FLOPs and bytes moved by one graph node at one phase (``node_cost``), with its op category.

One rule per kind of op, read from the node's fake values (``node.meta["val"]``) evaluated at the
phase's sizes (``SizeBinding``):

- matmuls: ``aten.mm/addmm/bmm/baddbmm`` through torch's own ``torch.utils.flop_counter`` formulas
  (called on meta tensors of the concrete shapes); ``aten.linear``, ``aten.matmul`` and every
  ``workbench::*linear*`` op (dense, fused, quantized, CPU-layout) as ``2 * out.numel() * K``. Bytes
  are the real bytes of every operand: a packed int4 weight ``[N, K/2]`` uint8 plus its scales and
  offsets is what it is (0.5 B/weight + scales), fp8 1 B, nvfp4 0.5 B + one fp8 scale per 16.
- attention (``torch_attention``, ``torch_attention_sdpa``, ``aten.scaled_dot_product_attention``):
  ``2 * h * (d + d_v)`` FLOPs per visible (query, key) pair -- ``4*b*h*s*kv*d`` without a mask,
  the causal triangle (and sliding window) counted exactly -- and q, k, v, out once each (a fused
  kernel keeps the scores on chip). Cached attention (any backend: same schema) reads the
  ``kv_len`` cached positions of each sequence from the pages it touches, plus the step's k/v
  written into them.
- MoE ops: only the active experts' weights, ``min(E, tokens * top_k)`` of them.
- norms, RoPE, SiLU-and-mul, pointwise and reductions: a few FLOPs per element, inputs + outputs.
- row gathers (embedding, index_select): the rows read, not the table.
- views, size queries, Python scalar math, no-op casts: 0 bytes, no launch.
- anything else: inputs + outputs, one FLOP per output element (rule ``generic``).

Backends (``cpu_*``, ``triton_*``, ``flashinfer_*``) cost what their canonical ``torch_*`` op
costs: the rule is picked by the op's base name.

``float_bytes``: count floating tensors wider than this as this many bytes per element (2: the graph
as it would run in bfloat16, the pipeline's default dtype on a GPU); None: as the graph has them.
"""

from __future__ import annotations

import math
import operator
import re
from dataclasses import dataclass
from typing import Any, Iterator, List, Optional, Tuple

import torch
import torch.fx as fx
import torch.utils.flop_counter as flop_counter

from .categories import GATHER_OPS, base_name, category_of, op_parts
from .sizes import SizeBinding

aten = torch.ops.aten
COPY_OPS = frozenset("clone contiguous _to_copy copy copy_".split())
TORCH_FLOPS = {aten.mm, aten.addmm, aten.bmm, aten.baddbmm}


@dataclass
class NodeCost:
    flops: float
    bytes: float
    category: str
    launches: int
    rule: str


def _val(node: Any, extra: Optional[dict] = None) -> Any:
    """The fake value of an argument node (``extra``: values computed for nodes a transform left
    without one; a real tensor for a ``get_attr`` without one)."""
    if not isinstance(node, fx.Node):
        return node
    v = node.meta.get("val")
    if v is None and extra:
        v = extra.get(node)
    if v is None and node.op == "get_attr" and node.graph.owning_module is not None:
        obj: Any = node.graph.owning_module
        for part in str(node.target).split("."):
            obj = getattr(obj, part, None)
        v = obj
    return v


def _tensor_args(node: fx.Node, extra: Optional[dict] = None) -> Iterator[Tuple[Any, torch.Tensor]]:
    """(argument node, value) of each distinct tensor the node reads (lists flattened)."""
    seen = set()
    for a in node.all_input_nodes:
        if a in seen:
            continue
        seen.add(a)
        v = _val(a, extra)
        if isinstance(v, torch.Tensor):
            yield a, v
        elif isinstance(v, (list, tuple)):
            for x in v:
                if isinstance(x, torch.Tensor):
                    yield a, x


def _outputs(node: fx.Node, extra: Optional[dict] = None) -> List[torch.Tensor]:
    v = _val(node, extra)
    if isinstance(v, torch.Tensor):
        return [v]
    if isinstance(v, (list, tuple)):
        return [x for x in v if isinstance(x, torch.Tensor)]
    return []


class Costing:
    """Bytes and sizes of one graph at one phase (``SizeBinding``), with the dtype rule."""

    def __init__(self, sizes: SizeBinding, float_bytes: Optional[int] = None):
        self.sizes, self.float_bytes = sizes, float_bytes
        self.extra = sizes.extra

    def itemsize(self, t: torch.Tensor) -> float:
        es = t.element_size()
        if self.float_bytes is not None and t.dtype.is_floating_point and es > self.float_bytes:
            return self.float_bytes
        return es

    def nbytes(self, t: torch.Tensor) -> float:
        return self.sizes.numel(t) * self.itemsize(t)

    def arg_bytes(self, arg: Any, t: torch.Tensor) -> float:
        """Bytes read of an input: a cache tensor (a cached graph's placeholder) only in the rows
        the step touches -- its sequences' state slots, or the pages of their context."""
        b = self.nbytes(t)
        if not (self.sizes.cached and isinstance(arg, fx.Node) and arg.op == "placeholder" and t.dim() >= 2):
            return b
        name = str(arg.target)
        if name in ("input_ids", "position_ids", "page_table"):
            return b
        rows = self.sizes.size(t.shape[0])
        p = self.sizes.phase
        if self.sizes.page_size > 1 and t.dim() >= 3 and self.sizes.size(t.shape[1]) == self.sizes.page_size:
            touched = p.batch * math.ceil(p.context / self.sizes.page_size)
        else:
            touched = p.batch
        return b * min(touched, rows) / max(rows, 1)


def _generic(c: Costing, node: fx.Node) -> Tuple[float, float]:
    outs = _outputs(node, c.extra)
    read = sum(c.arg_bytes(a, t) for a, t in _tensor_args(node, c.extra))
    return float(sum(c.sizes.numel(o) for o in outs)), read + sum(c.nbytes(o) for o in outs)


def _arg(node: fx.Node, i: int, name: str, default: Any = None) -> Any:
    if name in node.kwargs:
        return node.kwargs[name]
    return node.args[i] if len(node.args) > i else default


def _visible_pairs(s_q: int, s_k: int, causal: bool, window: Optional[int]) -> int:
    """(query, key) pairs a row-block of ``s_q`` queries over ``s_k`` keys attends (bottom-right
    causal alignment, keys within ``window`` of the query)."""
    if not causal and not window:
        return s_q * s_k
    total = 0
    for i in range(s_q):
        vis = s_k - s_q + i + 1 if causal else s_k
        total += max(min(vis, window) if window else vis, 0)
    return total


def _attention(c: Costing, node: fx.Node, bnsd: bool) -> Tuple[float, float]:
    q, k, v = (_val(_arg(node, i, n), c.extra) for i, n in enumerate(("query", "key", "value")))
    sq, sk, sv = c.sizes.shape(q), c.sizes.shape(k), c.sizes.shape(v)
    layout = _arg(node, 10, "layout", "bnsd")
    if bnsd or layout == "bnsd":
        b, h, s_q, d = sq
        s_k, dv = sk[-2], sv[-1]
    else:
        b, s_q, h, d = sq
        s_k, dv = sk[-3], sv[-1]
    causal = bool(_arg(node, 5, "is_causal", False))
    window = None if bnsd else _arg(node, 8, "sliding_window")
    pairs = b * _visible_pairs(s_q, s_k, causal, window)
    _, read = _generic(c, node)
    return 2.0 * h * (d + dv) * pairs, read


def _cached_attention(c: Costing, node: fx.Node) -> Tuple[float, float]:
    """q [1, T, Hq, D], k/v [1, T, Hkv, D], k_cache/v_cache [pages, page_size, Hkv, D]: each
    sequence's ``tokens`` queries attend ``kv_len`` cached + its own new positions."""
    args = [_val(a, c.extra) for a in node.args[:5]]
    q, k, v, k_cache, v_cache = args
    p = c.sizes.phase
    h, d = c.sizes.size(q.shape[-2]), c.sizes.size(q.shape[-1])
    dv = c.sizes.size(v_cache.shape[-1])
    window = node.kwargs.get("sliding_window")
    pairs = p.batch * _visible_pairs(p.tokens, p.context, True, window)
    cached = min(p.kv_len, window) if window else p.kv_len
    hkv = c.sizes.size(k_cache.shape[-2])
    cache_read = p.batch * cached * hkv * (d + dv) * c.itemsize(k_cache)
    new_kv = c.nbytes(k) + c.nbytes(v)
    out = sum(c.nbytes(o) for o in _outputs(node, c.extra))
    return 2.0 * h * (d + dv) * pairs, c.nbytes(q) + 2 * new_kv + cache_read + out


def _linear(c: Costing, node: fx.Node) -> Tuple[float, float]:
    x = _val(node.args[0], c.extra)
    outs = _outputs(node, c.extra)
    k = c.sizes.size(x.shape[-1])
    _, moved = _generic(c, node)
    return 2.0 * sum(c.sizes.numel(o) for o in outs) * k, moved


def _weight_elems(t: torch.Tensor, sizes: SizeBinding) -> int:
    """Logical weights in a (maybe packed) tensor: uint8 holds two 4-bit codes."""
    return sizes.numel(t) * (2 if t.dtype == torch.uint8 else 1)


def _mlp(c: Costing, node: fx.Node) -> Tuple[float, float]:
    """Whole SwiGLU MLP in one op: 2 FLOPs per weight per token."""
    x = _val(node.args[0], c.extra)
    tokens = c.sizes.numel(x) // max(c.sizes.size(x.shape[-1]), 1)
    weights = [
        t for a, t in _tensor_args(node, c.extra) if t.dim() == 2 and isinstance(a, fx.Node) and a.op == "get_attr"
    ]
    _, moved = _generic(c, node)
    return 2.0 * tokens * sum(_weight_elems(w, c.sizes) for w in weights), moved


def _moe(c: Costing, node: fx.Node) -> Tuple[float, float]:
    """Stacked expert weights [E, ...] (or per-expert lists): the active experts' bytes only."""
    x = _val(node.args[0], c.extra)
    tokens = c.sizes.numel(x) // max(c.sizes.size(x.shape[-1]), 1)
    top_k, experts, expert_bytes, expert_elems, rest = 1, 0, 0.0, 0, 0.0
    for _, t in _tensor_args(node, c.extra):
        if t.dim() == 2 and not t.is_floating_point() and t is not x:
            top_k = max(top_k, c.sizes.size(t.shape[-1]))
    for a in node.all_input_nodes:
        v = _val(a, c.extra)
        if isinstance(v, torch.Tensor) and v.dim() == 3 and v is not x:
            experts = max(experts, c.sizes.size(v.shape[0]))
            expert_bytes += c.nbytes(v)
            expert_elems += _weight_elems(v, c.sizes)
        elif isinstance(v, (list, tuple)) and v and all(isinstance(t, torch.Tensor) for t in v):
            experts = max(experts, len(v))
            expert_bytes += sum(c.nbytes(t) for t in v)
            expert_elems += sum(_weight_elems(t, c.sizes) for t in v)
        elif isinstance(v, torch.Tensor):
            rest += c.nbytes(v)
    out = sum(c.nbytes(o) for o in _outputs(node, c.extra))
    if not experts:
        return _generic(c, node)
    active = min(experts, tokens * top_k)
    return 2.0 * tokens * top_k * expert_elems / experts, expert_bytes * active / experts + rest + out


def _gather(c: Costing, node: fx.Node) -> Tuple[float, float]:
    outs = _outputs(node, c.extra)
    # the indices: integer inputs that are not the (maybe int8-quantized) table itself
    idx = sum(
        c.nbytes(t)
        for a, t in _tensor_args(node, c.extra)
        if not t.is_floating_point() and not (isinstance(a, fx.Node) and a.op == "get_attr")
    )
    return 0.0, 2.0 * sum(c.nbytes(o) for o in outs) + idx


def node_cost(node: fx.Node, sizes: SizeBinding, float_bytes: Optional[int] = None) -> NodeCost:
    """Cost of ``node`` at the phase of ``sizes`` (see the module docstring for the rules)."""
    if node.op != "call_function":
        return NodeCost(0.0, 0.0, "view", 0, "no-op")
    if node.target in (operator.getitem,) or not isinstance(
        node.target, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)
    ):
        return NodeCost(0.0, 0.0, "view", 0, "python")
    c = Costing(sizes, float_bytes)
    ns, name = op_parts(node)
    cat = category_of(ns, name)
    base = base_name(name) if ns == "workbench" else name
    if cat == "view":
        return NodeCost(0.0, 0.0, "view", 0, "view")
    if ns == "aten" and name == "to":
        src = _val(node.args[0], c.extra)
        out = _outputs(node, c.extra)
        if isinstance(src, torch.Tensor) and out and out[0].dtype == src.dtype:
            return NodeCost(0.0, 0.0, "view", 0, "no-op cast")
    if ns == "aten" and node.target.overloadpacket in TORCH_FLOPS:
        metas = [
            torch.empty(sizes.shape(v), device="meta", dtype=v.dtype) if isinstance(v, torch.Tensor) else v
            for v in (_val(a, c.extra) for a in node.args)
        ]
        out = _outputs(node, c.extra)
        flops = flop_counter.flop_registry[node.target.overloadpacket](
            *metas, out_val=torch.empty(sizes.shape(out[0]), device="meta") if out else None
        )
        return NodeCost(float(flops), _generic(c, node)[1], cat, 1, "torch flop_counter")
    if ns == "aten" and name == "scaled_dot_product_attention":
        f, b = _attention(c, node, bnsd=True)
        return NodeCost(f, b, cat, 1, "attention")
    if ns == "workbench" and base in ("attention", "attention_sdpa"):
        f, b = _attention(c, node, bnsd=base == "attention_sdpa")
        return NodeCost(f, b, cat, 1, "attention")
    if ns == "workbench" and base == "cached_attention":
        f, b = _cached_attention(c, node)
        return NodeCost(f, b, cat, 1, "cached attention")
    if cat == "moe":
        f, b = _moe(c, node)
        return NodeCost(f, b, cat, 1, "moe (active experts)")
    if (ns == "aten" and name in ("linear", "matmul")) or (ns == "workbench" and re.search(r"linear|gemm", base)):
        f, b = _linear(c, node)
        return NodeCost(f, b, cat, 1, "linear")
    if ns == "workbench" and "mlp" in base:
        f, b = _mlp(c, node)
        return NodeCost(f, b, cat, 1, "mlp")
    if base in GATHER_OPS:
        f, b = _gather(c, node)
        return NodeCost(f, b, cat, 1, "gather")
    f, b = _generic(c, node)
    if cat == "norm":
        return NodeCost(4.0 * f, b, cat, 1, "norm")
    if "rope" in base:
        return NodeCost(3.0 * f, b, cat, 1, "rope")
    if ns == "aten" and isinstance(node.target, torch._ops.OpOverload) and torch.Tag.pointwise in node.target.tags:
        return NodeCost(f, b, cat, 1, "pointwise")
    if ns == "aten" and base in COPY_OPS:
        return NodeCost(0.0, b, cat, 1, "copy")
    return NodeCost(f, b, cat, 1, "generic")


__all__ = ["NodeCost", "node_cost"]
