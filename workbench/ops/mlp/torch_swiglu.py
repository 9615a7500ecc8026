"""``workbench::torch_swiglu_mlp``: the gated MLP of Llama-family models as one node."""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from ..library import workbench_op


@workbench_op("torch_swiglu_mlp", category="matmul")
def torch_swiglu_mlp(
    input: torch.Tensor,
    gate_weight: torch.Tensor,
    up_weight: torch.Tensor,
    down_weight: torch.Tensor,
    gate_bias: Optional[torch.Tensor] = None,
    up_bias: Optional[torch.Tensor] = None,
    down_bias: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """``down(silu(gate(x)) * up(x))``.

    input [..., h]; gate/up weight [i, h]; down weight [h_out, i] -> [..., h_out].
    """
    gate = F.linear(input, gate_weight, gate_bias)
    up = F.linear(input, up_weight, up_bias)
    return F.linear(F.silu(gate) * up, down_weight, down_bias)


@torch_swiglu_mlp.register_fake
def _torch_swiglu_mlp_fake(input, gate_weight, up_weight, down_weight, gate_bias=None, up_bias=None, down_bias=None):
    return input.new_empty(*input.shape[:-1], down_weight.shape[0])
