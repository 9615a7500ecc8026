"""Jitted helpers shared by the paged-attention kernels.

Cache layout: ``cache[page, slot, kv_head, d]`` ([num_pages, page_size, Hkv, D]); sequence ``b``
keeps its logical position ``pos`` at ``page_table[b, pos // PAGE_SIZE]``, slot ``pos % PAGE_SIZE``.
"""

import triton
import triton.language as tl

# Softmax runs in base 2 (exp2 is the native instruction): logits are multiplied by log2(e) once.
LOG2E = tl.constexpr(1.4426950408889634)


@triton.jit
def paged_row_offsets(page_table_row_ptr, pos, mask, stride_page, stride_slot, PAGE_SIZE: tl.constexpr):
    """Element offset of each logical position's row in the cache; pos, mask: [BLOCK_N] -> int64.

    Gathers per position rather than per page, so a KV block may span several pages and block
    sizes need not divide the page size. Page ids go to int64 first: ``page * stride_page``
    overflows int32 once a cache holds more than 2**31 elements.
    """
    page = tl.load(page_table_row_ptr + pos // PAGE_SIZE, mask=mask, other=0)
    return page.to(tl.int64) * stride_page + (pos % PAGE_SIZE).to(tl.int64) * stride_slot


@triton.jit
def token_rows(tokens, heads, offs_d, strides):
    """Element offsets [M, D_PAD] of the (token, head) rows of a [T, H, D] tensor: ``tokens`` and
    ``heads`` broadcast to [M, 1] (one of them an [M, 1] column, the other a scalar), ``offs_d``
    [D_PAD] runs along D, ``strides`` is the tensor's (T, H, D) strides. A stride tuple is indexed,
    never unpacked in the kernel: triton < 3.7 cannot hash a kernel whose source unpacks nested
    tuples."""
    return tokens * strides[0] + heads * strides[1] + offs_d[None, :] * strides[2]


@triton.jit
def load_queries(q_ptr, tokens, heads, offs_d, mask, q_strides, FP32_DOT: tl.constexpr):
    """The query rows (``token_rows``) [M, D_PAD], 0 where masked; fp32 under FP32_DOT (k/v follow
    q's dtype in ``attend_block``)."""
    q = tl.load(q_ptr + token_rows(tokens, heads, offs_d, q_strides), mask=mask, other=0.0)
    if FP32_DOT:
        q = q.to(tl.float32)
    return q


@triton.jit
def store_rows(out_ptr, tokens, heads, offs_d, rows, mask, out_strides):
    """``rows`` [M, D_PAD] into the output rows (``token_rows``), in the output's dtype."""
    tl.store(out_ptr + token_rows(tokens, heads, offs_d, out_strides), rows.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def load_kv_block(
    k_cache_ptr,
    v_cache_ptr,
    page_table_row_ptr,
    start,
    end,
    kv_head,
    offs_d,
    d_ok,
    kc_strides,
    vc_strides,
    PAGE_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """The block of keys at logical positions start .. start + BLOCK_N - 1 (those below ``end``):
    (positions [BLOCK_N], their mask, K and V rows [BLOCK_N, D_PAD] of ``kv_head`` in the caches'
    dtype, 0 where masked); ``*_strides``: the caches' (page, slot, head, d) strides."""
    pos = start + tl.arange(0, BLOCK_N)
    mask = pos < end
    kv_mask = mask[:, None] & d_ok[None, :]
    rows = paged_row_offsets(page_table_row_ptr, pos, mask, kc_strides[0], kc_strides[1], PAGE_SIZE)
    k = tl.load(
        k_cache_ptr + rows[:, None] + kv_head * kc_strides[2] + offs_d[None, :] * kc_strides[3], mask=kv_mask, other=0.0
    )
    rows = paged_row_offsets(page_table_row_ptr, pos, mask, vc_strides[0], vc_strides[1], PAGE_SIZE)
    v = tl.load(
        v_cache_ptr + rows[:, None] + kv_head * vc_strides[2] + offs_d[None, :] * vc_strides[3], mask=kv_mask, other=0.0
    )
    return pos, mask, k, v


@triton.jit
def soft_cap(x, cap):
    """``cap * tanh(x / cap)`` with tanh(y) = 2*sigmoid(2y) - 1.

    tl has no tanh that both the CPU interpreter and the CUDA backend of triton 3.x accept
    (libdevice is backend-specific); the sigmoid form is exact to ~1e-7 in fp32 and saturates
    cleanly at +-cap for large |x|.
    """
    return cap * (2.0 * tl.sigmoid(2.0 * x / cap) - 1.0)


@triton.jit
def alibi_block(slopes, q_pos, k_pos):
    """ALiBi logit bias [M, N] fp32: ``slopes[m] * (k_pos[n] - q_pos[m])`` (slopes [M] or a
    scalar, positions absolute cache positions)."""
    return slopes * (k_pos[None, :] - q_pos[:, None]).to(tl.float32)


@triton.jit
def attend_block(
    q,
    k,
    v,
    visible,
    m_i,
    l_i,
    acc,
    scale,
    cap,
    slopes,
    q_pos,
    k_pos,
    HAS_CAP: tl.constexpr,
    FP32_DOT: tl.constexpr,
    HAS_ALIBI: tl.constexpr,
):
    """One online-softmax step over a block of keys (the flash-attention update).

    q [M, D] (M query rows), k/v [N, D] in the caches' dtype (cast to q's here), visible [M, N]
    bool; running state m_i [M] (max logit, base 2), l_i [M] (sum of exp2), acc [M, D] fp32 ->
    updated (m_i, l_i, acc). FP32_DOT (q already fp32): full fp32 products; tl.dot would otherwise
    use TF32 on GPUs. HAS_ALIBI: the bias ``alibi_block(slopes, q_pos [M], k_pos [N])`` is added
    to the scaled, capped logits (``slopes``, ``q_pos`` are not read without it).
    """
    k = k.to(q.dtype)
    v = v.to(q.dtype)
    if FP32_DOT:
        s = tl.dot(q, tl.trans(k), input_precision="ieee")
    else:
        s = tl.dot(q, tl.trans(k))
    if HAS_CAP:
        s = soft_cap(s * scale, cap) * LOG2E
    else:
        s = s * (scale * LOG2E)
    if HAS_ALIBI:
        s = s + alibi_block(slopes, q_pos, k_pos) * LOG2E
    s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    # A row that has seen no visible key yet keeps m = -inf; subtracting 0 instead of -inf keeps
    # exp2(-inf - (-inf)) = NaN out of alpha and p (both become exactly 0).
    m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_ref)
    p = tl.exp2(s - m_ref[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    if FP32_DOT:
        pv = tl.dot(p.to(v.dtype), v, input_precision="ieee")
    else:
        pv = tl.dot(p.to(v.dtype), v)
    acc = acc * alpha[:, None] + pv
    return m_new, l_i, acc


@triton.jit
def initial_state(sinks_ptr, heads, head_ok, ROWS: tl.constexpr, HAS_SINKS: tl.constexpr):
    """Online-softmax start (m [ROWS], l [ROWS]) for the query rows' heads [ROWS].

    A sink is a key with logit ``sinks[head]`` and a zero value: starting from m = sink, l = 1
    puts it in the denominator and nowhere else.
    """
    if HAS_SINKS:
        m_i = tl.load(sinks_ptr + heads, mask=head_ok, other=0.0).to(tl.float32) * LOG2E
        l_i = tl.full([ROWS], 1.0, tl.float32)
    else:
        m_i = tl.full([ROWS], float("-inf"), tl.float32)
        l_i = tl.zeros([ROWS], tl.float32)
    return m_i, l_i
