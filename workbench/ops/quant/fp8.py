"""FP8 (e4m3) linear and batched-matmul ops: per-tensor (ModelOpt / HF ``fp8`` with static
activation scales) and fine-grained 128 x 128 blocks (HF "fine-grained FP8", DeepSeek-V3).

    torch_fp8_linear             input [..., K], weight fp8 [N, K], input_scale / weight_scale fp32 (one element)
        y = (to_fp8(input, input_scale) * input_scale) @ (weight * weight_scale).T + bias
    torch_finegrained_fp8_linear input [..., K], weight fp8 [N, K], weight_scale_inv [ceil(N/bn), ceil(K/bk)]
        activations quantized dynamically, one scale per token per bk columns (as the FP8 block
        GEMM kernels do), the weight dequantized per (bn x bk) tile
    torch_fp8_bmm                input [B, M, K], weight fp8 [B, K, N] -> [B, M, N], per-tensor scales

The references compute in fp32 from the dequantized operands and return the input's dtype. The
per-tensor ops take ``torch._scaled_mm`` on CUDA devices of capability >= 8.9 (``fp8_scaled_mm.py``).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from ..library import define_op
from .codecs import FP8_E4M3_STEP, fp8_block_dequantize, fp8_group_dequantize, fp8_group_quantize, to_fp8
from .fp8_scaled_mm import fp8_scaled_mm, scaled_mm_applies
from .row_blocks import by_row_blocks, quantized_linear_fake


def _per_tensor(scale: torch.Tensor, what: str) -> torch.Tensor:
    if scale.numel() != 1:
        raise ValueError(
            f"{what} must be one per-tensor fp32 scale, got shape {tuple(scale.shape)}; "
            "per-block weights go through torch_finegrained_fp8_linear"
        )
    return scale.float().reshape(())


def _check_fp8(weight: torch.Tensor, what: str) -> None:
    if weight.dtype != torch.float8_e4m3fn:
        raise TypeError(
            f"{what} must be float8_e4m3fn, got {weight.dtype}; quantize it with workbench.ops.quant.codecs first"
        )


def fp8_qdq(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Static FP8 activation quantization, dequantized again: fp32 ``to_fp8(x, scale) * scale``."""
    return to_fp8(x, scale).float() * scale.float()


def fp8_group_qdq(x: torch.Tensor, group: int) -> torch.Tensor:
    """Dynamic per-token, per-``group``-column FP8 quantization, dequantized again (fp32)."""
    return fp8_group_dequantize(*fp8_group_quantize(x, group), group)


# ------------------------------------------------------------------------------- per-tensor linear
def fp8_linear_reference(
    input: torch.Tensor,
    weight: torch.Tensor,
    input_scale: torch.Tensor,
    weight_scale: torch.Tensor,
    bias: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """The plain-torch ground truth of ``torch_fp8_linear`` (any device)."""
    _check_fp8(weight, "torch_fp8_linear's weight")
    x = fp8_qdq(input, _per_tensor(input_scale, "input_scale"))
    w_scale = _per_tensor(weight_scale, "weight_scale")

    def rows(a: int, b: int) -> torch.Tensor:
        return F.linear(x, weight[a:b].float() * w_scale, None if bias is None else bias[a:b].float())

    return by_row_blocks(rows, weight.shape[0], weight.shape[1]).to(input.dtype)


def fp8_linear(input, weight, input_scale, weight_scale, bias=None):
    if weight.dtype == torch.float8_e4m3fn and scaled_mm_applies(input, weight.shape[0], input.dtype):
        x_scale = _per_tensor(input_scale, "input_scale")
        # fp32 out, bias added in fp32, one rounding to the input dtype: what the reference does
        # (rounding the product first, then the sum, put bf16 results 2 ulps off)
        y = fp8_scaled_mm(
            to_fp8(input, x_scale), weight, x_scale, _per_tensor(weight_scale, "weight_scale"), torch.float32
        )
        return (y if bias is None else y + bias.float()).to(input.dtype)
    return fp8_linear_reference(input, weight, input_scale, weight_scale, bias)


torch_fp8_linear = define_op(
    "torch_fp8_linear(Tensor input, Tensor weight, Tensor input_scale, Tensor weight_scale, Tensor? bias=None) "
    "-> Tensor",
    fp8_linear,
    quantized_linear_fake,
    activation_rounding=FP8_E4M3_STEP,
    category="quant",
)


# ----------------------------------------------------------------------------- fine-grained linear
def finegrained_fp8_linear(
    input: torch.Tensor,
    weight: torch.Tensor,
    weight_scale_inv: torch.Tensor,
    block_n: int = 128,
    block_k: int = 128,
    bias: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    _check_fp8(weight, "torch_finegrained_fp8_linear's weight")
    n, k = weight.shape
    want = (-(-n // block_n), -(-k // block_k))
    if tuple(weight_scale_inv.shape) != want:
        raise ValueError(
            f"torch_finegrained_fp8_linear: weight {(n, k)} with blocks {(block_n, block_k)} needs "
            f"weight_scale_inv of shape {want}, got {tuple(weight_scale_inv.shape)}"
        )
    x = fp8_group_qdq(input, block_k)

    def rows(a: int, b: int) -> torch.Tensor:  # a is a multiple of block_n: whole tiles of scales
        w = fp8_block_dequantize(weight[a:b], weight_scale_inv[a // block_n : -(-b // block_n)], (block_n, block_k))
        return F.linear(x, w, None if bias is None else bias[a:b].float())

    return by_row_blocks(rows, n, k, align=block_n).to(input.dtype)


torch_finegrained_fp8_linear = define_op(
    "torch_finegrained_fp8_linear(Tensor input, Tensor weight, Tensor weight_scale_inv, int block_n=128, "
    "int block_k=128, Tensor? bias=None) -> Tensor",
    finegrained_fp8_linear,
    quantized_linear_fake,
    activation_rounding=FP8_E4M3_STEP,
    category="quant",
)


# -------------------------------------------------------------------------------------------- bmm
def fp8_bmm_reference(
    input: torch.Tensor, weight: torch.Tensor, input_scale: torch.Tensor, weight_scale: torch.Tensor
) -> torch.Tensor:
    """The plain-torch ground truth of ``torch_fp8_bmm``."""
    _check_fp8(weight, "torch_fp8_bmm's weight")
    if input.dim() != 3 or weight.dim() != 3 or input.shape[0] != weight.shape[0] or input.shape[2] != weight.shape[1]:
        raise ValueError(
            f"torch_fp8_bmm needs input [B, M, K] and weight [B, K, N], got {tuple(input.shape)} "
            f"and {tuple(weight.shape)}"
        )
    x = fp8_qdq(input, _per_tensor(input_scale, "input_scale"))
    w = weight.float() * _per_tensor(weight_scale, "weight_scale")
    return torch.bmm(x, w).to(input.dtype)


def fp8_bmm(input, weight, input_scale, weight_scale):
    if (
        weight.dtype == torch.float8_e4m3fn
        and input.dim() == 3
        and weight.dim() == 3
        and scaled_mm_applies(input, weight.shape[2], input.dtype)
    ):
        x_scale = _per_tensor(input_scale, "input_scale")
        w_scale = _per_tensor(weight_scale, "weight_scale")
        x = to_fp8(input, x_scale)
        # weight[b] is [K, N] row-major; cuBLASLt wants it column-major, i.e. [N, K] row-major.
        w_nk = weight.transpose(1, 2).contiguous()
        return torch.stack([fp8_scaled_mm(x[b], w_nk[b], x_scale, w_scale, input.dtype) for b in range(input.shape[0])])
    return fp8_bmm_reference(input, weight, input_scale, weight_scale)


def _bmm_fake(input, weight, input_scale, weight_scale):
    return input.new_empty(input.shape[0], input.shape[1], weight.shape[2])


torch_fp8_bmm = define_op(
    "torch_fp8_bmm(Tensor input, Tensor weight, Tensor input_scale, Tensor weight_scale) -> Tensor",
    fp8_bmm,
    _bmm_fake,
    activation_rounding=FP8_E4M3_STEP,
    category="quant",
)
