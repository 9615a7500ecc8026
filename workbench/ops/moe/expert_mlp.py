"""The gated expert MLP every MoE op shares: gate/up halves, activation, optional biases.

One expert maps its tokens ``x [t, H]`` through ``w1_w3 [2I, H]`` (gate and up rows, ``nn.Linear``
layout) and ``w2 [H, I]``::

    h = x @ w1_w3.T (+ b1_w3)          [t, 2I]
    gate, up = halves(h)               [t, I] each
    y = gated(gate, up) @ w2.T (+ b2)  [t, H]

Two things vary between families, and both are options of the canonical MoE ops rather than new ops:

* where the gate and up rows sit in ``w1_w3``: ``gate_up_interleaved=False`` (all gate rows, then all
  up rows: HF transformers>=5 ``gate_up_proj``, Mixtral, Qwen-MoE...) or ``True`` (rows alternate gate,
  up, gate, up: gpt-oss, whose ``_apply_gate`` reads ``h[..., ::2]`` / ``h[..., 1::2]``). Interleaving
  is a layout of the stored weight; de-interleaving it at match time would copy every expert.
* the activation ``act_fn``: ``silu`` / ``gelu`` / ``relu`` (``act(gate) * up``) or ``clamped_swiglu``
  (gpt-oss): ``gate = min(gate, limit)``, ``up = clamp(up, -limit, limit)``,
  ``(up + 1) * gate * sigmoid(alpha * gate)`` with ``alpha`` (1.702) and ``limit`` (7.0) from the config.

Biases (gpt-oss has both, per expert) are ``[E, 2I]`` and ``[E, H]`` beside the stacked weights.
"""

from __future__ import annotations

from typing import Callable, Dict, Optional, Tuple

import torch
import torch.nn.functional as F

#: ``act(gate) * up`` activations.
PLAIN_ACTIVATIONS: Dict[str, Callable[[torch.Tensor], torch.Tensor]] = {"silu": F.silu, "gelu": F.gelu, "relu": F.relu}
#: Every ``act_fn`` the MoE ops take.
GATED_ACTIVATIONS = (*PLAIN_ACTIVATIONS, "clamped_swiglu")
#: gpt-oss's defaults (``GptOssConfig``: swiglu_limit 7.0; the experts hard-code alpha 1.702).
SWIGLU_ALPHA, SWIGLU_LIMIT = 1.702, 7.0


def check_activation(act_fn: str) -> None:
    if act_fn not in GATED_ACTIVATIONS:
        raise ValueError(f"unknown MoE activation {act_fn!r}; known: {sorted(GATED_ACTIVATIONS)}")


def gate_up_halves(h: torch.Tensor, interleaved: bool) -> Tuple[torch.Tensor, torch.Tensor]:
    """``h [..., 2I]`` -> (gate, up) ``[..., I]``: the two halves, or the even / odd columns."""
    if interleaved:
        return h[..., 0::2], h[..., 1::2]
    gate, up = h.chunk(2, dim=-1)
    return gate, up


def gated(
    gate: torch.Tensor, up: torch.Tensor, act_fn: str, alpha: float = SWIGLU_ALPHA, limit: float = SWIGLU_LIMIT
) -> torch.Tensor:
    """The gated activation of ``gate``/``up`` ``[..., I]`` -> ``[..., I]`` (see the module docstring)."""
    check_activation(act_fn)
    if act_fn == "clamped_swiglu":
        # gpt-oss's order of operations, so the products round as HF's do
        gate = gate.clamp(min=None, max=limit)
        up = up.clamp(min=-limit, max=limit)
        return (up + 1) * (gate * torch.sigmoid(gate * alpha))
    return PLAIN_ACTIVATIONS[act_fn](gate) * up


def expert_mlp(
    x: torch.Tensor,
    w1_w3: torch.Tensor,
    w2: torch.Tensor,
    act_fn: str = "silu",
    b1_w3: Optional[torch.Tensor] = None,
    b2: Optional[torch.Tensor] = None,
    gate_up_interleaved: bool = False,
    alpha: float = SWIGLU_ALPHA,
    limit: float = SWIGLU_LIMIT,
    quantize_h: Callable[[torch.Tensor], torch.Tensor] = lambda t: t,
) -> torch.Tensor:
    """One expert: ``x [t, H]``, ``w1_w3 [2I, H]``, ``w2 [H, I]``, biases ``[2I]`` / ``[H]`` -> ``[t, H]``.

    Biases are added after the product (``x @ W.T + b``), as transformers' grouped / batched experts
    do. ``quantize_h`` rounds the down projection's input (the quantized ops' activation formats).
    """
    h = F.linear(x, w1_w3)
    if b1_w3 is not None:
        h = h + b1_w3
    gate, up = gate_up_halves(h, gate_up_interleaved)
    y = F.linear(quantize_h(gated(gate, up, act_fn, alpha, limit)), w2)
    return y + b2 if b2 is not None else y


__all__ = [
    "PLAIN_ACTIVATIONS",
    "GATED_ACTIVATIONS",
    "SWIGLU_ALPHA",
    "SWIGLU_LIMIT",
    "check_activation",
    "gate_up_halves",
    "gated",
    "expert_mlp",
]
