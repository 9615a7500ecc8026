"""``workbench::torch_gated_delta_rule`` and ``workbench::torch_delta_rule``: uncached, whole sequences.

::

    q/k [b, s, hk, dk], v [b, s, h, dv] (h % hk == 0: value head j reads q/k head j // (h // hk))
    g [b, s, h]        log decay per token and value head, <= 0 (gated variant only)
    beta [b, s, h]     the delta rule's learning rate, usually sigmoid(...) in (0, 1)
    -> o [b, s, h, dv] in q's dtype

Every sequence starts from a zero state; the recurrence is in ``delta_rule_math`` (computed in
fp32). Options: ``scale`` multiplies q (None: ``dk ** -0.5``, what Qwen3-Next and FLA use),
``use_qk_l2norm`` L2-normalises q and k first (eps 1e-6, in fp32, as FLA's
``use_qk_l2norm_in_kernel``), ``chunk_size`` is the chunked form's block length (a speed knob:
every value gives the recurrence's result to fp32 round-off).

These are what the canonical export-time forwards (``workbench.models.canonical.delta_rule``)
call; the cache stage rewrites them into ``torch_cached_*`` (``torch_cached_delta_rule.py``).
"""

from __future__ import annotations

from typing import Optional

import torch

from ..library import define_op
from .delta_rule_math import check_delta_rule_args, chunked_delta_rule, prepare


def delta_rule_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: Optional[torch.Tensor],
    beta: torch.Tensor,
    scale: Optional[float] = None,
    use_qk_l2norm: bool = False,
    chunk_size: int = 64,
) -> torch.Tensor:
    """The (gated when ``g`` is given) delta rule of whole sequences from a zero state, chunked."""
    check_delta_rule_args(q, k, v, g, beta, chunk_size)
    qf, kf, vf, gf, bf = prepare(q, k, v, g, beta, scale, use_qk_l2norm)
    b, h = vf.shape[:2]
    state = vf.new_zeros(b, h, kf.shape[-1], vf.shape[-1])
    out, _ = chunked_delta_rule(qf, kf, vf, gf, bf, state, chunk_size)
    return out.transpose(1, 2).to(q.dtype).contiguous()


def delta_rule_output_like(q: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """An empty output: v's shape (per-token value heads), q's dtype."""
    return v.new_empty(v.shape, dtype=q.dtype)


def _gated(q, k, v, g, beta, scale=None, use_qk_l2norm=False, chunk_size=64):
    return delta_rule_reference(q, k, v, g, beta, scale, use_qk_l2norm, chunk_size)


def _gated_fake(q, k, v, g, beta, scale=None, use_qk_l2norm=False, chunk_size=64):
    check_delta_rule_args(q, k, v, g, beta, chunk_size)
    return delta_rule_output_like(q, v)


def _plain(q, k, v, beta, scale=None, use_qk_l2norm=False, chunk_size=64):
    return delta_rule_reference(q, k, v, None, beta, scale, use_qk_l2norm, chunk_size)


def _plain_fake(q, k, v, beta, scale=None, use_qk_l2norm=False, chunk_size=64):
    check_delta_rule_args(q, k, v, None, beta, chunk_size)
    return delta_rule_output_like(q, v)


OPTIONS = "*, float? scale=None, bool use_qk_l2norm=False, int chunk_size=64"

torch_gated_delta_rule = define_op(
    f"torch_gated_delta_rule(Tensor q, Tensor k, Tensor v, Tensor g, Tensor beta, {OPTIONS}) -> Tensor",
    _gated,
    _gated_fake,
)
torch_delta_rule = define_op(
    f"torch_delta_rule(Tensor q, Tensor k, Tensor v, Tensor beta, {OPTIONS}) -> Tensor", _plain, _plain_fake
)

__all__ = ["torch_gated_delta_rule", "torch_delta_rule", "delta_rule_reference", "delta_rule_output_like", "OPTIONS"]
