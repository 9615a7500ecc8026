"""``split_moe_fused_for_sharding``: ``torch_moe_fused`` (stacked experts) -> ``torch_moe`` with
per-expert weight lists, the form sharding splits by expert.

The per-expert weights are views of the stacked parameters (no copies), each recorded as derived
from the stacked tensor so ``load_weights`` rebuilds it as a view of the real weights.
"""

from __future__ import annotations

from typing import Any, List, Optional, Tuple

import torch
import torch.fx as fx

from .... import ops  # noqa: F401  (registers torch.ops.workbench)
from ....ops.moe.torch_moe import has_expert_extras
from ...context import PipelineContext
from ...graph.utils import call_nodes, tensor_meta
from ...interface import Transform, TransformInfo, register
from ...matcher import annotate_new_nodes, match_info, named_args
from ...weights import record_weight_view

wb = torch.ops.workbench


def _get_param(gm: fx.GraphModule, node: Any) -> Optional[torch.Tensor]:
    if isinstance(node, fx.Node) and node.op == "get_attr":
        try:
            return gm.get_parameter(node.target)
        except AttributeError:
            try:
                return gm.get_buffer(node.target)
            except AttributeError:
                return None
    return None


def _expert_views(gm, node: fx.Node, name: str, stacked: torch.Tensor, index: Tuple[Any, ...]) -> List[fx.Node]:
    """Register ``stacked[e][index]`` for every expert ``e`` next to the stacked parameter ``node``
    (views: no copy) and return their get_attr nodes. Each view is recorded as derived from the
    stacked tensor, so ``load_weights`` rebuilds it as a view of the real weights when the graph
    was traced on meta."""
    owner_path, _, attr = node.target.rpartition(".")
    owner = gm.get_submodule(owner_path) if owner_path else gm
    nodes = []
    for e in range(stacked.shape[0]):
        leaf = f"{attr}_{name}_{e}"
        target = f"{owner_path}.{leaf}" if owner_path else leaf
        if not hasattr(owner, leaf):
            owner.register_parameter(leaf, torch.nn.Parameter(stacked[e][index], requires_grad=False))
            record_weight_view(gm, target, node.target, (e, *index))
        nodes.append(gm.graph.get_attr(target))
    return nodes


@register("split_moe_fused_for_sharding")
class SplitMoeFusedForSharding(Transform):
    """Convert ``torch_moe_fused`` (stacked weights) to ``torch_moe`` (per-expert lists).

    The per-expert weights are views of the stacked parameters (no memory is copied), registered
    beside them as ``<stacked>_w1_<e>`` / ``_w2_<e>`` / ``_w3_<e>``. Nodes with gpt-oss's options
    (expert biases, interleaved gate/up rows, clamped SwiGLU) stay ``torch_moe_fused``: ``torch_moe``
    has none of them; ``details["left"]`` names each with the reason.
    """

    def _apply(self, gm: fx.GraphModule, ctx: PipelineContext) -> Tuple[torch.nn.Module, TransformInfo]:
        n, left = 0, []
        for node in call_nodes(gm, wb.torch_moe_fused.default):
            args = dict(named_args(node))
            extras = has_expert_extras(args)
            if extras:  # torch_moe's per-expert lists carry none of these
                left.append(f"{node.name}: {', '.join(extras)} (torch_moe has no such option)")
                continue
            w13, w2 = _get_param(gm, args["w1_w3_stacked"]), _get_param(gm, args["w2_stacked"])
            if w13 is None or w2 is None:
                left.append(f"{node.name}: the stacked experts are not plain parameters")
                continue
            inter = w13.shape[1] // 2
            with gm.graph.inserting_before(node):
                w1 = _expert_views(gm, args["w1_w3_stacked"], "w1", w13, (slice(None, inter),))
                w3 = _expert_views(gm, args["w1_w3_stacked"], "w3", w13, (slice(inter, None),))
                w2n = _expert_views(gm, args["w2_stacked"], "w2", w2, ())
                new = gm.graph.call_function(
                    wb.torch_moe.default,
                    (args["x"], args["selected_experts"], args["routing_weights"], w1, w2n, w3),
                    {"act_fn": args["act_fn"]} if args["act_fn"] != "silu" else {},
                )
            mode: Any = getattr(tensor_meta(args["x"]), "fake_mode", None)
            for p in (w1 + w3 + w2n) if mode is not None else ():
                p.meta["val"] = mode.from_tensor(gm.get_parameter(p.target), static_shapes=True)
            node.replace_all_uses_with(new)
            gm.graph.erase_node(node)
            annotate_new_nodes(gm, [new], [node.name], anchor=node)
            n += 1
        return match_info(gm, {"split_moe": n}, **({"left": left} if left else {}))


__all__ = ["SplitMoeFusedForSharding"]
