"""Sharding-aware Qwen3-MoE (``Qwen3MoeConfig``): prefill-only, canonical ops with TP/EP hints.

    per layer   x -> torch_rmsnorm -> attention -> + x -> torch_rmsnorm -> MoE (or SwiGLU MLP) -> +
    attention   as the Llama IR model, plus per-head q/k torch_rmsnorm before RoPE (replicated weights)
    MoE         router (plain linear, replicated) -> torch_moe_topk_softmax (fp32 softmax, top-k,
                renormalised when norm_topk_prob) -> torch_hint_moe(moe_mode="ep": experts over the
                ranks) -> torch_hint_all_reduce(moe)
    dense MLP   (mlp_only_layers / decoder_sparse_step) gate/up colwise, down rowwise + all_reduce(mlp)
    LM head     colwise by vocabulary rows -> torch_hint_all_gather(lm_head)

Experts are HF's stacked tensors (``mlp.experts.gate_up_proj [E, 2I, H]`` gate rows first,
``mlp.experts.down_proj [E, H, I]``), router ``mlp.gate.weight [E, H]``: strict load. In
``SHARDING_IR_MODELS`` only (``custom_models: sharding_ir``), never the default for the config.
"""

from __future__ import annotations

import torch
from torch import nn

from .common import OPS, StackedExperts, TopKSoftmaxRouter, check_silu
from .ir_layers import HintedAttention, HintedSwiGLU, PreNormBlock
from .modeling_llama_ir import LlamaIRForCausalLM, LlamaIRModel

MODEL_NAME = "Qwen3MoeIRForCausalLM"


class HintedSparseMoE(nn.Module):
    """[b, s, H] -> [b, s, H]: routed experts by ``torch_hint_moe`` (EP), one all_reduce (``moe``)."""

    def __init__(self, config):
        super().__init__()
        self.gate = TopKSoftmaxRouter(config)
        # the container of gate_up_proj / down_proj (HF layout); torch_hint_moe reads them, not its forward
        self.experts = StackedExperts(config.num_experts, config.hidden_size, config.moe_intermediate_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens = x.reshape(-1, x.shape[-1])  # [T, H]
        weights, expert_ids = self.gate(tokens)
        out = OPS.torch_hint_moe(
            tokens, expert_ids, weights, self.experts.gate_up_proj, self.experts.down_proj, "silu", "ep", "moe"
        )
        return OPS.torch_hint_all_reduce(out, "moe").view_as(x)


def uses_moe(config, i: int) -> bool:
    """HF's rule: MoE unless the layer is in ``mlp_only_layers`` or off the ``decoder_sparse_step`` grid."""
    return (
        i not in (config.mlp_only_layers or []) and config.num_experts > 0 and (i + 1) % config.decoder_sparse_step == 0
    )


def _layer(config, i: int) -> PreNormBlock:
    mlp = HintedSparseMoE(config) if uses_moe(config, i) else HintedSwiGLU(config.hidden_size, config.intermediate_size)
    return PreNormBlock(config, HintedAttention(config, qk_norm=True), mlp)


class Qwen3MoeIRModel(LlamaIRModel):
    """The Llama IR stack with Qwen3-MoE's layers (q/k norms; MoE or dense MLP): (input_ids,
    position_ids) [b, s] -> hidden [b, s, H]."""

    model_name = MODEL_NAME
    make_layer = staticmethod(_layer)


def _check_config(config) -> None:
    check_silu(config, MODEL_NAME, "the hinted MLP/MoE use")
    if getattr(config, "sliding_window", None) and getattr(config, "use_sliding_window", False):
        raise NotImplementedError(f"custom {MODEL_NAME}: sliding-window attention is not implemented")


class Qwen3MoeIRForCausalLM(LlamaIRForCausalLM):
    """``forward(input_ids, position_ids)`` -> ``CausalLMOutput`` with a hinted LM head (the Llama IR
    model's forward over this decoder)."""

    decoder_class = Qwen3MoeIRModel
    check_config = staticmethod(_check_config)


__all__ = ["Qwen3MoeIRForCausalLM", "Qwen3MoeIRModel"]
