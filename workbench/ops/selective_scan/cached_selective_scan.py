"""``workbench::torch_cached_selective_scan``: the Mamba-1 scan over per-sequence state slots.

One step of continuous batching (the convention of every stateful cached op, ``ops/state.py``):
B sequences, their new tokens back to back in one flattened token dim T -- ``num_prefill`` prefill
sequences of any length first, then one-token decode rows::

    hidden_states [1, T, d], B/C [1, T, n], dt [1, T, d]     per token (flattened)
    A [d, n], D, dt_bias [d]                                  weights, as in torch_selective_scan
    seq_lens / input_pos / slot_idx [B] int32, num_prefill    step metadata
    ssm_state [num_slots, d, n]                               fp32, updated in place
    -> y [1, T, d] in hidden_states' dtype

Sequence i starts from zero when ``input_pos[i] == 0`` -- whatever ``ssm_state[slot_idx[i]]`` holds,
so a reused slot never leaks its previous owner's state -- else from that row; afterwards the row
holds the state after the sequence's last new token. Prefill sequences run the chunked scan one at
a time from their initial state (a chunked prefill continues where the last chunk stopped); decode
rows run one recurrence step together.

The state is fp32 whatever the model's dtype: it sums decayed inputs over the whole sequence, and
a bf16 state would round every step's update away against a large held value.
"""

from __future__ import annotations

from typing import List

import torch

from .. import state as state_slots
from ..library import define_op
from ..state import STATE_HOST_SYNC, StatefulOp, StateSpec, check_step_metadata, initial_states, register_stateful_op
from .scan_math import discretize, selective_scan_chunked, selective_step
from .selective_scan import SELECTIVE_SCAN_OPTIONS, check_selective_scan_args


def check_selective_state(hidden_states, A, ssm_state) -> None:
    """``ssm_state`` must be ``[num_slots, d, state]`` for these inputs."""
    state_slots.check_state_shape(
        ssm_state, (hidden_states.shape[-1], A.shape[-1]), "ssm_state must be [num_slots, d, state]"
    )


def check_cached_selective_scan_args(
    hidden_states, A, B, C, D, dt, dt_bias, seq_lens, input_pos, slot_idx, num_prefill, ssm_state, chunk_size
) -> List[int]:
    """Validate the cached op's arguments; returns ``seq_lens`` as a host list."""
    check_selective_scan_args(hidden_states, A, B, C, D, dt, dt_bias, chunk_size, "torch_cached_selective_scan")
    if hidden_states.shape[0] != 1:
        raise ValueError(
            "torch_cached_selective_scan expects flattened tokens hidden_states [1, T, d]; "
            f"got {tuple(hidden_states.shape)}"
        )
    check_selective_state(hidden_states, A, ssm_state)
    return check_step_metadata(hidden_states.shape[1], seq_lens, input_pos, slot_idx, num_prefill, "hidden_states")


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
    chunk_size: int,
    out: torch.Tensor,
) -> int:
    """Sequences ``0..num_prefill-1``, one chunked scan each from their initial state. Writes their
    tokens of ``out [1, T, d]`` and their state rows; returns the first token of the decode rows."""
    start = 0
    for i in range(num_prefill):
        end = start + lens[i]
        x = hidden_states[0, start:end].float()[None]  # [1, s, d]
        step = discretize(dt[0, start:end], dt_bias)[None]
        init = initial_states(ssm_state, slots[i : i + 1], input_pos[i : i + 1], torch.float32)  # [1, d, n]
        y, final = selective_scan_chunked(
            x, step, A.float(), B[0, start:end].float()[None], C[0, start:end].float()[None], chunk_size, init
        )
        out[0, start:end] = (y[0] + D.float() * x[0]).to(out.dtype)
        ssm_state[slots[i]] = final[0].to(ssm_state.dtype)
        start = end
    return start


def decode_rows(hidden_states, A, B, C, D, dt, dt_bias, input_pos, slots, ssm_state, out, first_row, first_token):
    """Decode rows ``first_row..`` (tokens ``first_token..``, one each): one recurrence step for all."""
    x = hidden_states[0, first_token:].float()  # [Bd, d]
    step = discretize(dt[0, first_token:], dt_bias)
    decode = slots[first_row:]
    init = initial_states(ssm_state, decode, input_pos[first_row:], torch.float32)  # [Bd, d, n]
    y, new_state = selective_step(init, x, step, A.float(), B[0, first_token:].float(), C[0, first_token:].float())
    out[0, first_token:] = (y + D.float() * x).to(out.dtype)
    ssm_state.index_copy_(0, decode, new_state.to(ssm_state.dtype))


def torch_cached_selective_scan(
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
    chunk_size: int = 64,
) -> torch.Tensor:
    """One continuous-batching step of the scan; updates ``ssm_state`` in place (module docstring)."""
    lens = check_cached_selective_scan_args(
        hidden_states, A, B, C, D, dt, dt_bias, seq_lens, input_pos, slot_idx, num_prefill, ssm_state, chunk_size
    )
    slots = slot_idx.long()
    out = torch.empty_like(hidden_states)
    scan = (hidden_states, A, B, C, D, dt, dt_bias)
    start = prefill_rows(*scan, lens, input_pos, slots, num_prefill, ssm_state, chunk_size, out)
    if num_prefill < len(lens):
        decode_rows(*scan, input_pos, slots, ssm_state, out, num_prefill, start)
    return out


def cached_selective_scan_fake(
    hidden_states, A, B, C, D, dt, dt_bias, seq_lens, input_pos, slot_idx, num_prefill, ssm_state, chunk_size=64
):
    """Output of every cached selective-scan op: [1, T, d] like hidden_states."""
    check_selective_scan_args(hidden_states, A, B, C, D, dt, dt_bias, chunk_size, "torch_cached_selective_scan")
    return hidden_states.new_empty(hidden_states.shape)


#: The schema after the name, shared by every cached selective-scan backend (interchangeable in a graph).
CACHED_SELECTIVE_SCAN_ARGS = (
    "(Tensor hidden_states, Tensor A, Tensor B, Tensor C, Tensor D, Tensor dt, Tensor dt_bias, "
    "Tensor seq_lens, Tensor input_pos, Tensor slot_idx, SymInt num_prefill, Tensor(a!) ssm_state, "
    f"*, {SELECTIVE_SCAN_OPTIONS}) -> Tensor"
)

# ``define_op`` (a Library kernel) rather than ``custom_op``: a mutating custom_op pays ~50-80 us of
# Python argument handling per call (see library.py), a decode step calls this once per Mamba layer.
torch_cached_selective_scan_op = define_op(
    "torch_cached_selective_scan" + CACHED_SELECTIVE_SCAN_ARGS,
    torch_cached_selective_scan,
    cached_selective_scan_fake,
    host_sync=STATE_HOST_SYNC,
)


def _selective_state_shape(args) -> tuple:
    """Per-sequence state [d, state] from the uncached node's hidden_states [b, s, d] and A [d, state]."""
    return (int(args["hidden_states"].shape[-1]), int(args["A"].shape[-1]))


SELECTIVE_SCAN_STATEFUL_OP = register_stateful_op(
    StatefulOp(
        source="workbench::torch_selective_scan",
        cached={"torch": "workbench::torch_cached_selective_scan", "triton": "workbench::triton_cached_selective_scan"},
        token_args=("hidden_states", "B", "C", "dt"),
        states=(StateSpec("ssm_state", shape=_selective_state_shape, dtype=torch.float32),),
        insert_key="insert_cached_ssm_attention",
        description="Mamba-1 selective-scan state per sequence: [inner_width, state_size], fp32",
        backend_requirements={"triton": "a CUDA device (or TRITON_INTERPRET=1 on CPU, for tests)"},
    )
)

__all__ = [
    "torch_cached_selective_scan",
    "torch_cached_selective_scan_op",
    "check_cached_selective_scan_args",
    "check_selective_state",
    "prefill_rows",
    "decode_rows",
    "cached_selective_scan_fake",
    "CACHED_SELECTIVE_SCAN_ARGS",
    "SELECTIVE_SCAN_STATEFUL_OP",
]
