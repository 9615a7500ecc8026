"""The (gated) delta rule in plain torch: the recurrence (ground truth), one decode step, the chunked form.

A delta-rule layer keeps, per value head, a fast-weight state ``S [dk, dv]`` that maps keys to
values. Each token first decays the state (gated variant: by ``exp(g_t)``, ``g_t <= 0``), then
corrects what the state predicts for its key towards its value, with learning rate ``beta_t``, and
reads the result with its query::

    S  <- exp(g_t) * S                              (no decay in the plain delta rule: g_t = 0)
    u_t = beta_t * (v_t - S^T k_t)                  [dv]  the correction ("delta")
    S  <- S + k_t u_t^T                             [dk, dv]
    o_t = S^T q_t                                   [dv]

(Qwen3-Next's ``torch_recurrent_gated_delta_rule`` spells exactly this; DeltaNet is ``g = 0``.)

The chunked form computes the same thing for ``C`` tokens at a time with matmuls. Inside a chunk
that starts from state ``S0``, with ``gam_t = g_1 + ... + g_t`` (cumulative log decay since the
chunk start) and ``D[t, j] = exp(gam_t - gam_j)`` for ``j <= t`` (0 above the diagonal)::

    S_t = exp(gam_t) S0 + sum_{j<=t} D[t, j] k_j u_j^T
    u_t = beta_t (v_t - exp(gam_t) S0^T k_t - sum_{j<t} D[t, j] (k_t . k_j) u_j)

so the corrections solve one unit lower-triangular system per chunk,
``(I + A) U = beta*V - (beta*exp(gam))*K S0`` with ``A[t, j] = beta_t D[t, j] (k_t . k_j)``, ``j < t``;
writing ``W_v = (I+A)^-1 beta*V`` and ``W_k = (I+A)^-1 (beta*exp(gam))*K`` (both independent of
``S0``, so computed for all chunks at once), the only sequential part is, chunk by chunk::

    U   = W_v - W_k S0
    O   = (exp(gam) * Q) S0 + (D * Q K^T) U
    S0 <- exp(gam_C) S0 + (exp(gam_C - gam) * K)^T U

Conventions shared by every function here: tensors are fp32, heads before tokens
(``q/k [N, h, s, dk]``, ``v [N, h, s, dv]``, ``g/beta [N, h, s]``, ``state [N, h, dk, dv]``), and q
is already normalised and scaled (``prepare`` does that from the ops' ``[b, s, heads, d]`` layout).
"""

from __future__ import annotations

from typing import Mapping, Optional, Tuple

import torch
import torch.nn.functional as F

#: eps of the optional q/k L2 normalisation, ``x * rsqrt(sum(x^2) + eps)``: the value FLA's kernels
#: and HF's torch fallbacks (``l2norm`` in modeling_qwen3_next.py) use.
L2NORM_EPS = 1e-6


def check_fast_weight_args(
    q, k, v, per_head: Mapping[str, Optional[torch.Tensor]], chunk_size: int, mixer: str, why: str = ""
) -> None:
    """Validate a fast-weight mixer's arguments (the delta rules, decayed linear attention), also at
    trace time from the fakes: q/k ``[b, s, hk, dk]``, v ``[b, s, h, dv]`` with ``h % hk == 0``
    (value head j reads query/key head ``j // (h // hk)``), each of ``per_head`` (None: absent)
    ``[b, s, h]``, one scalar per token and value head. ``mixer`` names the op family in errors,
    ``why`` adds what a wrong per-head scalar usually means."""
    if q.dim() != 4 or k.shape != q.shape:
        raise ValueError(
            f"{mixer} expects q and k of one shape [b, s, heads, dk]; got q {tuple(q.shape)}, k {tuple(k.shape)}"
        )
    if v.dim() != 4 or v.shape[:2] != q.shape[:2]:
        raise ValueError(
            f"{mixer} expects v [b, s, value_heads, dv] with q's [b, s] = {tuple(q.shape[:2])}; got v {tuple(v.shape)}"
        )
    h = v.shape[2]
    if h % q.shape[2] != 0:
        raise ValueError(f"{h} value heads is not a multiple of {q.shape[2]} query/key heads")
    for name, t in per_head.items():
        if t is not None and tuple(t.shape) != (*v.shape[:2], h):
            raise ValueError(
                f"{mixer} expects {name} [b, s, value_heads] = {(*v.shape[:2], h)} (one scalar per token and "
                f"value head{why}); got {tuple(t.shape)}"
            )
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")


def check_delta_rule_args(q, k, v, g, beta, chunk_size: int = 64) -> None:
    """The delta rules' arguments: g/beta ``[b, s, h]`` (g is None for the plain delta rule)."""
    check_fast_weight_args(q, k, v, {"beta": beta, "g": g}, chunk_size, "delta rule")


def prepare(q, k, v, g, beta, scale: Optional[float], use_qk_l2norm: bool):
    """From the ops' layout ``[b, s, heads, d]`` to this module's: fp32, heads first, key heads
    repeated to the value heads, q/k L2-normalised if asked, q scaled (default ``dk ** -0.5``).
    Returns ``(q, k, v, g, beta)``; g stays None when None."""
    rep = v.shape[2] // q.shape[2]
    if rep > 1:  # grouped value heads: value head j reads key head j // rep
        q, k = (x.repeat_interleave(rep, dim=2) for x in (q, k))
    q, k, v = (x.transpose(1, 2).to(torch.float32) for x in (q, k, v))  # [b, h, s, d]
    beta = beta.transpose(1, 2).to(torch.float32)  # [b, h, s]
    g = None if g is None else g.transpose(1, 2).to(torch.float32)
    if use_qk_l2norm:
        q, k = (x * torch.rsqrt((x * x).sum(-1, keepdim=True) + L2NORM_EPS) for x in (q, k))
    return q * (q.shape[-1] ** -0.5 if scale is None else scale), k, v, g, beta


def delta_rule_step(q, k, v, g, beta, state) -> Tuple[torch.Tensor, torch.Tensor]:
    """One token of the recurrence for many rows at once: q/k ``[N, h, dk]``, v ``[N, h, dv]``,
    g/beta ``[N, h]``, state ``[N, h, dk, dv]`` -> (o ``[N, h, dv]``, new state)."""
    if g is not None:
        state = state * g.exp()[..., None, None]
    predicted = (k.unsqueeze(-2) @ state).squeeze(-2)  # S^T k: [N, h, dv]
    correction = beta.unsqueeze(-1) * (v - predicted)
    state = state + k.unsqueeze(-1) * correction.unsqueeze(-2)
    return (q.unsqueeze(-2) @ state).squeeze(-2), state


def recurrent_delta_rule(q, k, v, g, beta, state) -> Tuple[torch.Tensor, torch.Tensor]:
    """The recurrence token by token (the ground truth the chunked form is tested against).
    Returns (o ``[N, h, s, dv]``, final state)."""
    out = []
    for t in range(q.shape[2]):
        o, state = delta_rule_step(
            q[:, :, t], k[:, :, t], v[:, :, t], None if g is None else g[:, :, t], beta[:, :, t], state
        )
        out.append(o)
    return torch.stack(out, dim=2), state


def chunked_delta_rule(q, k, v, g, beta, state, chunk_size: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """The chunked form (see the module docstring). Returns (o ``[N, h, s, dv]``, final state).

    The sequence is zero-padded to whole chunks: padded tokens come after every real one, and with
    ``beta = 0`` and ``g = 0`` they neither correct nor decay the state.
    """
    n, h, s, dk = k.shape
    dv = v.shape[-1]
    c = chunk_size
    pad = -s % c
    if g is None:
        g = beta.new_zeros(beta.shape)
    if pad:
        q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
        g, beta = (F.pad(x, (0, pad)) for x in (g, beta))
    chunks = (s + pad) // c
    q, k, v = (x.reshape(n, h, chunks, c, x.shape[-1]) for x in (q, k, v))
    g, beta = (x.reshape(n, h, chunks, c) for x in (g, beta))

    gam = g.cumsum(-1)  # [n, h, chunks, c]: log decay from the chunk start through token t
    lower = torch.ones(c, c, dtype=torch.bool, device=q.device).tril()
    # D[t, j] = exp(gam_t - gam_j) for j <= t; masked before exp (above the diagonal it would grow)
    decay = (gam[..., :, None] - gam[..., None, :]).masked_fill(~lower, float("-inf")).exp()
    a = (beta[..., :, None] * (k @ k.transpose(-1, -2)) * decay).tril(-1)  # strictly lower
    # unitriangular=True: the solver reads only A's strict lower part and takes the diagonal as 1.
    w_v = torch.linalg.solve_triangular(a, beta[..., None] * v, upper=False, unitriangular=True)
    w_k = torch.linalg.solve_triangular(a, (beta * gam.exp())[..., None] * k, upper=False, unitriangular=True)
    scores = (q @ k.transpose(-1, -2)) * decay  # [n, h, chunks, c, c], zero above the diagonal
    q_from_start = q * gam.exp()[..., None]
    k_to_end = k * (gam[..., -1:] - gam).exp()[..., None]
    chunk_decay = gam[..., -1].exp()[..., None, None]  # [n, h, chunks, 1, 1]

    out = q.new_empty(n, h, chunks, c, dv)
    for i in range(chunks):
        u = w_v[:, :, i] - w_k[:, :, i] @ state  # [n, h, c, dv]
        out[:, :, i] = q_from_start[:, :, i] @ state + scores[:, :, i] @ u
        state = state * chunk_decay[:, :, i] + k_to_end[:, :, i].transpose(-1, -2) @ u
    return out.reshape(n, h, chunks * c, dv)[:, :, :s], state


__all__ = [
    "L2NORM_EPS",
    "check_delta_rule_args",
    "prepare",
    "delta_rule_step",
    "recurrent_delta_rule",
    "chunked_delta_rule",
]
