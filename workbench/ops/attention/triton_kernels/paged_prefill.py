"""Prefill / chunked prefill: flash attention of a sequence's new tokens over its pages.

Grid (tiles, Hq). The launcher numbers the BLOCK_M-row query tiles of all prefill sequences
back to back (tile_seq, tile_start); the grid is sized from T alone (no device->host sync), so
trailing programs find tile_seq == num_prefill and exit. Keys come from the cache, which the
write kernel has already filled with this step's rows, so chunked prefill (input_pos > 0) needs
no special case.
"""

import triton
import triton.language as tl

from .paged_common import attend_block, initial_state, load_kv_block, load_queries, store_rows


@triton.jit
def paged_prefill_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    out_ptr,
    sinks_ptr,
    cu_seqlens_ptr,
    input_pos_ptr,
    page_table_ptr,
    tile_seq_ptr,
    tile_start_ptr,
    num_prefill,
    scalars,
    strides,
    slopes_ptr,
    GROUP: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    D_PAD: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    HAS_CAP: tl.constexpr,
    HAS_SINKS: tl.constexpr,
    FP32_DOT: tl.constexpr,
    HAS_ALIBI: tl.constexpr,
    HAS_CHUNK: tl.constexpr,
):
    """out[0, rows of the tile, head] for q [T, Hq, D] and caches [pages, PAGE_SIZE, Hkv, D].

    Row r of sequence b sits at logical position input_pos[b] + r and sees cached positions
    max(0, pos - window + 1) .. pos (with a chunk: only those with k // chunk == pos // chunk).
    """
    scale, window, cap, chunk = scalars
    q_strides, o_strides, kc_strides, vc_strides, stride_pt = strides
    tile = tl.program_id(0)
    head = tl.program_id(1)
    b = tl.load(tile_seq_ptr + tile)
    if b >= num_prefill:
        return
    kv_head = head // GROUP
    seq_start = tl.load(cu_seqlens_ptr + b)
    seq_len = tl.load(cu_seqlens_ptr + b + 1) - seq_start
    ctx = tl.load(input_pos_ptr + b)
    m0 = tl.load(tile_start_ptr + tile)

    offs_m = m0 + tl.arange(0, BLOCK_M)  # query rows within the sequence
    row_ok = offs_m < seq_len
    q_pos = ctx + offs_m
    offs_d = tl.arange(0, D_PAD)
    d_ok = offs_d < HEAD_DIM
    tok = (seq_start + offs_m).to(tl.int64)[:, None]
    q_ok = row_ok[:, None] & d_ok[None, :]
    q = load_queries(q_ptr, tok, head, offs_d, q_ok, q_strides, FP32_DOT)  # [BLOCK_M, D_PAD]

    hi = ctx + tl.minimum(m0 + BLOCK_M, seq_len)  # one past the tile's last query position
    if HAS_WINDOW:
        # The tile's first row has the earliest window start; align down so blocks stay
        # page-aligned when BLOCK_N divides the page size (positions before it get masked).
        lo = tl.maximum(ctx + m0 - window + 1, 0)
        lo = (lo // BLOCK_N) * BLOCK_N
    else:
        lo = 0
    if HAS_CHUNK:  # the tile's first row has the earliest chunk start (aligned down, as the window's)
        lo = tl.maximum(lo, ((ctx + m0) // chunk) * chunk)
        lo = (lo // BLOCK_N) * BLOCK_N

    m_i, l_i = initial_state(sinks_ptr, head + tl.zeros([BLOCK_M], tl.int32), row_ok, BLOCK_M, HAS_SINKS)
    acc = tl.zeros([BLOCK_M, D_PAD], tl.float32)
    if HAS_ALIBI:
        slope = tl.load(slopes_ptr + head).to(tl.float32)
    else:
        slope = 0.0  # not read
    pt_row = page_table_ptr + b * stride_pt
    for start in range(lo, hi, BLOCK_N):
        offs_n, n_ok, k, v = load_kv_block(
            k_cache_ptr,
            v_cache_ptr,
            pt_row,
            start,
            hi,
            kv_head,
            offs_d,
            d_ok,
            kc_strides,
            vc_strides,
            PAGE_SIZE,
            BLOCK_N,
        )
        visible = (offs_n[None, :] <= q_pos[:, None]) & n_ok[None, :]
        if HAS_WINDOW:
            visible = visible & (q_pos[:, None] - offs_n[None, :] < window)
        if HAS_CHUNK:
            visible = visible & (offs_n[None, :] // chunk == q_pos[:, None] // chunk)
        m_i, l_i, acc = attend_block(
            q, k, v, visible, m_i, l_i, acc, scale, cap, slope, q_pos, offs_n, HAS_CAP, FP32_DOT, HAS_ALIBI
        )

    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]  # l == 0 only on rows past the sequence
    store_rows(out_ptr, tok, head, offs_d, out, q_ok, o_strides)
