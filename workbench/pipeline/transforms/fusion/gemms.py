"""``fuse_gemms`` (stage ``post_load_fusion``): linears that read the same input -> one GEMM + split.

The Q, K and V projections of an attention block all read the normed hidden state::

    q = linear(x, Wq)   [.., Nq]        fused = linear(x, W_qkv)       W_qkv = cat([Wq; Wk; Wv]) [Nq+Nk+Nv, H]
    k = linear(x, Wk)   [.., Nk]   ->   q, k, v = split_with_sizes(fused, [Nq, Nk, Nv], -1)
    v = linear(x, Wv)   [.., Nv]

One GEMM streams ``x`` once and launches once (at decode batch sizes the three launches and three
reads of ``x`` dominate). The weights are concatenated ONCE, here, into a new parameter registered
beside the originals (``<module>.fused_q_proj_k_proj_v_proj_weight``); an original is then dropped
from the graph module when no graph node reads it any more (a tied weight read elsewhere stays).
The original tensor objects -- held by the eager reference model, earlier snapshots and any tied
name -- are made views of their rows of the fused tensor (``graph/weights.alias_rows``): the same
values, and the weights held once, not twice. ``freed_bytes`` counts the storages the module no
longer holds, so the snapshot's memory delta is exactly ``new_bytes - freed_bytes`` (both in
``details``).

Quantized linears (``torch_int4_linear``, ``torch_int8_linear``: weights quantized per output row)
fuse the same way: their packed codes, scales and offsets are each concatenated along the output
rows, which is exactly the quantized form of the concatenated weight (same group size required).

The split outputs are strided views; a consumer ``view`` that the strides cannot serve (one that
merges the split dim with another) becomes a ``reshape``, so the rewrite never fails at run time.
The weight helpers (``concat_weights``, ``release_weights``) are in ``pipeline/graph/weights.py``.
"""

from __future__ import annotations

import operator
from typing import Any, Dict, List, Optional, Sequence, Tuple, cast

import torch
import torch.fx as fx
from torch._guards import detect_fake_mode

from ...context import PipelineContext
from ...graph.weights import LINEAR, concat_weights, fake_value, fetch_attr, param_of, release_weights, storage_bytes
from ...interface import Transform, TransformInfo, register
from ...matcher import annotate_new_nodes, fake_call, repropagate_users

aten = torch.ops.aten


# ------------------------------------------------------------------------------ the rewrite


class LinearForm:
    """Where an op keeps its weight tensors (concatenated along rows when fused), its constant
    arguments (equal across a group) and its bias."""

    def __init__(self, weights: Tuple[int, ...], consts: Tuple[int, ...], bias: int):
        self.weights, self.consts, self.bias = weights, consts, bias

    def bias_of(self, node: fx.Node) -> Any:
        return node.args[self.bias] if len(node.args) > self.bias else node.kwargs.get("bias")


def linear_forms() -> Dict[Any, LinearForm]:
    import workbench.ops.quant  # noqa: F401  (registers the quantized ops)

    ops = torch.ops.workbench
    return {
        LINEAR: LinearForm((1,), (), 2),
        ops.torch_int4_linear.default: LinearForm((1, 2, 3), (4,), 5),
        ops.torch_int8_linear.default: LinearForm((1, 2), (3,), 4),
    }


def _fusable_key(gm: fx.GraphModule, node: fx.Node, form: LinearForm) -> Optional[tuple]:
    """What linears must share to be fused: op, weight dtypes/device/row widths, constants, bias or not."""
    ws = [param_of(gm, node.args[i]) if len(node.args) > i else None for i in form.weights]
    if any(w is None or w.dim() != 2 for w in ws):
        return None
    bias = form.bias_of(node)
    if bias is not None:
        b = param_of(gm, bias)
        if b is None or b.dim() != 1:
            return None
    consts = tuple(node.args[i] if len(node.args) > i else None for i in form.consts)
    weights = cast(List[torch.Tensor], ws)  # none is None (checked above)
    return (node.target, tuple((w.dtype, w.device, w.shape[1]) for w in weights), consts, bias is not None)


def linear_groups(gm: fx.GraphModule) -> List[List[fx.Node]]:
    """Groups (graph order) of >= 2 fusable linear nodes (same op) reading the same input."""
    forms = linear_forms()
    by_input: Dict[fx.Node, Dict[tuple, List[fx.Node]]] = {}
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target in forms and len(node.args) >= 2:
            key = _fusable_key(gm, node, forms[node.target])
            if key is not None:
                by_input.setdefault(node.args[0], {}).setdefault(key, []).append(node)
    return [group for buckets in by_input.values() for group in buckets.values() if len(group) >= 2]


def _view_value(node: fx.Node) -> Optional[torch.Tensor]:
    """The fake value of ``aten.view`` node ``node`` run on its (new, strided) input's fake value;
    None when the view cannot be taken there."""
    src = node.args[0].meta.get("val") if isinstance(node.args[0], fx.Node) else None
    if not isinstance(src, torch.Tensor):
        return None
    mode = detect_fake_mode([src])
    shape = fx.node.map_arg(node.args[1], lambda a: a.meta.get("val"))
    try:
        if mode is None:
            return node.target(src, shape)
        # a view: cheaper uncached (matcher._cache_pays); equal inputs of the other layers share it
        return fake_call(mode, node.target, (src, shape), {}, cache=False)
    except Exception:  # noqa: BLE001 - any failure means "not provably a view"
        return None


def split_outputs(gm: fx.GraphModule, fused: fx.Node, sizes: Sequence[int], old: Sequence[fx.Node]) -> List[fx.Node]:
    """Insert ``split_with_sizes(fused, sizes, -1)`` + getitems after ``fused`` and reroute the
    users of ``old[i]`` to output i. Returns the new nodes (split, getitems) in order."""
    g = gm.graph
    with g.inserting_after(fused):
        split = g.call_function(aten.split_with_sizes.default, (fused, list(sizes), -1))
    new = [split]
    prev = split
    for i, node in enumerate(old):
        with g.inserting_after(prev):
            item = g.call_function(operator.getitem, (split, i))
        node.replace_all_uses_with(item)
        new.append(item)
        prev = item
    return new


def fix_views(gm: fx.GraphModule, outputs: Sequence[fx.Node], values: Optional[Dict[fx.Node, Any]] = None) -> int:
    """Turn ``aten.view`` users of strided split outputs that cannot be views into reshapes.

    ``values``: where to put the fake value of each view that stays one (computed to decide it), so
    that ``repropagate_users`` does not derive it a second time."""
    n = 0
    for out in outputs:
        for user in list(out.users):
            if user.target is aten.view.default:
                value = _view_value(user)
                if value is None:
                    user.target = aten.reshape.default
                    n += 1
                elif values is not None:
                    values[user] = value
    return n


def fuse_linear_group(gm: fx.GraphModule, group: Sequence[fx.Node]) -> Dict[str, Any]:
    """Rewrite one group (see the module docstring); returns what it did."""
    g = gm.graph
    form = linear_forms()[group[0].target]
    x, first = group[0].args[0], group[0]
    b_nodes = [form.bias_of(n) for n in group]
    has_bias = b_nodes[0] is not None
    sizes = [int(cast(torch.Tensor, param_of(gm, n.args[form.weights[0]])).shape[0]) for n in group]  # fusable
    tensor_groups = [[n.args[i] for n in group] for i in form.weights] + ([b_nodes] if has_bias else [])
    targets, new_bytes = [], 0
    for nodes in tensor_groups:
        target, nbytes = concat_weights(gm, nodes, alias_originals=True)
        targets.append(target)
        new_bytes += nbytes
    before = set(g.nodes)
    with g.inserting_before(first):
        reads = []
        for target in targets:
            node = g.get_attr(target)
            node.meta["val"] = fake_value(gm, fetch_attr(gm, target))
            reads.append(node)
        args = [x, *reads[: len(form.weights)], *(first.args[i] for i in form.consts)]
        if has_bias:
            args.append(reads[-1])
        fused = g.call_function(first.target, tuple(args))
    names = [n.name for n in group]
    outputs = split_outputs(gm, fused, sizes, group)
    for node in group:
        g.erase_node(node)
    new_nodes = [n for n in g.nodes if n not in before]
    annotate_new_nodes(gm, new_nodes, names, anchor=first)
    views: Dict[fx.Node, Any] = {}
    reshaped = fix_views(gm, outputs[1:], views)
    originals = [n.target for nodes in tensor_groups for n in nodes]
    return {
        "fused": names,
        "weight": targets[0],
        "sizes": sizes,
        "new_bytes": new_bytes,
        "originals": originals,
        "views_made_reshapes": reshaped,
        "outputs": outputs[1:],
        "view_values": views,
    }


@register("fuse_gemms")
class FuseGemms(Transform):
    """Fuse linear nodes (``aten.linear``, int4/int8 linears) that share an input into one GEMM over
    concatenated weights."""

    def _apply(self, gm: fx.GraphModule, ctx: PipelineContext) -> Tuple[fx.GraphModule, TransformInfo]:
        groups = linear_groups(gm)
        held = storage_bytes(gm)
        done = [fuse_linear_group(gm, group) for group in groups]
        # One release for all groups: the storage census walks every parameter.
        released = release_weights(gm, [t for d in done for t in d["originals"]])
        # Freed: what the module held before, plus what was made, less what it holds now -- the
        # originals' own storages once they are views of the fused tensors (alias_rows), even where a
        # graph node still reads one (tied weights). Totals, not a per-storage diff: a freed
        # storage's address is reused by the next fused tensor within this transform.
        new_bytes = sum(d["new_bytes"] for d in done)
        freed = sum(held.values()) + new_bytes - sum(storage_bytes(gm).values())
        if done:
            gm.graph.lint()
            gm.recompile()
        details = {
            "groups": [d["fused"] for d in done],
            "new_bytes": new_bytes,
            "freed_bytes": freed,
            "kept_originals": released.kept,  # still read by a node (every original now views the fused tensor)
            "views_made_reshapes": sum(d["views_made_reshapes"] for d in done),
        }
        # The split outputs have other strides than the linears they replace: re-derive the values
        # downstream of them (locally; a whole-graph propagation would cost the next transform ~1 s).
        # The views fix_views kept were derived on the new inputs there: not derived again.
        known = {node: v for d in done for node, v in d["view_values"].items()}
        shapes_valid = repropagate_users(gm, [o for d in done for o in d["outputs"]], known) if done else False
        return gm, TransformInfo(
            num_matches=len(done), is_clean=not done, has_valid_shapes=shapes_valid, details=details
        )


__all__ = ["FuseGemms", "linear_groups", "fuse_linear_group", "split_outputs", "fix_views"]
