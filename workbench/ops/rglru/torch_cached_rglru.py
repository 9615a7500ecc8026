"""``workbench::torch_cached_rglru``: the RG-LRU recurrence over per-sequence state slots.

One step of continuous batching (the convention of every stateful cached op, ``ops/state.py``):
B sequences, their new tokens back to back in one flattened token dim T -- ``num_prefill`` prefill
sequences of any length first, then one-token decode rows::

    x, gate_x, gate_a [1, T, w]                     per token (flattened)
    recurrent_param [w]                             weight, as in torch_rglru
    seq_lens / input_pos / slot_idx [B] int32, num_prefill     step metadata
    rglru_state [num_slots, w]                      fp32, updated in place
    -> h [1, T, w] in x's dtype

Sequence i is a new sequence when ``input_pos[i] == 0``: it starts from zero whatever
``rglru_state[slot_idx[i]]`` holds (a reused slot never leaks) and its first token takes
multiplier 1 (HF's reset at position 0); otherwise it continues from that row. Afterwards the row
holds the state after the sequence's last new token. Prefill sequences run the scan one at a time
from their initial state (a chunked prefill continues where the last chunk stopped); decode rows
run one step together. The "is it new" tests stay on the device (``torch.where``), so decode rows
read nothing on the host; only prefill's per-sequence loop reads ``seq_lens``.
"""

from __future__ import annotations

from typing import List

import torch

from .. import state as state_slots
from ..library import define_op
from ..state import STATE_HOST_SYNC, StatefulOp, StateSpec, check_step_metadata, initial_states, register_stateful_op
from .rglru_math import DEFAULT_DECAY_SCALE, gates, linear_scan
from .torch_rglru import RGLRU_OPTIONS, check_rglru_args


def check_rglru_state(x, rglru_state) -> None:
    """``rglru_state`` must be ``[num_slots, width]`` for these inputs."""
    state_slots.check_state_shape(rglru_state, (x.shape[-1],), "rglru_state must be [num_slots, width]")


def check_cached_rglru_args(
    x, gate_x, gate_a, recurrent_param, seq_lens, input_pos, slot_idx, num_prefill, rglru_state, op: str
) -> List[int]:
    """Validate the cached op's arguments; returns ``seq_lens`` as a host list."""
    check_rglru_args(x, gate_x, gate_a, recurrent_param, op)
    if x.shape[0] != 1:
        raise ValueError(f"{op} expects flattened tokens x [1, T, width]; got {tuple(x.shape)}")
    check_rglru_state(x, rglru_state)
    return check_step_metadata(x.shape[1], seq_lens, input_pos, slot_idx, num_prefill, "x")


def _first_input(u: torch.Tensor, u_reset: torch.Tensor, fresh: torch.Tensor) -> torch.Tensor:
    """The normalised input of each sequence's first new token: ``u_reset`` (multiplier 1) for a new
    sequence (``fresh``, a device bool broadcastable to ``u``), ``u`` for a continuing one."""
    return torch.where(fresh, u_reset, u)


def prefill_rows(
    x,
    gate_x,
    gate_a,
    recurrent_param,
    lens: List[int],
    input_pos,
    slots,
    num_prefill: int,
    rglru_state,
    decay_scale: float,
    out: torch.Tensor,
) -> int:
    """Sequences ``0..num_prefill-1``, one scan each from their initial state. Writes their tokens of
    ``out [1, T, w]`` and their state rows; returns the first token of the decode rows."""
    start = 0
    for i in range(num_prefill):
        end = start + lens[i]
        if end > start:
            a, u, u_reset = gates(
                x[:, start:end], gate_x[:, start:end], gate_a[:, start:end], recurrent_param, decay_scale
            )
            fresh = input_pos[i : i + 1] <= 0  # [1]
            u = torch.cat([_first_input(u[:, :1], u_reset[:, :1], fresh), u[:, 1:]], dim=1)
            h0 = initial_states(rglru_state, slots[i : i + 1], input_pos[i : i + 1], torch.float32)  # [1, w]
            h = linear_scan(a, u, h0)  # [1, s_i, w]
            out[:, start:end] = h.to(out.dtype)
            rglru_state[slots[i]] = h[0, -1].to(rglru_state.dtype)
        start = end
    return start


def decode_rows(
    x, gate_x, gate_a, recurrent_param, input_pos, slots, rglru_state, decay_scale: float, first_token: int
) -> torch.Tensor:
    """The decode rows (tokens ``first_token..``, one per row; ``input_pos``, ``slots`` theirs): one
    step for all, ``h = a * h0 + u``. Writes their state rows; returns ``h [Bd, w]`` in fp32."""
    a, u, u_reset = gates(
        x[0, first_token:], gate_x[0, first_token:], gate_a[0, first_token:], recurrent_param, decay_scale
    )
    h0 = initial_states(rglru_state, slots, input_pos, torch.float32)  # [Bd, w], zero for new sequences
    h = a * h0 + _first_input(u, u_reset, (input_pos <= 0)[:, None])
    rglru_state.index_copy_(0, slots, h.to(rglru_state.dtype))
    return h


def torch_cached_rglru(
    x: torch.Tensor,
    gate_x: torch.Tensor,
    gate_a: torch.Tensor,
    recurrent_param: torch.Tensor,
    seq_lens: torch.Tensor,
    input_pos: torch.Tensor,
    slot_idx: torch.Tensor,
    num_prefill: int,
    rglru_state: torch.Tensor,
    decay_scale: float = DEFAULT_DECAY_SCALE,
) -> torch.Tensor:
    """One continuous-batching step of the recurrence; updates ``rglru_state`` in place (module docstring)."""
    lens = check_cached_rglru_args(
        x,
        gate_x,
        gate_a,
        recurrent_param,
        seq_lens,
        input_pos,
        slot_idx,
        num_prefill,
        rglru_state,
        "torch_cached_rglru",
    )
    slots = slot_idx.long()
    out = torch.empty_like(x)
    args = (x, gate_x, gate_a, recurrent_param)
    start = prefill_rows(*args, lens, input_pos, slots, num_prefill, rglru_state, decay_scale, out)
    if num_prefill < len(lens):
        h = decode_rows(*args, input_pos[num_prefill:], slots[num_prefill:], rglru_state, decay_scale, start)
        out[0, start:] = h.to(out.dtype)
    return out


def cached_rglru_fake(
    x, gate_x, gate_a, recurrent_param, seq_lens, input_pos, slot_idx, num_prefill, rglru_state, decay_scale=8.0
):
    """Output of every cached RG-LRU op: [1, T, w] like x."""
    check_rglru_args(x, gate_x, gate_a, recurrent_param)
    return x.new_empty(x.shape)


#: The schema after the name, shared by every cached RG-LRU backend op (interchangeable in a graph).
CACHED_RGLRU_ARGS = (
    "(Tensor x, Tensor gate_x, Tensor gate_a, Tensor recurrent_param, "
    "Tensor seq_lens, Tensor input_pos, Tensor slot_idx, SymInt num_prefill, Tensor(a!) rglru_state, "
    f"*, {RGLRU_OPTIONS}) -> Tensor"
)

# ``define_op`` (a Library kernel) rather than ``custom_op``: a mutating custom_op pays ~50-80 us of
# Python argument handling per call (see library.py); a decode step calls this once per recurrent layer.
torch_cached_rglru_op = define_op(
    "torch_cached_rglru" + CACHED_RGLRU_ARGS, torch_cached_rglru, cached_rglru_fake, host_sync=STATE_HOST_SYNC
)


def _rglru_state_shape(args) -> tuple:
    """Per-sequence state [width] from the uncached node's x."""
    return (int(args["x"].shape[-1]),)


RGLRU_STATEFUL_OP = register_stateful_op(
    StatefulOp(
        source="workbench::torch_rglru",
        cached={"torch": "workbench::torch_cached_rglru", "triton": "workbench::triton_cached_rglru"},
        token_args=("x", "gate_x", "gate_a"),
        states=(StateSpec("rglru_state", shape=_rglru_state_shape, dtype=torch.float32),),
        insert_key="insert_cached_ssm_attention",
        description="RG-LRU recurrent state per sequence: [lru_width], fp32",
        backend_requirements={"triton": "a CUDA device (or TRITON_INTERPRET=1 on CPU, for tests)"},
    )
)

__all__ = [
    "torch_cached_rglru",
    "torch_cached_rglru_op",
    "check_cached_rglru_args",
    "check_rglru_state",
    "prefill_rows",
    "decode_rows",
    "cached_rglru_fake",
    "CACHED_RGLRU_ARGS",
    "RGLRU_STATEFUL_OP",
]
