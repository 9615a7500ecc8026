"""Canonical rotary position embedding ops, one per way models spell RoPE.

All three rotate ``q`` and ``k`` together (they share cos/sin, and a fused backend does both in one
pass) and return new tensors. ``unsqueeze_dim`` is where cos/sin get their broadcast head axis,
which makes it the op's layout: with cos/sin ``[b, s, d]``, ``unsqueeze_dim=1`` means q/k are
``[b, n, s, d]`` (bnsd) and ``unsqueeze_dim=2`` means ``[b, s, n, d]`` (bsnd). ``match_rope_layout``
flips it (and transposes around the op) to the layout a backend wants.
"""

from __future__ import annotations

from typing import Tuple

import torch

from ..library import define_op, workbench_op


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """``[x1, x2] -> [-x2, x1]`` over the last dim (the "NeoX" / HF Llama convention)."""
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _rotated(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # Contiguous, so the real output's strides always equal the fake impl's.
    return (x * cos + rotate_half(x) * sin).contiguous()


def _like(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Fake output of ``_rotated``: x's shape, the promoted dtype of the product, contiguous."""
    dtype = torch.promote_types(torch.promote_types(x.dtype, cos.dtype), sin.dtype)
    return x.new_empty(x.shape, dtype=dtype)


def rope_explicit_reference(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, unsqueeze_dim: int = 1
) -> Tuple[torch.Tensor, torch.Tensor]:
    """HF ``apply_rotary_pos_emb``: ``x * cos + rotate_half(x) * sin``.

    q [b, n, s, d] / k [b, n_kv, s, d] (bnsd, ``unsqueeze_dim=1``) or [b, s, n, d] (bsnd, 2);
    cos/sin [b, s, d] -> (q_out, k_out) with q's and k's shapes.
    """
    cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
    return _rotated(q, cos, sin), _rotated(k, cos, sin)


def _explicit_fake(q, k, cos, sin, unsqueeze_dim=1):
    return _like(q, cos, sin), _like(k, cos, sin)


# The canonical RoPE op for explicit cos/sin: ``rope_explicit_reference`` (decode hot path: see
# ops/library.py).
torch_rope_with_explicit_cos_sin = define_op(
    "torch_rope_with_explicit_cos_sin(Tensor q, Tensor k, Tensor cos, Tensor sin, int unsqueeze_dim=1) "
    "-> (Tensor, Tensor)",
    rope_explicit_reference,
    _explicit_fake,
    category="elementwise",
    reference=rope_explicit_reference,
)


def _deinterleave(x: torch.Tensor) -> torch.Tensor:
    """Pairs ``(x0, x1), (x2, x3), ...`` -> ``[x0, x2, ..., x1, x3, ...]`` (last dim)."""
    d = x.shape[-1]
    return x.unflatten(-1, (d // 2, 2)).transpose(-1, -2).reshape(x.shape)


@workbench_op("torch_rope_with_qk_interleaving", category="elementwise")
def torch_rope_with_qk_interleaving(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, unsqueeze_dim: int = 1
) -> Tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-style RoPE: de-interleave the pairs of q/k, then the rotate-half formula.

    Shapes as ``torch_rope_with_explicit_cos_sin``. Note the output stays de-interleaved, exactly
    like the model code (attention is invariant to a shared permutation of q and k dims).
    """
    cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
    return _rotated(_deinterleave(q), cos, sin), _rotated(_deinterleave(k), cos, sin)


@torch_rope_with_qk_interleaving.register_fake
def _interleaving_fake(q, k, cos, sin, unsqueeze_dim=1):
    return _like(q, cos, sin), _like(k, cos, sin)


@workbench_op("torch_rope_with_complex_freqs", category="elementwise")
def torch_rope_with_complex_freqs(
    xq: torch.Tensor, xk: torch.Tensor, freqs_cis: torch.Tensor, unsqueeze_dim: int = 2
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Meta-Llama-style RoPE: pairs of the last dim as complex numbers times ``freqs_cis``.

    xq [b, s, n, d] / xk [b, s, n_kv, d] (bsnd, ``unsqueeze_dim=2``) or bnsd (1); freqs_cis
    complex [b, s, d/2] -> (xq_out, xk_out) in the inputs' dtypes. Computed in fp32.
    """
    freqs = freqs_cis.unsqueeze(unsqueeze_dim)

    def rotate(x: torch.Tensor) -> torch.Tensor:
        xc = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
        return torch.view_as_real(xc * freqs).flatten(-2).to(x.dtype).contiguous()

    return rotate(xq), rotate(xk)


@torch_rope_with_complex_freqs.register_fake
def _complex_fake(xq, xk, freqs_cis, unsqueeze_dim=2):
    return xq.new_empty(xq.shape), xk.new_empty(xk.shape)
