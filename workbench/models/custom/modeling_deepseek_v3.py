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
from dataclasses import dataclass
from typing import Any, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn

import workbench.ops  # noqa: F401  (registers torch.ops.workbench)

OPS = torch.ops.workbench
STATIC_ROPE_TYPES = ("default", "linear", "yarn", "llama3")  # inv_freq independent of the sequence length


@dataclass
class CausalLMOutput:
    """What the export contract reads (``models/export_contract.CausalLMLogits``: ``.logits``)."""

    logits: torch.Tensor  # [b, s, vocab]


def _rope_parameters(config) -> dict:
    params = dict(getattr(config, "rope_parameters", None) or {})
    params.setdefault("rope_type", "default")
    return params


def rope_inverse_frequencies(config, dim: int) -> Tuple[torch.Tensor, float]:
    """(inv_freq [dim/2] fp32, attention_scaling) for the rotary part of ``dim`` channels.

    The plain schedule is computed here; scaled schedules (linear, YaRN, Llama-3) come from
    transformers' own ``ROPE_INIT_FUNCTIONS`` so they cannot drift from the checkpoint's reference.
    Length-dependent schedules (dynamic NTK, LongRoPE) would make the graph depend on the sequence
    length and are refused.
    """
    params = _rope_parameters(config)
    rope_type = params["rope_type"]
    if rope_type not in STATIC_ROPE_TYPES:
        raise NotImplementedError(
            f"custom DeepseekV3ForCausalLM: rope_type {rope_type!r} rescales with the sequence length; supported: "
            f"{STATIC_ROPE_TYPES}. Load with custom_models=False to export HF's own class"
        )
    if rope_type == "default":
        exponents = torch.arange(0, dim, 2, dtype=torch.int64).to(torch.float32) / dim
        return 1.0 / (float(params["rope_theta"]) ** exponents), 1.0
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](config)
    return inv_freq.to(torch.float32), float(scaling)


def softmax_scale(config) -> float:
    """``qk_head_dim ** -0.5``, times ``mscale(factor, mscale_all_dim) ** 2`` for scaled RoPE
    (DeepSeek's YaRN correction of the attention temperature)."""
    scale = (config.qk_nope_head_dim + config.qk_rope_head_dim) ** -0.5
    params = _rope_parameters(config)
    mscale_all_dim = params.get("mscale_all_dim", 0) if params["rope_type"] != "default" else 0
    factor = params.get("factor", 1.0)
    if mscale_all_dim and factor > 1:
        mscale = 0.1 * mscale_all_dim * math.log(factor) + 1.0
        scale *= mscale * mscale
    return scale


class RMSNorm(nn.Module):
    """``torch_rmsnorm``: weight * normalised x (statistics in fp32), HF's ``DeepseekV3RMSNorm``."""

    def __init__(self, size: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return OPS.torch_rmsnorm(x, self.weight, self.eps)


class RotaryEmbedding(nn.Module):
    """cos/sin ``[b, s, dr]`` for the given positions, computed once per forward for all layers.
    ``inv_freq`` is a non-persistent buffer, as in HF (not in the checkpoint)."""

    inv_freq: torch.Tensor

    def __init__(self, config):
        super().__init__()
        inv_freq, self.attention_scaling = rope_inverse_frequencies(config, config.qk_rope_head_dim)
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        angles = position_ids[..., None].to(torch.float32) * self.inv_freq.to(torch.float32)  # [b, s, dr/2]
        angles = torch.cat((angles, angles), dim=-1)  # [b, s, dr]
        cos, sin = angles.cos() * self.attention_scaling, angles.sin() * self.attention_scaling
        return cos.to(x.dtype), sin.to(x.dtype)


class SwiGLUMLP(nn.Module):
    """``down(silu(gate(x)) * up(x))`` as ``torch_swiglu_mlp`` (dense layers and the shared experts)."""

    def __init__(self, hidden: int, intermediate: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return OPS.torch_swiglu_mlp(x, self.gate_proj.weight, self.up_proj.weight, self.down_proj.weight)


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


class StackedExperts(nn.Module):
    """The routed experts as stacked tensors (HF transformers >= 5 layout): ``gate_up_proj [E, 2I, H]``
    (gate rows first), ``down_proj [E, H, I]``; combined by ``torch_moe_fused``."""

    def __init__(self, config):
        super().__init__()
        e, h, i = config.n_routed_experts, config.hidden_size, config.moe_intermediate_size
        self.gate_up_proj = nn.Parameter(torch.empty(e, 2 * i, h))
        self.down_proj = nn.Parameter(torch.empty(e, h, i))

    def forward(self, x: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """x [T, H], expert_ids / weights [T, k] -> [T, H] in x's dtype."""
        return OPS.torch_moe_fused(x, expert_ids, weights, self.gate_up_proj, self.down_proj, act_fn="silu")


class MixtureOfExperts(nn.Module):
    """Routed experts (``gate`` + ``experts``) plus always-on ``shared_experts``: [b, s, H] -> [b, s, H]."""

    def __init__(self, config):
        super().__init__()
        self.gate = NoAuxTopKRouter(config)
        self.experts = StackedExperts(config)
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


class DeepseekV3Model(nn.Module):
    """Embedding, decoder layers, final norm: (input_ids, position_ids) [b, s] -> hidden [b, s, H]."""

    def __init__(self, config):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(config)

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        cos, sin = self.rotary_emb(x, position_ids)
        for layer in self.layers:
            x = layer(x, cos, sin)
        return self.norm(x)


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


def check_export_contract(position_ids: Optional[torch.Tensor], unused: dict) -> None:
    """The contract is ``(input_ids, position_ids)``: positions are required (no fallback to arange),
    and HF runtime arguments that would change the result (a mask, a cache) are refused."""
    if position_ids is None:
        raise ValueError(
            "position_ids is required (the export contract passes them explicitly; there is no fallback to 0..s-1)"
        )
    live = {k: v for k, v in unused.items() if v is not None and v is not False}
    if live:
        raise ValueError(
            f"this prefill-only custom model takes (input_ids, position_ids) only: got {sorted(live)}. "
            "Masks and caches are added by the pipeline's cache stage, not passed to the model"
        )


class DeepseekV3ForCausalLM(nn.Module):
    """The custom DeepSeek-V3 causal LM: ``forward(input_ids, position_ids)`` -> ``CausalLMOutput``."""

    def __init__(self, config):
        super().__init__()
        _check_config(config)
        self.config = config
        self.model = DeepseekV3Model(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if getattr(config, "tie_word_embeddings", False):
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(
        self, input_ids: torch.Tensor, position_ids: Optional[torch.Tensor] = None, **unused: Any
    ) -> CausalLMOutput:
        check_export_contract(position_ids, unused)
        return CausalLMOutput(logits=self.lm_head(self.model(input_ids, position_ids)))


__all__ = ["DeepseekV3ForCausalLM", "DeepseekV3Model", "CausalLMOutput"]
