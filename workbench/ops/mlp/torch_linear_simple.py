"""``workbench::torch_linear_simple``: a plain linear layer as an op of ours.

``aten.linear`` is a composite op that backends and quantization passes cannot hang metadata
on; this op is the stable, un-decomposed spelling later passes rewrite (to quantized or sharded
linears) without touching every ``aten.linear`` in the graph.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from ..library import workbench_op


@workbench_op("torch_linear_simple", category="matmul")
def torch_linear_simple(input: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``input @ weight.T + bias``: input [..., k], weight [n, k], bias [n] -> [..., n]."""
    return F.linear(input, weight, bias)


@torch_linear_simple.register_fake
def _torch_linear_simple_fake(input, weight, bias=None):
    return input.new_empty(*input.shape[:-1], weight.shape[0])
