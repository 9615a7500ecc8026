"""What the attention patterns share: the check of q/k/v and the mask and the ``torch_attention`` call
that replace the eager variants (``eager.py``, ``bmm_heads.py``), and the SDPA spelling that both the
general SDPA patterns (``matchers.py``) and ALiBi's (``alibi.py``) trace."""

from __future__ import annotations

from typing import Any, Callable, Dict, Optional

import torch
import torch.nn.functional as F

from ...matcher import Match, Pattern, same_size
from ...matcher.masks import attention_mask_arguments

aten = torch.ops.aten
wb = torch.ops.workbench

#: Sentinel (see pipeline/matcher) of the KV heads' repeat count in traced patterns.
N_REP = 3
#: Sentinel (see pipeline/matcher) of the softmax scale in the traced eager patterns (``eager.py``,
#: ``alibi.py``, ``legacy.py``).
SCALE = 0.3125
#: SDPA's flags: read by each SDPA pattern's check, never compared.
SDPA_FLAGS = ("dropout_p", "is_causal", "scale", "enable_gqa")


def grouped_qkv(m: Match) -> bool:
    """4-D q/k/v with whole KV groups: the query heads a multiple of the KV heads, K and V alike."""
    q, k, v = m.val("q"), m.val("k"), m.val("v")
    if any(t is None or t.dim() != 4 for t in (q, k, v)):
        return False
    return not q.shape[1] % k.shape[1] and same_size(k.shape[1], v.shape[1])


def variant_masking(m: Match, with_mask: bool) -> Optional[Dict[str, Any]]:
    """Shared check of the eager variants: 4-D q/k/v with whole KV groups; the mask classified
    (``attention_mask_arguments``) so a causal / sliding-window mask becomes flags."""
    if not grouped_qkv(m):
        return None
    return attention_mask_arguments(m.inputs["attn_mask"] if with_mask else None, m.val("q"), m.val("k"))


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


def sdpa_pattern(
    name: str,
    source: str,
    repeated: bool,
    mask_example: Optional[Callable[[], torch.Tensor]],
    replacement: Callable[..., Any],
    check: Callable[[Match], Optional[Dict[str, Any]]],
) -> Pattern:
    """A pattern of SDPA (``source``: ``"aten"`` for ``F.scaled_dot_product_attention``, else our
    ``torch_attention_sdpa``) on q [1, 6, 4, 8] and K/V of 6 heads, or of 2 heads repeated by
    ``torch_attention_repeat_kv`` when ``repeated``; with an ``attn_mask`` input (example
    ``mask_example()``) unless that is None. The flags are left to ``check`` (``SDPA_FLAGS``)."""
    op = aten.scaled_dot_product_attention.default if source == "aten" else wb.torch_attention_sdpa.default

    def search(q, k, v, *mask, n_rep=None):
        if repeated:
            k = wb.torch_attention_repeat_kv.default(k, n_rep)
            v = wb.torch_attention_repeat_kv.default(v, n_rep)
        m = mask[0] if mask else None
        if source == "aten":
            return F.scaled_dot_product_attention(q, k, v, attn_mask=m)
        return wb.torch_attention_sdpa.default(q, k, v, m)

    def examples():
        n_kv = 2 if repeated else 6
        t = (torch.randn(1, 6, 4, 8), torch.randn(1, n_kv, 4, 8), torch.randn(1, n_kv, 4, 8))
        return (*t, mask_example()) if mask_example is not None else t

    return Pattern(
        name,
        search,
        replacement,
        examples,
        literals={"n_rep": N_REP} if repeated else {},
        ignore=tuple((op, flag) for flag in SDPA_FLAGS),
        check=check,
        inputs=("q", "k", "v", "attn_mask") if mask_example is not None else ("q", "k", "v"),
    )


__all__ = [
    "N_REP",
    "SCALE",
    "SDPA_FLAGS",
    "chunk_kwargs",
    "grouped_qkv",
    "sdpa_pattern",
    "variant_masking",
    "variant_replacement",
]
