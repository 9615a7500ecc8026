"""Normalization patterns (stage ``pattern_matcher``): RMSNorm and L2Norm -> canonical ops.

``match_rmsnorm_pattern`` rewrites HF's RMSNorm chain (cast to fp32, pow/mean/add eps/rsqrt/mul,
cast back, multiply by the weight) to ``workbench::torch_rmsnorm``; ``post_load_fusion`` later
picks a fused backend for it. ``match_l2norm_pattern`` does the same for the L2 normalisation
of linear-attention q/k, and for Llama-4's weightless QK norm (``Llama4TextL2Norm``).

Llama-4 spells both of its norms ``norm(x.float()).type_as(x)`` (``Llama4TextRMSNorm`` then
multiplies by the weight): the ``*_type_as`` patterns. ``Llama4TextL2Norm`` averages rather than
sums (``x * rsqrt(mean(x**2) + eps)``, an RMSNorm without a weight); over a last dim of size D that is
exactly ``sqrt(D) * x * rsqrt(sum(x**2) + D * eps)``, so it becomes ``torch_l2norm(x, D * eps) * sqrt(D)``
(in fp32, cast back to x's dtype as HF does). ``match_rmsnorm_pattern`` runs first and takes the
weighted form, so only the weightless chain is left for ``match_l2norm_pattern``.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Dict, Optional, Tuple

import torch

from .... import ops  # noqa: F401  (registers torch.ops.workbench)
from ...interface import register
from ...matcher import Match, Pattern, PatternTransform

wb = torch.ops.workbench

# Sentinels: values no real model uses, so the traced pattern shows exactly where they sit.
_EPS = 1.2345e-3
_CAST_DTYPE = torch.float16


def _example_norm_inputs():
    return torch.randn(2, 3, 8), torch.randn(8)


def _rmsnorm_with_casts(x, weight, *, eps, out_dtype):
    # HF LlamaRMSNorm.forward (also Mistral, Qwen2/3 incl. q/k norms, Mixtral, SmolLM2).
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(out_dtype)


def _rmsnorm_plain(x, weight, *, eps):
    # The same chain once identity casts are gone (fp32 graphs after cleanup_identity_dtype_cast).
    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def _rmsnorm_type_as(x, weight, *, eps):
    # HF Llama4TextRMSNorm.forward: the normalised fp32 value cast back with ``type_as(x)``.
    h = x.float()
    return h.mul(torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)).type_as(x) * weight


def _rmsnorm_replacement(x, weight, *, eps, out_dtype=None):
    return wb.torch_rmsnorm.default(x, weight, eps)


def _casts_back_to_input_dtype(m: Match):
    # torch_rmsnorm always casts back to the input dtype; a chain ending elsewhere is not ours.
    x = m.val("x")
    return {} if x is not None and m.literals["out_dtype"] == x.dtype else None


def _fp32_input(m: Match):
    # Without casts the chain runs in x's dtype; the op's fp32 statistics equal it only for fp32.
    x = m.val("x")
    return {} if x is not None and x.dtype == torch.float32 else None


RMSNORM_PATTERNS = (
    Pattern(
        "rmsnorm_with_casts",
        _rmsnorm_with_casts,
        _rmsnorm_replacement,
        _example_norm_inputs,
        literals={"eps": _EPS, "out_dtype": _CAST_DTYPE},
        check=_casts_back_to_input_dtype,
        shareable=(torch.ops.aten.to.dtype,),
    ),
    Pattern(
        "rmsnorm_type_as",
        _rmsnorm_type_as,
        _rmsnorm_replacement,
        _example_norm_inputs,
        literals={"eps": _EPS},
        shareable=(torch.ops.aten.to.dtype,),
    ),
    Pattern(
        "rmsnorm", _rmsnorm_plain, _rmsnorm_replacement, _example_norm_inputs, literals={"eps": _EPS}, check=_fp32_input
    ),
)


def _l2norm(x, *, eps):
    # FLA / Qwen3-Next l2norm: x * rsqrt(sum(x*x) + eps) over the last dim.
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def _l2norm_with_casts(x, *, eps, out_dtype):
    h = x.to(torch.float32)
    return (h * torch.rsqrt((h * h).sum(dim=-1, keepdim=True) + eps)).to(out_dtype)


def _l2norm_replacement(x, *, eps, out_dtype=None):
    return wb.torch_l2norm.default(x, eps)


def _rms_l2norm_type_as(x, *, eps):
    # HF Llama4TextL2Norm.forward (Llama-4's QK norm): mean, not sum, and no weight.
    h = x.float()
    return h.mul(torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)).type_as(x)


def _last_dim(m: Match) -> Optional[Dict[str, Any]]:
    # The mean's divisor D (x's last dim) sets the L2 form's eps and scale; it must be static.
    x = m.val("x")
    if x is None or x.dim() == 0 or not isinstance(x.shape[-1], int):
        return None
    return {"dim": x.shape[-1], "dtype": x.dtype}


def _rms_l2norm_replacement(x, *, eps, dim, dtype):
    # x * rsqrt(mean(x**2) + eps) == sqrt(D) * x * rsqrt(sum(x**2) + D * eps), in fp32 like HF.
    h = x if dtype == torch.float32 else x.to(torch.float32)
    y = torch.ops.aten.mul.Tensor(wb.torch_l2norm.default(h, eps * dim), math.sqrt(dim))
    return y if dtype == torch.float32 else y.to(dtype)


def _l2norm_pattern(
    name: str,
    search: Callable[..., Any],
    replace: Callable[..., Any],
    check: Callable[[Match], Optional[Dict[str, Any]]],
    *,
    out_dtype: Optional[torch.dtype] = None,
    shareable: Tuple[Any, ...] = (),
) -> Pattern:
    """One L2Norm pattern, traced on one (2, 3, 8) input with the eps sentinel (and the cast-back
    sentinel ``out_dtype`` for a chain that casts back); they differ only in these arguments."""
    literals: Dict[str, Any] = {"eps": _EPS} if out_dtype is None else {"eps": _EPS, "out_dtype": out_dtype}
    return Pattern(
        name, search, replace, lambda: (torch.randn(2, 3, 8),), literals=literals, check=check, shareable=shareable
    )


L2NORM_PATTERNS = (
    _l2norm_pattern(
        "l2norm_with_casts", _l2norm_with_casts, _l2norm_replacement, _casts_back_to_input_dtype, out_dtype=_CAST_DTYPE
    ),
    _l2norm_pattern("l2norm", _l2norm, _l2norm_replacement, _fp32_input),
    _l2norm_pattern(
        "rms_l2norm_type_as",
        _rms_l2norm_type_as,
        _rms_l2norm_replacement,
        _last_dim,
        shareable=(torch.ops.aten.to.dtype,),
    ),
)


@register("match_rmsnorm_pattern")
class MatchRMSNormPattern(PatternTransform):
    """Replace RMSNorm chains by ``torch_rmsnorm(x, weight, eps)``."""

    patterns = RMSNORM_PATTERNS


@register("match_l2norm_pattern")
class MatchL2NormPattern(PatternTransform):
    """Replace L2Norm chains by ``torch_l2norm(x, eps)``."""

    patterns = L2NORM_PATTERNS
