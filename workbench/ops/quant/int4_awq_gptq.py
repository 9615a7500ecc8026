"""INT4 weight-only linears in the layouts AWQ and GPTQ checkpoints arrive in.

``torch_int4_awq_linear(input, qweight, scales, offsets, pre_quant_scale, group_size, bias=None)``
    AWQ (ModelOpt ``int4_awq``): the activation-aware smoothing factor divides the weight columns
    offline and multiplies the activations at run time, so the op is exactly
    ``torch_int4_linear(input * pre_quant_scale, qweight, scales, offsets, group_size, bias)``
    (our int4 packing, see ``int4.py``); ``pre_quant_scale`` [K] or None (no smoothing).

``torch_int4_gptq_linear(input, qweight, qzeros, scales, g_idx, zero_offset=1, bias=None)``
    GPTQ storage as checkpoints hold it, read without repacking (see ``codecs.gptq_dequantize``):
    qweight int32 [K/8, N], qzeros int32 [G, N/8], scales [G, N], g_idx [K] (act-order permutes it);
    w[n, k] = (q[k, n] - (z[g_idx[k], n] + zero_offset)) * scales[g_idx[k], n]. ``zero_offset=1`` is
    AutoGPTQ's classic "zero points stored minus one", 0 the v2 format. Computed in fp32.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from ..library import define_op
from .codecs import gptq_dequantize
from .int4 import int4_linear
from .row_blocks import by_row_blocks, quantized_linear_fake

GPTQ_PACK = 8  # 4-bit codes per int32 word


def int4_awq_linear(
    input: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    offsets: torch.Tensor,
    pre_quant_scale: Optional[torch.Tensor],
    group_size: int,
    bias: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    if pre_quant_scale is not None:
        if pre_quant_scale.shape[-1] != input.shape[-1]:
            raise ValueError(
                f"torch_int4_awq_linear: pre_quant_scale {tuple(pre_quant_scale.shape)} must have "
                f"one factor per input column ({input.shape[-1]})"
            )
        input = input * pre_quant_scale.to(input.dtype)
    return int4_linear(input, qweight, scales, offsets, group_size, bias)


torch_int4_awq_linear = define_op(
    "torch_int4_awq_linear(Tensor input, Tensor qweight, Tensor scales, Tensor offsets, Tensor? pre_quant_scale, "
    "int group_size, Tensor? bias=None) -> Tensor",
    int4_awq_linear,
    quantized_linear_fake,
    category="quant",
)


def int4_gptq_linear(
    input: torch.Tensor,
    qweight: torch.Tensor,
    qzeros: torch.Tensor,
    scales: torch.Tensor,
    g_idx: torch.Tensor,
    zero_offset: int = 1,
    bias: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    k, n = qweight.shape[0] * GPTQ_PACK, qweight.shape[1]
    if input.shape[-1] != k:
        raise ValueError(
            f"torch_int4_gptq_linear: qweight {tuple(qweight.shape)} holds K = {k} input columns, "
            f"the input has {input.shape[-1]}"
        )
    x = input.float()

    def rows(a: int, b: int) -> torch.Tensor:  # output features a..b: qweight columns, 8 per qzeros word
        w = gptq_dequantize(
            qweight[:, a:b], qzeros[:, a // GPTQ_PACK : -(-b // GPTQ_PACK)], scales[:, a:b], g_idx, zero_offset
        )
        return F.linear(x, w, None if bias is None else bias[a:b].float())

    return by_row_blocks(rows, n, k, align=GPTQ_PACK).to(input.dtype)


def _gptq_fake(input, qweight, qzeros, scales, g_idx, zero_offset=1, bias=None):
    return input.new_empty(*input.shape[:-1], qweight.shape[1])


torch_int4_gptq_linear = define_op(
    "torch_int4_gptq_linear(Tensor input, Tensor qweight, Tensor qzeros, Tensor scales, Tensor g_idx, "
    "int zero_offset=1, Tensor? bias=None) -> Tensor",
    int4_gptq_linear,
    _gptq_fake,
    category="quant",
)
