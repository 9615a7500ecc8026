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
    strides,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    H_PAD: tl.constexpr,
    D_PAD: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
):
    """One program per new token t: k/v [T, Hkv, D] row t -> its (page, slot) in the caches.

    token_seq [T]: sequence of each token; cu_seqlens [B+1]; input_pos [B]; page_table [B, P].
    """
    k_strides, v_strides, kc_strides, vc_strides, stride_pt = strides
    t = tl.program_id(0)
    b = tl.load(token_seq_ptr + t)
    pos = tl.load(input_pos_ptr + b) + t - tl.load(cu_seqlens_ptr + b)
    page = tl.load(page_table_ptr + b * stride_pt + pos // PAGE_SIZE).to(tl.int64)
    slot = (pos % PAGE_SIZE).to(tl.int64)

    offs_h = tl.arange(0, H_PAD)
    offs_d = tl.arange(0, D_PAD)
    mask = (offs_h[:, None] < NUM_KV_HEADS) & (offs_d[None, :] < HEAD_DIM)
    _copy_row(k_ptr, k_strides, k_cache_ptr, kc_strides, t, page, slot, offs_h, offs_d, mask)
    _copy_row(v_ptr, v_strides, v_cache_ptr, vc_strides, t, page, slot, offs_h, offs_d, mask)


@triton.jit
def _copy_row(src_ptr, src_strides, cache_ptr, cache_strides, t, page, slot, offs_h, offs_d, mask):
    """Row t of src [T, Hkv, D] -> cache[page, slot] [Hkv, D], in the cache's dtype."""
    x = tl.load(
        src_ptr + t * src_strides[0] + offs_h[:, None] * src_strides[1] + offs_d[None, :] * src_strides[2], mask=mask
    )
    dst = cache_ptr + page * cache_strides[0] + slot * cache_strides[1]
    tl.store(
        dst + offs_h[:, None] * cache_strides[2] + offs_d[None, :] * cache_strides[3],
        x.to(cache_ptr.dtype.element_ty),
        mask=mask,
    )
