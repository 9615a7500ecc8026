"""Preparing quantized linears for fusion: one GEMM needs one scale per quantized tensor.

Fusing q/k/v (or gate/up) into one weight means one input quantizer, one pre-quant scale and --
for per-tensor formats -- one weight amax for the concatenated weight. These functions make the
modules agree before they are concatenated: the pre-quant scales are re-smoothed to their mean, and
the amax values are raised to their maximum (the larger range covers every member).
"""

from __future__ import annotations

from typing import Any, List, Sequence

import torch
import torch.nn as nn

from .formats import get_quantization_format
from .quantizer import SequentialQuantizer
from .smoothing import pre_quant_scales_of

# Child-name heads treated as attention input projections by adjust_attn_amax_values.
QKV_NAME_HEADS = ("q", "k", "v", "qkv", "kv", "query", "key", "value")


def all_items_same(item_list: Sequence[Any]) -> bool:
    """Checks if all elements in the provided list are the same (tensors: equal shape and values;
    an empty list counts as all the same)."""
    items = list(item_list)

    def same(a, b) -> bool:
        if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
            return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and torch.equal(a, b)
        return a == b

    return all(same(items[0], x) for x in items[1:])


def _unify_amax(quantizers, what: str) -> None:
    """Set every quantizer's per-tensor amax to their maximum."""
    amaxes = [q.amax for q in quantizers]
    if any(a is None for a in amaxes):
        return
    if any(a.numel() != 1 for a in amaxes):
        raise ValueError(
            f"{what}: only per-tensor amax values can be shared by fused modules, got shapes "
            f"{[tuple(a.shape) for a in amaxes]}"
        )
    shared = torch.stack([a.reshape(()) for a in amaxes]).max()
    for q in quantizers:
        q.amax = shared


def preprocess_linear_fusion(modules: Sequence[Any], resmooth_only: bool = False) -> None:
    """Preprocess the quantized linears that we plan to fuse.

    Use resmooth_only for MOE experts as each individual expert is not fused.

    In place, on modules that must all have the same quantization format: (1) pre-quant scales are
    re-smoothed to their mean (weights multiplied by old / mean column-wise, weight amax
    recalibrated), which leaves each module's float output unchanged; unless ``resmooth_only``,
    (2) per-tensor input amax and (3) per-tensor weight amax (the FP8 stage of W4A8-AWQ; the NVFP4
    global amax) become the maximum over the modules. Input amax values were calibrated on the old
    pre-scaled inputs; recalibrate activations afterwards where exact ranges matter.
    """
    if not modules:
        raise ValueError("preprocess_linear_fusion: no modules given")
    formats = [get_quantization_format(m) for m in modules]
    if not all_items_same(formats):
        raise ValueError(f"preprocess_linear_fusion: modules to fuse must share a quantization format, got {formats}")
    first_input = getattr(modules[0], "input_quantizer", None)
    if first_input is not None and first_input.pre_quant_scale is not None:
        scales = pre_quant_scales_of(modules, "preprocess_linear_fusion")
        mean = torch.stack(scales).mean(dim=0)
        for m, scale in zip(modules, scales):
            if torch.equal(scale, mean):
                continue
            with torch.no_grad():
                factor = (scale / mean).to(m.weight.dtype)
                m.weight = nn.Parameter(m.weight * factor, requires_grad=m.weight.requires_grad)
            m.input_quantizer.pre_quant_scale = mean
            m.weight_quantizer.reset_amax()
            m.weight_quantizer.collect(m.weight)
    if resmooth_only:
        return
    if first_input is not None and first_input.is_enabled:
        _unify_amax([m.input_quantizer for m in modules], "preprocess_linear_fusion")
    weight_quantizers: List[Any] = [getattr(m, "weight_quantizer", None) for m in modules]
    if any(q is None or not q.is_enabled for q in weight_quantizers):
        return
    if isinstance(weight_quantizers[0], SequentialQuantizer):
        _unify_amax([q[-1] for q in weight_quantizers], "preprocess_linear_fusion")
    elif weight_quantizers[0].amax is not None and weight_quantizers[0].amax.numel() == 1:
        _unify_amax(weight_quantizers, "preprocess_linear_fusion")


def _is_qkv(name: str) -> bool:
    return name.split("_", 1)[0] in QKV_NAME_HEADS


def adjust_attn_amax_values(module: nn.Module) -> None:
    """Adjusts the amax values for the attention layers.

    The children of ``module`` that are q/k/v projections (names starting ``q_``, ``k_``, ``v_``,
    ``qkv_``, ``kv_``, or ``query`` / ``key`` / ``value``) with a calibrated per-tensor weight amax
    all get the largest of those amax values, so the projections can be fused into one GEMM with
    one weight scale.
    """
    projections: List[Any] = [  # quantized linears, read by attribute
        child
        for name, child in module.named_children()
        if _is_qkv(name) and getattr(getattr(child, "weight_quantizer", None), "amax", None) is not None
    ]
    if not projections:
        raise ValueError(
            "adjust_attn_amax_values: no q/k/v projection children with a calibrated weight amax in "
            f"{type(module).__name__} (children: {[n for n, _ in module.named_children()]})"
        )
    _unify_amax([p.weight_quantizer for p in projections], "adjust_attn_amax_values")
    if float(projections[0].weight_quantizer.amax) <= 0:
        raise ValueError("adjust_attn_amax_values: the q/k/v weight amax is 0 (all-zero weights?)")
