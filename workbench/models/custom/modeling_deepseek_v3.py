"""Custom DeepSeek-V3 (``DeepseekV3ForCausalLM``): prefill-only, canonical ops, HF checkpoint names.

Why a custom model: HF's DeepSeek-V3 spells multi-head latent attention as an SDPA over per-head K/V
expanded from the latent (a cache stage working on that graph could only cache the expanded K/V),
and its MoE as a per-expert loop over data-dependent token sets (export only gets through it with
transformers' ``grouped_mm`` fallback, a histc/sort/grouped-GEMM chain the MoE matcher must then
recognise). Here each mechanism is the canonical op from the start:

    per layer   x -> torch_rmsnorm -> MLA -> + x -> torch_rmsnorm -> dense MLP or MoE -> +
    MLA         q = q_b_proj(torch_rmsnorm(q_a_proj(x)))  (or q_proj(x) without q_lora_rank)
                           -> [b, s, n, dn + dr] = q_nope | q_pe
                latent | k_pe = kv_a_proj_with_mqa(x)     -> [b, s, r] | [b, s, 1, dr]
                latent = torch_rmsnorm(latent)            (what the latent cache stores)
                q_pe, k_pe = torch_rope_with_qk_interleaving (rope_interleave) or
                             torch_rope_with_explicit_cos_sin, bsnd
                o_proj(torch_mla(q_nope, q_pe, latent, k_pe, kv_b_proj.weight, scale))
    dense MLP   torch_swiglu_mlp(x, gate_proj, up_proj, down_proj)
    MoE         router (plain torch: sigmoid scores + e_score_correction_bias, group-limited top-k,
                normalised, times routed_scaling_factor; no canonical op has this rule)
                -> torch_moe_fused(x, expert_ids, weights, experts.gate_up_proj, experts.down_proj)
                + torch_swiglu_mlp(shared_experts)

RoPE: cos/sin ``[b, s, dr]`` are computed once per forward from the vanilla ``position_ids`` and
handed to every layer (HF's rotary embedding: ``inv_freq`` from the config's ``rope_parameters``,
times ``attention_scaling``). The softmax scale is ``qk_head_dim ** -0.5``, times ``mscale**2`` for
YaRN configs with ``mscale_all_dim`` (as HF 5.17-5.23 and DeepSeek's reference do).

The module tree and parameter names are HF's (``model.layers.<i>.self_attn.kv_b_proj.weight``,
``model.layers.<i>.mlp.experts.gate_up_proj``, ``mlp.gate.e_score_correction_bias``...), so
``load_state_dict(hf_model.state_dict())`` is strict; the class names are our own, so no export patch
that targets an HF class by name (``canonical_deepseek_v3_mla``) ever touches this model.
Dropped on purpose: KV cache, attention masks, dropout, training paths, the MTP layer.
"""

from __future__ import annotations

import math
from typing import Tuple

import torch
import torch.nn.functional as F
from torch import nn

from .common import (
    OPS,
    CausalLMOutput,
    CustomCausalLM,
    DecoderStack,
    RMSNorm,
    StackedExperts,
    SwiGLUMLP,
    rope_parameters,
)

MODEL_NAME = "DeepseekV3ForCausalLM"


def softmax_scale(config) -> float:
    """``qk_head_dim ** -0.5``, times ``mscale(factor, mscale_all_dim) ** 2`` for scaled RoPE
    (DeepSeek's YaRN correction of the attention temperature)."""
    scale = (config.qk_nope_head_dim + config.qk_rope_head_dim) ** -0.5
    params = rope_parameters(config)
    mscale_all_dim = params.get("mscale_all_dim", 0) if params["rope_type"] != "default" else 0
    factor = params.get("factor", 1.0)
    if mscale_all_dim and factor > 1:
        mscale = 0.1 * mscale_all_dim * math.log(factor) + 1.0
        scale *= mscale * mscale
    return scale


class MultiHeadLatentAttention(nn.Module):
    """MLA, causal over the given tokens: [b, s, hidden] -> [b, s, hidden] (see the module docstring)."""

    def __init__(self, config):
        super().__init__()
        hidden, bias = config.hidden_size, config.attention_bias
        self.num_heads = config.num_attention_heads
        self.q_lora_rank, self.kv_lora_rank = config.q_lora_rank, config.kv_lora_rank
        self.nope_dim, self.rope_dim, self.v_dim = (config.qk_nope_head_dim, config.qk_rope_head_dim, config.v_head_dim)
        q_width = self.num_heads * (self.nope_dim + self.rope_dim)
        if self.q_lora_rank is None:
            self.q_proj = nn.Linear(hidden, q_width, bias=False)
        else:
            self.q_a_proj = nn.Linear(hidden, self.q_lora_rank, bias=bias)
            self.q_a_layernorm = RMSNorm(self.q_lora_rank)
            self.q_b_proj = nn.Linear(self.q_lora_rank, q_width, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(hidden, self.kv_lora_rank + self.rope_dim, bias=bias)
        self.kv_a_layernorm = RMSNorm(self.kv_lora_rank)
        self.kv_b_proj = nn.Linear(self.kv_lora_rank, self.num_heads * (self.nope_dim + self.v_dim), bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.v_dim, hidden, bias=bias)
        self.rope_interleave = bool(getattr(config, "rope_interleave", False))
        self.scaling = softmax_scale(config)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q = self.q_proj(x) if self.q_lora_rank is None else self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q_nope, q_pe = q.view(b, s, self.num_heads, -1).split([self.nope_dim, self.rope_dim], dim=-1)
        latent, k_pe = self.kv_a_proj_with_mqa(x).split([self.kv_lora_rank, self.rope_dim], dim=-1)
        latent = self.kv_a_layernorm(latent)  # [b, s, r]
        k_pe = k_pe.view(b, s, 1, self.rope_dim)  # one rope key shared by every head
        # Checkpoints store the rope dims as interleaved pairs: the interleaving op de-interleaves q and k
        # alike before rotating (the scores are unchanged by a permutation shared by q and k).
        rope = OPS.torch_rope_with_qk_interleaving if self.rope_interleave else OPS.torch_rope_with_explicit_cos_sin
        q_pe, k_pe = rope(q_pe, k_pe, cos, sin, 2)  # bsnd: cos/sin get their head axis at 2
        out = OPS.torch_mla(q_nope, q_pe, latent, k_pe, self.kv_b_proj.weight, scale=self.scaling)  # [b, s, n, dv]
        return self.o_proj(out.reshape(b, s, self.num_heads * self.v_dim))


class NoAuxTopKRouter(nn.Module):
    e_score_correction_bias: torch.Tensor  # a buffer
    """DeepSeek-V3's auxiliary-loss-free router, plain torch (fp32 throughout, as HF):

    scores = sigmoid(x W^T) [T, E]; experts are *chosen* on scores + e_score_correction_bias, within
    the ``topk_group`` groups (of ``n_group``) whose two best biased scores sum highest; the chosen
    experts are *weighted* by their unbiased scores, normalised to sum 1 (``norm_topk_prob``), times
    ``routed_scaling_factor``. Returns (weights fp32 [T, k], expert ids int64 [T, k]).
    """

    def __init__(self, config):
        super().__init__()
        self.num_experts, self.top_k = config.n_routed_experts, config.num_experts_per_tok
        self.n_group = config.n_group or 1
        self.topk_group = config.topk_group or self.n_group
        if self.num_experts % self.n_group or self.num_experts // self.n_group < 2:
            raise ValueError(
                f"custom DeepseekV3ForCausalLM: n_routed_experts={self.num_experts} must split into "
                f"n_group={self.n_group} groups of at least 2 experts (a group's score sums its best two)"
            )
        self.norm_topk_prob, self.routed_scaling_factor = config.norm_topk_prob, config.routed_scaling_factor
        self.weight = nn.Parameter(torch.zeros(self.num_experts, config.hidden_size))
        self.register_buffer("e_score_correction_bias", torch.zeros(self.num_experts))

    def forward(self, x: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        scores = F.linear(x.to(torch.float32), self.weight.to(torch.float32)).sigmoid()  # [T, E]
        biased = scores + self.e_score_correction_bias
        per_group = biased.unflatten(-1, (self.n_group, -1))  # [T, G, E/G]
        group_score = per_group.topk(2, dim=-1).values.sum(dim=-1)  # [T, G]
        kept_groups = group_score.topk(self.topk_group, dim=-1, sorted=False).indices  # [T, topk_group]
        in_kept_group = torch.zeros_like(group_score, dtype=torch.bool).scatter(1, kept_groups, True)
        allowed = in_kept_group.unsqueeze(-1).expand_as(per_group).flatten(1)  # [T, E]
        chosen = biased.masked_fill(~allowed, float("-inf")).topk(self.top_k, dim=-1, sorted=False).indices
        weights = scores.gather(1, chosen)
        if self.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * self.routed_scaling_factor, chosen


class MixtureOfExperts(nn.Module):
    """Routed experts (``gate`` + ``experts``) plus always-on ``shared_experts``: [b, s, H] -> [b, s, H]."""

    def __init__(self, config):
        super().__init__()
        self.gate = NoAuxTopKRouter(config)
        self.experts = StackedExperts(config.n_routed_experts, config.hidden_size, config.moe_intermediate_size)
        self.shared_experts = SwiGLUMLP(config.hidden_size, config.moe_intermediate_size * config.n_shared_experts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens = x.reshape(-1, x.shape[-1])  # [T, H]
        weights, expert_ids = self.gate(tokens)
        routed = self.experts(tokens, expert_ids, weights).view_as(x)
        return routed + self.shared_experts(x)


class DecoderLayer(nn.Module):
    """Pre-norm residual block: MLA, then a dense MLP (the first ``first_k_dense_replace`` layers) or MoE."""

    def __init__(self, config, layer_idx: int):
        super().__init__()
        self.self_attn = MultiHeadLatentAttention(config)
        dense = layer_idx < config.first_k_dense_replace
        self.mlp = SwiGLUMLP(config.hidden_size, config.intermediate_size) if dense else MixtureOfExperts(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        return x + self.mlp(self.post_attention_layernorm(x))


class DeepseekV3Model(DecoderStack):
    """Embedding, decoder layers, final norm: (input_ids, position_ids) [b, s] -> hidden [b, s, H]."""

    def __init__(self, config):
        super().__init__(config, DecoderLayer, RMSNorm, config.qk_rope_head_dim, MODEL_NAME)


def _check_config(config) -> None:
    """Refuse what this prefill-only rewrite does not implement, naming the way out."""
    problems = []
    if config.hidden_act != "silu":
        problems.append(f"hidden_act={config.hidden_act!r} (the canonical MLP/MoE ops here are SwiGLU)")
    if config.num_key_value_heads not in (None, config.num_attention_heads):
        problems.append("num_key_value_heads != num_attention_heads (MLA shares one latent, not KV groups)")
    if problems:
        raise NotImplementedError(
            f"custom DeepseekV3ForCausalLM does not support {'; '.join(problems)}. "
            "Load with custom_models=False to export HF's own class"
        )


class DeepseekV3ForCausalLM(CustomCausalLM):
    """The custom DeepSeek-V3 causal LM: ``forward(input_ids, position_ids)`` -> ``CausalLMOutput``."""

    decoder_class = DeepseekV3Model
    check_config = staticmethod(_check_config)


__all__ = ["DeepseekV3ForCausalLM", "DeepseekV3Model", "CausalLMOutput"]
