"""``fuse_gemms`` (stage ``post_load_fusion``): linears that read the same input -> one GEMM + split.

The Q, K and V projections of an attention block all read the normed hidden state::

    q = linear(x, Wq)   [.., Nq]        fused = linear(x, W_qkv)       W_qkv = cat([Wq; Wk; Wv]) [Nq+Nk+Nv, H]
    k = linear(x, Wk)   [.., Nk]   ->   q, k, v = split_with_sizes(fused, [Nq, Nk, Nv], -1)
    v = linear(x, Wv)   [.., Nv]

One GEMM streams ``x`` once and launches once (at decode batch sizes the three launches and three
reads of ``x`` dominate). The weights are concatenated ONCE, here, into a new parameter registered
beside the originals (``<module>.fused_q_proj_k_proj_v_proj_weight``); an original is then dropped
from the graph module when no graph node reads it any more, and its bytes count as freed only when
no other attribute of the module still holds the same storage (tied weights stay). The snapshot's
memory delta is therefore exactly ``new_bytes - freed_bytes`` (both reported in ``details``).
Earlier snapshots and the eager reference model keep their own references to the originals.

The split outputs are strided views; a consumer ``view`` that the strides cannot serve (one that
merges the split dim with another) becomes a ``reshape``, so the rewrite never fails at run time.
The weight helpers (``concat_weights``, ``release_weights``) are in ``pipeline/graph_weights.py``.
"""

from __future__ import annotations

import operator

from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
import torch.fx as fx
from torch._guards import detect_fake_mode

from ..graph_utils import symbolic_fake_mode
from ..graph_weights import LINEAR, concat_weights, fake_value, fetch_attr, linear_bias, param_of, release_weights
from ..interface import Transform, TransformInfo, register
from ..matcher import annotate_new_nodes

aten = torch.ops.aten


# ------------------------------------------------------------------------------ the rewrite


def _fusable_key(gm: fx.GraphModule, node: fx.Node) -> Optional[tuple]:
    """What linears must share to be fused: weight dtype/device/in-features, bias or not."""
    w = param_of(gm, node.args[1])
    if w is None or w.dim() != 2:
        return None
    bias = linear_bias(node)
    if bias is not None:
        b = param_of(gm, bias)
        if b is None or b.dim() != 1 or b.dtype != w.dtype:
            return None
    return (w.dtype, w.device, w.shape[1], bias is not None)


def linear_groups(gm: fx.GraphModule) -> List[List[fx.Node]]:
    """Groups (graph order) of >= 2 fusable ``aten.linear`` nodes reading the same input."""
    by_input: Dict[fx.Node, Dict[tuple, List[fx.Node]]] = {}
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target is LINEAR and len(node.args) >= 2:
            key = _fusable_key(gm, node)
            if key is not None:
                by_input.setdefault(node.args[0], {}).setdefault(key, []).append(node)
    return [group for buckets in by_input.values() for group in buckets.values() if len(group) >= 2]


def _viewable(node: fx.Node) -> bool:
    """Whether ``aten.view`` node ``node`` can run on its (new, strided) input's fake value."""
    src = node.args[0].meta.get("val") if isinstance(node.args[0], fx.Node) else None
    if not isinstance(src, torch.Tensor):
        return False
    mode = detect_fake_mode([src])
    shape = fx.node.map_arg(node.args[1], lambda a: a.meta.get("val"))
    try:
        if mode is None:
            src.view(shape)
        else:
            with symbolic_fake_mode(mode):
                src.view(shape)
        return True
    except Exception:  # noqa: BLE001 - any failure means "not provably a view"
        return False


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


def fix_views(gm: fx.GraphModule, outputs: Sequence[fx.Node]) -> int:
    """Turn ``aten.view`` users of strided split outputs that cannot be views into reshapes."""
    n = 0
    for out in outputs:
        for user in list(out.users):
            if user.target is aten.view.default and not _viewable(user):
                user.target = aten.reshape.default
                n += 1
    return n


def fuse_linear_group(gm: fx.GraphModule, group: Sequence[fx.Node]) -> Dict[str, Any]:
    """Rewrite one group (see the module docstring); returns what it did."""
    g = gm.graph
    x, first = group[0].args[0], group[0]
    w_nodes = [n.args[1] for n in group]
    b_nodes = [linear_bias(n) for n in group]
    has_bias = b_nodes[0] is not None
    sizes = [int(param_of(gm, w).shape[0]) for w in w_nodes]
    w_target, new_bytes = concat_weights(gm, w_nodes)
    b_target = None
    if has_bias:
        b_target, b_bytes = concat_weights(gm, b_nodes)
        new_bytes += b_bytes
    before = set(g.nodes)
    with g.inserting_before(first):
        w = g.get_attr(w_target)
        w.meta["val"] = fake_value(gm, fetch_attr(gm, w_target))
        args = (x, w)
        if has_bias:
            b = g.get_attr(b_target)
            b.meta["val"] = fake_value(gm, fetch_attr(gm, b_target))
            args = (x, w, b)
        fused = g.call_function(LINEAR, args)
    names = [n.name for n in group]
    outputs = split_outputs(gm, fused, sizes, group)
    for node in group:
        g.erase_node(node)
    new_nodes = [n for n in g.nodes if n not in before]
    annotate_new_nodes(gm, new_nodes, names, anchor=first)
    reshaped = fix_views(gm, outputs[1:])
    originals = [n.target for n in w_nodes] + ([n.target for n in b_nodes] if has_bias else [])
    return {"fused": names, "weight": w_target, "sizes": sizes, "new_bytes": new_bytes,
            "originals": originals, "views_made_reshapes": reshaped}


@register("fuse_gemms")
class FuseGemms(Transform):
    """Fuse ``aten.linear`` nodes that share an input into one GEMM over concatenated weights."""

    def _apply(self, gm, ctx) -> Tuple[fx.GraphModule, TransformInfo]:
        groups = linear_groups(gm)
        done = [fuse_linear_group(gm, group) for group in groups]
        # One release for all groups: the storage census walks every parameter.
        released = release_weights(gm, [t for d in done for t in d["originals"]])
        if done:
            gm.graph.lint()
            gm.recompile()
        details = {
            "groups": [d["fused"] for d in done],
            "new_bytes": sum(d["new_bytes"] for d in done),
            "freed_bytes": released.freed_bytes,
            "kept_originals": released.kept + released.tied,
            "views_made_reshapes": sum(d["views_made_reshapes"] for d in done),
        }
        # Downstream view outputs now have different strides than their recorded fake values.
        return gm, TransformInfo(num_matches=len(done), is_clean=not done, has_valid_shapes=not done,
                                 details=details)


__all__ = ["FuseGemms", "linear_groups", "fuse_linear_group", "split_outputs", "fix_views"]
