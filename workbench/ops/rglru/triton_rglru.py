"""``workbench::triton_cached_rglru``: the cached RG-LRU recurrence with its decode rows in Triton.

Same schema and semantics as ``torch_cached_rglru`` (see ``torch_cached_rglru.py``). A decode row
is elementwise per channel, so in eager torch it is ~15 small kernels (two sigmoids, softplus,
two exps, the sqrt, gather the slots, zero fresh ones, the update, scatter back). Here one program
per (decode row, block of channels) reads its state, computes in fp32 registers and writes back::

    a = exp(log_a),  log_a = -c * sigmoid(gate_a) * softplus(recurrent_param)   (torch's softplus)
    m = 1 if input_pos == 0 else sqrt(1 - exp(2 log_a))
    h = a * (state[slot] if input_pos > 0 else 0) + m * sigmoid(gate_x) * x

Prefill sequences run the torch reference's ``prefill_rows``. A decode-only step
(``num_prefill == 0``) reads no metadata on the host, so it can be captured in a CUDA graph.

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
from .rglru_math import DEFAULT_DECAY_SCALE
from .torch_cached_rglru import (
    CACHED_RGLRU_ARGS,
    cached_rglru_fake,
    check_cached_rglru_args,
    check_rglru_state,
    prefill_rows,
)
from .torch_rglru import check_rglru_args

#: Channels per program (the width of RecurrentGemma-2B is 2560: 10 programs per row).
BLOCK_W = 256


@functools.lru_cache(maxsize=None)
def kernel():
    """The jitted kernel, built once on first use (importing this module never needs triton)."""
    import triton
    import triton.language as tl

    @triton.jit
    def rglru_decode_kernel(
        x_ptr,
        gx_ptr,
        ga_ptr,
        param_ptr,
        state_ptr,
        out_ptr,
        slot_ptr,
        pos_ptr,
        first_row,
        first_token,
        width,
        decay_scale,
        stride_xt,
        stride_gxt,
        stride_gat,
        stride_ss,
        stride_ot,
        BLOCK: tl.constexpr,
    ):
        row = tl.program_id(0)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        ok = cols < width
        slot = tl.load(slot_ptr + first_row + row).to(tl.int64)
        # Channels to read from the slot: all for a continuing sequence, none for a new one
        # (input_pos 0: reset), whatever its slot holds. A per-channel mask, as the interpreter
        # wants masks of the loaded shape.
        held = cols < tl.where(tl.load(pos_ptr + first_row + row) > 0, width, 0)
        token = (first_token + row).to(tl.int64)

        x = tl.load(x_ptr + token * stride_xt + cols, mask=ok, other=0.0).to(tl.float32)
        gx = tl.load(gx_ptr + token * stride_gxt + cols, mask=ok, other=0.0).to(tl.float32)
        ga = tl.load(ga_ptr + token * stride_gat + cols, mask=ok, other=0.0).to(tl.float32)
        p = tl.load(param_ptr + cols, mask=ok, other=0.0).to(tl.float32)
        # softplus as torch computes it (identity above 20), log1p(exp(-|p|)) compensated so small
        # values are not lost to 1 + u.
        e = tl.exp(-tl.abs(p))
        w1 = 1.0 + e
        log1p_e = tl.where(w1 == 1.0, e, tl.log(w1) * (e / (w1 - 1.0)))
        softplus = tl.where(p > 20.0, p, tl.maximum(p, 0.0) + log1p_e)
        log_a = -decay_scale * (1.0 / (1.0 + tl.exp(-ga))) * softplus
        a = tl.exp(log_a)
        multiplier = tl.where(held, tl.sqrt(1.0 - tl.exp(2.0 * log_a)), 1.0)
        gated = x * (1.0 / (1.0 + tl.exp(-gx)))
        # A masked load, never a multiply by zero: a reused slot may hold inf/NaN.
        h = tl.load(state_ptr + slot * stride_ss + cols, mask=held, other=0.0).to(tl.float32)
        h = a * h + multiplier * gated
        tl.store(out_ptr + token * stride_ot + cols, h.to(out_ptr.dtype.element_ty), mask=ok)
        tl.store(state_ptr + slot * stride_ss + cols, h.to(state_ptr.dtype.element_ty), mask=ok)

    return rglru_decode_kernel


def decode_rows_triton(
    x,
    gate_x,
    gate_a,
    recurrent_param,
    input_pos,
    slot_idx,
    rglru_state,
    decay_scale: float,
    out,
    first_row,
    first_token,
) -> None:
    """Launch the kernel on rows ``first_row..`` of the metadata (tokens ``first_token..`` of the
    flattened [1, T, w] inputs); writes ``out [1, T, w]`` and the state rows in place."""
    import triton

    rows = slot_idx.numel() - first_row
    if rows <= 0:
        return
    width = x.shape[-1]
    if rglru_state.stride(-1) != 1:
        raise ValueError("rglru_state must be contiguous in its width dim (a real [num_slots, width] tensor)")
    xs, gxs, gas, os_ = (last_dim_contiguous(t[0]) for t in (x, gate_x, gate_a, out))
    if os_.data_ptr() != out[0].data_ptr():
        raise ValueError("out must be contiguous in its last dim")
    param = recurrent_param.contiguous()
    block = min(BLOCK_W, triton.next_power_of_2(width))
    grid = (rows, triton.cdiv(width, block))
    kernel()[grid](
        xs,
        gxs,
        gas,
        param,
        rglru_state,
        os_,
        slot_idx,
        input_pos,
        first_row,
        first_token,
        width,
        float(decay_scale),
        xs.stride(0),
        gxs.stride(0),
        gas.stride(0),
        rglru_state.stride(0),
        os_.stride(0),
        BLOCK=block,
        num_warps=4 if x.device.type == "cuda" else 1,
    )


def triton_cached_rglru(
    x: torch.Tensor,
    gate_x: torch.Tensor,
    gate_a: torch.Tensor,
    recurrent_param: torch.Tensor,
    seq_lens: torch.Tensor,
    input_pos: torch.Tensor,
    slot_idx: torch.Tensor,
    num_prefill: int,
    rglru_state: torch.Tensor,
    decay_scale: float = DEFAULT_DECAY_SCALE,
) -> torch.Tensor:
    """The cached recurrence, decode rows in Triton; see the module docstring."""
    require_triton(x.device, "triton_cached_rglru", "insert_cached_ssm_attention.backend=torch")
    out = torch.empty_like(x)
    args = (x, gate_x, gate_a, recurrent_param)
    if num_prefill == 0:  # decode only: T rows of one token, no host read of the metadata
        check_rglru_args(x, gate_x, gate_a, recurrent_param, "triton_cached_rglru")
        check_decode_only_metadata(x.shape[1], slot_idx, input_pos)
        check_rglru_state(x, rglru_state)
        first_token = 0
    else:
        lens = check_cached_rglru_args(
            *args, seq_lens, input_pos, slot_idx, num_prefill, rglru_state, "triton_cached_rglru"
        )
        first_token = prefill_rows(*args, lens, input_pos, slot_idx.long(), num_prefill, rglru_state, decay_scale, out)
    decode_rows_triton(*args, input_pos, slot_idx, rglru_state, decay_scale, out, num_prefill, first_token)
    return out


triton_cached_rglru_op = define_op(
    "triton_cached_rglru" + CACHED_RGLRU_ARGS, triton_cached_rglru, cached_rglru_fake, host_sync=TRITON_STATE_HOST_SYNC
)

__all__ = ["triton_cached_rglru", "triton_cached_rglru_op", "decode_rows_triton", "is_available", "kernel"]
