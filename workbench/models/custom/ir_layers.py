"""Sharding-aware building blocks of the ``modeling_*_ir.py`` custom models: the same layers as the
plain custom models, spelled with the ``torch_hint_*`` ops (``ops/sharding_hints``) so the exported
graph says how each op splits and ``apply_sharding_hints`` needs no structure search.

The hints follow one rule per projection: opening projections (Q/K/V, gate/up) ``colwise``,
closing ones (O, down) ``rowwise`` followed by one ``torch_hint_all_reduce`` with the layer's type;
head-count reshapes are ``torch_hint_view`` with the head axis as ``tp_scaled_dim``; routers stay
plain (replicated). Hints are unconditional: whether a layer is sharded is the transform's
``shard_layers`` and the world size, never the model's. Unsharded, every op is the plain op, so the
model computes what HF's does (module names are HF's: checkpoints load strictly).
"""

from __future__ import annotations

from typing import Tuple

import torch
import torch.nn.functional as F
from torch import nn

from .common import OPS, RMSNorm


def hint_linear(x: torch.Tensor, proj: nn.Linear, tp_mode: str, layer_type: str, unit: int = 1) -> torch.Tensor:
    """``proj(x)`` as ``torch_hint_linear`` (``unit``: the smallest piece a colwise split may cut)."""
    return OPS.torch_hint_linear(x, proj.weight, proj.bias, tp_mode, layer_type, unit)


class HintedAttention(nn.Module):
    """Causal GQA attention, optional per-head Q/K RMSNorm (Qwen3): [b, s, H] -> [b, s, H].

    q/k/v colwise in whole heads (``tp_min_local_shape = head_dim``), the [b, s, n*d] -> [b, s, n, d]
    views with the head axis scaling (dim 2), RoPE and ``torch_attention`` (bsnd) per head, the
    merge view scaling the n*d axis, o rowwise + all_reduce (layer type ``mha``)."""

    def __init__(self, config, qk_norm: bool):
        super().__init__()
        hidden, bias = config.hidden_size, getattr(config, "attention_bias", False)
        self.head_dim = getattr(config, "head_dim", None) or hidden // config.num_attention_heads
        self.num_heads, self.num_kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.q_proj = nn.Linear(hidden, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(hidden, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(hidden, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, hidden, bias=bias)
        if qk_norm:
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.qk_norm = qk_norm
        self.scaling = self.head_dim**-0.5

    def _heads(self, x: torch.Tensor, proj: nn.Linear, heads: int) -> torch.Tensor:
        b, s, _ = x.shape
        flat = hint_linear(x, proj, "colwise", "mha", self.head_dim)  # [b, s, heads*d]
        return OPS.torch_hint_view(flat, [b, s, heads, self.head_dim], 2, "mha")  # [b, s, heads, d]

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q = self._heads(x, self.q_proj, self.num_heads)
        k = self._heads(x, self.k_proj, self.num_kv_heads)
        v = self._heads(x, self.v_proj, self.num_kv_heads)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = OPS.torch_rope_with_explicit_cos_sin(q, k, cos, sin, 2)  # bsnd
        out = OPS.torch_attention(q, k, v, is_causal=True, scale=self.scaling, layout="bsnd")  # [b, s, n, d]
        out = OPS.torch_hint_view(out, [b, s, self.num_heads * self.head_dim], 2, "mha")  # [b, s, n*d]
        return OPS.torch_hint_all_reduce(hint_linear(out, self.o_proj, "rowwise", "mha"), "mha")


class HintedSwiGLU(nn.Module):
    """``down(silu(gate(x)) * up(x))``: gate/up colwise, down rowwise + all_reduce (layer type ``mlp``)."""

    def __init__(self, hidden: int, intermediate: int, bias: bool = False):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=bias)
        self.up_proj = nn.Linear(hidden, intermediate, bias=bias)
        self.down_proj = nn.Linear(intermediate, hidden, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.silu(hint_linear(x, self.gate_proj, "colwise", "mlp")) * hint_linear(x, self.up_proj, "colwise", "mlp")
        return OPS.torch_hint_all_reduce(hint_linear(h, self.down_proj, "rowwise", "mlp"), "mlp")


class PreNormBlock(nn.Module):
    """``x + attn(norm(x))``, then ``x + mlp(norm(x))`` (HF's Llama / Qwen3 decoder layer)."""

    def __init__(self, config, attn: nn.Module, mlp: nn.Module):
        super().__init__()
        self.self_attn, self.mlp = attn, mlp
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        return x + self.mlp(self.post_attention_layernorm(x))


def hinted_logits(hidden: torch.Tensor, lm_head: nn.Linear) -> torch.Tensor:
    """[b, s, H] -> [b, s, V]: the LM head colwise by vocabulary rows, logits all-gathered (``lm_head``)."""
    return OPS.torch_hint_all_gather(hint_linear(hidden, lm_head, "colwise", "lm_head"), -1, "lm_head")


def head_dims(config) -> Tuple[int, int, int]:
    """(query heads, KV heads, head dim) of an attention config."""
    hd = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return config.num_attention_heads, config.num_key_value_heads, hd


__all__ = ["hint_linear", "RMSNorm", "HintedAttention", "HintedSwiGLU", "PreNormBlock", "hinted_logits", "head_dims"]
