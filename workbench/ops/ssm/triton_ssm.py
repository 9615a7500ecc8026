"""``workbench::triton_cached_ssm``: the cached Mamba-2 scan with its decode rows in Triton.

Same schema and semantics as ``torch_cached_ssm`` (see ``cached_ssm_scan.py``). A decode row is
the hot path of every Mamba-2 model (one per SSM layer per generated token): in eager torch it is
~15 small kernels (softplus, clamp, exp, gather the slots, zero fresh ones, broadcast B/C to heads,
the state update, the C contraction, the D skip, scatter the state back). Here one program per
(decode row, head, head_dim block) reads its [BLOCK_D, n] state tile once, updates it in registers
and writes it back in place::

    dt    = clamp(softplus(dt_raw + dt_bias[h]), min, max)            fp32, torch's softplus
    state = exp(dt * A[h]) * (state[slot, h] if input_pos > 0 else 0) + dt * x B^T
    y     = state C + D[h] * x

B and C are read from the token's group (head // (heads / groups)), never expanded per head.
Prefill sequences (rare, long) run the torch reference's ``prefill_rows`` (the chunked scan). A
decode-only step (``num_prefill == 0``) reads no metadata on the host, so it can be captured in a
CUDA graph.

The op is always registered; ``is_available(device)`` says whether the kernel can run: CUDA
tensors, or CPU tensors under ``TRITON_INTERPRET=1`` (tests). Called where it cannot run, it raises
and names the ``torch`` backend instead of silently falling back.
"""

from __future__ import annotations

import functools
from typing import Optional

import torch

from ..library import define_op
from ..state import TRITON_STATE_HOST_SYNC, check_decode_only_metadata
from ..triton_support import last_dim_contiguous, require_triton
from ..triton_support import triton_available as is_available
from .cached_ssm_scan import CACHED_SSM_ARGS, cached_ssm_fake, check_cached_ssm_args, check_ssm_state, prefill_rows
from .ssm_scan import check_ssm_args

#: Largest state tile one program holds (elements): BLOCK_D * BLOCK_N, e.g. 32 x 128.
TILE_ELEMS = 4096


@functools.lru_cache(maxsize=None)
def kernel():
    """The jitted kernel, built once on first use (importing this module never needs triton)."""
    import triton
    import triton.language as tl

    @triton.jit
    def ssm_decode_kernel(
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
        heads_per_group,
        head_dim,
        state_size,
        dt_min,
        dt_max,
        stride_xt,
        stride_xh,
        stride_dtt,
        stride_bt,
        stride_bg,
        stride_ct,
        stride_cg,
        stride_ss,
        stride_sh,
        stride_sd,
        stride_ot,
        stride_oh,
        BLOCK_D: tl.constexpr,
        BLOCK_N: tl.constexpr,
        HAS_MAX: tl.constexpr,
    ):
        row = tl.program_id(0)
        head = tl.program_id(1)
        dd = tl.program_id(2) * BLOCK_D + tl.arange(0, BLOCK_D)  # [BLOCK_D] channels of the head
        nn = tl.arange(0, BLOCK_N)  # [BLOCK_N] state entries
        d_ok = dd < head_dim
        n_ok = nn < state_size
        slot = tl.load(slot_ptr + first_row + row).to(tl.int64)
        # State entries to read: all, or none for a new sequence (input_pos 0), whatever its slot holds.
        held_n = tl.where(tl.load(pos_ptr + first_row + row) > 0, state_size, 0)
        token = (first_token + row).to(tl.int64)
        group = head // heads_per_group

        # The step: softplus as torch computes it (identity above 20), log1p(exp(-|v|)) without
        # losing small values to 1 + u (the compensated log1p: log(w) * u / (w - 1)).
        v = tl.load(dt_ptr + token * stride_dtt + head).to(tl.float32) + tl.load(dt_bias_ptr + head).to(tl.float32)
        u = tl.exp(-tl.abs(v))
        w = 1.0 + u
        log1p_u = tl.where(w == 1.0, u, tl.log(w) * (u / (w - 1.0)))
        step = tl.where(v > 20.0, v, tl.maximum(v, 0.0) + log1p_u)
        step = tl.maximum(step, dt_min)
        if HAS_MAX:
            step = tl.minimum(step, dt_max)
        decay = tl.exp(step * tl.load(a_ptr + head).to(tl.float32))

        x = tl.load(x_ptr + token * stride_xt + head * stride_xh + dd, mask=d_ok, other=0.0).to(tl.float32)
        b = tl.load(b_ptr + token * stride_bt + group * stride_bg + nn, mask=n_ok, other=0.0).to(tl.float32)
        c = tl.load(c_ptr + token * stride_ct + group * stride_cg + nn, mask=n_ok, other=0.0).to(tl.float32)
        tile = state_ptr + slot * stride_ss + head * stride_sh + dd[:, None] * stride_sd + nn[None, :]
        in_tile = d_ok[:, None] & n_ok[None, :]
        # A masked load, never a multiply by zero: a reused slot may hold inf/NaN.
        state = tl.load(tile, mask=d_ok[:, None] & (nn[None, :] < held_n), other=0.0).to(tl.float32)
        state = decay * state + (step * x)[:, None] * b[None, :]
        y = tl.sum(state * c[None, :], axis=1) + tl.load(d_ptr + head).to(tl.float32) * x
        tl.store(out_ptr + token * stride_ot + head * stride_oh + dd, y.to(out_ptr.dtype.element_ty), mask=d_ok)
        tl.store(tile, state.to(state_ptr.dtype.element_ty), mask=in_tile)

    return ssm_decode_kernel


def decode_rows_triton(
    hidden_states,
    A,
    B,
    C,
    D,
    dt,
    dt_bias,
    input_pos,
    slot_idx,
    ssm_state,
    time_step_min: float,
    time_step_max: Optional[float],
    out: torch.Tensor,
    first_row: int,
    first_token: int,
) -> None:
    """Launch the kernel on rows ``first_row..`` of the metadata (tokens ``first_token..`` of the
    flattened [1, T, ...] inputs); writes ``out [1, T, h, d]`` and the state rows in place."""
    import triton

    rows = slot_idx.numel() - first_row
    if rows <= 0:
        return
    _, _, h, d = hidden_states.shape
    g, n = B.shape[2], B.shape[3]
    if ssm_state.stride(-1) != 1:
        raise ValueError("ssm_state must be contiguous in its state dim (a real [num_slots, h, d, n] tensor)")
    x, bs, cs, dts, os_ = (last_dim_contiguous(t[0]) for t in (hidden_states, B, C, dt, out))
    if os_.data_ptr() != out[0].data_ptr():
        raise ValueError("out must be contiguous in its last dim")
    block_n = triton.next_power_of_2(n)
    block_d = min(triton.next_power_of_2(d), max(1, TILE_ELEMS // block_n))
    grid = (rows, h, triton.cdiv(d, block_d))
    kernel()[grid](
        x,
        dts,
        dt_bias,
        A,
        bs,
        cs,
        D,
        ssm_state,
        os_,
        slot_idx,
        input_pos,
        first_row,
        first_token,
        h // g,
        d,
        n,
        float(time_step_min),
        0.0 if time_step_max is None else float(time_step_max),
        x.stride(0),
        x.stride(1),
        dts.stride(0),
        bs.stride(0),
        bs.stride(1),
        cs.stride(0),
        cs.stride(1),
        ssm_state.stride(0),
        ssm_state.stride(1),
        ssm_state.stride(2),
        os_.stride(0),
        os_.stride(1),
        BLOCK_D=block_d,
        BLOCK_N=block_n,
        HAS_MAX=time_step_max is not None,
        num_warps=4 if x.device.type == "cuda" else 1,
    )


def triton_cached_ssm(
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
    time_step_min: float = 0.0,
    time_step_max: Optional[float] = None,
    chunk_size: int = 256,
) -> torch.Tensor:
    """The cached scan, decode rows in Triton; see the module docstring."""
    require_triton(hidden_states.device, "triton_cached_ssm", "insert_cached_ssm_attention.backend=torch")
    out = torch.empty_like(hidden_states)
    scan = (hidden_states, A, B, C, D, dt, dt_bias)  # what prefill_rows and decode_rows_triton read first
    if num_prefill == 0:  # decode only: T rows of one token, no host read of the metadata
        check_ssm_args(hidden_states, A, B, C, D, dt, dt_bias, chunk_size)
        check_decode_only_metadata(hidden_states.shape[1], slot_idx, input_pos)
        check_ssm_state(hidden_states, B, ssm_state)
        first_token = 0
    else:
        lens = check_cached_ssm_args(
            hidden_states, A, B, C, D, dt, dt_bias, seq_lens, input_pos, slot_idx, num_prefill, ssm_state, chunk_size
        )
        first_token = prefill_rows(
            *scan,
            lens,
            input_pos,
            slot_idx.long(),
            num_prefill,
            ssm_state,
            time_step_min,
            time_step_max,
            chunk_size,
            out,
        )
    decode_rows_triton(
        *scan, input_pos, slot_idx, ssm_state, time_step_min, time_step_max, out, num_prefill, first_token
    )
    return out


triton_cached_ssm_op = define_op(
    "triton_cached_ssm" + CACHED_SSM_ARGS, triton_cached_ssm, cached_ssm_fake, host_sync=TRITON_STATE_HOST_SYNC
)

__all__ = ["triton_cached_ssm", "triton_cached_ssm_op", "decode_rows_triton", "is_available", "kernel"]
