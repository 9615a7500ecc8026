"""Attention patterns (stage ``pattern_matcher``): every attention spelling -> ``torch_attention``.

The chain, in pipeline order:

1. ``match_repeat_kv``: HF ``repeat_kv`` (unsqueeze/expand/reshape) -> ``torch_attention_repeat_kv``.
2. ``match_eager_attention``: matmul/softmax/matmul -> ``torch_attention_sdpa``; the eager
   variants SDPA cannot express -- logit soft-capping (Gemma 2) and attention sinks (gpt-oss) --
   straight to ``torch_attention(..., logit_cap=..., sinks=...)`` (K/V still repeated: step 4
   un-repeats them), their masks classified as in step 3. ALiBi's eager spellings (BLOOM, MPT,
   Falcon; ``alibi.py``) also go straight to ``torch_attention(..., alibi_slopes=...)``, and the
   older spellings that replace logits through a registered causal table (GPT-Neo, OpenAI GPT;
   ``legacy.py``) to ``torch_attention`` with an explicit mask, classified after load.
3. ``match_sdpa_to_torch_attention``: ``aten.scaled_dot_product_attention`` and
   ``torch_attention_sdpa`` (with or without repeated K/V) -> ``torch_attention`` with native GQA.
   A mask that only encodes causality (HF passes an explicit boolean mask built from aranges) is
   dropped in favour of ``is_causal`` (+ ``sliding_window`` or ``chunk_size``), which backends can implement without
   materialising a [s, s] mask (``masks.py``: HF's boolean SDPA masks and its additive eager
   masks alike).
   An SDPA mask that is a causal mask with an ALiBi bias folded in (Falcon) becomes ``is_causal``
   + ``alibi_slopes`` (``alibi.py``).
4. ``match_grouped_attention``: ``torch_attention`` still fed by repeated K/V -> un-repeated K/V.

This module holds step 3; steps 1 and 4 are in ``repeat_kv.py``, step 2 in ``eager.py``. Layout
changes (``match_attention_layout``) live in ``layout.py``.
"""

from __future__ import annotations

import itertools
from typing import Any, Dict, Optional

import torch

from .... import ops  # noqa: F401  (registers torch.ops.workbench)
from ...interface import register
from ...matcher import Match, Pattern, PatternTransform, named_args, same_size
from ...matcher.masks import attention_mask_arguments
from .alibi import ALIBI_SDPA_PATTERNS
from .variants import chunk_kwargs, sdpa_pattern

wb = torch.ops.workbench


def _sdpa_pattern(source: str, repeated: bool, with_mask: bool) -> Pattern:
    """``source`` (aten SDPA or our torch_attention_sdpa) on (maybe repeated) K/V, (maybe) masked."""

    def replacement(q, k, v, *mask, keep_mask, dropout_p, is_causal, scale, sliding_window, chunk_size=None, **_):
        return wb.torch_attention.default(
            q,
            k,
            v,
            attn_mask=mask[0] if mask and keep_mask else None,
            dropout_p=dropout_p,
            is_causal=is_causal,
            scale=scale,
            sliding_window=sliding_window,
            layout="bnsd",
            **chunk_kwargs(chunk_size),
        )

    def check(m: Match) -> Optional[Dict[str, Any]]:
        q, k, v = m.val("q"), m.val("k"), m.val("v")
        if q is None or k is None or v is None or q.dim() != 4 or k.dim() != 4:
            return None
        if q.shape[1] % k.shape[1] or not same_size(k.shape[1], v.shape[1]):
            return None
        flags = dict(named_args(m.outputs[0]))
        mask = m.inputs["attn_mask"] if with_mask else None
        return {
            "dropout_p": flags["dropout_p"],
            "scale": flags["scale"],
            **attention_mask_arguments(mask, q, k, is_causal=bool(flags["is_causal"])),
        }

    name = f"{source}_sdpa{'_repeat_kv' if repeated else ''}{'_mask' if with_mask else ''}"
    mask_example = (lambda: torch.ones(1, 1, 4, 4, dtype=torch.bool)) if with_mask else None
    return sdpa_pattern(name, source, repeated, mask_example, replacement, check)


SDPA_PATTERNS = tuple(
    _sdpa_pattern(source, repeated, with_mask)
    for source, repeated, with_mask in itertools.product(("aten", "workbench"), (True, False), (True, False))
)


@register("match_sdpa_to_torch_attention")
class MatchSDPAToTorchAttention(PatternTransform):
    """Replace SDPA (aten or ``torch_attention_sdpa``), with or without repeat_kv, by
    ``torch_attention`` in bnsd layout; causal-only masks become ``is_causal``/``sliding_window``."""

    patterns = ALIBI_SDPA_PATTERNS + SDPA_PATTERNS  # ALiBi first: the general ones would keep its mask


__all__ = ["SDPA_PATTERNS"]
