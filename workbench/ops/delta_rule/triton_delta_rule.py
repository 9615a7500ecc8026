"""``triton_cached_gated_delta_rule`` / ``triton_cached_delta_rule``: the cached delta rules with
their decode rows in Triton.

Same schemas and semantics as the torch ops (``torch_cached_delta_rule.py``). A decode row is the
hot path of every delta-rule layer (one per layer per generated token): in eager torch it is ~15
small kernels (gather the slots, zero fresh ones, normalise, decay, two matvecs, rank-1 update,
scatter back); here one program per (decode row, value head, dv block) reads its ``[dk, BLOCK_V]``
slice of the state once, updates it in registers and writes it back in place::

    q, k   = l2norm(q), l2norm(k) (if asked); q *= scale          key head = value head // (h / hk)
    S      = (state[slot, head] if input_pos > 0 else 0) * exp(g)        (gated only)
    u      = beta * (v - S^T k);   S += k u^T;   out = S^T q;   state[slot, head] = S     fp32 throughout

Prefill sequences (rare, long) run the torch reference's ``prefill_rows`` (the chunked form). A
decode-only step (``num_prefill == 0``) reads no metadata on the host, so it can be captured in a
CUDA graph.

The ops are always registered; ``is_available(device)`` says whether the kernel can run: CUDA
tensors, or CPU tensors under ``TRITON_INTERPRET=1`` (tests). Called where it cannot run, an op
raises and names the ``torch`` backend instead of silently falling back.
"""

from __future__ import annotations

import functools
from typing import Optional

from ..library import define_op
from ..state import TRITON_STATE_HOST_SYNC, check_decode_only_metadata
from ..triton_support import last_dim_contiguous, require_triton
from ..triton_support import triton_available as is_available
from .delta_rule_math import L2NORM_EPS, check_delta_rule_args
from .torch_cached_delta_rule import (
    CACHED_GATED_ARGS,
    CACHED_PLAIN_ARGS,
    cached_gated_fake,
    cached_plain_fake,
    check_cached_delta_rule_args,
    check_delta_rule_step,
    prefill_rows,
    without_gate,
)
from .torch_delta_rule import delta_rule_output_like


@functools.lru_cache(maxsize=None)
def kernel():
    """The jitted kernel, built once on first use (importing this module never needs triton)."""
    import triton
    import triton.language as tl

    @triton.jit
    def delta_rule_decode_kernel(
        q_ptr,
        k_ptr,
        v_ptr,
        g_ptr,
        beta_ptr,
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
        stride_bt,
        stride_bh,
        stride_ss,
        stride_sh,
        stride_sk,
        stride_ot,
        stride_oh,
        REP: tl.constexpr,
        DK_POW2: tl.constexpr,
        BLOCK_V: tl.constexpr,
        GATED: tl.constexpr,
        L2NORM: tl.constexpr,
        EPS: tl.constexpr,
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
        if L2NORM:
            q = q * tl.rsqrt(tl.sum(q * q, axis=0) + EPS)
            k = k * tl.rsqrt(tl.sum(k * k, axis=0) + EPS)
        q = q * scale
        v = tl.load(v_ptr + token * stride_vt + head * stride_vh + vd, mask=vd_ok, other=0.0).to(tl.float32)
        beta = tl.load(beta_ptr + token * stride_bt + head * stride_bh).to(tl.float32)

        # State rows to read: all dk, or none for a new sequence (input_pos 0), whatever its slot
        # holds -- a masked load, never a multiply by zero: a reused slot may hold inf/NaN.
        held_rows = tl.where(tl.load(pos_ptr + first_row + row) > 0, dk, 0)
        cells = state_ptr + slot * stride_ss + head * stride_sh + kd[:, None] * stride_sk + vd[None, :]
        s = tl.load(cells, mask=(kd[:, None] < held_rows) & vd_ok[None, :], other=0.0).to(tl.float32)
        if GATED:
            s = s * tl.exp(tl.load(g_ptr + token * stride_gt + head * stride_gh).to(tl.float32))
        correction = beta * (v - tl.sum(s * k[:, None], axis=0))  # [BLOCK_V]
        s = s + k[:, None] * correction[None, :]
        out = tl.sum(s * q[:, None], axis=0)
        tl.store(out_ptr + token * stride_ot + head * stride_oh + vd, out.to(out_ptr.dtype.element_ty), mask=vd_ok)
        tl.store(cells, s.to(state_ptr.dtype.element_ty), mask=kd_ok[:, None] & vd_ok[None, :])

    return delta_rule_decode_kernel


def decode_rows_triton(
    q,
    k,
    v,
    g,
    beta,
    input_pos,
    slot_idx,
    state,
    out,
    first_row: int,
    first_token: int,
    scale: Optional[float],
    use_qk_l2norm: bool,
) -> None:
    """Launch the kernel on rows ``first_row..`` of the metadata (tokens ``first_token..`` of the
    ``[1, T, ...]`` inputs); writes ``out [1, T, h, dv]`` and the state rows in place."""
    import triton

    rows = slot_idx.numel() - first_row
    if rows <= 0:
        return
    if state.stride(-1) != 1:
        raise ValueError("the delta-rule state must be contiguous in its last (dv) dim: the kernel updates it in place")
    hk, dk = q.shape[2], q.shape[3]
    h, dv = v.shape[2], v.shape[3]
    q, k, v = (last_dim_contiguous(x[0]) for x in (q, k, v))  # [T, heads, d]
    gs, bs = (None if x is None else x[0] for x in (g, beta))  # [T, h]
    assert bs is not None  # beta is required (g is optional)
    o = out[0]
    block_v = min(64, triton.next_power_of_2(dv))
    grid = (rows, h, triton.cdiv(dv, block_v))
    kernel()[grid](
        q,
        k,
        v,
        gs if gs is not None else bs,
        bs,
        state,
        o,
        slot_idx,
        input_pos,
        first_row,
        first_token,
        dk**-0.5 if scale is None else scale,
        dk,
        dv,
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        *(gs.stride() if gs is not None else (0, 0)),
        bs.stride(0),
        bs.stride(1),
        state.stride(0),
        state.stride(1),
        state.stride(2),
        o.stride(0),
        o.stride(1),
        REP=h // hk,
        DK_POW2=triton.next_power_of_2(dk),
        BLOCK_V=block_v,
        GATED=gs is not None,
        L2NORM=use_qk_l2norm,
        EPS=L2NORM_EPS,
        num_warps=1 if q.device.type != "cuda" else 4,
    )


def triton_cached_delta_rule_impl(
    q, k, v, g, beta, seq_lens, input_pos, slot_idx, num_prefill, state, scale=None, use_qk_l2norm=False, chunk_size=64
):
    """The cached (gated when ``g`` is given) delta rule, decode rows in Triton; see the module docstring."""
    gated = g is not None
    require_triton(
        q.device,
        "triton_cached_gated_delta_rule" if gated else "triton_cached_delta_rule",
        "insert_cached_gated_delta_rule.backend=torch" if gated else "insert_cached_delta_rule.backend=torch",
    )
    out = delta_rule_output_like(q, v)
    if num_prefill == 0:  # decode only: T rows of one token, no host read of the metadata
        check_delta_rule_args(q, k, v, g, beta, chunk_size)
        check_delta_rule_step(q, v, state)
        check_decode_only_metadata(q.shape[1], slot_idx, input_pos)
        first_token = 0
    else:
        lens = check_cached_delta_rule_args(
            q, k, v, g, beta, seq_lens, input_pos, slot_idx, num_prefill, state, chunk_size
        )
        first_token = prefill_rows(
            q,
            k,
            v,
            g,
            beta,
            lens,
            input_pos,
            slot_idx.long(),
            num_prefill,
            state,
            out,
            scale,
            use_qk_l2norm,
            chunk_size,
        )
    decode_rows_triton(
        q, k, v, g, beta, input_pos, slot_idx, state, out, num_prefill, first_token, scale, use_qk_l2norm
    )
    return out


triton_cached_gated_delta_rule = define_op(
    "triton_cached_gated_delta_rule" + CACHED_GATED_ARGS,
    triton_cached_delta_rule_impl,
    cached_gated_fake,
    host_sync=TRITON_STATE_HOST_SYNC,
)
triton_cached_delta_rule = define_op(
    "triton_cached_delta_rule" + CACHED_PLAIN_ARGS,
    without_gate(triton_cached_delta_rule_impl),
    cached_plain_fake,
    host_sync=TRITON_STATE_HOST_SYNC,
)

__all__ = ["triton_cached_gated_delta_rule", "triton_cached_delta_rule", "decode_rows_triton", "kernel", "is_available"]
