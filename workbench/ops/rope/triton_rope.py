"""``workbench::triton_rope_with_explicit_cos_sin``: HF rotate-half RoPE as one Triton kernel.

Why: the canonical op spells ``x*cos + rotate_half(x)*sin`` as ~8 eager kernels per tensor (two
slices, a negation, a cat, two muls, an add, a copy); this reads each q/k row and the token's
cos/sin once. Same signature and semantics as ``torch_rope_with_explicit_cos_sin``::

    q [b, s, n, d] / k [b, s, n_kv, d]   (bsnd, unsqueeze_dim=2; bnsd [b, n, s, d] with 1)
    cos/sin [b, s, d] (batch may be 1 and broadcast)
    -> (q_out, k_out) contiguous, q's/k's shapes, dtype promote(x, cos, sin)

With ``h = d/2``: ``out[:h] = x[:h]*cos[:h] - x[h:]*sin[:h]``, ``out[h:] = x[h:]*cos[h:] +
x[:h]*sin[h:]``, computed in fp32 and rounded once. Any input strides are read as they are (the
q/k of a fused QKV GEMM are strided views), so no copies precede the kernel.

One program per token (b, s) rotates all heads of that token: one launch for q, one for k. The op
is always registered; ``is_available(device)`` says whether the kernel can run (CUDA tensors, or
CPU tensors under ``TRITON_INTERPRET=1``); it raises rather than fall back where it cannot.
"""

from __future__ import annotations

from typing import Tuple

import torch

from ..library import workbench_op
from ..triton_support import lazy_kernel
from ..triton_support import triton_available as is_available  # noqa: F401  (public per-op name)


@lazy_kernel
def kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def rope_kernel(
        x_ptr,
        cos_ptr,
        sin_ptr,
        out_ptr,
        n_heads,
        seq_len,
        sx_b,
        sx_s,
        sx_n,
        sx_d,
        sc_b,
        sc_s,
        sc_d,
        ss_b,
        ss_s,
        ss_d,
        so_b,
        so_s,
        so_n,
        so_d,
        HALF: tl.constexpr,
        H_PAD: tl.constexpr,
        N_PAD: tl.constexpr,
    ):
        token = tl.program_id(0)
        b = (token // seq_len).to(tl.int64)
        s = (token % seq_len).to(tl.int64)
        j = tl.arange(0, H_PAD)
        n = tl.arange(0, N_PAD)
        jm = j < HALF
        c_lo = tl.load(cos_ptr + b * sc_b + s * sc_s + j * sc_d, mask=jm, other=0.0).to(tl.float32)
        c_hi = tl.load(cos_ptr + b * sc_b + s * sc_s + (j + HALF) * sc_d, mask=jm, other=0.0).to(tl.float32)
        s_lo = tl.load(sin_ptr + b * ss_b + s * ss_s + j * ss_d, mask=jm, other=0.0).to(tl.float32)
        s_hi = tl.load(sin_ptr + b * ss_b + s * ss_s + (j + HALF) * ss_d, mask=jm, other=0.0).to(tl.float32)
        mask = (n[:, None] < n_heads) & jm[None, :]
        x_row = x_ptr + b * sx_b + s * sx_s + n[:, None] * sx_n
        x_lo = tl.load(x_row + j[None, :] * sx_d, mask=mask, other=0.0).to(tl.float32)
        x_hi = tl.load(x_row + (j[None, :] + HALF) * sx_d, mask=mask, other=0.0).to(tl.float32)
        o_lo = x_lo * c_lo[None, :] - x_hi * s_lo[None, :]
        o_hi = x_hi * c_hi[None, :] + x_lo * s_hi[None, :]
        o_row = out_ptr + b * so_b + s * so_s + n[:, None] * so_n
        dtype = out_ptr.dtype.element_ty
        tl.store(o_row + j[None, :] * so_d, o_lo.to(dtype), mask=mask)
        tl.store(o_row + (j[None, :] + HALF) * so_d, o_hi.to(dtype), mask=mask)

    return rope_kernel


def _bsnd(t: torch.Tensor, unsqueeze_dim: int) -> torch.Tensor:
    """A [b, s, n, d] view of q/k/out whatever the op's layout (bnsd is transposed, no copy)."""
    return t if unsqueeze_dim == 2 else t.transpose(1, 2)


def rope_one(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, unsqueeze_dim: int) -> torch.Tensor:
    """Rotate one of q/k: x [b, s, n, d] (or bnsd), cos/sin [b|1, s, d] -> contiguous x-shaped."""
    import triton

    if unsqueeze_dim not in (1, 2) or x.dim() != 4 or cos.dim() != 3 or sin.dim() != 3:
        raise ValueError(
            f"triton rope needs 4-D q/k, 3-D cos/sin and unsqueeze_dim 1 or 2, got "
            f"{x.dim()}-D, {cos.dim()}-D, {unsqueeze_dim}"
        )
    xv = _bsnd(x, unsqueeze_dim)
    b, s, n, d = xv.shape
    if d % 2 or cos.shape[-1] != d or sin.shape[-1] != d:
        raise ValueError(
            f"triton rope needs an even head dim equal to cos/sin's last dim, got {d}, {cos.shape[-1]}, {sin.shape[-1]}"
        )
    dtype = torch.promote_types(torch.promote_types(x.dtype, cos.dtype), sin.dtype)
    out = torch.empty(x.shape, dtype=dtype, device=x.device)
    ov = _bsnd(out, unsqueeze_dim)
    cos, sin = cos.expand(b, s, d), sin.expand(b, s, d)  # batch-1 cos/sin: stride 0
    if b * s and n:
        half = d // 2
        kernel()[(b * s,)](
            xv,
            cos,
            sin,
            ov,
            n,
            s,
            *xv.stride(),
            *cos.stride(),
            *sin.stride(),
            *ov.stride(),
            HALF=half,
            H_PAD=triton.next_power_of_2(half),
            N_PAD=triton.next_power_of_2(n),
            num_warps=4 if x.device.type == "cuda" else 1,
        )
    return out


@workbench_op("triton_rope_with_explicit_cos_sin", category="elementwise")
def triton_rope_with_explicit_cos_sin(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, unsqueeze_dim: int = 1
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Triton RoPE; see the module docstring (same contract as the canonical op)."""
    ok, why = is_available(q.device)
    if not ok:
        raise RuntimeError(
            f"triton_rope_with_explicit_cos_sin cannot run on {q.device}: {why}. Use the 'torch' "
            "RoPE backend (fuse_rope.backend=torch) on this device."
        )
    return rope_one(q, cos, sin, unsqueeze_dim), rope_one(k, cos, sin, unsqueeze_dim)


@triton_rope_with_explicit_cos_sin.register_fake
def _triton_rope_fake(q, k, cos, sin, unsqueeze_dim=1):
    dtype = torch.promote_types(cos.dtype, sin.dtype)
    return (
        q.new_empty(q.shape, dtype=torch.promote_types(q.dtype, dtype)),
        k.new_empty(k.shape, dtype=torch.promote_types(k.dtype, dtype)),
    )
