"""``workbench::torch_ssm``: the Mamba-2 selective scan of whole sequences (the uncached op).

What a Mamba-2 mixer computes between its causal conv and its gated norm::

    hidden_states [b, s, h, d]   the conv output's x part, split into h heads of d channels
    A [h]                        negative: -exp(A_log)
    B, C [b, s, g, n]            input/output projections of the state, g groups (h % g == 0)
    D [h]                        skip weight
    dt [b, s, h]                 raw step sizes (before softplus)
    dt_bias [h]
    -> y [b, s, h, d] in hidden_states' dtype (the scan runs in fp32; see ``ssd.py`` for the math)

Keyword options mirror the model: ``time_step_min`` / ``time_step_max`` clamp the discretized
step exactly like HF's ``time_step_limit`` (``None``: no upper limit; a schema default cannot be
``inf``), ``chunk_size`` is the block length of the chunked computation (it changes round-off
only, never the result).

Export sees this op as one node (its fake gives the shape); the padding to whole chunks and the
chunk loop live in the implementation, where the sequence length is a concrete number.
"""

from __future__ import annotations

from typing import Optional

import torch

from ..library import define_op
from .ssd import discretize_dt, heads_from_groups, ssd_chunked


def check_ssm_args(hidden_states, A, B, C, D, dt, dt_bias, chunk_size: int) -> None:
    """Validate shapes (also at trace time, from the fakes), naming the argument that is off."""
    if hidden_states.dim() != 4:
        raise ValueError(f"torch_ssm expects hidden_states [b, s, heads, head_dim]; got {tuple(hidden_states.shape)}")
    b, s, h, _ = hidden_states.shape
    if B.dim() != 4 or C.dim() != 4 or tuple(B.shape[:2]) != (b, s) or B.shape != C.shape:
        raise ValueError(
            f"torch_ssm expects B and C [b, s, groups, state] matching hidden_states' [b, s] = "
            f"[{b}, {s}]; got B {tuple(B.shape)}, C {tuple(C.shape)}"
        )
    if h % B.shape[2]:
        raise ValueError(f"torch_ssm: {h} heads cannot share {B.shape[2]} groups of B/C (heads % groups != 0)")
    if tuple(dt.shape) != (b, s, h):
        raise ValueError(f"torch_ssm expects dt [b, s, heads] = [{b}, {s}, {h}]; got {tuple(dt.shape)}")
    for name, t in (("A", A), ("D", D), ("dt_bias", dt_bias)):
        if tuple(t.shape) != (h,):
            raise ValueError(f"torch_ssm expects {name} [heads] = [{h}]; got {tuple(t.shape)}")
    if chunk_size < 1:
        raise ValueError(f"torch_ssm chunk_size must be >= 1; got {chunk_size}")


def torch_ssm(
    hidden_states: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor,
    dt: torch.Tensor,
    dt_bias: torch.Tensor,
    time_step_min: float = 0.0,
    time_step_max: Optional[float] = None,
    chunk_size: int = 256,
) -> torch.Tensor:
    """The scan of whole sequences starting from a zero state; see the module docstring."""
    check_ssm_args(hidden_states, A, B, C, D, dt, dt_bias, chunk_size)
    h = hidden_states.shape[2]
    x = hidden_states.float()
    step = discretize_dt(dt, dt_bias, time_step_min, time_step_max)
    y, _ = ssd_chunked(x, step, A.float(), heads_from_groups(B, h), heads_from_groups(C, h), chunk_size)
    return (y + D.float()[:, None] * x).to(hidden_states.dtype)


def _torch_ssm_fake(hidden_states, A, B, C, D, dt, dt_bias, time_step_min=0.0, time_step_max=None, chunk_size=256):
    check_ssm_args(hidden_states, A, B, C, D, dt, dt_bias, chunk_size)
    return hidden_states.new_empty(hidden_states.shape)


# The options after ``*``: the cached op takes the same ones (the state-cache rewrite copies them).
SSM_OPTIONS = "float time_step_min=0.0, float? time_step_max=None, int chunk_size=256"

torch_ssm_op = define_op(
    "torch_ssm(Tensor hidden_states, Tensor A, Tensor B, Tensor C, Tensor D, Tensor dt, Tensor dt_bias, "
    f"*, {SSM_OPTIONS}) -> Tensor",
    torch_ssm,
    _torch_ssm_fake,
)

__all__ = ["torch_ssm", "torch_ssm_op", "check_ssm_args", "SSM_OPTIONS"]
