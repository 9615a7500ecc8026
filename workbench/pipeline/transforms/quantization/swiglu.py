"""Quantized SwiGLU patterns (stage ``pattern_matcher``, after the quantized linears exist).

``down(silu(gate(x)) * up(x))`` with all three projections already quantized by
``quantize_nvfp4_linear_from_config`` / ``quantize_finegrained_fp8_linear_from_config`` becomes one
``torch_nvfp4_swiglu_mlp`` / ``torch_finegrained_fp8_swiglu_mlp`` node (a later fused backend's
unit). The ops compute exactly the three linears they replace, so the match changes no value.
Projections with a bias are left alone (the ops take none), as is an MLP whose fine-grained FP8
projections use different block sizes. The unquantized form is ``match_swiglu_pattern``'s.
"""

from __future__ import annotations

from typing import Tuple

import torch
import torch.fx as fx
import torch.nn.functional as F

from .... import ops  # noqa: F401  (registers torch.ops.workbench)
from ....ops.quant.codecs import FP8_E4M3_MAX
from ...context import PipelineContext
from ...interface import Transform, TransformInfo, register
from ...matcher import Pattern, PatternMatcher, match_info

wb = torch.ops.workbench
_H, _I = 32, 16
# Sentinel block sizes: no model uses them, so the trace shows where the block arguments sit.
_BLOCK_N, _BLOCK_K = 131, 127


def _nvfp4_swiglu(x, gw, gis, gws, gws2, uw, uis, uws, uws2, dw, dis, dws, dws2):
    gate = wb.torch_nvfp4_linear.default(x, gw, gis, gws, gws2)
    up = wb.torch_nvfp4_linear.default(x, uw, uis, uws, uws2)
    return wb.torch_nvfp4_linear.default(F.silu(gate) * up, dw, dis, dws, dws2)


def _nvfp4_swiglu_replacement(x, gw, gis, gws, gws2, uw, uis, uws, uws2, dw, dis, dws, dws2):
    return wb.torch_nvfp4_swiglu_mlp.default(x, gw, gis, gws, gws2, uw, uis, uws, uws2, dw, dis, dws, dws2)


def _nvfp4_examples():
    def proj(n, k):  # weight, input_scale, weight_scale, weight_scale_2
        block_scales = torch.full((n, k // 16), 1.0).to(torch.float8_e4m3fn)
        return torch.zeros(n, k // 2, dtype=torch.uint8), torch.tensor(1.0), block_scales, torch.tensor(1.0)

    gw, gis, gws, gws2 = proj(_I, _H)
    uw, uis, uws, uws2 = proj(_I, _H)
    dw, dis, dws, dws2 = proj(_H, _I)
    return (torch.randn(2, 3, _H), gw, gis, gws, gws2, uw, uis, uws, uws2, dw, dis, dws, dws2)


def _fp8_swiglu(x, gw, gs, uw, us, dw, ds, *, block_n, block_k):
    gate = wb.torch_finegrained_fp8_linear.default(x, gw, gs, block_n, block_k)
    up = wb.torch_finegrained_fp8_linear.default(x, uw, us, block_n, block_k)
    return wb.torch_finegrained_fp8_linear.default(F.silu(gate) * up, dw, ds, block_n, block_k)


def _fp8_swiglu_replacement(x, gw, gs, uw, us, dw, ds, *, block_n, block_k):
    return wb.torch_finegrained_fp8_swiglu_mlp.default(x, gw, gs, uw, us, dw, ds, block_n, block_k)


def _fp8_examples():
    def proj(n, k):
        w = (torch.randn(n, k).clamp(-1, 1) * FP8_E4M3_MAX).to(torch.float8_e4m3fn)
        return w, torch.ones(-(-n // _BLOCK_N), -(-k // _BLOCK_K))

    (gw, gs), (uw, us), (dw, ds) = proj(_I, _H), proj(_I, _H), proj(_H, _I)
    return (torch.randn(2, 3, _H), gw, gs, uw, us, dw, ds)


NVFP4_SWIGLU_PATTERNS = (Pattern("nvfp4_swiglu", _nvfp4_swiglu, _nvfp4_swiglu_replacement, _nvfp4_examples),)
FINEGRAINED_FP8_SWIGLU_PATTERNS = (
    Pattern(
        "finegrained_fp8_swiglu",
        _fp8_swiglu,
        _fp8_swiglu_replacement,
        _fp8_examples,
        literals={"block_n": _BLOCK_N, "block_k": _BLOCK_K},
    ),
)


def match_quantized_swiglu(gm, patterns, linear_op, quantize_key: str, checkpoint: str):
    """Run ``patterns`` (three ``linear_op`` nodes around silu * mul -> one quantized SwiGLU op); 0 matches
    come with the reason: no such linears at all (``quantize_key`` did not run or found nothing), or none
    in the SwiGLU shape."""
    name = str(linear_op).rsplit(".", 1)[0].replace("workbench.", "")
    if not any(n.target is linear_op for n in gm.graph.nodes):
        gm, info = match_info(gm, {p.name: 0 for p in patterns})
        return gm, info.model_copy(
            update={"skip_reason": f"no {name} nodes (run {quantize_key} on an {checkpoint} checkpoint first)"}
        )
    gm, info = match_info(gm, PatternMatcher(patterns).apply(gm))
    if info.num_matches:
        return gm, info
    return gm, info.model_copy(
        update={
            "skip_reason": f"no silu(gate) * up MLP of three bias-free {name} nodes "
            "(with the same block sizes) in the graph"
        }
    )


@register("match_nvfp4_swiglu_pattern")
class MatchNvfp4SwigluPattern(Transform):
    """Three NVFP4 linears around silu-and-multiply -> ``torch_nvfp4_swiglu_mlp``."""

    changes_numerics = True  # quantizes: meant to move the logits

    def _apply(self, gm: fx.GraphModule, ctx: PipelineContext) -> Tuple[torch.nn.Module, TransformInfo]:
        return match_quantized_swiglu(
            gm, NVFP4_SWIGLU_PATTERNS, wb.torch_nvfp4_linear.default, "quantize_nvfp4_linear_from_config", "NVFP4"
        )


@register("match_finegrained_fp8_swiglu_pattern")
class MatchFinegrainedFp8SwigluPattern(Transform):
    """Three fine-grained FP8 linears around silu-and-multiply -> ``torch_finegrained_fp8_swiglu_mlp``."""

    changes_numerics = True  # quantizes: meant to move the logits

    def _apply(self, gm: fx.GraphModule, ctx: PipelineContext) -> Tuple[torch.nn.Module, TransformInfo]:
        return match_quantized_swiglu(
            gm,
            FINEGRAINED_FP8_SWIGLU_PATTERNS,
            wb.torch_finegrained_fp8_linear.default,
            "quantize_finegrained_fp8_linear_from_config",
            "FP8_BLOCK",
        )


__all__ = [
    "NVFP4_SWIGLU_PATTERNS",
    "FINEGRAINED_FP8_SWIGLU_PATTERNS",
    "MatchNvfp4SwigluPattern",
    "MatchFinegrainedFp8SwigluPattern",
]
