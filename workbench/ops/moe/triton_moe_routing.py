"""``workbench::triton_moe_topk_softmax``: fused MoE routing (softmax -> top-k -> renormalize).

One program per token row keeps the row's E logits in registers and picks the top k by repeated
argmax (k is small). With ``renormalize`` it never computes the full softmax: the top-k of
softmax(x), renormalised, equals softmax over the top-k logits, because the common denominator
cancels. Same signature and semantics as ``torch_moe_topk_softmax``.

The op is always registered. It runs the Triton kernel when ``is_available(device)`` says so
(CUDA tensors, or CPU tensors under ``TRITON_INTERPRET=1``) and otherwise falls back to the torch
reference, so a graph that uses it runs everywhere.
"""

from __future__ import annotations

from typing import Tuple

import torch

from ..library import workbench_op
from ..triton_support import lazy_kernel
from ..triton_support import triton_available as is_available  # noqa: F401  (public per-op name)
from .torch_moe_routing import torch_moe_topk_softmax


@lazy_kernel
def _kernel():
    """Build the jitted kernel on first use, so importing this module never needs triton; built
    once (a new JITFunction per call would compile -- or load from triton's disk cache -- again)."""
    import triton
    import triton.language as tl

    @triton.jit
    def topk_softmax_kernel(
        logits_ptr,
        weights_ptr,
        indices_ptr,
        n_experts,
        stride_logits,
        stride_out,
        K: tl.constexpr,
        K_PAD: tl.constexpr,
        BLOCK_E: tl.constexpr,
        RENORMALIZE: tl.constexpr,
    ):
        row = tl.program_id(0)
        offs = tl.arange(0, BLOCK_E)
        valid = offs < n_experts
        x = tl.load(logits_ptr + row * stride_logits + offs, mask=valid, other=-float("inf"))
        x = x.to(tl.float32)
        row_max = tl.max(x, axis=0)
        kofs = tl.arange(0, K_PAD)
        top_val = tl.full([K_PAD], -float("inf"), tl.float32)
        top_idx = tl.zeros([K_PAD], tl.int64)
        remaining = x
        for j in tl.static_range(K):
            v = tl.max(remaining, axis=0)
            i = tl.min(tl.where(remaining == v, offs, BLOCK_E), axis=0)  # first index of the max
            top_val = tl.where(kofs == j, v, top_val)
            top_idx = tl.where(kofs == j, i.to(tl.int64), top_idx)
            remaining = tl.where(offs == i, -float("inf"), remaining)
        if RENORMALIZE:
            e = tl.exp(top_val - row_max)  # padded slots are exp(-inf) = 0
            w = e / tl.sum(e, axis=0)
        else:
            w = tl.exp(top_val - row_max) / tl.sum(tl.exp(x - row_max), axis=0)
        out = row * stride_out + kofs
        tl.store(weights_ptr + out, w, mask=kofs < K)
        tl.store(indices_ptr + out, top_idx, mask=kofs < K)

    return topk_softmax_kernel


def triton_topk_softmax(logits: torch.Tensor, k: int, renormalize: bool = True):
    """Launch the kernel: logits [..., E] -> (weights [..., k] fp32, indices [..., k] int64)."""
    import triton

    n_experts = logits.shape[-1]
    flat = logits.reshape(-1, n_experts).contiguous()
    weights = torch.empty(flat.shape[0], k, dtype=torch.float32, device=logits.device)
    indices = torch.empty(flat.shape[0], k, dtype=torch.int64, device=logits.device)
    if flat.shape[0]:
        _kernel()[(flat.shape[0],)](
            flat,
            weights,
            indices,
            n_experts,
            flat.stride(0),
            weights.stride(0),
            K=k,
            K_PAD=triton.next_power_of_2(k),
            BLOCK_E=triton.next_power_of_2(n_experts),
            RENORMALIZE=renormalize,
        )
    shape = (*logits.shape[:-1], k)
    return weights.reshape(shape), indices.reshape(shape)


@workbench_op("triton_moe_topk_softmax", category="moe")
def triton_moe_topk_softmax(
    logits: torch.Tensor, k: int, renormalize: bool = True
) -> Tuple[torch.Tensor, torch.Tensor]:
    if is_available(logits.device)[0]:
        return triton_topk_softmax(logits, k, renormalize)
    weights, indices = torch_moe_topk_softmax(logits, k, renormalize)
    return weights.clone(), indices.clone()  # custom-op outputs must be fresh tensors


@triton_moe_topk_softmax.register_fake
def _triton_moe_topk_softmax_fake(logits, k, renormalize=True):
    shape = (*logits.shape[:-1], k)
    return logits.new_empty(shape, dtype=torch.float32), logits.new_empty(shape, dtype=torch.int64)
