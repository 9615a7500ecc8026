"""``workbench::torch_rglru``: the RG-LRU recurrence of whole sequences (the uncached op).

What a RecurrentGemma recurrent block computes between its causal conv and the output gate
(``rglru_math.py`` has the formulas)::

    x [b, s, w]                  the conv output (w = lru_width)
    gate_x, gate_a [b, s, w]     input / recurrence gate pre-activations (block-diagonal per-head
                                 projections of x plus bias, computed outside the op by plain torch)
    recurrent_param [w]          learned; the decay is a = exp(-c * sigmoid(gate_a) * softplus(it))
    -> h [b, s, w] in x's dtype  (gates and state in fp32, as HF accumulates)

Token 0 of every row is a sequence start (HF resets where ``position_ids == 0``; the export
contract's positions are ``0..s-1`` per row). Keyword option ``decay_scale`` is Griffin's ``c``
(8 in every RecurrentGemma). Export sees one node; the scan's ``log2(s)`` rounds run where ``s``
is a concrete number.
"""

from __future__ import annotations

import torch

from ..library import define_op
from .rglru_math import DEFAULT_DECAY_SCALE, gates, linear_scan


def check_rglru_args(x, gate_x, gate_a, recurrent_param, op: str = "torch_rglru") -> None:
    """Validate shapes (also at trace time, from the fakes), naming the argument that is off."""
    if x.dim() != 3:
        raise ValueError(f"{op} expects x [b, s, width]; got {tuple(x.shape)}")
    for name, t in (("gate_x", gate_x), ("gate_a", gate_a)):
        if tuple(t.shape) != tuple(x.shape):
            raise ValueError(f"{op} expects {name} shaped like x {tuple(x.shape)}; got {tuple(t.shape)}")
    if tuple(recurrent_param.shape) != (x.shape[-1],):
        raise ValueError(f"{op} expects recurrent_param [width] = [{x.shape[-1]}]; got {tuple(recurrent_param.shape)}")


def torch_rglru(
    x: torch.Tensor,
    gate_x: torch.Tensor,
    gate_a: torch.Tensor,
    recurrent_param: torch.Tensor,
    decay_scale: float = DEFAULT_DECAY_SCALE,
) -> torch.Tensor:
    """The recurrence of whole sequences from a reset at token 0; see the module docstring."""
    check_rglru_args(x, gate_x, gate_a, recurrent_param)
    a, u, u_reset = gates(x, gate_x, gate_a, recurrent_param, decay_scale)
    u = torch.cat([u_reset[:, :1], u[:, 1:]], dim=1)  # token 0: multiplier 1, nothing to decay
    return linear_scan(a, u).to(x.dtype)


def _torch_rglru_fake(x, gate_x, gate_a, recurrent_param, decay_scale=DEFAULT_DECAY_SCALE):
    check_rglru_args(x, gate_x, gate_a, recurrent_param)
    return x.new_empty(x.shape)


# The options after ``*``: the cached ops take the same ones (the state-cache rewrite copies them).
RGLRU_OPTIONS = f"float decay_scale={DEFAULT_DECAY_SCALE}"

torch_rglru_op = define_op(
    f"torch_rglru(Tensor x, Tensor gate_x, Tensor gate_a, Tensor recurrent_param, *, {RGLRU_OPTIONS}) -> Tensor",
    torch_rglru,
    _torch_rglru_fake,
)

__all__ = ["torch_rglru", "torch_rglru_op", "check_rglru_args", "RGLRU_OPTIONS"]
