"""``workbench::triton_cached_mla``: MLA over a paged latent cache, decode rows in Triton.

Same schema and semantics as ``torch_cached_mla`` (``torch_cached_mla.py``: shapes, metadata, the
cache layout ``[num_pages, page_size, r + dr]``). What differs is how a step runs:

* the cache write is one Triton launch for every new token (``append_paged_kv``, shared with the
  cached-attention ops: the latent cache is a one-head K/V cache of latent and rope-key columns);
* decode rows use the absorbed form on the device, in a fixed number of launches whatever the batch:
  ``q_lat = W_k^T q_nope`` (one batched matmul over heads: ``[n, Bd, dn] @ [n, dn, r]``), the
  paged attention against the cached latents + rope keys (``decode_kernel``: one program per decode
  row, block of heads and split of the keys, online softmax, context ``[n, Bd, r]`` in fp32; the
  split count comes from static sizes and the SM count, merged by log-sum-exp), then the context through
  ``W_v`` (``[n, Bd, r] @ [n, r, dv]``). The weights are read once per step for all rows;
  per-head keys and values are never materialised;
* prefill and chunked-prefill rows (many queries per key, not captured) run the torch op's own
  code (``prefill_rows``: fresh prefills bit-identical to ``torch_mla``), which reads lengths on
  the host.

A decode-only step (``num_prefill == 0``) reads nothing on the host: every size comes from tensor
shapes (B = ``seq_lens.shape[0]`` rows, one token each, decode rows are the last ``B - num_prefill``
tokens) and the checks are shape checks, so a CUDA graph captures it and the op carries no
host-sync tag (``workbench.ops.capture``). The CUDA-graph runner only captures decode-only steps.

Numerics: fp32 inputs give fp32 products throughout (``input_precision="ieee"``, no TF32), equal
to ``torch_cached_mla`` to reassociation (~1e-6 relative). Half-precision inputs absorb and
project in their own dtype (q_lat and the context are rounded to it once, as HF's bf16 model rounds
its expanded keys and values), with fp32 softmax and accumulation.

The op is always registered; ``is_available(device)`` says whether the kernels can run (CUDA, or
CPU under ``TRITON_INTERPRET=1`` for tests). Called where they cannot, it raises and names the
``torch`` backend instead of silently falling back.
"""

from __future__ import annotations

import functools
from typing import Any, List

import torch

from ..triton_support import last_dim_contiguous, require_triton
from ..triton_support import triton_available as is_available  # noqa: F401  (public per-op name)
from .torch_cached_mla import CachedMLAArgs, check_cached_mla_args, check_latent_cache, define_cached_mla, prefill_rows
from .torch_mla import mla_dims, split_kv_b
from .triton_mla_kernels import LOG2E, decode_kernel

USE_TORCH = "insert_cached_mla_attention.backend=torch"


def _check_decode_only(call: CachedMLAArgs):
    """The checks of a decode-only step, from shapes alone (no host read): one token per sequence
    and a cache of latent + rope rows. Returns ``(n, dn, dr, r, dv)``."""
    dims = mla_dims(*call[:5])  # from q_nope, q_pe, compressed_kv, kpe, kv_b_proj_weight
    _, dn, dr, r, _ = dims
    q_nope, seq_lens, input_pos, page_table = call.q_nope, call.seq_lens, call.input_pos, call.page_table
    t, b = q_nope.shape[1], seq_lens.shape[0]
    if q_nope.shape[0] != 1 or t != b or input_pos.shape != (b,) or page_table.dim() != 2 or page_table.shape[0] < b:
        raise ValueError(
            f"triton_cached_mla: a decode-only step has one token per sequence: q_nope {tuple(q_nope.shape)}, "
            f"seq_lens {tuple(seq_lens.shape)}, input_pos {tuple(input_pos.shape)}, page_table {tuple(page_table.shape)}"
        )
    check_latent_cache(call.mla_cache, r, dr)
    return dims


def _check_layout(mla_cache, seq_lens, input_pos, page_table) -> None:
    """What the kernels index with unit stride, and the metadata dtype they load."""
    for name, x in (("seq_lens", seq_lens), ("input_pos", input_pos), ("page_table", page_table)):
        if x.dtype != torch.int32:
            raise ValueError(f"triton_cached_mla: {name} must be int32, got {x.dtype}")
    if mla_cache.stride(2) != 1 or page_table.stride(1) != 1:
        raise ValueError("triton_cached_mla: mla_cache rows and page_table rows must have unit stride")


def write_latents_triton(compressed_kv, kpe, mla_cache, seq_lens, input_pos, page_table) -> None:
    """One launch of T programs: each new token's ``[compressed_kv, kpe]`` row into its page slot.
    The latent cache is written as a one-head K/V cache (``append_paged_kv``, the attention ops'
    cache write): K is its first r columns (the latent), V the last dr (the rope key)."""
    from ..attention.triton_kernels.paged_kv_append import append_paged_kv

    r = compressed_kv.shape[2]
    rows = mla_cache.unsqueeze(2)  # [num_pages, page_size, 1, r + dr]: one "head"
    latent = compressed_kv[0].unsqueeze(1)  # [T, 1, r]
    append_paged_kv(latent, kpe[0], rows[..., :r], rows[..., r:], seq_lens, input_pos, page_table)


def _launch_config(device: torch.device, dtype: torch.dtype, r_pad: int) -> dict:
    """Tiles: on GPUs a [BLOCK_N, r] latent block stays within shared memory at 2 stages (r = 512:
    32 rows of bf16, 16 of fp32; tl.dot needs >= 16). The interpreter has no such floor and gets
    4-row blocks, so tiny test sequences cross block, page and split edges."""
    if device.type != "cuda":
        return dict(BLOCK_N=4, num_warps=1)
    rows = 32 if dtype.itemsize <= 2 else 16
    return dict(BLOCK_N=rows if r_pad >= 256 else 64, num_warps=8 if r_pad >= 256 else 4, num_stages=2)


@functools.lru_cache(maxsize=None)
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def decode_splits(device: torch.device, programs: int, max_keys: int, block_n: int) -> int:
    """Split-K factor from static sizes only (a CUDA-graph replay keeps its grid): enough programs
    for ~2 waves of SMs, each split keeping >= 2 blocks of keys; 1 off CUDA."""
    if device.type != "cuda" or programs == 0:
        return 1
    index = device.index if device.index is not None else torch.cuda.current_device()
    want = -(-2 * _sm_count(index) // programs)
    return max(1, min(want, max(1, -(-max_keys // block_n) // 2), 32))


def decode_rows_triton(call: CachedMLAArgs, out: torch.Tensor) -> None:
    """The decode rows (the last ``B - num_prefill`` tokens) in the absorbed form: absorb, one
    attention launch (+ the split merge when it splits), project; writes them into ``out`` [1, T, n, dv]."""
    import triton

    q_nope, q_pe, kv_b_proj_weight, mla_cache = call.q_nope, call.q_pe, call.kv_b_proj_weight, call.mla_cache
    input_pos, page_table, num_prefill = call.input_pos, call.page_table, call.num_prefill
    b = input_pos.shape[0]
    nd = b - num_prefill
    if nd <= 0:
        return
    t, n, dn = q_nope.shape[1], q_nope.shape[2], q_nope.shape[3]
    dr, r = q_pe.shape[3], kv_b_proj_weight.shape[1]
    first = t - nd
    w_k, w_v = split_kv_b(kv_b_proj_weight, n, dn)  # [n, dn, r], [n, dv, r] views
    fp32 = q_nope.dtype == torch.float32
    # q_lat [n, Bd, r]: one batched matmul over heads, the weights read once for every row
    q_lat = torch.bmm(q_nope[0, first:].transpose(0, 1).to(w_k.dtype), w_k)
    r_pad = max(16, triton.next_power_of_2(r))
    cfg = _launch_config(q_nope.device, q_lat.dtype, r_pad)
    h_block = 16
    head_blocks = triton.cdiv(n, h_block)
    splits = decode_splits(q_nope.device, nd * head_blocks, page_table.shape[1] * mla_cache.shape[1], cfg["BLOCK_N"])
    ctx = torch.empty(splits, n, nd, r, dtype=torch.float32, device=q_nope.device)
    lse = torch.empty(splits, n, nd, dtype=torch.float32, device=q_nope.device) if splits > 1 else ctx
    q_pe3 = last_dim_contiguous(q_pe[0])
    decode_kernel()[(nd, head_blocks, splits)](
        q_lat,
        q_pe3,
        mla_cache,
        ctx,
        lse,
        input_pos,
        page_table,
        num_prefill,
        first,
        n,
        float(call.scale) * LOG2E,
        q_lat.stride(0),
        q_lat.stride(1),
        q_pe3.stride(0),
        q_pe3.stride(1),
        mla_cache.stride(0),
        mla_cache.stride(1),
        page_table.stride(0),
        ctx.stride(0),
        ctx.stride(1),
        ctx.stride(2),
        R=r,
        DR=dr,
        R_PAD=r_pad,
        DR_PAD=max(16, triton.next_power_of_2(dr)),
        H_BLOCK=h_block,
        PAGE_SIZE=mla_cache.shape[1],
        # fp32 models: full fp32 products. The interpreter keeps bf16 as raw bits and its tl.dot
        # multiplies those (triton-lang/triton#11584), so it gets fp32 products for every dtype.
        FP32_DOT=fp32 or q_nope.device.type != "cuda",
        NUM_SPLITS=splits,
        **cfg,
    )
    if splits > 1:  # merge: sum_s 2^lse_s ctx_s / sum_s 2^lse_s (split 0 is never empty)
        weight = torch.exp2(lse - lse.amax(0, keepdim=True)).unsqueeze(-1)  # [S, n, Bd, 1]
        ctx = (ctx * weight).sum(0) / weight.sum(0)
    else:
        ctx = ctx[0]
    # the context through W_v: [n, Bd, r] @ [n, r, dv] -> [n, Bd, dv]
    proj = torch.bmm(ctx if fp32 else ctx.to(w_v.dtype), w_v.transpose(1, 2))
    out[0, first:] = proj.transpose(0, 1).to(out.dtype)


def triton_cached_mla(*args: Any, **kwargs: Any) -> torch.Tensor:
    """Write the step's latents, then attend (decode rows in Triton); see the module docstring.
    ``args``/``kwargs``: the cached-MLA arguments (``CachedMLAArgs``)."""
    call = CachedMLAArgs(*args, **kwargs)
    q_nope, compressed_kv, kpe, mla_cache = call.q_nope, call.compressed_kv, call.kpe, call.mla_cache
    seq_lens, input_pos, page_table = call.seq_lens, call.input_pos, call.page_table
    require_triton(q_nope.device, "triton_cached_mla", USE_TORCH)
    _check_layout(mla_cache, seq_lens, input_pos, page_table)
    if call.num_prefill == 0:  # decode only: the CUDA-graph path, no host read
        dv = _check_decode_only(call)[4]
        lens: List[int] = []  # no prefill rows
        past: List[int] = []
    else:
        lens, past, dv = check_cached_mla_args(call)
    out = q_nope.new_empty(*q_nope.shape[:-1], dv)  # [1, T, n, dv]
    # append_paged_kv reads every stride: no contiguous copies of the new rows
    write_latents_triton(compressed_kv, kpe, mla_cache, seq_lens, input_pos, page_table)
    if call.num_prefill:
        prefill_rows(call, lens, past, out)
    decode_rows_triton(call, out)
    return out


# No host_sync: a decode-only step reads nothing on the host (the only steps a CUDA graph captures).
triton_cached_mla_op = define_cached_mla("triton_cached_mla", triton_cached_mla)

__all__ = [
    "triton_cached_mla",
    "triton_cached_mla_op",
    "decode_rows_triton",
    "decode_splits",
    "write_latents_triton",
    "is_available",
]
