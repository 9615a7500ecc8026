"""One Triton decode kernel for the fast-weight mixers: the delta rules and decayed linear attention.

Both keep a matrix state ``S [dk, dv]`` per value head and differ only in what they write into it,
so their decode rows (one per layer per generated token, the hot path) are one kernel with
constexpr switches. In eager torch a row is ~15 small kernels (gather the slots, zero fresh ones,
normalise, decay, two matvecs, rank-1 update, scatter back); here one program per (decode row,
value head, dv block) reads its ``[dk, BLOCK_V]`` slice of the state once, updates it in registers
and writes it back in place::

    q, k = l2norm(q), l2norm(k) (L2NORM); q *= scale              key head = value head // (h / hk)
    S    = (state[slot, head] if input_pos > 0 else 0) * exp(g)   (GATED)
    w    = beta * (v - S^T k)  (DELTA: the delta rule)   or   v  (linear attention)
    S   += k w^T;   out = S^T q;   state[slot, head] = S          fp32 throughout

The ops (``torch_delta_rule.py``, ``ops/linear_attention/linear_attention.py``), their prefill rows
and their checks come from the cached-state kit (``ops/recurrent.py``).
"""

from __future__ import annotations

import torch

from ..recurrent import DecodeRows, Options
from ..triton_support import last_dim_contiguous, lazy_kernel, num_warps
from .delta_rule_math import L2NORM_EPS


@lazy_kernel
def kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def fast_weight_decode_kernel(
        q_ptr,
        k_ptr,
        v_ptr,
        g_ptr,
        beta_ptr,
        state_ptr,
        out_ptr,
        slot_ptr,
        pos_ptr,
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
        DELTA: tl.constexpr,
        L2NORM: tl.constexpr,
        EPS: tl.constexpr,
    ):
        token = tl.program_id(0).to(tl.int64)  # decode row r: token r, slot_idx[r], input_pos[r]
        head = tl.program_id(1)
        kd = tl.arange(0, DK_POW2)  # [DK_POW2]
        vd = tl.program_id(2) * BLOCK_V + tl.arange(0, BLOCK_V)  # [BLOCK_V]
        kd_ok, vd_ok = kd < dk, vd < dv
        slot = tl.load(slot_ptr + token).to(tl.int64)
        key_head = head // REP

        q = tl.load(q_ptr + token * stride_qt + key_head * stride_qh + kd, mask=kd_ok, other=0.0).to(tl.float32)
        k = tl.load(k_ptr + token * stride_kt + key_head * stride_kh + kd, mask=kd_ok, other=0.0).to(tl.float32)
        if L2NORM:
            q = q * tl.rsqrt(tl.sum(q * q, axis=0) + EPS)
            k = k * tl.rsqrt(tl.sum(k * k, axis=0) + EPS)
        q = q * scale
        v = tl.load(v_ptr + token * stride_vt + head * stride_vh + vd, mask=vd_ok, other=0.0).to(tl.float32)

        # State rows to read: all dk, or none for a new sequence (input_pos 0), whatever its slot
        # holds -- a masked load, never a multiply by zero: a reused slot may hold inf/NaN.
        held_rows = tl.where(tl.load(pos_ptr + token) > 0, dk, 0)
        cells = state_ptr + slot * stride_ss + head * stride_sh + kd[:, None] * stride_sk + vd[None, :]
        s = tl.load(cells, mask=(kd[:, None] < held_rows) & vd_ok[None, :], other=0.0).to(tl.float32)
        if GATED:
            s = s * tl.exp(tl.load(g_ptr + token * stride_gt + head * stride_gh).to(tl.float32))
        if DELTA:  # the delta rule writes the error of what S predicts for k, scaled by beta
            beta = tl.load(beta_ptr + token * stride_bt + head * stride_bh).to(tl.float32)
            v = beta * (v - tl.sum(s * k[:, None], axis=0))  # [BLOCK_V]
        s = s + k[:, None] * v[None, :]
        out = tl.sum(s * q[:, None], axis=0)
        tl.store(out_ptr + token * stride_ot + head * stride_oh + vd, out.to(out_ptr.dtype.element_ty), mask=vd_ok)
        tl.store(cells, s.to(state_ptr.dtype.element_ty), mask=kd_ok[:, None] & vd_ok[None, :])

    return fast_weight_decode_kernel


def _launch(rows: DecodeRows, state: torch.Tensor, scale: float, **switches):
    """One launch over the decode rows (``q/k [n, hk, dk]``, ``v [n, h, dv]``); writes their
    ``out [n, h, dv]`` and state rows in place."""
    import triton

    if state.stride(-1) != 1:
        raise ValueError(
            "the fast-weight state must be contiguous in its last (dv) dim: the kernel updates it in place"
        )
    q, k, v = (last_dim_contiguous(rows.inputs[n]) for n in ("q", "k", "v"))  # [n, heads, d]
    hk, dk = q.shape[1], q.shape[2]
    h, dv = v.shape[1], v.shape[2]
    g, beta = (rows.inputs.get(n) for n in ("g", "beta"))  # [n, h], or None where the mixer has none
    o = rows.out
    block_v = min(64, triton.next_power_of_2(dv))
    kernel()[(rows.num_rows, h, triton.cdiv(dv, block_v))](
        q,
        k,
        v,
        g if g is not None else v,
        beta if beta is not None else v,
        state,
        o,
        rows.slot_idx,
        rows.input_pos,
        scale,
        dk,
        dv,
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        *(g.stride() if g is not None else (0, 0)),
        *(beta.stride() if beta is not None else (0, 0)),
        state.stride(0),
        state.stride(1),
        state.stride(2),
        o.stride(0),
        o.stride(1),
        REP=h // hk,
        DK_POW2=triton.next_power_of_2(dk),
        BLOCK_V=block_v,
        GATED=g is not None,
        EPS=L2NORM_EPS,
        num_warps=num_warps(q),
        **switches,
    )


def decode(rows: DecodeRows, state: torch.Tensor, options: Options) -> None:
    """The delta rules' decode rows (gated when the inputs have ``g``)."""
    scale = options["scale"]
    dk = rows.inputs["q"].shape[-1]
    _launch(rows, state, dk**-0.5 if scale is None else scale, DELTA=True, L2NORM=options["use_qk_l2norm"])


def decode_linear_attention(rows: DecodeRows, state: torch.Tensor, options: Options) -> None:
    """Decayed linear attention's decode rows: ``S = S * exp(g) + k v^T``."""
    _launch(rows, state, float(options["scale"]), DELTA=False, L2NORM=False)


__all__ = ["decode", "decode_linear_attention", "kernel"]
