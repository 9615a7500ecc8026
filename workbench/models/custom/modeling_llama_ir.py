"""Sharding-aware Llama (``LlamaConfig``): prefill-only, canonical ops with tensor-parallel hints.

    per layer   x -> torch_rmsnorm -> attention -> + x -> torch_rmsnorm -> SwiGLU MLP -> +
    attention   q/k/v: torch_hint_linear colwise (whole heads) -> torch_hint_view [b, s, n, d] (heads scale)
                -> torch_rope_with_explicit_cos_sin (bsnd) -> torch_attention (causal, GQA)
                -> torch_hint_view [b, s, n*d] -> o: torch_hint_linear rowwise -> torch_hint_all_reduce(mha)
    MLP         gate/up colwise, silu(gate) * up, down rowwise -> torch_hint_all_reduce(mlp)
    LM head     colwise by vocabulary rows -> torch_hint_all_gather(lm_head)

Not registered by default (plain ``LlamaConfig`` models keep HF's class): it is in
``SHARDING_IR_MODELS``, which a registry entry picks with ``custom_models: sharding_ir`` and
``Workbench(..., custom_models=SHARDING_IR_MODELS)`` takes. Module and parameter names are HF's
(strict load). Dropped on purpose: KV cache, masks, dropout, training paths.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from .common import CausalLMOutput, CustomCausalLM, DecoderStack, check_export_contract, check_silu
from .ir_layers import HintedAttention, HintedSwiGLU, PreNormBlock, RMSNorm, head_dims, hinted_logits

MODEL_NAME = "LlamaIRForCausalLM"


def _layer(config, i: int) -> PreNormBlock:
    mlp = HintedSwiGLU(config.hidden_size, config.intermediate_size, bias=getattr(config, "mlp_bias", False))
    return PreNormBlock(config, HintedAttention(config, qk_norm=False), mlp)


class LlamaIRModel(DecoderStack):
    """Embedding, decoder layers, final norm: (input_ids, position_ids) [b, s] -> hidden [b, s, H].

    The other sharding-aware models subclass it with their own decoder layers (``make_layer``) and
    ``model_name`` (the name their errors give)."""

    model_name = MODEL_NAME
    make_layer = staticmethod(_layer)

    def __init__(self, config):
        super().__init__(config, self.make_layer, RMSNorm, head_dims(config)[2], self.model_name)


def _check_config(config) -> None:
    check_silu(config, MODEL_NAME, "the hinted MLP uses")


class LlamaIRForCausalLM(CustomCausalLM):
    """``forward(input_ids, position_ids)`` -> ``CausalLMOutput`` with a hinted LM head.

    The other sharding-aware models subclass it with their own ``decoder_class`` and ``check_config``."""

    decoder_class = LlamaIRModel
    check_config = staticmethod(_check_config)

    def forward(
        self, input_ids: torch.Tensor, position_ids: Optional[torch.Tensor] = None, **unused: Any
    ) -> CausalLMOutput:
        check_export_contract(position_ids, unused)
        return CausalLMOutput(logits=hinted_logits(self.model(input_ids, position_ids), self.lm_head))


__all__ = ["LlamaIRForCausalLM", "LlamaIRModel"]
