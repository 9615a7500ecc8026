"""Scatter the step's new K/V rows into the paged cache.

A separate kernel (not folded into the attention kernels) because every query tile of a sequence
reads the new rows of the *whole* sequence: writing them from inside the attention programs would
need a grid-wide barrier between the write and the reads.
"""

import triton
import triton.language as tl


@triton.jit
def paged_cache_write_kernel(
    k_ptr,
    v_ptr,
    k_cache_ptr,
    v_cache_ptr,
    token_seq_ptr,
    cu_seqlens_ptr,
    input_pos_ptr,
    page_table_ptr,
    stride_kt,
    stride_kh,
    stride_kd,
    stride_vt,
    stride_vh,
    stride_vd,
    stride_kcp,
    stride_kcs,
    stride_kch,
    stride_kcd,
    stride_vcp,
    stride_vcs,
    stride_vch,
    stride_vcd,
    stride_pt,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    H_PAD: tl.constexpr,
    D_PAD: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
):
    """One program per new token t: k/v [T, Hkv, D] row t -> its (page, slot) in the caches.

    token_seq [T]: sequence of each token; cu_seqlens [B+1]; input_pos [B]; page_table [B, P].
    """
    t = tl.program_id(0)
    b = tl.load(token_seq_ptr + t)
    pos = tl.load(input_pos_ptr + b) + t - tl.load(cu_seqlens_ptr + b)
    page = tl.load(page_table_ptr + b * stride_pt + pos // PAGE_SIZE).to(tl.int64)
    slot = (pos % PAGE_SIZE).to(tl.int64)

    offs_h = tl.arange(0, H_PAD)
    offs_d = tl.arange(0, D_PAD)
    mask = (offs_h[:, None] < NUM_KV_HEADS) & (offs_d[None, :] < HEAD_DIM)

    k = tl.load(k_ptr + t * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :] * stride_kd, mask=mask)
    dst = k_cache_ptr + page * stride_kcp + slot * stride_kcs
    tl.store(
        dst + offs_h[:, None] * stride_kch + offs_d[None, :] * stride_kcd, k.to(k_cache_ptr.dtype.element_ty), mask=mask
    )

    v = tl.load(v_ptr + t * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :] * stride_vd, mask=mask)
    dst = v_cache_ptr + page * stride_vcp + slot * stride_vcs
    tl.store(
        dst + offs_h[:, None] * stride_vch + offs_d[None, :] * stride_vcd, v.to(v_cache_ptr.dtype.element_ty), mask=mask
    )
