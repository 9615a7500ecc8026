"""``workbench::triton_cached_causal_conv1d``: the cached causal conv with its decode rows in Triton.

Same schema and semantics as ``torch_cached_causal_conv1d`` (see ``causal_conv.py``). A decode
row is the hot path of every conv-bearing hybrid (one per conv layer per generated token): in
eager torch it is ~8 small kernels (gather the slots, zero fresh ones, cat, multiply, sum, bias,
activation, scatter the shifted window back); here one program per (decode row, channel block)
reads the row's ``k-1`` state columns and its new input once, writes the output, and writes the
shifted state back in place::

    window [c, k] = (state[slot, :, :] if input_pos > 0 else 0) ++ x[token]
    out[token]    = act(bias + sum_j weight[:, 0, j] * window[:, j])          fp32 accumulation
    state[slot]   = window[:, 1:]

Prefill sequences (rare, long) run the torch reference's ``prefill_rows``. A decode-only step
(``num_prefill == 0``) reads no metadata on the host, so it can be captured in a CUDA graph.

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
from ..triton_support import require_triton
from ..triton_support import triton_available as is_available
from .causal_conv import (
    CACHED_CONV_ARGS,
    cached_causal_conv1d_fake,
    check_cached_conv_args,
    check_conv_args,
    check_conv_state,
    prefill_rows,
)


@functools.lru_cache(maxsize=None)
def kernel():
    """The jitted kernel, built once on first use (importing this module never needs triton)."""
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
        first_row,
        first_token,
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
        row = tl.program_id(0)
        ch = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)  # [BLOCK_C]
        tap = tl.arange(0, K_POW2)  # [K_POW2]: window columns 0..K-1 (K-1 = the new input)
        ch_ok = ch < channels
        slot = tl.load(slot_ptr + first_row + row).to(tl.int64)
        # State columns to read: K-1, or none for a new sequence (input_pos 0), whatever its slot holds.
        held_cols = tl.where(tl.load(pos_ptr + first_row + row) > 0, K - 1, 0)
        token = (first_token + row).to(tl.int64)

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


def decode_rows_triton(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor],
    input_pos: torch.Tensor,
    slot_idx: torch.Tensor,
    conv_state: torch.Tensor,
    activation: Optional[str],
    out: torch.Tensor,
    first_row: int,
    first_token: int,
) -> None:
    """Launch the kernel on rows ``first_row..`` of the metadata (tokens ``first_token..`` of
    ``x [1, T, c]``); writes ``out [1, T, c]`` and the state rows in place."""
    import triton

    rows = slot_idx.numel() - first_row
    c, k = weight.shape[0], weight.shape[2]
    if rows <= 0:
        return
    xs, os_ = x[0], out[0]
    if xs.stride(-1) != 1:
        xs = xs.contiguous()
    if conv_state.shape[2] and conv_state.stride(1) == 0:
        raise ValueError("conv_state must be a real tensor, not a broadcast view")
    block = min(256, triton.next_power_of_2(c))
    grid = (rows, triton.cdiv(c, block))
    kernel()[grid](
        xs,
        weight,
        bias if bias is not None else weight,
        conv_state,
        os_,
        slot_idx,
        input_pos,
        first_row,
        first_token,
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
        SILU=activation == "silu",
        num_warps=1 if x.device.type != "cuda" else 4,
    )


def triton_cached_causal_conv1d(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor],
    seq_lens: torch.Tensor,
    input_pos: torch.Tensor,
    slot_idx: torch.Tensor,
    num_prefill: int,
    conv_state: torch.Tensor,
    activation: Optional[str] = None,
) -> torch.Tensor:
    """The cached causal conv, decode rows in Triton; see the module docstring."""
    require_triton(x.device, "triton_cached_causal_conv1d", "insert_cached_causal_conv.backend=torch")
    out = torch.empty_like(x)
    if num_prefill == 0:  # decode only: T rows of one token, no host read of the metadata
        check_conv_args(x, weight, bias, activation)
        check_decode_only_metadata(x.shape[1], slot_idx, input_pos)
        check_conv_state(weight, conv_state)
        first_token = 0
    else:
        lens = check_cached_conv_args(
            x, weight, bias, seq_lens, input_pos, slot_idx, num_prefill, conv_state, activation
        )
        first_token = prefill_rows(
            x, weight, bias, lens, input_pos, slot_idx.long(), num_prefill, conv_state, activation, out
        )
    decode_rows_triton(x, weight, bias, input_pos, slot_idx, conv_state, activation, out, num_prefill, first_token)
    return out


triton_cached_causal_conv1d_op = define_op(
    "triton_cached_causal_conv1d" + CACHED_CONV_ARGS,
    triton_cached_causal_conv1d,
    cached_causal_conv1d_fake,
    host_sync=TRITON_STATE_HOST_SYNC,
)

__all__ = ["triton_cached_causal_conv1d", "triton_cached_causal_conv1d_op", "decode_rows_triton", "is_available"]
