"""Custom canonical-op models: lean, prefill-only rewrites of HF architectures whose HF code fights
export or hides its structure, one file per architecture (``modeling_<name>.py``); what they share
(the export contract check, RoPE tables, SwiGLU MLP, stacked experts, the decoder skeleton) is in
``common.py``.

Each custom model keeps the HF checkpoint's module hierarchy and parameter names (so the HF model's
state dict loads into it unchanged, strictly), takes the export contract ``(input_ids,
position_ids)`` (no masks, no cache arguments) and spells attention, RoPE, norms, MLPs and MoE as
canonical ``torch.ops.workbench`` ops, so the exported graph holds those ops from the start instead
of whatever the pattern matchers recover from HF's spelling.

``CUSTOM_MODELS`` maps an HF config class name to the custom model class built for it; it is filled
here, where it is defined, and never changed at run time. ``load_model`` (``models/factory.py``)
builds the registered custom model beside the HF one (``loading.build_export_model``: the two share
every tensor) unless told ``custom_models=False``; ``export_to_gm`` then traces the custom model
while the numerics probe keeps comparing against HF's eager model.
"""

from __future__ import annotations

from types import MappingProxyType
from typing import Mapping

from .modeling_deepseek_v3 import DeepseekV3ForCausalLM
from .modeling_llama_ir import LlamaIRForCausalLM
from .modeling_qwen3_moe_ir import Qwen3MoeIRForCausalLM
from .modeling_qwen3_next import Qwen3NextForCausalLM

#: HF config class name -> custom model class (constructed as ``cls(config)``). Read-only.
CUSTOM_MODELS: Mapping[str, type] = MappingProxyType(
    {"DeepseekV3Config": DeepseekV3ForCausalLM, "Qwen3NextConfig": Qwen3NextForCausalLM}
)

#: The sharding-aware ("IR") models, whose graphs carry tensor-parallel hints (``ir_layers.py``,
#: ``apply_sharding_hints``). Never the default for their config classes: a registry entry picks them
#: with ``custom_models: sharding_ir``; in Python pass ``custom_models=dict(SHARDING_IR_MODELS)`` (a
#: plain dict travels to the ranks of a sharded run). Read-only.
SHARDING_IR_MODELS: Mapping[str, type] = MappingProxyType(
    {"LlamaConfig": LlamaIRForCausalLM, "Qwen3MoeConfig": Qwen3MoeIRForCausalLM}
)

__all__ = [
    "CUSTOM_MODELS",
    "SHARDING_IR_MODELS",
    "DeepseekV3ForCausalLM",
    "Qwen3NextForCausalLM",
    "LlamaIRForCausalLM",
    "Qwen3MoeIRForCausalLM",
]
