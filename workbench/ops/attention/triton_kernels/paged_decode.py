"""Decode: one new token per sequence against its pages, the whole GQA group per program.

Grid (num_decode, Hkv, NUM_SPLITS). A program loads the K/V rows of its kv head once for all
GROUP query heads sharing them (decode is bound by reading the cache, so this divides the traffic
by GROUP compared with one program per query head). The group is padded to G_PAD >= 16 rows
because tl.dot needs M >= 16 on GPUs.

Split-K (flash-decoding): with few sequences, B * Hkv programs leave most of a GPU idle, so the
key range is cut into NUM_SPLITS chunks whose partial results (normalised output and base-2
log-sum-exp) ``paged_decode_reduce_kernel`` merges. With NUM_SPLITS == 1 the decode kernel writes
the output itself.
"""

import triton
import triton.language as tl

from .paged_common import attend_block, initial_state, load_kv_block, load_queries, store_rows


@triton.jit
def paged_decode_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    out_ptr,
    part_o_ptr,
    part_lse_ptr,
    sinks_ptr,
    cu_seqlens_ptr,
    input_pos_ptr,
    page_table_ptr,
    num_prefill,
    scalars,
    strides,
    slopes_ptr,
    GROUP: tl.constexpr,
    G_PAD: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    D_PAD: tl.constexpr,
    BLOCK_N: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    HAS_CAP: tl.constexpr,
    HAS_SINKS: tl.constexpr,
    FP32_DOT: tl.constexpr,
    HAS_ALIBI: tl.constexpr,
    HAS_CHUNK: tl.constexpr,
):
    """Decode sequence j = program_id(0) is sequence num_prefill + j; its token sits at
    logical position input_pos[b] and sees positions max(0, pos - window + 1) .. pos (with a
    chunk: from max(that, chunk * (pos // chunk))).

    part_o [num_decode, Hq, NUM_SPLITS, D_PAD] fp32, part_lse [num_decode, Hq, NUM_SPLITS] fp32
    (contiguous; unused when NUM_SPLITS == 1).
    """
    scale, window, cap, chunk = scalars
    q_strides, o_strides, kc_strides, vc_strides, stride_pt = strides
    j = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    b = num_prefill + j
    t = tl.load(cu_seqlens_ptr + b).to(tl.int64)
    pos = tl.load(input_pos_ptr + b)
    kv_end = pos + 1
    if HAS_WINDOW:
        kv_lo = tl.maximum(kv_end - window, 0)
    else:
        kv_lo = 0
    if HAS_CHUNK:  # chunked local attention: the keys of the token's own chunk only
        kv_lo = tl.maximum(kv_lo, (pos // chunk) * chunk)
    # Whole blocks per split, so only the last block of a split is partial.
    per_split = tl.cdiv(tl.cdiv(kv_end - kv_lo, BLOCK_N), NUM_SPLITS) * BLOCK_N
    start = kv_lo + split * per_split
    end = tl.minimum(start + per_split, kv_end)

    offs_g = tl.arange(0, G_PAD)
    g_ok = offs_g < GROUP
    heads = kv_head * GROUP + offs_g
    offs_d = tl.arange(0, D_PAD)
    d_ok = offs_d < HEAD_DIM
    q_ok = g_ok[:, None] & d_ok[None, :]  # the group's query (and output) rows
    q = load_queries(q_ptr, t, heads[:, None], offs_d, q_ok, q_strides, FP32_DOT)  # [G_PAD, D_PAD]

    # The sink joins the softmax once: in split 0 only (the merge carries it to the others).
    m_i, l_i = initial_state(sinks_ptr, heads, g_ok, G_PAD, HAS_SINKS)
    if NUM_SPLITS > 1:
        first = split == 0
        m_i = tl.where(first, m_i, float("-inf"))
        l_i = tl.where(first, l_i, 0.0)
    acc = tl.zeros([G_PAD, D_PAD], tl.float32)
    if HAS_ALIBI:  # one slope per query head of the group, every row at the token's position
        slopes = tl.load(slopes_ptr + heads, mask=g_ok, other=0.0).to(tl.float32)[:, None]
        q_pos = pos + tl.zeros([G_PAD], tl.int32)
    else:
        slopes, q_pos = 0.0, pos  # not read
    pt_row = page_table_ptr + b * stride_pt
    for s0 in range(start, end, BLOCK_N):
        offs_n, n_ok, k, v = load_kv_block(
            k_cache_ptr, v_cache_ptr, pt_row, s0, end, kv_head, offs_d, d_ok, kc_strides, vc_strides, PAGE_SIZE, BLOCK_N
        )
        # Causality, the window and the chunk are already in [start, end): only the block tail is masked.
        visible = g_ok[:, None] & n_ok[None, :]
        m_i, l_i, acc = attend_block(
            q, k, v, visible, m_i, l_i, acc, scale, cap, slopes, q_pos, offs_n, HAS_CAP, FP32_DOT, HAS_ALIBI
        )

    l_safe = tl.where(l_i == 0.0, 1.0, l_i)  # l == 0: padded group rows, or an empty split
    out = acc / l_safe[:, None]
    if NUM_SPLITS == 1:
        store_rows(out_ptr, t, heads[:, None], offs_d, out, q_ok, o_strides)
    else:
        lse = tl.where(l_i == 0.0, float("-inf"), m_i + tl.log2(l_safe))
        row = (j * (GROUP * tl.num_programs(1)) + heads) * NUM_SPLITS + split  # [G_PAD]
        tl.store(part_lse_ptr + row, lse, mask=g_ok)
        tl.store(part_o_ptr + row[:, None] * D_PAD + offs_d[None, :], out, mask=g_ok[:, None])


@triton.jit
def paged_decode_reduce_kernel(
    part_o_ptr,
    part_lse_ptr,
    out_ptr,
    cu_seqlens_ptr,
    num_prefill,
    stride_ot,
    stride_oh,
    stride_od,
    HEAD_DIM: tl.constexpr,
    D_PAD: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    S_PAD: tl.constexpr,
):
    """Merge the splits of decode sequence j = program_id(0), query head h = program_id(1):
    out = sum_s 2^lse_s * o_s / sum_s 2^lse_s (split 0 is never empty, so max lse is finite)."""
    j = tl.program_id(0)
    h = tl.program_id(1)
    t = tl.load(cu_seqlens_ptr + num_prefill + j).to(tl.int64)
    row = (j * tl.num_programs(1) + h) * NUM_SPLITS
    offs_s = tl.arange(0, S_PAD)
    s_ok = offs_s < NUM_SPLITS
    offs_d = tl.arange(0, D_PAD)
    lse = tl.load(part_lse_ptr + row + offs_s, mask=s_ok, other=float("-inf"))
    w = tl.exp2(lse - tl.max(lse, 0))  # empty splits: 2^-inf = 0
    o = tl.load(part_o_ptr + (row + offs_s)[:, None] * D_PAD + offs_d[None, :], mask=s_ok[:, None], other=0.0)
    out = tl.sum(o * w[:, None], 0) / tl.sum(w, 0)
    tl.store(
        out_ptr + t * stride_ot + h * stride_oh + offs_d * stride_od,
        out.to(out_ptr.dtype.element_ty),
        mask=offs_d < HEAD_DIM,
    )
