"""``workbench::torch_mla``: multi-head latent attention (DeepSeek-V2/V3), uncached and causal.

MLA compresses each token's keys and values into one latent vector shared by all heads; only the
latent (and one small rotated RoPE key, also shared by all heads) is worth caching. The op takes
exactly those per-token inputs plus the up-projection that expands them, so everything a cache
needs is visible at the op's boundary::

    q_nope          [b, s, n, dn]   query part without position (``qk_nope_head_dim``)
    q_pe            [b, s, n, dr]   query RoPE part, already rotated (``qk_rope_head_dim``)
    compressed_kv   [b, s, r]       the latent after ``kv_a_layernorm`` (``kv_lora_rank``)
    kpe             [b, s, 1, dr]   the RoPE key, rotated, one head shared by all query heads
    kv_b_proj_weight [n*(dn+dv), r] ``kv_b_proj.weight``: per head h, rows h*(dn+dv) .. +dn expand
                                    the latent to k_nope, the next dv rows to v
    -> out          [b, s, n, dv]   causal attention, ``scale`` (default ``(dn + dr) ** -0.5``)

The reference is HF's own computation ("expanded" form): ``kv = compressed_kv @ W^T`` per head,
``k = [k_nope, kpe]``, ``q = [q_nope, q_pe]``, causal SDPA. The cached op
(``torch_cached_mla``) caches ``[compressed_kv, kpe]`` (r + dr values per token and layer) and
decodes in the *absorbed* form, which never expands the cached latents (``mla_absorbed``).
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
import torch.nn.functional as F

from ..library import define_op


def mla_dims(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    compressed_kv: torch.Tensor,
    kpe: torch.Tensor,
    kv_b_proj_weight: torch.Tensor,
) -> Tuple[int, int, int, int, int]:
    """Validate the per-token shapes (also on fakes at trace time); returns ``(n, dn, dr, r, dv)``."""
    if q_nope.dim() != 4 or q_pe.dim() != 4 or compressed_kv.dim() != 3 or kpe.dim() != 4:
        raise ValueError(
            f"torch_mla expects q_nope [b, s, n, dn], q_pe [b, s, n, dr], compressed_kv [b, s, r], "
            f"kpe [b, s, 1, dr]; got {tuple(q_nope.shape)}, {tuple(q_pe.shape)}, {tuple(compressed_kv.shape)}, "
            f"{tuple(kpe.shape)}"
        )
    n, dn = q_nope.shape[2], q_nope.shape[3]
    dr, r = q_pe.shape[3], compressed_kv.shape[2]
    if q_pe.shape[2] != n or kpe.shape[2] != 1 or kpe.shape[3] != dr:
        raise ValueError(
            f"torch_mla: q_pe {tuple(q_pe.shape)} must have q_nope's {n} heads and kpe {tuple(kpe.shape)} one "
            f"head of the same rope dim {dr} (the rope key is shared by all heads)"
        )
    if kv_b_proj_weight.dim() != 2 or kv_b_proj_weight.shape[1] != r or kv_b_proj_weight.shape[0] % n:
        raise ValueError(
            f"torch_mla: kv_b_proj_weight must be [n * (dn + dv), r] = [{n} * (dn + dv), {r}] (kv_b_proj.weight "
            f"as stored); got {tuple(kv_b_proj_weight.shape)}"
        )
    dv = kv_b_proj_weight.shape[0] // n - dn
    if dv < 1:
        raise ValueError(
            f"torch_mla: kv_b_proj_weight has {kv_b_proj_weight.shape[0] // n} rows per head, not more "
            f"than q_nope's head dim {dn}: no room for the value part"
        )
    return n, dn, dr, r, dv


def default_scale(q_nope: torch.Tensor, q_pe: torch.Tensor, scale: Optional[float]) -> float:
    """``scale`` or ``1 / sqrt(dn + dr)`` (the full query/key head dim)."""
    return float(scale) if scale is not None else (q_nope.shape[-1] + q_pe.shape[-1]) ** -0.5


def split_kv_b(kv_b_proj_weight: torch.Tensor, n: int, dn: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """``kv_b_proj.weight [n*(dn+dv), r]`` as its per-head key part ``[n, dn, r]`` and value part
    ``[n, dv, r]`` (views): HF views the projection's output as ``[..., n, dn + dv]``."""
    w = kv_b_proj_weight.view(n, -1, kv_b_proj_weight.shape[-1])
    return w[:, :dn], w[:, dn:]


def expand_latent(
    compressed_kv: torch.Tensor, kpe: torch.Tensor, kv_b_proj_weight: torch.Tensor, n: int, dn: int
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Per-head keys and values of cached tokens, as HF computes them.

    compressed_kv [..., L, r], kpe [..., L, dr] -> k [..., L, n, dn + dr], v [..., L, n, dv].
    """
    kv = F.linear(compressed_kv, kv_b_proj_weight)
    kv = kv.view(*kv.shape[:-1], n, kv.shape[-1] // n)
    k_nope, v = kv[..., :dn], kv[..., dn:]
    k = torch.cat([k_nope, kpe.unsqueeze(-2).expand(*k_nope.shape[:-1], kpe.shape[-1])], dim=-1)
    return k, v


def mla_expanded(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    compressed_kv: torch.Tensor,
    kpe: torch.Tensor,
    kv_b_proj_weight: torch.Tensor,
    keep: Optional[torch.Tensor],
    scale: float,
) -> torch.Tensor:
    """Attention with the latents expanded to per-head K/V (HF's form).

    q_nope [N, s, n, dn], q_pe [N, s, n, dr], compressed_kv [N, L, r], kpe [N, L, dr],
    keep [N, s, L] bool (True: the key is visible) or None for plain causal with s == L
    -> [N, s, n, dv] in q's dtype. SDPA in the inputs' dtype, like HF's sdpa attention.
    """
    n, dn = q_nope.shape[2], q_nope.shape[3]
    k, v = expand_latent(compressed_kv, kpe, kv_b_proj_weight, n, dn)
    q = torch.cat([q_nope, q_pe], dim=-1)
    mask = None if keep is None else keep[:, None]  # [N, 1, s, L]
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask, is_causal=keep is None, scale=scale
    )
    return out.transpose(1, 2)


def mla_absorbed(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    compressed_kv: torch.Tensor,
    kpe: torch.Tensor,
    kv_b_proj_weight: torch.Tensor,
    keep: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """The same attention without expanding the latents: the key up-projection is *absorbed* into
    the query and the value up-projection applied after the softmax.

    ``q_nope . (W_k c)`` = ``(W_k^T q_nope) . c``, so each head scores the cached latents ``c``
    directly with ``q_lat = W_k^T q_nope [n, r]``; the context ``sum_j p_j c_j [n, r]`` goes through
    ``W_v`` once. Per step this reads r + dr values per cached token instead of n * (dn + dr + dv),
    which is what decode (memory-bound) wants. Same shapes as ``mla_expanded`` (keep required);
    computed in fp32, returned in q's dtype.
    """
    n, dn = q_nope.shape[2], q_nope.shape[3]
    w_k, w_v = split_kv_b(kv_b_proj_weight.float(), n, dn)  # [n, dn, r], [n, dv, r]
    lat, pe = compressed_kv.float(), kpe.float()  # [N, L, r], [N, L, dr]
    q_lat = torch.einsum("bsnd,ndr->bnsr", q_nope.float(), w_k)  # [N, n, s, r]
    scores = torch.matmul(q_lat, lat[:, None].transpose(-1, -2))  # [N, n, s, L]
    scores = scores + torch.matmul(q_pe.float().transpose(1, 2), pe[:, None].transpose(-1, -2))
    scores = (scores * scale).masked_fill(~keep[:, None], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    ctx = torch.matmul(probs, lat[:, None])  # [N, n, s, r]
    out = torch.einsum("bnsr,nvr->bsnv", ctx, w_v)  # [N, s, n, dv]
    return out.to(q_nope.dtype)


def torch_mla_reference(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    compressed_kv: torch.Tensor,
    kpe: torch.Tensor,
    kv_b_proj_weight: torch.Tensor,
    scale: Optional[float] = None,
) -> torch.Tensor:
    """Causal MLA over whole sequences, expanded form; see the module docstring."""
    mla_dims(q_nope, q_pe, compressed_kv, kpe, kv_b_proj_weight)
    out = mla_expanded(
        q_nope, q_pe, compressed_kv, kpe[:, :, 0], kv_b_proj_weight, None, default_scale(q_nope, q_pe, scale)
    )
    return out.contiguous()


def _torch_mla_fake(q_nope, q_pe, compressed_kv, kpe, kv_b_proj_weight, scale=None):
    n, dn, dr, r, dv = mla_dims(q_nope, q_pe, compressed_kv, kpe, kv_b_proj_weight)
    return q_nope.new_empty(*q_nope.shape[:-1], dv)


torch_mla = define_op(
    "torch_mla(Tensor q_nope, Tensor q_pe, Tensor compressed_kv, Tensor kpe, Tensor kv_b_proj_weight, *, "
    "float? scale=None) -> Tensor",
    torch_mla_reference,
    _torch_mla_fake,
    category="attention",
)

__all__ = [
    "torch_mla",
    "torch_mla_reference",
    "mla_dims",
    "default_scale",
    "split_kv_b",
    "expand_latent",
    "mla_expanded",
    "mla_absorbed",
]
