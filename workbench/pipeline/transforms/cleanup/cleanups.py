"""Post-export cleanups (stage ``post_export``) and the identity dtype-cast cleanup.

Each removes nodes that compute nothing, so later pattern matchers see the canonical chains
(``x.to(x.dtype)`` or ``x[:, 0:N]`` in the middle of an RMSNorm would otherwise break a match).
Every rule is conservative: when shape or dtype metadata cannot prove the node is an identity, it
stays.
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Tuple

import torch
import torch.fx as fx
from torch.fx.experimental.symbolic_shapes import statically_known_true

from ...context import PipelineContext
from ...graph.utils import remove_input_checks, remove_noop_slices, tensor_meta
from ...interface import Transform, TransformInfo, register, rewrite_info

aten = torch.ops.aten
prims = torch.ops.prims


def _bypass(gm: fx.GraphModule, source_of: Callable[[fx.Node], Optional[fx.Node]]) -> int:
    """Route the users of every node for which ``source_of`` names a source to that source, and
    erase the node; returns how many."""
    n = 0
    for node in list(gm.graph.nodes):
        src = source_of(node)
        if src is not None:
            node.replace_all_uses_with(src)
            gm.graph.erase_node(node)
            n += 1
    return n


def _finish(gm: fx.GraphModule, n: int, **details) -> Tuple[fx.GraphModule, TransformInfo]:
    if n:
        gm.graph.eliminate_dead_code()  # what the removed nodes alone fed
    return rewrite_info(gm, n, details)


@register("cleanup_noop_slice")
class CleanupNoopSlice(Transform):
    """Remove slices that select a whole dimension (``x[:, 0:size]``, ``x[..., :]``)."""

    def _apply(self, gm: fx.GraphModule, ctx: PipelineContext) -> Tuple[torch.nn.Module, TransformInfo]:
        return _finish(gm, remove_noop_slices(gm))


def _is_zero_tensor(node: Any) -> bool:
    if not isinstance(node, fx.Node) or node.op != "call_function":
        return False
    if node.target in (aten.zeros.default, aten.zeros_like.default, aten.new_zeros.default):
        return True
    if node.target in (aten.full.default, aten.full_like.default, aten.new_full.default):
        fill = node.args[2] if node.target is aten.new_full.default else node.args[1]
        return fill == 0
    return False


def is_noop_add(node: fx.Node) -> Optional[fx.Node]:
    """For ``x + 0`` (scalar zero or an all-zeros tensor) return ``x`` if the add is an identity.

    Identity only when the result has ``x``'s exact shape and dtype: ``x + zeros(bigger)`` broadcasts
    and ``int + 0.0`` promotes, so those stay.
    """
    if node.op != "call_function" or node.target not in (aten.add.Tensor, aten.add.Scalar):
        return None
    a, b = node.args[0], node.args[1]
    alpha = node.kwargs.get("alpha", 1)
    # add(x, 0, alpha) == x for any alpha; add(0, x, alpha) == alpha * x, so only with alpha == 1.
    pairs = [(a, b)] + ([(b, a)] if alpha == 1 else [])
    for x, other in pairs:
        zero = (isinstance(other, (int, float)) and not isinstance(other, bool) and other == 0) or (
            _is_zero_tensor(other)
        )
        if not zero or not isinstance(x, fx.Node):
            continue
        xv, out = tensor_meta(x), tensor_meta(node)
        if xv is None or out is None:
            continue
        if (
            xv.dtype == out.dtype
            and len(xv.shape) == len(out.shape)
            and all(statically_known_true(p == q) for p, q in zip(xv.shape, out.shape))
        ):
            return x
    return None


@register("cleanup_noop_add")
class CleanupNoopAdd(Transform):
    """Remove additions of zero (``x + 0``, ``x + zeros_like(x)``)."""

    def _apply(self, gm: fx.GraphModule, ctx: PipelineContext) -> Tuple[torch.nn.Module, TransformInfo]:
        return _finish(gm, _bypass(gm, is_noop_add))


@register("cleanup_input_constraints")
class CleanupInputConstraints(Transform):
    """Remove export's runtime input checks; keep the ranges they encode as graph metadata.

    ``ExportedProgram.module()`` installs a forward pre-hook and a ``_guards_fn`` node that reject
    any call whose inputs differ from the export signature. Later stages add inputs (cache
    metadata, KV caches) and change the batch layout, so the checks must go; the dynamic-dim ranges
    stay readable in ``gm.meta['range_constraints']``.
    """

    def _apply(self, gm: fx.GraphModule, ctx: PipelineContext) -> Tuple[torch.nn.Module, TransformInfo]:
        return _finish(gm, remove_input_checks(gm))


_DEFAULT_FORMATS = (None, torch.preserve_format)


def identity_cast_source(node: fx.Node) -> Optional[fx.Node]:
    """The input of a dtype cast that changes nothing observable, else None.

    Handles the three spellings tracing produces: ``aten.to.dtype``, ``aten._to_copy.default`` and
    ``prims.convert_element_type.default``.
    """
    if node.op != "call_function" or not node.args or not isinstance(node.args[0], fx.Node):
        return None
    src = node.args[0]
    x = tensor_meta(src)
    if x is None:
        return None
    kw = node.kwargs
    if node.target is aten.to.dtype:
        # to.dtype(self, dtype, non_blocking=False, copy=False, memory_format=None)
        dtype = node.args[1] if len(node.args) > 1 else kw.get("dtype")
        copy = node.args[3] if len(node.args) > 3 else kw.get("copy", False)
        fmt = node.args[4] if len(node.args) > 4 else kw.get("memory_format")
        ok = dtype == x.dtype and not copy and fmt in _DEFAULT_FORMATS
    elif node.target is aten._to_copy.default:
        # _to_copy(self, *, dtype=None, layout=None, device=None, pin_memory=None,
        #          non_blocking=False, memory_format=None)
        dtype = kw.get("dtype", x.dtype)
        device = kw.get("device")
        ok = (
            dtype == x.dtype
            and kw.get("layout") in (None, x.layout)
            and (device is None or torch.device(device) == x.device)
            and not kw.get("pin_memory")
            and kw.get("memory_format") in _DEFAULT_FORMATS
        )
    elif node.target is prims.convert_element_type.default:
        dtype = node.args[1] if len(node.args) > 1 else kw.get("dtype")
        ok = dtype == x.dtype
    else:
        return None
    return src if ok else None


@register("cleanup_identity_dtype_cast")
class CleanupIdentityDtypeCast(Transform):
    """Remove identity dtype casts where the input dtype already matches the target dtype."""

    def _apply(self, gm: fx.GraphModule, ctx: PipelineContext) -> Tuple[torch.nn.Module, TransformInfo]:
        return _finish(gm, _bypass(gm, identity_cast_source))
