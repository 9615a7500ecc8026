"""Canonical normalization ops: RMSNorm and L2Norm."""

from __future__ import annotations

import torch

from ..library import define_op, workbench_op


def rmsnorm_reference(input: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``weight * (x * rsqrt(mean(x**2, -1) + eps))`` with the statistics in fp32.

    input [..., h], weight [h] -> [..., h]. Like HF's LlamaRMSNorm the normalised value is cast
    back to the input dtype *before* the weight multiply, so the result has the promoted dtype
    of (input, weight) -- identical to the pattern it replaces. A plain function so that
    ``torch.compile`` can trace through it (``workbench.ops.inline``).
    """
    x = input.to(torch.float32)
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x.to(input.dtype)


def _torch_rmsnorm_fake(input, weight, eps):
    return input.new_empty(input.shape, dtype=torch.promote_types(input.dtype, weight.dtype))


# The canonical RMSNorm op: ``rmsnorm_reference`` (on the decode hot path: see ops/library.py).
torch_rmsnorm = define_op(
    "torch_rmsnorm(Tensor input, Tensor weight, float eps) -> Tensor",
    rmsnorm_reference,
    _torch_rmsnorm_fake,
    category="norm",
    norm="rms",
    reference=rmsnorm_reference,
)


@workbench_op("torch_l2norm", category="norm", norm="l2")
def torch_l2norm(input: torch.Tensor, eps: float) -> torch.Tensor:
    """``x * rsqrt(sum(x**2, -1) + eps)`` (the L2 normalisation of linear-attention q/k).

    input [..., d] -> [..., d], computed in fp32 and returned in the input dtype.
    """
    x = input.to(torch.float32)
    return (x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)).to(input.dtype)


@torch_l2norm.register_fake
def _torch_l2norm_fake(input, eps):
    return input.new_empty(input.shape)
