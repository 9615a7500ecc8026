"""Export with few experts: ``export_to_gm.num_moe_experts_for_export``.

``num_moe_experts_for_export: N`` traces every stacked-experts module (transformers'
``@use_experts_implementation`` experts) with its stacked tensors cut to their first N experts, then
gives the graph's expert tensors back their full size (still on ``meta``) and re-derives the fake
values: ``load_weights`` binds all experts. The traced ops are the same for any expert count -- the
experts' forward reads the count from ``num_experts`` (kept whole, like the router), never from the
weights' shape -- so the graph equals a full export's. Experts that read the count from their
weights (Llama-4's ``view(gate_up_proj.shape[0], ...)``) are refused.
"""

from __future__ import annotations

from typing import Any, Dict, Optional

import torch
import torch.fx as fx

from ...graph.utils import run_shape_prop
from ...graph.weights import fake_value, fetch_attr

aten = torch.ops.aten


def cut_experts(traced: torch.nn.Module, n: Optional[int], trace_device: str) -> Dict[str, Any]:
    """Cut the stacked experts of ``traced`` (a meta twin) to ``n`` (``num_moe_experts_for_export``).

    Each experts module's ``num_experts`` is set to N too (transformers' grouped GEMM checks that the
    histogram of routed ids has one bin per stacked expert). Returns ``{"shapes": parameter name ->
    full shape, "counts": experts class name -> full count}``, empty when nothing is cut."""
    if n is None:
        return {}
    if trace_device != "meta":
        raise ValueError("export_to_gm.num_moe_experts_for_export needs trace_device=meta (it cuts a meta twin)")
    shapes: Dict[str, torch.Size] = {}
    counts: Dict[str, int] = {}
    for path, m in traced.named_modules():
        count = getattr(m, "num_experts", None)
        # transformers' stacked experts: @use_experts_implementation sets _is_expert_parallel
        if not hasattr(m, "_is_expert_parallel") or not isinstance(count, int) or count <= n:
            continue
        cls = f"{type(m).__module__}.{type(m).__qualname__}"
        if counts.setdefault(cls, count) != count:
            raise ValueError(f"export_to_gm.num_moe_experts_for_export: {cls} modules differ in expert count")
        for name, p in list(m.named_parameters(recurse=False)):
            if p.dim() >= 2 and p.shape[0] == count:  # [E, ...] stacked weights and biases
                shapes[f"{path}.{name}" if path else name] = p.shape
                setattr(m, name, torch.nn.Parameter(p.detach()[:n], requires_grad=False))
        m.num_experts = n
    if not shapes:
        raise ValueError(
            f"export_to_gm.num_moe_experts_for_export={n}: the model has no stacked experts module "
            "(transformers' @use_experts_implementation experts) with more than that many experts"
        )
    return {"n": n, "shapes": shapes, "counts": counts}


# Where transformers' experts forwards put the expert count E in the graph (argument index, offset
# from E): histc(ids, bins=E, min=0, max=E-1); the expert-parallel sentinel test ids >= E and clamps
# to E-1 (no-ops with all experts local).
_EXPERT_COUNT_ARGS = {
    aten.histc.default: ((1, 0), (3, -1)),
    aten.ge.Scalar: ((1, 0),),
    aten.clamp_.default: ((2, -1),),
    aten.clamp.default: ((2, -1),),
}


def restore_experts(gm: fx.GraphModule, cut: Dict[str, Any]) -> None:
    """Undo ``cut_experts`` in the graph: the cut expert tensors get their full shape (meta), the
    experts' count literals their full count, and every fake value is re-derived. A graph whose ops
    depended on the cut count elsewhere fails here (or differs from a full export: tests compare)."""
    n, shapes, counts = cut["n"], cut["shapes"], cut["counts"]
    restored = 0
    for name, p in list(gm.named_parameters()):
        shape = shapes.get(name)
        if shape is None or p.shape == shape:
            continue
        owner, _, leaf = name.rpartition(".")
        module = gm.get_submodule(owner) if owner else gm
        setattr(module, leaf, torch.nn.Parameter(torch.empty(shape, dtype=p.dtype, device="meta"), requires_grad=False))
        restored += 1
    if restored == 0:
        raise RuntimeError("export_to_gm.num_moe_experts_for_export: no traced expert tensor was found to restore")
    for node in gm.graph.nodes:
        if node.op == "get_attr" and node.target in shapes:
            node.meta["val"] = fake_value(gm, fetch_attr(gm, node.target))
        stack = node.meta.get("nn_module_stack") or {}
        owner_cls = list(stack.values())[-1][1] if stack else None
        full = counts.get(owner_cls) if isinstance(owner_cls, str) else None
        if full is None or node.target not in _EXPERT_COUNT_ARGS:
            continue
        args = list(node.args)
        for i, off in _EXPERT_COUNT_ARGS[node.target]:
            if i < len(args) and args[i] == n + off:
                args[i] = full + off
        node.args = tuple(args)
    try:
        run_shape_prop(gm)
    except Exception as e:  # the traced ops read the cut count (e.g. from a weight's shape)
        raise RuntimeError(
            "export_to_gm.num_moe_experts_for_export: the graph traced with fewer experts does not run "
            f"with all of them ({type(e).__name__}: {str(e).splitlines()[0][:200]}); this model's experts "
            "read the expert count from their weights: export with all experts (leave it None)"
        ) from e
