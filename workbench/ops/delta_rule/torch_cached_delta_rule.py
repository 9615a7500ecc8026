"""``torch_cached_gated_delta_rule`` / ``torch_cached_delta_rule``: one continuous-batching step
over per-sequence state slots (the convention of every stateful cached op, ``workbench/ops/state.py``)::

    q/k [1, T, hk, dk], v [1, T, h, dv], g/beta [1, T, h]     B sequences' new tokens back to back
    seq_lens, input_pos, slot_idx [B] int32, num_prefill      prefill sequences first, then 1-token decodes
    state [num_slots, h, dk, dv] (fp32)                       the fast-weight matrix of each slot
    -> o [1, T, h, dv] in q's dtype

Sequence i starts from a zero state when ``input_pos[i] == 0`` -- whatever its slot holds, so a
reused slot never leaks its previous owner's state -- else from ``state[slot_idx[i]]``; afterwards
that row holds the state after its last new token (written in place). Prefill sequences (also
chunked prefill: ``input_pos > 0`` and several tokens) run the chunked form one sequence at a time;
the decode rows run one vectorised recurrence step together. The state is kept in fp32 whatever the
model dtype: it accumulates over the whole sequence, and FLA/HF keep it in fp32 too.

``prefill_rows`` and the schemas/fakes are shared with the Triton backend (``triton_delta_rule.py``),
which runs the decode rows in one kernel.
"""

from __future__ import annotations

from typing import Callable, List, Optional

import torch

from .. import state as state_slots
from ..library import define_op
from ..state import STATE_HOST_SYNC, StatefulOp, StateSpec, check_step_metadata, initial_states, register_stateful_op
from .delta_rule_math import check_delta_rule_args, chunked_delta_rule, delta_rule_step, prepare
from .torch_delta_rule import OPTIONS, delta_rule_output_like


def check_delta_rule_step(q, v, state) -> None:
    """What every cached call must hold, read from shapes only: flattened tokens and a state of
    ``[num_slots, value_heads, dk, dv]``."""
    if q.shape[0] != 1:
        raise ValueError(f"cached delta rule expects flattened tokens q/k [1, T, hk, dk]; got {tuple(q.shape)}")
    state_slots.check_state_shape(
        state, (v.shape[2], q.shape[3], v.shape[3]), "delta rule state must be [num_slots, value_heads, dk, dv]"
    )


def check_cached_delta_rule_args(
    q, k, v, g, beta, seq_lens, input_pos, slot_idx, num_prefill, state, chunk_size: int
) -> List[int]:
    """Validate a cached call; returns ``seq_lens`` as a host list."""
    check_delta_rule_args(q, k, v, g, beta, chunk_size)
    check_delta_rule_step(q, v, state)
    return check_step_metadata(q.shape[1], seq_lens, input_pos, slot_idx, num_prefill, "q")


def prefill_rows(
    q,
    k,
    v,
    g,
    beta,
    lens: List[int],
    input_pos: torch.Tensor,
    slots: torch.Tensor,
    num_prefill: int,
    state: torch.Tensor,
    out: torch.Tensor,
    scale: Optional[float],
    use_qk_l2norm: bool,
    chunk_size: int,
) -> int:
    """The prefill sequences of a step (``0..num_prefill-1``), one chunked run each from its slot's
    state (or zero); writes their tokens of ``out [1, T, h, dv]`` and their slots. Returns the
    first decode token's index. Shared by every cached backend (prefill is long and rare)."""
    end = sum(lens[:num_prefill])
    if num_prefill == 0:
        return 0
    head = slice(0, end)
    qf, kf, vf, gf, bf = prepare(
        q[:, head], k[:, head], v[:, head], None if g is None else g[:, head], beta[:, head], scale, use_qk_l2norm
    )  # [1, h, t, d], [1, h, t]
    past = input_pos[:num_prefill].tolist()
    start = 0
    for i in range(num_prefill):
        part = slice(start, start + lens[i])
        init = (
            state[slots[i]].to(torch.float32)[None]
            if past[i] > 0
            else state.new_zeros(1, *state.shape[1:], dtype=torch.float32)
        )
        o, final = chunked_delta_rule(
            qf[:, :, part],
            kf[:, :, part],
            vf[:, :, part],
            None if gf is None else gf[:, :, part],
            bf[:, :, part],
            init,
            chunk_size,
        )
        out[:, part] = o.transpose(1, 2).to(out.dtype)
        state[slots[i]] = final[0].to(state.dtype)
        start = part.stop
    return end


def _rows(x: torch.Tensor) -> torch.Tensor:
    """[1, h, Bd, ...] (one decode token per row) -> [Bd, h, ...]."""
    return x[0].transpose(0, 1)


def decode_rows(
    q,
    k,
    v,
    g,
    beta,
    input_pos: torch.Tensor,
    slots: torch.Tensor,
    state: torch.Tensor,
    out: torch.Tensor,
    first: int,
    scale: Optional[float],
    use_qk_l2norm: bool,
) -> None:
    """Decode sequences ``first..`` (one token each, tokens ``T - Bd..``): one vectorised recurrence step."""
    decode = slots[first:]
    start = q.shape[1] - decode.numel()
    tail = slice(start, q.shape[1])
    qf, kf, vf, gf, bf = prepare(
        q[:, tail], k[:, tail], v[:, tail], None if g is None else g[:, tail], beta[:, tail], scale, use_qk_l2norm
    )  # [1, h, Bd, d], [1, h, Bd]
    init = initial_states(state, decode, input_pos[first:], torch.float32)  # [Bd, h, dk, dv]
    o, new = delta_rule_step(_rows(qf), _rows(kf), _rows(vf), None if gf is None else _rows(gf), _rows(bf), init)
    out[0, tail] = o.to(out.dtype)
    state.index_copy_(0, decode, new.to(state.dtype))


def cached_delta_rule_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: Optional[torch.Tensor],
    beta: torch.Tensor,
    seq_lens: torch.Tensor,
    input_pos: torch.Tensor,
    slot_idx: torch.Tensor,
    num_prefill: int,
    state: torch.Tensor,
    scale: Optional[float] = None,
    use_qk_l2norm: bool = False,
    chunk_size: int = 64,
) -> torch.Tensor:
    """One step of the (gated when ``g`` is given) delta rule; updates ``state`` in place."""
    lens = check_cached_delta_rule_args(q, k, v, g, beta, seq_lens, input_pos, slot_idx, num_prefill, state, chunk_size)
    out = delta_rule_output_like(q, v)
    slots = slot_idx.long()
    prefill_rows(q, k, v, g, beta, lens, input_pos, slots, num_prefill, state, out, scale, use_qk_l2norm, chunk_size)
    if num_prefill < len(lens):
        decode_rows(q, k, v, g, beta, input_pos, slots, state, out, num_prefill, scale, use_qk_l2norm)
    return out


def without_gate(gated_body: Callable) -> Callable:
    """The body of a plain (ungated) op from its gated twin's: the same arguments but ``g``, run
    with ``g=None``. The metadata and state pass positionally, the options (keyword-only in the
    schemas) by name, as the dispatcher calls op bodies."""

    def plain_body(q, k, v, beta, *metadata_and_state, **options):
        return gated_body(q, k, v, None, beta, *metadata_and_state, **options)

    return plain_body


def cached_gated_fake(q, k, v, g, beta, *metadata_and_state, chunk_size=64, **options):
    check_delta_rule_args(q, k, v, g, beta, chunk_size)
    return delta_rule_output_like(q, v)


cached_plain_fake = without_gate(cached_gated_fake)


# Every backend of one cached op (torch, triton) shares its schema and fake: interchangeable in a graph.
_METADATA = "Tensor seq_lens, Tensor input_pos, Tensor slot_idx, SymInt num_prefill"
CACHED_GATED_ARGS = (
    f"(Tensor q, Tensor k, Tensor v, Tensor g, Tensor beta, {_METADATA}, "
    f"Tensor(a!) gated_delta_state, {OPTIONS}) -> Tensor"
)
CACHED_PLAIN_ARGS = (
    f"(Tensor q, Tensor k, Tensor v, Tensor beta, {_METADATA}, Tensor(a!) delta_state, {OPTIONS}) -> Tensor"
)

# ``define_op`` (a Library kernel) rather than ``custom_op``: a mutating custom_op pays ~50-80 us of
# Python argument handling per call (see library.py), once per linear-attention layer and step.
torch_cached_gated_delta_rule = define_op(
    "torch_cached_gated_delta_rule" + CACHED_GATED_ARGS,
    cached_delta_rule_reference,
    cached_gated_fake,
    host_sync=STATE_HOST_SYNC,
)
torch_cached_delta_rule = define_op(
    "torch_cached_delta_rule" + CACHED_PLAIN_ARGS,
    without_gate(cached_delta_rule_reference),
    cached_plain_fake,
    host_sync=STATE_HOST_SYNC,
)


def state_shape(args) -> tuple:
    """Per-sequence state of a (gated) delta-rule node: ``(value_heads, dk, dv)`` from its fake q and v."""
    return (int(args["v"].shape[2]), int(args["q"].shape[3]), int(args["v"].shape[3]))


# The triton ops are defined in triton_delta_rule.py, which the package imports next to this module.
TRITON_REQUIREMENT = {"triton": "a CUDA device (or TRITON_INTERPRET=1 on CPU, for tests)"}
GATED_DELTA_RULE = register_stateful_op(
    StatefulOp(
        source="workbench::torch_gated_delta_rule",
        cached={
            "torch": "workbench::torch_cached_gated_delta_rule",
            "triton": "workbench::triton_cached_gated_delta_rule",
        },
        token_args=("q", "k", "v", "g", "beta"),
        states=(StateSpec("gated_delta_state", shape=state_shape, dtype=torch.float32),),
        insert_key="insert_cached_gated_delta_rule",
        description="fast-weight matrix S [value_heads, dk, dv] per sequence (fp32), decayed by exp(g) each token",
        backend_requirements=TRITON_REQUIREMENT,
    )
)
DELTA_RULE = register_stateful_op(
    StatefulOp(
        source="workbench::torch_delta_rule",
        cached={"torch": "workbench::torch_cached_delta_rule", "triton": "workbench::triton_cached_delta_rule"},
        token_args=("q", "k", "v", "beta"),
        states=(StateSpec("delta_state", shape=state_shape, dtype=torch.float32),),
        insert_key="insert_cached_delta_rule",
        description="fast-weight matrix S [value_heads, dk, dv] per sequence (fp32)",
        backend_requirements=TRITON_REQUIREMENT,
    )
)

__all__ = [
    "torch_cached_gated_delta_rule",
    "torch_cached_delta_rule",
    "cached_delta_rule_reference",
    "prefill_rows",
    "decode_rows",
    "CACHED_GATED_ARGS",
    "CACHED_PLAIN_ARGS",
    "cached_gated_fake",
    "cached_plain_fake",
    "check_cached_delta_rule_args",
    "check_delta_rule_step",
    "without_gate",
    "state_shape",
    "GATED_DELTA_RULE",
    "DELTA_RULE",
]
