"""The RG-LRU recurrence in plain torch (fp32): its gates and the token-by-token reference (the whole-sequence scan is ``selective_scan.scan_math.linear_scan``).

RecurrentGemma's (Griffin's) Real-Gated Linear Recurrent Unit keeps one number per channel,
``h [w]``. From the conv output ``x_t [w]`` and two gate pre-activations ``gate_x_t``, ``gate_a_t``
(the block-diagonal per-head projections of ``x_t``, computed outside the op), with the learned
per-channel ``recurrent_param [w]`` and Griffin's constant ``c = 8``::

    i_t   = sigmoid(gate_x_t)                           input gate
    r_t   = sigmoid(gate_a_t)                           recurrence gate
    log_a = -c * r_t * softplus(recurrent_param)        so a_t = exp(log_a) in (0, 1]
    m_t   = sqrt(1 - exp(2 * log_a))                    keeps |h| ~ |x| whatever the memory length
    h_t   = a_t * h_{t-1} + m_t * i_t * x_t

At a sequence's first token (HF: ``position_ids == 0``) the state resets: ``h_{-1} = 0`` and
``m = 1`` (so ``h_0 = i_0 * x_0``). ``1 - exp(2 log_a)`` is spelled as HF spells it (not
``-expm1``), so fp32 results agree with HF's to round-off even where ``a`` is close to 1.

Everything here is fp32 and channels-last: ``[..., w]`` per token, ``[N, w]`` per state.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
import torch.nn.functional as F

#: Griffin's fixed scale of the log decay (HF: the literal ``-8.0`` in ``RecurrentGemmaRglru.forward``).
DEFAULT_DECAY_SCALE = 8.0


def gates(
    x: torch.Tensor, gate_x: torch.Tensor, gate_a: torch.Tensor, recurrent_param: torch.Tensor, decay_scale: float
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per token (any leading dims, last dim w), in fp32: ``(a, u, u_reset)`` where ``a`` is the
    decay, ``u = m * i * x`` the normalised input of a continuing token and ``u_reset = i * x`` that
    of a sequence's first token (multiplier 1)."""
    log_a = -decay_scale * torch.sigmoid(gate_a.float()) * F.softplus(recurrent_param.float())
    gated = x.float() * torch.sigmoid(gate_x.float())
    multiplier = torch.sqrt(1 - torch.exp(2 * log_a))
    return torch.exp(log_a), gated * multiplier, gated


def rglru_recurrence(
    x: torch.Tensor,
    gate_x: torch.Tensor,
    gate_a: torch.Tensor,
    recurrent_param: torch.Tensor,
    initial_state: Optional[torch.Tensor] = None,
    decay_scale: float = DEFAULT_DECAY_SCALE,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Ground truth, token by token: ``x, gate_x, gate_a [b, s, w]`` -> ``(h [b, s, w], final [b, w])``
    in fp32. Without ``initial_state`` token 0 is a sequence start (reset); with one, a continuation."""
    a, u, u_reset = gates(x, gate_x, gate_a, recurrent_param, decay_scale)
    h = torch.zeros_like(a[:, 0]) if initial_state is None else initial_state.float()
    out = []
    for t in range(x.shape[1]):
        first = initial_state is None and t == 0
        h = u_reset[:, 0] if first else a[:, t] * h + u[:, t]
        out.append(h)
    return torch.stack(out, dim=1), h


__all__ = ["DEFAULT_DECAY_SCALE", "gates", "rglru_recurrence"]
