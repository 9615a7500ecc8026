"""Canonical forwards of the delta-rule token mixers: Qwen3-Next's gated delta net, the gated delta
nets spelled with separate projections (Qwen3.5, Qwen3.5-MoE, OLMo-Hybrid, recognised by structure),
the tiny DeltaNet.

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

from dataclasses import dataclass
from typing import Any, Optional, Tuple

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


@dataclass(frozen=True)
class SplitSpelling:
    """The attribute names of a gated delta net whose projections are not grouped per key head:
    ``qkv`` -- the projections whose outputs, concatenated, are ``[q | k | v]`` (the conv's channel
    order); ``gate`` -- the output norm's gate (z); ``b`` / ``a`` -- beta's and the decay's inputs;
    ``norm`` -- the gated RMSNorm module (called as ``norm(o, z)`` per value head); ``out``."""

    qkv: Tuple[str, ...]
    gate: str
    b: str
    a: str
    norm: str
    out: str


#: Qwen3.5 / Qwen3.5-MoE (and the families copying them): one fused q|k|v projection.
QWEN3_5_SPELLING = SplitSpelling(("in_proj_qkv",), "in_proj_z", "in_proj_b", "in_proj_a", "norm", "out_proj")
#: OLMo-Hybrid: separate q, k, v projections, beta optionally doubled (``allow_neg_eigval``).
OLMO_HYBRID_SPELLING = SplitSpelling(("q_proj", "k_proj", "v_proj"), "g_proj", "b_proj", "a_proj", "o_norm", "o_proj")
#: What every gated delta net of these spellings holds besides its spelling's projections.
_GATED_DELTA_NET_PARTS = ("conv1d", "A_log", "dt_bias", "num_k_heads", "num_v_heads", "head_k_dim", "head_v_dim")


def split_spelling(module: torch.nn.Module) -> Optional[SplitSpelling]:
    """The spelling a module's attributes match (every part and projection present), else None."""
    if not all(hasattr(module, p) for p in _GATED_DELTA_NET_PARTS):
        return None
    for spelling in (QWEN3_5_SPELLING, OLMO_HYBRID_SPELLING):
        names = (*spelling.qkv, spelling.gate, spelling.b, spelling.a, spelling.norm, spelling.out)
        if all(isinstance(getattr(module, n, None), torch.nn.Module) for n in names):
            return spelling
    return None


def split_gated_delta_net_forward(
    module: Any, hidden_states: torch.Tensor, cache=None, *_args, attention_mask=None, cache_params=None, **_kwargs
) -> torch.Tensor:
    """A gated delta net of a ``SplitSpelling``: hidden_states [b, s, hidden] -> [b, s, hidden], HF's
    forward without cache, with the short conv and the gated delta rule as canonical ops. Key head j
    serves value heads ``j*r .. j*r+r-1`` (``r = h / hk``: HF's ``repeat_interleave``), as in
    Qwen3-Next."""
    spelling = split_spelling(module)
    assert spelling is not None  # the patch applies only to modules split_spelling recognises
    refuse_cache(module, cache if cache is not None else cache_params, "conv and delta-rule states")
    hidden_states = _zero_padding(hidden_states, attention_mask)
    hk, dk, h, dv = module.num_k_heads, module.head_k_dim, module.num_v_heads, module.head_v_dim
    qkv = torch.cat([getattr(module, n)(hidden_states) for n in spelling.qkv], dim=-1)
    qkv = conv_then_activation(qkv, module.conv1d.weight, module.conv1d.bias, module.activation)
    q, k, v = qkv.split([hk * dk, hk * dk, h * dv], dim=-1)
    beta = getattr(module, spelling.b)(hidden_states).sigmoid()
    if getattr(module, "allow_neg_eigval", False):  # OLMo-Hybrid: beta in [0, 2]
        beta = beta * 2.0
    g = -module.A_log.float().exp() * F.softplus(getattr(module, spelling.a)(hidden_states).float() + module.dt_bias)
    o = torch.ops.workbench.torch_gated_delta_rule(
        q.unflatten(-1, (hk, dk)), k.unflatten(-1, (hk, dk)), v.unflatten(-1, (h, dv)), g, beta, use_qk_l2norm=True
    )  # [b, s, h, dv]
    z = getattr(module, spelling.gate)(hidden_states).unflatten(-1, (h, dv))
    o = getattr(module, spelling.norm)(o, z)  # gated RMSNorm over each head's dv
    return getattr(module, spelling.out)(o.flatten(-2))


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
        "canonical_split_gated_delta_net",
        "Gated delta nets with separate projections (Qwen3.5, Qwen3.5-MoE, OLMo-Hybrid; recognised by their "
        "attributes under any class name): short conv and gated delta rule as torch_causal_conv1d and "
        "torch_gated_delta_rule.",
        (),
        split_gated_delta_net_forward,
        match=lambda m: split_spelling(m) is not None,
    ),
    ModulePatch(
        "canonical_deltanet_mixer",
        "Tiny DeltaNet mixer: short conv and delta rule as torch_causal_conv1d and torch_delta_rule "
        "(its eager forward is a token-by-token loop).",
        ("DeltaNetMixer",),
        deltanet_mixer_forward,
    ),
)
