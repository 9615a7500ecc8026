"""Layout transforms (stage ``pattern_matcher``): put attention and RoPE in the backend's layout,
then drop the transposes that cancel out.

* ``match_attention_layout``: ``torch_attention`` in the other layout -> transposes around it.
* ``match_rope_layout``: RoPE ops in the other layout -> transposes around them.
* ``eliminate_redundant_transposes``: ``transpose(transpose(x, a, b), a, b) -> x``, also across a
  reshape/view that does not change the shape (HF reshapes the attention output to its own shape)
  and across ``.contiguous()`` / ``clone`` copies.

The first two only *add* transposes; the model's own ``view -> transpose(1, 2)`` into bnsd then
meets the new ``transpose(1, 2)`` back to bsnd and the pair disappears, leaving
``view -> rope -> attention`` with no data movement.
"""

from __future__ import annotations

import operator
from typing import Any, Dict, List, Literal, Tuple

import torch
import torch.fx as fx
from pydantic import Field, field_validator

from .... import ops  # noqa: F401  (registers torch.ops.workbench)
from ...context import PipelineContext
from ...graph.utils import call_nodes, tensor_meta
from ...interface import Transform, TransformConfig, TransformInfo, register
from ...matcher import annotate_new_nodes, match_info, named_args, refresh_after_rewrite, same_shape

aten = torch.ops.aten
wb = torch.ops.workbench

LAYOUTS = ("bnsd", "bsnd")


def call_kwargs(node: fx.Node, skip: int) -> Dict[str, Any]:
    """``node``'s arguments after the first ``skip`` as keywords, defaults left out (readable)."""
    schema = {a.name: a for a in node.target._schema.arguments}
    out = {}
    for name, value in named_args(node)[skip:]:
        arg = schema[name]
        if not (arg.has_default_value() and arg.default_value == value):
            out[name] = value
    return out


def _transpose(graph: fx.Graph, x: fx.Node) -> fx.Node:
    return graph.call_function(aten.transpose.int, (x, 1, 2))


class MatchAttentionLayoutConfig(TransformConfig):
    attn_layout: Literal["bsnd", "bnsd"] = Field(description="Layout expected by the attention backend.")


@register("match_attention_layout")
class MatchAttentionLayout(Transform[MatchAttentionLayoutConfig]):
    """Rewrite ``torch_attention`` calls to ``attn_layout``: Q/K/V transposed in, output back."""

    def _apply(self, gm: fx.GraphModule, ctx: PipelineContext) -> Tuple[torch.nn.Module, TransformInfo]:
        target = self.config.attn_layout
        graph, n = gm.graph, 0
        for node in call_nodes(gm, wb.torch_attention.default):
            args = dict(named_args(node))
            if args["layout"] == target:
                continue
            kwargs = {**call_kwargs(node, 3), "layout": target}  # attn_mask is [b,n,s,s] in both
            with graph.inserting_before(node):
                qkv = [_transpose(graph, args[k]) for k in ("query", "key", "value")]
                new = graph.call_function(wb.torch_attention.default, tuple(qkv), kwargs)
                out = _transpose(graph, new)
            node.replace_all_uses_with(out)
            graph.erase_node(node)
            annotate_new_nodes(gm, [*qkv, new, out], [node.name], anchor=node)
            refresh_after_rewrite(gm, [(node.meta.get("val"), out)])  # a view of the output may need a reshape
            n += 1
        return match_info(gm, {"attention": n}, attn_layout=target)


_ROPE_OPS = {
    # op -> index of the unsqueeze_dim argument (the number of tensor inputs before it)
    wb.torch_rope_with_explicit_cos_sin.default: 4,
    wb.torch_rope_with_qk_interleaving.default: 4,
    wb.torch_rope_with_complex_freqs.default: 3,
}
_ROPE_LAYOUT = {1: "bnsd", 2: "bsnd"}  # unsqueeze_dim of cos/sin -> layout of q/k


class MatchRopeLayoutConfig(TransformConfig):
    expected_layout: str = Field(
        default="bsnd", description="The expected layout of the rope operation. Must be one of 'bsnd' or 'bnsd'."
    )

    @field_validator("expected_layout")
    @classmethod
    def _known(cls, v: str) -> str:
        if v not in LAYOUTS:
            raise ValueError(f"expected_layout must be one of {LAYOUTS}, got {v!r}")
        return v


@register("match_rope_layout")
class MatchRopeLayout(Transform[MatchRopeLayoutConfig]):
    """Rewrite RoPE ops to ``expected_layout``: q/k transposed in, both outputs transposed back."""

    def _apply(self, gm: fx.GraphModule, ctx: PipelineContext) -> Tuple[torch.nn.Module, TransformInfo]:
        target = self.config.expected_layout
        graph, n = gm.graph, 0
        for node in call_nodes(gm, *_ROPE_OPS):
            n_tensors = _ROPE_OPS[node.target]
            args = named_args(node)
            dim = args[n_tensors][1]
            if _ROPE_LAYOUT.get(dim) in (None, target):
                continue
            getitems = list(node.users)
            if not all(u.target is operator.getitem and isinstance(u.args[1], int) for u in getitems):
                continue
            tensors = [a for _, a in args[:n_tensors]]
            created: List[fx.Node] = []
            with graph.inserting_before(node):
                q, k = _transpose(graph, tensors[0]), _transpose(graph, tensors[1])
                new_dim = 2 if dim == 1 else 1
                new = graph.call_function(node.target, (q, k, *tensors[2:], new_dim))
                created += [q, k, new]
            pairs = []
            for g in getitems:
                with graph.inserting_before(g):
                    item = graph.call_function(operator.getitem, (new, g.args[1]))
                    back = _transpose(graph, item)
                created += [item, back]
                pairs.append((g.meta.get("val"), back))
                g.replace_all_uses_with(back)
                graph.erase_node(g)
            graph.erase_node(node)
            annotate_new_nodes(gm, created, [node.name, *(g.name for g in getitems)], anchor=node)
            refresh_after_rewrite(gm, pairs)
            n += 1
        return match_info(gm, {"rope": n}, expected_layout=target)


def _dims(node: fx.Node) -> Any:
    x = tensor_meta(node.args[0])
    if x is None:
        return None
    a, b = node.args[1] % x.dim(), node.args[2] % x.dim()
    return frozenset((a, b))


_COPIES = (aten.contiguous.default, aten.clone.default)  # the same values in other memory


def _skip_identity_reshapes(node: fx.Node) -> fx.Node:
    """Follow nodes that return their input's values in the same shape: reshape/view nodes that
    keep the shape, and copies (``.contiguous()``, ``clone``: ``transpose -> contiguous ->
    transpose`` is ``x`` too; a view after it that needed the copy's strides becomes a reshape,
    ``refresh_after_rewrite``)."""
    while node.op == "call_function" and node.target in (aten.reshape.default, aten.view.default, *_COPIES):
        src = node.args[0]
        if node.target in _COPIES:
            node = src
            continue
        a, b = tensor_meta(node), tensor_meta(src)
        if a is None or b is None or not same_shape(a.shape, b.shape):
            break
        node = src
    return node


@register("eliminate_redundant_transposes")
class EliminateRedundantTransposes(Transform):
    """Remove pairs of transposes over the same two dims: ``transpose(transpose(x, a, b), a, b) = x``."""

    def _apply(self, gm: fx.GraphModule, ctx: PipelineContext) -> Tuple[torch.nn.Module, TransformInfo]:
        n, pairs = 0, []
        for node in list(gm.graph.nodes):
            if node.op != "call_function" or node.target is not aten.transpose.int or node._erased:
                continue
            inner = _skip_identity_reshapes(node.args[0])
            if inner.op != "call_function" or inner.target is not aten.transpose.int:
                continue
            dims = _dims(node)
            if dims is None or dims != _dims(inner):
                continue
            pairs.append((node.meta.get("val"), inner.args[0]))
            node.replace_all_uses_with(inner.args[0])
            n += 1
        if n:
            gm.graph.eliminate_dead_code()
            refresh_after_rewrite(gm, pairs)  # the users now read the source's strides
        return match_info(gm, {"transpose_pairs": n})
