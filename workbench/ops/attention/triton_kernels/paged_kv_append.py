"""Append the step's new K/V rows to the paged caches in one kernel launch.

The cached-attention ops of the GPU backends (Triton, FlashInfer) write K and V before attending.
Written with tensor ops, that write costs ~15 launches per layer (token -> sequence search,
positions, page lookups, two index_put); in a decode step of a small model those launches, not the
bytes, are the time. Here one program per new token finds its sequence from ``seq_lens`` itself
(a cumulative sum over the batch, which fits one block), so nothing is prepared beforehand and
the launch needs no host read: a CUDA graph captures it.

Shapes: k ``[T, Hkv, D]``, v ``[T, Hkv, Dv]``; k_cache ``[num_pages, page_size, Hkv, D]``, v_cache
``[num_pages, page_size, Hkv, Dv]``; seq_lens, input_pos ``[B]`` int32 (sequence b's tokens are the
``seq_lens[b]`` rows after those of sequences ``0..b-1``, at positions ``input_pos[b]...``);
page_table ``[B, P]`` int32. The caches may be views: ``triton_cached_mla`` writes its latent
cache ``[num_pages, page_size, r + dr]`` as a one-head K cache (its first r columns, the latent)
and V cache (the last dr, the rope key) of the same page pool.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .paged_common import token_rows


@triton.jit
def copy_into_slot(
    src_ptr,
    src_strides,
    dst_ptr,
    dst_strides,
    t,
    page,
    slot,
    NUM_HEADS: tl.constexpr,
    H_PAD: tl.constexpr,
    DIM: tl.constexpr,
    D_PAD: tl.constexpr,
):
    """Row t ``[NUM_HEADS, DIM]`` of ``src`` ``[T, NUM_HEADS, DIM]`` into slot ``slot`` of page
    ``page`` of ``dst`` ``[num_pages, page_size, NUM_HEADS, DIM]``, in dst's dtype; ``*_strides``:
    the tensors' strides."""
    offs_h = tl.arange(0, H_PAD)[:, None]
    offs_d = tl.arange(0, D_PAD)
    mask = (offs_h < NUM_HEADS) & (offs_d[None, :] < DIM)
    row = tl.load(src_ptr + token_rows(t, offs_h, offs_d, src_strides), mask=mask)
    dst = dst_ptr + page * dst_strides[0] + slot * dst_strides[1]
    tl.store(
        dst + offs_h * dst_strides[2] + offs_d[None, :] * dst_strides[3], row.to(dst_ptr.dtype.element_ty), mask=mask
    )


@triton.jit
def paged_kv_append_kernel(
    k_ptr,
    v_ptr,
    k_cache_ptr,
    v_cache_ptr,
    seq_lens_ptr,
    input_pos_ptr,
    page_table_ptr,
    num_seqs,
    strides,
    NUM_KV_HEADS: tl.constexpr,
    H_PAD: tl.constexpr,
    K_DIM: tl.constexpr,
    K_PAD: tl.constexpr,
    V_DIM: tl.constexpr,
    V_PAD: tl.constexpr,
    B_PAD: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
):
    """Program t: row t of k/v -> (page, slot) of its sequence's next position. ``strides``: those
    of (k, v, k_cache, v_cache) and the page table's row stride."""
    k_strides, v_strides, kc_strides, vc_strides, stride_pt = strides
    t = tl.program_id(0)
    offs_b = tl.arange(0, B_PAD)
    lens = tl.load(seq_lens_ptr + offs_b, mask=offs_b < num_seqs, other=0)
    ends = tl.cumsum(lens, axis=0)  # one past each sequence's last row
    done = ends <= t  # sequences wholly before row t
    b = tl.sum(done.to(tl.int32), axis=0)
    start = tl.max(tl.where(done, ends, 0), axis=0)
    pos = tl.load(input_pos_ptr + b) + t - start
    page = tl.load(page_table_ptr + b * stride_pt + pos // PAGE_SIZE).to(tl.int64)
    slot = (pos % PAGE_SIZE).to(tl.int64)
    row = t.to(tl.int64)  # row * stride may pass 2**31 elements
    copy_into_slot(k_ptr, k_strides, k_cache_ptr, kc_strides, row, page, slot, NUM_KV_HEADS, H_PAD, K_DIM, K_PAD)
    copy_into_slot(v_ptr, v_strides, v_cache_ptr, vc_strides, row, page, slot, NUM_KV_HEADS, H_PAD, V_DIM, V_PAD)


def append_paged_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    seq_lens: torch.Tensor,
    input_pos: torch.Tensor,
    page_table: torch.Tensor,
) -> None:
    """Write k ``[T, Hkv, D]`` and v ``[T, Hkv, Dv]`` into the paged caches (shapes in the module
    docstring): one launch of T programs. ``page_table`` must have unit stride along its pages."""
    t, hkv, d = k.shape
    dv = v.shape[2]
    if t == 0:
        return
    if page_table.stride(1) != 1:
        raise ValueError("append_paged_kv needs a page table with unit stride along its pages")
    paged_kv_append_kernel[(t,)](
        k,
        v,
        k_cache,
        v_cache,
        seq_lens,
        input_pos,
        page_table,
        seq_lens.shape[0],
        (k.stride(), v.stride(), k_cache.stride(), v_cache.stride(), page_table.stride(0)),
        NUM_KV_HEADS=hkv,
        H_PAD=triton.next_power_of_2(hkv),
        K_DIM=d,
        K_PAD=triton.next_power_of_2(d),
        V_DIM=dv,
        V_PAD=triton.next_power_of_2(dv),
        B_PAD=max(2, triton.next_power_of_2(seq_lens.shape[0])),
        PAGE_SIZE=k_cache.shape[1],
    )


__all__ = ["append_paged_kv", "paged_kv_append_kernel"]
