"""``workbench::triton_cached_selective_scan``: the cached Mamba-1 scan with its decode rows in Triton.

Same schema and semantics as ``torch_cached_selective_scan`` (``cached_selective_scan.py``). A
decode row is the hot path of every Mamba-1 model (one per Mamba layer per generated token): in
eager torch it is a dozen small kernels (softplus, exp of the [d, n] decays, gather the slots, zero
fresh ones, the state update, the C contraction, the D skip, scatter the state back). Here one
program per (decode row, channel block) reads its [BLOCK_D, n] state tile once, updates it in
registers and writes it back in place::

    dt    = softplus(dt_raw[c] + dt_bias[c])                         fp32, torch's softplus
    state = exp(dt * A[c, :]) * (state[slot, c, :] if input_pos > 0 else 0) + dt * x[c] * B
    y[c]  = state . C + D[c] * x[c]

Prefill sequences (rare, long) run the torch reference's ``prefill_rows`` (the chunked scan). A
decode-only step (``num_prefill == 0``) reads no metadata on the host, so it can be captured in a
CUDA graph.

The op is always registered; ``is_available(device)`` says whether the kernel can run: CUDA
tensors, or CPU tensors under ``TRITON_INTERPRET=1`` (tests). Called where it cannot run, it raises
and names the ``torch`` backend instead of silently falling back.
"""

from __future__ import annotations

import functools

import torch

from ..library import define_op
from ..state import TRITON_STATE_HOST_SYNC, check_decode_only_metadata
from ..triton_support import last_dim_contiguous, require_triton
from ..triton_support import triton_available as is_available
from .cached_selective_scan import (
    CACHED_SELECTIVE_SCAN_ARGS,
    cached_selective_scan_fake,
    check_cached_selective_scan_args,
    check_selective_state,
    prefill_rows,
)
from .selective_scan import check_selective_scan_args

#: Largest state tile one program holds (elements): BLOCK_D * BLOCK_N, e.g. 64 x 16 or 16 x 64.
TILE_ELEMS = 1024


@functools.lru_cache(maxsize=None)
def kernel():
    """The jitted kernel, built once on first use (importing this module never needs triton)."""
    import triton
    import triton.language as tl

    @triton.jit
    def selective_scan_decode_kernel(
        x_ptr,
        dt_ptr,
        dt_bias_ptr,
        a_ptr,
        b_ptr,
        c_ptr,
        d_ptr,
        state_ptr,
        out_ptr,
        slot_ptr,
        pos_ptr,
        first_row,
        first_token,
        width,
        state_size,
        stride_xt,
        stride_dtt,
        stride_ad,
        stride_bt,
        stride_ct,
        stride_ss,
        stride_sd,
        stride_ot,
        BLOCK_D: tl.constexpr,
        BLOCK_N: tl.constexpr,
    ):
        row = tl.program_id(0)
        cc = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)  # [BLOCK_D] channels
        nn = tl.arange(0, BLOCK_N)  # [BLOCK_N] state entries
        c_ok = cc < width
        n_ok = nn < state_size
        in_tile = c_ok[:, None] & n_ok[None, :]
        slot = tl.load(slot_ptr + first_row + row).to(tl.int64)
        # State entries to read: all, or none for a new sequence (input_pos 0), whatever its slot holds.
        held_n = tl.where(tl.load(pos_ptr + first_row + row) > 0, state_size, 0)
        token = (first_token + row).to(tl.int64)

        # The step per channel: softplus as torch computes it (identity above 20), log1p(exp(-|v|))
        # without losing small values to 1 + u (the compensated log1p: log(w) * u / (w - 1)).
        v = tl.load(dt_ptr + token * stride_dtt + cc, mask=c_ok, other=0.0).to(tl.float32)
        v += tl.load(dt_bias_ptr + cc, mask=c_ok, other=0.0).to(tl.float32)
        u = tl.exp(-tl.abs(v))
        w = 1.0 + u
        log1p_u = tl.where(w == 1.0, u, tl.log(w) * (u / (w - 1.0)))
        step = tl.where(v > 20.0, v, tl.maximum(v, 0.0) + log1p_u)  # [BLOCK_D]

        a = tl.load(a_ptr + cc[:, None] * stride_ad + nn[None, :], mask=in_tile, other=0.0).to(tl.float32)
        x = tl.load(x_ptr + token * stride_xt + cc, mask=c_ok, other=0.0).to(tl.float32)
        b = tl.load(b_ptr + token * stride_bt + nn, mask=n_ok, other=0.0).to(tl.float32)
        c = tl.load(c_ptr + token * stride_ct + nn, mask=n_ok, other=0.0).to(tl.float32)
        tile = state_ptr + slot * stride_ss + cc[:, None] * stride_sd + nn[None, :]
        # A masked load, never a multiply by zero: a reused slot may hold inf/NaN.
        state = tl.load(tile, mask=c_ok[:, None] & (nn[None, :] < held_n), other=0.0).to(tl.float32)
        state = tl.exp(step[:, None] * a) * state + (step * x)[:, None] * b[None, :]
        y = tl.sum(state * c[None, :], axis=1) + tl.load(d_ptr + cc, mask=c_ok, other=0.0).to(tl.float32) * x
        tl.store(out_ptr + token * stride_ot + cc, y.to(out_ptr.dtype.element_ty), mask=c_ok)
        tl.store(tile, state.to(state_ptr.dtype.element_ty), mask=in_tile)

    return selective_scan_decode_kernel


def decode_rows_triton(
    hidden_states, A, B, C, D, dt, dt_bias, input_pos, slot_idx, ssm_state, out, first_row: int, first_token: int
) -> None:
    """Launch the kernel on rows ``first_row..`` of the metadata (tokens ``first_token..`` of the
    flattened [1, T, ...] inputs); writes ``out [1, T, d]`` and the state rows in place."""
    import triton

    rows = slot_idx.numel() - first_row
    if rows <= 0:
        return
    d, n = A.shape
    if ssm_state.stride(-1) != 1:
        raise ValueError("ssm_state must be contiguous in its state dim (a real [num_slots, d, n] tensor)")
    x, bs, cs, dts, os_ = (last_dim_contiguous(t[0]) for t in (hidden_states, B, C, dt, out))
    if os_.data_ptr() != out[0].data_ptr():
        raise ValueError("out must be contiguous in its last dim")
    a = last_dim_contiguous(A)
    block_n = triton.next_power_of_2(n)
    block_d = min(triton.next_power_of_2(d), max(1, TILE_ELEMS // block_n))
    grid = (rows, triton.cdiv(d, block_d))
    kernel()[grid](
        x,
        dts,
        last_dim_contiguous(dt_bias),
        a,
        bs,
        cs,
        last_dim_contiguous(D),
        ssm_state,
        os_,
        slot_idx,
        input_pos,
        first_row,
        first_token,
        d,
        n,
        x.stride(0),
        dts.stride(0),
        a.stride(0),
        bs.stride(0),
        cs.stride(0),
        ssm_state.stride(0),
        ssm_state.stride(1),
        os_.stride(0),
        BLOCK_D=block_d,
        BLOCK_N=block_n,
        num_warps=4 if x.device.type == "cuda" else 1,
    )


def triton_cached_selective_scan(
    hidden_states: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor,
    dt: torch.Tensor,
    dt_bias: torch.Tensor,
    seq_lens: torch.Tensor,
    input_pos: torch.Tensor,
    slot_idx: torch.Tensor,
    num_prefill: int,
    ssm_state: torch.Tensor,
    chunk_size: int = 64,
) -> torch.Tensor:
    """The cached scan, decode rows in Triton; see the module docstring."""
    require_triton(hidden_states.device, "triton_cached_selective_scan", "insert_cached_ssm_attention.backend=torch")
    out = torch.empty_like(hidden_states)
    scan = (hidden_states, A, B, C, D, dt, dt_bias)
    if num_prefill == 0:  # decode only: T rows of one token, no host read of the metadata
        check_selective_scan_args(*scan, chunk_size, "triton_cached_selective_scan")
        check_decode_only_metadata(hidden_states.shape[1], slot_idx, input_pos)
        check_selective_state(hidden_states, A, ssm_state)
        first_token = 0
    else:
        lens = check_cached_selective_scan_args(
            *scan, seq_lens, input_pos, slot_idx, num_prefill, ssm_state, chunk_size
        )
        first_token = prefill_rows(*scan, lens, input_pos, slot_idx.long(), num_prefill, ssm_state, chunk_size, out)
    decode_rows_triton(*scan, input_pos, slot_idx, ssm_state, out, num_prefill, first_token)
    return out


triton_cached_selective_scan_op = define_op(
    "triton_cached_selective_scan" + CACHED_SELECTIVE_SCAN_ARGS,
    triton_cached_selective_scan,
    cached_selective_scan_fake,
    host_sync=TRITON_STATE_HOST_SYNC,
)

__all__ = [
    "triton_cached_selective_scan",
    "triton_cached_selective_scan_op",
    "decode_rows_triton",
    "is_available",
    "kernel",
]
