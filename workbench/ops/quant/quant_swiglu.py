"""Quantized SwiGLU MLPs, ``down(silu(gate(x)) * up(x))`` with every projection quantized.

What ``match_nvfp4_swiglu_pattern`` / ``match_finegrained_fp8_swiglu_pattern`` produce from three
quantized linears around a SiLU-and-multiply. The reference is that subgraph, op for op: each
projection is the canonical quantized linear (so each output is rounded to the input's dtype
between them, as in the unfused graph), which keeps the match numerically exact; a fused backend
may later keep the intermediate in higher precision.

    torch_nvfp4_swiglu_mlp(input, gate_{weight, input_scale, weight_scale, weight_scale_2},
                           up_{...}, down_{...})                     see nvfp4.py for each group
    torch_finegrained_fp8_swiglu_mlp(input, gate_weight, gate_weight_scale_inv, up_weight,
                           up_weight_scale_inv, down_weight, down_weight_scale_inv, block_n=128, block_k=128)
Weights [I, H] (gate, up) and [H, I] (down) in ``nn.Linear`` layout; input [..., H] -> [..., H].
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..library import define_op
from .codecs import FP4_E2M1_STEP, FP8_E4M3_STEP
from .fp8 import finegrained_fp8_linear
from .nvfp4 import nvfp4_linear
from .row_blocks import quantized_linear_fake


def quantized_swiglu(linear, input, gate: tuple, up: tuple, down: tuple) -> torch.Tensor:
    """``down(silu(gate(x)) * up(x))`` where each projection is ``linear(x, *its_tensors)``."""
    return linear(F.silu(linear(input, *gate)) * linear(input, *up), *down)


def nvfp4_swiglu_mlp(input, *projections):
    """``projections``: the schema's (weight, input_scale, weight_scale, weight_scale_2) of gate, up, then down."""
    gate, up, down = projections[0:4], projections[4:8], projections[8:12]
    return quantized_swiglu(nvfp4_linear, input, gate, up, down)


def _nvfp4_fake(input, *projections):
    # projections: the schema's (weight, input_scale, weight_scale, weight_scale_2) of gate, up, down
    return quantized_linear_fake(input, projections[8])  # the down projection's weight


torch_nvfp4_swiglu_mlp = define_op(
    "torch_nvfp4_swiglu_mlp(Tensor input, Tensor gate_weight, Tensor gate_input_scale, Tensor gate_weight_scale, "
    "Tensor gate_weight_scale_2, Tensor up_weight, Tensor up_input_scale, Tensor up_weight_scale, "
    "Tensor up_weight_scale_2, Tensor down_weight, Tensor down_input_scale, Tensor down_weight_scale, "
    "Tensor down_weight_scale_2) -> Tensor",
    nvfp4_swiglu_mlp,
    _nvfp4_fake,
    activation_rounding=FP4_E2M1_STEP,
    category="quant",
)


def finegrained_fp8_swiglu_mlp(
    input,
    gate_weight,
    gate_weight_scale_inv,
    up_weight,
    up_weight_scale_inv,
    down_weight,
    down_weight_scale_inv,
    block_n=128,
    block_k=128,
):
    gate = (gate_weight, gate_weight_scale_inv, block_n, block_k)
    up = (up_weight, up_weight_scale_inv, block_n, block_k)
    down = (down_weight, down_weight_scale_inv, block_n, block_k)
    return quantized_swiglu(finegrained_fp8_linear, input, gate, up, down)


def _fp8_fake(input, *projections_and_blocks):
    # the schema's (weight, weight_scale_inv) of gate, up, down, then block_n / block_k when given
    return quantized_linear_fake(input, projections_and_blocks[4])  # the down projection's weight


torch_finegrained_fp8_swiglu_mlp = define_op(
    "torch_finegrained_fp8_swiglu_mlp(Tensor input, Tensor gate_weight, Tensor gate_weight_scale_inv, "
    "Tensor up_weight, Tensor up_weight_scale_inv, Tensor down_weight, Tensor down_weight_scale_inv, "
    "int block_n=128, int block_k=128) -> Tensor",
    finegrained_fp8_swiglu_mlp,
    _fp8_fake,
    activation_rounding=FP8_E4M3_STEP,
    category="quant",
)
