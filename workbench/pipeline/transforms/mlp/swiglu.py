"""SwiGLU pattern (stage ``pattern_matcher``): ``match_swiglu_pattern``.

``down(silu(gate(x)) * up(x))`` -- the MLP of Llama-family models -- becomes one
``torch_swiglu_mlp`` node that ``post_load_fusion`` can later turn into a fused gate/up GEMM.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .... import ops  # noqa: F401  (registers torch.ops.workbench)
from ...interface import register
from ...matcher import Pattern, PatternTransform

wb = torch.ops.workbench


def _swiglu(x, gate_weight, up_weight, down_weight):
    return F.linear(F.silu(F.linear(x, gate_weight)) * F.linear(x, up_weight), down_weight)


def _swiglu_replacement(x, gate_weight, up_weight, down_weight):
    return wb.torch_swiglu_mlp.default(x, gate_weight, up_weight, down_weight)


def _swiglu_bias(x, gate_weight, gate_bias, up_weight, up_bias, down_weight, down_bias):
    gate = F.linear(x, gate_weight, gate_bias)
    return F.linear(F.silu(gate) * F.linear(x, up_weight, up_bias), down_weight, down_bias)


def _swiglu_bias_replacement(x, gate_weight, gate_bias, up_weight, up_bias, down_weight, down_bias):
    return wb.torch_swiglu_mlp.default(x, gate_weight, up_weight, down_weight, gate_bias, up_bias, down_bias)


def _examples(bias: bool):
    x, g, u, d = torch.randn(2, 3, 8), torch.randn(16, 8), torch.randn(16, 8), torch.randn(8, 16)
    if not bias:
        return x, g, u, d
    return x, g, torch.randn(16), u, torch.randn(16), d, torch.randn(8)


SWIGLU_PATTERNS = (
    Pattern("swiglu_bias", _swiglu_bias, _swiglu_bias_replacement, lambda: _examples(True)),
    Pattern("swiglu", _swiglu, _swiglu_replacement, lambda: _examples(False)),
)


@register("match_swiglu_pattern")
class MatchSwiGLUPattern(PatternTransform):
    """Replace ``silu(x @ gate.T) * (x @ up.T) @ down.T`` by ``torch_swiglu_mlp``."""

    patterns = SWIGLU_PATTERNS
