"""Quantization utilities (issue 17): ModelOpt-style quantizers on real modules, and the export helpers
that read them (scaling factors, packed weights, KV-cache scales, ``hf_quant_config.json``).

Formats supported: see ``formats``. Files, one concept each: ``quantizer`` (TensorQuantizer),
``quant_modules`` (attaching and calibrating), ``formats``, ``scaling``, ``weights``, ``kv_cache``,
``smoothing`` (pre-quant scales), ``linear_fusion``, ``layer_config``, ``state_dict``.
"""

from .formats import SUPPORTED_FORMATS, get_quantization_format
from .kv_cache import get_kv_cache_bias, get_kv_cache_dtype, get_kv_cache_scaling_factor
from .layer_config import get_quant_config, process_layer_quant_config
from .linear_fusion import adjust_attn_amax_values, all_items_same, preprocess_linear_fusion
from .quant_modules import (
    QuantLinear,
    apply_pre_quant_scale,
    attach_kv_quantizers,
    attach_quantizers,
    calibrate_weights,
    calibrating,
    quantize_linears,
)
from .quantizer import SequentialQuantizer, TensorQuantizer
from .scaling import (
    get_activation_scaling_factor,
    get_prequant_scaling_factor,
    get_scaling_factor,
    get_scaling_factor_from_weight,
    get_weight_block_size,
    get_weight_scaling_factor,
    get_weight_scaling_factor_2,
)
from .smoothing import fuse_prequant_layernorm, resmooth_and_get_scale
from .state_dict import postprocess_state_dict
from .weights import (
    from_quantized_weight,
    maybe_transpose_expert_weight_dimensions,
    pack_int4_in_uint8,
    to_quantized_weight,
    unpack_int4_from_uint8,
)

# The seed's quant_utils functions (004).
UTILITIES = [
    "adjust_attn_amax_values",
    "all_items_same",
    "from_quantized_weight",
    "fuse_prequant_layernorm",
    "get_activation_scaling_factor",
    "get_kv_cache_bias",
    "get_kv_cache_dtype",
    "get_kv_cache_scaling_factor",
    "get_prequant_scaling_factor",
    "get_quant_config",
    "get_quantization_format",
    "get_scaling_factor",
    "get_scaling_factor_from_weight",
    "get_weight_block_size",
    "get_weight_scaling_factor",
    "get_weight_scaling_factor_2",
    "maybe_transpose_expert_weight_dimensions",
    "pack_int4_in_uint8",
    "postprocess_state_dict",
    "preprocess_linear_fusion",
    "process_layer_quant_config",
    "resmooth_and_get_scale",
    "to_quantized_weight",
]

__all__ = UTILITIES + [
    "SUPPORTED_FORMATS",
    "TensorQuantizer",
    "SequentialQuantizer",
    "QuantLinear",
    "attach_quantizers",
    "attach_kv_quantizers",
    "quantize_linears",
    "calibrate_weights",
    "calibrating",
    "apply_pre_quant_scale",
    "unpack_int4_from_uint8",
]
