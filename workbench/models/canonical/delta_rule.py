"""Canonical forwards of the delta-rule token mixers: Qwen3-Next's gated delta net, the tiny DeltaNet.

HF's no-kernel path of a gated delta net (``torch_chunk_gated_delta_rule``) pads to whole chunks,
solves a triangular system by a Python loop over the chunk (under export) and scans the chunks in
Python: thousands of nodes, and a graph that bakes in the traced sequence length. The replacement
keeps the layer's surroundings as plain module calls (projections, the gated RMSNorm, ``out_proj``:
the usual matchers still see linears and norms) and routes the two recurrent pieces through
canonical ops, each of which the cache stage turns into a state-slot op::

    in_proj_qkvz, in_proj_ba -> regroup per key head -> [q | k | v] -> silu(torch_causal_conv1d)
      -> torch_gated_delta_rule(q, k, v, g = -exp(A_log) * softplus(a + dt_bias), beta = sigmoid(b),
                                use_qk_l2norm=True) -> norm(o, z) -> out_proj

These forwards run only while ``export_to_gm`` traces a model without cache: a cache object is
refused (the cache stage adds the conv and delta-rule states).
"""

from __future__ import annotations

from typing import Any, Tuple

import torch
import torch.nn.functional as F

from . import ModulePatch, refuse_cache
from .conv import conv_then_activation


def _zero_padding(hidden_states: torch.Tensor, attention_mask) -> torch.Tensor:
    """HF zeroes padded tokens ([b, s] mask) before a recurrent mixer; the export contract has no mask."""
    if attention_mask is None or attention_mask.dim() != 2:
        return hidden_states
    return (hidden_states * attention_mask[:, :, None]).to(hidden_states.dtype)


def _qwen3_next_split(module: Any, qkvz: torch.Tensor, ba: torch.Tensor) -> Tuple[torch.Tensor, ...]:
    """Qwen3-Next's projections are grouped per *key* head: ``qkvz [b, s, hk * (2 dk + 2 r dv)]`` holds,
    for each key head, its q, its k, then the v and z of its ``r = h / hk`` value heads; ``ba
    [b, s, hk * 2r]`` holds each key head's r b's then r a's. Returns q/k ``[b, s, hk * dk]``, v/z
    ``[b, s, h * dv]`` (value heads in order), b/a ``[b, s, h]``."""
    hk, dk, dv = module.num_k_heads, module.head_k_dim, module.head_v_dim
    r = module.num_v_heads // hk
    q, k, v, z = qkvz.unflatten(-1, (hk, 2 * dk + 2 * r * dv)).split([dk, dk, r * dv, r * dv], dim=-1)
    b, a = ba.unflatten(-1, (hk, 2 * r)).split([r, r], dim=-1)
    return q.flatten(-2), k.flatten(-2), v.flatten(-2), z.flatten(-2), b.flatten(-2), a.flatten(-2)


def qwen3_next_gated_delta_net_forward(
    module: Any, hidden_states: torch.Tensor, cache_params=None, *_args, attention_mask=None, **_kwargs
) -> torch.Tensor:
    """``Qwen3NextGatedDeltaNet``: hidden_states [b, s, hidden] -> [b, s, hidden], HF's torch fallback
    without cache, with the short conv and the gated delta rule as canonical ops."""
    refuse_cache(module, cache_params, "conv and delta-rule states")
    hidden_states = _zero_padding(hidden_states, attention_mask)
    hk, dk, h, dv = module.num_k_heads, module.head_k_dim, module.num_v_heads, module.head_v_dim
    q, k, v, z, b, a = _qwen3_next_split(module, module.in_proj_qkvz(hidden_states), module.in_proj_ba(hidden_states))
    qkv = conv_then_activation(
        torch.cat([q, k, v], dim=-1), module.conv1d.weight, module.conv1d.bias, module.activation
    )
    q, k, v = qkv.split([hk * dk, hk * dk, h * dv], dim=-1)
    # g in fp32 as HF computes it (exp(A_log) overflows fp16 for strongly decaying heads)
    g = -module.A_log.float().exp() * F.softplus(a.float() + module.dt_bias)
    o = torch.ops.workbench.torch_gated_delta_rule(
        q.unflatten(-1, (hk, dk)),
        k.unflatten(-1, (hk, dk)),
        v.unflatten(-1, (h, dv)),
        g,
        b.sigmoid(),
        use_qk_l2norm=True,
    )  # [b, s, h, dv]
    o = module.norm(o, z.unflatten(-1, (h, dv)))  # gated RMSNorm over each head's dv
    return module.out_proj(o.flatten(-2))


def deltanet_mixer_forward(
    module: Any, hidden_states: torch.Tensor, cache_params=None, *_args, attention_mask=None, **_kwargs
) -> torch.Tensor:
    """``DeltaNetMixer`` (the tiny DeltaNet, ``models/tiny_families/deltanet_model.py``): its eager
    forward is the token-by-token recurrence; here the rule is ``torch_delta_rule``."""
    refuse_cache(module, cache_params, "conv and delta-rule states")
    hidden_states = _zero_padding(hidden_states, attention_mask)
    heads, dk, dv = module.num_heads, module.head_k_dim, module.head_v_dim
    qkv = conv_then_activation(module.qkv_proj(hidden_states), module.conv1d.weight, module.conv1d.bias, "silu")
    q, k, v = qkv.split([heads * dk, heads * dk, heads * dv], dim=-1)
    o = torch.ops.workbench.torch_delta_rule(
        q.unflatten(-1, (heads, dk)),
        k.unflatten(-1, (heads, dk)),
        v.unflatten(-1, (heads, dv)),
        module.beta_proj(hidden_states).sigmoid(),
        use_qk_l2norm=True,
    )
    return module.out_proj(o.flatten(-2))


PATCHES: tuple = (
    ModulePatch(
        "canonical_qwen3_next_gated_delta_net",
        "Qwen3-Next gated delta net: short conv and gated delta rule as torch_causal_conv1d and "
        "torch_gated_delta_rule (HF's chunked torch fallback is thousands of nodes).",
        ("Qwen3NextGatedDeltaNet",),
        qwen3_next_gated_delta_net_forward,
    ),
    ModulePatch(
        "canonical_deltanet_mixer",
        "Tiny DeltaNet mixer: short conv and delta rule as torch_causal_conv1d and torch_delta_rule "
        "(its eager forward is a token-by-token loop).",
        ("DeltaNetMixer",),
        deltanet_mixer_forward,
    ),
)
