"""``workbench::torch_int4_linear``: a linear layer whose weight is 4-bit integers in groups.

The canonical INT4 weight-only linear, and its plain-torch reference (the numerical ground truth
every backend is tested against)::

    input   [..., K]      float
    qweight [N, K/2]      uint8, two 4-bit codes q in 0..15 per byte
    scales  [N, K/group]  float (fp16 as checkpoints store them)
    offsets [N, K/group]  float
    w[n, k] = q[n, k] * scales[n, k // group] + offsets[n, k // group]      (computed in fp32)
    -> input @ w.T + bias  [..., N]

Packing: within every run of 32 codes of a row, byte j holds code j in its low nibble and code
j + 16 in its high nibble -- the order of ggml's Q4_0/Q4_1 blocks, so a GGUF file's bytes are used
as they are, and one 16-byte load gives a SIMD kernel 32 codes. ``group`` is a multiple of 32.

Every asymmetric int4 scheme is this op: GGUF Q4_1 (``scales`` = d, ``offsets`` = m, group 32),
Q4_0 (offsets = -8 d), AWQ/GPTQ with zero points z (offsets = -z * scales).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from ..library import define_op
from .cpu_fast_path import exact_cpu_kernel
from .row_blocks import by_row_blocks, quantized_linear_fake

RUN = 32  # codes per packing run


def unpack_int4(qweight: torch.Tensor) -> torch.Tensor:
    """[N, K/2] uint8 -> [N, K] uint8 codes (0..15), undoing the per-32 nibble order."""
    n, half = qweight.shape
    runs = qweight.reshape(n, half // (RUN // 2), RUN // 2)
    return torch.cat([runs & 15, runs >> 4], dim=-1).reshape(n, half * 2)


def pack_int4(codes: torch.Tensor) -> torch.Tensor:
    """[N, K] integer codes in 0..15 -> [N, K/2] uint8 (inverse of ``unpack_int4``)."""
    n, k = codes.shape
    if k % RUN:
        raise ValueError(f"int4 packing needs K to be a multiple of {RUN}, got {k}")
    runs = codes.to(torch.uint8).reshape(n, k // RUN, RUN)
    return (runs[..., : RUN // 2] | (runs[..., RUN // 2 :] << 4)).reshape(n, k // 2)


def dequantize_int4(
    qweight: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor, group_size: int
) -> torch.Tensor:
    """The fp32 weight [N, K]: q * scale + offset, per group (multiply, then add, in fp32)."""
    n, k = qweight.shape[0], qweight.shape[1] * 2
    q = unpack_int4(qweight).float().view(n, k // group_size, group_size)
    return (q * scales.float()[..., None] + offsets.float()[..., None]).view(n, k)


def int4_linear_reference(
    input: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    offsets: torch.Tensor,
    group_size: int,
    bias: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """The op's definition: dequantize (a block of rows at a time), then ``F.linear``."""

    def rows(a: int, b: int) -> torch.Tensor:
        w = dequantize_int4(qweight[a:b], scales[a:b], offsets[a:b], group_size).to(input.dtype)
        return F.linear(input, w, None if bias is None else bias[a:b])

    return by_row_blocks(rows, qweight.shape[0], qweight.shape[1] * 2)


def int4_linear(
    input: Tensor, qweight: Tensor, scales: Tensor, offsets: Tensor, group_size: int, bias: Optional[Tensor] = None
) -> Tensor:
    """The op's body: the exact C++ kernel where it runs (see ``cpu_fast_path``), else the reference."""
    kernel = exact_cpu_kernel("cpu_int4_linear", input, scales, offsets)
    if kernel is not None and group_size % 32 == 0:
        return kernel(
            input.contiguous(), qweight.contiguous(), scales.contiguous(), offsets.contiguous(), group_size, bias
        )
    return int4_linear_reference(input, qweight, scales, offsets, group_size, bias)


torch_int4_linear = define_op(
    "torch_int4_linear(Tensor input, Tensor qweight, Tensor scales, Tensor offsets, int group_size, "
    "Tensor? bias=None) -> Tensor",
    int4_linear,
    quantized_linear_fake,
    category="quant",
)
