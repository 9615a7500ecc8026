"""From a model's state dict with quantizer buffers to the keys a quantized checkpoint stores.

The quantizers' own buffers are not checkpoint tensors: weight/input amax values become
``weight_scale`` / ``input_scale`` elsewhere (the exporter writes those from the scaling
functions), output quantizers only calibrate. What survives is renamed to the names inference
engines (TensorRT-LLM, vLLM, HF) load:

======================================  ===========================================================
``<attn>.k_bmm_quantizer._amax``        ``<attn>.k_proj.k_scale`` = amax / maxbound (fp32)
``<attn>.v_bmm_quantizer._amax``        ``<attn>.v_proj.v_scale``
``<attn>.k_bmm_quantizer._bias_value``  ``<attn>.k_proj.k_bias`` (affine KV cache)
``<attn>.v_bmm_quantizer._bias_value``  ``<attn>.v_proj.v_bias``
``<lin>.input_quantizer._pre_quant_scale``  ``<lin>.pre_quant_scale`` (AWQ)
======================================  ===========================================================
"""

from __future__ import annotations

import warnings
from typing import Any, Dict, Optional, Tuple

import torch

from .formats import KV_CACHE_FP8, KV_CACHE_NVFP4, KV_CACHE_NVFP4_AFFINE
from .kv_cache import LARGE_FP8_KV_SCALE

RENAMES = {
    "k_bmm_quantizer._amax": "k_proj.k_scale",
    "v_bmm_quantizer._amax": "v_proj.v_scale",
    "k_bmm_quantizer._bias_value": "k_proj.k_bias",
    "v_bmm_quantizer._bias_value": "v_proj.v_bias",
    "input_quantizer._pre_quant_scale": "pre_quant_scale",
}
# A key containing any of these belongs to a quantizer: renamed above, or dropped.
QUANTIZER_MARKERS = ("output_quantizer", "_amax", "_bias_value", "input_quantizer._pre_quant_scale")
KV_SCALE_FORMATS = (KV_CACHE_FP8, KV_CACHE_NVFP4, KV_CACHE_NVFP4_AFFINE)


def postprocess_state_dict(state_dict: dict, maxbound: float, quantization: Optional[str]) -> dict:
    """Filters out keys related to weight quantizers and updates KV cache related keys.

    Keys of no quantizer pass through; quantizer keys are renamed per the module docstring's table
    or dropped (``_amax`` of weight/input quantizers, anything of an output quantizer). KV amax
    values become scales ``amax / maxbound`` (``maxbound``: the KV quantizer's, 448 for FP8), which
    needs ``quantization`` to be a KV-cache format (``"FP8"``, ``"NVFP4"``, ``"NVFP4_AFFINE"``); FP8
    scales are raised to at least 1 (``get_kv_cache_scaling_factor`` says why). Afterwards, scales
    [1, a, b] are squeezed to [a, b], and tensors sharing storage with an earlier key (tied
    weights, e.g. lm_head and the embedding) are dropped, since safetensors cannot store aliases.
    The input dict is not modified.
    """
    out: Dict[str, object] = {}
    for key, value in state_dict.items():
        if not any(marker in key for marker in QUANTIZER_MARKERS):
            out[key] = value
            continue
        suffix = next((s for s in RENAMES if key.endswith(s)), None)
        if suffix is None:
            continue
        if "_amax" in suffix:
            if quantization not in KV_SCALE_FORMATS:
                raise ValueError(
                    f"postprocess_state_dict: {key!r} is a KV-cache amax but quantization is "
                    f"{quantization!r}; pass the KV-cache format, one of {KV_SCALE_FORMATS}"
                )
            if not maxbound > 0:
                raise ValueError(f"postprocess_state_dict: maxbound must be positive, got {maxbound}")
            value = value.float() / maxbound
            if quantization == KV_CACHE_FP8:
                if float(value.max()) > LARGE_FP8_KV_SCALE:
                    warnings.warn(
                        f"Large KV activations at {key!r}; a quantized KV cache may lose accuracy "
                        "(the FP8 scale is set to at least 1)",
                        stacklevel=2,
                    )
                value = value.clamp(min=1.0)
        out[key[: -len(suffix)] + RENAMES[suffix]] = value
    for key, value in out.items():
        if "scale" in key and isinstance(value, torch.Tensor) and value.dim() == 3 and value.shape[0] == 1:
            out[key] = value.squeeze(0)
    seen: Dict[Tuple[Any, ...], str] = {}
    for key in list(out):
        value = out[key]
        if not isinstance(value, torch.Tensor) or value.numel() == 0 or value.device.type == "meta":
            continue  # meta tensors have no storage to compare
        alias = (value.untyped_storage().data_ptr(), value.storage_offset(), tuple(value.shape), value.stride())
        if alias in seen:
            warnings.warn(
                f"postprocess_state_dict: {key!r} is tied to {seen[alias]!r}; the duplicate is dropped", stacklevel=2
            )
            del out[key]
        else:
            seen[alias] = key
    return out
