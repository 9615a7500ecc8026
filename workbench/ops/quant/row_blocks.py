"""Reference quantized linears dequantize a weight a block of rows at a time."""

from __future__ import annotations

import torch

# Rows of a weight dequantized at a time by the reference linears: an LM head (49,152 x 576) would
# otherwise be a 113 MB fp32 temporary on every call; 4,096 rows of it are 9 MB.
ROW_BLOCK_ELEMENTS = 4096 * 576


def by_row_blocks(compute, n: int, k: int) -> torch.Tensor:
    """``compute(a, b)`` (the output columns of weight rows a..b) over row blocks, concatenated."""
    step = max(1, ROW_BLOCK_ELEMENTS // max(1, k))
    if n <= step:
        return compute(0, n)
    return torch.cat([compute(a, min(n, a + step)) for a in range(0, n, step)], dim=-1)
