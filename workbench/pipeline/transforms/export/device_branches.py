"""Device-neutralising rewrites of the exported graph: a trace on ``meta`` gets a CPU trace's ops.

Three facts of a trace depend on its device, and each is rewritten away
(``export_to_gm.normalize_device_branches``, on by default, runs all three):

- HF attention ends in ``attn_output.transpose(1, 2).contiguous().reshape(...)``. Whether
  ``contiguous`` is a no-op (and so absent from the trace) depends on the strides the trace
  device's SDPA kernel returns: on CPU it is absent, on ``meta`` it is a real node. ``reshape``
  copies when it must, so a ``contiguous`` whose only users are reshapes changes no value; it is
  dropped (``drop_contiguous_before_reshape``) and the meta and CPU traces have the same op histogram.
- HF's own device branch in the grouped-MoE forward (histc on int ids off CPU): ``histc_on_float``.
- A constant made in the forward is read through ``lift_fresh_copy`` on a device with data and
  directly on meta: ``drop_lift_fresh_copy``.
"""

from __future__ import annotations

from typing import Dict

import torch
import torch.fx as fx

aten = torch.ops.aten


def normalize_device_branches(gm: fx.GraphModule) -> Dict[str, int]:
    """The device-neutralising rewrites (see the module docstring); counts per rewrite."""
    return {
        "contiguous_before_reshape": drop_contiguous_before_reshape(gm),
        "histc_on_float": histc_on_float(gm),
        "lift_fresh_copy": drop_lift_fresh_copy(gm),
    }


def drop_lift_fresh_copy(gm: fx.GraphModule) -> int:
    """Remove ``aten.lift_fresh_copy`` of a lifted constant when nothing mutates the copy.

    A tensor made in forward from Python data (``torch.tensor([...])``, a list index) is read
    through ``lift_fresh_copy`` (a copy, guarding the constant against in-place use) when traced on
    a device with data, and directly when traced on meta. The copy changes no value unless a user
    writes to it; dropped, the meta and CPU traces have the same ops.
    """
    n = 0
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target is not aten.lift_fresh_copy.default:
            continue
        src = node.args[0]
        if not isinstance(src, fx.Node) or src.op != "get_attr":
            continue
        schemas = [getattr(u.target, "_schema", None) for u in node.users]
        if any(s is None or s.is_mutable for s in schemas):
            continue  # a user that may write to the copy (or that we cannot tell)
        node.replace_all_uses_with(src)
        gm.graph.erase_node(node)
        n += 1
    return n


def histc_on_float(gm: fx.GraphModule) -> int:
    """Make ``histc`` count integer ids cast to float32, not to an integer dtype.

    transformers' grouped-MoE forward casts the sorted expert ids to float on CPU/MPS and to int32
    elsewhere (CUDA's deterministic histc takes ints; CPU histc rejects them). Traced on meta it
    takes the int branch, and that graph cannot run on CPU. Float ids count the same (they are small
    integers, exact in fp32) and run on both, except on CUDA under
    ``torch.use_deterministic_algorithms(True)``.
    """
    n = 0
    for node in gm.graph.nodes:
        if node.op != "call_function" or node.target is not aten.histc.default:
            continue
        src = node.args[0]
        if (
            isinstance(src, fx.Node)
            and src.target is aten.to.dtype
            and len(src.args) >= 2
            and not src.args[1].is_floating_point
            and len(src.users) == 1
        ):
            src.args = (src.args[0], torch.float32, *src.args[2:])
            val = src.meta.get("val")
            if isinstance(val, torch.Tensor):
                src.meta["val"] = val.to(torch.float32)
            n += 1
    return n


def drop_contiguous_before_reshape(gm: fx.GraphModule) -> int:
    """Remove ``aten.contiguous`` nodes whose users are all ``aten.reshape`` (see module docstring)."""
    n = 0
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target is not aten.contiguous.default:
            continue
        if len(node.args) > 1 or node.kwargs.get("memory_format", torch.contiguous_format) != torch.contiguous_format:
            continue  # channels-last and friends: a real layout request
        if node.users and all(u.target is aten.reshape.default for u in node.users):
            node.replace_all_uses_with(node.args[0])
            gm.graph.erase_node(node)
            n += 1
    return n
