"""The decode kernel of ``workbench::triton_cached_rglru`` (the cached RG-LRU, ``torch_rglru.py``).

A decode row is elementwise per channel, so in eager torch it is ~15 small kernels (two sigmoids,
softplus, two exps, the sqrt, gather the slots, zero fresh ones, the update, scatter back). Here
one program per (decode row, block of channels) reads its state, computes in fp32 registers and
writes back::

    a = exp(log_a),  log_a = -c * sigmoid(gate_a) * softplus(recurrent_param)   (torch's softplus)
    m = 1 if input_pos == 0 else sqrt(1 - exp(2 log_a))
    h = a * (state[slot] if input_pos > 0 else 0) + m * sigmoid(gate_x) * x

The op, its prefill rows and its checks come from the cached-state kit (``ops/recurrent.py``).
"""

from __future__ import annotations

import torch

from ..recurrent import DecodeRows, Options
from ..triton_support import last_dim_contiguous, lazy_kernel, num_warps

#: Channels per program (the width of RecurrentGemma-2B is 2560: 10 programs per row).
BLOCK_W = 256


@lazy_kernel
def kernel():
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
        width,
        decay_scale,
        stride_xt,
        stride_gxt,
        stride_gat,
        stride_ss,
        stride_ot,
        BLOCK: tl.constexpr,
    ):
        token = tl.program_id(0).to(tl.int64)  # decode row r: token r, slot_idx[r], input_pos[r]
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        ok = cols < width
        slot = tl.load(slot_ptr + token).to(tl.int64)
        # Channels to read from the slot: all for a continuing sequence, none for a new one
        # (input_pos 0: reset), whatever its slot holds. A per-channel mask, as the interpreter
        # wants masks of the loaded shape.
        held = cols < tl.where(tl.load(pos_ptr + token) > 0, width, 0)

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


def decode(rows: DecodeRows, rglru_state: torch.Tensor, options: Options) -> None:
    """Launch the kernel on the decode rows (``x``, ``gate_x``, ``gate_a [n, w]``); writes their
    ``out [n, w]`` and state rows in place."""
    import triton

    width = rows.inputs["x"].shape[-1]
    if rglru_state.stride(-1) != 1:
        raise ValueError("rglru_state must be contiguous in its width dim (a real [num_slots, width] tensor)")
    xs, gxs, gas = (last_dim_contiguous(rows.inputs[k]) for k in ("x", "gate_x", "gate_a"))
    os_ = rows.out
    block = min(BLOCK_W, triton.next_power_of_2(width))
    kernel()[(rows.num_rows, triton.cdiv(width, block))](
        xs,
        gxs,
        gas,
        rows.inputs["recurrent_param"].contiguous(),
        rglru_state,
        os_,
        rows.slot_idx,
        rows.input_pos,
        width,
        float(options["decay_scale"]),
        xs.stride(0),
        gxs.stride(0),
        gas.stride(0),
        rglru_state.stride(0),
        os_.stride(0),
        BLOCK=block,
        num_warps=num_warps(xs),
    )


__all__ = ["decode", "kernel", "BLOCK_W"]
