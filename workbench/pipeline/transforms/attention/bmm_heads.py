"""BART-style eager attention over heads folded into the batch (stage ``pattern_matcher``, part of
``match_eager_attention``): XGLM, and the decoder attention of BART / mBART / Marian / PLBart-style code.

    q = q_proj(h) * scaling                      # pre-scaled query, [b, n, s, d] after view/transpose
    w = bmm(q.reshape(b*n, -1, d), k.reshape(b*n, -1, d).transpose(1, 2))        # [b*n, s, s]
    w = max(w.view(b, n, s, s) + mask, full((), finfo.min)).view(b*n, s, s)    (with a mask)
    p = softmax(w, -1).view(b, n, s, s).view(b*n, s, s)      # the double view keeps HF's weights
    o = bmm(dropout(p), v.reshape(b*n, -1, d)).view(b, n, s, d)

-> ``torch_attention(q, k, v, scale=1.0)`` on the [b, n, s, d] inputs (the query's scaling stays the
multiplication before it), the mask classified like every other (causal: dropped for ``is_causal``).
The clamp at ``finfo.min`` only turns ``-inf`` logits into the most negative finite one: their weight
stays exactly 0 while a visible logit in the row is above ``min + 104`` (every causal row keeps its own
key), so the clamp is dropped with the mask; a clamp at anything above ``REPLACED_HIDDEN`` is not matched.
"""

from __future__ import annotations

import itertools
from typing import Any, Dict, Optional

import torch
import torch.nn.functional as F

from ...graph.utils import tensor_meta
from ...matcher import EVAL_DROPOUT, Match, Pattern, same_size
from ...matcher.masks import attention_mask_arguments
from .legacy import REPLACED_HIDDEN
from .variants import variant_replacement

aten = torch.ops.aten

_CLAMP = -12345.5  # sentinel for the clamp's value (finfo(dtype).min in the model)


def _bmm_attention(with_mask: bool, with_dropout: bool) -> Pattern:
    def search(q, k, v, *mask, clamp=None):
        b, n, s, d = q.shape
        w = torch.bmm(q.reshape(b * n, -1, d), k.reshape(b * n, -1, d).transpose(1, 2))
        if mask:
            w = w.view(b, n, s, -1) + mask[0]
            w = torch.max(w, torch.full((), clamp, device=w.device)).view(b * n, s, -1)
        p = F.softmax(w, dim=-1)
        p = p.view(b, n, s, -1).view(b * n, s, -1)
        if with_dropout:
            p = F.dropout(p, p=0.0, training=False)
        return torch.bmm(p, v.reshape(b * n, -1, d)).view(b, n, s, d)

    def replacement(q, k, v, *mask, clamp=None, **flags):
        return variant_replacement(q, k, v, mask, scale=1.0, **flags)

    def check(m: Match) -> Optional[Dict[str, Any]]:
        q, k, v = m.val("q"), m.val("k"), m.val("v")
        if any(t is None or t.dim() != 4 for t in (q, k, v)):
            return None
        # one head per query head (no GQA in these families), same head dim, keys and values aligned
        if not (same_size(q.shape[1], k.shape[1]) and same_size(k.shape[1], v.shape[1])):
            return None
        if not (same_size(q.shape[3], k.shape[3]) and same_size(k.shape[2], v.shape[2])):
            return None
        # the view back to [b, n, s, d] must be the bmm's own sizes (not a regrouping of heads)
        out = tensor_meta(m.outputs[0])
        if out is None or not all(same_size(a, b) for a, b in zip(out.shape, (*q.shape[:3], v.shape[3]))):
            return None
        if with_mask:
            clamp = m.literals["clamp"]
            if not isinstance(clamp, (int, float)) or clamp > REPLACED_HIDDEN:
                return None
        return attention_mask_arguments(m.inputs["attn_mask"] if with_mask else None, q, k)

    def examples():
        t = tuple(torch.randn(1, 2, 4, 8) for _ in range(3))
        return (*t, *((torch.zeros(1, 1, 4, 4),) if with_mask else ()))

    return Pattern(
        f"bmm_heads_attention{'_mask' if with_mask else ''}{'_dropout' if with_dropout else ''}",
        search,
        replacement,
        examples,
        literals={"clamp": _CLAMP} if with_mask else {},
        ignore=(
            (aten.view.default, "size"),
            (aten.reshape.default, "shape"),
            # the clamp's scalar tensor takes its dtype, device, layout and pinning from the model
            *((aten.full.default, arg) for arg in ("dtype", "device", "layout", "pin_memory")),
            *EVAL_DROPOUT,
        ),
        check=check,
        inputs=("q", "k", "v", *(("attn_mask",) if with_mask else ())),
    )


BMM_HEADS_PATTERNS = tuple(
    _bmm_attention(mask, dropout) for mask, dropout in itertools.product((True, False), repeat=2)
)

__all__ = ["BMM_HEADS_PATTERNS"]
