"""``workbench::torch_attention_sdpa``: SDPA semantics as an op of ours.

``match_eager_attention`` rewrites the eager matmul/softmax/matmul chain to this op first (a
one-to-one, easily checked step); ``match_sdpa_to_torch_attention`` then lowers it, like
``aten.scaled_dot_product_attention``, to ``torch_attention``. Layout is always bnsd::

    query [b, n, s_q, d], key/value [b, n_kv, s_k, d] -> out [b, n, s_q, d_v]
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from ..library import workbench_op


@workbench_op("torch_attention_sdpa", category="attention")
def torch_attention_sdpa(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: Optional[torch.Tensor] = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: Optional[float] = None,
    enable_gqa: bool = False,
) -> torch.Tensor:
    """Exactly ``F.scaled_dot_product_attention`` with the same arguments."""
    return F.scaled_dot_product_attention(
        query,
        key,
        value,
        attn_mask=attn_mask,
        dropout_p=dropout_p,
        is_causal=is_causal,
        scale=scale,
        enable_gqa=enable_gqa,
    )


@torch_attention_sdpa.register_fake
def _torch_attention_sdpa_fake(
    query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False
):
    return query.new_empty(*query.shape[:-1], value.shape[-1])
