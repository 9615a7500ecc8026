"""Canonical forwards for the short causal conv families (see the package docstring).

LFM2's short-conv layer (``Lfm2ShortConv``) is a gated depthwise causal conv::

    B, C, x = in_proj(h).chunk(3)                 each [b, s, hidden]
    y = out_proj(C * causal_conv(B * x))          conv: conv_L_cache taps, no activation

HF runs the conv as ``nn.Conv1d`` on channels-first activations (or a hub kernel, or its own
cache-update function when decoding), which exports as transposes around an aten convolution that
only sees the new tokens: a cached graph would then convolve each decode token with zeros. Here the
conv is ``torch.ops.workbench.torch_causal_conv1d`` (channels last, the module's own weight
``[hidden, 1, k]`` and bias), the node ``insert_cached_causal_conv`` gives its per-sequence conv
state; the projections and gates stay plain torch so the usual matchers still see linears.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from ...ops import conv as _conv_ops  # noqa: F401  (registers workbench::torch_causal_conv1d)
from ...ops.conv.causal_conv import ACTIVATIONS
from . import ModulePatch


def conv_then_activation(
    x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], activation: Optional[str]
) -> torch.Tensor:
    """``torch_causal_conv1d(x, weight, bias)`` [b, s, c], then ``activation`` as a node of its own:
    HF's spelling, ``act(conv(x))``. The cache stage turns the conv into its cached op, and
    ``fuse_causal_conv_activation`` then folds the activation into that op's kernel (the
    reference's order: the cached conv kernels apply it while the output is in registers)."""
    if activation not in ACTIVATIONS:
        raise ValueError(
            f"causal conv activation {activation!r}: the cached conv kernels apply only "
            f"{sorted(a for a in ACTIVATIONS if a)} (or none)"
        )
    y = torch.ops.workbench.torch_causal_conv1d(x, weight, bias)
    act = ACTIVATIONS[activation]
    return y if act is None else act(y)


def lfm2_short_conv_forward(
    module: Any,
    hidden_states: torch.Tensor,
    past_key_values=None,
    attention_mask: Optional[torch.Tensor] = None,
    **kwargs,
) -> torch.Tensor:
    """``Lfm2ShortConv.forward`` through the canonical conv op: [b, s, hidden] -> [b, s, hidden].

    ``attention_mask`` is the 2D padding mask transformers 5.2x hands recurrent layers (None
    unless padded): padded positions are zeroed before they can enter the conv, as HF does. A 4D
    mask (what older transformers passed every layer) is an attention mask, not padding: ignored,
    as HF's own padding helper did.
    """
    if past_key_values is not None:
        raise ValueError(
            "the canonical LFM2 short-conv forward is for export (use_cache=False): the cached "
            "graph keeps conv state through insert_cached_causal_conv, not an HF cache object"
        )
    if attention_mask is not None and attention_mask.dim() == 2:
        hidden_states = (hidden_states * attention_mask[:, :, None]).to(hidden_states.dtype)
    # HF chunks the channels-first [b, 3h, s] projection on dim -2: the same channel thirds.
    b_gate, c_gate, x = module.in_proj(hidden_states).chunk(3, dim=-1)  # [b, s, hidden] each
    conv = torch.ops.workbench.torch_causal_conv1d(b_gate * x, module.conv.weight, module.conv.bias)
    return module.out_proj(c_gate * conv)


PATCHES: tuple = (
    ModulePatch(
        "canonical_lfm2_short_conv",
        "Export LFM2's short-conv layers (Lfm2ShortConv) with their depthwise causal conv as "
        "workbench::torch_causal_conv1d (channels last), so the cache stage can give it a conv state.",
        ("Lfm2ShortConv",),
        lfm2_short_conv_forward,
    ),
)
