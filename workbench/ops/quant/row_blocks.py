"""What the quantized linears share: references dequantize a weight a block of rows at a time, and
every linear's fake output has the input's leading dims and one column per weight row."""

from __future__ import annotations

import torch

# Rows of a weight dequantized at a time by the reference linears: an LM head (49,152 x 576) would
# otherwise be a 113 MB fp32 temporary on every call; 4,096 rows of it are 9 MB.
ROW_BLOCK_ELEMENTS = 4096 * 576


def quantized_linear_fake(input: torch.Tensor, weight: torch.Tensor, *rest, **options) -> torch.Tensor:
    """The fake (meta) output of a quantized linear whose ``weight`` holds one row per output
    feature: ``[..., N]`` like ``input``. ``rest`` / ``options``: the op's other arguments, unused."""
    return input.new_empty(*input.shape[:-1], weight.shape[0])


def by_row_blocks(compute, n: int, k: int, align: int = 1) -> torch.Tensor:
    """``compute(a, b)`` (the output columns of weight rows a..b) over row blocks, concatenated.

    ``align``: every block but the last starts and ends at a multiple of it (formats whose scales
    or packed words span several rows: 128-row FP8 tiles, GPTQ's 8 columns per int32)."""
    step = max(align, ROW_BLOCK_ELEMENTS // max(1, k) // align * align)
    if n <= step:
        return compute(0, n)
    return torch.cat([compute(a, min(n, a + step)) for a in range(0, n, step)], dim=-1)
