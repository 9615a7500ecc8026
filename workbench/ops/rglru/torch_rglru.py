"""``workbench::torch_rglru`` and its cached forms: the RG-LRU recurrence (a cached-state kit op).

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

The cached ops (``ops/recurrent.py``) keep ``rglru_state [num_slots, w]`` in fp32. Sequence i is a
new sequence when ``input_pos[i] == 0``: it starts from zero whatever its slot holds and its first
token takes multiplier 1 (HF's reset at position 0); otherwise it continues from its slot. The
"is it new" tests of the decode rows stay on the device (``torch.where``); the Triton decode
kernel is in ``triton_rglru.py``.
"""

from __future__ import annotations

from typing import Optional

import torch

from ..recurrent import Inputs, Options, RecurrentMath, RecurrentOp, RecurrentState, define_recurrent_op

# The whole-sequence scan over ``[N, s, w]`` (``h_t = a_t h_{t-1} + u_t`` in log2(s) rounds, where
# HF loops over the tokens) is the Mamba-1 chunks' scan.
from ..selective_scan.scan_math import linear_scan
from . import triton_rglru
from .rglru_math import DEFAULT_DECAY_SCALE, gates


def check_rglru_args(x, gate_x, gate_a, recurrent_param, op: str = "torch_rglru") -> None:
    """Validate shapes (also at trace time, from the fakes), naming the argument that is off."""
    if x.dim() != 3:
        raise ValueError(f"{op} expects x [b, s, width]; got {tuple(x.shape)}")
    for name, t in (("gate_x", gate_x), ("gate_a", gate_a)):
        if tuple(t.shape) != tuple(x.shape):
            raise ValueError(f"{op} expects {name} shaped like x {tuple(x.shape)}; got {tuple(t.shape)}")
    if tuple(recurrent_param.shape) != (x.shape[-1],):
        raise ValueError(f"{op} expects recurrent_param [width] = [{x.shape[-1]}]; got {tuple(recurrent_param.shape)}")


def _check(i: Inputs, options: Options) -> None:
    check_rglru_args(i["x"], i["gate_x"], i["gate_a"], i["recurrent_param"])


def _gates(i: Inputs, options: Options):
    return gates(i["x"], i["gate_x"], i["gate_a"], i["recurrent_param"], options["decay_scale"])


def _run(i: Inputs, init: Optional[torch.Tensor], options: Options):
    """Whole sequences ``[b, s, w]``: from a reset (``init`` None: token 0 takes multiplier 1,
    nothing to decay) or continuing from ``init [b, w]``."""
    a, u, u_reset = _gates(i, options)
    if init is None:
        u = torch.cat([u_reset[:, :1], u[:, 1:]], dim=1)
    h = linear_scan(a, u, None if init is None else init.float())  # [b, s, w]
    return h, h[:, -1]


def _step(i: Inputs, held: torch.Tensor, fresh: torch.Tensor, options: Options):
    """One token per row, ``x [n, w]``: ``h = a * held + u`` (``u_reset`` for a new sequence)."""
    a, u, u_reset = _gates(i, options)
    h = a * held.float() + torch.where(fresh[:, None], u_reset, u)
    return h, h


def _rglru_state_shape(args) -> tuple:
    """Per-sequence state [width] from x."""
    return (int(args["x"].shape[-1]),)


RGLRU = define_recurrent_op(
    RecurrentOp(
        name="rglru",
        inputs="Tensor x, Tensor gate_x, Tensor gate_a, Tensor recurrent_param",
        options=f"float decay_scale={DEFAULT_DECAY_SCALE}",
        state=RecurrentState(
            "rglru_state",
            shape=_rglru_state_shape,
            dtype=torch.float32,
            layout="width",
            description="RG-LRU recurrent state per sequence: [lru_width], fp32",
        ),
        token_args=("x", "gate_x", "gate_a"),
        insert_key="insert_cached_ssm_attention",
        math=RecurrentMath(check=_check, run=_run, step=_step),
        triton_decode=triton_rglru.decode,
    )
)

__all__ = ["check_rglru_args", "RGLRU"]
