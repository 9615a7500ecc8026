"""Tensors made inside the model's forward, recovered for a meta trace.

Tensors made inside ``forward`` from Python data -- ``torch.tensor([...], device=x.device)``, or an
index list (Falcon's multi-query split ``fused_qkv[..., [-2], :]`` makes an index tensor on the
input's device inside ``Tensor.__getitem__``) -- are constants to export, which lifts them into the
graph as attributes (``<module>.lifted_tensor_<n>``). Made on ``meta``, they have no values, and
nothing in the eager model holds them. Their values cannot depend on the weights (export would
have traced the computation instead), only on the code path, so they are recovered from a second
export of the same (truncated) module on ``cpu`` with uninitialised weights (``torch.empty``: never
read, as export fakes them; the pages are never touched), matched by name, shape and dtype, and
recorded (``weights.record_forward_constant``); ``load_weights`` binds them like weights. The
second export runs only when the first lifted such tensors (most models lift none). Why not
intercept the creation calls while tracing on meta: the index tensor of ``x[..., [i]]`` is made in
C++ with Python dispatch excluded, so no mode sees it -- re-tracing on a device that keeps data
covers every way a forward can make a constant.
"""

from __future__ import annotations

from typing import Any, Dict

import torch
import torch.fx as fx

from ...graph.weights import fetch_attr


def meta_constants(gm: fx.GraphModule, ep: Any) -> Dict[str, torch.Tensor]:
    """The tensors export lifted from the forward (``lifted_tensor_constants``) that hold no values:
    made on ``meta``. Target name -> the graph module's meta tensor."""
    out: Dict[str, torch.Tensor] = {}
    for target in ep.graph_signature.lifted_tensor_constants:
        try:
            value = fetch_attr(gm, target)
        except AttributeError:  # not read by the unlifted module
            continue
        if isinstance(value, torch.Tensor) and value.is_meta:
            out[target] = value
    return out


def constant_values(made: Dict[str, torch.Tensor], cpu_ep: Any) -> Dict[str, torch.Tensor]:
    """Each meta constant's value from the CPU export, matched by name, shape and dtype; raises
    naming those the CPU trace did not make the same way (its code path differed)."""
    values, differ = {}, []
    for target, meta in made.items():
        real = cpu_ep.constants.get(target)
        if not isinstance(real, torch.Tensor) or real.is_meta or real.shape != meta.shape or real.dtype != meta.dtype:
            got = f"{tuple(real.shape)} {real.dtype}" if isinstance(real, torch.Tensor) else "nothing"
            differ.append(f"{target} ({tuple(meta.shape)} {meta.dtype}; on cpu: {got})")
            continue
        values[target] = real.detach().clone()
    if differ:
        raise RuntimeError(
            f"export_to_gm: {len(differ)} tensor(s) made inside the model's forward were lifted by export on meta "
            f"without values, and a trace on cpu did not make them the same way: {'; '.join(differ[:4])}. "
            "Export on the model's device instead (export_to_gm.trace_device=model)."
        )
    return values


def forget_meta_constants(gm: fx.GraphModule, made: Dict[str, torch.Tensor]) -> None:
    """The fake values of the ``get_attr`` nodes reading ``made`` carry their meta tensor as the fake
    tensor's ``constant`` (what fake mode propagates through ops): a constant without data, which
    moving the fake value to the device (``load_weights``) would try to copy. Dropped; the real values
    are recorded."""
    for node in gm.graph.nodes:
        val = node.meta.get("val")
        if node.op == "get_attr" and node.target in made and getattr(val, "constant", None) is not None:
            val.constant = None
