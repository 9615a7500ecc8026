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

from typing import Optional

import torch
import torch.nn.functional as F

from ..recurrent import Inputs, Options, RecurrentMath, RecurrentOp, RecurrentState, define_recurrent_op
from . import triton_causal_conv

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


def _check(inputs: Inputs, options: Options) -> None:
    check_conv_args(inputs["x"], inputs["weight"], inputs["bias"], options["activation"])


def _run(inputs: Inputs, init: Optional[torch.Tensor], options: Options):
    """Whole sequences ``x [b, s, c]`` after ``init [b, c, k-1]`` (None: zeros): one ``F.conv1d``
    over state and inputs ([b, c, k-1+s], no padding: the state is the padding). Returns
    ``(y [b, s, c], the last k-1 inputs [b, c, k-1])`` (older ones too when s < k-1)."""
    x, weight = inputs["x"], inputs["weight"]
    c, k = weight.shape[0], weight.shape[2]
    if init is None:  # zero padding, as the models' own nn.Conv1d call (bit-identical to it)
        window = F.pad(x.transpose(1, 2), (k - 1, 0))  # [b, c, k-1+s]
        y = F.conv1d(x.transpose(1, 2), weight, inputs["bias"], padding=k - 1, groups=c)[..., : x.shape[1]]
    else:
        window = torch.cat([init.to(x.dtype), x.transpose(1, 2)], dim=2)
        y = F.conv1d(window, weight, inputs["bias"], groups=c)  # [b, c, s]
    return _activate(y, options["activation"]).transpose(1, 2), window[:, :, window.shape[2] - (k - 1) :]


def _step(inputs: Inputs, held: torch.Tensor, fresh: torch.Tensor, options: Options):
    """One token per row, ``x [n, c]`` after ``held [n, c, k-1]``: a multiply-and-sum over the
    [n, c, k] windows. Returns ``(y [n, c], the shifted windows [n, c, k-1])``."""
    x, weight, bias = inputs["x"], inputs["weight"], inputs["bias"]
    window = torch.cat([held.to(x.dtype), x[:, :, None]], dim=2)  # [n, c, k]
    y = (window * weight[:, 0]).sum(-1)  # [n, c]
    if bias is not None:
        y = y + bias
    return _activate(y, options["activation"]), window[:, :, 1:]


def _conv_state_shape(args) -> tuple:
    """Per sequence: the last k-1 inputs of every channel, [c, k-1]."""
    c, _, k = args["weight"].shape
    return (int(c), int(k) - 1)


CAUSAL_CONV = define_recurrent_op(
    RecurrentOp(
        name="causal_conv1d",
        inputs="Tensor x, Tensor weight, Tensor? bias",
        options="str? activation=None",
        # The state holds inputs as they were (no arithmetic on them), so the cache dtype -- the
        # model's, the dtype x arrives in -- loses nothing.
        state=RecurrentState(
            "conv_state",
            shape=_conv_state_shape,
            layout="c, k-1",
            description="causal conv window per sequence: the last k-1 inputs of every channel, [channels, k-1]",
        ),
        token_args=("x",),
        insert_key="insert_cached_causal_conv",
        math=RecurrentMath(check=_check, run=_run, step=_step),
        triton_decode=triton_causal_conv.decode,
    )
)

__all__ = ["check_conv_args", "ACTIVATIONS", "CAUSAL_CONV"]
