"""The ``hf_quant_config.json`` structure ModelOpt writes beside a quantized checkpoint.

::

    {"producer": {"name": "workbench", "version": "0.1.0"},
     "quantization": {"quant_algo": "NVFP4", "group_size": 16, "kv_cache_quant_algo": "FP8",
                      "exclude_modules": ["lm_head"]}}

One format for every quantized layer puts its fields at the top of ``"quantization"``; several give
``"quant_algo": "MIXED_PRECISION"`` and a ``"quantized_layers"`` map of module name -> fields.
``"exclude_modules"`` lists the unquantized layers by exact module name (ModelOpt may summarise
them with prefix wildcards such as ``model.layers.0.mlp*``; readers accept either).

Per-layer fields (``quant_algo`` strings as ModelOpt / TensorRT-LLM spell them):

=============  =====================================================================================
format         fields
=============  =====================================================================================
fp8            ``{"quant_algo": "FP8"}``
fp8_pb_wo      ``{"quant_algo": "FP8_BLOCK", "weight_block_size": [b, b]}`` (HF fine-grained FP8's key;
               ModelOpt puts the lowercase format name ``fp8_pb_wo`` here; ``FP8_BLOCK`` is what
               this project's ``checkpoint_config.read_quant_config`` reads)
int8_sq        ``{"quant_algo": "W8A8_SQ_PER_CHANNEL"}``
int8_wo        ``{"quant_algo": "W8A16"}``
int4_awq       ``{"quant_algo": "W4A16_AWQ", "group_size": g, "has_zero_point": false, "pre_quant_scale": true}``
w4a8_awq       ``{"quant_algo": "W4A8_AWQ", ...}`` (the same fields as int4_awq)
nvfp4          ``{"quant_algo": "NVFP4", "group_size": 16}``
nvfp4_awq      ``{"quant_algo": "NVFP4_AWQ", "group_size": 16, "has_zero_point": false, "pre_quant_scale": true}``
mxfp4          ``{"quant_algo": "MXFP4", "group_size": 32}``
=============  =====================================================================================
"""

from __future__ import annotations

import importlib.metadata
from typing import Any, Callable, Dict, Mapping, Optional, Union

import torch.nn as nn

from .formats import (
    QUANTIZATION_FP8,
    QUANTIZATION_FP8_PB_WO,
    QUANTIZATION_INT4_AWQ,
    QUANTIZATION_INT8_SQ,
    QUANTIZATION_INT8_WO,
    QUANTIZATION_MXFP4,
    QUANTIZATION_NONE,
    QUANTIZATION_NVFP4,
    QUANTIZATION_NVFP4_AWQ,
    QUANTIZATION_W4A8_AWQ,
    check_format,
    get_quantization_format,
    quantizer_names,
    weight_names,
)
from .kv_cache import get_kv_cache_dtype
from .quantizer import SequentialQuantizer, TensorQuantizer
from .scaling import get_weight_block_size

MIXED_PRECISION = "MIXED_PRECISION"
_QUANTIZATION_KEY = ".quantization"
_BLOCK_KEY = ".awq_block_size"


def layer_quant_config(quantization: Optional[str], block_size: int = 0) -> Dict[str, Any]:
    """The per-layer fields of one format (module docstring's table); ``{"quant_algo": None}`` for None."""
    if quantization is QUANTIZATION_NONE:
        return {"quant_algo": None}
    check_format(quantization, "layer_quant_config")
    awq = {"group_size": block_size, "has_zero_point": False, "pre_quant_scale": True}
    fields: Dict[Optional[str], Callable[[], Dict[str, Any]]] = {
        QUANTIZATION_FP8: lambda: {"quant_algo": "FP8"},
        QUANTIZATION_FP8_PB_WO: lambda: {"quant_algo": "FP8_BLOCK", "weight_block_size": [block_size, block_size]},
        QUANTIZATION_INT8_SQ: lambda: {"quant_algo": "W8A8_SQ_PER_CHANNEL"},
        QUANTIZATION_INT8_WO: lambda: {"quant_algo": "W8A16"},
        QUANTIZATION_INT4_AWQ: lambda: {"quant_algo": "W4A16_AWQ", **awq},
        QUANTIZATION_W4A8_AWQ: lambda: {"quant_algo": "W4A8_AWQ", **awq},
        QUANTIZATION_NVFP4: lambda: {"quant_algo": "NVFP4", "group_size": block_size},
        QUANTIZATION_NVFP4_AWQ: lambda: {"quant_algo": "NVFP4_AWQ", **awq},
        QUANTIZATION_MXFP4: lambda: {"quant_algo": "MXFP4", "group_size": block_size},
    }
    return fields[quantization]()


def process_layer_quant_config(layer_config_dict: Mapping[str, Any]) -> Dict[str, Any]:
    """Processes per layer quantization information for TRTLLM export to quant_cfg.json.

    ``layer_config_dict`` holds ``"<module>.quantization"`` -> format (``None`` for unquantized) and
    ``"<module>.awq_block_size"`` -> block size (0 or absent when not block quantized). Returns the
    ``"quantization"`` section (module docstring) without producer; ``kv_cache_quant_algo`` is None
    here (``get_quant_config`` fills it in).
    """
    quantized: Dict[str, Dict[str, Any]] = {}
    excluded = []
    for key, value in layer_config_dict.items():
        if key.endswith(_BLOCK_KEY):
            continue
        if not key.endswith(_QUANTIZATION_KEY):
            raise ValueError(
                f"process_layer_quant_config: unexpected key {key!r}; keys are '<module>.quantization' "
                "and '<module>.awq_block_size'"
            )
        name = key[: -len(_QUANTIZATION_KEY)]
        config = layer_quant_config(value, int(layer_config_dict.get(name + _BLOCK_KEY, 0) or 0))
        if config["quant_algo"] is None:
            excluded.append(name)
        else:
            quantized[name] = config
    out: Dict[str, Any] = {"quant_algo": None, "kv_cache_quant_algo": None}
    distinct = {tuple(sorted((k, str(v)) for k, v in c.items())) for c in quantized.values()}
    if len(distinct) > 1:
        out.update(quant_algo=MIXED_PRECISION, quantized_layers=quantized)
    elif quantized:
        out.update(next(iter(quantized.values())))
    out["exclude_modules"] = sorted(excluded)
    return out


def _has_quantizers(module: nn.Module) -> bool:
    return any(hasattr(module, q) for w in weight_names(module) for q in quantizer_names(w))


def _producer_version() -> str:
    try:
        return importlib.metadata.version("workbench")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def get_quant_config(named_modules: Union[nn.Module, Mapping[str, nn.Module]]) -> Dict[str, Any]:
    """Generate quantization config for a torch model.

    ``named_modules``: the model, or its ``dict(model.named_modules())``. Layers are the modules with
    quantizer attributes (their format from ``get_quantization_format``) and plain ``nn.Linear``
    modules (unquantized, so excluded); the KV-cache format comes from the attention modules' bmm
    quantizers (or enabled output quantizers) and must be the same everywhere.
    """
    if isinstance(named_modules, nn.Module):
        items = list(named_modules.named_modules())
    elif isinstance(named_modules, Mapping):
        items = list(named_modules.items())
    else:
        raise TypeError(
            f"get_quant_config: expected a module or a dict of name -> module, got {type(named_modules).__name__}"
        )
    layer_config: Dict[str, Any] = {}
    kv_cache = None
    for name, module in items:
        if isinstance(module, (TensorQuantizer, SequentialQuantizer)):
            continue
        if _has_quantizers(module):
            layer_config[name + _QUANTIZATION_KEY] = get_quantization_format(module)
            layer_config[name + _BLOCK_KEY] = next(
                (b for b in (get_weight_block_size(module, w) for w in weight_names(module)) if b), 0
            )
        elif isinstance(module, nn.Linear):
            layer_config[name + _QUANTIZATION_KEY] = None
        output = getattr(module, "output_quantizer", None)
        if (
            hasattr(module, "k_bmm_quantizer")
            or hasattr(module, "v_bmm_quantizer")
            or (output is not None and output.is_enabled)
        ):
            found = get_kv_cache_dtype(module)
            if kv_cache is not None and found is not None and found != kv_cache:
                raise ValueError(
                    f"get_quant_config: mixed KV-cache formats ({kv_cache} and {found} at {name!r}) "
                    "are not supported; quantize every attention's cache the same way"
                )
            kv_cache = kv_cache or found
    quantization = process_layer_quant_config(layer_config)
    quantization["kv_cache_quant_algo"] = kv_cache
    return {"producer": {"name": "workbench", "version": _producer_version()}, "quantization": quantization}
