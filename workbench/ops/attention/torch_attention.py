"""``workbench::torch_attention``: the one canonical attention op every attention form is matched to.

Native GQA (no repeated K/V in the graph), two layouts, causal masking aligned for a KV cache,
optional sliding window, attention sinks, logit soft-capping and ALiBi position biases. Backends (cached attention,
flashinfer, triton) later replace this op; the reference below is the numerical truth they are
tested against.

Layouts (``b`` batch, ``n`` query heads, ``n_kv`` KV heads, ``s`` sequence, ``d`` head dim)::

    layout="bnsd": query [b, n, s_q, d], key/value [b, n_kv, s_k, d] -> out [b, n, s_q, d_v]
    layout="bsnd": query [b, s_q, n, d], key/value [b, s_k, n_kv, d] -> out [b, s_q, n, d_v]
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F

from ..library import workbench_op

LAYOUTS = ("bnsd", "bsnd")


def _to_bnsd(x: torch.Tensor, layout: str) -> torch.Tensor:
    return x if layout == "bnsd" else x.transpose(1, 2)


def visible_keys(
    s_q: int,
    s_k: int,
    device: torch.device,
    causal: bool,
    sliding_window: Optional[int],
    chunk_size: Optional[int] = None,
) -> Optional[torch.Tensor]:
    """Boolean [s_q, s_k] mask (True = may attend), or None when every key is visible.

    Queries are the *last* ``s_q`` positions of the ``s_k`` keys (bottom-right alignment): with a
    KV cache, query ``i`` sits at absolute position ``s_k - s_q + i``. For ``s_q == s_k`` this is
    the usual lower-triangular causal mask. A sliding window of ``w`` keeps the ``w`` most recent
    keys including the query's own position (``q_pos - k_pos < w``), as HF's sliding masks do.
    Chunked local attention (Llama 4's ``attention_chunk_size``) of ``c`` keeps the keys of the
    query's own chunk of absolute positions (``k_pos // c == q_pos // c``).
    """
    if not causal and sliding_window is None and chunk_size is None:
        return None
    q_pos = torch.arange(s_k - s_q, s_k, device=device)[:, None]
    k_pos = torch.arange(s_k, device=device)[None, :]
    keep = torch.ones(s_q, s_k, dtype=torch.bool, device=device)
    if causal:
        keep &= k_pos <= q_pos
    if sliding_window is not None:
        keep &= (q_pos - k_pos) < sliding_window
    if chunk_size is not None:
        keep &= (k_pos // chunk_size) == (q_pos // chunk_size)
    return keep


def alibi_bias(slopes: torch.Tensor, q_pos: torch.Tensor, k_pos: torch.Tensor) -> torch.Tensor:
    """ALiBi logit bias ``slopes[h] * (k_pos - q_pos)`` in fp32: [n, *q_pos.shape, k_pos.shape[-1]]
    for ``slopes`` [n], positions broadcastable as [..., s_q, 1] / [..., s_k] (absolute positions:
    the same for a token whether it is computed in a prefill or a decode step).

    ALiBi (Press et al., "Train Short, Test Long") adds a per-head linear penalty on the distance
    to each key. HF spells it as ``slope * k_pos`` (BLOOM, Falcon) or ``slope * (k_pos - s_k + 1)``
    (MPT): per query row those differ from this only by a constant, which softmax ignores."""
    rel = (k_pos[..., None, :] - q_pos[..., :, None]).float()
    return slopes.float().reshape(-1, *([1] * rel.dim())) * rel


def _math_attention(
    q,
    k,
    v,
    attn_mask,
    dropout_p,
    is_causal,
    scale,
    sinks,
    sliding_window,
    logit_cap,
    alibi_slopes=None,
    chunk_size=None,
):
    """Explicit softmax attention in fp32 (bnsd, K/V already repeated to ``n`` heads)."""
    s_q, s_k = q.shape[-2], k.shape[-2]
    scores = torch.matmul(q.float(), k.float().transpose(-2, -1)) * scale  # [b, n, s_q, s_k]
    if logit_cap is not None:
        scores = logit_cap * torch.tanh(scores / logit_cap)
    if alibi_slopes is not None:  # queries bottom-right aligned, as the causal mask
        positions = torch.arange(s_k, device=q.device)
        scores = scores + alibi_bias(alibi_slopes, positions[s_k - s_q :], positions)
    keep = visible_keys(s_q, s_k, q.device, is_causal, sliding_window, chunk_size)
    if keep is not None:
        scores = scores.masked_fill(~keep, float("-inf"))
    if attn_mask is not None:
        if attn_mask.dtype == torch.bool:
            scores = scores.masked_fill(~attn_mask, float("-inf"))
        else:
            scores = scores + attn_mask.float()
    if sinks is not None:
        # A sink is one extra logit per head that joins the softmax normaliser but has no value.
        sink = sinks.float().reshape(1, -1, 1, 1).expand(scores.shape[0], -1, s_q, 1)
        probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
    else:
        probs = torch.softmax(scores, dim=-1)
    if dropout_p:
        probs = F.dropout(probs, dropout_p)
    return torch.matmul(probs.to(v.dtype), v)


@workbench_op("torch_attention", category="attention")
def torch_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: Optional[torch.Tensor] = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: Optional[float] = None,
    sinks: Optional[torch.Tensor] = None,
    sliding_window: Optional[int] = None,
    logit_cap: Optional[float] = None,
    layout: str = "bnsd",
    alibi_slopes: Optional[torch.Tensor] = None,
    chunk_size: Optional[int] = None,
) -> torch.Tensor:
    """Grouped-query attention; see the module docstring for shapes.

    ``attn_mask`` (bool: True = attend, or float: added to the logits) broadcasts to
    ``[b, n, s_q, s_k]`` in either layout. ``scale`` defaults to ``1/sqrt(d)``. ``sinks`` is
    ``[n]``. ``logit_cap`` applies ``cap * tanh(logits / cap)`` before masking. ``alibi_slopes``
    ``[n]`` adds ``slopes[h] * (k_pos - q_pos)`` to the (scaled, capped) logits of head ``h``
    (ALiBi; positions bottom-right aligned as for ``is_causal``). ``chunk_size`` ``c``: chunked
    local attention, a key is visible only from queries of its own chunk of absolute positions
    (``k_pos // c == q_pos // c``; Llama 4's ``attention_chunk_size``), on top of ``is_causal``.
    """
    if layout not in LAYOUTS:
        raise ValueError(f"torch_attention: layout must be one of {LAYOUTS}, got {layout!r}")
    q, k, v = (_to_bnsd(t, layout) for t in (query, key, value))
    n, n_kv = q.shape[1], k.shape[1]
    if n % n_kv:
        raise ValueError(f"torch_attention: {n} query heads is not a multiple of {n_kv} KV heads")
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    s_q, s_k = q.shape[-2], k.shape[-2]
    if sliding_window is not None and is_causal and sliding_window >= s_k:
        sliding_window = None  # q_pos - k_pos <= s_k - 1 < window: the window hides nothing
    if chunk_size is not None and chunk_size < 1:
        raise ValueError(f"torch_attention: chunk_size must be >= 1, got {chunk_size}")
    if chunk_size is not None and chunk_size >= s_k:
        chunk_size = None  # every position 0..s_k-1 lies in chunk 0: the chunks hide nothing
    plain = sinks is None and logit_cap is None and sliding_window is None and alibi_slopes is None
    plain = plain and chunk_size is None
    if plain and (not is_causal or s_q == s_k) and (attn_mask is None or not is_causal):
        # SDPA's is_causal is top-left aligned, which equals ours only for s_q == s_k.
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale, enable_gqa=n != n_kv
        )
    else:
        if n != n_kv:
            k, v = k.repeat_interleave(n // n_kv, dim=1), v.repeat_interleave(n // n_kv, dim=1)
        out = _math_attention(
            q, k, v, attn_mask, dropout_p, is_causal, scale, sinks, sliding_window, logit_cap, alibi_slopes, chunk_size
        )
    return _to_bnsd(out, layout).contiguous()


@torch_attention.register_fake
def _torch_attention_fake(
    query,
    key,
    value,
    attn_mask=None,
    dropout_p=0.0,
    is_causal=False,
    scale=None,
    sinks=None,
    sliding_window=None,
    logit_cap=None,
    layout="bnsd",
    alibi_slopes=None,
    chunk_size=None,
):
    return query.new_empty(*query.shape[:-1], value.shape[-1])
