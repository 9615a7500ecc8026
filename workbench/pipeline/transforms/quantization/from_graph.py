"""Quantized linears from fake-quant nodes left in the graph (stage ``pattern_matcher``).

A model with ModelOpt-style quantizers attached (``workbench.quantization.attach_quantizers``)
exports every quantized linear as ``linear(fake_quant(x, input_amax), fake_quant(W, weight_amax))``;
the amax values are buffers of the model. These transforms fold each such pair into the real op,
quantizing the weight at load time from the model's own tensors (``TensorBinding`` in the
``"model"`` namespace) -- the rewritten graph computes exactly what the fake-quant graph did:

* ``quantize_fp8_from_graph``: ``torch_fake_quant_fp8`` on input and weight (per-tensor amax) ->
  ``torch_fp8_linear`` with ``weight = to_fp8(W, amax/448)``, ``weight_scale = amax_w / 448``,
  ``input_scale = amax_x / 448``.
* ``quantize_nvfp4_from_graph``: ``torch_fake_quant_nvfp4`` (block 16) on both ->
  ``torch_nvfp4_linear`` with ``nvfp4_quantize(W, amax_w / (6 * 448))`` (packed weight, fp8 block
  scales), ``weight_scale_2 = amax_w / (6 * 448)``, ``input_scale = amax_x / (6 * 448)``.

An amax of 0 gives scale 1, as the fake-quant ops do. The amax buffers the graph no longer reads
are dropped.
"""

from __future__ import annotations

from typing import Any, List, Optional, Tuple

import torch
import torch.fx as fx

from .... import ops  # noqa: F401  (registers torch.ops.workbench)
from ....ops.quant import codecs
from ...context import PipelineContext
from ...graph.utils import call_nodes
from ...graph.weights import fetch_attr, linear_bias
from ...interface import Transform, TransformInfo, register, rewrite_info
from .graph import GraphTensors, drop_unread_attrs, get_attr_target, nothing_to_do, replace_node

aten = torch.ops.aten
wb = torch.ops.workbench
NVFP4_GLOBAL = codecs.E2M1_MAX * codecs.FP8_E4M3_MAX


def _nonzero(scale: torch.Tensor) -> torch.Tensor:
    return torch.where(scale == 0, torch.ones_like(scale), scale)


# ------------------------------------------------------------------------------ declared conversions
def fp8_scale_from_amax(amax: torch.Tensor) -> torch.Tensor:
    return _nonzero(amax.float().reshape(()) / codecs.FP8_E4M3_MAX)


def fp8_weight_from_amax(weight: torch.Tensor, amax: torch.Tensor) -> torch.Tensor:
    return codecs.to_fp8(weight, fp8_scale_from_amax(amax))


def nvfp4_global_from_amax(amax: torch.Tensor) -> torch.Tensor:
    return _nonzero(amax.float().reshape(()) / NVFP4_GLOBAL)


def nvfp4_weight_from_amax(weight: torch.Tensor, amax: torch.Tensor, block: int = 16):
    """(packed uint8 [N, K/2], block scales fp8 [N, K/16], global scale) of ``weight``."""
    return codecs.nvfp4_quantize(weight, nvfp4_global_from_amax(amax), block)


_CASTS = (aten.to.dtype, aten.to.dtype_layout, aten.to.device, aten._to_copy.default)


def _through_casts(node: Any) -> Any:
    """The tensor behind ``amax.to(x.device)`` and friends (the quantizers move amax to the input)."""
    while isinstance(node, fx.Node) and node.op == "call_function" and node.target in _CASTS:
        node = node.args[0]
    return node


def _fake_quant(node: Any, op: Any) -> Optional[Tuple[fx.Node, str]]:
    """(quantized input, amax attribute) when ``node`` is ``op(x, get_attr amax, ...)`` (casts of
    amax looked through)."""
    if not isinstance(node, fx.Node) or node.op != "call_function" or node.target is not op:
        return None
    amax = get_attr_target(_through_casts(node.args[1]))
    return (node.args[0], amax) if amax is not None else None


def _fold(gm: fx.GraphModule, ctx, key: str, fake_op: Any, fold, fmt: str) -> Tuple[fx.GraphModule, TransformInfo]:
    if not any(n.target is fake_op for n in gm.graph.nodes):
        return nothing_to_do(
            gm,
            f"no {fake_op.name().split('::')[-1]} nodes in the graph (the model has no {fmt} "
            "ModelOpt-style quantizers attached)",
        )
    t = GraphTensors(gm, None, ctx.weights)
    done: List[str] = []
    left: List[str] = []
    amaxes: List[str] = []
    for node in call_nodes(gm, aten.linear.default):
        x, w = _fake_quant(node.args[0], fake_op), _fake_quant(node.args[1], fake_op)
        if x is None or w is None:
            continue
        weight = get_attr_target(w[0])
        if weight is None or not weight.endswith(".weight"):
            continue
        why = fold.problem(gm, node, x, w)
        if why:
            left.append(f"{weight}: {why}")
            continue
        module = weight[: -len(".weight")]
        args = fold.arguments(t, module, weight, x[1], w[1], node)
        bias = linear_bias(node)
        fq_nodes = [node.args[0], node.args[1], w[0]]
        replace_node(gm, node, fold.op, (x[0], *args), {"bias": bias} if bias is not None else {}, t, replaced=fq_nodes)
        amaxes += [x[1], w[1]]
        done.append(module)
    if done:
        gm.graph.eliminate_dead_code()  # the amax casts the fake-quant nodes read
    dropped = drop_unread_attrs(gm, amaxes)
    gm, info = rewrite_info(gm, len(done), {"quantized": done, "left": left, "amax_dropped": len(dropped)})
    if not done:
        info = info.model_copy(
            update={
                "skip_reason": left
                and f"{len(left)} fake-quant linears could not be folded"
                or f"no linear reads {fake_op.name()} outputs (no ModelOpt-style quantizers "
                "were attached to the model before export)"
            }
        )
    return gm, info


class _FP8Fold:
    op = wb.torch_fp8_linear.default

    def problem(self, gm, node, x, w):
        if fetch_attr(gm, x[1]).numel() != 1 or fetch_attr(gm, w[1]).numel() != 1:
            return "per-channel amax (torch_fp8_linear takes per-tensor scales)"
        return None

    def arguments(self, t, module, weight, x_amax, w_amax, before):
        t.bind(weight, [weight, w_amax], fp8_weight_from_amax, namespace="model")
        t.bind(f"{module}.input_scale", [x_amax], fp8_scale_from_amax, namespace="model")
        t.bind(f"{module}.weight_scale", [w_amax], fp8_scale_from_amax, namespace="model")
        return [t.node(n, before) for n in (weight, f"{module}.input_scale", f"{module}.weight_scale")]


class _NVFP4Fold:
    op = wb.torch_nvfp4_linear.default

    def problem(self, gm, node, x, w):
        blocks = [fq.args[2] if len(fq.args) > 2 else fq.kwargs.get("block_size", 16) for fq in node.args[:2]]
        if any(b != 16 for b in blocks):
            return f"block sizes {blocks} (torch_nvfp4_linear uses 16)"
        if fetch_attr(gm, x[1]).numel() != 1 or fetch_attr(gm, w[1]).numel() != 1:
            return "per-channel amax (NVFP4 has one global scale per tensor)"
        return None

    def arguments(self, t, module, weight, x_amax, w_amax, before):
        t.bind(weight, [weight, w_amax], nvfp4_weight_from_amax, namespace="model", output=0)
        t.bind(f"{module}.weight_scale", [weight, w_amax], nvfp4_weight_from_amax, namespace="model", output=1)
        t.bind(f"{module}.weight_scale_2", [w_amax], nvfp4_global_from_amax, namespace="model")
        t.bind(f"{module}.input_scale", [x_amax], nvfp4_global_from_amax, namespace="model")
        names = (weight, f"{module}.input_scale", f"{module}.weight_scale", f"{module}.weight_scale_2")
        return [t.node(n, before) for n in names]


@register("quantize_fp8_from_graph")
class QuantizeFp8FromGraph(Transform):
    """``linear(fake_quant_fp8(x), fake_quant_fp8(W))`` -> ``torch_fp8_linear`` (weight quantized at load)."""

    changes_numerics = True  # quantizes: meant to move the logits

    def _apply(self, gm: fx.GraphModule, ctx: PipelineContext) -> Tuple[torch.nn.Module, TransformInfo]:
        return _fold(gm, ctx, self.key, wb.torch_fake_quant_fp8.default, _FP8Fold(), "FP8")


@register("quantize_nvfp4_from_graph")
class QuantizeNvfp4FromGraph(Transform):
    """``linear(fake_quant_nvfp4(x), fake_quant_nvfp4(W))`` -> ``torch_nvfp4_linear`` (weight quantized at load)."""

    changes_numerics = True  # quantizes: meant to move the logits

    def _apply(self, gm: fx.GraphModule, ctx: PipelineContext) -> Tuple[torch.nn.Module, TransformInfo]:
        return _fold(gm, ctx, self.key, wb.torch_fake_quant_nvfp4.default, _NVFP4Fold(), "NVFP4")


__all__ = [
    "QuantizeFp8FromGraph",
    "QuantizeNvfp4FromGraph",
    "fp8_weight_from_amax",
    "fp8_scale_from_amax",
    "nvfp4_weight_from_amax",
    "nvfp4_global_from_amax",
]
