"""Custom Qwen3-Next (``Qwen3NextForCausalLM``): prefill-only, canonical ops, HF checkpoint names.

Why a custom model: Qwen3-Next is a hybrid whose HF code hides its structure from a graph. Its gated
delta nets run a chunked recurrence (padding to 64-token chunks, a Python loop solving a triangular
system) that exports as thousands of nodes bound to the traced length; its full-attention layers
end in an output gate and per-head zero-centred norms around SDPA; its MoE is a per-expert loop.
Here every mechanism is a canonical op from the start:

    layer        x -> norm -> token mixer (per config.layer_types) -> + x -> norm -> MoE or MLP -> +
    norm         zero-centred RMSNorm: torch_rmsnorm(x, 1 + weight), in fp32, cast back (HF's
                 ``Qwen3NextRMSNorm`` multiplies by ``1 + weight`` before casting)
    linear_attn  in_proj_qkvz, in_proj_ba (grouped per *key* head, regrouped here)
                 -> torch_causal_conv1d([q|k|v], silu) -> torch_gated_delta_rule(q, k, v,
                    g = -exp(A_log) * softplus(a + dt_bias), beta = sigmoid(b), use_qk_l2norm)
                 -> gated RMSNorm per value head (torch_rmsnorm(o) * silu(z)) -> out_proj
    self_attn    q_proj -> [query | output gate] per head; q_norm / k_norm per head;
                 torch_rope_with_explicit_cos_sin on the rotary part (partial_rotary_factor),
                 torch_attention(causal, bsnd, native GQA) * sigmoid(gate) -> o_proj
    MoE          torch_moe_topk_softmax(router logits) -> torch_moe_fused(stacked experts)
                 + sigmoid(shared_expert_gate(x)) * torch_swiglu_mlp(shared_expert)
    dense MLP    torch_swiglu_mlp (``mlp_only_layers`` / ``decoder_sparse_step``)

RoPE cos/sin ``[b, s, rotary_dim]`` are computed once per forward from the vanilla ``position_ids``.
The module tree and parameter names are HF's (``model.layers.<i>.linear_attn.in_proj_qkvz.weight``,
``...mlp.experts.gate_up_proj``, ``...mlp.shared_expert_gate.weight``...), so
``load_state_dict(hf_model.state_dict())`` is strict; the class names are our own, so the
``canonical_qwen3_next_gated_delta_net`` export patch (it targets HF's class by name) never touches
this model. Dropped on purpose: KV/conv/recurrent caches, padding masks, dropout, the MTP head.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .common import (
    OPS,
    CausalLMOutput,
    CustomCausalLM,
    DecoderStack,
    StackedExperts,
    SwiGLUMLP,
    TopKSoftmaxRouter,
    check_silu,
    rope_parameters,
)

MODEL_NAME = "Qwen3NextForCausalLM"


def rotary_dim(config) -> int:
    """How many channels of each attention head RoPE rotates (``partial_rotary_factor`` of ``head_dim``)."""
    return int(config.head_dim * rope_parameters(config).get("partial_rotary_factor", 1.0))


class ZeroCenteredRMSNorm(nn.Module):
    """HF ``Qwen3NextRMSNorm``: ``(normalised x) * (1 + weight)`` in fp32, cast to x's dtype (weights
    are stored zero-centred). ``torch_rmsnorm`` on fp32 operands computes exactly that."""

    def __init__(self, size: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return OPS.torch_rmsnorm(x.to(torch.float32), 1.0 + self.weight.to(torch.float32), self.eps).to(x.dtype)


class GatedRMSNorm(nn.Module):
    """HF ``Qwen3NextRMSNormGated`` over each value head: ``torch_rmsnorm(o) * silu(z)`` (the gate in fp32)."""

    def __init__(self, size: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        return (OPS.torch_rmsnorm(x, self.weight, self.eps) * F.silu(gate.to(torch.float32))).to(x.dtype)


class GatedAttention(nn.Module):
    """Qwen3-Next's full attention: [b, s, hidden] -> [b, s, hidden], causal over the given tokens."""

    def __init__(self, config):
        super().__init__()
        hidden, bias, self.head_dim = config.hidden_size, config.attention_bias, config.head_dim
        self.num_heads, self.num_kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.q_proj = nn.Linear(hidden, self.num_heads * self.head_dim * 2, bias=bias)  # query | gate per head
        self.k_proj = nn.Linear(hidden, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(hidden, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, hidden, bias=bias)
        self.q_norm = ZeroCenteredRMSNorm(self.head_dim, config.rms_norm_eps)
        self.k_norm = ZeroCenteredRMSNorm(self.head_dim, config.rms_norm_eps)
        self.rotary_dim = rotary_dim(config)
        self.scaling = self.head_dim**-0.5

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q, gate = self.q_proj(x).view(b, s, self.num_heads, 2 * self.head_dim).chunk(2, dim=-1)
        q = self.q_norm(q)  # [b, s, n, d]
        k = self.k_norm(self.k_proj(x).view(b, s, self.num_kv_heads, self.head_dim))
        v = self.v_proj(x).view(b, s, self.num_kv_heads, self.head_dim)
        # RoPE on the first rotary_dim channels of each head only; the rest pass through.
        pass_dim = self.head_dim - self.rotary_dim
        q_rot, q_pass = q.split([self.rotary_dim, pass_dim], dim=-1)
        k_rot, k_pass = k.split([self.rotary_dim, pass_dim], dim=-1)
        q_rot, k_rot = OPS.torch_rope_with_explicit_cos_sin(q_rot, k_rot, cos, sin, 2)  # bsnd
        q, k = torch.cat((q_rot, q_pass), dim=-1), torch.cat((k_rot, k_pass), dim=-1)
        out = OPS.torch_attention(q, k, v, is_causal=True, scale=self.scaling, layout="bsnd")  # [b, s, n, d]
        out = out.reshape(b, s, self.num_heads * self.head_dim) * torch.sigmoid(gate.reshape(b, s, -1))
        return self.o_proj(out)


class GatedDeltaNet(nn.Module):
    """Qwen3-Next's linear attention (gated delta rule): [b, s, hidden] -> [b, s, hidden].

    Sizes: ``hk`` key heads of ``dk``, ``h`` value heads of ``dv`` (each key head serves ``r = h / hk``
    consecutive value heads). ``in_proj_qkvz`` is laid out per key head: its q, its k, then the v and
    z of its r value heads; ``in_proj_ba`` per key head: r b's then r a's.
    """

    def __init__(self, config):
        super().__init__()
        hidden = config.hidden_size
        self.num_k_heads, self.num_v_heads = config.linear_num_key_heads, config.linear_num_value_heads
        self.head_k_dim, self.head_v_dim = config.linear_key_head_dim, config.linear_value_head_dim
        if self.num_v_heads % self.num_k_heads:
            raise ValueError(
                f"custom Qwen3NextForCausalLM: linear_num_value_heads={self.num_v_heads} is not a "
                f"multiple of linear_num_key_heads={self.num_k_heads}"
            )
        key_dim, value_dim = self.num_k_heads * self.head_k_dim, self.num_v_heads * self.head_v_dim
        conv_dim, kernel = 2 * key_dim + value_dim, config.linear_conv_kernel_dim
        self.conv1d = nn.Conv1d(conv_dim, conv_dim, kernel, groups=conv_dim, padding=kernel - 1, bias=False)
        self.in_proj_qkvz = nn.Linear(hidden, 2 * key_dim + 2 * value_dim, bias=False)
        self.in_proj_ba = nn.Linear(hidden, 2 * self.num_v_heads, bias=False)
        self.dt_bias = nn.Parameter(torch.ones(self.num_v_heads))
        self.A_log = nn.Parameter(torch.zeros(self.num_v_heads))
        self.norm = GatedRMSNorm(self.head_v_dim, config.rms_norm_eps)
        self.out_proj = nn.Linear(value_dim, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hk, dk, h, dv = self.num_k_heads, self.head_k_dim, self.num_v_heads, self.head_v_dim
        r = h // hk
        q, k, v, z = self.in_proj_qkvz(x).unflatten(-1, (hk, -1)).split([dk, dk, r * dv, r * dv], dim=-1)
        beta_in, decay_in = self.in_proj_ba(x).unflatten(-1, (hk, -1)).split([r, r], dim=-1)  # [b, s, hk, r] each
        mixed = torch.cat((q.flatten(-2), k.flatten(-2), v.flatten(-2)), dim=-1)  # [b, s, 2 hk dk + h dv]
        mixed = OPS.torch_causal_conv1d(mixed, self.conv1d.weight, self.conv1d.bias, activation="silu")
        q, k, v = mixed.split([hk * dk, hk * dk, h * dv], dim=-1)
        # log-decay in fp32 (exp(A_log) overflows half precision for fast-decaying heads)
        g = -self.A_log.to(torch.float32).exp() * F.softplus(decay_in.flatten(-2).to(torch.float32) + self.dt_bias)
        o = OPS.torch_gated_delta_rule(
            q.unflatten(-1, (hk, dk)),
            k.unflatten(-1, (hk, dk)),
            v.unflatten(-1, (h, dv)),
            g,
            beta_in.flatten(-2).sigmoid(),
            use_qk_l2norm=True,
        )  # [b, s, h, dv]
        o = self.norm(o, z.reshape(o.shape))  # z: [b, s, hk, r dv] -> [b, s, h, dv] (value heads in order)
        return self.out_proj(o.flatten(-2))


class SparseMoE(nn.Module):
    """Routed experts plus a sigmoid-gated shared expert: [b, s, H] -> [b, s, H]."""

    def __init__(self, config):
        super().__init__()
        self.gate = TopKSoftmaxRouter(config)
        self.experts = StackedExperts(config.num_experts, config.hidden_size, config.moe_intermediate_size)
        self.shared_expert = SwiGLUMLP(config.hidden_size, config.shared_expert_intermediate_size)
        self.shared_expert_gate = nn.Linear(config.hidden_size, 1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens = x.reshape(-1, x.shape[-1])  # [T, H]
        weights, expert_ids = self.gate(tokens)
        routed = self.experts(tokens, expert_ids, weights)
        shared = torch.sigmoid(self.shared_expert_gate(tokens)) * self.shared_expert(tokens)
        return (routed + shared).view_as(x)


def uses_moe(config, layer_idx: int) -> bool:
    """HF's rule: MoE unless the layer is in ``mlp_only_layers`` or off the ``decoder_sparse_step`` grid."""
    return (
        layer_idx not in (config.mlp_only_layers or [])
        and config.num_experts > 0
        and (layer_idx + 1) % config.decoder_sparse_step == 0
    )


class DecoderLayer(nn.Module):
    """Pre-norm residual block; the token mixer is ``linear_attn`` or ``self_attn`` per ``config.layer_types``."""

    def __init__(self, config, layer_idx: int):
        super().__init__()
        self.layer_type = config.layer_types[layer_idx]
        if self.layer_type == "linear_attention":
            self.linear_attn = GatedDeltaNet(config)
        elif self.layer_type == "full_attention":
            self.self_attn = GatedAttention(config)
        else:
            raise ValueError(
                f"custom Qwen3NextForCausalLM: layer {layer_idx} has layer type {self.layer_type!r}; "
                "known: 'linear_attention', 'full_attention'"
            )
        self.mlp = (
            SparseMoE(config)
            if uses_moe(config, layer_idx)
            else SwiGLUMLP(config.hidden_size, config.intermediate_size)
        )
        self.input_layernorm = ZeroCenteredRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = ZeroCenteredRMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        h = self.input_layernorm(x)
        h = self.linear_attn(h) if self.layer_type == "linear_attention" else self.self_attn(h, cos, sin)
        x = x + h
        return x + self.mlp(self.post_attention_layernorm(x))


class Qwen3NextModel(DecoderStack):
    """Embedding, hybrid decoder layers, final norm: (input_ids, position_ids) [b, s] -> hidden [b, s, H]."""

    def __init__(self, config):
        super().__init__(config, DecoderLayer, ZeroCenteredRMSNorm, rotary_dim(config), MODEL_NAME)


def _check_config(config) -> None:
    """Refuse what this prefill-only rewrite does not implement, naming the way out."""
    check_silu(config, MODEL_NAME, "the canonical conv/MLP/MoE ops here use")


class Qwen3NextForCausalLM(CustomCausalLM):
    """The custom Qwen3-Next causal LM: ``forward(input_ids, position_ids)`` -> ``CausalLMOutput``."""

    decoder_class = Qwen3NextModel
    check_config = staticmethod(_check_config)


__all__ = ["Qwen3NextForCausalLM", "Qwen3NextModel", "CausalLMOutput"]
