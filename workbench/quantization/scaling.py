"""Scaling factors as checkpoints store them, read from a module's quantizers (or from a weight).

A *scaling factor* multiplies a quantized value back: ``w ~= q * scale``. For the per-tensor and
per-group formats it is ``amax / maxbound`` (448 fp8, 127 int8, 7 int4). NVFP4 has two levels:
``weight_scale_2`` (global) = amax / (6 * 448) and per-16 fp8 block scales relative to it; MXFP4 has
e8m0 (uint8) block scales. Shapes, for a weight [N, K]:

==============  ====================================  =============================
format          ``get_weight_scaling_factor``         ``get_weight_scaling_factor_2``
==============  ====================================  =============================
fp8             fp32 0-d                              None
fp8_pb_wo       fp32 [ceil(N/b), ceil(K/b)]           None
int8_sq / _wo   fp32 [N]                              None
int4_awq        fp32 [N, K/g]                         None
w4a8_awq        fp32 [N, K/g] (int4 stage)            fp32 0-d (fp8 stage, amax/448)
nvfp4 / _awq    float8_e4m3fn [..., K/16]             fp32 0-d (amax / (6 * 448))
mxfp4           uint8 e8m0 [..., K/32]                None
==============  ====================================  =============================
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn as nn

from ..ops.quant import codecs
from .formats import NVFP4_FORMATS, QUANTIZATION_MXFP4, QUANTIZATION_NONE, quantizer_names, weight_format
from .quantizer import SequentialQuantizer, TensorQuantizer

NVFP4_GLOBAL_MAXBOUND = codecs.E2M1_MAX * codecs.FP8_E4M3_MAX  # 6 * 448: the largest NVFP4 value


def get_scaling_factor(quantizer: Optional[TensorQuantizer]) -> Optional[torch.Tensor]:
    """Returns scaling factor from the quantizer as torch.Tensor.

    ``amax / maxbound`` in fp32 (the amax layout's shape); for FP4 quantizers the NVFP4 global scale
    ``amax / (6 * 448)``. ``None`` when the quantizer is disabled or not calibrated. An amax of 0 (an
    all-zero tensor or block) gives a scale of 1, as the codecs do, so nothing divides 0 by 0.
    """
    if quantizer is None or not quantizer.is_enabled or quantizer.amax is None:
        return None
    amax = quantizer.amax.float()
    if not bool(torch.isfinite(amax).all()) or bool((amax < 0).any()):
        raise ValueError(f"get_scaling_factor: amax must be finite and non-negative, got {amax}; recalibrate")
    bound = NVFP4_GLOBAL_MAXBOUND if quantizer.num_bits == (2, 1) else quantizer.maxbound
    scale = amax / bound
    return torch.where(scale == 0, torch.ones_like(scale), scale)


def get_scaling_factor_from_weight(weight: torch.Tensor, group_size: int) -> torch.Tensor:
    """Calculate the weight scaling factor for a given group size.

    weight [N, K] -> ``group_size`` 0: per output row amax / 127 (int8) [N]; otherwise per group of
    ``group_size`` input columns amax / 7 (int4) [N, K / group_size]. Zeros become 1.
    """
    if weight.dim() != 2:
        raise ValueError(f"get_scaling_factor_from_weight: needs a 2-D weight [N, K], got {tuple(weight.shape)}")
    n, k = weight.shape
    if group_size < 0:
        raise ValueError(f"get_scaling_factor_from_weight: group_size must be >= 0, got {group_size}")
    if group_size:
        if k % group_size:
            raise ValueError(f"get_scaling_factor_from_weight: K={k} is not a multiple of group_size={group_size}")
        amax, bound = weight.detach().float().abs().reshape(n, k // group_size, group_size).amax(dim=-1), 7.0
    else:
        amax, bound = weight.detach().float().abs().amax(dim=-1), 127.0
    scale = amax / bound
    return torch.where(scale == 0, torch.ones_like(scale), scale)


def get_activation_scaling_factor(
    module: nn.Module, input_quantizer_name: str = "input_quantizer"
) -> Optional[torch.Tensor]:
    """Returns the activation scaling factor.

    ``get_scaling_factor`` of the module's input quantizer: amax / 448 for FP8, amax / 127 for INT8,
    and the NVFP4 input global scale amax / (6 * 448) for NVFP4 inputs. ``None`` without an enabled,
    calibrated input quantizer.
    """
    return get_scaling_factor(getattr(module, input_quantizer_name, None))


def _weight_quantizer(module: nn.Module, weight_name: str):
    return getattr(module, quantizer_names(weight_name)[0], None)


def get_weight_scaling_factor(module: nn.Module, weight_name: str = "weight") -> Optional[torch.Tensor]:
    """Returns the weight scaling factor (see the module docstring's table for each format).

    NVFP4 block scales are computed from the weight with the global scale of
    ``get_weight_scaling_factor_2``, MXFP4 e8m0 scales from the weight alone (both with the codecs,
    so they are the scales ``to_quantized_weight`` quantizes with).
    """
    quantizer = _weight_quantizer(module, weight_name)
    if quantizer is None:
        return None
    if isinstance(quantizer, SequentialQuantizer):
        return get_scaling_factor(quantizer[0])
    fmt = weight_format(module, weight_name)
    if fmt is QUANTIZATION_NONE:
        return None
    weight = getattr(module, weight_name)
    if fmt in NVFP4_FORMATS:
        global_scale = get_weight_scaling_factor_2(module, weight_name)
        if global_scale is None:
            return None
        return codecs.nvfp4_quantize(weight, global_scale, quantizer.block_size)[1]
    if fmt == QUANTIZATION_MXFP4:
        return codecs.mxfp4_quantize(weight, quantizer.block_size)[1]
    return get_scaling_factor(quantizer)


def get_weight_scaling_factor_2(module: nn.Module, weight_name: str = "weight") -> Optional[torch.Tensor]:
    """Returns the secondary weight scaling factor: the NVFP4 global scale amax / (6 * 448), or the
    per-tensor FP8 stage of a W4A8-AWQ weight (amax / 448); ``None`` for single-level formats."""
    quantizer = _weight_quantizer(module, weight_name)
    if quantizer is None:
        return None
    if isinstance(quantizer, SequentialQuantizer):
        return get_scaling_factor(quantizer[-1]) if len(quantizer) == 2 else None
    if weight_format(module, weight_name) in NVFP4_FORMATS:
        return get_scaling_factor(quantizer)
    return None


def get_prequant_scaling_factor(module: nn.Module) -> Optional[torch.Tensor]:
    """Returns the prequant scaling factor: the input quantizer's ``pre_quant_scale`` (AWQ /
    SmoothQuant), squeezed to [K]; ``None`` when there is none."""
    quantizer = getattr(module, "input_quantizer", None)
    scale = getattr(quantizer, "pre_quant_scale", None) if quantizer is not None else None
    if scale is None:
        return None
    scale = scale.squeeze()
    if not bool((scale > 0).all()):
        raise ValueError(
            "get_prequant_scaling_factor: the pre_quant_scale has non-positive entries; it divides "
            "the weight columns, so every entry must be > 0"
        )
    return scale


def get_weight_block_size(module: nn.Module, weight_name: str = "weight") -> int:
    """Returns the weight block size: the group / block along the input dim (int4 groups, NVFP4 16,
    MXFP4 32, block FP8), or 0 for unquantized, per-tensor or per-channel weights."""
    quantizer = _weight_quantizer(module, weight_name)
    if isinstance(quantizer, SequentialQuantizer):
        quantizer = quantizer[0]
    if quantizer is None or not quantizer.is_enabled:
        return 0
    return quantizer.block_size
