"""The Mamba-2 selective state space scan (SSD), written twice: chunked and as a recurrence.

Per head h (``num_heads`` of them, ``head_dim`` d channels each, ``state_size`` n), token t::

    dt_t    = clamp(softplus(dt_raw_t + dt_bias), time_step_min, time_step_max)      scalar per head
    state_t = exp(dt_t * A) * state_{t-1} + dt_t * x_t B_t^T                          [d, n]
    y_t     = state_t C_t + D * x_t                                                   [d]

``A`` is negative (``-exp(A_log)``), so ``exp(dt * A)`` in (0, 1] is a per-token decay. B and C come
in ``g`` groups shared by ``h / g`` consecutive heads (head i reads group ``i // (h / g)``).

The recurrence is one step per token -- right for decode, far too slow for prefill. The chunked
form ("state space duality") computes the same sums in blocks of ``chunk_size`` tokens: within a
chunk, y is an attention-like masked matrix product (scores ``C_l . B_s`` times the decay between
s and l); across chunks, a short recurrence over the chunk-end states carries the past in. All in
fp32 whatever the input dtype: decays multiply over thousands of tokens.

Padding a sequence up to a multiple of the chunk size with ``dt = 0`` tokens changes nothing: such a
token decays the state by ``exp(0) = 1`` and adds ``0 * x B^T``. So the state after the padded
last chunk IS the state after the last real token, without slicing.
"""

from __future__ import annotations

from typing import Any, Optional, Tuple

import torch
import torch.nn.functional as F


def discretize_dt(
    dt: torch.Tensor, dt_bias: torch.Tensor, time_step_min: float, time_step_max: Optional[float]
) -> torch.Tensor:
    """Per-token step sizes in fp32: ``clamp(softplus(dt + dt_bias), min, max)``; dt [..., h], dt_bias [h].
    ``time_step_max=None`` is no upper limit (HF's ``time_step_limit=(0.0, inf)``)."""
    step = F.softplus(dt.float() + dt_bias.float())
    return torch.clamp(step, min=time_step_min, max=time_step_max)


def heads_from_groups(t: torch.Tensor, num_heads: int) -> torch.Tensor:
    """B or C [..., g, n] -> [..., h, n] in fp32: head i reads group ``i // (h / g)``."""
    groups = t.shape[-2]
    return t.float().repeat_interleave(num_heads // groups, dim=-2)


def _segment_decay(a: torch.Tensor) -> torch.Tensor:
    """Log-decay between positions of a chunk: a [..., L] (per-token dt * A) -> [..., L, L] with
    ``out[l, s] = a[s+1] + ... + a[l]`` for ``l >= s`` and ``-inf`` above the diagonal.

    Each segment is summed on its own (a masked cumulative sum) rather than as a difference of two
    prefix sums: ``cum[l] - cum[s]`` of large prefix sums would lose the small segments to round-off.
    """
    length = a.shape[-1]
    later = torch.ones(length, length, dtype=torch.bool, device=a.device).tril(-1)  # [l, s]: l > s
    seg = torch.cumsum(a[..., :, None].expand(*a.shape, length).masked_fill(~later, 0.0), dim=-2)
    causal = torch.ones(length, length, dtype=torch.bool, device=a.device).tril()  # l >= s
    return seg.masked_fill(~causal, float("-inf"))


def ssd_chunked(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    chunk_size: int,
    initial_state: Optional[torch.Tensor] = None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """The scan of whole sequences, without the ``D * x`` skip.

    x [b, s, h, d], dt [b, s, h] (already discretized), A [h], B/C [b, s, h, n] (per head), all fp32;
    initial_state [b, h, d, n] or None (zeros). Returns (y [b, s, h, d], final state [b, h, d, n]).
    """
    b, s, h, d = x.shape
    n = B.shape[-1]
    pad = (-s) % chunk_size
    if pad:  # dt = 0 tokens: no decay, no input (see the module docstring)
        x, B, C = (F.pad(t, (0, 0, 0, 0, 0, pad)) for t in (x, B, C))
        dt = F.pad(dt, (0, 0, 0, pad))
    chunks = (s + pad) // chunk_size
    L = chunk_size
    xdt = (x * dt[..., None]).reshape(b, chunks, L, h, d)  # inputs scaled by their step
    Bc, Cc = B.reshape(b, chunks, L, h, n), C.reshape(b, chunks, L, h, n)
    a = (dt * A).reshape(b, chunks, L, h).permute(0, 1, 3, 2)  # [b, c, h, L] log-decay per token
    cum = torch.cumsum(a, dim=-1)  # [b, c, h, L]: log-decay from the chunk start through token l

    # Within each chunk: y_l = sum_{s <= l} (C_l . B_s) exp(a_{s+1} + ... + a_l) dt_s x_s.
    decay = torch.exp(_segment_decay(a))  # [b, c, h, L(l), L(s)]
    scores = torch.einsum("bclhn,bcshn->bchls", Cc, Bc) * decay
    y = torch.einsum("bchls,bcshd->bclhd", scores, xdt)

    # What each chunk adds to the state at its end: sum_s exp(cum[-1] - cum[s]) dt_s x_s B_s^T.
    # The exponent a_{l+1} + ... + a_{L-1} as a reversed cumulative sum of the later tokens (not as
    # cum[-1] - cum[l], whose cancellation would cost the short tails their precision).
    tail = torch.flip(torch.cumsum(torch.flip(a[..., 1:], dims=(-1,)), dim=-1), dims=(-1,))
    to_end = torch.exp(F.pad(tail, (0, 1)))  # [b, c, h, L]
    chunk_states = torch.einsum("bchl,bclhd,bclhn->bchdn", to_end, xdt, Bc)
    chunk_decay = torch.exp(cum[..., -1])  # [b, c, h]: decay across a whole chunk

    # Across chunks: the state entering chunk c, a recurrence over the (few) chunks.
    state = x.new_zeros(b, h, d, n) if initial_state is None else initial_state.float()
    entering: Any = []  # the per-chunk states, then stacked into one tensor
    for c in range(chunks):
        entering.append(state)
        state = chunk_decay[:, c, :, None, None] * state + chunk_states[:, c]
    entering = torch.stack(entering, dim=1)  # [b, c, h, d, n]

    # The past's share of each output: exp(cum[l]) (C_l . state entering the chunk).
    y = y + torch.einsum("bclhn,bchdn->bclhd", Cc, entering) * torch.exp(cum).permute(0, 1, 3, 2)[..., None]
    return y.reshape(b, chunks * L, h, d)[:, :s], state


def ssm_step(
    state: torch.Tensor, x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor
) -> Tuple[torch.Tensor, torch.Tensor]:
    """One token of the recurrence for N rows at once, without the ``D * x`` skip.

    state [N, h, d, n], x [N, h, d], dt [N, h] (discretized), A [h], B/C [N, h, n], all fp32.
    Returns (y [N, h, d], new state [N, h, d, n]).
    """
    decay = torch.exp(dt * A)[..., None, None]  # [N, h, 1, 1]
    new_state = decay * state + (dt[..., None] * x)[..., None] * B[:, :, None, :]
    y = torch.matmul(new_state, C[..., None])[..., 0]  # [N, h, d]
    return y, new_state


def ssm_recurrence(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    initial_state: Optional[torch.Tensor] = None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """The scan token by token (the definition ``ssd_chunked`` must equal); same arguments and
    results as ``ssd_chunked``. Slow: for tests and short sequences."""
    b, s, h, d = x.shape
    state = x.new_zeros(b, h, d, B.shape[-1]) if initial_state is None else initial_state.float()
    ys = []
    for t in range(s):
        y, state = ssm_step(state, x[:, t], dt[:, t], A, B[:, t], C[:, t])
        ys.append(y)
    return torch.stack(ys, dim=1), state


__all__ = ["discretize_dt", "heads_from_groups", "ssd_chunked", "ssm_step", "ssm_recurrence"]
