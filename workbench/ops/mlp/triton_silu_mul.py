"""``workbench::triton_silu_and_mul``: ``torch_silu_and_mul`` as one Triton kernel.

Why: eager ``F.silu(gate) * up`` writes the silu result to memory and reads it back; the kernel
reads gate and up once and writes the product once. Same contract as ``torch_silu_and_mul``::

    input [..., 2*I] (gate columns, then up) -> out [..., I] in input's dtype
    out = gate * sigmoid(gate) * up, computed in fp32

A grid of (rows, column blocks); rows are read with their own stride (a strided GEMM output is
fine as long as the last dim is contiguous). The op is always registered; ``is_available(device)``
says whether the kernel can run (CUDA tensors, or CPU tensors under ``TRITON_INTERPRET=1``) and the
op raises rather than silently fall back where it cannot.
"""

from __future__ import annotations

import torch

from ..library import workbench_op
from ..triton_support import lazy_kernel
from ..triton_support import triton_available as is_available  # noqa: F401  (public per-op name)


@lazy_kernel
def kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def silu_and_mul_kernel(x_ptr, out_ptr, n_cols, stride_x, stride_out, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < n_cols
        gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
        up = tl.load(x_ptr + row * stride_x + n_cols + cols, mask=mask, other=0.0).to(tl.float32)
        out = gate / (1.0 + tl.exp(-gate)) * up
        tl.store(out_ptr + row * stride_out + cols, out.to(out_ptr.dtype.element_ty), mask=mask)

    return silu_and_mul_kernel


def silu_and_mul_forward(input: torch.Tensor) -> torch.Tensor:
    """Launch the kernel: input [..., 2I] -> [..., I]."""
    import triton

    width = input.shape[-1]
    if width % 2:
        raise ValueError(f"triton_silu_and_mul needs an even last dim (gate|up), got {width}")
    inter = width // 2
    rows = input.reshape(-1, width)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    out = torch.empty(rows.shape[0], inter, dtype=input.dtype, device=input.device)
    if rows.shape[0] and inter:
        block = (
            min(1024, triton.next_power_of_2(inter))
            if input.device.type == "cuda"
            else min(64, triton.next_power_of_2(inter))
        )
        grid = (rows.shape[0], triton.cdiv(inter, block))
        kernel()[grid](
            rows,
            out,
            inter,
            rows.stride(0),
            out.stride(0),
            BLOCK=block,
            num_warps=4 if input.device.type == "cuda" else 1,
        )
    return out.reshape(*input.shape[:-1], inter)


@workbench_op("triton_silu_and_mul", category="elementwise")
def triton_silu_and_mul(input: torch.Tensor) -> torch.Tensor:
    """Triton SiLU-and-mul; see the module docstring."""
    ok, why = is_available(input.device)
    if not ok:
        raise RuntimeError(
            f"triton_silu_and_mul cannot run on {input.device}: {why}. Use the 'torch' SwiGLU "
            "backend (fuse_swiglu.backend=torch) on this device."
        )
    return silu_and_mul_forward(input)


@triton_silu_and_mul.register_fake
def _triton_silu_and_mul_fake(input):
    return input.new_empty(*input.shape[:-1], input.shape[-1] // 2)
