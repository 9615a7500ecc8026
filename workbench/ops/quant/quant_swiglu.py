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

from typing import Callable, Tuple

import torch
import torch.nn.functional as F

from ..library import define_op
from .codecs import FP4_E2M1_STEP, FP8_E4M3_STEP
from .fp8 import finegrained_fp8_linear
from .nvfp4 import nvfp4_linear
from .row_blocks import quantized_linear_fake

PROJECTIONS = ("gate", "up", "down")  # the schemas' order


def quantized_swiglu(linear, input, gate: tuple, up: tuple, down: tuple) -> torch.Tensor:
    """``down(silu(gate(x)) * up(x))`` where each projection is ``linear(x, *its_tensors)``."""
    return linear(F.silu(linear(input, *gate)) * linear(input, *up), *down)


def define_swiglu_mlp(
    name: str, linear: Callable, tensors: Tuple[str, ...], activation_rounding: float, options: Tuple[str, ...] = ()
) -> Callable:
    """Define ``workbench::<name>(Tensor input, Tensor gate_<t>..., Tensor up_<t>..., Tensor down_<t>...,
    *options)``, one ``Tensor`` per name t in ``tensors`` (weight first) for each projection: the
    ``quantized_swiglu`` whose projections are ``linear(x, *their_tensors, *options)``."""
    n = len(tensors)
    tensor_args = [f"Tensor {projection}_{t}" for projection in PROJECTIONS for t in tensors]
    schema = f"{name}({', '.join(['Tensor input', *tensor_args, *options])}) -> Tensor"

    def mlp(input, *args):
        # the options the call gives (the dispatcher leaves trailing defaults out: linear's apply)
        given_options = args[3 * n :]
        gate, up, down = (args[i * n : (i + 1) * n] + given_options for i in range(3))
        return quantized_swiglu(linear, input, gate, up, down)

    def fake(input, *args):
        return quantized_linear_fake(input, args[2 * n])  # the down projection's weight

    return define_op(schema, mlp, fake, activation_rounding=activation_rounding, category="quant")


torch_nvfp4_swiglu_mlp = define_swiglu_mlp(
    "torch_nvfp4_swiglu_mlp", nvfp4_linear, ("weight", "input_scale", "weight_scale", "weight_scale_2"), FP4_E2M1_STEP
)
torch_finegrained_fp8_swiglu_mlp = define_swiglu_mlp(
    "torch_finegrained_fp8_swiglu_mlp",
    finegrained_fp8_linear,
    ("weight", "weight_scale_inv"),
    FP8_E4M3_STEP,
    options=("int block_n=128", "int block_k=128"),
)
