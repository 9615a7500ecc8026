"""The decode kernel of ``workbench::triton_cached_ssm`` (the cached Mamba-2 scan, ``ssm_scan.py``).

A decode row is the hot path of every Mamba-2 model (one per SSM layer per generated token): in
eager torch it is ~15 small kernels (softplus, clamp, exp, gather the slots, zero fresh ones, broadcast B/C to heads,
the state update, the C contraction, the D skip, scatter the state back). Here one program per
(decode row, head, head_dim block) reads its [BLOCK_D, n] state tile once, updates it in registers
and writes it back in place::

    dt    = clamp(softplus(dt_raw + dt_bias[h]), min, max)            fp32, torch's softplus
    state = exp(dt * A[h]) * (state[slot, h] if input_pos > 0 else 0) + dt * x B^T
    y     = state C + D[h] * x

B and C are read from the token's group (head // (heads / groups)), never expanded per head.
The op, its prefill rows (the chunked scan) and its checks come from the cached-state kit
(``ops/recurrent.py``).
"""

from __future__ import annotations

from typing import Optional

import torch

from ..recurrent import DecodeRows, Options
from ..triton_support import last_dim_contiguous, lazy_kernel, num_warps

#: Largest state tile one program holds (elements): BLOCK_D * BLOCK_N, e.g. 32 x 128 (Mamba-2).
TILE_ELEMS = 4096
#: Mamba-1's: 64 x 16 or 16 x 64 (its exp is per state entry, not per head).
TILE_ELEMS_PER_CHANNEL = 1024


@lazy_kernel
def kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def scan_decode_kernel(
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
        heads_per_group,
        head_dim,
        state_size,
        dt_min,
        dt_max,
        stride_xt,
        stride_xh,
        stride_dtt,
        stride_ad,
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
        PER_CHANNEL: tl.constexpr,
    ):
        token = tl.program_id(0).to(tl.int64)  # decode row r: token r, slot_idx[r], input_pos[r]
        head = tl.program_id(1)
        dd = tl.program_id(2) * BLOCK_D + tl.arange(0, BLOCK_D)  # [BLOCK_D] channels of the head
        nn = tl.arange(0, BLOCK_N)  # [BLOCK_N] state entries
        d_ok = dd < head_dim
        n_ok = nn < state_size
        in_tile = d_ok[:, None] & n_ok[None, :]
        slot = tl.load(slot_ptr + token).to(tl.int64)
        # State entries to read: all, or none for a new sequence (input_pos 0), whatever its slot holds.
        held_n = tl.where(tl.load(pos_ptr + token) > 0, state_size, 0)
        group = head // heads_per_group

        # Mamba-1 (PER_CHANNEL): dt, dt_bias, D per channel, A [d, n]; Mamba-2: one of each per head.
        if PER_CHANNEL:
            v = tl.load(dt_ptr + token * stride_dtt + dd, mask=d_ok, other=0.0).to(tl.float32)
            v += tl.load(dt_bias_ptr + dd, mask=d_ok, other=0.0).to(tl.float32)
            skip = tl.load(d_ptr + dd, mask=d_ok, other=0.0).to(tl.float32)
        else:
            v = tl.load(dt_ptr + token * stride_dtt + head).to(tl.float32) + tl.load(dt_bias_ptr + head).to(tl.float32)
            skip = tl.load(d_ptr + head).to(tl.float32)
        # The step: softplus as torch computes it (identity above 20), log1p(exp(-|v|)) without
        # losing small values to 1 + u (the compensated log1p: log(w) * u / (w - 1)).
        u = tl.exp(-tl.abs(v))
        w = 1.0 + u
        log1p_u = tl.where(w == 1.0, u, tl.log(w) * (u / (w - 1.0)))
        step = tl.where(v > 20.0, v, tl.maximum(v, 0.0) + log1p_u)
        step = tl.maximum(step, dt_min)
        if HAS_MAX:
            step = tl.minimum(step, dt_max)

        x = tl.load(x_ptr + token * stride_xt + head * stride_xh + dd, mask=d_ok, other=0.0).to(tl.float32)
        b = tl.load(b_ptr + token * stride_bt + group * stride_bg + nn, mask=n_ok, other=0.0).to(tl.float32)
        c = tl.load(c_ptr + token * stride_ct + group * stride_cg + nn, mask=n_ok, other=0.0).to(tl.float32)
        tile = state_ptr + slot * stride_ss + head * stride_sh + dd[:, None] * stride_sd + nn[None, :]
        # A masked load, never a multiply by zero: a reused slot may hold inf/NaN.
        state = tl.load(tile, mask=d_ok[:, None] & (nn[None, :] < held_n), other=0.0).to(tl.float32)
        if PER_CHANNEL:
            a = tl.load(a_ptr + dd[:, None] * stride_ad + nn[None, :], mask=in_tile, other=0.0).to(tl.float32)
            state = tl.exp(step[:, None] * a) * state + (step * x)[:, None] * b[None, :]
        else:
            state = tl.exp(step * tl.load(a_ptr + head).to(tl.float32)) * state + (step * x)[:, None] * b[None, :]
        y = tl.sum(state * c[None, :], axis=1) + skip * x
        tl.store(out_ptr + token * stride_ot + head * stride_oh + dd, y.to(out_ptr.dtype.element_ty), mask=d_ok)
        tl.store(tile, state.to(state_ptr.dtype.element_ty), mask=in_tile)

    return scan_decode_kernel


def _launch(
    rows: DecodeRows,
    state: torch.Tensor,
    *,
    heads: int,
    head_dim: int,
    tile: int,
    heads_per_group: int,
    A: torch.Tensor,
    stride_ad: int,
    time_step_min: float,
    time_step_max: Optional[float],
    per_channel: bool,
) -> None:
    """One launch over the decode rows (the ``[n, ...]`` inputs), heads x head_dim blocks of at most
    ``tile`` state elements; writes their ``out`` and state rows in place."""
    import triton

    if state.stride(-1) != 1:
        raise ValueError(f"the scan state must be contiguous in its state dim; got strides {state.stride()}")
    inputs = rows.inputs
    x, bs, cs, dts = (last_dim_contiguous(inputs[k]) for k in ("hidden_states", "B", "C", "dt"))
    d, n = head_dim, inputs["B"].shape[-1]
    block_n = triton.next_power_of_2(n)
    block_d = min(triton.next_power_of_2(d), max(1, tile // block_n))
    o = rows.out

    def head_stride(t: torch.Tensor, dims: int) -> int:  # 0 for Mamba-1's one head (no head dim)
        return t.stride(1) if t.dim() == dims else 0

    kernel()[(rows.num_rows, heads, triton.cdiv(d, block_d))](
        x,
        dts,
        last_dim_contiguous(inputs["dt_bias"]),
        A,
        bs,
        cs,
        last_dim_contiguous(inputs["D"]),
        state,
        o,
        rows.slot_idx,
        rows.input_pos,
        heads_per_group,
        d,
        n,
        float(time_step_min),
        0.0 if time_step_max is None else float(time_step_max),
        x.stride(0),
        head_stride(x, 3),
        dts.stride(0),
        stride_ad,
        bs.stride(0),
        head_stride(bs, 3),
        cs.stride(0),
        head_stride(cs, 3),
        state.stride(0),
        head_stride(state, 4),
        state.stride(-2),
        o.stride(0),
        head_stride(o, 3),
        BLOCK_D=block_d,
        BLOCK_N=block_n,
        HAS_MAX=time_step_max is not None,
        PER_CHANNEL=per_channel,
        num_warps=num_warps(x),
    )


def decode(rows: DecodeRows, ssm_state: torch.Tensor, options: Options) -> None:
    """Mamba-2 decode rows: ``hidden_states [n, h, d]``, B/C ``[n, g, n_state]``, A/D/dt_bias ``[h]``,
    ``ssm_state [num_slots, h, d, n_state]``."""
    _, h, d = rows.inputs["hidden_states"].shape
    _launch(
        rows,
        ssm_state,
        heads=h,
        head_dim=d,
        tile=TILE_ELEMS,
        heads_per_group=h // rows.inputs["B"].shape[1],
        A=last_dim_contiguous(rows.inputs["A"]),  # the kernel reads A[head] at unit stride
        stride_ad=0,
        time_step_min=options["time_step_min"],
        time_step_max=options["time_step_max"],
        per_channel=False,
    )


def decode_selective(rows: DecodeRows, ssm_state: torch.Tensor, options: Options) -> None:
    """Mamba-1 decode rows: one "head" of d channels, ``hidden_states``/``dt [n, d]``, B/C
    ``[n, n_state]``, ``A [d, n_state]``, D/dt_bias ``[d]``, ``ssm_state [num_slots, d, n_state]``; no
    step clamp."""
    A = last_dim_contiguous(rows.inputs["A"])
    _launch(
        rows,
        ssm_state,
        heads=1,
        head_dim=A.shape[0],
        tile=TILE_ELEMS_PER_CHANNEL,
        heads_per_group=1,
        A=A,
        stride_ad=A.stride(0),
        time_step_min=0.0,  # softplus is >= 0: a no-op bound
        time_step_max=None,
        per_channel=True,
    )


__all__ = ["decode", "decode_selective", "kernel", "TILE_ELEMS"]
