"""``torch_cached_linear_attention``: one continuous-batching step of decayed linear attention over
per-sequence state slots (the convention of every stateful cached op, ``workbench/ops/state.py``)::

    q/k [1, T, hk, dk], v [1, T, h, dv], g [1, T, h]     B sequences' new tokens back to back
    seq_lens, input_pos, slot_idx [B] int32, num_prefill  prefill sequences first, then 1-token decodes
    linear_attention_state [num_slots, h, dk, dv] (fp32)  the decayed sum of k^T v of each slot
    -> o [1, T, h, dv] in q's dtype

Sequence i starts from a zero state when ``input_pos[i] == 0`` -- whatever its slot holds, so a
reused slot never leaks its previous owner's state -- else from ``state[slot_idx[i]]``; afterwards
that row holds the state after its last new token (written in place). Prefill sequences (chunked
prefill too: ``input_pos > 0`` and several tokens) run the chunked form one sequence at a time; the
decode rows run one vectorised recurrence step together. The state stays fp32 whatever the model
dtype: it sums over the whole sequence (HF keeps MiniMax's in the model dtype; in fp32 the two agree).

``prefill_rows``, the schema and the fake are shared with the Triton backend
(``triton_linear_attention.py``), which runs the decode rows in one kernel.
"""

from __future__ import annotations

from typing import List

import torch

from ..library import define_op
from ..state import (
    STATE_HOST_SYNC,
    StatefulOp,
    StateSpec,
    check_state_shape,
    check_step_metadata,
    initial_states,
    register_stateful_op,
)
from .linear_attention import (
    OPTIONS,
    check_linear_attention_args,
    chunked_linear_attention,
    linear_attention_output_like,
    linear_attention_step,
    prepare,
)


def check_linear_attention_step(q, v, state) -> None:
    """What every cached call must hold, from shapes only: flattened tokens, a state of
    ``[num_slots, value_heads, dk, dv]``."""
    if q.shape[0] != 1:
        raise ValueError(f"cached linear attention expects flattened tokens q/k [1, T, hk, dk]; got {tuple(q.shape)}")
    check_state_shape(
        state, (v.shape[2], q.shape[3], v.shape[3]), "linear attention state must be [num_slots, value_heads, dk, dv]"
    )


def check_cached_linear_attention_args(
    q, k, v, g, seq_lens, input_pos, slot_idx, num_prefill, state, chunk_size: int
) -> List[int]:
    """Validate a cached call; returns ``seq_lens`` as a host list."""
    check_linear_attention_args(q, k, v, g, chunk_size)
    check_linear_attention_step(q, v, state)
    return check_step_metadata(q.shape[1], seq_lens, input_pos, slot_idx, num_prefill, "q")


def prefill_rows(
    q, k, v, g, lens: List[int], input_pos, slots, num_prefill: int, state, out, scale: float, chunk_size: int
) -> int:
    """The prefill sequences ``0..num_prefill-1``, one chunked run each from its slot's state (or
    zero); writes their tokens of ``out [1, T, h, dv]`` and their slots. Returns the first decode
    token's index. Shared by every backend (prefill is long and rare)."""
    if num_prefill == 0:
        return 0
    end = sum(lens[:num_prefill])
    qf, kf, vf, gf = prepare(q[:, :end], k[:, :end], v[:, :end], g[:, :end], scale)  # [1, h, t, d], [1, h, t]
    past = input_pos[:num_prefill].tolist()
    start = 0
    for i in range(num_prefill):
        part = slice(start, start + lens[i])
        init = (
            state[slots[i]].to(torch.float32)[None]
            if past[i] > 0
            else state.new_zeros(1, *state.shape[1:], dtype=torch.float32)
        )
        o, final = chunked_linear_attention(
            qf[:, :, part], kf[:, :, part], vf[:, :, part], gf[:, :, part], init, chunk_size
        )
        out[:, part] = o.transpose(1, 2).to(out.dtype)
        state[slots[i]] = final[0].to(state.dtype)
        start = part.stop
    return end


def decode_rows(q, k, v, g, input_pos, slots, state, out, first: int, scale: float) -> None:
    """Decode sequences ``first..`` (one token each, the last ``Bd`` tokens): one vectorised step."""
    decode = slots[first:]
    tail = slice(q.shape[1] - decode.numel(), q.shape[1])
    qf, kf, vf, gf = (x[0].transpose(0, 1) for x in prepare(q[:, tail], k[:, tail], v[:, tail], g[:, tail], scale))
    init = initial_states(state, decode, input_pos[first:], torch.float32)  # [Bd, h, dk, dv]
    o, new = linear_attention_step(qf, kf, vf, gf, init)
    out[0, tail] = o.to(out.dtype)
    state.index_copy_(0, decode, new.to(state.dtype))


def cached_linear_attention_reference(
    q, k, v, g, seq_lens, input_pos, slot_idx, num_prefill, state, scale: float = 1.0, chunk_size: int = 64
) -> torch.Tensor:
    """One step; updates ``state`` in place (module docstring)."""
    lens = check_cached_linear_attention_args(q, k, v, g, seq_lens, input_pos, slot_idx, num_prefill, state, chunk_size)
    out = linear_attention_output_like(q, v)
    slots = slot_idx.long()
    prefill_rows(q, k, v, g, lens, input_pos, slots, num_prefill, state, out, scale, chunk_size)
    if num_prefill < len(lens):
        decode_rows(q, k, v, g, input_pos, slots, state, out, num_prefill, scale)
    return out


def cached_fake(q, k, v, g, *metadata_and_state, scale=1.0, chunk_size=64):
    check_linear_attention_args(q, k, v, g, chunk_size)
    return linear_attention_output_like(q, v)


# Every backend (torch, triton) shares this schema and fake: interchangeable in a graph.
CACHED_ARGS = (
    "(Tensor q, Tensor k, Tensor v, Tensor g, Tensor seq_lens, Tensor input_pos, Tensor slot_idx, "
    f"SymInt num_prefill, Tensor(a!) linear_attention_state, {OPTIONS}) -> Tensor"
)

# ``define_op`` (a Library kernel), not a mutating custom_op: see torch_cached_delta_rule.py.
torch_cached_linear_attention = define_op(
    "torch_cached_linear_attention" + CACHED_ARGS,
    cached_linear_attention_reference,
    cached_fake,
    host_sync=STATE_HOST_SYNC,
)


def state_shape(args) -> tuple:
    """Per-sequence state of a linear-attention node: ``(value_heads, dk, dv)`` from its fake q and v."""
    return (int(args["v"].shape[2]), int(args["q"].shape[3]), int(args["v"].shape[3]))


# The triton op is defined in triton_linear_attention.py, which the package imports next to this one.
LINEAR_ATTENTION = register_stateful_op(
    StatefulOp(
        source="workbench::torch_linear_attention",
        cached={
            "torch": "workbench::torch_cached_linear_attention",
            "triton": "workbench::triton_cached_linear_attention",
        },
        token_args=("q", "k", "v", "g"),
        states=(StateSpec("linear_attention_state", shape=state_shape, dtype=torch.float32),),
        insert_key="insert_cached_linear_attention",
        description="decayed sum of k^T v, S [value_heads, dk, dv] per sequence (fp32), scaled by exp(g) each token",
        backend_requirements={"triton": "a CUDA device (or TRITON_INTERPRET=1 on CPU, for tests)"},
    )
)

__all__ = [
    "torch_cached_linear_attention",
    "cached_linear_attention_reference",
    "check_cached_linear_attention_args",
    "check_linear_attention_step",
    "prefill_rows",
    "decode_rows",
    "cached_fake",
    "CACHED_ARGS",
    "state_shape",
    "LINEAR_ATTENTION",
]
