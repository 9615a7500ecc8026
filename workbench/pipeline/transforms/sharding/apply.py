"""Rewrite the graph by a ``ShardingPlan`` (``sharding_transform_executor``), before ``load_weights``.

The graph still holds meta tensors here, so cutting a weight costs nothing: the attribute becomes a
meta tensor of the local shape, and a ``TensorBinding`` records how ``load_weights`` makes it from
the eager model's whole tensor (``take_shard``). Each rank therefore loads only its slice into the
graph; the numerics probe (which runs graphs before ``weight_load`` through the same bindings)
sees the same slices.

A tensor also read by a node the plan does not cut (the tied embedding of an LM head) is cut into
a new attribute ``<name>_shard`` instead, so the other reader keeps the whole tensor.
"""

from __future__ import annotations

from collections import Counter
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
import torch.fx as fx

from ...graph.weights import fake_value, fetch_attr, release_weights
from ...matcher.rewrite import annotate_new_nodes
from ...weights import WEIGHT_VIEWS_KEY, TensorBinding, record_tensor_binding, tensor_bindings
from .plan import Region, ShardingPlan, TensorCut, width

wb = torch.ops.workbench
SHARDING_META = "sharding"  # node.meta label: split kind and what this rank holds (renders read it)


def take_shard(
    t: torch.Tensor, *, dim: int, ranges: Tuple[Tuple[int, int], ...], zero: bool = False, index: Optional[tuple] = None
) -> torch.Tensor:
    """This rank's part of ``t``: ``ranges`` along ``dim`` concatenated (after ``t[index]`` when
    the graph tensor is a recorded view), copied so the rank holds only its slice."""
    if index is not None:
        t = t[index]
    parts = [t.narrow(dim, a, b - a) for a, b in ranges]
    out = parts[0] if len(parts) == 1 else torch.cat(parts, dim=dim)
    return (
        torch.zeros_like(out, memory_format=torch.contiguous_format)
        if zero
        else out.clone(memory_format=torch.contiguous_format)
    )


def take_shard_of_converted(*inputs: torch.Tensor, inner, inner_kwargs, inner_output, dim, ranges, zero=False):
    """``take_shard`` of what an earlier binding (a quantized checkpoint's conversion) makes."""
    out = inner(*inputs, **dict(inner_kwargs)) if inner is not None else inputs[0]
    if inner_output is not None:
        out = out[inner_output]
    return take_shard(out, dim=dim, ranges=ranges, zero=zero)


def _binding(gm: fx.GraphModule, source: str, cut: TensorCut) -> TensorBinding:
    """How load_weights makes the cut tensor from what ``source`` would have been bound to."""
    kw = (("dim", cut.dim), ("ranges", cut.ranges), ("zero", cut.zero))
    earlier = tensor_bindings(gm).get(source)
    if earlier is not None:
        return TensorBinding(
            earlier.inputs,
            earlier.namespace,
            take_shard_of_converted,
            (("inner", earlier.convert), ("inner_kwargs", earlier.kwargs), ("inner_output", earlier.output), *kw),
        )
    view = gm.meta.get(WEIGHT_VIEWS_KEY, {}).get(source)
    if view is not None:
        base, index = view
        return TensorBinding((base,), "model", take_shard, (("index", index), *kw))
    return TensorBinding((source,), "model", take_shard, kw)


def _local_shape(shape: Sequence[int], cut: TensorCut) -> Tuple[int, ...]:
    out = list(shape)
    out[cut.dim] = width(cut.ranges)
    return tuple(out)


def _cut_tensor(gm: fx.GraphModule, node: fx.Node, cut: TensorCut, readers: Counter) -> None:
    """Cut ``node``'s tensor argument; ``readers`` counts the get_attr nodes per target (kept up to date)."""
    attr = node.args[cut.arg_index] if isinstance(cut.arg_index, int) else node.kwargs[cut.arg_index]
    whole = fetch_attr(gm, attr.target)
    if not whole.is_meta:
        raise RuntimeError(
            f"{attr.target} already holds real weights: sharding must run before load_weights "
            "(stage sharding comes before weight_load)"
        )
    local = torch.empty(_local_shape(whole.shape, cut), dtype=whole.dtype, device="meta")
    if isinstance(whole, torch.nn.Parameter):
        local = torch.nn.Parameter(local, requires_grad=False)
    owner_path, _, name = attr.target.rpartition(".")
    owner = gm.get_submodule(owner_path) if owner_path else gm
    binding = _binding(gm, cut.target, cut)  # before the attribute changes: it reads earlier bindings
    shared = any(u is not node for u in attr.users) or readers[attr.target] > 1
    if shared:  # another reader keeps the whole tensor: cut into a new attribute
        new_name, i = f"{name}_shard", 1
        while hasattr(owner, new_name):
            new_name, i = f"{name}_shard{i}", i + 1
        if isinstance(local, torch.nn.Parameter):
            owner.register_parameter(new_name, local)
        else:
            owner.register_buffer(new_name, local)
        target = f"{owner_path}.{new_name}" if owner_path else new_name
        with gm.graph.inserting_before(node):
            new_attr = gm.graph.get_attr(target)
        readers[target] += 1
        node.replace_input_with(attr, new_attr)
        attr = new_attr
    else:
        if name in owner._parameters:
            owner._parameters[name] = local
        elif name in owner._buffers:
            owner._buffers[name] = local
        else:
            setattr(owner, name, local)
        target = attr.target
    record_tensor_binding(gm, target, binding)
    fake = fake_value(gm, local)
    attr.meta["val"] = fake if fake is not None else local


def _insert_collective(gm: fx.GraphModule, region: Region, plan: ShardingPlan, by_name: Dict[str, fx.Node]) -> fx.Node:
    assert region.collective is not None  # the caller checks
    after, kind = region.collective
    node = by_name[after]
    with gm.graph.inserting_after(node):
        if kind == "all_reduce":
            new = gm.graph.call_function(wb.torch_dist_all_reduce.default, (node, plan.group_name))
        else:
            new = gm.graph.call_function(wb.torch_dist_all_gather.default, (node, -1, plan.world_size, plan.group_name))
    node.replace_all_uses_with(new, delete_user_cb=lambda u: u is not new)
    annotate_new_nodes(gm, [new], [], anchor=node)
    new.meta[SHARDING_META] = f"{kind} over {plan.world_size} ranks"
    return new


def _localize_experts(gm: fx.GraphModule, region: Region, by_name: Dict[str, fx.Node]) -> List[str]:
    """Route other ranks' experts to -1; per-expert lists keep this rank's entries only. Returns
    the attributes of the dropped list entries."""
    assert region.local_experts is not None  # the caller checks
    name, first, count = region.local_experts
    moe = by_name[name]
    selected = moe.args[1]
    with gm.graph.inserting_before(moe):
        local = gm.graph.call_function(wb.torch_moe_local_experts.default, (selected, first, count))
    moe.replace_input_with(selected, local)
    annotate_new_nodes(gm, [local], [], anchor=moe)
    local.meta[SHARDING_META] = f"expert ids -> local {first}..{first + count - 1} (else -1)"
    dropped: List[str] = []
    if region.expert_lists is not None:
        a, b = region.expert_lists[1]
        args = list(moe.args)
        for i in (3, 4, 5):
            dropped += [w.target for j, w in enumerate(args[i]) if not a <= j < b]
            args[i] = list(args[i])[a:b]
        moe.args = tuple(args)
    return dropped


def apply_plan(gm: fx.GraphModule, plan: ShardingPlan) -> Dict[str, Any]:
    """Cut the weights, fix literal head counts, remap experts and insert the collectives."""
    by_name = {n.name: n for n in gm.graph.nodes}
    readers = Counter(n.target for n in gm.graph.nodes if n.op == "get_attr")
    dropped: List[str] = []
    counts = {"tensors_cut": 0, "shape_literals_fixed": 0, "all_reduce": 0, "all_gather": 0}
    for region in plan.sharded:
        for cut in region.cuts:
            node = by_name[cut.node]
            for t in cut.tensors:
                _cut_tensor(gm, node, t, readers)
                counts["tensors_cut"] += 1
            node.meta[SHARDING_META] = f"{cut.kind} {region.per_rank[plan.rank]}"
        for name, index, value in region.shape_fixes:
            node = by_name[name]
            shape = list(node.args[1])
            shape[index] = value
            node.args = (node.args[0], shape, *node.args[2:])
            counts["shape_literals_fixed"] += 1
        if region.local_experts is not None:
            dropped += _localize_experts(gm, region, by_name)
            held = region.per_rank[plan.rank].replace("experts ", "")
            by_name[region.local_experts[0]].meta[SHARDING_META] = f"expert {held} here"
        if region.collective is not None:
            _insert_collective(gm, region, plan, by_name)
            counts[region.collective[1]] += 1
    gm.graph.eliminate_dead_code()
    counts["expert_tensors_dropped"] = len(release_weights(gm, dropped).dropped)
    return counts


__all__ = ["apply_plan", "take_shard", "take_shard_of_converted", "SHARDING_META"]
