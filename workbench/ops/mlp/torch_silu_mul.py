"""``workbench::torch_silu_and_mul``: the gated activation of a fused gate/up GEMM.

Why an op: once ``fuse_swiglu`` concatenates the gate and up weights, the MLP is
``down(silu_and_mul(x @ [gate; up].T))``; this op is the canonical spelling of the middle step,
so a backend (``triton_silu_and_mul``) can replace it without touching the GEMMs.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..library import define_op


def silu_and_mul_reference(input: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` with ``gate, up = input.chunk(2, -1)``.

    input [..., 2*I] (gate columns first, then up; in its own dtype) -> [..., I]. Identical to the
    ``F.silu(gate(x)) * up(x)`` step of ``torch_swiglu_mlp`` on the same GEMM outputs.
    """
    gate, up = input.chunk(2, dim=-1)
    return F.silu(gate) * up


def _torch_silu_and_mul_fake(input):
    return input.new_empty(*input.shape[:-1], input.shape[-1] // 2)


# The canonical gated activation: ``silu_and_mul_reference`` (decode hot path: see ops/library.py).
torch_silu_and_mul = define_op(
    "torch_silu_and_mul(Tensor input) -> Tensor",
    silu_and_mul_reference,
    _torch_silu_and_mul_fake,
    category="elementwise",
    reference=silu_and_mul_reference,
)
