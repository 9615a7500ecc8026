"""The absorbed-decode Triton kernel of ``triton_cached_mla`` (its cache write is the attention
ops' ``append_paged_kv``, on two column views of the latent cache).

Cache layout (one page pool per layer): ``mla_cache[page, slot, :r]`` is a token's latent
(``compressed_kv``), ``mla_cache[page, slot, r:r + dr]`` its rotated rope key; sequence ``b`` keeps
logical position ``pos`` at ``page_table[b, pos // PAGE_SIZE]``, slot ``pos % PAGE_SIZE``.

``decode_kernel`` -- grid (num_decode, cdiv(n, H_BLOCK), NUM_SPLITS): decode row j (sequence
num_prefill + j, at position ``input_pos``) for a block of H_BLOCK heads and one of NUM_SPLITS
ranges of its cached rows. Every head scores the same cached rows
(MLA is multi-query in latent space), so one program reads each latent row once for its whole
head block::

    q_lat [H_BLOCK, r]   the absorbed query (q_nope through W_k, computed before the launch)
    q_pe  [H_BLOCK, dr]  the rotated rope query
    per block of BLOCK_N cached rows c [BLOCK_N, r], k_pe [BLOCK_N, dr]:
        s = scale * (q_lat c^T + q_pe k_pe^T)          [H_BLOCK, BLOCK_N], online softmax (base 2)
        acc = acc * alpha + p c                        [H_BLOCK, r] fp32
    ctx = acc / l  -> written fp32 [NUM_SPLITS, n, num_decode, r]; W_v is applied after the launch.

Split-K (flash-decoding): with few decode rows, num_decode * cdiv(n, H_BLOCK) programs leave most
of a GPU idle while each reads a long cache, so the rows are cut into NUM_SPLITS ranges; each split
also writes its base-2 log-sum-exp ``[NUM_SPLITS, n, num_decode]`` and the caller merges them
(``sum_s 2^lse_s ctx_s / sum_s 2^lse_s``; an empty split has lse -inf and weight 0).

tl.dot needs every dim >= 16 on GPUs, so heads, r and dr are padded to powers of two >= 16 (padded
heads have zero queries and are never stored). Rows past ``input_pos`` are masked loads (0), never
multiplied: a reused page may hold stale or non-finite values.
"""

from __future__ import annotations

from ..triton_support import lazy_kernel

# Softmax in base 2 (exp2 is the native instruction): logits are multiplied by log2(e) once.
LOG2E = 1.4426950408889634


@lazy_kernel
def decode_kernel():
    """The jitted absorbed-decode kernel (see the module docstring), built on first use."""
    import triton
    import triton.language as tl

    @triton.jit
    def mla_decode_kernel(
        q_lat_ptr,
        q_pe_ptr,
        cache_ptr,
        ctx_ptr,
        part_lse_ptr,
        input_pos_ptr,
        page_table_ptr,
        num_prefill,
        first_token,
        num_heads,
        scale_log2,
        stride_qlh,
        stride_qlt,
        stride_qpt,
        stride_qph,
        stride_cp,
        stride_cs,
        stride_pt,
        stride_split,
        stride_ch,
        stride_ct,
        R: tl.constexpr,
        DR: tl.constexpr,
        R_PAD: tl.constexpr,
        DR_PAD: tl.constexpr,
        H_BLOCK: tl.constexpr,
        BLOCK_N: tl.constexpr,
        PAGE_SIZE: tl.constexpr,
        FP32_DOT: tl.constexpr,
        NUM_SPLITS: tl.constexpr,
    ):
        j = tl.program_id(0)
        heads = tl.program_id(1) * H_BLOCK + tl.arange(0, H_BLOCK)
        split = tl.program_id(2)
        h_ok = heads < num_heads
        b = num_prefill + j
        kv_len = tl.load(input_pos_ptr + b) + 1  # positions 0 .. input_pos (its own row included)
        # whole blocks per split, so only a split's last block is partial; late splits may be empty
        per_split = tl.cdiv(tl.cdiv(kv_len, BLOCK_N), NUM_SPLITS) * BLOCK_N
        kv_start = split * per_split
        kv_end = tl.minimum(kv_start + per_split, kv_len)
        offs_r = tl.arange(0, R_PAD)
        r_ok = offs_r < R
        offs_e = tl.arange(0, DR_PAD)
        e_ok = offs_e < DR
        token = (first_token + j).to(tl.int64)
        q_lat = tl.load(
            q_lat_ptr + heads[:, None] * stride_qlh + j.to(tl.int64) * stride_qlt + offs_r[None, :],
            mask=h_ok[:, None] & r_ok[None, :],
            other=0.0,
        )
        q_pe = tl.load(
            q_pe_ptr + token * stride_qpt + heads[:, None] * stride_qph + offs_e[None, :],
            mask=h_ok[:, None] & e_ok[None, :],
            other=0.0,
        )
        if FP32_DOT:
            q_lat = q_lat.to(tl.float32)
            q_pe = q_pe.to(tl.float32)
        else:
            q_pe = q_pe.to(q_lat.dtype)
        m_i = tl.full([H_BLOCK], float("-inf"), tl.float32)
        l_i = tl.zeros([H_BLOCK], tl.float32)
        acc = tl.zeros([H_BLOCK, R_PAD], tl.float32)
        pt_row = page_table_ptr + b * stride_pt
        for s0 in range(kv_start, kv_end, BLOCK_N):
            pos = s0 + tl.arange(0, BLOCK_N)
            n_ok = pos < kv_end
            page = tl.load(pt_row + pos // PAGE_SIZE, mask=n_ok, other=0).to(tl.int64)
            rows = cache_ptr + page * stride_cp + (pos % PAGE_SIZE).to(tl.int64) * stride_cs  # [BLOCK_N]
            c = tl.load(rows[:, None] + offs_r[None, :], mask=n_ok[:, None] & r_ok[None, :], other=0.0)
            k_pe = tl.load(rows[:, None] + R + offs_e[None, :], mask=n_ok[:, None] & e_ok[None, :], other=0.0)
            if FP32_DOT:
                c = c.to(tl.float32)
                s = tl.dot(q_lat, tl.trans(c), input_precision="ieee")
                s += tl.dot(q_pe, tl.trans(k_pe.to(tl.float32)), input_precision="ieee")
            else:
                c = c.to(q_lat.dtype)
                s = tl.dot(q_lat, tl.trans(c))
                s += tl.dot(q_pe, tl.trans(k_pe.to(q_lat.dtype)))
            s = tl.where(n_ok[None, :], s * scale_log2, float("-inf"))
            # a split that runs at all sees a key in its first block, so m_new is finite from then on
            m_new = tl.maximum(m_i, tl.max(s, 1))
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            if FP32_DOT:
                pc = tl.dot(p, c, input_precision="ieee")
            else:
                pc = tl.dot(p.to(c.dtype), c)
            acc = acc * alpha[:, None] + pc
            m_i = m_new
        l_safe = tl.where(l_i == 0.0, 1.0, l_i)  # an empty split (never split 0)
        row = (
            split.to(tl.int64) * stride_split + heads.to(tl.int64) * stride_ch + j.to(tl.int64) * stride_ct
        )  # [H_BLOCK]
        tl.store(ctx_ptr + row[:, None] + offs_r[None, :], acc / l_safe[:, None], mask=h_ok[:, None] & r_ok[None, :])
        if NUM_SPLITS > 1:  # base-2 log-sum-exp of the split's scores, for the merge
            lse = tl.where(l_i == 0.0, float("-inf"), m_i + tl.log2(l_safe))
            tl.store(part_lse_ptr + (split * num_heads + heads) * tl.num_programs(0) + j, lse, mask=h_ok)

    return mla_decode_kernel


__all__ = ["decode_kernel", "LOG2E"]
