"""``workbench::torch_int8_linear`` / ``torch_int8_embedding``: symmetric 8-bit weights in groups.

    qweight [N, K] int8, scales [N, K/group] float;   w[n, k] = q[n, k] * scales[n, k // group]

GGUF's Q8_0 (group 32, fp16 scales) is this format; SmolLM2's file stores its tied token embedding
/ LM head so. The linear computes ``input @ w.T + bias``; the embedding returns rows ``w[ids]``
dequantized, so a lookup reads B rows, not the table.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from ..library import define_op
from .cpu_fast_path import exact_cpu_kernel
from .row_blocks import by_row_blocks, quantized_linear_fake


def dequantize_int8(qweight: torch.Tensor, scales: torch.Tensor, group_size: int) -> torch.Tensor:
    """[N, K] fp32: q * scale per group."""
    n, k = qweight.shape
    return (qweight.float().view(n, k // group_size, group_size) * scales.float()[..., None]).view(n, k)


def int8_linear_reference(
    input: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    group_size: int,
    bias: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """The op's definition: dequantize (a block of rows at a time), then ``F.linear``."""

    def rows(a: int, b: int) -> torch.Tensor:
        w = dequantize_int8(qweight[a:b], scales[a:b], group_size).to(input.dtype)
        return F.linear(input, w, None if bias is None else bias[a:b])

    return by_row_blocks(rows, qweight.shape[0], qweight.shape[1])


def int8_linear(
    input: Tensor, qweight: Tensor, scales: Tensor, group_size: int, bias: Optional[Tensor] = None
) -> Tensor:
    """The op's body: the exact C++ kernel where it runs (see ``cpu_fast_path``), else the reference."""
    kernel = exact_cpu_kernel("cpu_int8_linear", input, scales)
    if kernel is not None and group_size % 32 == 0 and qweight.dtype == torch.int8:
        return kernel(input.contiguous(), qweight.contiguous(), scales.contiguous(), group_size, bias)
    return int8_linear_reference(input, qweight, scales, group_size, bias)


def int8_embedding(ids: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, group_size: int) -> torch.Tensor:
    flat = ids.reshape(-1)
    rows = dequantize_int8(qweight.index_select(0, flat), scales.index_select(0, flat), group_size)
    return rows.reshape(*ids.shape, qweight.shape[1])


def _embedding_fake(ids, qweight, scales, group_size):
    return scales.new_empty(*ids.shape, qweight.shape[1], dtype=torch.float32)


torch_int8_linear = define_op(
    "torch_int8_linear(Tensor input, Tensor qweight, Tensor scales, int group_size, Tensor? bias=None) -> Tensor",
    int8_linear,
    quantized_linear_fake,
    category="quant",
)
torch_int8_embedding = define_op(
    "torch_int8_embedding(Tensor ids, Tensor qweight, Tensor scales, int group_size) -> Tensor",
    int8_embedding,
    _embedding_fake,
    category="quant",
)
