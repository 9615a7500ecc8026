"""``workbench::torch_cached_ssm``: the Mamba-2 scan over per-sequence state slots.

One step of continuous batching (the convention of every stateful cached op, ``ops/state.py``):
B sequences, their new tokens back to back in one flattened token dim T -- ``num_prefill`` prefill
sequences of any length first, then one-token decode rows::

    hidden_states [1, T, h, d], B/C [1, T, g, n], dt [1, T, h]     per token (flattened)
    A, D, dt_bias [h]                                              weights, as in torch_ssm
    seq_lens / input_pos / slot_idx [B] int32, num_prefill         step metadata
    ssm_state [num_slots, h, d, n]                                 fp32, updated in place
    -> y [1, T, h, d] in hidden_states' dtype

Sequence i starts from zero when ``input_pos[i] == 0`` -- whatever ``ssm_state[slot_idx[i]]`` holds,
so a reused slot never leaks its previous owner's state -- else from that row; afterwards the row
holds the state after the sequence's last new token. Prefill sequences run the chunked scan one
at a time from their initial state (a chunked prefill continues where the last chunk stopped);
decode rows run one recurrence step together.
"""

from __future__ import annotations

from typing import List, Optional

import torch

from .. import state as state_slots
from ..library import define_op
from ..state import STATE_HOST_SYNC, StatefulOp, StateSpec, check_step_metadata, initial_states, register_stateful_op
from .ssd import discretize_dt, heads_from_groups, ssd_chunked, ssm_step
from .ssm_scan import SSM_OPTIONS, check_ssm_args


def check_ssm_state(hidden_states, B, ssm_state) -> None:
    """``ssm_state`` must be ``[num_slots, heads, head_dim, state]`` for these inputs."""
    _, _, h, d = hidden_states.shape
    state_slots.check_state_shape(
        ssm_state, (h, d, B.shape[-1]), "ssm_state must be [num_slots, heads, head_dim, state]"
    )


def check_cached_ssm_args(
    hidden_states, A, B, C, D, dt, dt_bias, seq_lens, input_pos, slot_idx, num_prefill, ssm_state, chunk_size
) -> List[int]:
    """Validate the cached op's arguments; returns ``seq_lens`` as a host list."""
    check_ssm_args(hidden_states, A, B, C, D, dt, dt_bias, chunk_size)
    if hidden_states.shape[0] != 1:
        raise ValueError(
            f"torch_cached_ssm expects flattened tokens hidden_states [1, T, h, d]; got {tuple(hidden_states.shape)}"
        )
    check_ssm_state(hidden_states, B, ssm_state)
    return check_step_metadata(hidden_states.shape[1], seq_lens, input_pos, slot_idx, num_prefill, "hidden_states")


def _scan_inputs(hidden_states, B, C, dt, dt_bias, a: int, e: int, time_step_min, time_step_max):
    """Tokens ``a:e`` of the flattened step in fp32: x [n, h, d], step [n, h], B/C per head [n, h, n_state]."""
    h = hidden_states.shape[2]
    x = hidden_states[0, a:e].float()
    step = discretize_dt(dt[0, a:e], dt_bias, time_step_min, time_step_max)
    return x, step, heads_from_groups(B[0, a:e], h), heads_from_groups(C[0, a:e], h)


def prefill_rows(
    hidden_states,
    A,
    B,
    C,
    D,
    dt,
    dt_bias,
    lens: List[int],
    input_pos,
    slots,
    num_prefill: int,
    ssm_state,
    time_step_min: float,
    time_step_max: Optional[float],
    chunk_size: int,
    out: torch.Tensor,
) -> int:
    """Sequences ``0..num_prefill-1``, one chunked scan each from their initial state. Writes their
    tokens of ``out [1, T, h, d]`` and their state rows; returns the first token of the decode rows."""
    start = 0
    for i in range(num_prefill):
        end = start + lens[i]
        x, step, Bh, Ch = _scan_inputs(hidden_states, B, C, dt, dt_bias, start, end, time_step_min, time_step_max)
        init = initial_states(ssm_state, slots[i : i + 1], input_pos[i : i + 1], torch.float32)  # [1, h, d, n]
        y, final = ssd_chunked(x[None], step[None], A.float(), Bh[None], Ch[None], chunk_size, initial_state=init)
        out[0, start:end] = y[0] + D.float()[:, None] * x
        ssm_state[slots[i]] = final[0].to(ssm_state.dtype)
        start = end
    return start


def decode_rows(
    hidden_states,
    A,
    B,
    C,
    D,
    dt,
    dt_bias,
    input_pos,
    slots,
    ssm_state,
    time_step_min: float,
    time_step_max: Optional[float],
    out: torch.Tensor,
    first_row: int,
    first_token: int,
) -> None:
    """Decode rows ``first_row..`` (tokens ``first_token..``, one each): one recurrence step for all."""
    x, step, Bh, Ch = _scan_inputs(
        hidden_states, B, C, dt, dt_bias, first_token, hidden_states.shape[1], time_step_min, time_step_max
    )
    decode = slots[first_row:]
    init = initial_states(ssm_state, decode, input_pos[first_row:], torch.float32)  # [Bd, h, d, n]
    y, new_state = ssm_step(init, x, step, A.float(), Bh, Ch)
    out[0, first_token:] = y + D.float()[:, None] * x
    ssm_state.index_copy_(0, decode, new_state.to(ssm_state.dtype))


def torch_cached_ssm(
    hidden_states: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor,
    dt: torch.Tensor,
    dt_bias: torch.Tensor,
    seq_lens: torch.Tensor,
    input_pos: torch.Tensor,
    slot_idx: torch.Tensor,
    num_prefill: int,
    ssm_state: torch.Tensor,
    time_step_min: float = 0.0,
    time_step_max: Optional[float] = None,
    chunk_size: int = 256,
) -> torch.Tensor:
    """One continuous-batching step of the scan; updates ``ssm_state`` in place (module docstring)."""
    lens = check_cached_ssm_args(
        hidden_states, A, B, C, D, dt, dt_bias, seq_lens, input_pos, slot_idx, num_prefill, ssm_state, chunk_size
    )
    slots = slot_idx.long()
    out = torch.empty_like(hidden_states)
    scan = (hidden_states, A, B, C, D, dt, dt_bias)  # what prefill_rows and decode_rows read first
    start = prefill_rows(
        *scan, lens, input_pos, slots, num_prefill, ssm_state, time_step_min, time_step_max, chunk_size, out
    )
    if num_prefill < len(lens):
        decode_rows(*scan, input_pos, slots, ssm_state, time_step_min, time_step_max, out, num_prefill, start)
    return out


def cached_ssm_fake(
    hidden_states,
    A,
    B,
    C,
    D,
    dt,
    dt_bias,
    seq_lens,
    input_pos,
    slot_idx,
    num_prefill,
    ssm_state,
    time_step_min=0.0,
    time_step_max=None,
    chunk_size=256,
):
    """Output of every cached-SSM op: [1, T, h, d] like hidden_states."""
    check_ssm_args(hidden_states, A, B, C, D, dt, dt_bias, chunk_size)
    return hidden_states.new_empty(hidden_states.shape)


#: The schema after the name, shared by every cached-SSM backend op (interchangeable in a graph).
CACHED_SSM_ARGS = (
    "(Tensor hidden_states, Tensor A, Tensor B, Tensor C, Tensor D, Tensor dt, Tensor dt_bias, "
    "Tensor seq_lens, Tensor input_pos, Tensor slot_idx, SymInt num_prefill, Tensor(a!) ssm_state, "
    f"*, {SSM_OPTIONS}) -> Tensor"
)

# ``define_op`` (a Library kernel) rather than ``custom_op``: a mutating custom_op pays ~50-80 us of
# Python argument handling per call (see library.py), a decode step calls this once per SSM layer.
torch_cached_ssm_op = define_op(
    "torch_cached_ssm" + CACHED_SSM_ARGS, torch_cached_ssm, cached_ssm_fake, host_sync=STATE_HOST_SYNC
)


def _ssm_state_shape(args) -> tuple:
    """Per-sequence state [heads, head_dim, state] from the uncached node's hidden_states / B."""
    _, _, h, d = args["hidden_states"].shape
    return (int(h), int(d), int(args["B"].shape[-1]))


SSM_STATEFUL_OP = register_stateful_op(
    StatefulOp(
        source="workbench::torch_ssm",
        cached={"torch": "workbench::torch_cached_ssm", "triton": "workbench::triton_cached_ssm"},
        token_args=("hidden_states", "B", "C", "dt"),
        states=(StateSpec("ssm_state", shape=_ssm_state_shape, dtype=torch.float32),),
        insert_key="insert_cached_ssm_attention",
        description="Mamba-2 SSM state per sequence: [heads, head_dim, state_size], fp32",
        backend_requirements={"triton": "a CUDA device (or TRITON_INTERPRET=1 on CPU, for tests)"},
    )
)

__all__ = [
    "torch_cached_ssm",
    "torch_cached_ssm_op",
    "check_cached_ssm_args",
    "check_ssm_state",
    "prefill_rows",
    "decode_rows",
    "cached_ssm_fake",
    "CACHED_SSM_ARGS",
    "SSM_STATEFUL_OP",
]
