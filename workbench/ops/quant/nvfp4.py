"""``workbench::torch_nvfp4_linear``: NVFP4 weights *and* activations (W4A4, as on Blackwell).

input          [..., K]   float
weight         [N, K/2]   uint8, two e2m1 codes per byte (element 2i low nibble)
weight_scale   [N, K/16]  float8_e4m3fn block scales
weight_scale_2 fp32, one element: the weight's global scale (amax / (6 * 448))
input_scale    fp32, one element: the activations' global scale, calibrated by ModelOpt
w = e2m1 * weight_scale * weight_scale_2 per 16-column block
x = NVFP4(input): per 16-column block of each token, an fp8 scale block_amax / 6 / input_scale,
    computed at run time -- the activation quantization the FP4 tensor-core GEMM needs
-> x @ w.T + bias   [..., N] in the input's dtype (computed in fp32)
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from ..library import define_op
from .codecs import FP4_E2M1_STEP, nvfp4_dequantize, nvfp4_quantize
from .row_blocks import by_row_blocks, quantized_linear_fake

NVFP4_BLOCK = 16


def nvfp4_qdq(x: torch.Tensor, global_scale: torch.Tensor) -> torch.Tensor:
    """Dynamic NVFP4 activation quantization with a fixed global scale, dequantized again (fp32)."""
    if x.shape[-1] % NVFP4_BLOCK:
        raise ValueError(
            f"NVFP4 activations need the last dimension to be a multiple of {NVFP4_BLOCK}, "
            f"got {tuple(x.shape)}; leave this layer unquantized"
        )
    packed, block_scales, gs = nvfp4_quantize(x, global_scale, NVFP4_BLOCK)
    return nvfp4_dequantize(packed, block_scales, gs, NVFP4_BLOCK)


def _check_weight(weight: torch.Tensor, weight_scale: torch.Tensor, what: str) -> None:
    if weight.dtype != torch.uint8 or weight_scale.dtype != torch.float8_e4m3fn:
        raise TypeError(
            f"{what}: NVFP4 weights are packed uint8 with float8_e4m3fn block scales, got "
            f"{weight.dtype} and {weight_scale.dtype}"
        )
    if tuple(weight_scale.shape) != (*weight.shape[:-1], weight.shape[-1] * 2 // NVFP4_BLOCK):
        want = (*weight.shape[:-1], weight.shape[-1] * 2 // NVFP4_BLOCK)
        raise ValueError(
            f"{what}: packed weight {tuple(weight.shape)} needs weight_scale of shape {want}, "
            f"got {tuple(weight_scale.shape)}"
        )


def nvfp4_linear(
    input: torch.Tensor,
    weight: torch.Tensor,
    input_scale: torch.Tensor,
    weight_scale: torch.Tensor,
    weight_scale_2: torch.Tensor,
    bias: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    _check_weight(weight, weight_scale, "torch_nvfp4_linear")
    x = nvfp4_qdq(input, input_scale)

    def rows(a: int, b: int) -> torch.Tensor:
        w = nvfp4_dequantize(weight[a:b], weight_scale[a:b], weight_scale_2, NVFP4_BLOCK)
        return F.linear(x, w, None if bias is None else bias[a:b].float())

    return by_row_blocks(rows, weight.shape[0], weight.shape[1] * 2).to(input.dtype)


torch_nvfp4_linear = define_op(
    "torch_nvfp4_linear(Tensor input, Tensor weight, Tensor input_scale, Tensor weight_scale, "
    "Tensor weight_scale_2, Tensor? bias=None) -> Tensor",
    nvfp4_linear,
    quantized_linear_fake,
    activation_rounding=FP4_E2M1_STEP,
    category="quant",
)
