"""The GPU fast path of the per-tensor FP8 ops: ``torch._scaled_mm`` (cuBLASLt FP8 GEMM).

FP8 tensor cores exist from compute capability 8.9 (Ada, Hopper, Blackwell). cuBLASLt's FP8 GEMM
takes a row-major first operand and a column-major second one, both in fp8, with dimensions K and N
multiples of 16, and one fp32 scale per operand -- which is exactly ``torch_fp8_linear``'s
``x_fp8 @ w_fp8.T * input_scale * weight_scale``: a ``[N, K]`` row-major weight transposed *is*
column-major, so no copy is needed. Everything else (CPU, older GPUs, odd shapes) runs the plain-torch
reference, which is the numerical ground truth this path is tested against.
"""

from __future__ import annotations

from typing import Optional

import torch

MIN_CAPABILITY = (8, 9)
_OUT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def scaled_mm_unavailable_reason(device: torch.device) -> Optional[str]:
    """Why ``torch._scaled_mm`` cannot serve FP8 GEMMs on ``device``; None when it can."""
    device = torch.device(device)
    if device.type != "cuda":
        return f"the FP8 torch._scaled_mm path needs a CUDA device, got {device.type!r}"
    if not torch.cuda.is_available():
        return "CUDA is not available"
    capability = torch.cuda.get_device_capability(device)
    if capability < MIN_CAPABILITY:
        return (
            f"FP8 tensor cores need compute capability >= {MIN_CAPABILITY[0]}.{MIN_CAPABILITY[1]}, "
            f"{device} has {capability[0]}.{capability[1]}"
        )
    return None


def scaled_mm_applies(x: torch.Tensor, n: int, out_dtype: torch.dtype) -> bool:
    """Whether the fast path serves an [..., K] x [N, K] FP8 product with this output dtype."""
    return (
        x.shape[-1] % 16 == 0
        and n % 16 == 0
        and out_dtype in _OUT_DTYPES
        and scaled_mm_unavailable_reason(x.device) is None
    )


def fp8_scaled_mm(
    x_fp8: torch.Tensor, w_fp8: torch.Tensor, x_scale: torch.Tensor, w_scale: torch.Tensor, out_dtype: torch.dtype
) -> torch.Tensor:
    """``(x_fp8 * x_scale) @ (w_fp8 * w_scale).T`` -> [..., N] in ``out_dtype``.

    x_fp8 [..., K] and w_fp8 [N, K] float8_e4m3fn; the scales one fp32 element each. Accumulates in
    fp32 (``use_fast_accum=False``: Hopper's fast accumulation drops low bits on long K)."""
    lead = x_fp8.shape[:-1]
    out = torch._scaled_mm(
        x_fp8.reshape(-1, x_fp8.shape[-1]).contiguous(),
        w_fp8.contiguous().t(),
        scale_a=x_scale.float().reshape(()),
        scale_b=w_scale.float().reshape(()),
        out_dtype=out_dtype,
        use_fast_accum=False,
    )
    return out.reshape(*lead, w_fp8.shape[0])
