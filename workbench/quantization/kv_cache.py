"""KV-cache quantization read from an attention module's ``k_bmm_quantizer`` / ``v_bmm_quantizer``.

The KV-cache format is a property of the whole model (``hf_quant_config.json``'s
``kv_cache_quant_algo``): ``"FP8"``, ``"INT8"``, ``"NVFP4"`` or ``"NVFP4_AFFINE"`` (NVFP4 with a
per-tensor ``bias_value`` offset); ``None`` when the cache is not quantized.
"""

from __future__ import annotations

import warnings
from typing import List, Optional, Sequence, Union

import torch
import torch.nn as nn

from .formats import KV_CACHE_FP8, KV_CACHE_INT8, KV_CACHE_NVFP4, KV_CACHE_NVFP4_AFFINE
from .scaling import get_scaling_factor

KV_QUANTIZERS = ("k_bmm_quantizer", "v_bmm_quantizer")

# An FP8 KV scale above this means calibrated activations beyond 0.5 * 448 = 224 (ModelOpt's threshold
# for warning that a quantized KV cache may cost accuracy).
LARGE_FP8_KV_SCALE = 0.5


def get_kv_cache_bias(kv_module: nn.Module) -> List[Optional[torch.Tensor]]:
    """Returns the kv_cache bias if _bias_value is set. Else returns None.

    [k bias, v bias]: each the quantizer's ``_bias_value`` (affine KV cache), or None."""
    out = []
    for name in KV_QUANTIZERS:
        quantizer = getattr(kv_module, name, None)
        out.append(getattr(quantizer, "_bias_value", None) if quantizer is not None else None)
    return out


def get_kv_cache_dtype(modules: Union[Sequence[nn.Module], nn.Module]) -> Optional[str]:
    """Returns the kv_cache dtype.

    From the enabled ``k_bmm_quantizer`` / ``v_bmm_quantizer`` / ``output_quantizer`` of the
    module(s): num_bits (4, 3) -> ``"FP8"``; 8 -> ``"INT8"``; (2, 1) -> ``"NVFP4"``, or
    ``"NVFP4_AFFINE"`` when every such quantizer has a ``_bias_value``; otherwise ``None``.
    """
    if isinstance(modules, nn.Module):
        modules = [modules]
    num_bits, affine = [], True
    for module in modules:
        for name in (*KV_QUANTIZERS, "output_quantizer"):
            quantizer = getattr(module, name, None)
            if quantizer is not None and quantizer.is_enabled:
                num_bits.append(quantizer.num_bits)
                affine = affine and hasattr(quantizer, "_bias_value")
    if (4, 3) in num_bits:
        return KV_CACHE_FP8
    if 8 in num_bits:
        return KV_CACHE_INT8
    if (2, 1) in num_bits:
        return KV_CACHE_NVFP4_AFFINE if affine else KV_CACHE_NVFP4
    return None


def get_kv_cache_scaling_factor(kv_module: nn.Module) -> List[Optional[torch.Tensor]]:
    """Returns the kv_cache scaling factor if output quantizer is set. Else returns None by default.

    [k scale, v scale] from the two bmm quantizers (``get_scaling_factor``), [None, None] without
    them. For an FP8 cache each scale is raised to at least 1, as ModelOpt exports it: e4m3's
    relative precision is the same across its normal range, so a scale below 1 (amax < 448) would
    only help values small enough to be subnormal, while it clips any later activation larger than
    calibration saw. A scale above 0.5 warns that large activations may cost accuracy.
    """
    if not all(hasattr(kv_module, name) for name in KV_QUANTIZERS):
        return [None, None]
    scales = [get_scaling_factor(getattr(kv_module, name)) for name in KV_QUANTIZERS]
    if get_kv_cache_dtype(kv_module) == KV_CACHE_FP8:
        for i, scale in enumerate(scales):
            if scale is None:
                continue
            if float(scale.max()) > LARGE_FP8_KV_SCALE:
                warnings.warn(
                    f"Large KV activation detected (scale {float(scale.max()):.4g}); a quantized KV cache "
                    "may lose accuracy",
                    stacklevel=2,
                )
            scales[i] = torch.clamp(scale, min=1.0)
    return scales
