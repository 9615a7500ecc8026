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

import torch.nn.functional as F

from ..library import define_op
from .fp8 import finegrained_fp8_linear
from .nvfp4 import nvfp4_linear


def nvfp4_swiglu_mlp(
    input,
    gate_weight,
    gate_input_scale,
    gate_weight_scale,
    gate_weight_scale_2,
    up_weight,
    up_input_scale,
    up_weight_scale,
    up_weight_scale_2,
    down_weight,
    down_input_scale,
    down_weight_scale,
    down_weight_scale_2,
):
    gate = nvfp4_linear(input, gate_weight, gate_input_scale, gate_weight_scale, gate_weight_scale_2)
    up = nvfp4_linear(input, up_weight, up_input_scale, up_weight_scale, up_weight_scale_2)
    return nvfp4_linear(F.silu(gate) * up, down_weight, down_input_scale, down_weight_scale, down_weight_scale_2)


def _nvfp4_fake(
    input,
    gate_weight,
    gate_input_scale,
    gate_weight_scale,
    gate_weight_scale_2,
    up_weight,
    up_input_scale,
    up_weight_scale,
    up_weight_scale_2,
    down_weight,
    down_input_scale,
    down_weight_scale,
    down_weight_scale_2,
):
    return input.new_empty(*input.shape[:-1], down_weight.shape[0])


torch_nvfp4_swiglu_mlp = define_op(
    "torch_nvfp4_swiglu_mlp(Tensor input, Tensor gate_weight, Tensor gate_input_scale, Tensor gate_weight_scale, "
    "Tensor gate_weight_scale_2, Tensor up_weight, Tensor up_input_scale, Tensor up_weight_scale, "
    "Tensor up_weight_scale_2, Tensor down_weight, Tensor down_input_scale, Tensor down_weight_scale, "
    "Tensor down_weight_scale_2) -> Tensor",
    nvfp4_swiglu_mlp,
    _nvfp4_fake,
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
    gate = finegrained_fp8_linear(input, gate_weight, gate_weight_scale_inv, block_n, block_k)
    up = finegrained_fp8_linear(input, up_weight, up_weight_scale_inv, block_n, block_k)
    return finegrained_fp8_linear(F.silu(gate) * up, down_weight, down_weight_scale_inv, block_n, block_k)


def _fp8_fake(
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
    return input.new_empty(*input.shape[:-1], down_weight.shape[0])


torch_finegrained_fp8_swiglu_mlp = define_op(
    "torch_finegrained_fp8_swiglu_mlp(Tensor input, Tensor gate_weight, Tensor gate_weight_scale_inv, "
    "Tensor up_weight, Tensor up_weight_scale_inv, Tensor down_weight, Tensor down_weight_scale_inv, "
    "int block_n=128, int block_k=128) -> Tensor",
    finegrained_fp8_swiglu_mlp,
    _fp8_fake,
)
