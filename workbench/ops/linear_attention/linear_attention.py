"""``workbench::torch_linear_attention``: linear attention with a per-token, per-head log decay.

One recurrence behind MiniMax's lightning attention, RetNet-style retention and other decayed
linear-attention layers. Per value head, with a state ``S [dk, dv]`` that starts at zero::

    S_t = exp(g_t) * S_{t-1} + k_t^T v_t          (k_t [dk] a column, v_t [dv] a row)
    o_t = scale * q_t S_t                          [dv]

::

    q/k [b, s, hk, dk], v [b, s, h, dv] (h % hk == 0: value head j reads q/k head j // (h // hk))
    g   [b, s, h]     log decay per token and value head (<= 0 for a decay; a constant per-head
                      decay, MiniMax's ``-slope_rate``, is expanded over [b, s]: one float per token
                      and head, next to q/k/v's 3 * 16+ -- and the cache rewrite treats every
                      per-token argument alike)
    -> o [b, s, h, dv] in q's dtype, computed in fp32

No activation, normalisation or gate happens here: those differ per family and stay plain ops in
the canonical forward (``workbench.models.canonical.linear_attention``), where the usual matchers
see them.

The chunked form (what the op runs) computes ``C`` tokens at a time with matmuls. Inside a chunk
starting from state ``S0``, with ``gam_t = g_1 + ... + g_t`` (cumulative log decay since the chunk
start) and ``D[t, j] = exp(gam_t - gam_j)`` for ``j <= t`` (0 above the diagonal)::

    O     = (exp(gam) * Q) S0 + (D * Q K^T) V
    S_end = exp(gam_C) S0 + (exp(gam_C - gam) * K)^T V

The intra-chunk terms do not depend on ``S0``, so they are computed for every chunk at once; only
the chunk-to-chunk state carry is a loop. ``chunk_size`` changes round-off only.

The cached ops (``ops/recurrent.py``) keep ``linear_attention_state [num_slots, h, dk, dv]`` in fp32
whatever the model dtype (HF keeps MiniMax's in the model dtype; in fp32 the two agree). Their
Triton decode rows run the fast-weight kernel shared with the delta rules
(``ops/delta_rule/triton_delta_rule.py``, ``DELTA=False``).
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
import torch.nn.functional as F

from ..delta_rule import triton_delta_rule
from ..delta_rule.delta_rule_math import check_fast_weight_args
from ..delta_rule.torch_delta_rule import fast_weight_state, output_like
from ..recurrent import Inputs, Options, RecurrentMath, RecurrentOp, define_recurrent_op


def check_linear_attention_args(q, k, v, g, chunk_size: int = 64) -> None:
    """Validate the ops' shared arguments (also at trace time, from the fakes): q/k ``[b, s, hk, dk]``,
    v ``[b, s, h, dv]`` with ``h % hk == 0``, g ``[b, s, h]`` (required: a per-head decay is expanded)."""
    if g is None:
        raise ValueError("linear attention needs g [b, s, value_heads], the log decay per token and value head")
    check_fast_weight_args(q, k, v, {"g": g}, chunk_size, "linear attention", "; expand a per-head decay over [b, s]")


def prepare(q, k, v, g, scale: float) -> Tuple[torch.Tensor, ...]:
    """From the ops' layout ``[b, s, heads, d]`` to the math's: fp32, heads first, key heads repeated
    to the value heads, q scaled. Returns q/k ``[b, h, s, dk]``, v ``[b, h, s, dv]``, g ``[b, h, s]``."""
    rep = v.shape[2] // q.shape[2]
    if rep > 1:  # grouped value heads: value head j reads key head j // rep
        q, k = (x.repeat_interleave(rep, dim=2) for x in (q, k))
    q, k, v = (x.transpose(1, 2).to(torch.float32) for x in (q, k, v))
    g = g.transpose(1, 2).to(torch.float32)
    return (q if scale == 1.0 else q * scale), k, v, g


def linear_attention_step(q, k, v, g, state) -> Tuple[torch.Tensor, torch.Tensor]:
    """One token for many rows at once: q/k ``[N, h, dk]``, v ``[N, h, dv]``, g ``[N, h]``, state
    ``[N, h, dk, dv]`` -> (o ``[N, h, dv]``, new state)."""
    state = state * g.exp()[..., None, None] + k.unsqueeze(-1) * v.unsqueeze(-2)
    return (q.unsqueeze(-2) @ state).squeeze(-2), state


def recurrent_linear_attention(q, k, v, g, state) -> Tuple[torch.Tensor, torch.Tensor]:
    """The recurrence token by token (the ground truth of the tests), in ``prepare``'s layout.
    Returns (o ``[N, h, s, dv]``, final state)."""
    out = []
    for t in range(q.shape[2]):
        o, state = linear_attention_step(q[:, :, t], k[:, :, t], v[:, :, t], g[:, :, t], state)
        out.append(o)
    return torch.stack(out, dim=2), state


def chunked_linear_attention(q, k, v, g, state, chunk_size: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """The chunked form (module docstring), in ``prepare``'s layout, from ``state [N, h, dk, dv]``.
    Returns (o ``[N, h, s, dv]``, final state). Padded tokens (zero k/v, ``g = 0``) come after every
    real one: they neither add to nor decay the state."""
    n, h, s, dk = k.shape
    dv = v.shape[-1]
    c = min(chunk_size, max(s, 1))
    pad = -s % c
    if pad:
        q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
        g = F.pad(g, (0, pad))
    chunks = (s + pad) // c
    q, k, v = (x.reshape(n, h, chunks, c, x.shape[-1]) for x in (q, k, v))
    gam = g.reshape(n, h, chunks, c).cumsum(-1)  # log decay from the chunk start through token t

    lower = torch.ones(c, c, dtype=torch.bool, device=q.device).tril()
    # D[t, j] = exp(gam_t - gam_j), j <= t; masked before exp (above the diagonal it would grow)
    decay = (gam[..., :, None] - gam[..., None, :]).masked_fill(~lower, float("-inf")).exp()
    out = ((q @ k.transpose(-1, -2)) * decay) @ v  # intra-chunk part, [n, h, chunks, c, dv]
    q_from_start = q * gam.exp()[..., None]
    kv = (k * (gam[..., -1:] - gam).exp()[..., None]).transpose(-1, -2) @ v  # [n, h, chunks, dk, dv]
    chunk_decay = gam[..., -1].exp()[..., None, None]  # [n, h, chunks, 1, 1]
    for i in range(chunks):
        out[:, :, i] += q_from_start[:, :, i] @ state
        state = state * chunk_decay[:, :, i] + kv[:, :, i]
    return out.reshape(n, h, chunks * c, dv)[:, :, :s], state


def _check(i: Inputs, options: Options) -> None:
    check_linear_attention_args(i["q"], i["k"], i["v"], i["g"], options["chunk_size"])


def _run(i: Inputs, init: Optional[torch.Tensor], options: Options):
    """Whole sequences from ``init [b, h, dk, dv]`` (None: zeros): the chunked form."""
    q, k, v, g = prepare(i["q"], i["k"], i["v"], i["g"], options["scale"])  # [b, h, s, d], [b, h, s]
    state = v.new_zeros(v.shape[0], v.shape[1], k.shape[-1], v.shape[-1]) if init is None else init.float()
    out, final = chunked_linear_attention(q, k, v, g, state, options["chunk_size"])
    return out.transpose(1, 2), final  # [b, s, h, dv]


def _step(i: Inputs, held: torch.Tensor, fresh: torch.Tensor, options: Options):
    """One token per row (``q [n, hk, dk]``, ...) from ``held [n, h, dk, dv]``."""
    rows = prepare(i["q"][None], i["k"][None], i["v"][None], i["g"][None], options["scale"])  # [1, h, n, ...]
    q, k, v, g = (t[0].transpose(0, 1) for t in rows)
    return linear_attention_step(q, k, v, g, held.float())


LINEAR_ATTENTION = define_recurrent_op(
    RecurrentOp(
        name="linear_attention",
        inputs="Tensor q, Tensor k, Tensor v, Tensor g",
        options="float scale=1.0, int chunk_size=64",
        state=fast_weight_state(
            "linear_attention_state",
            "decayed sum of k^T v, S [value_heads, dk, dv] per sequence (fp32), scaled by exp(g) each token",
        ),
        token_args=("q", "k", "v", "g"),
        insert_key="insert_cached_linear_attention",
        math=RecurrentMath(check=_check, run=_run, step=_step),
        triton_decode=triton_delta_rule.decode_linear_attention,
        output_like=output_like,
    )
)

__all__ = [
    "check_linear_attention_args",
    "chunked_linear_attention",
    "recurrent_linear_attention",
    "linear_attention_step",
    "prepare",
    "LINEAR_ATTENTION",
]
