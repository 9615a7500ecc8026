"""``workbench::torch_cached_attention``: attention over a paged KV cache for a mixed batch.

This is the reference every cached backend (``triton_cached_attention``,
``flashinfer_cached_attention``) is tested against, and the CPU path of the runtime; they share its
schema (``cached_attention_schema.py``). One call
serves a whole step of continuous batching: B sequences whose new tokens are laid back to back
in one flattened token dimension T (so the same graph runs prefill, decode and mixed batches)::

    q [1, T, Hq, D], k/v [1, T, Hkv, D]         sequence i owns tokens cu[i]:cu[i+1], cu = cumsum(seq_lens)
    k_cache/v_cache [num_pages, page_size, Hkv, D]   paged, shared by all sequences
    page_table [B, max_pages_per_seq] int32      page ids of sequence i, in logical order
    seq_lens [B] int32                           new tokens of each sequence this step
    input_pos [B] int32                          tokens of each sequence already in the cache
    -> out [1, T, Hq, Dv] in q's dtype

Semantics: the new k/v of sequence i are first written at logical positions
``input_pos[i] .. input_pos[i] + seq_lens[i] - 1`` (page ``page_table[i, pos // page_size]``, slot
``pos % page_size``); then the new query at logical position p attends causally to the cached
positions ``0..p`` (only the last ``sliding_window`` of them when set; with ``chunk_size`` ``c``
only those of p's own chunk, ``c * (p // c) .. p``: chunked local attention), with ``scale``, an optional
``logit_cap * tanh(x / logit_cap)``, optional per-head ``sinks`` (one extra logit per head in the
softmax denominator) and optional ALiBi ``alibi_slopes`` [Hq] (``slopes[h] * (k_pos - q_pos)`` added
to the logits, from absolute cache positions: a token's bias is the same in prefill and decode). Sequences ``0..num_prefill-1`` may have any length >= 1 (prefill, chunked
prefill); the rest are decode steps (one token each). Softmax is in fp32; GQA is native (query
head h reads KV head ``h // (Hq // Hkv)``; K/V are never repeated in memory).

A prefill that starts at position 0 without window, cap, sinks or ALiBi runs SDPA on its own k/v
(exactly what the uncached ``torch_attention`` computes, so the numerics probe reads 0.0 through
the cached graph), and so do decode rows under the same conditions (one SDPA call over the gathered
pages: few ops, which is what a CPU decode step is made of); everything else runs explicit fp32
softmax attention over the gathered pages.

The reference reads only cache slots that were written (positions ``< input_pos + seq_lens``), so
it never depends on what unwritten pages contain.
"""

from __future__ import annotations

from typing import List, Optional, Tuple

import torch
import torch.nn.functional as F

from .cached_attention_schema import define_cached_attention


def token_layout(seq_lens: torch.Tensor, input_pos: torch.Tensor, num_tokens: int):
    """Per flattened token: (sequence index [T], logical position [T]), both int64, for the step's
    ``num_tokens`` = T tokens. Computed on the device with no host read (token t belongs to the
    first sequence whose cumulative length exceeds t), so a CUDA graph can capture it."""
    lens = seq_lens.long()
    ends = torch.cumsum(lens, 0)  # [B]: one past each sequence's last flattened token
    tokens = torch.arange(num_tokens, device=lens.device)
    seq_idx = torch.searchsorted(ends, tokens, right=True)
    offset = tokens - (ends - lens)[seq_idx]
    return seq_idx, input_pos.long()[seq_idx] + offset


def write_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    seq_idx: torch.Tensor,
    pos: torch.Tensor,
    page_table: torch.Tensor,
) -> None:
    """Scatter the new tokens' k/v ([T, Hkv, D]) into their pages/slots."""
    page_size = k_cache.shape[1]
    pages = page_table.long()[seq_idx, pos // page_size]
    slots = pos % page_size
    k_cache[pages, slots] = k.to(k_cache.dtype)
    v_cache[pages, slots] = v.to(v_cache.dtype)


def gather_pages(cache: torch.Tensor, page_ids: torch.Tensor, length: int) -> torch.Tensor:
    """The first ``length`` logical slots of a sequence: [length, Hkv, D] (or [N, length, Hkv, D]
    for ``page_ids [N, n_pages]``)."""
    lead = page_ids.shape  # index_select on flat ids: much cheaper than advanced indexing on CPU
    pages = cache.index_select(0, page_ids.reshape(-1).long())  # [N * n_pages, page_size, Hkv, D]
    flat = pages.view(*lead[:-1], lead[-1] * cache.shape[1], *cache.shape[2:])
    return flat[..., :length, :, :]


def _attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    keep: torch.Tensor,
    scale: float,
    logit_cap: Optional[float],
    sinks: Optional[torch.Tensor],
    alibi: Optional[Tuple[torch.Tensor, torch.Tensor]] = None,
) -> torch.Tensor:
    """Masked GQA attention in fp32.

    q [N, s, Hq, D], k [N, L, Hkv, D], v [N, L, Hkv, Dv], keep [N, s, L] bool -> [N, s, Hq, Dv] fp32.
    ``alibi``: (slopes [Hq], k_pos - q_pos [N, s, L]) for an ALiBi bias.
    """
    n, s, hq, d = q.shape
    hkv, length, dv = k.shape[2], k.shape[1], v.shape[-1]
    rep = hq // hkv
    # Query heads of one KV head side by side: [N, Hkv, rep*s, D] @ [N, Hkv, D, L] (plain matmuls).
    qg = q.float().view(n, s, hkv, rep, d).permute(0, 2, 3, 1, 4).reshape(n, hkv, rep * s, d)
    scores = torch.matmul(qg, k.float().permute(0, 2, 3, 1)) * scale  # [N, Hkv, rep*s, L]
    scores = scores.view(n, hkv, rep, s, length)
    if logit_cap is not None:
        scores = logit_cap * torch.tanh(scores / logit_cap)
    if alibi is not None:
        slopes, rel = alibi
        scores = scores + slopes.float().view(1, hkv, rep, 1, 1) * rel.float()[:, None, None]
    scores = scores.masked_fill(~keep[:, None, None], float("-inf"))
    if sinks is not None:
        # The sink joins the normaliser only: softmax over [scores, sink], then drop the sink column.
        sink = sinks.float().view(1, hkv, rep, 1, 1).expand(n, hkv, rep, s, 1)
        probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
    else:
        probs = torch.softmax(scores, dim=-1)
    out = torch.matmul(probs.reshape(n, hkv, rep * s, length), v.float().permute(0, 2, 1, 3))  # [N, Hkv, rep*s, Dv]
    return out.view(n, hkv, rep, s, dv).permute(0, 3, 1, 2, 4).reshape(n, s, hq, dv)


def _keep(
    q_pos: torch.Tensor, k_pos: torch.Tensor, sliding_window: Optional[int], chunk_size: Optional[int] = None
) -> torch.Tensor:
    """[..., s, L] bool: key visible to query (causal, optional window ``q - k < window``, optional
    chunk ``k // chunk == q // chunk``)."""
    rel = q_pos[..., :, None] - k_pos[..., None, :]
    keep = rel >= 0
    if sliding_window is not None:
        keep &= rel < sliding_window
    if chunk_size is not None:
        keep &= (q_pos[..., :, None] // chunk_size) == (k_pos[..., None, :] // chunk_size)
    return keep


def _check(q, k, v, k_cache, v_cache, seq_lens, input_pos, page_table, num_prefill) -> Tuple[List[int], List[int]]:
    """Validate shapes and metadata; returns (seq_lens, input_pos) as host lists."""
    if q.dim() != 4 or q.shape[0] != 1 or k.shape[:2] != q.shape[:2] or v.shape[:2] != q.shape[:2]:
        raise ValueError(
            f"cached attention expects flattened tokens q [1, T, Hq, D], k/v [1, T, Hkv, D]; got "
            f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}"
        )
    if q.shape[2] % k.shape[2]:
        raise ValueError(f"{q.shape[2]} query heads is not a multiple of {k.shape[2]} KV heads")
    if k_cache.shape[2:] != k.shape[2:] or v_cache.shape[2:] != v.shape[2:]:
        raise ValueError(
            f"cache pages {tuple(k_cache.shape)} / {tuple(v_cache.shape)} do not hold k {tuple(k.shape)} / "
            f"v {tuple(v.shape)} tokens ([num_pages, page_size, Hkv, D] expected)"
        )
    return check_paged_metadata(seq_lens, input_pos, page_table, num_prefill, ("q", q.shape[1]), k_cache.shape[1])


def check_paged_metadata(
    seq_lens: torch.Tensor,
    input_pos: torch.Tensor,
    page_table: torch.Tensor,
    num_prefill: int,
    tokens: Tuple[str, int],
    page_size: int,
) -> Tuple[List[int], List[int]]:
    """The metadata checks of every paged cached op (attention, MLA): ``tokens`` is (name, T) of
    the per-token input; returns (seq_lens, input_pos) as host lists."""
    lens = seq_lens.tolist()
    if sum(lens) != tokens[1]:
        raise ValueError(f"seq_lens sum to {sum(lens)} tokens but {tokens[0]} has {tokens[1]}")
    if not 0 <= num_prefill <= len(lens) or any(n != 1 for n in lens[num_prefill:]):
        raise ValueError(f"num_prefill={num_prefill}: sequences after it must be decode steps (1 token), got {lens}")
    if input_pos.numel() != len(lens) or page_table.shape[0] < len(lens):
        raise ValueError(
            f"metadata sizes disagree: seq_lens {len(lens)}, input_pos {input_pos.numel()}, "
            f"page_table rows {page_table.shape[0]}"
        )
    past = input_pos.tolist()
    need = max((-(-(p + n) // page_size) for p, n in zip(past, lens)), default=0)
    if need > page_table.shape[1]:
        raise ValueError(f"a sequence needs {need} pages but page_table has {page_table.shape[1]} columns")
    return lens, past


def _page_grid(ids: torch.Tensor):
    """``(first page, page stride between rows)`` when every row of ``ids [B, n]`` is a run of
    consecutive pages and row i starts ``i * stride`` after row 0 (what a fresh allocator hands a
    batch of equal requests), else None. Such a page table is a strided *view* of the cache."""
    rows = ids.tolist()
    n, base = len(rows[0]), rows[0][0]
    stride = rows[1][0] - base if len(rows) > 1 else n
    if stride < n:
        return None
    for i, row in enumerate(rows):
        if row != list(range(base + i * stride, base + i * stride + n)):
            return None
    return base, stride


def _paged_view(cache: torch.Tensor, grid, b: int, n_pages: int, length: int) -> torch.Tensor:
    """[B, length, Hkv, D] view of ``cache`` for a page grid (see ``_page_grid``); no copy."""
    base, stride = grid
    page = cache.stride(0)
    shape = (b, n_pages * cache.shape[1], *cache.shape[2:])
    strides = (stride * page, *cache.stride()[1:])
    return cache.as_strided(shape, strides, cache.storage_offset() + base * page)[:, :length]


def _decode_sdpa(
    qd, k_cache, v_cache, input_pos, page_table, first: int, b: int, past: List[int], scale: float
) -> torch.Tensor:
    """Decode sequences ``first..b-1`` (one token each, queries ``qd [Bd, Hq, D]``) without
    window/cap/sinks: one SDPA call, over a strided view of the cache when the page table allows.

    The few ops matter: a CPU decode step runs this once per layer, and the general path's ~40
    small ops cost more than the attention itself. Keys are read up to the longest sequence;
    shorter ones mask the rest. A masked slot still enters the kernel's arithmetic (a NaN key
    makes its score NaN, a NaN value times probability 0 is NaN), so stale slots must be finite:
    they are checked on the tail that some sequence masks (usually a few slots) and, only if
    something there is not finite, zeroed in copies of the keys and values -- copying the whole
    view every step cost as much as the attention itself at batch 32.
    Returns [Bd, Hq, Dv] in q's dtype.
    """
    longest = max(past) + 1
    n_pages = -(-longest // k_cache.shape[1])
    ids = page_table[first:b, :n_pages]
    grid = _page_grid(ids) if k_cache.is_contiguous() and v_cache.is_contiguous() else None
    if grid is not None:  # consecutive pages per sequence, evenly spaced (the usual case): a view
        kc, vc = (_paged_view(c, grid, b - first, n_pages, longest).transpose(1, 2) for c in (k_cache, v_cache))
    else:
        kc = gather_pages(k_cache, ids, longest).transpose(1, 2)  # [Bd, Hkv, L, D]
        vc = gather_pages(v_cache, ids, longest).transpose(1, 2)
    qd = qd.unsqueeze(2)  # [Bd, Hq, 1, D]
    mask = None
    if min(past) != max(past):
        valid = torch.arange(longest, device=qd.device)[None, :] <= input_pos[first:b].long()[:, None]  # [Bd, L]
        mask = valid[:, None, None, :]
        tail = min(past) + 1  # slots below it are valid for every sequence
        if not bool(torch.isfinite(kc[:, :, tail:]).all() & torch.isfinite(vc[:, :, tail:]).all()):
            stale = ~valid[:, None, :, None]
            kc, vc = kc.masked_fill(stale, 0), vc.masked_fill(stale, 0)
    o = F.scaled_dot_product_attention(qd, kc, vc, attn_mask=mask, scale=scale, enable_gqa=True)
    return o[:, :, 0]


def _decode_only(q, k, v, k_cache, v_cache, input_pos, page_table, past: List[int], scale: float) -> torch.Tensor:
    """A decode-only step without window/cap/sinks -- the CPU decode hot path, so as few ops as
    possible: one sequence writes its K/V slot by host indices (no index tensors), then one SDPA.
    Returns [1, B, Hq, Dv]."""
    page_size, b = k_cache.shape[1], len(past)
    if b == 1:
        pos = past[0]
        page = int(page_table[0, pos // page_size])
        k_cache[page, pos % page_size] = k[0, 0]
        v_cache[page, pos % page_size] = v[0, 0]
    else:
        write_kv(k[0], v[0], k_cache, v_cache, torch.arange(b, device=q.device), input_pos.long(), page_table)
    o = _decode_sdpa(q[0], k_cache, v_cache, input_pos, page_table, 0, b, past, scale)  # [B, Hq, Dv]
    return o.contiguous().unsqueeze(0)


def torch_cached_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    seq_lens: torch.Tensor,
    input_pos: torch.Tensor,
    page_table: torch.Tensor,
    num_prefill: int,
    scale: float,
    sliding_window: Optional[int] = None,
    logit_cap: Optional[float] = None,
    sinks: Optional[torch.Tensor] = None,
    alibi_slopes: Optional[torch.Tensor] = None,
    chunk_size: Optional[int] = None,
) -> torch.Tensor:
    """Write the step's k/v into the paged cache, then attend; see the module docstring."""
    lens, past = _check(q, k, v, k_cache, v_cache, seq_lens, input_pos, page_table, num_prefill)
    plain = (
        sliding_window is None
        and logit_cap is None
        and sinks is None
        and alibi_slopes is None
        and chunk_size is None
        and k_cache.dtype == k.dtype
    )
    if num_prefill == 0 and plain:
        return _decode_only(q, k, v, k_cache, v_cache, input_pos, page_table, past, scale)
    if num_prefill == 0:  # decode only: token i is sequence i, at its input_pos
        seq_idx, pos = torch.arange(len(lens), device=q.device), input_pos.long()
    else:
        seq_idx, pos = token_layout(seq_lens, input_pos, q.shape[1])
    write_kv(k[0], v[0], k_cache, v_cache, seq_idx, pos, page_table)

    out = q.new_empty(*q.shape[:-1], v.shape[-1])  # [1, T, Hq, Dv]
    starts = [0]
    for n in lens:
        starts.append(starts[-1] + n)
    # A fresh prefill's keys are exactly its new k/v: plain causal attention on them is SDPA,
    # which is faster and bit-identical to the uncached torch_attention.
    # Prefill (and chunked prefill): one sequence at a time, its keys gathered from its pages.
    for i in range(num_prefill):
        a, b, total = starts[i], starts[i + 1], past[i] + lens[i]
        if plain and past[i] == 0:
            qi, ki, vi = (x[0, a:b].transpose(0, 1)[None] for x in (q, k, v))  # [1, H, s, D]
            o = F.scaled_dot_product_attention(qi, ki, vi, is_causal=True, scale=scale, enable_gqa=True)
            out[0, a:b] = o[0].transpose(0, 1)
            continue
        kc = gather_pages(k_cache, page_table[i], total)[None]  # [1, L, Hkv, D]
        vc = gather_pages(v_cache, page_table[i], total)[None]
        q_pos, k_pos = torch.arange(past[i], total, device=q.device), torch.arange(total, device=q.device)
        keep = _keep(q_pos, k_pos, sliding_window, chunk_size)[None]
        alibi = None if alibi_slopes is None else (alibi_slopes, (k_pos[None, :] - q_pos[:, None])[None])
        out[0, a:b] = _attend(q[:, a:b], kc, vc, keep, scale, logit_cap, sinks, alibi)[0].to(out.dtype)
    # Decode: all sequences together, keys padded to the longest and masked.
    if num_prefill < len(lens) and plain:
        a = starts[num_prefill]
        out[0, a:] = _decode_sdpa(
            q[0, a:], k_cache, v_cache, input_pos, page_table, num_prefill, len(lens), past[num_prefill:], scale
        )
    elif num_prefill < len(lens):
        a = starts[num_prefill]
        totals = input_pos[num_prefill:].long() + 1  # [Bd]
        longest = int(max(past[num_prefill:])) + 1
        n_pages = -(-longest // k_cache.shape[1])
        ids = page_table[num_prefill : len(lens), :n_pages]  # [Bd, n_pages]
        kc = gather_pages(k_cache, ids, longest)  # [Bd, L, Hkv, D]
        vc = gather_pages(v_cache, ids, longest)
        k_pos = torch.arange(longest, device=q.device)
        valid = k_pos[None, :] < totals[:, None]  # [Bd, L]; slots past the end may be stale
        vc = vc.masked_fill(~valid[:, :, None, None], 0)  # 0 * stale inf/nan would still be nan
        keep = _keep((totals - 1)[:, None], k_pos.expand(len(totals), -1), sliding_window, chunk_size)
        keep = keep & valid[:, None]
        qd = q[0, a:].unsqueeze(1)  # [Bd, 1, Hq, D]
        alibi = None if alibi_slopes is None else (alibi_slopes, (k_pos[None, :] - (totals - 1)[:, None])[:, None])
        out[0, a:] = _attend(qd, kc, vc, keep, scale, logit_cap, sinks, alibi)[:, 0].to(out.dtype)
    return out


define_cached_attention(
    "torch_cached_attention",
    torch_cached_attention,
    host_sync="reads seq_lens and input_pos on the host (.tolist()) to slice each sequence",
)
