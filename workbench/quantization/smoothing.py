"""AWQ / SmoothQuant pre-quant scales: re-smoothing weights to a common scale, fusing it into a norm.

A smoothed linear computes ``(x * s) @ W_s.T`` with ``W_s = W / s`` column-wise (``s`` = the input
quantizer's ``pre_quant_scale`` [K]): the float result is ``x @ W.T``, but the quantized one is
better because ``s`` moves outliers from activations into weights. Two linears that read the same
input (q/k/v, gate/up, the shards of one weight across tensor-parallel ranks) must share ``s`` to be
fused or to read one pre-scaled input, so their weights are *re-smoothed* to a common ``s'``:
``W' = W_s * s / s'`` keeps ``(x * s') @ W'.T == (x * s) @ W_s.T``.
"""

from __future__ import annotations

from typing import Any, List, Optional, Sequence, Tuple

import torch
import torch.nn as nn

from ..ops.quant import codecs
from .formats import INT4_FORMATS, QUANTIZATION_INT8_SQ, QUANTIZATION_NVFP4_AWQ
from .scaling import get_scaling_factor_from_weight

_RESMOOTH_FORMATS = (None, *INT4_FORMATS, QUANTIZATION_INT8_SQ, QUANTIZATION_NVFP4_AWQ)


def resmooth_and_get_scale(
    merged_weights: torch.Tensor,
    pre_quant_scales: List[torch.Tensor],
    ranks: int,
    group_size: int,
    new_pre_quant_scale: Optional[torch.Tensor] = None,
    quantization: Optional[str] = None,
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Resmooths weights from a single or multiple ranks and get scaling factors and amax.

    ``merged_weights`` [ranks * N_r, K] holds each rank's smoothed weight rows (rank r's are chunk r),
    ``pre_quant_scales`` each rank's scale [K]. Returns (resmoothed weights [ranks * N_r, K], their
    weight scaling factors, the new pre-quant scale [K] -- ``new_pre_quant_scale``, or the mean of
    ``pre_quant_scales`` when not given). The scaling factors are ``get_scaling_factor_from_weight``
    (int4 groups [ranks * N_r, K / group_size], or int8 rows [ranks * N_r] with ``group_size`` 0);
    for ``"nvfp4_awq"`` the fp8 block scales [ranks * N_r, K / group_size] of ``nvfp4_quantize``,
    each rank's relative to that rank's own global scale (amax / (6 * 448), not returned).
    """
    if merged_weights.dim() != 2:
        raise ValueError(f"resmooth_and_get_scale: needs a 2-D merged weight, got {tuple(merged_weights.shape)}")
    if ranks < 1 or len(pre_quant_scales) != ranks or merged_weights.shape[0] % ranks:
        raise ValueError(
            f"resmooth_and_get_scale: needs one pre_quant_scale per rank and rows divisible by ranks; "
            f"got {len(pre_quant_scales)} scales, ranks={ranks}, weight {tuple(merged_weights.shape)}"
        )
    if quantization not in _RESMOOTH_FORMATS:
        raise ValueError(
            f"resmooth_and_get_scale: quantization {quantization!r} has no pre-quant scale; use one of "
            f"{_RESMOOTH_FORMATS}"
        )
    k = merged_weights.shape[1]
    if new_pre_quant_scale is None:
        new_pre_quant_scale = torch.stack([s.reshape(-1) for s in pre_quant_scales]).mean(dim=0)
    if new_pre_quant_scale.numel() != k or any(s.numel() != k for s in pre_quant_scales):
        raise ValueError(f"resmooth_and_get_scale: pre-quant scales must have K={k} entries")
    dtype = merged_weights.dtype
    new_scale = new_pre_quant_scale.reshape(-1).to(dtype)
    weights, scales = [], []
    for chunk, old in zip(merged_weights.chunk(ranks, dim=0), pre_quant_scales):
        weight = chunk * old.reshape(-1).to(dtype) / new_scale
        weights.append(weight)
        if quantization == QUANTIZATION_NVFP4_AWQ:
            # fp8 tensors cannot be concatenated on every device: carry their bytes
            scales.append(codecs.nvfp4_quantize(weight, None, group_size)[1].view(torch.uint8))
        else:
            scales.append(get_scaling_factor_from_weight(weight, group_size))
    scale = torch.cat(scales, dim=0)
    if quantization == QUANTIZATION_NVFP4_AWQ:
        scale = scale.view(torch.float8_e4m3fn)
    return torch.cat(weights, dim=0), scale, new_pre_quant_scale


def pre_quant_scales_of(modules: Sequence[nn.Module], what: str) -> List[torch.Tensor]:
    """Each module's input-quantizer ``pre_quant_scale``; a ``ValueError`` (prefixed ``what``) if one lacks it."""
    scales = []
    for m in modules:
        q = getattr(m, "input_quantizer", None)
        s = getattr(q, "pre_quant_scale", None) if q is not None else None
        if s is None:
            raise ValueError(
                f"{what}: every module needs an input_quantizer with a pre_quant_scale; {type(m).__name__} has none"
            )
        scales.append(s)
    return scales


def fuse_prequant_layernorm(layernorm_module: nn.Module, modules: Sequence[Any]) -> None:
    """Scales layernorm weights with avg_pre_quant_scale of the modules list and sets pre_quant_scales
    to be deleted.

    ``norm(x) * weight (+ bias)`` followed by ``* s`` in each linear's input quantizer becomes
    ``norm(x) * (weight * s) (+ bias * s)``: the norm's weight (and bias) absorb ``s`` and the
    linears' ``pre_quant_scale`` is removed (``fused_with_layernorm`` is set on them, so NVFP4 still
    reads as ``nvfp4_awq``). The output of norm + linears is unchanged. All modules must share one
    scale (run ``preprocess_linear_fusion`` first to re-smooth them), and the norm must scale by its
    weight directly (LayerNorm, Llama's RMSNorm; not Gemma's ``1 + weight``).
    """
    if not modules:
        raise ValueError("fuse_prequant_layernorm: no modules given")
    scales = pre_quant_scales_of(modules, "fuse_prequant_layernorm")
    if not all(torch.equal(scales[0], s) for s in scales[1:]):
        raise ValueError(
            "fuse_prequant_layernorm: the modules' pre_quant_scales differ, so one norm weight cannot "
            "absorb them; call preprocess_linear_fusion(modules) first to re-smooth them to their mean"
        )
    scale = torch.stack(scales).mean(dim=0)
    weight = getattr(layernorm_module, "weight", None)
    if not isinstance(weight, torch.Tensor) or weight.shape != scale.shape:
        raise ValueError(
            f"fuse_prequant_layernorm: the norm needs a weight of shape {tuple(scale.shape)}, got "
            f"{None if weight is None else tuple(weight.shape)}"
        )
    with torch.no_grad():
        layernorm_module.weight = nn.Parameter(weight * scale.to(weight.dtype), requires_grad=weight.requires_grad)
        bias = getattr(layernorm_module, "bias", None)
        if isinstance(bias, torch.Tensor):
            layernorm_module.bias = nn.Parameter(bias * scale.to(bias.dtype), requires_grad=bias.requires_grad)
    for m in modules:
        m.input_quantizer.pre_quant_scale = None
        m.fused_with_layernorm = True
