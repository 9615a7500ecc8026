"""``workbench::triton_cached_attention``: attention over a paged KV cache, in Triton.

One step of a mixed batch: B sequences, the first ``num_prefill`` prefill (or chunked prefill)
sequences, then decode sequences of one token each. Their new tokens are flattened back to back::

    q [1, T, Hq, D], k/v [1, T, Hkv, D]        T = sum(seq_lens); sequence i owns tokens
                                               cu[i]:cu[i+1], cu = [0, cumsum(seq_lens)]
    k_cache/v_cache [num_pages, page_size, Hkv, D]   (mutated: the new rows are written)
    page_table [B, max_pages_per_seq] int32    page of logical position p: page_table[i, p // page_size]
    seq_lens [B] int32 (new tokens), input_pos [B] int32 (tokens already cached)
    -> out [1, T, Hq, D] in q's dtype

Query row j of sequence i sits at position p = input_pos[i] + j and attends to cached positions
0..p (the last ``sliding_window`` of them if set; with ``chunk_size`` c those of p's own chunk,
c * (p // c) .. p), logits ``scale * q.k``, optionally soft-capped
``logit_cap * tanh(x / logit_cap)``, with an optional per-head sink logit ``sinks`` [Hq] in the
softmax denominator and an optional ALiBi bias ``alibi_slopes[h] * (k_pos - q_pos)`` ([Hq] slopes,
absolute cache positions). Softmax runs online in fp32.

Three launches (kernels in ``triton_kernels/``): the cache write, the prefill kernel over the
prefill tiles, the decode kernel (+ the split-K merge when it splits). All metadata the launches
need is derived on the device from the inputs' shapes and small tensor ops: no ``.item()``, so the
op runs under CUDA graphs. The op is always registered; ``is_available`` says whether it can run.
"""

from __future__ import annotations

import functools
from typing import Any, Optional

import torch

from ..triton_support import triton_available as is_available  # noqa: F401  (public per-op name)
from .cached_attention_schema import CachedAttentionArgs, define_cached_attention


@functools.lru_cache(maxsize=None)
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _block_sizes(device: torch.device, d_pad: int) -> dict:
    """Tile sizes: GPU values keep q/k/v tiles (fp16, D <= 128) within shared memory at 2 stages;
    the interpreter gets small tiles so tiny test sequences still cross tile and block edges."""
    if device.type != "cuda":
        return dict(prefill_m=16, prefill_n=16, decode_n=16, num_warps=1)
    return dict(prefill_m=64, prefill_n=64 if d_pad <= 128 else 32, decode_n=64, num_warps=4)


def _decode_splits(device: torch.device, num_decode: int, num_kv_heads: int, max_keys: int, block_n: int) -> int:
    """Split-K factor from static shapes only (so CUDA-graph replays keep one grid): enough
    programs for ~2 waves of SMs, each split keeping >= 2 blocks of keys."""
    if device.type != "cuda" or num_decode == 0:
        return 1
    programs = num_decode * num_kv_heads
    index = device.index if device.index is not None else torch.cuda.current_device()
    want = -(-2 * _sm_count(index) // programs)
    most = max(1, -(-max_keys // block_n) // 2)
    return max(1, min(want, most, 64))


def _check(call: CachedAttentionArgs) -> None:
    """Shape/dtype/option checks that need no device->host sync, before anything is written."""
    q, k, v, k_cache, v_cache, seq_lens, input_pos, page_table = call[:8]
    num_prefill, sliding_window, sinks, alibi = call.num_prefill, call.sliding_window, call.sinks, call.alibi_slopes
    if q.dim() != 4 or q.shape[0] != 1:
        raise ValueError(f"triton_cached_attention: q must be [1, T, Hq, D], got {tuple(q.shape)}")
    _, t, hq, d = q.shape
    hkv = k.shape[2]
    if k.shape != (1, t, hkv, d) or v.shape != k.shape:
        raise ValueError(
            f"triton_cached_attention: k/v must be [1, {t}, Hkv, {d}], got {tuple(k.shape)} / {tuple(v.shape)}"
        )
    if hq % hkv:
        raise ValueError(f"triton_cached_attention: {hq} query heads is not a multiple of {hkv} KV heads")
    if k_cache.dim() != 4 or k_cache.shape[2:] != (hkv, d) or v_cache.shape != k_cache.shape:
        raise ValueError(
            f"triton_cached_attention: caches must be [pages, page_size, {hkv}, {d}], "
            f"got {tuple(k_cache.shape)} / {tuple(v_cache.shape)}"
        )
    b = seq_lens.shape[0]
    for name, x in (("seq_lens", seq_lens), ("input_pos", input_pos), ("page_table", page_table)):
        if x.dtype != torch.int32:
            raise ValueError(f"triton_cached_attention: {name} must be int32, got {x.dtype}")
    if input_pos.shape != (b,) or page_table.dim() != 2 or page_table.shape[0] != b:
        raise ValueError("triton_cached_attention: seq_lens/input_pos must be [B], page_table [B, P]")
    if not 0 <= num_prefill <= b or t < b - num_prefill:
        raise ValueError(f"triton_cached_attention: num_prefill={num_prefill} with B={b}, T={t}")
    if sliding_window is not None and sliding_window < 1:
        raise ValueError(f"triton_cached_attention: sliding_window must be >= 1, got {sliding_window}")
    if call.chunk_size is not None and call.chunk_size < 1:
        raise ValueError(f"triton_cached_attention: chunk_size must be >= 1, got {call.chunk_size}")
    if sinks is not None and sinks.shape != (hq,):
        raise ValueError(f"triton_cached_attention: sinks must be [{hq}], got {tuple(sinks.shape)}")
    if alibi is not None and alibi.shape != (hq,):
        raise ValueError(f"triton_cached_attention: alibi_slopes must be [{hq}], got {tuple(alibi.shape)}")


def cached_attention_forward(*args: Any, num_splits: Optional[int] = None, **kwargs: Any) -> torch.Tensor:
    """Launch write + prefill + decode; ``args``/``kwargs``: the cached-attention arguments
    (``CachedAttentionArgs``), shapes as in the module docstring.

    ``num_splits`` forces the decode split-K factor (tests use it; None picks one per device).
    """
    import triton

    from .triton_kernels.paged_decode import paged_decode_kernel, paged_decode_reduce_kernel
    from .triton_kernels.paged_kv_append import append_paged_kv
    from .triton_kernels.paged_prefill import paged_prefill_kernel

    call = CachedAttentionArgs(*args, **kwargs)
    _check(call)
    q, k, v, k_cache, v_cache, seq_lens, input_pos, page_table, num_prefill, scale = call[:10]
    sliding_window, logit_cap, sinks, alibi_slopes, chunk_size = call[10:]
    dev = q.device
    _, t, hq, d = q.shape
    hkv = k.shape[2]
    page_size = k_cache.shape[1]
    b = seq_lens.shape[0]
    num_decode = b - num_prefill
    d_pad = max(16, triton.next_power_of_2(d))  # tl.dot needs K >= 16
    cfg = _block_sizes(dev, d_pad)
    q3, k3, v3 = q[0], k[0], v[0]  # [T, H, D] views
    page_table = page_table.contiguous()
    out = torch.empty_like(q)
    o3 = out[0]
    if t == 0:
        return out

    # the new K/V rows into their pages first: every query tile of a sequence reads all of them
    append_paged_kv(k3, v3, k_cache, v_cache, seq_lens, input_pos, page_table)
    # cu[i] = first token of sequence i (the attention kernels' token ranges)
    cu = torch.zeros(b + 1, dtype=torch.int32, device=dev)
    cu[1:] = torch.cumsum(seq_lens, 0)

    # scale, window, cap, chunk
    scalars = (float(scale), int(sliding_window or 0), float(logit_cap or 0.0), int(chunk_size or 0))
    flags = dict(
        GROUP=hq // hkv,
        PAGE_SIZE=page_size,
        HEAD_DIM=d,
        D_PAD=d_pad,
        HAS_WINDOW=sliding_window is not None,
        HAS_CAP=logit_cap is not None,
        HAS_SINKS=sinks is not None,
        HAS_ALIBI=alibi_slopes is not None,
        HAS_CHUNK=chunk_size is not None,
        # The interpreter keeps bf16 as raw uint16 bits and its tl.dot multiplies those bits
        # (triton-lang/triton#11584: bf16 is unsupported there), so it gets fp32 products.
        FP32_DOT=q.dtype == torch.float32 or (q.dtype == torch.bfloat16 and dev.type != "cuda"),
    )
    strides = (q3.stride(), o3.stride(), k_cache.stride(), v_cache.stride(), page_table.stride(0))
    sinks_arg = sinks if sinks is not None else q  # never read when HAS_SINKS is False
    slopes_arg = alibi_slopes.contiguous() if alibi_slopes is not None else q  # read only when HAS_ALIBI

    if num_prefill:
        bm = cfg["prefill_m"]
        # Tiles numbered back to back over the prefill sequences; max_tiles bounds the true count
        # (each sequence wastes at most one partial tile) without reading seq_lens on the host.
        n_tiles = (seq_lens[:num_prefill] + bm - 1) // bm
        tile_end = torch.cumsum(n_tiles, 0).to(torch.int32)
        max_tiles = triton.cdiv(t - num_decode, bm) + num_prefill
        ids = torch.arange(max_tiles, dtype=torch.int32, device=dev)
        tile_seq = torch.searchsorted(tile_end, ids, right=True).to(torch.int32)
        first = (tile_end - n_tiles)[tile_seq.clamp(max=num_prefill - 1)]
        tile_start = ((ids - first) * bm).to(torch.int32)
        paged_prefill_kernel[(max_tiles, hq)](
            q3,
            k_cache,
            v_cache,
            o3,
            sinks_arg,
            cu,
            input_pos,
            page_table,
            tile_seq,
            tile_start,
            num_prefill,
            scalars,
            strides,
            slopes_arg,
            **flags,
            BLOCK_M=bm,
            BLOCK_N=cfg["prefill_n"],
            num_warps=cfg["num_warps"],
        )

    if num_decode:
        bn = cfg["decode_n"]
        max_keys = page_table.shape[1] * page_size
        if sliding_window is not None:
            max_keys = min(max_keys, sliding_window)
        if chunk_size is not None:
            max_keys = min(max_keys, chunk_size)
        splits = num_splits or _decode_splits(dev, num_decode, hkv, max_keys, bn)
        if splits > 1:
            part_o = torch.empty(num_decode, hq, splits, d_pad, dtype=torch.float32, device=dev)
            part_lse = torch.empty(num_decode, hq, splits, dtype=torch.float32, device=dev)
        else:
            part_o = part_lse = o3  # never touched with one split
        paged_decode_kernel[(num_decode, hkv, splits)](
            q3,
            k_cache,
            v_cache,
            o3,
            part_o,
            part_lse,
            sinks_arg,
            cu,
            input_pos,
            page_table,
            num_prefill,
            scalars,
            strides,
            slopes_arg,
            **flags,
            G_PAD=max(16, triton.next_power_of_2(hq // hkv)),
            BLOCK_N=bn,
            NUM_SPLITS=splits,
            num_warps=cfg["num_warps"],
        )
        if splits > 1:
            paged_decode_reduce_kernel[(num_decode, hq)](
                part_o,
                part_lse,
                o3,
                cu,
                num_prefill,
                *o3.stride(),
                HEAD_DIM=d,
                D_PAD=d_pad,
                NUM_SPLITS=splits,
                S_PAD=triton.next_power_of_2(splits),
            )
    return out


def triton_cached_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    *metadata,
    **options,
) -> torch.Tensor:
    """Write k/v into the paged caches, then paged causal attention; see the module docstring.
    ``metadata``/``options``: the rest of the shared cached-attention arguments (``CachedAttentionArgs``)."""
    ok, why = is_available(q.device)
    if not ok:
        raise RuntimeError(
            f"workbench::triton_cached_attention cannot run on {q.device}: {why}. "
            "Use the attention backend 'torch' (torch_cached_attention) instead."
        )
    return cached_attention_forward(q, k, v, k_cache, v_cache, *metadata, **options)


define_cached_attention("triton_cached_attention", triton_cached_attention)
