"""``workbench::torch_selective_scan`` and its cached forms: the Mamba-1 scan (a cached-state kit op).

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

The cached ops (``ops/recurrent.py``) keep ``ssm_state [num_slots, d, n]`` in fp32 whatever the
model's dtype: it sums decayed inputs over the whole sequence, and a bf16 state would round every
step's update away against a large held value. Their Triton decode rows run the scan kernel
shared with Mamba-2 (``ops/ssm/triton_ssm.py``, per-channel variant).
"""

from __future__ import annotations

from typing import Optional

import torch

from ..recurrent import Inputs, Options, RecurrentMath, RecurrentOp, RecurrentState, define_recurrent_op
from ..ssm import triton_ssm
from .scan_math import discretize, selective_scan_chunked, selective_step


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


def _check(i: Inputs, options: Options) -> None:
    check_selective_scan_args(
        i["hidden_states"], i["A"], i["B"], i["C"], i["D"], i["dt"], i["dt_bias"], options["chunk_size"]
    )


def _run(i: Inputs, init: Optional[torch.Tensor], options: Options):
    """Whole sequences ``[b, s, d]`` from ``init [b, d, n]`` (None: zeros): the chunked scan."""
    x = i["hidden_states"].float()
    step = discretize(i["dt"], i["dt_bias"])
    y, final = selective_scan_chunked(
        x, step, i["A"].float(), i["B"].float(), i["C"].float(), options["chunk_size"], init
    )
    return y + i["D"].float() * x, final


def _step(i: Inputs, held: torch.Tensor, fresh: torch.Tensor, options: Options):
    """One token per row, ``hidden_states [n, d]``, from ``held [n, d, state]``."""
    x = i["hidden_states"].float()
    y, new = selective_step(
        held.float(), x, discretize(i["dt"], i["dt_bias"]), i["A"].float(), i["B"].float(), i["C"].float()
    )
    return y + i["D"].float() * x, new


def _selective_state_shape(args) -> tuple:
    """Per-sequence state [d, state] from hidden_states [b, s, d] and A [d, state]."""
    return (int(args["hidden_states"].shape[-1]), int(args["A"].shape[-1]))


SELECTIVE_SCAN = define_recurrent_op(
    RecurrentOp(
        name="selective_scan",
        inputs="Tensor hidden_states, Tensor A, Tensor B, Tensor C, Tensor D, Tensor dt, Tensor dt_bias",
        options="int chunk_size=64",
        state=RecurrentState(
            "ssm_state",
            shape=_selective_state_shape,
            dtype=torch.float32,
            layout="d, state",
            description="Mamba-1 selective-scan state per sequence: [inner_width, state_size], fp32",
        ),
        token_args=("hidden_states", "B", "C", "dt"),
        insert_key="insert_cached_ssm_attention",
        math=RecurrentMath(check=_check, run=_run, step=_step),
        triton_decode=triton_ssm.decode_selective,
    )
)

__all__ = ["check_selective_scan_args", "SELECTIVE_SCAN"]
