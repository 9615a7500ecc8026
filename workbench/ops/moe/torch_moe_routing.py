"""``workbench::torch_moe_topk_softmax``: the softmax -> top-k -> renormalize router as one op.

Reference semantics of the fused routing kernel (``triton_moe_topk_softmax`` beside this file)::

    logits [T, E] -> weights [T, k] float32, indices [T, k] int64

``weights`` are the top-k softmax probabilities, divided by their sum when ``renormalize``.
"""

from __future__ import annotations

from typing import Tuple

import torch

from ..library import workbench_op


@workbench_op("torch_moe_topk_softmax", category="moe")
def torch_moe_topk_softmax(logits: torch.Tensor, k: int, renormalize: bool = True) -> Tuple[torch.Tensor, torch.Tensor]:
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    weights, indices = torch.topk(probs, k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, indices


@torch_moe_topk_softmax.register_fake
def _torch_moe_topk_softmax_fake(logits, k, renormalize=True):
    shape = (*logits.shape[:-1], k)
    return logits.new_empty(shape, dtype=torch.float32), logits.new_empty(shape, dtype=torch.int64)
