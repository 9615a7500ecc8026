"""``workbench::triton_rmsnorm``: ``torch_rmsnorm`` as one Triton kernel (one program per row).

Why: the canonical op is six eager kernels (cast, pow, mean, add, rsqrt, two muls) that each
stream the row through memory; one program per row reads ``x`` and the weight once and writes the
output once. Same signature and semantics as ``torch_rmsnorm``::

    input [..., H] (any float dtype), weight [H], eps -> out [..., H] in promote(input, weight)
    out = weight * (x * rsqrt(mean(x**2) + eps)).to(input.dtype)     statistics in fp32

The normalised row is rounded to the input dtype *before* the weight multiply, exactly like HF's
LlamaRMSNorm, so half-precision results match the canonical op to the last rounding.

The op is always registered (graphs that use it load and print anywhere); ``is_available(device)``
says whether the kernel can run: CUDA tensors, or CPU tensors under ``TRITON_INTERPRET=1`` (tests).
Called where it cannot run, it raises and names the ``torch`` backend instead of silently falling
back, so a user who picked Triton never measures the reference by mistake.
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
    def rmsnorm_kernel(x_ptr, w_ptr, out_ptr, n_cols, stride_x, stride_out, eps, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        offs = tl.arange(0, BLOCK)
        mask = offs < n_cols
        x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
        rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / n_cols + eps)
        y = (x * rstd).to(x_ptr.dtype.element_ty)  # HF rounds to the input dtype first
        w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        out = w * y.to(tl.float32)
        tl.store(out_ptr + row * stride_out + offs, out.to(out_ptr.dtype.element_ty), mask=mask)

    return rmsnorm_kernel


def _num_warps(block: int, device: torch.device) -> int:
    if device.type != "cuda":
        return 1
    return max(1, min(16, block // 256))


def rmsnorm_forward(input: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Launch the kernel: input [..., H], weight [H] -> [..., H] (rows read with their stride)."""
    import triton

    hidden = input.shape[-1]
    if weight.shape != (hidden,):
        raise ValueError(f"triton_rmsnorm: weight must be [{hidden}], got {list(weight.shape)}")
    rows = input.reshape(-1, hidden)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    weight = weight.contiguous()
    out = torch.empty(rows.shape, dtype=torch.promote_types(input.dtype, weight.dtype), device=input.device)
    if rows.shape[0]:
        block = triton.next_power_of_2(hidden)
        kernel()[(rows.shape[0],)](
            rows,
            weight,
            out,
            hidden,
            rows.stride(0),
            out.stride(0),
            float(eps),
            BLOCK=block,
            num_warps=_num_warps(block, input.device),
        )
    return out.reshape(input.shape)


@workbench_op("triton_rmsnorm", category="norm", norm="rms")
def triton_rmsnorm(input: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Triton RMSNorm; see the module docstring (same contract as ``torch_rmsnorm``)."""
    ok, why = is_available(input.device)
    if not ok:
        raise RuntimeError(
            f"triton_rmsnorm cannot run on {input.device}: {why}. Use the 'torch' RMSNorm backend "
            "(fuse_rmsnorm.backend=torch) on this device."
        )
    return rmsnorm_forward(input, weight, eps)


@triton_rmsnorm.register_fake
def _triton_rmsnorm_fake(input, weight, eps):
    return input.new_empty(input.shape, dtype=torch.promote_types(input.dtype, weight.dtype))
