"""``workbench::torch_selective_scan``: the Mamba-1 selective scan of whole sequences (uncached op).

What a Mamba-1 mixer (Mamba, FalconMamba, Jamba's Mamba layers) computes between its causal conv
and its silu(gate) product::

    hidden_states [b, s, d]   the conv output (d = the mixer's inner width)
    A [d, n]                  negative: -exp(A_log), one decay rate per channel and state entry
    B, C [b, s, n]            input/output projections of the state, shared by all channels
    D [d]                     skip weight
    dt [b, s, d]              raw step sizes: dt_proj's product WITHOUT its bias
    dt_bias [d]               dt_proj's bias (added in fp32 before the softplus, as HF does)
    -> y [b, s, d] in hidden_states' dtype; the scan runs in fp32 (``scan_math.py`` has the math)

``chunk_size`` (keyword) is the block length of the chunked parallel scan: it changes round-off
and peak memory only, never the result. The silu(gate) product stays outside the op, as plain
graph nodes: it needs no state.

Export sees this op as one node (its fake gives the shape); the chunk loop lives in the
implementation, where the sequence length is a concrete number -- HF's own reference path loops
over the tokens in Python, which ``torch.export`` cannot keep dynamic.
"""

from __future__ import annotations

import torch

from ..library import define_op
from .scan_math import discretize, selective_scan_chunked


def check_selective_scan_args(
    hidden_states, A, B, C, D, dt, dt_bias, chunk_size: int, op: str = "torch_selective_scan"
):
    """Validate shapes (also at trace time, from the fakes), naming the argument that is off."""
    if hidden_states.dim() != 3:
        raise ValueError(f"{op} expects hidden_states [b, s, d]; got {tuple(hidden_states.shape)}")
    b, s, d = hidden_states.shape
    if A.dim() != 2 or A.shape[0] != d:
        raise ValueError(f"{op} expects A [d, state] with d = {d}; got {tuple(A.shape)}")
    n = A.shape[1]
    for name, t in (("B", B), ("C", C)):
        if tuple(t.shape) != (b, s, n):
            raise ValueError(f"{op} expects {name} [b, s, state] = [{b}, {s}, {n}]; got {tuple(t.shape)}")
    if tuple(dt.shape) != (b, s, d):
        raise ValueError(f"{op} expects dt [b, s, d] = [{b}, {s}, {d}]; got {tuple(dt.shape)}")
    for name, t in (("D", D), ("dt_bias", dt_bias)):
        if tuple(t.shape) != (d,):
            raise ValueError(f"{op} expects {name} [d] = [{d}]; got {tuple(t.shape)}")
    if chunk_size < 1:
        raise ValueError(f"{op} chunk_size must be >= 1; got {chunk_size}")


def torch_selective_scan(
    hidden_states: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor,
    dt: torch.Tensor,
    dt_bias: torch.Tensor,
    chunk_size: int = 64,
) -> torch.Tensor:
    """The scan of whole sequences from a zero state; see the module docstring."""
    check_selective_scan_args(hidden_states, A, B, C, D, dt, dt_bias, chunk_size)
    x = hidden_states.float()
    y, _ = selective_scan_chunked(x, discretize(dt, dt_bias), A.float(), B.float(), C.float(), chunk_size)
    return (y + D.float() * x).to(hidden_states.dtype)


def _torch_selective_scan_fake(hidden_states, A, B, C, D, dt, dt_bias, chunk_size=64):
    check_selective_scan_args(hidden_states, A, B, C, D, dt, dt_bias, chunk_size)
    return hidden_states.new_empty(hidden_states.shape)


# The options after ``*``: the cached ops take the same ones (the state-cache rewrite copies them).
SELECTIVE_SCAN_OPTIONS = "int chunk_size=64"

torch_selective_scan_op = define_op(
    "torch_selective_scan(Tensor hidden_states, Tensor A, Tensor B, Tensor C, Tensor D, Tensor dt, "
    f"Tensor dt_bias, *, {SELECTIVE_SCAN_OPTIONS}) -> Tensor",
    torch_selective_scan,
    _torch_selective_scan_fake,
)

__all__ = ["torch_selective_scan", "torch_selective_scan_op", "check_selective_scan_args", "SELECTIVE_SCAN_OPTIONS"]
