"""The decode kernel of ``workbench::triton_cached_causal_conv1d`` (the cached causal conv).

Same schema and semantics as ``torch_cached_causal_conv1d`` (see ``causal_conv.py``). A decode
row is the hot path of every conv-bearing hybrid (one per conv layer per generated token): in
eager torch it is ~8 small kernels (gather the slots, zero fresh ones, cat, multiply, sum, bias,
activation, scatter the shifted window back); here one program per (decode row, channel block)
reads the row's ``k-1`` state columns and its new input once, writes the output, and writes the
shifted state back in place::

    window [c, k] = (state[slot, :, :] if input_pos > 0 else 0) ++ x[token]
    out[token]    = act(bias + sum_j weight[:, 0, j] * window[:, j])          fp32 accumulation
    state[slot]   = window[:, 1:]

The op itself, its prefill rows and its checks come from the cached-state kit (``ops/recurrent.py``).
"""

from __future__ import annotations

import torch

from ..recurrent import DecodeRows, Options
from ..triton_support import last_dim_contiguous, lazy_kernel, num_warps


@lazy_kernel
def kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def conv_decode_kernel(
        x_ptr,
        w_ptr,
        b_ptr,
        state_ptr,
        out_ptr,
        slot_ptr,
        pos_ptr,
        channels,
        stride_xt,
        stride_wc,
        stride_wk,
        stride_ss,
        stride_sc,
        stride_sk,
        stride_ot,
        K: tl.constexpr,
        K_POW2: tl.constexpr,
        BLOCK_C: tl.constexpr,
        HAS_BIAS: tl.constexpr,
        SILU: tl.constexpr,
    ):
        token = tl.program_id(0).to(tl.int64)  # decode row r: token r, slot_idx[r], input_pos[r]
        ch = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)  # [BLOCK_C]
        tap = tl.arange(0, K_POW2)  # [K_POW2]: window columns 0..K-1 (K-1 = the new input)
        ch_ok = ch < channels
        slot = tl.load(slot_ptr + token).to(tl.int64)
        # State columns to read: K-1, or none for a new sequence (input_pos 0), whatever its slot holds.
        held_cols = tl.where(tl.load(pos_ptr + token) > 0, K - 1, 0)

        x = tl.load(x_ptr + token * stride_xt + ch, mask=ch_ok, other=0.0).to(tl.float32)  # [BLOCK_C]
        rows = state_ptr + slot * stride_ss + ch[:, None] * stride_sc  # [BLOCK_C, 1]
        # Masked loads, never a multiply by zero: a reused slot may hold inf/NaN.
        held = tl.load(rows + tap[None, :] * stride_sk, mask=ch_ok[:, None] & (tap[None, :] < held_cols), other=0.0).to(
            tl.float32
        )  # [BLOCK_C, K_POW2]
        window = tl.where(tap[None, :] == K - 1, x[:, None], held)
        w = tl.load(
            w_ptr + ch[:, None] * stride_wc + tap[None, :] * stride_wk,
            mask=ch_ok[:, None] & (tap[None, :] < K),
            other=0.0,
        ).to(tl.float32)
        y = tl.sum(window * w, axis=1)  # [BLOCK_C]
        if HAS_BIAS:
            y += tl.load(b_ptr + ch, mask=ch_ok, other=0.0).to(tl.float32)
        if SILU:
            y = y * tl.sigmoid(y)
        tl.store(out_ptr + token * stride_ot + ch, y.to(out_ptr.dtype.element_ty), mask=ch_ok)

        # The shifted window window[:, 1:], read again from the state (loads come before the store).
        later = tl.load(
            rows + (tap[None, :] + 1) * stride_sk, mask=ch_ok[:, None] & (tap[None, :] + 1 < held_cols), other=0.0
        )
        shifted = tl.where(tap[None, :] == K - 2, x[:, None].to(later.dtype), later)
        tl.store(
            rows + tap[None, :] * stride_sk,
            shifted.to(state_ptr.dtype.element_ty),
            mask=ch_ok[:, None] & (tap[None, :] < K - 1),
        )

    return conv_decode_kernel


def decode(rows: DecodeRows, conv_state: torch.Tensor, options: Options) -> None:
    """Launch the kernel on the decode rows (``x [n, c]``); writes their ``out [n, c]`` and state rows."""
    import triton

    x, weight, bias = rows.inputs["x"], rows.inputs["weight"], rows.inputs["bias"]
    c, k = weight.shape[0], weight.shape[2]
    xs, os_ = last_dim_contiguous(x), rows.out
    if conv_state.shape[2] and conv_state.stride(1) == 0:
        raise ValueError("conv_state must be a real tensor, not a broadcast view")
    block = min(256, triton.next_power_of_2(c))
    grid = (rows.num_rows, triton.cdiv(c, block))
    kernel()[grid](
        xs,
        weight,
        bias if bias is not None else weight,
        conv_state,
        os_,
        rows.slot_idx,
        rows.input_pos,
        c,
        xs.stride(0),
        weight.stride(0),
        weight.stride(2),
        conv_state.stride(0),
        conv_state.stride(1),
        conv_state.stride(2) if k > 1 else 1,
        os_.stride(0),
        K=k,
        K_POW2=triton.next_power_of_2(k),
        BLOCK_C=block,
        HAS_BIAS=bias is not None,
        SILU=options["activation"] == "silu",
        num_warps=num_warps(x),
    )


__all__ = ["decode", "kernel"]
