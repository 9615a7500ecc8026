"""Append the step's new K/V rows to the paged caches in one kernel launch.

The cached-attention ops of the GPU backends (Triton, FlashInfer) write K and V before attending.
Written with tensor ops, that write costs ~15 launches per layer (token -> sequence search,
positions, page lookups, two index_put); in a decode step of a small model those launches, not the
bytes, are the time. Here one program per new token finds its sequence from ``seq_lens`` itself
(a cumulative sum over the batch, which fits one block), so nothing is prepared beforehand and
the launch needs no host read: a CUDA graph captures it.

Shapes: k, v ``[T, Hkv, D]``; k_cache, v_cache ``[num_pages, page_size, Hkv, D]``; seq_lens,
input_pos ``[B]`` int32 (sequence b's tokens are the ``seq_lens[b]`` rows after those of
sequences ``0..b-1``, at positions ``input_pos[b]...``); page_table ``[B, P]`` int32.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


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
    HEAD_DIM: tl.constexpr,
    H_PAD: tl.constexpr,
    D_PAD: tl.constexpr,
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

    offs_h = tl.arange(0, H_PAD)
    offs_d = tl.arange(0, D_PAD)
    mask = (offs_h[:, None] < NUM_KV_HEADS) & (offs_d[None, :] < HEAD_DIM)
    k = tl.load(k_ptr + t * k_strides[0] + offs_h[:, None] * k_strides[1] + offs_d[None, :] * k_strides[2], mask=mask)
    k_dst = k_cache_ptr + page * kc_strides[0] + slot * kc_strides[1]
    tl.store(
        k_dst + offs_h[:, None] * kc_strides[2] + offs_d[None, :] * kc_strides[3],
        k.to(k_cache_ptr.dtype.element_ty),
        mask=mask,
    )
    v = tl.load(v_ptr + t * v_strides[0] + offs_h[:, None] * v_strides[1] + offs_d[None, :] * v_strides[2], mask=mask)
    v_dst = v_cache_ptr + page * vc_strides[0] + slot * vc_strides[1]
    tl.store(
        v_dst + offs_h[:, None] * vc_strides[2] + offs_d[None, :] * vc_strides[3],
        v.to(v_cache_ptr.dtype.element_ty),
        mask=mask,
    )


def append_paged_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    seq_lens: torch.Tensor,
    input_pos: torch.Tensor,
    page_table: torch.Tensor,
) -> None:
    """Write k/v ``[T, Hkv, D]`` into the paged caches (shapes in the module docstring): one launch
    of T programs. ``page_table`` must have unit stride along its pages."""
    t, hkv, d = k.shape
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
        HEAD_DIM=d,
        H_PAD=triton.next_power_of_2(hkv),
        D_PAD=triton.next_power_of_2(d),
        B_PAD=max(2, triton.next_power_of_2(seq_lens.shape[0])),
        PAGE_SIZE=k_cache.shape[1],
    )


__all__ = ["append_paged_kv", "paged_kv_append_kernel"]
