"""The Mamba-1 selective scan, written twice: as a chunked parallel scan and as a recurrence.

Per channel c of the mixer's inner width (``d`` channels) and state entry j (``n`` of them), token t::

    dt_t[c]      = softplus(dt_raw_t[c] + dt_bias[c])                      step size, per channel
    h_t[c, j]    = exp(dt_t[c] * A[c, j]) * h_{t-1}[c, j] + dt_t[c] * x_t[c] * B_t[j]
    y_t[c]       = sum_j h_t[c, j] * C_t[j]  (+ D[c] * x_t[c], added by the ops)

Unlike Mamba-2 (one scalar decay per head), the decay here differs per channel AND per state entry
(``A`` is ``[d, n]``), so there is no attention-like "dual" form with a [L, L] score matrix shared
by the channels. What stays true is that ``h_t = a_t * h_{t-1} + b_t`` is a first-order linear
recurrence, and pairs ``(a, b)`` compose associatively::

    (a1, b1) then (a2, b2)  =  (a1 * a2,  a2 * b1 + b2)

so a chunk of L tokens is scanned in ceil(log2 L) elementwise rounds (Hillis-Steele: at round k,
token t absorbs token t - 2^k), each over the whole [b, L, d, n] chunk, instead of L dependent
steps; the state entering the chunk is folded into its first token, and the chunk's last state
enters the next chunk. Decays multiply as they are (no logs, so no ``exp(-cum)`` that could
overflow): a product that underflows to 0 is a decay that is 0 to fp32 anyway.

All in fp32 whatever the input dtype. The recurrence (``selective_recurrence``) is the definition
the tests hold the chunked scan to, and the decode path of the cached ops (``selective_step``).
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
import torch.nn.functional as F


def discretize(dt: torch.Tensor, dt_bias: torch.Tensor) -> torch.Tensor:
    """Per-token, per-channel step sizes in fp32: ``softplus(dt + dt_bias)``; dt [..., d], dt_bias [d].
    The bias is added in fp32, as HF's ``delta_bias`` (the model's dt_proj.bias, upcast) is."""
    return F.softplus(dt.float() + dt_bias.float())


def linear_scan(a: torch.Tensor, u: torch.Tensor, h0: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Every ``h_t = a_t h_{t-1} + u_t`` along dim 1 of ``a, u [N, s, ...]`` (elementwise over the
    other dims) from ``h0 [N, ...]`` (None: zero): the Mamba-1 chunks' and RG-LRU's scan.

    Hillis-Steele: after the round with offset k, position t holds the composition of its last 2k
    steps (clipped at 0), ``(A, U)`` with ``h_t = A h_{t-2k} + U``, so ``ceil(log2 s)`` vectorised
    rounds replace the s-step loop. ``h0`` is one more input to the first token, decayed by its
    ``a``. Products of decays in [0, 1] stay there: no overflow whatever the length. Sums run in
    another order than the loop's: fp32 round-off only.
    """
    if h0 is not None:
        u = torch.cat([u[:, :1] + a[:, :1] * h0[:, None], u[:, 1:]], dim=1)
    length, k = u.shape[1], 1
    while k < length:
        # position t absorbs position t-k: (a_prev, u_prev) then (a, u) = (a_prev * a, a * u_prev + u)
        u = torch.cat([u[:, :k], u[:, k:] + a[:, k:] * u[:, :-k]], dim=1)
        a = torch.cat([a[:, :k], a[:, k:] * a[:, :-k]], dim=1)
        k *= 2
    return u


def selective_scan_chunked(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    chunk_size: int,
    initial_state: Optional[torch.Tensor] = None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """The scan of whole sequences, without the ``D * x`` skip.

    x [b, s, d], dt [b, s, d] (discretized), A [d, n], B/C [b, s, n], all fp32; initial_state
    [b, d, n] or None (zeros). Returns (y [b, s, d], final state [b, d, n]). Memory: a few
    [b, chunk_size, d, n] tensors at a time.
    """
    b, s, d = x.shape
    n = A.shape[-1]
    state = x.new_zeros(b, d, n) if initial_state is None else initial_state.float()
    ys = []
    for start in range(0, s, chunk_size):
        end = min(start + chunk_size, s)
        step = dt[:, start:end, :, None]  # [b, L, d, 1]
        decay = torch.exp(step * A)  # [b, L, d, n]
        inp = (step * x[:, start:end, :, None]) * B[:, start:end, None, :]  # [b, L, d, n]
        states = linear_scan(decay, inp, state)  # from the state entering the chunk
        ys.append(torch.einsum("bldn,bln->bld", states, C[:, start:end]))
        state = states[:, -1]
    y = torch.cat(ys, dim=1) if ys else x.new_zeros(b, 0, d)
    return y, state


def selective_step(
    state: torch.Tensor, x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor
) -> Tuple[torch.Tensor, torch.Tensor]:
    """One token of the recurrence for N rows at once, without the ``D * x`` skip.

    state [N, d, n], x [N, d], dt [N, d] (discretized), A [d, n], B/C [N, n], all fp32.
    Returns (y [N, d], new state [N, d, n]).
    """
    new_state = torch.exp(dt[..., None] * A) * state + (dt * x)[..., None] * B[:, None, :]
    y = torch.matmul(new_state, C[..., None])[..., 0]  # [N, d]
    return y, new_state


def selective_recurrence(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    initial_state: Optional[torch.Tensor] = None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """The scan token by token (the definition ``selective_scan_chunked`` must equal); same arguments
    and results. Slow: for tests and short sequences."""
    b, s, d = x.shape
    state = x.new_zeros(b, d, A.shape[-1]) if initial_state is None else initial_state.float()
    ys = []
    for t in range(s):
        y, state = selective_step(state, x[:, t], dt[:, t], A, B[:, t], C[:, t])
        ys.append(y)
    return (torch.stack(ys, dim=1) if ys else x.new_zeros(b, 0, d)), state


__all__ = ["discretize", "linear_scan", "selective_scan_chunked", "selective_step", "selective_recurrence"]
