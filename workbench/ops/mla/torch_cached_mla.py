"""``workbench::torch_cached_mla``: MLA over a paged *latent* cache, for a mixed batch.

One call serves a whole step of continuous batching, with the metadata of
``torch_cached_attention`` (B sequences, their new tokens back to back in one flattened dim T,
``num_prefill`` prefill sequences of any length first, then one-token decode rows)::

    q_nope [1, T, n, dn], q_pe [1, T, n, dr]     per-token queries (q_pe rotated)
    compressed_kv [1, T, r], kpe [1, T, 1, dr]   per-token latent and rotated rope key
    kv_b_proj_weight [n*(dn+dv), r]              the up-projection (``torch_mla``'s layout)
    mla_cache [num_pages, page_size, r + dr]     per layer: latent then rope key of every cached token
    seq_lens, input_pos [B] int32, page_table [B, max_pages_per_seq] int32, num_prefill
    -> out [1, T, n, dv] in q's dtype

Semantics: the new ``[compressed_kv, kpe]`` rows of sequence i are written at logical positions
``input_pos[i] .. input_pos[i] + seq_lens[i] - 1`` (page ``page_table[i, pos // page_size]``, slot
``pos % page_size``); then each new query attends causally to positions ``0..p`` of its sequence.

How each row attends:

* a prefill starting at position 0 runs ``torch_mla``'s own computation on its new tokens
  (bit-identical to the uncached op, so the numerics probe reads 0.0 through the cached graph);
* a chunked prefill (``input_pos > 0``) expands its gathered latents to per-head K/V (many
  queries per key: expanding once is cheaper than absorbing per query);
* decode rows use the absorbed form (``mla_absorbed``): scores against the cached latents
  directly, never materialising per-head keys or values -- the point of MLA.

The cache holds r + dr values per token and layer, where per-head K/V would hold
n * (dn + dr + dv). Only slots that were written (positions ``< input_pos + seq_lens``) are read;
stale slots of reused pages are zeroed in the gathered copy before they enter any arithmetic.
"""

from __future__ import annotations

from typing import Any, Callable, List, NamedTuple, Tuple

import torch

from ..attention.torch_cached_attention import check_paged_metadata, token_layout
from ..library import check_named_args, define_op
from .torch_mla import mla_absorbed, mla_dims, mla_expanded, torch_mla_reference


class CachedMLAArgs(NamedTuple):
    """The arguments of a cached-MLA op (``torch_cached_mla``, ``triton_cached_mla``) by name, in
    the order of their shared schema (``CACHED_MLA_SCHEMA``; checked when an op is defined). The
    dispatcher hands a kernel all of them positionally; a direct call may name them."""

    q_nope: torch.Tensor  # [1, T, n, dn]
    q_pe: torch.Tensor  # [1, T, n, dr], rotated
    compressed_kv: torch.Tensor  # [1, T, r]: the latent
    kpe: torch.Tensor  # [1, T, 1, dr]: the rotated rope key
    kv_b_proj_weight: torch.Tensor  # [n * (dn + dv), r]
    mla_cache: torch.Tensor  # [num_pages, page_size, r + dr]; the new rows are written into it
    seq_lens: torch.Tensor  # [B] int32: new tokens of each sequence
    input_pos: torch.Tensor  # [B] int32: tokens of each sequence already cached
    page_table: torch.Tensor  # [B, max_pages_per_seq] int32
    num_prefill: int  # sequences 0..num_prefill-1 prefill (any length), the rest decode (1 token)
    scale: float


def check_latent_cache(mla_cache: torch.Tensor, r: int, dr: int) -> None:
    """``mla_cache`` must be [num_pages, page_size, r + dr]: latent then rope key per token."""
    if mla_cache.dim() != 3 or mla_cache.shape[2] != r + dr:
        raise ValueError(
            f"mla_cache {tuple(mla_cache.shape)} does not hold latent + rope key rows: expected "
            f"[num_pages, page_size, {r} + {dr}]"
        )


def check_cached_mla_args(call: CachedMLAArgs) -> Tuple[List[int], List[int], int]:
    """Validate shapes and metadata; returns (seq_lens, input_pos) as host lists and dv."""
    q_nope, q_pe, compressed_kv, kpe, _, mla_cache = call[:6]
    n, dn, dr, r, dv = mla_dims(*call[:5])  # from q_nope, q_pe, compressed_kv, kpe, kv_b_proj_weight
    t = q_nope.shape[1]
    if q_nope.shape[0] != 1 or q_pe.shape[:2] != (1, t) or compressed_kv.shape[:2] != (1, t) or kpe.shape[:2] != (1, t):
        raise ValueError(
            f"cached MLA expects flattened tokens [1, T, ...] for every per-token input; got q_nope "
            f"{tuple(q_nope.shape)}, q_pe {tuple(q_pe.shape)}, compressed_kv {tuple(compressed_kv.shape)}, "
            f"kpe {tuple(kpe.shape)}"
        )
    check_latent_cache(mla_cache, r, dr)
    lens, past = check_paged_metadata(
        call.seq_lens, call.input_pos, call.page_table, call.num_prefill, ("q_nope", t), mla_cache.shape[1]
    )
    return lens, past, dv


def gather_latents(mla_cache: torch.Tensor, page_ids: torch.Tensor, length: int) -> torch.Tensor:
    """The first ``length`` cached rows of each sequence: page_ids [N, n_pages] -> [N, length, r + dr]."""
    n, n_pages = page_ids.shape
    rows = mla_cache.index_select(0, page_ids.reshape(-1).long())  # [N * n_pages, page_size, r + dr]
    return rows.view(n, n_pages * mla_cache.shape[1], mla_cache.shape[2])[:, :length]


def write_latents(compressed_kv, kpe, mla_cache, seq_lens, input_pos, page_table) -> None:
    """Write one ``[compressed_kv, kpe]`` row (r + dr values) per new token into its page slot."""
    seq_idx, pos = token_layout(seq_lens, input_pos, compressed_kv.shape[1])
    page_size = mla_cache.shape[1]
    pages = page_table.long()[seq_idx, pos // page_size]
    mla_cache[pages, pos % page_size] = torch.cat([compressed_kv[0], kpe[0, :, 0]], dim=-1).to(mla_cache.dtype)


def prefill_rows(call: CachedMLAArgs, lens: List[int], past: List[int], out: torch.Tensor) -> int:
    """Attention of the ``num_prefill`` prefill sequences (their rows already written), into ``out``
    [1, T, n, dv]; ``lens``/``past`` are the host lists. Returns the first decode row's token index.
    Shared by ``triton_cached_mla``, whose prefill rows run this same torch code."""
    q_nope, q_pe, compressed_kv, kpe, kv_b_proj_weight, mla_cache = call[:6]
    page_table, scale = call.page_table, call.scale
    r = compressed_kv.shape[-1]
    page_size = mla_cache.shape[1]
    device = q_nope.device
    a = 0
    for i in range(call.num_prefill):
        b, total = a + lens[i], past[i] + lens[i]
        if past[i] == 0 and mla_cache.dtype == compressed_kv.dtype:  # fresh prefill: keys = its new tokens
            out[0, a:b] = torch_mla_reference(
                q_nope[:, a:b], q_pe[:, a:b], compressed_kv[:, a:b], kpe[:, a:b], kv_b_proj_weight, scale
            )[0]
        else:
            rows = gather_latents(mla_cache, page_table[i : i + 1, : -(-total // page_size)], total).to(q_nope.dtype)
            keep = torch.arange(total, device=device)[None, :] <= torch.arange(past[i], total, device=device)[:, None]
            out[0, a:b] = mla_expanded(
                q_nope[:, a:b], q_pe[:, a:b], rows[..., :r], rows[..., r:], kv_b_proj_weight, keep[None], scale
            )[0]
        a = b
    return a


def torch_cached_mla(*args: Any, **kwargs: Any) -> torch.Tensor:
    """Write the step's latents into the paged cache, then attend; see the module docstring.
    ``args``/``kwargs``: the cached-MLA arguments (``CachedMLAArgs``)."""
    call = CachedMLAArgs(*args, **kwargs)
    lens, past, dv = check_cached_mla_args(call)
    q_nope, q_pe, compressed_kv, kpe, kv_b_proj_weight, mla_cache, seq_lens, input_pos, page_table = call[:9]
    num_prefill, scale = call.num_prefill, call.scale
    r = compressed_kv.shape[-1]
    device = q_nope.device
    page_size = mla_cache.shape[1]
    write_latents(compressed_kv, kpe, mla_cache, seq_lens, input_pos, page_table)
    out = q_nope.new_empty(*q_nope.shape[:-1], dv)  # [1, T, n, dv]
    a = prefill_rows(call, lens, past, out)
    if num_prefill < len(lens):  # decode rows: absorbed, keys padded to the longest and masked
        totals = input_pos[num_prefill:].long().to(device) + 1  # [Bd]
        longest = max(past[num_prefill:]) + 1
        ids = page_table[num_prefill : len(lens), : -(-longest // page_size)]
        rows = gather_latents(mla_cache, ids, longest)  # [Bd, L, r + dr]
        valid = torch.arange(longest, device=device)[None, :] < totals[:, None]  # [Bd, L]
        rows = rows.masked_fill(~valid[:, :, None], 0)  # stale slots: 0 * inf/nan would still be nan
        q_n, q_p = q_nope[0, a:].unsqueeze(1), q_pe[0, a:].unsqueeze(1)  # [Bd, 1, n, d]
        out[0, a:] = mla_absorbed(q_n, q_p, rows[..., :r], rows[..., r:], kv_b_proj_weight, valid[:, None], scale)[:, 0]
    return out


def cached_mla_fake(q_nope, q_pe, compressed_kv, kpe, kv_b_proj_weight, *_rest):
    n, dn, dr, r, dv = mla_dims(q_nope, q_pe, compressed_kv, kpe, kv_b_proj_weight)
    return q_nope.new_empty(*q_nope.shape[:-1], dv)


# ``define_op`` (a Library kernel) rather than ``custom_op``, for the reason given beside
# ``torch_cached_attention``: custom_op's Python in-place handling costs more than a decode step.
CACHED_MLA_SCHEMA = (
    "torch_cached_mla(Tensor q_nope, Tensor q_pe, Tensor compressed_kv, Tensor kpe, Tensor kv_b_proj_weight, "
    "Tensor(a!) mla_cache, Tensor seq_lens, Tensor input_pos, Tensor page_table, SymInt num_prefill, "
    "float scale) -> Tensor"
)


def define_cached_mla(name: str, impl: Callable, **traits: Any):
    """Register ``workbench::<name>`` with the shared cached-MLA schema and fake; ``traits``: its
    ``OpTraits`` beyond the category (``host_sync``)."""
    op = define_op(
        CACHED_MLA_SCHEMA.replace("torch_cached_mla", name, 1), impl, cached_mla_fake, category="attention", **traits
    )
    check_named_args(op, CachedMLAArgs)
    return op


torch_cached_mla_op = define_cached_mla(
    "torch_cached_mla",
    torch_cached_mla,
    host_sync=(
        "reads seq_lens and input_pos on the host (.tolist()); insert_cached_mla_attention.backend=triton "
        "(auto on CUDA) is captured"
    ),
)

__all__ = [
    "torch_cached_mla",
    "torch_cached_mla_op",
    "CachedMLAArgs",
    "define_cached_mla",
    "gather_latents",
    "write_latents",
    "prefill_rows",
    "check_cached_mla_args",
    "check_latent_cache",
    "cached_mla_fake",
    "CACHED_MLA_SCHEMA",
]
