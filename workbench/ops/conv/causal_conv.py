"""``workbench::torch_causal_conv1d`` and its cached form over per-sequence conv-state slots.

A short depthwise causal convolution (Mamba / Mamba-2 mixers, gated delta nets, LFM2's short-conv
layers) mixes each channel with its own last ``k`` inputs. Channels are LAST, as the surrounding
projections produce them, so the op sits between linears without transposes in the graph::

    x [b, s, c], weight [c, 1, k] (a depthwise nn.Conv1d weight as stored), bias [c] or None
    out[:, t] = act(bias + sum_j weight[:, 0, j] * x[:, t - (k-1) + j])      (x[t < 0] = 0)
             = F.conv1d(x^T, weight, bias, padding=k-1, groups=c)[..., :s]^T

The cached op runs one step of continuous batching (the convention of every stateful cached op,
see ``workbench/ops/state.py``): B sequences, their new tokens back to back in ``x [1, T, c]``
(``num_prefill`` prefill sequences of any length first, then one-token decode rows), and
``conv_state [num_slots, c, k-1]``, the last ``k-1`` inputs of each sequence (the left padding the
next token needs). Sequence i starts from zeros when ``input_pos[i] == 0`` -- whatever its slot
holds, so a reused slot never leaks its previous owner's inputs -- else from
``conv_state[slot_idx[i]]``; afterwards that row holds the last ``k-1`` inputs seen (including
older ones when the chunk is shorter than ``k-1``).
"""

from __future__ import annotations

from typing import List, Optional

import torch
import torch.nn.functional as F

from .. import state as state_slots
from ..library import define_op
from ..state import STATE_HOST_SYNC, StatefulOp, StateSpec, check_step_metadata, initial_states, register_stateful_op

#: Activations the conv kernels can apply in registers (``fuse_causal_conv_activation``).
ACTIVATIONS = {None: None, "silu": F.silu}


def check_conv_args(
    x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], activation: Optional[str]
) -> int:
    """Validate the shared arguments (also at trace time, from the fakes); returns ``k``."""
    if activation not in ACTIVATIONS:
        raise ValueError(
            f"causal conv activation {activation!r} is not supported; use one of "
            f"{sorted(a for a in ACTIVATIONS if a)} or None"
        )
    if weight.dim() != 3 or weight.shape[1] != 1:
        raise ValueError(
            f"causal conv expects a depthwise weight [c, 1, k] (nn.Conv1d with groups=c, as "
            f"stored); got {tuple(weight.shape)}"
        )
    if x.dim() != 3 or x.shape[-1] != weight.shape[0]:
        raise ValueError(
            f"causal conv expects x [b, s, c] with channels last matching weight's "
            f"{weight.shape[0]} channels; got x {tuple(x.shape)}"
        )
    if bias is not None and tuple(bias.shape) != (weight.shape[0],):
        raise ValueError(f"causal conv bias must be [c] = [{weight.shape[0]}]; got {tuple(bias.shape)}")
    return weight.shape[2]


def _activate(y: torch.Tensor, activation: Optional[str]) -> torch.Tensor:
    fn = ACTIVATIONS[activation]
    return y if fn is None else fn(y)


def causal_conv1d_reference(
    x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], activation: Optional[str] = None
) -> torch.Tensor:
    """Uncached causal conv of whole sequences: [b, s, c] -> [b, s, c] (see the module docstring)."""
    k = check_conv_args(x, weight, bias, activation)
    s = x.shape[1]
    y = F.conv1d(x.transpose(1, 2), weight, bias, padding=k - 1, groups=weight.shape[0])[..., :s]
    return _activate(y, activation).transpose(1, 2).contiguous()


def _causal_conv1d_fake(x, weight, bias, activation=None):
    check_conv_args(x, weight, bias, activation)
    return x.new_empty(x.shape)


torch_causal_conv1d = define_op(
    "torch_causal_conv1d(Tensor x, Tensor weight, Tensor? bias, *, str? activation=None) -> Tensor",
    causal_conv1d_reference,
    _causal_conv1d_fake,
)


def check_conv_state(weight, conv_state) -> None:
    """``conv_state`` must be ``[num_slots, c, k-1]`` for this depthwise ``weight [c, 1, k]``."""
    state_slots.check_state_shape(
        conv_state, (weight.shape[0], weight.shape[2] - 1), "conv_state must be [num_slots, c, k-1]"
    )


def check_cached_conv_args(
    x, weight, bias, seq_lens, input_pos, slot_idx, num_prefill, conv_state, activation
) -> List[int]:
    """Validate the cached op's arguments; returns ``seq_lens`` as a host list."""
    check_conv_args(x, weight, bias, activation)
    if x.shape[0] != 1:
        raise ValueError(f"cached causal conv expects flattened tokens x [1, T, c]; got {tuple(x.shape)}")
    check_conv_state(weight, conv_state)
    return check_step_metadata(x.shape[1], seq_lens, input_pos, slot_idx, num_prefill, "x")


def prefill_rows(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor],
    lens: List[int],
    input_pos: torch.Tensor,
    slots: torch.Tensor,
    num_prefill: int,
    conv_state: torch.Tensor,
    activation: Optional[str],
    out: torch.Tensor,
) -> int:
    """Sequences ``0..num_prefill-1``: one ``F.conv1d`` each over their state and new inputs
    ([c, k-1+s], no padding: the state is the padding). Writes ``out`` and the state rows; returns
    the first token of the decode rows."""
    c, k = weight.shape[0], weight.shape[2]
    start = 0
    for i in range(num_prefill):
        end = start + lens[i]
        init = initial_states(conv_state, slots[i : i + 1], input_pos[i : i + 1])[0].to(x.dtype)  # [c, k-1]
        window = torch.cat([init, x[0, start:end].transpose(0, 1)], dim=1)  # [c, k-1+s]
        y = F.conv1d(window[None], weight, bias, groups=c)[0]  # [c, s]
        out[0, start:end] = _activate(y, activation).transpose(0, 1)
        conv_state[slots[i]] = window[:, window.shape[1] - (k - 1) :].to(conv_state.dtype)
        start = end
    return start


def decode_rows(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor],
    input_pos: torch.Tensor,
    slots: torch.Tensor,
    conv_state: torch.Tensor,
    activation: Optional[str],
) -> torch.Tensor:
    """Decode rows together, ``x [Bd, c]`` (one token each, slots ``slots [Bd]``): one
    multiply-and-sum over their [Bd, c, k] windows; shifts their state rows. Returns [Bd, c]."""
    init = initial_states(conv_state, slots, input_pos).to(x.dtype)  # [Bd, c, k-1]
    window = torch.cat([init, x[:, :, None]], dim=2)  # [Bd, c, k]
    y = (window * weight[:, 0]).sum(-1)  # [Bd, c]
    if bias is not None:
        y = y + bias
    conv_state.index_copy_(0, slots, window[:, :, 1:].to(conv_state.dtype))
    return _activate(y, activation)


def cached_causal_conv1d_reference(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor],
    seq_lens: torch.Tensor,
    input_pos: torch.Tensor,
    slot_idx: torch.Tensor,
    num_prefill: int,
    conv_state: torch.Tensor,
    activation: Optional[str] = None,
) -> torch.Tensor:
    """One continuous-batching step of the causal conv; updates ``conv_state`` in place.

    x [1, T, c] -> [1, T, c]: prefill sequences one by one (``prefill_rows``), then the decode
    rows together (``decode_rows``).
    """
    lens = check_cached_conv_args(x, weight, bias, seq_lens, input_pos, slot_idx, num_prefill, conv_state, activation)
    slots = slot_idx.long()
    out = torch.empty_like(x)
    start = prefill_rows(x, weight, bias, lens, input_pos, slots, num_prefill, conv_state, activation, out)
    if num_prefill < len(lens):
        out[0, start:] = decode_rows(
            x[0, start:], weight, bias, input_pos[num_prefill:], slots[num_prefill:], conv_state, activation
        )
    return out


def cached_causal_conv1d_fake(x, weight, bias, seq_lens, input_pos, slot_idx, num_prefill, conv_state, activation=None):
    check_conv_args(x, weight, bias, activation)
    return x.new_empty(x.shape)


# Every cached causal-conv backend (torch, triton) shares this schema and fake: interchangeable in a graph.
CACHED_CONV_ARGS = (
    "(Tensor x, Tensor weight, Tensor? bias, Tensor seq_lens, Tensor input_pos, Tensor slot_idx, "
    "SymInt num_prefill, Tensor(a!) conv_state, *, str? activation=None) -> Tensor"
)

# ``define_op`` (a Library kernel) rather than ``custom_op``: a mutating custom_op pays ~50-80 us of
# Python argument handling per call, more than a decode step's conv itself (see library.py).
torch_cached_causal_conv1d = define_op(
    "torch_cached_causal_conv1d" + CACHED_CONV_ARGS,
    cached_causal_conv1d_reference,
    cached_causal_conv1d_fake,
    host_sync=STATE_HOST_SYNC,
)


def _conv_state_shape(args) -> tuple:
    """Per sequence: the last k-1 inputs of every channel, [c, k-1]."""
    c, _, k = args["weight"].shape
    return (int(c), int(k) - 1)


# The state holds inputs as they were (no arithmetic on them), so the cache dtype -- the model's,
# the dtype x arrives in -- loses nothing. The triton op is defined in triton_causal_conv.py, which
# the package imports next to this module.
CAUSAL_CONV_STATEFUL_OP = register_stateful_op(
    StatefulOp(
        source="workbench::torch_causal_conv1d",
        cached={"torch": "workbench::torch_cached_causal_conv1d", "triton": "workbench::triton_cached_causal_conv1d"},
        token_args=("x",),
        states=(StateSpec("conv_state", shape=_conv_state_shape),),
        insert_key="insert_cached_causal_conv",
        description="causal conv window per sequence: the last k-1 inputs of every channel, [channels, k-1]",
        backend_requirements={"triton": "a CUDA device (or TRITON_INTERPRET=1 on CPU, for tests)"},
    )
)

__all__ = [
    "torch_causal_conv1d",
    "torch_cached_causal_conv1d",
    "causal_conv1d_reference",
    "cached_causal_conv1d_reference",
    "check_conv_args",
    "ACTIVATIONS",
    "CAUSAL_CONV_STATEFUL_OP",
]
