"""What the eager-attention variants' patterns share (``matchers.py``, ``bmm_heads.py``): the check of
q/k/v and the mask, and the ``torch_attention`` call that replaces them."""

from __future__ import annotations

from typing import Any, Dict, Optional

import torch

from ...matcher import Match, same_size
from ...matcher.masks import attention_mask_arguments

wb = torch.ops.workbench


def variant_masking(m: Match, with_mask: bool) -> Optional[Dict[str, Any]]:
    """Shared check of the eager variants: 4-D q/k/v with whole KV groups; the mask classified
    (``attention_mask_arguments``) so a causal / sliding-window mask becomes flags."""
    q, k, v = m.val("q"), m.val("k"), m.val("v")
    if any(t is None or t.dim() != 4 for t in (q, k, v)):
        return None
    if q.shape[1] % k.shape[1] or not same_size(k.shape[1], v.shape[1]):
        return None
    return attention_mask_arguments(m.inputs["attn_mask"] if with_mask else None, q, k)


def chunk_kwargs(chunk_size: Optional[int]) -> Dict[str, Any]:
    """``torch_attention``'s ``chunk_size`` keyword where a mask was classified as chunked (none
    otherwise: the other families' graphs keep the op's default)."""
    return {} if chunk_size is None else {"chunk_size": chunk_size}


def variant_replacement(q, k, v, mask, *, scale, keep_mask, is_causal, sliding_window, chunk_size=None, **variant):
    """``torch_attention`` on [b, n, s, d] q/k/v with ``variant_masking``'s flags (the explicit
    ``mask[0]`` only where it must stay) and the variant's own keywords (``logit_cap``, ``sinks``)."""
    return wb.torch_attention.default(
        q,
        k,
        v,
        attn_mask=mask[0] if mask and keep_mask else None,
        is_causal=is_causal,
        scale=float(scale),
        sliding_window=sliding_window,
        layout="bnsd",
        **chunk_kwargs(chunk_size),
        **variant,
    )
