"""``workbench::torch_ssm`` and its cached forms: the Mamba-2 selective scan (a cached-state kit op).

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

The cached ops (``torch_cached_ssm``, ``triton_cached_ssm``; ``ops/recurrent.py``) keep
``ssm_state [num_slots, h, d, n]`` in fp32: prefill sequences run the chunked scan from their
slot's state, decode rows one recurrence step (``ssd.ssm_step``; the Triton kernel in
``triton_ssm.py``).
"""

from __future__ import annotations

from typing import Optional

import torch

from ..recurrent import Inputs, Options, RecurrentMath, RecurrentOp, RecurrentState, define_recurrent_op
from . import triton_ssm
from .ssd import discretize_dt, heads_from_groups, ssd_chunked, ssm_step


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


def _check(i: Inputs, options: Options) -> None:
    check_ssm_args(i["hidden_states"], i["A"], i["B"], i["C"], i["D"], i["dt"], i["dt_bias"], options["chunk_size"])


def _step_sizes(i: Inputs, options: Options) -> torch.Tensor:
    return discretize_dt(i["dt"], i["dt_bias"], options["time_step_min"], options["time_step_max"])


def _run(i: Inputs, init: Optional[torch.Tensor], options: Options):
    """Whole sequences from ``init [b, h, d, n]`` (None: zeros): the chunked scan (``ssd.py``)."""
    x, h = i["hidden_states"].float(), i["hidden_states"].shape[2]
    B, C = heads_from_groups(i["B"], h), heads_from_groups(i["C"], h)
    y, final = ssd_chunked(x, _step_sizes(i, options), i["A"].float(), B, C, options["chunk_size"], init)
    return y + i["D"].float()[:, None] * x, final


def _step(i: Inputs, held: torch.Tensor, fresh: torch.Tensor, options: Options):
    """One token per row, ``hidden_states [n, h, d]``, from ``held [n, h, d, n_state]``."""
    x, h = i["hidden_states"].float(), i["hidden_states"].shape[1]
    B, C = heads_from_groups(i["B"], h), heads_from_groups(i["C"], h)
    y, new = ssm_step(held.float(), x, _step_sizes(i, options), i["A"].float(), B, C)
    return y + i["D"].float()[:, None] * x, new


def _ssm_state_shape(args) -> tuple:
    """Per-sequence state [heads, head_dim, state] from hidden_states / B."""
    _, _, h, d = args["hidden_states"].shape
    return (int(h), int(d), int(args["B"].shape[-1]))


# The options after ``*`` (the cached ops take the same ones; the state-cache rewrite copies them).
SSM_OPTIONS = "float time_step_min=0.0, float? time_step_max=None, int chunk_size=256"

SSM = define_recurrent_op(
    RecurrentOp(
        name="ssm",
        inputs="Tensor hidden_states, Tensor A, Tensor B, Tensor C, Tensor D, Tensor dt, Tensor dt_bias",
        options=SSM_OPTIONS,
        state=RecurrentState(
            "ssm_state",
            shape=_ssm_state_shape,
            dtype=torch.float32,
            layout="heads, head_dim, state",
            description="Mamba-2 SSM state per sequence: [heads, head_dim, state_size], fp32",
        ),
        token_args=("hidden_states", "B", "C", "dt"),
        insert_key="insert_cached_ssm_attention",
        math=RecurrentMath(check=_check, run=_run, step=_step),
        triton_decode=triton_ssm.decode,
    )
)

__all__ = ["check_ssm_args", "SSM_OPTIONS", "SSM"]
