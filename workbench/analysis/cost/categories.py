"""The op category of a graph node or profiler event, and the names the cost rules go by.

``category_of(ns, name)`` puts every op in one of ``CATEGORIES``: ``workbench::*`` ops as they
declare themselves (``OpTraits.category``), ATen ops by name (views, matmuls, norms, attention,
gathers; anything else elementwise), Python calls as views. ``op_parts`` splits a node's target
into (namespace, op name); ``base_name`` strips a backend prefix (``cpu_``, ``triton_``, ...), so a
backend op is costed as its canonical ``torch_*`` op.
"""

from __future__ import annotations

from typing import Tuple

import torch
import torch.fx as fx

from ...ops.library import op_traits

BACKEND_PREFIXES = ("torch_", "cpu_", "triton_", "flashinfer_")
CATEGORIES = ("matmul", "attention", "norm", "elementwise", "moe", "quant", "view", "other")

VIEW_OPS = frozenset(
    "view _unsafe_view reshape unsqueeze squeeze expand permute transpose t slice select split "
    "split_with_sizes alias detach as_strided unflatten flatten chunk unbind narrow view_as expand_as "
    "movedim sym_size sym_numel sym_stride sym_storage_offset _assert_tensor_metadata _assert_scalar "
    "sym_constrain_range_for_size sym_constrain_range lift_fresh_copy scalar_tensor".split()
)
MATMUL_OPS = frozenset("mm addmm bmm baddbmm matmul linear _scaled_mm".split())
NORM_OPS = frozenset("layer_norm native_layer_norm group_norm rms_norm _fused_rms_norm".split())
ATTENTION_OPS = frozenset("scaled_dot_product_attention _scaled_dot_product_flash_attention_for_cpu".split())
GATHER_OPS = frozenset("embedding index_select gather index int8_embedding".split())


def op_parts(node: fx.Node) -> Tuple[str, str]:
    """(namespace, op name) of a call: ("aten", "linear"), ("workbench", "cpu_linear"),
    ("python", "getitem")."""
    t = node.target
    if isinstance(t, torch._ops.OpOverload):
        ns, name = t.name().split("::", 1)
        return ns, name.split(".")[0]
    if isinstance(t, torch._ops.OpOverloadPacket):
        return t._qualified_op_name.split("::", 1)[0], t._qualified_op_name.split("::", 1)[1]
    return "python", getattr(t, "__name__", str(t))


def base_name(name: str) -> str:
    """A backend op's canonical name: ``cpu_cached_attention`` -> ``cached_attention``."""
    for p in BACKEND_PREFIXES:
        if name.startswith(p):
            return name[len(p) :]
    return name


def category_of(ns: str, name: str) -> str:
    """The op category of ``ns::name`` (also used for profiler event names)."""
    if ns == "python":
        return "view"  # getitem, scalar arithmetic on sizes
    if ns == "workbench":  # declared at the op (OpTraits.category)
        traits = op_traits(name)
        return traits.category if traits is not None else "other"
    base = name
    if base in VIEW_OPS:
        return "view"
    if base in MATMUL_OPS:
        return "matmul"
    if base in NORM_OPS:
        return "norm"
    if base in ATTENTION_OPS:
        return "attention"
    if base in GATHER_OPS or base in ("cat", "stack", "index_put", "scatter", "arange", "zeros", "full", "empty"):
        return "other"
    return "elementwise"


__all__ = ["CATEGORIES", "GATHER_OPS", "base_name", "category_of", "op_parts"]
