"""Canonical forward of the RG-LRU recurrent block (RecurrentGemma / Griffin).

HF's ``RecurrentGemmaRecurrentBlock`` runs its recurrence as a Python loop over time
(``RecurrentGemmaRglru._rnn_scan``) and keeps its conv / recurrent state as module attributes:
``torch.export`` with a dynamic sequence length fails on the loop ("specialized it to be a
constant"). The replacement keeps the projections as plain module calls (the usual matchers see
linears) and routes the two recurrent pieces through canonical ops, each of which the cache stage
turns into a state-slot op::

    y  = act(linear_y(h))                                       [b, s, w]
    x  = torch_causal_conv1d(linear_x(h), conv_1d.weight, conv_1d.bias)
    gate_x, gate_a = per-head block-diagonal projections of x   [b, s, w] each (plain matmuls + bias)
    x  = torch_rglru(x, gate_x, gate_a, rg_lru.recurrent_param)
    out = linear_out(x * y)

HF's conv is an ordinary depthwise causal conv with bias (``nn.Conv1d(groups=w, padding=k-1)``
cut to the first s outputs), which is exactly ``torch_causal_conv1d``. The block is recognised by
its structure (``is_rglru_block``: the projections, a depthwise causal ``conv_1d`` and an ``rg_lru``
with block-diagonal gate weights and ``recurrent_param``), HF's class by name as well.

This forward runs only while ``export_to_gm`` traces a model without cache: an HF cache object is
refused (the cache stage adds the state), ``use_cache`` and the attention mask are ignored (the
runtime never pads; HF's block ignores the mask too), and positions are the export contract's
``0..s-1``: token 0 of every row is a sequence start, where HF resets (``position_ids == 0``).
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from ...ops import conv as _conv_ops  # noqa: F401  (registers workbench::torch_causal_conv1d)
from ...ops import rglru as _rglru_ops  # noqa: F401  (registers workbench::torch_rglru)
from . import ModulePatch


def _is_linear(m: Any, in_features: Optional[int] = None, out_features: Optional[int] = None) -> bool:
    return (
        isinstance(m, torch.nn.Linear)
        and (in_features is None or m.in_features == in_features)
        and (out_features is None or m.out_features == out_features)
    )


def is_rglru_block(module: torch.nn.Module) -> bool:
    """Whether ``module`` has the RG-LRU recurrent block's structure (parameter names and shapes):
    ``linear_x`` / ``linear_y`` hidden -> w, ``linear_out`` w -> hidden, a depthwise causal
    ``conv_1d`` over w channels (padding k-1, so HF's slice to s outputs is the causal conv), and
    ``rg_lru`` holding ``recurrent_param [w]`` and ``input_gate_*`` / ``recurrent_gate_*`` weights
    ``[heads, w/heads, w/heads]`` with biases ``[heads, w/heads]``."""
    lx, ly, lo = (getattr(module, n, None) for n in ("linear_x", "linear_y", "linear_out"))
    conv, lru = getattr(module, "conv_1d", None), getattr(module, "rg_lru", None)
    if not (isinstance(lx, torch.nn.Linear) and callable(getattr(module, "act_fn", None))):
        return False
    w = lx.out_features
    if not (_is_linear(ly, lx.in_features, w) and _is_linear(lo, w)):
        return False
    if not (
        isinstance(conv, torch.nn.Conv1d)
        and conv.in_channels == conv.out_channels == conv.groups == w
        and conv.padding == (conv.kernel_size[0] - 1,)
        and conv.stride == (1,)
        and conv.dilation == (1,)
    ):
        return False
    params = dict(lru.named_parameters(recurse=False)) if isinstance(lru, torch.nn.Module) else {}
    weight = params.get("input_gate_weight")
    if weight is None or weight.dim() != 3 or weight.shape[0] * weight.shape[1] != w:
        return False
    h, bw = weight.shape[0], weight.shape[1]
    want = {
        "recurrent_param": (w,),
        "input_gate_weight": (h, bw, bw),
        "input_gate_bias": (h, bw),
        "recurrent_gate_weight": (h, bw, bw),
        "recurrent_gate_bias": (h, bw),
    }
    return all(n in params and tuple(params[n].shape) == s for n, s in want.items())


def block_diagonal_gate(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """One gate's pre-activation: each of the h heads of ``x [b, s, h*bw]`` times its own
    ``weight [h, bw, bw]`` plus ``bias [h, bw]`` (HF's ``baddbmm`` over heads) -> [b, s, h*bw]."""
    heads = x.unflatten(-1, (weight.shape[0], weight.shape[1]))  # [b, s, h, bw]
    return (torch.einsum("bshi,hij->bshj", heads, weight) + bias).flatten(-2)


def rglru_block_forward(module: Any, input_states: torch.Tensor, *_args, **kwargs):
    """``RecurrentGemmaRecurrentBlock.forward`` through the canonical ops: [b, s, hidden] ->
    ([b, s, hidden], None) as HF returns it (see the module docstring)."""
    for name in ("cache", "past_key_values"):
        if kwargs.get(name) is not None:
            raise ValueError(
                f"the canonical {type(module).__name__} forward traces the model without cache (the cache stage "
                f"adds the conv and RG-LRU state): got {name}. Switch the export patch canonical_rglru_block off "
                "to run HF's own forward with a cache."
            )
    y = module.act_fn(module.linear_y(input_states))
    conv = module.conv_1d
    x = torch.ops.workbench.torch_causal_conv1d(module.linear_x(input_states), conv.weight, conv.bias)
    lru = module.rg_lru
    gate_x = block_diagonal_gate(x, lru.input_gate_weight, lru.input_gate_bias)
    gate_a = block_diagonal_gate(x, lru.recurrent_gate_weight, lru.recurrent_gate_bias)
    x = torch.ops.workbench.torch_rglru(x, gate_x, gate_a, lru.recurrent_param)
    return module.linear_out(x * y), None


PATCHES: tuple = (
    ModulePatch(
        "canonical_rglru_block",
        "Trace RG-LRU recurrent blocks (RecurrentGemmaRecurrentBlock, or any module of its structure) as "
        "linear_x -> torch_causal_conv1d -> block-diagonal gates -> torch_rglru, gated by act(linear_y), "
        "-> linear_out instead of HF's Python loop over time.",
        ("RecurrentGemmaRecurrentBlock",),
        rglru_block_forward,
        match=is_rglru_block,
    ),
)

__all__ = ["PATCHES", "rglru_block_forward", "block_diagonal_gate", "is_rglru_block"]
