"""Fake-quantization ops: quantize, then dequantize, same dtype out.

What a model with ModelOpt-style quantizers attached exports (one op per quantizer, on weights and
activations alike), and what ``quantize_fp8_from_graph`` / ``quantize_nvfp4_from_graph`` recognise
and fold into the real quantized linears. ``amax`` is the quantizer's calibrated absolute maximum.

    torch_fake_quant_fp8(input, amax)                  scale = amax / 448 (``amax`` broadcasts:
                                                       one element, or per channel)
    torch_fake_quant_nvfp4(input, amax, block_size=16) global scale = amax / (6 * 448) (one element),
                                                       fp8 block scales per ``block_size`` columns of
                                                       the last dimension, computed from the data
"""

from __future__ import annotations

import torch

from ..library import define_op
from .codecs import E2M1_MAX, FP4_E2M1_STEP, FP8_E4M3_MAX, FP8_E4M3_STEP, nvfp4_dequantize, nvfp4_quantize, to_fp8


def _nonzero(scale: torch.Tensor) -> torch.Tensor:
    """An amax of 0 (a quantizer that only saw zeros) gives scale 1: zeros stay zeros, no 0 / 0."""
    return torch.where(scale == 0, torch.ones_like(scale), scale)


def fake_quant_fp8(input: torch.Tensor, amax: torch.Tensor) -> torch.Tensor:
    scale = _nonzero(amax.float() / FP8_E4M3_MAX)
    return (to_fp8(input, scale).float() * scale).to(input.dtype)


def fake_quant_nvfp4(input: torch.Tensor, amax: torch.Tensor, block_size: int = 16) -> torch.Tensor:
    if amax.numel() != 1:
        raise ValueError(f"torch_fake_quant_nvfp4: amax must be one per-tensor value, got shape {tuple(amax.shape)}")
    global_scale = _nonzero(amax.float().reshape(()) / (E2M1_MAX * FP8_E4M3_MAX))
    packed, block_scales, gs = nvfp4_quantize(input, global_scale, block_size)
    return nvfp4_dequantize(packed, block_scales, gs, block_size).to(input.dtype)


def _fake(input, amax, *args):
    return torch.empty_like(input)


torch_fake_quant_fp8 = define_op(
    "torch_fake_quant_fp8(Tensor input, Tensor amax) -> Tensor",
    fake_quant_fp8,
    _fake,
    activation_rounding=FP8_E4M3_STEP,
    category="quant",
)
torch_fake_quant_nvfp4 = define_op(
    "torch_fake_quant_nvfp4(Tensor input, Tensor amax, int block_size=16) -> Tensor",
    fake_quant_nvfp4,
    _fake,
    activation_rounding=FP4_E2M1_STEP,
    category="quant",
)
