"""``triton_cached_linear_attention``: the cached linear attention with its decode rows in Triton.

Same schema and semantics as ``torch_cached_linear_attention`` (``cached_linear_attention.py``). A
decode row is the hot path of every linear-attention layer (one per layer per generated token): in
eager torch it is a handful of small kernels (gather the slots, zero fresh ones, decay, rank-1
update, matvec, scatter back); here one program per (decode row, value head, dv block) reads its
``[dk, BLOCK_V]`` slice of the state once, updates it in registers and writes it back in place::

    S      = (state[slot, head] if input_pos > 0 else 0) * exp(g) + k^T v     key head = head // (h / hk)
    out    = scale * q S;   state[slot, head] = S                              fp32 throughout

Prefill sequences (rare, long) run the torch reference's ``prefill_rows`` (the chunked form). A
decode-only step (``num_prefill == 0``) reads no metadata on the host, so it can be captured in a
CUDA graph.

The op is always registered; ``is_available(device)`` says whether the kernel can run: CUDA
tensors, or CPU tensors under ``TRITON_INTERPRET=1`` (tests). Called where it cannot run, it raises
and names the ``torch`` backend instead of silently falling back.
"""

from __future__ import annotations

import functools

from ..library import define_op
from ..state import TRITON_STATE_HOST_SYNC, check_decode_only_metadata
from ..triton_support import last_dim_contiguous, require_triton
from ..triton_support import triton_available as is_available
from .cached_linear_attention import (
    CACHED_ARGS,
    cached_fake,
    check_cached_linear_attention_args,
    check_linear_attention_step,
    prefill_rows,
)
from .linear_attention import check_linear_attention_args, linear_attention_output_like


@functools.lru_cache(maxsize=None)
def kernel():
    """The jitted kernel, built once on first use (importing this module never needs triton)."""
    import triton
    import triton.language as tl

    @triton.jit
    def linear_attention_decode_kernel(
        q_ptr,
        k_ptr,
        v_ptr,
        g_ptr,
        state_ptr,
        out_ptr,
        slot_ptr,
        pos_ptr,
        first_row,
        first_token,
        scale,
        dk,
        dv,
        stride_qt,
        stride_qh,
        stride_kt,
        stride_kh,
        stride_vt,
        stride_vh,
        stride_gt,
        stride_gh,
        stride_ss,
        stride_sh,
        stride_sk,
        stride_ot,
        stride_oh,
        REP: tl.constexpr,
        DK_POW2: tl.constexpr,
        BLOCK_V: tl.constexpr,
    ):
        row = tl.program_id(0)
        head = tl.program_id(1)
        kd = tl.arange(0, DK_POW2)  # [DK_POW2]
        vd = tl.program_id(2) * BLOCK_V + tl.arange(0, BLOCK_V)  # [BLOCK_V]
        kd_ok, vd_ok = kd < dk, vd < dv
        token = (first_token + row).to(tl.int64)
        slot = tl.load(slot_ptr + first_row + row).to(tl.int64)
        key_head = head // REP

        q = tl.load(q_ptr + token * stride_qt + key_head * stride_qh + kd, mask=kd_ok, other=0.0).to(tl.float32)
        k = tl.load(k_ptr + token * stride_kt + key_head * stride_kh + kd, mask=kd_ok, other=0.0).to(tl.float32)
        v = tl.load(v_ptr + token * stride_vt + head * stride_vh + vd, mask=vd_ok, other=0.0).to(tl.float32)
        decay = tl.exp(tl.load(g_ptr + token * stride_gt + head * stride_gh).to(tl.float32))

        # State rows to read: all dk, or none for a new sequence (input_pos 0), whatever its slot
        # holds -- a masked load, never a multiply by zero: a reused slot may hold inf/NaN.
        held_rows = tl.where(tl.load(pos_ptr + first_row + row) > 0, dk, 0)
        cells = state_ptr + slot * stride_ss + head * stride_sh + kd[:, None] * stride_sk + vd[None, :]
        s = tl.load(cells, mask=(kd[:, None] < held_rows) & vd_ok[None, :], other=0.0).to(tl.float32)
        s = s * decay + k[:, None] * v[None, :]
        out = tl.sum(s * q[:, None], axis=0) * scale
        tl.store(out_ptr + token * stride_ot + head * stride_oh + vd, out.to(out_ptr.dtype.element_ty), mask=vd_ok)
        tl.store(cells, s.to(state_ptr.dtype.element_ty), mask=kd_ok[:, None] & vd_ok[None, :])

    return linear_attention_decode_kernel


def decode_rows_triton(q, k, v, g, input_pos, slot_idx, state, out, first_row: int, first_token: int, scale: float):
    """Launch the kernel on metadata rows ``first_row..`` (tokens ``first_token..`` of the
    ``[1, T, ...]`` inputs); writes ``out [1, T, h, dv]`` and the state rows in place."""
    import triton

    rows = slot_idx.numel() - first_row
    if rows <= 0:
        return
    if state.stride(-1) != 1:
        raise ValueError("the linear-attention state must be contiguous in its last (dv) dim: updated in place")
    hk, dk = q.shape[2], q.shape[3]
    h, dv = v.shape[2], v.shape[3]
    q, k, v = (last_dim_contiguous(x[0]) for x in (q, k, v))  # [T, heads, d]
    gs = g[0]  # [T, h]
    o = out[0]
    block_v = min(64, triton.next_power_of_2(dv))
    grid = (rows, h, triton.cdiv(dv, block_v))
    kernel()[grid](
        q,
        k,
        v,
        gs,
        state,
        o,
        slot_idx,
        input_pos,
        first_row,
        first_token,
        float(scale),
        dk,
        dv,
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        gs.stride(0),
        gs.stride(1),
        state.stride(0),
        state.stride(1),
        state.stride(2),
        o.stride(0),
        o.stride(1),
        REP=h // hk,
        DK_POW2=triton.next_power_of_2(dk),
        BLOCK_V=block_v,
        num_warps=1 if q.device.type != "cuda" else 4,
    )


def triton_cached_linear_attention_impl(
    q, k, v, g, seq_lens, input_pos, slot_idx, num_prefill, state, scale=1.0, chunk_size=64
):
    """The cached linear attention, decode rows in Triton; see the module docstring."""
    require_triton(q.device, "triton_cached_linear_attention", "insert_cached_linear_attention.backend=torch")
    out = linear_attention_output_like(q, v)
    if num_prefill == 0:  # decode only: T rows of one token, no host read of the metadata
        check_linear_attention_args(q, k, v, g, chunk_size)
        check_linear_attention_step(q, v, state)
        check_decode_only_metadata(q.shape[1], slot_idx, input_pos)
        first_token = 0
    else:
        lens = check_cached_linear_attention_args(
            q, k, v, g, seq_lens, input_pos, slot_idx, num_prefill, state, chunk_size
        )
        first_token = prefill_rows(
            q, k, v, g, lens, input_pos, slot_idx.long(), num_prefill, state, out, scale, chunk_size
        )
    decode_rows_triton(q, k, v, g, input_pos, slot_idx, state, out, num_prefill, first_token, scale)
    return out


triton_cached_linear_attention = define_op(
    "triton_cached_linear_attention" + CACHED_ARGS,
    triton_cached_linear_attention_impl,
    cached_fake,
    host_sync=TRITON_STATE_HOST_SYNC,
)

__all__ = ["triton_cached_linear_attention", "decode_rows_triton", "kernel", "is_available"]
